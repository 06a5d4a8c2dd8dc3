//! Outcomes nobody knows yet (a payout whose answer was lost) and their reconciliation against the
//! provider's answer.

use super::{
    After, Caller, Cx, Failure, Heard, Reported, apply_failure, apply_success, attach, check_caller, close_attempt,
    emit, guard_hit, holds_lease, must_lock_job, must_read_job, replay_or_refuse,
};
use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::*;
use settle_core::Timestamp;
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind, Signal};
use settle_core::ids::{FailCode, JobId};
use settle_core::job::{self, JobState};

pub(crate) async fn mark_unknown(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: &LeaseToken,
    message: Option<&str>,
    caller: Caller,
) -> Result<(Outcome<Job>, Option<Box<LeaseLost>>), StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, caller)?;
    if !holds_lease(cx, &job, token) {
        // A replay when this token's attempt was closed by its own `unknown` (decision 0019).
        let heard = Heard { signal: Signal::Unknown, code: None, message };
        let (_, refused) = replay_or_refuse(db, cx, &job, &token.0, heard, Reported::UNKNOWN.signal).await?;
        let job = attach(db, cx, job).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: job, applied: false }, refused));
    }
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'unknown', unknown_since = $3, lease_token = NULL, lease_expires_at = NULL, \
             lease_worker = NULL, updated_at = $3 WHERE id = $1 AND state = 'running' AND lease_token = $2",
            args![&job.id, &token.0, cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "unknown")?;
    close_attempt(db, cx, &job, AttemptResult::Unknown, None, message, Some(Reported::UNKNOWN)).await?;
    cx.point(CrashPoint::AfterGuard)?;
    emit(
        db,
        cx,
        EventKind::JobUnknown,
        Some(&job.id),
        &job.account_id,
        serde_json::json!({ "attempt": job.attempt, "message": message }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: job, applied: true }, None))
}

pub(crate) async fn reconcile(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    finding: Finding,
) -> Result<(Outcome<Job>, After), StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    let (applied, after) = if job.state != JobState::Unknown {
        (false, After::Nothing)
    } else {
        match finding {
            // A withdrawal's success needs its txid (`ops::payouts::payout_succeeded`), a top-up's
            // its charge id and its grant.
            Finding::Present if job::Rail::of(&job.kind).is_reserved() => {
                return Err(StoreError::invalid(
                    "a withdrawal or top-up found at the provider is recorded by its processor, with the provider's id",
                ));
            }
            Finding::Present => apply_success(db, cx, &job, Reporter::Reconciler, None, &Costs::default()).await?,
            Finding::Absent => {
                let since = job.unknown_since.unwrap_or(job.updated_at);
                let window_over = Timestamp::from_micros(since)
                    .plus_seconds(cx.policy.for_kind(&job.kind).confirm_window_seconds)
                    <= cx.now;
                if window_over {
                    let code = match job::Rail::of(&job.kind) {
                        job::Rail::Funding => FailCode::timeout_confirmed_not_charged(),
                        _ => FailCode::timeout_confirmed_not_sent(),
                    };
                    let after = apply_failure(
                        db,
                        cx,
                        &job,
                        Failure {
                            code: &code,
                            message: Some("absent at the external system after the confirm window"),
                            retryable: true,
                            retry_after_ms: None,
                            attempt_result: AttemptResult::Failed,
                            // A payout's hold goes back only on a definitive "not sent": its
                            // retries never run out. A top-up's may: closing it gives back only a
                            // reservation, and a charge that lands later is still granted (the
                            // re-check), so a provider that never answers ends it.
                            budget_exempt: job::Rail::of(&job.kind) == job::Rail::Payout,
                            defer_cancel: false,
                            reported: None,
                        },
                    )
                    .await?;
                    (true, after)
                } else {
                    (false, After::Nothing)
                }
            }
        }
    };
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: job, applied }, after))
}
