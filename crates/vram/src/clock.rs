//! Time, injected.
//!
//! Hold times, simulated event schedules, sampler timestamps and restore
//! times all read a [`Clock`] instead of the system clock, so tests can step
//! time by hand and run instantly and deterministically. Production uses
//! [`SystemClock`]; tests use [`ManualClock`].

use std::sync::Mutex;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// A source of monotonic and wall time.
pub trait Clock: Send + Sync {
    /// Monotonic time since the clock's own origin (process start for the
    /// system clock, zero for a manual clock).
    fn now(&self) -> Duration;
    /// Wall time in milliseconds since the Unix epoch, for marks a person reads.
    fn wall_unix_ms(&self) -> u64;
}

/// The real clock: monotonic time since construction, wall time from the OS.
#[derive(Debug)]
pub struct SystemClock {
    origin: Instant,
}

impl SystemClock {
    pub fn new() -> SystemClock {
        SystemClock { origin: Instant::now() }
    }
}

impl Default for SystemClock {
    fn default() -> Self {
        SystemClock::new()
    }
}

impl Clock for SystemClock {
    fn now(&self) -> Duration {
        self.origin.elapsed()
    }
    fn wall_unix_ms(&self) -> u64 {
        // A clock set before 1970 is a broken host, not an input error; zero
        // keeps marks readable instead of aborting the server.
        SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
    }
}

/// A clock that moves only when told to.
#[derive(Debug, Default)]
pub struct ManualClock {
    now: Mutex<Duration>,
}

/// The wall time a manual clock reports at its origin (2026-01-01T00:00:00Z),
/// so marks written under test look like real ones.
const MANUAL_WALL_ORIGIN_MS: u64 = 1_767_225_600_000;

impl ManualClock {
    pub fn new() -> ManualClock {
        ManualClock::default()
    }
    /// Move time forward by `by`.
    pub fn advance(&self, by: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        *now += by;
    }
    /// Jump to an absolute time; moving backwards is ignored because the
    /// clock is monotonic.
    pub fn set(&self, to: Duration) {
        let mut now = self.now.lock().unwrap_or_else(|e| e.into_inner());
        if to > *now {
            *now = to;
        }
    }
}

impl Clock for ManualClock {
    fn now(&self) -> Duration {
        *self.now.lock().unwrap_or_else(|e| e.into_inner())
    }
    fn wall_unix_ms(&self) -> u64 {
        MANUAL_WALL_ORIGIN_MS + self.now().as_millis() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn manual_clock_moves_only_forward() {
        let c = ManualClock::new();
        assert_eq!(c.now(), Duration::ZERO);
        c.advance(Duration::from_millis(150));
        c.set(Duration::from_millis(100));
        assert_eq!(c.now(), Duration::from_millis(150));
        c.set(Duration::from_secs(2));
        assert_eq!(c.now(), Duration::from_secs(2));
        assert_eq!(c.wall_unix_ms(), MANUAL_WALL_ORIGIN_MS + 2000);
    }
}
