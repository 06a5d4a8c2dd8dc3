//! A worker SDK for Settle's HTTP API (`api-v1.md`, worker protocol), so a job's author writes only
//! the work: [`Worker::run`] claims with long-polls, heartbeats on a timer, hands each job to a
//! [`Handler`], reports items one by one, stops at the next item boundary when a cancel is
//! requested, and reports success, a retryable or permanent failure, or an unknown outcome. Jobs
//! that finish while earlier reports are in flight are reported together, in one
//! `POST /v1/reports` ([`Client::reports`]; docs/design/reports.md §9).
//!
//! Every report answers a [`Report`]: `Applied` (it took effect now) or `Replayed` (the same report
//! had already taken effect — a re-send after a lost answer); a refused one is
//! [`ClientError::LeaseLost`], whose `details` say what became of the job (decision 0019).
//!
//! The worker rides out a server that is down or busy (connection errors, timeouts, `429`, `5xx`):
//! claims, heartbeats and reports are retried with capped exponential backoff and full jitter, with
//! one log line when the outage starts and one when it ends. A report is re-sent as first sent, so
//! one whose answer was lost is answered as a replay. A refused token (`401`, `403`) ends
//! [`Worker::run`] with that error.

mod accounts;
mod reports;

pub use accounts::{Alert, AutoTopUp, NewLimit, NewTopUp, SpendLimit, TopUp};
use reports::Reporter;
pub use reports::{JobReport, REPORTS_MAX, Signal};
use serde::Deserialize;
use serde_json::{Value, json};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The server's largest claim.
const CLAIM_LIMIT_MAX: u32 = 100;
/// The longest wait between two tries while Settle does not answer.
const BACKOFF_MAX: Duration = Duration::from_secs(10);
/// How long a report is re-sent before the worker gives up on it (the lease then lapses and the
/// server rescues the job).
const REPORT_PATIENCE: Duration = Duration::from_secs(900);

/// Whether trying again later may succeed: no answer at all, or the server said so.
fn transient(e: &ClientError) -> bool {
    match e {
        ClientError::Transport(_) => true,
        ClientError::Api { status, .. } => *status == 429 || *status >= 500,
        _ => false,
    }
}

/// Capped exponential backoff with full jitter: a random wait below 0.2 s · 2^n, at most 10 s.
fn backoff(failures: u32) -> Duration {
    use std::hash::BuildHasher;
    let cap = (200u64 << failures.min(16)).min(BACKOFF_MAX.as_millis() as u64);
    // A fresh randomly keyed hasher per call: jitter without a dependency.
    let r = std::collections::hash_map::RandomState::new().hash_one(std::time::Instant::now());
    Duration::from_millis(r % cap.max(1))
}

/// One log line when Settle stops answering and one when it answers again — not one per try.
#[derive(Default)]
struct Outage(std::sync::Mutex<Option<std::time::Instant>>);

impl Outage {
    fn failed(&self, what: &str, e: &ClientError) {
        let mut since = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if since.is_none() {
            *since = Some(std::time::Instant::now());
            tracing::warn!(error = %e, "Settle does not answer ({what}); retrying with backoff");
        }
    }

    fn answered(&self) {
        let mut since = self.0.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(t) = since.take() {
            tracing::warn!(after_seconds = t.elapsed().as_secs_f64(), "Settle answers again");
        }
    }
}

/// `call` until it answers or fails for good: a report re-sent as it was first sent.
async fn retrying<T, F, Fut>(outage: &Outage, what: &str, mut call: F) -> Result<T, ClientError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, ClientError>>,
{
    let deadline = std::time::Instant::now() + REPORT_PATIENCE;
    let mut failures = 0;
    loop {
        match call().await {
            Err(e) if transient(&e) && std::time::Instant::now() < deadline => {
                outage.failed(what, &e);
                failures += 1;
                tokio::time::sleep(backoff(failures)).await;
            }
            r => {
                if !matches!(&r, Err(e) if transient(e)) {
                    outage.answered();
                }
                return r;
            }
        }
    }
}

#[derive(Debug, Clone, thiserror::Error)]
pub enum ClientError {
    /// The report was refused because its lease is gone (expired and rescued, or the job ended):
    /// stop working on the job. `details`: `{"state", "lease": "expired" | "ended" |
    /// "never_issued", "attempt": {…} | null}` — what became of the job and of the token's attempt.
    #[error("lease lost: {message}")]
    LeaseLost { message: String, details: Value },
    /// Settle answered with an error body; `details` are its `error.details` (`Null` when none),
    /// e.g. a `spend_limit_exceeded`'s `{period, amount, spent, remaining, kinds, needed}`.
    #[error("{status} {code}: {message}")]
    Api { status: u16, code: String, message: String, details: Value },
    #[error("transport: {0}")]
    Transport(String),
    /// An id that cannot be a path segment: nothing was sent.
    #[error("{0}")]
    InvalidId(String),
}

/// An id as one path segment, refused unless it follows the spec's id rule. URL clients (reqwest
/// among them) remove `.` and `..` segments, so `items/../succeed` would be sent as the job's own
/// `succeed`; anything else outside the alphabet would need encoding the server never decodes to
/// an id. Settle refuses such ids at creation, so meeting one here is a caller's mistake.
fn segment<'a>(what: &str, id: &'a str) -> Result<&'a str, ClientError> {
    let alphabet = id.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b':' | b'-'));
    if id.is_empty() || id.len() > 128 || !alphabet || id == "." || id == ".." {
        return Err(ClientError::InvalidId(format!(
            "the {what} {id:?} is not an id: 1-128 characters of [A-Za-z0-9_.:-], and not '.' or '..'"
        )));
    }
    Ok(id)
}

#[derive(Debug, Clone, Deserialize)]
pub struct Item {
    pub id: String,
    /// Its price; null for a held item until a success prices it.
    #[serde(default)]
    pub cost: Option<i64>,
    /// A held item's hold: its price is what the work used, at most this (report it with
    /// `JobContext::item_done_at`, or `Outcome::Priced`).
    #[serde(default)]
    pub hold: Option<i64>,
    pub state: String,
    /// `job_failed`, `item_failed`, `cancelled`, or null.
    #[serde(default)]
    pub refund_reason: Option<String>,
}

impl Item {
    /// Whether this attempt must do the item: still charged, or refunded only because an earlier
    /// attempt of the job failed (the job's success will reclaim it, so the work must be done).
    pub fn to_do(&self) -> bool {
        self.state == "charged" || (self.state == "refunded" && self.refund_reason.as_deref() == Some("job_failed"))
    }
}

/// A claimed job, as `POST /v1/claims` answers it (the fields a worker needs).
#[derive(Debug, Clone, Deserialize)]
pub struct ClaimedJob {
    pub id: String,
    pub kind: String,
    pub attempt: u32,
    pub payload: Value,
    pub items: Vec<Item>,
    pub lease_token: String,
    pub lease_expires_at: String,
    pub cancel_requested: bool,
}

#[derive(Debug, Deserialize)]
struct Claimed {
    jobs: Vec<ClaimedJob>,
}

#[derive(Debug, Clone, Deserialize)]
pub struct Heartbeat {
    pub lease_expires_at: String,
    pub cancel_requested: bool,
}

#[derive(Debug, Deserialize)]
struct ItemReport {
    cancel_requested: bool,
}

/// How a worker's report landed (decision 0019).
#[derive(Debug, Clone, PartialEq)]
pub enum Report<T> {
    /// It took effect now.
    Applied(T),
    /// The same report had already taken effect (re-sent after its answer was lost): nothing
    /// changed; `T` is as it is now.
    Replayed(T),
}

impl<T> Report<T> {
    pub fn value(self) -> T {
        match self {
            Report::Applied(v) | Report::Replayed(v) => v,
        }
    }

    pub fn is_replay(&self) -> bool {
        matches!(self, Report::Replayed(_))
    }

    fn map<U>(self, f: impl FnOnce(T) -> U) -> Report<U> {
        match self {
            Report::Applied(v) => Report::Applied(f(v)),
            Report::Replayed(v) => Report::Replayed(f(v)),
        }
    }
}

/// The HTTP client: one call per endpoint of the worker protocol.
#[derive(Clone)]
pub struct Client {
    base: String,
    token: Option<String>,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base: &str, token: Option<&str>) -> Client {
        let http = reqwest::Client::builder().timeout(Duration::from_secs(60)).build().unwrap_or_default();
        Client { base: base.trim_end_matches('/').to_owned(), token: token.map(str::to_owned), http }
    }

    async fn post(&self, path: &str, body: Value) -> Result<Value, ClientError> {
        self.report(path, body).await.map(Report::value)
    }

    /// A POST whose answer may be a replay (`Idempotent-Replayed: true`).
    async fn report(&self, path: &str, body: Value) -> Result<Report<Value>, ClientError> {
        self.request(reqwest::Method::POST, path, Some(body)).await
    }

    /// One request, its error body made a `ClientError`.
    async fn request(
        &self,
        method: reqwest::Method,
        path: &str,
        body: Option<Value>,
    ) -> Result<Report<Value>, ClientError> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(body) = &body {
            req = req.json(body);
        }
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let resp = req.send().await.map_err(|e| ClientError::Transport(e.to_string()))?;
        let status = resp.status().as_u16();
        let replayed = resp.headers().get("idempotent-replayed").is_some_and(|v| v == "true");
        // `204 No Content` (a delete) answers nothing: null.
        let text = resp.text().await.map_err(|e| ClientError::Transport(e.to_string()))?;
        let v: Value = match serde_json::from_str(&text) {
            _ if text.is_empty() => Value::Null,
            Ok(v) => v,
            // An error that is not Settle's (a proxy's page): judged by its status alone.
            Err(_) if status >= 300 => {
                let message = text.chars().take(200).collect();
                return Err(ClientError::Api { status, code: String::new(), message, details: Value::Null });
            }
            Err(e) => return Err(ClientError::Transport(e.to_string())),
        };
        if status < 300 {
            return Ok(if replayed { Report::Replayed(v) } else { Report::Applied(v) });
        }
        Err(api_error(status, &v["error"]))
    }

    pub async fn claim(
        &self,
        worker: &str,
        kinds: &[String],
        limit: u32,
        lease_seconds: Option<u32>,
        wait_seconds: u32,
    ) -> Result<Vec<ClaimedJob>, ClientError> {
        self.claim_labelled(worker, kinds, &[], limit, lease_seconds, wait_seconds).await
    }

    /// `claim` by a worker that has `labels` (`gpu:a100`, `region:eu`): it is given only jobs whose
    /// every required label is among them.
    pub async fn claim_labelled(
        &self,
        worker: &str,
        kinds: &[String],
        labels: &[String],
        limit: u32,
        lease_seconds: Option<u32>,
        wait_seconds: u32,
    ) -> Result<Vec<ClaimedJob>, ClientError> {
        let mut body =
            json!({"worker": worker, "limit": limit.clamp(1, CLAIM_LIMIT_MAX), "wait_seconds": wait_seconds});
        if !labels.is_empty() {
            body["labels"] = json!(labels);
        }
        if let Some(l) = lease_seconds {
            body["lease_seconds"] = json!(l);
        }
        if !kinds.is_empty() {
            body["kinds"] = json!(kinds);
        }
        let v = self.post("/v1/claims", body).await?;
        serde_json::from_value::<Claimed>(v).map(|c| c.jobs).map_err(|e| ClientError::Transport(e.to_string()))
    }

    pub async fn heartbeat(&self, job: &str, token: &str) -> Result<Heartbeat, ClientError> {
        let job = segment("job id", job)?;
        let v = self.post(&format!("/v1/jobs/{job}/heartbeat"), json!({"lease_token": token})).await?;
        serde_json::from_value(v).map_err(|e| ClientError::Transport(e.to_string()))
    }

    /// Answers the job (a cancel that won the race: its `state` is `cancelling` or `cancelled`).
    pub async fn succeed(&self, job: &str, token: &str, result: Option<Value>) -> Result<Report<Value>, ClientError> {
        self.succeed_priced(job, token, result, &Costs::new()).await
    }

    /// A success with the prices of the held items it decides (item id → credits, at most each
    /// item's hold): what the work used.
    pub async fn succeed_priced(
        &self,
        job: &str,
        token: &str,
        result: Option<Value>,
        costs: &Costs,
    ) -> Result<Report<Value>, ClientError> {
        let mut body = json!({"lease_token": token});
        if let Some(r) = result {
            body["result"] = r;
        }
        if !costs.is_empty() {
            body["costs"] = json!(costs);
        }
        self.report(&format!("/v1/jobs/{}/succeed", segment("job id", job)?), body).await
    }

    pub async fn fail(&self, job: &str, token: &str, failure: &Failure) -> Result<Report<Value>, ClientError> {
        let mut body = json!({"lease_token": token, "code": failure.code, "message": failure.message});
        if let Some(r) = failure.retryable {
            body["retryable"] = json!(r);
        }
        if let Some(ms) = failure.retry_after_ms {
            body["retry_after_ms"] = json!(ms);
        }
        self.report(&format!("/v1/jobs/{}/fail", segment("job id", job)?), body).await
    }

    /// Hands the job back at an item boundary (the worker must stop): queued again, due at once,
    /// the attempt not counted; torn down instead when a cancel was requested.
    pub async fn release(&self, job: &str, token: &str) -> Result<Report<Value>, ClientError> {
        let job = segment("job id", job)?;
        self.report(&format!("/v1/jobs/{job}/release"), json!({"lease_token": token})).await
    }

    pub async fn unknown(&self, job: &str, token: &str, message: &str) -> Result<Report<Value>, ClientError> {
        let job = segment("job id", job)?;
        self.report(&format!("/v1/jobs/{job}/unknown"), json!({"lease_token": token, "message": message})).await
    }

    /// Answers whether a cancel has been requested.
    pub async fn item_succeed(&self, job: &str, item: &str, token: &str) -> Result<Report<bool>, ClientError> {
        self.item_succeed_priced(job, item, token, None).await
    }

    /// An item delivered, with its price when it is held (required then: at most its hold).
    /// Answers whether a cancel has been requested.
    pub async fn item_succeed_priced(
        &self,
        job: &str,
        item: &str,
        token: &str,
        cost: Option<i64>,
    ) -> Result<Report<bool>, ClientError> {
        let (job, item) = (segment("job id", job)?, segment("item id", item)?);
        let mut body = json!({"lease_token": token});
        if let Some(c) = cost {
            body["cost"] = json!(c);
        }
        let r = self.report(&format!("/v1/jobs/{job}/items/{item}/succeed"), body).await?;
        Ok(r.map(cancel_requested))
    }

    /// Registers an artifact of an item (an output teardown deletes if the item is not delivered);
    /// returns the path to write it at in the artifact store, `{job}/{item}/{key}`.
    pub async fn register_artifact(
        &self,
        job: &str,
        item: &str,
        token: &str,
        key: &str,
    ) -> Result<Report<String>, ClientError> {
        let (job, item) = (segment("job id", job)?, segment("item id", item)?);
        let r = self
            .report(&format!("/v1/jobs/{job}/items/{item}/artifacts"), json!({"lease_token": token, "key": key}))
            .await?;
        match r.map(|v| v["path"].as_str().map(str::to_owned).ok_or_else(|| format!("no path in {v}"))) {
            Report::Applied(Ok(p)) => Ok(Report::Applied(p)),
            Report::Replayed(Ok(p)) => Ok(Report::Replayed(p)),
            Report::Applied(Err(e)) | Report::Replayed(Err(e)) => Err(ClientError::Transport(e)),
        }
    }

    /// Answers whether a cancel has been requested.
    pub async fn item_fail(
        &self,
        job: &str,
        item: &str,
        token: &str,
        code: &str,
        message: &str,
    ) -> Result<Report<bool>, ClientError> {
        let (job, item) = (segment("job id", job)?, segment("item id", item)?);
        let r = self
            .report(
                &format!("/v1/jobs/{job}/items/{item}/fail"),
                json!({"lease_token": token, "code": code, "message": message}),
            )
            .await?;
        Ok(r.map(cancel_requested))
    }
}

/// An error answer's `error` object as a `ClientError`: `lease_lost` with its details, or the rest.
fn api_error(status: u16, error: &Value) -> ClientError {
    let code = error["code"].as_str().unwrap_or("").to_owned();
    let message = error["message"].as_str().unwrap_or("").to_owned();
    if code == "lease_lost" {
        return ClientError::LeaseLost { message, details: error["details"].clone() };
    }
    ClientError::Api { status, code, message, details: error["details"].clone() }
}

fn cancel_requested(v: Value) -> bool {
    serde_json::from_value::<ItemReport>(v).map(|r| r.cancel_requested).unwrap_or(false)
}

#[derive(Debug, Clone)]
pub struct Failure {
    pub code: String,
    pub message: String,
    /// `None` defers to the server's retryable codes for the job's kind.
    pub retryable: Option<bool>,
    pub retry_after_ms: Option<u64>,
}

/// The prices of a job's held items (item id → credits): what the work used, at most each hold.
pub type Costs = std::collections::BTreeMap<String, i64>;

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
