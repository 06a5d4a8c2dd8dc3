//! Whose database is this? Checked before anything is written: Settle opens an empty database or
//! one of its own, and refuses — writing nothing — a file that is not a database, a database that
//! belongs to another program, and a Settle database whose schema is newer than this binary.
//!
//! A Settle database is known by its migration log: every migration sqlx recorded is one of this
//! binary's, with the same checksum (on both engines), and on SQLite by `application_id`, which
//! Settle sets once it has migrated.

use crate::error::StoreError;
use sqlx::migrate::Migrator;
use sqlx::sqlite::SqliteConnectOptions;
use sqlx::{ConnectOptions, Connection, Row};
use std::path::Path;

/// SQLite `PRAGMA application_id` of a Settle database: "SETL".
pub(crate) const SQLITE_APPLICATION_ID: i64 = 0x5345_544C;

/// The first 16 bytes of every SQLite 3 database file.
const SQLITE_HEADER: &[u8; 16] = b"SQLite format 3\0";

/// What the database holds, as far as identity goes.
struct Found {
    /// Tables that are not the engine's own.
    tables: Vec<String>,
    /// `(version, checksum)` of every migration sqlx recorded, if it has a log.
    applied: Option<Vec<(i64, Vec<u8>)>>,
}

/// Refuses a schema older than this binary's (a process started with `--no-migrate`): each of
/// its migrations must be applied. (A newer schema was refused before, by `judge`.)
pub(crate) fn require_current(migrator: &Migrator, applied: &[i64]) -> Result<(), StoreError> {
    let missing: Vec<i64> = migrator.iter().map(|m| m.version).filter(|v| !applied.contains(v)).collect();
    if missing.is_empty() {
        return Ok(());
    }
    let known = migrator.iter().map(|m| m.version).max().unwrap_or(0);
    let at = applied.iter().max().copied().unwrap_or(0);
    Err(StoreError::NotSettle(format!(
        "the schema is at migration {at} and this settle needs {known} ({} not applied): run `settle migrate` \
         first, or start without --no-migrate",
        missing.len()
    )))
}

/// Judges what was found against this binary's migrations.
fn judge(found: &Found, migrator: &Migrator, what: &str) -> Result<(), StoreError> {
    let Some(applied) = &found.applied else {
        if found.tables.is_empty() {
            return Ok(());
        }
        let some: Vec<&str> = found.tables.iter().take(3).map(String::as_str).collect();
        return Err(StoreError::NotSettle(format!(
            "{what} is not a Settle database: it holds other tables ({}) and no Settle schema; \
             point Settle at an empty database or one of its own",
            some.join(", ")
        )));
    };
    let known_max = migrator.iter().map(|m| m.version).max().unwrap_or(0);
    for (version, checksum) in applied {
        match migrator.iter().find(|m| m.version == *version) {
            Some(m) if m.checksum.as_ref() == checksum.as_slice() => {}
            Some(_) => {
                return Err(StoreError::NotSettle(format!(
                    "{what} is not a Settle database this binary knows: its migration {version} differs from Settle's"
                )));
            }
            None if *version > known_max => {
                return Err(StoreError::NotSettle(format!(
                    "{what} has a Settle schema newer than this binary (migration {version}; this binary knows up \
                     to {known_max}): run a newer settle"
                )));
            }
            None => {
                return Err(StoreError::NotSettle(format!(
                    "{what} is not a Settle database this binary knows: it records migration {version}, which Settle \
                     does not have"
                )));
            }
        }
    }
    if !found.tables.iter().any(|t| t == "ledger_entries") && !applied.is_empty() {
        return Err(StoreError::NotSettle(format!("{what} has a migration log but no Settle ledger")));
    }
    Ok(())
}

/// Checks an SQLite file before Settle opens it for writing (a missing or empty file is new).
pub(crate) async fn check_sqlite(options: &SqliteConnectOptions, migrator: &Migrator) -> Result<(), StoreError> {
    let path: &Path = options.get_filename();
    if path.as_os_str().is_empty() || path == Path::new(":memory:") {
        return Ok(());
    }
    let what = path.display().to_string();
    let mut header = [0u8; 16];
    match std::fs::File::open(path) {
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(StoreError::NotSettle(format!("{what} cannot be read: {e}"))),
        Ok(mut f) => {
            use std::io::Read;
            let len = f.metadata().map(|m| m.len()).unwrap_or(0);
            if len == 0 {
                return Ok(());
            }
            if len < 16 || f.read_exact(&mut header).is_err() || &header != SQLITE_HEADER {
                return Err(StoreError::NotSettle(format!("{what} is not an SQLite database")));
            }
        }
    }
    // Read-only, and no pragma that could change the file. One read transaction: another process
    // migrating the file meanwhile is seen before or after each of its migrations, never between
    // the tables read and the log read.
    let mut raw = SqliteConnectOptions::new().filename(path).read_only(true).connect().await?;
    let mut conn = raw.begin().await?;
    let app_id: i64 = sqlx::query("PRAGMA application_id").fetch_one(&mut *conn).await?.try_get(0)?;
    let tables: Vec<String> =
        sqlx::query("SELECT name FROM sqlite_schema WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name")
            .fetch_all(&mut *conn)
            .await?
            .iter()
            .map(|r| r.try_get::<String, _>(0))
            .collect::<Result<_, _>>()?;
    let applied = if tables.iter().any(|t| t == "_sqlx_migrations") {
        let rows = sqlx::query("SELECT version, checksum FROM _sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(&mut *conn)
            .await?;
        Some(rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect::<Result<Vec<_>, sqlx::Error>>()?)
    } else {
        None
    };
    conn.rollback().await?;
    raw.close().await?;
    if app_id != 0 && app_id != SQLITE_APPLICATION_ID {
        return Err(StoreError::NotSettle(format!(
            "{what} belongs to another program (SQLite application_id {app_id:#x}, Settle's is {SQLITE_APPLICATION_ID:#x})"
        )));
    }
    judge(&Found { tables, applied }, migrator, &what)
}

/// Checks a PostgreSQL database (its current schema) before Settle migrates it.
pub(crate) async fn check_postgres(pool: &sqlx::PgPool, migrator: &Migrator) -> Result<(), StoreError> {
    // One snapshot for the tables and the log: another process migrating this database at the
    // same moment (two servers started at once) is seen before or after each of its migrations,
    // never with a migration logged whose tables were read before it committed.
    let mut conn = pool.begin().await?;
    sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY").execute(&mut *conn).await?;
    let db: String = sqlx::query("SELECT current_database()").fetch_one(&mut *conn).await?.try_get(0)?;
    let what = format!("PostgreSQL database {db}");
    let tables: Vec<String> = sqlx::query(
        // Relations an extension owns (pg_stat_statements' views, which pg_auto_failover installs in
        // every database it makes) are the server's, not another program's data.
        "SELECT c.relname::text FROM pg_class c \
         WHERE c.relnamespace = (SELECT oid FROM pg_namespace WHERE nspname = current_schema()) \
           AND c.relkind IN ('r', 'p', 'v', 'm', 'f') \
           AND NOT EXISTS (SELECT 1 FROM pg_depend d WHERE d.classid = 'pg_class'::regclass \
                           AND d.objid = c.oid AND d.deptype = 'e') \
         ORDER BY 1",
    )
    .fetch_all(&mut *conn)
    .await?
    .iter()
    .map(|r| r.try_get::<String, _>(0))
    .collect::<Result<_, _>>()?;
    let applied = if tables.iter().any(|t| t == "_sqlx_migrations") {
        let rows = sqlx::query("SELECT version, checksum FROM _sqlx_migrations WHERE success ORDER BY version")
            .fetch_all(&mut *conn)
            .await?;
        Some(rows.iter().map(|r| Ok((r.try_get(0)?, r.try_get(1)?))).collect::<Result<Vec<_>, sqlx::Error>>()?)
    } else {
        None
    };
    conn.rollback().await?;
    judge(&Found { tables, applied }, migrator, &what)
}
