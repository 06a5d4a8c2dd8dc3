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

/// The last event number given and the current epoch of an open store. A store from before
/// epochs (migration 0023) is refused: an epoch read as "1" by default could be one already used.
fn position(conn: &Connection) -> Result<(i64, i64), StoreError> {
    let has_epochs: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'store_epochs')",
            [],
            |r| r.get(0),
        )
        .map_err(|e| fail(format!("read the schema: {e}")))?;
    if !has_epochs {
        return Err(fail(
            "the store is from a Settle older than epochs (migration 0023): bring it to this release first \
             (`settle migrate --db sqlite://FILE`)",
        ));
    }
    // What numbering uses, not the largest number seen: the same, unless a number was taken and
    // its event is still to come. Events are numbered by stamp since migration 0024; a backup from
    // before it still has them in `outbox`.
    let numbered_by_stamp: bool = conn
        .query_row(
            "SELECT EXISTS (SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = 'stamp_numbers')",
            [],
            |r| r.get(0),
        )
        .map_err(|e| fail(format!("read the schema: {e}")))?;
    let newest =
        if numbered_by_stamp { "SELECT MAX(last_seq) FROM stamp_numbers" } else { "SELECT MAX(seq) FROM outbox" };
    let last_seq: i64 = conn
        .query_row(
            &format!(
                "SELECT MAX(COALESCE((SELECT value FROM counters WHERE name = 'outbox'), 0), COALESCE(({newest}), 0))"
            ),
            [],
            |r| r.get(0),
        )
        .map_err(|e| fail(format!("read the event numbers: {e}")))?;
    let epoch: i64 = conn
        .query_row("SELECT MAX(epoch) FROM store_epochs", [], |r| r.get(0))
        .map_err(|e| fail(format!("read the epoch: {e}")))?;
    Ok((last_seq, epoch))
}

fn size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// A file name beside `path` that is not taken: `{path}.{what}-{stamp}`, then `-2`, `-3`, ….
fn free_name(path: &Path, what: &str, stamp: i64) -> PathBuf {
    let base = format!("{}.{what}-{stamp}", path.display());
    let mut name = PathBuf::from(&base);
    let mut n = 1;
    while name.exists() || PathBuf::from(format!("{}-wal", name.display())).exists() {
        n += 1;
        name = PathBuf::from(format!("{base}-{n}"));
    }
    name
}

/// Copies `src` (one step of the online backup API: one read transaction, one consistent state)
/// into a new private file beside `beside` (mode 0600, created here, never an existing file), lets
/// `finish` work on the copy, leaves it a single file in `journal` mode, syncs it and returns its
/// path. On failure nothing is left behind.
fn stage(
    src: &Connection,
    beside: &Path,
    journal: &str,
    finish: impl FnOnce(&Connection) -> Result<(), StoreError>,
) -> Result<PathBuf, StoreError> {
    use std::os::unix::fs::OpenOptionsExt;
    let tmp = free_name(beside, "partial", i64::from(std::process::id()));
    std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(|e| fail(format!("create {}: {e}", tmp.display())))?;
    let result = (|| {
        let mut dst = Connection::open(&tmp).map_err(|e| fail(format!("open {}: {e}", tmp.display())))?;
        {
            let backup = rusqlite::backup::Backup::new(src, &mut dst).map_err(|e| fail(format!("copy: {e}")))?;
            match backup.step(-1).map_err(|e| fail(format!("copy: {e}")))? {
                rusqlite::backup::StepResult::Done => {}
                other => return Err(fail(format!("the copy did not finish in one step: {other:?}"))),
            }
        }
        dst.pragma_update(None, "journal_mode", "DELETE").map_err(|e| fail(format!("copy: {e}")))?;
        finish(&dst)?;
        // The mode is kept in the file's header; a single file either way (the last connection to
        // a WAL database checkpoints and removes its WAL as it closes).
        dst.pragma_update(None, "journal_mode", journal).map_err(|e| fail(format!("copy: {e}")))?;
        dst.close().map_err(|(_, e)| fail(format!("close the copy: {e}")))?;
        std::fs::File::open(&tmp)
            .and_then(|f| f.sync_all())
            .map_err(|e| fail(format!("sync {}: {e}", tmp.display())))?;
        Ok(())
    })();
    if let Err(e) = result {
        for suffix in ["", "-wal", "-shm", "-journal"] {
            let _ = std::fs::remove_file(format!("{}{suffix}", tmp.display()));
        }
        return Err(e);
    }
    Ok(tmp)
}

fn sync_dir(path: &Path) {
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        let _ = std::fs::File::open(dir).and_then(|d| d.sync_all());
    }
}

/// Puts `staged` at `to` only if nothing is there (a link, then the staged name removed).
fn place_new(staged: &Path, to: &Path) -> Result<(), StoreError> {
    let placed = std::fs::hard_link(staged, to);
    let _ = std::fs::remove_file(staged);
    placed.map_err(|e| fail(format!("put {} in place: {e}", to.display())))?;
    sync_dir(to);
    Ok(())
}

/// A consistent copy of the live embedded store `url` into the new file `to` (refused if it
/// exists): private (mode 0600), whole or absent.
pub fn backup(url: &str, to: &Path) -> Result<BackupReport, StoreError> {
    let from = sqlite_path(url)?;
    if to.exists() {
        return Err(fail(format!("{} exists: a backup never overwrites a file", to.display())));
    }
    let src = open_settle(&from, "the store")?;
    let staged = stage(&src, to, "DELETE", |_| Ok(()))?;
    drop(src);
    place_new(&staged, to)?;
    let copy = open_settle(to, "the backup")?;
    let (last_seq, epoch) = position(&copy)?;
    Ok(BackupReport { path: to.to_owned(), bytes: size(to), last_seq, epoch, replaced: None })
}

/// How a restore goes.
#[derive(Debug, Clone, Default)]
pub struct RestoreOptions {
    /// Replace a store already there (moved aside, never deleted).
    pub replace: bool,
    /// The new epoch, when the store being replaced cannot tell its own (damaged, gone): higher
    /// than any epoch receivers have seen.
    pub epoch: Option<i64>,
}

/// Takes the store at `path` for this process alone: refused while any other process has it open
/// (an idle connection of a running server holds a shared lock in WAL mode). Returns the connection
/// holding the lock and the store's epoch, if it can be read.
fn take_alone(path: &Path) -> Result<(Connection, Result<i64, StoreError>), StoreError> {
    let conn = Connection::open_with_flags(path, OpenFlags::SQLITE_OPEN_READ_WRITE | OpenFlags::SQLITE_OPEN_NO_MUTEX)
        .map_err(|e| fail(format!("open {}: {e}", path.display())))?;
    conn.busy_timeout(std::time::Duration::from_millis(200)).map_err(|e| fail(e.to_string()))?;
    conn.pragma_update(None, "locking_mode", "EXCLUSIVE").map_err(|e| fail(e.to_string()))?;
    if let Err(e) = conn.execute_batch("BEGIN EXCLUSIVE; COMMIT") {
        return Err(fail(format!(
            "{} is in use by another process ({e}): stop every settle using it, then restore",
            path.display()
        )));
    }
    let epoch = position(&conn).map(|(_, epoch)| epoch);
    Ok((conn, epoch))
}

/// Puts the backup `from` in place as the embedded store `url`, with its epoch raised above both
/// the backup's and the replaced store's (or to `options.epoch`).
///
/// The copy is made, its epoch raised and synced under a temporary name first; only then does it
/// take the store's name, in one rename — at every moment the name holds either the old store or
/// the restored one, never nothing and never a copy without its new epoch. A store already there
/// is refused unless `options.replace`, and while any other process has it open; replaced, it is
/// kept under `PATH.replaced-<unix seconds>` (a single file), never deleted.
pub fn restore(from: &Path, url: &str, options: &RestoreOptions, now_micros: i64) -> Result<BackupReport, StoreError> {
    let to = sqlite_path(url)?;
    let src = open_settle(from, "the backup")?;
    let (_, backup_epoch) = position(&src)?;
    let mut floor = backup_epoch;
    let mut guard = None;
    if to.exists() {
        if !options.replace {
            return Err(fail(format!(
                "{} exists: stop the processes using it, then restore with --replace (it is moved aside, not deleted)",
                to.display()
            )));
        }
        let (conn, epoch) = take_alone(&to)?;
        match (epoch, options.epoch) {
            (Ok(current), _) => floor = floor.max(current),
            (Err(_), Some(_)) => {}
            (Err(e), None) => {
                return Err(fail(format!(
                    "cannot read the epoch of the store being replaced ({e}): pass --epoch N, higher than any \
                     epoch its receivers have seen"
                )));
            }
        }
        guard = Some(conn);
    }
    let epoch = match options.epoch {
        Some(n) if n <= floor => {
            return Err(fail(format!("--epoch {n} is not above the epochs in use (up to {floor})")));
        }
        Some(n) => n,
        None => floor + 1,
    };
    let reason = format!("restored from {}", from.display());
    let staged = stage(&src, &to, "WAL", |c| raise_epoch_sqlite(c, epoch, now_micros, &reason))?;
    drop(src);
    let Some(guard) = guard else {
        place_new(&staged, &to)?;
        return report(&to, None);
    };
    // The store being replaced becomes one self-contained file (its WAL folded in and removed) while
    // this process alone holds it; it keeps its name until the restored copy takes it.
    let swapped = (|| {
        guard.pragma_update(None, "journal_mode", "DELETE").map_err(|e| fail(format!("fold the old WAL in: {e}")))?;
        drop(guard);
        if let Ok(meta) = std::fs::metadata(&to) {
            use std::os::unix::fs::MetadataExt;
            let _ = std::fs::set_permissions(&staged, meta.permissions());
            let _ = std::os::unix::fs::chown(&staged, Some(meta.uid()), Some(meta.gid()));
        }
        let aside = free_name(&to, "replaced", now_micros.div_euclid(1_000_000));
        std::fs::hard_link(&to, &aside).map_err(|e| fail(format!("keep the old store at {}: {e}", aside.display())))?;
        std::fs::rename(&staged, &to).map_err(|e| fail(format!("put the copy in place: {e}")))?;
        sync_dir(&to);
        Ok(aside)
    })();
    match swapped {
        Ok(aside) => report(&to, Some(aside)),
        Err(e) => {
            let _ = std::fs::remove_file(&staged);
            Err(e)
        }
    }
}

fn report(to: &Path, replaced: Option<PathBuf>) -> Result<BackupReport, StoreError> {
    let conn = open_settle(to, "the restored store")?;
    let (last_seq, epoch) = position(&conn)?;
    Ok(BackupReport { path: to.to_owned(), bytes: size(to), last_seq, epoch, replaced })
}

/// Begins `epoch` at the next event number of a copy being restored.
fn raise_epoch_sqlite(conn: &Connection, epoch: i64, now_micros: i64, reason: &str) -> Result<(), StoreError> {
    let (last_seq, _) = position(conn)?;
    conn.execute(
        "INSERT INTO store_epochs (epoch, first_seq, started_at, reason) VALUES (?1, ?2, ?3, ?4)",
        rusqlite::params![epoch, last_seq + 1, now_micros, reason],
    )
    .map_err(|e| fail(format!("raise the epoch: {e}")))?;
    Ok(())
}
