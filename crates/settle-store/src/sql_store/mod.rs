//! `SqlStore`: the `Store` for SQLite (embedded, one writer that batches) and PostgreSQL (many
//! processes, transactions batched in write lanes). The transitions themselves live in `ops` and
//! are shared; each engine's writer lives in `engine`. Here:
//!
//! - this module: opening either engine (with `crate::options`), and running operations (writes,
//!   reads, crash points);
//! - [`store`]: the `Store` trait, each method one operation (or a few, for teardown);
//! - [`payouts`]: the `Payouts` trait, the payout processor's side;
//! - [`teardown`]: a cancelling job's steps 2–3, after its refunds committed.

use crate::artifacts::ArtifactStore;
use crate::db::{Db, Engine};
use crate::engine::postgres::{PgShared, PlanCounts};
use crate::engine::primary::{Hosts, Leased, Primary};
use crate::engine::sequencer::Sequencer;
use crate::engine::{BatchOp, Env, Op, OpFn};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::plan::{Intent, IntentKind};
use crate::ops::{self, Caller, Cx};
pub use crate::options::{Durability, StoreOptions};
use futures_util::future::BoxFuture;
use settle_core::backoff::SplitMix64;
use settle_core::crash::CrashPoint;
use settle_core::ids::JobId;
use settle_core::limits;
use sqlx::postgres::PgPool;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Boxes an async block over `(db, cx)` as an operation.
/// Clones the listed captures into each run, so PostgreSQL can retry the whole operation.
/// Each operation ends with the top-ups its postings' crossings of an auto top-up rule make, in
/// its own transaction (`ops::auto_top_ups::after_operation`).
macro_rules! op {
    ([$($v:ident),*] |$db:ident, $cx:ident| $body:expr) => {
        Arc::new(move |$db: &mut Db<'_>, $cx: &Cx| -> BoxFuture<'_, _> {
            $(let $v = $v.clone();)*
            Box::pin(async move {
                $cx.crossings.lock().expect("crossings lock").clear();
                let out: Result<_, StoreError> = async { $body }.await;
                let out = out?;
                crate::ops::auto_top_ups::after_operation($db, $cx).await?;
                Ok(out)
            })
        })
    };
}

// After `op!`, which they use.
mod audits;
mod funding;
mod payouts;
mod route;
mod store;
mod teardown;

pub(crate) use route::Route;

enum Backend {
    Sqlite {
        writer: mpsc::Sender<Box<dyn BatchOp>>,
        readers: SqlitePool,
        /// The file, for reads that stream through a rusqlite connection of their own (the audit).
        path: std::path::PathBuf,
        /// The audit's connections, kept between audits.
        audits: Arc<audits::Kept>,
        /// The writer's and the checkpointer's threads, joined by `close`.
        threads: Vec<std::thread::JoinHandle<()>>,
    },
    /// `lanes` commits batches of operations, an account's on its own lane; `shared.transaction`
    /// runs one operation alone; `jobs` remembers whose account a job is, for the lanes.
    Postgres { shared: Arc<PgShared>, lanes: crate::engine::postgres::Lanes, jobs: route::JobAccounts },
}

pub struct SqlStore {
    backend: Backend,
    env: Env,
    /// Woken when a job may have become due (here, or in any process via LISTEN/NOTIFY).
    wake: Arc<tokio::sync::Notify>,
    /// Woken when events became readable: SQLite, after this process's writes that appended some;
    /// PostgreSQL, after a sequencer pass numbered some (here, or in any process via LISTEN).
    events_wake: Arc<tokio::sync::Notify>,
    artifacts: Option<Arc<dyn ArtifactStore>>,
    /// The other stores artifacts were registered in (by location), opened when a teardown needs
    /// them: a job's artifacts are deleted where they are, whatever this process is configured with.
    recorded: std::sync::Mutex<std::collections::HashMap<String, Arc<crate::artifacts::ObjectArtifactStore>>>,
    /// Where the next rescue and sweep passes start (job sequence numbers). Each pass takes the next
    /// page and wraps around at the end, so jobs whose step keeps failing never hide the ones behind
    /// them (a failing step writes nothing, so "oldest first" would return them every time).
    rescue_after: Mutex<i64>,
    sweep_after: Mutex<i64>,
}

/// The cursor after a page: its last row, or the beginning again when the page was the last one.
fn next_cursor(seqs: &[i64], limit: u32) -> i64 {
    match seqs.last() {
        Some(last) if seqs.len() as u32 >= limit.clamp(1, limits::PAGE_LIMIT_MAX) => *last,
        _ => 0,
    }
}

// `sqlite_migrations()` and `postgres_migrations()`: the files of `migrations/`, embedded by build.rs.
include!(concat!(env!("OUT_DIR"), "/migrations.rs"));

static SQLITE_MIGRATOR: LazyLock<sqlx::migrate::Migrator> =
    LazyLock::new(|| sqlx::migrate::Migrator::with_migrations(sqlite_migrations()));
/// Runs under sqlx's PostgreSQL advisory lock, so processes starting at once apply it once.
static POSTGRES_MIGRATOR: LazyLock<sqlx::migrate::Migrator> =
    LazyLock::new(|| sqlx::migrate::Migrator::with_migrations(postgres_migrations()));

impl SqlStore {
    /// The migrations applied to the store at `url` (none for an empty database), without opening
    /// it as a store: what `settle migrate` reports before and after.
    pub async fn schema_versions(url: &str) -> Result<Vec<i64>, StoreError> {
        use sqlx::{ConnectOptions, Connection};
        let sql = "SELECT version FROM _sqlx_migrations WHERE success ORDER BY version";
        if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url).map_err(|e| StoreError::invalid(e.to_string()))?;
            if !options.get_filename().exists() {
                return Ok(Vec::new());
            }
            let mut c = options.read_only(true).connect().await?;
            let versions = sqlx::query_scalar(sql).fetch_all(&mut c).await.unwrap_or_default();
            c.close().await?;
            Ok(versions)
        } else {
            let options =
                sqlx::postgres::PgConnectOptions::from_str(url).map_err(|e| StoreError::invalid(e.to_string()))?;
            let mut c = options.connect().await?;
            let versions = sqlx::query_scalar(sql).fetch_all(&mut c).await.unwrap_or_default();
            c.close().await?;
            Ok(versions)
        }
    }

    /// What names this binary's PostgreSQL schema: a hash of every migration's version and
    /// checksum. Two binaries with the same schema id make the same database from an empty one.
    pub fn postgres_schema_id() -> String {
        let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
        for m in POSTGRES_MIGRATOR.iter() {
            for byte in m.version.to_le_bytes().iter().chain(m.checksum.iter()) {
                hash = (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3);
            }
        }
        format!("{hash:016x}")
    }

    /// Applies this binary's migrations to the empty or Settle PostgreSQL database at `url` on one
    /// connection, closed before it returns: what opening a store does first, without the pools,
    /// the listener and the sequencer, whose connections outlive a close by a moment. The test kit
    /// makes its migrated template database with it.
    pub async fn migrate_postgres(url: &str) -> Result<(), StoreError> {
        let options =
            sqlx::postgres::PgConnectOptions::from_str(url).map_err(|e| StoreError::invalid(e.to_string()))?;
        let pool = sqlx::postgres::PgPoolOptions::new().max_connections(1).connect_with(options).await?;
        crate::identity::check_postgres(&pool, &POSTGRES_MIGRATOR).await?;
        let ran = POSTGRES_MIGRATOR.run(&pool).await.map_err(|e| StoreError::internal(format!("migrations: {e}")));
        pool.close().await;
        ran
    }

    /// Opens (creating if needed) the store at `url`: `sqlite://PATH`.
    pub async fn open(url: &str, options: StoreOptions) -> Result<SqlStore, StoreError> {
        if url.starts_with("sqlite:") {
            SqlStore::open_sqlite(url, options).await
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            SqlStore::open_postgres(url, options).await
        } else {
            Err(StoreError::invalid(format!(
                "unsupported database url {:?}: use sqlite://PATH or postgres://…",
                crate::db::redacted_url(url)
            )))
        }
    }

    async fn open_sqlite(url: &str, options: StoreOptions) -> Result<SqlStore, StoreError> {
        let base = SqliteConnectOptions::from_str(url)
            .map_err(|e| StoreError::invalid(format!("bad sqlite url {url:?}: {e}")))?
            .foreign_keys(true)
            .busy_timeout(options.busy_timeout)
            .synchronous(match options.durability {
                Durability::Full => SqliteSynchronous::Full,
                Durability::Normal => SqliteSynchronous::Normal,
            })
            .statement_cache_capacity(256);
        crate::identity::check_sqlite(&base, &SQLITE_MIGRATOR).await?;
        if !options.migrate && !base.get_filename().exists() {
            return Err(StoreError::NotSettle(format!(
                "no store at {}: create it with `settle migrate`, or start without --no-migrate",
                base.get_filename().display()
            )));
        }
        let mut writer = base.clone().create_if_missing(true).journal_mode(SqliteJournalMode::Wal).connect().await?;
        let path = base.get_filename().to_owned();
        if options.migrate {
            SQLITE_MIGRATOR.run(&mut writer).await.map_err(|e| StoreError::internal(format!("migrations: {e}")))?;
        } else {
            let applied = sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(&mut writer)
                .await
                .unwrap_or_default();
            crate::identity::require_current(&SQLITE_MIGRATOR, &applied)?;
        }
        // Marks the file as Settle's, for this check next time and for other tools.
        sqlx::raw_sql(sqlx::AssertSqlSafe(format!(
            "PRAGMA application_id = {}",
            crate::identity::SQLITE_APPLICATION_ID
        )))
        .execute(&mut writer)
        .await?;
        writer.close().await?;
        let readers = SqlitePoolOptions::new()
            .max_connections(options.sqlite_readers.max(1))
            .connect_with(base.read_only(true))
            .await?;
        let env = Env {
            clock: options.clock.clone(),
            policy: Arc::new(options.policy.clone()),
            rng: Arc::new(Mutex::new(SplitMix64::new(options.jitter_seed))),
            crash: options.crash.clone(),
            tokens: options.token_seed.map(|s| Arc::new(Mutex::new(SplitMix64::new(s)))),
            broken: options.broken,
            lines: Arc::default(),
        };
        let (tx, rx) = mpsc::channel(limits::WRITE_QUEUE_MAX);
        let conn = crate::engine::sqlite::open_writer(&path, &options)?;
        let checkpointer = crate::engine::sqlite::open_checkpointer(&path, &options)?;
        let threads = crate::engine::sqlite::spawn_writer(
            conn,
            rx,
            env.clone(),
            options.write_batch_max.clamp(1, limits::WRITE_BATCH_MAX),
            checkpointer,
        )?;
        Ok(SqlStore {
            backend: Backend::Sqlite { writer: tx, readers, path, threads, audits: Arc::default() },
            env,
            wake: Arc::new(tokio::sync::Notify::new()),
            events_wake: Arc::new(tokio::sync::Notify::new()),
            artifacts: options.artifacts,
            recorded: std::sync::Mutex::default(),
            rescue_after: Mutex::new(0),
            sweep_after: Mutex::new(0),
        })
    }

    async fn open_postgres(url: &str, options: StoreOptions) -> Result<SqlStore, StoreError> {
        let hosts = Hosts::parse(url)?.map(|o| {
            // Durability is the server's: every commit waits for its WAL flush (and, on a
            // formation, for a synchronous standby).
            o.options([
                ("synchronous_commit", "on".to_owned()),
                ("lock_timeout", format!("{}ms", options.pg_lock_timeout.as_millis().max(1))),
                ("statement_timeout", format!("{}ms", options.pg_statement_timeout.as_millis().max(1))),
            ])
        });
        // The writable primary among the URL's hosts (docs/decisions/0024); none is a refusal. A
        // formation's primary must also wait for a synchronous standby (docs/decisions/0027).
        let synchronous = options.pg_synchronous_standby.unwrap_or(hosts.count() > 1);
        let primary = Primary::find(hosts, synchronous).await?;
        let connect = primary.options();
        let pool = primary
            .pool_options()
            .max_connections(options.pg_max_connections)
            .acquire_timeout(options.pg_acquire_timeout)
            .connect_with(connect.clone())
            .await?;
        // LISTEN holds its connection for good, and the sequencer's passes must never wait for one
        // the writers hold: each has a pool of its own, outside the `pg_max_connections` the
        // transactions need.
        // Two each: a connection given up (a round past its limit, a listener that reconnects) is
        // closed in the background, and must not hold the only place while it is.
        let listen_pool = primary.pool_options().max_connections(2).connect_lazy_with(connect.clone());
        let sequencer_pool = primary
            .pool_options()
            .max_connections(2)
            .acquire_timeout(options.pg_acquire_timeout)
            .connect_lazy_with(connect);
        for p in [&pool, &listen_pool, &sequencer_pool] {
            primary.follow(p);
        }
        crate::identity::check_postgres(&pool, &POSTGRES_MIGRATOR).await?;
        if options.migrate {
            POSTGRES_MIGRATOR.run(&pool).await.map_err(|e| StoreError::internal(format!("migrations: {e}")))?;
        } else {
            let applied = sqlx::query_scalar("SELECT version FROM _sqlx_migrations WHERE success")
                .fetch_all(&pool)
                .await
                .unwrap_or_default();
            crate::identity::require_current(&POSTGRES_MIGRATOR, &applied)?;
        }
        let env = Env {
            clock: options.clock.clone(),
            policy: Arc::new(options.policy.clone()),
            rng: Arc::new(Mutex::new(SplitMix64::new(options.jitter_seed))),
            crash: options.crash.clone(),
            tokens: options.token_seed.map(|s| Arc::new(Mutex::new(SplitMix64::new(s)))),
            broken: options.broken,
            lines: Arc::default(),
        };
        let wake = Arc::new(tokio::sync::Notify::new());
        let events_wake = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(listen_for_wakeups(
            listen_pool,
            primary.clone(),
            Arc::downgrade(&wake),
            Arc::downgrade(&events_wake),
        ));
        let sequencer = Sequencer::spawn(sequencer_pool, events_wake.clone(), primary.clone());
        let shared = Arc::new(PgShared {
            pool,
            env: env.clone(),
            tx_retries: AtomicU64::new(0),
            plan: PlanCounts::default(),
            lock_timeout: options.pg_lock_timeout,
            sequencer,
            primary,
        });
        let lanes = crate::engine::postgres::spawn_lanes(
            shared.clone(),
            options.pg_write_lanes,
            options.write_batch_max,
            options.pg_batch_gather,
        );
        Ok(SqlStore {
            backend: Backend::Postgres { lanes, shared, jobs: route::JobAccounts::new() },
            env,
            wake,
            events_wake,
            artifacts: options.artifacts,
            recorded: std::sync::Mutex::default(),
            rescue_after: Mutex::new(0),
            sweep_after: Mutex::new(0),
        })
    }

    /// Closes the store and waits until it is closed: on SQLite the writer commits what it was
    /// given and stops, the checkpointer stops, the readers close; then another store may open the
    /// same file with nothing of this one still running (the simulator reopens after a crash). On
    /// PostgreSQL the pools close.
    pub async fn close(self) {
        match self.backend {
            Backend::Sqlite { writer, readers, threads, .. } => {
                drop(writer);
                readers.close().await;
                let _ = tokio::task::spawn_blocking(move || {
                    for t in threads {
                        let _ = t.join();
                    }
                })
                .await;
            }
            Backend::Postgres { shared, .. } => shared.pool.close().await,
        }
    }

    pub fn engine(&self) -> Engine {
        match self.backend {
            Backend::Sqlite { .. } => Engine::Sqlite,
            Backend::Postgres { .. } => Engine::Postgres,
        }
    }

    /// On PostgreSQL, a connection of the writers' pool answers and its server is not in recovery;
    /// on SQLite, a read answers.
    async fn ready_for_writes(&self) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Sqlite { readers, .. } => {
                sqlx::query("SELECT 1").execute(readers).await?;
                Ok(())
            }
            Backend::Postgres { shared, .. } => {
                let asked: Result<bool, StoreError> = sqlx::query_scalar("SELECT pg_is_in_recovery()")
                    .fetch_one(&shared.pool)
                    .await
                    .map_err(StoreError::from);
                match shared.observed_result(asked)? {
                    false => Ok(()),
                    true => Err(shared.observed(StoreError::Unavailable(format!(
                        "{} is a standby (in recovery), not the primary",
                        shared.primary.host()
                    )))),
                }
            }
        }
    }

    fn connection_stats(&self) -> DatabaseStats {
        match &self.backend {
            Backend::Sqlite { .. } => DatabaseStats::default(),
            Backend::Postgres { shared, .. } => {
                let c = &shared.primary.counters;
                DatabaseStats {
                    connections_opened: c.connections_opened.load(Ordering::Relaxed),
                    failover_signals: c.failover_signals.load(Ordering::Relaxed),
                    primary_changes: c.primary_changes.load(Ordering::Relaxed),
                    plan: shared.plan.tally(),
                    primary: Some(shared.primary.host()),
                }
            }
        }
    }

    /// How many PostgreSQL transactions were retried after a serialization failure, deadlock or
    /// concurrent create (a metric; always 0 on SQLite).
    pub fn tx_retries(&self) -> u64 {
        match &self.backend {
            Backend::Sqlite { .. } => 0,
            Backend::Postgres { shared, .. } => shared.tx_retries.load(Ordering::Relaxed),
        }
    }

    /// What the PostgreSQL lanes' phase 1 did so far (docs/design/batch-plan.md §12); zeros on
    /// SQLite.
    pub fn plan_counts(&self) -> PlanTally {
        match &self.backend {
            Backend::Sqlite { .. } => PlanTally::default(),
            Backend::Postgres { shared, .. } => shared.plan.tally(),
        }
    }

    /// Runs one write operation in its own transaction (SQLite: one operation of the writer's batch)
    /// and answers after the commit.
    /// A write that appends outbox events when it succeeds: wakes the events long-polls (on
    /// PostgreSQL the sequencer does, once it has numbered them).
    async fn write<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        self.write_to(Route::Any, f).await
    }

    /// `write`, for an operation on `route`'s rows (on PostgreSQL, queued on its account's lane).
    async fn write_to<T: Send + 'static>(&self, route: Route<'_>, f: OpFn<T>) -> Result<T, StoreError> {
        self.write_intent(route, None, f).await
    }

    /// `write_to`, for an operation with an intent: a PostgreSQL lane may lock and read its job
    /// together with the batch's others (docs/design/batch-plan.md §12).
    async fn write_intent<T: Send + 'static>(
        &self,
        route: Route<'_>,
        intent: Option<Intent>,
        f: OpFn<T>,
    ) -> Result<T, StoreError> {
        let out = self.write_inner(route, intent, f).await;
        if out.is_ok() {
            self.events_appended();
        }
        out
    }

    /// A write of this process appended events: on SQLite they are readable now, so the event
    /// long-polls are woken; on PostgreSQL the sequencer wakes them once it has numbered them.
    fn events_appended(&self) {
        if self.engine() == Engine::Sqlite {
            self.events_wake.notify_waiters();
        }
    }

    /// Returns once every event committed before the call is numbered, so a read that follows sees
    /// them all (PostgreSQL numbers events after their commit; SQLite at once).
    async fn events_ready(&self) -> Result<(), StoreError> {
        match &self.backend {
            Backend::Sqlite { .. } => Ok(()),
            Backend::Postgres { shared, .. } => shared.sequencer.sync().await,
        }
    }

    /// A write that appends nothing to the outbox (heartbeats, webhook bookkeeping): wakes no one,
    /// so a loop that waits on a wake-up never wakes itself.
    async fn write_quiet<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        self.write_inner(Route::Any, None, f).await
    }

    /// `write_quiet`, for an operation on `route`'s rows.
    async fn write_quiet_to<T: Send + 'static>(&self, route: Route<'_>, f: OpFn<T>) -> Result<T, StoreError> {
        self.write_inner(route, None, f).await
    }

    /// PostgreSQL: the job's account is `account`, for routing its later operations.
    fn remember_job(&self, job: &str, account: &str) {
        if let Backend::Postgres { jobs, .. } = &self.backend {
            jobs.remember(job, account);
        }
    }

    /// The account whose lane an operation on `route` queues on: the cache, else one read of the
    /// job (none when it does not exist: the operation itself answers that).
    async fn lane_account(&self, route: Route<'_>) -> Option<String> {
        let Backend::Postgres { shared, jobs, .. } = &self.backend else { return None };
        match route {
            Route::Any => None,
            Route::Account(a) => Some(a.to_owned()),
            Route::Job(j) => {
                if let Some(a) = jobs.get(j) {
                    return Some(a);
                }
                let found: Option<String> = sqlx::query_scalar("SELECT account_id FROM jobs WHERE id = $1")
                    .bind(j)
                    .fetch_optional(&shared.pool)
                    .await
                    .ok()
                    .flatten();
                if let Some(a) = &found {
                    jobs.remember(j, a);
                }
                found
            }
        }
    }

    /// A write whose answer is a ledger entry with its number (grants, adjustments: `ops::post_now`):
    /// on PostgreSQL in a transaction of its own, never in a lane's batch.
    async fn write_alone<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        let out = match &self.backend {
            Backend::Sqlite { .. } => self.write_inner(Route::Any, None, f).await,
            Backend::Postgres { shared, .. } => shared.transaction(f).await,
        };
        if out.is_ok() {
            self.events_appended();
        }
        out
    }

    /// A change of an account's cap: on PostgreSQL in a transaction of its own that closes the cap
    /// gate (`ops::close_cap_gate`, docs/design/fair-claims.md §10); SQLite's one writer needs none.
    async fn write_closing_gate<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        let out = match &self.backend {
            Backend::Sqlite { .. } => self.write_inner(Route::Any, None, f).await,
            Backend::Postgres { shared, .. } => shared.transaction_closing_gate(f).await,
        };
        if out.is_ok() {
            self.events_appended();
            // A raised or removed cap may let parked jobs return: the claims look again.
            self.work_due();
        }
        out
    }

    /// Work may have become due: wake the long-polling claims of this process.
    fn work_due(&self) {
        self.wake.notify_waiters();
    }

    async fn write_inner<T: Send + 'static>(
        &self,
        route: Route<'_>,
        intent: Option<Intent>,
        f: OpFn<T>,
    ) -> Result<T, StoreError> {
        let account = self.lane_account(route).await;
        match &self.backend {
            Backend::Sqlite { writer, .. } => {
                let (op, answer) = Op::boxed(f, None);
                writer.send(op).await.map_err(|_| StoreError::Unavailable("the writer has stopped".into()))?;
                answer.await.map_err(|_| StoreError::Unavailable("the writer dropped the operation".into()))?
            }
            Backend::Postgres { lanes, .. } => {
                let (op, answer) = Op::boxed(f, intent);
                lanes.send(account.as_deref(), op).await?;
                answer.await.map_err(|_| StoreError::Unavailable("the write lanes dropped the operation".into()))?
            }
        }
    }

    /// Runs reads on one consistent snapshot.
    async fn read<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        match &self.backend {
            Backend::Sqlite { readers, .. } => {
                let mut tx = readers.begin().await?;
                let cx = self.env.cx(None);
                let out = {
                    let mut db = Db::sqlite(&mut tx);
                    f(&mut db, &cx).await
                };
                tx.rollback().await?;
                out
            }
            Backend::Postgres { shared, .. } => {
                // Closed, not returned, unless the read ends cleanly (a dropped future included).
                let mut conn = Leased::acquire(&shared.pool).await.map_err(|e| shared.observed(e.into()))?;
                // One snapshot for every statement of the read (the audit above all).
                let mut tx =
                    sqlx::Connection::begin_with(&mut *conn, "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY")
                        .await
                        .map_err(|e| shared.observed(e.into()))?;
                let cx = self.env.cx(None);
                let out = {
                    let mut db = Db::pg(&mut tx);
                    f(&mut db, &cx).await
                };
                shared.observe(&out);
                tx.rollback().await.map_err(|e| shared.observed(e.into()))?;
                conn.clean_unless_unavailable(&out);
                out
            }
        }
    }

    fn crash_point(&self, point: CrashPoint) -> Result<(), StoreError> {
        match &self.env.crash {
            Some(hook) if hook.should_crash(point) => Err(StoreError::InjectedCrash(point.name())),
            _ => Ok(()),
        }
    }

    /// A failure signal from a worker or from the payout processor (each may move only its jobs).
    async fn fail_as(&self, job: &JobId, signal: FailSignal, caller: Caller) -> Result<Outcome<Job>, StoreError> {
        check_text("message", signal.message.as_deref(), false)?;
        let id = job.clone();
        let intent = Intent { job: job.as_str().to_owned(), kind: IntentKind::Fail };
        let (outcome, after, refused) = self
            .write_intent(
                Route::Job(job.as_str()),
                Some(intent),
                op!([id, signal] | db, cx | ops::fail(db, cx, &id, &signal, caller).await),
            )
            .await?;
        if outcome.applied {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        answer(self.continue_after(outcome.value, after).await, outcome.applied, refused)
    }

    /// A release by the lease holder (a worker that must stop): back to `queued`, due now, or the
    /// teardown when a cancel was requested.
    async fn release_as(&self, job: &JobId, token: &LeaseToken, caller: Caller) -> Result<Outcome<Job>, StoreError> {
        let (id, token) = (job.clone(), token.clone());
        let (outcome, after, refused) = self
            .write_to(
                Route::Job(job.as_str()),
                op!([id, token] | db, cx | ops::release(db, cx, &id, &token, caller).await),
            )
            .await?;
        if outcome.applied {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        answer(self.continue_after(outcome.value, after).await, outcome.applied, refused)
    }

    async fn unknown_as(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
        caller: Caller,
    ) -> Result<Outcome<Job>, StoreError> {
        check_text("message", message, false)?;
        let (id, token, message) = (job.clone(), token.clone(), message.map(str::to_owned));
        let (out, refused) = self
            .write_to(
                Route::Job(job.as_str()),
                op!(
                    [id, token, message] | db,
                    cx | ops::mark_unknown(db, cx, &id, &token, message.as_deref(), caller).await
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        match refused {
            Some(r) => Err(StoreError::LeaseLost(r)),
            None => Ok(out),
        }
    }

    async fn heartbeat_as(&self, job: &JobId, token: &LeaseToken, caller: Caller) -> Result<Heartbeat, StoreError> {
        let route = Route::Job(job.as_str());
        let (job, token) = (job.clone(), token.clone());
        let out = self
            .write_quiet_to(route, op!([job, token] | db, cx | ops::heartbeat(db, cx, &job, &token, caller).await))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }
}

/// PostgreSQL LISTEN for `settle_wake` (a job may have become due in some process: wakes this
/// process's long-polling claims) and `settle_events` (a sequencer numbered events: wakes the event
/// long-polls, the webhook loop and `events tail`). Both are hints: every waiter also looks again on
/// a timer. Reconnects after a lost connection, and after a failover signal newer than its
/// connection (the server it listens on may be a standby now: docs/decisions/0024); ends when the
/// store is dropped.
async fn listen_for_wakeups(
    pool: PgPool,
    primary: Arc<Primary>,
    wake: std::sync::Weak<tokio::sync::Notify>,
    events_wake: std::sync::Weak<tokio::sync::Notify>,
) {
    loop {
        if wake.strong_count() == 0 {
            return;
        }
        let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot LISTEN for wake-ups; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                continue;
            }
        };
        let since = std::time::Instant::now();
        if let Err(e) = listener.listen_all(["settle_wake", "settle_events"]).await {
            tracing::warn!(error = %e, "LISTEN settle_wake, settle_events failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        loop {
            let next = tokio::time::timeout(Duration::from_secs(1), listener.recv()).await;
            let (Some(w), Some(ew)) = (wake.upgrade(), events_wake.upgrade()) else { return };
            match next {
                Ok(Ok(n)) if n.channel() == "settle_events" => ew.notify_waiters(),
                Ok(Ok(_)) => w.notify_waiters(),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "wake-up listener lost its connection; reconnecting");
                    break;
                }
                Err(_) => {} // no notification for 1 s: look again whether the store still exists
            }
            if !primary.is_after_epoch(since.elapsed()) {
                tracing::info!("a failover signal since LISTEN began; listening again on the primary");
                // Wakes every waiter: a notification may have been lost with the old server.
                w.notify_waiters();
                ew.notify_waiters();
                break;
            }
        }
    }
}

/// A report's answer after its commit and continuation. A refusal stays a refusal whatever the
/// continuation (a resumed teardown) met: the sweeper finishes what it could not.
pub(super) fn answer(
    continued: Result<Job, StoreError>,
    applied: bool,
    refused: Option<Box<LeaseLost>>,
) -> Result<Outcome<Job>, StoreError> {
    match (refused, continued) {
        (Some(r), Err(e)) => {
            tracing::warn!(error = %e, job = %r.job, "resuming a teardown after a refused report failed; the sweeper goes on");
            Err(StoreError::LeaseLost(r))
        }
        (Some(r), Ok(_)) => Err(StoreError::LeaseLost(r)),
        (None, continued) => Ok(Outcome { value: continued?, applied }),
    }
}

fn lease_lost(refused: ops::Refused) -> StoreError {
    StoreError::LeaseLost(refused.0)
}

fn check_text(what: &str, s: Option<&str>, required: bool) -> Result<(), StoreError> {
    match s {
        None if required => Err(StoreError::invalid(format!("{what} is required"))),
        Some(t) if t.len() > limits::MESSAGE_LEN_MAX => {
            Err(StoreError::invalid(format!("{what} is longer than {} bytes", limits::MESSAGE_LEN_MAX)))
        }
        Some("") if required => Err(StoreError::invalid(format!("{what} is required"))),
        _ => Ok(()),
    }
}
