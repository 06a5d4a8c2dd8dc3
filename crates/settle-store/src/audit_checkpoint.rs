//! The audit's checkpoint (decision 0040, docs/design/audit-checkpoints.md): what the newest clean
//! audit proved, read by an audit that starts from it, and written after an audit that found
//! nothing wrong — in one guarded transaction, describing that audit's snapshot.

use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use crate::model::CheckpointMark;
use settle_core::Timestamp;
use settle_core::ledger::Hash32;
use std::collections::{BTreeMap, BTreeSet};

/// An account as a checkpoint's snapshot held it: its last position, the sum of its lines to it,
/// that line's hash and `seq`, and what its items held (its exposure, and the items' part of its
/// held: open top-ups are not in it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Sealed {
    pub position: i64,
    pub sum: i64,
    pub hash: Hash32,
    pub last_seq: i64,
    pub refunded: i64,
    pub held: i64,
}

/// Where a store stands, read in an audit's snapshot: what a checkpoint must match to be used, and
/// what a new one records.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Mark {
    pub epoch: i64,
    pub schema_version: i64,
    /// The highest event number given (0: none).
    pub last_event_seq: i64,
    /// Ledger rows.
    pub entries: i64,
}

/// A usable checkpoint.
pub(crate) struct Checkpoint {
    pub generation: i64,
    pub taken_at: i64,
    pub mark: Mark,
    pub accounts: BTreeMap<String, Sealed>,
}

impl Checkpoint {
    pub(crate) fn mark(&self) -> CheckpointMark {
        CheckpointMark {
            generation: self.generation,
            taken_at: Timestamp::from_micros(self.taken_at),
            entries: self.mark.entries.max(0) as u64,
        }
    }
}

/// What an audit found of the store's checkpoint, in its snapshot.
pub(crate) struct Found {
    /// The checkpoint row's generation, usable or not (`None`: the store has none): what a new
    /// checkpoint must still find to replace it.
    pub base: Option<i64>,
    /// Where the store stands.
    pub now: Mark,
    /// The checkpoint, or why it cannot be started from.
    pub usable: Result<Checkpoint, String>,
}

columns! {
    MarkRow {
        epoch = "(SELECT MAX(epoch) FROM store_epochs)",
        schema_version = "(SELECT MAX(version) FROM _sqlx_migrations)",
        last_event_seq = "(SELECT COALESCE(MAX(last_seq), 0) FROM stamp_numbers)",
        entries = "(SELECT COUNT(*) FROM ledger_entries)",
    }
}

columns! {
    HeadRow { generation, epoch, schema_version, taken_at, last_event_seq, entries, retired }
}

columns! {
    SealedRow { account_id, position, sum, hash, last_seq, refunded, held }
}

columns! {
    JobIdRow { job_id }
}

columns! {
    SealedJobRow { account_id, refunded, held }
}

/// The store's checkpoint and where the store stands, in the audit's snapshot.
pub(crate) async fn find(db: &mut Db<'_>) -> Result<Found, StoreError> {
    static MARK: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| format!("SELECT {}", MarkRow::LIST));
    static HEAD: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| format!("SELECT {} FROM audit_checkpoint WHERE id = 1", HeadRow::LIST));
    let r = db.one(&MARK, args![]).await?;
    let now = Mark {
        epoch: r.opt_i64(MarkRow::epoch)?.unwrap_or(1),
        schema_version: r.opt_i64(MarkRow::schema_version)?.unwrap_or(0),
        last_event_seq: r.i64(MarkRow::last_event_seq)?,
        entries: r.i64(MarkRow::entries)?,
    };
    let Some(h) = db.opt(&HEAD, args![]).await? else {
        return Ok(Found { base: None, now, usable: Err("the store has no checkpoint".to_owned()) });
    };
    let generation = h.i64(HeadRow::generation)?;
    let then = Mark {
        epoch: h.i64(HeadRow::epoch)?,
        schema_version: h.i64(HeadRow::schema_version)?,
        last_event_seq: h.i64(HeadRow::last_event_seq)?,
        entries: h.i64(HeadRow::entries)?,
    };
    let unusable = if h.i64(HeadRow::retired)? != 0 {
        Some("the checkpoint was retired: an audit found something wrong since it was recorded".to_owned())
    } else if then.epoch != now.epoch {
        Some(format!("the checkpoint is of epoch {}, the store of epoch {} (restored since)", then.epoch, now.epoch))
    } else if then.schema_version != now.schema_version {
        Some(format!(
            "the checkpoint was taken at schema version {}, the store is at {} (upgraded since)",
            then.schema_version, now.schema_version
        ))
    } else if then.entries > now.entries || then.last_event_seq > now.last_event_seq {
        Some(format!(
            "the checkpoint counts {} entries and {} events, the store {} and {}",
            then.entries, then.last_event_seq, now.entries, now.last_event_seq
        ))
    } else {
        None
    };
    if let Some(why) = unusable {
        return Ok(Found { base: Some(generation), now, usable: Err(why) });
    }
    let taken_at = h.i64(HeadRow::taken_at)?;
    let usable = sealed_accounts(db).await?.map(|accounts| Checkpoint { generation, taken_at, mark: then, accounts });
    Ok(Found { base: Some(generation), now, usable })
}

/// The checkpoint's accounts; `Err` (unusable) when one's hash is not 32 bytes.
async fn sealed_accounts(db: &mut Db<'_>) -> Result<Result<BTreeMap<String, Sealed>, String>, StoreError> {
    static SQL: std::sync::LazyLock<String> =
        std::sync::LazyLock::new(|| format!("SELECT {} FROM audit_checkpoint_accounts", SealedRow::LIST));
    let mut accounts = BTreeMap::new();
    for r in db.all(&SQL, args![]).await? {
        use SealedRow as C;
        let id = r.text(C::account_id)?;
        let Ok(hash) = Hash32::try_from(r.blob(C::hash)?.as_slice()) else {
            return Ok(Err(format!("the checkpoint's hash of account {id} is damaged")));
        };
        let sealed = Sealed {
            position: r.i64(C::position)?,
            sum: r.i64(C::sum)?,
            hash,
            last_seq: r.i64(C::last_seq)?,
            refunded: r.i64(C::refunded)?,
            held: r.i64(C::held)?,
        };
        accounts.insert(id, sealed);
    }
    Ok(Ok(accounts))
}

/// The jobs of the events numbered after `$1` or waiting for their numbers. CROSS JOIN: SQLite keeps
/// the few stamps outside (with no statistics it would walk every event to probe the pending
/// stamps). Plan-tested.
pub(crate) const TOUCHED_BY_EVENTS: &str = "SELECT e.job_id AS job_id FROM stamp_numbers n CROSS JOIN events e \
     WHERE e.stamp = n.stamp AND n.last_seq > $1 AND e.job_id IS NOT NULL \
     UNION SELECT e.job_id AS job_id FROM stamps_pending p CROSS JOIN events e \
     WHERE e.stamp = p.stamp AND e.job_id IS NOT NULL";

/// Adds to `into` every job named by an event numbered after `after` or waiting for its number:
/// every job a transition committed after the checkpoint's snapshot wrote (numbers are given in
/// commit order, after COMMIT: every event not numbered at that snapshot gets one above `after`).
pub(crate) async fn touched_by_events(
    db: &mut Db<'_>,
    after: i64,
    into: &mut BTreeSet<String>,
) -> Result<(), StoreError> {
    db.each(TOUCHED_BY_EVENTS, args![after], |r| {
        let job = r.str(JobIdRow::job_id)?;
        if !into.contains(job) {
            into.insert(job.to_owned());
        }
        Ok(())
    })
    .await?;
    Ok(())
}

/// What each of `jobs` counted towards its account's sums at the checkpoint (none: nothing).
pub(crate) async fn sealed_jobs(
    db: &mut Db<'_>,
    jobs: &BTreeSet<String>,
) -> Result<Vec<(String, i64, i64)>, StoreError> {
    static ONE: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!("SELECT {} FROM audit_checkpoint_jobs WHERE job_id = $1", SealedJobRow::LIST)
    });
    static MANY: std::sync::LazyLock<String> = std::sync::LazyLock::new(|| {
        format!("SELECT {} FROM audit_checkpoint_jobs WHERE job_id = ANY($1)", SealedJobRow::LIST)
    });
    let mut rows = Vec::new();
    match db.engine() {
        // One statement per few thousand jobs: a round trip each would cost more than the rows.
        Engine::Postgres => {
            let jobs: Vec<String> = jobs.iter().cloned().collect();
            for chunk in jobs.chunks(10_000) {
                rows.extend(db.all(&MANY, &[Value::Texts(chunk.to_vec())]).await?);
            }
        }
        Engine::Sqlite => {
            for job in jobs {
                rows.extend(db.opt(&ONE, args![job.as_str()]).await?);
            }
        }
    }
    let mut sealed = Vec::with_capacity(rows.len());
    for r in rows {
        use SealedJobRow as C;
        sealed.push((r.text(C::account_id)?, r.i64(C::refunded)?, r.i64(C::held)?));
    }
    Ok(sealed)
}

/// What one job's items count towards its account's sums: the cost of its refunded items, and of
/// those that may still be credited back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct JobSum {
    pub job: String,
    pub account: String,
    pub refunded: i64,
    pub held: i64,
}

impl JobSum {
    pub(crate) fn new(job: &str, account: &str) -> JobSum {
        JobSum { job: job.to_owned(), account: account.to_owned(), refunded: 0, held: 0 }
    }
}

/// The jobs a new checkpoint records.
#[derive(Debug, Clone)]
pub(crate) enum JobSums {
    /// Every job whose sums are not zero (an audit of every item).
    All(Vec<JobSum>),
    /// The jobs the audit checked again, each replaced by what it counts now (dropped when zero).
    Touched { touched: Vec<String>, now: Vec<JobSum> },
}

/// A checkpoint to record: of the snapshot `now` describes, replacing the one of generation `base`.
#[derive(Debug, Clone)]
pub(crate) struct Record {
    pub base: Option<i64>,
    pub now: Mark,
    pub accounts: Vec<(String, Sealed)>,
    pub jobs: JobSums,
}

/// Rows per INSERT: under both engines' limit on parameters.
const ROWS_PER_INSERT: usize = 500;

/// Writes `record` as the store's checkpoint, in the caller's transaction: `Err` (nothing written)
/// when the checkpoint it replaces moved meanwhile (another audit recorded one).
pub(crate) async fn write(
    db: &mut Db<'_>,
    taken_at: Timestamp,
    record: &Record,
) -> Result<Result<CheckpointMark, String>, StoreError> {
    // Guarded on the checkpoint it replaces (another audit may have recorded one since this one's
    // snapshot), and on the store being the one the snapshot saw: its epoch and schema version.
    const FIRST: &str = "INSERT INTO audit_checkpoint (id, generation, epoch, schema_version, taken_at, last_event_seq, entries) \
         SELECT 1, 1, $1, $2, $3, $4, $5 WHERE (SELECT MAX(epoch) FROM store_epochs) = $1 \
         AND (SELECT MAX(version) FROM _sqlx_migrations) = $2 ON CONFLICT (id) DO NOTHING";
    const NEXT: &str = "UPDATE audit_checkpoint SET generation = generation + 1, epoch = $1, schema_version = $2, \
         taken_at = $3, last_event_seq = $4, entries = $5, retired = 0 WHERE id = 1 AND generation = $6 \
         AND (SELECT MAX(epoch) FROM store_epochs) = $1 AND (SELECT MAX(version) FROM _sqlx_migrations) = $2";
    let Mark { epoch, schema_version, last_event_seq, entries } = record.now;
    let at = taken_at.micros();
    let (rows, generation) = match record.base {
        None => (db.exec(FIRST, args![epoch, schema_version, at, last_event_seq, entries]).await?, 1),
        Some(base) => (db.exec(NEXT, args![epoch, schema_version, at, last_event_seq, entries, base]).await?, base + 1),
    };
    if rows != 1 {
        return Ok(Err(
            "another audit recorded a checkpoint meanwhile, or the store was restored or upgraded: this one was not recorded"
                .to_owned(),
        ));
    }
    db.exec("DELETE FROM audit_checkpoint_accounts", args![]).await?;
    let accounts = record.accounts.iter().map(|(id, s)| {
        vec![
            Value::from(id.as_str()),
            Value::from(s.position),
            Value::from(s.sum),
            Value::from(&s.hash),
            Value::from(s.last_seq),
            Value::from(s.refunded),
            Value::from(s.held),
        ]
    });
    insert(db, "audit_checkpoint_accounts", SealedRow::LIST, accounts.collect()).await?;
    let now = match &record.jobs {
        JobSums::All(all) => {
            db.exec("DELETE FROM audit_checkpoint_jobs", args![]).await?;
            all
        }
        JobSums::Touched { touched, now } => {
            forget_jobs(db, touched).await?;
            now
        }
    };
    let jobs = now.iter().filter(|j| j.refunded != 0 || j.held != 0).map(|j| {
        vec![Value::from(j.job.as_str()), Value::from(j.account.as_str()), Value::from(j.refunded), Value::from(j.held)]
    });
    insert(db, "audit_checkpoint_jobs", "job_id, account_id, refunded, held", jobs.collect()).await?;
    Ok(Ok(CheckpointMark { generation, taken_at, entries: entries.max(0) as u64 }))
}

/// Retires the store's checkpoint (an audit found something wrong): marked `retired`, its
/// generation raised — also when the store had none, so an audit already running, built on no
/// checkpoint or on the one retired, cannot record one over the retirement — and its accounts and
/// jobs deleted. Whether a usable one was retired.
pub(crate) async fn retire(db: &mut Db<'_>, at: Timestamp) -> Result<bool, StoreError> {
    const RETIRED: &str = "SELECT retired FROM audit_checkpoint WHERE id = 1";
    const RETIRE: &str = "INSERT INTO audit_checkpoint (id, generation, epoch, schema_version, taken_at, last_event_seq, entries, retired) \
         VALUES (1, 1, 0, 0, $1, 0, 0, 1) \
         ON CONFLICT (id) DO UPDATE SET generation = audit_checkpoint.generation + 1, retired = 1";
    columns! {
        RetiredRow { retired }
    }
    let usable = db.opt(RETIRED, args![]).await?.map(|r| r.i64(RetiredRow::retired)).transpose()? == Some(0);
    db.exec(RETIRE, args![at.micros()]).await?;
    db.exec("DELETE FROM audit_checkpoint_accounts", args![]).await?;
    db.exec("DELETE FROM audit_checkpoint_jobs", args![]).await?;
    Ok(usable)
}

/// Deletes the checkpoint's rows of `jobs`.
async fn forget_jobs(db: &mut Db<'_>, jobs: &[String]) -> Result<(), StoreError> {
    match db.engine() {
        Engine::Postgres => {
            for chunk in jobs.chunks(10_000) {
                let ids = Value::Texts(chunk.to_vec());
                db.exec("DELETE FROM audit_checkpoint_jobs WHERE job_id = ANY($1)", &[ids]).await?;
            }
        }
        Engine::Sqlite => {
            for job in jobs {
                db.exec("DELETE FROM audit_checkpoint_jobs WHERE job_id = $1", args![job.as_str()]).await?;
            }
        }
    }
    Ok(())
}

/// Inserts `rows` of `columns` into `table`, a few hundred rows a statement.
async fn insert(db: &mut Db<'_>, table: &str, columns: &str, rows: Vec<Vec<Value>>) -> Result<(), StoreError> {
    for chunk in rows.chunks(ROWS_PER_INSERT) {
        let width = chunk.first().map_or(0, Vec::len);
        let mut n = 0;
        let values: Vec<String> = chunk
            .iter()
            .map(|_| {
                let places: Vec<String> = (0..width)
                    .map(|_| {
                        n += 1;
                        format!("${n}")
                    })
                    .collect();
                format!("({})", places.join(", "))
            })
            .collect();
        let sql = format!("INSERT INTO {table} ({columns}) VALUES {}", values.join(", "));
        let args: Vec<Value> = chunk.iter().flatten().cloned().collect();
        db.all_built(sql, &args).await?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn record(base: Option<i64>, now: Mark) -> Record {
        let sealed = Sealed { position: 2, sum: 7, hash: [3; 32], last_seq: 9, refunded: 1, held: 0 };
        let jobs = JobSums::All(vec![JobSum { job: "j".into(), account: "a".into(), refunded: 1, held: 0 }]);
        Record { base, now, accounts: vec![("a".into(), sealed)], jobs }
    }

    /// The write is guarded: on the checkpoint it replaces (two built on one predecessor: the
    /// second is refused and writes nothing), and on the store's epoch and schema version.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_checkpoint_replaces_only_the_one_it_was_built_on() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.db");
        drop(
            crate::SqlStore::open(&format!("sqlite://{}", path.display()), crate::StoreOptions::default())
                .await
                .unwrap(),
        );
        let mut c = rusqlite::Connection::open(&path).unwrap();
        let db = &mut Db::lite(&mut c);
        let now = find(db).await.unwrap().now;
        let at = Timestamp::from_micros(1);
        assert_eq!(write(db, at, &record(None, now)).await.unwrap().unwrap().generation, 1);
        assert!(write(db, at, &record(None, now)).await.unwrap().is_err(), "a second first");
        assert_eq!(write(db, at, &record(Some(1), now)).await.unwrap().unwrap().generation, 2);
        assert!(write(db, at, &record(Some(1), now)).await.unwrap().is_err(), "built on a replaced one");
        let other_epoch = Mark { epoch: now.epoch + 1, ..now };
        assert!(write(db, at, &record(Some(2), other_epoch)).await.unwrap().is_err(), "another epoch");
        let other_schema = Mark { schema_version: now.schema_version - 1, ..now };
        assert!(write(db, at, &record(Some(2), other_schema)).await.unwrap().is_err(), "another schema");
        let found = find(db).await.unwrap();
        assert_eq!(found.base, Some(2));
        let usable = found.usable.unwrap();
        assert_eq!(usable.accounts.get("a").map(|s| (s.position, s.hash)), Some((2, [3; 32])));
        // Retired: kept, its generation raised, not usable; what was built on it cannot record.
        assert!(retire(db, at).await.unwrap());
        let found = find(db).await.unwrap();
        assert_eq!(found.base, Some(3));
        assert!(found.usable.err().unwrap().contains("retired"));
        assert!(write(db, at, &record(Some(2), now)).await.unwrap().is_err(), "built on the retired one");
        assert!(!retire(db, at).await.unwrap(), "already retired");
        assert_eq!(write(db, at, &record(Some(4), now)).await.unwrap().unwrap().generation, 5);
        assert!(find(db).await.unwrap().usable.is_ok());
        // A store that never had one: the retirement still raises a generation a first record cannot pass.
        db.exec("DELETE FROM audit_checkpoint", args![]).await.unwrap();
        assert!(!retire(db, at).await.unwrap());
        assert!(write(db, at, &record(None, now)).await.unwrap().is_err(), "a first record after a retirement");
    }
}
