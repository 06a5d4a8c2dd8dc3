//! The ledger: guarded balance changes, and the lines that explain them, hash-chained per account.
//!
//! Each account numbers its own entries: the guarded balance UPDATE every posting makes also bumps
//! `accounts.last_account_seq` by the posting's lines, so their `account_seq` (the chain position) is known
//! at once from a row the transaction holds anyway. `seq` (unique, increasing within an account in
//! commit order) comes on SQLite from the `ledger` counter, which only the single writer takes; on
//! PostgreSQL from a plain sequence taken at the flush, after every account row of the transaction
//! is locked, so no global row is held on the commit path (docs/decisions/0021). On PostgreSQL the
//! lines wait in the transaction's `Pending` and are hashed and written by `flush_lines`.

use super::alerts::{Band, LineAt, after_posting};
use super::{Cx, PendingLine, guard_hit, lock_pending, next_seq, spend_limits};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::Credits;
use settle_core::ids::AccountId;
use settle_core::ledger::{EntryFields, EntryKind, GENESIS_HASH, Hash32, chain_hash};
use settle_core::limits;
use std::sync::LazyLock;

/// How a balance change may be refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum BalanceCheck {
    /// Charges: the balance may not go below `-overdraft_limit`.
    Overdraft,
    /// Withdrawals: the balance may not go below zero. An overdraft is a credit line for work,
    /// never cash to take away (spec §1, decision 0017).
    Cash,
    /// Grants and adjustments: the balance stays within `±BALANCE_MAX`, so refunds of outstanding
    /// charges can never overflow.
    Bounded,
    /// Refunds and reclaims: never refused (a reclaim may take the balance negative).
    Never,
}

columns! {
    /// What a balance change returns: the balance after it, and the account's entries counting the
    /// posting's lines (its last line's `account_seq`).
    BalanceCol { balance, entries = "last_account_seq", debt, alert_floor, alert_ceiling, spend_limited }
}

columns! {
    /// Why a debit was refused: the balance and the overdraft it may use; whether the account has
    /// spend limits (a checked debit misses an account that has, until its limits are checked).
    LimitCol { balance, overdraft_limit, next_expiry, spend_limited }
}

columns! {
    /// An account's entry's hash.
    HashCol { hash }
}

columns! {
    /// Each account (of an array) and the hash of its entry at `a.prev` (NULL when `prev` is 0), each
    /// row carrying the same `$3` new ledger numbers, comma-separated (taken once: see `CHAIN_HEADS`).
    HeadCol {
        id = "a.id",
        prev = "a.prev",
        hash = "(SELECT e.hash FROM ledger_entries e WHERE e.account_id = a.id AND e.account_seq = a.prev)",
        seqs = "(SELECT seqs FROM numbers)",
    }
}

columns! {
    /// A number from PostgreSQL's ledger sequence.
    SeqCol { seq = "nextval('ledger_seq_numbers')" }
}

// The checked debits (a create's charges, a withdrawal) match an account with spend limits
// (`spend_limited = 1`) only once its limits have passed the charge ($8 = 1): an account with limits
// misses first, and the miss path checks them on the locked row, before anything is written.
// Debits (charges, negative adjustments) keep `balance − exposure ≥ −BALANCE_MAX`: the balance
// after every possible reclaim stays inside i64 (docs/decisions/0003).
// Each also moves `held` by $4 and `exposure` by $5 (`Holds`) in the same statement, and counts the
// posting's $6 lines in `entries`; the guards read the values from before it, as when they were
// separate statements after the balance.
static DEBIT_OVERDRAFT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5, last_account_seq = last_account_seq + $6 \
         WHERE id = $1 AND balance >= (0 - overdraft_limit) - $2 AND balance - exposure >= (0 - $3) - $2 \
         AND next_expiry > $7 AND spend_limited <= $8 RETURNING {}",
        BalanceCol::LIST
    )
});
// As DEBIT_OVERDRAFT with the overdraft limit taken as zero, whatever the account's is.
static DEBIT_CASH: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5, last_account_seq = last_account_seq + $6 \
         WHERE id = $1 AND balance >= 0 - $2 AND balance - exposure >= (0 - $3) - $2 AND next_expiry > $7 \
         AND spend_limited <= $8 RETURNING {}",
        BalanceCol::LIST
    )
});
// Credits (grants, positive adjustments) keep `balance + held ≤ BALANCE_MAX`: the balance after every
// refund and return still possible stays inside i64 (docs/decisions/0003). `held` may move with
// them (a top-up reserves its credits, its grant turns the reservation into balance): the bound is
// on both after the posting.
static CREDIT_BOUNDED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5, last_account_seq = last_account_seq + $6 \
         WHERE id = $1 AND balance + held <= ($3 - $2) - $4 AND next_expiry > $7 RETURNING {}",
        BalanceCol::LIST
    )
});
static DEBIT_BOUNDED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5, last_account_seq = last_account_seq + $6 \
         WHERE id = $1 AND balance - exposure >= (0 - $3) - $2 AND next_expiry > $7 RETURNING {}",
        BalanceCol::LIST
    )
});
static CREDIT_ANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $3, exposure = exposure + $4, \
         last_account_seq = last_account_seq + $5 WHERE id = $1 AND next_expiry > $6 RETURNING {}",
        BalanceCol::LIST
    )
});
static LIMITS: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", LimitCol::LIST));
static LOCK_LIMITS_PG: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1 FOR NO KEY UPDATE", LimitCol::LIST));
static CHAIN_HEAD: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM ledger_entries WHERE account_id = $1 AND account_seq = $2", HashCol::LIST)
});
/// The chain heads and the flush's ledger numbers in one round trip. The numbers come from a
/// materialized CTE, which PostgreSQL evaluates once however many rows read it: `nextval` runs
/// exactly `$3` times (the count is checked all the same).
static CHAIN_HEADS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH numbers AS MATERIALIZED (SELECT string_agg(nextval('ledger_seq_numbers')::text, ',') AS seqs \
         FROM generate_series(1::bigint, $3::bigint)) \
         SELECT {} FROM unnest($1::text[], $2::bigint[]) AS a(id, prev)",
        HeadCol::LIST
    )
});
static SEQ_NUMBERS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM generate_series(1::bigint, $1::bigint)", SeqCol::LIST));
const INSERT_ENTRY: &str = "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, job_id, \
     item_id, ref_id, reason, request_hash, created_at, prev_hash, hash) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14)";
/// SQLite's: the line's `job_seq` too, from the job row the operation holds (`Line::job_seq`),
/// which the table's trigger checks against the job (migration 0037, decision 0039); PostgreSQL
/// leaves the column NULL.
const INSERT_ENTRY_LITE: &str = "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, \
     job_id, item_id, ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq) \
     VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15)";
const HOLDS_ONLY: &str = "UPDATE accounts SET held = held + $2, exposure = exposure + $3 WHERE id = $1";

/// How a transition moves an account's `held` (what later refunds and returns could add back) and
/// `exposure` (what a later success could reclaim), written with its balance change.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Holds {
    pub held: i64,
    pub exposure: i64,
}

/// `holds` alone, for a transition that moves no money (an item succeeding leaves the held set).
pub(crate) async fn change_holds(db: &mut Db<'_>, account_id: &str, holds: Holds) -> Result<(), StoreError> {
    if holds == Holds::default() {
        return Ok(());
    }
    let rows = db.exec(HOLDS_ONLY, args![account_id, holds.held, holds.exposure]).await?;
    guard_hit(rows, "held")
}

/// One operation's ledger lines on one account, and what guards them: the balance check, and how
/// the operation moves the account's holds. Built by the operation, carried whole down the posting
/// path (`postings::post`, `append`, the balance change).
#[derive(Clone, Copy)]
pub(crate) struct Posting<'a> {
    pub account_id: &'a str,
    /// The kind of the job the lines belong to (a posting's lines are one job's), for the spend
    /// limits covering it; `None` for lines of no job (grants, adjustments, expiries).
    pub job_kind: Option<&'a str>,
    pub check: BalanceCheck,
    pub lines: &'a [Line<'a>],
    pub holds: Holds,
}

/// When a posting's lines are written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Write {
    /// With the transaction: on PostgreSQL queued for its `flush`, which gives them their `seq` and
    /// hashes just before COMMIT (decision 0021); at once on SQLite, whose writer numbers as it goes.
    WithTheTransaction,
    /// At once on both engines, for an answer that is the entry itself (grants, adjustments).
    Now,
}

/// One ledger line to append.
pub(crate) struct Line<'a> {
    pub kind: EntryKind,
    pub amount: Credits,
    pub job_id: Option<&'a str>,
    /// The job's number, from the job row the operation holds: SQLite's INSERT writes it and its
    /// trigger refuses one that is not the job's (migration 0037); PostgreSQL leaves it NULL.
    pub job_seq: Option<i64>,
    pub item_id: Option<&'a str>,
    pub ref_id: Option<&'a str>,
    pub reason: Option<&'a str>,
    pub request_hash: Option<&'a [u8; 32]>,
}

/// The `expire` lines of grants the expiry just closed: no check, no clock guard (the expiry is
/// what the guard waits for), and no grants' side (the expiry moved its grants itself).
pub(crate) async fn post_expiries(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    lines: &[Line<'_>],
    write: Write,
) -> Result<(), StoreError> {
    if lines.is_empty() {
        return Ok(());
    }
    let posting = Posting { account_id, job_kind: None, check: BalanceCheck::Never, lines, holds: Holds::default() };
    let appended = append(db, cx, &posting, Guard::Off, write).await?;
    appended.map(drop).ok_or_else(|| StoreError::internal("an unguarded posting waited for an expiry"))
}

/// Whether a balance change waits for the account's due grants to expire first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Guard {
    /// Every posting: no check may count a grant past its expiry (docs/decisions/0023).
    Clock,
    /// The expiry's own lines.
    Off,
}

/// The guarded balance change and the lines: written at once (`Write::Now`, or SQLite), else
/// queued. Returns the posting's place and, when written, its entries — or `None` under
/// `Guard::Clock` when the account has a grant due and not expired yet: nothing was written, and
/// the caller expires the account's due grants first (`expiry::expire_due`) and posts again.
pub(crate) async fn append(
    db: &mut Db<'_>,
    cx: &Cx,
    posting: &Posting<'_>,
    guard: Guard,
    write: Write,
) -> Result<Option<(Posted, Vec<LedgerEntry>)>, StoreError> {
    let pending = match &cx.pending {
        Some(p) if write == Write::WithTheTransaction => p,
        _ => return post_lines(db, cx, posting, guard).await,
    };
    let Posting { account_id, lines, .. } = *posting;
    let total = Credits::checked_sum(lines.iter().map(|l| l.amount))?;
    let Some(posted) = change_balance(db, cx, posting, total, guard).await? else {
        return Ok(None);
    };
    let mut balance = Credits::new(posted.balance).checked_sub(total)?;
    let mut at = Vec::with_capacity(lines.len());
    {
        let mut pending = lock_pending(pending);
        for (line, account_seq) in lines.iter().zip(posted.first_account_seq..) {
            balance = balance.checked_add(line.amount)?;
            at.push(LineAt { balance_after: balance.get(), amount: line.amount.get(), seq: None, account_seq });
            pending.lines.push(PendingLine {
                account_id: account_id.to_owned(),
                account_seq,
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
        assert_eq!(balance.get(), posted.balance, "ledger lines must sum to the balance change");
    }
    after_posting(db, cx, account_id, posted.band, &at).await?;
    spend_limits::after_posting(db, cx, account_id, posted.limited, posting.job_kind, spent(lines)?).await?;
    Ok(Some((posted, Vec::new())))
}

/// What a posting's lines spend (spec §4a): the negated sum of its job lines.
fn spent(lines: &[Line<'_>]) -> Result<i64, StoreError> {
    settle_core::spend::of_lines(lines.iter().map(|l| (l.kind, l.amount.get()))).ok_or(StoreError::Overflow)
}

/// What a guarded balance change left: the balance after it, the `account_seq` of the first of
/// the posting's lines, and the account's debt (which the change itself does not move).
pub(crate) struct Posted {
    pub balance: i64,
    pub first_account_seq: i64,
    pub debt: i64,
    /// The account's alert band as the change found it (`alerts::after_posting`).
    pub band: Band,
    /// Whether the account has spend limits, for the posting to count its spend in
    /// (`spend_limits::after_posting`).
    pub limited: bool,
}

/// The guarded balance change for `posting`, whose lines sum to `total`. Under `Guard::Clock` an
/// account with a grant due matches nothing: `None`, for the caller to expire its due grants first.
async fn change_balance(
    db: &mut Db<'_>,
    cx: &Cx,
    posting: &Posting<'_>,
    total: Credits,
    guard: Guard,
) -> Result<Option<Posted>, StoreError> {
    let Posting { account_id, check, holds, .. } = *posting;
    debug_assert!(
        posting.lines.windows(2).all(|w| w[0].job_id == w[1].job_id),
        "a posting's lines are one job's (its spend counts under one kind)"
    );
    let (held, exposure, n) = (holds.held, holds.exposure, posting.lines.len() as i64);
    let max = limits::BALANCE_MAX;
    let clock = match guard {
        Guard::Clock if cx.broken(crate::broken::Guard::ExpiryClock) => i64::MIN,
        Guard::Clock => cx.now.micros(),
        Guard::Off => i64::MIN,
    };
    // `$8` of the checked debits: whether the account's spend limits passed this charge.
    let mut args = match check {
        BalanceCheck::Never => args![account_id, total.get(), held, exposure, n, clock].to_vec(),
        BalanceCheck::Overdraft | BalanceCheck::Cash => {
            // A charge of nothing spends nothing: no limit to check.
            let passed = i64::from(!total.is_negative());
            args![account_id, total.get(), max, held, exposure, n, clock, passed].to_vec()
        }
        BalanceCheck::Bounded => args![account_id, total.get(), max, held, exposure, n, clock].to_vec(),
    };
    let sql: &'static str = match check {
        BalanceCheck::Overdraft => &DEBIT_OVERDRAFT,
        BalanceCheck::Cash => &DEBIT_CASH,
        BalanceCheck::Bounded if total.is_negative() => &DEBIT_BOUNDED,
        BalanceCheck::Bounded => &CREDIT_BOUNDED,
        BalanceCheck::Never => &CREDIT_ANY,
    };
    debug_assert!(!matches!(check, BalanceCheck::Overdraft | BalanceCheck::Cash) || !total.is_positive());
    // A miss is judged on the locked row: the UPDATE that missed took no lock, so another
    // transaction (an expiry, a grant) may have moved the account since. Under the lock, spend
    // limits are checked first (a refusal writes nothing), then a grant due answers `None`;
    // anything else is tried once more before it is refused.
    let mut locked = false;
    let checked_debit = matches!(check, BalanceCheck::Overdraft | BalanceCheck::Cash);
    let mut spend_checked = !total.is_negative();
    loop {
        if let Some(row) = db.opt(sql, &args).await? {
            let entries = row.i64(BalanceCol::entries)?;
            return Ok(Some(Posted {
                balance: row.i64(BalanceCol::balance)?,
                first_account_seq: entries - n + 1,
                debt: row.i64(BalanceCol::debt)?,
                band: Band {
                    floor: row.opt_i64(BalanceCol::alert_floor)?,
                    ceiling: row.opt_i64(BalanceCol::alert_ceiling)?,
                },
                limited: row.i64(BalanceCol::spend_limited)? == 1,
            }));
        }
        let limits: &'static str = match db.engine() {
            Engine::Postgres => &LOCK_LIMITS_PG,
            Engine::Sqlite => &LIMITS,
        };
        let current =
            db.opt(limits, args![account_id]).await?.ok_or_else(|| StoreError::not_found("account", account_id))?;
        if checked_debit && !spend_checked && current.i64(LimitCol::spend_limited)? == 1 {
            let kind = posting.job_kind.ok_or_else(|| StoreError::internal("a checked debit of no job"))?;
            spend_limits::check(db, cx, account_id, kind, total.checked_neg()?.get()).await?;
            spend_checked = true;
            args[7] = Value::I64(1);
        }
        if current.i64(LimitCol::next_expiry)? <= clock {
            return Ok(None);
        }
        if !locked {
            locked = true;
            continue;
        }
        let balance = current.i64(LimitCol::balance)?;
        return Err(match check {
            BalanceCheck::Overdraft => StoreError::InsufficientCredits {
                balance,
                overdraft_limit: current.i64(LimitCol::overdraft_limit)?,
                needed: total.checked_neg()?.get(),
            },
            BalanceCheck::Cash => StoreError::InsufficientBalance { balance, needed: total.checked_neg()?.get() },
            _ => StoreError::Overflow,
        });
    }
}

/// `n` fresh `seq` numbers, ascending: SQLite's writer takes them from the batch's `ledger`
/// counter (it alone writes); PostgreSQL from the ledger sequence, called after the account rows
/// are locked.
async fn seq_numbers(db: &mut Db<'_>, cx: &Cx, n: usize) -> Result<Vec<i64>, StoreError> {
    match db.engine() {
        Engine::Sqlite => {
            let first = next_seq(cx, "ledger", n as i64)?;
            Ok((first..first + n as i64).collect())
        }
        Engine::Postgres => sequence_numbers(db, n).await,
    }
}

/// `n` numbers from PostgreSQL's ledger sequence, ascending.
async fn sequence_numbers(db: &mut Db<'_>, n: usize) -> Result<Vec<i64>, StoreError> {
    let rows = db.all(&SEQ_NUMBERS, args![n as i64]).await?;
    let mut seqs = rows.iter().map(|r| r.i64(SeqCol::seq)).collect::<Result<Vec<_>, _>>()?;
    // One statement's numbers come in the order it called nextval; sorted all the same, so an
    // account's lines increase in the order they were posted whatever the plan.
    seqs.sort_unstable();
    if seqs.len() != n {
        return Err(StoreError::internal(format!("asked for {n} ledger numbers, got {}", seqs.len())));
    }
    Ok(seqs)
}

/// Posts and writes the posting's lines at once.
async fn post_lines(
    db: &mut Db<'_>,
    cx: &Cx,
    posting: &Posting<'_>,
    guard: Guard,
) -> Result<Option<(Posted, Vec<LedgerEntry>)>, StoreError> {
    let Posting { account_id, lines, .. } = *posting;
    let total = Credits::checked_sum(lines.iter().map(|l| l.amount))?;
    let Some(posted) = change_balance(db, cx, posting, total, guard).await? else {
        return Ok(None);
    };
    let mut balance = Credits::new(posted.balance).checked_sub(total)?;
    let mut prev = chain_head(db, account_id, posted.first_account_seq - 1).await?;
    let seqs = seq_numbers(db, cx, lines.len()).await?;
    let mut out = Vec::with_capacity(lines.len());
    for ((line, seq), account_seq) in lines.iter().zip(seqs).zip(posted.first_account_seq..) {
        balance = balance.checked_add(line.amount)?;
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
        let args = args![
            seq,
            account_seq,
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
            &hash,
            line.job_seq
        ];
        match db.engine() {
            Engine::Sqlite => db.exec(INSERT_ENTRY_LITE, args).await?,
            Engine::Postgres => db.exec(INSERT_ENTRY, &args[..14]).await?,
        };
        out.push(LedgerEntry {
            seq,
            account_seq,
            // The account the guarded balance change above just found by this id.
            account_id: AccountId::stored(account_id),
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
    let at: Vec<LineAt> = out
        .iter()
        .map(|e| LineAt {
            balance_after: e.balance_after.get(),
            amount: e.amount.get(),
            seq: Some(e.seq),
            account_seq: e.account_seq,
        })
        .collect();
    after_posting(db, cx, account_id, posted.band, &at).await?;
    spend_limits::after_posting(db, cx, account_id, posted.limited, posting.job_kind, spent(lines)?).await?;
    assert_eq!(balance.get(), posted.balance, "ledger lines must sum to the balance change");
    Ok(Some((posted, out)))
}

fn hash32(h: Vec<u8>) -> Result<Hash32, StoreError> {
    h.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes"))
}

/// The hash of an account's entry at `account_seq` — the genesis hash at 0. A position the account
/// counts but the ledger lacks is an internal error, never a fresh chain.
async fn chain_head(db: &mut Db<'_>, account_id: &str, account_seq: i64) -> Result<Hash32, StoreError> {
    if account_seq == 0 {
        return Ok(GENESIS_HASH);
    }
    match db.opt(&CHAIN_HEAD, args![account_id, account_seq]).await? {
        Some(r) => hash32(r.blob(HashCol::hash)?),
        None => Err(StoreError::internal(format!("account {account_id} has no ledger entry {account_seq}"))),
    }
}

/// PostgreSQL, just before COMMIT: gives the transaction's queued lines their `seq` from the ledger
/// sequence and chains them per account, in one statement; returns the columns of their INSERT
/// (`INSERT_LINES`), which `outbox::flush_with_lines` sends with the events as the transaction's last statement.
/// Each account's previous hash is its entry before the first queued line's `account_seq`; it
/// cannot change meanwhile, as this transaction holds the row of every account it posted to.
pub(super) async fn flush_lines(db: &mut Db<'_>, lines: &[PendingLine]) -> Result<Vec<Value>, StoreError> {
    debug_assert!(!lines.is_empty(), "flush_lines is called with lines to write");
    // Each account's first queued position: the lines of one account were queued in order.
    let mut firsts: Vec<(&str, i64)> = Vec::new();
    for line in lines {
        if !firsts.iter().any(|(a, _)| *a == line.account_id) {
            firsts.push((&line.account_id, line.account_seq));
        }
    }
    let rows = db
        .all(
            &CHAIN_HEADS,
            &[
                Value::Texts(firsts.iter().map(|(a, _)| a.to_string()).collect()),
                Value::I64s(firsts.iter().map(|(_, first)| first - 1).collect()),
                Value::I64(lines.len() as i64),
            ],
        )
        .await?;
    let mut heads: std::collections::HashMap<String, (i64, Hash32)> = std::collections::HashMap::new();
    let mut seqs: Vec<i64> = match rows.first() {
        Some(r) => r
            .text(HeadCol::seqs)?
            .split(',')
            .map(str::parse)
            .collect::<Result<_, _>>()
            .map_err(|e| StoreError::internal(format!("ledger numbers that are not numbers: {e}")))?,
        None => Vec::new(),
    };
    // One statement's numbers come in the order it called nextval; sorted all the same, so an
    // account's lines increase in the order they were posted whatever the plan.
    seqs.sort_unstable();
    if seqs.len() != lines.len() {
        return Err(StoreError::internal(format!("asked for {} ledger numbers, got {}", lines.len(), seqs.len())));
    }
    for r in &rows {
        let (account, prev) = (r.text(HeadCol::id)?, r.i64(HeadCol::prev)?);
        let head = match (prev, r.opt_blob(HeadCol::hash)?) {
            (0, _) => GENESIS_HASH,
            (_, Some(h)) => hash32(h)?,
            (_, None) => return Err(StoreError::internal(format!("account {account} has no ledger entry {prev}"))),
        };
        heads.insert(account, (prev, head));
    }
    let n = lines.len();
    let (mut prevs, mut hashes) = (Vec::with_capacity(n), Vec::with_capacity(n));
    for (line, &seq) in lines.iter().zip(&seqs) {
        let (at, head) = heads.get_mut(&line.account_id).ok_or_else(|| StoreError::internal("no chain head"))?;
        assert_eq!(line.account_seq, *at + 1, "an account's queued lines follow each other");
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
        prevs.push(head.to_vec());
        hashes.push(hash.to_vec());
        (*at, *head) = (line.account_seq, hash);
    }
    Ok(vec![
        Value::I64s(seqs),
        Value::I64s(lines.iter().map(|l| l.account_seq).collect()),
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
    ])
}
