//! `settle audit` on each engine: two connections of one snapshot, so the allocations pass runs
//! beside the ledger pass and the checks that need neither, and both take pass B's ranges of jobs
//! in turn (docs/design/audit-checkpoints.md §9).

use crate::audit::{self, Against, Audit, AuditProgress};
use crate::audit_apart::Apart;
use crate::audit_checkpoint::Record;
use crate::db::{Db, args, columns};
use crate::engine::postgres::PgShared;
use crate::engine::primary::Leased;
use crate::error::StoreError;
use crate::model::{AuditReport, AuditRun};
use sqlx::PgConnection;
use std::sync::LazyLock;
use std::time::Duration;

/// The SQLite audit's connections, kept between audits: a new connection parses the whole schema
/// and prepares the audit's statements again, which in the simulator (two audits at every check)
/// was about 7 % of its CPU. Kept outside any transaction, their page caches given back.
#[derive(Default)]
pub(super) struct Kept {
    readers: std::sync::Mutex<Vec<rusqlite::Connection>>,
    lock: std::sync::Mutex<Option<rusqlite::Connection>>,
}

impl Kept {
    /// At most as many readers as one audit takes.
    const READERS: usize = 2;

    fn reader(&self) -> Option<rusqlite::Connection> {
        self.readers.lock().unwrap_or_else(|e| e.into_inner()).pop()
    }

    fn lock(&self) -> Option<rusqlite::Connection> {
        self.lock.lock().unwrap_or_else(|e| e.into_inner()).take()
    }

    /// Keeps `conn` if its transaction ended; one that cannot end it is closed.
    fn put_reader(&self, conn: rusqlite::Connection) {
        if let Some(conn) = ended(conn) {
            let mut readers = self.readers.lock().unwrap_or_else(|e| e.into_inner());
            if readers.len() < Self::READERS {
                readers.push(conn);
            }
        }
    }

    fn put_lock(&self, conn: rusqlite::Connection) {
        if let Some(conn) = ended(conn) {
            *self.lock.lock().unwrap_or_else(|e| e.into_inner()) = Some(conn);
        }
    }
}

/// `conn` with its transaction rolled back and its page cache freed, or `None` if it still has one.
fn ended(conn: rusqlite::Connection) -> Option<rusqlite::Connection> {
    if !conn.is_autocommit() {
        let _ = conn.execute_batch("ROLLBACK");
    }
    (conn.is_autocommit() && conn.execute_batch("PRAGMA shrink_memory").is_ok()).then_some(conn)
}

/// A read-only connection for the audit, in a read transaction not begun yet: pages mapped rather
/// than copied in, a large cache for the index lookups of the items pass.
fn audit_connection(path: &std::path::Path, kept: &Kept) -> Result<rusqlite::Connection, StoreError> {
    let conn = match kept.reader() {
        Some(conn) => conn,
        None => {
            let conn = rusqlite::Connection::open_with_flags(
                path,
                rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
            )
            .map_err(StoreError::from_sqlite)?;
            conn.execute_batch("PRAGMA mmap_size = 1073741824; PRAGMA cache_size = -262144")
                .map_err(StoreError::from_sqlite)?;
            conn
        }
    };
    conn.execute_batch("BEGIN").map_err(StoreError::from_sqlite)?;
    Ok(conn)
}

/// Starts the connection's read transaction: its snapshot is taken at its first read (WAL).
fn pin_snapshot(conn: &rusqlite::Connection) -> Result<(), StoreError> {
    conn.query_row("SELECT COUNT(*) FROM counters", [], |_| Ok(())).map_err(StoreError::from_sqlite)
}

/// A read-write connection holding the write lock (`BEGIN IMMEDIATE`), waiting up to 5 s for it.
fn write_lock(path: &std::path::Path, kept: &Kept) -> rusqlite::Result<rusqlite::Connection> {
    let conn = match kept.lock() {
        Some(conn) => conn,
        None => rusqlite::Connection::open_with_flags(
            path,
            rusqlite::OpenFlags::SQLITE_OPEN_READ_WRITE | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
        )
        .and_then(|c| c.busy_timeout(std::time::Duration::from_secs(5)).map(|()| c))?,
    };
    conn.execute_batch("BEGIN IMMEDIATE")?;
    Ok(conn)
}

/// Two connections on one snapshot: both read transactions begin while a third connection holds
/// the write lock for an instant, so no commit can fall between them. `None` for the second when
/// the write lock cannot be had (a read-only file, a writer holding it past the wait): the audit
/// then runs its passes one after the other on the first.
fn snapshot_pair(
    path: &std::path::Path,
    kept: &Kept,
) -> Result<(rusqlite::Connection, Option<rusqlite::Connection>), StoreError> {
    let first = audit_connection(path, kept)?;
    let Ok(lock) = write_lock(path, kept) else {
        pin_snapshot(&first)?;
        return Ok((first, None));
    };
    let pinned = pin_snapshot(&first);
    let second = match pinned {
        Ok(()) => audit_connection(path, kept).and_then(|c| pin_snapshot(&c).map(|()| c)).ok(),
        Err(_) => None,
    };
    kept.put_lock(lock);
    pinned?;
    Ok((first, second))
}

/// Pass B's ranges on SQLite: enough that two connections taking them in turn finish together.
const AUDIT_RANGES: u64 = 16;

/// The SQLite audit on two connections of one snapshot: one runs pass A (the ledger) while the
/// other runs L5's allocations pass; then both take pass B's ranges of jobs in turn; the rest after.
/// From a checkpoint (decision 0040) pass B's jobs are known only when both first passes are done.
pub(super) fn sqlite_audit(
    path: &std::path::Path,
    kept: &Kept,
    runtime: &tokio::runtime::Handle,
    run: AuditRun,
    progress: &(dyn Fn(AuditProgress) + Send + Sync),
) -> Result<(AuditReport, Option<Record>), StoreError> {
    let (mut first, mut second) = snapshot_pair(path, kept)?;
    let against = match run {
        AuditRun { from_checkpoint: false, record: false } => None,
        _ => Some(runtime.block_on(Against::find(&mut Db::lite(&mut first), run))?),
    };
    let mut audit = runtime.block_on(Audit::start(&mut Db::lite(&mut first), progress, against))?;
    let positions = audit.positions();
    // Pass B's ranges, when known before the first passes: both connections go on to them at once.
    let upfront = match audit.starts_from_checkpoint() {
        false => {
            let ranges = runtime.block_on(audit.ranges(&mut Db::lite(&mut first), AUDIT_RANGES))?;
            Some(audit.items_pass(ranges))
        }
        true => None,
    };
    let mut l5 = std::mem::take(&mut audit.l5);
    let after = audit.events_proved();
    let (ledger, apart) = match second.as_mut() {
        Some(second) => std::thread::scope(|scope| {
            let other = scope.spawn(|| {
                let db = &mut Db::lite(second);
                runtime.block_on(async {
                    l5.parts(db, positions.as_deref()).await?;
                    match &upfront {
                        Some(items) => items.run(db).await,
                        None => Ok(()),
                    }
                })
            });
            // The checks that need neither pass, while the other connection reads the allocations.
            let ledger = runtime.block_on(async {
                let db = &mut Db::lite(&mut first);
                let ledger = audit.ledger_pass(db).await?;
                let apart = Apart::run(db, after).await?;
                match &upfront {
                    Some(items) => items.run(db).await.map(|()| (ledger, Some(apart))),
                    None => Ok((ledger, Some(apart))),
                }
            });
            let other = other.join().map_err(|_| StoreError::internal("the audit's second pass panicked"))?;
            other.and(ledger)
        })?,
        None => runtime.block_on(async {
            let db = &mut Db::lite(&mut first);
            let ledger = audit.ledger_pass(db).await?;
            l5.parts(db, positions.as_deref()).await?;
            match &upfront {
                Some(items) => items.run(db).await.map(|()| (ledger, None)),
                None => Ok((ledger, None)),
            }
        })?,
    };
    audit.l5 = l5;
    let items = match upfront {
        Some(items) => items,
        None => {
            let ranges = runtime.block_on(audit.ranges(&mut Db::lite(&mut first), AUDIT_RANGES))?;
            let items = audit.items_pass(ranges);
            both_run(runtime, &items, &mut first, second.as_mut())?;
            items
        }
    };
    audit.absorb(items.finished()?);
    let report = runtime.block_on(audit.finish(&mut Db::lite(&mut first), ledger, apart));
    kept.put_reader(first);
    if let Some(second) = second {
        kept.put_reader(second);
    }
    report
}

/// Pass B's ranges taken in turn by both connections of the snapshot (the first alone without a second).
fn both_run(
    runtime: &tokio::runtime::Handle,
    items: &audit::ItemsPass<'_>,
    first: &mut rusqlite::Connection,
    second: Option<&mut rusqlite::Connection>,
) -> Result<(), StoreError> {
    let Some(second) = second else { return runtime.block_on(items.run(&mut Db::lite(first))) };
    std::thread::scope(|scope| {
        let other = scope.spawn(|| runtime.block_on(items.run(&mut Db::lite(second))));
        let mine = runtime.block_on(items.run(&mut Db::lite(first)));
        let other = other.join().map_err(|_| StoreError::internal("the audit's second pass panicked"))?;
        other.and(mine)
    })
}

/// Pass B's ranges on PostgreSQL in a full audit: enough that two connections taking them in turn
/// finish together.
const PG_AUDIT_RANGES: u64 = 16;

/// How long the audit waits for its second connection before it runs on one.
const SECOND_WAIT: Duration = Duration::from_secs(2);

/// The PostgreSQL audit on two connections of one snapshot: the first exports its snapshot and
/// the second imports it (`SET TRANSACTION SNAPSHOT`) before either reads, so both see the same
/// committed rows. As on SQLite, one runs pass A and the checks apart while the other reads the
/// allocations, then both take pass B's ranges. Without a second connection within
/// [`SECOND_WAIT`] (the pool at its limit), the passes run one after the other on the first.
pub(super) async fn postgres_audit(
    shared: &PgShared,
    run: AuditRun,
    progress: &(dyn Fn(AuditProgress) + Send + Sync),
) -> Result<(AuditReport, Option<Record>), StoreError> {
    // Closed, not returned, unless the read ends cleanly (a dropped future included).
    let mut first = Leased::acquire(&shared.pool).await.map_err(|e| shared.observed(e.into()))?;
    let mut second = None;
    let out = async {
        let snapshot = begin(&mut first, None).await?;
        second = join_snapshot(shared, &snapshot).await;
        let out = match second.as_mut() {
            Some(second) => two_connections(&mut first, second, run, progress).await,
            None => audit::audit(&mut Db::pg(&mut first), run, progress).await,
        };
        end(&mut first, &out).await;
        if let Some(second) = second.as_mut() {
            end(second, &out).await;
        }
        out
    }
    .await;
    shared.observe(&out);
    out
}

/// Begins the audit's read-only transaction on `conn`: on the snapshot `import` names, or on a
/// new one it exports (returns its name). The JIT compiler off: the audit's few long statements
/// are estimated at costs that start it, and it costs more than it saves here (measured).
async fn begin(conn: &mut PgConnection, import: Option<&str>) -> Result<String, StoreError> {
    use sqlx::Executor;
    conn.execute("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await?;
    let snapshot = match import {
        Some(name) => {
            // A snapshot's name is hex digits and dashes (`00000003-0000001B-1`): checked before
            // it is spliced into the statement, which takes no parameter.
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_hexdigit() || c == '-') {
                return Err(StoreError::internal(format!("an exported snapshot named {name:?}")));
            }
            conn.execute(sqlx::AssertSqlSafe(format!("SET TRANSACTION SNAPSHOT '{name}'"))).await?;
            name.to_owned()
        }
        None => sqlx::query_scalar::<_, String>("SELECT pg_export_snapshot()").fetch_one(&mut *conn).await?,
    };
    conn.execute("SET LOCAL jit = off").await?;
    Ok(snapshot)
}

/// A second connection on the first's snapshot, or `None` when the pool has none to give at once
/// or it cannot join (the audit then runs on the first alone).
async fn join_snapshot(shared: &PgShared, snapshot: &str) -> Option<Leased> {
    let mut conn = tokio::time::timeout(SECOND_WAIT, Leased::acquire(&shared.pool)).await.ok()?.ok()?;
    match begin(&mut conn, Some(snapshot)).await {
        Ok(_) => Some(conn),
        Err(e) => {
            tracing::warn!(error = %e, "the audit's second connection could not join its snapshot: one connection");
            None
        }
    }
}

/// Ends a read transaction: after a clean end, the connection goes back to the pool; after an
/// error it is closed, not rolled back (a copy cut short leaves its rows unread on the connection,
/// and a ROLLBACK would read them as its answer). The audit's verdict stands whatever this finds.
async fn end<T>(conn: &mut Leased, out: &Result<T, StoreError>) {
    use sqlx::Executor;
    if out.is_err() {
        return;
    }
    match conn.execute("ROLLBACK").await {
        Ok(_) => conn.clean(),
        Err(e) => {
            tracing::warn!(error = %e, "the audit's read transaction did not end cleanly: its connection is closed")
        }
    }
}

/// The audit's passes on two connections of one snapshot (see [`postgres_audit`]).
async fn two_connections(
    first: &mut PgConnection,
    second: &mut PgConnection,
    run: AuditRun,
    progress: &(dyn Fn(AuditProgress) + Send + Sync),
) -> Result<(AuditReport, Option<Record>), StoreError> {
    let against = match run {
        AuditRun { from_checkpoint: false, record: false } => None,
        _ => Some(Against::find(&mut Db::pg(first), run).await?),
    };
    let mut audit = Audit::start(&mut Db::pg(first), progress, against).await?;
    let positions = audit.positions();
    // Pass B's ranges, when known before the first passes: both connections go on to them at once.
    let upfront = match audit.starts_from_checkpoint() {
        false => {
            let ranges = audit.ranges(&mut Db::pg(first), PG_AUDIT_RANGES).await?;
            Some(audit.items_pass(ranges))
        }
        true => None,
    };
    let mut l5 = std::mem::take(&mut audit.l5);
    let after = audit.events_proved();
    // The allocations in two ranges of ids, the later one read by the second connection, the
    // earlier by the first after pass A and the checks apart (those are quick; the allocations are
    // every part ever written: PostgreSQL's own reading and sending of them bounded the audit).
    let halves = halves(&mut Db::pg(first)).await?;
    let mut later = l5.fork();
    let (other, mine) = tokio::join!(
        async {
            let db = &mut Db::pg(second);
            let unmatched = match halves {
                Some((_, mid)) => later.parts_in(db, positions.as_deref(), Some((mid, None))).await?,
                None => Vec::new(),
            };
            match &upfront {
                Some(items) => items.run(db).await.map(|()| unmatched),
                None => Ok(unmatched),
            }
        },
        async {
            let db = &mut Db::pg(first);
            let ledger = audit.ledger_pass(db).await?;
            // The checks that need neither pass, while the other connection reads the allocations.
            let apart = Apart::run(db, after).await?;
            let unmatched = match halves {
                Some((start, mid)) => l5.parts_in(db, positions.as_deref(), Some((start, Some(mid)))).await?,
                None => l5.parts_in(db, positions.as_deref(), None).await?,
            };
            match &upfront {
                Some(items) => items.run(db).await.map(|()| (ledger, apart, unmatched)),
                None => Ok((ledger, apart, unmatched)),
            }
        }
    );
    let theirs = other?;
    let (ledger, apart, mut unmatched) = mine?;
    l5.merge(later);
    unmatched.extend(theirs);
    l5.settle(&mut Db::pg(first), unmatched).await?;
    audit.l5 = l5;
    let items = match upfront {
        Some(items) => items,
        None => {
            let ranges = audit.ranges(&mut Db::pg(first), PG_AUDIT_RANGES).await?;
            let items = audit.items_pass(ranges);
            let (one, two) = (&mut Db::pg(first), &mut Db::pg(second));
            let (a, b) = tokio::join!(items.run(one), items.run(two));
            a.and(b)?;
            items
        }
    };
    audit.absorb(items.finished()?);
    audit.finish(&mut Db::pg(first), ledger, Some(apart)).await
}

columns! {
    /// The allocations' first and last ids.
    PartIds { start = "MIN(id)", last = "MAX(id)" }
}

/// The allocations' ids cut in two ranges, `[start, mid)` and `[mid, …)` (the later one with no
/// upper bound: the last id, whatever it is, is in it); `None` when there are none.
async fn halves(db: &mut Db<'_>) -> Result<Option<(i64, i64)>, StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM allocations", PartIds::LIST));
    let row = db.one(&SQL, args![]).await?;
    let (Some(start), Some(last)) = (row.opt_i64(PartIds::start)?, row.opt_i64(PartIds::last)?) else {
        return Ok(None);
    };
    Ok(Some((start, start + (last - start) / 2 + 1)))
}
