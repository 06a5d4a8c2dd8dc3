//! Every write of Settle, written once for both engines. Each function runs inside a transaction
//! the caller opened (a batch's, shared with other operations: an operation that fails must have
//! changed nothing, or the batch runs again with a savepoint each — `Db::touched`).
//!
//! The shape of every transition: lock and read the job row (PostgreSQL `FOR UPDATE`; on SQLite
//! the single writer already serialises), decide with the pure functions of `settle-core`, then
//! apply the decision as guarded `UPDATE … WHERE state = <from> …` statements whose row counts are
//! asserted, the ledger rows, the server-side balance change and the outbox event — all in the
//! one transaction. Nothing here reads the system clock or keeps money in application state.
//!
//! The transitions, by family:
//!
//! - [`accounts`]: accounts, grants and adjustments.
//! - [`create`]: a job and its items, charged.
//! - [`claim`]: due jobs leased to workers, each with an attempt row; [`lines`]: the lines and turns
//!   claims take them from.
//! - [`signals`]: heartbeats, item reports and artifacts from the lease holder.
//! - [`failure`]: a failure signal or a lapsed lease: refund, then retry or dead.
//! - [`success`]: success from any attempt, reclaiming what a failure refunded.
//! - [`unknown`]: outcomes nobody knows yet, and their reconciliation.
//! - [`release`]: a job handed back by a worker that must stop, at an item boundary.
//! - [`teardown`]: cancel, requeue, and the cancelling job's artifact cleanup and end.
//! - [`alerts`] and [`spend_limits`]: an account's money controls, on the postings' path.
//! - [`payouts`]: withdrawals created, paid, resolved and returned.
//! - [`webhooks`]: deliveries fanned out, claimed and reported; the circuit breaker.
//!
//! over what they share:
//!
//! - [`rows`]: reading job, item, entry, account, event and delivery rows (decoded by column
//!   name), shared with `reads`.
//! - [`ledger`]: guarded balance changes and the per-account hash-chained ledger lines.
//! - [`outbox`]: events, written in the transition's transaction.
//! - [`items`]: the item arrows applied to a job's items, with their ledger lines.
//! - [`history`]: the attempt log, the signal log and the operator actions.

mod accounts;
pub(crate) mod alerts;
pub(crate) mod allocations;
pub(crate) mod auto_top_ups;
mod caps;
mod claim;
mod commit;
mod create;
pub(crate) mod expiry;
mod failure;
mod history;
mod items;
mod ledger;
pub(crate) mod lines;
mod outbox;
pub(crate) mod payouts;
pub(crate) mod plan;
mod postings;
mod prices;
mod release;
mod rows;
mod signals;
pub(crate) mod spend_limits;
mod success;
mod teardown;
mod top_up_close;
mod top_up_rule;
pub(crate) mod top_ups;
mod unknown;
pub(crate) mod webhooks;

pub(crate) use accounts::*;
pub(crate) use claim::*;
pub(crate) use commit::flush;
pub(crate) use create::*;
pub(crate) use failure::*;
pub(crate) use history::*;
pub(crate) use items::*;
pub(crate) use ledger::*;
pub(crate) use outbox::*;
pub(crate) use postings::*;
pub(crate) use prices::*;
pub(crate) use release::*;
pub(crate) use rows::*;
pub(crate) use signals::*;
pub(crate) use success::*;
pub(crate) use teardown::*;
pub(crate) use unknown::*;

use crate::error::StoreError;
use settle_core::backoff::SplitMix64;
use settle_core::crash::CrashPoint;
use settle_core::history::EventKind;
use settle_core::job::Policies;
use settle_core::ledger::EntryKind;
use settle_core::{Credits, Timestamp};
use std::sync::{Arc, Mutex};

/// Asked at every crash point; answers whether to "crash" there.
pub trait CrashHook: Send + Sync {
    fn should_crash(&self, point: CrashPoint) -> bool;
}

/// What every operation needs besides the connection.
pub(crate) struct Cx {
    pub now: Timestamp,
    pub policy: Arc<Policies>,
    pub rng: Arc<Mutex<SplitMix64>>,
    pub crash: Option<Arc<dyn CrashHook>>,
    /// Seeded tokens (the simulator's); `None`: the operating system's randomness.
    pub tokens: Option<Arc<Mutex<SplitMix64>>>,
    /// A guard the simulator's tests removed (`crate::broken`).
    pub broken: Option<crate::broken::Guard>,
    /// PostgreSQL: the transaction's ledger lines and events, written by `flush` just before its
    /// COMMIT (docs/decisions/0021). `None` on SQLite, whose single writer numbers them at once.
    pub pending: Option<Arc<Mutex<Pending>>>,
    /// SQLite: the writer batch's gap-free counters, read once after its `BEGIN IMMEDIATE` and
    /// written back once before its COMMIT. `None` on PostgreSQL and for reads.
    pub counters: Option<Arc<Mutex<Counters>>>,
    /// PostgreSQL: the job this operation's intent names, locked and read by its batch's phase 1
    /// (docs/design/batch-plan.md §12) — for this operation, this run only; taken once.
    pub ahead: Mutex<Option<ReadAhead>>,
    /// The store's lines as this process last read them (docs/design/fair-claims.md §4).
    pub lines: Arc<Mutex<lines::Lines>>,
    /// The auto top-up rules this operation's postings crossed (account, rule generation), for
    /// `auto_top_ups::after_operation` at its end; cleared as each operation begins.
    pub crossings: Mutex<Vec<(String, i64)>>,
}

/// The `counters` rows (job, ledger and outbox numbers) as one SQLite writer batch holds them: the
/// batch holds the database's write lock from its `BEGIN IMMEDIATE` to its COMMIT, so numbers are
/// taken here in memory instead of by a statement each, and written back once. The writer takes a
/// mark before each operation and restores it when the operation fails (rolled back to its
/// savepoint, or having changed nothing), so the numbers stay gap-free.
#[derive(Debug)]
pub(crate) struct Counters {
    values: Vec<(String, i64)>,
    read: Vec<i64>,
    /// The stamp this batch's events go under, if it writes any: one past the largest stamp the
    /// store holds (and past zero), read under the batch's write lock (`events_stamp`); `None`
    /// past `i64::MAX`, which refuses the batch's events, and only them.
    stamp: Option<i64>,
}

impl Counters {
    /// The counters as read at the start of the batch, and the largest stamp the store held then.
    pub fn new(values: Vec<(String, i64)>, largest_stamp: i64) -> Self {
        let read = values.iter().map(|(_, v)| *v).collect();
        Counters { values, read, stamp: largest_stamp.max(0).checked_add(1) }
    }

    pub fn mark(&self) -> Vec<i64> {
        self.values.iter().map(|(_, v)| *v).collect()
    }

    pub fn restore(&mut self, mark: &[i64]) {
        for ((_, v), m) in self.values.iter_mut().zip(mark) {
            *v = *m;
        }
    }

    /// The counters the batch moved, with their new values: to write back before COMMIT.
    pub fn changed(&self) -> impl Iterator<Item = (&str, i64)> {
        self.values.iter().zip(&self.read).filter(|((_, v), r)| v != *r).map(|((n, v), _)| (n.as_str(), *v))
    }

    /// The value `name` had when the batch read it.
    pub fn read_value(&self, name: &str) -> Option<i64> {
        self.values.iter().zip(&self.read).find(|((c, _), _)| c == name).map(|(_, r)| *r)
    }

    /// The batch's events as one stamp (docs/design/batch-plan.md §4a, §16): `(stamp, first_seq,
    /// last_seq)`, or `None` when the batch numbered no event. The stamp is one past every stamp
    /// the store holds — whichever engine or release gave them (a store copied from PostgreSQL
    /// keeps its sequence's stamps; stores written before this release, and older processes still
    /// writing, hold negative ones) — so it never meets one, and each batch's events go in at the
    /// right edge of `events`' key. An event numbered means `event_place` gave it the stamp.
    pub fn events_stamp(&self) -> Option<(i64, i64, i64)> {
        let read = self.read_value("outbox")?;
        let now = self.values.iter().find(|(c, _)| c == "outbox").map(|(_, v)| *v)?;
        (now > read).then_some((self.stamp?, read + 1, now))
    }

    /// An event of this batch numbered `seq`: its stamp, and its place in it (`seq` less the
    /// counter as read).
    pub fn event_place(&self, seq: i64) -> Result<(i64, i64), StoreError> {
        let read = (self.read_value("outbox"))
            .ok_or_else(|| StoreError::internal("an event written outside the SQLite writer"))?;
        Ok((self.stamp.ok_or(StoreError::Overflow)?, seq - read))
    }

    /// Reserves `n` numbers of `name`; returns the first.
    fn take(&mut self, name: &str, n: i64) -> Result<i64, StoreError> {
        let (_, value) = (self.values.iter_mut().find(|(c, _)| c == name))
            .ok_or_else(|| StoreError::internal(format!("no counter named {name}")))?;
        let first = value.checked_add(1).ok_or(StoreError::Overflow)?;
        *value = value.checked_add(n).ok_or(StoreError::Overflow)?;
        Ok(first)
    }
}

/// Ledger lines and outbox events of one PostgreSQL transaction, in the order they were written,
/// waiting for their `seq` and hashes (lines) and their stamp (events). Shared by every operation of a batch; the batch runner cuts it back
/// to the mark taken before an operation that fails.
#[derive(Default)]
pub(crate) struct Pending {
    pub lines: Vec<PendingLine>,
    pub events: Vec<PendingEvent>,
}

impl Pending {
    pub fn mark(&self) -> (usize, usize) {
        (self.lines.len(), self.events.len())
    }

    pub fn truncate(&mut self, (lines, events): (usize, usize)) {
        self.lines.truncate(lines);
        self.events.truncate(events);
    }

    /// What the transaction has queued so far for one job (added to its `net`).
    fn job_amount(&self, job_id: &str) -> Result<Credits, StoreError> {
        Ok(Credits::checked_sum(
            self.lines.iter().filter(|l| l.job_id.as_deref() == Some(job_id)).map(|l| Credits::new(l.amount)),
        )?)
    }
}

pub(crate) struct PendingLine {
    pub account_id: String,
    /// Its place in the account's chain, from the balance UPDATE that posted it.
    pub account_seq: i64,
    pub kind: EntryKind,
    pub amount: i64,
    pub balance_after: i64,
    pub job_id: Option<String>,
    pub item_id: Option<String>,
    pub ref_id: Option<String>,
    pub reason: Option<String>,
    pub request_hash: Option<Vec<u8>>,
    pub created_at: i64,
}

/// An event waiting for its number (PostgreSQL).
pub(crate) struct PendingEvent {
    pub kind: EventKind,
    pub job_id: Option<String>,
    pub account_id: String,
    pub data: String,
    pub created_at: i64,
    /// The `account_seq` of the queued ledger line whose `seq` the flush writes into the data's
    /// `ledger_seq` (an alert's crossing of a line not yet numbered).
    pub ledger_line: Option<i64>,
}

/// The queued lines' INSERT, from the 14 arrays `ledger::flush_lines` returns, bound from `$1`: the text of a
/// `SELECT` list over `unnest`, for `outbox::flush_with_lines` to put in its last statement.
pub(crate) const INSERT_LINES: &str = "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, \
     balance_after, job_id, item_id, ref_id, reason, request_hash, created_at, prev_hash, hash) \
     SELECT u.* FROM unnest($1::bigint[], $2::bigint[], $3::text[], $4::text[], $5::bigint[], $6::bigint[], \
     $7::text[], $8::text[], $9::text[], $10::text[], $11::bytea[], $12::bigint[], $13::bytea[], $14::bytea[]) AS u \
     CROSS JOIN cfg";

fn lock_counters(counters: &Mutex<Counters>) -> std::sync::MutexGuard<'_, Counters> {
    counters.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn lock_pending(pending: &Mutex<Pending>) -> std::sync::MutexGuard<'_, Pending> {
    pending.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

impl Cx {
    /// The job `job` as this operation's batch locked and read it ahead (`None`: it did not; the
    /// operation locks and reads it itself). Taken once.
    pub fn take_ahead(&self, job: &str) -> Option<ReadAhead> {
        let mut ahead = self.ahead.lock().unwrap_or_else(|p| p.into_inner());
        if ahead.as_ref().is_some_and(|a| a.row.id == job) { ahead.take() } else { None }
    }

    /// Whether the simulator's test removed `guard` (always `false` without `broken-guards`).
    pub fn broken(&self, guard: crate::broken::Guard) -> bool {
        crate::broken::is_broken(self.broken, guard)
    }

    /// A fresh unguessable token (a UUIDv4), or the next of the seeded stream (the simulator's).
    pub fn token(&self) -> uuid::Uuid {
        match &self.tokens {
            None => uuid::Uuid::new_v4(),
            Some(rng) => {
                let mut rng = rng.lock().unwrap_or_else(|p| p.into_inner());
                let (hi, lo) = (rng.next_u64(), rng.next_u64());
                uuid::Builder::from_random_bytes(((u128::from(hi) << 64) | u128::from(lo)).to_be_bytes()).into_uuid()
            }
        }
    }

    pub fn point(&self, point: CrashPoint) -> Result<(), StoreError> {
        match &self.crash {
            Some(hook) if hook.should_crash(point) => Err(StoreError::InjectedCrash(point.name())),
            _ => Ok(()),
        }
    }
}

/// Reserves `n` numbers of a gap-free counter (SQLite: from the writer batch's `Counters`); returns
/// the first.
pub(crate) fn next_seq(cx: &Cx, counter: &'static str, n: i64) -> Result<i64, StoreError> {
    debug_assert!(n >= 1);
    let counters = (cx.counters.as_ref())
        .ok_or_else(|| StoreError::internal(format!("the {counter} counter taken outside the SQLite writer")))?;
    lock_counters(counters).take(counter, n)
}

pub(crate) fn guard_hit(rows: u64, what: &'static str) -> Result<(), StoreError> {
    // The job row is locked (or the writer is single), so a decided guard cannot miss.
    if rows != 1 {
        return Err(StoreError::internal(format!("guard for {what} matched {rows} rows on a locked job")));
    }
    Ok(())
}
