//! A rail's processor (docs/design/payouts.md, docs/design/money-controls.md §4): the loop that
//! moves a reserved kind's jobs against the external system that is their only source of truth —
//! payouts through `provider-v1`, top-ups through `funding-v1` — written once.
//!
//! Every attempt asks the provider whether the job's idempotency key exists before it sends, and
//! sends only after it has renewed its lease and marked the attempt as sending (committed before
//! the request leaves). No database transaction is open while a provider call is in flight. A send
//! without an answer is `unknown`, never retried automatically; the reconcile pass asks the provider
//! about each unknown job (found → succeeded; absent after the confirm window → retried with the
//! same key; no answer → stays unknown), and the re-check pass asks about young closed ones (an
//! earlier send that executed after all; a payout sent back).

use async_trait::async_trait;
use settle_core::crash::CrashPoint;
use settle_core::ids::{FailCode, JobId, WorkerName};
use settle_core::job::JobState;
use settle_core::{Timestamp, limits};
use settle_store::{
    ClaimedJob, CrashHook, FailSignal, Finding, Heartbeat, Job, LeaseToken, Outcome, Page, Paged, Store, StoreError,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What a lookup of an idempotency key learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// The provider has it: its id (a transfer's txid, a charge's id); `returned`: a payout the
    /// receiving side sent back.
    Found { id: String, returned: bool },
    /// The provider answered that nothing has that key.
    Absent,
    /// No usable answer (an error answer, no answer, something outside the protocol): nothing learned.
    Failed { message: String },
}

/// What a send learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// Executed: the provider's id of it.
    Executed { id: String },
    /// A definitive refusal: nothing was executed. `retry_after_ms` from `Retry-After`.
    Refused { code: FailCode, message: String, retry_after_ms: Option<u64> },
    /// No answer, or one outside the protocol: it may or may not have happened.
    NoAnswer { message: String },
}

/// One rail: how its processor reads, asks, sends and records. `PayoutRail` and `FundingRail`.
#[async_trait]
pub trait Rail: Send + Sync + 'static {
    /// A job of the rail as the store answers it (a withdrawal, a top-up).
    type Row: Send + Sync;
    /// For logs: `payout`, `top-up`.
    const WHAT: &'static str;
    /// Whether an executed job may come back later (a payout the receiving side returns): the
    /// re-check asks about succeeded ones only then.
    const RETURNS: bool;
    fn job(row: &Self::Row) -> &Job;
    fn key(row: &Self::Row) -> &str;
    /// The provider's id, once recorded.
    fn provider_id(row: &Self::Row) -> Option<&str>;
    /// Whether a refusal's code may be retried, when the protocol says (`None`: the kind's
    /// configured retryable codes decide).
    fn retryable(code: &FailCode) -> Option<bool>;
    async fn claim(&self, store: &dyn Store, worker: &WorkerName, limit: u32) -> Result<Vec<ClaimedJob>, StoreError>;
    async fn read(&self, store: &dyn Store, id: &JobId) -> Result<Self::Row, StoreError>;
    async fn list(
        &self,
        store: &dyn Store,
        state: JobState,
        updated_since: Option<Timestamp>,
        page: Page,
    ) -> Result<Paged<Self::Row>, StoreError>;
    async fn heartbeat(&self, store: &dyn Store, id: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError>;
    async fn lookup(&self, key: &str) -> Lookup;
    async fn send(&self, row: &Self::Row) -> Sent;
    /// The provider has it: the success path, from any attempt (`token`: the attempt's lease).
    async fn succeeded(
        &self,
        store: &dyn Store,
        id: &JobId,
        token: Option<&LeaseToken>,
        found: &str,
        returned: bool,
    ) -> Result<Outcome<Self::Row>, StoreError>;
    async fn failed(&self, store: &dyn Store, id: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError>;
    async fn unknown(
        &self,
        store: &dyn Store,
        id: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError>;
    /// A succeeded job the re-check found sent back (payouts); `false` where nothing comes back.
    async fn returned(&self, store: &dyn Store, id: &JobId) -> Result<bool, StoreError>;
}

#[derive(Debug, Clone, Copy)]
pub struct ProcessorSettings {
    /// How often to look for due jobs when nothing wakes the loop.
    pub every: Duration,
    /// How often to ask about unknown (and recently succeeded or dead) jobs.
    pub reconcile_every: Duration,
    /// Most jobs one pass claims and has in flight.
    pub batch: u32,
    /// Re-check succeeded jobs this young for returns, and dead or cancelled ones for a late
    /// execution (zero: off).
    pub return_window: Duration,
}

impl Default for ProcessorSettings {
    fn default() -> ProcessorSettings {
        ProcessorSettings {
            every: Duration::from_secs(1),
            reconcile_every: Duration::from_secs(10),
            batch: 16,
            return_window: Duration::ZERO,
        }
    }
}

/// How one attempt ended, for logs and tests.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptEnd {
    Succeeded,
    Failed,
    Unknown,
    Cancelled,
    /// The lease was gone before the send: nothing sent, nothing recorded.
    LeaseLost,
    /// The crash hook stopped the attempt (tests): nothing more recorded.
    Crashed,
    /// A store call failed; the lease will expire and the rescuer takes the job back.
    StoreError,
}

pub struct Processor<R: Rail> {
    store: Arc<dyn Store>,
    rail: R,
    worker: WorkerName,
    settings: ProcessorSettings,
    crash: Option<Arc<dyn CrashHook>>,
    /// The simulator's broken-guard test: send without looking the key up first (honoured only
    /// under the `broken-guards` feature).
    skip_lookup: bool,
    /// Where the next reconcile and re-check passes start (wrapping cursors: a job no one can
    /// resolve yet never hides the ones behind it).
    reconcile_after: Mutex<i64>,
    recheck_after: Mutex<(usize, i64)>,
}

impl<R: Rail> Processor<R> {
    pub fn on(store: Arc<dyn Store>, rail: R, worker: WorkerName, settings: ProcessorSettings) -> Processor<R> {
        Processor {
            store,
            rail,
            worker,
            settings,
            crash: None,
            skip_lookup: false,
            reconcile_after: Mutex::new(0),
            recheck_after: Mutex::new((0, 0)),
        }
    }

    /// Tests: stop an attempt at a crash point, as if the process died there.
    pub fn with_crash_hook(mut self, hook: Arc<dyn CrashHook>) -> Processor<R> {
        self.crash = Some(hook);
        self
    }

    /// The simulator's broken-guard test only: attempts send without looking the key up first.
    /// Has an effect only under the `broken-guards` feature, which no build that ships turns on.
    pub fn without_lookup_before_send(mut self) -> Processor<R> {
        self.skip_lookup = true;
        self
    }

    fn looks_up(&self) -> bool {
        !(cfg!(feature = "broken-guards") && self.skip_lookup)
    }

    fn crashes_at(&self, point: CrashPoint) -> bool {
        self.crash.as_ref().is_some_and(|h| h.should_crash(point))
    }

    fn store(&self) -> &dyn Store {
        self.store.as_ref()
    }

    /// One pass: claims up to `batch` due jobs and makes one attempt of each, all at once.
    pub async fn process_pass(&self) -> Result<Vec<(String, AttemptEnd)>, StoreError> {
        let batch = self.settings.batch.clamp(1, limits::PAYOUTS_IN_FLIGHT_MAX);
        let claimed = self.rail.claim(self.store(), &self.worker, batch).await?;
        let attempts = claimed.into_iter().map(|c| async move {
            let id = String::from(c.job.id.clone());
            let end = self.attempt(c).await;
            (id, end)
        });
        Ok(futures_util::future::join_all(attempts).await)
    }

    /// One attempt of one claimed job: lookup, then (renew lease, mark sending) send, then record.
    pub async fn attempt(&self, claimed: ClaimedJob) -> AttemptEnd {
        let id = claimed.job.id.clone();
        let token = claimed.lease_token.clone();
        match self.try_attempt(&id, &token, claimed).await {
            Ok(end) => end,
            // A report refused because the lease lapsed meanwhile: the rescuer has the job.
            Err(StoreError::LeaseLost(lost)) => {
                tracing::warn!(job = %id, %lost, rail = R::WHAT, "attempt lost its lease before recording its result");
                AttemptEnd::LeaseLost
            }
            Err(e) => {
                tracing::warn!(job = %id, error = %e, rail = R::WHAT, "attempt could not be recorded; the lease will expire");
                AttemptEnd::StoreError
            }
        }
    }

    fn fail(&self, token: &LeaseToken, code: FailCode, message: String, retryable: Option<bool>) -> FailSignal {
        let retryable = retryable.or_else(|| R::retryable(&code));
        FailSignal {
            lease_token: token.clone(),
            code,
            message: Some(bounded(message)),
            retryable,
            retry_after_ms: None,
        }
    }

    async fn try_attempt(&self, id: &JobId, token: &LeaseToken, claimed: ClaimedJob) -> Result<AttemptEnd, StoreError> {
        let store = self.store();
        let row = self.rail.read(store, id).await?;
        let found = if self.looks_up() { self.rail.lookup(R::key(&row)).await } else { Lookup::Absent };
        match found {
            Lookup::Found { id: found, returned } => {
                self.rail.succeeded(store, id, Some(token), &found, returned).await?;
                return Ok(AttemptEnd::Succeeded);
            }
            Lookup::Failed { message } => {
                tracing::warn!(job = %id, %message, rail = R::WHAT, "provider lookup failed; retrying later");
                let signal = self.fail(token, FailCode::lookup_failed(), message, Some(true));
                self.rail.failed(store, id, signal).await?;
                return Ok(AttemptEnd::Failed);
            }
            Lookup::Absent => {}
        }
        // Renew the lease and mark the attempt as sending, committed before the request leaves.
        let heartbeat = match self.rail.heartbeat(store, id, token).await {
            Ok(h) => h,
            Err(StoreError::LeaseLost(_)) => return Ok(AttemptEnd::LeaseLost),
            Err(e) => return Err(e),
        };
        if heartbeat.cancel_requested {
            let signal = self.fail(token, FailCode::cancelled(), "cancelled before the send".into(), Some(false));
            self.rail.failed(store, id, signal).await?;
            return Ok(AttemptEnd::Cancelled);
        }
        if self.crashes_at(CrashPoint::PayoutAfterLookup) {
            return Ok(AttemptEnd::Crashed);
        }
        // A process that stalled since the renewal (a pause, a swap storm) must not send on a lease
        // that may have run out: the attempt is marked sending, so the rescuer makes it unknown. The
        // lease is measured on the store's clock, from what the renewal wrote.
        let lease_micros = claimed.lease_expires_at.micros() - claimed.job.updated_at.micros();
        let left_micros = heartbeat.lease_expires_at.micros() - store.now().micros();
        if left_micros < lease_micros / 2 {
            tracing::warn!(job = %id, rail = R::WHAT, "stalled before the send; leaving it to the reconciler");
            return Ok(AttemptEnd::LeaseLost);
        }
        let end = match self.rail.send(&row).await {
            Sent::Executed { id: executed } => {
                if self.crashes_at(CrashPoint::PayoutAfterSend) {
                    return Ok(AttemptEnd::Crashed);
                }
                self.rail.succeeded(store, id, Some(token), &executed, false).await?;
                AttemptEnd::Succeeded
            }
            Sent::Refused { code, message, retry_after_ms } => {
                let mut signal = self.fail(token, code, message, None);
                signal.retry_after_ms = retry_after_ms;
                self.rail.failed(store, id, signal).await?;
                AttemptEnd::Failed
            }
            Sent::NoAnswer { message } => {
                tracing::warn!(job = %id, %message, rail = R::WHAT, "no answer to a send; its outcome is unknown");
                self.rail.unknown(store, id, token, Some(&bounded(message))).await?;
                AttemptEnd::Unknown
            }
        };
        Ok(end)
    }

    /// One reconcile pass over at most `batch` unknown jobs; returns the ids it moved.
    pub async fn reconcile_pass(&self) -> Result<Vec<String>, StoreError> {
        let after = *self.reconcile_after.lock().expect("cursor lock");
        let page = Page { after, limit: self.settings.batch.max(1) };
        let page = self.rail.list(self.store(), JobState::Unknown, None, page).await?;
        *self.reconcile_after.lock().expect("cursor lock") = page.next_after.unwrap_or(0);
        let mut moved = Vec::new();
        for row in page.rows {
            let id = &R::job(&row).id;
            match self.reconcile_one(&row).await {
                Ok(true) => moved.push(id.to_string()),
                Ok(false) => {}
                Err(e) => tracing::warn!(job = %id, error = %e, rail = R::WHAT, "reconcile failed; continuing"),
            }
        }
        Ok(moved)
    }

    async fn reconcile_one(&self, row: &R::Row) -> Result<bool, StoreError> {
        let id = &R::job(row).id;
        match self.rail.lookup(R::key(row)).await {
            Lookup::Found { id: found, returned } => {
                Ok(self.rail.succeeded(self.store(), id, None, &found, returned).await?.applied)
            }
            // Applied only once the kind's confirm window has passed since the job went unknown.
            Lookup::Absent => Ok(self.store.reconcile(id, Finding::Absent).await?.applied),
            Lookup::Failed { message } => {
                tracing::warn!(job = %id, %message, rail = R::WHAT, "provider unreachable; the job stays unknown");
                Ok(false)
            }
        }
    }

    /// One re-check pass (when `return_window` is set): succeeded jobs that young are asked whether
    /// they came back; dead and cancelled ones whether an earlier send executed after all (then the
    /// success path records it). Returns the ids it moved.
    pub async fn recheck_pass(&self) -> Result<Vec<String>, StoreError> {
        if self.settings.return_window.is_zero() {
            return Ok(Vec::new());
        }
        let since = self.store.now().micros().saturating_sub(self.settings.return_window.as_micros() as i64);
        let states: &[JobState] = if R::RETURNS {
            &[JobState::Succeeded, JobState::Dead, JobState::Cancelled]
        } else {
            &[JobState::Dead, JobState::Cancelled]
        };
        let (which, after) = *self.recheck_after.lock().expect("cursor lock");
        let state = states[which % states.len()];
        let page = Page { after, limit: self.settings.batch.max(1) };
        let page = self.rail.list(self.store(), state, Some(Timestamp::from_micros(since)), page).await?;
        *self.recheck_after.lock().expect("cursor lock") = match page.next_after {
            Some(next) => (which, next),
            None => ((which + 1) % states.len(), 0),
        };
        let mut moved = Vec::new();
        for row in page.rows {
            let job = R::job(&row);
            // Never tried, or a late execution already recorded: nothing to ask.
            if state != JobState::Succeeded && (job.attempt == 0 || R::provider_id(&row).is_some()) {
                continue;
            }
            let applied = match (state, self.rail.lookup(R::key(&row)).await) {
                (JobState::Succeeded, Lookup::Found { returned: true, .. }) => {
                    self.rail.returned(self.store(), &job.id).await
                }
                (JobState::Dead | JobState::Cancelled, Lookup::Found { id: found, returned }) => {
                    tracing::error!(job = %job.id, %found, state = state.as_str(), rail = R::WHAT, "a closed job was executed after all");
                    self.rail
                        .succeeded(self.store(), &job.id, None, &found, returned)
                        .await
                        .map(|o| o.applied || R::provider_id(&o.value).is_some())
                }
                _ => Ok(false),
            };
            match applied {
                Ok(true) => moved.push(job.id.to_string()),
                Ok(false) => {}
                Err(e) => tracing::warn!(job = %job.id, error = %e, rail = R::WHAT, "re-check failed; continuing"),
            }
        }
        Ok(moved)
    }

    /// Runs the processing loop (woken when work becomes due) and the reconcile loop until `cancel`.
    pub fn spawn(self, cancel: CancellationToken) -> Vec<JoinHandle<()>> {
        let this = Arc::new(self);
        let process = {
            let (this, cancel) = (this.clone(), cancel.clone());
            tokio::spawn(async move { this.run_processing(cancel).await })
        };
        let reconcile = tokio::spawn(async move { this.run_reconcile(cancel).await });
        vec![process, reconcile]
    }

    async fn run_processing(&self, cancel: CancellationToken) {
        let wake = self.store.wake();
        loop {
            let notified = wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            let busy = match self.process_pass().await {
                Ok(done) => {
                    if !done.is_empty() {
                        tracing::debug!(count = done.len(), rail = R::WHAT, "pass made attempts");
                    }
                    done.len() as u32 >= self.settings.batch.clamp(1, limits::PAYOUTS_IN_FLIGHT_MAX)
                }
                Err(e) => {
                    tracing::warn!(error = %e, rail = R::WHAT, "pass failed; will try again");
                    false
                }
            };
            if busy {
                if cancel.is_cancelled() {
                    return;
                }
                continue;
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = &mut notified => {}
                _ = tokio::time::sleep(self.settings.every) => {}
            }
        }
    }

    async fn run_reconcile(&self, cancel: CancellationToken) {
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(self.settings.reconcile_every) => {}
            }
            match self.reconcile_pass().await {
                Ok(ids) if !ids.is_empty() => {
                    tracing::info!(count = ids.len(), rail = R::WHAT, "reconciled unknown jobs")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, rail = R::WHAT, "reconcile pass failed; will try again"),
            }
            match self.recheck_pass().await {
                Ok(ids) if !ids.is_empty() => tracing::info!(count = ids.len(), rail = R::WHAT, "re-check moved jobs"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, rail = R::WHAT, "re-check pass failed; will try again"),
            }
        }
    }
}

/// A provider's words kept within the longest message the store takes.
pub(crate) fn bounded(mut message: String) -> String {
    if message.len() > limits::MESSAGE_LEN_MAX {
        let mut cut = limits::MESSAGE_LEN_MAX;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    message
}
