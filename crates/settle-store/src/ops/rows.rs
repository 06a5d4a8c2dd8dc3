//! Reading rows: every column list is written once, and rows are decoded by column name from it.

use super::{Cx, lock_pending};
use crate::db::{Db, Engine, Row, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::history::EventKind;
use settle_core::ids::AccountId;
use settle_core::item::{ItemState, RefundReason};
use settle_core::job::{self, JobState, RefundPolicy};
use settle_core::ledger::EntryKind;
use settle_core::{Credits, Timestamp};
use std::sync::LazyLock;

columns! {
    /// A job row's columns.
    pub(crate) JobCol {
        id, account_id, kind, state, cost, attempt, budget_base, max_attempts, refund_on, cancel_requested,
        not_before, lease_token, lease_expires_at, lease_worker, last_error_code, last_error_message,
        unknown_since, payload, request_hash, created_at, updated_at, lease_seconds, job_seq, result,
    }
}

columns! {
    /// An item row's columns, as a job shows them.
    pub(crate) ItemCol { item_id, cost, state, refund_reason }
}

columns! {
    /// A ledger entry's columns, as `LedgerEntry` shows them.
    pub(crate) EntryCol { seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason, created_at, hash }
}

columns! {
    /// An account row's columns, as `Account` shows them.
    pub(crate) AccountCol { id, balance, overdraft_limit, created_at }
}

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
    use JobCol as C;
    let state = r.text(C::state)?;
    let refund_on = r.text(C::refund_on)?;
    Ok(JobRow {
        id: r.text(C::id)?,
        account_id: r.text(C::account_id)?,
        kind: r.text(C::kind)?,
        state: JobState::parse(&state).ok_or_else(|| StoreError::internal(format!("bad job state {state}")))?,
        cost: r.i64(C::cost)?,
        attempt: r.i64(C::attempt)?,
        budget_base: r.i64(C::budget_base)?,
        max_attempts: r.i64(C::max_attempts)?,
        refund_on: RefundPolicy::parse(&refund_on)
            .ok_or_else(|| StoreError::internal(format!("bad refund policy {refund_on}")))?,
        cancel_requested: r.i64(C::cancel_requested)? != 0,
        not_before: r.i64(C::not_before)?,
        lease_token: r.opt_text(C::lease_token)?,
        lease_expires_at: r.opt_i64(C::lease_expires_at)?,
        last_error_code: r.opt_text(C::last_error_code)?,
        last_error_message: r.opt_text(C::last_error_message)?,
        unknown_since: r.opt_i64(C::unknown_since)?,
        payload: r.text(C::payload)?,
        request_hash: r.blob(C::request_hash)?,
        created_at: r.i64(C::created_at)?,
        updated_at: r.i64(C::updated_at)?,
        lease_seconds: r.i64(C::lease_seconds)?,
        job_seq: r.i64(C::job_seq)?,
        result: r.opt_text(C::result)?,
    })
}

static SELECT_JOB: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM jobs WHERE id = $1", JobCol::LIST));
static LOCK_JOB_PG: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM jobs WHERE id = $1 FOR UPDATE", JobCol::LIST));
/// An account with its request fingerprint after its columns (at `AccountCol::COUNT`).
pub(crate) static SELECT_ACCOUNT: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {}, request_hash FROM accounts WHERE id = $1", AccountCol::LIST));
/// One item of a job.
pub(crate) static SELECT_ITEM: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM items WHERE job_id = $1 AND item_id = $2", ItemCol::LIST));
static JOB_ITEMS_AND_NET: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {}, (SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_id = $1) \
         FROM items WHERE job_id = $1 ORDER BY ord",
        ItemCol::LIST
    )
});

/// Reads the job row and, on PostgreSQL, locks it until commit. Every job transition starts here,
/// so the decision below is made on a row no one else can change (lock order: job → items →
/// account → counters).
pub(crate) async fn lock_job(db: &mut Db<'_>, id: &str) -> Result<Option<JobRow>, StoreError> {
    let sql = match db.engine() {
        Engine::Sqlite => &*SELECT_JOB,
        Engine::Postgres => &*LOCK_JOB_PG,
    };
    db.opt(sql, args![id]).await?.map(|r| job_row(&r)).transpose()
}

pub(crate) async fn must_lock_job(db: &mut Db<'_>, id: &str) -> Result<JobRow, StoreError> {
    lock_job(db, id).await?.ok_or_else(|| StoreError::not_found("job", id))
}

pub(crate) async fn read_job(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Option<Job>, StoreError> {
    let Some(row) = db.opt(&SELECT_JOB, args![id]).await? else { return Ok(None) };
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
    let rows = db.all(&JOB_ITEMS_AND_NET, args![&row.id]).await?;
    let items = rows.iter().map(item_from_row).collect::<Result<Vec<_>, _>>()?;
    let mut net = match rows.first() {
        Some(r) => Credits::new(r.i64(ItemCol::COUNT)?),
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

pub(crate) fn item_from_row(r: &Row) -> Result<Item, StoreError> {
    use ItemCol as C;
    let state = r.text(C::state)?;
    Ok(Item {
        id: r.text(C::item_id)?,
        cost: Credits::new(r.i64(C::cost)?),
        state: ItemState::parse(&state).ok_or_else(|| StoreError::internal(format!("bad item state {state}")))?,
        refund_reason: r
            .opt_text(C::refund_reason)?
            .map(|t| name(RefundReason::parse, "refund reason", t))
            .transpose()?,
    })
}

pub(crate) fn entry_from_row(r: &Row) -> Result<LedgerEntry, StoreError> {
    use EntryCol as C;
    let kind = r.text(C::kind)?;
    let hash = r.blob(C::hash)?;
    Ok(LedgerEntry {
        seq: r.i64(C::seq)?,
        account_id: r.text(C::account_id)?,
        kind: EntryKind::parse(&kind).ok_or_else(|| StoreError::internal(format!("bad entry kind {kind}")))?,
        amount: Credits::new(r.i64(C::amount)?),
        balance_after: Credits::new(r.i64(C::balance_after)?),
        job_id: r.opt_text(C::job_id)?,
        item_id: r.opt_text(C::item_id)?,
        ref_id: r.opt_text(C::ref_id)?,
        reason: r.opt_text(C::reason)?,
        created_at: Timestamp::from_micros(r.i64(C::created_at)?),
        hash: hash.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes"))?,
    })
}

pub(crate) fn account_from_row(r: &Row) -> Result<Account, StoreError> {
    use AccountCol as C;
    Ok(Account {
        id: AccountId::stored(&r.text(C::id)?),
        balance: Credits::new(r.i64(C::balance)?),
        overdraft_limit: Credits::new(r.i64(C::overdraft_limit)?),
        created_at: Timestamp::from_micros(r.i64(C::created_at)?),
    })
}

/// A stored name read back into its enum; a name this build does not know is an internal error.
pub(crate) fn name<T>(parse: fn(&str) -> Option<T>, what: &str, text: String) -> Result<T, StoreError> {
    parse(&text).ok_or_else(|| StoreError::internal(format!("bad {what} {text}")))
}

pub(crate) fn event_from_row(r: &Row, at: usize) -> Result<Event, StoreError> {
    Ok(Event {
        seq: r.i64(at)?,
        kind: name(EventKind::parse, "event type", r.text(at + 1)?)?,
        job_id: r.opt_text(at + 2)?,
        account_id: r.text(at + 3)?,
        data: r.text(at + 4)?,
        created_at: Timestamp::from_micros(r.i64(at + 5)?),
    })
}

pub(crate) const DELIVERY_SELECT: &str = "SELECT d.endpoint_id, d.state, d.attempts, d.next_attempt_at, d.last_status, d.last_error, \
     d.delivered_at, o.seq, o.type, o.job_id, o.account_id, o.data, o.created_at \
     FROM webhook_deliveries d JOIN outbox o ON o.seq = d.event_seq";

pub(crate) fn delivery_from_row(r: &Row) -> Result<Delivery, StoreError> {
    Ok(Delivery {
        endpoint_id: r.text(0)?,
        state: name(DeliveryState::parse, "delivery state", r.text(1)?)?,
        attempts: u32::try_from(r.i64(2)?).map_err(StoreError::internal)?,
        next_attempt_at: Timestamp::from_micros(r.i64(3)?),
        last_status: r.opt_i64(4)?.map(|s| s as u16),
        last_error: r.opt_text(5)?,
        delivered_at: r.opt_i64(6)?.map(Timestamp::from_micros),
        event: event_from_row(r, 7)?,
        lease_token: None,
    })
}

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
