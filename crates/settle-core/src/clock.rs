//! Time is injected. Stores and loops take a `Clock`; tests use `FakeClock`.

use std::sync::atomic::{AtomicI64, Ordering};

/// Microseconds since the Unix epoch, UTC. Stored as an integer on every engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
pub struct Timestamp(i64);

impl Timestamp {
    pub const fn from_micros(micros: i64) -> Timestamp {
        Timestamp(micros)
    }
    pub const fn micros(self) -> i64 {
        self.0
    }
    /// `self + ms`, saturating at the far future rather than wrapping.
    pub fn plus_millis(self, ms: u64) -> Timestamp {
        let delta = i64::try_from(ms).unwrap_or(i64::MAX).saturating_mul(1_000);
        Timestamp(self.0.saturating_add(delta))
    }
    pub fn plus_seconds(self, seconds: u64) -> Timestamp {
        self.plus_millis(seconds.saturating_mul(1_000))
    }
    pub fn minus_seconds(self, seconds: u64) -> Timestamp {
        let delta = i64::try_from(seconds).unwrap_or(i64::MAX).saturating_mul(1_000_000);
        Timestamp(self.0.saturating_sub(delta))
    }
}

pub trait Clock: Send + Sync + std::fmt::Debug {
    fn now(&self) -> Timestamp;
}

/// The wall clock. The only place in Settle that reads system time.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)] // the one place that reads the wall clock
    fn now(&self) -> Timestamp {
        let since_epoch = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        Timestamp(i64::try_from(since_epoch.as_micros()).unwrap_or(i64::MAX))
    }
}

impl SystemClock {
    /// Now plus `ms`, for tests and tools that schedule against the wall clock.
    pub fn now_plus_millis(&self, ms: u64) -> Timestamp {
        self.now().plus_millis(ms)
    }
    pub fn now_micros(&self) -> i64 {
        self.now().micros()
    }
}

/// A clock that moves only when told to; for tests and the demo.
#[derive(Debug)]
pub struct FakeClock(AtomicI64);

impl FakeClock {
    pub fn new(start: Timestamp) -> FakeClock {
        FakeClock(AtomicI64::new(start.micros()))
    }
    pub fn advance_millis(&self, ms: u64) {
        let delta = i64::try_from(ms).unwrap_or(i64::MAX).saturating_mul(1_000);
        self.0.fetch_add(delta, Ordering::SeqCst);
    }
    pub fn advance_seconds(&self, seconds: u64) {
        self.advance_millis(seconds.saturating_mul(1_000));
    }
    pub fn set(&self, t: Timestamp) {
        self.0.store(t.micros(), Ordering::SeqCst);
    }
}

impl Clock for FakeClock {
    fn now(&self) -> Timestamp {
        Timestamp(self.0.load(Ordering::SeqCst))
    }
}
