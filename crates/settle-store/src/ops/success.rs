//! Success, accepted from any attempt (spec §3): what a failure refunded is reclaimed, and the
//! attempt it overtakes is closed as superseded.

use super::{
    After, Caller, Cx, Heard, JobRow, Move, Reported, begin_teardown, check_caller, check_costs, close_attempt, emit,
    guard_hit, holds_lease, job_items, log_signal, mark_reported_success, move_items, must_lock_job, must_read_job,
    record_action, refusal, resume_if_cancelling, sum, token_attempt,
};
use crate::db::{Db, Engine, args};
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
/// An attempt whose own success took effect has it recorded on its row (decision 0019).
pub(crate) async fn apply_success(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    by: Reporter<'_>,
    result: Option<&str>,
    costs: &Costs,
) -> Result<(bool, After), StoreError> {
    let token = match by {
        Reporter::Lease(t) => Some(t),
        Reporter::Operator(_) | Reporter::Reconciler => None,
    };
    let current = token.is_some_and(|t| holds_lease(cx, job, t));
    let own = current.then_some(Reported::SUCCEED);
    // The earlier attempt whose worker sent this success (the seed's late result).
    let earlier = match token {
        Some(t) if !current => token_attempt(db, job, &t.0).await?.map(|a| a.end.attempt_no),
        _ => None,
    };
    let from_ok = JobState::SUCCEED_FROM.contains(&job.state);
    let cancel_wins = job.cancel_requested
        && job.refund_on != RefundPolicy::FinalFailure
        && !cx.broken(crate::broken::Guard::CancelWins);
    if from_ok && cancel_wins && matches!(job.state, JobState::Running | JobState::Unknown) {
        begin_teardown(db, cx, job, Some(AttemptResult::Cancelled), own).await?;
        if let Some(n) = earlier {
            mark_reported_success(db, cx, job, n).await?;
        }
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
    if !costs.0.is_empty() {
        check_costs(&job_items(db, job).await?, costs)?;
    }
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'succeeded', lease_token = NULL, lease_expires_at = NULL, lease_worker = NULL, \
             unknown_since = NULL, result = $4, updated_at = $3 WHERE id = $1 AND state = $2",
            args![&job.id, job.state.as_str(), cx.now.micros(), result],
        )
        .await?;
    guard_hit(rows, "success")?;
    if job.state == JobState::Running {
        let ended = if current { AttemptResult::Succeeded } else { AttemptResult::Superseded };
        close_attempt(db, cx, job, ended, None, None, own).await?;
    }
    if let Some(n) = earlier {
        mark_reported_success(db, cx, job, n).await?;
    }
    // A success from an earlier attempt is kept in the signal log (what support asks about); an
    // operator's is in the action log, the reconciler's in the events.
    if token.is_some() && !current {
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
    settle_items(db, cx, job, costs).await?;
    Ok((true, After::Nothing))
}

/// A success's money and events: every charged item delivered (a held one priced, the rest of its
/// hold released), every refunded one reclaimed (spec §2), `job.reclaimed` when anything was, then
/// `job.succeeded` (with the held items' hold, price and release).
async fn settle_items(db: &mut Db<'_>, cx: &Cx, job: &JobRow, costs: &Costs) -> Result<(), StoreError> {
    let delivered = move_items(db, cx, job, Move::all(ItemState::Charged, ItemSignal::Succeed).priced(costs)).await?;
    let reclaimed = move_items(db, cx, job, Move::all(ItemState::Refunded, ItemSignal::Succeed).priced(costs)).await?;
    cx.point(CrashPoint::AfterLedger)?;
    if !reclaimed.is_empty() {
        emit(
            db,
            cx,
            EventKind::JobReclaimed,
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "amount": sum(&reclaimed)?.get(), "items": reclaimed.iter().map(|m| m.id.as_str()).collect::<Vec<_>>() }),
        )
        .await?;
    }
    let mut data = serde_json::json!({ "from": job.state.as_str(), "attempt": job.attempt });
    let priced: Vec<serde_json::Value> = delivered.iter().chain(&reclaimed).filter_map(|m| m.priced()).collect();
    if !priced.is_empty() {
        data["items"] = serde_json::Value::Array(priced);
    }
    emit(db, cx, EventKind::JobSucceeded, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)
}

/// A worker's (or an operator's) success report (decision 0019). With some attempt's token it is
/// applied when the job is where a success moves it, a replay when the job already succeeded (or
/// this attempt's own success lost to a cancel), and refused otherwise; a token no attempt of the
/// job held is refused and writes nothing. An operator's success is recorded in the action log.
pub(crate) async fn succeed(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    by: Reporter<'_>,
    result: Option<&str>,
    costs: &Costs,
) -> Result<(Outcome<Job>, After, Option<Box<LeaseLost>>), StoreError> {
    if result.is_some_and(|r| r.len() > limits::PAYLOAD_BYTES_MAX) {
        return Err(StoreError::invalid(format!("result is larger than {} bytes", limits::PAYLOAD_BYTES_MAX)));
    }
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, Caller::Worker)?;
    // PostgreSQL: the common shape in three or four statements (docs/design/batch-plan.md §10).
    if let Reporter::Lease(t) = by
        && costs.0.is_empty()
        && db.engine() == Engine::Postgres
        && let Some(job) = super::plan::succeeds(db, cx, &job, &t.0, result).await?
    {
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: job, applied: true }, After::Nothing, None));
    }
    let heard = || Heard { signal: Signal::Succeed, code: None, message: None };
    let unmoved = |after| (false, after);
    let decided = match by {
        Reporter::Lease(t) if !holds_lease(cx, &job, t) => match token_attempt(db, &job, &t.0).await? {
            None => Some((unmoved(After::Nothing), Some(refusal(&job, None)))),
            Some(att) => {
                let cancel_won = matches!(job.state, JobState::Cancelling | JobState::Cancelled);
                if job.state == JobState::Succeeded || (cancel_won && att.success) {
                    check_replayed_costs(db, &job, costs).await?;
                    log_signal(db, cx, &job, Some(&t.0), heard(), SignalEffect::Noop).await?;
                    Some((unmoved(resume_if_cancelling(&job)), None))
                } else if !JobState::SUCCEED_FROM.contains(&job.state) {
                    log_signal(db, cx, &job, Some(&t.0), heard(), SignalEffect::Stale).await?;
                    Some((unmoved(resume_if_cancelling(&job)), Some(refusal(&job, Some(att)))))
                } else {
                    None
                }
            }
        },
        Reporter::Lease(_) => None,
        Reporter::Operator(_) | Reporter::Reconciler => match job.state {
            JobState::Succeeded => {
                check_replayed_costs(db, &job, costs).await?;
                Some((unmoved(After::Nothing), None))
            }
            JobState::Cancelled => return Err(StoreError::JobFinished(job.id)),
            s if !JobState::SUCCEED_FROM.contains(&s) => {
                return Err(StoreError::InvalidTransition {
                    job: job.id,
                    action: "be succeeded",
                    state: s.as_str().to_owned(),
                });
            }
            _ => None,
        },
    };
    let ((applied, after), refused) = match decided {
        Some(d) => d,
        None => {
            let (applied, after) = apply_success(db, cx, &job, by, result, costs).await?;
            if !applied {
                // Only a withdrawal waits queued or dead with a cancel pending, and this route
                // refuses withdrawals: a success here would be heard and lost.
                return Err(StoreError::InvalidTransition {
                    job: job.id,
                    action: "be succeeded while its cancel is pending",
                    state: job.state.as_str().to_owned(),
                });
            }
            if let Reporter::Operator(actor) = by {
                let detail = serde_json::json!({ "from": job.state.as_str(), "teardown": after == After::Teardown });
                record_action(db, cx, actor, ActionKind::JobSucceed, Some(&job.id), Some(&job.account_id), detail)
                    .await?;
            }
            ((applied, after), None)
        }
    };
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: job, applied }, after, refused))
}

/// A success re-sent or late after the job succeeded changes nothing — its items keep the prices
/// the first success gave them — but a malformed price is refused all the same (docs/decisions/0022).
async fn check_replayed_costs(db: &mut Db<'_>, job: &JobRow, costs: &Costs) -> Result<(), StoreError> {
    if costs.0.is_empty() {
        return Ok(());
    }
    check_costs(&job_items(db, job).await?, costs)
}
