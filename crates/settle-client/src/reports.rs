//! Many jobs' reports in one request (`POST /v1/reports`, decision 0041), and the worker's reporter
//! that forms those requests from the jobs that finish while earlier ones are in flight
//! (docs/design/reports.md §9).

use crate::{Client, ClientError, Costs, Failure, Report, segment};
use serde_json::{Value, json};
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{Semaphore, mpsc, oneshot};

/// The route's largest request.
pub const REPORTS_MAX: usize = 100;

/// What a job came to, as its worker reports it.
#[derive(Debug, Clone)]
pub enum Signal {
    /// `succeed`, with the prices of the held items it decides (empty for none).
    Succeed {
        result: Option<Value>,
        costs: Costs,
    },
    Fail(Failure),
    /// Handed back unfinished: queued again, the attempt not counted.
    Release,
    /// The work may or may not have happened.
    Unknown(String),
}

/// One job's report: the job, the lease it was done under, and what it came to.
#[derive(Debug, Clone)]
pub struct JobReport {
    pub job_id: String,
    pub lease_token: String,
    pub signal: Signal,
}

impl JobReport {
    /// The fields its single route's body has (the lease token, the outcome's own).
    fn fields(&self) -> Value {
        let mut body = json!({"lease_token": self.lease_token});
        match &self.signal {
            Signal::Succeed { result, costs } => {
                if let Some(r) = result {
                    body["result"] = r.clone();
                }
                if !costs.is_empty() {
                    body["costs"] = json!(costs);
                }
            }
            Signal::Fail(f) => {
                body["code"] = json!(f.code);
                body["message"] = json!(f.message);
                if let Some(r) = f.retryable {
                    body["retryable"] = json!(r);
                }
                if let Some(ms) = f.retry_after_ms {
                    body["retry_after_ms"] = json!(ms);
                }
            }
            Signal::Release => {}
            Signal::Unknown(m) => body["message"] = json!(m),
        }
        body
    }

    /// The route's name for it, `outcome` in `POST /v1/reports` and the last segment of its own.
    fn outcome(&self) -> &'static str {
        match self.signal {
            Signal::Succeed { .. } => "succeed",
            Signal::Fail(_) => "fail",
            Signal::Release => "release",
            Signal::Unknown(_) => "unknown",
        }
    }

    /// As an element of `POST /v1/reports`'s `reports`.
    fn element(&self) -> Value {
        let mut e = self.fields();
        e["job_id"] = json!(self.job_id);
        e["outcome"] = json!(self.outcome());
        e
    }

    /// Sent by its single route (`POST /v1/jobs/{id}/{outcome}`): answered with the whole job.
    pub async fn send_alone(&self, client: &Client) -> Result<Report<Value>, ClientError> {
        let job = segment("job id", &self.job_id)?;
        client.report(&format!("/v1/jobs/{job}/{}", self.outcome()), self.fields()).await
    }
}

impl Client {
    /// Reports on many jobs in one request (`POST /v1/reports`): each report is its own guarded
    /// transition, answered as its single route would answer it, but with the job in brief (`id`,
    /// `state`, `attempt`, `max_attempts`, `cancel_requested`, `not_before`, `net`, `last_error`,
    /// `updated_at`). `Err` is the request's own failure (nothing was answered: send the reports
    /// again, each is answered as a replay if it took effect); `Ok` holds one answer per report, in
    /// order. A report whose job id is not an id is answered `InvalidId` and not sent.
    pub async fn reports(&self, reports: &[JobReport]) -> Result<Vec<Result<Report<Value>, ClientError>>, ClientError> {
        let mut answers: Vec<Option<Result<Report<Value>, ClientError>>> =
            reports.iter().map(|r| segment("job id", &r.job_id).err().map(Err)).collect();
        let sent: Vec<usize> = (0..reports.len()).filter(|&i| answers[i].is_none()).collect();
        if !sent.is_empty() {
            let body = json!({"reports": sent.iter().map(|&i| reports[i].element()).collect::<Vec<_>>()});
            let v = self.post("/v1/reports", body).await?;
            let results = v["results"].as_array().map(Vec::as_slice).unwrap_or_default();
            let matched = results.len() == sent.len()
                && sent.iter().zip(results).all(|(&i, r)| r["job_id"].as_str() == Some(reports[i].job_id.as_str()));
            if !matched {
                return Err(ClientError::Transport(format!("{} reports sent, answered {}", sent.len(), v["results"])));
            }
            for (&i, r) in sent.iter().zip(results) {
                answers[i] = Some(result(r));
            }
        }
        Ok(answers.into_iter().map(|a| a.expect("every report answered")).collect())
    }
}

/// One report's answer in `POST /v1/reports`' `results`, as the single route's answer would read.
fn result(r: &Value) -> Result<Report<Value>, ClientError> {
    let status = r["status"].as_u64().and_then(|s| u16::try_from(s).ok()).unwrap_or(0);
    if (200..300).contains(&status) {
        let body = if r["job"].is_null() { r["heartbeat"].clone() } else { r["job"].clone() };
        return Ok(if r["replayed"] == true { Report::Replayed(body) } else { Report::Applied(body) });
    }
    Err(crate::api_error(status, &r["error"]))
}

/// The most a request's reports may weigh, encoded: the server takes bodies up to 1 MiB.
const REQUEST_BYTES: usize = 900 * 1024;
/// The longest `message` the route takes in a report (longer refuses the whole request).
const MESSAGE_BYTES: usize = 2_000;
/// While this many requests are in flight, finished jobs wait for one of them to be answered...
const IN_FLIGHT: usize = 4;
/// ...for this long at most: one slow report (a teardown deleting artifacts) must not hold every
/// other job's report behind its request...
const IN_FLIGHT_PATIENCE: Duration = Duration::from_secs(1);
/// ...and never more than this many at once.
const IN_FLIGHT_MAX: usize = 16;
/// After a server answered that it has no `POST /v1/reports`, each report goes by its own route for
/// this long, then the route is tried again (a rolling upgrade ends).
const ALONE_FOR: Duration = Duration::from_secs(600);

type Answer = oneshot::Sender<Result<Report<Value>, ClientError>>;
type Queued = (JobReport, usize, Answer);

/// A worker's reports, sent together: jobs that finish while requests are in flight go in the
/// next one (docs/design/reports.md §9). Dropping every clone lets the reporter's task end once
/// the reports queued are answered.
#[derive(Clone)]
pub(crate) struct Reporter {
    client: Client,
    queue: mpsc::UnboundedSender<Queued>,
}

impl Reporter {
    /// The reporter and its task; `per_request` reports at most in one request (1: each by its own
    /// route).
    pub(crate) fn start(client: Client, per_request: usize) -> (Reporter, tokio::task::JoinHandle<()>) {
        let (queue, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(forming(client.clone(), rx, per_request.clamp(1, REPORTS_MAX)));
        (Reporter { client, queue }, task)
    }

    /// `report`'s answer, from whichever request carried it; by its own route if the reporter is
    /// gone.
    pub(crate) async fn send(&self, report: &JobReport) -> Result<Report<Value>, ClientError> {
        let (answer, answered) = oneshot::channel();
        let weight = report.element().to_string().len();
        if self.queue.send((report.clone(), weight, answer)).is_err() {
            return report.send_alone(&self.client).await;
        }
        match answered.await {
            Ok(a) => a,
            Err(_) => report.send_alone(&self.client).await,
        }
    }
}

impl JobReport {
    /// Whether the route takes it in company: a report the route would refuse for its shape
    /// (refusing the whole request) or too heavy to share a request goes alone, by its own route,
    /// for its own answer.
    fn fits_a_request(&self, weight: usize) -> bool {
        let message = match &self.signal {
            Signal::Fail(f) => {
                let code = !f.code.is_empty()
                    && f.code.len() <= 64
                    && f.code.bytes().all(|b| b.is_ascii_uppercase() || b.is_ascii_digit() || b == b'_');
                if !code {
                    return false;
                }
                f.message.len()
            }
            Signal::Unknown(m) => m.len(),
            Signal::Succeed { .. } | Signal::Release => 0,
        };
        message <= MESSAGE_BYTES && weight <= REQUEST_BYTES / 4
    }
}

/// What the reporter learns from the server's answers.
struct Learned {
    /// Until when each report goes by its own route (a server without `POST /v1/reports`).
    alone_until: Mutex<Option<Instant>>,
    /// The most reports a request carries now: halved by each `429`, grown back by answers.
    size: AtomicUsize,
    per_request: usize,
}

impl Learned {
    fn alone(&self) -> bool {
        let until = self.alone_until.lock().unwrap_or_else(|p| p.into_inner());
        until.is_some_and(|t| Instant::now() < t)
    }

    fn answered(&self, status: Option<u16>) {
        let size = self.size.load(Ordering::Relaxed);
        let next = match status {
            Some(429) => (size / 2).max(1),
            None => (size + size / 2 + 1).min(self.per_request),
            Some(_) => size,
        };
        self.size.store(next, Ordering::Relaxed);
    }
}

/// The reporter's task: a request from the reports queued (one per job, within the learned size
/// and `REQUEST_BYTES`), `IN_FLIGHT` at once or more when they are slow; ends when the queue is
/// closed and every request answered.
async fn forming(client: Client, mut rx: mpsc::UnboundedReceiver<Queued>, per_request: usize) {
    let (soft, hard) = (Arc::new(Semaphore::new(IN_FLIGHT)), Arc::new(Semaphore::new(IN_FLIGHT_MAX)));
    let learned = Arc::new(Learned { alone_until: Mutex::new(None), size: AtomicUsize::new(per_request), per_request });
    // Reports on a job already in the request being formed: first in the next one.
    let mut held: VecDeque<Queued> = VecDeque::new();
    let mut requests = tokio::task::JoinSet::new();
    loop {
        let first = match held.pop_front() {
            Some(q) => q,
            None => match rx.recv().await {
                Some(q) => q,
                None => break,
            },
        };
        let permits = (
            hard.clone().acquire_owned().await.expect("never closed"),
            tokio::time::timeout(IN_FLIGHT_PATIENCE, soft.clone().acquire_owned()).await.ok().map(Result::ok),
        );
        let batch =
            if first.0.fits_a_request(first.1) { fill(first, &mut held, &mut rx, &learned) } else { vec![first] };
        let (client, learned) = (client.clone(), learned.clone());
        requests.spawn(async move {
            carry(&client, batch, &learned).await;
            drop(permits);
        });
        while requests.try_join_next().is_some() {}
    }
    while requests.join_next().await.is_some() {}
}

/// `first` and what is queued after it, up to the learned size and `REQUEST_BYTES`, one report per
/// job; a report that goes alone, or on a job already in, waits for the next request.
fn fill(
    first: Queued,
    held: &mut VecDeque<Queued>,
    rx: &mut mpsc::UnboundedReceiver<Queued>,
    learned: &Learned,
) -> Vec<Queued> {
    let size = learned.size.load(Ordering::Relaxed).max(1);
    let mut weight = first.1;
    let mut jobs: HashSet<String> = HashSet::from([first.0.job_id.clone()]);
    let mut batch = vec![first];
    let mut later = VecDeque::new();
    while batch.len() < size {
        let Some(q) = held.pop_front().or_else(|| rx.try_recv().ok()) else { break };
        if q.0.fits_a_request(q.1) && weight + q.1 <= REQUEST_BYTES && jobs.insert(q.0.job_id.clone()) {
            weight += q.1;
            batch.push(q);
        } else {
            later.push_back(q);
        }
    }
    // Back first in line, in the order they came.
    for q in later.into_iter().rev() {
        held.push_front(q);
    }
    batch
}

/// One request's reports, each answered to its job: by `POST /v1/reports`, or by their single
/// routes when there is one, when the route is missing, refused the request whole or failed on it.
async fn carry(client: &Client, batch: Vec<Queued>, learned: &Learned) {
    if batch.len() > 1 && !learned.alone() {
        let reports: Vec<JobReport> = batch.iter().map(|(r, ..)| r.clone()).collect();
        match client.reports(&reports).await {
            Ok(answers) => {
                learned.answered(None);
                for ((.., slot), answer) in batch.into_iter().zip(answers) {
                    let _ = slot.send(answer);
                }
                return;
            }
            // A server without the route (older than decision 0041), or a proxy that does not pass it.
            Err(ClientError::Api { status: 404 | 405, .. }) => {
                tracing::info!("Settle has no POST /v1/reports: each report goes by its own route for now");
                *learned.alone_until.lock().unwrap_or_else(|p| p.into_inner()) = Some(Instant::now() + ALONE_FOR);
            }
            // Refused whole (a report's shape, the body's size) or failed on one report: nothing
            // was written; each goes alone, for its own answer.
            Err(ClientError::Api { status: 400 | 413 | 500 | 501 | 502 | 504..=599, .. }) => {}
            // Busy or unreachable: every report is handed the error and re-sent by its job after
            // its backoff.
            Err(e) => {
                if let ClientError::Api { status, .. } = &e {
                    learned.answered(Some(*status));
                }
                for (.., slot) in batch {
                    let _ = slot.send(Err(e.clone()));
                }
                return;
            }
        }
    }
    let mut sends = tokio::task::JoinSet::new();
    for (report, _, slot) in batch {
        let client = client.clone();
        sends.spawn(async move {
            let _ = slot.send(report.send_alone(&client).await);
        });
    }
    while sends.join_next().await.is_some() {}
}
