//! The KV page pool and its prefix cache.
//!
//! Every page is in exactly one of four states, and the counts always add up:
//! `free + cached + in_use + withheld == capacity`.
//! - `free`: holds nothing; handed out first.
//! - `cached`: holds a full page of some earlier prompt, registered under a
//!   hash of its tokens chained with its parent's hash, and referenced by no
//!   live sequence. Reusable by a later request with the same prefix; evicted
//!   least-recently-used first when the free list is empty.
//! - `in_use`: referenced by one or more live sequences (a prefix page can be
//!   shared, so it carries a reference count).
//! - `withheld`: ids above the row cap. They may point at memory that is not
//!   committed, so they are never handed out (DESIGN.md §3.3); lifting the cap
//!   returns them to the free list.
//!
//! Hash chaining (a page's key covers its own tokens and, through the parent
//! hash, every token before it) means a hit on page `i` implies the whole
//! prefix up to `i` matches, so lookups walk a prompt page by page and stop at
//! the first miss.

use corridor_units::{PageId, Pages, Tokens};
use std::collections::{BTreeSet, HashMap};

/// The key of a full page: a hash over the parent key and the page's tokens.
pub type PageHash = u64;

#[derive(Clone, Debug, Default)]
struct PageInfo {
    refs: u32,
    /// Set once the page is full and registered in the cache.
    hash: Option<PageHash>,
    /// Logical time of the last release, for LRU eviction.
    last_used: u64,
    /// The tokens a registered page holds, compared on every hit so a hash
    /// collision can never hand one prompt another prompt's KV.
    tokens: Vec<u32>,
}

/// Counts of pages by state.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolCounts {
    pub capacity: usize,
    pub free: usize,
    pub cached: usize,
    pub in_use: usize,
    pub withheld: usize,
}

/// The page pool: ids `0..capacity`, of which ids `>= cap` are withheld.
#[derive(Debug)]
pub struct PagePool {
    page_size: usize,
    pages: Vec<PageInfo>,
    /// Free ids below the cap; lowest first, so live pages stay packed at the
    /// bottom of the arena and the top can be decommitted.
    free: BTreeSet<u32>,
    /// Cached (evictable) pages ordered by (last_used, id).
    lru: BTreeSet<(u64, u32)>,
    by_hash: HashMap<PageHash, u32>,
    cap: usize,
    clock: u64,
    /// Prefix-cache statistics: tokens looked up and tokens found.
    pub lookup_tokens: u64,
    pub hit_tokens: u64,
    pub evictions: u64,
}

impl PagePool {
    pub fn new(capacity: Pages, page_size: Tokens) -> Self {
        let n = capacity.get();
        PagePool {
            page_size: page_size.get(),
            pages: vec![PageInfo::default(); n],
            free: (0..n as u32).collect(),
            lru: BTreeSet::new(),
            by_hash: HashMap::new(),
            cap: n,
            clock: 0,
            lookup_tokens: 0,
            hit_tokens: 0,
            evictions: 0,
        }
    }

    pub fn page_size(&self) -> usize {
        self.page_size
    }
    pub fn capacity(&self) -> usize {
        self.pages.len()
    }
    /// Pages that can be handed out right now (free plus evictable).
    pub fn available(&self) -> usize {
        self.free.len() + self.lru.len()
    }

    pub fn counts(&self) -> PoolCounts {
        let in_use = self.pages.iter().filter(|p| p.refs > 0).count();
        PoolCounts {
            capacity: self.pages.len(),
            free: self.free.len(),
            cached: self.lru.len(),
            in_use,
            // Ids above the cap still held by a live sequence count as in use
            // until released; only the idle ones are withheld.
            withheld: self.pages[self.cap.min(self.pages.len())..].iter().filter(|p| p.refs == 0).count(),
        }
    }

    /// Check `free + cached + in_use + withheld == capacity` and the internal
    /// cross-references. Tests call this after every operation; debug builds
    /// assert it in the engine loop.
    pub fn check_invariants(&self) -> Result<(), String> {
        let c = self.counts();
        if c.free + c.cached + c.in_use + c.withheld != c.capacity {
            return Err(format!("page states do not add up: {c:?}"));
        }
        for &id in &self.free {
            let p = &self.pages[id as usize];
            if p.refs != 0 || p.hash.is_some() || id as usize >= self.cap {
                return Err(format!("free page {id} is referenced, hashed or above the cap"));
            }
        }
        for &(_, id) in &self.lru {
            let p = &self.pages[id as usize];
            if p.refs != 0 || p.hash.is_none() {
                return Err(format!("cached page {id} is referenced or unhashed"));
            }
        }
        for (&h, &id) in &self.by_hash {
            if self.pages[id as usize].hash != Some(h) {
                return Err(format!("hash index points at page {id}, which holds another hash"));
            }
        }
        // Above the cap only live pages may remain (they drain as requests end).
        for id in self.cap..self.pages.len() {
            if self.free.contains(&(id as u32)) || self.pages[id].refs == 0 && self.pages[id].hash.is_some() {
                return Err(format!("page {id} above the cap is free or cached"));
            }
        }
        Ok(())
    }

    /// Take `n` pages for a sequence, evicting cached pages LRU-first when the
    /// free list runs out. All or nothing: returns `None` (and changes nothing)
    /// when fewer than `n` are available.
    pub fn allocate(&mut self, n: usize) -> Option<Vec<PageId>> {
        if self.available() < n {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = match self.free.pop_first() {
                Some(id) => id,
                None => {
                    let (_, id) = self.lru.pop_first().expect("available() counted it");
                    let h = self.pages[id as usize].hash.take().expect("cached pages are hashed");
                    self.by_hash.remove(&h);
                    self.evictions += 1;
                    id
                }
            };
            self.pages[id as usize].refs = 1;
            out.push(PageId(id));
        }
        Some(out)
    }

    /// Drop one reference to each page; a page no sequence holds becomes cached
    /// (if it is registered) or free.
    pub fn release(&mut self, pages: &[PageId]) {
        for &p in pages.iter().rev() {
            self.clock += 1;
            let id = p.0;
            let info = &mut self.pages[p.index()];
            assert!(info.refs > 0, "release of {p}, which no sequence holds");
            info.refs -= 1;
            if info.refs > 0 {
                continue;
            }
            info.last_used = self.clock;
            if (id as usize) >= self.cap {
                // Above the cap: the page must not be reused; forget its contents.
                if let Some(h) = info.hash.take() {
                    self.by_hash.remove(&h);
                }
            } else if info.hash.is_some() {
                self.lru.insert((info.last_used, id));
            } else {
                self.free.insert(id);
            }
        }
    }

    /// Register a full page under `hash` so later prompts can reuse it. If the
    /// same content is already registered under another page, nothing changes.
    pub fn register(&mut self, page: PageId, hash: PageHash, tokens: &[u32]) {
        debug_assert_eq!(tokens.len(), self.page_size);
        if self.by_hash.contains_key(&hash) || self.pages[page.index()].hash.is_some() {
            return;
        }
        let info = &mut self.pages[page.index()];
        info.hash = Some(hash);
        info.tokens.clear();
        info.tokens.extend_from_slice(tokens);
        self.by_hash.insert(hash, page.0);
    }

    /// Find the longest cached prefix of `tokens` over at most `max_pages`
    /// full pages and take a reference on each page found.
    pub fn acquire_prefix(&mut self, tokens: &[u32], max_pages: usize) -> Vec<PageId> {
        let mut hashes = page_hashes(tokens, self.page_size);
        hashes.truncate(max_pages);
        let mut out = Vec::new();
        for (i, h) in hashes.iter().enumerate() {
            let Some(&id) = self.by_hash.get(h) else { break };
            let want = &tokens[i * self.page_size..(i + 1) * self.page_size];
            if self.pages[id as usize].tokens != want {
                break; // a hash collision: treat as a miss
            }
            let info = &mut self.pages[id as usize];
            if info.refs == 0 {
                self.lru.remove(&(info.last_used, id));
            }
            info.refs += 1;
            out.push(PageId(id));
        }
        self.lookup_tokens += (hashes.len() * self.page_size) as u64;
        self.hit_tokens += (out.len() * self.page_size) as u64;
        out
    }

    /// Evict up to `n` cached pages to the free list (relief under memory
    /// pressure); returns how many were evicted.
    pub fn evict_cached(&mut self, n: usize) -> usize {
        let mut done = 0;
        while done < n {
            let Some((_, id)) = self.lru.pop_first() else { break };
            let h = self.pages[id as usize].hash.take().expect("cached pages are hashed");
            self.by_hash.remove(&h);
            self.free.insert(id);
            self.evictions += 1;
            done += 1;
        }
        done
    }

    /// The highest page id held by a live sequence, if any.
    pub fn highest_live(&self) -> Option<PageId> {
        self.pages.iter().rposition(|p| p.refs > 0).map(|i| PageId(i as u32))
    }

    pub fn cap(&self) -> usize {
        self.cap
    }

    /// Withhold every id at or above `cap`: free and cached pages there leave
    /// the pool now; live ones leave when released. Returns the new cap.
    pub fn set_cap(&mut self, cap: usize) -> usize {
        let cap = cap.min(self.pages.len());
        if cap < self.cap {
            let above: Vec<u32> = self.free.range(cap as u32..).copied().collect();
            for id in above {
                self.free.remove(&id);
            }
            let cached: Vec<(u64, u32)> = self.lru.iter().filter(|(_, id)| *id as usize >= cap).copied().collect();
            for key in cached {
                self.lru.remove(&key);
                let h = self.pages[key.1 as usize].hash.take().expect("cached pages are hashed");
                self.by_hash.remove(&h);
            }
        } else {
            for id in self.cap..cap {
                let p = &self.pages[id];
                if p.refs == 0 && p.hash.is_none() {
                    self.free.insert(id as u32);
                }
            }
        }
        self.cap = cap;
        cap
    }
}

/// Chained hashes of the full pages of `tokens` (FNV-1a over the parent hash
/// and the page's token ids: cheap and deterministic across runs; a collision
/// is harmless because every hit also compares the page's tokens).
pub fn page_hashes(tokens: &[u32], page_size: usize) -> Vec<PageHash> {
    let mut out = Vec::with_capacity(tokens.len() / page_size);
    let mut parent: u64 = 0xcbf2_9ce4_8422_2325;
    for page in tokens.chunks_exact(page_size) {
        let mut h = parent;
        for &t in page {
            for b in t.to_le_bytes() {
                h ^= b as u64;
                h = h.wrapping_mul(0x0000_0100_0000_01b3);
            }
        }
        out.push(h);
        parent = h;
    }
    out
}
