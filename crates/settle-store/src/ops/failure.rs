//! The failure path: a failure signal from the lease holder or a lapsed lease refunds per the job's
//! policy, then schedules a retry with backoff or ends the job `dead`.

use super::plan::{IntentKind, check_counts, item, plan_read};
use super::{
    After, Caller, Cx, Heard, JobRow, Move, Reported, attach, begin_teardown, check_caller, close_attempt, emit,
    guard_hit, holds_lease, lock_job, log_signal, move_items, must_lock_job, must_read_job, refusal,
    resume_if_cancelling, sum, token_attempt,
};
use super::{ItemRead, PartRead, PlanRead};
use super::{PendingLine, assemble, lock_pending};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind, Signal, SignalEffect};
use settle_core::ids::{FailCode, JobId};
use settle_core::item::{ItemSignal, ItemState, RefundReason};
use settle_core::job::{self, FailOutcome, JobState, Rail};
use settle_core::ledger::EntryKind;
use settle_core::limits;
use settle_core::{Credits, Timestamp};
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
            "UPDATE jobs SET state = $3, turn = NULL, not_before = $4, lease_token = NULL, lease_expires_at = NULL, lease_worker = NULL, \
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
    if state == JobState::Dead {
        super::top_up_close::closed(db, cx, job, code.as_str(), true).await?;
    }
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
    // Locked and read by the batch's phase 1, or here.
    let (job, ahead) = match cx.take_ahead(id.as_str()) {
        Some(a) => (a.row, Some(a.read)),
        None => (must_lock_job(db, id.as_str()).await?, None),
    };
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
    let inconclusive = matches!(caller, Caller::Processor(_)) && signal.code == FailCode::lookup_failed();
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
        && let Some(job) = holder_fails(db, cx, &job, &failure, ahead).await?
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
    static SQL: LazyLock<[String; 2]> = LazyLock::new(|| {
        [Rail::Payout, Rail::Funding].map(|rail| {
            format!("SELECT {} FROM {} WHERE job_id = $1", SendingCol::LIST, rail.table().unwrap_or_default())
        })
    });
    let marker_sql = match Rail::of(&job.kind) {
        Rail::Work => None,
        Rail::Payout => Some(&SQL[0]),
        Rail::Funding => Some(&SQL[1]),
    };
    let sending = match marker_sql {
        Some(sql) => db.one(sql, args![&job.id]).await?.opt_i64(SendingCol::sending_attempt)? == Some(job.attempt),
        None => false,
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
    // A processor's job whose attempt never started its external call did nothing: retry it, and
    // let the next attempt ask the provider before any refund.
    let payout = Rail::of(&job.kind).is_reserved();
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

columns! {
    /// What step 3 of a failure changed, table by table.
    FailWroteCol { jobs, attempts, items, balance, entries, alert_floor, alert_ceiling, spend_limited, parts, grants }
}

/// Step 3 of a failure: the job, its attempt, its refunded items, the balance, the parts given
/// back and the grants they return to — each guarded as the existing code guards it.
const FAIL_WRITE: &str = "WITH \
     j AS (UPDATE jobs SET state = $3, turn = NULL, not_before = $4, lease_token = NULL, lease_expires_at = NULL, \
           lease_worker = NULL, last_error_code = $5, last_error_message = $6, unknown_since = NULL, updated_at = $7, \
           budget_base = budget_base + $8 WHERE id = $1 AND state = $2 RETURNING 1), \
     t AS (UPDATE attempts SET finished_at = $7, result = $9, fail_code = $5, message = $6, reported = $10, \
           sent_code = $11, expired_at = NULL, success_at = NULL \
           WHERE job_id = $1 AND attempt_no = $12 AND finished_at IS NULL RETURNING 1), \
     i AS (UPDATE items SET state = 'refunded', refund_reason = 'job_failed' \
           WHERE job_id = $1 AND item_id = ANY($13::text[]) AND state = 'charged' RETURNING 1), \
     b AS (UPDATE accounts SET balance = balance + $14, held = held - $14, exposure = exposure + $14, \
           last_account_seq = last_account_seq + $15 WHERE id = $16 AND $15 > 0 AND next_expiry > $7 \
           RETURNING balance, last_account_seq, alert_floor, alert_ceiling, spend_limited), \
     p AS (UPDATE allocations SET given_back = given_back + u.x, owed = 0 \
           FROM unnest($17::bigint[], $18::bigint[]) AS u(id, x) \
           WHERE allocations.job_id = $1 AND allocations.id = u.id AND allocations.grant_key IS NOT NULL \
           AND given_back + u.x <= taken RETURNING 1), \
     g AS (UPDATE grants SET remaining = remaining + u.x, spent = CASE WHEN remaining + u.x = 0 THEN 1 ELSE 0 END \
           FROM unnest($19::bigint[], $20::bigint[]) AS u(key, x) \
           WHERE grants.account_id = $16 AND grants.key = u.key AND expired_at IS NULL RETURNING 1) \
     SELECT (SELECT count(*) FROM j) AS jobs, (SELECT count(*) FROM t) AS attempts, (SELECT count(*) FROM i) AS items, \
     (SELECT balance FROM b) AS balance, (SELECT last_account_seq FROM b) AS entries, \
     (SELECT alert_floor FROM b) AS alert_floor, (SELECT alert_ceiling FROM b) AS alert_ceiling, \
     (SELECT spend_limited FROM b) AS spend_limited, \
     (SELECT count(*) FROM p) AS parts, (SELECT count(*) FROM g) AS grants";

/// The lease holder's failure in the plan, `job` locked: `Ok(None)` when it is not in the plan's
/// shape (nothing written; the caller takes the existing path), else the job as it now is.
pub(crate) async fn holder_fails(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    failure: &Failure<'_>,
    ahead: Option<PlanRead>,
) -> Result<Option<Job>, StoreError> {
    let outcome = fail_outcome(job, failure);
    let in_shape = outcome != FailOutcome::Teardown
        && !Rail::of(&job.kind).is_reserved()
        && job.state == JobState::Running
        && failure.attempt_result == AttemptResult::Failed
        && failure.reported.is_some()
        && cx.broken.is_none();
    if !in_shape {
        return Ok(None);
    }
    let PlanRead { mut items, net, parts, next_expiry, .. } = plan_read(db, job, &IntentKind::Fail, ahead).await?;
    let refunds = job::refunds_on(job.refund_on, outcome);
    let Some(Refund { back, to_grants, moved }) = refund_of(refunds, &items, &parts)? else { return Ok(None) };
    // Every posting waits for the account's due grants to expire first (`postings`): the existing
    // path does that.
    if !moved.is_empty() && next_expiry.is_none_or(|at| at <= cx.now.micros()) {
        return Ok(None);
    }
    let Aftermath { state, not_before, base_step, .. } = aftermath(cx, job, failure);
    let total = Credits::checked_sum(moved.iter().map(|m| Credits::new(m.1)))?;
    let code = failure.code.as_str();
    let reported = failure.reported.expect("in shape: the worker's report");
    let (parts_back, grants_back) = (back.len(), to_grants.len());
    let (back_ids, back_x): (Vec<i64>, Vec<i64>) = back.into_iter().unzip();
    let (grant_keys, grant_x): (Vec<i64>, Vec<i64>) = to_grants.into_iter().unzip();
    let wrote = db
        .one(
            FAIL_WRITE,
            &[
                Value::from(job.id.as_str()),
                job.state.as_str().into(),
                state.as_str().into(),
                not_before.into(),
                code.into(),
                failure.message.into(),
                cx.now.micros().into(),
                base_step.into(),
                failure.attempt_result.as_str().into(),
                reported.signal.into(),
                reported.sent_code.into(),
                job.attempt.into(),
                Value::Texts(moved.iter().map(|m| m.0.clone()).collect()),
                total.get().into(),
                (moved.len() as i64).into(),
                job.account_id.as_str().into(),
                Value::I64s(back_ids),
                Value::I64s(back_x),
                Value::I64s(grant_keys),
                Value::I64s(grant_x),
            ],
        )
        .await?;
    let counts = [
        ("job", wrote.i64(FailWroteCol::jobs)?, 1),
        ("items", wrote.i64(FailWroteCol::items)?, moved.len() as i64),
        ("allocation parts", wrote.i64(FailWroteCol::parts)?, parts_back as i64),
    ];
    check_counts("the failure of job", &job.id, &counts)?;
    // The account's side, read before its row was locked: a guard that missed is a stale read.
    let balance = (wrote.opt_i64(FailWroteCol::balance)?).zip(wrote.opt_i64(FailWroteCol::entries)?);
    let grants = wrote.i64(FailWroteCol::grants)?;
    if grants != grants_back as i64 || balance.is_some() == moved.is_empty() {
        return Err(StoreError::Retryable(format!(
            "the account of job {} moved between the failure's read and its write (a grant expired or came due)",
            job.id
        )));
    }
    cx.point(CrashPoint::AfterGuard)?;
    if let Some((balance, entries)) = balance {
        let band = super::alerts::Band {
            floor: wrote.opt_i64(FailWroteCol::alert_floor)?,
            ceiling: wrote.opt_i64(FailWroteCol::alert_ceiling)?,
        };
        let lines = queue_lines(cx, job, &moved, balance, entries)?;
        super::alerts::after_posting(db, cx, &job.account_id, band, &lines).await?;
        // The refunds give back what the job's charges spent (`total` is what they credit).
        let limited = wrote.i64(FailWroteCol::spend_limited)? == 1;
        super::spend_limits::after_posting(db, cx, &job.account_id, limited, Some(&job.kind), -total.get()).await?;
    }
    cx.point(CrashPoint::AfterLedger)?;
    failure_events(db, cx, job, failure, &moved, (state, not_before)).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    // The answer, from the decision: the job row as written, its items as moved.
    let row = failed_row(cx, job, failure, (state, not_before), base_step);
    for item in items.iter_mut().filter(|i| moved.iter().any(|m| m.0 == i.0)) {
        item.3 = ItemState::Refunded.as_str().to_owned();
        item.4 = Some(RefundReason::JobFailed.as_str().to_owned());
    }
    let answer = assemble(cx, row, items.into_iter().map(item).collect::<Result<_, _>>()?, Credits::new(net))?;
    #[cfg(debug_assertions)]
    super::plan::assert_stored(db, cx, &answer).await?;
    Ok(Some(answer))
}

/// What a planned failure gives back: each part (id, amount), each grant's sum, each item moved
/// (id, cost).
struct Refund {
    back: Vec<(i64, i64)>,
    to_grants: Vec<(i64, i64)>,
    moved: Vec<(String, i64)>,
}

/// The refund of every charged item when `refunds`: each one's open parts, all on live grants and
/// covering its cost exactly (the existing path gives each back whole then, last taken first);
/// `None` for anything else (held items, debt parts, expired grants), which is not the plan's shape.
fn refund_of(refunds: bool, items: &[ItemRead], parts: &[PartRead]) -> Result<Option<Refund>, StoreError> {
    let mut refund = Refund { back: Vec::new(), to_grants: Vec::new(), moved: Vec::new() };
    if !refunds {
        return Ok(Some(refund));
    }
    let charged = ItemState::Charged.as_str();
    for (id, cost, hold, _, _) in items.iter().filter(|i| i.3 == charged) {
        if hold.is_some() {
            return Ok(None);
        }
        let mut covered = 0_i64;
        for (part, grant, _, open, live) in parts.iter().filter(|p| p.2.as_deref() == Some(id.as_str())) {
            let (Some(grant), Some(true)) = (grant, live) else { return Ok(None) };
            covered = covered.checked_add(*open).ok_or(StoreError::Overflow)?;
            refund.back.push((*part, *open));
            match refund.to_grants.iter_mut().find(|(k, _)| k == grant) {
                Some((_, sum)) => *sum = sum.checked_add(*open).ok_or(StoreError::Overflow)?,
                None => refund.to_grants.push((*grant, *open)),
            }
        }
        if covered != *cost {
            return Ok(None);
        }
        refund.moved.push((id.clone(), *cost));
    }
    Ok(Some(refund))
}

/// `job.refunded` when anything was, then `job.retry_scheduled` or `job.dead`, as `apply_failure`
/// writes them; `to` is the state and `not_before` the failure wrote.
async fn failure_events(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    failure: &Failure<'_>,
    moved: &[(String, i64)],
    (state, not_before): (JobState, i64),
) -> Result<(), StoreError> {
    let code = failure.code.as_str();
    if !moved.is_empty() {
        let total = Credits::checked_sum(moved.iter().map(|m| Credits::new(m.1)))?;
        let items: Vec<&str> = moved.iter().map(|m| m.0.as_str()).collect();
        let data = serde_json::json!({ "reason": "job_failed", "code": code, "amount": total.get(), "items": items });
        emit(db, cx, EventKind::JobRefunded, Some(&job.id), &job.account_id, data).await?;
    }
    let rfc = Timestamp::from_micros(not_before).rfc3339();
    let data =
        serde_json::json!({ "code": code, "message": failure.message, "attempt": job.attempt, "not_before": rfc });
    let event = if state == JobState::Queued { EventKind::JobRetryScheduled } else { EventKind::JobDead };
    emit(db, cx, event, Some(&job.id), &job.account_id, data).await
}

/// The job row as a planned failure wrote it.
fn failed_row(
    cx: &Cx,
    job: &JobRow,
    failure: &Failure<'_>,
    (state, not_before): (JobState, i64),
    base_step: i64,
) -> JobRow {
    let mut row = job.clone();
    row.state = state;
    row.not_before = not_before;
    row.lease_token = None;
    row.lease_expires_at = None;
    row.last_error_code = Some(failure.code.as_str().to_owned());
    row.last_error_message = failure.message.map(str::to_owned);
    row.unknown_since = None;
    row.updated_at = cx.now.micros();
    row.budget_base += base_step;
    row
}

/// The refund lines, one per item in the job's order, queued for the flush as `ledger::append`
/// queues them: the balance UPDATE returned the balance after the last line and the account's
/// last position. Returns the lines as the alerts see them.
fn queue_lines(
    cx: &Cx,
    job: &JobRow,
    moved: &[(String, i64)],
    balance: i64,
    entries: i64,
) -> Result<Vec<super::alerts::LineAt>, StoreError> {
    let pending = cx.pending.as_ref().ok_or_else(|| StoreError::internal("a plan without the transaction's queue"))?;
    let total = Credits::checked_sum(moved.iter().map(|m| Credits::new(m.1)))?;
    let mut after = Credits::new(balance).checked_sub(total)?;
    let first = entries - moved.len() as i64 + 1;
    let mut pending = lock_pending(pending);
    let mut lines = Vec::with_capacity(moved.len());
    for ((item, cost), account_seq) in moved.iter().zip(first..) {
        after = after.checked_add(Credits::new(*cost))?;
        lines.push(super::alerts::LineAt { balance_after: after.get(), amount: *cost, seq: None, account_seq });
        pending.lines.push(PendingLine {
            account_id: job.account_id.clone(),
            account_seq,
            kind: EntryKind::Refund,
            amount: *cost,
            balance_after: after.get(),
            job_id: Some(job.id.clone()),
            item_id: Some(item.clone()),
            ref_id: None,
            reason: Some(RefundReason::JobFailed.as_str().to_owned()),
            request_hash: None,
            created_at: cx.now.micros(),
        });
    }
    Ok(lines)
}
