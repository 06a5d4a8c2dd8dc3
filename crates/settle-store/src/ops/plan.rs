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

use super::{ItemRead, JobCol, JobRow, PlanRead, ReadAhead, job_row};
use crate::db::{Db, Value, columns};
use crate::error::StoreError;
use crate::model::Item;
use settle_core::Credits;
use settle_core::ids::ItemId;
use settle_core::item::{ItemState, RefundReason};
use std::sync::LazyLock;

/// What a queued operation will move, when a PostgreSQL lane may plan it with the batch's others
/// (docs/design/batch-plan.md §12): the job, and the token of a success (whose plan reads the
/// attempt that held it). SQLite ignores intents.
#[derive(Debug, Clone)]
pub(crate) struct Intent {
    pub job: String,
    pub kind: IntentKind,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum IntentKind {
    /// A worker's failure report.
    Fail,
    /// A success reported with this lease token and no prices.
    Succeed { token: String },
}

/// A job whose plan is read: its id, its account, and what its intent needs.
pub(super) struct ToRead<'a> {
    pub job: &'a str,
    pub account: &'a str,
    pub kind: &'a IntentKind,
}

columns! {
    /// `PLAN_READ`'s row for each job, in the order asked.
    PlanReadCol {
        items = "(SELECT CAST(json_agg(json_build_array(item_id, cost, hold, state, refund_reason) ORDER BY ord) AS text) \
                 FROM items WHERE job_id = u.id)",
        net = "(SELECT CAST(COALESCE(SUM(amount), 0) AS bigint) FROM ledger_entries WHERE job_id = u.id)",
        parts = "(SELECT CAST(json_agg(json_build_array(p.id, p.grant_key, p.item_id, p.taken - p.given_back, \
                 g.expired_at IS NULL) ORDER BY p.id DESC) AS text) FROM allocations p LEFT JOIN grants g ON g.key = p.grant_key \
                 WHERE u.fails = 1 AND p.job_id = u.id AND p.given_back < p.taken)",
        token_attempt = "(SELECT attempt_no FROM attempts WHERE job_id = u.id AND lease_token = u.token)",
        next_expiry = "(SELECT next_expiry FROM accounts WHERE id = u.account)",
    }
}

/// Every job's plan read in one statement: each column a subquery correlated on its own job (so
/// each is an index lookup whatever the number of jobs; a join against the arrays would be planned
/// for unnest's 100-row guess), the rows in the order asked.
static PLAN_READ: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM unnest($1::text[], $2::text[], $3::text[], $4::bigint[]) WITH ORDINALITY \
         AS u(id, account, token, fails, ord) ORDER BY u.ord",
        PlanReadCol::LIST
    )
});

/// `PLAN_READ` for one job, without the arrays (the function scan and sort of `unnest` are executor
/// nodes a read of one job would start for nothing).
static PLAN_READ_ONE: LazyLock<String> = LazyLock::new(|| {
    let list = (PlanReadCol::LIST.replace("u.id", "$1::text").replace("u.account", "$2::text"))
        .replace("u.token", "$3::text")
        .replace("u.fails", "$4::bigint");
    format!("SELECT {list}")
});

/// The plans of `jobs`, read in one statement, in their order.
pub(super) async fn plan_reads(db: &mut Db<'_>, jobs: &[ToRead<'_>]) -> Result<Vec<PlanRead>, StoreError> {
    let ids = jobs.iter().map(|j| j.job.to_owned()).collect();
    let accounts = jobs.iter().map(|j| j.account.to_owned()).collect();
    let (tokens, fails): (Vec<Option<String>>, Vec<i64>) = jobs
        .iter()
        .map(|j| match j.kind {
            IntentKind::Fail => (None, 1),
            IntentKind::Succeed { token } => (Some(token.clone()), 0),
        })
        .unzip();
    let rows = match (jobs, tokens.first(), fails.first()) {
        ([job], Some(token), Some(fails)) => {
            let args = [job.job.into(), job.account.into(), Value::OptText(token.clone()), (*fails).into()];
            db.all(&PLAN_READ_ONE, &args).await?
        }
        _ => {
            let args = [Value::Texts(ids), Value::Texts(accounts), Value::OptTexts(tokens), Value::I64s(fails)];
            db.all(&PLAN_READ, &args).await?
        }
    };
    if rows.len() != jobs.len() {
        return Err(StoreError::internal(format!("a plan read {} rows for {} jobs", rows.len(), jobs.len())));
    }
    rows.iter()
        .map(|r| {
            Ok(PlanRead {
                items: parse(r.opt_text(PlanReadCol::items)?)?,
                net: r.i64(PlanReadCol::net)?,
                parts: parse(r.opt_text(PlanReadCol::parts)?)?,
                token_attempt: r.opt_i64(PlanReadCol::token_attempt)?,
                next_expiry: r.opt_i64(PlanReadCol::next_expiry)?,
            })
        })
        .collect()
}

/// `job`'s plan as its batch read it ahead, or read now.
pub(super) async fn plan_read(
    db: &mut Db<'_>,
    job: &JobRow,
    kind: &IntentKind,
    ahead: Option<PlanRead>,
) -> Result<PlanRead, StoreError> {
    if let Some(read) = ahead {
        return Ok(read);
    }
    let to_read = ToRead { job: &job.id, account: &job.account_id, kind };
    plan_reads(db, &[to_read]).await?.pop().ok_or_else(|| StoreError::internal("a plan read no row"))
}

/// Phase 1's lock: the intents' jobs, in id order, never waiting — a job another transaction holds
/// is skipped (the batch holds no lock yet, so nothing skipped is its own).
static LOCK_AHEAD: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM jobs WHERE id = ANY($1::text[]) ORDER BY id FOR UPDATE SKIP LOCKED", JobCol::LIST)
});

/// A batch's phase 1 (docs/design/batch-plan.md §12): every intent's job locked in one statement
/// and every plan read in one more, after the locks. `None` for an intent whose job was not locked
/// (another transaction holds it, or there is none).
pub(crate) async fn read_ahead(db: &mut Db<'_>, intents: &[&Intent]) -> Result<Vec<Option<ReadAhead>>, StoreError> {
    let ids: Vec<String> = intents.iter().map(|i| i.job.clone()).collect();
    let mut locked: Vec<JobRow> =
        (db.all(&LOCK_AHEAD, &[Value::Texts(ids)]).await?.iter()).map(job_row).collect::<Result<_, _>>()?;
    let mut rows: Vec<Option<JobRow>> =
        intents.iter().map(|i| locked.iter().position(|r| r.id == i.job).map(|at| locked.swap_remove(at))).collect();
    let to_read: Vec<ToRead<'_>> = (intents.iter().zip(&rows))
        .filter_map(|(i, row)| row.as_ref().map(|r| ToRead { job: &r.id, account: &r.account_id, kind: &i.kind }))
        .collect();
    let mut reads = plan_reads(db, &to_read).await?.into_iter();
    drop(to_read);
    Ok(rows
        .iter_mut()
        .map(|row| row.take().map(|row| ReadAhead { row, read: reads.next().expect("one read per locked job") }))
        .collect())
}

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
