//! Which source of credit paid for each movement (docs/decisions/0023): grants burned down in order,
//! every return back to where it came from, and debt — the grants' side of a posting. It never posts
//! itself: the posting calls it (`postings`), and the expiry of due grants has a room of its own
//! (`expiry`), above the posting.
//!
//! Everything here runs inside `postings::post`, after the posting's guarded balance UPDATE: that
//! UPDATE holds the account row (PostgreSQL) or the single writer holds everything (SQLite), so no
//! other transaction moves this account's grants, allocations or debt meanwhile (the lock order:
//! ARCHITECTURE.md); the expiry takes the account row first too.

use super::{Cx, Line, guard_hit};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use settle_core::Timestamp;
use settle_core::ledger::{AllocationKind, EntryKind, GrantOrigin};
use std::collections::HashMap;
use std::sync::LazyLock;

/// `expiry_key` of a grant that never expires, and `next_expiry` of an account with none due.
pub(crate) const NEVER: i64 = i64::MAX;
/// Priority of a grant that names none, of adjustments and of opening balances.
pub(crate) const PRIORITY_DEFAULT: i64 = 50;
/// How many grants one read of the burn-down order takes.
const HEAD_ROWS: i64 = 16;

/// Which grants a debit may take from (docs/decisions/0023).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Spend {
    /// Any active grant, in burn-down order; what they do not cover is debt.
    Any,
    /// A withdrawal's money: only grants that never expire (expiring credit is never cash); what
    /// they do not cover is debt (a reclaim of a payout that went out after all).
    Cash,
    /// A withdrawal being made: only grants that never expire, and refused whole
    /// (`InsufficientCash`) when they do not cover it.
    CashOnly,
}

/// A grant's terms: its priority, when it expires (never, for `None`), and where a `grant` line's
/// credit comes from (given by an admin, or bought: a top-up's).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Terms {
    pub priority: i64,
    pub expires_at: Option<Timestamp>,
    pub origin: GrantOrigin,
}

impl Default for Terms {
    fn default() -> Terms {
        Terms { priority: PRIORITY_DEFAULT, expires_at: None, origin: GrantOrigin::Grant }
    }
}

columns! {
    /// One grant at the head of the burn-down order.
    HeadCol { key, remaining, priority, expiry_key }
}

columns! {
    /// A movement's part still open: what may be given back, to which grant (none: debt), and for
    /// a debt part what later credit has paid of it.
    PartCol { id, grant_key, item_id, open = "taken - given_back", settled }
}

columns! {
    /// What an account's live grants that never expire have left: its cash before its debt.
    CashCol { cash = "CAST(COALESCE(SUM(remaining), 0) AS BIGINT)" }
}

columns! {
    /// A debt part not yet paid.
    UnpaidCol { id, unpaid = "taken - given_back - settled" }
}

columns! {
    /// A grant's id, for the ref of an expiry.
    SourceCol { source_id }
}

static HEAD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM grants WHERE account_id = $1 AND spent = 0 AND expired_at IS NULL \
         AND (priority, expiry_key, key) > ($2, $3, $4) ORDER BY priority, expiry_key, key LIMIT $5",
        HeadCol::LIST
    )
});
// A withdrawal's: only credit that never expires is cash (docs/decisions/0023).
static CASH_HEAD: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM grants WHERE account_id = $1 AND spent = 0 AND expired_at IS NULL \
         AND (priority, expiry_key, key) > ($2, $3, $4) AND expiry_key = 9223372036854775807 \
         ORDER BY priority, expiry_key, key LIMIT $5",
        HeadCol::LIST
    )
});
// Every grant the cash rule counts (semantics §1), by the burn-down index.
static CASH: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM grants WHERE account_id = $1 AND spent = 0 AND expired_at IS NULL \
         AND expiry_key = 9223372036854775807",
        CashCol::LIST
    )
});
static UNPAID: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM allocations WHERE account_id = $1 AND owed = 1 \
         ORDER BY id LIMIT $2",
        UnpaidCol::LIST
    )
});
static SETTLEMENTS_OF: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM allocations WHERE paid_part = $1 AND given_back < taken ORDER BY id DESC", PartCol::LIST)
});
/// An item's open parts, last taken first. On SQLite a job's parts are filed by its number
/// (`allocations_job_seq`, migration 0037), read once from the job's row by the statement.
fn open_item_parts(job: &str) -> String {
    format!(
        "SELECT {} FROM allocations WHERE {job} AND item_id = $2 AND given_back < taken ORDER BY id DESC",
        PartCol::LIST
    )
}
static OPEN_ITEM_PARTS: LazyLock<String> = LazyLock::new(|| open_item_parts("job_id = $1"));
static OPEN_ITEM_PARTS_LITE: LazyLock<String> =
    LazyLock::new(|| open_item_parts("job_seq = (SELECT job_seq FROM jobs WHERE id = $1)"));
/// A job's open parts: each item's last taken first; the order across items does not matter (and
/// lets the index `(job, item_id, id)` give the rows in order, read backwards).
fn open_parts(job: &str) -> String {
    format!(
        "SELECT {} FROM allocations WHERE {job} AND given_back < taken ORDER BY item_id DESC, id DESC",
        PartCol::LIST
    )
}
static OPEN_PARTS: LazyLock<String> = LazyLock::new(|| open_parts("job_id = $1"));
static OPEN_PARTS_LITE: LazyLock<String> =
    LazyLock::new(|| open_parts("job_seq = (SELECT job_seq FROM jobs WHERE id = $1)"));
static SOURCE: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM grants WHERE key = $1", SourceCol::LIST));

columns! {
    /// The account row as the expiry locks it, and a new grant reads it.
    pub(super) LockCol { next_expiry, last_account_seq }
}

pub(super) static READ_ACCOUNT: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", LockCol::LIST));
pub(super) const SET_NEXT_EXPIRY: &str = "UPDATE accounts SET next_expiry = $2 WHERE id = $1";

// Every write of `remaining` keeps `spent` (1 when nothing remains: the burn-down index's predicate,
// migration 0025), so a take that leaves something changes no indexed column.
const TAKE: &str = "UPDATE grants SET remaining = remaining - $2, spent = CASE WHEN remaining = $2 THEN 1 ELSE 0 END \
     WHERE key = $1 AND remaining >= $2 AND expired_at IS NULL";
const RETURN_LIVE: &str = "UPDATE grants SET remaining = remaining + $2, \
     spent = CASE WHEN remaining + $2 = 0 THEN 1 ELSE 0 END WHERE key = $1 AND expired_at IS NULL";
// Every write of `given_back` or `settled` keeps `owed` (1 for a debt part with something unpaid:
// the unpaid-debt index's predicate, migration 0025), so a grant part's give-back changes no indexed
// column.
const GIVE_BACK: &str = "UPDATE allocations SET given_back = given_back + $2, \
     owed = CASE WHEN grant_key IS NULL AND taken > given_back + $2 + settled THEN 1 ELSE 0 END \
     WHERE id = $1 AND given_back + $2 <= taken";
const SETTLE: &str = "UPDATE allocations SET settled = settled + $2, \
     owed = CASE WHEN taken > given_back + settled + $2 THEN 1 ELSE 0 END WHERE id = $1 AND grant_key IS NULL \
     AND given_back + settled + $2 <= taken";
// A debt part given back: what it returns beyond its unpaid rest un-pays it ($3), as its
// settlements are given back to the grants that paid them.
const GIVE_BACK_DEBT: &str = "UPDATE allocations SET given_back = given_back + $2, settled = settled - $3, \
     owed = CASE WHEN taken > given_back + $2 + settled - $3 THEN 1 ELSE 0 END \
     WHERE id = $1 AND grant_key IS NULL AND settled >= $3 AND given_back + $2 + settled - $3 <= taken";
const SET_DEBT: &str = "UPDATE accounts SET debt = $2 WHERE id = $1";
const INSERT_ALLOCATION: &str = "INSERT INTO allocations (account_id, grant_key, kind, job_id, item_id, ref_id, \
     account_seq, taken, paid_part, owed, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, \
     CASE WHEN $2 IS NULL AND $8 > 0 THEN 1 ELSE 0 END, $10)";
/// SQLite's: the part's `job_seq` too (`Part::job_seq`), which the table's trigger checks against
/// the job (migration 0037); PostgreSQL leaves the column NULL.
const INSERT_ALLOCATION_LITE: &str = "INSERT INTO allocations (account_id, grant_key, kind, job_id, item_id, ref_id, \
     account_seq, taken, paid_part, owed, created_at, job_seq) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, \
     CASE WHEN $2 IS NULL AND $8 > 0 THEN 1 ELSE 0 END, $10, $11)";
const INSERT_ALLOCATIONS_PG: &str = "INSERT INTO allocations (account_id, grant_key, kind, job_id, item_id, ref_id, \
     account_seq, taken, paid_part, owed, created_at) SELECT $1, g, k, j, i, r, s, t, p, \
     CASE WHEN g IS NULL AND t > 0 THEN 1 ELSE 0 END, $2 FROM unnest($3::bigint[], \
     $4::text[], $5::text[], $6::text[], $7::text[], $8::bigint[], $9::bigint[], $10::bigint[]) \
     AS a(g, k, j, i, r, s, t, p)";
/// `TAKE` and `INSERT_ALLOCATION` of the head grant in one statement: the head (as `HEAD` orders
/// it) takes $2 if it has that much, and its part is recorded; no row when it has not.
macro_rules! take_from_head_pg {
    ($filter:literal) => {
        concat!(
            "WITH head AS (SELECT key FROM grants WHERE account_id = $1 AND spent = 0 AND expired_at IS NULL ",
            $filter,
            " ORDER BY priority, expiry_key, key LIMIT 1), \
             took AS (UPDATE grants g SET remaining = g.remaining - $2, \
             spent = CASE WHEN g.remaining = $2 THEN 1 ELSE 0 END FROM head \
             WHERE g.key = head.key AND g.remaining >= $2 RETURNING g.key) \
             INSERT INTO allocations (account_id, grant_key, kind, job_id, item_id, ref_id, account_seq, taken, created_at) \
             SELECT $1, took.key, $3, $4, $5, $6, $7, $2, $8 FROM took"
        )
    };
}
const TAKE_FROM_HEAD_PG: &str = take_from_head_pg!("");
const TAKE_FROM_CASH_HEAD_PG: &str = take_from_head_pg!("AND expiry_key = 9223372036854775807");
const INSERT_GRANT: &str = "INSERT INTO grants (account_id, origin, source_id, amount, priority, expires_at, \
     expiry_key, remaining, spent, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, \
     CASE WHEN $8 = 0 THEN 1 ELSE 0 END, $9) RETURNING key";

columns! {
    /// A new grant's key.
    KeyCol { key }
}

fn add(a: i64, b: i64) -> Result<i64, StoreError> {
    a.checked_add(b).ok_or(StoreError::Overflow)
}

fn sub(a: i64, b: i64) -> Result<i64, StoreError> {
    a.checked_sub(b).ok_or(StoreError::Overflow)
}

/// One allocation row to insert.
struct Part<'a> {
    grant_key: Option<i64>,
    kind: AllocationKind,
    job_id: Option<&'a str>,
    /// Its job's number (`Line::job_seq`): SQLite's INSERT writes it, PostgreSQL's leave it NULL.
    job_seq: Option<i64>,
    item_id: Option<&'a str>,
    ref_id: Option<&'a str>,
    account_seq: i64,
    taken: i64,
    /// A settlement's debt part.
    paid_part: Option<i64>,
}

/// A part of a return that landed on a grant already expired: expired again at once.
struct Reexpiry {
    grant_key: i64,
    amount: i64,
}

/// The account as a posting leaves it, for the grants: what it owes, and what must expire at once.
pub(crate) struct Books<'a> {
    account_id: &'a str,
    debt: i64,
    debt_read: i64,
    reexpiries: Vec<Reexpiry>,
    /// The head of the burn-down order was asked already (the plan's take, which found it short):
    /// PostgreSQL's one-statement take is not tried again.
    head_asked: bool,
}

impl<'a> Books<'a> {
    pub fn new(account_id: &'a str, debt: i64) -> Books<'a> {
        Books { account_id, debt, debt_read: debt, reexpiries: Vec::new(), head_asked: false }
    }

    /// `new`, after the plan's take from the head of the burn-down order found it short.
    pub fn after_the_head(account_id: &'a str, debt: i64) -> Books<'a> {
        Books { head_asked: true, ..Books::new(account_id, debt) }
    }
}

/// The grants' side of one posting: `lines`, numbered from `first_account_seq`. Debits take in
/// burn-down order from the grants `spend` allows; returns go back to their parts; new credit pays
/// debt first and becomes a grant (`terms` for a grant line). Parts returned to grants that have
/// expired are left in `books`, for `reexpiries` and the caller's posting right after.
pub(crate) async fn account_for(
    db: &mut Db<'_>,
    cx: &Cx,
    books: &mut Books<'_>,
    lines: &[Line<'_>],
    first_account_seq: i64,
    terms: Terms,
    spend: Spend,
) -> Result<(), StoreError> {
    let mut takes: Vec<(&Line<'_>, i64)> = Vec::new();
    let mut returns: Vec<&Line<'_>> = Vec::new();
    for (line, account_seq) in lines.iter().zip(first_account_seq..) {
        let amount = line.amount.get();
        match line.kind {
            EntryKind::Charge | EntryKind::Reclaim => takes.push((line, account_seq)),
            EntryKind::Adjustment if amount < 0 => takes.push((line, account_seq)),
            EntryKind::Refund | EntryKind::Release | EntryKind::PayoutReturn => returns.push(line),
            EntryKind::Grant => open(db, cx, books, terms.origin, line, account_seq, terms).await?,
            EntryKind::Adjustment => {
                open(db, cx, books, GrantOrigin::Adjustment, line, account_seq, Terms::default()).await?
            }
            // Written by the expiry itself, which moves its grants.
            EntryKind::Expire => {}
        }
    }
    if !takes.is_empty() {
        take(db, cx, books, &takes, spend).await?;
    }
    if !returns.is_empty() {
        give_back(db, books, &returns).await?;
    }
    Ok(())
}

/// Writes what the posting changed on the account row (its debt).
pub(crate) async fn close(db: &mut Db<'_>, books: &Books<'_>) -> Result<(), StoreError> {
    if books.debt != books.debt_read {
        let rows = db.exec(SET_DEBT, args![books.account_id, books.debt]).await?;
        guard_hit(rows, "account debt")?;
    }
    Ok(())
}

/// An `expire` line owed by a part given back to a grant that had expired.
pub(crate) struct Reexpired {
    /// `{grant}#{account_seq}`: the line's own position makes it unique.
    pub ref_id: String,
    /// The grant's id.
    pub grant: String,
    pub amount: i64,
}

/// The expire lines owed by returns to expired grants, numbered from `first_account_seq`.
pub(crate) async fn reexpiries(
    db: &mut Db<'_>,
    books: &mut Books<'_>,
    first_account_seq: i64,
) -> Result<Vec<Reexpired>, StoreError> {
    let mut out = Vec::with_capacity(books.reexpiries.len());
    for (r, account_seq) in books.reexpiries.drain(..).zip(first_account_seq..) {
        let grant = db.one(&SOURCE, args![r.grant_key]).await?.text(SourceCol::source_id)?;
        out.push(Reexpired { ref_id: format!("{grant}#{account_seq}"), grant, amount: r.amount });
    }
    Ok(out)
}

/// A new grant or positive adjustment: pays the account's debt first — its unpaid debt parts,
/// oldest first, each settlement naming the part it paid — and the rest is its remaining.
async fn open(
    db: &mut Db<'_>,
    cx: &Cx,
    books: &mut Books<'_>,
    origin: GrantOrigin,
    line: &Line<'_>,
    account_seq: i64,
    terms: Terms,
) -> Result<(), StoreError> {
    let amount = line.amount.get();
    let source = line.ref_id.ok_or_else(|| StoreError::internal("a grant line without its id"))?;
    let settling = amount.min(books.debt);
    let expires_at = terms.expires_at.map(Timestamp::micros);
    let row = db
        .one(
            INSERT_GRANT,
            args![
                books.account_id,
                origin.as_str(),
                source,
                amount,
                terms.priority,
                expires_at,
                expires_at.unwrap_or(NEVER),
                sub(amount, settling)?,
                cx.now.micros()
            ],
        )
        .await?;
    let key = row.i64(KeyCol::key)?;
    let mut rest = settling;
    let mut parts = Vec::new();
    while rest > 0 {
        let rows = db.all(&UNPAID, args![books.account_id, HEAD_ROWS]).await?;
        if rows.is_empty() {
            return Err(StoreError::internal(format!(
                "account {} owes {rest} more than its debt parts",
                books.account_id
            )));
        }
        for r in &rows {
            let (id, unpaid) = (r.i64(UnpaidCol::id)?, r.i64(UnpaidCol::unpaid)?);
            let x = rest.min(unpaid);
            guard_hit(db.exec(SETTLE, args![id, x]).await?, "debt settlement")?;
            parts.push(Part {
                grant_key: Some(key),
                kind: AllocationKind::SettleDebt,
                job_id: None,
                job_seq: None,
                item_id: None,
                ref_id: Some(source),
                account_seq,
                taken: x,
                paid_part: Some(id),
            });
            rest -= x;
            if rest == 0 {
                break;
            }
        }
    }
    books.debt = sub(books.debt, settling)?;
    insert_parts(db, cx, books.account_id, &parts).await?;
    if let Some(at) = expires_at {
        // The account row is held: the soonest expiry moves only under it.
        let current = db.one(&READ_ACCOUNT, args![books.account_id]).await?.i64(LockCol::next_expiry)?;
        if at < current {
            let rows = db.exec(SET_NEXT_EXPIRY, args![books.account_id, at]).await?;
            guard_hit(rows, "account next expiry")?;
        }
    }
    Ok(())
}

/// Takes the debits of one posting from the live grants in burn-down order (priority, soonest
/// expiry, oldest), reading the head of the order a few grants at a time; what no grant covers is
/// debt. Each grant is updated once, and each line records what paid for it.
/// A withdrawal's money (`Spend::Cash`, `Spend::CashOnly`) comes only from grants that never expire:
/// cash leaves only from credit that was never promotional (docs/decisions/0023).
async fn take(
    db: &mut Db<'_>,
    cx: &Cx,
    books: &mut Books<'_>,
    takes: &[(&Line<'_>, i64)],
    spend: Spend,
) -> Result<(), StoreError> {
    let cash = spend != Spend::Any;
    if spend == Spend::CashOnly && !cx.broken(crate::broken::Guard::CashRule) {
        cash_rule(db, books, takes).await?;
    }
    if let [(line, account_seq)] = takes
        && db.engine() == Engine::Postgres
        && !books.head_asked
        && take_from_head(db, cx, books, line, *account_seq, cash).await?
    {
        return Ok(());
    }

    let head: &'static str = if cash { &CASH_HEAD } else { &HEAD };
    // (key, what it had, what this posting takes from it)
    let mut grants: Vec<(i64, i64, i64)> = Vec::new();
    let mut cursor = (-1_i64, i64::MIN, i64::MIN);
    let mut exhausted = false;
    let mut at = 0usize;
    let mut parts: Vec<Part<'_>> = Vec::new();
    for (line, account_seq) in takes {
        let mut need = line.amount.get().checked_neg().ok_or(StoreError::Overflow)?;
        let kind = AllocationKind::of_debit(line.kind);
        while need > 0 {
            if at == grants.len() {
                if exhausted {
                    break;
                }
                let rows = db.all(head, args![books.account_id, cursor.0, cursor.1, cursor.2, HEAD_ROWS]).await?;
                exhausted = (rows.len() as i64) < HEAD_ROWS;
                for r in &rows {
                    let key = r.i64(HeadCol::key)?;
                    grants.push((key, r.i64(HeadCol::remaining)?, 0));
                    cursor = (r.i64(HeadCol::priority)?, r.i64(HeadCol::expiry_key)?, key);
                }
                if rows.is_empty() {
                    break;
                }
            }
            let (key, had, taken) = &mut grants[at];
            let t = need.min(*had - *taken);
            *taken += t;
            need -= t;
            parts.push(Part {
                grant_key: Some(*key),
                kind,
                job_id: line.job_id,
                job_seq: line.job_seq,
                item_id: line.item_id,
                ref_id: line.ref_id,
                account_seq: *account_seq,
                taken: t,
                paid_part: None,
            });
            if *taken == *had {
                at += 1;
            }
        }
        if need > 0 && spend == Spend::CashOnly {
            let asked = line.amount.get().checked_neg().ok_or(StoreError::Overflow)?;
            return Err(StoreError::InsufficientCash { available: sub(asked, need)?, needed: asked });
        }
        if need > 0 {
            books.debt = add(books.debt, need)?;
            parts.push(Part {
                grant_key: None,
                kind,
                job_id: line.job_id,
                job_seq: line.job_seq,
                item_id: line.item_id,
                ref_id: line.ref_id,
                account_seq: *account_seq,
                taken: need,
                paid_part: None,
            });
        }
    }
    for (key, _, taken) in grants.iter().filter(|g| g.2 > 0) {
        let rows = db.exec(TAKE, args![*key, *taken]).await?;
        guard_hit(rows, "grant burn-down")?;
    }
    insert_parts(db, cx, books.account_id, &parts).await
}

/// The cash rule (semantics §1): a withdrawal of `W` needs what the account's never-expiring grants
/// have left, less its debt, to cover `W` — so no withdrawal leaves the account owing what it drew on
/// the overdraft, whatever expiring credit it holds (that would expire and leave the debt unpaid:
/// the overdraft gone as cash). Refused whole (`InsufficientCash`, nothing written) otherwise.
async fn cash_rule(db: &mut Db<'_>, books: &Books<'_>, takes: &[(&Line<'_>, i64)]) -> Result<(), StoreError> {
    let mut asked = 0_i64;
    for (line, _) in takes {
        asked = add(asked, line.amount.get().checked_neg().ok_or(StoreError::Overflow)?)?;
    }
    let free = sub(cash(db, books.account_id).await?, books.debt)?;
    if free < asked {
        return Err(StoreError::InsufficientCash { available: free.max(0), needed: asked });
    }
    Ok(())
}

/// What the account's live never-expiring grants have left (the cash rule's first term).
pub(crate) async fn cash(db: &mut Db<'_>, account_id: &str) -> Result<i64, StoreError> {
    db.one(&CASH, args![account_id]).await?.i64(CashCol::cash)
}

/// PostgreSQL's common case in one round trip: a posting of one debit that the head of the burn-down
/// order covers takes it and records its part in one statement (the account row is held, so the
/// head it reads is current). `false`: nothing written, the head does not cover it (or there is
/// none) — the caller takes the general way.
async fn take_from_head(
    db: &mut Db<'_>,
    cx: &Cx,
    books: &Books<'_>,
    line: &Line<'_>,
    account_seq: i64,
    cash: bool,
) -> Result<bool, StoreError> {
    let need = line.amount.get().checked_neg().ok_or(StoreError::Overflow)?;
    if need <= 0 {
        return Ok(false);
    }
    let sql = if cash { TAKE_FROM_CASH_HEAD_PG } else { TAKE_FROM_HEAD_PG };
    let kind = AllocationKind::of_debit(line.kind).as_str();
    let args =
        args![books.account_id, need, kind, line.job_id, line.item_id, line.ref_id, account_seq, cx.now.micros()];
    Ok(db.exec(sql, args).await? == 1)
}

async fn insert_parts(db: &mut Db<'_>, cx: &Cx, account_id: &str, parts: &[Part<'_>]) -> Result<(), StoreError> {
    match db.engine() {
        Engine::Postgres if parts.len() > 1 => {
            fn owned<'p>(parts: &'p [Part<'p>], f: impl Fn(&'p Part<'p>) -> Option<&'p str>) -> Vec<Option<String>> {
                parts.iter().map(|p| f(p).map(str::to_owned)).collect()
            }
            db.exec(
                INSERT_ALLOCATIONS_PG,
                &[
                    Value::from(account_id),
                    Value::I64(cx.now.micros()),
                    Value::OptI64s(parts.iter().map(|p| p.grant_key).collect()),
                    Value::OptTexts(parts.iter().map(|p| Some(p.kind.as_str().to_owned())).collect()),
                    Value::OptTexts(owned(parts, |p| p.job_id)),
                    Value::OptTexts(owned(parts, |p| p.item_id)),
                    Value::OptTexts(owned(parts, |p| p.ref_id)),
                    Value::I64s(parts.iter().map(|p| p.account_seq).collect()),
                    Value::I64s(parts.iter().map(|p| p.taken).collect()),
                    Value::OptI64s(parts.iter().map(|p| p.paid_part).collect()),
                ],
            )
            .await?;
        }
        _ => {
            for p in parts {
                let args = args![
                    account_id,
                    p.grant_key,
                    p.kind.as_str(),
                    p.job_id,
                    p.item_id,
                    p.ref_id,
                    p.account_seq,
                    p.taken,
                    p.paid_part,
                    cx.now.micros(),
                    p.job_seq
                ];
                match db.engine() {
                    Engine::Sqlite => db.exec(INSERT_ALLOCATION_LITE, args).await?,
                    Engine::Postgres => db.exec(INSERT_ALLOCATION, &args[..10]).await?,
                };
            }
        }
    }
    Ok(())
}

/// An open part of a movement, as read.
struct Open {
    id: i64,
    grant_key: Option<i64>,
    item_id: Option<String>,
    open: i64,
    settled: i64,
}

fn open_part(r: &crate::db::Row) -> Result<Open, StoreError> {
    Ok(Open {
        id: r.i64(PartCol::id)?,
        grant_key: r.opt_i64(PartCol::grant_key)?,
        item_id: r.opt_text(PartCol::item_id)?,
        open: r.i64(PartCol::open)?,
        settled: r.i64(PartCol::settled)?,
    })
}

/// Each returned item's open parts, last taken first: one item's alone when one item returns (an
/// item report), else every open part of the job at once (a job's failure or cancel). On SQLite a
/// job's parts are found by its number (migration 0037).
async fn open_parts_returned(
    db: &mut Db<'_>,
    returns: &[&Line<'_>],
) -> Result<HashMap<(String, String), Vec<Open>>, StoreError> {
    let mut parts: HashMap<(String, String), Vec<Open>> = HashMap::new();
    let mut read = |rows: Vec<crate::db::Row>, job: &str| -> Result<(), StoreError> {
        for r in &rows {
            let part = open_part(r)?;
            let item = part.item_id.clone().unwrap_or_default();
            parts.entry((job.to_owned(), item)).or_default().push(part);
        }
        Ok(())
    };
    if let [line] = returns {
        let job = line.job_id.ok_or_else(|| StoreError::internal("a return without its job"))?;
        let sql = if db.engine() == Engine::Sqlite { &*OPEN_ITEM_PARTS_LITE } else { &*OPEN_ITEM_PARTS };
        read(db.all(sql, args![job, line.item_id]).await?, job)?;
    } else {
        let mut jobs: Vec<&str> = Vec::new();
        for line in returns {
            let job = line.job_id.ok_or_else(|| StoreError::internal("a return without its job"))?;
            if !jobs.contains(&job) {
                jobs.push(job);
            }
        }
        let sql = if db.engine() == Engine::Sqlite { &*OPEN_PARTS_LITE } else { &*OPEN_PARTS };
        for job in jobs {
            read(db.all(sql, args![job]).await?, job)?;
        }
    }
    Ok(parts)
}

/// Gives the returns of one posting back to the parts that paid for their items, last taken
/// first: to a live grant, to an expired one (expired again at once), or to debt. A debt part
/// lowers the debt by what of it is still unpaid; the rest had been paid by later credit, whose
/// settlements of this very part are given back to the grants that paid them.
async fn give_back(db: &mut Db<'_>, books: &mut Books<'_>, returns: &[&Line<'_>]) -> Result<(), StoreError> {
    let mut parts = open_parts_returned(db, returns).await?;
    // (grant key, returned)
    let mut to_grants: Vec<(i64, i64)> = Vec::new();
    let mut credit = |key: i64, x: i64| -> Result<(), StoreError> {
        match to_grants.iter_mut().find(|(k, _)| *k == key) {
            Some((_, sum)) => *sum = add(*sum, x)?,
            None => to_grants.push((key, x)),
        }
        Ok(())
    };
    for line in returns {
        let (job, item) = (line.job_id.unwrap_or_default(), line.item_id);
        let mut need = line.amount.get();
        let key = (job.to_owned(), item.unwrap_or_default().to_owned());
        for part in parts.get_mut(&key).map(Vec::as_mut_slice).unwrap_or_default() {
            if need == 0 {
                break;
            }
            if part.open == 0 {
                continue;
            }
            let x = need.min(part.open);
            part.open -= x;
            need -= x;
            let Some(key) = part.grant_key else {
                let unpaid = sub(add(part.open, x)?, part.settled)?;
                let lowered = x.min(unpaid);
                let unpay = sub(x, lowered)?;
                guard_hit(db.exec(GIVE_BACK_DEBT, args![part.id, x, unpay]).await?, "debt give-back")?;
                part.settled = sub(part.settled, unpay)?;
                books.debt = sub(books.debt, lowered)?;
                let mut rest = unpay;
                if rest > 0 {
                    for r in db.all(&SETTLEMENTS_OF, args![part.id]).await? {
                        let settlement = open_part(&r)?;
                        let y = rest.min(settlement.open);
                        guard_hit(db.exec(GIVE_BACK, args![settlement.id, y]).await?, "settlement give-back")?;
                        let key = settlement
                            .grant_key
                            .ok_or_else(|| StoreError::internal("a settlement without its grant"))?;
                        credit(key, y)?;
                        rest -= y;
                        if rest == 0 {
                            break;
                        }
                    }
                }
                if rest > 0 {
                    return Err(StoreError::internal(format!(
                        "debt part {} un-pays {rest} more than its settlements",
                        part.id
                    )));
                }
                continue;
            };
            guard_hit(db.exec(GIVE_BACK, args![part.id, x]).await?, "allocation give-back")?;
            credit(key, x)?;
        }
        if need > 0 {
            return Err(StoreError::internal(format!(
                "job {job} item {} returns {need} more than its parts hold",
                item.unwrap_or_default()
            )));
        }
    }
    for (key, x) in to_grants {
        if db.exec(RETURN_LIVE, args![key, x]).await? == 0 {
            // Expired (every posting expires what is due first, so the clock agrees): the part is
            // credited and expires at once.
            books.reexpiries.push(Reexpiry { grant_key: key, amount: x });
        }
    }
    Ok(())
}

#[cfg(test)]
mod plan_tests {
    use super::*;

    /// The closed sets of grant origins and allocation kinds are the ones both schemas' CHECKs
    /// allow, in the same order (decision 0020: every closed set named once).
    #[test]
    fn grant_origins_and_allocation_kinds_are_the_schemas() {
        use settle_core::ledger::{AllocationKind, GrantOrigin};
        let quoted = |names: &[&str]| names.iter().map(|n| format!("'{n}'")).collect::<Vec<_>>().join(", ");
        let origins: Vec<_> = GrantOrigin::ALL.iter().map(|o| o.as_str()).collect();
        let kinds: Vec<_> = AllocationKind::ALL.iter().map(|k| k.as_str()).collect();
        for sql in [
            include_str!("../../migrations/postgres/0017_grants.sql"),
            include_str!("../../migrations/sqlite/0017_grants.sql"),
        ] {
            assert!(sql.contains(&format!("kind IN ({})", quoted(&kinds))), "allocation kinds: {kinds:?}");
        }
        // Migration 0026: PostgreSQL's CHECKs became domains; SQLite's, comparisons joined by OR.
        // 0031 widened the origins by `top_up`.
        let domains = include_str!("../../migrations/postgres/0026_domains.sql");
        assert!(domains.contains(&format!("VALUE IN ({})", quoted(&kinds))), "allocation kinds: {kinds:?}");
        let top_ups = include_str!("../../migrations/postgres/0031_top_ups.sql");
        assert!(top_ups.contains(&format!("VALUE IN ({})", quoted(&origins))), "grant origins: {origins:?}");
        let either = |column: &str, names: &[&str]| {
            names.iter().map(|n| format!("{column} = ''{n}''")).collect::<Vec<_>>().join(" OR ")
        };
        let compared = include_str!("../../migrations/sqlite/0026_domains.sql");
        assert!(compared.contains(&either("kind", &kinds)), "allocation kinds: {kinds:?}");
        let widened = include_str!("../../migrations/sqlite/0031_top_ups.sql");
        assert!(widened.contains(&either("origin", &origins)), "grant origins: {origins:?}");
    }

    /// The SQLite writer runs with the query planner stability guarantee (engine/sqlite.rs), under
    /// which a bound value never proves a partial index's condition: each statement that needs one
    /// must write the condition out. Planned here as the writer plans them, on the real schema.
    #[test]
    fn the_writers_partial_index_reads_seek_their_index() {
        let conn = rusqlite::Connection::open_in_memory().unwrap();
        assert!(conn.set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true).unwrap());
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("migrations/sqlite");
        let mut files: Vec<_> = std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().path()).collect();
        files.sort();
        for file in files {
            conn.execute_batch(&std::fs::read_to_string(&file).unwrap()).unwrap();
        }
        let plan = |sql: &str| -> String {
            let mut stmt = conn.prepare(&format!("EXPLAIN QUERY PLAN {sql}")).unwrap();
            let unbound = vec![rusqlite::types::Null; stmt.parameter_count()];
            let rows = stmt.query_map(rusqlite::params_from_iter(unbound), |r| r.get::<_, String>(3)).unwrap();
            rows.map(Result::unwrap).collect::<Vec<_>>().join("; ")
        };
        for (sql, index) in [
            (&*HEAD, "grants_burn"),
            (&*CASH_HEAD, "grants_burn"),
            (&*CASH, "grants_due"),
            (&*UNPAID, "allocations_unpaid"),
            (&*super::super::expiry::DUE, "grants_due"),
            (&*OPEN_ITEM_PARTS_LITE, "allocations_job_seq"),
            (&*OPEN_PARTS_LITE, "allocations_job_seq"),
            (&*SETTLEMENTS_OF, "allocations_paid"),
        ] {
            let plan = plan(sql);
            assert!(plan.contains(&format!("USING INDEX {index}")), "{sql}\n  planned: {plan}");
        }
    }
}
