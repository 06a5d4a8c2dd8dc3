//! PostgreSQL writes (docs/decisions/0013).
//!
//! - `PgShared::transaction`: one operation in one READ COMMITTED transaction, retried whole on the
//!   retryable SQLSTATEs; its ledger lines and events are written by `ops::flush` just before COMMIT,
//!   and the sequencer is asked to number its events after it (docs/decisions/0021).
//! - Lanes: `lanes` tasks, a queue each; an operation on an account always goes to that account's
//!   lane, others to the shortest queue. A lane takes the first waiting operation and whatever else
//!   is waiting (up to `batch_max`, no timer), runs them in one transaction under a short lock
//!   timeout, flushes once, commits once, then answers every one. An operation that met a lock it
//!   may not wait for (or a deadlock, a serialization failure, a concurrent create) runs again alone
//!   after the batch, so a batch never waits long on another transaction and cannot hold a wait
//!   cycle for more than the short timeout. No savepoint per operation unless one failed after it
//!   wrote: then the batch is rolled back and run again careful, a savepoint each
//!   (docs/design/batches-without-savepoints.md).

use super::primary::{Leased, Primary};
use super::sequencer::Sequencer;
use super::{Batch, BatchOp, CAREFUL_BATCHES, Env, OpFn, Ran, answered_now};
use crate::db::Db;
use crate::error::StoreError;
use crate::model::PlanTally;
use crate::ops::plan::Intent;
use crate::ops::{self, Pending, ReadAhead};
use futures_util::FutureExt;
use settle_core::limits;
use sqlx::postgres::PgPool;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::mpsc;

/// A batch's BEGIN, in the same round trip as its short lock timeout — the longest a batched
/// operation waits for another transaction's row lock before it leaves the batch to run alone (with
/// the store's full `lock_timeout`) — and its generic plans: a statement over arrays (phase 1's, the
/// plans' `unnest`s) is otherwise planned again on every run, PostgreSQL estimating each custom plan
/// from the arrays' lengths cheaper than the generic one (decision 0031, amended: +10 % of the
/// server's CPU per transition measured without it).
/// Every write transaction passes the cap gate first (before its short lock timeout: a cap change
/// holds the gate for milliseconds).
const BATCH_BEGIN: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock_shared(24184, 0); \
                           SET LOCAL lock_timeout = '50ms'; SET LOCAL plan_cache_mode = force_generic_plan";
/// `BATCH_BEGIN` in careful mode, with the first operation's savepoint.
const BATCH_BEGIN_CAREFUL: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock_shared(24184, 0); \
                                   SET LOCAL lock_timeout = '50ms'; SET LOCAL plan_cache_mode = force_generic_plan; \
                                   SAVEPOINT op";
/// One operation's transaction, through the cap gate.
const BEGIN_GATED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED; SELECT pg_advisory_xact_lock_shared(24184, 0)";
/// The transaction of a cap change, which closes the gate itself (`ops::close_cap_gate`).
const BEGIN_UNGATED: &str = "BEGIN ISOLATION LEVEL READ COMMITTED";
/// The cap gate (docs/design/fair-claims.md §10): every write transaction holds it shared from its
/// BEGIN, a change of an account's `max_running` holds it exclusive (class 0x5e78, key 0), so no
/// transaction that claims overlaps a cap change and every claim reads the cap it runs under.
pub(crate) const CAP_GATE: (i32, i32) = (0x5e78, 0);
/// Savepoints per transaction: PostgreSQL caches 64 subtransaction ids per backend; past that every
/// snapshot in the cluster must consult pg_subtrans.
pub(crate) const BATCH_MAX: usize = 48;

pub(crate) struct PgShared {
    pub pool: PgPool,
    pub env: Env,
    pub tx_retries: AtomicU64,
    /// What the batches' phase 1 did (docs/design/batch-plan.md §12).
    pub plan: PlanCounts,
    /// The store's lock timeout, restored before the flush.
    pub lock_timeout: Duration,
    /// Numbers the events of every COMMIT that wrote some.
    pub sequencer: Arc<Sequencer>,
    /// Which host is the primary; told of every failover signal (docs/decisions/0024).
    pub primary: Arc<Primary>,
}

/// What the lanes' phase 1 did so far (docs/design/batch-plan.md §12), counted.
#[derive(Default)]
pub(crate) struct PlanCounts {
    ahead: AtomicU64,
    skipped: AtomicU64,
    failed: AtomicU64,
    /// The shape of the lanes' batches (issue 43's measurement): batches run optimistic, their
    /// operations, and of the intents read ahead, the failures, the successes, and those whose
    /// account another intent of the same batch also has.
    batches: AtomicU64,
    operations: AtomicU64,
    fails: AtomicU64,
    succeeds: AtomicU64,
    shared_account: AtomicU64,
}

impl PlanCounts {
    pub fn tally(&self) -> PlanTally {
        let load = |c: &AtomicU64| c.load(Ordering::Relaxed);
        PlanTally {
            ahead: load(&self.ahead),
            skipped: load(&self.skipped),
            failed: load(&self.failed),
            batches: load(&self.batches),
            operations: load(&self.operations),
            fails: load(&self.fails),
            succeeds: load(&self.succeeds),
            shared_account: load(&self.shared_account),
        }
    }

    /// The intents a batch read ahead, by kind and by whether their account is another's too.
    fn shape(&self, read: &[(&Intent, &ReadAhead)]) {
        let mut accounts: std::collections::HashMap<&str, u64> = std::collections::HashMap::new();
        for (intent, ahead) in read {
            *accounts.entry(ahead.row.account_id.as_str()).or_default() += 1;
            let kind = match intent.kind {
                ops::plan::IntentKind::Fail => &self.fails,
                ops::plan::IntentKind::Succeed { .. } => &self.succeeds,
            };
            kind.fetch_add(1, Ordering::Relaxed);
        }
        let shared: u64 = accounts.values().filter(|n| **n > 1).sum();
        self.shared_account.fetch_add(shared, Ordering::Relaxed);
    }
}

/// How long a transaction (or a lane's batch) may go without an answer before its connection is
/// closed and its callers answered `Unavailable` (a host gone without a word: no RST, no FIN).
/// Below the HTTP request limit (60 s), so the store, not the request's timeout, gives the
/// connection up; far above any statement Settle sends (the lock timeout is 10 s).
pub(crate) const ANSWER_LIMIT: Duration = Duration::from_secs(45);

fn new_pending() -> Arc<Mutex<Pending>> {
    Arc::new(Mutex::new(Pending::default()))
}

fn take(pending: &Mutex<Pending>) -> Pending {
    std::mem::take(&mut *pending.lock().unwrap_or_else(|p| p.into_inner()))
}

impl PgShared {
    /// A failover signal (an `Unavailable` answer: a read-only transaction, a shutdown, a cut
    /// connection, no connection in time) is told to the primary's watcher.
    pub fn observe<T>(&self, result: &Result<T, StoreError>) {
        if let Err(StoreError::Unavailable(_)) = result {
            self.primary.signal();
        }
    }

    /// `observe`, passing the result on.
    pub fn observed_result<T>(&self, result: Result<T, StoreError>) -> Result<T, StoreError> {
        self.observe(&result);
        result
    }

    /// `observe`, for an error on its way out.
    pub fn observed(&self, e: StoreError) -> StoreError {
        if let StoreError::Unavailable(_) = e {
            self.primary.signal();
        }
        e
    }

    /// Runs a batch's operation in a transaction of its own, and answers it.
    async fn run_alone(&self, op: Box<dyn BatchOp>) {
        let (run, answer) = op.alone();
        answer(self.transaction(run).await);
    }

    /// One PostgreSQL transaction (READ COMMITTED) for one operation, retried whole on the
    /// retryable SQLSTATEs.
    pub async fn transaction<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        self.transaction_from(BEGIN_GATED, f).await
    }

    /// `transaction` for a cap change: it does not pass the gate shared, as it closes it.
    pub async fn transaction_closing_gate<T: Send + 'static>(&self, f: OpFn<T>) -> Result<T, StoreError> {
        self.transaction_from(BEGIN_UNGATED, f).await
    }

    async fn transaction_from<T: Send + 'static>(&self, begin: &'static str, f: OpFn<T>) -> Result<T, StoreError> {
        let mut attempt = 0;
        loop {
            attempt += 1;
            let mut conn = Leased::acquire(&self.pool).await.map_err(|e| self.observed(e.into()))?;
            // A deadline that closes the connection instead of cancelling anything: the server
            // goes on with a COMMIT it has (a closed socket cuts no wait for a standby short), and
            // the answer is `Unavailable` — the outcome unknown, never "not done".
            let outcome = match tokio::time::timeout(ANSWER_LIMIT, self.attempt(&mut conn, begin, &f)).await {
                Ok(outcome) => outcome,
                Err(_) => Err(StoreError::Unavailable(format!(
                    "no answer from PostgreSQL in {} s; the outcome is unknown",
                    ANSWER_LIMIT.as_secs()
                ))),
            };
            // The connection that met a failover signal is never used again (docs/decisions/0024).
            conn.clean_unless_unavailable(&outcome);
            drop(conn);
            self.observe(&outcome);
            match outcome {
                Err(e) if attempt < limits::TX_ATTEMPTS_MAX && e.is_pg_retryable() => {
                    self.tx_retries.fetch_add(1, Ordering::Relaxed);
                    tracing::debug!(attempt, error = %e, "retrying a PostgreSQL transaction");
                    let pause_ms = { self.env.rng.lock().expect("rng lock").below_inclusive(5 << attempt) };
                    tokio::time::sleep(Duration::from_millis(pause_ms)).await;
                }
                other => return other,
            }
        }
    }

    /// One attempt of `transaction`, on `conn`.
    async fn attempt<T: Send + 'static>(
        &self,
        conn: &mut sqlx::PgConnection,
        begin: &'static str,
        f: &OpFn<T>,
    ) -> Result<T, StoreError> {
        // A `Transaction` rolls back if this future is dropped midway (a client hanging up, a
        // timeout): a pooled connection never goes back with a transaction open.
        let mut tx = sqlx::Connection::begin_with(conn, begin).await?;
        let pending = new_pending();
        let cx = self.env.cx(Some(pending.clone()));
        let out = {
            let mut db = Db::pg(&mut tx);
            match f(&mut db, &cx).await {
                // Its last statement sets what COMMIT needs (`ops::flush`, docs/decisions/0024).
                Ok(v) => ops::flush(&mut db, &take(&pending), self.lock_timeout).await.map(|events| (v, events)),
                Err(e) => Err(e),
            }
        };
        match out {
            Err(e) => {
                let _ = tx.rollback().await;
                Err(e)
            }
            Ok((v, events)) => {
                let started = std::time::Instant::now();
                tx.commit().await.map_err(StoreError::from_commit)?;
                self.primary.confirm_commit(conn, started.elapsed()).await?;
                if events {
                    self.sequencer.poke();
                }
                Ok(v)
            }
        }
    }
}

/// The write lanes: a queue and a task each. An operation that names an account always goes to
/// that account's lane, so operations on one account share batches instead of waiting for each
/// other's row locks across lanes (a hot account's operations commit together); one that names none
/// goes to the lane with the shortest queue.
pub(crate) struct Lanes {
    queues: Vec<mpsc::Sender<Box<dyn BatchOp>>>,
}

impl Lanes {
    /// Queues `op` on `account`'s lane (by a hash of the id), or on the least busy lane.
    pub async fn send(&self, account: Option<&str>, op: Box<dyn BatchOp>) -> Result<(), StoreError> {
        let queue = match account {
            Some(a) => &self.queues[lane_of(a, self.queues.len())],
            // `capacity` is the room left: the most room is the shortest queue.
            None => self.queues.iter().max_by_key(|q| q.capacity()).expect("at least one lane"),
        };
        queue.send(op).await.map_err(|_| StoreError::Unavailable("the write lanes have stopped".into()))
    }
}

/// An account's lane: FNV-1a of its id, so every process routes an account alike.
fn lane_of(account: &str, lanes: usize) -> usize {
    let h = account.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3));
    (h % lanes as u64) as usize
}

/// The longest a lane waits to gather a test's batch (`StoreOptions::pg_batch_gather`).
const GATHER_WAIT: Duration = Duration::from_secs(5);

/// Starts `lanes` lane tasks, a queue each; they end when the `Lanes` are dropped.
/// `gather`: tests only (`StoreOptions::pg_batch_gather`).
pub(crate) fn spawn_lanes(
    shared: Arc<PgShared>,
    lanes: usize,
    batch_max: usize,
    gather: Option<Arc<AtomicUsize>>,
) -> Lanes {
    let lanes = lanes.max(1);
    let queues = (0..lanes)
        .map(|_| {
            let (tx, rx) = mpsc::channel::<Box<dyn BatchOp>>((limits::WRITE_QUEUE_MAX / lanes).max(1));
            tokio::spawn(lane(shared.clone(), rx, batch_max.clamp(1, BATCH_MAX), gather.clone()));
            tx
        })
        .collect();
    Lanes { queues }
}

async fn lane(
    shared: Arc<PgShared>,
    mut rx: mpsc::Receiver<Box<dyn BatchOp>>,
    batch_max: usize,
    gather: Option<Arc<AtomicUsize>>,
) {
    let mut batch: Vec<Box<dyn BatchOp>> = Vec::with_capacity(batch_max);
    // Batches left to run in careful mode after one fell back.
    let mut careful_left: u32 = 0;
    loop {
        match rx.recv().await {
            Some(op) => batch.push(op),
            None => return,
        }
        while batch.len() < batch_max {
            match rx.try_recv() {
                Ok(op) => batch.push(op),
                Err(_) => break,
            }
        }
        if let Some(least) = gather.as_ref().map(|n| n.load(Ordering::Relaxed)) {
            let until = tokio::time::Instant::now() + GATHER_WAIT;
            while batch.len() < least.min(batch_max) {
                match tokio::time::timeout_at(until, rx.recv()).await {
                    Ok(Some(op)) => batch.push(op),
                    Ok(None) | Err(_) => break,
                }
            }
        }
        if batch.len() == 1 {
            // Nothing to share the transaction with: no savepoint, no short lock timeout — the
            // operation runs as it would alone, and the lane is free again after its COMMIT.
            let op = batch.pop().expect("one operation");
            shared.run_alone(op).await;
            continue;
        }
        // A batch that gets no answer (a host gone without a word) is given up: its operations'
        // callers hear `Unavailable` (the outcome unknown), and the lane goes on.
        let careful = careful_left > 0;
        careful_left = careful_left.saturating_sub(1);
        let mut later = Vec::new();
        let batches = async {
            let first = run_batch(&shared, &mut batch, careful, &mut later).await;
            if first == Batch::FellBack && !batch.is_empty() {
                run_batch(&shared, &mut batch, true, &mut later).await;
            }
            first
        };
        let ended = tokio::time::timeout(ANSWER_LIMIT, batches).await;
        if ended == Ok(Batch::FellBack) {
            careful_left = CAREFUL_BATCHES;
        }
        all_alone(&shared, later);
        if ended.is_err() {
            tracing::warn!("a write batch got no answer from PostgreSQL in time; its outcome is unknown");
            batch.clear();
            shared.primary.signal();
        }
    }
}

/// Runs every operation of the batch alone, in a task each (they were never committed).
fn all_alone(shared: &Arc<PgShared>, ops: impl IntoIterator<Item = Box<dyn BatchOp>>) {
    for op in ops {
        let shared = shared.clone();
        tokio::spawn(async move { shared.run_alone(op).await });
    }
}

async fn exec(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, sql: &str) -> Result<(), sqlx::Error> {
    sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_owned())).execute(&mut **tx).await.map(|_| ())
}

/// A batch that could not begin: nothing ran; every operation is answered `Unavailable`.
fn unanswered(shared: &PgShared, batch: &mut Vec<Box<dyn BatchOp>>, e: sqlx::Error) {
    let e = shared.observed(StoreError::from(e));
    for op in batch.drain(..) {
        op.deliver(Err(StoreError::Unavailable(e.to_string())));
    }
}

/// One batch: one transaction, one flush, one COMMIT, then the answers. Anything failing before
/// COMMIT is sent leaves nothing committed: every operation is run again alone. A failed COMMIT
/// leaves the outcome unknown: the operations that ran are answered `Unavailable` (never "nothing
/// happened"); those that left the batch run alone.
///
/// Optimistic (not `careful`): no savepoint. An operation that fails or must run alone having
/// changed nothing (`Db::touched`) leaves the transaction as it found it; one that changed a row
/// rolls the whole transaction back, and the batch ends `FellBack` with the operations to run again
/// in careful mode — a savepoint each — left in `batch`, and one that must run alone in `later`, to
/// start once the careful run has ended (docs/design/batches-without-savepoints.md).
async fn run_batch(
    shared: &Arc<PgShared>,
    batch: &mut Vec<Box<dyn BatchOp>>,
    careful: bool,
    later: &mut Vec<Box<dyn BatchOp>>,
) -> Batch {
    // Closed, not returned, unless the batch ends cleanly (a deadline that cut it off included).
    let mut conn = match Leased::acquire(&shared.pool).await {
        Ok(conn) => conn,
        Err(e) => {
            unanswered(shared, batch, e);
            return Batch::Ended;
        }
    };
    let begin = if careful { BATCH_BEGIN_CAREFUL } else { BATCH_BEGIN };
    let mut tx = match sqlx::Connection::begin_with(&mut *conn, begin).await {
        Ok(tx) => tx,
        Err(e) => {
            unanswered(shared, batch, e);
            return Batch::Ended;
        }
    };
    let Ok(mut ahead) = read_batch_ahead(shared, &mut tx, batch, later, careful).await else {
        let _ = tx.rollback().await;
        all_alone(shared, batch.drain(..));
        return Batch::Ended;
    };
    let pending = new_pending();
    // How each operation ended, by its place in `batch`.
    let mut ended: Vec<Ran> = Vec::with_capacity(batch.len());
    // Careful mode: a savepoint is always open when an operation starts: released and opened again
    // in one round trip after an operation that stays, rolled back to (which keeps it) after one
    // that does not. The last one is left open; COMMIT takes it with the rest.
    let mut broken: Option<String> = None;
    while broken.is_none() && ended.len() < batch.len() {
        let at = ended.len();
        let (op, read) = (&mut *batch[at], ahead.get_mut(at).and_then(Option::take));
        let (outcome, touched, panicked) = run_op(shared, &mut tx, &pending, op, careful, read).await;
        let step = match (careful, outcome) {
            (true, Ran::Done) => exec(&mut tx, "RELEASE SAVEPOINT op; SAVEPOINT op").await,
            (true, _) => exec(&mut tx, "ROLLBACK TO SAVEPOINT op").await,
            (false, _) if outcome == Ran::Done || !touched => Ok(()),
            (false, _) => {
                let rolled_back = tx.rollback().await;
                shared.tx_retries.fetch_add(1, Ordering::Relaxed);
                if rolled_back.is_err() || matches!(batch[at].error(), Some(StoreError::Unavailable(_))) {
                    // The connection may be gone (a failover, a cut): closed, not returned, and
                    // every operation runs alone on a fresh one, as after any broken batch.
                    shared.primary.signal();
                    all_alone(shared, batch.drain(..));
                    return Batch::Ended;
                }
                conn.clean_unless_unavailable(&Ok::<(), StoreError>(()));
                let earlier_done = ended.contains(&Ran::Done);
                if outcome == Ran::Again {
                    later.push(batch.remove(at));
                } else if answered_now((!panicked).then_some(outcome), earlier_done, &*batch[at]) {
                    batch.remove(at).deliver(Err(StoreError::internal("the operation panicked; it was rolled back")));
                }
                return Batch::FellBack;
            }
        };
        if let Err(e) = step {
            broken = Some(e.to_string());
        }
        ended.push(outcome);
    }
    let mut events = false;
    if broken.is_none() {
        // The flush's last statement restores the store's lock timeout and sets what COMMIT needs.
        let flushed = async {
            let mut db = Db::pg(&mut tx);
            ops::flush(&mut db, &take(&pending), shared.lock_timeout).await
        };
        match AssertUnwindSafe(flushed).catch_unwind().await {
            Ok(Ok(wrote)) => events = wrote,
            Ok(Err(e)) => broken = Some(e.to_string()),
            Err(_) => broken = Some("the flush panicked".into()),
        }
    }
    if let Some(reason) = broken {
        tracing::warn!(%reason, ops = batch.len(), "a write batch failed before COMMIT; its operations run alone");
        let _ = tx.rollback().await;
        shared.tx_retries.fetch_add(1, Ordering::Relaxed);
        all_alone(shared, batch.drain(..));
        return Batch::Ended;
    }
    // Every operation ran (the loop ends early only when `broken`).
    let (ran, again): (Vec<_>, Vec<_>) = batch.drain(..).zip(ended).partition(|(_, outcome)| *outcome != Ran::Again);
    let (ran, again) = (ran.into_iter().map(|(op, _)| op), again.into_iter().map(|(op, _)| op).collect::<Vec<_>>());
    let started = std::time::Instant::now();
    let mut committed = tx.commit().await.map_err(StoreError::from_commit);
    if committed.is_ok() {
        committed = shared.primary.confirm_commit(&mut conn, started.elapsed()).await;
    }
    shared.observe(&committed);
    conn.clean_unless_unavailable(&committed);
    answer(shared, committed, events, ran, again);
    Batch::Ended
}

/// Runs one operation of a batch: how it ended, whether it changed anything, whether it panicked.
/// Its queued lines and events are cut back unless it is `Done`.
async fn run_op(
    shared: &PgShared,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    pending: &Arc<Mutex<Pending>>,
    op: &mut dyn BatchOp,
    careful: bool,
    ahead: Option<ReadAhead>,
) -> (Ran, bool, bool) {
    let mark = pending.lock().unwrap_or_else(|p| p.into_inner()).mark();
    let cx = shared.env.cx(Some(pending.clone()));
    // For this operation and this run only (review of §12, finding 1).
    *cx.ahead.lock().unwrap_or_else(|p| p.into_inner()) = ahead;
    // Debug builds (the whole test suite) check the rule against PostgreSQL's own count.
    let check = cfg!(debug_assertions) && !careful;
    let changes = if check { row_changes(tx).await } else { 0 };
    let (result, touched) = {
        let mut db = Db::pg(tx);
        let result = AssertUnwindSafe(op.run(&mut db, &cx)).catch_unwind().await;
        // A panic may have cut a statement short: counted, whatever it did.
        let touched = db.touched() || result.is_err();
        (result, touched)
    };
    if check && !touched {
        let now = row_changes(tx).await;
        assert_eq!(now, changes, "an operation that changed rows was counted untouched");
    }
    let panicked = result.is_err();
    let outcome = result.unwrap_or_else(|_| {
        tracing::error!("a write operation panicked; it is rolled back");
        Ran::Failed
    });
    if outcome != Ran::Done {
        pending.lock().unwrap_or_else(|p| p.into_inner()).truncate(mark);
    }
    (outcome, touched, panicked)
}

/// A batch's phase 1 (docs/design/batch-plan.md §12), as its transaction's first statements: the
/// intents first, their jobs locked and read. With
/// two intents or more on distinct jobs (of two on one job only the first is one), `batch` is
/// reordered — the intents first, in arrival order, then the others in arrival order: every
/// operation of a batch is in flight until the COMMIT, so any order is one its clients could have
/// seen — and their jobs are locked and read in two statements. An intent whose job was not locked
/// (another transaction holds it, or there is none) leaves for `later`, to run alone after the
/// batch, having touched nothing. Returns each of the first operations' reads, by place; nothing
/// in careful mode. `Err`: phase 1 failed (counted, and a lost connection told to the primary's
/// watcher); the batch is to be rolled back and its operations run alone.
async fn read_batch_ahead(
    shared: &PgShared,
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    batch: &mut Vec<Box<dyn BatchOp>>,
    later: &mut Vec<Box<dyn BatchOp>>,
    careful: bool,
) -> Result<Vec<Option<ReadAhead>>, ()> {
    if careful {
        return Ok(Vec::new());
    }
    shared.plan.batches.fetch_add(1, Ordering::Relaxed);
    shared.plan.operations.fetch_add(batch.len() as u64, Ordering::Relaxed);
    let mut seen = std::collections::HashSet::new();
    let first: Vec<bool> = batch.iter().map(|op| op.intent().is_some_and(|i| seen.insert(i.job.clone()))).collect();
    if first.iter().filter(|f| **f).count() < 2 {
        return Ok(Vec::new());
    }
    let (mut intents, mut others) = (Vec::new(), Vec::new());
    for (op, first) in batch.drain(..).zip(first) {
        if first { intents.push(op) } else { others.push(op) }
    }
    let read = {
        let named: Vec<&Intent> = intents.iter().filter_map(|op| op.intent()).collect();
        let mut db = Db::pg(tx);
        AssertUnwindSafe(ops::plan::read_ahead(&mut db, &named)).catch_unwind().await
    };
    let read = match read {
        Ok(Ok(read)) => read,
        failed => {
            batch.extend(intents.into_iter().chain(others));
            let e = match failed {
                Ok(Err(e)) => shared.observed(e),
                _ => StoreError::internal("a batch's phase 1 panicked"),
            };
            tracing::warn!(reason = %e, ops = batch.len(), "a write batch's phase 1 failed; its operations run alone");
            shared.plan.failed.fetch_add(1, Ordering::Relaxed);
            return Err(());
        }
    };
    let shape: Vec<(&Intent, &ReadAhead)> =
        intents.iter().zip(&read).filter_map(|(op, read)| Some((op.intent()?, read.as_ref()?))).collect();
    shared.plan.shape(&shape);
    let (mut ahead, mut skipped) = (Vec::with_capacity(intents.len()), 0);
    for (op, read) in intents.into_iter().zip(read) {
        match read {
            Some(read) => {
                batch.push(op);
                ahead.push(Some(read));
            }
            None => {
                later.push(op);
                skipped += 1;
            }
        }
    }
    shared.plan.ahead.fetch_add(ahead.len() as u64, Ordering::Relaxed);
    shared.plan.skipped.fetch_add(skipped, Ordering::Relaxed);
    batch.extend(others);
    Ok(ahead)
}

/// Answers a batch's operations once its COMMIT has ended, and starts those that must run alone.
fn answer(
    shared: &Arc<PgShared>,
    committed: Result<(), StoreError>,
    events: bool,
    ran: impl Iterator<Item = Box<dyn BatchOp>>,
    again: Vec<Box<dyn BatchOp>>,
) {
    match committed {
        Ok(()) => {
            if events {
                shared.sequencer.poke();
            }
            for op in ran {
                op.deliver(Ok(()));
            }
        }
        // Refused, so nothing of it committed.
        Err(e) if e.is_pg_retryable() => all_alone(shared, ran),
        Err(e) => {
            let msg = e.to_string();
            for op in ran {
                op.deliver(Err(StoreError::Unavailable(format!("the write batch's commit failed: {msg}"))));
            }
        }
    }
    if !again.is_empty() {
        shared.tx_retries.fetch_add(again.len() as u64, Ordering::Relaxed);
    }
    all_alone(shared, again);
}

/// The rows this transaction has inserted, updated and deleted so far: the check, in debug builds
/// (the whole test suite), that an operation counted untouched changed nothing.
async fn row_changes(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>) -> i64 {
    sqlx::query_scalar(
        "SELECT COALESCE(SUM(n_tup_ins + n_tup_upd + n_tup_del), 0)::bigint FROM pg_stat_xact_user_tables",
    )
    .fetch_one(&mut **tx)
    .await
    .unwrap_or(-1)
}
