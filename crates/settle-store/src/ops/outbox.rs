//! The outbox: every transition's events, written in its own transaction (spec §4). On SQLite each
//! is numbered at once from the gap-free `outbox` counter; on PostgreSQL queued and numbered at
//! the batch's end, just before COMMIT (docs/decisions/0013).

use super::{Cx, Pending, PendingEvent, lock_pending, next_seq};
use crate::db::{Db, Engine, Value, args};
use crate::error::StoreError;
use settle_core::history::EventKind;

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
    let seq = next_seq(db, "outbox", 1).await?;
    db.exec(
        "INSERT INTO outbox (seq, type, job_id, account_id, data, created_at) VALUES ($1, $2, $3, $4, $5, $6)",
        args![seq, kind.as_str(), job_id, account_id, data.to_string(), cx.now.micros()],
    )
    .await?;
    // A PostgreSQL transaction that makes work due wakes the long-polling claims of every process
    // at its commit (NOTIFY is delivered only if it commits).
    if db.engine() == Engine::Postgres && kind.wakes_claims() {
        db.exec("SELECT pg_notify('settle_wake', '')", &[]).await?;
    }
    Ok(())
}

/// PostgreSQL, just before COMMIT: numbers the transaction's queued events from the `outbox`
/// counter and writes them in one statement; wakes waiting claims if any made work due.
pub(super) async fn flush_events(db: &mut Db<'_>, events: &[PendingEvent]) -> Result<(), StoreError> {
    if events.is_empty() {
        return Ok(());
    }
    let first = next_seq(db, "outbox", events.len() as i64).await?;
    db.exec(
        "INSERT INTO outbox (seq, type, job_id, account_id, data, created_at) \
         SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bigint[])",
        &[
            Value::I64s((0..events.len() as i64).map(|i| first + i).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.kind.as_str().to_owned())).collect()),
            Value::OptTexts(events.iter().map(|e| e.job_id.clone()).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.account_id.clone())).collect()),
            Value::OptTexts(events.iter().map(|e| Some(e.data.clone())).collect()),
            Value::I64s(events.iter().map(|e| e.created_at).collect()),
        ],
    )
    .await?;
    if events.iter().any(|e| e.kind.wakes_claims()) {
        db.exec("SELECT pg_notify('settle_wake', '')", &[]).await?;
    }
    Ok(())
}

/// PostgreSQL, the last statements before COMMIT: numbers the transaction's queued ledger lines
/// and events from the gap-free counters and writes them, one statement each (decision 0013).
/// From the counter UPDATE to the end of COMMIT nothing here waits for another transaction's row.
pub(crate) async fn flush(db: &mut Db<'_>, pending: &Pending) -> Result<(), StoreError> {
    super::ledger::flush_lines(db, &pending.lines).await?;
    flush_events(db, &pending.events).await
}
