//! The run's tape: the seeded random stream every choice is drawn from, the trace hash every step
//! and answer feeds, and the rules an answer broke (reported by the auditor after the step).

use crate::fakes::{FNV_START, fnv};
use settle_core::backoff::SplitMix64;
use settle_store::StoreError;
use std::sync::{Arc, Mutex};

pub struct Tape {
    pub rng: SplitMix64,
    /// FNV-1a over every trace line.
    pub hash: u64,
    /// Rules broken while a step ran (answers the step got), reported by `World::check`.
    pub broken: Vec<String>,
    /// `SETTLE_SIM_TRACE=1`: every trace line on stderr, to read a failing run.
    print: bool,
    /// The step running, and where the newest trace line goes for a watcher (`run_watched`).
    pub step: u32,
    pub last: Option<Arc<Mutex<String>>>,
}

impl Tape {
    pub fn new(rng: SplitMix64) -> Tape {
        Tape {
            rng,
            hash: FNV_START,
            broken: Vec::new(),
            print: std::env::var_os("SETTLE_SIM_TRACE").is_some(),
            step: 0,
            last: None,
        }
    }

    /// Feeds the trace hash.
    pub fn trace(&mut self, line: &str) {
        self.hash = fnv(fnv(self.hash, line.as_bytes()), b"\n");
        if self.print {
            eprintln!("{line}");
        }
        if let Some(last) = &self.last {
            *last.lock().unwrap_or_else(|p| p.into_inner()) = format!("step {}: {line}", self.step);
        }
    }

    pub fn pick(&mut self, n: usize) -> usize {
        self.rng.below_inclusive(n.saturating_sub(1) as u64) as usize
    }

    pub fn chance(&mut self, percent: u64) -> bool {
        self.rng.below_inclusive(99) < percent
    }

    /// Records an answer in the trace; an internal error breaks the rules (Settle never answers
    /// one on purpose), and so does an overflow here (amounts stay far below the limits).
    pub fn answer<T: std::fmt::Debug>(&mut self, what: &str, result: Result<T, &StoreError>) {
        let line = match &result {
            Ok(v) => format!("{what}: {v:?}"),
            Err(e) => format!("{what}: {}", error_name(e)),
        };
        self.trace(&line);
        if let Err(e @ (StoreError::Internal(_) | StoreError::Overflow)) = result {
            self.broken.push(format!("{what}: {e}"));
        }
    }
}

/// An error's kind for the trace (its text may hold paths and tokens).
pub fn error_name(e: &StoreError) -> &'static str {
    match e {
        StoreError::Invalid(_) => "invalid",
        StoreError::NotFound { .. } => "not_found",
        StoreError::CursorAhead { .. } => "cursor_ahead",
        StoreError::InsufficientCredits { .. } => "insufficient_credits",
        StoreError::InsufficientBalance { .. } => "insufficient_balance",
        StoreError::InsufficientCash { .. } => "insufficient_cash",
        StoreError::SpendLimitExceeded { .. } => "spend_limit_exceeded",
        StoreError::IdempotencyConflict { .. } => "idempotency_conflict",
        StoreError::ReportConflict(_) => "report_conflict",
        StoreError::CostRequired { .. } => "cost_required",
        StoreError::CostExceedsHold { .. } => "cost_exceeds_hold",
        StoreError::IdTaken { .. } => "id_taken",
        StoreError::JobFinished(_) => "job_finished",
        StoreError::OutcomeUnknown(_) => "outcome_unknown",
        StoreError::LeaseLost(_) => "lease_lost",
        StoreError::InvalidTransition { .. } => "invalid_transition",
        StoreError::Overflow => "overflow",
        StoreError::CleanupFailed { .. } => "cleanup_failed",
        StoreError::InjectedCrash(_) => "crash",
        StoreError::Unavailable(_) => "unavailable",
        StoreError::Busy(_) => "busy",
        StoreError::Retryable(_) => "retryable",
        StoreError::NotSettle(_) => "not_settle",
        StoreError::Internal(_) => "internal",
    }
}
