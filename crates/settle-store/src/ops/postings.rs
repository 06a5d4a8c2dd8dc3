//! A posting: the ledger lines of one operation on one account (`ledger`), and the grants' side of
//! them (`grants`): which grant paid for each debit, where each return goes back to, and what
//! expires first (docs/decisions/0021, 0023).
//!
//! Every balance change waits for the clock: an account with a grant past its instant and not yet
//! expired posts nothing until its due grants are expired, in the same transaction on the same
//! account row, so no check counts credit that is already dead.

use super::allocations::{self, Books, Spend, Terms};
use super::expiry::{self, Expiry};
use super::{BalanceCheck, Cx, Guard, Holds, Line, Posted, Posting, Write, append, change_holds, emit, lock_pending};
use crate::db::Db;
use crate::error::StoreError;
use crate::model::LedgerEntry;
use settle_core::Credits;
use settle_core::history::EventKind;
use settle_core::ledger::EntryKind;

/// Appends a posting's lines to its account's ledger: one server-side balance change for their sum
/// (guarded per its check, numbering them in the account), then the lines themselves — at once on
/// SQLite; on PostgreSQL queued for `flush`, which gives them their `seq` and hashes just before
/// COMMIT — and the grants' side of it: its debits taken from the grants `spend` allows.
pub(crate) async fn post(db: &mut Db<'_>, cx: &Cx, posting: Posting<'_>, spend: Spend) -> Result<(), StoreError> {
    let side = Side { terms: Terms::default(), spend };
    post_with(db, cx, &posting, side, Write::WithTheTransaction).await.map(|_| ())
}

/// A top-up's grant (origin `top_up`, never expiring): `post`, with the grant line's terms, queued
/// with the transaction as every posting of a job's transition is (docs/design/money-controls.md §4).
pub(crate) async fn post_bought(db: &mut Db<'_>, cx: &Cx, posting: Posting<'_>) -> Result<(), StoreError> {
    let terms = Terms { origin: settle_core::ledger::GrantOrigin::TopUp, ..Terms::default() };
    let side = Side { terms, spend: Spend::Any };
    post_with(db, cx, &posting, side, Write::WithTheTransaction).await.map(|_| ())
}

/// The grants' side of a posting: a grant line's terms, which grants its debits take from.
#[derive(Debug, Clone, Copy)]
struct Side {
    terms: Terms,
    spend: Spend,
}

/// `post`, with the lines numbered and written at once, for an answer that is the entry itself
/// (grants, adjustments; a grant line opens a grant on `terms`; no holds move). It runs in a
/// transaction of its own on PostgreSQL: nothing may be queued before it (the chain head it reads
/// would miss the queued lines).
pub(crate) async fn post_now(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    check: BalanceCheck,
    lines: &[Line<'_>],
    terms: Terms,
) -> Result<Vec<LedgerEntry>, StoreError> {
    if let Some(pending) = &cx.pending
        && !lock_pending(pending).lines.is_empty()
    {
        return Err(StoreError::internal("post_now after queued ledger lines would fork the chain"));
    }
    let side = Side { terms, spend: Spend::Any };
    let posting = Posting { account_id, job_kind: None, check, lines, holds: Holds::default() };
    post_with(db, cx, &posting, side, Write::Now).await
}

/// The balance change and lines, after the account's due grants have expired.
async fn post_on_the_clock(
    db: &mut Db<'_>,
    cx: &Cx,
    posting: &Posting<'_>,
    write: Write,
) -> Result<(Posted, Vec<LedgerEntry>), StoreError> {
    if let Some(done) = append(db, cx, posting, Guard::Clock, write).await? {
        return Ok(done);
    }
    let account_id = posting.account_id;
    expiry::expire_due(db, cx, account_id, Expiry::Met { write }).await?;
    append(db, cx, posting, Guard::Clock, write)
        .await?
        .ok_or_else(|| StoreError::internal(format!("account {account_id} still has a grant due after its expiry")))
}

async fn post_with(
    db: &mut Db<'_>,
    cx: &Cx,
    posting: &Posting<'_>,
    side: Side,
    write: Write,
) -> Result<Vec<LedgerEntry>, StoreError> {
    let Posting { account_id, lines, holds, .. } = *posting;
    if lines.is_empty() {
        change_holds(db, account_id, holds).await?;
        return Ok(Vec::new());
    }
    let (posted, mut entries) = post_on_the_clock(db, cx, posting, write).await?;
    let books = Books::new(account_id, posted.debt);
    entries.extend(grants_side(db, cx, posting, &posted, side, write, books).await?);
    Ok(entries)
}

/// The balance change and lines of a posting whose grants' side the caller writes itself (the plan,
/// docs/design/batch-plan.md §10), or leaves to [`debits_from_grants`].
pub(crate) async fn post_balance(db: &mut Db<'_>, cx: &Cx, posting: &Posting<'_>) -> Result<Posted, StoreError> {
    post_on_the_clock(db, cx, posting, Write::WithTheTransaction).await.map(|(posted, _)| posted)
}

/// The grants' side of a posting of debits whose balance change `posted` is done: what the plan's
/// one-statement take from the head of the burn-down order could not cover.
pub(crate) async fn debits_from_grants(
    db: &mut Db<'_>,
    cx: &Cx,
    posting: &Posting<'_>,
    posted: &Posted,
    spend: Spend,
) -> Result<(), StoreError> {
    let side = Side { terms: Terms::default(), spend };
    let books = Books::after_the_head(posting.account_id, posted.debt);
    grants_side(db, cx, posting, posted, side, Write::WithTheTransaction, books).await.map(drop)
}

/// Which grants pay for a posting's lines, after its balance change: debits taken, returns given
/// back (and expired again at once where their grant has expired: those entries are returned),
/// new credit opened.
async fn grants_side(
    db: &mut Db<'_>,
    cx: &Cx,
    posting: &Posting<'_>,
    posted: &Posted,
    side: Side,
    write: Write,
    mut books: Books<'_>,
) -> Result<Vec<LedgerEntry>, StoreError> {
    let Posting { account_id, lines, .. } = *posting;
    let mut entries = Vec::new();
    allocations::account_for(db, cx, &mut books, lines, posted.first_account_seq, side.terms, side.spend).await?;
    let after = posted.first_account_seq + lines.len() as i64;
    let reexpired = allocations::reexpiries(db, &mut books, after).await?;
    if !reexpired.is_empty() {
        // Parts given back to expired grants expire at once, right after the posting's lines, on
        // the account row this operation still holds.
        let lines: Vec<Line<'_>> = reexpired
            .iter()
            .map(|r| Line {
                kind: EntryKind::Expire,
                amount: Credits::new(-r.amount),
                job_id: None,
                job_seq: None,
                item_id: None,
                ref_id: Some(&r.ref_id),
                reason: None,
                request_hash: None,
            })
            .collect();
        let expiries =
            Posting { account_id, job_kind: None, check: BalanceCheck::Never, lines: &lines, holds: Holds::default() };
        let unguarded = append(db, cx, &expiries, Guard::Off, write);
        let (again, more) = unguarded.await?.ok_or_else(|| StoreError::internal("an unguarded posting waited"))?;
        if again.first_account_seq != after {
            return Err(StoreError::internal("an account moved between two postings of one operation"));
        }
        entries.extend(more);
        for r in &reexpired {
            let data =
                serde_json::json!({ "grant": r.grant, "amount": r.amount, "ref_id": r.ref_id, "on_return": true });
            emit(db, cx, EventKind::GrantExpired, None, account_id, data).await?;
        }
    }
    allocations::close(db, &books).await?;
    Ok(entries)
}
