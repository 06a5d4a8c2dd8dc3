//! The SQLite writer: one OS thread owning the one connection that writes, committing batches of
//! operations (one transaction, a savepoint each). Readers are a separate sqlx pool (WAL).

use super::{BatchOp, Env, Ran};
use crate::db::Db;
use crate::error::StoreError;
use crate::sql_store::{Durability, StoreOptions};
use futures_util::FutureExt;
use std::panic::AssertUnwindSafe;
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
) -> Result<(), StoreError> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .build()
        .map_err(|e| StoreError::internal(format!("the SQLite writer's runtime: {e}")))?;
    std::thread::Builder::new()
        .name("settle-sqlite-writer".into())
        .spawn(move || {
            runtime.block_on(async move {
                let mut batch: Vec<Box<dyn BatchOp>> = Vec::with_capacity(batch_max);
                while let Some(first) = rx.recv().await {
                    batch.push(first);
                    while batch.len() < batch_max {
                        match rx.try_recv() {
                            Ok(op) => batch.push(op),
                            Err(_) => break,
                        }
                    }
                    run_batch(&mut conn, &env, &mut batch).await;
                }
                let _ = conn.close();
            });
        })
        .map_err(|e| StoreError::internal(format!("cannot start the SQLite writer: {e}")))?;
    Ok(())
}

/// Opens the writer's connection: the file the migrations just prepared (WAL is persistent), with
/// the store's durability, foreign keys on and a cache for every statement of the write path.
pub(crate) fn open_writer(path: &std::path::Path, options: &StoreOptions) -> Result<rusqlite::Connection, StoreError> {
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
    conn.execute_batch(&format!("PRAGMA foreign_keys = ON; PRAGMA synchronous = {sync};"))
        .map_err(StoreError::from_sqlite)?;
    let mode: String = conn.query_row("PRAGMA journal_mode", [], |r| r.get(0)).map_err(StoreError::from_sqlite)?;
    if !mode.eq_ignore_ascii_case("wal") {
        return Err(StoreError::internal(format!("the SQLite writer found journal_mode {mode}, not wal")));
    }
    conn.set_prepared_statement_cache_capacity(256);
    Ok(conn)
}

/// One transaction for the whole batch, one savepoint per operation. Replies go out only after
/// COMMIT returns; if the transaction is lost midway (the engine rolled it back on its own, a
/// panic), every operation of the batch is answered with an error — none was acknowledged.
async fn run_batch(conn: &mut rusqlite::Connection, env: &Env, batch: &mut Vec<Box<dyn BatchOp>>) {
    if let Err(e) = conn.execute_batch("BEGIN IMMEDIATE") {
        let e = StoreError::from_sqlite(e);
        for op in batch.drain(..) {
            op.deliver(Err(StoreError::Unavailable(e.to_string())));
        }
        return;
    }
    let mut broken: Option<String> = None;
    for op in batch.iter_mut() {
        if let Err(e) = conn.execute_batch("SAVEPOINT op") {
            broken = Some(e.to_string());
            break;
        }
        let cx = env.cx(None);
        let result = {
            let mut db = Db::Lite(&mut *conn);
            AssertUnwindSafe(op.run(&mut db, &cx)).catch_unwind().await
        };
        let step = match result {
            Ok(Ran::Done) => conn.execute_batch("RELEASE op"),
            // One writer: nothing to wait for, so no operation is run again elsewhere.
            Ok(Ran::Failed | Ran::Again) => conn.execute_batch("ROLLBACK TO op; RELEASE op"),
            Err(_) => {
                // A programmer error in one operation: undo it alone; the others in the batch go on.
                tracing::error!("a write operation panicked; it is rolled back");
                conn.execute_batch("ROLLBACK TO op; RELEASE op")
            }
        };
        if let Err(e) = step {
            broken = Some(e.to_string());
            break;
        }
    }
    let committed = match broken {
        Some(msg) => {
            let _ = conn.execute_batch("ROLLBACK");
            Err(msg)
        }
        None => match conn.execute_batch("COMMIT") {
            Ok(()) => Ok(()),
            Err(e) => {
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
