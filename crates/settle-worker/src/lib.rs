//! Settle's background loops. Each is a pass of guarded transitions through the `Store`, with a
//! bounded batch and its own pace; any number of processes may run them against one PostgreSQL
//! (every transition is guarded, so two rescuers never rescue one lease twice).
//!
//! - lease rescuer: `running` past its lease → the failure path (`LEASE_EXPIRED`, retryable), or
//!   teardown after a cancel request (`unknown` for `final_failure` jobs);
//! - teardown sweeper: finishes every job left `cancelling`;
//! - grant expiry (at the sweeper's pace): expires what is left of every grant past its
//!   `expires_at`, one guarded transition per account (docs/decisions/0023);
//! - reconciler: asks a kind's `OutcomeChecker` about each `unknown` job; without a checker, or when
//!   the checker finds nothing, "absent" — which the store turns into `TIMEOUT_CONFIRMED_NOT_SENT`
//!   (retryable) only once the kind's confirm window has passed. Withdrawals are left to the payout
//!   processor's own reconcile pass, which asks the provider (no provider: they stay unknown);
//! - payout processor (`payouts`): withdrawals against the provider.

pub mod funding;
mod http;
pub mod payouts;
pub mod processor;
pub mod webhooks;

use async_trait::async_trait;
use settle_core::job::JobState;
use settle_store::{Finding, Job, JobFilter, Page, Store, StoreError};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Asks the external system whether an `unknown` job's effect happened (a payout provider, by the
/// job's idempotency key).
#[async_trait]
pub trait OutcomeChecker: Send + Sync {
    /// `Some(Present)`: it happened; `Some(Absent)`: it did not; `None`: cannot tell now.
    async fn check(&self, job: &Job) -> Result<Option<Finding>, String>;
}

#[derive(Debug, Clone, Copy)]
pub struct LoopSettings {
    pub rescue_every: Duration,
    pub sweep_every: Duration,
    pub reconcile_every: Duration,
    /// Most jobs one pass takes; the next pass takes the rest.
    pub batch: u32,
}

impl Default for LoopSettings {
    fn default() -> LoopSettings {
        LoopSettings {
            rescue_every: Duration::from_secs(1),
            sweep_every: Duration::from_secs(1),
            reconcile_every: Duration::from_secs(10),
            batch: 100,
        }
    }
}

pub struct Maintenance {
    store: Arc<dyn Store>,
    settings: LoopSettings,
    checkers: BTreeMap<String, Arc<dyn OutcomeChecker>>,
    /// Where the next reconcile pass starts: passes walk all unknown jobs page by page and wrap
    /// around, so jobs nobody can resolve yet never hide the ones behind them.
    reconcile_after: std::sync::Mutex<i64>,
}

impl Maintenance {
    pub fn new(store: Arc<dyn Store>, settings: LoopSettings) -> Maintenance {
        Maintenance { store, settings, checkers: BTreeMap::new(), reconcile_after: std::sync::Mutex::new(0) }
    }

    /// Registers the checker for one job kind.
    pub fn with_checker(mut self, kind: &str, checker: Arc<dyn OutcomeChecker>) -> Maintenance {
        self.checkers.insert(kind.to_owned(), checker);
        self
    }

    /// One rescuer pass; returns the ids of the jobs it took back.
    pub async fn rescue_pass(&self) -> Result<Vec<String>, StoreError> {
        self.store.rescue_expired_leases(self.settings.batch).await
    }

    /// One sweeper pass; returns the ids of the jobs it finished.
    pub async fn sweep_pass(&self) -> Result<Vec<String>, StoreError> {
        self.store.resume_teardowns(self.settings.batch).await
    }

    /// One expiry pass; returns the accounts whose grants it expired.
    pub async fn expire_pass(&self) -> Result<Vec<String>, StoreError> {
        self.store.expire_grants(self.settings.batch).await
    }

    /// One reconciler pass over at most `batch` unknown jobs; returns the ids it resolved.
    pub async fn reconcile_pass(&self) -> Result<Vec<String>, StoreError> {
        let filter = JobFilter { state: Some(JobState::Unknown), ..JobFilter::ALL };
        let after = *self.reconcile_after.lock().expect("cursor lock");
        let page = self.store.jobs(&filter, Page { after, limit: self.settings.batch }).await?;
        *self.reconcile_after.lock().expect("cursor lock") = page.next_after.unwrap_or(0);
        let mut resolved = Vec::new();
        for job in page.rows {
            // Only the provider can say what became of a payout or a charge: never "absent" for lack
            // of asking (their processors reconcile them).
            if settle_core::job::Rail::of(job.kind.as_str()).is_reserved() {
                continue;
            }
            let finding = match self.checkers.get(job.kind.as_str()) {
                None => Finding::Absent,
                Some(checker) => match checker.check(&job).await {
                    Ok(Some(f)) => f,
                    Ok(None) => continue,
                    Err(e) => {
                        tracing::warn!(job = %job.id, error = %e, "outcome check failed; will ask again");
                        continue;
                    }
                },
            };
            match self.store.reconcile(&job.id, finding).await {
                Ok(out) if out.applied => resolved.push(job.id.into()),
                Ok(_) => {}
                Err(e) => tracing::error!(job = %job.id, error = %e, "reconcile failed; continuing"),
            }
        }
        Ok(resolved)
    }

    /// Runs the four loops until `cancel`; each pass's errors are logged and the loop goes on.
    pub fn spawn(self, cancel: CancellationToken) -> Vec<JoinHandle<()>> {
        let this = Arc::new(self);
        let mut handles = Vec::new();
        for which in [Loop::Rescue, Loop::Sweep, Loop::Expire, Loop::Reconcile] {
            let (this, cancel) = (this.clone(), cancel.clone());
            handles.push(tokio::spawn(async move { this.run_loop(which, cancel).await }));
        }
        handles
    }

    async fn run_loop(&self, which: Loop, cancel: CancellationToken) {
        let every = match which {
            Loop::Rescue => self.settings.rescue_every,
            Loop::Sweep | Loop::Expire => self.settings.sweep_every,
            Loop::Reconcile => self.settings.reconcile_every,
        };
        loop {
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            let result = match which {
                Loop::Rescue => self.rescue_pass().await,
                Loop::Sweep => self.sweep_pass().await,
                Loop::Expire => self.expire_pass().await,
                Loop::Reconcile => self.reconcile_pass().await,
            };
            match result {
                Ok(ids) if !ids.is_empty() => {
                    tracing::info!(pass = which.name(), count = ids.len(), "background pass moved jobs or grants")
                }
                Ok(_) => {}
                Err(e) => tracing::warn!(pass = which.name(), error = %e, "background pass failed; will try again"),
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Loop {
    Rescue,
    Sweep,
    Expire,
    Reconcile,
}

impl Loop {
    fn name(self) -> &'static str {
        match self {
            Loop::Rescue => "lease_rescue",
            Loop::Sweep => "teardown_sweep",
            Loop::Expire => "grant_expiry",
            Loop::Reconcile => "reconcile",
        }
    }
}
