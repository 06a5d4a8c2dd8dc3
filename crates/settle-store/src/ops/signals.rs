//! Signals from the lease holder that do not end the job: heartbeats, item reports, artifacts. A
//! signal whose token is not the current attempt's changes nothing: a re-sent item report whose
//! attempt decided the item is a replay, anything else is refused and logged as stale — except a
//! token no attempt of the job ever held, which writes nothing (decision 0019).

use super::{
    Caller, Cx, Heard, ItemCol, JobRow, Move, SELECT_ITEM, check_caller, check_costs, emit, guard_hit, item_from_row,
    log_signal, move_items, must_lock_job, refusal, token_attempt,
};
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::Credits;
use settle_core::crash::CrashPoint;
use settle_core::history::{EventKind, Signal, SignalEffect};
use settle_core::ids::{FailCode, ItemId, JobId};
use settle_core::item::{self, ItemSignal, ItemState, RefundReason};
use settle_core::job::{JobState, Rail};
use std::sync::LazyLock;

/// A signal refused because its lease is gone. It is logged in the same transaction, which then
/// commits; the caller turns it into `LeaseLost` afterwards, so the log row survives.
#[derive(Debug)]
pub(crate) struct Refused(pub Box<LeaseLost>);

/// Refuses a signal whose token is not the current lease: logged as stale, unless no attempt of
/// the job ever held the token (then nothing is written).
async fn refuse(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    token: &LeaseToken,
    heard: Heard<'_>,
) -> Result<Refused, StoreError> {
    let attempt = token_attempt(db, job, &token.0).await?;
    if attempt.is_some() {
        log_signal(db, cx, job, Some(&token.0), heard, SignalEffect::Stale).await?;
    }
    Ok(Refused(refusal(job, attempt)))
}

pub(super) fn holds_lease(cx: &Cx, job: &JobRow, token: &LeaseToken) -> bool {
    let current = job.lease_token.as_deref() == Some(token.0.as_str());
    job.state == JobState::Running && (current || cx.broken(crate::broken::Guard::Lease))
}

pub(crate) async fn heartbeat(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: &LeaseToken,
    caller: Caller,
) -> Result<Result<Heartbeat, Refused>, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, caller)?;
    if !holds_lease(cx, &job, token) {
        let heard = Heard { signal: Signal::Heartbeat, code: None, message: None };
        return Ok(Err(refuse(db, cx, &job, token, heard).await?));
    }
    let expires = cx.now.plus_seconds(u64::try_from(job.lease_seconds).unwrap_or(0));
    let rows = db
        .exec(
            "UPDATE jobs SET lease_expires_at = $3, updated_at = $4 WHERE id = $1 AND state = 'running' AND lease_token = $2",
            args![&job.id, &token.0, expires.micros(), cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "heartbeat")?;
    // The payout processor's last heartbeat before a send marks the attempt as sending, committed
    // before the request leaves: from here an expired lease is `unknown` (docs/design/payouts.md).
    let marker = match caller {
        Caller::Worker | Caller::Processor(Rail::Work) => None,
        Caller::Processor(Rail::Payout) => Some("UPDATE withdrawals SET sending_attempt = $2 WHERE job_id = $1"),
        Caller::Processor(Rail::Funding) => Some("UPDATE top_ups SET sending_attempt = $2 WHERE job_id = $1"),
    };
    if let Some(sql) = marker
        && !job.cancel_requested
    {
        let rows = db.exec(sql, args![&job.id, job.attempt]).await?;
        guard_hit(rows, "sending marker")?;
    }
    cx.point(CrashPoint::AfterGuard)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Ok(Heartbeat { lease_expires_at: expires, cancel_requested: job.cancel_requested }))
}

/// An item report from the worker holding the lease: `charged → succeeded`, `refunded → reclaimed`
/// (an explicit item success takes back any refund), or `charged → refunded` on failure. A report
/// the item's state already holds is a replay; one it contradicts (a failure of a delivered item)
/// is `invalid_transition`. With a token that is not the current lease, only the attempt that
/// decided the item gets a replay; others are refused.
pub(crate) async fn item_report(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    item_id: &ItemId,
    token: &LeaseToken,
    failure: Option<(&FailCode, Option<&str>)>,
    cost: Option<Credits>,
) -> Result<Result<ItemReport, Refused>, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, Caller::Worker)?;
    let signal_name = if failure.is_some() { Signal::ItemFail } else { Signal::ItemSucceed };
    let (code, message) = failure.map(|(c, m)| (Some(c.as_str()), m)).unwrap_or((None, None));
    let heard = Heard { signal: signal_name, code, message };
    let current = db
        .opt(&SELECT_ITEM, args![&job.id, item_id.as_str()])
        .await?
        .ok_or_else(|| StoreError::not_found("item", item_id.as_str()))?;
    let current = item_from_row::<ItemCol>(&current)?;
    let costs = Costs(cost.map(|c| (item_id.clone(), c)).into_iter().collect());
    if failure.is_some() && cost.is_some() {
        return Err(StoreError::invalid("a failure report carries no cost"));
    }
    let holds = already_holds(&current, failure.is_some());
    if !holds_lease(cx, &job, token) {
        return stale_item_report(db, cx, &job, current, token, heard, &costs).await;
    }
    check_costs(std::slice::from_ref(&current), &costs)?;
    let signal = if failure.is_some() { ItemSignal::Fail } else { ItemSignal::Succeed };
    let reason_only = signal == ItemSignal::Fail
        && current.state == ItemState::Refunded
        && current.refund_reason != Some(RefundReason::ItemFailed);
    let applied = match item::arrow(current.state, signal) {
        // Already refunded by a job-level failure; the worker now says this item was not delivered,
        // so a later job-level success must not reclaim it (spec §2). No money moves.
        None if reason_only => {
            let rows = db
                .exec(
                    "UPDATE items SET refund_reason = 'item_failed', decided_attempt = $3 \
                     WHERE job_id = $1 AND item_id = $2 AND state = 'refunded'",
                    args![&job.id, item_id.as_str(), job.attempt],
                )
                .await?;
            guard_hit(rows, "item refund reason")?;
            cx.point(CrashPoint::AfterGuard)?;
            true
        }
        None if holds => {
            log_signal(db, cx, &job, Some(&token.0), heard, SignalEffect::Noop).await?;
            false
        }
        // A failure of a delivered (or cancelled) item, a success of a cancelled one.
        None => {
            return Err(StoreError::InvalidTransition {
                job: job.id,
                action: if failure.is_some() { "fail this item" } else { "succeed this item" },
                state: format!("{} (item {} is {})", job.state.as_str(), item_id, current.state.as_str()),
            });
        }
        Some(arrow) => {
            move_item(db, cx, &job, &current, arrow, failure, &costs).await?;
            true
        }
    };
    let item = item_from_row::<ItemCol>(&db.one(&SELECT_ITEM, args![&job.id, item_id.as_str()]).await?)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Ok(ItemReport { item, cancel_requested: job.cancel_requested, applied }))
}

columns! {
    /// The attempt whose report decided an item, if one did.
    DecidedCol { decided_attempt }
}

/// An item report with a token that is not the current lease: a replay when the report's effect
/// holds and was decided by the token's attempt or an earlier one — then that attempt was answered
/// a replay (or applied) while it held the lease, and its re-send gets the same class (decision
/// 0019); otherwise refused.
async fn stale_item_report(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    current: Item,
    token: &LeaseToken,
    heard: Heard<'_>,
    costs: &Costs,
) -> Result<Result<ItemReport, Refused>, StoreError> {
    let holds = already_holds(&current, heard.signal == Signal::ItemFail);
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM items WHERE job_id = $1 AND item_id = $2", DecidedCol::LIST));
    let decided = db.one(&SQL, args![&job.id, &current.id]).await?.opt_i64(DecidedCol::decided_attempt)?;
    if let Some(att) = token_attempt(db, job, &token.0).await?
        && holds
        && decided.is_some_and(|d| d <= i64::from(att.end.attempt_no))
    {
        check_costs(std::slice::from_ref(&current), costs)?;
        log_signal(db, cx, job, Some(&token.0), heard, SignalEffect::Noop).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok(Ok(ItemReport { item: current, cancel_requested: job.cancel_requested, applied: false }));
    }
    Ok(Err(refuse(db, cx, job, token, heard).await?))
}

/// Whether what an item report asks for (a failure, or a success) already holds.
fn already_holds(item: &Item, failure: bool) -> bool {
    if failure {
        item.state == ItemState::Refunded && item.refund_reason == Some(RefundReason::ItemFailed)
    } else {
        matches!(item.state, ItemState::Succeeded | ItemState::Reclaimed)
    }
}

/// The item arrow an item report takes, with its ledger line and event.
async fn move_item(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    current: &Item,
    arrow: item::Arrow,
    failure: Option<(&FailCode, Option<&str>)>,
    costs: &Costs,
) -> Result<(), StoreError> {
    let signal = if failure.is_some() { ItemSignal::Fail } else { ItemSignal::Succeed };
    let reason = failure.is_some().then_some(RefundReason::ItemFailed);
    let moved =
        move_items(db, cx, job, Move::all(arrow.from, signal).only(current.id.as_str()).because(reason).priced(costs))
            .await?;
    guard_hit(moved.len() as u64, "item report")?;
    let moved = &moved[0];
    cx.point(CrashPoint::AfterLedger)?;
    let (event, data) = match (arrow.to, failure) {
        (ItemState::Refunded, Some((code, message))) => (
            EventKind::JobItemRefunded,
            serde_json::json!({ "item_id": current.id.as_str(), "amount": moved.cost.get(), "code": code.as_str(), "message": message }),
        ),
        (ItemState::Reclaimed, _) => (
            EventKind::JobItemReclaimed,
            serde_json::json!({ "item_id": current.id.as_str(), "amount": moved.cost.get() }),
        ),
        _ => {
            let mut data = serde_json::json!({ "item_id": current.id.as_str() });
            if let Some(hold) = moved.hold {
                data["hold"] = hold.get().into();
                data["cost"] = moved.cost.get().into();
                data["released"] = moved.released.get().into();
            }
            (EventKind::JobItemSucceeded, data)
        }
    };
    emit(db, cx, event, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)
}

pub(crate) async fn register_artifact(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    item_id: &ItemId,
    token: &LeaseToken,
    artifact: &NewArtifact,
    store: Option<&str>,
) -> Result<Result<bool, Refused>, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, Caller::Worker)?;
    // No replay without the current lease: a worker that lost it must not write artifacts — nor
    // one whose lease has lapsed (the rescuer's teardown could delete before it writes, and its
    // object would be left behind: issue 41).
    let lapsed = job.lease_expires_at.is_some_and(|t| t <= cx.now.micros());
    if !holds_lease(cx, &job, token) || lapsed {
        let heard = Heard { signal: Signal::Artifact, code: None, message: Some(artifact.key.as_str()) };
        return Ok(Err(refuse(db, cx, &job, token, heard).await?));
    }
    // A cancel was requested: the worker stops at this item boundary, and nothing new is made
    // for the teardown to miss.
    if job.cancel_requested {
        return Err(StoreError::InvalidTransition {
            job: job.id,
            action: "register an artifact (a cancel was requested: stop at the item boundary)",
            state: job.state.as_str().to_owned(),
        });
    }
    if db
        .opt("SELECT 1 FROM items WHERE job_id = $1 AND item_id = $2", args![&job.id, item_id.as_str()])
        .await?
        .is_none()
    {
        return Err(StoreError::not_found("item", item_id.as_str()));
    }
    let rows = db
        .exec(
            "INSERT INTO artifacts (job_id, item_id, key, path, store, created_at) VALUES ($1, $2, $3, $4, $5, $6) \
             ON CONFLICT DO NOTHING",
            args![
                &job.id,
                item_id.as_str(),
                artifact.key.as_str(),
                artifact.key.path_in(&job.id, item_id.as_str()),
                store,
                cx.now.micros()
            ],
        )
        .await?;
    cx.point(CrashPoint::AfterGuard)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Ok(rows == 1))
}
