//! The floor guard: spill before allocate (DESIGN.md §3.2).
//!
//! Before anything takes memory on a card the guard checks the driver's
//! free memory. If `free - want` would fall under the arming floor it arms:
//! it aims for `arming floor + delta + want` and spends relief providers in
//! (tier, cost) order, re-probing the driver after each one and crediting
//! only the measured rise, never what the provider says it freed. The host
//! tier opens only when every card is level or when refusing would deadlock
//! serving. The verdict is judged against the law floor, which is kept
//! apart from the arming floor; when the providers are exhausted the guard
//! refuses and the caller degrades (waits, preempts, abandons).

use crate::config::CardSettings;
use corridor_units::{Bytes, CardId};
use serde::Serialize;
use std::fmt;
use std::sync::Arc;

/// Where relief comes from, in spending order. A later tier is never
/// spent before an earlier one, however cheap it is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Tier {
    /// Bytes on this card that hold nothing live (idle KV chunks, unreferenced prefix pages).
    Local,
    /// Move ownership to a card with headroom.
    Rebalance,
    /// Move a cold payload into a peer card's spare memory.
    Park,
    /// Move cold KV to host RAM.
    Host,
}

/// Something that can free memory on a card when asked. The engine
/// registers its own ("release idle KV chunks", "evict cached prefixes",
/// "preempt"); the KV arena is one out of the box.
///
/// A provider must not reserve memory on the card it is relieving: the
/// guard holds that card's decision lock while it runs.
pub trait ReliefProvider: Send + Sync {
    /// A short name for logs.
    fn name(&self) -> &str;
    fn tier(&self) -> Tier;
    /// Relative cost inside the tier (lower is spent first).
    fn cost(&self) -> u32;
    /// Try to free `need` bytes on `card`; return what it believes it freed.
    /// The guard does not trust the answer: it re-probes the driver.
    fn relieve(&self, card: CardId, need: Bytes) -> Bytes;
}

/// How badly the caller needs the memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Urgency {
    /// Take it only if it fits above the arming floor as things are; never
    /// spend providers (growing KV back into headroom that returned).
    Opportunistic,
    /// The caller can wait or degrade on a refusal (admission, boot sizing).
    Deferrable,
    /// Refusing would deadlock serving (or the law itself is being restored):
    /// the host tier opens even if the fleet is not level; the order stays.
    Blocking,
}

/// Why a reservation was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum RefusalReason {
    /// Granting would take free memory under the law floor.
    Floor,
    /// Granting would take our books over the card budget.
    Budget,
    /// The caller asked opportunistically and the card has no spare headroom.
    NoSpareHeadroom,
    /// The guard granted but the card itself failed the allocation.
    Card(crate::card::CardError),
}

impl fmt::Display for RefusalReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            RefusalReason::Floor => f.write_str("it would cross the floor"),
            RefusalReason::Budget => f.write_str("it would exceed the card budget"),
            RefusalReason::NoSpareHeadroom => f.write_str("no spare headroom above the arming floor"),
            RefusalReason::Card(e) => write!(f, "the card failed: {e}"),
        }
    }
}

/// A refused reservation, with the numbers that decided it.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{card}: refused {want}: {reason} (free {free}, floor {floor}, books {books}, budget {})",
    .budget.map(|b| b.to_string()).unwrap_or_else(|| "none".to_string()))]
pub struct Refusal {
    pub card: CardId,
    pub want: Bytes,
    /// Driver free memory after relief.
    pub free: Bytes,
    pub floor: Bytes,
    pub books: Bytes,
    pub budget: Option<Bytes>,
    pub reason: RefusalReason,
}

/// One provider call while armed.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReliefStep {
    pub provider: String,
    pub tier: Tier,
    /// What the provider said it freed.
    pub claimed: Bytes,
    /// The measured rise in driver free memory (the only thing credited).
    pub measured: Bytes,
}

/// Why the host tier was open during an armed reservation.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum HostOpening {
    Closed,
    /// Every card was at or under floor + delta.
    FleetLevel,
    /// The caller said refusing would deadlock serving.
    Deadlock,
}

/// What the guard did for one request.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct GuardOutcome {
    pub armed: bool,
    pub free_before: Bytes,
    pub free_after: Bytes,
    pub steps: Vec<ReliefStep>,
    pub host: HostOpening,
}

/// Counters of one card's guard.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
pub struct GuardStats {
    pub requests: u64,
    pub arms: u64,
    pub refusals: u64,
    pub provider_calls: u64,
    /// Bytes providers claimed beyond what the driver showed.
    pub overclaimed: Bytes,
    pub host_openings_level: u64,
    pub host_openings_deadlock: u64,
    /// Allocations that landed under the floor (another process took memory
    /// between the guard's probe and the driver's allocation) and were undone.
    pub landings_undone: u64,
}

/// Readings the guard needs from its card.
pub(crate) trait GuardProbe {
    /// (driver free, our books total), read now.
    fn probe(&self) -> (Bytes, Bytes);
    /// Whether every card of the fleet rests at or under its floor + delta,
    /// this one counted as if it held `want` already.
    fn fleet_is_level(&self, want: Bytes) -> bool;
}

/// Sort providers by (tier, cost); the sort is stable so registration order
/// breaks ties.
pub(crate) fn spending_order(providers: &[Arc<dyn ReliefProvider>]) -> Vec<Arc<dyn ReliefProvider>> {
    let mut order = providers.to_vec();
    order.sort_by_key(|p| (p.tier(), p.cost()));
    order
}

/// One guard decision. The caller holds the card's decision lock.
pub(crate) fn ensure_headroom(
    card: CardId,
    settings: &CardSettings,
    want: Bytes,
    urgency: Urgency,
    providers: &[Arc<dyn ReliefProvider>],
    probe: &dyn GuardProbe,
    stats: &mut GuardStats,
) -> Result<GuardOutcome, Refusal> {
    stats.requests += 1;
    let arming = settings.arming_floor();
    let (free0, books0) = probe.probe();
    let within_budget = |books: Bytes| settings.budget.is_none_or(|b| books + want <= b);
    let refusal = |free: Bytes, books: Bytes, reason: RefusalReason| Refusal {
        card,
        want,
        free,
        floor: settings.floor,
        books,
        budget: settings.budget,
        reason,
    };
    let calm = |free: Bytes, books: Bytes| free >= arming + want && within_budget(books);
    let outcome =
        |armed, free_after, steps, host| GuardOutcome { armed, free_before: free0, free_after, steps, host };

    if calm(free0, books0) {
        return Ok(outcome(false, free0, Vec::new(), HostOpening::Closed));
    }
    if urgency == Urgency::Opportunistic {
        stats.refusals += 1;
        let reason =
            if within_budget(books0) { RefusalReason::NoSpareHeadroom } else { RefusalReason::Budget };
        return Err(refusal(free0, books0, reason));
    }

    stats.arms += 1;
    let target_free = arming + settings.delta + want;
    // Aim the budget with the same overshoot, so a card at its budget does
    // not re-arm on every following reservation.
    let target_books = settings.budget.map(|b| b.saturating_sub(want + settings.delta));
    let satisfied =
        |free: Bytes, books: Bytes| free >= target_free && target_books.is_none_or(|t| books <= t);

    let mut host = HostOpening::Closed;
    let mut host_decided = false;
    let (mut free, mut books) = (free0, books0);
    let mut steps = Vec::new();
    for provider in spending_order(providers) {
        if satisfied(free, books) {
            break;
        }
        if provider.tier() == Tier::Host {
            if !host_decided {
                host_decided = true;
                host = if probe.fleet_is_level(want) {
                    stats.host_openings_level += 1;
                    HostOpening::FleetLevel
                } else if urgency == Urgency::Blocking {
                    stats.host_openings_deadlock += 1;
                    HostOpening::Deadlock
                } else {
                    HostOpening::Closed
                };
            }
            if host == HostOpening::Closed {
                continue;
            }
        }
        let need_free = target_free.saturating_sub(free);
        let need_books = target_books.map_or(Bytes::ZERO, |t| books.saturating_sub(t));
        let claimed = provider.relieve(card, need_free.max(need_books));
        stats.provider_calls += 1;
        let (free_now, books_now) = probe.probe();
        let measured = free_now.saturating_sub(free);
        stats.overclaimed += claimed.saturating_sub(measured);
        steps.push(ReliefStep {
            provider: provider.name().to_string(),
            tier: provider.tier(),
            claimed,
            measured,
        });
        (free, books) = (free_now, books_now);
    }

    // The verdict is the law floor, not the arming floor.
    let fits_floor = free >= settings.floor + want;
    if fits_floor && within_budget(books) {
        tracing::debug!(%card, %want, free_before = %free0, free_after = %free, steps = steps.len(), "guard armed and granted");
        return Ok(outcome(true, free, steps, host));
    }
    stats.refusals += 1;
    let reason = if fits_floor { RefusalReason::Budget } else { RefusalReason::Floor };
    let refused = refusal(free, books, reason);
    tracing::info!(%card, providers = steps.len(), "guard refused: {refused}");
    Err(refused)
}
