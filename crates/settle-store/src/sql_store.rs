//! `SqlStore`: the `Store` for SQLite (embedded, one writer that batches) and PostgreSQL (many
//! processes, one READ COMMITTED transaction per operation). The transitions themselves live in
//! `ops` and are shared; this file is transactions, batching, teardown steps 2–3 and crash points.

use crate::artifacts::ArtifactStore;
use crate::db::{Db, Engine};
use crate::engine::postgres::PgShared;
use crate::engine::{BatchOp, Env, Op, OpFn};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, After, Caller, CrashHook, Cx};
use crate::store::{Payouts, Store};
use crate::{audit, payouts, reads, webhooks};
use async_trait::async_trait;
use futures_util::future::BoxFuture;
use settle_core::backoff::SplitMix64;
use settle_core::crash::CrashPoint;
use settle_core::ids::{AccountId, FailCode, ItemId, JobId};
use settle_core::job::Policies;
use settle_core::ledger::EntryKind;
use settle_core::{Clock, Credits, SystemClock, limits};
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous};
use sqlx::{ConnectOptions, Connection};
use std::str::FromStr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// Boxes an async block over `(db, cx)` as an operation.
/// Clones the listed captures into each run, so PostgreSQL can retry the whole operation.
macro_rules! op {
    ([$($v:ident),*] |$db:ident, $cx:ident| $body:expr) => {
        Arc::new(move |$db: &mut Db<'_>, $cx: &Cx| -> BoxFuture<'_, _> {
            $(let $v = $v.clone();)*
            Box::pin(async move { $body })
        })
    };
}

/// SQLite durability. `Full` (the default) fsyncs the WAL at every commit; `Normal` may lose the
/// last commits on power loss (never corrupts) and exists for benchmarks and throwaway stores.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Durability {
    Full,
    Normal,
}

/// How a store is opened. Every option is explicit; `StoreOptions::default()` is production.
#[derive(Clone)]
pub struct StoreOptions {
    pub clock: Arc<dyn Clock>,
    /// Retry, lease and refund policy per job kind.
    pub policy: Policies,
    /// Seed of the backoff jitter generator (fixed in tests for reproducible schedules).
    pub jitter_seed: u64,
    pub durability: Durability,
    /// Most operations the SQLite writer commits in one transaction (1 disables batching).
    pub write_batch_max: usize,
    /// SQLite readers (WAL lets them run beside the writer).
    pub sqlite_readers: u32,
    pub busy_timeout: Duration,
    /// PostgreSQL connections per process.
    pub pg_max_connections: u32,
    /// PostgreSQL write lanes per process: tasks committing batches of operations in parallel
    /// (docs/decisions/0013); each holds one of the `pg_max_connections` while it commits.
    pub pg_write_lanes: usize,
    /// How long a PostgreSQL statement waits for a row lock, and runs at most; past either the
    /// transaction is rolled back and the caller gets `Busy` (`503` with `Retry-After`).
    pub pg_lock_timeout: Duration,
    pub pg_statement_timeout: Duration,
    /// How long a request waits for a PostgreSQL connection — including reconnecting to a server
    /// that is down — before it is answered `Unavailable` (`503`): a client hears within this
    /// bound that the database is away, instead of hanging.
    pub pg_acquire_timeout: Duration,
    pub artifacts: Option<Arc<dyn ArtifactStore>>,
    pub crash: Option<Arc<dyn CrashHook>>,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            clock: Arc::new(SystemClock),
            policy: Policies::default(),
            jitter_seed: SystemClock.now().micros() as u64,
            durability: Durability::Full,
            write_batch_max: limits::WRITE_BATCH_MAX,
            sqlite_readers: 4,
            busy_timeout: Duration::from_secs(5),
            pg_max_connections: 16,
            pg_write_lanes: 4,
            pg_lock_timeout: Duration::from_secs(10),
            pg_statement_timeout: Duration::from_secs(60),
            pg_acquire_timeout: Duration::from_secs(5),
            artifacts: None,
            crash: None,
        }
    }
}

enum Backend {
    Sqlite {
        writer: mpsc::Sender<Box<dyn BatchOp>>,
        readers: SqlitePool,
        /// The file, for reads that stream through a rusqlite connection of their own (the audit).
        path: std::path::PathBuf,
    },
    /// `lanes` commits batches of operations; `shared.transaction` runs one operation alone.
    Postgres { shared: Arc<PgShared>, lanes: mpsc::Sender<Box<dyn BatchOp>> },
}

pub struct SqlStore {
    backend: Backend,
    env: Env,
    /// Woken when a job may have become due (here, or in any process via LISTEN/NOTIFY).
    wake: Arc<tokio::sync::Notify>,
    /// Woken when this process appended outbox events.
    events_wake: Arc<tokio::sync::Notify>,
    artifacts: Option<Arc<dyn ArtifactStore>>,
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

static SQLITE_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/sqlite");
/// Runs under sqlx's PostgreSQL advisory lock, so processes starting at once apply it once.
static POSTGRES_MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("./migrations/postgres");

impl SqlStore {
    /// Opens (creating if needed) the store at `url`: `sqlite://PATH`.
    pub async fn open(url: &str, options: StoreOptions) -> Result<SqlStore, StoreError> {
        if url.starts_with("sqlite:") {
            SqlStore::open_sqlite(url, options).await
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            SqlStore::open_postgres(url, options).await
        } else {
            Err(StoreError::invalid(format!("unsupported database url {url:?}: use sqlite://PATH or postgres://…")))
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
        let mut writer = base.clone().create_if_missing(true).journal_mode(SqliteJournalMode::Wal).connect().await?;
        let path = base.get_filename().to_owned();
        SQLITE_MIGRATOR.run(&mut writer).await.map_err(|e| StoreError::internal(format!("migrations: {e}")))?;
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
        };
        let (tx, rx) = mpsc::channel(limits::WRITE_QUEUE_MAX);
        let conn = crate::engine::sqlite::open_writer(&path, &options)?;
        let checkpointer = crate::engine::sqlite::open_checkpointer(&path, &options)?;
        crate::engine::sqlite::spawn_writer(
            conn,
            rx,
            env.clone(),
            options.write_batch_max.clamp(1, limits::WRITE_BATCH_MAX),
            checkpointer,
        )?;
        Ok(SqlStore {
            backend: Backend::Sqlite { writer: tx, readers, path },
            env,
            wake: Arc::new(tokio::sync::Notify::new()),
            events_wake: Arc::new(tokio::sync::Notify::new()),
            artifacts: options.artifacts,
            rescue_after: Mutex::new(0),
            sweep_after: Mutex::new(0),
        })
    }

    async fn open_postgres(url: &str, options: StoreOptions) -> Result<SqlStore, StoreError> {
        let connect = PgConnectOptions::from_str(url)
            .map_err(|e| StoreError::invalid(format!("bad postgres url: {e}")))?
            // Durability is the server's: every commit waits for its WAL flush.
            .options([
                ("synchronous_commit", "on".to_owned()),
                ("lock_timeout", format!("{}ms", options.pg_lock_timeout.as_millis().max(1))),
                ("statement_timeout", format!("{}ms", options.pg_statement_timeout.as_millis().max(1))),
            ]);
        let pool = PgPoolOptions::new()
            .max_connections(options.pg_max_connections)
            .acquire_timeout(options.pg_acquire_timeout)
            .connect_with(connect.clone())
            .await?;
        // LISTEN holds its connection for good: give it a pool of its own, so it never takes one of
        // the `pg_max_connections` the transactions need.
        let listen_pool = PgPoolOptions::new().max_connections(1).connect_lazy_with(connect);
        crate::identity::check_postgres(&pool, &POSTGRES_MIGRATOR).await?;
        POSTGRES_MIGRATOR.run(&pool).await.map_err(|e| StoreError::internal(format!("migrations: {e}")))?;
        let env = Env {
            clock: options.clock.clone(),
            policy: Arc::new(options.policy.clone()),
            rng: Arc::new(Mutex::new(SplitMix64::new(options.jitter_seed))),
            crash: options.crash.clone(),
        };
        let wake = Arc::new(tokio::sync::Notify::new());
        tokio::spawn(listen_for_wakeups(listen_pool, Arc::downgrade(&wake)));
        let shared = Arc::new(PgShared {
            pool,
            env: env.clone(),
            tx_retries: AtomicU64::new(0),
            lock_timeout: options.pg_lock_timeout,
        });
        let lanes =
            crate::engine::postgres::spawn_lanes(shared.clone(), options.pg_write_lanes, options.write_batch_max);
        Ok(SqlStore {
            backend: Backend::Postgres { lanes, shared },
            env,
            wake,
            events_wake: Arc::new(tokio::sync::Notify::new()),
            artifacts: options.artifacts,
            rescue_after: Mutex::new(0),
            sweep_after: Mutex::new(0),
        })
    }

    pub fn engine(&self) -> Engine {
        match self.backend {
            Backend::Sqlite { .. } => Engine::Sqlite,
            Backend::Postgres { .. } => Engine::Postgres,
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

    /// Runs one write operation in its own transaction (SQLite: a savepoint in the writer's batch)
    /// and answers after the commit.
    /// A write that appends outbox events when it succeeds: wakes the events long-polls.
    async fn write<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        let out = self.write_inner(f).await;
        if out.is_ok() {
            self.events_wake.notify_waiters();
        }
        out
    }

    /// A write that appends nothing to the outbox (heartbeats, webhook bookkeeping): wakes no one,
    /// so a loop that waits on a wake-up never wakes itself.
    async fn write_quiet<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        self.write_inner(f).await
    }

    /// A write whose answer is a ledger entry with its number (grants, adjustments: `ops::post_now`):
    /// on PostgreSQL in a transaction of its own, never in a lane's batch.
    async fn write_alone<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        let out = match &self.backend {
            Backend::Sqlite { .. } => self.write_inner(f).await,
            Backend::Postgres { shared, .. } => shared.transaction(f).await,
        };
        if out.is_ok() {
            self.events_wake.notify_waiters();
        }
        out
    }

    /// Work may have become due: wake the long-polling claims of this process.
    fn work_due(&self) {
        self.wake.notify_waiters();
    }

    async fn write_inner<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        match &self.backend {
            Backend::Sqlite { writer, .. } => {
                let (op, answer) = Op::boxed(f);
                writer.send(op).await.map_err(|_| StoreError::Unavailable("the writer has stopped".into()))?;
                answer.await.map_err(|_| StoreError::Unavailable("the writer dropped the operation".into()))?
            }
            Backend::Postgres { lanes, .. } => {
                let (op, answer) = Op::boxed(f);
                lanes.send(op).await.map_err(|_| StoreError::Unavailable("the write lanes have stopped".into()))?;
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
                    let mut db = Db::Sqlite(&mut tx);
                    f(&mut db, &cx).await
                };
                tx.rollback().await?;
                out
            }
            Backend::Postgres { shared, .. } => {
                let pool = &shared.pool;
                // One snapshot for every statement of the read (the audit above all).
                let mut tx = pool.begin_with("BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY").await?;
                let cx = self.env.cx(None);
                let out = {
                    let mut db = Db::Pg(&mut tx);
                    f(&mut db, &cx).await
                };
                tx.rollback().await?;
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

    /// Teardown steps 2 and 3, after step 1 committed: delete the artifacts of every undelivered
    /// item (a full rescan, each delete idempotent), then `cancelling → cancelled`, last.
    /// A cleanup failure leaves the job `cancelling` and is returned as `CleanupFailed`.
    async fn finish_teardown(&self, id: &str) -> Result<Job, StoreError> {
        self.crash_point(CrashPoint::TeardownAfterRefund)?;
        let owned = id.to_owned();
        let keys = self.read(op!([owned] | db, _cx | ops::cleanup_keys(db, &owned).await)).await?;
        if !keys.is_empty() {
            let Some(artifacts) = &self.artifacts else {
                return Err(StoreError::CleanupFailed {
                    job: id.to_owned(),
                    message: "no artifact store is configured".into(),
                });
            };
            for key in &keys {
                artifacts
                    .delete(key)
                    .await
                    .map_err(|message| StoreError::CleanupFailed { job: id.to_owned(), message })?;
            }
        }
        self.crash_point(CrashPoint::TeardownAfterCleanup)?;
        let owned = id.to_owned();
        let job = self.write(op!([owned] | db, cx | ops::finish_teardown(db, cx, &owned).await)).await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(job)
    }

    /// A failure signal from a worker or from the payout processor (each may move only its jobs).
    async fn fail_as(&self, job: &JobId, signal: FailSignal, caller: Caller) -> Result<Outcome<Job>, StoreError> {
        check_text("message", signal.message.as_deref(), false)?;
        let id = job.clone();
        let (outcome, after) =
            self.write(op!([id, signal] | db, cx | ops::fail(db, cx, &id, &signal, caller).await)).await?;
        if outcome.applied {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        let value = self.continue_after(outcome.value, after).await?;
        Ok(Outcome { value, applied: outcome.applied })
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
        let out = self
            .write(op!(
                [id, token, message] | db,
                cx | ops::mark_unknown(db, cx, &id, &token, message.as_deref(), caller).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn heartbeat_as(&self, job: &JobId, token: &LeaseToken, caller: Caller) -> Result<Heartbeat, StoreError> {
        let (job, token) = (job.clone(), token.clone());
        let out =
            self.write_quiet(op!([job, token] | db, cx | ops::heartbeat(db, cx, &job, &token, caller).await)).await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }

    /// Continues a transition that left teardown to do; a cleanup failure is not an error for the
    /// signal that caused it: the job stays `cancelling` for the sweeper.
    async fn continue_after(&self, job: Job, after: After) -> Result<Job, StoreError> {
        match after {
            After::Nothing => Ok(job),
            After::Teardown => match self.finish_teardown(&job.id).await {
                Ok(done) => Ok(done),
                Err(StoreError::CleanupFailed { job: id, message }) => {
                    tracing::warn!(job = %id, %message, "artifact cleanup failed; the job stays cancelling for the sweeper");
                    self.job(&JobId::parse(&id)?).await
                }
                Err(e) => Err(e),
            },
        }
    }
}

/// PostgreSQL LISTEN for `settle_wake`: wakes this process's long-polls when any process makes a
/// job due. Reconnects after a lost connection; ends when the store is dropped.
async fn listen_for_wakeups(pool: PgPool, wake: std::sync::Weak<tokio::sync::Notify>) {
    loop {
        let mut listener = match sqlx::postgres::PgListener::connect_with(&pool).await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!(error = %e, "cannot LISTEN for wake-ups; retrying");
                tokio::time::sleep(Duration::from_secs(1)).await;
                if wake.strong_count() == 0 {
                    return;
                }
                continue;
            }
        };
        if let Err(e) = listener.listen("settle_wake").await {
            tracing::warn!(error = %e, "LISTEN settle_wake failed; retrying");
            tokio::time::sleep(Duration::from_secs(1)).await;
            continue;
        }
        loop {
            let next = tokio::time::timeout(Duration::from_secs(5), listener.recv()).await;
            let Some(w) = wake.upgrade() else { return };
            match next {
                Ok(Ok(_)) => w.notify_waiters(),
                Ok(Err(e)) => {
                    tracing::warn!(error = %e, "wake-up listener lost its connection; reconnecting");
                    break;
                }
                Err(_) => {} // no notification for 5 s: look again whether the store still exists
            }
        }
    }
}

fn lease_lost(stale: ops::Stale) -> StoreError {
    StoreError::LeaseLost(stale.0)
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

#[async_trait]
impl Store for SqlStore {
    fn engine_name(&self) -> &'static str {
        self.engine().name()
    }

    fn payouts(&self) -> &dyn Payouts {
        self
    }

    fn wake(&self) -> Arc<tokio::sync::Notify> {
        self.wake.clone()
    }

    fn events_wake(&self) -> Arc<tokio::sync::Notify> {
        self.events_wake.clone()
    }

    fn now(&self) -> settle_core::Timestamp {
        self.env.clock.now()
    }

    async fn next_due_at(
        &self,
        kinds: &[settle_core::ids::JobKind],
    ) -> Result<Option<settle_core::Timestamp>, StoreError> {
        let kinds = kinds.to_vec();
        self.read(op!([kinds] | db, _cx | reads::next_due_at(db, &kinds).await)).await
    }

    async fn create_account_by(&self, req: NewAccount, actor: &str) -> Result<Created<Account>, StoreError> {
        let actor = actor.to_owned();
        let out = self
            .write(op!(
                [req, actor] | db,
                cx | {
                    let out = ops::create_account(db, cx, &req).await?;
                    if !out.replayed {
                        let detail = serde_json::json!({ "overdraft_limit": req.overdraft_limit.get() });
                        ops::record_action(db, cx, &actor, "account.create", None, Some(req.id.as_str()), detail)
                            .await?;
                    }
                    Ok(out)
                }
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn actions(&self, job: Option<&JobId>, account: Option<&AccountId>) -> Result<Vec<Action>, StoreError> {
        let (job, account) = (job.map(|j| j.as_str().to_owned()), account.map(|a| a.as_str().to_owned()));
        self.read(op!([job, account] | db, _cx | reads::actions(db, job.as_deref(), account.as_deref()).await)).await
    }

    async fn account(&self, id: &AccountId) -> Result<Account, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, _cx | reads::account(db, &id).await)).await
    }

    async fn grant_by(
        &self,
        account: &AccountId,
        req: NewGrant,
        actor: &str,
    ) -> Result<Created<LedgerEntry>, StoreError> {
        if !req.amount.is_positive() {
            return Err(StoreError::invalid("a grant's amount must be greater than zero"));
        }
        check_text("reason", req.reason.as_deref(), false)?;
        let (account, actor) = (account.clone(), actor.to_owned());
        let out = self
            .write_alone(op!([account, req, actor] | db, cx | {
                let out = ops::credit(
                    db,
                    cx,
                    EntryKind::Grant,
                    &account,
                    req.id.as_str(),
                    req.amount,
                    req.reason.as_deref(),
                )
                .await?;
                if !out.replayed {
                    let detail = serde_json::json!({ "id": req.id.as_str(), "amount": req.amount.get(), "seq": out.value.seq });
                    ops::record_action(db, cx, &actor, "grant", None, Some(account.as_str()), detail).await?;
                }
                Ok(out)
            }))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn adjust_by(
        &self,
        account: &AccountId,
        req: NewAdjustment,
        actor: &str,
    ) -> Result<Created<LedgerEntry>, StoreError> {
        if req.amount == Credits::ZERO {
            return Err(StoreError::invalid("an adjustment's amount must not be zero"));
        }
        check_text("reason", Some(&req.reason), true)?;
        let (account, actor) = (account.clone(), actor.to_owned());
        let out = self
            .write_alone(op!([account, req, actor] | db, cx | {
                let out = ops::credit(
                    db,
                    cx,
                    EntryKind::Adjustment,
                    &account,
                    req.id.as_str(),
                    req.amount,
                    Some(&req.reason),
                )
                .await?;
                if !out.replayed {
                    let detail = serde_json::json!({
                        "id": req.id.as_str(), "amount": req.amount.get(), "reason": req.reason, "seq": out.value.seq
                    });
                    ops::record_action(db, cx, &actor, "adjustment", None, Some(account.as_str()), detail).await?;
                }
                Ok(out)
            }))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn ledger(&self, account: &AccountId, page: Page) -> Result<Paged<LedgerEntry>, StoreError> {
        let account = account.clone();
        self.read(op!([account] | db, _cx | reads::ledger(db, &account, page).await)).await
    }

    async fn create_job(&self, req: NewJob) -> Result<Created<Job>, StoreError> {
        ops::validate_job(&req)?;
        let out = self.write(op!([req] | db, cx | ops::create_job(db, cx, &req).await)).await?;
        if !out.replayed {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn job(&self, id: &JobId) -> Result<Job, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, cx | ops::must_read_job(db, cx, id.as_str()).await)).await
    }

    async fn jobs(&self, filter: &JobFilter, page: Page) -> Result<Paged<Job>, StoreError> {
        let filter = filter.clone();
        self.read(op!([filter] | db, cx | reads::jobs(db, cx, &filter, page).await)).await
    }

    async fn claim(&self, req: ClaimRequest) -> Result<Vec<ClaimedJob>, StoreError> {
        if req.lease_seconds.is_some_and(|s| !(limits::LEASE_SECONDS_MIN..=limits::LEASE_SECONDS_MAX).contains(&s)) {
            return Err(StoreError::invalid(format!(
                "lease_seconds must be between {} and {}",
                limits::LEASE_SECONDS_MIN,
                limits::LEASE_SECONDS_MAX
            )));
        }
        if req.limit == 0 || req.limit > limits::CLAIM_LIMIT_MAX {
            return Err(StoreError::invalid(format!("limit must be between 1 and {}", limits::CLAIM_LIMIT_MAX)));
        }
        if req.kinds.len() > limits::CLAIM_KINDS_MAX {
            return Err(StoreError::invalid(format!("at most {} kinds per claim", limits::CLAIM_KINDS_MAX)));
        }
        let out = self.write_quiet(op!([req] | db, cx | ops::claim(db, cx, &req, Caller::Worker).await)).await?;
        if !out.is_empty() {
            self.events_wake.notify_waiters();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError> {
        self.heartbeat_as(job, token, Caller::Worker).await
    }

    async fn item_succeed(&self, job: &JobId, item: &ItemId, token: &LeaseToken) -> Result<ItemReport, StoreError> {
        let (job, item, token) = (job.clone(), item.clone(), token.clone());
        let out = self
            .write(op!([job, item, token] | db, cx | ops::item_report(db, cx, &job, &item, &token, None).await))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }

    async fn item_fail(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        code: &FailCode,
        message: Option<&str>,
    ) -> Result<ItemReport, StoreError> {
        check_text("message", message, false)?;
        let (job, item, token, code) = (job.clone(), item.clone(), token.clone(), code.clone());
        let message = message.map(str::to_owned);
        let out = self
            .write(op!(
                [job, item, token, code, message] | db,
                cx | ops::item_report(db, cx, &job, &item, &token, Some((&code, message.as_deref()))).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }

    async fn register_artifact(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        artifact: NewArtifact,
    ) -> Result<bool, StoreError> {
        let (job, item, token) = (job.clone(), item.clone(), token.clone());
        let out = self
            .write_quiet(op!(
                [job, item, token, artifact] | db,
                cx | ops::register_artifact(db, cx, &job, &item, &token, &artifact).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }

    async fn succeed_with_result(
        &self,
        job: &JobId,
        token: Option<&LeaseToken>,
        result: Option<String>,
    ) -> Result<Outcome<Job>, StoreError> {
        let (id, token) = (job.clone(), token.cloned());
        let (outcome, after) = self
            .write(op!(
                [id, token, result] | db,
                cx | ops::succeed(db, cx, &id, token.as_ref(), result.as_deref()).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        let value = self.continue_after(outcome.value, after).await?;
        Ok(Outcome { value, applied: outcome.applied })
    }

    async fn fail(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError> {
        self.fail_as(job, signal, Caller::Worker).await
    }

    async fn mark_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError> {
        self.unknown_as(job, token, message, Caller::Worker).await
    }

    async fn reconcile(&self, job: &JobId, finding: Finding) -> Result<Outcome<Job>, StoreError> {
        let id = job.clone();
        let (outcome, after) = self.write(op!([id] | db, cx | ops::reconcile(db, cx, &id, finding).await)).await?;
        if outcome.applied {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        let value = self.continue_after(outcome.value, after).await?;
        Ok(Outcome { value, applied: outcome.applied })
    }

    async fn cancel(&self, job: &JobId) -> Result<CancelOutcome, StoreError> {
        let id = job.clone();
        let (job, after) = self.write(op!([id] | db, cx | ops::cancel(db, cx, &id).await)).await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        let job = match after {
            After::Nothing => job,
            After::Teardown => match self.finish_teardown(&job.id).await {
                Ok(done) => done,
                Err(StoreError::CleanupFailed { job: id, message }) => {
                    tracing::warn!(job = %id, %message, "artifact cleanup failed; the job stays cancelling for the sweeper");
                    return Ok(CancelOutcome::Accepted(self.job(&JobId::parse(&id)?).await?));
                }
                Err(e) => return Err(e),
            },
        };
        Ok(match job.state {
            settle_core::job::JobState::Cancelled => CancelOutcome::Cancelled(job),
            _ => CancelOutcome::Accepted(job),
        })
    }

    async fn requeue_by(&self, job: &JobId, actor: &str) -> Result<Job, StoreError> {
        let (id, actor) = (job.clone(), actor.to_owned());
        let out = self
            .write(op!(
                [id, actor] | db,
                cx | {
                    let before = ops::must_lock_job(db, id.as_str()).await?.state;
                    let job = ops::requeue(db, cx, &id).await?;
                    // A re-sent requeue answers the job again; only the one that moved it is an action.
                    if before == settle_core::job::JobState::Dead {
                        let detail = serde_json::json!({ "attempt": job.attempt });
                        ops::record_action(db, cx, &actor, "requeue", Some(id.as_str()), Some(&job.account_id), detail)
                            .await?;
                    }
                    Ok(job)
                }
            ))
            .await?;
        self.work_due();
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn rescue_expired_leases(&self, limit: u32) -> Result<Vec<String>, StoreError> {
        let now = self.env.clock.now();
        let after = *self.rescue_after.lock().expect("cursor lock");
        let seen = self.read(op!([] | db, _cx | reads::expired_leases(db, now, after, limit).await)).await?;
        let seqs: Vec<i64> = seen.iter().map(|(seq, _, _)| *seq).collect();
        *self.rescue_after.lock().expect("cursor lock") = next_cursor(&seqs, limit);
        let mut rescued = Vec::new();
        for (_, id, token) in seen {
            let job_id = id.clone();
            let rescued_one = async {
                let (applied, after) = self
                    .write(op!([job_id, token] | db, cx | ops::expire_lease(db, cx, &job_id, &token).await))
                    .await?;
                if applied && after == After::Teardown {
                    let job = self.job(&JobId::parse(&id)?).await?;
                    self.continue_after(job, after).await?;
                }
                Ok::<bool, StoreError>(applied)
            };
            // One job that fails every time must not stop the rescue of those behind it.
            match rescued_one.await {
                Ok(true) => {
                    self.work_due();
                    rescued.push(id);
                }
                Ok(false) => {}
                Err(e @ (StoreError::InjectedCrash(_) | StoreError::Unavailable(_))) => return Err(e),
                Err(e) => tracing::error!(job = %id, error = %e, "lease rescue failed; continuing with the next job"),
            }
        }
        Ok(rescued)
    }

    async fn resume_teardowns(&self, limit: u32) -> Result<Vec<String>, StoreError> {
        let after = *self.sweep_after.lock().expect("cursor lock");
        let ids = self.read(op!([] | db, _cx | reads::cancelling(db, after, limit).await)).await?;
        let seqs: Vec<i64> = ids.iter().map(|(seq, _)| *seq).collect();
        *self.sweep_after.lock().expect("cursor lock") = next_cursor(&seqs, limit);
        let mut done = Vec::new();
        for (_, id) in ids {
            match self.finish_teardown(&id).await {
                Ok(job) if job.state == settle_core::job::JobState::Cancelled => done.push(id),
                Ok(_) => {}
                Err(StoreError::CleanupFailed { job, message }) => {
                    tracing::warn!(%job, %message, "artifact cleanup failed again; will retry");
                }
                Err(e @ (StoreError::InjectedCrash(_) | StoreError::Unavailable(_))) => return Err(e),
                Err(e) => tracing::error!(job = %id, error = %e, "teardown failed; continuing with the next job"),
            }
        }
        Ok(done)
    }

    async fn attempts(&self, job: &JobId) -> Result<Vec<Attempt>, StoreError> {
        let id = job.clone();
        self.read(op!([id] | db, cx | reads::attempts(db, cx, id.as_str()).await)).await
    }

    async fn signals(&self, job: &JobId) -> Result<Vec<SignalRecord>, StoreError> {
        let id = job.clone();
        self.read(op!([id] | db, _cx | reads::signals(db, id.as_str()).await)).await
    }

    async fn failure_summary(&self) -> Result<Vec<FailureCount>, StoreError> {
        self.read(op!([] | db, _cx | reads::failure_summary(db).await)).await
    }

    async fn events(&self, after: i64, limit: u32) -> Result<Paged<Event>, StoreError> {
        self.read(op!([] | db, _cx | reads::events(db, after, limit).await)).await
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let mut stats = self.read(op!([] | db, _cx | reads::stats(db).await)).await?;
        stats.tx_retries = self.tx_retries();
        Ok(stats)
    }

    async fn audit_with_progress(
        &self,
        progress: Arc<dyn Fn(audit::AuditProgress) + Send + Sync>,
    ) -> Result<AuditReport, StoreError> {
        match &self.backend {
            // Streamed through rusqlite on a blocking thread: sqlx-sqlite sends every row from its
            // worker thread to the caller, which costs far more than SQLite reading it.
            Backend::Sqlite { path, .. } => {
                let path = path.clone();
                let runtime = tokio::runtime::Handle::current();
                tokio::task::spawn_blocking(move || {
                    let mut conn = rusqlite::Connection::open_with_flags(
                        &path,
                        rusqlite::OpenFlags::SQLITE_OPEN_READ_ONLY | rusqlite::OpenFlags::SQLITE_OPEN_NO_MUTEX,
                    )
                    .map_err(StoreError::from_sqlite)?;
                    // Pages mapped rather than copied in, a large cache for the index lookups of the
                    // items pass; then one snapshot (WAL) for every statement of the audit.
                    conn.execute_batch("PRAGMA mmap_size = 1073741824; PRAGMA cache_size = -262144; BEGIN")
                        .map_err(StoreError::from_sqlite)?;
                    let report = runtime.block_on(async {
                        let mut db = Db::Lite(&mut conn);
                        audit::audit(&mut db, &*progress).await
                    });
                    let _ = conn.execute_batch("ROLLBACK");
                    report
                })
                .await
                .map_err(|e| StoreError::internal(format!("the audit thread failed: {e}")))?
            }
            Backend::Postgres { .. } => self.read(op!([progress] | db, _cx | audit::audit(db, &*progress).await)).await,
        }
    }

    async fn webhook_start(&self, endpoint: &str, from: StartFrom) -> Result<bool, StoreError> {
        let endpoint = endpoint.to_owned();
        self.write_quiet(op!([endpoint] | db, cx | webhooks::start(db, cx, &endpoint, from).await)).await
    }

    async fn webhook_requeue_dead(&self, endpoint: &str, limit: u32, actor: &str) -> Result<u64, StoreError> {
        let (endpoint, actor) = (endpoint.to_owned(), actor.to_owned());
        self.write_quiet(op!(
            [endpoint, actor] | db,
            cx | {
                let n = webhooks::requeue_dead(db, cx, &endpoint, limit).await?;
                if n > 0 {
                    let detail = serde_json::json!({ "endpoint": endpoint, "requeued": n });
                    ops::record_action(db, cx, &actor, "webhook.requeue_dead", None, None, detail).await?;
                }
                Ok(n)
            }
        ))
        .await
    }

    async fn webhook_prune(
        &self,
        endpoint: &str,
        before: settle_core::Timestamp,
        limit: u32,
    ) -> Result<u64, StoreError> {
        let endpoint = endpoint.to_owned();
        self.write_quiet(op!([endpoint] | db, _cx | webhooks::prune(db, &endpoint, before, limit).await)).await
    }

    async fn webhook_fan_out(&self, endpoint: &str, batch: u32) -> Result<u64, StoreError> {
        let endpoint = endpoint.to_owned();
        let created =
            self.write_quiet(op!([endpoint] | db, cx | webhooks::fan_out(db, cx, &endpoint, batch).await)).await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(created)
    }

    async fn webhook_claim(
        &self,
        endpoint: &str,
        limit: u32,
        lease_ms: u64,
        attempts_max: u32,
        breaker: BreakerPolicy,
    ) -> Result<Vec<Delivery>, StoreError> {
        let endpoint = endpoint.to_owned();
        let claimed = self
            .write_quiet(op!(
                [endpoint] | db,
                cx | webhooks::claim(db, cx, &endpoint, limit, lease_ms, attempts_max, breaker).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(claimed)
    }

    async fn webhook_report(
        &self,
        endpoint: &str,
        seq: i64,
        token: &LeaseToken,
        report: DeliveryReport,
        breaker: BreakerPolicy,
    ) -> Result<bool, StoreError> {
        let (endpoint, token) = (endpoint.to_owned(), token.clone());
        let applied = self
            .write_quiet(op!(
                [endpoint, token, report] | db,
                cx | webhooks::report(db, cx, &endpoint, seq, &token, &report, breaker).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(applied)
    }

    async fn webhook_breakers(&self) -> Result<Vec<BreakerStatus>, StoreError> {
        self.read(op!([] | db, _cx | webhooks::breakers(db).await)).await
    }

    async fn webhook_breaker_close_by(&self, endpoint: &str, actor: &str) -> Result<BreakerStatus, StoreError> {
        let (endpoint, actor) = (endpoint.to_owned(), actor.to_owned());
        self.write_quiet(op!(
            [endpoint, actor] | db,
            cx | {
                let b = webhooks::close_by_hand(db, cx, &endpoint).await?;
                let detail = serde_json::json!({ "endpoint": endpoint });
                ops::record_action(db, cx, &actor, "webhook.breaker_close", None, None, detail).await?;
                Ok(b)
            }
        ))
        .await
    }

    async fn webhook_requeue_by(&self, endpoint: &str, seq: i64, actor: &str) -> Result<Delivery, StoreError> {
        let (endpoint, actor) = (endpoint.to_owned(), actor.to_owned());
        self.write_quiet(op!(
            [endpoint, actor] | db,
            cx | {
                let d = webhooks::requeue(db, cx, &endpoint, seq).await?;
                let detail = serde_json::json!({ "endpoint": endpoint, "seq": seq });
                let (job, account) = (d.event.job_id.clone(), d.event.account_id.clone());
                ops::record_action(db, cx, &actor, "webhook.requeue", job.as_deref(), Some(&account), detail).await?;
                Ok(d)
            }
        ))
        .await
    }

    async fn webhook_deliveries(
        &self,
        filter: &DeliveryFilter,
        after: i64,
        limit: u32,
    ) -> Result<Paged<Delivery>, StoreError> {
        let filter = filter.clone();
        self.read(op!([filter] | db, _cx | webhooks::list(db, &filter, after, limit).await)).await
    }
}

#[async_trait]
impl Payouts for SqlStore {
    async fn create_withdrawal(&self, req: NewWithdrawal) -> Result<Created<Withdrawal>, StoreError> {
        payouts::validate_withdrawal(&req)?;
        let out = self.write(op!([req] | db, cx | payouts::create_withdrawal(db, cx, &req).await)).await?;
        if !out.replayed {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn withdrawal(&self, id: &JobId) -> Result<Withdrawal, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, cx | payouts::must_read_withdrawal(db, cx, id.as_str()).await)).await
    }

    async fn withdrawals(&self, filter: &WithdrawalFilter, page: Page) -> Result<Paged<Withdrawal>, StoreError> {
        let filter = filter.clone();
        self.read(op!([filter] | db, cx | payouts::withdrawals(db, cx, &filter, page).await)).await
    }

    async fn claim_payouts(
        &self,
        worker: &settle_core::ids::WorkerName,
        limit: u32,
    ) -> Result<Vec<ClaimedJob>, StoreError> {
        if limit == 0 || limit > limits::CLAIM_LIMIT_MAX {
            return Err(StoreError::invalid(format!("limit must be between 1 and {}", limits::CLAIM_LIMIT_MAX)));
        }
        let req = ClaimRequest { worker: worker.clone(), kinds: Vec::new(), limit, lease_seconds: None };
        let out =
            self.write_quiet(op!([req] | db, cx | ops::claim(db, cx, &req, Caller::PayoutProcessor).await)).await?;
        if !out.is_empty() {
            self.events_wake.notify_waiters();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn payout_heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError> {
        self.heartbeat_as(job, token, Caller::PayoutProcessor).await
    }

    async fn payout_succeeded(
        &self,
        job: &JobId,
        token: Option<&LeaseToken>,
        txid: &str,
        returned: bool,
    ) -> Result<Outcome<Withdrawal>, StoreError> {
        payouts::check_txid(txid)?;
        let (id, token, txid) = (job.clone(), token.cloned(), txid.to_owned());
        let (out, after) = self
            .write(op!(
                [id, token, txid] | db,
                cx | payouts::payout_succeeded(db, cx, &id, token.as_ref(), &txid, returned).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        if after == After::Nothing {
            return Ok(out);
        }
        self.continue_after(out.value.job, after).await?;
        Ok(Outcome { value: self.withdrawal(job).await?, applied: out.applied })
    }

    async fn payout_failed(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError> {
        self.fail_as(job, signal, Caller::PayoutProcessor).await
    }

    async fn payout_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError> {
        self.unknown_as(job, token, message, Caller::PayoutProcessor).await
    }

    async fn payout_returned_by(
        &self,
        job: &JobId,
        source: ReturnSource,
        actor: &str,
    ) -> Result<Outcome<Withdrawal>, StoreError> {
        let (id, actor) = (job.clone(), actor.to_owned());
        let out = self
            .write(op!([id, actor] | db, cx | {
                let out = payouts::payout_returned(db, cx, &id, source).await?;
                if out.applied && source == ReturnSource::Admin {
                    let detail = serde_json::json!({ "amount": out.value.amount.get(), "provider_txid": out.value.provider_txid });
                    let account = out.value.job.account_id.clone();
                    ops::record_action(db, cx, &actor, "withdrawal.returned", Some(id.as_str()), Some(&account), detail)
                        .await?;
                }
                Ok(out)
            }))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }
}
