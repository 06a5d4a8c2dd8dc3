//! The expiry of an account's due grants (docs/decisions/0023): each expired grant's rest taken by
//! an `expire` entry, its event, and the account's next expiry. Run by the background pass in an
//! operation of its own, and by a posting that meets a grant due (`postings`): it posts its own
//! lines, so it stands above the posting, apart from the grants' side of one (`allocations`).

use super::allocations::{LockCol, NEVER, READ_ACCOUNT, SET_NEXT_EXPIRY};
use super::{Cx, Line, Write, emit, guard_hit};
use crate::db::{Db, Engine, args, columns};
use crate::error::StoreError;
use settle_core::Timestamp;
use settle_core::crash::CrashPoint;
use settle_core::history::EventKind;
use settle_core::ledger::EntryKind;
use std::sync::LazyLock;

/// Who expires an account's due grants.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Expiry {
    /// The background pass, in an operation of its own.
    Pass,
    /// A posting that met them; the expiry's lines are written when the posting's are.
    Met { write: Write },
}

columns! {
    /// A due grant.
    DueCol { key, source_id, remaining, expires_at }
}

columns! {
    /// The account's soonest unexpired grant.
    NextCol { next = "MIN(expiry_key)" }
}

pub(super) static DUE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM grants WHERE account_id = $1 AND expired_at IS NULL AND expiry_key <= $2 ORDER BY expiry_key, key",
        DueCol::LIST
    )
});
static NEXT: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM grants WHERE account_id = $1 AND expired_at IS NULL", NextCol::LIST));
static LOCK_ACCOUNT_PG: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1 FOR NO KEY UPDATE", LockCol::LIST));

const EXPIRE: &str = "UPDATE grants SET expired_at = $2, expired_seq = $4, remaining = 0, spent = 1 \
     WHERE key = $1 AND expired_at IS NULL AND remaining = $3";

/// Expires every grant of the account that is due at `cx.now`: one guarded update per grant, one
/// `expire` entry of what it had left (none when nothing), one `grant.expired` event each, and the
/// account's next expiry. Locks the account row first; nothing when nothing is due (another pass or
/// posting got there first). Returns how many grants it expired.
pub(crate) async fn expire_due(db: &mut Db<'_>, cx: &Cx, account_id: &str, how: Expiry) -> Result<u32, StoreError> {
    // The crash points are the pass's own: a posting that meets a grant due crashes at its own.
    let point = |p: CrashPoint| if how == Expiry::Pass { cx.point(p) } else { Ok(()) };
    let write = match how {
        Expiry::Met { write } => write,
        Expiry::Pass => Write::WithTheTransaction,
    };
    let lock = match db.engine() {
        Engine::Postgres => &*LOCK_ACCOUNT_PG,
        Engine::Sqlite => &*READ_ACCOUNT,
    };
    let Some(row) = db.opt(lock, args![account_id]).await? else {
        return Err(StoreError::not_found("account", account_id));
    };
    let at = cx.now.micros();
    if row.i64(LockCol::next_expiry)? > at {
        return Ok(0);
    }
    // Each grant's `expired_seq`: its `expire` entry's position, or the account's last one when it
    // had nothing left (the lines below are posted in this order).
    let mut last = row.i64(LockCol::last_account_seq)?;
    let due = db.all(&DUE, args![account_id, at]).await?;
    let mut expired = Vec::with_capacity(due.len());
    for r in &due {
        let (key, source, remaining) = (r.i64(DueCol::key)?, r.text(DueCol::source_id)?, r.i64(DueCol::remaining)?);
        if remaining > 0 {
            last += 1;
        }
        let rows = db.exec(EXPIRE, args![key, at, remaining, last]).await?;
        guard_hit(rows, "grant expiry")?;
        expired.push((source, remaining, r.opt_i64(DueCol::expires_at)?));
    }
    point(CrashPoint::AfterGuard)?;
    let lines: Vec<Line<'_>> = expired
        .iter()
        .filter(|(_, remaining, _)| *remaining > 0)
        .map(|(source, remaining, _)| Line {
            kind: EntryKind::Expire,
            amount: settle_core::Credits::new(-*remaining),
            job_id: None,
            job_seq: None,
            item_id: None,
            ref_id: Some(source),
            reason: None,
            request_hash: None,
        })
        .collect();
    super::ledger::post_expiries(db, cx, account_id, &lines, write).await?;
    point(CrashPoint::AfterLedger)?;
    let next = db.one(&NEXT, args![account_id]).await?.opt_i64(NextCol::next)?.unwrap_or(NEVER);
    let rows = db.exec(SET_NEXT_EXPIRY, args![account_id, next]).await?;
    guard_hit(rows, "account next expiry")?;
    for (source, remaining, expires_at) in &expired {
        let data = serde_json::json!({
            "grant": source,
            "amount": remaining,
            "expires_at": expires_at.map(|t| Timestamp::from_micros(t).rfc3339()),
        });
        emit(db, cx, EventKind::GrantExpired, None, account_id, data).await?;
    }
    point(CrashPoint::AfterOutbox)?;
    point(CrashPoint::BeforeCommit)?;
    Ok(expired.len() as u32)
}
