//! A release: the lease holder must stop (its machine is being taken away) and hands the job back
//! at an item boundary — queued, due at once, no money moved; the attempt closes `released` and
//! does not count toward `max_attempts` (semantics §3 "Release", docs/decisions/0028).

use super::{
    After, Caller, Cx, Heard, Reported, attach, begin_teardown, check_caller, close_attempt, emit, guard_hit,
    holds_lease, must_lock_job, must_read_job, replay_or_refuse, resume_if_cancelling,
};
use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::*;
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind, Signal};
use settle_core::ids::JobId;

/// A release with `token`. With the current lease: the job goes back to `queued`, due now, and its
/// budget's base moves up by one (the attempt does not count); when a cancel was requested, the
/// worker's stop is the cancel's acknowledgement and the job is torn down instead (a release never
/// puts back a job its client cancelled). A re-send after it took effect is a replay; another
/// stale token changes nothing and is refused (`LeaseLost`), logged — except a token no attempt
/// held, which writes nothing (decision 0019).
pub(crate) async fn release(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: &LeaseToken,
    caller: Caller,
) -> Result<(Outcome<Job>, After, Option<Box<LeaseLost>>), StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, caller)?;
    if !holds_lease(cx, &job, token) {
        let heard = Heard { signal: Signal::Release, code: None, message: None };
        let (held, refused) = replay_or_refuse(db, cx, &job, &token.0, heard, Reported::RELEASE.signal).await?;
        // A token no attempt held writes nothing, not even the teardown's continuation; a re-sent
        // release whose teardown a crash interrupted carries it on, as a re-sent fail does.
        let after = if held { resume_if_cancelling(&job) } else { After::Nothing };
        let job = attach(db, cx, job).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: job, applied: false }, after, refused));
    }
    if job.cancel_requested {
        begin_teardown(db, cx, &job, Some(AttemptResult::Cancelled), Some(Reported::RELEASE)).await?;
        let job = must_read_job(db, cx, id.as_str()).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: job, applied: true }, After::Teardown, None));
    }
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'queued', turn = NULL, not_before = $3, lease_token = NULL, lease_expires_at = NULL, \
             lease_worker = NULL, updated_at = $3, budget_base = budget_base + 1 \
             WHERE id = $1 AND state = 'running' AND lease_token = $2",
            args![&job.id, &token.0, cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "release")?;
    close_attempt(db, cx, &job, AttemptResult::Released, None, None, Some(Reported::RELEASE)).await?;
    cx.point(CrashPoint::AfterGuard)?;
    let data = serde_json::json!({ "attempt": job.attempt });
    emit(db, cx, EventKind::JobReleased, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: job, applied: true }, After::Nothing, None))
}
