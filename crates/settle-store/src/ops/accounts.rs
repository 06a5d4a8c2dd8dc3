//! Accounts, grants and adjustments: the only writes that create credits from nothing, each answered
//! with its ledger entry.

use super::allocations::{PRIORITY_DEFAULT, Terms};
use super::{
    AccountCol, BalanceCheck, Cx, EntryCol, Line, SELECT_ACCOUNT, account_from_row, emit, entry_from_row, post_now,
};
use crate::db::{Db, args, columns, holds};
use crate::error::StoreError;
use crate::model::*;
use settle_core::Credits;
use settle_core::crash::CrashPoint;
use settle_core::fingerprint::Fingerprint;
use settle_core::history::EventKind;
use settle_core::ids::AccountId;
use settle_core::ledger::EntryKind;
use settle_core::limits;
use std::sync::LazyLock;

/// An account create's fingerprint; `max_running` joins it only when given, so creates made before
/// caps existed still replay.
pub(crate) fn account_fingerprint(req: &NewAccount) -> [u8; 32] {
    let f = Fingerprint::new("account").str("id", req.id.as_str()).i64("overdraft_limit", req.overdraft_limit.get());
    match req.max_running {
        Some(cap) => f.i64("max_running", cap).finish(),
        None => f.finish(),
    }
}

fn check_overdraft_limit(limit: Credits) -> Result<(), StoreError> {
    if limit.is_negative() || limit.get() > limits::BALANCE_MAX {
        return Err(StoreError::invalid(format!("overdraft_limit must be between 0 and {}", limits::BALANCE_MAX)));
    }
    Ok(())
}

fn check_max_running(cap: Option<i64>) -> Result<(), StoreError> {
    if cap.is_some_and(|c| !(0..=limits::MAX_RUNNING_MAX).contains(&c)) {
        return Err(StoreError::invalid(format!(
            "max_running must be between 0 and {} (null: no cap)",
            limits::MAX_RUNNING_MAX
        )));
    }
    Ok(())
}

pub(crate) async fn create_account(db: &mut Db<'_>, cx: &Cx, req: &NewAccount) -> Result<Created<Account>, StoreError> {
    check_overdraft_limit(req.overdraft_limit)?;
    check_max_running(req.max_running)?;
    let fp = account_fingerprint(req);
    let inserted = db
        .exec(
            "INSERT INTO accounts (id, balance, overdraft_limit, max_running, created_at, request_hash) \
             VALUES ($1, 0, $2, $3, $4, $5) ON CONFLICT (id) DO NOTHING",
            args![req.id.as_str(), req.overdraft_limit.get(), req.max_running, cx.now.micros(), &fp],
        )
        .await?;
    cx.point(CrashPoint::AfterGuard)?;
    let row = db.one(&SELECT_ACCOUNT, args![req.id.as_str()]).await?;
    let account = account_from_row(&row)?;
    if inserted == 0 {
        if row.blob(AccountCol::request_hash)? != fp {
            return Err(StoreError::IdempotencyConflict { what: "account", id: req.id.to_string() });
        }
        return Ok(Created { value: account, replayed: true });
    }
    emit(
        db,
        cx,
        EventKind::AccountCreated,
        None,
        req.id.as_str(),
        serde_json::json!({ "overdraft_limit": req.overdraft_limit.get(), "max_running": req.max_running }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Created { value: account, replayed: false })
}

/// The account row, locked on PostgreSQL as every posting locks it (SQLite's one writer needs none).
static LOCK_ACCOUNT: LazyLock<[String; 2]> = LazyLock::new(|| {
    let sql = format!("SELECT {} FROM accounts WHERE id = $1", AccountCol::LIST);
    [sql.clone(), format!("{sql} FOR NO KEY UPDATE")]
});

/// Closes the cap gate for the rest of this transaction (PostgreSQL; docs/design/fair-claims.md
/// §10): waits for every write transaction in flight, and holds back every new one, so no claim
/// runs across the cap change and every later one reads the new cap. Its transaction must not pass
/// the gate shared (`SqlStore::write_closing_gate`).
async fn close_cap_gate(db: &mut Db<'_>) -> Result<(), StoreError> {
    if db.engine() == crate::db::Engine::Postgres {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            let (class, key) = crate::engine::postgres::CAP_GATE;
            format!("SELECT 1 AS closed FROM (SELECT pg_advisory_xact_lock({class}, {key})) g")
        });
        db.one(&SQL, args![]).await?;
    }
    Ok(())
}

/// Sets what `changes` gives of the account's overdraft limit and cap: the account as it is after,
/// and whether anything changed (a change that changes nothing writes nothing, not even an event). A lowered cap stops new claims while the
/// account runs at or over it; a raised or removed one lets its parked jobs return (the unpark pass).
pub(crate) async fn update_account(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &AccountId,
    changes: &AccountChanges,
) -> Result<(Account, bool), StoreError> {
    if let Some(limit) = changes.overdraft_limit {
        check_overdraft_limit(limit)?;
    }
    if let Some(cap) = changes.max_running {
        check_max_running(cap)?;
    }
    if changes.max_running.is_some() {
        close_cap_gate(db).await?;
    }
    let sql = match db.engine() {
        crate::db::Engine::Sqlite => &LOCK_ACCOUNT[0],
        crate::db::Engine::Postgres => &LOCK_ACCOUNT[1],
    };
    let Some(row) = db.opt(sql, args![id.as_str()]).await? else {
        return Err(StoreError::NotFound { what: "account", id: id.to_string() });
    };
    let before = account_from_row(&row)?;
    let limit = changes.overdraft_limit.unwrap_or(before.overdraft_limit);
    let cap = changes.max_running.unwrap_or(before.max_running);
    if limit == before.overdraft_limit && cap == before.max_running {
        return Ok((before, false));
    }
    let rows = db
        .exec(
            "UPDATE accounts SET overdraft_limit = $2, max_running = $3 WHERE id = $1",
            args![id.as_str(), limit.get(), cap],
        )
        .await?;
    super::guard_hit(rows, "account update")?;
    cx.point(CrashPoint::AfterGuard)?;
    let after = Account { overdraft_limit: limit, max_running: cap, ..before.clone() };
    emit(
        db,
        cx,
        EventKind::AccountUpdated,
        None,
        id.as_str(),
        serde_json::json!({
            "overdraft_limit": limit.get(), "max_running": cap,
            "before": { "overdraft_limit": before.overdraft_limit.get(), "max_running": before.max_running },
        }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((after, true))
}

columns! {
    /// A grant's or adjustment's entry and the fingerprint of the request that made it.
    CreditCol {
        seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason, created_at, hash,
        request_hash,
    }
}
holds!(CreditCol: EntryCol {
    seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, reason, created_at, hash,
});

/// A grant or adjustment by its id.
static SELECT_CREDIT: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM ledger_entries WHERE kind = $1 AND ref_id = $2", CreditCol::LIST));

/// A grant (`amount > 0`, on `terms`) or an adjustment (`amount ≠ 0`, reason required, default
/// terms), as asked: one posting of one line.
pub(crate) struct Credit<'a> {
    pub kind: EntryKind,
    pub account: &'a AccountId,
    pub id: &'a str,
    pub amount: Credits,
    pub reason: Option<&'a str>,
    pub terms: Terms,
}

/// A grant's or adjustment's fingerprint. A grant's terms join it only when given (a priority only
/// when not the default), so grants made before grants could expire still replay.
fn credit_fingerprint(c: &Credit<'_>) -> [u8; 32] {
    let Credit { kind, account, id, amount, reason, terms } = *c;
    let mut f = Fingerprint::new(kind.as_str())
        .str("account_id", account.as_str())
        .str("id", id)
        .i64("amount", amount.get())
        .opt_str("reason", reason);
    if let Some(at) = terms.expires_at {
        f = f.i64("expires_at", at.micros());
    }
    if terms.priority != PRIORITY_DEFAULT {
        f = f.i64("priority", terms.priority);
    }
    f.finish()
}

/// A grant's terms as asked: a priority of 0–100, an expiry (checked against the clock later, after
/// the replay check, so an old grant's replay still answers).
pub(crate) fn grant_terms(
    expires_at: Option<settle_core::Timestamp>,
    priority: Option<i64>,
) -> Result<Terms, StoreError> {
    let priority = priority.unwrap_or(PRIORITY_DEFAULT);
    if !(0..=100).contains(&priority) {
        return Err(StoreError::invalid("priority must be between 0 and 100"));
    }
    Ok(Terms { priority, expires_at, ..Terms::default() })
}

/// A grant or adjustment, created by its id.
pub(crate) async fn credit(db: &mut Db<'_>, cx: &Cx, c: &Credit<'_>) -> Result<Created<LedgerEntry>, StoreError> {
    let Credit { kind, account, id, amount, reason, terms } = *c;
    debug_assert!(matches!(kind, EntryKind::Grant | EntryKind::Adjustment));
    let fp = credit_fingerprint(c);
    if kind == EntryKind::Grant {
        // One namespace with the top-ups, whose confirmed charges grant under their own ids.
        super::top_ups::lock_grant_id(db, id).await?;
        if super::top_ups::is_top_up(db, id).await? {
            return Err(StoreError::IdTaken { what: "grant", id: id.to_owned() });
        }
    }
    if let Some(existing) = db.opt(&SELECT_CREDIT, args![kind.as_str(), id]).await? {
        if existing.blob(CreditCol::request_hash)? != fp {
            // Ids are unique across accounts: say so when the id is another account's.
            if entry_from_row::<CreditCol>(&existing)?.account_id != *account {
                return Err(StoreError::IdTaken { what: kind.as_str(), id: id.to_owned() });
            }
            return Err(StoreError::IdempotencyConflict { what: kind.as_str(), id: id.to_owned() });
        }
        return Ok(Created { value: entry_from_row::<CreditCol>(&existing)?, replayed: true });
    }
    if let Some(at) = terms.expires_at
        && at <= cx.now
    {
        return Err(StoreError::invalid(format!("expires_at ({}) must be in the future", at.rfc3339())));
    }
    let entries = post_now(
        db,
        cx,
        account.as_str(),
        BalanceCheck::Bounded,
        &[Line {
            kind,
            amount,
            job_id: None,
            job_seq: None,
            item_id: None,
            ref_id: Some(id),
            reason,
            request_hash: Some(&fp),
        }],
        terms,
    )
    .await?;
    cx.point(CrashPoint::AfterLedger)?;
    let entry = entries.into_iter().next().expect("one line posted");
    let event = match kind {
        EntryKind::Grant => EventKind::AccountGranted,
        _ => EventKind::AccountAdjusted,
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
