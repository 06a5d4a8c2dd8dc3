//! The test kit: a fresh store per test on a real database file, a fake clock, a real
//! file-system artifact store that can be told to fail, and short helpers.

use async_trait::async_trait;
use settle_core::backoff::{BackoffPolicy, Jitter};
use settle_core::ids::*;
use settle_core::job::{JobState, RefundPolicy, RetryPolicy};
use settle_core::{Credits, FakeClock, Timestamp};
use settle_store::*;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

/// Real files under a temp dir; `fail` makes every delete fail (a storage outage), `fail_prefix`
/// the deletes of keys starting with it (objects the store refuses to delete).
pub struct TestArtifacts {
    pub fs: ObjectArtifactStore,
    pub fail: AtomicBool,
    pub fail_prefix: Mutex<Option<String>>,
    pub deletes: AtomicUsize,
}

#[async_trait]
impl ArtifactStore for TestArtifacts {
    fn location(&self) -> String {
        ArtifactStore::location(&self.fs)
    }

    async fn delete(&self, key: &str) -> Result<(), String> {
        self.delete_all(&[key.to_owned()]).await
    }

    /// The real store's bulk delete, after the faults asked for.
    async fn delete_all(&self, keys: &[String]) -> Result<(), String> {
        if self.fail.load(Ordering::SeqCst) {
            return Err("artifact store unavailable".into());
        }
        let refused = self.fail_prefix.lock().unwrap().clone();
        if let Some(p) = refused
            && keys.iter().any(|k| k.starts_with(&p))
        {
            return Err("delete refused".into());
        }
        self.deletes.fetch_add(keys.len(), Ordering::SeqCst);
        self.fs.delete_all(keys).await
    }
}

/// Crash injection: `arm(point)` makes the next visit of `point` fail once; every visited point
/// is recorded so the harness can iterate exactly the points an operation passes.
#[derive(Default)]
pub struct Crasher {
    armed: Mutex<Option<settle_core::crash::CrashPoint>>,
    seen: Mutex<Vec<settle_core::crash::CrashPoint>>,
}

impl Crasher {
    pub fn arm(&self, p: settle_core::crash::CrashPoint) {
        *self.armed.lock().unwrap() = Some(p);
    }
    pub fn disarm(&self) -> bool {
        self.armed.lock().unwrap().take().is_some()
    }
    pub fn take_seen(&self) -> Vec<settle_core::crash::CrashPoint> {
        std::mem::take(&mut *self.seen.lock().unwrap())
    }
}

impl CrashHook for Crasher {
    fn should_crash(&self, point: settle_core::crash::CrashPoint) -> bool {
        self.seen.lock().unwrap().push(point);
        let mut armed = self.armed.lock().unwrap();
        if *armed == Some(point) {
            *armed = None;
            return true;
        }
        false
    }
}

/// `both_engines!(scenario, …)`: a test per engine of each `async fn scenario(EngineKind)`.
macro_rules! both_engines {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name(crate::kit::EngineKind::Sqlite).await }) *
        }
        mod postgres {
            $(#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn $name() { super::$name(crate::kit::EngineKind::Postgres).await }) *
        }
    };
}

pub struct Kit {
    pub store: SqlStore,
    pub clock: Arc<FakeClock>,
    pub artifacts: Arc<TestArtifacts>,
    pub crasher: Arc<Crasher>,
    pub url: String,
    pub dir: tempfile::TempDir,
}

pub const T0: i64 = 1_767_225_600_000_000; // 2026-01-01T00:00:00Z

pub fn test_policy() -> RetryPolicy {
    RetryPolicy {
        backoff: BackoffPolicy { backoff_ms_base: 1_000, backoff_ms_max: 600_000, jitter: Jitter::None },
        attempts_max: 3,
        ..RetryPolicy::default()
    }
}

#[derive(Clone, Copy, Debug)]
pub enum EngineKind {
    Sqlite,
    Postgres,
}

impl Kit {
    pub async fn new(engine: EngineKind) -> Kit {
        Kit::with(engine, test_policy(), limits_batch()).await
    }

    pub async fn with(engine: EngineKind, policy: RetryPolicy, batch: usize) -> Kit {
        Kit::tuned(engine, policy, batch, |_| {}).await
    }

    /// `with`, the store's options changed by `tune` before it opens.
    pub async fn tuned(
        engine: EngineKind,
        policy: RetryPolicy,
        batch: usize,
        tune: impl FnOnce(&mut StoreOptions),
    ) -> Kit {
        let dir = tempfile::tempdir().unwrap();
        let clock = Arc::new(FakeClock::new(Timestamp::from_micros(T0)));
        let artifacts = Arc::new(TestArtifacts {
            fs: ObjectArtifactStore::local(dir.path().join("artifacts")).unwrap(),
            fail: AtomicBool::new(false),
            fail_prefix: Mutex::new(None),
            deletes: AtomicUsize::new(0),
        });
        let crasher = Arc::new(Crasher::default());
        let url = match engine {
            EngineKind::Sqlite => format!("sqlite://{}", dir.path().join("settle.db").display()),
            EngineKind::Postgres => {
                settle_testkit::fresh_database_from_template(
                    &settle_store::SqlStore::postgres_schema_id(),
                    |url| async move { settle_store::SqlStore::migrate_postgres(&url).await.unwrap() },
                )
                .await
            }
        };
        let mut options = StoreOptions {
            clock: clock.clone(),
            policy: policy.into(),
            jitter_seed: 7,
            write_batch_max: batch,
            artifacts: Some(artifacts.clone()),
            crash: Some(crasher.clone()),
            ..StoreOptions::default()
        };
        tune(&mut options);
        let store = SqlStore::open(&url, options).await.unwrap();
        Kit { store, clock, artifacts, crasher, url, dir }
    }

    /// The audit is clean, and every event and logged signal of a job carries the job's number
    /// (migrations 0035, 0036: the audit accepts a row without one, as those written before the
    /// migration are; a path that wrote a job's event before its job row would file it so, and only
    /// this check would see it).
    pub async fn assert_clean(&self) {
        let report = self.store.audit(None).await.unwrap();
        assert!(report.ok(), "audit violations: {:#?}", report.violations);
        // The audit from the last checkpoint (decision 0040) agrees, and records the next: every
        // job a path moved since the last clean check must be one it finds touched, or the sums it
        // takes by difference would not match what the accounts hold.
        let run = AuditRun { from_checkpoint: true, record: true };
        let from = self.store.audit_with(run, None).await.unwrap();
        assert!(from.ok(), "audit from the checkpoint: violations: {:#?}", from.violations);
        assert!(matches!(from.checkpoint.recorded, Some(Ok(_))), "{:?}", from.checkpoint);
        use sqlx::ConnectOptions;
        use std::str::FromStr;
        let sql = "SELECT (SELECT count(*) FROM events WHERE job_id IS NOT NULL AND job_seq IS NULL) \
                   + (SELECT count(*) FROM signals WHERE job_seq IS NULL)";
        let unfiled: i64 = if self.is_sqlite() {
            let mut c = sqlx::sqlite::SqliteConnectOptions::from_str(&self.url).unwrap().connect().await.unwrap();
            sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap()
        } else {
            let mut c = sqlx::postgres::PgConnectOptions::from_str(&self.url).unwrap().connect().await.unwrap();
            sqlx::query_scalar(sql).fetch_one(&mut c).await.unwrap()
        };
        assert_eq!(unfiled, 0, "events or logged signals of a job written without the job's number");
    }

    pub async fn account(&self, id: &str, grant: i64) -> AccountId {
        let id = acc(id);
        self.store
            .create_account(
                NewAccount { id: id.clone(), overdraft_limit: Credits::ZERO, max_running: None },
                settle_store::SYSTEM_ACTOR,
            )
            .await
            .unwrap();
        if grant > 0 {
            self.store
                .grant(
                    &id,
                    NewGrant {
                        id: RefId::parse(&format!("g-{id}")).unwrap(),
                        amount: Credits::new(grant),
                        reason: None,
                        expires_at: None,
                        priority: None,
                    },
                    settle_store::SYSTEM_ACTOR,
                )
                .await
                .unwrap();
        }
        id
    }

    pub async fn balance(&self, id: &AccountId) -> i64 {
        self.store.account(id).await.unwrap().balance.get()
    }

    pub async fn job(&self, id: &str, account: &AccountId, cost: i64) -> Job {
        self.store.create_job(new_job(id, account, cost)).await.unwrap().value
    }

    pub async fn items_job(&self, id: &str, account: &AccountId, costs: &[i64]) -> Job {
        self.store.create_job(items_job(id, account, costs)).await.unwrap().value
    }

    pub async fn get(&self, id: &str) -> Job {
        self.store.job(&jid(id)).await.unwrap()
    }

    /// Claims exactly the job `id` (it must be the only one due) and returns its token.
    pub async fn claim_one(&self, id: &str) -> LeaseToken {
        let claimed = self.store.claim(claim_req("w1", 1)).await.unwrap();
        assert_eq!(claimed.len(), 1, "expected one claim");
        assert_eq!(claimed[0].job.id, id);
        claimed[0].lease_token.clone()
    }

    pub async fn fail(&self, id: &str, token: &LeaseToken, code: &str) -> Outcome<Job> {
        self.store.fail(&jid(id), fail_sig(token, code)).await.unwrap()
    }

    pub async fn ledger_kinds(&self, account: &AccountId) -> Vec<(String, i64)> {
        self.store
            .ledger(account, Page { after: 0, limit: 1000 })
            .await
            .unwrap()
            .rows
            .into_iter()
            .map(|e| (e.kind.as_str().to_owned(), e.amount.get()))
            .collect()
    }

    pub async fn event_types(&self) -> Vec<String> {
        self.store
            .events(0, 1000, &settle_core::scope::Scope::ALL)
            .await
            .unwrap()
            .rows
            .into_iter()
            .map(|e| e.kind.as_str().to_owned())
            .collect()
    }

    /// Raw SQL straight at the database, behind Settle's back.
    pub async fn raw(&self, sql: &'static str) -> Result<u64, sqlx::Error> {
        use sqlx::{ConnectOptions, Connection};
        use std::str::FromStr;
        if self.url.starts_with("sqlite:") {
            let mut conn = sqlx::sqlite::SqliteConnectOptions::from_str(&self.url)?.connect().await?;
            let r = sqlx::query(sql).execute(&mut conn).await?.rows_affected();
            conn.close().await?;
            Ok(r)
        } else {
            let mut conn = sqlx::postgres::PgConnectOptions::from_str(&self.url)?.connect().await?;
            let r = sqlx::query(sql).execute(&mut conn).await?.rows_affected();
            conn.close().await?;
            Ok(r)
        }
    }

    /// Raw SQL statements (`;`-separated) straight at the database, behind Settle's back.
    pub async fn raw_script(&self, sql: &str) -> Result<(), sqlx::Error> {
        raw_script_at(&self.url, sql).await
    }

    pub fn is_sqlite(&self) -> bool {
        self.url.starts_with("sqlite:")
    }

    /// Drops the trigger that refuses UPDATEs of the ledger (to tamper with it in a test).
    pub async fn drop_update_trigger(&self) {
        let sql = if self.url.starts_with("sqlite:") {
            "DROP TRIGGER ledger_entries_no_update"
        } else {
            "DROP TRIGGER ledger_entries_no_update ON ledger_entries"
        };
        self.raw(sql).await.unwrap();
    }
}

/// `Kit::raw_script` at a store's URL (after its `Kit` is taken apart to reopen the store).
pub async fn raw_script_at(url: &str, sql: &str) -> Result<(), sqlx::Error> {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let sql = sqlx::AssertSqlSafe(sql.to_owned());
    if url.starts_with("sqlite:") {
        let mut conn = sqlx::sqlite::SqliteConnectOptions::from_str(url)?.connect().await?;
        let done = sqlx::raw_sql(sql).execute(&mut conn).await.map(drop);
        conn.close().await?;
        done
    } else {
        let mut conn = sqlx::postgres::PgConnectOptions::from_str(url)?.connect().await?;
        let done = sqlx::raw_sql(sql).execute(&mut conn).await.map(drop);
        conn.close().await?;
        done
    }
}

pub fn limits_batch() -> usize {
    settle_core::limits::WRITE_BATCH_MAX
}

pub fn acc(s: &str) -> AccountId {
    AccountId::parse(s).unwrap()
}
pub fn jid(s: &str) -> JobId {
    JobId::parse(s).unwrap()
}
pub fn iid(s: &str) -> ItemId {
    ItemId::parse(s).unwrap()
}
pub fn code(s: &str) -> FailCode {
    FailCode::parse(s).unwrap()
}

pub fn new_job(id: &str, account: &AccountId, cost: i64) -> NewJob {
    NewJob {
        id: jid(id),
        account_id: account.clone(),
        kind: JobKind::parse("render").unwrap(),
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(cost)) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        refund_on: None,
        not_before: None,
        priority: None,
        requires: Default::default(),
    }
}

pub fn items_job(id: &str, account: &AccountId, costs: &[i64]) -> NewJob {
    priced_job(id, account, costs, Price::Cost)
}

/// A job of held items `i0`, `i1`, … (docs/decisions/0022).
pub fn held_job(id: &str, account: &AccountId, holds: &[i64]) -> NewJob {
    priced_job(id, account, holds, Price::Hold)
}

fn priced_job(id: &str, account: &AccountId, amounts: &[i64], price: fn(Credits) -> Price) -> NewJob {
    NewJob {
        items: amounts
            .iter()
            .enumerate()
            .map(|(i, c)| NewItem { id: iid(&format!("i{i}")), price: price(Credits::new(*c)) })
            .collect(),
        ..new_job(id, account, 0)
    }
}

pub fn with_policy(mut j: NewJob, p: RefundPolicy) -> NewJob {
    j.refund_on = Some(p);
    j
}

pub fn claim_req(worker: &str, limit: u32) -> ClaimRequest {
    ClaimRequest {
        worker: WorkerName::parse(worker).unwrap(),
        kinds: vec![],
        limit,
        lease_seconds: Some(30),
        labels: Default::default(),
    }
}

pub fn fail_sig(token: &LeaseToken, c: &str) -> FailSignal {
    FailSignal {
        lease_token: token.clone(),
        code: code(c),
        message: Some(format!("{c} happened")),
        retryable: None,
        retry_after_ms: None,
    }
}

pub fn states(job: &Job) -> Vec<&'static str> {
    job.items.iter().map(|i| i.state.as_str()).collect()
}

pub fn assert_state(job: &Job, state: JobState) {
    assert_eq!(job.state, state, "job {} is {:?}", job.id, job.state);
}

/// A watchdog for tests that must not hang: past `limit` it prints every thread of this process
/// (name, state, the kernel function it waits in) and ends the process, so a hang shows where it
/// waits instead of running into nextest's timeout silently. It is an OS thread, so it fires even
/// when every runtime worker is stuck. Dropping it disarms it.
pub struct Watchdog {
    disarm: Option<std::sync::mpsc::Sender<()>>,
}

impl Watchdog {
    pub fn arm(limit: std::time::Duration, what: &'static str) -> Watchdog {
        let (disarm, armed) = std::sync::mpsc::channel::<()>();
        std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) = armed.recv_timeout(limit) {
                let mut dump = format!("{what}: still running after {limit:?}; threads:\n");
                if let Ok(tasks) = std::fs::read_dir("/proc/self/task") {
                    for t in tasks.flatten() {
                        let read = |f: &str| std::fs::read_to_string(t.path().join(f)).unwrap_or_default();
                        let state =
                            read("stat").split(") ").nth(1).and_then(|r| r.split(' ').next()).unwrap_or("?").to_owned();
                        dump += &format!(
                            "  {:>7} {:<16} {state} {}\n",
                            t.file_name().to_string_lossy(),
                            read("comm").trim(),
                            read("wchan")
                        );
                    }
                }
                eprintln!("{dump}");
                std::process::exit(101);
            }
        });
        Watchdog { disarm: Some(disarm) }
    }
}

impl Drop for Watchdog {
    fn drop(&mut self) {
        if let Some(d) = self.disarm.take() {
            let _ = d.send(());
        }
    }
}

/// Each test `name(&Kit)` instantiated on both engines, as `sqlite::name` and `postgres::name`.
macro_rules! per_engine {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&crate::kit::Kit::new(crate::kit::EngineKind::Sqlite).await).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(&crate::kit::Kit::new(crate::kit::EngineKind::Postgres).await).await;
                }
            )*
        }
    };
}

/// Alters the store behind Settle's back (the audit's tamper tests).
pub async fn tamper(k: &Kit, sql: &str) {
    // Every event committed so far numbered first (PostgreSQL numbers them after their commit),
    // so the rows tampered with are the ones the audit reads.
    k.store.events(0, 1, &settle_core::scope::Scope::ALL).await.unwrap();
    k.raw_script(sql).await.unwrap();
}

/// The ledger's append-only triggers, dropped: what a person altering rows by hand does first.
pub fn drop_ledger_guards(k: &Kit) -> &'static str {
    if k.is_sqlite() {
        "DROP TRIGGER ledger_entries_no_update; DROP TRIGGER ledger_entries_no_delete;"
    } else {
        "DROP TRIGGER ledger_entries_no_update ON ledger_entries; DROP TRIGGER ledger_entries_no_delete ON ledger_entries;"
    }
}
