//! Capped exponential backoff, `min(base · 2^(n-1), max)` for the n-th failed attempt, with
//! optional full jitter (uniform in `[0, delay]`) from a seedable generator.

use crate::limits::{BACKOFF_MS_BASE_DEFAULT, BACKOFF_MS_MAX_DEFAULT};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Jitter {
    /// The exact capped delay: deterministic, but every job failed in one outage retries together.
    None,
    /// Uniform in `[0, capped delay]` (the AWS "full jitter"): spreads a herd of retries.
    Full,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BackoffPolicy {
    pub backoff_ms_base: u64,
    pub backoff_ms_max: u64,
    pub jitter: Jitter,
}

impl Default for BackoffPolicy {
    fn default() -> BackoffPolicy {
        BackoffPolicy {
            backoff_ms_base: BACKOFF_MS_BASE_DEFAULT,
            backoff_ms_max: BACKOFF_MS_MAX_DEFAULT,
            jitter: Jitter::Full,
        }
    }
}

impl BackoffPolicy {
    /// The capped delay before retrying after failed attempt `n` (1-based), before jitter.
    /// The first retry waits `base`, then `2·base`, `4·base`, … up to `max`.
    pub fn capped_ms(&self, n: u32) -> u64 {
        let exponent = n.saturating_sub(1).min(63);
        let factor = 1u64.checked_shl(exponent).unwrap_or(u64::MAX);
        self.backoff_ms_base.saturating_mul(factor).min(self.backoff_ms_max)
    }

    /// The delay to apply, drawing jitter from `rng`.
    pub fn delay_ms(&self, n: u32, rng: &mut SplitMix64) -> u64 {
        let capped = self.capped_ms(n);
        match self.jitter {
            Jitter::None => capped,
            Jitter::Full => rng.below_inclusive(capped),
        }
    }
}

/// SplitMix64: a tiny, seedable, well-distributed generator. Not for secrets (lease tokens use uuid v4).
#[derive(Debug, Clone)]
pub struct SplitMix64(u64);

impl SplitMix64 {
    pub fn new(seed: u64) -> SplitMix64 {
        SplitMix64(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in `[0, max]`.
    pub fn below_inclusive(&mut self, max: u64) -> u64 {
        if max == u64::MAX {
            return self.next_u64();
        }
        // Multiply-shift keeps the bias below 2^-64 · (max+1): negligible for delays.
        ((u128::from(self.next_u64()) * u128::from(max + 1)) >> 64) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_from_base_and_caps() {
        let p = BackoffPolicy { backoff_ms_base: 1_000, backoff_ms_max: 600_000, jitter: Jitter::None };
        let got: Vec<u64> = (1..=12).map(|n| p.capped_ms(n)).collect();
        assert_eq!(
            got,
            [1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000, 256_000, 512_000, 600_000, 600_000]
        );
        assert_eq!(p.capped_ms(u32::MAX), 600_000);
        assert_eq!(p.capped_ms(0), 1_000);
    }

    #[test]
    fn full_jitter_stays_in_range_and_is_seedable() {
        let p = BackoffPolicy { jitter: Jitter::Full, ..BackoffPolicy::default() };
        let mut a = SplitMix64::new(42);
        let mut b = SplitMix64::new(42);
        for n in 1..40 {
            let d = p.delay_ms(n, &mut a);
            assert!(d <= p.capped_ms(n));
            assert_eq!(d, p.delay_ms(n, &mut b));
        }
        let mut r = SplitMix64::new(7);
        let draws: Vec<u64> = (0..1000).map(|_| p.delay_ms(20, &mut r)).collect();
        let mean = draws.iter().sum::<u64>() / 1000;
        assert!((250_000..350_000).contains(&mean), "mean {mean}");
    }

    /// SplitMix64's published sequence for seed 0 (Vigna's reference implementation).
    #[test]
    fn splitmix64_matches_the_reference() {
        let mut r = SplitMix64::new(0);
        let got: Vec<u64> = (0..4).map(|_| r.next_u64()).collect();
        assert_eq!(got, [0xe220_a839_7b1d_cdaf, 0x6e78_9e6a_a1b9_65f4, 0x06c4_5d18_8009_454f, 0xf88b_b8a8_724c_81ec]);
    }

    #[test]
    fn below_inclusive_covers_exactly_zero_to_max() {
        let mut r = SplitMix64::new(7);
        for max in [0u64, 1, 9] {
            let mut seen = vec![false; max as usize + 1];
            for _ in 0..2_000 {
                let v = r.below_inclusive(max);
                assert!(v <= max, "{v} > {max}");
                seen[v as usize] = true;
            }
            assert!(seen.iter().all(|s| *s), "not every value of 0..={max} was drawn: {seen:?}");
        }
    }
}
