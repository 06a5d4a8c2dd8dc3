//! The ledger: guarded balance changes, and the lines that explain them, hash-chained per account.
//! On SQLite lines are numbered at once from the gap-free `ledger` counter; on PostgreSQL they wait
//! in the transaction's `Pending` and are numbered just before COMMIT (docs/decisions/0013).

use super::{Cx, PendingLine, guard_hit, lock_pending, next_seq};
use crate::db::{Db, Value, args, columns};
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
    /// What a balance change returns: the balance after it.
    BalanceCol { balance }
}

columns! {
    /// Why a debit was refused: the balance and the overdraft it may use.
    LimitCol { balance, overdraft_limit }
}

columns! {
    /// An account's newest entry's hash.
    HashCol { hash }
}

columns! {
    /// Each account (of an array) and its newest entry's hash (NULL for none).
    HeadCol { id = "a.id", hash = "(SELECT e.hash FROM ledger_entries e WHERE e.account_id = a.id ORDER BY e.seq DESC LIMIT 1)" }
}

// Debits (charges, negative adjustments) keep `balance − exposure ≥ −BALANCE_MAX`: the balance
// after every possible reclaim stays inside i64 (docs/decisions/0003).
// Each also moves `held` by $4 and `exposure` by $5 (`Holds`) in the same statement; the guards
// read the values from before it, as when they were separate statements after the balance.
static DEBIT_OVERDRAFT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5 \
         WHERE id = $1 AND balance >= (0 - overdraft_limit) - $2 AND balance - exposure >= (0 - $3) - $2 \
         RETURNING {}",
        BalanceCol::LIST
    )
});
// As DEBIT_OVERDRAFT with the overdraft limit taken as zero, whatever the account's is.
static DEBIT_CASH: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5 \
         WHERE id = $1 AND balance >= 0 - $2 AND balance - exposure >= (0 - $3) - $2 RETURNING {}",
        BalanceCol::LIST
    )
});
// Credits (grants, positive adjustments) keep `balance + held ≤ BALANCE_MAX`: the balance after every
// refund and return still possible stays inside i64 (docs/decisions/0003).
static CREDIT_BOUNDED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5 \
         WHERE id = $1 AND balance + held <= $3 - $2 RETURNING {}",
        BalanceCol::LIST
    )
});
static DEBIT_BOUNDED: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $4, exposure = exposure + $5 \
         WHERE id = $1 AND balance - exposure >= (0 - $3) - $2 RETURNING {}",
        BalanceCol::LIST
    )
});
static CREDIT_ANY: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE accounts SET balance = balance + $2, held = held + $3, exposure = exposure + $4 \
         WHERE id = $1 RETURNING {}",
        BalanceCol::LIST
    )
});
static LIMITS: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", LimitCol::LIST));
static CHAIN_HEAD: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM ledger_entries WHERE account_id = $1 ORDER BY seq DESC LIMIT 1", HashCol::LIST)
});
static CHAIN_HEADS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM unnest($1::text[]) AS a(id)", HeadCol::LIST));
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
            db.opt(&DEBIT_OVERDRAFT, args![account_id, total.get(), limits::BALANCE_MAX, held, exposure]).await?
        }
        BalanceCheck::Cash => {
            debug_assert!(!total.is_positive());
            db.opt(&DEBIT_CASH, args![account_id, total.get(), limits::BALANCE_MAX, held, exposure]).await?
        }
        BalanceCheck::Bounded if total.is_negative() => {
            db.opt(&DEBIT_BOUNDED, args![account_id, total.get(), limits::BALANCE_MAX, held, exposure]).await?
        }
        BalanceCheck::Bounded => {
            db.opt(&CREDIT_BOUNDED, args![account_id, total.get(), limits::BALANCE_MAX, held, exposure]).await?
        }
        BalanceCheck::Never => db.opt(&CREDIT_ANY, args![account_id, total.get(), held, exposure]).await?,
    };
    let Some(row) = row else {
        let current =
            db.opt(&LIMITS, args![account_id]).await?.ok_or_else(|| StoreError::not_found("account", account_id))?;
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
    };
    row.i64(BalanceCol::balance)
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
    assert_eq!(balance.get(), balance_end, "ledger lines must sum to the balance change");
    Ok(out)
}

/// The hash of an account's newest entry (the genesis hash for an account without entries).
async fn chain_head(db: &mut Db<'_>, account_id: &str) -> Result<Hash32, StoreError> {
    match db.opt(&CHAIN_HEAD, args![account_id]).await? {
        Some(r) => r.blob(HashCol::hash)?.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes")),
        None => Ok(GENESIS_HASH),
    }
}

/// PostgreSQL, just before COMMIT: numbers the transaction's queued lines from the `ledger`
/// counter, chains them per account and writes them in one statement. The previous hash of each
/// account is read before the counter is taken; it cannot change meanwhile, as this transaction
/// holds the row of every account it posted to.
pub(super) async fn flush_lines(db: &mut Db<'_>, lines: &[PendingLine]) -> Result<(), StoreError> {
    if lines.is_empty() {
        return Ok(());
    }
    let mut accounts: Vec<&str> = Vec::new();
    for line in lines {
        if !accounts.contains(&line.account_id.as_str()) {
            accounts.push(&line.account_id);
        }
    }
    let mut heads: std::collections::HashMap<String, Hash32> = std::collections::HashMap::new();
    let rows = db.all(&CHAIN_HEADS, &[Value::Texts(accounts.iter().map(|a| a.to_string()).collect())]).await?;
    for r in &rows {
        let head = match r.opt_blob(HeadCol::hash)? {
            Some(h) => h.try_into().map_err(|_| StoreError::internal("ledger hash is not 32 bytes"))?,
            None => GENESIS_HASH,
        };
        heads.insert(r.text(HeadCol::id)?, head);
    }
    let first = next_seq(db, "ledger", lines.len() as i64).await?;
    let n = lines.len();
    let (mut seqs, mut prevs, mut hashes) = (Vec::with_capacity(n), Vec::with_capacity(n), Vec::with_capacity(n));
    for (i, line) in lines.iter().enumerate() {
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
    Ok(())
}
