//! Backups of an embedded store, restores, and the store's epoch (semantics §5, decision 0029).
//!
//! `backup` copies a live SQLite store through SQLite's online backup API, in one step under one
//! read transaction: the copy is the store as of one commit, whatever is written meanwhile (WAL
//! readers do not block writers). `restore` puts such a copy in place and raises the epoch: the
//! restored store numbers events again from where the backup stood, and those events carry the new
//! epoch, so a receiver deduplicating by (`epoch`, `seq`) takes them as new.

use crate::error::StoreError;
use crate::identity::SQLITE_APPLICATION_ID;
use rusqlite::{Connection, OpenFlags};
use std::path::{Path, PathBuf};

/// What a backup or a restore did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackupReport {
    /// The file written (the backup, or the restored store).
    pub path: PathBuf,
    /// Its size in bytes.
    pub bytes: u64,
    /// The last event number it holds (0 if none).
    pub last_seq: i64,
    /// Its epoch: the backup's as taken; after a restore, the raised one.
    pub epoch: i64,
    /// A restore that replaced a store: where the store it replaced was moved.
    pub replaced: Option<PathBuf>,
}

/// The file a `sqlite://` URL names.
pub fn sqlite_path(url: &str) -> Result<PathBuf, StoreError> {
    let rest = url
        .strip_prefix("sqlite://")
        .or_else(|| url.strip_prefix("sqlite:"))
        .ok_or_else(|| StoreError::invalid(format!("{url:?} is not an embedded store: sqlite://PATH")))?;
    let path = rest.split('?').next().unwrap_or(rest);
    if path.is_empty() || path == ":memory:" {
        return Err(StoreError::invalid("name the store's file: sqlite://PATH"));
    }
    Ok(PathBuf::from(path))
}

fn fail(what: impl std::fmt::Display) -> StoreError {
    StoreError::invalid(what.to_string())
}

/// Opens `path` read-only and checks it is a Settle store (its `application_id`) that SQLite finds
/// sound (`quick_check`).
fn open_settle(path: &Path, what: &str) -> Result<Connection, StoreError> {
    if !path.is_file() {
        return Err(fail(format!("{what} {}: no such file", path.display())));
    }
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_ONLY | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| fail(format!("{what} {}: {e}", path.display())))?;
    let id: i64 = conn
        .query_row("PRAGMA application_id", [], |r| r.get(0))
        .map_err(|e| fail(format!("{what} {}: {e}", path.display())))?;
    if id != SQLITE_APPLICATION_ID {
        return Err(fail(format!("{what} {} is not a Settle store", path.display())));
    }
    let check: String = conn
        .query_row("PRAGMA quick_check", [], |r| r.get(0))
        .map_err(|e| fail(format!("{what} {}: {e}", path.display())))?;
    if check != "ok" {
        return Err(fail(format!("{what} {} is damaged: {check}", path.display())));
    }
    Ok(conn)
}

/// The last event number and the current epoch of an open store.
fn position(conn: &Connection) -> Result<(i64, i64), StoreError> {
    let last_seq: i64 = conn
        .query_row("SELECT COALESCE(MAX(seq), 0) FROM outbox", [], |r| r.get(0))
        .map_err(|e| fail(format!("read the event numbers: {e}")))?;
    // A store from before migration 0023 has no epochs: it is in its first.
    let epoch: i64 = conn.query_row("SELECT MAX(epoch) FROM store_epochs", [], |r| r.get(0)).unwrap_or(1);
    Ok((last_seq, epoch))
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// Writes `to` whole or not at all: the copy goes to a temporary file beside it, is synced, then
/// renamed into place (and the directory synced).
fn copy_into_place(src: &Connection, to: &Path) -> Result<(), StoreError> {
    let tmp = to.with_extension(format!("partial-{}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    let result = (|| {
        let mut dst = Connection::open(&tmp).map_err(|e| fail(format!("create {}: {e}", tmp.display())))?;
        {
            let backup = rusqlite::backup::Backup::new(src, &mut dst).map_err(|e| fail(format!("backup: {e}")))?;
            // One step copies every page under one read transaction: one consistent state.
            match backup.step(-1).map_err(|e| fail(format!("backup: {e}")))? {
                rusqlite::backup::StepResult::Done => {}
                other => return Err(fail(format!("backup did not finish in one step: {other:?}"))),
            }
        }
        // A single file, no WAL beside it: the copy is complete as it stands.
        dst.pragma_update(None, "journal_mode", "DELETE").map_err(|e| fail(format!("backup: {e}")))?;
        dst.close().map_err(|(_, e)| fail(format!("backup: {e}")))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| fail(format!("sync {}: {e}", tmp.display())))?;
        std::fs::rename(&tmp, to).map_err(|e| fail(format!("move into place {}: {e}", to.display())))?;
        if let Some(dir) = to.parent().filter(|d| !d.as_os_str().is_empty()) {
            let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
        }
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result
}

/// A consistent copy of the live embedded store `url` into the new file `to` (refused if it exists).
pub fn backup(url: &str, to: &Path) -> Result<BackupReport, StoreError> {
    let from = sqlite_path(url)?;
    if to.exists() {
        return Err(fail(format!("{} exists: a backup never overwrites a file", to.display())));
    }
    let src = open_settle(&from, "the store")?;
    copy_into_place(&src, to)?;
    let copy = open_settle(to, "the backup")?;
    let (last_seq, epoch) = position(&copy)?;
    Ok(BackupReport { path: to.to_owned(), bytes: size(to), last_seq, epoch, replaced: None })
}

/// Puts the backup `from` in place as the embedded store `url` and raises its epoch above both the
/// backup's and the replaced store's. A store already at `url` is refused unless `replace`, which
/// moves it (and its WAL) aside to `PATH.replaced-<unix seconds>` — never deleted. Stop every process
/// using the store first: one that goes on writing writes to the file moved aside.
pub fn restore(from: &Path, url: &str, replace: bool, now_micros: i64) -> Result<BackupReport, StoreError> {
    let to = sqlite_path(url)?;
    let src = open_settle(from, "the backup")?;
    let (_, backup_epoch) = position(&src)?;
    let mut floor = backup_epoch;
    let mut replaced = None;
    if to.exists() {
        if !replace {
            return Err(fail(format!(
                "{} exists: stop the processes using it, then restore with --replace (it is moved aside, not deleted)",
                to.display()
            )));
        }
        // The store being replaced may have gone on to later epochs: the new one is above them too.
        if let Ok(current) = open_settle(&to, "the store") {
            floor = floor.max(position(&current)?.1);
        }
        let aside = PathBuf::from(format!("{}.replaced-{}", to.display(), now_micros.div_euclid(1_000_000)));
        for suffix in ["", "-wal", "-shm"] {
            let (a, b) = (PathBuf::from(format!("{}{suffix}", to.display())), format!("{}{suffix}", aside.display()));
            if a.exists() {
                std::fs::rename(&a, &b).map_err(|e| fail(format!("move {} aside: {e}", a.display())))?;
            }
        }
        replaced = Some(aside);
    }
    copy_into_place(&src, &to)?;
    drop(src);
    let conn = Connection::open(&to).map_err(|e| fail(format!("open {}: {e}", to.display())))?;
    let epoch = floor + 1;
    raise_epoch_sqlite(&conn, epoch, now_micros, &format!("restored from {}", from.display()))?;
    conn.pragma_update(None, "journal_mode", "WAL").map_err(|e| fail(format!("restore: {e}")))?;
    let (last_seq, epoch) = position(&conn)?;
    drop(conn);
    Ok(BackupReport { path: to.clone(), bytes: size(&to), last_seq, epoch, replaced })
}

/// Begins `epoch` at the next event number of a store restored to this file.
fn raise_epoch_sqlite(conn: &Connection, epoch: i64, now_micros: i64, reason: &str) -> Result<(), StoreError> {
    let has_epochs: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'store_epochs')",
            [],
            |r| r.get(0),
        )
        .map_err(|e| fail(format!("restore: {e}")))?;
    if !has_epochs {
        return Err(fail(
            "the backup is from a Settle older than epochs (migration 0023): open it once with this settle \
             (`settle migrate --db sqlite://BACKUP`), then restore it",
        ));
    }
    conn.execute(
        "INSERT INTO store_epochs (epoch, first_seq, started_at, reason) \
         VALUES (?1, (SELECT COALESCE(MAX(seq), 0) + 1 FROM outbox), ?2, ?3)",
        rusqlite::params![epoch, now_micros, reason],
    )
    .map_err(|e| fail(format!("raise the epoch: {e}")))?;
    Ok(())
}
