//! How a store is opened: the options both engines read (below `engine` and `sql_store`, which
//! both take them).

use crate::artifacts::ArtifactStore;
use crate::ops::CrashHook;
use settle_core::job::Policies;
use settle_core::{Clock, SystemClock, limits};
use std::sync::Arc;
use std::sync::atomic::AtomicUsize;
use std::time::Duration;

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
    /// Where lease tokens and payout idempotency keys come from: `None` (production), the operating
    /// system's randomness (UUIDv4); `Some(seed)`, a SplitMix64 stream — for the deterministic
    /// simulator only (docs/decisions/0025), whose runs must repeat exactly. Never set it where
    /// tokens must be unguessable.
    pub token_seed: Option<u64>,
    /// A guard removed (the simulator's tests only: honoured under the `broken-guards` feature).
    pub broken: Option<crate::broken::Guard>,
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
    /// Tests only: while this holds `n` > 1, a PostgreSQL lane waits until it holds `n` operations
    /// (at most `GATHER_WAIT`) before it runs a batch, so a test can make a batch of chosen
    /// operations. `None` in use.
    pub pg_batch_gather: Option<Arc<AtomicUsize>>,
    /// How long a PostgreSQL statement waits for a row lock, and runs at most; past either the
    /// transaction is rolled back and the caller gets `Busy` (`503` with `Retry-After`).
    pub pg_lock_timeout: Duration,
    pub pg_statement_timeout: Duration,
    /// How long a request waits for a PostgreSQL connection — including reconnecting to a server
    /// that is down — before it is answered `Unavailable` (`503`): a client hears within this
    /// bound that the database is away, instead of hanging.
    pub pg_acquire_timeout: Duration,
    /// Whether Settle writes only to a PostgreSQL primary that waits for a synchronous standby at
    /// COMMIT (`synchronous_standby_names` set): one that does not — pg_auto_failover's
    /// `wait_primary` — is refused like a standby, and writes answer `503` until it does
    /// (docs/decisions/0027). `None` (the default): required when the URL lists several hosts, a
    /// formation whose failovers would lose what an asynchronous primary acknowledged; not for one
    /// host, a server of its own.
    pub pg_synchronous_standby: Option<bool>,
    pub artifacts: Option<Arc<dyn ArtifactStore>>,
    pub crash: Option<Arc<dyn CrashHook>>,
    /// Whether opening applies the schema's migrations (the default). `false` (`settle serve
    /// --no-migrate`): a schema older than this binary is refused — migrations are an explicit
    /// step (`settle migrate`), run once, before the processes of a new release start.
    pub migrate: bool,
}

impl Default for StoreOptions {
    fn default() -> StoreOptions {
        StoreOptions {
            clock: Arc::new(SystemClock),
            policy: Policies::default(),
            jitter_seed: SystemClock.now().micros() as u64,
            token_seed: None,
            broken: None,
            durability: Durability::Full,
            write_batch_max: limits::WRITE_BATCH_MAX,
            sqlite_readers: 4,
            busy_timeout: Duration::from_secs(5),
            migrate: true,
            pg_max_connections: 16,
            pg_write_lanes: 4,
            pg_batch_gather: None,
            pg_lock_timeout: Duration::from_secs(10),
            pg_statement_timeout: Duration::from_secs(60),
            pg_acquire_timeout: Duration::from_secs(5),
            pg_synchronous_standby: None,
            artifacts: None,
            crash: None,
        }
    }
}
