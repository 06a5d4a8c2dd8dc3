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

/// PostgreSQL, the last statement before COMMIT: the transaction's queued events into
/// `outbox_pending` under one stamp (an uncorrelated scalar subquery: one `nextval` per statement),
/// `pos` their order in the transaction. The stamp is taken after every lock the transaction waited
/// for, so a transaction that waited for another's row, or read its write, has the larger stamp.
async fn flush_events(db: &mut Db<'_>, events: &[PendingEvent]) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    db.exec(
        "INSERT INTO outbox_pending (stamp, pos, type, job_id, account_id, data, created_at) \
         SELECT (SELECT nextval('outbox_stamps')), u.pos, u.type, u.job_id, u.account_id, u.data, u.created_at \
         FROM unnest($1::text[], $2::text[], $3::text[], $4::text[], $5::bigint[]) \
         WITH ORDINALITY AS u(type, job_id, account_id, data, created_at, pos)",
        &[
            Value::OptTexts(events.iter().map(|e| Some(e.kind.as_str().to_owned())).collect()),
            Value::OptTexts(events.iter().map(|e| e.job_id.clone()).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.account_id.clone())).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.data.clone())).collect()),
            Value::I64s(events.iter().map(|e| e.created_at).collect()),
        ],
    )
    .await?;
    Ok(())
}

/// PostgreSQL, the last statements before COMMIT: the transaction's queued ledger lines, then its
/// events (whose stamp must be taken last). Returns whether it wrote events, so the engine asks the
/// sequencer to number them once the COMMIT is done.
pub(crate) async fn flush(db: &mut Db<'_>, pending: &Pending) -> Result<bool, StoreError> {
    super::ledger::flush_lines(db, &pending.lines).await?;
    flush_events(db, &pending.events).await?;
    Ok(!pending.events.is_empty())
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
        wakes = "(SELECT COUNT(*) FROM ins WHERE type IN ('job.queued', 'job.retry_scheduled', 'job.requeued'))",
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
                 SELECT seq, type, job_id, account_id, data, created_at FROM numbered RETURNING seq, type) \
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
/// The counter row is locked by a statement of its own, before the numbering statement: a second
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
    if numbered.events > 0 {
        let new_last = r.i64(NumberedCol::last)?;
        if new_last != last + numbered.events {
            return Err(StoreError::internal(format!(
                "a pass numbered {} events after {last} but ended at {new_last}",
                numbered.events
            )));
        }
        db.exec("UPDATE counters SET value = $1 WHERE name = 'outbox'", args![new_last]).await?;
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
