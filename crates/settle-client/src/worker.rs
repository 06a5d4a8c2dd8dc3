//! The worker: claims with long-polls, runs each job's [`Handler`] beside its heartbeat, reports
//! items one by one, stops at the next item boundary when a cancel is requested, and reports the
//! job's outcome through the reporter (`reports.rs`), together with other jobs' that finish
//! meanwhile.

use crate::reports::Reporter;
use crate::{
    ClaimedJob, Client, ClientError, Costs, Failure, JobReport, Outage, REPORTS_MAX, Report, Signal, backoff, retrying,
    transient,
};
use serde_json::Value;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// What a handler's work came to.
#[derive(Debug, Clone)]
pub enum Outcome {
    Succeeded(Option<Value>),
    /// Succeeded, with the prices of the job's held items (a job made with `hold`: its item is
    /// `main`).
    Priced(Option<Value>, Costs),
    Failed(Failure),
    /// The work may or may not have happened (a timeout after sending): never retried automatically.
    Unknown(String),
    /// The handler stopped at an item boundary ([`Flow::Stop`]): reported as `fail` with code
    /// `CANCELLED` when a cancel was requested, else — the worker is stopping — as a release.
    Cancelled,
    /// The handler hands the job back unfinished (the worker must stop): reported as a release —
    /// queued again, due at once, the attempt not counted.
    Released,
}

/// Whether to go on with the next item.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flow {
    Continue,
    /// A cancel was requested, the lease is gone, or the worker is stopping: stop at this item
    /// boundary.
    Stop,
}

/// What a handler sees of its job, and how it reports items.
pub struct JobContext {
    client: Client,
    pub job: ClaimedJob,
    cancel: Arc<AtomicBool>,
    lost: Arc<AtomicBool>,
    /// The worker was asked to stop: the job is released at the next item boundary.
    draining: CancellationToken,
    /// The items reported in this attempt (a stop after the last one lets the job finish).
    decided: Mutex<std::collections::HashSet<String>>,
    outage: Arc<Outage>,
}

impl JobContext {
    /// A cancel was requested, or the lease is gone: stop at this item boundary.
    pub fn cancel_requested(&self) -> bool {
        self.cancel.load(Ordering::SeqCst) || self.lost.load(Ordering::SeqCst)
    }

    /// Whether to stop at this item boundary: a cancel was requested, the lease is gone, or the
    /// worker is stopping (the `stop` token given to [`Worker::run`] was cancelled). Returning
    /// [`Outcome::Cancelled`] then fails the job `CANCELLED` after a cancel, and releases it when
    /// the worker is stopping.
    pub fn stopping(&self) -> bool {
        self.cancel_requested() || self.draining.is_cancelled()
    }

    /// Reports `item` delivered. A report the item's state contradicts (an earlier attempt failed
    /// it, a cancel ended it) changed nothing and is logged: the job goes on.
    pub async fn item_done(&self, item: &str) -> Result<Flow, ClientError> {
        self.item_done_at(item, None).await
    }

    /// Reports a held `item` delivered at `cost` (what its work used, at most its hold); the rest
    /// of its hold is released.
    pub async fn item_done_at(&self, item: &str, cost: Option<i64>) -> Result<Flow, ClientError> {
        let (id, token) = (&self.job.id, &self.job.lease_token);
        let cancel =
            retrying(&self.outage, "item report", || self.client.item_succeed_priced(id, item, token, cost)).await;
        self.item_answer(item, cancel)
    }

    fn item_answer(&self, item: &str, answer: Result<Report<bool>, ClientError>) -> Result<Flow, ClientError> {
        if answer.is_ok() || matches!(&answer, Err(ClientError::Api { code, .. }) if code == "invalid_transition") {
            self.decided.lock().unwrap_or_else(|p| p.into_inner()).insert(item.to_owned());
        }
        match answer {
            Ok(cancel) => Ok(self.flow(cancel.value())),
            Err(ClientError::Api { code, message, .. }) if code == "invalid_transition" => {
                tracing::warn!(job = %self.job.id, item, %message, "the item report changed nothing");
                Ok(self.flow(false))
            }
            Err(e) => {
                self.note(&e);
                Err(e)
            }
        }
    }

    pub async fn item_failed(&self, item: &str, code: &str, message: &str) -> Result<Flow, ClientError> {
        let (id, token) = (&self.job.id, &self.job.lease_token);
        let cancel =
            retrying(&self.outage, "item report", || self.client.item_fail(id, item, token, code, message)).await;
        self.item_answer(item, cancel)
    }

    /// Registers an artifact of `item` before writing it, so a teardown knows to delete it;
    /// returns the path to write it at (`{job}/{item}/{key}` under the artifact store's root).
    pub async fn register_artifact(&self, item: &str, key: &str) -> Result<String, ClientError> {
        let (id, token) = (&self.job.id, &self.job.lease_token);
        retrying(&self.outage, "artifact registration", || self.client.register_artifact(id, item, token, key))
            .await
            .map(Report::value)
            .inspect_err(|e| self.note(e))
    }

    /// Whether the lease was lost (the job is the server's to rescue now).
    pub fn lease_lost(&self) -> bool {
        self.lost.load(Ordering::SeqCst)
    }

    fn note(&self, e: &ClientError) {
        if matches!(e, ClientError::LeaseLost { .. }) {
            self.lost.store(true, Ordering::SeqCst);
        }
    }

    fn flow(&self, cancel: bool) -> Flow {
        if cancel {
            self.cancel.store(true, Ordering::SeqCst);
        }
        if self.cancel_requested() {
            return Flow::Stop;
        }
        // A worker stopping lets a job whose every item is reported finish: releasing it would
        // leave finished work queued for a worker that may never come.
        let decided = self.decided.lock().unwrap_or_else(|p| p.into_inner());
        let all_reported = self.job.items.iter().filter(|i| i.to_do()).all(|i| decided.contains(&i.id));
        if self.draining.is_cancelled() && !all_reported { Flow::Stop } else { Flow::Continue }
    }
}

#[async_trait::async_trait]
pub trait Handler: Send + Sync {
    async fn run(&self, ctx: &JobContext) -> Outcome;
}

/// A worker's labels from its environment: `SETTLE_WORKER_LABELS`, comma-separated.
fn labels_from_env() -> Vec<String> {
    let given = std::env::var("SETTLE_WORKER_LABELS").unwrap_or_default();
    given.split(',').map(str::trim).filter(|l| !l.is_empty()).map(str::to_owned).collect()
}

/// Claims and runs jobs until cancelled.
pub struct Worker {
    pub client: Client,
    pub name: String,
    pub kinds: Vec<String>,
    /// What this worker has (`gpu:a100`, `region:eu`): it is given only jobs whose every required
    /// label is among them. `Worker::new` takes them from `SETTLE_WORKER_LABELS` (comma-separated).
    pub labels: Vec<String>,
    /// Jobs run at once.
    pub concurrency: u32,
    /// A claim waits up to this long for work.
    pub wait_seconds: u32,
    /// The lease asked for with each claim (heartbeats then come at least every third of it);
    /// `None` takes the job kind's lease from the server's configuration, and `heartbeat_every`
    /// must then fit it.
    pub lease_seconds: Option<u32>,
    pub heartbeat_every: Duration,
    /// The most jobs' outcomes one request reports (`POST /v1/reports`, at most 100): jobs that
    /// finish while earlier reports are in flight go together in the next request. 1 sends each
    /// by its own route.
    pub reports_per_request: u32,
}

impl Worker {
    pub fn new(client: Client, name: &str) -> Worker {
        Worker {
            client,
            name: name.to_owned(),
            kinds: Vec::new(),
            labels: labels_from_env(),
            concurrency: 4,
            wait_seconds: 5,
            lease_seconds: None,
            heartbeat_every: Duration::from_secs(10),
            reports_per_request: REPORTS_MAX as u32,
        }
    }

    /// Claims and runs jobs until `stop`. Jobs in hand then stop at their next item boundary (each
    /// handler learns it from its next item report, as it would a cancel), report the item in hand
    /// and are released: queued again, due at once, the attempt not counted. A handler that reports
    /// no items runs to its end. Ends early with the error when Settle refuses the token (`401`,
    /// `403`); rides out everything else.
    pub async fn run(self, handler: Arc<dyn Handler>, stop: CancellationToken) -> Result<(), ClientError> {
        let slots = Arc::new(tokio::sync::Semaphore::new(self.concurrency.max(1) as usize));
        let mut tasks = tokio::task::JoinSet::new();
        let outage = Arc::new(Outage::default());
        let (reporter, reporting) = Reporter::start(self.client.clone(), self.reports_per_request as usize);
        let mut failures = 0;
        let mut refused = None;
        let heartbeat_every = match self.lease_seconds {
            Some(l) => self.heartbeat_every.min(Duration::from_millis(u64::from(l) * 1_000 / 3)),
            None => self.heartbeat_every,
        };
        while !stop.is_cancelled() {
            let free = slots.available_permits() as u32;
            if free == 0 {
                tokio::select! {
                    _ = stop.cancelled() => break,
                    _ = tasks.join_next() => continue,
                }
            }
            // Not raced against `stop`: a claim the server committed must not be thrown away
            // (its jobs would wait for their leases to expire). It is bounded by `wait_seconds`.
            let claimed = (self.client)
                .claim_labelled(&self.name, &self.kinds, &self.labels, free, self.lease_seconds, self.wait_seconds)
                .await;
            let jobs = match claimed {
                Ok(jobs) => {
                    outage.answered();
                    failures = 0;
                    jobs
                }
                Err(e @ ClientError::Api { status: 401 | 403, .. }) => {
                    tracing::error!(error = %e, "Settle refused the worker's token; stopping");
                    refused = Some(e);
                    break;
                }
                Err(e) => {
                    if transient(&e) {
                        outage.failed("claim", &e);
                    } else {
                        tracing::warn!(error = %e, "claim failed; retrying");
                    }
                    failures += 1;
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tokio::time::sleep(backoff(failures)) => {}
                    }
                    continue;
                }
            };
            for job in jobs {
                let permit = slots.clone().acquire_owned().await.expect("semaphore open");
                let (client, handler, outage, draining) =
                    (self.client.clone(), handler.clone(), outage.clone(), stop.clone());
                let reporter = reporter.clone();
                tasks.spawn(async move {
                    run_one(client, handler, job, heartbeat_every, (outage, reporter), draining).await;
                    drop(permit);
                });
            }
            while tasks.try_join_next().is_some() {}
        }
        // Jobs under way stop at their next item boundary, report and are released.
        while tasks.join_next().await.is_some() {}
        // Every job's report is answered: the reporter ends with its last sender.
        drop(reporter);
        let _ = reporting.await;
        refused.map_or(Ok(()), Err)
    }
}

/// The heartbeat of one job's lease, every `every` until `beating` is cancelled: it carries a
/// cancel request into `flags.0` and a lost lease into `flags.1`.
fn heartbeat(
    client: &Client,
    job: &ClaimedJob,
    every: Duration,
    flags: (&Arc<AtomicBool>, &Arc<AtomicBool>),
    beating: &CancellationToken,
    outage: &Arc<Outage>,
) -> tokio::task::JoinHandle<()> {
    let (client, id, token) = (client.clone(), job.id.clone(), job.lease_token.clone());
    let (cancel, lost, beating, outage) = (flags.0.clone(), flags.1.clone(), beating.clone(), outage.clone());
    tokio::spawn(async move {
        loop {
            tokio::select! {
                _ = beating.cancelled() => return,
                _ = tokio::time::sleep(every) => {}
            }
            match client.heartbeat(&id, &token).await {
                Ok(hb) => {
                    outage.answered();
                    cancel.store(hb.cancel_requested, Ordering::SeqCst)
                }
                Err(ClientError::LeaseLost { .. }) => {
                    lost.store(true, Ordering::SeqCst);
                    return;
                }
                // The beat goes on while the lease may last: one line per outage.
                Err(e) if transient(&e) => outage.failed("heartbeat", &e),
                Err(e) => tracing::warn!(job = %id, error = %e, "heartbeat failed"),
            }
        }
    })
}

async fn run_one(
    client: Client,
    handler: Arc<dyn Handler>,
    job: ClaimedJob,
    heartbeat_every: Duration,
    (outage, reporter): (Arc<Outage>, Reporter),
    draining: CancellationToken,
) {
    let cancel = Arc::new(AtomicBool::new(job.cancel_requested));
    let lost = Arc::new(AtomicBool::new(false));
    let beating = CancellationToken::new();
    // Stops the heartbeat whatever happens to this task (a panicking handler, an abort).
    let _stop_beating = beating.clone().drop_guard();
    let beat = heartbeat(&client, &job, heartbeat_every, (&cancel, &lost), &beating, &outage);
    let ctx = JobContext {
        client: client.clone(),
        job,
        cancel,
        lost,
        draining,
        decided: Mutex::default(),
        outage: outage.clone(),
    };
    let outcome = handler.run(&ctx).await;
    let (id, token) = (&ctx.job.id, &ctx.job.lease_token);
    // After the lease was lost only a success is reported (accepted from any attempt): a lost lease
    // is not a cancel, and a failure or an unknown outcome would be refused — the job is the
    // rescuer's now.
    let success = matches!(outcome, Outcome::Succeeded(_) | Outcome::Priced(..));
    if ctx.lease_lost() && !success {
        if matches!(outcome, Outcome::Unknown(_)) {
            tracing::error!(job = %id, "lease lost with the outcome unknown: the job was rescued and may run again");
        } else {
            tracing::warn!(job = %id, "lease lost; the server rescues the job, nothing to report");
        }
        return;
    }
    let unknown = matches!(outcome, Outcome::Unknown(_));
    // A stop at an item boundary that no cancel asked for: the worker is stopping, the job goes back.
    let release = matches!(outcome, Outcome::Released)
        || (matches!(outcome, Outcome::Cancelled) && !ctx.cancel_requested() && ctx.draining.is_cancelled());
    let cancelled = Failure {
        code: "CANCELLED".into(),
        message: "stopped at an item boundary".into(),
        retryable: Some(false),
        retry_after_ms: None,
    };
    let signal = match outcome {
        Outcome::Succeeded(result) => Signal::Succeed { result, costs: Costs::new() },
        Outcome::Priced(result, costs) => Signal::Succeed { result, costs },
        Outcome::Failed(f) => Signal::Fail(f),
        Outcome::Unknown(m) => Signal::Unknown(m),
        _ if release => Signal::Release,
        Outcome::Cancelled | Outcome::Released => Signal::Fail(cancelled),
    };
    let report = JobReport { job_id: id.clone(), lease_token: token.clone(), signal };
    // Re-sent as first sent until answered, alone or with other jobs' reports: a lost answer comes
    // back as a replay.
    // The lease is kept beating until the report is answered: it may wait behind other requests.
    let reported = retrying(&outage, "report", || reporter.send(&report)).await;
    beating.cancel();
    let _ = beat.await;
    match reported {
        Ok(Report::Applied(job)) if success && matches!(job["state"].as_str(), Some("cancelling" | "cancelled")) => {
            tracing::warn!(job = %id, "a cancel won over this success: the undelivered items were refunded")
        }
        Ok(Report::Applied(_)) => {}
        Ok(Report::Replayed(_)) => tracing::debug!(job = %id, "the report had already taken effect (a replay)"),
        // The rescuer retried the job meanwhile: the external effect may happen twice.
        Err(e @ ClientError::LeaseLost { .. }) if unknown => {
            tracing::error!(job = %id, error = %e, "the unknown outcome was refused: the job was rescued and may run again")
        }
        Err(e @ ClientError::LeaseLost { .. }) => tracing::warn!(job = %id, error = %e, "the report was refused"),
        Err(e) => {
            tracing::warn!(job = %id, error = %e, "could not report the outcome; the lease will expire and the job be rescued")
        }
    }
}
