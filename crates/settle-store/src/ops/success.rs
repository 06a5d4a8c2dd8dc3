//! Success, accepted from any attempt (spec §3): what a failure refunded is reclaimed, and the
//! attempt it overtakes is closed as superseded.

use super::allocations::Spend;
use super::plan::{IntentKind, TakeAt, check_counts, item, plan_read, take_from_head};
use super::{
    After, Caller, Cx, Heard, JobRow, Move, Reported, begin_teardown, check_caller, check_costs, close_attempt, emit,
    guard_hit, holds_lease, job_items, log_signal, mark_reported_success, move_items, must_lock_job, must_read_job,
    record_action, refusal, resume_if_cancelling, sum, token_attempt,
};
use super::{BalanceCheck, Holds, Line, Posting, assemble, debits_from_grants, post_balance};
use super::{ItemRead, PlanRead};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::Credits;
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind, Signal, SignalEffect};
use settle_core::ids::JobId;
use settle_core::item::{ItemSignal, ItemState, RefundReason};
use settle_core::job;
use settle_core::job::{JobState, RefundPolicy};
use settle_core::ledger::{AllocationKind, EntryKind};
use settle_core::limits;
use std::sync::LazyLock;

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
    // Locked and read by the batch's phase 1, or here.
    let (job, ahead) = match cx.take_ahead(id.as_str()) {
        Some(a) => (a.row, Some(a.read)),
        None => (must_lock_job(db, id.as_str()).await?, None),
    };
    check_caller(&job, Caller::Worker)?;
    // PostgreSQL: the common shape in three or four statements (docs/design/batch-plan.md §10).
    if let Reporter::Lease(t) = by
        && costs.0.is_empty()
        && db.engine() == Engine::Postgres
        && let Some(job) = succeeds(db, cx, &job, &t.0, result, ahead).await?
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

columns! {
    /// What the write of a success changed, table by table, and whether the head grant paid.
    SucceedWroteCol { jobs, closed, marked, signals, items, held, took, parts }
}

static SUCCEED_WRITE: LazyLock<String> = LazyLock::new(|| {
    let take = take_from_head(&TakeAt {
        account: "$7",
        total: "$13",
        kind: "$14",
        job: "$1",
        first_seq: "$15",
        now: "$3",
        lines: "$16::text[], $17::bigint[]",
    });
    format!(
        "WITH \
         j AS (UPDATE jobs SET state = 'succeeded', lease_token = NULL, lease_expires_at = NULL, lease_worker = NULL, \
               unknown_since = NULL, result = $4, updated_at = $3 WHERE id = $1 AND state = $2 RETURNING 1), \
         closed AS (UPDATE attempts SET finished_at = $3, result = 'succeeded', fail_code = NULL, message = NULL, \
               reported = 'succeed', sent_code = NULL, expired_at = NULL, success_at = $3 \
               WHERE job_id = $1 AND attempt_no = $5 AND finished_at IS NULL AND $6 = 1 RETURNING 1), \
         marked AS (UPDATE attempts SET reported = COALESCE(reported, 'succeed'), success_at = COALESCE(success_at, $3) \
               WHERE job_id = $1 AND attempt_no = $5 AND $6 = 0 RETURNING 1), \
         s AS (INSERT INTO signals (job_id, job_seq, attempt_no, signal, fail_code, message, effect, received_at) \
               SELECT $1, (SELECT job_seq FROM jobs WHERE id = $1), $5, 'succeed', NULL, NULL, 'recovered', $3 \
               WHERE $6 = 0 RETURNING 1), \
         i AS (UPDATE items SET state = u.to_state FROM unnest($8::text[], $9::text[], $10::text[]) AS u(id, from_state, to_state) \
               WHERE items.job_id = $1 AND items.item_id = u.id AND items.state = u.from_state \
               AND (u.from_state <> 'refunded' OR items.refund_reason <> 'item_failed') RETURNING 1), \
         h AS (UPDATE accounts SET held = held + $11 WHERE id = $7 AND $11 <> 0 AND $12 = 1 RETURNING 1), \
         {take} \
         SELECT (SELECT count(*) FROM j) AS jobs, (SELECT count(*) FROM closed) AS closed, \
         (SELECT count(*) FROM marked) AS marked, (SELECT count(*) FROM s) AS signals, (SELECT count(*) FROM i) AS items, \
         (SELECT count(*) FROM h) AS held, (SELECT count(*) FROM took) AS took, (SELECT count(*) FROM parts) AS parts"
    )
});

/// An item a planned success moves: its id and cost.
type ItemMove = (String, i64);

/// A success's item moves (id, cost): every charged item delivered, every refund reclaimed but an
/// item's own failure — as `RECLAIM_ALL`, whose `refund_reason <> 'item_failed'` a NULL reason does
/// not pass.
fn delivered_and_reclaimed(items: &[ItemRead]) -> (Vec<ItemMove>, Vec<ItemMove>) {
    let (charged, refunded) = (ItemState::Charged.as_str(), ItemState::Refunded.as_str());
    let item_failed = Some(RefundReason::ItemFailed.as_str());
    let delivered = items.iter().filter(|i| i.3 == charged).map(|i| (i.0.clone(), i.1)).collect();
    let reclaimed = (items.iter())
        .filter(|i| i.3 == refunded && i.4.is_some() && i.4.as_deref() != item_failed)
        .map(|i| (i.0.clone(), i.1))
        .collect();
    (delivered, reclaimed)
}

/// `job.reclaimed` when anything was, then `job.succeeded`, as `settle_items` writes them.
async fn success_events(db: &mut Db<'_>, cx: &Cx, job: &JobRow, reclaimed: &[ItemMove]) -> Result<(), StoreError> {
    if !reclaimed.is_empty() {
        let amount = Credits::checked_sum(reclaimed.iter().map(|m| Credits::new(m.1)))?;
        let items: Vec<&str> = reclaimed.iter().map(|m| m.0.as_str()).collect();
        let data = serde_json::json!({ "amount": amount.get(), "items": items });
        emit(db, cx, EventKind::JobReclaimed, Some(&job.id), &job.account_id, data).await?;
    }
    let data = serde_json::json!({ "from": job.state.as_str(), "attempt": job.attempt });
    emit(db, cx, EventKind::JobSucceeded, Some(&job.id), &job.account_id, data).await
}

/// The item moves as the write's arrays: ids, the states they leave, the states they take.
fn item_moves(delivered: &[ItemMove], reclaimed: &[ItemMove]) -> (Vec<String>, Vec<String>, Vec<String>) {
    let (charged, refunded) = (ItemState::Charged.as_str(), ItemState::Refunded.as_str());
    let moves = (delivered.iter().map(|m| (m, charged, ItemState::Succeeded)))
        .chain(reclaimed.iter().map(|m| (m, refunded, ItemState::Reclaimed)));
    let (mut ids, mut froms, mut tos) = (Vec::new(), Vec::new(), Vec::new());
    for ((id, _), from, to) in moves {
        ids.push(id.clone());
        froms.push(from.to_owned());
        tos.push(to.as_str().to_owned());
    }
    (ids, froms, tos)
}

/// The job row as a planned success wrote it, and its items (in place) as moved.
fn succeeded_row(
    cx: &Cx,
    job: &JobRow,
    result: Option<&str>,
    items: &mut [ItemRead],
    (delivered, reclaimed): (&[ItemMove], &[ItemMove]),
) -> JobRow {
    let mut row = job.clone();
    row.state = JobState::Succeeded;
    row.lease_token = None;
    row.lease_expires_at = None;
    row.unknown_since = None;
    row.result = result.map(str::to_owned);
    row.updated_at = cx.now.micros();
    for item in items {
        if delivered.iter().any(|m| m.0 == item.0) {
            item.3 = ItemState::Succeeded.as_str().to_owned();
        } else if reclaimed.iter().any(|m| m.0 == item.0) {
            item.3 = ItemState::Reclaimed.as_str().to_owned();
        }
    }
    row
}

/// One reclaim line per reclaimed item, in the job's order.
fn reclaim_lines<'a>(job: &'a JobRow, reclaimed: &'a [ItemMove]) -> Result<Vec<Line<'a>>, StoreError> {
    reclaimed
        .iter()
        .map(|(id, cost)| {
            Ok(Line {
                kind: EntryKind::Reclaim,
                amount: Credits::new(*cost).checked_neg()?,
                job_id: Some(job.id.as_str()),
                job_seq: Some(job.job_seq),
                item_id: Some(id.as_str()),
                ref_id: None,
                reason: None,
                request_hash: None,
            })
        })
        .collect()
}

/// A success reported with a lease token, in the plan, `job` locked: from the attempt holding the
/// lease (a running job) or from an earlier attempt (the seed's late result, on a job queued again,
/// dead or unknown). Every charged item is delivered, every refund but an item's own failure is
/// reclaimed — the reclaim's balance change first (it locks the account, so the head grant read
/// after it is current), then everything else in one statement. `Ok(None)`: not the plan's shape
/// (a cancel requested, held items, a withdrawal, a token no attempt held), nothing written.
pub(crate) async fn succeeds(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    token: &str,
    result: Option<&str>,
    ahead: Option<PlanRead>,
) -> Result<Option<Job>, StoreError> {
    let current = job.state == JobState::Running && job.lease_token.as_deref() == Some(token);
    let in_shape = cx.broken.is_none()
        && !job::Rail::of(&job.kind).is_reserved()
        && !job.cancel_requested
        && JobState::SUCCEED_FROM.contains(&job.state)
        && (current || job.state != JobState::Running);
    if !in_shape {
        return Ok(None);
    }
    let kind = IntentKind::Succeed { token: token.to_owned() };
    let PlanRead { mut items, net, token_attempt, .. } = plan_read(db, job, &kind, ahead).await?;
    let attempt_no = match (current, token_attempt) {
        (true, _) => job.attempt,
        (false, Some(n)) => n,
        (false, None) => return Ok(None),
    };
    if items.iter().any(|i| i.2.is_some()) {
        return Ok(None);
    }
    let (delivered, reclaimed) = delivered_and_reclaimed(&items);
    let delivered_total = Credits::checked_sum(delivered.iter().map(|m| Credits::new(m.1)))?;
    let reclaimed_total = Credits::checked_sum(reclaimed.iter().map(|m| Credits::new(m.1)))?;
    // The reclaim's posting, with the delivery's release of its holds: one balance change.
    let lines = reclaim_lines(job, &reclaimed)?;
    let holds = Holds { held: delivered_total.checked_neg()?.get(), exposure: reclaimed_total.checked_neg()?.get() };
    let posting = Posting {
        account_id: &job.account_id,
        job_kind: Some(&job.kind),
        check: BalanceCheck::Never,
        lines: &lines,
        holds,
    };
    let posted = match lines.is_empty() {
        true => None,
        false => Some(post_balance(db, cx, &posting).await?),
    };
    let (ids, froms, tos) = item_moves(&delivered, &reclaimed);
    let amounts: Vec<i64> = reclaimed.iter().map(|m| m.1).collect();
    let wrote = db
        .one(
            &SUCCEED_WRITE,
            &[
                Value::from(job.id.as_str()),
                job.state.as_str().into(),
                cx.now.micros().into(),
                result.into(),
                attempt_no.into(),
                i64::from(current).into(),
                job.account_id.as_str().into(),
                Value::Texts(ids),
                Value::Texts(froms),
                Value::Texts(tos),
                holds.held.into(),
                i64::from(posted.is_none()).into(),
                reclaimed_total.get().into(),
                AllocationKind::of_debit(EntryKind::Reclaim).as_str().into(),
                posted.as_ref().map_or(0, |p| p.first_account_seq).into(),
                Value::Texts(reclaimed.iter().map(|m| m.0.clone()).collect()),
                Value::I64s(amounts.clone()),
            ],
        )
        .await?;
    let took = wrote.i64(SucceedWroteCol::took)?;
    let paying = amounts.iter().filter(|x| **x > 0).count() as i64;
    let counts = [
        ("job", wrote.i64(SucceedWroteCol::jobs)?, 1),
        ("attempts closed", wrote.i64(SucceedWroteCol::closed)?, i64::from(current)),
        ("attempts marked", wrote.i64(SucceedWroteCol::marked)?, i64::from(!current)),
        ("signals", wrote.i64(SucceedWroteCol::signals)?, i64::from(!current)),
        ("items", wrote.i64(SucceedWroteCol::items)?, (delivered.len() + reclaimed.len()) as i64),
        ("accounts' holds", wrote.i64(SucceedWroteCol::held)?, i64::from(posted.is_none() && holds.held != 0)),
        ("allocation parts", wrote.i64(SucceedWroteCol::parts)?, if took == 1 { paying } else { 0 }),
    ];
    check_counts("the success of job", &job.id, &counts)?;
    cx.point(CrashPoint::AfterGuard)?;
    if let Some(posted) = &posted
        && took == 0
        && reclaimed_total.is_positive()
    {
        debits_from_grants(db, cx, &posting, posted, Spend::Any).await?;
    }
    cx.point(CrashPoint::AfterLedger)?;
    success_events(db, cx, job, &reclaimed).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let row = succeeded_row(cx, job, result, &mut items, (&delivered, &reclaimed));
    let answer = assemble(cx, row, items.into_iter().map(item).collect::<Result<_, _>>()?, Credits::new(net))?;
    #[cfg(debug_assertions)]
    super::plan::assert_stored(db, cx, &answer).await?;
    Ok(Some(answer))
}
