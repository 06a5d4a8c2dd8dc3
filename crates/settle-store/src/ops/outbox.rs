//! The outbox: every transition's events, written in its own transaction (spec §5), numbered
//! gap-free in commit order. Each event row is written once, into `events` under its transaction's
//! stamp; numbers are given to stamps (`stamp_numbers`: a stamp holds `first_seq ..= last_seq`, its
//! events at `pos` 1, 2, …), never to events one by one (docs/design/batch-plan.md §4a).
//!
//! On SQLite the single writer's order is the commit order: a writer batch's stamp is one past every
//! stamp the store holds, and the batch numbers its events from the `outbox` counter and writes the
//! stamp's numbers itself (docs/design/batch-plan.md §16). On
//! PostgreSQL a transaction's events are queued, and its last statement writes them under one stamp
//! from a sequence, with one `stamps_pending` row — no counter, no NOTIFY on the commit path. A
//! sequencer pass (`number_events`, run by `engine::sequencer` after the commit) then numbers whole
//! stamps, in stamp order, under the `outbox` counter, which only passes take (docs/decisions/0021).

use super::{Cx, Pending, PendingEvent, lock_counters, lock_pending, next_seq};
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
            ledger_line: None,
        });
        return Ok(());
    }
    if db.engine() == Engine::Postgres {
        // Every PostgreSQL write runs with a queue (engine::postgres): an event numbered here
        // would take the counter on the commit path.
        return Err(StoreError::internal("a PostgreSQL event written outside a transaction's queue"));
    }
    // SQLite: the writer batch's events are one stamp (`Counters::events_stamp`, docs/design/
    // batch-plan.md §4a, §16); the batch writes the stamp's numbers beside its counters.
    let seq = next_seq(cx, "outbox", 1)?;
    let counters =
        cx.counters.as_ref().ok_or_else(|| StoreError::internal("an event written outside the SQLite writer"))?;
    let (stamp, pos) = lock_counters(counters).event_place(seq)?;
    // The job's number from its row, in the statement (migration 0035): the job is written or
    // locked earlier in this transaction, and no caller passes a number that could disagree.
    db.exec(
        "INSERT INTO events (stamp, pos, type, job_id, job_seq, account_id, data, created_at) \
         VALUES ($1, $2, $3, $4, (SELECT job_seq FROM jobs WHERE id = $4), $5, $6, $7)",
        args![stamp, pos, kind.as_str(), job_id, account_id, data.to_string(), cx.now.micros()],
    )
    .await?;
    Ok(())
}

/// An event about one ledger line of `account_id` (an alert's crossing): its data's `ledger_seq`
/// is the line's `seq` — given now when the line is numbered (`seq`), else written in by the flush
/// that numbers the queued line at `account_seq`.
pub(crate) async fn emit_at_line(
    db: &mut Db<'_>,
    cx: &Cx,
    kind: EventKind,
    account_id: &str,
    data: serde_json::Value,
    (seq, account_seq): (Option<i64>, i64),
) -> Result<(), StoreError> {
    match (&cx.pending, seq) {
        (Some(pending), None) => {
            lock_pending(pending).events.push(PendingEvent {
                kind,
                job_id: None,
                account_id: account_id.to_owned(),
                data: data.to_string(),
                created_at: cx.now.micros(),
                ledger_line: Some(account_seq),
            });
            Ok(())
        }
        (None, None) => Err(StoreError::internal("a ledger line without its seq outside a transaction's queue")),
        _ => emit(db, cx, kind, None, account_id, data).await,
    }
}

/// Writes each queued line's `seq` into the data of the events about it (`PendingEvent::ledger_line`).
fn number_lines_in_events(pending: &Pending, seqs: &[i64]) -> Result<Vec<String>, StoreError> {
    pending
        .events
        .iter()
        .map(|e| {
            let Some(account_seq) = e.ledger_line else { return Ok(e.data.clone()) };
            let at = pending
                .lines
                .iter()
                .position(|l| l.account_id == e.account_id && l.account_seq == account_seq)
                .ok_or_else(|| StoreError::internal("an event about a ledger line the transaction did not queue"))?;
            let mut data: serde_json::Value =
                serde_json::from_str(&e.data).map_err(|err| StoreError::internal(format!("event data: {err}")))?;
            data["ledger_seq"] = serde_json::json!(seqs[at]);
            Ok(data.to_string())
        })
        .collect()
}

/// The events' INSERTs, their 5 arrays bound from `$first` and whether one makes work due as
/// `$first + 5`: the events into `events` under the transaction's one stamp, `pos` their order in
/// it, each job event's `job_seq` read from its job's row (a scalar subquery per event, never a
/// join: migration 0035), and the stamp into `stamps_pending` for the sequencer
/// (docs/design/batch-plan.md §4a). `st`,
/// a materialized CTE, takes the stamp once, in the transaction's last statement, after every lock
/// it waited for, so a transaction that waited for another's row, or read its write, has the larger
/// stamp. With lines in the same statement it reads their INSERT's count first (`AFTER_LINES`), so
/// the lines, and any wait they meet, come before the stamp.
fn insert_events(first: usize, after_lines: bool) -> String {
    let p = |k: usize| format!("${}", first + k);
    let from = if after_lines { " FROM (SELECT count(*) FROM lines) AS written" } else { "" };
    format!(
        "st AS MATERIALIZED (SELECT nextval('outbox_stamps') AS stamp{from}), \
         ev AS (INSERT INTO events (stamp, pos, type, job_id, job_seq, account_id, data, created_at) \
                SELECT st.stamp, u.pos, u.type, u.job_id, (SELECT j.job_seq FROM jobs j WHERE j.id = u.job_id), \
                       u.account_id, u.data, u.created_at \
                FROM st CROSS JOIN cfg CROSS JOIN unnest({}::text[], {}::text[], {}::text[], {}::text[], {}::bigint[]) \
                WITH ORDINALITY AS u(type, job_id, account_id, data, created_at, pos) RETURNING 1) \
         INSERT INTO stamps_pending (stamp, events, wakes) SELECT st.stamp, (SELECT count(*) FROM ev), {}::bigint FROM st",
        p(0),
        p(1),
        p(2),
        p(3),
        p(4),
        p(5),
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

/// The last statement of a transaction that queued lines and events, of one that queued lines
/// only, of one that queued events only, and of one that queued nothing.
static LINES_AND_EVENTS: LazyLock<String> = LazyLock::new(|| {
    format!("WITH {}, lines AS ({} RETURNING 1), {}", commit_settings(21), super::INSERT_LINES, insert_events(15, true))
});
static LINES_ONLY: LazyLock<String> = LazyLock::new(|| format!("WITH {} {}", commit_settings(15), super::INSERT_LINES));
static EVENTS_ONLY: LazyLock<String> =
    LazyLock::new(|| format!("WITH {}, {}", commit_settings(7), insert_events(1, false)));
static NOTHING: LazyLock<String> = LazyLock::new(|| format!("WITH {} SELECT 1 FROM cfg", commit_settings(1)));

/// PostgreSQL, the transaction's last statement before COMMIT: the queued lines (`lines`, the
/// columns `ledger::flush_lines` made of them; empty when none) and the events written, and what
/// COMMIT needs set (`commit_settings`, `lock_timeout` the store's). Returns whether it wrote events.
pub(crate) async fn flush_with_lines(
    db: &mut Db<'_>,
    pending: &Pending,
    lines: Vec<Value>,
    lock_timeout: Duration,
) -> Result<bool, StoreError> {
    let events = &pending.events;
    let mut binds = lines;
    let sql: &'static str = match (binds.is_empty(), events.is_empty()) {
        (false, false) => &LINES_AND_EVENTS,
        (false, true) => &LINES_ONLY,
        (true, false) => &EVENTS_ONLY,
        (true, true) => &NOTHING,
    };
    if !events.is_empty() {
        let data = match binds.first() {
            Some(Value::I64s(seqs)) if events.iter().any(|e| e.ledger_line.is_some()) => {
                number_lines_in_events(pending, seqs)?
            }
            _ if events.iter().any(|e| e.ledger_line.is_some()) => {
                return Err(StoreError::internal("an event about a ledger line in a transaction without lines"));
            }
            _ => events.iter().map(|e| e.data.clone()).collect(),
        };
        binds.extend([
            Value::OptTexts(events.iter().map(|e| Some(e.kind.as_str().to_owned())).collect()),
            Value::OptTexts(events.iter().map(|e| e.job_id.clone()).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.account_id.clone())).collect()),
            Value::OptTexts(data.into_iter().map(Some).collect()),
            Value::I64s(events.iter().map(|e| e.created_at).collect()),
            Value::I64(i64::from(events.iter().any(|e| e.kind.wakes_claims()))),
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
        stamps = "(SELECT COUNT(*) FROM nums)",
        last_stamp = "(SELECT MAX(stamp) FROM nums)",
        events = "(SELECT CAST(COALESCE(SUM(last_seq - first_seq + 1), 0) AS bigint) FROM nums)",
        last = "(SELECT MAX(last_seq) FROM nums)",
        wakes = "(SELECT COUNT(*) FROM numbered WHERE wakes = 1)",
        counter = "(SELECT value FROM bump)",
        removed = "(SELECT COUNT(*) FROM gone)",
    }
}

/// A pass: the visible pending stamps in stamp order, at most `$2` of them, numbered after `$1`;
/// their numbers recorded, their pending rows deleted, the counter moved to the last number.
static NUMBER: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH todo AS (SELECT stamp, events, wakes FROM stamps_pending ORDER BY stamp LIMIT $2), \
         numbered AS (SELECT stamp, events, wakes, CAST($1 + SUM(events) OVER (ORDER BY stamp) AS bigint) AS last_seq \
                      FROM todo), \
         gone AS (DELETE FROM stamps_pending p USING numbered n WHERE p.stamp = n.stamp RETURNING p.stamp), \
         nums AS (INSERT INTO stamp_numbers (stamp, first_seq, last_seq) \
                  SELECT stamp, last_seq - events + 1, last_seq FROM numbered RETURNING stamp, first_seq, last_seq), \
         bump AS (UPDATE counters SET value = (SELECT MAX(last_seq) FROM nums) \
                  WHERE name = 'outbox' AND EXISTS (SELECT 1 FROM nums) RETURNING value) \
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
/// `stamps_max` committed transactions (stamps), in stamp order, after the last number given.
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
    // Every numbered stamp left the pending table.
    let removed = r.i64(NumberedCol::removed)?;
    if removed != numbered.stamps {
        return Err(StoreError::internal(format!(
            "a pass numbered {} stamps but removed {removed} pending ones",
            numbered.stamps
        )));
    }
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

columns! {
    /// A numbered stamp's range.
    StampRangeCol { first_seq, last_seq }
}

static STAMPS_AFTER: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM stamp_numbers WHERE last_seq > $1 ORDER BY last_seq LIMIT $2", StampRangeCol::LIST)
});

/// How far a page of about `want` events after `after` (numbered at most `upto`) reads: the
/// `last_seq` of the stamp that brings the count to `want`, or of the last stamp numbered up to
/// `upto`; `None` when nothing after `after` is numbered. A page then reads the events of the stamps
/// with `last_seq` in `(after, through]` (docs/design/batch-plan.md §4a): every event up to
/// `through` is numbered and stays as it is, so the two statements need no common snapshot.
pub(crate) async fn read_through(db: &mut Db<'_>, after: i64, upto: i64, want: i64) -> Result<Option<i64>, StoreError> {
    let mut through = None;
    let mut events = 0;
    for r in db.all(&STAMPS_AFTER, args![after, want.max(1)]).await? {
        let (first, last) = (r.i64(StampRangeCol::first_seq)?, r.i64(StampRangeCol::last_seq)?);
        if first > upto {
            break;
        }
        events += last.min(upto) - first.max(after + 1) + 1;
        through = Some(last.min(upto));
        if events >= want {
            break;
        }
    }
    Ok(through)
}

#[cfg(test)]
mod tests {
    use settle_core::history::EventKind;

    /// A flush decides in Rust whether its events wake claimers (`EventKind::wakes_claims`); the
    /// previous release's writers, during a rolling upgrade, by migration 0024's list (its copy of
    /// the queued events, and its function, which 0035 replaced with the same list), which must
    /// name the same kinds.
    #[test]
    fn the_migration_wakes_claims_for_the_events_that_make_work_due() {
        let waking: Vec<_> = EventKind::ALL.iter().filter(|k| k.wakes_claims()).map(|k| k.as_str()).collect();
        let lists = [
            (include_str!("../../migrations/postgres/0024_events_written_once.sql"), 2),
            (include_str!("../../migrations/postgres/0035_events_by_job_seq.sql"), 1),
        ];
        for (sql, times) in lists {
            for kind in &waking {
                assert_eq!(sql.matches(&format!("'{kind}'")).count(), times, "{kind} in each of the migration's lists");
            }
            assert_eq!(sql.matches("'job.").count(), times * waking.len());
        }
    }
}
