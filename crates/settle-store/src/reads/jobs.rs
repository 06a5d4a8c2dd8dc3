//! Jobs as they are read: lists by filter (pages bounded in bytes), what a filter would touch, a
//! job's attempts, signals and whole history, the failure summary, and what the background loops
//! look for (lapsed leases, cancelling jobs, the next due time).

use super::filter::{Kinds, filter_sql, running_seqs, scope_sql};
use super::{next_after, page_limit};
use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, Cx, EntryCol, EventCol, entry_from_row, event_from_row, job_row, name};
use settle_core::Timestamp;
use settle_core::history::{AttemptResult, Signal, SignalEffect};
use settle_core::limits;
use std::sync::LazyLock;

columns! {
    /// A job's number and its stored size (SQL given at run time: bytes are counted per engine).
    SizeCol { job_seq, size }
}

/// A page of jobs: at most `page.limit`, and no more than `PAGE_BYTES_MAX` of stored job text
/// (payloads, results and items, estimated from their stored lengths) — a page ends early at the
/// budget, with `next_after` where it stopped, and always holds at least one job. The sizes are
/// read first, without the texts, so a page of fat jobs is never loaded whole to be cut.
pub(crate) async fn jobs(db: &mut Db<'_>, cx: &Cx, filter: &JobFilter, page: Page) -> Result<Paged<Job>, StoreError> {
    let limit = page_limit(page.limit);
    let mut a: Vec<Value> = vec![page.after.into()];
    // Bytes, not characters: a payload of 4-byte characters is four times its `length`.
    let engine = db.engine();
    let bytes = |column: &str| match engine {
        crate::db::Engine::Sqlite => format!("COALESCE(length(CAST({column} AS BLOB)), 0)"),
        crate::db::Engine::Postgres => format!("COALESCE(octet_length({column}), 0)"),
    };
    let size = format!(
        "{} + {} + {} + {} * (SELECT count(*) FROM items WHERE items.job_id = jobs.id)",
        bytes("payload"),
        bytes("result"),
        bytes("last_error_message"),
        limits::ITEM_BYTES_ESTIMATE
    );
    let mut sizes = format!("SELECT {} FROM jobs WHERE job_seq > $1", SizeCol::list_with(SizeCol::size, &size));
    sizes.push_str(&filter_sql(db.engine(), filter, &mut a));
    a.push(limit.into());
    sizes.push_str(&format!(" ORDER BY job_seq LIMIT ${}", a.len()));
    let sized = db.all_built(sizes, &a).await?;
    let (mut taken, mut bytes, mut last) = (0i64, 0i64, None);
    for r in &sized {
        let size = r.i64(SizeCol::size)?.saturating_add(limits::JOB_BYTES_OVERHEAD);
        if taken > 0 && bytes.saturating_add(size) > limits::PAGE_BYTES_MAX {
            break;
        }
        (taken, bytes, last) = (taken + 1, bytes.saturating_add(size), Some(r.i64(SizeCol::job_seq)?));
    }
    let Some(last) = last else { return Ok(Paged { rows: vec![], next_after: None }) };
    let cut_short = taken < sized.len() as i64;
    let mut within = filter.clone();
    within.until_seq = Some(within.until_seq.map_or(last, |u| u.min(last)));
    let mut a: Vec<Value> = vec![page.after.into()];
    let mut sql = format!("SELECT {} FROM jobs WHERE job_seq > $1", ops::JobCol::LIST);
    sql.push_str(&filter_sql(db.engine(), &within, &mut a));
    a.push(limit.into());
    sql.push_str(&format!(" ORDER BY job_seq LIMIT ${}", a.len()));
    let rows = db.all_built(sql, &a).await?.iter().map(job_row).collect::<Result<Vec<_>, _>>()?;
    let seqs: Vec<i64> = rows.iter().map(|r| r.job_seq).collect();
    let jobs = ops::attach_all(db, cx, rows).await?;
    let next = if cut_short { seqs.last().copied() } else { next_after(&seqs, limit, |s| *s) };
    Ok(Paged { rows: jobs, next_after: next })
}

columns! {
    /// An attempt as the attempt log shows it.
    AttemptCol { attempt_no, worker, started_at, finished_at, result, fail_code, message, success_at }
}

columns! {
    /// A logged signal.
    SignalCol { attempt_no, signal, fail_code, message, effect, received_at }
}

columns! {
    /// A row of the failure summary.
    FailureCol {
        code = "COALESCE(last_error_code, 'NONE')",
        bucket = "CASE WHEN state = 'queued' THEN 'retrying' ELSE state END",
        count = "COUNT(*)",
    }
}

pub(crate) async fn attempts(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Vec<Attempt>, StoreError> {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM attempts WHERE job_id = $1 ORDER BY attempt_no", AttemptCol::LIST));
    ops::must_read_job(db, cx, id).await?;
    let rows = db.all(&SQL, args![id]).await?;
    rows.iter()
        .map(|r| {
            use AttemptCol as C;
            let result = r.opt_text(C::result)?.map(|t| name(AttemptResult::parse, "attempt result", t)).transpose()?;
            // A success this attempt reported after it had ended otherwise (its lease expired, it
            // failed): the late success that recovered the job.
            let recovered_at = match result {
                Some(AttemptResult::Succeeded) | None => None,
                Some(_) => r.opt_i64(C::success_at)?.map(Timestamp::from_micros),
            };
            Ok(Attempt {
                attempt_no: u32::try_from(r.i64(C::attempt_no)?).map_err(StoreError::internal)?,
                worker: r.text(C::worker)?,
                started_at: Timestamp::from_micros(r.i64(C::started_at)?),
                finished_at: r.opt_i64(C::finished_at)?.map(Timestamp::from_micros),
                result,
                recovered_at,
                fail_code: r.opt_text(C::fail_code)?,
                message: r.opt_text(C::message)?,
            })
        })
        .collect()
}

/// A job's logged signals, the first `$2` in the order they came: those under its number (migration
/// 0036; and its id, as for its events) and those logged before the number was kept, each arm on its
/// partial index.
static JOB_SIGNALS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM (SELECT * FROM signals WHERE job_seq = (SELECT job_seq FROM jobs WHERE id = $1) AND job_id = $1 \
         UNION ALL SELECT * FROM signals WHERE job_id = $1 AND job_seq IS NULL) AS s ORDER BY id LIMIT $2",
        SignalCol::LIST
    )
});

pub(crate) async fn signals(db: &mut Db<'_>, id: &str) -> Result<Vec<SignalRecord>, StoreError> {
    // Recovered successes are kept past the bound: at most one per attempt beyond it.
    let bound = (limits::SIGNALS_LOGGED_MAX + limits::ATTEMPTS_MAX_LIMIT as usize) as i64;
    let rows = db.all(&JOB_SIGNALS, args![id, bound]).await?;
    rows.iter()
        .map(|r| {
            use SignalCol as C;
            Ok(SignalRecord {
                attempt_no: r.opt_i64(C::attempt_no)?.map(|n| n as u32),
                signal: name(Signal::parse, "signal", r.text(C::signal)?)?,
                fail_code: r.opt_text(C::fail_code)?,
                message: r.opt_text(C::message)?,
                effect: name(SignalEffect::parse, "signal effect", r.text(C::effect)?)?,
                received_at: Timestamp::from_micros(r.i64(C::received_at)?),
            })
        })
        .collect()
}

/// The jobs the failure summary counts: `jobs_open`'s predicate up to its last arm, in its words
/// (SQLite matches a partial index by the expression's text; migration 0033).
const OPEN_FAILED: &str = "(state = 'dead' OR state = 'unknown' OR (state = 'queued' AND last_error_code IS NOT NULL))";

/// Jobs now `dead`, `unknown` or waiting to retry, grouped by their last fail code.
pub(crate) async fn failure_summary(
    db: &mut Db<'_>,
    scope: &settle_core::scope::Scope,
) -> Result<Vec<FailureCount>, StoreError> {
    let mut a: Vec<Value> = Vec::new();
    let scoped = scope_sql(scope, &mut a, "account_id", Kinds::Column("kind"));
    let rows = db
        .all_built(
            format!(
                "SELECT {} \
                 FROM jobs WHERE {OPEN_FAILED}{scoped} \
                 GROUP BY 1, 2 ORDER BY 3 DESC, 1, 2",
                FailureCol::LIST
            ),
            &a,
        )
        .await?;
    rows.iter()
        .map(|r| {
            let state = name(FailureState::parse, "failure state", r.text(FailureCol::bucket)?)?;
            Ok(FailureCount { code: r.text(FailureCol::code)?, state, count: r.i64(FailureCol::count)? })
        })
        .collect()
}

columns! {
    /// A running job and the lease the rescuer saw.
    LeaseCol { job_seq, id, lease_token }
}

columns! {
    /// A job, by number and id.
    SeqIdCol { job_seq, id }
}

columns! {
    /// The earliest time a waiting job is due.
    DueCol { not_before = "MIN(not_before)" }
}

columns! {
    /// The totals of the jobs a filter selects; `net` (a sum over each job's entries) is selected
    /// as `0` unless asked for.
    TotalsCol {
        jobs = "COUNT(*)",
        cost = "CAST(COALESCE(SUM(cost), 0) AS bigint)",
        net = "CAST(COALESCE(SUM((SELECT COALESCE(SUM(amount), 0) FROM ledger_entries e WHERE e.job_id = jobs.id)), 0) AS bigint)",
        last_seq = "COALESCE(MAX(job_seq), 0)",
    }
}

columns! {
    /// An artifact as a job's history shows it.
    ArtifactCol { item_id, key, path = "COALESCE(path, key)", created_at }
}

columns! {
    /// How many of a job's signals were counted but not logged.
    UnloggedCol { signals_unlogged }
}

/// Running jobs whose lease has expired, with the token the rescuer saw.
/// Running jobs past their lease, after the cursor `after` (a job sequence number), in job order:
/// `(job_seq, id, lease_token)`.
pub(crate) async fn expired_leases(
    db: &mut Db<'_>,
    now: Timestamp,
    after: i64,
    limit: u32,
) -> Result<Vec<(i64, String, String)>, StoreError> {
    // The running jobs are read from the two partial indexes that hold them (migration 0033),
    // as every list of running jobs reads them (`running_seqs`).
    static SQL: LazyLock<[String; 2]> = LazyLock::new(|| {
        let sql = |engine| {
            format!(
                "SELECT {} FROM jobs WHERE state = 'running' AND lease_expires_at <= $1 AND job_seq > $2{} \
                 ORDER BY job_seq LIMIT $3",
                LeaseCol::LIST,
                running_seqs(engine)
            )
        };
        [sql(crate::db::Engine::Sqlite), sql(crate::db::Engine::Postgres)]
    });
    let sql = match db.engine() {
        crate::db::Engine::Sqlite => &SQL[0],
        crate::db::Engine::Postgres => &SQL[1],
    };
    let rows = db.all(sql, args![now.micros(), after, page_limit(limit)]).await?;
    use LeaseCol as C;
    rows.iter().map(|r| Ok((r.i64(C::job_seq)?, r.text(C::id)?, r.text(C::lease_token)?))).collect()
}

/// Jobs left `cancelling`, after the cursor `after`, in job order: `(job_seq, id)`.
/// A job whose cleanup failed waits for its retry time (decision 0028 §6).
pub(crate) async fn cancelling(
    db: &mut Db<'_>,
    now: Timestamp,
    after: i64,
    limit: u32,
) -> Result<Vec<(i64, String)>, StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM jobs WHERE state = 'cancelling' AND job_seq > $1 \
             AND NOT EXISTS (SELECT 1 FROM teardown_retries r WHERE r.job_id = jobs.id AND r.retry_at > $3) \
             ORDER BY job_seq LIMIT $2",
            SeqIdCol::LIST
        )
    });
    let rows = db.all(&SQL, args![after, page_limit(limit), now.micros()]).await?;
    rows.iter().map(|r| Ok((r.i64(SeqIdCol::job_seq)?, r.text(SeqIdCol::id)?))).collect()
}

pub(crate) async fn next_due_at(
    db: &mut Db<'_>,
    kinds: &[settle_core::ids::JobKind],
) -> Result<Option<Timestamp>, StoreError> {
    // Waiting jobs only (docs/design/fair-claims.md §4): a lined job is due now, and one the
    // worker could take would have been claimed; one it cannot take (its labels) must not wake it.
    let index = match db.engine() {
        crate::db::Engine::Sqlite => "INDEXED BY jobs_waiting_unparked ",
        crate::db::Engine::Postgres => "",
    };
    let mut sql = format!(
        "SELECT {} FROM jobs {index}WHERE state = 'queued' AND turn IS NULL AND parked = 0 AND {} AND cancel_requested = 0",
        DueCol::LIST,
        settle_core::job::not_reserved("kind")
    );
    let mut a: Vec<Value> = Vec::new();
    if !kinds.is_empty() {
        let params: Vec<String> = (1..=kinds.len()).map(|i| format!("${i}")).collect();
        sql.push_str(&format!(" AND kind IN ({})", params.join(", ")));
        a.extend(kinds.iter().map(|k| Value::from(k.as_str())));
    }
    let row = db.opt_built(sql, &a).await?;
    Ok(match row {
        Some(r) => r.opt_i64(DueCol::not_before)?.map(Timestamp::from_micros),
        None => None,
    })
}

/// `TotalsCol::net` on SQLite.
const NET_BY_NUMBER: &str = "CAST(COALESCE(SUM((SELECT COALESCE(SUM(amount), 0) FROM ledger_entries e WHERE e.job_seq = jobs.job_seq)), 0) AS bigint)";

pub(crate) async fn job_totals(db: &mut Db<'_>, filter: &JobFilter, net: bool) -> Result<JobTotals, StoreError> {
    use TotalsCol as C;
    let mut a = Vec::new();
    let list = match (net, db.engine()) {
        (false, _) => C::list_with(C::net, "0"),
        (true, Engine::Postgres) => C::LIST.to_owned(),
        // SQLite's lines are filed by their job's number (migration 0037).
        (true, Engine::Sqlite) => C::list_with(C::net, NET_BY_NUMBER),
    };
    let sql = format!("SELECT {list} FROM jobs WHERE 1 = 1{}", filter_sql(db.engine(), filter, &mut a));
    let row = db.opt_built(sql, &a).await?.ok_or_else(|| StoreError::internal("no totals row"))?;
    Ok(JobTotals {
        jobs: row.i64(C::jobs)?,
        cost: row.i64(C::cost)?,
        net: if net { Some(row.i64(C::net)?) } else { None },
        last_seq: row.i64(C::last_seq)?,
    })
}

/// A job's events, the first 1,000 by number: two arms, each on its partial index (migration
/// 0035) — the events under the job's number (and its id: a number a hand edit got wrong shows
/// nothing of another job), and those written before the number was kept. Ordered by `seq`, the
/// first column (the stamps' order, then each stamp's).
static HISTORY_EVENTS: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {list} FROM {from} WHERE e.job_seq = (SELECT job_seq FROM jobs WHERE id = $1) AND e.job_id = $1 \
         UNION ALL SELECT {list} FROM {from} WHERE e.job_id = $1 AND e.job_seq IS NULL \
         ORDER BY 1 LIMIT 1000",
        list = EventCol::LIST,
        from = ops::EVENTS
    )
});

/// A job's ledger lines: PostgreSQL's by its id, SQLite's by its number (migration 0037).
static ENTRIES: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM ledger_entries WHERE job_id = $1 ORDER BY seq", EntryCol::LIST));
static ENTRIES_LITE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM ledger_entries WHERE job_seq = (SELECT job_seq FROM jobs WHERE id = $1) ORDER BY seq",
        EntryCol::LIST
    )
});

pub(crate) async fn job_history(db: &mut Db<'_>, cx: &ops::Cx, id: &str) -> Result<JobHistory, StoreError> {
    static ARTIFACTS: LazyLock<String> = LazyLock::new(|| {
        format!("SELECT {} FROM artifacts WHERE job_id = $1 ORDER BY created_at, item_id, key", ArtifactCol::LIST)
    });
    static UNLOGGED: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM jobs WHERE id = $1", UnloggedCol::LIST));
    ops::must_read_job(db, cx, id).await?;
    let entries_sql = if db.engine() == Engine::Sqlite { &*ENTRIES_LITE } else { &*ENTRIES };
    let entries = (db.all(entries_sql, args![id]).await?.iter())
        .map(entry_from_row::<EntryCol>)
        .collect::<Result<Vec<_>, _>>()?;
    let events = (db.all(&HISTORY_EVENTS, args![id]).await?.iter())
        .map(event_from_row::<EventCol>)
        .collect::<Result<Vec<_>, _>>()?;
    let artifacts = (db.all(&ARTIFACTS, args![id]).await?.iter())
        .map(|r| {
            use ArtifactCol as C;
            Ok(ArtifactRecord {
                item_id: r.text(C::item_id)?,
                key: r.text(C::key)?,
                path: r.text(C::path)?,
                created_at: Timestamp::from_micros(r.i64(C::created_at)?),
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    let signals_unlogged = db.one(&UNLOGGED, args![id]).await?.i64(UnloggedCol::signals_unlogged)?;
    Ok(JobHistory { entries, events, artifacts, signals_unlogged })
}

#[cfg(test)]
mod tests {
    use std::sync::LazyLock;

    /// The statements that read a job's events and logged signals (migrations 0035, 0036), each
    /// with its PostgreSQL parameter types, the table they read, and the partial index each of their
    /// two arms must be planned on (SQLite's words).
    fn arms() -> [(&'static LazyLock<String>, &'static str, &'static str, [&'static str; 2]); 3] {
        [
            (&super::HISTORY_EVENTS, "text", "e", ["events_job_seq (job_seq=?)", "events_job (job_id=?)"]),
            (&super::JOB_SIGNALS, "text, bigint", "signals", ["signals_job_seq (job_seq=?)", "signals_job (job_id=?)"]),
            (
                &crate::ops::SIGNALS_KEPT,
                "text, bigint, bigint",
                "signals",
                ["signals_job_seq (job_seq=?)", "signals_job (job_id=?)"],
            ),
        ]
    }

    /// A new SQLite store, migrated, and a connection to it.
    async fn fresh_sqlite() -> (tempfile::TempDir, rusqlite::Connection) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("store.db");
        let url = format!("sqlite://{}", path.display());
        drop(crate::SqlStore::open(&url, crate::StoreOptions::default()).await.unwrap());
        let c = rusqlite::Connection::open(&path).unwrap();
        (dir, c)
    }

    /// SQLite's plan of `sql` (Settle's `$n` placeholders), one step a line, every parameter NULL.
    fn sqlite_plan(c: &rusqlite::Connection, sql: &str) -> Vec<String> {
        let mut plan = c.prepare(&format!("EXPLAIN QUERY PLAN {}", sql.replace('$', "?"))).unwrap();
        let nulls = vec![rusqlite::types::Null; plan.parameter_count()];
        let steps = plan.query_map(rusqlite::params_from_iter(nulls), |r| r.get::<_, String>(3)).unwrap();
        steps.collect::<Result<_, _>>().unwrap()
    }

    /// Each arm of a job's history and of its signal log is planned on its own partial index, by the
    /// job's number and by its id; none scans the table.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_a_jobs_events_and_signals_are_read_each_arm_on_its_partial_index() {
        let (_dir, c) = fresh_sqlite().await;
        for (sql, _, table, indexes) in arms() {
            let sql = sql.as_str();
            let steps = sqlite_plan(&c, sql);
            for index in indexes {
                let on = steps.iter().filter(|s| s.starts_with(&format!("SEARCH {table} USING INDEX {index}")));
                assert_eq!(on.count(), 1, "{index} in {sql}: {steps:#?}");
            }
            assert!(!steps.iter().any(|s| *s == format!("SCAN {table}")), "{sql}: {steps:#?}");
        }
    }

    /// SQLite's readers of a job's ledger lines and allocations (migration 0037): each is planned on
    /// the index by the job's number, none scans `ledger_entries` or `allocations`, and the audit's
    /// items pass merges its arms without sorting.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sqlite_a_jobs_lines_and_parts_are_read_by_its_number() {
        let (_dir, c) = fresh_sqlite().await;
        let totals = format!(
            "SELECT {} FROM jobs WHERE account_id = $1",
            super::TotalsCol::list_with(super::TotalsCol::net, super::NET_BY_NUMBER)
        );
        let items_pass = crate::audit::items_pass_sql(crate::audit::Jobs::Bounded, crate::db::Engine::Sqlite);
        // The audit from a checkpoint reads each touched job by itself (decision 0040).
        let items_one = crate::audit::items_pass_sql(crate::audit::Jobs::One, crate::db::Engine::Sqlite);
        let lines = "USING INDEX ledger_entries_job_seq";
        let parts = "USING INDEX allocations_job_seq";
        // The audit from a checkpoint: each account's lines after its position, by the positions' index.
        let after = crate::audit::ledger_after_sql(crate::Engine::Sqlite);
        let statements: [(&str, &[&str]); 10] = [
            (&super::ENTRIES_LITE, &[lines]),
            (&crate::ops::JOB_ITEMS_AND_NET_LITE, &[lines]),
            (&crate::ops::nets_by_number("IN ($1, $2)"), &[lines]),
            (&totals, &[lines]),
            (&super::super::accounts::JOB_ALLOCATIONS_LITE, &[parts]),
            (&items_pass, &[lines, parts, "USING INDEX allocations_item"]),
            (&items_one, &[lines, parts, "USING INDEX allocations_item"]),
            (&after, &["ledger_entries_account_seq (account_id=? AND account_seq>?)"]),
            (&crate::audit::EXPIRIES, &["ledger_entries_ref (kind=? AND ref_id>?)"]),
            (crate::audit_checkpoint::TOUCHED_BY_EVENTS, &["SCAN p", "SEARCH e USING PRIMARY KEY (stamp=?)"]),
        ];
        for (sql, indexes) in statements {
            let steps = sqlite_plan(&c, sql);
            for index in indexes {
                assert!(steps.iter().any(|s| s.contains(index)), "{index} in {sql}: {steps:#?}");
            }
            for table in ["ledger_entries", "allocations", "e", "a"] {
                assert!(!steps.iter().any(|s| *s == format!("SCAN {table}")), "{sql}: {steps:#?}");
            }
            if sql == items_pass || sql == items_one {
                assert!(!steps.iter().any(|s| s.contains("TEMP B-TREE")), "{sql}: {steps:#?}");
            }
        }
    }

    /// The same on PostgreSQL, under the generic plan a prepared statement settles on: the partial
    /// indexes' conditions are proved from the parameters (`job_seq = $x` implies `IS NOT NULL`).
    /// Sequential scans are priced out, so a scan of the table in the plan means an index could not
    /// be used at all.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_a_jobs_events_and_signals_are_read_each_arm_on_its_partial_index() {
        use sqlx::{ConnectOptions, Connection, Row};
        use std::str::FromStr;
        let url = settle_testkit::fresh_database().await;
        drop(crate::SqlStore::open(&url, crate::StoreOptions::default()).await.unwrap());
        let mut c = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        for sql in ["SET plan_cache_mode = force_generic_plan", "SET enable_seqscan = off"] {
            sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
        }
        for (n, (sql, types, table, indexes)) in arms().into_iter().enumerate() {
            let prepare = format!("PREPARE arms{n} ({types}) AS {}", sql.as_str());
            sqlx::raw_sql(sqlx::AssertSqlSafe(prepare)).execute(&mut c).await.unwrap();
            let args = ["'a-job'", "100", "1"][..types.split(',').count()].join(", ");
            let explain = format!("EXPLAIN EXECUTE arms{n}({args})");
            let plan = sqlx::raw_sql(sqlx::AssertSqlSafe(explain)).fetch_all(&mut c).await.unwrap();
            let plan: Vec<String> = plan.iter().map(|r| r.get::<String, _>(0)).collect();
            for index in indexes.map(|i| i.split(' ').next().unwrap()) {
                // `Index Scan using events_job on events e_1  (…)`, or `Bitmap Index Scan on events_job  (…)`.
                let (scan, bitmap) = (format!(" using {index} on "), format!("Bitmap Index Scan on {index} "));
                let on = plan.iter().filter(|l| l.contains(&scan) || l.contains(&bitmap)).count();
                assert_eq!(on, 1, "{index}: {plan:#?}");
            }
            let whole = if table == "e" { "events" } else { table };
            assert!(!plan.iter().any(|l| l.contains(&format!("Seq Scan on {whole}"))), "{plan:#?}");
        }
        c.close().await.unwrap();
    }

    /// The audit's statements that must read by an index on PostgreSQL whatever the estimates (the
    /// test prices sequential scans out, so a table scanned whole means no index could serve):
    /// each account's lines after the checkpoint by one range of `ledger_entries_account_seq` per
    /// account (the LATERAL subquery, not flattened into a join of the whole ledger), the touched
    /// jobs' items by their ids with `jobs` by its key, and the withdrawals by `jobs_rail`.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_the_audits_reads_after_a_checkpoint_take_their_indexes() {
        use sqlx::{ConnectOptions, Connection, Row};
        use std::str::FromStr;
        let url = settle_testkit::fresh_database().await;
        drop(crate::SqlStore::open(&url, crate::StoreOptions::default()).await.unwrap());
        let mut c = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        for sql in ["SET plan_cache_mode = force_generic_plan", "SET enable_seqscan = off"] {
            sqlx::raw_sql(sql).execute(&mut c).await.unwrap();
        }
        let many = crate::audit::items_pass_sql(crate::audit::Jobs::Many, crate::db::Engine::Postgres);
        let statements: [(String, &str, &str, &[&str]); 3] = [
            (
                crate::audit::ledger_after_sql(crate::db::Engine::Postgres),
                "",
                "",
                &["using ledger_entries_account_seq on ledger_entries l", "Index Cond: ((account_id = a.id) AND "],
            ),
            (many, "(text[])", "(ARRAY['a','b'])", &["jobs_pkey", "Index Cond: (id = ANY ($1))"]),
            (crate::audit_apart::WITHDRAWALS.clone(), "", "", &["jobs_rail"]),
        ];
        for (n, (sql, types, args, wanted)) in statements.into_iter().enumerate() {
            let prepare = format!("PREPARE audit{n} {types} AS {sql}");
            sqlx::raw_sql(sqlx::AssertSqlSafe(prepare)).execute(&mut c).await.unwrap();
            let explain = format!("EXPLAIN EXECUTE audit{n}{args}");
            let plan = sqlx::raw_sql(sqlx::AssertSqlSafe(explain)).fetch_all(&mut c).await.unwrap();
            let plan: Vec<String> = plan.iter().map(|r| r.get::<String, _>(0)).collect();
            for want in wanted {
                assert!(plan.iter().any(|l| l.contains(want)), "{want} in {sql}: {plan:#?}");
            }
            for table in ["ledger_entries", "jobs", "items"] {
                assert!(!plan.iter().any(|l| l.contains(&format!("Seq Scan on {table}"))), "{sql}: {plan:#?}");
            }
        }
        c.close().await.unwrap();
    }
}
