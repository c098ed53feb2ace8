//! The relief loop: the governor's own reaction to intrusions.
//!
//! When another process grows into a card's floor, corridor cannot stop it,
//! but it must give the floor back by itself: each step, every card whose
//! driver free memory sits under its arming floor runs the guard with
//! nothing to allocate, which spends the registered providers (release idle
//! KV chunks, evict cached prefixes, preempt, spill) in (tier, cost) order
//! and re-probes after each. Restoring the law is never deferrable, so the
//! host tier may open. When the other process shrinks again and the hold
//! time has passed, the KV arenas grow back through the guard into the
//! headroom that returned, never spending relief to do so.

use crate::arena::KvArena;
use crate::device::Device;
use crate::guard::{ReliefStep, Urgency};
use corridor_units::{Bytes, CardId, Pages};
use serde::Serialize;
use std::sync::Arc;

/// What one relief step did on one card.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReliefAction {
    pub card: CardId,
    pub free_before: Bytes,
    pub free_after: Bytes,
    /// Provider calls, each with its claim and its measured effect.
    pub steps: Vec<ReliefStep>,
    /// Whether the card ended at or above its law floor.
    pub restored: bool,
    /// KV pages grown back (when the card had spare headroom).
    pub regrown: Pages,
}

/// Run one relief step over `devices`, letting `arenas` grow back on cards
/// with headroom. Returns an action for every card that needed or got one.
pub fn relief_step(devices: &[Device], arenas: &[Arc<KvArena>]) -> Vec<ReliefAction> {
    let mut actions = Vec::new();
    for dev in devices {
        let s = dev.settings();
        let free = dev.card().driver_free();
        if free < s.arming_floor() {
            let action = match dev.make_room(Bytes::ZERO, Urgency::Blocking) {
                Ok(outcome) => ReliefAction {
                    card: dev.id(),
                    free_before: outcome.free_before,
                    free_after: outcome.free_after,
                    restored: outcome.free_after >= s.floor,
                    steps: outcome.steps,
                    regrown: Pages(0),
                },
                Err(refusal) => ReliefAction {
                    card: dev.id(),
                    free_before: free,
                    free_after: refusal.free,
                    restored: false,
                    steps: Vec::new(),
                    regrown: Pages(0),
                },
            };
            if !action.restored {
                tracing::warn!(card = %dev.id(), free = %action.free_after, floor = %s.floor, "relief exhausted; the card stays under its floor");
            }
            actions.push(action);
        } else {
            let regrown: usize =
                arenas.iter().filter(|a| a.card() == dev.id()).map(|a| a.recover().get()).sum();
            if regrown > 0 {
                let after = dev.card().driver_free();
                actions.push(ReliefAction {
                    card: dev.id(),
                    free_before: free,
                    free_after: after,
                    steps: Vec::new(),
                    restored: true,
                    regrown: Pages(regrown),
                });
            }
        }
    }
    actions
}
