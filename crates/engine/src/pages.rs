//! The engine's page pool: the card's KV arena plus a prefix cache.
//!
//! Page states live in the `vram` KV arena (free, in use with a holder count,
//! cached, withheld; `free + cached + in_use + withheld == capacity`, and no
//! id of an uncommitted chunk is ever handed out). This
//! module adds what the arena does not know: which full pages hold which
//! tokens, so a later prompt with the same prefix can reuse them.
//!
//! Hash chaining (a page's key covers its own tokens and, through the parent
//! hash, every token before it) means a hit on page `i` implies the whole
//! prefix up to `i` matches, so lookups walk a prompt page by page and stop at
//! the first miss; every hit also compares the page's tokens, so a hash
//! collision can never hand one prompt another prompt's KV. Cached pages
//! (registered, held by no sequence) are evicted least-recently-used first
//! when a sequence needs pages. When the card needs memory back, live pages
//! (cached ones included) are moved out of the sparsest chunks between steps
//! so those chunks can be released ([`PagePool::vacate`]); while the engine
//! is busy, the governor's evictor drops the cached pages of chunks that
//! hold nothing in use.
//!
//! Locking: the prefix index is shared with the governor's relief provider.
//! The engine never holds the index lock while it calls into the guard (which
//! may run that provider), so the two cannot deadlock.

use corridor_units::{Bytes, CardId, PageId, Pages, TokenId, Tokens};
use corridor_vram::{
    ArenaCounts, CardSettings, Device, KvArena, KvArenaConfig, ManualClock, ReliefProvider, SimCard,
    SimCardSpec, Tier, Urgency,
};
use std::collections::{BTreeSet, HashMap};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The key of a full page: a hash over the parent key and the page's tokens.
pub type PageHash = u64;

/// Counts of pages by state (the arena's, in the engine's terms).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    pub capacity: usize,
    pub free: usize,
    pub cached: usize,
    pub in_use: usize,
    pub withheld: usize,
    /// Pages backed by committed memory.
    pub committed: usize,
}

impl From<ArenaCounts> for PoolCounts {
    fn from(c: ArenaCounts) -> Self {
        PoolCounts {
            capacity: c.capacity.get(),
            free: c.free.get(),
            cached: c.cached.get(),
            in_use: c.in_use.get(),
            withheld: c.withheld.get(),
            committed: c.committed.get(),
        }
    }
}

#[derive(Debug)]
struct Registered {
    hash: PageHash,
    tokens: Vec<TokenId>,
}

/// Which pages hold which prefix, and the engine's holder counts.
#[derive(Debug, Default)]
struct PrefixIndex {
    by_hash: HashMap<PageHash, PageId>,
    registered: HashMap<PageId, Registered>,
    /// Holders per page held by a live sequence (mirrors the arena's count,
    /// so the engine knows when a page stops being held).
    refs: HashMap<PageId, u32>,
    /// Cached pages by (last release, id), oldest first.
    lru: BTreeSet<(u64, PageId)>,
    /// Release time of each cached page (to find it in `lru`).
    released_at: HashMap<PageId, u64>,
    clock: u64,
    evictions: u64,
}

impl PrefixIndex {
    fn forget(&mut self, id: PageId) {
        if let Some(r) = self.registered.remove(&id) {
            self.by_hash.remove(&r.hash);
        }
        if let Some(t) = self.released_at.remove(&id) {
            self.lru.remove(&(t, id));
        }
    }
}

fn lock(m: &Mutex<PrefixIndex>) -> MutexGuard<'_, PrefixIndex> {
    // A panic elsewhere must not wedge the pool: the index stays consistent
    // between statements, so the poisoned data is still usable.
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The pages one sequence holds, in the order of its tokens: an owning
/// allocation from the pool. Dropping it, or [`SeqPages::clear`], drops the
/// sequence's hold on every page (a page no sequence holds becomes cached if
/// it is registered, else free), so a sequence that ends, is preempted or is
/// refused gives its pages back by letting go of them, never by a call that
/// could be forgotten.
pub struct SeqPages {
    ids: Vec<PageId>,
    arena: Arc<KvArena>,
    index: Arc<Mutex<PrefixIndex>>,
}

impl SeqPages {
    /// Take `more`'s pages after these (the pages of the next tokens).
    pub fn append(&mut self, mut more: SeqPages) {
        debug_assert!(Arc::ptr_eq(&self.arena, &more.arena), "pages of one pool");
        self.ids.append(&mut more.ids);
    }

    /// Give every page back; the holder stays, empty.
    pub fn clear(&mut self) {
        let ids = std::mem::take(&mut self.ids);
        let mut idx = lock(&self.index);
        for &p in ids.iter().rev() {
            idx.clock += 1;
            let now = idx.clock;
            let Some(r) = idx.refs.get_mut(&p) else {
                // A bookkeeping bug; panicking here (often inside a drop)
                // would abort the process, so it is reported and skipped.
                tracing::error!("{p} is released but no sequence holds it");
                debug_assert!(false, "release of {p}, which no sequence holds");
                continue;
            };
            *r -= 1;
            let left = *r;
            let registered = idx.registered.contains_key(&p);
            let result = if registered { self.arena.release_to_cache(p) } else { self.arena.release(p) };
            if let Err(e) = result {
                tracing::error!("{p} is held but the arena says: {e}");
            }
            if left == 0 {
                idx.refs.remove(&p);
                if registered {
                    idx.lru.insert((now, p));
                    idx.released_at.insert(p, now);
                }
            }
        }
    }

    /// Rewrite the page ids that moved (`from -> to`).
    pub fn remap(&mut self, moved: &HashMap<PageId, PageId>) {
        for p in &mut self.ids {
            if let Some(&to) = moved.get(p) {
                *p = to;
            }
        }
    }
}

impl std::ops::Deref for SeqPages {
    type Target = [PageId];
    fn deref(&self) -> &[PageId] {
        &self.ids
    }
}

impl std::fmt::Debug for SeqPages {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_list().entries(&self.ids).finish()
    }
}

impl Drop for SeqPages {
    fn drop(&mut self) {
        if !self.ids.is_empty() {
            self.clear();
        }
    }
}

/// The page pool of one KV arena.
pub struct PagePool {
    arena: Arc<KvArena>,
    page_size: usize,
    index: Arc<Mutex<PrefixIndex>>,
    /// Prefix-cache statistics: tokens looked up and tokens found.
    pub lookup_tokens: u64,
    pub hit_tokens: u64,
}

impl std::fmt::Debug for PagePool {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PagePool").field("counts", &self.counts()).finish()
    }
}

impl PagePool {
    pub fn new(arena: Arc<KvArena>, page_size: Tokens) -> Self {
        PagePool { arena, page_size: page_size.get(), index: Arc::default(), lookup_tokens: 0, hit_tokens: 0 }
    }

    /// A pool of exactly `capacity` pages on a private simulated card, fully
    /// committed: for tests and tools that want a page pool without a
    /// governor.
    pub fn standalone(capacity: Pages, page_size: Tokens) -> Self {
        let gran = Bytes::mib(2);
        let clock = Arc::new(ManualClock::new());
        let mut spec = SimCardSpec::new(CardId(0), Bytes(gran.get() * (capacity.get() as u64 + 1024)));
        spec.granularity = gran;
        let card = Arc::new(SimCard::new(spec, &[], clock.clone()));
        let dev = Device::standalone(card, CardSettings { floor: Bytes::ZERO, ..CardSettings::default() });
        let cfg = KvArenaConfig {
            page_bytes: gran,
            max_pages: capacity,
            chunk_target: gran,
            hold: Duration::ZERO,
            margin: Bytes::ZERO,
        };
        let arena = Arc::new(KvArena::new(&dev, cfg, clock).expect("a standalone arena fits its card"));
        arena.commit_to(capacity, Urgency::Blocking).expect("a standalone arena commits");
        PagePool::new(arena, page_size)
    }

    pub fn arena(&self) -> &Arc<KvArena> {
        &self.arena
    }
    pub fn page_size(&self) -> usize {
        self.page_size
    }
    /// The id space of the arena.
    pub fn capacity(&self) -> Pages {
        self.arena.capacity()
    }
    /// Pages the arena holds when the card has room (its sized target, or
    /// what is committed if that is more): a sequence needing more than this
    /// can never run.
    pub fn target(&self) -> usize {
        let c = self.arena.counts();
        c.target.get().max(c.committed.get())
    }
    /// Pages that can be handed out right now without growing the arena
    /// (free plus evictable).
    pub fn available(&self) -> usize {
        let c = self.arena.counts();
        c.free.get() + c.cached.get()
    }
    pub fn counts(&self) -> PoolCounts {
        self.arena.counts().into()
    }
    pub fn evictions(&self) -> u64 {
        lock(&self.index).evictions
    }

    /// The arena's invariant plus the index's agreement with it.
    pub fn check_invariants(&self) -> Result<(), String> {
        // Index first: the relief provider changes cached pages only while it
        // holds the index, so the arena's counts are stable under this lock.
        let idx = lock(&self.index);
        // The recount is linear in the id space, which on a big card filled
        // with KV is millions of pages: past this size only the counters are
        // checked here (the arena recounts small id spaces after every
        // operation in debug builds, and tests recount through the arena).
        const RECOUNT_UP_TO: usize = 1 << 16;
        let c = if self.arena.capacity().get() <= RECOUNT_UP_TO {
            self.arena.check_invariants()?
        } else {
            self.arena.check_counters()?
        };
        if idx.lru.len() != c.cached.get() {
            return Err(format!(
                "{} cached pages in the arena, {} in the index",
                c.cached.get(),
                idx.lru.len()
            ));
        }
        if idx.refs.len() != c.in_use.get() {
            return Err(format!(
                "{} pages in use in the arena, {} held in the index",
                c.in_use.get(),
                idx.refs.len()
            ));
        }
        for (&h, &id) in &idx.by_hash {
            if idx.registered.get(&id).map(|r| r.hash) != Some(h) {
                return Err(format!("hash index points at page {id}, which holds another hash"));
            }
        }
        Ok(())
    }

    /// A holder of no pages yet (a sequence that was never admitted).
    pub fn no_pages(&self) -> SeqPages {
        SeqPages { ids: Vec::new(), arena: self.arena.clone(), index: self.index.clone() }
    }

    /// Take `n` pages for a sequence: grow the arena if the card has room as
    /// things are, else evict cached pages LRU-first. All or nothing:
    /// `None` (and nothing changed) when `n` cannot be had now. Dropping the
    /// answer gives the pages back.
    pub fn allocate(&mut self, n: usize) -> Option<SeqPages> {
        if n == 0 {
            return Some(self.no_pages());
        }
        // Growing never spends relief here: admission waits rather than
        // pushing the card towards its floor. Shortly after KV gave memory
        // back (another process is growing), evicting cached pages comes
        // before growing into the headroom relief just made.
        let c = self.arena.counts();
        if c.free.get() < n && (!self.arena.holding() || c.free.get() + c.cached.get() < n) {
            let _ = self.arena.ensure_free(Pages(n), Urgency::Opportunistic);
        }
        let mut idx = lock(&self.index);
        let free = self.arena.counts().free.get();
        if free + idx.lru.len() < n {
            return None;
        }
        while self.arena.counts().free.get() < n {
            let (_, id) = idx.lru.pop_first().expect("counted above");
            idx.released_at.remove(&id);
            if let Some(r) = idx.registered.remove(&id) {
                idx.by_hash.remove(&r.hash);
            }
            self.arena.evict(id).expect("an indexed cached page is cached in the arena");
            idx.evictions += 1;
        }
        let pages = self.arena.alloc_many(Pages(n)).ok()?;
        for p in &pages {
            idx.refs.insert(*p, 1);
        }
        Some(SeqPages { ids: pages, arena: self.arena.clone(), index: self.index.clone() })
    }

    /// Register a full page under `hash` so later prompts can reuse it. If the
    /// same content is already registered under another page, nothing changes.
    pub fn register(&mut self, page: PageId, hash: PageHash, tokens: &[TokenId]) {
        debug_assert_eq!(tokens.len(), self.page_size);
        let mut idx = lock(&self.index);
        if idx.by_hash.contains_key(&hash) || idx.registered.contains_key(&page) {
            return;
        }
        idx.registered.insert(page, Registered { hash, tokens: tokens.to_vec() });
        idx.by_hash.insert(hash, page);
    }

    /// Find the longest cached prefix of `tokens` over at most `max_pages`
    /// full pages and take a hold on each page found.
    pub fn acquire_prefix(&mut self, tokens: &[TokenId], max_pages: usize) -> SeqPages {
        let mut hashes = page_hashes(tokens, self.page_size);
        hashes.truncate(max_pages);
        let mut idx = lock(&self.index);
        let mut out = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(&id) = idx.by_hash.get(h) else { break };
            let want = &tokens[i * self.page_size..(i + 1) * self.page_size];
            if idx.registered.get(&id).map(|r| r.tokens.as_slice()) != Some(want) {
                break; // a hash collision: treat as a miss
            }
            match idx.refs.get_mut(&id) {
                Some(r) => {
                    *r += 1;
                    self.arena.retain(id).expect("a held page is in use in the arena");
                }
                None => {
                    let t = idx.released_at.remove(&id).expect("an unheld registered page is cached");
                    idx.lru.remove(&(t, id));
                    idx.refs.insert(id, 1);
                    self.arena.revive(id).expect("an indexed cached page is cached in the arena");
                }
            }
            out.push(id);
        }
        self.lookup_tokens += (hashes.len() * self.page_size) as u64;
        self.hit_tokens += (out.len() * self.page_size) as u64;
        drop(idx);
        SeqPages { ids: out, arena: self.arena.clone(), index: self.index.clone() }
    }

    /// Empty up to `chunks` chunks of the arena so they can be released:
    /// the live pages (cached prefixes too) of the chunks with the fewest
    /// move to free pages of other chunks in use, their data copied by
    /// `copy` (every layer, every rank) before any page changes state.
    /// Returns the moves (the caller rewrites its sequences' page tables with
    /// them); none when the free pages cannot take a chunk's worth. On a
    /// failed copy nothing moved.
    pub fn vacate(
        &mut self,
        chunks: usize,
        copy: &mut dyn FnMut(&[(PageId, PageId)]) -> Result<(), String>,
    ) -> Result<Vec<(PageId, PageId)>, String> {
        // The index is held throughout, so the governor's evictor cannot
        // touch a cached page that is being moved.
        let mut idx = lock(&self.index);
        let plan = self.arena.plan_vacate(chunks);
        if plan.moves.is_empty() {
            return Ok(Vec::new());
        }
        if let Err(e) = copy(&plan.moves) {
            self.arena.abandon_moves(&plan.moves);
            return Err(e);
        }
        self.arena.finish_moves(&plan.moves).expect("planned moves of live pages onto taken pages");
        // Sources and destinations are disjoint (live pages onto free ones),
        // so the entries can be moved one by one.
        for &(from, to) in &plan.moves {
            if let Some(r) = idx.registered.remove(&from) {
                idx.by_hash.insert(r.hash, to);
                idx.registered.insert(to, r);
            }
            if let Some(n) = idx.refs.remove(&from) {
                idx.refs.insert(to, n);
            }
            if let Some(t) = idx.released_at.remove(&from) {
                idx.lru.remove(&(t, from));
                idx.lru.insert((t, to));
                idx.released_at.insert(to, t);
            }
        }
        Ok(plan.moves)
    }

    /// Evict cached pages so that up to `chunks` chunks can be released or
    /// emptied: first the cached pages of chunks that hold nothing in use
    /// (those chunks are then free), the chunks with the fewest cached pages
    /// and the least recently used first; failing that, least recently used
    /// cached pages anywhere, a chunk's worth, so live pages can move into
    /// their room. Returns the pages evicted.
    pub fn evict_for(&mut self, chunks: usize) -> usize {
        let mut idx = lock(&self.index);
        let n = evict_whole_chunks(&self.arena, &mut idx, chunks);
        if n > 0 {
            return n;
        }
        let cp = self.arena.geometry().chunk_pages;
        let victims: Vec<PageId> = idx.lru.iter().take(cp).map(|&(_, id)| id).collect();
        evict_all(&self.arena, &mut idx, &victims)
    }

    /// The relief provider that gives cached prefixes back to the card.
    pub fn prefix_evictor(&self) -> Arc<dyn ReliefProvider> {
        Arc::new(PrefixEvictor { arena: self.arena.clone(), index: self.index.clone() })
    }
}

fn evict_all(arena: &KvArena, idx: &mut PrefixIndex, victims: &[PageId]) -> usize {
    for &id in victims {
        idx.forget(id);
        arena.evict(id).expect("an indexed cached page is cached in the arena");
        idx.evictions += 1;
    }
    victims.len()
}

/// Evict the cached pages of up to `chunks` chunks that hold no page in
/// use, so those chunks can be released: the chunks with the fewest cached
/// pages first (the least reuse lost), the least recently used among
/// equals. Cached pages that share a chunk with pages in use are left
/// alone: evicting them would free no memory.
fn evict_whole_chunks(arena: &KvArena, idx: &mut PrefixIndex, chunks: usize) -> usize {
    let cp = arena.geometry().chunk_pages;
    let busy: BTreeSet<usize> = idx.refs.keys().map(|&id| id.index() / cp).collect();
    let mut by_chunk: HashMap<usize, Vec<PageId>> = HashMap::new();
    for &id in idx.released_at.keys() {
        let c = id.index() / cp;
        if !busy.contains(&c) {
            by_chunk.entry(c).or_default().push(id);
        }
    }
    // Fewest cached pages first (the least reuse lost), then the chunk whose
    // newest page was released longest ago.
    let newest = |ids: &[PageId]| ids.iter().map(|id| idx.released_at[id]).max().unwrap_or(0);
    let mut order: Vec<(usize, u64, Vec<PageId>)> =
        by_chunk.into_values().map(|ids| (ids.len(), newest(&ids), ids)).collect();
    order.sort_by_key(|(n, t, _)| (*n, *t));
    let victims: Vec<PageId> = order.into_iter().take(chunks).flat_map(|(_, _, ids)| ids).collect();
    evict_all(arena, idx, &victims)
}

/// Relief provider: evict the cached prefixes of chunks that hold nothing
/// else, then release the chunks that became idle. The engine's own relief
/// (moving pages between steps) runs before it; this one answers while the
/// engine is busy. The guard re-probes the card afterwards and credits only
/// what the driver shows.
struct PrefixEvictor {
    arena: Arc<KvArena>,
    index: Arc<Mutex<PrefixIndex>>,
}

impl ReliefProvider for PrefixEvictor {
    fn name(&self) -> &str {
        "evict cached prefixes"
    }
    fn tier(&self) -> Tier {
        Tier::Local
    }
    fn cost(&self) -> u32 {
        // After idle chunks (the arena itself, cost 0) and after the engine's
        // page moves, which keep the prefixes: losing a cached prefix costs
        // a later prompt its recompute.
        10
    }
    fn relieve(&self, card: CardId, need: Bytes) -> Bytes {
        // Any card the arena spans: a page evicted frees its share on every card.
        let Some(part) = self.arena.part_on(card) else {
            return Bytes::ZERO;
        };
        let chunks = need.get().div_ceil(part.geometry.chunk_bytes.get().max(1)) as usize;
        let idle = self.arena.free_chunks();
        if chunks > idle {
            let mut idx = lock(&self.index);
            evict_whole_chunks(&self.arena, &mut idx, chunks - idle);
        }
        let released = self.arena.release_idle_on(card, need);
        Bytes(released.chunks as u64 * part.geometry.chunk_bytes.get())
    }
}

/// Chained hashes of the full pages of `tokens` (FNV-1a over the parent hash
/// and the page's token ids: cheap and deterministic across runs; a collision
/// is harmless because every hit also compares the page's tokens).
pub fn page_hashes(tokens: &[TokenId], page_size: usize) -> Vec<PageHash> {
    let mut out = Vec::with_capacity(tokens.len() / page_size);
    let mut parent: u64 = 0xcbf2_9ce4_8422_2325;
    for page in tokens.chunks_exact(page_size) {
        let mut h = parent;
        for &t in page {
            for b in t.get().to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out.push(h);
        parent = h;
    }
    out
}
