//! A simulated card: a card of a given size whose memory is pure bookkeeping.
//!
//! Compute on a sim card runs on the CPU in host buffers; what is simulated
//! is the device memory, so the whole governance (floor, guard, arena,
//! sampler, ledger) runs end to end without a GPU. Like a real card:
//! - the driver's free memory is `total - carve_out - residue - ours - foreign`;
//! - foreign processes appear, grow and vanish on a schedule (`--sim-events`)
//!   or when a test says so, and a foreign process can only take memory that
//!   is free: what it wants beyond that stays pending and is taken as soon as
//!   memory frees up, the way a co-tenant that keeps retrying would;
//! - allocations fail when the card is full, and failures can be injected.
//!
//! `residue` models the context a real driver charges to this process
//! (0 by default), so the ledger's identity closes exactly on a sim card.

use crate::card::{CardError, CardKind, ProcessBytes, RawBlock, RawCard, VaRange};
use crate::clock::Clock;
use crate::Card;
use corridor_units::{Bytes, CardId};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

/// The granularity of a simulated card, the same as an H200's.
pub const SIM_GRANULARITY: Bytes = Bytes::mib(2);

/// One line of a `--sim-events` file: from `at_s` seconds after boot, `pid`
/// holds `bytes` on `card`; `bytes == 0` means the process exited.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct SimEvent {
    pub at_s: f64,
    pub card: u32,
    pub pid: u32,
    pub bytes: u64,
}

/// Why a `--sim-events` file was rejected.
#[derive(Debug, thiserror::Error)]
pub enum SimEventError {
    #[error("sim events line {line}: {reason}")]
    BadLine { line: usize, reason: String },
}

/// Parse a `--sim-events` file (JSON lines; blank lines and lines starting
/// with `#` are skipped). Events come back sorted by time.
pub fn parse_sim_events(text: &str) -> Result<Vec<SimEvent>, SimEventError> {
    let mut events = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let t = line.trim();
        if t.is_empty() || t.starts_with('#') {
            continue;
        }
        let ev: SimEvent = serde_json::from_str(t)
            .map_err(|e| SimEventError::BadLine { line: i + 1, reason: e.to_string() })?;
        if !ev.at_s.is_finite() || ev.at_s < 0.0 {
            return Err(SimEventError::BadLine {
                line: i + 1,
                reason: format!("at_s must be a finite number >= 0, got {}", ev.at_s),
            });
        }
        events.push(ev);
    }
    // A stable sort keeps same-time events in file order.
    events.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
    Ok(events)
}

/// The shape of one simulated card.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SimCardSpec {
    pub id: CardId,
    /// All memory on the card, carve-out included.
    pub total: Bytes,
    /// What the simulated driver keeps for itself.
    pub carve_out: Bytes,
    /// What the simulated driver charges this process beyond our books (the
    /// CUDA context on a real card).
    pub residue: Bytes,
    pub granularity: Bytes,
}

impl SimCardSpec {
    /// A card of `total` bytes with no carve-out and no residue.
    pub fn new(id: CardId, total: Bytes) -> SimCardSpec {
        SimCardSpec { id, total, carve_out: Bytes::ZERO, residue: Bytes::ZERO, granularity: SIM_GRANULARITY }
    }
}

#[derive(Debug, Default)]
struct SimState {
    /// Bytes this process holds through raw allocations and commits.
    ours: Bytes,
    next_handle: u64,
    blocks: BTreeMap<u64, Bytes>,
    /// Reserved ranges: handle -> (size, committed offset -> bytes).
    ranges: BTreeMap<u64, (Bytes, BTreeMap<u64, Bytes>)>,
    /// Bytes each foreign process holds.
    foreign: BTreeMap<u32, Bytes>,
    /// Bytes each foreign process wants (it holds at most this much).
    desired: BTreeMap<u32, Bytes>,
    /// Index of the next scheduled event not yet applied.
    next_event: usize,
    /// How many of the next allocations or commits fail.
    fail_next: u32,
    /// A foreign process that grows during the next allocation or commit,
    /// after the guard's probe and before the memory is taken.
    intrude_next: Option<(u32, Bytes)>,
    /// Foreign processes the per-process list does not show (another
    /// container's, or ones the driver has not listed yet).
    unlisted: Vec<u32>,
}

/// A simulated card. Share it as `Arc<SimCard>` (it is also the test's
/// handle for moving foreign processes and injecting failures).
pub struct SimCard {
    spec: SimCardSpec,
    clock: Arc<dyn Clock>,
    /// This card's scheduled events, sorted by time.
    events: Vec<SimEvent>,
    state: Mutex<SimState>,
}

impl std::fmt::Debug for SimCard {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SimCard").field("spec", &self.spec).finish_non_exhaustive()
    }
}

impl SimCard {
    /// A sim card that plays the events addressed to it (others are ignored).
    pub fn new(spec: SimCardSpec, events: &[SimEvent], clock: Arc<dyn Clock>) -> SimCard {
        let mut mine: Vec<SimEvent> = events.iter().copied().filter(|e| e.card == spec.id.0).collect();
        mine.sort_by(|a, b| a.at_s.total_cmp(&b.at_s));
        SimCard { spec, clock, events: mine, state: Mutex::new(SimState::default()) }
    }

    pub fn spec(&self) -> &SimCardSpec {
        &self.spec
    }

    /// Let `pid` want `bytes` from now on (0 ends it). It takes what is free.
    pub fn set_foreign(&self, pid: u32, bytes: Bytes) {
        let mut st = self.lock();
        Self::set_desire(&mut st, pid, bytes);
        self.settle(&mut st);
    }

    /// Like [`SimCard::set_foreign`], for a process the per-process list
    /// never shows (on a real card: another container's process, or one the
    /// driver has not listed yet). Its memory is gone from the free column
    /// all the same.
    pub fn set_unlisted_foreign(&self, pid: u32, bytes: Bytes) {
        let mut st = self.lock();
        if !st.unlisted.contains(&pid) {
            st.unlisted.push(pid);
        }
        Self::set_desire(&mut st, pid, bytes);
        self.settle(&mut st);
    }

    /// Bytes foreign processes hold now.
    pub fn foreign_bytes(&self) -> Bytes {
        let mut st = self.lock();
        self.settle(&mut st);
        st.foreign.values().copied().sum()
    }

    /// Bytes this process holds through allocations and commits (residue excluded).
    pub fn our_bytes(&self) -> Bytes {
        self.lock().ours
    }

    /// Make the next `n` allocations or commits fail.
    pub fn inject_failures(&self, n: u32) {
        self.lock().fail_next = n;
    }

    /// Let `pid` come to want `bytes` inside the next allocation or commit,
    /// just before it takes memory: the race of a real card, where another
    /// process allocates between the guard's probe and the driver's call.
    pub fn intrude_during_next_take(&self, pid: u32, bytes: Bytes) {
        self.lock().intrude_next = Some((pid, bytes));
    }

    fn lock(&self) -> MutexGuard<'_, SimState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn set_desire(st: &mut SimState, pid: u32, bytes: Bytes) {
        if bytes == Bytes::ZERO {
            st.desired.remove(&pid);
            st.foreign.remove(&pid);
            return;
        }
        st.desired.insert(pid, bytes);
        // Shrinking happens at once; growing waits for free memory in settle().
        if let Some(held) = st.foreign.get_mut(&pid) {
            if *held > bytes {
                *held = bytes;
            }
        }
    }

    fn free_of(&self, st: &SimState) -> Bytes {
        let foreign: Bytes = st.foreign.values().copied().sum();
        self.spec.total.saturating_sub(self.spec.carve_out + self.spec.residue + st.ours + foreign)
    }

    /// Apply the events that are due and let foreign processes take what
    /// they want out of what is free, in pid order so runs are deterministic.
    fn settle(&self, st: &mut SimState) {
        let now = self.clock.now();
        while let Some(ev) = self.events.get(st.next_event) {
            if Duration::from_secs_f64(ev.at_s) > now {
                break;
            }
            Self::set_desire(st, ev.pid, Bytes(ev.bytes));
            st.next_event += 1;
        }
        let wants: Vec<(u32, Bytes)> = st.desired.iter().map(|(p, b)| (*p, *b)).collect();
        for (pid, want) in wants {
            let held = st.foreign.get(&pid).copied().unwrap_or(Bytes::ZERO);
            if held < want {
                let take = (want - held).min(self.free_of(st));
                if take > Bytes::ZERO {
                    st.foreign.insert(pid, held + take);
                }
            }
        }
    }

    fn take(&self, st: &mut SimState, want: Bytes) -> Result<(), CardError> {
        if let Some((pid, bytes)) = st.intrude_next.take() {
            Self::set_desire(st, pid, bytes);
        }
        self.settle(st);
        if st.fail_next > 0 {
            st.fail_next -= 1;
            return Err(CardError::Injected { card: self.spec.id, want });
        }
        let free = self.free_of(st);
        if want > free {
            return Err(CardError::OutOfMemory { card: self.spec.id, want, free });
        }
        st.ours += want;
        Ok(())
    }

    fn give_back(&self, st: &mut SimState, bytes: Bytes) {
        st.ours = st.ours.saturating_sub(bytes);
        self.settle(st);
    }
}

impl Card for SimCard {
    fn id(&self) -> CardId {
        self.spec.id
    }
    fn uuid(&self) -> String {
        format!("SIM-{:02}-{}MiB", self.spec.id.0, self.spec.total.get() / Bytes::MIB)
    }
    fn kind(&self) -> CardKind {
        CardKind::Sim
    }
    fn total(&self) -> Bytes {
        self.spec.total
    }
    fn carve_out(&self) -> Bytes {
        self.spec.carve_out
    }
    fn driver_free(&self) -> Bytes {
        let mut st = self.lock();
        self.settle(&mut st);
        self.free_of(&st)
    }
    fn process_bytes(&self) -> Bytes {
        self.spec.residue + self.lock().ours
    }
    fn processes(&self) -> Vec<ProcessBytes> {
        let mut st = self.lock();
        self.settle(&mut st);
        let mut list = vec![ProcessBytes { pid: self.self_pid(), bytes: self.spec.residue + st.ours }];
        list.extend(
            st.foreign
                .iter()
                .filter(|(pid, _)| !st.unlisted.contains(pid))
                .map(|(pid, bytes)| ProcessBytes { pid: *pid, bytes: *bytes }),
        );
        list
    }
    fn granularity(&self) -> Bytes {
        self.spec.granularity
    }
}

impl RawCard for SimCard {
    fn raw_alloc(&self, bytes: Bytes) -> Result<RawBlock, CardError> {
        let mut st = self.lock();
        self.take(&mut st, bytes)?;
        st.next_handle += 1;
        let handle = st.next_handle;
        st.blocks.insert(handle, bytes);
        Ok(RawBlock { handle, bytes })
    }

    fn raw_free(&self, block: RawBlock) {
        let mut st = self.lock();
        let known = st.blocks.remove(&block.handle);
        debug_assert_eq!(known, Some(block.bytes), "sim card: freeing an unknown block");
        self.give_back(&mut st, block.bytes);
    }

    fn reserve_va(&self, bytes: Bytes) -> Result<VaRange, CardError> {
        let mut st = self.lock();
        st.next_handle += 1;
        let handle = st.next_handle;
        st.ranges.insert(handle, (bytes, BTreeMap::new()));
        Ok(VaRange { handle, bytes })
    }

    fn release_va(&self, va: VaRange) {
        let mut st = self.lock();
        let range = st.ranges.remove(&va.handle);
        // Releasing a range with live commits would leak the physical memory
        // on a real card; here it is given back so the books stay closed.
        if let Some((_, commits)) = range {
            debug_assert!(commits.is_empty(), "sim card: releasing a range with committed memory");
            let leaked: Bytes = commits.values().copied().sum();
            self.give_back(&mut st, leaked);
        }
    }

    fn commit(&self, va: &VaRange, offset: Bytes, bytes: Bytes) -> Result<(), CardError> {
        let gran = self.spec.granularity;
        let bad = CardError::BadRange { card: self.spec.id, offset, bytes, reserved: va.bytes };
        let aligned = offset.round_down(gran) == offset && bytes.round_down(gran) == bytes;
        if !aligned || offset + bytes > va.bytes {
            return Err(bad);
        }
        let mut st = self.lock();
        let overlaps = match st.ranges.get(&va.handle) {
            None => true,
            // Commits are disjoint, so only the last one starting before this
            // range's end can reach into it (a walk over all of them made
            // filling a big card quadratic).
            Some((_, commits)) => commits
                .range(..(offset + bytes).get())
                .next_back()
                .is_some_and(|(o, b)| offset.get() < o + b.get()),
        };
        if overlaps {
            return Err(bad);
        }
        self.take(&mut st, bytes)?;
        if let Some((_, commits)) = st.ranges.get_mut(&va.handle) {
            commits.insert(offset.get(), bytes);
        }
        Ok(())
    }

    fn decommit(&self, va: &VaRange, offset: Bytes, bytes: Bytes) -> Result<(), CardError> {
        let mut st = self.lock();
        let removed = st.ranges.get_mut(&va.handle).and_then(|(_, commits)| commits.remove(&offset.get()));
        if removed != Some(bytes) {
            if let Some(b) = removed {
                // Put back what was wrongly removed; the caller's books are off.
                if let Some((_, commits)) = st.ranges.get_mut(&va.handle) {
                    commits.insert(offset.get(), b);
                }
            }
            return Err(CardError::BadRange { card: self.spec.id, offset, bytes, reserved: va.bytes });
        }
        self.give_back(&mut st, bytes);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::ManualClock;

    fn card(clock: Arc<ManualClock>, events: &[SimEvent]) -> SimCard {
        SimCard::new(SimCardSpec::new(CardId(0), Bytes::gib(8)), events, clock)
    }

    #[test]
    fn parses_events_and_rejects_bad_lines() {
        let text = "# comment\n{\"at_s\": 5.0, \"card\": 0, \"pid\": 4242, \"bytes\": 2147483648}\n\n\
                    {\"at_s\": 1.5, \"card\": 1, \"pid\": 7, \"bytes\": 0}\n";
        let evs = parse_sim_events(text).unwrap();
        assert_eq!(evs.len(), 2);
        assert_eq!(evs[0].at_s, 1.5, "sorted by time");
        assert_eq!(evs[1].bytes, 2147483648);
        let err = parse_sim_events("{\"at_s\": 1}\n").unwrap_err();
        assert!(err.to_string().contains("line 1"), "{err}");
        assert!(parse_sim_events("{\"at_s\": -1, \"card\": 0, \"pid\": 1, \"bytes\": 1}").is_err());
    }

    #[test]
    fn free_is_total_minus_everything_held() {
        let clock = Arc::new(ManualClock::new());
        let spec = SimCardSpec {
            carve_out: Bytes::mib(600),
            residue: Bytes::mib(500),
            ..SimCardSpec::new(CardId(0), Bytes::gib(8))
        };
        let c = SimCard::new(spec, &[], clock);
        let b = c.raw_alloc(Bytes::gib(1)).unwrap();
        c.set_foreign(99, Bytes::gib(2));
        assert_eq!(c.driver_free(), Bytes::gib(5) - Bytes::mib(1100));
        assert_eq!(c.process_bytes(), Bytes::gib(1) + Bytes::mib(500));
        assert!(c.processes().contains(&ProcessBytes { pid: 99, bytes: Bytes::gib(2) }));
        c.raw_free(b);
        assert_eq!(c.driver_free(), Bytes::gib(6) - Bytes::mib(1100));
    }

    #[test]
    fn events_play_on_schedule_and_foreign_takes_only_free_memory() {
        let clock = Arc::new(ManualClock::new());
        let evs = [
            SimEvent { at_s: 5.0, card: 0, pid: 4242, bytes: Bytes::gib(10).get() },
            SimEvent { at_s: 5.0, card: 1, pid: 1, bytes: Bytes::gib(1).get() },
            SimEvent { at_s: 9.0, card: 0, pid: 4242, bytes: 0 },
        ];
        let c = card(clock.clone(), &evs);
        let ours = c.raw_alloc(Bytes::gib(3)).unwrap();
        assert_eq!(c.foreign_bytes(), Bytes::ZERO);
        clock.set(Duration::from_secs(5));
        // It wants 10 GiB but only 5 GiB are free: it takes those and waits.
        assert_eq!(c.foreign_bytes(), Bytes::gib(5));
        assert_eq!(c.driver_free(), Bytes::ZERO);
        c.raw_free(ours);
        assert_eq!(c.foreign_bytes(), Bytes::gib(8), "freed memory is taken by the pending process");
        clock.set(Duration::from_secs(9));
        assert_eq!(c.foreign_bytes(), Bytes::ZERO);
        assert_eq!(c.driver_free(), Bytes::gib(8));
    }

    #[test]
    fn full_card_and_injected_failures_refuse() {
        let clock = Arc::new(ManualClock::new());
        let c = card(clock, &[]);
        assert!(matches!(c.raw_alloc(Bytes::gib(9)), Err(CardError::OutOfMemory { .. })));
        c.inject_failures(1);
        assert!(matches!(c.raw_alloc(Bytes::mib(2)), Err(CardError::Injected { .. })));
        assert!(c.raw_alloc(Bytes::mib(2)).is_ok());
    }

    #[test]
    fn commits_must_be_aligned_inside_the_range_and_disjoint() {
        let clock = Arc::new(ManualClock::new());
        let c = card(clock, &[]);
        let va = c.reserve_va(Bytes::mib(8)).unwrap();
        assert_eq!(c.driver_free(), Bytes::gib(8), "a reservation takes no memory");
        c.commit(&va, Bytes::ZERO, Bytes::mib(4)).unwrap();
        assert!(c.commit(&va, Bytes::mib(2), Bytes::mib(2)).is_err(), "overlap");
        assert!(c.commit(&va, Bytes::mib(1), Bytes::mib(2)).is_err(), "misaligned");
        assert!(c.commit(&va, Bytes::mib(8), Bytes::mib(2)).is_err(), "outside");
        assert_eq!(c.our_bytes(), Bytes::mib(4));
        assert!(c.decommit(&va, Bytes::ZERO, Bytes::mib(2)).is_err(), "must match a commit");
        c.decommit(&va, Bytes::ZERO, Bytes::mib(4)).unwrap();
        assert_eq!(c.our_bytes(), Bytes::ZERO);
        c.release_va(va);
    }
}
