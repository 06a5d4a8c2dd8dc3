//! The outbox: every transition's events, written in its own transaction (spec §5), numbered
//! gap-free in commit order.
//!
//! On SQLite each is numbered at once from the `outbox` counter: the single writer's order is the
//! commit order. On PostgreSQL a transaction's events are queued, and its last statement writes them
//! to `outbox_pending` under one stamp from a sequence — no counter, no NOTIFY on the commit path. A
//! sequencer pass (`number_events`, run by `engine::sequencer` after the commit) then moves whole
//! stamps into `outbox`, numbered in stamp order under the `outbox` counter, which only passes take
//! (docs/decisions/0021).

use super::{Cx, Pending, PendingEvent, lock_pending, next_seq};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use settle_core::history::EventKind;
use std::sync::LazyLock;
use std::time::Duration;

/// Appends one outbox event: numbered at once on SQLite; on PostgreSQL queued for `flush`.
pub(crate) async fn emit(
    db: &mut Db<'_>,
    cx: &Cx,
    kind: EventKind,
    job_id: Option<&str>,
    account_id: &str,
    data: serde_json::Value,
) -> Result<(), StoreError> {
    if let Some(pending) = &cx.pending {
        lock_pending(pending).events.push(PendingEvent {
            kind,
            job_id: job_id.map(str::to_owned),
            account_id: account_id.to_owned(),
            data: data.to_string(),
            created_at: cx.now.micros(),
        });
        return Ok(());
    }
    if db.engine() == Engine::Postgres {
        // Every PostgreSQL write runs with a queue (engine::postgres): an event numbered here
        // would take the counter on the commit path.
        return Err(StoreError::internal("a PostgreSQL event written outside a transaction's queue"));
    }
    let seq = next_seq(cx, "outbox", 1)?;
    db.exec(
        "INSERT INTO outbox (seq, type, job_id, account_id, data, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
        args![seq, kind.as_str(), job_id, account_id, data.to_string(), cx.now.micros()],
    )
    .await?;
    Ok(())
}

/// The events' INSERT into `outbox_pending`, its 5 arrays bound from `$first`: one stamp for the
/// transaction (an uncorrelated scalar subquery: one `nextval` per statement), `pos` their order in
/// it. The stamp is taken in the transaction's last statement, after every lock it waited for, so a
/// transaction that waited for another's row, or read its write, has the larger stamp.
///
/// `stamp` is the stamp's scalar subquery: with lines in the same statement it reads their INSERT's
/// count first (`STAMP_AFTER_LINES`), so the lines, and any wait they meet, come before the stamp.
fn insert_events(first: usize, stamp: &str) -> String {
    let p = |k: usize| format!("${}", first + k);
    format!(
        "INSERT INTO outbox_pending (stamp, pos, type, job_id, account_id, data, created_at) \
         SELECT {stamp}, u.pos, u.type, u.job_id, u.account_id, u.data, u.created_at \
         FROM unnest({}::text[], {}::text[], {}::text[], {}::text[], {}::bigint[]) \
         WITH ORDINALITY AS u(type, job_id, account_id, data, created_at, pos) CROSS JOIN cfg",
        p(0),
        p(1),
        p(2),
        p(3),
        p(4)
    )
}

/// What must hold for COMMIT, set by the last statement before it (docs/decisions/0024), its lock
/// timeout bound as `$param`: `statement_timeout` off, since the COMMIT may wait for a synchronous
/// standby and a wait cancelled by it is not a rollback; the store's own lock timeout back for what
/// follows (a batch ran under a short one; the statement's own table locks were taken under it, and
/// `outbox_pending` is never truncated by autovacuum, migration 0018); and a transaction id, so a
/// transaction that wrote nothing else still commits with a record and waits for the standby past
/// everything before it. `set_config(…, true)` is `SET LOCAL`; a materialized CTE runs once, and
/// every statement below reads it.
fn commit_settings(param: usize) -> String {
    format!(
        "cfg AS MATERIALIZED (SELECT set_config('statement_timeout', '0', true) AS st, \
         set_config('lock_timeout', ${param}, true) AS lt, pg_current_xact_id() AS xid)"
    )
}

/// The stamp's subquery alone, and after the lines' INSERT in the same statement.
const STAMP: &str = "(SELECT nextval('outbox_stamps'))";
const STAMP_AFTER_LINES: &str = "(SELECT nextval('outbox_stamps') FROM (SELECT count(*) FROM lines) AS written)";
/// The last statement of a transaction that queued lines and events, of one that queued lines
/// only, of one that queued events only, and of one that queued nothing.
static LINES_AND_EVENTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH {}, lines AS ({} RETURNING 1) {}",
        commit_settings(20),
        super::ledger::INSERT_LINES,
        insert_events(15, STAMP_AFTER_LINES)
    )
});
static LINES_ONLY: LazyLock<String> =
    LazyLock::new(|| format!("WITH {} {}", commit_settings(15), super::ledger::INSERT_LINES));
static EVENTS_ONLY: LazyLock<String> =
    LazyLock::new(|| format!("WITH {} {}", commit_settings(6), insert_events(1, STAMP)));
static NOTHING: LazyLock<String> = LazyLock::new(|| format!("WITH {} SELECT 1 FROM cfg", commit_settings(1)));

/// PostgreSQL, the statements before COMMIT: the chain heads and ledger numbers of the queued lines,
/// then one statement that writes the lines and the events and sets what COMMIT needs
/// (`commit_settings`, `lock_timeout` the store's). Returns whether it wrote events, so the engine
/// asks the sequencer to number them once the COMMIT is done.
pub(crate) async fn flush(db: &mut Db<'_>, pending: &Pending, lock_timeout: Duration) -> Result<bool, StoreError> {
    let events = &pending.events;
    let mut binds =
        if pending.lines.is_empty() { Vec::new() } else { super::ledger::flush_lines(db, &pending.lines).await? };
    let sql: &'static str = match (binds.is_empty(), events.is_empty()) {
        (false, false) => &LINES_AND_EVENTS,
        (false, true) => &LINES_ONLY,
        (true, false) => &EVENTS_ONLY,
        (true, true) => &NOTHING,
    };
    if !events.is_empty() {
        binds.extend([
            Value::OptTexts(events.iter().map(|e| Some(e.kind.as_str().to_owned())).collect()),
            Value::OptTexts(events.iter().map(|e| e.job_id.clone()).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.account_id.clone())).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.data.clone())).collect()),
            Value::I64s(events.iter().map(|e| e.created_at).collect()),
        ]);
    }
    binds.push(Value::Text(format!("{}ms", lock_timeout.as_millis().max(1))));
    db.exec(sql, &binds).await?;
    Ok(!events.is_empty())
}

columns! {
    /// The `outbox` counter: the last number given.
    CounterCol { value }
}

columns! {
    /// What one sequencer pass did.
    NumberedCol {
        stamps = "(SELECT COUNT(DISTINCT stamp) FROM numbered)",
        last_stamp = "(SELECT MAX(stamp) FROM numbered)",
        events = "(SELECT COUNT(*) FROM ins)",
        last = "(SELECT MAX(seq) FROM ins)",
        wakes = "(SELECT COUNT(*) FROM ins WHERE type IN ('job.queued', 'job.retry_scheduled', 'job.requeued', 'job.released'))",
        counter = "(SELECT value FROM bump)",
    }
}

static NUMBER: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH todo AS (SELECT stamp FROM outbox_pending GROUP BY stamp ORDER BY stamp LIMIT $2), \
         moved AS (DELETE FROM outbox_pending p USING todo WHERE p.stamp = todo.stamp \
                   RETURNING p.stamp, p.pos, p.type, p.job_id, p.account_id, p.data, p.created_at), \
         numbered AS (SELECT $1 + row_number() OVER (ORDER BY stamp, pos) AS seq, stamp, type, job_id, account_id, \
                      data, created_at FROM moved), \
         ins AS (INSERT INTO outbox (seq, type, job_id, account_id, data, created_at) \
                 SELECT seq, type, job_id, account_id, data, created_at FROM numbered RETURNING seq, type), \
         bump AS (UPDATE counters SET value = (SELECT MAX(seq) FROM ins) \
                  WHERE name = 'outbox' AND EXISTS (SELECT 1 FROM ins) RETURNING value) \
         SELECT {}",
        NumberedCol::LIST
    )
});

/// What a sequencer pass numbered.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Numbered {
    /// Whole transactions moved (at most the pass's limit: fewer means none was left).
    pub stamps: i64,
    /// The newest of them (stamps move in order).
    pub last_stamp: Option<i64>,
    pub events: i64,
    /// Whether one of them makes work due (claims in other processes are woken).
    pub wakes_claims: bool,
}

/// PostgreSQL, one sequencer pass in a transaction of its own: numbers the events of up to
/// `stamps_max` committed transactions, in stamp order, after the last number given.
///
/// The counter row is locked by a statement of its own, before the numbering statement (which also
/// moves it to the last number given): a second
/// pass waits there, and its numbering statement's snapshot then includes the first pass's moves
/// (READ COMMITTED takes a snapshot per statement), so no event is numbered twice or skipped. Only a
/// committed transaction's rows are visible, and all of a transaction's rows at once: a pass moves
/// whole transactions, never a part of one.
pub(crate) async fn number_events(db: &mut Db<'_>, stamps_max: i64) -> Result<Numbered, StoreError> {
    debug_assert_eq!(db.engine(), Engine::Postgres);
    let last =
        db.one("SELECT value FROM counters WHERE name = 'outbox' FOR UPDATE", args![]).await?.i64(CounterCol::value)?;
    let r = db.one(&NUMBER, args![last, stamps_max]).await?;
    let numbered = Numbered {
        stamps: r.i64(NumberedCol::stamps)?,
        last_stamp: r.opt_i64(NumberedCol::last_stamp)?,
        events: r.i64(NumberedCol::events)?,
        wakes_claims: r.i64(NumberedCol::wakes)? > 0,
    };
    // The counter moved to the last number in the same statement (`bump`); checked here, so a pass
    // that numbered anything but `last + 1 ..= last + events` never commits.
    if numbered.events > 0 {
        let (new_last, counter) = (r.i64(NumberedCol::last)?, r.opt_i64(NumberedCol::counter)?);
        if new_last != last + numbered.events || counter != Some(new_last) {
            return Err(StoreError::internal(format!(
                "a pass numbered {} events after {last} but ended at {new_last} (counter {counter:?})",
                numbered.events
            )));
        }
    }
    Ok(numbered)
}

#[cfg(test)]
mod tests {
    use settle_core::history::EventKind;

    #[test]
    fn the_pass_wakes_claims_for_the_events_that_make_work_due() {
        let waking: Vec<_> = EventKind::ALL.iter().filter(|k| k.wakes_claims()).map(|k| k.as_str()).collect();
        let sql = &*super::NUMBER;
        for kind in &waking {
            assert!(sql.contains(&format!("'{kind}'")), "{kind} missing from the pass's wake-up list");
        }
        assert_eq!(sql.matches("'job.").count(), waking.len());
    }
}
