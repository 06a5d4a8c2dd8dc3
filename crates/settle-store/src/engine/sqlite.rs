//! The SQLite writer: one OS thread owning the one connection that writes, committing batches of
//! operations (one transaction; a savepoint each only after a batch fell back, decision 0026).
//! Readers are a separate sqlx pool (WAL).

use super::{Batch, BatchOp, CAREFUL_BATCHES, Env, Ran, answered_now};
use crate::db::Db;
use crate::error::StoreError;
use crate::ops::Counters;
use crate::options::{Durability, StoreOptions};
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::mpsc;

/// The SQLite writer: one OS thread owning the one connection that writes (rusqlite), so every
/// statement of a transition runs in place — prepared once, no hop to another thread and back.
/// Operations arrive over `rx`; the thread runs their futures on a runtime of its own (they never
/// wait for anything but the connection, which answers at once).
pub(crate) fn spawn_writer(
    mut conn: rusqlite::Connection,
    mut rx: mpsc::Receiver<Box<dyn BatchOp>>,
    env: Env,
    batch_max: usize,
    checkpointer: rusqlite::Connection,
) -> Result<Vec<std::thread::JoinHandle<()>>, StoreError> {
    // The writer keeps `stop` while it runs; the checkpointer ends when it is dropped.
    let (stop, stopped) = std::sync::mpsc::channel::<()>();
    let disk_full = Arc::new(AtomicBool::new(false));
    let full = disk_full.clone();
    let checkpoints = std::thread::Builder::new()
        .name("settle-sqlite-checkpoint".into())
        .spawn(move || checkpoint_loop(checkpointer, stopped, &full))
        .map_err(|e| StoreError::internal(format!("cannot start the SQLite checkpointer: {e}")))?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| StoreError::internal(format!("the SQLite writer's runtime: {e}")))?;
    let writes = std::thread::Builder::new()
        .name("settle-sqlite-writer".into())
        .spawn(move || {
            runtime.block_on(async move {
                let mut batch: Vec<Box<dyn BatchOp>> = Vec::with_capacity(batch_max);
                // Batches left to run in careful mode after one fell back.
                let mut careful_left: u32 = 0;
                while let Some(first) = rx.recv().await {
                    batch.push(first);
                    while batch.len() < batch_max {
                        match rx.try_recv() {
                            Ok(op) => batch.push(op),
                            Err(_) => break,
                        }
                    }
                    if disk_full.load(Ordering::Acquire) {
                        for op in batch.drain(..) {
                            op.deliver(Err(StoreError::Unavailable(DISK_FULL.into())));
                        }
                        continue;
                    }
                    let careful = careful_left > 0;
                    careful_left = careful_left.saturating_sub(1);
                    if run_batch(&mut conn, &env, &mut batch, careful, &disk_full).await == Batch::FellBack {
                        careful_left = CAREFUL_BATCHES;
                        if !batch.is_empty() {
                            run_batch(&mut conn, &env, &mut batch, true, &disk_full).await;
                        }
                    }
                }
                let _ = conn.close();
                drop(stop);
            });
        })
        .map_err(|e| StoreError::internal(format!("cannot start the SQLite writer: {e}")))?;
    Ok(vec![writes, checkpoints])
}

/// How often the checkpointer copies the WAL back into the database file.
const CHECKPOINT_EVERY: std::time::Duration = std::time::Duration::from_millis(200);
/// The writer's own automatic checkpoint (pages of WAL): the checkpointer thread copies the WAL back
/// without the writer, and under a steady load this one, rarely, is what lets the WAL start over.
const WRITER_AUTOCHECKPOINT_PAGES: u32 = 50_000;

/// What a write is answered while the checkpointer finds the disk full.
const DISK_FULL: &str = "the database's disk is full; nothing was written";
/// How long the checkpointer's TRUNCATE (only on a full disk) waits for the readers' snapshots; a
/// checkpoint that gives up is tried again the next round, and the writer's stop is not held up.
const CHECKPOINT_WAIT: std::time::Duration = std::time::Duration::from_millis(200);

/// Checkpoints on a connection and thread of its own, so the single writer spends its time on
/// transitions, not on copying the WAL back.
///
/// Each round is PASSIVE: it copies back what the WAL holds without blocking anyone. SQLite starts
/// the WAL over only when a write begins with every frame copied back, which under a steady stream
/// of commits happens when the writer's own backstop checkpoint runs (`WRITER_AUTOCHECKPOINT_PAGES`):
/// under a full load the WAL's file grows to about 200 MB and stays there (measured: 206 MB beside an
/// 11 MB database after 20 s of 8 clients creating jobs). A RESTART checkpoint past a smaller bound
/// was tried and cost 16–20 % of the throughput and p99 ×5 (the writer waits behind it).
///
/// A full disk: the checkpoint needs room to grow the database file, and while the writer goes on
/// committing, every byte freed goes to the WAL first, so the checkpoint never gets its room (seen:
/// the store still full seconds after 5.8 MB were freed beside a 10 MB WAL). So a write or a
/// checkpoint refused for a full disk sets `disk_full`; the writer answers every write
/// `unavailable` without running it while it is set; each round then TRUNCATEs (copies the WAL back
/// and empties its file) and the first that succeeds clears it: the first room the disk gets goes
/// to the checkpoint, which gives the WAL's room back.
fn checkpoint_loop(conn: rusqlite::Connection, stopped: std::sync::mpsc::Receiver<()>, disk_full: &AtomicBool) {
    use std::sync::mpsc::RecvTimeoutError;
    while let Err(RecvTimeoutError::Timeout) = stopped.recv_timeout(CHECKPOINT_EVERY) {
        let mode = if disk_full.load(Ordering::Acquire) { "TRUNCATE" } else { "PASSIVE" };
        match checkpoint(&conn, mode) {
            Ok(()) => {
                if disk_full.swap(false, Ordering::AcqRel) {
                    tracing::warn!("SQLite checkpoint: the disk has room again; writes resume");
                }
            }
            Err(e) if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) => note_full(&e, disk_full),
            Err(e) => tracing::warn!(error = %e, "SQLite checkpoint failed; trying again"),
        }
    }
    // The last checkpoint, after the writer's last commit.
    let _ = checkpoint(&conn, "PASSIVE");
}

/// One checkpoint of `mode`.
fn checkpoint(conn: &rusqlite::Connection, mode: &str) -> Result<(), rusqlite::Error> {
    conn.query_row(&format!("PRAGMA wal_checkpoint({mode})"), [], |_| Ok(()))
}

/// A read-write connection to the store's file with the store's busy timeout and durability.
fn open_rw(path: &std::path::Path, options: &StoreOptions, pragmas: &str) -> Result<rusqlite::Connection, StoreError> {
    use rusqlite::OpenFlags;
    let conn = rusqlite::Connection::open_with_flags(
        path,
        OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX,
    )
    .map_err(StoreError::from_sqlite)?;
    conn.busy_timeout(options.busy_timeout).map_err(StoreError::from_sqlite)?;
    let sync = match options.durability {
        Durability::Full => "FULL",
        Durability::Normal => "NORMAL",
    };
    conn.execute_batch(&format!("PRAGMA synchronous = {sync}; {pragmas}")).map_err(StoreError::from_sqlite)?;
    Ok(conn)
}

/// Opens the checkpointer's connection to the store's file.
pub(crate) fn open_checkpointer(
    path: &std::path::Path,
    options: &StoreOptions,
) -> Result<rusqlite::Connection, StoreError> {
    let conn = open_rw(path, options, "")?;
    conn.busy_timeout(CHECKPOINT_WAIT).map_err(StoreError::from_sqlite)?;
    Ok(conn)
}

/// Opens the writer's connection: the file the migrations just prepared (WAL is persistent), with
/// the store's durability, foreign keys on and a cache for every statement of the write path.
/// temp_store = MEMORY keeps each savepoint's journal (the pages to restore if the operation is
/// rolled back to it) in memory instead of a temporary file per batch.
pub(crate) fn open_writer(path: &std::path::Path, options: &StoreOptions) -> Result<rusqlite::Connection, StoreError> {
    let conn = open_rw(
        path,
        options,
        &format!(
            "PRAGMA foreign_keys = ON; PRAGMA temp_store = MEMORY; \
             PRAGMA wal_autocheckpoint = {WRITER_AUTOCHECKPOINT_PAGES};"
        ),
    )?;
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).map_err(StoreError::from_sqlite)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::internal(format!("the SQLite writer found journal_mode {mode}, not wal")));
    }
    conn.set_prepared_statement_cache_capacity(256);
    // The query planner stability guarantee: a statement's plan never depends on the values bound
    // to it. Without it SQLite marks a statement whose plan read a bound value (a `LIMIT $5`, a
    // parameter compared with a constant) to be prepared again after every new binding: the
    // burn-down's head read was parsed and planned afresh on every debit (docs/performance.md).
    // What it costs: a bound value no longer proves a partial index's condition, so every query
    // that needs one writes the condition out (ops/allocations.rs, `plan_tests`, checks that they do).
    let qpsg = conn
        .set_db_config(rusqlite::config::DbConfig::SQLITE_DBCONFIG_ENABLE_QPSG, true)
        .map_err(StoreError::from_sqlite)?;
    debug_assert!(qpsg, "SQLite did not take the query planner stability guarantee");
    Ok(conn)
}

/// One transaction for the whole batch, the counters read once after BEGIN and written back once
/// before COMMIT. Replies go out only after COMMIT returns; if the transaction is lost midway (the
/// engine rolled it back on its own), every operation of the batch is answered with an error —
/// none was acknowledged.
///
/// Optimistic (not `careful`): no savepoint. An operation that fails having changed nothing (the
/// engine's own `total_changes`, and no statement error) needs nothing undone but its counters; one
/// that fails after it changed a row rolls the whole transaction back, and the batch ends `FellBack`
/// with the operations to run again in careful mode — a savepoint each — left in `batch` (the one
/// that failed is answered at once when `answered_now`; docs/design/batches-without-savepoints.md).
async fn run_batch(
    conn: &mut rusqlite::Connection,
    env: &Env,
    batch: &mut Vec<Box<dyn BatchOp>>,
    careful: bool,
    disk_full: &AtomicBool,
) -> Batch {
    let read = conn.execute_batch("BEGIN IMMEDIATE").and_then(|()| read_counters(conn)).map_err(|e| {
        note_full(&e, disk_full);
        StoreError::from_sqlite(e)
    });
    let counters = match read.map(|(values, stamp)| Counters::new(values, stamp)) {
        Ok(counters) => Arc::new(Mutex::new(counters)),
        Err(e) => {
            if !conn.is_autocommit() {
                let _ = conn.execute_batch("ROLLBACK");
            }
            for op in batch.drain(..) {
                op.deliver(Err(StoreError::Unavailable(e.to_string())));
            }
            return Batch::Ended;
        }
    };
    let mut broken: Option<String> = None;
    let mut at = 0;
    let mut earlier_done = false;
    while at < batch.len() {
        if careful && let Err(e) = run(conn, "SAVEPOINT op") {
            note_full(&e, disk_full);
            broken = Some(e.to_string());
            break;
        }
        let mark = lock(&counters).mark();
        let mut cx = env.cx(None);
        cx.counters = Some(counters.clone());
        let changes = conn.total_changes();
        let (result, touched) = {
            let mut db = Db::lite(&mut *conn);
            let result = AssertUnwindSafe(batch[at].run(&mut db, &cx)).catch_unwind().await;
            (result, db.touched())
        };
        let moved = conn.total_changes() != changes;
        // The engine's own count checks the statements' (the rules PostgreSQL relies on alone).
        debug_assert!(!moved || touched || result.is_err(), "an operation that changed rows was counted untouched");
        // A panic may have cut a statement short: counted, whatever it did.
        let touched = touched || moved || result.is_err();
        // One writer: nothing to wait for, so `Again` is a failure like any other here.
        let failed = match result {
            Ok(Ran::Done) => false,
            Ok(Ran::Failed | Ran::Again) => true,
            Err(_) => {
                // A programmer error in one operation: undo it alone; the others in the batch go on.
                tracing::error!("a write operation panicked; it is rolled back");
                true
            }
        };
        if failed {
            lock(&counters).restore(&mark);
        }
        earlier_done |= !failed;
        let step = match (careful, failed) {
            (true, false) => run(conn, "RELEASE op"),
            (true, true) => run(conn, "ROLLBACK TO op").and_then(|()| run(conn, "RELEASE op")),
            (false, false) => Ok(()),
            (false, true) if !touched => Ok(()),
            (false, true) => {
                let _ = conn.execute_batch("ROLLBACK");
                if answered_now(result.as_ref().ok().copied(), earlier_done, &*batch[at]) {
                    batch.remove(at).deliver(Err(StoreError::internal("the operation panicked; it was rolled back")));
                }
                return Batch::FellBack;
            }
        };
        if let Err(e) = step {
            note_full(&e, disk_full);
            broken = Some(e.to_string());
            break;
        }
        // The engine rolled the transaction back on its own (a full disk, an I/O error): nothing
        // more may run, or each statement would commit alone.
        if conn.is_autocommit() {
            broken = Some("SQLite ended the write transaction on its own".into());
            break;
        }
        at += 1;
    }
    finish(conn, &lock(&counters), batch, broken, disk_full);
    Batch::Ended
}

/// Writes the moved counters back and commits — or rolls back, when the batch broke — then answers
/// every operation of the batch: each its own result after a COMMIT, else the rollback's error.
fn finish(
    conn: &mut rusqlite::Connection,
    counters: &Counters,
    batch: &mut Vec<Box<dyn BatchOp>>,
    mut broken: Option<String>,
    disk_full: &AtomicBool,
) {
    if broken.is_none()
        && let Err(e) = write_counters(conn, counters)
    {
        note_full(&e, disk_full);
        broken = Some(e.to_string());
    }
    let committed = match broken {
        Some(msg) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(msg)
        }
        None => match conn.execute_batch("COMMIT") {
            Ok(()) => Ok(()),
            Err(e) => {
                note_full(&e, disk_full);
                let msg = StoreError::from_sqlite(e).to_string();
                if !conn.is_autocommit() {
                    let _ = conn.execute_batch("ROLLBACK");
                }
                Err(msg)
            }
        },
    };
    for op in batch.drain(..) {
        match &committed {
            Ok(()) => op.deliver(Ok(())),
            Err(msg) => op.deliver(Err(StoreError::Unavailable(format!("the write batch was rolled back: {msg}")))),
        }
    }
}

/// A write refused for a full disk closes the gate: writes wait for the checkpointer to make room
/// (`checkpoint_loop`).
fn note_full(e: &rusqlite::Error, disk_full: &AtomicBool) {
    if e.sqlite_error_code() == Some(rusqlite::ErrorCode::DiskFull) && !disk_full.swap(true, Ordering::AcqRel) {
        tracing::error!(error = %e, "SQLite: the disk is full; writes are refused until a checkpoint makes room");
    }
}

fn lock(counters: &Mutex<Counters>) -> std::sync::MutexGuard<'_, Counters> {
    counters.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// Every counter, as the batch's write lock found them, and the largest stamp the store holds:
/// in `events`, and in `stamp_numbers` and `stamps_pending` too, so a stamp whose events are gone (a
/// damaged store the audit names) is never taken again — each the last key of its primary key, one
/// seek (docs/design/batch-plan.md §16).
fn read_counters(conn: &rusqlite::Connection) -> Result<(Vec<(String, i64)>, i64), rusqlite::Error> {
    let mut stmt = conn.prepare_cached("SELECT name, value FROM counters")?;
    let rows = stmt.query_map([], |r| Ok((r.get(0)?, r.get(1)?)))?;
    let values = rows.collect::<Result<_, _>>()?;
    let stamp = conn
        .prepare_cached(
            "SELECT MAX((SELECT COALESCE(MAX(stamp), 0) FROM events), (SELECT COALESCE(MAX(stamp), 0) FROM stamp_numbers), \
             (SELECT COALESCE(MAX(stamp), 0) FROM stamps_pending))",
        )?
        .query_row([], |r| r.get(0))?;
    Ok((values, stamp))
}

/// The counters the batch moved, written back in its transaction, and the numbers of its events'
/// stamp (docs/design/batch-plan.md §4a, §16).
fn write_counters(conn: &rusqlite::Connection, counters: &Counters) -> Result<(), rusqlite::Error> {
    if let Some((stamp, first, last)) = counters.events_stamp() {
        conn.prepare_cached("INSERT INTO stamp_numbers (stamp, first_seq, last_seq) VALUES (?1, ?2, ?3)")?
            .execute(rusqlite::params![stamp, first, last])?;
    }
    for (name, value) in counters.changed() {
        let n = conn
            .prepare_cached("UPDATE counters SET value = ?1 WHERE name = ?2")?
            .execute(rusqlite::params![value, name])?;
        if n != 1 {
            return Err(rusqlite::Error::StatementChangedRows(n));
        }
    }
    Ok(())
}

/// A transaction-control statement, prepared once.
fn run(conn: &rusqlite::Connection, sql: &str) -> Result<(), rusqlite::Error> {
    conn.prepare_cached(sql)?.execute([]).map(|_| ())
}
