//! Limits on abuse, per bearer token: a request rate (a token bucket: `429 rate_limited` with
//! `Retry-After` past it) and a number of concurrent long-polls (past it a long-poll answers at once
//! instead of waiting). Requests without a known token share one bucket, so guessing tokens is
//! limited too. Memory is bounded: one bucket per configured token, plus that one — console
//! sessions take from their token's bucket, never one of their own.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;

/// Whose request: a configured token's digest, or everyone without one.
pub type Key = Option<[u8; 32]>;

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AbuseLimits {
    /// Sustained requests per second per token; 0 turns the rate limit off.
    pub requests_per_second: f64,
    /// Requests a token may make at once above the rate.
    pub burst: f64,
    /// Long-polls (`wait_seconds` > 0) a token may have waiting at once.
    pub long_polls: usize,
}

impl Default for AbuseLimits {
    fn default() -> AbuseLimits {
        AbuseLimits { requests_per_second: 1_000.0, burst: 2_000.0, long_polls: 64 }
    }
}

pub struct Limiter {
    limits: AbuseLimits,
    buckets: Mutex<HashMap<Key, (f64, Instant)>>,
    polls: Mutex<HashMap<Key, Arc<tokio::sync::Semaphore>>>,
}

impl Limiter {
    pub fn new(limits: AbuseLimits) -> Limiter {
        Limiter { limits, buckets: Mutex::new(HashMap::new()), polls: Mutex::new(HashMap::new()) }
    }

    /// Takes one request from `key`'s bucket, or says how long until one is there.
    pub fn admit(&self, key: Key) -> Result<(), Duration> {
        self.take(key, 1.0)
    }

    /// Takes `more` requests from `key`'s bucket at once, after the one the door took for the
    /// request (a request carrying `more + 1` reports), or none and says how long until they are
    /// there. At most the burst less the door's one is asked for, so a request the bucket could
    /// never hold still passes when the bucket was full before its door.
    pub fn admit_more(&self, key: Key, more: usize) -> Result<(), Duration> {
        let room = (self.limits.burst.max(1.0) - 1.0).max(0.0);
        self.take(key, (more as f64).min(room))
    }

    fn take(&self, key: Key, wanted: f64) -> Result<(), Duration> {
        let rate = self.limits.requests_per_second;
        if rate <= 0.0 {
            return Ok(());
        }
        let burst = self.limits.burst.max(1.0);
        let now = Instant::now();
        let mut buckets = self.buckets.lock().expect("limiter lock");
        if !buckets.contains_key(&key) {
            // Keys are configured tokens' digests and the anonymous `None`: this stays small.
            metrics::gauge!("settle_http_rate_buckets").set((buckets.len() + 1) as f64);
        }
        let (tokens, last) = buckets.entry(key).or_insert((burst, now));
        *tokens = (*tokens + now.duration_since(*last).as_secs_f64() * rate).min(burst);
        *last = now;
        if *tokens >= wanted {
            *tokens -= wanted;
            Ok(())
        } else {
            Err(Duration::from_secs_f64((wanted - *tokens) / rate))
        }
    }

    /// A place for one more waiting long-poll of `key`, or `None` when it has all it may.
    pub fn long_poll(&self, key: Key) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let sem = {
            let mut polls = self.polls.lock().expect("limiter lock");
            polls.entry(key).or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.limits.long_polls))).clone()
        };
        sem.try_acquire_owned().ok()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_bucket_refills_at_the_rate() {
        let l = Limiter::new(AbuseLimits { requests_per_second: 10.0, burst: 3.0, long_polls: 1 });
        let (a, b) = (Some([1u8; 32]), Some([2u8; 32]));
        for _ in 0..3 {
            assert!(l.admit(a).is_ok());
        }
        let wait = l.admit(a).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(100), "{wait:?}");
        assert!(l.admit(b).is_ok(), "another token has its own bucket");
        tokio::time::advance(Duration::from_millis(100)).await;
        assert!(l.admit(a).is_ok());
        let held = l.long_poll(a).unwrap();
        assert!(l.long_poll(a).is_none());
        assert!(l.long_poll(b).is_some());
        drop(held);
        assert!(l.long_poll(a).is_some());
    }

    /// A request of more reports than the burst passes when the bucket was full before its door,
    /// and takes the whole bucket (the door's one and the burst less one more).
    #[tokio::test(start_paused = true)]
    async fn a_request_of_more_than_the_burst_passes_a_full_bucket() {
        let l = Limiter::new(AbuseLimits { requests_per_second: 1.0, burst: 3.0, long_polls: 1 });
        let a = Some([1u8; 32]);
        assert!(l.admit(a).is_ok(), "the door");
        assert!(l.admit_more(a, 99).is_ok(), "the burst less the door's one");
        assert!(l.admit(a).is_err(), "the bucket is empty");
        tokio::time::advance(Duration::from_secs(3)).await;
        assert!(l.admit(a).is_ok());
        assert!(l.admit_more(a, 1).is_ok());
        assert!(l.admit_more(a, 1).is_ok());
        assert!(l.admit_more(a, 1).is_err(), "all or none: one was asked for, none is there");
    }
}
