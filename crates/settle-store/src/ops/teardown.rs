//! Cancel and requeue, and the teardown of a cancelling job: refunds first, artifacts deleted
//! after the commit, the terminal state written last (seed 003).

use super::{
    Cx, JobRow, Move, Reported, attach, close_attempt, emit, guard_hit, move_items, must_lock_job, must_read_job, sum,
};
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::Timestamp;
use settle_core::backoff::{BackoffPolicy, Jitter};
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind};
use settle_core::ids::{FailCode, JobId};
use settle_core::item::{ItemSignal, ItemState, RefundReason};
use settle_core::job::{self, JobState};
use std::sync::LazyLock;

/// What a transition left to do after its commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    Nothing,
    /// The job is `cancelling`: clean up artifacts, then finish (teardown steps 2–3).
    Teardown,
}

/// Teardown step 1 inside the caller's transaction: the job (now in `from`) becomes `cancelling`,
/// every item still `charged` becomes `cancelled` with its refund.
pub(super) async fn begin_teardown(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    attempt_result: Option<AttemptResult>,
    reported: Option<Reported<'_>>,
) -> Result<(), StoreError> {
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'cancelling', cancel_requested = 1, lease_token = NULL, lease_expires_at = NULL, \
             lease_worker = NULL, updated_at = $3 WHERE id = $1 AND state = $2",
            args![&job.id, job.state.as_str(), cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "teardown")?;
    if let Some(result) = attempt_result {
        let code =
            if result == AttemptResult::LeaseExpired { FailCode::lease_expired() } else { FailCode::cancelled() };
        close_attempt(db, cx, job, result, Some(code.as_str()), None, reported).await?;
    }
    cx.point(CrashPoint::AfterGuard)?;
    let refund = Move::all(ItemState::Charged, ItemSignal::Cancel).because(Some(RefundReason::Cancelled));
    let moved = move_items(db, cx, job, refund).await?;
    cx.point(CrashPoint::AfterLedger)?;
    emit(
        db,
        cx,
        EventKind::JobCancelling,
        Some(&job.id),
        &job.account_id,
        serde_json::json!({ "from": job.state.as_str() }),
    )
    .await?;
    if !moved.is_empty() {
        emit(
            db,
            cx,
            EventKind::JobRefunded,
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "reason": "cancelled", "amount": sum(&moved)?.get(), "items": moved.iter().map(|m| m.id.as_str()).collect::<Vec<_>>() }),
        )
        .await?;
    }
    cx.point(CrashPoint::AfterOutbox)?;
    Ok(())
}

/// Teardown step 3: `cancelling → cancelled`, last, with the final totals.
pub(crate) async fn finish_teardown(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Job, StoreError> {
    let job = must_lock_job(db, id).await?;
    if job.state == JobState::Cancelling {
        let rows = db
            .exec(
                "UPDATE jobs SET state = 'cancelled', updated_at = $2 WHERE id = $1 AND state = 'cancelling'",
                args![id, cx.now.micros()],
            )
            .await?;
        guard_hit(rows, "finish teardown")?;
        cx.point(CrashPoint::AfterGuard)?;
        let done = must_read_job(db, cx, id).await?;
        emit(db, cx, EventKind::JobCancelled, Some(id), &job.account_id, cancelled_totals(&done)).await?;
        super::top_up_close::closed(db, cx, &job, "CANCELLED", false).await?;
        cx.point(CrashPoint::AfterOutbox)?;
    }
    let job = must_read_job(db, cx, id).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(job)
}

/// The final totals a `job.cancelled` event carries.
fn cancelled_totals(done: &Job) -> serde_json::Value {
    let count = |s: ItemState| done.items.iter().filter(|i| i.state == s).count();
    serde_json::json!({
        "net": done.net.get(),
        "items_cancelled": count(ItemState::Cancelled),
        "items_succeeded": count(ItemState::Succeeded) + count(ItemState::Reclaimed),
        "items_refunded": count(ItemState::Refunded),
    })
}

/// A repeated signal for a job whose teardown was interrupted finishes that teardown, so
/// re-sending what was interrupted converges without waiting for the sweeper.
pub(super) fn resume_if_cancelling(job: &JobRow) -> After {
    if job.state == JobState::Cancelling { After::Teardown } else { After::Nothing }
}

/// Cancel, per the spec's table. Returns the job and what is left to do after the commit.
pub(crate) async fn cancel(db: &mut Db<'_>, cx: &Cx, id: &JobId) -> Result<(Job, After), StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    let rail = job::Rail::of(&job.kind);
    let action = match job::cancel_action(job.state) {
        // A dead withdrawal's hold was refunded already (a dead top-up charged nothing); `cancelled`
        // would only hide it from the late-execution check.
        job::CancelAction::Teardown if rail.is_reserved() && job.state == JobState::Dead => job::CancelAction::Finished,
        // A queued withdrawal or top-up that was tried before is cancelled through its processor,
        // which asks the provider first (an earlier send or charge may have gone through after all).
        job::CancelAction::Teardown if rail.is_reserved() && job.attempt > 0 => job::CancelAction::RequestFlag,
        // A running top-up may be charging the customer right now: not cancellable (spec §4a).
        job::CancelAction::RequestFlag if rail == job::Rail::Funding => {
            return Err(StoreError::InvalidTransition {
                job: job.id,
                action: "be cancelled while running (the customer may be being charged)",
                state: job.state.as_str().to_owned(),
            });
        }
        other => other,
    };
    let after = match action {
        job::CancelAction::Teardown => {
            begin_teardown(db, cx, &job, None, None).await?;
            After::Teardown
        }
        job::CancelAction::ResumeTeardown => After::Teardown,
        job::CancelAction::RequestFlag => {
            if !job.cancel_requested {
                let rows = db
                    .exec(
                        "UPDATE jobs SET cancel_requested = 1, updated_at = $2 WHERE id = $1 AND state = $3 AND cancel_requested = 0",
                        args![&job.id, cx.now.micros(), job.state.as_str()],
                    )
                    .await?;
                guard_hit(rows, "cancel request")?;
                cx.point(CrashPoint::AfterGuard)?;
                emit(
                    db,
                    cx,
                    EventKind::JobCancelRequested,
                    Some(&job.id),
                    &job.account_id,
                    serde_json::json!({ "attempt": job.attempt }),
                )
                .await?;
                cx.point(CrashPoint::AfterOutbox)?;
            }
            After::Nothing
        }
        job::CancelAction::Finished => return Err(StoreError::JobFinished(job.id)),
        job::CancelAction::OutcomeUnknown => return Err(StoreError::OutcomeUnknown(job.id)),
        job::CancelAction::AlreadyCancelled => After::Nothing,
    };
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((job, after))
}

pub(crate) async fn requeue(db: &mut Db<'_>, cx: &Cx, id: &JobId) -> Result<Job, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    let refused = match job::Rail::of(&job.kind) {
        job::Rail::Work => None,
        // Dead means the hold was refunded after a definitive "not sent", and an item is refunded
        // once: a re-run is a new withdrawal with a new key (docs/decisions/0010).
        job::Rail::Payout => Some("be requeued (a dead withdrawal's hold was refunded: create a new withdrawal)"),
        // A declined card is not charged again by a requeue: buying again is a new top-up.
        job::Rail::Funding => Some("be requeued (a dead top-up was declined or gave up: create a new top-up)"),
    };
    if let Some(action) = refused {
        return Err(StoreError::InvalidTransition { job: job.id, action, state: job.state.as_str().to_owned() });
    }
    // A requeue re-sent after its answer was lost finds the job requeued and not claimed since:
    // answer it again rather than fail (docs/decisions/0005).
    // (A job whose last attempt was released is queued with the same figures, never requeued.)
    if job.state == JobState::Queued
        && job.attempt > 0
        && job.budget_base == job.attempt
        && !super::last_attempt_released(db, &job).await?
    {
        let job = attach(db, cx, job).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok(job);
    }
    if job.state != JobState::Dead {
        return Err(StoreError::InvalidTransition {
            job: job.id,
            action: "be requeued",
            state: job.state.as_str().to_owned(),
        });
    }
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'queued', turn = NULL, budget_base = attempt, not_before = $2, updated_at = $2 WHERE id = $1 AND state = 'dead'",
            args![&job.id, cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "requeue")?;
    cx.point(CrashPoint::AfterGuard)?;
    emit(db, cx, EventKind::JobRequeued, Some(&job.id), &job.account_id, serde_json::json!({ "attempt": job.attempt }))
        .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(job)
}

columns! {
    /// An artifact to delete: where it lives and the store it was registered in.
    CleanupCol { path = "COALESCE(a.path, a.key)", store = "a.store" }
}

/// Artifacts to delete for a job being torn down, each as (path, the store it was registered in):
/// every item that ends undelivered (net 0), rescanned in full each time (seed 003: the marker, not
/// "undecided").
pub(crate) async fn cleanup_keys(db: &mut Db<'_>, id: &str) -> Result<Vec<(String, Option<String>)>, StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM artifacts a JOIN items i ON i.job_id = a.job_id AND i.item_id = a.item_id \
             WHERE a.job_id = $1 AND i.state IN ('cancelled', 'refunded') ORDER BY 1",
            CleanupCol::LIST
        )
    });
    let rows = db.all(&SQL, args![id]).await?;
    rows.iter().map(|r| Ok((r.text(CleanupCol::path)?, r.opt_text(CleanupCol::store)?))).collect()
}

/// How long a failed cleanup waits before the sweeper tries it again: 1 s, 2 s, 4 s, … an hour at
/// most, so a cleanup that fails every time (a store that refuses, a file that will not go) costs
/// one try an hour, not one a second (decision 0028 §6).
const CLEANUP_BACKOFF: BackoffPolicy =
    BackoffPolicy { backoff_ms_base: 1_000, backoff_ms_max: 3_600_000, jitter: Jitter::None };

columns! {
    /// A cancelling job's failed cleanups.
    RetryCol { failures, retry_at, last_error, failed_at }
}

/// Records that a cancelling job's cleanup failed: one more failure, the next try after the backoff,
/// the message kept for the operator. Returns how many times it has failed.
pub(crate) async fn cleanup_failed(db: &mut Db<'_>, cx: &Cx, id: &str, message: &str) -> Result<i64, StoreError> {
    let failures = match db.opt("SELECT failures FROM teardown_retries WHERE job_id = $1", args![id]).await? {
        Some(r) => r.i64(RetryCol::failures)? + 1,
        None => 1,
    };
    let wait_ms = CLEANUP_BACKOFF.capped_ms(u32::try_from(failures).unwrap_or(u32::MAX));
    let retry_at = cx.now.micros().saturating_add(i64::try_from(wait_ms).unwrap_or(i64::MAX).saturating_mul(1_000));
    let message: String = message.chars().take(2_000).collect();
    db.exec(
        "INSERT INTO teardown_retries (job_id, failures, retry_at, last_error, failed_at) VALUES ($1, $2, $3, $4, $5) \
         ON CONFLICT (job_id) DO UPDATE SET failures = $2, retry_at = $3, last_error = $4, failed_at = $5",
        args![id, failures, retry_at, message, cx.now.micros()],
    )
    .await?;
    Ok(failures)
}

/// A cancelling job's failed cleanups, if any: how many, when the next try is, the last error.
pub(crate) async fn cleanup_retry(db: &mut Db<'_>, id: &str) -> Result<Option<CleanupRetry>, StoreError> {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM teardown_retries WHERE job_id = $1", RetryCol::LIST));
    let Some(r) = db.opt(&SQL, args![id]).await? else { return Ok(None) };
    Ok(Some(CleanupRetry {
        failures: r.i64(RetryCol::failures)?,
        retry_at: Timestamp::from_micros(r.i64(RetryCol::retry_at)?),
        last_error: r.text(RetryCol::last_error)?,
        failed_at: Timestamp::from_micros(r.i64(RetryCol::failed_at)?),
    }))
}

/// The operator's way out of a teardown whose cleanup cannot succeed: `cancelling → cancelled`
/// without it. The refunds were made in step 1; what is left is files. The artifacts it leaves are
/// named in the `job.cancelled` event (`artifacts_left`) and in the action the caller records, for
/// someone to delete by hand. Returns the job and, when this call moved it, the paths left; a job
/// already `cancelled` is answered as it is (a re-sent request); any other state is
/// `invalid_transition`.
pub(crate) async fn abandon_cleanup(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &str,
) -> Result<(Job, Option<Vec<String>>), StoreError> {
    let job = must_lock_job(db, id).await?;
    match job.state {
        JobState::Cancelling => {}
        JobState::Cancelled => {
            let job = must_read_job(db, cx, id).await?;
            cx.point(CrashPoint::BeforeCommit)?;
            return Ok((job, None));
        }
        other => {
            return Err(StoreError::InvalidTransition {
                job: job.id,
                action: "finish its teardown without cleanup (only a cancelling job)",
                state: other.as_str().to_owned(),
            });
        }
    }
    let left: Vec<String> = cleanup_keys(db, id).await?.into_iter().map(|(path, _)| path).collect();
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'cancelled', updated_at = $2 WHERE id = $1 AND state = 'cancelling'",
            args![id, cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "abandon cleanup")?;
    cx.point(CrashPoint::AfterGuard)?;
    let done = must_read_job(db, cx, id).await?;
    let mut totals = cancelled_totals(&done);
    totals["artifacts_left"] = serde_json::json!(left);
    emit(db, cx, EventKind::JobCancelled, Some(id), &job.account_id, totals).await?;
    super::top_up_close::closed(db, cx, &job, "CANCELLED", false).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((done, Some(left)))
}
