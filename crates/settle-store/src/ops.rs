//! Every write of Settle, written once for both engines. Each function runs inside a transaction
//! the caller opened (on SQLite, a savepoint inside the writer's batch).
//!
//! The shape of every transition: lock and read the job row (PostgreSQL `FOR UPDATE`; on SQLite
//! the single writer already serialises), decide with the pure functions of `settle-core`, then
//! apply the decision as guarded `UPDATE … WHERE state = <from> …` statements whose row counts are
//! asserted, the ledger rows, the server-side balance change and the outbox event — all in the
//! one transaction. Nothing here reads the system clock or keeps money in application state.

use crate::db::{Db, Engine, Row, args};
use crate::error::StoreError;
use crate::model::*;
use settle_core::backoff::SplitMix64;
use settle_core::crash::CrashPoint;
use settle_core::fingerprint::Fingerprint;
use settle_core::ids::{AccountId, FailCode, ItemId, JobId};
use settle_core::item::{self, ItemSignal, ItemState, RefundReason};
use settle_core::job::{self, FailOutcome, JobState, Policies, RefundPolicy};
use settle_core::ledger::{EntryFields, EntryKind, GENESIS_HASH, Hash32, chain_hash};
use settle_core::limits;
use settle_core::{Credits, Timestamp};
use std::sync::{Arc, Mutex};

/// Who sends a signal. Withdrawals move only through the payout processor and reconciler (the
/// provider is their only source of truth); every other job only through workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caller {
    Worker,
    PayoutProcessor,
}

/// Refuses a signal whose caller may not move this job (docs/decisions/0010).
pub(crate) fn check_caller(job: &JobRow, caller: Caller) -> Result<(), StoreError> {
    let is_withdrawal = job.kind == job::WITHDRAWAL_KIND;
    match (is_withdrawal, caller) {
        (true, Caller::Worker) => Err(StoreError::InvalidTransition {
            job: job.id.clone(),
            action: "take worker signals (withdrawals are settled by the payout processor against the provider)",
            state: job.state.as_str().to_owned(),
        }),
        (false, Caller::PayoutProcessor) => Err(StoreError::InvalidTransition {
            job: job.id.clone(),
            action: "be settled as a payout (it is not a withdrawal)",
            state: job.state.as_str().to_owned(),
        }),
        _ => Ok(()),
    }
}

/// Asked at every crash point; answers whether to "crash" there.
pub trait CrashHook: Send + Sync {
    fn should_crash(&self, point: CrashPoint) -> bool;
}

/// What every operation needs besides the connection.
pub(crate) struct Cx {
    pub now: Timestamp,
    pub policy: Arc<Policies>,
    pub rng: Arc<Mutex<SplitMix64>>,
    pub crash: Option<Arc<dyn CrashHook>>,
    /// PostgreSQL: the transaction's ledger lines and events, numbered by `flush` just before its
    /// COMMIT (docs/decisions/0013). `None` on SQLite, whose single writer numbers them at once.
    pub pending: Option<Arc<Mutex<Pending>>>,
}

/// Ledger lines and outbox events of one PostgreSQL transaction, in the order they were written,
/// waiting for their numbers. Shared by every operation of a batch; the batch runner cuts it back
/// to the mark taken before an operation that fails.
#[derive(Default)]
pub(crate) struct Pending {
    pub lines: Vec<PendingLine>,
    pub events: Vec<PendingEvent>,
}

pub(crate) struct PendingLine {
    pub account_id: String,
    pub kind: EntryKind,
    pub amount: i64,
    pub balance_after: i64,
    pub job_id: Option<String>,
    pub item_id: Option<String>,
    pub ref_id: Option<String>,
    pub reason: Option<String>,
    pub request_hash: Option<Vec<u8>>,
    pub created_at: i64,
}

pub(crate) struct PendingEvent {
    pub kind: &'static str,
    pub job_id: Option<String>,
    pub account_id: String,
    pub data: String,
    pub created_at: i64,
}

impl Pending {
    pub fn mark(&self) -> (usize, usize) {
        (self.lines.len(), self.events.len())
    }

    pub fn truncate(&mut self, (lines, events): (usize, usize)) {
        self.lines.truncate(lines);
        self.events.truncate(events);
    }

    /// What the transaction has queued so far for one job (added to its `net`).
    fn job_amount(&self, job_id: &str) -> Result<Credits, StoreError> {
        Ok(Credits::checked_sum(
            self.lines.iter().filter(|l| l.job_id.as_deref() == Some(job_id)).map(|l| Credits::new(l.amount)),
        )?)
    }
}

fn lock_pending(pending: &Mutex<Pending>) -> std::sync::MutexGuard<'_, Pending> {
    pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Cx {
    pub fn point(&self, point: CrashPoint) -> Result<(), StoreError> {
        match &self.crash {
            Some(hook) if hook.should_crash(point) => Err(StoreError::InjectedCrash(point.name())),
            _ => Ok(()),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Reading rows

/// The job row's columns, in the order `job_row` decodes them (a macro, so statements can be
/// assembled with `concat!`).
macro_rules! job_columns {
    () => {
        "id, account_id, kind, state, cost, attempt, budget_base, max_attempts, refund_on, \
         cancel_requested, not_before, lease_token, lease_expires_at, lease_worker, last_error_code, \
         last_error_message, unknown_since, payload, request_hash, created_at, updated_at, lease_seconds, job_seq, result"
    };
}
pub(crate) const JOB_COLUMNS: &str = job_columns!();

/// A job row as stored, before its items are attached.
#[derive(Debug, Clone)]
pub(crate) struct JobRow {
    pub id: String,
    pub account_id: String,
    pub kind: String,
    pub state: JobState,
    pub cost: i64,
    pub attempt: i64,
    pub budget_base: i64,
    pub max_attempts: i64,
    pub refund_on: RefundPolicy,
    pub cancel_requested: bool,
    pub not_before: i64,
    pub lease_token: Option<String>,
    pub lease_expires_at: Option<i64>,
    pub last_error_code: Option<String>,
    pub last_error_message: Option<String>,
    pub unknown_since: Option<i64>,
    pub payload: String,
    pub request_hash: Vec<u8>,
    pub created_at: i64,
    pub updated_at: i64,
    pub lease_seconds: i64,
    pub job_seq: i64,
    pub result: Option<String>,
}

pub(crate) fn job_row(r: &Row) -> Result<JobRow, StoreError> {
    let state = r.text(3)?;
    let refund_on = r.text(8)?;
    Ok(JobRow {
        id: r.text(0)?,
        account_id: r.text(1)?,
        kind: r.text(2)?,
        state: JobState::parse(&state).ok_or_else(|| StoreError::internal(format!("bad job state {state}")))?,
        cost: r.i64(4)?,
        attempt: r.i64(5)?,
        budget_base: r.i64(6)?,
        max_attempts: r.i64(7)?,
        refund_on: RefundPolicy::parse(&refund_on)
            .ok_or_else(|| StoreError::internal(format!("bad refund policy {refund_on}")))?,
        cancel_requested: r.i64(9)? != 0,
        not_before: r.i64(10)?,
        lease_token: r.opt_text(11)?,
        lease_expires_at: r.opt_i64(12)?,
        last_error_code: r.opt_text(14)?,
        last_error_message: r.opt_text(15)?,
        unknown_since: r.opt_i64(16)?,
        payload: r.text(17)?,
        request_hash: r.blob(18)?,
        created_at: r.i64(19)?,
        updated_at: r.i64(20)?,
        lease_seconds: r.i64(21)?,
        job_seq: r.i64(22)?,
        result: r.opt_text(23)?,
    })
}

const SELECT_JOB: &str = concat!("SELECT ", job_columns!(), " FROM jobs WHERE id = $1");
const LOCK_JOB_PG: &str = concat!("SELECT ", job_columns!(), " FROM jobs WHERE id = $1 FOR UPDATE");

/// Reads the job row and, on PostgreSQL, locks it until commit. Every job transition starts here,
/// so the decision below is made on a row no one else can change (lock order: job → items →
/// account → counters).
pub(crate) async fn lock_job(db: &mut Db<'_>, id: &str) -> Result<Option<JobRow>, StoreError> {
    let sql = match db.engine() {
        Engine::Sqlite => SELECT_JOB,
        Engine::Postgres => LOCK_JOB_PG,
    };
    db.opt(sql, args![id]).await?.map(|r| job_row(&r)).transpose()
}

pub(crate) async fn must_lock_job(db: &mut Db<'_>, id: &str) -> Result<JobRow, StoreError> {
    lock_job(db, id).await?.ok_or_else(|| StoreError::not_found("job", id))
}

pub(crate) async fn read_job(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Option<Job>, StoreError> {
    let Some(row) = db.opt(SELECT_JOB, args![id]).await? else { return Ok(None) };
    let row = job_row(&row)?;
    Ok(Some(attach(db, cx, row).await?))
}

pub(crate) async fn must_read_job(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Job, StoreError> {
    read_job(db, cx, id).await?.ok_or_else(|| StoreError::not_found("job", id))
}

/// Completes a job row with its items and its net (the sum of its ledger entries, those the
/// transaction has queued included).
pub(crate) async fn attach(db: &mut Db<'_>, cx: &Cx, row: JobRow) -> Result<Job, StoreError> {
    // One statement: the items, each row carrying the job's net (an uncorrelated subquery, run once).
    let rows = db
        .all(
            "SELECT item_id, cost, state, refund_reason, \
             (SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_id = $1) \
             FROM items WHERE job_id = $1 ORDER BY ord",
            args![&row.id],
        )
        .await?;
    let items = rows.iter().map(item_from_row).collect::<Result<Vec<_>, _>>()?;
    let mut net = match rows.first() {
        Some(r) => Credits::new(r.i64(4)?),
        None => Credits::ZERO,
    };
    if let Some(pending) = &cx.pending {
        net = net.checked_add(lock_pending(pending).job_amount(&row.id)?)?;
    }
    Ok(Job {
        id: row.id,
        account_id: row.account_id,
        kind: row.kind,
        state: row.state,
        cost: Credits::new(row.cost),
        net,
        attempt: u32::try_from(row.attempt).map_err(StoreError::internal)?,
        max_attempts: u32::try_from(row.max_attempts).map_err(StoreError::internal)?,
        budget_base: u32::try_from(row.budget_base).map_err(StoreError::internal)?,
        refund_on: row.refund_on,
        cancel_requested: row.cancel_requested,
        not_before: Timestamp::from_micros(row.not_before),
        lease_expires_at: row.lease_expires_at.map(Timestamp::from_micros),
        last_error: row.last_error_code.map(|code| LastError { code, message: row.last_error_message }),
        items,
        payload: row.payload,
        result: row.result,
        created_at: Timestamp::from_micros(row.created_at),
        updated_at: Timestamp::from_micros(row.updated_at),
    })
}

fn item_from_row(r: &Row) -> Result<Item, StoreError> {
    let state = r.text(2)?;
    Ok(Item {
        id: r.text(0)?,
        cost: Credits::new(r.i64(1)?),
        state: ItemState::parse(&state).ok_or_else(|| StoreError::internal(format!("bad item state {state}")))?,
        refund_reason: r.opt_text(3)?,
    })
}

pub(crate) fn entry_from_row(r: &Row) -> Result<LedgerEntry, StoreError> {
    let kind = r.text(2)?;
    let hash = r.blob(10)?;
    Ok(LedgerEntry {
        seq: r.i64(0)?,
        account_id: r.text(1)?,
        kind: EntryKind::parse(&kind).ok_or_else(|| StoreError::internal(format!("bad entry kind {kind}")))?,
        amount: Credits::new(r.i64(3)?),
        balance_after: Credits::new(r.i64(4)?),
        job_id: r.opt_text(5)?,
        item_id: r.opt_text(6)?,
        ref_id: r.opt_text(7)?,
        reason: r.opt_text(8)?,
        created_at: Timestamp::from_micros(r.i64(9)?),
        hash: hash.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes"))?,
    })
}

pub(crate) fn account_from_row(r: &Row) -> Result<Account, StoreError> {
    Ok(Account {
        id: AccountId::parse(&r.text(0)?)?,
        balance: Credits::new(r.i64(1)?),
        overdraft_limit: Credits::new(r.i64(2)?),
        created_at: Timestamp::from_micros(r.i64(3)?),
    })
}

// ---------------------------------------------------------------------------------------------
// Ledger, counters, events

/// Reserves `n` numbers of a gap-free counter; returns the first.
pub(crate) async fn next_seq(db: &mut Db<'_>, counter: &'static str, n: i64) -> Result<i64, StoreError> {
    debug_assert!(n >= 1);
    let row =
        db.one("UPDATE counters SET value = value + $2 WHERE name = $1 RETURNING value", args![counter, n]).await?;
    Ok(row.i64(0)? - n + 1)
}

/// How a balance change may be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BalanceCheck {
    /// Charges: the balance may not go below `-overdraft_limit`.
    Overdraft,
    /// Grants and adjustments: the balance stays within `±BALANCE_MAX`, so refunds of outstanding
    /// charges can never overflow.
    Bounded,
    /// Refunds and reclaims: never refused (a reclaim may take the balance negative).
    Never,
}

// Debits (charges, negative adjustments) keep `balance − exposure ≥ −BALANCE_MAX`: the balance
// after every possible reclaim stays inside i64 (docs/decisions/0003).
// Each also moves `held` by $4 and `exposure` by $5 (`Holds`) in the same statement; the guards
// read the values from before it, as when they were separate statements after the balance.
const DEBIT_OVERDRAFT: &str = "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5 \
     WHERE id = $1 AND balance >= (0 - overdraft_limit) - $2 AND balance - exposure >= (0 - $3) - $2 \
     RETURNING balance";
// Credits (grants, positive adjustments) keep `balance + held ≤ BALANCE_MAX`: the balance after every
// refund and return still possible stays inside i64 (docs/decisions/0003).
const CREDIT_BOUNDED: &str = "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5 \
     WHERE id = $1 AND balance + held <= $3 - $2 RETURNING balance";
const DEBIT_BOUNDED: &str = "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5 \
     WHERE id = $1 AND balance - exposure >= (0 - $3) - $2 RETURNING balance";
const CREDIT_ANY: &str = "UPDATE accounts SET balance = balance + $2, held = held + $3, exposure = exposure + $4 \
     WHERE id = $1 RETURNING balance";
const HOLDS_ONLY: &str = "UPDATE accounts SET held = held + $2, exposure = exposure + $3 WHERE id = $1";

/// How a transition moves an account's `held` (what later refunds and returns could add back) and
/// `exposure` (what a later success could reclaim), written with its balance change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Holds {
    pub held: i64,
    pub exposure: i64,
}

/// `holds` alone, for a transition that moves no money (an item succeeding leaves the held set).
async fn change_holds(db: &mut Db<'_>, account_id: &str, holds: Holds) -> Result<(), StoreError> {
    if holds == Holds::default() {
        return Ok(());
    }
    let rows = db.exec(HOLDS_ONLY, args![account_id, holds.held, holds.exposure]).await?;
    guard_hit(rows, "held")
}

/// One ledger line to append.
pub(crate) struct Line<'a> {
    pub kind: EntryKind,
    pub amount: Credits,
    pub job_id: Option<&'a str>,
    pub item_id: Option<&'a str>,
    pub ref_id: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub request_hash: Option<&'a [u8; 32]>,
}

/// Appends `lines` to one account's ledger: one server-side balance change for their sum (guarded
/// per `check`), then the lines themselves — at once on SQLite; on PostgreSQL queued for `flush`,
/// which numbers and chains them just before COMMIT (docs/decisions/0013).
pub(crate) async fn post(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    check: BalanceCheck,
    lines: &[Line<'_>],
    holds: Holds,
) -> Result<(), StoreError> {
    if lines.is_empty() {
        return change_holds(db, account_id, holds).await;
    }
    let Some(pending) = &cx.pending else {
        post_lines(db, cx, account_id, check, lines, holds).await?;
        return Ok(());
    };
    let total = Credits::checked_sum(lines.iter().map(|l| l.amount))?;
    let balance_end = change_balance(db, account_id, check, total, holds).await?;
    let mut balance = Credits::new(balance_end).checked_sub(total)?;
    let mut pending = lock_pending(pending);
    for line in lines {
        balance = balance.checked_add(line.amount)?;
        pending.lines.push(PendingLine {
            account_id: account_id.to_owned(),
            kind: line.kind,
            amount: line.amount.get(),
            balance_after: balance.get(),
            job_id: line.job_id.map(str::to_owned),
            item_id: line.item_id.map(str::to_owned),
            ref_id: line.ref_id.map(str::to_owned),
            reason: line.reason.map(str::to_owned),
            request_hash: line.request_hash.map(|h| h.to_vec()),
            created_at: cx.now.micros(),
        });
    }
    assert_eq!(balance.get(), balance_end, "ledger lines must sum to the balance change");
    Ok(())
}

/// The guarded balance change for a posting of `total`; returns the balance after it.
async fn change_balance(
    db: &mut Db<'_>,
    account_id: &str,
    check: BalanceCheck,
    total: Credits,
    holds: Holds,
) -> Result<i64, StoreError> {
    let (held, exposure) = (holds.held, holds.exposure);
    let row = match check {
        BalanceCheck::Overdraft => {
            debug_assert!(!total.is_positive());
            db.opt(DEBIT_OVERDRAFT, args![account_id, total.get(), limits::BALANCE_MAX, held, exposure]).await?
        }
        BalanceCheck::Bounded if total.is_negative() => {
            db.opt(DEBIT_BOUNDED, args![account_id, total.get(), limits::BALANCE_MAX, held, exposure]).await?
        }
        BalanceCheck::Bounded => {
            db.opt(CREDIT_BOUNDED, args![account_id, total.get(), limits::BALANCE_MAX, held, exposure]).await?
        }
        BalanceCheck::Never => db.opt(CREDIT_ANY, args![account_id, total.get(), held, exposure]).await?,
    };
    let Some(row) = row else {
        let current = db
            .opt("SELECT balance, overdraft_limit FROM accounts WHERE id = $1", args![account_id])
            .await?
            .ok_or_else(|| StoreError::not_found("account", account_id))?;
        return Err(match check {
            BalanceCheck::Overdraft => StoreError::InsufficientCredits {
                balance: current.i64(0)?,
                overdraft_limit: current.i64(1)?,
                needed: total.checked_neg()?.get(),
            },
            _ => StoreError::Overflow,
        });
    };
    row.i64(0)
}

/// `post`, with the lines numbered and written at once, for an answer that is the entry itself
/// (grants, adjustments). On PostgreSQL this takes the ledger counter now and holds it to COMMIT, so
/// it runs in a transaction of its own; nothing may be queued before it.
pub(crate) async fn post_now(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    check: BalanceCheck,
    lines: &[Line<'_>],
) -> Result<Vec<LedgerEntry>, StoreError> {
    if let Some(pending) = &cx.pending
        && !lock_pending(pending).lines.is_empty()
    {
        return Err(StoreError::internal("post_now after queued ledger lines would fork the chain"));
    }
    post_lines(db, cx, account_id, check, lines, Holds::default()).await
}

/// Posts and writes `lines` at once, numbered from the `ledger` counter.
async fn post_lines(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    check: BalanceCheck,
    lines: &[Line<'_>],
    holds: Holds,
) -> Result<Vec<LedgerEntry>, StoreError> {
    if lines.is_empty() {
        change_holds(db, account_id, holds).await?;
        return Ok(Vec::new());
    }
    let total = Credits::checked_sum(lines.iter().map(|l| l.amount))?;
    let balance_end = change_balance(db, account_id, check, total, holds).await?;
    let mut balance = Credits::new(balance_end).checked_sub(total)?;
    let mut prev = chain_head(db, account_id).await?;
    let first_seq = next_seq(db, "ledger", lines.len() as i64).await?;
    let mut out = Vec::with_capacity(lines.len());
    for (i, line) in lines.iter().enumerate() {
        balance = balance.checked_add(line.amount)?;
        let seq = first_seq + i as i64;
        let fields = EntryFields {
            seq,
            account_id,
            kind: line.kind,
            amount: line.amount.get(),
            balance_after: balance.get(),
            job_id: line.job_id,
            item_id: line.item_id,
            ref_id: line.ref_id,
            reason: line.reason,
            created_at: cx.now.micros(),
        };
        let hash = chain_hash(&prev, &fields);
        db.exec(
            "INSERT INTO ledger_entries (seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason, \
             request_hash, created_at, prev_hash, hash) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
            args![
                seq,
                account_id,
                line.kind.as_str(),
                line.amount.get(),
                balance.get(),
                line.job_id,
                line.item_id,
                line.ref_id,
                line.reason,
                line.request_hash.map(|h| h.to_vec()),
                cx.now.micros(),
                &prev,
                &hash
            ],
        )
        .await?;
        out.push(LedgerEntry {
            seq,
            account_id: account_id.to_owned(),
            kind: line.kind,
            amount: line.amount,
            balance_after: balance,
            job_id: line.job_id.map(str::to_owned),
            item_id: line.item_id.map(str::to_owned),
            ref_id: line.ref_id.map(str::to_owned),
            reason: line.reason.map(str::to_owned),
            created_at: cx.now,
            hash,
        });
        prev = hash;
    }
    assert_eq!(balance.get(), balance_end, "ledger lines must sum to the balance change");
    Ok(out)
}

/// The hash of an account's newest entry (the genesis hash for an account without entries).
async fn chain_head(db: &mut Db<'_>, account_id: &str) -> Result<Hash32, StoreError> {
    match db
        .opt("SELECT hash FROM ledger_entries WHERE account_id = $1 ORDER BY seq DESC LIMIT 1", args![account_id])
        .await?
    {
        Some(r) => r.blob(0)?.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes")),
        None => Ok(GENESIS_HASH),
    }
}

/// Appends one outbox event: numbered at once on SQLite; on PostgreSQL queued for `flush`.
pub(crate) async fn emit(
    db: &mut Db<'_>,
    cx: &Cx,
    kind: &'static str,
    job_id: Option<&str>,
    account_id: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    if let Some(pending) = &cx.pending {
        lock_pending(pending).events.push(PendingEvent {
            kind,
            job_id: job_id.map(str::to_owned),
            account_id: account_id.to_owned(),
            data: data.to_string(),
            created_at: cx.now.micros(),
        });
        return Ok(());
    }
    let seq = next_seq(db, "outbox", 1).await?;
    db.exec(
        "INSERT INTO outbox (seq, type, job_id, account_id, data, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
        args![seq, kind, job_id, account_id, data.to_string(), cx.now.micros()],
    )
    .await?;
    if db.engine() == Engine::Postgres && wakes_claims(kind) {
        db.exec("SELECT pg_notify('settle_wake', '')", &[]).await?;
    }
    Ok(())
}

/// Events after which work may be due: a PostgreSQL transaction that writes one wakes the
/// long-polling claims of every process at its commit (NOTIFY is delivered only if it commits).
fn wakes_claims(kind: &str) -> bool {
    matches!(kind, "job.queued" | "job.retry_scheduled" | "job.requeued")
}

/// PostgreSQL, the last statements before COMMIT: numbers the transaction's queued ledger lines
/// and events from the gap-free counters and writes them, one statement each (decision 0013).
/// The previous hash of each account is read before the counter is taken; it cannot change
/// meanwhile, as this transaction holds the row of every account it posted to. From the counter
/// UPDATE to the end of COMMIT nothing here waits for another transaction's row.
pub(crate) async fn flush(db: &mut Db<'_>, pending: &Pending) -> Result<(), StoreError> {
    use crate::db::Value;
    if !pending.lines.is_empty() {
        let mut accounts: Vec<&str> = Vec::new();
        for line in &pending.lines {
            if !accounts.contains(&line.account_id.as_str()) {
                accounts.push(&line.account_id);
            }
        }
        let mut heads: std::collections::HashMap<String, Hash32> = std::collections::HashMap::new();
        let rows = db
            .all(
                "SELECT a.id, (SELECT e.hash FROM ledger_entries e WHERE e.account_id = a.id ORDER BY e.seq DESC LIMIT 1) \
                 FROM unnest($1::text[]) AS a(id)",
                &[Value::Texts(accounts.iter().map(|a| a.to_string()).collect())],
            )
            .await?;
        for r in &rows {
            let head = match r.opt_blob(1)? {
                Some(h) => h.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes"))?,
                None => GENESIS_HASH,
            };
            heads.insert(r.text(0)?, head);
        }
        let first = next_seq(db, "ledger", pending.lines.len() as i64).await?;
        let n = pending.lines.len();
        let (mut seqs, mut prevs, mut hashes) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
        for (i, line) in pending.lines.iter().enumerate() {
            let seq = first + i as i64;
            let head = heads.get_mut(&line.account_id).ok_or_else(|| StoreError::internal("no chain head"))?;
            let hash = chain_hash(
                head,
                &EntryFields {
                    seq,
                    account_id: &line.account_id,
                    kind: line.kind,
                    amount: line.amount,
                    balance_after: line.balance_after,
                    job_id: line.job_id.as_deref(),
                    item_id: line.item_id.as_deref(),
                    ref_id: line.ref_id.as_deref(),
                    reason: line.reason.as_deref(),
                    created_at: line.created_at,
                },
            );
            seqs.push(seq);
            prevs.push(head.to_vec());
            hashes.push(hash.to_vec());
            *head = hash;
        }
        let lines = &pending.lines;
        db.exec(
            "INSERT INTO ledger_entries (seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason, \
             request_hash, created_at, prev_hash, hash) \
             SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::bigint[], $5::bigint[], $6::text[], \
             $7::text[], $8::text[], $9::text[], $10::bytea[], $11::bigint[], $12::bytea[], $13::bytea[])",
            &[
                Value::I64s(seqs),
                Value::OptTexts(lines.iter().map(|l| Some(l.account_id.clone())).collect()),
                Value::OptTexts(lines.iter().map(|l| Some(l.kind.as_str().to_owned())).collect()),
                Value::I64s(lines.iter().map(|l| l.amount).collect()),
                Value::I64s(lines.iter().map(|l| l.balance_after).collect()),
                Value::OptTexts(lines.iter().map(|l| l.job_id.clone()).collect()),
                Value::OptTexts(lines.iter().map(|l| l.item_id.clone()).collect()),
                Value::OptTexts(lines.iter().map(|l| l.ref_id.clone()).collect()),
                Value::OptTexts(lines.iter().map(|l| l.reason.clone()).collect()),
                Value::OptBlobs(lines.iter().map(|l| l.request_hash.clone()).collect()),
                Value::I64s(lines.iter().map(|l| l.created_at).collect()),
                Value::OptBlobs(prevs.into_iter().map(Some).collect()),
                Value::OptBlobs(hashes.into_iter().map(Some).collect()),
            ],
        )
        .await?;
    }
    if !pending.events.is_empty() {
        let events = &pending.events;
        let first = next_seq(db, "outbox", events.len() as i64).await?;
        db.exec(
            "INSERT INTO outbox (seq, type, job_id, account_id, data, created_at) \
             SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[])",
            &[
                Value::I64s((0..events.len() as i64).map(|i| first + i).collect()),
                Value::OptTexts(events.iter().map(|e| Some(e.kind.to_owned())).collect()),
                Value::OptTexts(events.iter().map(|e| e.job_id.clone()).collect()),
                Value::OptTexts(events.iter().map(|e| Some(e.account_id.clone())).collect()),
                Value::OptTexts(events.iter().map(|e| Some(e.data.clone())).collect()),
                Value::I64s(events.iter().map(|e| e.created_at).collect()),
            ],
        )
        .await?;
        if events.iter().any(|e| wakes_claims(e.kind)) {
            db.exec("SELECT pg_notify('settle_wake', '')", &[]).await?;
        }
    }
    Ok(())
}

/// A signal as received, for the signal log.
pub(crate) struct Heard<'a> {
    pub signal: &'static str,
    pub code: Option<&'a str>,
    pub message: Option<&'a str>,
}

pub(crate) async fn log_signal(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    token: Option<&str>,
    heard: Heard<'_>,
    effect: &'static str,
) -> Result<(), StoreError> {
    let Heard { signal, code: fail_code, message } = heard;
    let attempt_no = match token {
        Some(t) => db
            .opt("SELECT attempt_no FROM attempts WHERE job_id = $1 AND lease_token = $2", args![&job.id, t])
            .await?
            .map(|r| r.i64(0))
            .transpose()?,
        None => None,
    };
    db.exec(
        "INSERT INTO signals (job_id, attempt_no, signal, fail_code, message, effect, received_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        args![&job.id, attempt_no, signal, fail_code, message, effect, cx.now.micros()],
    )
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Item arrows

/// Applies `signal` to every item of `job_id` in the arrow's `from` state (optionally only
/// `only_item`, and for reclaims only refunds that a job-level success may take back), writing one
/// ledger row per item that actually moved. Returns the moved items with their entries.
pub(crate) async fn move_items(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    from: ItemState,
    signal: ItemSignal,
    only_item: Option<&str>,
    reason: Option<RefundReason>,
) -> Result<Vec<(String, Credits)>, StoreError> {
    let arrow = item::arrow(from, signal).expect("move_items is called only on listed arrows");
    let rows = match (only_item, signal) {
        (Some(item_id), _) => {
            db.all(
                "UPDATE items SET state = $3, refund_reason = COALESCE($4, refund_reason) \
                 WHERE job_id = $1 AND item_id = $2 AND state = $5 RETURNING item_id, cost, ord",
                args![&job.id, item_id, arrow.to.as_str(), reason.map(|r| r.as_str()), from.as_str()],
            )
            .await?
        }
        // A job-level success reclaims every refund except those of items the worker itself failed.
        (None, ItemSignal::Succeed) if from == ItemState::Refunded => {
            db.all(
                "UPDATE items SET state = $2 WHERE job_id = $1 AND state = $3 AND refund_reason <> 'item_failed' \
                 RETURNING item_id, cost, ord",
                args![&job.id, arrow.to.as_str(), from.as_str()],
            )
            .await?
        }
        (None, _) => {
            db.all(
                "UPDATE items SET state = $2, refund_reason = COALESCE($3, refund_reason) \
                 WHERE job_id = $1 AND state = $4 RETURNING item_id, cost, ord",
                args![&job.id, arrow.to.as_str(), reason.map(|r| r.as_str()), from.as_str()],
            )
            .await?
        }
    };
    let mut moved = Vec::with_capacity(rows.len());
    for r in &rows {
        moved.push((r.i64(2)?, r.text(0)?, Credits::new(r.i64(1)?)));
    }
    // RETURNING order is unspecified; ledger rows follow the job's item order on both engines.
    moved.sort();
    let moved: Vec<(String, Credits)> = moved.into_iter().map(|(_, id, cost)| (id, cost)).collect();
    // What a later transition could still credit back (refund, return), and what a later success
    // could still reclaim, move with the balance in one statement.
    let returnable = job.kind == job::WITHDRAWAL_KIND;
    let held_step = i64::from(arrow.to.is_held(returnable)) - i64::from(arrow.from.is_held(returnable));
    let mut holds = Holds::default();
    if held_step != 0 && !moved.is_empty() {
        holds.held = if held_step > 0 { sum(&moved)? } else { sum(&moved)?.checked_neg()? }.get();
    }
    holds.exposure = match (arrow.from, arrow.to) {
        (_, ItemState::Refunded) => sum(&moved)?.get(),
        (ItemState::Refunded, _) => sum(&moved)?.checked_neg()?.get(),
        _ => 0,
    };
    let lines = match arrow.entry {
        Some(kind) => moved
            .iter()
            .map(|(item_id, cost)| {
                Ok(Line {
                    kind,
                    amount: item::entry_amount(kind, *cost)?,
                    job_id: Some(job.id.as_str()),
                    item_id: Some(item_id.as_str()),
                    ref_id: None,
                    reason: reason.map(|r| r.as_str()),
                    request_hash: None,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?,
        None => Vec::new(),
    };
    post(db, cx, &job.account_id, BalanceCheck::Never, &lines, holds).await?;
    Ok(moved)
}

pub(crate) fn sum(moved: &[(String, Credits)]) -> Result<Credits, StoreError> {
    Ok(Credits::checked_sum(moved.iter().map(|(_, c)| *c))?)
}

async fn close_attempt(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    result: &'static str,
    code: Option<&str>,
    message: Option<&str>,
) -> Result<(), StoreError> {
    db.exec(
        "UPDATE attempts SET finished_at = $3, result = $4, fail_code = $5, message = $6 \
         WHERE job_id = $1 AND attempt_no = $2 AND finished_at IS NULL",
        args![&job.id, job.attempt, cx.now.micros(), result, code, message],
    )
    .await?;
    Ok(())
}

pub(crate) fn guard_hit(rows: u64, what: &'static str) -> Result<(), StoreError> {
    // The job row is locked (or the writer is single), so a decided guard cannot miss.
    if rows != 1 {
        return Err(StoreError::internal(format!("guard for {what} matched {rows} rows on a locked job")));
    }
    Ok(())
}

/// Records an admin action in the caller's transaction.
pub(crate) async fn record_action(
    db: &mut Db<'_>,
    cx: &Cx,
    actor: &str,
    action: &'static str,
    job_id: Option<&str>,
    account_id: Option<&str>,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    if actor.is_empty() || actor.len() > limits::WORKER_LEN_MAX {
        return Err(StoreError::invalid("an actor's name is 1 to 128 characters"));
    }
    db.exec(
        "INSERT INTO actions (at, actor, action, job_id, account_id, detail) VALUES ($1, $2, $3, $4, $5, $6)",
        args![cx.now.micros(), actor, action, job_id, account_id, detail.to_string()],
    )
    .await?;
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Accounts and grants

pub(crate) fn account_fingerprint(req: &NewAccount) -> [u8; 32] {
    Fingerprint::new("account").str("id", req.id.as_str()).i64("overdraft_limit", req.overdraft_limit.get()).finish()
}

pub(crate) async fn create_account(db: &mut Db<'_>, cx: &Cx, req: &NewAccount) -> Result<Created<Account>, StoreError> {
    if req.overdraft_limit.is_negative() || req.overdraft_limit.get() > limits::BALANCE_MAX {
        return Err(StoreError::invalid(format!("overdraft_limit must be between 0 and {}", limits::BALANCE_MAX)));
    }
    let fp = account_fingerprint(req);
    let inserted = db
        .exec(
            "INSERT INTO accounts (id, balance, overdraft_limit, created_at, request_hash) VALUES ($1, 0, $2, $3, $4) \
             ON CONFLICT (id) DO NOTHING",
            args![req.id.as_str(), req.overdraft_limit.get(), cx.now.micros(), &fp],
        )
        .await?;
    cx.point(CrashPoint::AfterGuard)?;
    let row = db
        .one(
            "SELECT id, balance, overdraft_limit, created_at, request_hash FROM accounts WHERE id = $1",
            args![req.id.as_str()],
        )
        .await?;
    let account = account_from_row(&row)?;
    if inserted == 0 {
        if row.blob(4)? != fp {
            return Err(StoreError::IdempotencyConflict { what: "account", id: req.id.to_string() });
        }
        return Ok(Created { value: account, replayed: true });
    }
    emit(
        db,
        cx,
        "account.created",
        None,
        req.id.as_str(),
        serde_json::json!({ "overdraft_limit": req.overdraft_limit.get() }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Created { value: account, replayed: false })
}

pub(crate) fn credit_fingerprint(
    kind: EntryKind,
    account: &AccountId,
    id: &str,
    amount: Credits,
    reason: Option<&str>,
) -> [u8; 32] {
    Fingerprint::new(kind.as_str())
        .str("account_id", account.as_str())
        .str("id", id)
        .i64("amount", amount.get())
        .opt_str("reason", reason)
        .finish()
}

/// Grants (`amount > 0`) and adjustments (`amount ≠ 0`, reason required), created by id.
pub(crate) async fn credit(
    db: &mut Db<'_>,
    cx: &Cx,
    kind: EntryKind,
    account: &AccountId,
    id: &str,
    amount: Credits,
    reason: Option<&str>,
) -> Result<Created<LedgerEntry>, StoreError> {
    debug_assert!(matches!(kind, EntryKind::Grant | EntryKind::Adjustment));
    let fp = credit_fingerprint(kind, account, id, amount, reason);
    if let Some(existing) = db
        .opt(
            "SELECT seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason, created_at, hash, request_hash \
             FROM ledger_entries WHERE kind = $1 AND ref_id = $2",
            args![kind.as_str(), id],
        )
        .await?
    {
        if existing.blob(11)? != fp {
            return Err(StoreError::IdempotencyConflict { what: kind.as_str(), id: id.to_owned() });
        }
        return Ok(Created { value: entry_from_row(&existing)?, replayed: true });
    }
    let entries = post_now(
        db,
        cx,
        account.as_str(),
        BalanceCheck::Bounded,
        &[Line { kind, amount, job_id: None, item_id: None, ref_id: Some(id), reason, request_hash: Some(&fp) }],
    )
    .await?;
    cx.point(CrashPoint::AfterLedger)?;
    let entry = entries.into_iter().next().expect("one line posted");
    let event = match kind {
        EntryKind::Grant => "account.granted",
        _ => "account.adjusted",
    };
    emit(
        db,
        cx,
        event,
        None,
        account.as_str(),
        serde_json::json!({ "id": id, "amount": amount.get(), "seq": entry.seq }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Created { value: entry, replayed: false })
}

// ---------------------------------------------------------------------------------------------
// Jobs

pub(crate) fn job_fingerprint(req: &NewJob) -> [u8; 32] {
    let mut f = Fingerprint::new("job")
        .str("id", req.id.as_str())
        .str("account_id", req.account_id.as_str())
        .str("kind", req.kind.as_str())
        .str("payload", &req.payload)
        .opt_i64("max_attempts", req.max_attempts.map(i64::from))
        .opt_str("refund_on", req.refund_on.map(|p| p.as_str()))
        .opt_i64("not_before", req.not_before.map(|t| t.micros()))
        .i64("items", req.items.len() as i64);
    for item in &req.items {
        f = f.str("item", item.id.as_str()).i64("cost", item.cost.get());
    }
    f.finish()
}

pub(crate) fn validate_job(req: &NewJob) -> Result<Credits, StoreError> {
    if req.items.is_empty() || req.items.len() > limits::JOB_ITEMS_MAX {
        return Err(StoreError::invalid(format!("a job has 1 to {} items", limits::JOB_ITEMS_MAX)));
    }
    let mut ids: Vec<&str> = req.items.iter().map(|i| i.id.as_str()).collect();
    ids.sort_unstable();
    if ids.windows(2).any(|w| w[0] == w[1]) {
        return Err(StoreError::invalid("item ids must be unique within a job"));
    }
    if req.items.iter().any(|i| i.cost.is_negative()) {
        return Err(StoreError::invalid("item cost must be zero or more"));
    }
    let total = Credits::checked_sum(req.items.iter().map(|i| i.cost))?;
    if total.get() > limits::BALANCE_MAX {
        return Err(StoreError::Overflow);
    }
    if let Some(n) = req.max_attempts
        && !(1..=limits::ATTEMPTS_MAX_LIMIT).contains(&n)
    {
        return Err(StoreError::invalid(format!("max_attempts must be between 1 and {}", limits::ATTEMPTS_MAX_LIMIT)));
    }
    if req.payload.len() > limits::PAYLOAD_BYTES_MAX {
        return Err(StoreError::invalid(format!("payload is larger than {} bytes", limits::PAYLOAD_BYTES_MAX)));
    }
    Ok(total)
}

pub(crate) async fn create_job(db: &mut Db<'_>, cx: &Cx, req: &NewJob) -> Result<Created<Job>, StoreError> {
    validate_job(req)?;
    if req.kind.as_str() == job::WITHDRAWAL_KIND {
        return Err(StoreError::invalid(
            "the job kind withdrawal is reserved: create withdrawals with POST /v1/withdrawals",
        ));
    }
    let fp = job_fingerprint(req);
    if db.opt("SELECT 1 FROM accounts WHERE id = $1", args![req.account_id.as_str()]).await?.is_none() {
        return Err(StoreError::not_found("account", req.account_id.as_str()));
    }
    // Replay or conflict first, so a re-sent create takes no sequence number. Two concurrent
    // creates of one id on PostgreSQL: the loser hits `jobs_pkey`, is retried, and lands here.
    if let Some(existing) = lock_job(db, req.id.as_str()).await? {
        if existing.request_hash != fp {
            return Err(StoreError::IdempotencyConflict { what: "job", id: req.id.to_string() });
        }
        return Ok(Created { value: attach(db, cx, existing).await?, replayed: true });
    }
    let job = insert_job(db, cx, req, &fp).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Created { value: job, replayed: false })
}

/// Inserts a new job (its id known to be free): the job row, its items `charged`, one charge per
/// item under the overdraft guard (`insufficient_credits` aborts the whole transaction), `job.queued`.
/// Returns the job as written, built from the request (debug builds check it against a re-read).
pub(crate) async fn insert_job(db: &mut Db<'_>, cx: &Cx, req: &NewJob, fp: &[u8; 32]) -> Result<Job, StoreError> {
    let total = validate_job(req)?;
    let job_seq = match db.engine() {
        Engine::Sqlite => next_seq(db, "job", 1).await?,
        Engine::Postgres => db.one("SELECT nextval('job_seq_numbers')", &[]).await?.i64(0)?,
    };
    let policy = cx.policy.for_kind(req.kind.as_str());
    let max_attempts = i64::from(req.max_attempts.unwrap_or(policy.attempts_max));
    let refund_on = req.refund_on.unwrap_or(policy.refund_on);
    let not_before = req.not_before.unwrap_or(cx.now).micros();
    let inserted = db
        .exec(
            "INSERT INTO jobs (id, job_seq, account_id, kind, state, cost, attempt, budget_base, max_attempts, refund_on, \
             cancel_requested, not_before, lease_seconds, payload, request_hash, created_at, updated_at) \
             VALUES ($1, $2, $3, $4, 'queued', $5, 0, 0, $6, $7, 0, $8, $9, $10, $11, $12, $12)",
            args![
                req.id.as_str(),
                job_seq,
                req.account_id.as_str(),
                req.kind.as_str(),
                total.get(),
                max_attempts,
                refund_on.as_str(),
                not_before,
                i64::from(limits::LEASE_SECONDS_DEFAULT),
                &req.payload,
                fp,
                cx.now.micros()
            ],
        )
        .await?;
    guard_hit(inserted, "job insert")?;
    cx.point(CrashPoint::AfterGuard)?;
    for (ord, item) in req.items.iter().enumerate() {
        db.exec(
            "INSERT INTO items (job_id, item_id, ord, cost, state) VALUES ($1, $2, $3, $4, 'charged')",
            args![req.id.as_str(), item.id.as_str(), ord as i64, item.cost.get()],
        )
        .await?;
    }
    let lines: Vec<Line<'_>> = req
        .items
        .iter()
        .map(|i| {
            Ok(Line {
                kind: EntryKind::Charge,
                amount: i.cost.checked_neg()?,
                job_id: Some(req.id.as_str()),
                item_id: Some(i.id.as_str()),
                ref_id: None,
                reason: None,
                request_hash: None,
            })
        })
        .collect::<Result<_, StoreError>>()?;
    // Every charged item may still be refunded: it is held until it is decided.
    let holds = Holds { held: total.get(), exposure: 0 };
    post(db, cx, req.account_id.as_str(), BalanceCheck::Overdraft, &lines, holds).await?;
    cx.point(CrashPoint::AfterLedger)?;
    emit(
        db,
        cx,
        "job.queued",
        Some(req.id.as_str()),
        req.account_id.as_str(),
        serde_json::json!({ "kind": req.kind.as_str(), "cost": total.get(), "items": req.items.len() }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let job = Job {
        id: req.id.as_str().to_owned(),
        account_id: req.account_id.as_str().to_owned(),
        kind: req.kind.as_str().to_owned(),
        state: JobState::Queued,
        cost: total,
        net: total.checked_neg()?,
        attempt: 0,
        max_attempts: u32::try_from(max_attempts).map_err(StoreError::internal)?,
        budget_base: 0,
        refund_on,
        cancel_requested: false,
        not_before: Timestamp::from_micros(not_before),
        lease_expires_at: None,
        last_error: None,
        items: req
            .items
            .iter()
            .map(|i| Item {
                id: i.id.as_str().to_owned(),
                cost: i.cost,
                state: ItemState::Charged,
                refund_reason: None,
            })
            .collect(),
        payload: req.payload.clone(),
        result: None,
        created_at: cx.now,
        updated_at: cx.now,
    };
    #[cfg(debug_assertions)]
    {
        let stored = must_read_job(db, cx, req.id.as_str()).await?;
        assert_eq!(job, stored, "a created job's answer must be what was stored");
    }
    Ok(job)
}

/// The job claim; `$lock` as for webhooks: nothing on SQLite, `FOR UPDATE SKIP LOCKED` on PostgreSQL,
/// and the guard again in the outer WHERE. `{KINDS}` is replaced by the kind filter's placeholders.
/// `$cancel` is the cancel guard: workers never claim a job whose cancel was requested; the payout
/// processor does claim a queued withdrawal with a cancel request, to ask the provider before the
/// hold is refunded (docs/decisions/0010).
macro_rules! claim_sql {
    ($lock:literal, $cancel:literal) => {
        concat!(
            "UPDATE jobs SET state = 'running', attempt = attempt + 1, lease_token = $2, \
             lease_expires_at = $3, lease_worker = $4, lease_seconds = $5, updated_at = $1 \
             WHERE id = (SELECT id FROM jobs WHERE state = 'queued' AND not_before <= $1 ",
            $cancel,
            " {KINDS} ORDER BY not_before, job_seq LIMIT 1 ",
            $lock,
            ") AND state = 'queued' AND not_before <= $1 ",
            $cancel,
            " RETURNING ",
            job_columns!()
        )
    };
}
const CLAIM_SQLITE: &str = claim_sql!("", "AND cancel_requested = 0");
const CLAIM_PG: &str = claim_sql!("FOR UPDATE SKIP LOCKED", "AND cancel_requested = 0");
const CLAIM_PAYOUTS_SQLITE: &str = claim_sql!("", "");
const CLAIM_PAYOUTS_PG: &str = claim_sql!("FOR UPDATE SKIP LOCKED", "");

/// Claims up to `limit` due jobs, one guarded UPDATE each; every claim opens an attempt row.
/// Workers never get a withdrawal (a claim naming no kinds leaves them out); the payout processor
/// gets only withdrawals.
pub(crate) async fn claim(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &ClaimRequest,
    caller: Caller,
) -> Result<Vec<ClaimedJob>, StoreError> {
    let template = match (db.engine(), caller) {
        (Engine::Sqlite, Caller::Worker) => CLAIM_SQLITE,
        (Engine::Postgres, Caller::Worker) => CLAIM_PG,
        (Engine::Sqlite, Caller::PayoutProcessor) => CLAIM_PAYOUTS_SQLITE,
        (Engine::Postgres, Caller::PayoutProcessor) => CLAIM_PAYOUTS_PG,
    };
    let names_withdrawal = req.kinds.iter().any(|k| k.as_str() == job::WITHDRAWAL_KIND);
    let kinds_sql = match caller {
        Caller::PayoutProcessor => format!("AND kind = '{}'", job::WITHDRAWAL_KIND),
        Caller::Worker if names_withdrawal => {
            return Err(StoreError::invalid("withdrawals are claimed only by the built-in payout processor"));
        }
        Caller::Worker if req.kinds.is_empty() => format!("AND kind <> '{}'", job::WITHDRAWAL_KIND),
        Caller::Worker => {
            let params: Vec<String> = (0..req.kinds.len()).map(|i| format!("${}", 6 + i)).collect();
            format!("AND kind IN ({})", params.join(", "))
        }
    };
    let sql = template.replace("{KINDS}", &kinds_sql);
    let lease_seconds = req.lease_seconds.unwrap_or(cx.policy.default.lease_seconds);
    let lease_expires_at = cx.now.plus_seconds(u64::from(lease_seconds));
    let mut claimed = Vec::new();
    for _ in 0..req.limit.min(limits::CLAIM_LIMIT_MAX) {
        let token = uuid::Uuid::new_v4().to_string();
        let mut a = vec![
            crate::db::Value::from(cx.now.micros()),
            token.clone().into(),
            lease_expires_at.micros().into(),
            req.worker.as_str().into(),
            i64::from(lease_seconds).into(),
        ];
        if caller == Caller::Worker {
            a.extend(req.kinds.iter().map(|k| crate::db::Value::from(k.as_str())));
        }
        let Some(row) = db.opt_built(sql.clone(), &a).await? else { break };
        let mut row = job_row(&row)?;
        let (job_id, attempt) = (row.id.clone(), row.attempt);
        cx.point(CrashPoint::AfterGuard)?;
        // A claim that names no lease gets its job kind's.
        let mut expires = lease_expires_at;
        let kind_lease = cx.policy.for_kind(&row.kind).lease_seconds;
        if req.lease_seconds.is_none() && kind_lease != lease_seconds {
            expires = cx.now.plus_seconds(u64::from(kind_lease));
            let rows = db
                .exec(
                    "UPDATE jobs SET lease_expires_at = $3, lease_seconds = $4 WHERE id = $1 AND lease_token = $2",
                    args![&job_id, &token, expires.micros(), i64::from(kind_lease)],
                )
                .await?;
            guard_hit(rows, "kind lease")?;
            row.lease_expires_at = Some(expires.micros());
            row.lease_seconds = i64::from(kind_lease);
        }
        db.exec(
            "INSERT INTO attempts (job_id, attempt_no, worker, lease_token, started_at) VALUES ($1, $2, $3, $4, $5)",
            args![&job_id, attempt, req.worker.as_str(), &token, cx.now.micros()],
        )
        .await?;
        let job = attach(db, cx, row).await?;
        #[cfg(debug_assertions)]
        assert_eq!(job, must_read_job(db, cx, &job_id).await?, "a claimed job's answer must be what was stored");
        emit(
            db,
            cx,
            "job.claimed",
            Some(&job_id),
            &job.account_id,
            serde_json::json!({ "attempt": attempt, "worker": req.worker.as_str() }),
        )
        .await?;
        cx.point(CrashPoint::AfterOutbox)?;
        claimed.push(ClaimedJob { job, lease_token: LeaseToken(token), lease_expires_at: expires });
    }
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(claimed)
}

/// A signal with a lease token that is not the current one. It is logged in the same transaction,
/// which then commits; the caller turns it into `LeaseLost` afterwards, so the log row survives.
#[derive(Debug)]
pub(crate) struct Stale(pub String);

fn holds_lease(job: &JobRow, token: &LeaseToken) -> bool {
    job.state == JobState::Running && job.lease_token.as_deref() == Some(token.0.as_str())
}

pub(crate) async fn heartbeat(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: &LeaseToken,
    caller: Caller,
) -> Result<Result<Heartbeat, Stale>, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, caller)?;
    if !holds_lease(&job, token) {
        log_signal(db, cx, &job, Some(&token.0), Heard { signal: "heartbeat", code: None, message: None }, "stale")
            .await?;
        return Ok(Err(Stale(job.id)));
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
    if caller == Caller::PayoutProcessor && !job.cancel_requested {
        let rows = db
            .exec("UPDATE withdrawals SET sending_attempt = $2 WHERE job_id = $1", args![&job.id, job.attempt])
            .await?;
        guard_hit(rows, "sending marker")?;
    }
    cx.point(CrashPoint::AfterGuard)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Ok(Heartbeat { lease_expires_at: expires, cancel_requested: job.cancel_requested }))
}

/// An item report from the worker holding the lease: `charged → succeeded`, `refunded → reclaimed`
/// (an explicit item success takes back any refund), or `charged → refunded` on failure.
pub(crate) async fn item_report(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    item_id: &ItemId,
    token: &LeaseToken,
    failure: Option<(&FailCode, Option<&str>)>,
) -> Result<Result<ItemReport, Stale>, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, Caller::Worker)?;
    let signal_name = if failure.is_some() { "item_fail" } else { "item_succeed" };
    if !holds_lease(&job, token) {
        let (code, message) = failure.map(|(c, m)| (Some(c.as_str()), m)).unwrap_or((None, None));
        log_signal(db, cx, &job, Some(&token.0), Heard { signal: signal_name, code, message }, "stale").await?;
        return Ok(Err(Stale(job.id)));
    }
    let current = db
        .opt(
            "SELECT item_id, cost, state, refund_reason FROM items WHERE job_id = $1 AND item_id = $2",
            args![&job.id, item_id.as_str()],
        )
        .await?
        .ok_or_else(|| StoreError::not_found("item", item_id.as_str()))?;
    let current = item_from_row(&current)?;
    let signal = if failure.is_some() { ItemSignal::Fail } else { ItemSignal::Succeed };
    let reason_only = signal == ItemSignal::Fail
        && current.state == ItemState::Refunded
        && current.refund_reason.as_deref() != Some(RefundReason::ItemFailed.as_str());
    let applied = match item::arrow(current.state, signal) {
        // Already refunded by a job-level failure; the worker now says this item was not delivered,
        // so a later job-level success must not reclaim it (spec §2). No money moves.
        None if reason_only => {
            let rows = db
                .exec(
                    "UPDATE items SET refund_reason = 'item_failed' WHERE job_id = $1 AND item_id = $2 AND state = 'refunded'",
                    args![&job.id, item_id.as_str()],
                )
                .await?;
            guard_hit(rows, "item refund reason")?;
            cx.point(CrashPoint::AfterGuard)?;
            true
        }
        None => {
            let (code, message) = failure.map(|(c, m)| (Some(c.as_str()), m)).unwrap_or((None, None));
            log_signal(db, cx, &job, Some(&token.0), Heard { signal: signal_name, code, message }, "noop").await?;
            false
        }
        Some(arrow) => {
            let reason = (signal == ItemSignal::Fail).then_some(RefundReason::ItemFailed);
            let moved = move_items(db, cx, &job, arrow.from, signal, Some(item_id.as_str()), reason).await?;
            guard_hit(moved.len() as u64, "item report")?;
            cx.point(CrashPoint::AfterLedger)?;
            let (event, data) = match (arrow.to, failure) {
                (ItemState::Refunded, Some((code, message))) => (
                    "job.item_refunded",
                    serde_json::json!({ "item_id": item_id.as_str(), "amount": current.cost.get(), "code": code.as_str(), "message": message }),
                ),
                (ItemState::Reclaimed, _) => (
                    "job.item_reclaimed",
                    serde_json::json!({ "item_id": item_id.as_str(), "amount": current.cost.get() }),
                ),
                _ => ("job.item_succeeded", serde_json::json!({ "item_id": item_id.as_str() })),
            };
            emit(db, cx, event, Some(&job.id), &job.account_id, data).await?;
            cx.point(CrashPoint::AfterOutbox)?;
            true
        }
    };
    let item = item_from_row(
        &db.one(
            "SELECT item_id, cost, state, refund_reason FROM items WHERE job_id = $1 AND item_id = $2",
            args![&job.id, item_id.as_str()],
        )
        .await?,
    )?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Ok(ItemReport { item, cancel_requested: job.cancel_requested, applied }))
}

pub(crate) async fn register_artifact(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    item_id: &ItemId,
    token: &LeaseToken,
    artifact: &NewArtifact,
) -> Result<Result<bool, Stale>, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, Caller::Worker)?;
    if !holds_lease(&job, token) {
        log_signal(
            db,
            cx,
            &job,
            Some(&token.0),
            Heard { signal: "artifact", code: None, message: Some(artifact.key.as_str()) },
            "stale",
        )
        .await?;
        return Ok(Err(Stale(job.id)));
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
            "INSERT INTO artifacts (job_id, item_id, key, created_at) VALUES ($1, $2, $3, $4) ON CONFLICT DO NOTHING",
            args![&job.id, item_id.as_str(), artifact.key.as_str(), cx.now.micros()],
        )
        .await?;
    cx.point(CrashPoint::AfterGuard)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Ok(rows == 1))
}

/// What a transition left to do after its commit.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum After {
    Nothing,
    /// The job is `cancelling`: clean up artifacts, then finish (teardown steps 2–3).
    Teardown,
}

/// Teardown step 1 inside the caller's transaction: the job (now in `from`) becomes `cancelling`,
/// every item still `charged` becomes `cancelled` with its refund.
async fn begin_teardown(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    attempt_result: Option<&'static str>,
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
        let code = if result == "lease_expired" { FailCode::lease_expired() } else { FailCode::cancelled() };
        close_attempt(db, cx, job, result, Some(code.as_str()), None).await?;
    }
    cx.point(CrashPoint::AfterGuard)?;
    let moved =
        move_items(db, cx, job, ItemState::Charged, ItemSignal::Cancel, None, Some(RefundReason::Cancelled)).await?;
    cx.point(CrashPoint::AfterLedger)?;
    emit(db, cx, "job.cancelling", Some(&job.id), &job.account_id, serde_json::json!({ "from": job.state.as_str() }))
        .await?;
    if !moved.is_empty() {
        emit(
            db,
            cx,
            "job.refunded",
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "reason": "cancelled", "amount": sum(&moved)?.get(), "items": moved.iter().map(|m| m.0.as_str()).collect::<Vec<_>>() }),
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
        let count = |s: ItemState| done.items.iter().filter(|i| i.state == s).count();
        emit(
            db,
            cx,
            "job.cancelled",
            Some(id),
            &job.account_id,
            serde_json::json!({
                "net": done.net.get(),
                "items_cancelled": count(ItemState::Cancelled),
                "items_succeeded": count(ItemState::Succeeded) + count(ItemState::Reclaimed),
                "items_refunded": count(ItemState::Refunded),
            }),
        )
        .await?;
        cx.point(CrashPoint::AfterOutbox)?;
    }
    let job = must_read_job(db, cx, id).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(job)
}

/// A repeated signal for a job whose teardown was interrupted finishes that teardown, so
/// re-sending what was interrupted converges without waiting for the sweeper.
fn resume_if_cancelling(job: &JobRow) -> After {
    if job.state == JobState::Cancelling { After::Teardown } else { After::Nothing }
}

/// A failure as the failure path needs it.
struct Failure<'a> {
    code: &'a FailCode,
    message: Option<&'a str>,
    retryable: bool,
    /// Overrides the backoff formula (a 429 with Retry-After).
    retry_after_ms: Option<u64>,
    /// How the attempt row is closed: `failed`, `lease_expired`, `cancelled`.
    attempt_result: &'static str,
    /// Retry whatever the attempts used: a withdrawal confirmed absent after its window is never
    /// dead-lettered (and refunded) on that conclusion alone; the next attempt asks first.
    budget_exempt: bool,
    /// Keep a requested cancel for later: a withdrawal is torn down (refunded) only after the
    /// provider said its key is absent, and this failure is not such an answer.
    defer_cancel: bool,
}

/// The failure path shared by a worker's fail, the lease rescuer and reconcile-absent.
async fn apply_failure(db: &mut Db<'_>, cx: &Cx, job: &JobRow, failure: Failure<'_>) -> Result<After, StoreError> {
    let Failure { code, message, retryable, retry_after_ms, attempt_result, budget_exempt, defer_cancel } = failure;
    let used = if budget_exempt { 0 } else { u32::try_from(job.attempt - job.budget_base).unwrap_or(u32::MAX) };
    let max = u32::try_from(job.max_attempts).unwrap_or(u32::MAX);
    let outcome = job::fail_outcome(job.cancel_requested && !defer_cancel, retryable, used, max);
    if outcome == FailOutcome::Teardown {
        begin_teardown(
            db,
            cx,
            job,
            Some(if attempt_result == "lease_expired" { "lease_expired" } else { "cancelled" }),
        )
        .await?;
        return Ok(After::Teardown);
    }
    let (state, not_before) = match outcome {
        FailOutcome::Retry => {
            let delay = match retry_after_ms {
                Some(ms) => ms.min(cx.policy.for_kind(&job.kind).backoff.backoff_ms_max),
                None => {
                    let mut rng = cx.rng.lock().expect("rng lock");
                    let backoff = &cx.policy.for_kind(&job.kind).backoff;
                    backoff.delay_ms(u32::try_from(job.attempt).unwrap_or(u32::MAX), &mut rng)
                }
            };
            (JobState::Queued, cx.now.plus_millis(delay).micros())
        }
        _ => (JobState::Dead, job.not_before),
    };
    // An exempt failure does not count against the budget, now or later: the budget's base moves up.
    let base_step = i64::from(budget_exempt);
    let rows = db
        .exec(
            "UPDATE jobs SET state = $3, not_before = $4, lease_token = NULL, lease_expires_at = NULL, lease_worker = NULL, \
             last_error_code = $5, last_error_message = $6, unknown_since = NULL, updated_at = $7, \
             budget_base = budget_base + $8 WHERE id = $1 AND state = $2",
            args![&job.id, job.state.as_str(), state.as_str(), not_before, code.as_str(), message, cx.now.micros(), base_step],
        )
        .await?;
    guard_hit(rows, "failure")?;
    close_attempt(db, cx, job, attempt_result, Some(code.as_str()), message).await?;
    cx.point(CrashPoint::AfterGuard)?;
    let moved = if job::refunds_on(job.refund_on, outcome) {
        move_items(db, cx, job, ItemState::Charged, ItemSignal::Fail, None, Some(RefundReason::JobFailed)).await?
    } else {
        Vec::new()
    };
    cx.point(CrashPoint::AfterLedger)?;
    if !moved.is_empty() {
        emit(
            db,
            cx,
            "job.refunded",
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "reason": "job_failed", "code": code.as_str(), "amount": sum(&moved)?.get(), "items": moved.iter().map(|m| m.0.as_str()).collect::<Vec<_>>() }),
        )
        .await?;
    }
    let data = serde_json::json!({ "code": code.as_str(), "message": message, "attempt": job.attempt, "not_before": not_before });
    let event = if state == JobState::Queued { "job.retry_scheduled" } else { "job.dead" };
    emit(db, cx, event, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    Ok(After::Nothing)
}

pub(crate) async fn fail(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    signal: &FailSignal,
    caller: Caller,
) -> Result<(Outcome<Job>, After), StoreError> {
    if let Some(m) = &signal.message
        && m.len() > limits::MESSAGE_LEN_MAX
    {
        return Err(StoreError::invalid(format!("message is longer than {} bytes", limits::MESSAGE_LEN_MAX)));
    }
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, caller)?;
    if !holds_lease(&job, &signal.lease_token) {
        log_signal(
            db,
            cx,
            &job,
            Some(&signal.lease_token.0),
            Heard { signal: "fail", code: Some(signal.code.as_str()), message: signal.message.as_deref() },
            "stale",
        )
        .await?;
        let after = resume_if_cancelling(&job);
        let job = attach(db, cx, job).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: job, applied: false }, after));
    }
    // A payout attempt that could not ask the provider learned nothing: retry, keep any cancel
    // request for an attempt that can ask, never dead-letter (and refund) on it.
    let inconclusive = caller == Caller::PayoutProcessor && signal.code == FailCode::lookup_failed();
    let retryable = inconclusive || cx.policy.for_kind(&job.kind).is_retryable(&signal.code, signal.retryable);
    let after = apply_failure(
        db,
        cx,
        &job,
        Failure {
            code: &signal.code,
            message: signal.message.as_deref(),
            retryable,
            retry_after_ms: signal.retry_after_ms,
            attempt_result: "failed",
            budget_exempt: inconclusive,
            defer_cancel: inconclusive,
        },
    )
    .await?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: job, applied: true }, after))
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
        let marker = db.one("SELECT sending_attempt FROM withdrawals WHERE job_id = $1", args![&job.id]).await?;
        marker.opt_i64(0)? == Some(job.attempt)
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
        close_attempt(db, cx, &job, "lease_expired", Some(FailCode::lease_expired().as_str()), Some("lease expired"))
            .await?;
        cx.point(CrashPoint::AfterGuard)?;
        emit(
            db,
            cx,
            "job.unknown",
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
            attempt_result: "lease_expired",
            budget_exempt: payout,
            defer_cancel: payout,
        },
    )
    .await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((true, after))
}

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
        begin_teardown(db, cx, job, Some("cancelled")).await?;
        return Ok((true, After::Teardown));
    }
    if !from_ok || cancel_wins {
        log_signal(
            db,
            cx,
            job,
            token.map(|t| t.0.as_str()),
            Heard { signal: "succeed", code: None, message: None },
            "noop",
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
        close_attempt(db, cx, job, if current { "succeeded" } else { "superseded" }, None, None).await?;
    }
    if !current {
        log_signal(
            db,
            cx,
            job,
            token.map(|t| t.0.as_str()),
            Heard { signal: "succeed", code: None, message: None },
            "recovered",
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
            "job.reclaimed",
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "amount": sum(&reclaimed)?.get(), "items": reclaimed.iter().map(|m| m.0.as_str()).collect::<Vec<_>>() }),
        )
        .await?;
    }
    emit(
        db,
        cx,
        "job.succeeded",
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

pub(crate) async fn mark_unknown(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: &LeaseToken,
    message: Option<&str>,
    caller: Caller,
) -> Result<Outcome<Job>, StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    check_caller(&job, caller)?;
    if !holds_lease(&job, token) {
        log_signal(db, cx, &job, Some(&token.0), Heard { signal: "unknown", code: None, message }, "stale").await?;
        let job = attach(db, cx, job).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok(Outcome { value: job, applied: false });
    }
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'unknown', unknown_since = $3, lease_token = NULL, lease_expires_at = NULL, \
             lease_worker = NULL, updated_at = $3 WHERE id = $1 AND state = 'running' AND lease_token = $2",
            args![&job.id, &token.0, cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "unknown")?;
    close_attempt(db, cx, &job, "unknown", None, message).await?;
    cx.point(CrashPoint::AfterGuard)?;
    emit(
        db,
        cx,
        "job.unknown",
        Some(&job.id),
        &job.account_id,
        serde_json::json!({ "attempt": job.attempt, "message": message }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Outcome { value: job, applied: true })
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
            // A withdrawal's success needs its txid: `payouts::payout_succeeded`.
            Finding::Present if job.kind == job::WITHDRAWAL_KIND => {
                return Err(StoreError::invalid("a withdrawal found at the provider is recorded with its txid"));
            }
            Finding::Present => apply_success(db, cx, &job, None, None).await?,
            Finding::Absent => {
                let since = job.unknown_since.unwrap_or(job.updated_at);
                let window_over = Timestamp::from_micros(since)
                    .plus_seconds(cx.policy.for_kind(&job.kind).confirm_window_seconds)
                    <= cx.now;
                if window_over {
                    let code = FailCode::timeout_confirmed_not_sent();
                    let after = apply_failure(
                        db,
                        cx,
                        &job,
                        Failure {
                            code: &code,
                            message: Some("absent at the external system after the confirm window"),
                            retryable: true,
                            retry_after_ms: None,
                            attempt_result: "failed",
                            budget_exempt: job.kind == job::WITHDRAWAL_KIND,
                            defer_cancel: false,
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

/// Cancel, per the spec's table. Returns the job and what is left to do after the commit.
pub(crate) async fn cancel(db: &mut Db<'_>, cx: &Cx, id: &JobId) -> Result<(Job, After), StoreError> {
    let job = must_lock_job(db, id.as_str()).await?;
    let is_withdrawal = job.kind == job::WITHDRAWAL_KIND;
    let action = match job::cancel_action(job.state) {
        // A dead withdrawal's hold was refunded already; `cancelled` would only hide it from the
        // late-execution check.
        job::CancelAction::Teardown if is_withdrawal && job.state == JobState::Dead => job::CancelAction::Finished,
        // A queued withdrawal that was tried before is cancelled through the processor, which asks
        // the provider first (an earlier send may have gone through after all).
        job::CancelAction::Teardown if is_withdrawal && job.attempt > 0 => job::CancelAction::RequestFlag,
        other => other,
    };
    let after = match action {
        job::CancelAction::Teardown => {
            begin_teardown(db, cx, &job, None).await?;
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
                    "job.cancel_requested",
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
    if job.kind == job::WITHDRAWAL_KIND {
        // Dead means the hold was refunded after a definitive "not sent", and an item is refunded
        // once: a re-run is a new withdrawal with a new key (docs/decisions/0010).
        return Err(StoreError::InvalidTransition {
            job: job.id,
            action: "be requeued (a dead withdrawal's hold was refunded: create a new withdrawal)",
            state: job.state.as_str().to_owned(),
        });
    }
    // A requeue re-sent after its answer was lost finds the job requeued and not claimed since:
    // answer it again rather than fail (docs/decisions/0005).
    if job.state == JobState::Queued && job.attempt > 0 && job.budget_base == job.attempt {
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
            "UPDATE jobs SET state = 'queued', budget_base = attempt, not_before = $2, updated_at = $2 WHERE id = $1 AND state = 'dead'",
            args![&job.id, cx.now.micros()],
        )
        .await?;
    guard_hit(rows, "requeue")?;
    cx.point(CrashPoint::AfterGuard)?;
    emit(db, cx, "job.requeued", Some(&job.id), &job.account_id, serde_json::json!({ "attempt": job.attempt })).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let job = must_read_job(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(job)
}

/// Artifact keys to delete for a job being torn down: every item that ends undelivered (net 0),
/// rescanned in full each time (seed 003: the marker, not "undecided").
pub(crate) async fn cleanup_keys(db: &mut Db<'_>, id: &str) -> Result<Vec<String>, StoreError> {
    let rows = db
        .all(
            "SELECT a.key FROM artifacts a JOIN items i ON i.job_id = a.job_id AND i.item_id = a.item_id \
             WHERE a.job_id = $1 AND i.state IN ('cancelled', 'refunded') ORDER BY a.key",
            args![id],
        )
        .await?;
    rows.iter().map(|r| r.text(0)).collect()
}
