//! Success, accepted from any attempt (spec §3): what a failure refunded is reclaimed, and the
//! attempt it overtakes is closed as superseded.

use super::{
    After, Caller, Cx, Heard, JobRow, begin_teardown, check_caller, close_attempt, emit, guard_hit, holds_lease,
    log_signal, move_items, must_lock_job, must_read_job, resume_if_cancelling, sum,
};
use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::*;
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind, Signal, SignalEffect};
use settle_core::ids::JobId;
use settle_core::item::{ItemSignal, ItemState};
use settle_core::job::{JobState, RefundPolicy};
use settle_core::limits;

/// Success from any attempt (spec §3). A pending cancel wins over it unless the job's refund policy
/// is `final_failure` (an external effect such as a payout cannot be taken back: docs/decisions/0004).
pub(crate) async fn apply_success(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    token: Option<&LeaseToken>,
    result: Option<&str>,
) -> Result<(bool, After), StoreError> {
    let from_ok = JobState::SUCCEED_FROM.contains(&job.state);
    let cancel_wins = job.cancel_requested && job.refund_on != RefundPolicy::FinalFailure;
    if from_ok && cancel_wins && matches!(job.state, JobState::Running | JobState::Unknown) {
        begin_teardown(db, cx, job, Some(AttemptResult::Cancelled)).await?;
        return Ok((true, After::Teardown));
    }
    if !from_ok || cancel_wins {
        log_signal(
            db,
            cx,
            job,
            token.map(|t| t.0.as_str()),
            Heard { signal: Signal::Succeed, code: None, message: None },
            SignalEffect::Noop,
        )
        .await?;
        return Ok((false, resume_if_cancelling(job)));
    }
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'succeeded', lease_token = NULL, lease_expires_at = NULL, lease_worker = NULL, \
             unknown_since = NULL, result = $4, updated_at = $3 WHERE id = $1 AND state = $2",
            args![&job.id, job.state.as_str(), cx.now.micros(), result],
        )
        .await?;
    guard_hit(rows, "success")?;
    let current = token.is_some_and(|t| holds_lease(job, t));
    if job.state == JobState::Running {
        close_attempt(
            db,
            cx,
            job,
            if current { AttemptResult::Succeeded } else { AttemptResult::Superseded },
            None,
            None,
        )
        .await?;
    }
    if !current {
        log_signal(
            db,
            cx,
            job,
            token.map(|t| t.0.as_str()),
            Heard { signal: Signal::Succeed, code: None, message: None },
            SignalEffect::Recovered,
        )
        .await?;
    }
    cx.point(CrashPoint::AfterGuard)?;
    move_items(db, cx, job, ItemState::Charged, ItemSignal::Succeed, None, None).await?;
    let reclaimed = move_items(db, cx, job, ItemState::Refunded, ItemSignal::Succeed, None, None).await?;
    cx.point(CrashPoint::AfterLedger)?;
    if !reclaimed.is_empty() {
        emit(
            db,
            cx,
            EventKind::JobReclaimed,
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "amount": sum(&reclaimed)?.get(), "items": reclaimed.iter().map(|m| m.0.as_str()).collect::<Vec<_>>() }),
        )
        .await?;
    }
    emit(
        db,
        cx,
        EventKind::JobSucceeded,
        Some(&job.id),
        &job.account_id,
        serde_json::json!({ "from": job.state.as_str(), "attempt": job.attempt }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    Ok((true, After::Nothing))
}

pub(crate) async fn succeed(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: Option<&LeaseToken>,
    result: Option<&str>,
) -> Result<(Outcome<Job>, After), StoreError> {
    if result.is_some_and(|r| r.len() > limits::PAYLOAD_BYTES_MAX) {
        return Err(StoreError::invalid(format!("result is larger than {} bytes", limits::PAYLOAD_BYTES_MAX)));
    }
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, Caller::Worker)?;
    let (applied, after) = apply_success(db, cx, &job, token, result).await?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: job, applied }, after))
}
