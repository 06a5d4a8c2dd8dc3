//! The failure path: a failure signal from the lease holder or a lapsed lease refunds per the job's
//! policy, then schedules a retry with backoff or ends the job `dead`.

use super::plan;
use super::{
    After, Caller, Cx, Heard, JobRow, Move, Reported, attach, begin_teardown, check_caller, close_attempt, emit,
    guard_hit, holds_lease, lock_job, log_signal, move_items, must_lock_job, must_read_job, refusal,
    resume_if_cancelling, sum, token_attempt,
};
use crate::db::{Db, Engine, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind, Signal, SignalEffect};
use settle_core::ids::{FailCode, JobId};
use settle_core::item::{ItemSignal, ItemState, RefundReason};
use settle_core::job::{self, FailOutcome, JobState};
use settle_core::limits;
use std::sync::LazyLock;

/// A failure as the failure path needs it.
pub(crate) struct Failure<'a> {
    pub(crate) code: &'a FailCode,
    pub(crate) message: Option<&'a str>,
    pub(crate) retryable: bool,
    /// Overrides the backoff formula (a 429 with Retry-After).
    pub(crate) retry_after_ms: Option<u64>,
    /// How the attempt row is closed: `failed`, `lease_expired`, `cancelled`.
    pub(crate) attempt_result: AttemptResult,
    /// Retry whatever the attempts used: a withdrawal confirmed absent after its window is never
    /// dead-lettered (and refunded) on that conclusion alone; the next attempt asks first.
    pub(crate) budget_exempt: bool,
    /// Keep a requested cancel for later: a withdrawal is torn down (refunded) only after the
    /// provider said its key is absent, and this failure is not such an answer.
    pub(crate) defer_cancel: bool,
    /// The worker's report that closes the attempt, if one does (not the rescuer, not reconcile).
    pub(crate) reported: Option<Reported<'a>>,
}

/// Where a failure takes the job: the outcome, the state and `not_before` it is written with, and
/// how far the budget's base moves up (an exempt failure does not count against the budget, now or
/// later). A retry's backoff draws from the store's random stream here, once.
pub(crate) struct Aftermath {
    pub outcome: FailOutcome,
    pub state: JobState,
    pub not_before: i64,
    pub base_step: i64,
}

pub(crate) fn aftermath(cx: &Cx, job: &JobRow, failure: &Failure<'_>) -> Aftermath {
    let outcome = fail_outcome(job, failure);
    let (state, not_before) = match outcome {
        FailOutcome::Retry => {
            let delay = match failure.retry_after_ms {
                Some(ms) => ms.min(cx.policy.for_kind(&job.kind).backoff.backoff_ms_max),
                None => {
                    let mut rng = cx.rng.lock().expect("rng lock");
                    let backoff = &cx.policy.for_kind(&job.kind).backoff;
                    // The attempts that count (releases and requeues do not grow the backoff).
                    let counted = job.attempt - job.budget_base;
                    backoff.delay_ms(u32::try_from(counted).unwrap_or(u32::MAX), &mut rng)
                }
            };
            (JobState::Queued, cx.now.plus_millis(delay).micros())
        }
        _ => (JobState::Dead, job.not_before),
    };
    Aftermath { outcome, state, not_before, base_step: i64::from(failure.budget_exempt) }
}

/// The outcome alone (no random draw): teardown, retry or dead.
pub(crate) fn fail_outcome(job: &JobRow, failure: &Failure<'_>) -> FailOutcome {
    let used = if failure.budget_exempt { 0 } else { u32::try_from(job.attempt - job.budget_base).unwrap_or(u32::MAX) };
    let max = u32::try_from(job.max_attempts).unwrap_or(u32::MAX);
    job::fail_outcome(job.cancel_requested && !failure.defer_cancel, failure.retryable, used, max)
}

/// The failure path shared by a worker's fail, the lease rescuer and reconcile-absent.
pub(crate) async fn apply_failure(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    failure: Failure<'_>,
) -> Result<After, StoreError> {
    let Failure { code, message, attempt_result, reported, .. } = failure;
    let Aftermath { outcome, state, not_before, base_step } = aftermath(cx, job, &failure);
    if outcome == FailOutcome::Teardown {
        begin_teardown(
            db,
            cx,
            job,
            Some(if attempt_result == AttemptResult::LeaseExpired {
                AttemptResult::LeaseExpired
            } else {
                AttemptResult::Cancelled
            }),
            reported,
        )
        .await?;
        return Ok(After::Teardown);
    }
    let rows = db
        .exec(
            "UPDATE jobs SET state = $3, not_before = $4, lease_token = NULL, lease_expires_at = NULL, lease_worker = NULL, \
             last_error_code = $5, last_error_message = $6, unknown_since = NULL, updated_at = $7, \
             budget_base = budget_base + $8 WHERE id = $1 AND state = $2",
            args![&job.id, job.state.as_str(), state.as_str(), not_before, code.as_str(), message, cx.now.micros(), base_step],
        )
        .await?;
    guard_hit(rows, "failure")?;
    close_attempt(db, cx, job, attempt_result, Some(code.as_str()), message, reported).await?;
    cx.point(CrashPoint::AfterGuard)?;
    let moved = if job::refunds_on(job.refund_on, outcome) {
        let refund = Move::all(ItemState::Charged, ItemSignal::Fail).because(Some(RefundReason::JobFailed));
        move_items(db, cx, job, refund).await?
    } else {
        Vec::new()
    };
    cx.point(CrashPoint::AfterLedger)?;
    if !moved.is_empty() {
        emit(
            db,
            cx,
            EventKind::JobRefunded,
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "reason": "job_failed", "code": code.as_str(), "amount": sum(&moved)?.get(), "items": moved.iter().map(|m| m.id.as_str()).collect::<Vec<_>>() }),
        )
        .await?;
    }
    // Times in events are RFC 3339, as everywhere in the API.
    let not_before = settle_core::Timestamp::from_micros(not_before).rfc3339();
    let data = serde_json::json!({ "code": code.as_str(), "message": message, "attempt": job.attempt, "not_before": not_before });
    let event = if state == JobState::Queued { EventKind::JobRetryScheduled } else { EventKind::JobDead };
    emit(db, cx, event, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    Ok(After::Nothing)
}

/// A failure report. With the current lease it takes the failure path; otherwise it is a replay
/// when the token's attempt was closed by a `fail` with the same code (its answer was lost), a
/// conflict when with another code, and refused (`LeaseLost`) else — logged, except for a token no
/// attempt held, which writes nothing (decision 0019). A cancelling job's teardown is resumed
/// either way.
pub(crate) async fn fail(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    signal: &FailSignal,
    caller: Caller,
) -> Result<(Outcome<Job>, After, Option<Box<LeaseLost>>), StoreError> {
    if let Some(m) = &signal.message
        && m.len() > limits::MESSAGE_LEN_MAX
    {
        return Err(StoreError::invalid(format!("message is longer than {} bytes", limits::MESSAGE_LEN_MAX)));
    }
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, caller)?;
    if !holds_lease(cx, &job, &signal.lease_token) {
        let token = signal.lease_token.0.as_str();
        let heard =
            Heard { signal: Signal::Fail, code: Some(signal.code.as_str()), message: signal.message.as_deref() };
        let attempt = token_attempt(db, &job, token).await?;
        // A token no attempt held writes nothing, not even the teardown's continuation.
        let after = if attempt.is_some() { resume_if_cancelling(&job) } else { After::Nothing };
        let refused = match attempt {
            None => Some(refusal(&job, None)),
            Some(att) if att.reported("fail") => {
                if att.sent_code.as_deref() != Some(signal.code.as_str()) {
                    return Err(StoreError::ReportConflict(format!(
                        "attempt {} of job {} already reported its failure with code {}; a re-sent report carries the code it first sent",
                        att.end.attempt_no,
                        job.id,
                        att.sent_code.as_deref().unwrap_or("?")
                    )));
                }
                log_signal(db, cx, &job, Some(token), heard, SignalEffect::Noop).await?;
                None
            }
            Some(att) => {
                log_signal(db, cx, &job, Some(token), heard, SignalEffect::Stale).await?;
                Some(refusal(&job, Some(att)))
            }
        };
        let job = attach(db, cx, job).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: job, applied: false }, after, refused));
    }
    // A payout attempt that could not ask the provider learned nothing: retry, keep any cancel
    // request for an attempt that can ask, never dead-letter (and refund) on it.
    let inconclusive = caller == Caller::PayoutProcessor && signal.code == FailCode::lookup_failed();
    let retryable = inconclusive || cx.policy.for_kind(&job.kind).is_retryable(&signal.code, signal.retryable);
    let failure = Failure {
        code: &signal.code,
        message: signal.message.as_deref(),
        retryable,
        retry_after_ms: signal.retry_after_ms,
        attempt_result: AttemptResult::Failed,
        budget_exempt: inconclusive,
        defer_cancel: inconclusive,
        reported: Some(Reported { signal: "fail", sent_code: Some(signal.code.as_str()) }),
    };
    // PostgreSQL: the common shape in three statements (docs/design/batch-plan.md §10).
    if db.engine() == Engine::Postgres
        && let Some(job) = plan::holder_fails(db, cx, &job, &failure).await?
    {
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: job, applied: true }, After::Nothing, None));
    }
    let after = apply_failure(db, cx, &job, failure).await?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: job, applied: true }, after, None))
}

columns! {
    /// The attempt a withdrawal was marked as sending in, if any.
    SendingCol { sending_attempt }
}

/// The lease rescuer's transition for one job it saw running with `seen_token` past its lease.
pub(crate) async fn expire_lease(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &str,
    seen_token: &str,
) -> Result<(bool, After), StoreError> {
    let Some(job) = lock_job(db, id).await? else { return Ok((false, After::Nothing)) };
    let expired = job.lease_expires_at.is_some_and(|t| t <= cx.now.micros());
    if job.state != JobState::Running || job.lease_token.as_deref() != Some(seen_token) || !expired {
        return Ok((false, After::Nothing));
    }
    let sending = if job.kind == job::WITHDRAWAL_KIND {
        static SQL: LazyLock<String> =
            LazyLock::new(|| format!("SELECT {} FROM withdrawals WHERE job_id = $1", SendingCol::LIST));
        let marker = db.one(&SQL, args![&job.id]).await?;
        marker.opt_i64(SendingCol::sending_attempt)? == Some(job.attempt)
    } else {
        false
    };
    if job::lease_expiry_is_unknown(&job.kind, sending, job.refund_on, job.cancel_requested) {
        // The worker of an external effect vanished: a payout processor mid-attempt (it may have
        // sent), or a `final_failure` worker after a cancel request. Retrying could send twice and
        // tearing down would refund money that may have left, so the outcome is unknown until
        // reconciled (docs/decisions/0004, 0010).
        let rows = db
            .exec(
                "UPDATE jobs SET state = 'unknown', unknown_since = $3, lease_token = NULL, lease_expires_at = NULL, \
                 lease_worker = NULL, updated_at = $3 WHERE id = $1 AND state = 'running' AND lease_token = $2",
                args![&job.id, seen_token, cx.now.micros()],
            )
            .await?;
        guard_hit(rows, "lease expiry to unknown")?;
        close_attempt(
            db,
            cx,
            &job,
            AttemptResult::LeaseExpired,
            Some(FailCode::lease_expired().as_str()),
            Some("lease expired"),
            None,
        )
        .await?;
        cx.point(CrashPoint::AfterGuard)?;
        emit(
            db,
            cx,
            EventKind::JobUnknown,
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "attempt": job.attempt, "message": "lease expired; the outcome is unknown until reconciled" }),
        )
        .await?;
        cx.point(CrashPoint::AfterOutbox)?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((true, After::Nothing));
    }
    // A withdrawal whose attempt never started its send sent nothing: retry it, and let the next
    // attempt ask the provider before any refund.
    let payout = job.kind == job::WITHDRAWAL_KIND;
    let after = apply_failure(
        db,
        cx,
        &job,
        Failure {
            code: &FailCode::lease_expired(),
            message: Some("lease expired"),
            retryable: true,
            retry_after_ms: None,
            attempt_result: AttemptResult::LeaseExpired,
            budget_exempt: payout,
            defer_cancel: payout,
            reported: None,
        },
    )
    .await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((true, after))
}
