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

    /// RFC 3339 in UTC, as every answer, event and webhook body writes it (fraction without
    /// trailing zeros). One formatter, so one event reads the same everywhere.
    pub fn rfc3339(self) -> String {
        let nanos = i128::from(self.0) * 1_000;
        time::OffsetDateTime::from_unix_timestamp_nanos(nanos)
            .ok()
            .and_then(|dt| dt.format(&time::format_description::well_known::Rfc3339).ok())
            .unwrap_or_else(|| "1970-01-01T00:00:00Z".to_owned())
    }

    pub fn parse_rfc3339(s: &str) -> Option<Timestamp> {
        let dt = time::OffsetDateTime::parse(s, &time::format_description::well_known::Rfc3339).ok()?;
        let micros = dt.unix_timestamp_nanos() / 1_000;
        i64::try_from(micros).ok().map(Timestamp::from_micros)
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

#[cfg(test)]
mod tests {
    use super::Timestamp;

    #[test]
    fn rfc3339_round_trips_in_utc() {
        assert_eq!(Timestamp::from_micros(0).rfc3339(), "1970-01-01T00:00:00Z");
        assert_eq!(Timestamp::from_micros(1_767_225_600_000_005).rfc3339(), "2026-01-01T00:00:00.000005Z");
        assert_eq!(Timestamp::from_micros(951_782_400_500_000).rfc3339(), "2000-02-29T00:00:00.5Z");
        for t in [0, 1_767_225_600_000_005, 951_782_400_500_000] {
            let ts = Timestamp::from_micros(t);
            assert_eq!(Timestamp::parse_rfc3339(&ts.rfc3339()), Some(ts));
        }
        assert_eq!(
            Timestamp::parse_rfc3339("2026-01-01T01:00:00+01:00"),
            Some(Timestamp::from_micros(1_767_225_600_000_000))
        );
        assert_eq!(Timestamp::parse_rfc3339("yesterday"), None);
    }

    #[test]
    fn arithmetic_and_clocks() {
        use super::{Clock, FakeClock, SystemClock};
        let t = Timestamp::from_micros(5_000_000);
        assert_eq!(t.micros(), 5_000_000);
        assert_eq!(t.plus_millis(1_500).micros(), 6_500_000);
        assert_eq!(t.plus_seconds(2).micros(), 7_000_000);
        assert_eq!(t.minus_seconds(3).micros(), 2_000_000);
        assert_eq!(Timestamp::from_micros(i64::MAX - 1).plus_millis(1).micros(), i64::MAX, "saturates");
        let fake = FakeClock::new(t);
        assert_eq!(fake.now(), t);
        fake.advance_millis(250);
        fake.advance_seconds(1);
        assert_eq!(fake.now().micros(), 6_250_000);
        fake.set(Timestamp::from_micros(42));
        assert_eq!(fake.now().micros(), 42);
        // The system clock reads a real time (after 2020-01-01), whichever way it is asked.
        let y2020 = 1_577_836_800_000_000;
        assert!(SystemClock.now_micros() > y2020);
        assert!(SystemClock.now().micros() > y2020);
        assert!(SystemClock.now_plus_millis(60_000).micros() > y2020 + 60_000_000);
    }
}
