//! Helpers shared by the integration tests: sim cards and relief providers
//! whose behaviour (honest, lying, logging) the tests choose.
#![allow(dead_code)]

use corridor_units::{Bytes, CardId};
use corridor_vram::{Allocation, Device, ManualClock, Purpose, ReliefProvider, SimCard, SimCardSpec, Tier};
use std::sync::{Arc, Mutex};

pub fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new())
}

pub fn sim(clock: &Arc<ManualClock>, id: u32, total: Bytes) -> Arc<SimCard> {
    Arc::new(SimCard::new(SimCardSpec::new(CardId(id), total), &[], clock.clone()))
}

/// A provider that holds allocations (a cache) and frees them when asked,
/// or, if `lie` is set, frees nothing and claims `lie` bytes.
pub struct TestProvider {
    pub name: String,
    pub tier: Tier,
    pub cost: u32,
    pub card: CardId,
    pub held: Mutex<Vec<Allocation>>,
    pub lie: Option<Bytes>,
    /// (provider name, need) of every call, shared between providers.
    pub log: Arc<Mutex<Vec<(String, Bytes)>>>,
}

impl TestProvider {
    /// An honest provider holding `pieces` allocations of `piece` bytes on `dev`.
    pub fn honest(
        name: &str,
        tier: Tier,
        cost: u32,
        dev: &Device,
        pieces: usize,
        piece: Bytes,
        log: &Arc<Mutex<Vec<(String, Bytes)>>>,
    ) -> Arc<TestProvider> {
        let held =
            (0..pieces).map(|_| dev.reserve(piece, Purpose::Other).expect("test setup fits")).collect();
        Arc::new(TestProvider {
            name: name.into(),
            tier,
            cost,
            card: dev.id(),
            held: Mutex::new(held),
            lie: None,
            log: log.clone(),
        })
    }

    pub fn liar(
        name: &str,
        tier: Tier,
        cost: u32,
        card: CardId,
        claim: Bytes,
        log: &Arc<Mutex<Vec<(String, Bytes)>>>,
    ) -> Arc<TestProvider> {
        Arc::new(TestProvider {
            name: name.into(),
            tier,
            cost,
            card,
            held: Mutex::new(Vec::new()),
            lie: Some(claim),
            log: log.clone(),
        })
    }
}

impl ReliefProvider for TestProvider {
    fn name(&self) -> &str {
        &self.name
    }
    fn tier(&self) -> Tier {
        self.tier
    }
    fn cost(&self) -> u32 {
        self.cost
    }
    fn relieve(&self, card: CardId, need: Bytes) -> Bytes {
        self.log.lock().unwrap().push((self.name.clone(), need));
        if card != self.card {
            return Bytes::ZERO;
        }
        if let Some(claim) = self.lie {
            return claim;
        }
        let mut held = self.held.lock().unwrap();
        let mut freed = Bytes::ZERO;
        while freed < need {
            let Some(a) = held.pop() else { break };
            freed += a.bytes();
        }
        freed
    }
}

pub fn names(log: &Arc<Mutex<Vec<(String, Bytes)>>>) -> Vec<String> {
    log.lock().unwrap().iter().map(|(n, _)| n.clone()).collect()
}
