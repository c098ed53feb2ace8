//! The governor: a fleet of cards with their chokepoints, the shared relief
//! providers, the KV arenas, the sampler and the relief loop.
//!
//! The cli builds one at boot from the cards and a [`GovernorConfig`]; the
//! engine takes devices from it, attaches its KV arenas and registers its
//! providers; [`Governor::spawn_monitor`] starts the sampler and relief
//! threads. Tests drive the same machinery one [`Governor::tick`] at a time
//! under a manual clock.

use crate::arena::KvArena;
use crate::card::Card;
use crate::clock::Clock;
use crate::config::{ConfigError, GovernorConfig};
use crate::device::{lock, Device, FleetView, ProviderRegistry};
use crate::guard::ReliefProvider;
use crate::recorder::FlightRecorder;
use crate::relief::{relief_step, ReliefAction};
use crate::report::{build_report, MemoryReport};
use crate::sampler::{SampleResult, Sampler};
use corridor_units::CardId;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

/// The memory governor of one process.
pub struct Governor {
    devices: Vec<Device>,
    providers: Arc<ProviderRegistry>,
    config: GovernorConfig,
    clock: Arc<dyn Clock>,
    arenas: Mutex<Vec<Arc<KvArena>>>,
    sampler: Sampler,
    recorder: Mutex<Option<Arc<FlightRecorder>>>,
}

impl std::fmt::Debug for Governor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Governor").field("devices", &self.devices).finish_non_exhaustive()
    }
}

impl Governor {
    /// A governor over `cards`, which must be numbered `card0..cardN` in order.
    pub fn new(
        cards: Vec<Arc<dyn Card>>,
        config: GovernorConfig,
        clock: Arc<dyn Clock>,
    ) -> Result<Governor, ConfigError> {
        config.validate(cards.len())?;
        for (i, card) in cards.iter().enumerate() {
            if card.id() != CardId(i as u32) {
                return Err(ConfigError::CardOrder { position: i, card: card.id() });
            }
        }
        let fleet =
            Arc::new(FleetView { cards: cards.iter().map(|c| (c.clone(), config.card(c.id()))).collect() });
        let providers = Arc::new(ProviderRegistry::default());
        let devices: Vec<Device> = cards
            .iter()
            .map(|c| Device::in_fleet(c.clone(), config.card(c.id()), providers.clone(), fleet.clone()))
            .collect();
        let sampler = Sampler::new(devices.clone(), clock.clone());
        Ok(Governor {
            devices,
            providers,
            config,
            clock,
            arenas: Mutex::new(Vec::new()),
            sampler,
            recorder: Mutex::new(None),
        })
    }

    pub fn devices(&self) -> &[Device] {
        &self.devices
    }
    pub fn device(&self, card: CardId) -> Option<&Device> {
        self.devices.get(card.0 as usize)
    }
    pub fn config(&self) -> &GovernorConfig {
        &self.config
    }
    pub fn clock(&self) -> &Arc<dyn Clock> {
        &self.clock
    }
    pub fn sampler(&self) -> &Sampler {
        &self.sampler
    }

    /// Add a relief provider for every card.
    pub fn register_provider(&self, provider: Arc<dyn ReliefProvider>) {
        self.providers.register(provider);
    }

    /// Attach a KV arena: it becomes the first relief provider of its card
    /// and grows back when headroom returns.
    pub fn attach_arena(&self, arena: Arc<KvArena>) {
        self.providers.register(arena.clone());
        lock(&self.arenas).push(arena);
    }

    pub fn arenas(&self) -> Vec<Arc<KvArena>> {
        lock(&self.arenas).clone()
    }

    /// Record a phase flip: a flip mark of every card, when a recorder is
    /// attached (a failed write is logged, never fatal).
    pub fn record_flip(&self, event: &crate::recorder::FlipEvent) {
        let recorder = lock(&self.recorder).clone();
        if let Some(r) = recorder {
            if let Err(e) = r.flip_mark(event, &self.devices) {
                tracing::warn!("flight recorder: {e}");
            }
        }
    }

    /// Write serving marks through `recorder` at its pace from now on.
    pub fn attach_recorder(&self, recorder: Arc<FlightRecorder>) {
        *lock(&self.recorder) = Some(recorder);
    }

    /// One sample of every card, and a serving mark if one is due.
    pub fn sample(&self) -> Vec<SampleResult> {
        let results = self.sampler.sample();
        let recorder = lock(&self.recorder).clone();
        if let Some(r) = recorder {
            if let Err(e) = r.serving_mark_if_due(&self.devices) {
                tracing::warn!("serving mark not written: {e}");
            }
        }
        results
    }

    /// One relief step: restore floors, grow KV back where there is room. A
    /// card found under its floor is sampled first, so the record never
    /// misses a dip that relief ends before the sampler's next period.
    pub fn relieve(&self) -> Vec<ReliefAction> {
        if self.devices.iter().any(|d| d.card().driver_free() < d.settings().floor) {
            self.sample();
        }
        relief_step(&self.devices, &self.arenas())
    }

    /// Sample, then relieve: what the monitor threads do in one period.
    pub fn tick(&self) -> Vec<ReliefAction> {
        self.sample();
        self.relieve()
    }

    /// The `GET /v1/memory` body.
    pub fn memory_report(&self) -> MemoryReport {
        build_report(self)
    }

    /// Start the sampler thread and the relief thread. The sampler only
    /// reads, so a slow provider can never stretch the sampling period; it
    /// wakes the relief thread as soon as a card is under its floor.
    pub fn spawn_monitor(self: &Arc<Self>) -> std::io::Result<Monitor> {
        let stop = Arc::new(AtomicBool::new(false));
        let wake = Arc::new((Mutex::new(false), Condvar::new()));
        let interval = self.config.sample_interval;

        let (gov, stop_s, wake_s) = (self.clone(), stop.clone(), wake.clone());
        let sampler = std::thread::Builder::new().name("corridor-sampler".into()).spawn(move || {
            while !stop_s.load(Ordering::Relaxed) {
                let results = gov.sample();
                if results.iter().any(|r| r.under.is_some()) {
                    *lock(&wake_s.0) = true;
                    wake_s.1.notify_one();
                }
                std::thread::sleep(interval);
            }
        })?;

        let (gov, stop_r, wake_r) = (self.clone(), stop.clone(), wake.clone());
        let relief = std::thread::Builder::new().name("corridor-relief".into()).spawn(move || {
            while !stop_r.load(Ordering::Relaxed) {
                gov.relieve();
                let (flag, cvar) = &*wake_r;
                let woken = lock(flag);
                let (mut woken, _) = cvar.wait_timeout(woken, interval).unwrap_or_else(|e| e.into_inner());
                *woken = false;
            }
        })?;
        Ok(Monitor { stop, wake, threads: vec![sampler, relief] })
    }
}

/// The running sampler and relief threads; dropping it stops and joins them.
pub struct Monitor {
    stop: Arc<AtomicBool>,
    wake: Arc<(Mutex<bool>, Condvar)>,
    threads: Vec<JoinHandle<()>>,
}

impl Drop for Monitor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        self.wake.1.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::clock::SystemClock;
    use crate::config::CardSettings;
    use crate::sim::{SimCard, SimCardSpec};
    use corridor_units::Bytes;

    fn card(id: u32, clock: &Arc<dyn Clock>) -> Arc<dyn Card> {
        Arc::new(SimCard::new(SimCardSpec::new(CardId(id), Bytes::gib(4)), &[], clock.clone()))
    }

    #[test]
    fn cards_must_be_numbered_in_order() {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
        let config = GovernorConfig::uniform(2, CardSettings::default());
        let err =
            Governor::new(vec![card(1, &clock), card(0, &clock)], config.clone(), clock.clone()).unwrap_err();
        assert!(matches!(err, ConfigError::CardOrder { position: 0, .. }));
        assert!(Governor::new(vec![card(0, &clock)], config, clock).is_err(), "one card, two settings");
    }

    #[test]
    fn the_monitor_threads_run_and_stop_on_drop() {
        let clock: Arc<dyn Clock> = Arc::new(SystemClock::new());
        let mut config = GovernorConfig::uniform(1, CardSettings::default());
        config.sample_interval = std::time::Duration::from_millis(1);
        let gov = Arc::new(Governor::new(vec![card(0, &clock)], config, clock).unwrap());
        let monitor = gov.spawn_monitor().unwrap();
        // Wait for the sampler to take a first sample (no time bound asserted).
        while gov.sampler().stats(CardId(0)).unwrap().samples == 0 {
            std::thread::yield_now();
        }
        drop(monitor);
        assert_eq!(Arc::strong_count(&gov), 1, "both threads let go of the governor");
    }
}
