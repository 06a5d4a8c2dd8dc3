//! The job lifecycle (spec §3): states, refund policy, retry policy, and the pure decisions a
//! store applies inside its guarded transactions.

use crate::backoff::BackoffPolicy;
use crate::ids::FailCode;
use crate::limits::{ATTEMPTS_MAX_DEFAULT, CONFIRM_WINDOW_SECONDS_DEFAULT, LEASE_SECONDS_DEFAULT};
use std::collections::BTreeMap;

crate::names! {
    /// A job's state (spec §3).
    pub JobState {
        Queued = "queued",
        Running = "running",
        Unknown = "unknown",
        Cancelling = "cancelling",
        Succeeded = "succeeded",
        Dead = "dead",
        Cancelled = "cancelled",
        /// A withdrawal paid out and then sent back by the receiving side; its amount was credited again.
        Returned = "returned",
    }
}

impl JobState {
    /// `dead` is terminal for the queue, though a person may requeue it and a late success
    /// still recovers it.
    pub const fn is_terminal(self) -> bool {
        matches!(self, JobState::Succeeded | JobState::Dead | JobState::Cancelled | JobState::Returned)
    }

    /// States from which a success is accepted (any attempt: the work exists).
    pub const SUCCEED_FROM: [JobState; 4] = [JobState::Running, JobState::Queued, JobState::Unknown, JobState::Dead];
}

/// The job kind of withdrawals (spec §4). Reserved: only `POST /v1/withdrawals` creates it and only
/// the built-in payout processor and reconciler move it (docs/decisions/0010).
pub const WITHDRAWAL_KIND: &str = "withdrawal";

/// The job kind of top-ups (spec §4a). Reserved: only `POST /v1/top-ups` and the auto rule create
/// it and only the built-in funding processor and reconciler move it.
pub const TOP_UP_KIND: &str = "top_up";

crate::names! {
    /// Which machinery moves the jobs of a kind (docs/design/money-controls.md §11.1). Work is what
    /// workers claim and report; each other rail is one reserved kind that only its built-in
    /// processor moves, against the external system that is its only source of truth. Every place
    /// that treats a reserved kind apart asks the rail, never the kind's name.
    pub Rail {
        /// Jobs of the platform's own kinds: claimed and reported by workers.
        Work = "work",
        /// Withdrawals: sent by the payout processor (`provider-v1`).
        Payout = "payout",
        /// Top-ups: charged by the funding processor (`funding-v1`).
        Funding = "funding",
    }
}

impl Rail {
    /// The rail a job kind travels on.
    pub fn of(kind: &str) -> Rail {
        match kind {
            WITHDRAWAL_KIND => Rail::Payout,
            TOP_UP_KIND => Rail::Funding,
            _ => Rail::Work,
        }
    }

    /// The one kind a processor's rail carries; `None` for work.
    pub const fn kind(self) -> Option<&'static str> {
        match self {
            Rail::Work => None,
            Rail::Payout => Some(WITHDRAWAL_KIND),
            Rail::Funding => Some(TOP_UP_KIND),
        }
    }

    /// Whether only a built-in processor moves the rail's jobs.
    pub const fn is_reserved(self) -> bool {
        !matches!(self, Rail::Work)
    }

    /// The table of the rail's own rows (the idempotency key, the marker of an attempt that started
    /// its external call); `None` for work.
    pub const fn table(self) -> Option<&'static str> {
        match self {
            Rail::Work => None,
            Rail::Payout => Some("withdrawals"),
            Rail::Funding => Some("top_ups"),
        }
    }
}

/// A SQL predicate: `expr` (a kind) is none of the reserved kinds — what a worker's claim, lines,
/// caps and wake-ups ask. Written as one `<>` per kind, never `NOT IN`: the partial indexes say
/// `kind <> 'withdrawal'`, and SQLite uses a partial index only when the query repeats its terms.
pub fn not_reserved(expr: &str) -> String {
    let terms: Vec<String> = Rail::ALL.iter().filter_map(|r| r.kind()).map(|k| format!("{expr} <> '{k}'")).collect();
    terms.join(" AND ")
}

/// Where an expired lease takes a running job: `unknown` when only the external system can tell
/// what happened. A processor's job whose attempt had started its external call (`sending`: the
/// marker is committed before the request leaves) may have paid out or charged; any other
/// `final_failure` job's worker may have acted once a cancel was requested. Otherwise the failure
/// path (retry) is safe.
pub fn lease_expiry_is_unknown(kind: &str, sending: bool, refund_on: RefundPolicy, cancel_requested: bool) -> bool {
    if Rail::of(kind).is_reserved() {
        return sending;
    }
    cancel_requested && refund_on == RefundPolicy::FinalFailure
}

crate::names! {
    /// When a failed job's charges are refunded.
    pub RefundPolicy {
        /// Refund at the first failure; reclaim if a retry or a late signal succeeds.
        Failure = "failure",
        /// Hold the charge while retries continue; refund only when the job is dead-lettered.
        FinalFailure = "final_failure",
    }
}

/// Which failures retry, how long to wait, how often, how long a lease and an unknown last, and
/// when refunds happen — for one job kind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetryPolicy {
    pub backoff: BackoffPolicy,
    pub attempts_max: u32,
    pub retryable_codes: Vec<FailCode>,
    pub confirm_window_seconds: u64,
    /// Lease of a claim that does not ask for one.
    pub lease_seconds: u32,
    /// Refund policy of a job created without one.
    pub refund_on: RefundPolicy,
    /// The most jobs of the kind that may run at once (`None`: no cap; docs/design/fair-claims.md
    /// §9). Set per kind only, never for withdrawals.
    pub max_running: Option<i64>,
}

/// The policy of every job kind: a default and per-kind overrides.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Policies {
    pub default: RetryPolicy,
    pub kinds: BTreeMap<String, RetryPolicy>,
}

impl Policies {
    pub fn for_kind(&self, kind: &str) -> &RetryPolicy {
        self.kinds.get(kind).unwrap_or(&self.default)
    }
}

impl From<RetryPolicy> for Policies {
    fn from(default: RetryPolicy) -> Policies {
        Policies { default, kinds: BTreeMap::new() }
    }
}

impl Default for RetryPolicy {
    fn default() -> RetryPolicy {
        let codes =
            ["NODE_DOWN", "TIMEOUT", "RATE_LIMITED", "LEASE_EXPIRED", "TIMEOUT_CONFIRMED_NOT_SENT", "UNAVAILABLE"];
        RetryPolicy {
            backoff: BackoffPolicy::default(),
            attempts_max: ATTEMPTS_MAX_DEFAULT,
            retryable_codes: codes.iter().map(|c| FailCode::parse(c).expect("default codes are valid")).collect(),
            confirm_window_seconds: CONFIRM_WINDOW_SECONDS_DEFAULT,
            lease_seconds: LEASE_SECONDS_DEFAULT,
            refund_on: RefundPolicy::Failure,
            max_running: None,
        }
    }
}

impl RetryPolicy {
    /// A signal's own `retryable` wins over the configured list.
    pub fn is_retryable(&self, code: &FailCode, signal_says: Option<bool>) -> bool {
        signal_says.unwrap_or_else(|| self.retryable_codes.contains(code))
    }
}

/// Where a failure takes a running job.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailOutcome {
    /// Back to `queued` with a later `not_before`.
    Retry,
    /// Out of attempts or not retryable: dead letters, for people.
    Dead,
    /// A cancel was requested: tear down, never retry, never dead.
    Teardown,
}

/// The failure decision. `attempts_used` counts attempts since the last requeue by a person.
pub fn fail_outcome(cancel_requested: bool, retryable: bool, attempts_used: u32, attempts_max: u32) -> FailOutcome {
    if cancel_requested {
        FailOutcome::Teardown
    } else if retryable && attempts_used < attempts_max {
        FailOutcome::Retry
    } else {
        FailOutcome::Dead
    }
}

/// Whether the items still `charged` are refunded on this failure outcome.
pub const fn refunds_on(policy: RefundPolicy, outcome: FailOutcome) -> bool {
    match outcome {
        FailOutcome::Retry => matches!(policy, RefundPolicy::Failure),
        FailOutcome::Dead | FailOutcome::Teardown => true,
    }
}

/// What a cancel request does in each state (spec §3 table).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CancelAction {
    /// queued, dead: synchronous teardown.
    Teardown,
    /// cancelling: finish the teardown that is under way.
    ResumeTeardown,
    /// running: set `cancel_requested`, answer 202; the worker stops at the next item boundary.
    RequestFlag,
    /// succeeded: `409 job_finished`.
    Finished,
    /// unknown: `409 outcome_unknown` — reconcile first.
    OutcomeUnknown,
    /// cancelled: idempotent 200.
    AlreadyCancelled,
}

pub const fn cancel_action(state: JobState) -> CancelAction {
    match state {
        JobState::Queued | JobState::Dead => CancelAction::Teardown,
        JobState::Cancelling => CancelAction::ResumeTeardown,
        JobState::Running => CancelAction::RequestFlag,
        JobState::Succeeded | JobState::Returned => CancelAction::Finished,
        JobState::Unknown => CancelAction::OutcomeUnknown,
        JobState::Cancelled => CancelAction::AlreadyCancelled,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cancel_wins_over_retry_and_dead() {
        assert_eq!(fail_outcome(true, true, 1, 5), FailOutcome::Teardown);
        assert_eq!(fail_outcome(true, false, 5, 5), FailOutcome::Teardown);
        assert_eq!(fail_outcome(false, true, 4, 5), FailOutcome::Retry);
        assert_eq!(fail_outcome(false, true, 5, 5), FailOutcome::Dead);
        assert_eq!(fail_outcome(false, false, 1, 5), FailOutcome::Dead);
    }

    #[test]
    fn an_expired_payout_lease_is_unknown_never_a_retry() {
        assert!(lease_expiry_is_unknown(WITHDRAWAL_KIND, true, RefundPolicy::FinalFailure, false));
        assert!(lease_expiry_is_unknown(WITHDRAWAL_KIND, true, RefundPolicy::FinalFailure, true));
        // No send was started by the attempt: nothing can have left, a retry asks first anyway.
        assert!(!lease_expiry_is_unknown(WITHDRAWAL_KIND, false, RefundPolicy::FinalFailure, true));
        assert!(lease_expiry_is_unknown("render", false, RefundPolicy::FinalFailure, true));
        assert!(!lease_expiry_is_unknown("render", false, RefundPolicy::FinalFailure, false));
        assert!(!lease_expiry_is_unknown("render", false, RefundPolicy::Failure, true));
        assert_eq!(cancel_action(JobState::Returned), CancelAction::Finished);
    }

    #[test]
    fn each_reserved_kind_has_its_rail_and_the_sql_list_names_them_all() {
        assert_eq!(Rail::of(WITHDRAWAL_KIND), Rail::Payout);
        assert_eq!(Rail::of(TOP_UP_KIND), Rail::Funding);
        assert_eq!(Rail::of("render"), Rail::Work);
        assert!(lease_expiry_is_unknown(TOP_UP_KIND, true, RefundPolicy::FinalFailure, false));
        assert!(!lease_expiry_is_unknown(TOP_UP_KIND, false, RefundPolicy::FinalFailure, true));
        assert_eq!(not_reserved("kind"), "kind <> 'withdrawal' AND kind <> 'top_up'");
        assert!(
            Rail::ALL
                .iter()
                .all(|r| r.is_reserved() == r.kind().is_some() && r.kind().is_some() == r.table().is_some())
        );
    }

    #[test]
    fn final_failure_holds_the_charge_while_retrying() {
        assert!(!refunds_on(RefundPolicy::FinalFailure, FailOutcome::Retry));
        assert!(refunds_on(RefundPolicy::FinalFailure, FailOutcome::Dead));
        assert!(refunds_on(RefundPolicy::Failure, FailOutcome::Retry));
    }

    #[test]
    fn the_signal_decides_retryability_before_the_list() {
        let p = RetryPolicy::default();
        let node_down = FailCode::parse("NODE_DOWN").unwrap();
        let invalid = FailCode::parse("INVALID_ADDRESS").unwrap();
        assert!(p.is_retryable(&node_down, None));
        assert!(!p.is_retryable(&invalid, None));
        assert!(p.is_retryable(&invalid, Some(true)));
        assert!(!p.is_retryable(&node_down, Some(false)));
    }

    #[test]
    fn job_names_and_finality() {
        let names: Vec<&str> = JobState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(names, ["queued", "running", "unknown", "cancelling", "succeeded", "dead", "cancelled", "returned"]);
        for s in JobState::ALL {
            assert_eq!(JobState::parse(s.as_str()), Some(s));
            // `dead` is terminal for the queue (a person may requeue it).
            let terminal = matches!(s, JobState::Succeeded | JobState::Dead | JobState::Cancelled | JobState::Returned);
            assert_eq!(s.is_terminal(), terminal, "{s:?}");
        }
        assert_eq!(JobState::parse("done"), None);
        for (p, name) in [(RefundPolicy::Failure, "failure"), (RefundPolicy::FinalFailure, "final_failure")] {
            assert_eq!((p.as_str(), RefundPolicy::parse(name)), (name, Some(p)));
        }
        assert_eq!(RefundPolicy::parse("never"), None);
    }

    #[test]
    fn a_kind_has_its_own_policy_or_the_default() {
        let default = RetryPolicy { attempts_max: 3, ..RetryPolicy::default() };
        let mut policies = Policies::from(default.clone());
        assert_eq!(policies.default, default);
        assert!(policies.kinds.is_empty());
        let payout = RetryPolicy { attempts_max: 9, ..RetryPolicy::default() };
        policies.kinds.insert("payout".into(), payout.clone());
        assert_eq!(policies.for_kind("payout"), &payout);
        assert_eq!(policies.for_kind("render"), &default);
    }
}
