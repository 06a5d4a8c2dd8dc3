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
mod worker;

pub use accounts::{Alert, AutoTopUp, NewLimit, NewTopUp, SpendLimit, TopUp};
pub use reports::{JobReport, REPORTS_MAX, Signal};
use serde::Deserialize;
use serde_json::{Value, json};
use std::time::Duration;
pub use worker::{Flow, Handler, JobContext, Outcome, Worker};

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
