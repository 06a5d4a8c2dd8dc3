//! Reading rows: every column list is written once, and rows are decoded by column name from it.

use super::{Cx, lock_pending};
use crate::db::{Db, Engine, Holds, Row, args, columns, holds};
use crate::error::StoreError;
use crate::model::*;
use settle_core::history::EventKind;
use settle_core::ids::{AccountId, ItemId, JobId, JobKind, Labels};
use settle_core::item::{ItemState, RefundReason};
use settle_core::job::{JobState, Rail, RefundPolicy};
use settle_core::ledger::EntryKind;
use settle_core::{Credits, Timestamp, limits};
use std::sync::LazyLock;

columns! {
    /// A job row's columns.
    pub(crate) JobCol {
        id, account_id, kind, state, cost, attempt, budget_base, max_attempts, refund_on, cancel_requested,
        not_before, lease_token, lease_expires_at, lease_worker, last_error_code, last_error_message,
        unknown_since, payload, request_hash, created_at, updated_at, lease_seconds, job_seq, result, priority,
        requires,
    }
}

columns! {
    /// An item row's columns, as a job shows them.
    pub(crate) ItemCol { item_id, cost, hold, state, refund_reason }
}

columns! {
    /// A job's items, each row carrying the job's net: the sum of its ledger entries (an
    /// uncorrelated subquery, run once).
    ItemNetCol {
        item_id, cost, hold, state, refund_reason,
        net = "(SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_id = $1)",
    }
}
holds!(ItemNetCol: ItemCol { item_id, cost, hold, state, refund_reason });

columns! {
    /// The items of a page of jobs, each row naming its job.
    ItemOfCol { job_id, item_id, cost, hold, state, refund_reason }
}
holds!(ItemOfCol: ItemCol { item_id, cost, hold, state, refund_reason });

columns! {
    /// The net of each job of a page: the sum of its ledger entries.
    NetOfCol { job_id, net = "CAST(SUM(amount) AS bigint)" }
}

columns! {
    /// The same on SQLite, whose lines are filed by their job's number (migration 0037).
    NetOfSeqCol { job_seq, net = "CAST(SUM(amount) AS bigint)" }
}

/// A job's net on SQLite: its lines found by its number `$2` (`ledger_entries_job_seq`, migration
/// 0037, decision 0039); PostgreSQL's (`ItemNetCol`'s own) finds them by its id.
const NET_BY_NUMBER: &str = "(SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_seq = $2)";

columns! {
    /// A ledger entry's columns, as `LedgerEntry` shows them.
    pub(crate) EntryCol { seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason, created_at, hash }
}

columns! {
    /// An account row's columns, as `Account` shows them, and the fingerprint of the request that
    /// created it (what a replay of the create is compared with).
    pub(crate) AccountCol { id, balance, overdraft_limit, max_running, created_at, request_hash }
}

columns! {
    /// A numbered event's columns, as `Event` shows them, over `EVENTS` (`type` is a Rust keyword).
    pub(crate) EventCol {
        seq = "n.first_seq + e.pos - 1", kind = "e.type", job_id = "e.job_id", account_id = "e.account_id",
        data = "e.data", created_at = "e.created_at",
        epoch = "(SELECT MAX(x.epoch) FROM store_epochs x WHERE x.first_seq <= n.first_seq + e.pos - 1)",
    }
}

columns! {
    /// A webhook delivery joined with its event.
    pub(crate) DeliveryCol {
        endpoint_id = "d.endpoint_id", state = "d.state", attempts = "d.attempts",
        next_attempt_at = "d.next_attempt_at", last_status = "d.last_status", last_error = "d.last_error",
        delivered_at = "d.delivered_at",
        seq = "d.event_seq", kind = "o.type", job_id = "o.job_id", account_id = "o.account_id", data = "o.data",
        created_at = "o.created_at",
        epoch = "(SELECT MAX(x.epoch) FROM store_epochs x WHERE x.first_seq <= d.event_seq)",
    }
}
holds!(DeliveryCol: EventCol { seq, kind, job_id, account_id, data, created_at, epoch });

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
    pub priority: u8,
    /// `Labels::text`.
    pub requires: String,
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
        priority: u8::try_from(r.i64(C::priority)?).map_err(StoreError::internal)?,
        requires: r.text(C::requires)?,
    })
}

static SELECT_JOB: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM jobs WHERE id = $1", JobCol::LIST));
static LOCK_JOB_PG: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM jobs WHERE id = $1 FOR UPDATE", JobCol::LIST));
/// An account with its request fingerprint.
pub(crate) static SELECT_ACCOUNT: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", AccountCol::LIST));
/// One item of a job.
pub(crate) static SELECT_ITEM: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM items WHERE job_id = $1 AND item_id = $2", ItemCol::LIST));
static JOB_ITEMS_AND_NET: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM items WHERE job_id = $1 ORDER BY ord", ItemNetCol::LIST));
pub(crate) static JOB_ITEMS_AND_NET_LITE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM items WHERE job_id = $1 ORDER BY ord",
        ItemNetCol::list_with(ItemNetCol::net, NET_BY_NUMBER)
    )
});

/// Reads the job row and, on PostgreSQL, locks it until commit. Every job transition starts here,
/// so the decision below is made on a row no one else can change (the first lock of the lock order,
/// ARCHITECTURE.md; SQLite's writer holds everything).
pub(crate) async fn lock_job(db: &mut Db<'_>, id: &str) -> Result<Option<JobRow>, StoreError> {
    let sql = match db.engine() {
        Engine::Sqlite => &*SELECT_JOB,
        Engine::Postgres => &*LOCK_JOB_PG,
    };
    db.opt(sql, args![id]).await?.map(|r| job_row(&r)).transpose()
}

/// The job row as committed, without a lock (`None`: no such job).
pub(crate) async fn read_job_row(db: &mut Db<'_>, id: &str) -> Result<Option<JobRow>, StoreError> {
    db.opt(&SELECT_JOB, args![id]).await?.map(|r| job_row(&r)).transpose()
}

/// A job's columns, each qualified by `alias` (`accounts` has columns of the same names).
fn job_cols_of(alias: &str) -> String {
    JobCol::LIST.split(", ").map(|c| format!("{alias}.{c}")).collect::<Vec<_>>().join(", ")
}
static ACCOUNT_AND_JOB_SQLITE: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM accounts a LEFT JOIN jobs j ON j.id = $2 WHERE a.id = $1", job_cols_of("j"))
});
/// The job's lock is taken in the subquery (its `LockRows`), only when the account exists.
static ACCOUNT_AND_JOB_PG: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM accounts a LEFT JOIN LATERAL (SELECT {} FROM jobs WHERE id = $2 FOR UPDATE) j ON true \
         WHERE a.id = $1",
        job_cols_of("j"),
        JobCol::LIST
    )
});

/// `lock_job` for a job of `account`, in the same round trip as the check that the account exists:
/// `None` when it does not (nothing locked), else the job if there is one.
pub(crate) async fn lock_account_job(
    db: &mut Db<'_>,
    account: &str,
    id: &str,
) -> Result<Option<Option<JobRow>>, StoreError> {
    let sql = match db.engine() {
        Engine::Sqlite => &*ACCOUNT_AND_JOB_SQLITE,
        Engine::Postgres => &*ACCOUNT_AND_JOB_PG,
    };
    let Some(r) = db.opt(sql, args![account, id]).await? else { return Ok(None) };
    if r.opt_text(JobCol::id)?.is_none() {
        return Ok(Some(None));
    }
    Ok(Some(Some(job_row(&r)?)))
}

pub(crate) async fn must_lock_job(db: &mut Db<'_>, id: &str) -> Result<JobRow, StoreError> {
    lock_job(db, id).await?.ok_or_else(|| StoreError::not_found("job", id))
}

/// The columns after a job's (`JobCol`, in its order) in `JOB_WITH_ITEMS_PG`: one of its items (NULL
/// when it has none) and the job's net.
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum JobItemCol {
    item_id,
    cost,
    hold,
    state,
    refund_reason,
    net,
}

impl crate::db::Col for JobItemCol {
    fn at(self) -> usize {
        JobCol::COUNT + self as usize
    }
}

impl Holds<ItemCol> for JobItemCol {
    fn of(column: ItemCol) -> JobItemCol {
        match column {
            ItemCol::item_id => JobItemCol::item_id,
            ItemCol::cost => JobItemCol::cost,
            ItemCol::hold => JobItemCol::hold,
            ItemCol::state => JobItemCol::state,
            ItemCol::refund_reason => JobItemCol::refund_reason,
        }
    }
}

/// A job with its items, one row each, in one statement (PostgreSQL: one round trip): the job's
/// columns first (read by `job_row`), then `JobItemCol`'s. The job's texts that may be large (a
/// payload of up to 256 KiB, a result, an error message) come on the first item's row only (the
/// first position is an uncorrelated subquery, an init plan run once): repeated on each of 1,000
/// items they made one read of a fat job 256 MB from the engine.
static JOB_WITH_ITEMS_PG: LazyLock<String> = LazyLock::new(|| {
    let cols = JobCol::LIST
        .split(", ")
        .map(|c| match c {
            "payload" | "result" | "last_error_message" => format!(
                "CASE WHEN i.ord IS NULL OR i.ord = (SELECT MIN(ord) FROM items WHERE job_id = $1) THEN j.{c} END"
            ),
            _ => format!("j.{c}"),
        })
        .collect::<Vec<_>>()
        .join(", ");
    format!(
        "SELECT {cols}, i.item_id, i.cost, i.hold, i.state, i.refund_reason, \
         (SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_id = $1) \
         FROM jobs j LEFT JOIN items i ON i.job_id = j.id WHERE j.id = $1 ORDER BY i.ord"
    )
});

/// The job with its items and net. SQLite (no round trips) reads the row, then the items and net:
/// fewer instructions than the join, whose sorter carried the job's columns on every item's row
/// (callgrind, `settle bench`: 44.5 k a read against 59.9 k).
pub(crate) async fn read_job(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Option<Job>, StoreError> {
    if db.engine() == Engine::Sqlite {
        return match read_job_row(db, id).await? {
            Some(row) => Ok(Some(attach(db, cx, row).await?)),
            None => Ok(None),
        };
    }
    let rows = db.all(&JOB_WITH_ITEMS_PG, args![id]).await?;
    let Some(first) = rows.first() else { return Ok(None) };
    let row = job_row(first)?;
    let mut items = Vec::with_capacity(rows.len());
    for r in &rows {
        if r.opt_text(JobItemCol::item_id)?.is_some() {
            items.push(item_from_row::<JobItemCol>(r)?);
        }
    }
    let net = Credits::new(first.i64(JobItemCol::net)?);
    Ok(Some(assemble(cx, row, items, net)?))
}

pub(crate) async fn must_read_job(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Job, StoreError> {
    read_job(db, cx, id).await?.ok_or_else(|| StoreError::not_found("job", id))
}

/// Completes a job row with its items and its net (the sum of its ledger entries, those the
/// transaction has queued included).
pub(crate) async fn attach(db: &mut Db<'_>, cx: &Cx, row: JobRow) -> Result<Job, StoreError> {
    // One statement: the items, each row carrying the job's net (an uncorrelated subquery, run once).
    let rows = match db.engine() {
        Engine::Sqlite => db.all(&JOB_ITEMS_AND_NET_LITE, args![&row.id, row.job_seq]).await?,
        Engine::Postgres => db.all(&JOB_ITEMS_AND_NET, args![&row.id]).await?,
    };
    let items = rows.iter().map(item_from_row::<ItemNetCol>).collect::<Result<Vec<_>, _>>()?;
    let net = match rows.first() {
        Some(r) => Credits::new(r.i64(ItemNetCol::net)?),
        None => Credits::ZERO,
    };
    assemble(cx, row, items, net)
}

/// SQLite's nets of a page of jobs by their numbers (`list`: `IN (…)` of them), migration 0037.
pub(crate) fn nets_by_number(list: &str) -> String {
    format!("SELECT {} FROM ledger_entries WHERE job_seq {list} GROUP BY job_seq", NetOfSeqCol::LIST)
}

/// Completes a page of job rows, as `attach` completes one, in two statements whatever the page's
/// length (its items, its nets) rather than one per job: a list's cost grows with its rows read,
/// not with round trips to the engine.
pub(crate) async fn attach_all(db: &mut Db<'_>, cx: &Cx, rows: Vec<JobRow>) -> Result<Vec<Job>, StoreError> {
    if rows.len() < 2 {
        let mut jobs = Vec::with_capacity(rows.len());
        for row in rows {
            jobs.push(attach(db, cx, row).await?);
        }
        return Ok(jobs);
    }
    // PostgreSQL takes the page's ids as one array, so the statement's text is one whatever the
    // page's length (an `IN` list per length would crowd hot statements out of a connection's
    // prepared-statement cache); SQLite has no arrays and takes the list.
    let (ids, list): (Vec<crate::db::Value>, String) = if db.engine() == crate::db::Engine::Postgres {
        (vec![crate::db::Value::Texts(rows.iter().map(|r| r.id.clone()).collect())], "= ANY($1)".to_owned())
    } else {
        let list = (1..=rows.len()).map(|i| format!("${i}")).collect::<Vec<_>>().join(", ");
        (rows.iter().map(|r| r.id.as_str().into()).collect(), format!("IN ({list})"))
    };
    let items_sql = format!("SELECT {} FROM items WHERE job_id {list} ORDER BY job_id, ord", ItemOfCol::LIST);
    let mut items: std::collections::HashMap<String, Vec<Item>> = std::collections::HashMap::with_capacity(rows.len());
    for r in db.all_built(items_sql, &ids).await? {
        items.entry(r.text(ItemOfCol::job_id)?).or_default().push(item_from_row::<ItemOfCol>(&r)?);
    }
    let mut nets = std::collections::HashMap::with_capacity(rows.len());
    if db.engine() == Engine::Sqlite {
        // SQLite's lines are filed by their job's number (migration 0037).
        let seqs: Vec<crate::db::Value> = rows.iter().map(|r| crate::db::Value::I64(r.job_seq)).collect();
        let by_seq: std::collections::HashMap<i64, &str> = rows.iter().map(|r| (r.job_seq, r.id.as_str())).collect();
        let nets_sql = nets_by_number(&list);
        for r in db.all_built(nets_sql, &seqs).await? {
            let id = by_seq.get(&r.i64(NetOfSeqCol::job_seq)?).copied().unwrap_or_default();
            nets.insert(id.to_owned(), Credits::new(r.i64(NetOfSeqCol::net)?));
        }
    } else {
        let nets_sql = format!("SELECT {} FROM ledger_entries WHERE job_id {list} GROUP BY job_id", NetOfCol::LIST);
        for r in db.all_built(nets_sql, &ids).await? {
            nets.insert(r.text(NetOfCol::job_id)?, Credits::new(r.i64(NetOfCol::net)?));
        }
    }
    rows.into_iter()
        .map(|row| {
            let net = nets.get(&row.id).copied().unwrap_or(Credits::ZERO);
            let its = items.remove(&row.id).unwrap_or_default();
            assemble(cx, row, its, net)
        })
        .collect()
}

/// A job from its row, its items and its net as stored, the transaction's queued entries added.
pub(super) fn assemble(cx: &Cx, row: JobRow, items: Vec<Item>, mut net: Credits) -> Result<Job, StoreError> {
    if let Some(pending) = &cx.pending {
        net = net.checked_add(lock_pending(pending).job_amount(&row.id)?)?;
    }
    Ok(Job {
        id: stored_id(JobId::stored, "job id", &row.id)?,
        account_id: stored_id(AccountId::stored, "account id", &row.account_id)?,
        kind: stored_id(JobKind::stored, "job kind", &row.kind)?,
        state: row.state,
        cost: Credits::new(row.cost),
        net,
        attempt: u32::try_from(row.attempt).map_err(StoreError::internal)?,
        max_attempts: u32::try_from(row.max_attempts).map_err(StoreError::internal)?,
        budget_base: u32::try_from(row.budget_base).map_err(StoreError::internal)?,
        refund_on: row.refund_on,
        cancel_requested: row.cancel_requested,
        not_before: Timestamp::from_micros(row.not_before),
        priority: row.priority,
        requires: Labels::stored(&row.requires),
        lease_expires_at: row.lease_expires_at.map(Timestamp::from_micros),
        last_error: row.last_error_code.map(|code| LastError { code, message: row.last_error_message }),
        items,
        payload: row.payload,
        result: row.result,
        created_at: Timestamp::from_micros(row.created_at),
        updated_at: Timestamp::from_micros(row.updated_at),
    })
}

/// An item, from a row of any column set that holds `ItemCol`.
pub(crate) fn item_from_row<C: Holds<ItemCol>>(r: &Row) -> Result<Item, StoreError> {
    use ItemCol as I;
    let state = r.text(C::of(I::state))?;
    Ok(Item {
        id: stored_id(ItemId::stored, "item id", &r.text(C::of(I::item_id))?)?,
        cost: Credits::new(r.i64(C::of(I::cost))?),
        hold: r.opt_i64(C::of(I::hold))?.map(Credits::new),
        state: ItemState::parse(&state).ok_or_else(|| StoreError::internal(format!("bad item state {state}")))?,
        refund_reason: r
            .opt_text(C::of(I::refund_reason))?
            .map(|t| name(RefundReason::parse, "refund reason", t))
            .transpose()?,
    })
}

/// A ledger entry, from a row of any column set that holds `EntryCol`.
pub(crate) fn entry_from_row<C: Holds<EntryCol>>(r: &Row) -> Result<LedgerEntry, StoreError> {
    use EntryCol as E;
    let kind = r.text(C::of(E::kind))?;
    let hash = r.blob(C::of(E::hash))?;
    Ok(LedgerEntry {
        seq: r.i64(C::of(E::seq))?,
        account_seq: r.i64(C::of(E::account_seq))?,
        account_id: stored_id(AccountId::stored, "account id", &r.text(C::of(E::account_id))?)?,
        kind: EntryKind::parse(&kind).ok_or_else(|| StoreError::internal(format!("bad entry kind {kind}")))?,
        amount: Credits::new(r.i64(C::of(E::amount))?),
        balance_after: Credits::new(r.i64(C::of(E::balance_after))?),
        job_id: r.opt_text(C::of(E::job_id))?,
        item_id: r.opt_text(C::of(E::item_id))?,
        ref_id: r.opt_text(C::of(E::ref_id))?,
        reason: r.opt_text(C::of(E::reason))?,
        created_at: Timestamp::from_micros(r.i64(C::of(E::created_at))?),
        hash: hash.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes"))?,
    })
}

pub(crate) fn account_from_row(r: &Row) -> Result<Account, StoreError> {
    use AccountCol as C;
    Ok(Account {
        id: stored_id(AccountId::stored, "account id", &r.text(C::id)?)?,
        balance: Credits::new(r.i64(C::balance)?),
        overdraft_limit: Credits::new(r.i64(C::overdraft_limit)?),
        max_running: r.opt_i64(C::max_running)?,
        created_at: Timestamp::from_micros(r.i64(C::created_at)?),
    })
}

/// An id read back from Settle's own rows (`JobId::stored` and its kin): not checked again
/// against today's rule, as it was checked when it was written, perhaps under an earlier one
/// (decision 0017) — but one that is not even 1-128 characters is an internal error, not a panic.
pub(crate) fn stored_id<T>(stored: fn(&str) -> T, what: &str, text: &str) -> Result<T, StoreError> {
    if text.is_empty() || text.len() > limits::ID_LEN_MAX {
        return Err(StoreError::internal(format!("bad stored {what} {text:?}")));
    }
    Ok(stored(text))
}

/// A stored name read back into its enum; a name this build does not know is an internal error.
pub(crate) fn name<T>(parse: fn(&str) -> Option<T>, what: &str, text: String) -> Result<T, StoreError> {
    parse(&text).ok_or_else(|| StoreError::internal(format!("bad {what} {text}")))
}

/// An outbox event, from a row of any column set that holds `EventCol`.
pub(crate) fn event_from_row<C: Holds<EventCol>>(r: &Row) -> Result<Event, StoreError> {
    use EventCol as E;
    Ok(Event {
        seq: r.i64(C::of(E::seq))?,
        kind: name(EventKind::parse, "event type", r.text(C::of(E::kind))?)?,
        job_id: r.opt_text(C::of(E::job_id))?,
        account_id: r.text(C::of(E::account_id))?,
        data: r.text(C::of(E::data))?,
        created_at: Timestamp::from_micros(r.i64(C::of(E::created_at))?),
        epoch: r.opt_i64(C::of(E::epoch))?.unwrap_or(1),
    })
}

/// Numbered events (`EventCol`'s `FROM`): each event with its stamp's numbers.
pub(crate) const EVENTS: &str = "stamp_numbers n JOIN events e ON e.stamp = n.stamp";

/// Deliveries with their events; a statement adds its `WHERE`. A delivery's event is found by its
/// number: the stamp whose range holds it (the least `last_seq` at or after it), then its place.
pub(crate) static DELIVERY_SELECT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM webhook_deliveries d \
         JOIN stamp_numbers n ON n.last_seq = (SELECT MIN(m.last_seq) FROM stamp_numbers m WHERE m.last_seq >= d.event_seq) \
         JOIN events o ON o.stamp = n.stamp AND o.pos = d.event_seq - n.first_seq + 1",
        DeliveryCol::LIST
    )
});

pub(crate) fn delivery_from_row(r: &Row) -> Result<Delivery, StoreError> {
    use DeliveryCol as C;
    Ok(Delivery {
        endpoint_id: r.text(C::endpoint_id)?,
        state: name(DeliveryState::parse, "delivery state", r.text(C::state)?)?,
        attempts: u32::try_from(r.i64(C::attempts)?).map_err(StoreError::internal)?,
        next_attempt_at: Timestamp::from_micros(r.i64(C::next_attempt_at)?),
        last_status: r.opt_i64(C::last_status)?.map(|s| s as u16),
        last_error: r.opt_text(C::last_error)?,
        delivered_at: r.opt_i64(C::delivered_at)?.map(Timestamp::from_micros),
        event: event_from_row::<DeliveryCol>(r)?,
        lease_token: None,
    })
}

/// Who sends a signal. A reserved kind's jobs move only through its rail's processor and
/// reconciler (the external system is their only source of truth); every other job only through
/// workers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Caller {
    Worker,
    /// The built-in processor of a reserved rail (payouts, funding).
    Processor(Rail),
}

impl Caller {
    pub(crate) const PAYOUTS: Caller = Caller::Processor(Rail::Payout);
    pub(crate) const FUNDING: Caller = Caller::Processor(Rail::Funding);

    fn rail(self) -> Rail {
        match self {
            Caller::Worker => Rail::Work,
            Caller::Processor(rail) => rail,
        }
    }
}

/// Refuses a signal whose caller may not move this job (docs/decisions/0010).
pub(crate) fn check_caller(job: &JobRow, caller: Caller) -> Result<(), StoreError> {
    let rail = Rail::of(&job.kind);
    if rail == caller.rail() {
        return Ok(());
    }
    let action = match (rail, caller) {
        (Rail::Payout, Caller::Worker) => {
            "take worker signals (withdrawals are settled by the payout processor against the provider)"
        }
        (Rail::Funding, Caller::Worker) => {
            "take worker signals (top-ups are settled by the funding processor against the provider)"
        }
        (_, Caller::Processor(Rail::Funding)) => "be settled as a top-up (it is not a top-up)",
        _ => "be settled as a payout (it is not a withdrawal)",
    };
    Err(StoreError::InvalidTransition { job: job.id.clone(), action, state: job.state.as_str().to_owned() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stored_id_is_not_checked_again_but_an_impossible_one_is_an_error() {
        // Refused by today's rule (decision 0017), yet a row may hold it from before.
        assert_eq!(stored_id(JobId::stored, "job id", "..").unwrap().as_str(), "..");
        for bad in [String::new(), "x".repeat(limits::ID_LEN_MAX + 1)] {
            assert!(matches!(stored_id(JobId::stored, "job id", &bad), Err(StoreError::Internal(_))), "{bad:?}");
        }
    }

    #[test]
    fn a_job_with_items_reads_its_items_after_the_jobs_columns() {
        assert_eq!(JobCol::COUNT, JobCol::LIST.split(", ").count());
        assert_eq!(JobCol::LIST.split(", ").count(), job_cols_of("j").split(", ").count());
        assert_eq!(crate::db::Col::at(JobItemCol::item_id), JobCol::COUNT);
    }
}

/// An item as read: id, cost, hold, state, refund reason.
pub(crate) type ItemRead = (String, i64, Option<i64>, String, Option<String>);

/// An open allocation part as read: id, grant, item, what is still open, whether its grant is live.
pub(crate) type PartRead = (i64, Option<i64>, Option<String>, i64, Option<bool>);

/// What a job's plan reads before it decides, under the job's lock (its snapshot taken after the
/// lock: review H1): its items in order, its net as stored, the open parts of its items with
/// whether each part's grant is live (a failure's), the attempt that held a success's token, and
/// its account's `next_expiry` — the last two of the account's side, not locked, so guarded again
/// by the write.
#[derive(Debug, Clone)]
pub(crate) struct PlanRead {
    pub items: Vec<ItemRead>,
    pub net: i64,
    pub parts: Vec<PartRead>,
    pub token_attempt: Option<i64>,
    pub next_expiry: Option<i64>,
}

/// A job an intent names, locked and read by its batch's phase 1 (docs/design/batch-plan.md §12).
#[derive(Debug, Clone)]
pub(crate) struct ReadAhead {
    pub row: JobRow,
    pub read: PlanRead,
}
