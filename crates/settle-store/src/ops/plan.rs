//! The plan per operation (docs/design/batch-plan.md §10), PostgreSQL: an operation in its common
//! shape is three statements whatever it moves — lock the job, read what the decision needs (its
//! snapshot taken after the lock), and write every table it changes in one statement, each
//! table's change still a guarded conditional write whose count is checked. The decision is the
//! existing code's, made in Rust from the rows read; an operation in any other shape is decided by
//! the existing code, in the same transaction, from the same locked job (nothing was written yet).
//!
//! What the read takes from under the job's lock is current until the write: every writer of a
//! job's items, attempts and allocation parts holds the job row. What it takes from the account's
//! side (whether a grant has expired, whether one is due) is not locked yet — the account row is
//! locked by the write's balance UPDATE, as on the existing path — so the write guards it again
//! (`expired_at IS NULL`, `next_expiry > now`), and a guard that misses there is a read gone stale:
//! `Retryable`, the transaction rolled back and the operation run again.
//!
//! In the plan so far: the lease holder's failure (`holder_fails`), a new job (`creates`), a success
//! reported with a lease token (`succeeds`).

use super::allocations::Spend;
use super::create::{Terms, ValidJob, as_written, charge_lines, queued};
use super::failure::{Aftermath, Failure, aftermath, fail_outcome};
use super::{
    BalanceCheck, Cx, Holds, JobRow, Line, PendingLine, Posting, assemble, debits_from_grants, emit, lock_pending,
    post_balance,
};
use crate::db::{Db, Value, args, columns};
use crate::error::StoreError;
use crate::model::{Item, Job};
use settle_core::crash::CrashPoint;
use settle_core::history::{AttemptResult, EventKind};
use settle_core::ids::ItemId;
use settle_core::item::{ItemState, RefundReason};
use settle_core::job::{self, FailOutcome, JobState};
use settle_core::ledger::{AllocationKind, EntryKind};
use settle_core::{Credits, Timestamp, limits};
use std::sync::LazyLock;

columns! {
    /// Step 2 of a failure: the job's items (in order), its net as stored, and the open parts of
    /// its items with whether each part's grant is live.
    FailReadCol {
        items = "(SELECT CAST(json_agg(json_build_array(item_id, cost, hold, state, refund_reason) ORDER BY ord) AS text) \
                 FROM items WHERE job_id = $1)",
        net = "(SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_id = $1)",
        parts = "(SELECT CAST(json_agg(json_build_array(p.id, p.grant_key, p.item_id, p.taken - p.given_back, \
                 g.expired_at IS NULL) ORDER BY p.id DESC) AS text) FROM allocations p LEFT JOIN grants g ON g.key = p.grant_key \
                 WHERE p.job_id = $1 AND p.given_back < p.taken)",
        next_expiry = "(SELECT next_expiry FROM accounts WHERE id = $2)",
    }
}

static FAIL_READ: LazyLock<String> = LazyLock::new(|| format!("SELECT {}", FailReadCol::LIST));

/// An item as read: id, cost, hold, state, refund reason.
type ItemRead = (String, i64, Option<i64>, String, Option<String>);
/// An open part as read: id, grant, item, open, whether its grant is live.
type PartRead = (i64, Option<i64>, Option<String>, i64, Option<bool>);

columns! {
    /// What step 3 of a failure changed, table by table.
    FailWroteCol { jobs, attempts, items, balance, entries, parts, grants }
}

/// Step 3 of a failure: the job, its attempt, its refunded items, the balance, the parts given
/// back and the grants they return to — each guarded as the existing code guards it.
const FAIL_WRITE: &str = "WITH \
     j AS (UPDATE jobs SET state = $3, not_before = $4, lease_token = NULL, lease_expires_at = NULL, \
           lease_worker = NULL, last_error_code = $5, last_error_message = $6, unknown_since = NULL, updated_at = $7, \
           budget_base = budget_base + $8 WHERE id = $1 AND state = $2 RETURNING 1), \
     t AS (UPDATE attempts SET finished_at = $7, result = $9, fail_code = $5, message = $6, reported = $10, \
           sent_code = $11, expired_at = NULL, success_at = NULL \
           WHERE job_id = $1 AND attempt_no = $12 AND finished_at IS NULL RETURNING 1), \
     i AS (UPDATE items SET state = 'refunded', refund_reason = 'job_failed' \
           WHERE job_id = $1 AND item_id = ANY($13::text[]) AND state = 'charged' RETURNING 1), \
     b AS (UPDATE accounts SET balance = balance + $14, held = held - $14, exposure = exposure + $14, \
           last_account_seq = last_account_seq + $15 WHERE id = $16 AND $15 > 0 AND next_expiry > $7 \
           RETURNING balance, last_account_seq), \
     p AS (UPDATE allocations SET given_back = given_back + u.x, owed = 0 \
           FROM unnest($17::bigint[], $18::bigint[]) AS u(id, x) \
           WHERE allocations.job_id = $1 AND allocations.id = u.id AND allocations.grant_key IS NOT NULL \
           AND given_back + u.x <= taken RETURNING 1), \
     g AS (UPDATE grants SET remaining = remaining + u.x, spent = CASE WHEN remaining + u.x = 0 THEN 1 ELSE 0 END \
           FROM unnest($19::bigint[], $20::bigint[]) AS u(key, x) \
           WHERE grants.account_id = $16 AND grants.key = u.key AND expired_at IS NULL RETURNING 1) \
     SELECT (SELECT count(*) FROM j) AS jobs, (SELECT count(*) FROM t) AS attempts, (SELECT count(*) FROM i) AS items, \
     (SELECT balance FROM b) AS balance, (SELECT last_account_seq FROM b) AS entries, \
     (SELECT count(*) FROM p) AS parts, (SELECT count(*) FROM g) AS grants";

/// The lease holder's failure in the plan, `job` locked: `Ok(None)` when it is not in the plan's
/// shape (nothing written; the caller takes the existing path), else the job as it now is.
pub(crate) async fn holder_fails(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    failure: &Failure<'_>,
) -> Result<Option<Job>, StoreError> {
    let outcome = fail_outcome(job, failure);
    let in_shape = outcome != FailOutcome::Teardown
        && job.kind != job::WITHDRAWAL_KIND
        && job.state == JobState::Running
        && failure.attempt_result == AttemptResult::Failed
        && failure.reported.is_some()
        && cx.broken.is_none();
    if !in_shape {
        return Ok(None);
    }
    let read = db.one(&FAIL_READ, args![&job.id, &job.account_id]).await?;
    let mut items: Vec<ItemRead> = parse(read.opt_text(FailReadCol::items)?)?;
    let parts: Vec<PartRead> = parse(read.opt_text(FailReadCol::parts)?)?;
    let refunds = job::refunds_on(job.refund_on, outcome);
    let charged = ItemState::Charged.as_str();
    // Each refunded item's open parts, all on live grants and covering its cost exactly (the
    // existing path gives each back whole then, last taken first); anything else is not the
    // plan's shape.
    let mut back: Vec<(i64, i64)> = Vec::new();
    let mut to_grants: Vec<(i64, i64)> = Vec::new();
    let mut moved: Vec<(String, i64)> = Vec::new();
    if refunds {
        for (id, cost, hold, _, _) in items.iter().filter(|i| i.3 == charged) {
            if hold.is_some() {
                return Ok(None);
            }
            let mut covered = 0_i64;
            for (part, grant, _, open, live) in parts.iter().filter(|p| p.2.as_deref() == Some(id.as_str())) {
                let (Some(grant), Some(true)) = (grant, live) else { return Ok(None) };
                covered = covered.checked_add(*open).ok_or(StoreError::Overflow)?;
                back.push((*part, *open));
                match to_grants.iter_mut().find(|(k, _)| k == grant) {
                    Some((_, sum)) => *sum = sum.checked_add(*open).ok_or(StoreError::Overflow)?,
                    None => to_grants.push((*grant, *open)),
                }
            }
            if covered != *cost {
                return Ok(None);
            }
            moved.push((id.clone(), *cost));
        }
    }
    // Every posting waits for the account's due grants to expire first (`postings`): the existing
    // path does that.
    if !moved.is_empty() && read.opt_i64(FailReadCol::next_expiry)?.is_none_or(|at| at <= cx.now.micros()) {
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
    for (what, got, want) in counts {
        if got != want {
            return Err(StoreError::internal(format!(
                "the failure of job {} changed {got} {what}, not {want}, under the job's lock",
                job.id
            )));
        }
    }
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
        queue_lines(cx, job, &moved, balance, entries)?;
    }
    cx.point(CrashPoint::AfterLedger)?;
    if !moved.is_empty() {
        let data = serde_json::json!({ "reason": "job_failed", "code": code, "amount": total.get(), "items": moved.iter().map(|m| m.0.as_str()).collect::<Vec<_>>() });
        emit(db, cx, EventKind::JobRefunded, Some(&job.id), &job.account_id, data).await?;
    }
    let rfc = Timestamp::from_micros(not_before).rfc3339();
    let data =
        serde_json::json!({ "code": code, "message": failure.message, "attempt": job.attempt, "not_before": rfc });
    let event = if state == JobState::Queued { EventKind::JobRetryScheduled } else { EventKind::JobDead };
    emit(db, cx, event, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    // The answer, from the decision: the job row as written, its items as moved.
    let mut row = job.clone();
    row.state = state;
    row.not_before = not_before;
    row.lease_token = None;
    row.lease_expires_at = None;
    row.last_error_code = Some(code.to_owned());
    row.last_error_message = failure.message.map(str::to_owned);
    row.unknown_since = None;
    row.updated_at = cx.now.micros();
    row.budget_base += base_step;
    for item in items.iter_mut().filter(|i| moved.iter().any(|m| m.0 == i.0)) {
        item.3 = ItemState::Refunded.as_str().to_owned();
        item.4 = Some(RefundReason::JobFailed.as_str().to_owned());
    }
    let net = Credits::new(read.i64(FailReadCol::net)?);
    let answer = assemble(cx, row, items.into_iter().map(item).collect::<Result<_, _>>()?, net)?;
    #[cfg(debug_assertions)]
    assert_eq!(
        answer,
        super::must_read_job(db, cx, &job.id).await?,
        "a planned failure's answer must be what was stored"
    );
    Ok(Some(answer))
}

/// The refund lines, one per item in the job's order, queued for the flush as `ledger::append`
/// queues them: the balance UPDATE returned the balance after the last line and the account's
/// last position.
fn queue_lines(cx: &Cx, job: &JobRow, moved: &[(String, i64)], balance: i64, entries: i64) -> Result<(), StoreError> {
    let pending = cx.pending.as_ref().ok_or_else(|| StoreError::internal("a plan without the transaction's queue"))?;
    let total = Credits::checked_sum(moved.iter().map(|m| Credits::new(m.1)))?;
    let mut after = Credits::new(balance).checked_sub(total)?;
    let first = entries - moved.len() as i64 + 1;
    let mut pending = lock_pending(pending);
    for ((item, cost), account_seq) in moved.iter().zip(first..) {
        after = after.checked_add(Credits::new(*cost))?;
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
    Ok(())
}

fn parse<T: serde::de::DeserializeOwned>(json: Option<String>) -> Result<Vec<T>, StoreError> {
    match json {
        None => Ok(Vec::new()),
        Some(text) => serde_json::from_str(&text).map_err(|e| StoreError::internal(format!("a plan's read: {e}"))),
    }
}

fn item((id, cost, hold, state, reason): ItemRead) -> Result<Item, StoreError> {
    Ok(Item {
        id: super::stored_id(ItemId::stored, "item id", &id)?,
        cost: Credits::new(cost),
        hold: hold.map(Credits::new),
        state: ItemState::parse(&state).ok_or_else(|| StoreError::internal(format!("bad item state {state}")))?,
        refund_reason: reason.map(|t| super::name(RefundReason::parse, "refund reason", t)).transpose()?,
    })
}

/// The head of an account's burn-down order (`allocations::HEAD`'s first grant) taking `$T` for a
/// posting's charge lines `$U` (item ids, amounts, ordinal) numbered from `$S`, one part per line
/// that takes something — when the head has it all; else nothing, and the caller takes the general
/// way (`postings::debits_from_grants`). `$A` the account, `$J` the job, `$K` the allocation kind,
/// `$N` now: replaced by the statement's own placeholders.
const TAKE_FROM_HEAD: &str = "\
     head AS (SELECT key FROM grants WHERE account_id = $A AND spent = 0 AND expired_at IS NULL \
              ORDER BY priority, expiry_key, key LIMIT 1), \
     took AS (UPDATE grants g SET remaining = g.remaining - $T, spent = CASE WHEN g.remaining = $T THEN 1 ELSE 0 END \
              FROM head WHERE g.key = head.key AND g.remaining >= $T AND $T > 0 RETURNING g.key), \
     parts AS (INSERT INTO allocations (account_id, grant_key, kind, job_id, item_id, account_seq, taken, created_at) \
               SELECT $A, took.key, $K, $J, u.item_id, $S + u.ord - 1, u.x, $N \
               FROM took, unnest($U) WITH ORDINALITY AS u(item_id, x, ord) WHERE u.x > 0 ORDER BY u.ord RETURNING 1)";

columns! {
    /// What the write of a create changed, table by table, and whether the head grant paid.
    CreateWroteCol { jobs, items, took, parts }
}

static CREATE_WRITE: LazyLock<String> = LazyLock::new(|| {
    let take = TAKE_FROM_HEAD
        .replace("$A", "$2")
        .replace("$T", "$15")
        .replace("$K", "$16")
        .replace("$J", "$1")
        .replace("$S", "$17")
        .replace("$N", "$11")
        .replace("$U", "$12::text[], $13::bigint[]");
    format!(
        "WITH \
         j AS (INSERT INTO jobs (id, job_seq, account_id, kind, state, cost, attempt, budget_base, max_attempts, \
               refund_on, cancel_requested, not_before, lease_seconds, payload, request_hash, created_at, updated_at) \
               VALUES ($1, nextval('job_seq_numbers'), $2, $3, 'queued', $4, 0, 0, $5, $6, 0, $7, $8, $9, $10, $11, $11) \
               RETURNING 1), \
         i AS (INSERT INTO items (job_id, item_id, ord, cost, hold, state) \
               SELECT $1, u.item_id, u.ord - 1, u.cost, u.hold, 'charged' \
               FROM j, unnest($12::text[], $13::bigint[], $14::bigint[]) WITH ORDINALITY AS u(item_id, cost, hold, ord) \
               RETURNING 1), \
         {take} \
         SELECT (SELECT count(*) FROM j) AS jobs, (SELECT count(*) FROM i) AS items, (SELECT count(*) FROM took) AS took, \
         (SELECT count(*) FROM parts) AS parts"
    )
});

/// A new job (its id free, its account existing) in the plan: the charge first — the guarded
/// balance UPDATE, which locks the account row, so the head grant read after it is current, and a
/// refused charge writes nothing — then the job, its items and the head grant's take in one
/// statement. When the head grant cannot pay it all, the general take (which may split across
/// grants and run into debt) follows in the same transaction.
pub(crate) async fn creates(db: &mut Db<'_>, cx: &Cx, job: &ValidJob, fp: &[u8; 32]) -> Result<Job, StoreError> {
    let req = &job.req;
    let terms = Terms::of(cx, job);
    let lines = charge_lines(job)?;
    let holds = Holds { held: job.total.get(), exposure: 0 };
    let posting = Posting { account_id: req.account_id.as_str(), check: BalanceCheck::Overdraft, lines: &lines, holds };
    let posted = post_balance(db, cx, &posting).await?;
    let amounts: Vec<i64> = lines.iter().map(|l| -l.amount.get()).collect();
    let wrote = db
        .one(
            &CREATE_WRITE,
            &[
                Value::from(req.id.as_str()),
                req.account_id.as_str().into(),
                req.kind.as_str().into(),
                job.total.get().into(),
                i64::from(terms.max_attempts).into(),
                terms.refund_on.as_str().into(),
                terms.not_before.micros().into(),
                i64::from(limits::LEASE_SECONDS_DEFAULT).into(),
                job.payload.as_str().into(),
                Value::Blob(fp.to_vec()),
                cx.now.micros().into(),
                Value::Texts(req.items.iter().map(|i| i.id.to_string()).collect()),
                Value::I64s(amounts.clone()),
                Value::OptI64s(req.items.iter().map(|i| i.price.hold().map(|n| n.get())).collect()),
                job.total.get().into(),
                AllocationKind::of_debit(EntryKind::Charge).as_str().into(),
                posted.first_account_seq.into(),
            ],
        )
        .await?;
    let paying = amounts.iter().filter(|x| **x > 0).count() as i64;
    let took = wrote.i64(CreateWroteCol::took)?;
    let counts = [
        ("job", wrote.i64(CreateWroteCol::jobs)?, 1),
        ("items", wrote.i64(CreateWroteCol::items)?, req.items.len() as i64),
        ("allocation parts", wrote.i64(CreateWroteCol::parts)?, if took == 1 { paying } else { 0 }),
    ];
    check_counts("the create of job", req.id.as_str(), &counts)?;
    cx.point(CrashPoint::AfterGuard)?;
    if took == 0 && job.total.is_positive() {
        debits_from_grants(db, cx, &posting, &posted, Spend::Any).await?;
    }
    cx.point(CrashPoint::AfterLedger)?;
    queued(db, cx, job).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let answer = as_written(cx, job, &terms)?;
    #[cfg(debug_assertions)]
    assert_eq!(
        answer,
        super::must_read_job(db, cx, req.id.as_str()).await?,
        "a planned create's answer must be what was stored"
    );
    Ok(answer)
}

/// Every count a write returned under locks it holds equals the plan's: anything else is a bug.
fn check_counts(what: &str, id: &str, counts: &[(&str, i64, i64)]) -> Result<(), StoreError> {
    for (table, got, want) in counts {
        if got != want {
            return Err(StoreError::internal(format!("{what} {id} changed {got} {table}, not {want}, on locked rows")));
        }
    }
    Ok(())
}

columns! {
    /// Step 2 of a success: the job's items (in order), its net as stored, and the attempt that
    /// held the report's token.
    SucceedReadCol {
        items = "(SELECT CAST(json_agg(json_build_array(item_id, cost, hold, state, refund_reason) ORDER BY ord) AS text) \
                 FROM items WHERE job_id = $1)",
        net = "(SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_id = $1)",
        attempt_no = "(SELECT attempt_no FROM attempts WHERE job_id = $1 AND lease_token = $2)",
    }
}

static SUCCEED_READ: LazyLock<String> = LazyLock::new(|| format!("SELECT {}", SucceedReadCol::LIST));

columns! {
    /// What the write of a success changed, table by table, and whether the head grant paid.
    SucceedWroteCol { jobs, closed, marked, signals, items, held, took, parts }
}

static SUCCEED_WRITE: LazyLock<String> = LazyLock::new(|| {
    let take = TAKE_FROM_HEAD
        .replace("$A", "$7")
        .replace("$T", "$13")
        .replace("$K", "$14")
        .replace("$J", "$1")
        .replace("$S", "$15")
        .replace("$N", "$3")
        .replace("$U", "$16::text[], $17::bigint[]");
    format!(
        "WITH \
         j AS (UPDATE jobs SET state = 'succeeded', lease_token = NULL, lease_expires_at = NULL, lease_worker = NULL, \
               unknown_since = NULL, result = $4, updated_at = $3 WHERE id = $1 AND state = $2 RETURNING 1), \
         closed AS (UPDATE attempts SET finished_at = $3, result = 'succeeded', fail_code = NULL, message = NULL, \
               reported = 'succeed', sent_code = NULL, expired_at = NULL, success_at = $3 \
               WHERE job_id = $1 AND attempt_no = $5 AND finished_at IS NULL AND $6 = 1 RETURNING 1), \
         marked AS (UPDATE attempts SET reported = COALESCE(reported, 'succeed'), success_at = COALESCE(success_at, $3) \
               WHERE job_id = $1 AND attempt_no = $5 AND $6 = 0 RETURNING 1), \
         s AS (INSERT INTO signals (job_id, attempt_no, signal, fail_code, message, effect, received_at) \
               SELECT $1, $5, 'succeed', NULL, NULL, 'recovered', $3 WHERE $6 = 0 RETURNING 1), \
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
) -> Result<Option<Job>, StoreError> {
    let current = job.state == JobState::Running && job.lease_token.as_deref() == Some(token);
    let in_shape = cx.broken.is_none()
        && job.kind != job::WITHDRAWAL_KIND
        && !job.cancel_requested
        && JobState::SUCCEED_FROM.contains(&job.state)
        && (current || job.state != JobState::Running);
    if !in_shape {
        return Ok(None);
    }
    let read = db.one(&SUCCEED_READ, args![&job.id, token]).await?;
    let attempt_no = match (current, read.opt_i64(SucceedReadCol::attempt_no)?) {
        (true, _) => job.attempt,
        (false, Some(n)) => n,
        (false, None) => return Ok(None),
    };
    let mut items: Vec<ItemRead> = parse(read.opt_text(SucceedReadCol::items)?)?;
    if items.iter().any(|i| i.2.is_some()) {
        return Ok(None);
    }
    let (charged, refunded) = (ItemState::Charged.as_str(), ItemState::Refunded.as_str());
    let item_failed = Some(RefundReason::ItemFailed.as_str());
    let delivered: Vec<(String, i64)> = items.iter().filter(|i| i.3 == charged).map(|i| (i.0.clone(), i.1)).collect();
    // As `RECLAIM_ALL` (whose `refund_reason <> 'item_failed'` a NULL reason does not pass).
    let reclaimed: Vec<(String, i64)> = (items.iter())
        .filter(|i| i.3 == refunded && i.4.is_some() && i.4.as_deref() != item_failed)
        .map(|i| (i.0.clone(), i.1))
        .collect();
    let delivered_total = Credits::checked_sum(delivered.iter().map(|m| Credits::new(m.1)))?;
    let reclaimed_total = Credits::checked_sum(reclaimed.iter().map(|m| Credits::new(m.1)))?;
    // The reclaim's posting, with the delivery's release of its holds: one balance change.
    let lines: Vec<Line<'_>> = reclaimed
        .iter()
        .map(|(id, cost)| {
            Ok(Line {
                kind: EntryKind::Reclaim,
                amount: Credits::new(*cost).checked_neg()?,
                job_id: Some(job.id.as_str()),
                item_id: Some(id.as_str()),
                ref_id: None,
                reason: None,
                request_hash: None,
            })
        })
        .collect::<Result<_, StoreError>>()?;
    let holds = Holds { held: delivered_total.checked_neg()?.get(), exposure: reclaimed_total.checked_neg()?.get() };
    let posting = Posting { account_id: &job.account_id, check: BalanceCheck::Never, lines: &lines, holds };
    let posted = match lines.is_empty() {
        true => None,
        false => Some(post_balance(db, cx, &posting).await?),
    };
    let moves = delivered
        .iter()
        .map(|m| (m, charged, ItemState::Succeeded))
        .chain(reclaimed.iter().map(|m| (m, refunded, ItemState::Reclaimed)));
    let (mut ids, mut froms, mut tos) = (Vec::new(), Vec::new(), Vec::new());
    for ((id, _), from, to) in moves {
        ids.push(id.clone());
        froms.push(from.to_owned());
        tos.push(to.as_str().to_owned());
    }
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
    if !reclaimed.is_empty() {
        let data = serde_json::json!({ "amount": reclaimed_total.get(), "items": reclaimed.iter().map(|m| m.0.as_str()).collect::<Vec<_>>() });
        emit(db, cx, EventKind::JobReclaimed, Some(&job.id), &job.account_id, data).await?;
    }
    let data = serde_json::json!({ "from": job.state.as_str(), "attempt": job.attempt });
    emit(db, cx, EventKind::JobSucceeded, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let mut row = job.clone();
    row.state = JobState::Succeeded;
    row.lease_token = None;
    row.lease_expires_at = None;
    row.unknown_since = None;
    row.result = result.map(str::to_owned);
    row.updated_at = cx.now.micros();
    for item in &mut items {
        if delivered.iter().any(|m| m.0 == item.0) {
            item.3 = ItemState::Succeeded.as_str().to_owned();
        } else if reclaimed.iter().any(|m| m.0 == item.0) {
            item.3 = ItemState::Reclaimed.as_str().to_owned();
        }
    }
    let net = Credits::new(read.i64(SucceedReadCol::net)?);
    let answer = assemble(cx, row, items.into_iter().map(item).collect::<Result<_, _>>()?, net)?;
    #[cfg(debug_assertions)]
    assert_eq!(
        answer,
        super::must_read_job(db, cx, &job.id).await?,
        "a planned success's answer must be what was stored"
    );
    Ok(Some(answer))
}
