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
//! In the plan so far, each beside the existing path it stands in for: the lease holder's failure
//! (`failure::holder_fails`), a new job (`create::creates`), a success reported with a lease token
//! (`success::succeeds`). This file holds what they share.

use crate::error::StoreError;
use crate::model::Item;
use settle_core::Credits;
use settle_core::ids::ItemId;
use settle_core::item::{ItemState, RefundReason};

/// An item as read: id, cost, hold, state, refund reason.
pub(super) type ItemRead = (String, i64, Option<i64>, String, Option<String>);

pub(super) fn parse<T: serde::de::DeserializeOwned>(json: Option<String>) -> Result<Vec<T>, StoreError> {
    match json {
        None => Ok(Vec::new()),
        Some(text) => serde_json::from_str(&text).map_err(|e| StoreError::internal(format!("a plan's read: {e}"))),
    }
}

pub(super) fn item((id, cost, hold, state, reason): ItemRead) -> Result<Item, StoreError> {
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

/// Every count a write returned under locks it holds equals the plan's: anything else is a bug.
pub(super) fn check_counts(what: &str, id: &str, counts: &[(&str, i64, i64)]) -> Result<(), StoreError> {
    for (table, got, want) in counts {
        if got != want {
            return Err(StoreError::internal(format!("{what} {id} changed {got} {table}, not {want}, on locked rows")));
        }
    }
    Ok(())
}

/// Where `TAKE_FROM_HEAD`'s values are in the statement that holds it: each a placeholder (`$2`),
/// `lines` two (`$12::text[], $13::bigint[]`: the lines' items and amounts).
pub(super) struct TakeAt<'a> {
    pub account: &'a str,
    pub total: &'a str,
    pub kind: &'a str,
    pub job: &'a str,
    pub first_seq: &'a str,
    pub now: &'a str,
    pub lines: &'a str,
}

/// `TAKE_FROM_HEAD` with its values at `at`, for a statement's `WITH` list.
pub(super) fn take_from_head(at: &TakeAt<'_>) -> String {
    TAKE_FROM_HEAD
        .replace("$A", at.account)
        .replace("$T", at.total)
        .replace("$K", at.kind)
        .replace("$J", at.job)
        .replace("$S", at.first_seq)
        .replace("$N", at.now)
        .replace("$U", at.lines)
}

/// Debug builds (the whole test suite): a planned operation's answer, built from its decision, is
/// the job as stored.
#[cfg(debug_assertions)]
pub(super) async fn assert_stored(
    db: &mut crate::db::Db<'_>,
    cx: &super::Cx,
    answer: &crate::model::Job,
) -> Result<(), StoreError> {
    let stored = super::must_read_job(db, cx, answer.id.as_str()).await?;
    assert_eq!(*answer, stored, "a planned operation's answer must be what was stored");
    Ok(())
}
