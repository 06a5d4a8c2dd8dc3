//! Payouts (spec §4, docs/design/payouts.md): the provider adapter and the payout processor.
//!
//! Every attempt asks the provider whether the withdrawal's idempotency key exists before it sends,
//! and sends only after it has renewed its lease and marked the attempt as sending (committed before
//! the request leaves). No database transaction is open while a provider call is in flight. A send
//! without an answer is `unknown`, never retried automatically; the processor's reconcile pass asks
//! the provider about each unknown withdrawal (found → succeeded; absent after the confirm window →
//! `TIMEOUT_CONFIRMED_NOT_SENT`, retried with the same key; no answer → stays unknown).

use async_trait::async_trait;
use settle_core::crash::CrashPoint;
use settle_core::ids::{FailCode, JobId, WorkerName};
use settle_core::job::JobState;
use settle_core::limits;
use settle_store::{
    ClaimedJob, CrashHook, FailSignal, Finding, LeaseToken, Page, ReturnSource, Store, StoreError, Withdrawal,
    WithdrawalFilter,
};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// What a lookup of an idempotency key learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Lookup {
    /// A transfer with that key exists; `returned`: the receiving side sent it back.
    Found { txid: String, returned: bool },
    /// The provider answered that no transfer has that key.
    Absent,
    /// No usable answer (an error answer, no answer, something outside the protocol): nothing learned.
    Failed { message: String },
}

/// What a send learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Sent {
    /// Executed: the provider's id of the transfer.
    Executed { txid: String },
    /// A definitive refusal: nothing was executed. `retry_after_ms` from `Retry-After`.
    Refused { code: FailCode, message: String, retry_after_ms: Option<u64> },
    /// No answer, or one outside the protocol: the payout may or may not have happened.
    NoAnswer { message: String },
}

/// The payout provider. `HttpProvider` speaks `provider-v1`; tests may put anything behind it.
#[async_trait]
pub trait Provider: Send + Sync {
    async fn lookup(&self, key: &str) -> Lookup;
    async fn send(&self, key: &str, destination: &str, amount: i64) -> Sent;
}

/// Codes a provider's error answer may carry that mean "not executed" (provider-v1). `TIMEOUT` is
/// not one of them: a provider that timed out itself does not know either (docs/decisions/0010).
pub const DEFINITIVE_CODES: [&str; 4] = ["INSUFFICIENT", "INVALID_ADDRESS", "NODE_DOWN", "RATE_LIMITED"];

#[derive(Debug, Clone)]
pub struct HttpProviderConfig {
    pub url: String,
    /// The whole request, connect included.
    pub timeout: Duration,
    pub connect_timeout: Duration,
}

/// `provider-v1` over HTTP: one reused client, explicit timeouts, no redirects.
pub struct HttpProvider {
    base: String,
    http: reqwest::Client,
}

impl HttpProvider {
    pub fn new(config: &HttpProviderConfig) -> Result<HttpProvider, String> {
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("provider client: {e}"))?;
        Ok(HttpProvider { base: config.url.trim_end_matches('/').to_owned(), http })
    }
}

/// A read answer: status, whether it said JSON, and the body (bounded).
struct Answer {
    status: u16,
    json: bool,
    retry_after_ms: Option<u64>,
    body: Vec<u8>,
}

async fn read(response: reqwest::Response) -> Result<Answer, String> {
    let status = response.status().as_u16();
    let json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let retry_after_ms = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|s| s.saturating_mul(1_000));
    let mut response = response;
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("reading the answer failed: {e}"))? {
        body.extend_from_slice(&chunk);
        if body.len() > limits::PROVIDER_BODY_BYTES_MAX {
            return Err("the answer is larger than the protocol allows".into());
        }
    }
    Ok(Answer { status, json, retry_after_ms, body })
}

/// `{"code", "message"}` of an error answer, if that is what it is.
fn error_body(a: &Answer) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
    let code = v.get("code")?.as_str()?.to_owned();
    let message = v.get("message").and_then(|m| m.as_str()).unwrap_or("").to_owned();
    Some((code, message))
}

fn txid_of(a: &Answer) -> Option<(String, Option<String>)> {
    let v: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
    let txid = v.get("txid")?.as_str()?.to_owned();
    if txid.is_empty() || txid.len() > limits::PROVIDER_TXID_LEN_MAX || txid.chars().any(char::is_control) {
        return None;
    }
    // A status that is there must be a string the protocol knows; anything else is not an answer.
    let status = match v.get("status") {
        None => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
    };
    Some((txid, status))
}

#[async_trait]
impl Provider for HttpProvider {
    async fn lookup(&self, key: &str) -> Lookup {
        let url = format!("{}/v1/transactions/{key}", self.base);
        let answer = match self.http.get(&url).send().await {
            Ok(r) => read(r).await,
            Err(e) => Err(format!("no answer: {e}")),
        };
        let a = match answer {
            Ok(a) => a,
            Err(message) => return Lookup::Failed { message },
        };
        match a.status {
            200..=299 => match txid_of(&a) {
                Some((txid, None)) => Lookup::Found { txid, returned: false },
                Some((txid, Some(s))) if s == "executed" => Lookup::Found { txid, returned: false },
                Some((txid, Some(s))) if s == "returned" => Lookup::Found { txid, returned: true },
                Some((_, Some(s))) => Lookup::Failed { message: format!("unknown transfer status {s:?}") },
                None => Lookup::Failed { message: format!("a {} answer without a txid", a.status) },
            },
            // Absent only when the provider itself says so: an empty body or JSON. An HTML 404 from
            // a proxy or a wrong base URL proves nothing.
            404 if a.body.is_empty() || a.json => Lookup::Absent,
            status => Lookup::Failed {
                message: match error_body(&a) {
                    Some((code, message)) => format!("{status} {code}: {message}"),
                    None => format!("an answer outside the protocol (status {status})"),
                },
            },
        }
    }

    async fn send(&self, key: &str, destination: &str, amount: i64) -> Sent {
        let url = format!("{}/v1/transactions", self.base);
        let body = serde_json::json!({ "key": key, "destination": destination, "amount": amount });
        let request = self
            .http
            .post(&url)
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(&body).unwrap_or_default());
        let a = match request.send().await {
            Ok(r) => match read(r).await {
                Ok(a) => a,
                Err(message) => return Sent::NoAnswer { message },
            },
            // The connection was never made: the request did not leave, nothing can have executed.
            Err(e) if e.is_connect() => {
                return Sent::Refused {
                    code: FailCode::parse("UNAVAILABLE").expect("a valid code"),
                    message: format!("cannot connect to the provider: {e}"),
                    retry_after_ms: None,
                };
            }
            Err(e) => return Sent::NoAnswer { message: format!("no answer: {e}") },
        };
        if (200..=299).contains(&a.status) {
            return match txid_of(&a) {
                Some((txid, _)) => Sent::Executed { txid },
                None => Sent::NoAnswer { message: format!("a {} answer without a txid", a.status) },
            };
        }
        match error_body(&a) {
            Some((code, message)) if DEFINITIVE_CODES.contains(&code.as_str()) => {
                let code = FailCode::parse(&code).expect("the definitive codes are valid");
                let retry_after_ms = if code.as_str() == "RATE_LIMITED" { a.retry_after_ms } else { None };
                Sent::Refused { code, message, retry_after_ms }
            }
            Some((code, message)) => {
                tracing::warn!(%code, %message, "the provider answered a code outside the protocol; outcome unknown");
                Sent::NoAnswer { message: format!("{} {code}: {message}", a.status) }
            }
            None => Sent::NoAnswer { message: format!("an answer outside the protocol (status {})", a.status) },
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct PayoutSettings {
    /// How often to look for due withdrawals when nothing wakes the loop.
    pub every: Duration,
    /// How often to ask about unknown (and recently succeeded or dead) withdrawals.
    pub reconcile_every: Duration,
    /// Most withdrawals one pass claims and has in flight.
    pub batch: u32,
    /// Re-check succeeded withdrawals this young for returns, and dead ones for a late execution
    /// (zero: off).
    pub return_window: Duration,
}

impl Default for PayoutSettings {
    fn default() -> PayoutSettings {
        PayoutSettings {
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

pub struct PayoutProcessor {
    store: Arc<dyn Store>,
    provider: Arc<dyn Provider>,
    worker: WorkerName,
    settings: PayoutSettings,
    crash: Option<Arc<dyn CrashHook>>,
    /// The simulator's broken-guard test: send without looking the key up first (honoured only
    /// under the `broken-guards` feature).
    skip_lookup: bool,
    /// Where the next reconcile and re-check passes start (wrapping cursors: a withdrawal no one can
    /// resolve yet never hides the ones behind it).
    reconcile_after: Mutex<i64>,
    recheck_after: Mutex<(usize, i64)>,
}

impl PayoutProcessor {
    pub fn new(
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        worker: WorkerName,
        settings: PayoutSettings,
    ) -> PayoutProcessor {
        PayoutProcessor {
            store,
            provider,
            worker,
            settings,
            crash: None,
            skip_lookup: false,
            reconcile_after: Mutex::new(0),
            recheck_after: Mutex::new((0, 0)),
        }
    }

    /// Tests: stop an attempt at a crash point, as if the process died there.
    pub fn with_crash_hook(mut self, hook: Arc<dyn CrashHook>) -> PayoutProcessor {
        self.crash = Some(hook);
        self
    }

    /// The simulator's broken-guard test only: attempts send without looking the key up first.
    /// Has an effect only under the `broken-guards` feature, which no build that ships turns on.
    pub fn without_lookup_before_send(mut self) -> PayoutProcessor {
        self.skip_lookup = true;
        self
    }

    fn looks_up(&self) -> bool {
        !(cfg!(feature = "broken-guards") && self.skip_lookup)
    }

    fn crashes_at(&self, point: CrashPoint) -> bool {
        self.crash.as_ref().is_some_and(|h| h.should_crash(point))
    }

    /// One pass: claims up to `batch` due withdrawals and makes one attempt of each, all at once.
    pub async fn process_pass(&self) -> Result<Vec<(String, AttemptEnd)>, StoreError> {
        let batch = self.settings.batch.clamp(1, limits::PAYOUTS_IN_FLIGHT_MAX);
        let claimed = self.store.payouts().claim_payouts(&self.worker, batch).await?;
        let attempts = claimed.into_iter().map(|c| async move {
            let id = String::from(c.job.id.clone());
            let end = self.attempt(c).await;
            (id, end)
        });
        Ok(futures_util::future::join_all(attempts).await)
    }

    /// One attempt of one claimed withdrawal: lookup, then (renew lease, mark sending) send, then record.
    pub async fn attempt(&self, claimed: ClaimedJob) -> AttemptEnd {
        let id = claimed.job.id.clone();
        let token = claimed.lease_token.clone();
        match self.try_attempt(&id, &token, claimed).await {
            Ok(end) => end,
            // A report refused because the lease lapsed meanwhile: the rescuer has the withdrawal.
            Err(StoreError::LeaseLost(lost)) => {
                tracing::warn!(job = %id, %lost, "payout attempt lost its lease before recording its result");
                AttemptEnd::LeaseLost
            }
            Err(e) => {
                tracing::warn!(job = %id, error = %e, "payout attempt could not be recorded; the lease will expire");
                AttemptEnd::StoreError
            }
        }
    }

    async fn try_attempt(&self, id: &JobId, token: &LeaseToken, claimed: ClaimedJob) -> Result<AttemptEnd, StoreError> {
        let payouts = self.store.payouts();
        let w = payouts.withdrawal(id).await?;
        let found = if self.looks_up() { self.provider.lookup(&w.idempotency_key).await } else { Lookup::Absent };
        match found {
            Lookup::Found { txid, returned } => {
                payouts.payout_succeeded(id, Some(token), &txid, returned).await?;
                return Ok(AttemptEnd::Succeeded);
            }
            Lookup::Failed { message } => {
                tracing::warn!(job = %id, %message, "provider lookup failed; retrying later");
                let signal = fail(token, FailCode::lookup_failed(), message, None);
                payouts.payout_failed(id, signal).await?;
                return Ok(AttemptEnd::Failed);
            }
            Lookup::Absent => {}
        }
        // Renew the lease and mark the attempt as sending, committed before the request leaves.
        let heartbeat = match payouts.payout_heartbeat(id, token).await {
            Ok(h) => h,
            Err(StoreError::LeaseLost(_)) => return Ok(AttemptEnd::LeaseLost),
            Err(e) => return Err(e),
        };
        if heartbeat.cancel_requested {
            let signal = fail(token, FailCode::cancelled(), "cancelled before the send".into(), Some(false));
            payouts.payout_failed(id, signal).await?;
            return Ok(AttemptEnd::Cancelled);
        }
        if self.crashes_at(CrashPoint::PayoutAfterLookup) {
            return Ok(AttemptEnd::Crashed);
        }
        // A process that stalled since the renewal (a pause, a swap storm) must not send on a lease
        // that may have run out: the attempt is marked sending, so the rescuer makes it unknown. The
        // lease is measured on the store's clock, from what the renewal wrote.
        let lease_micros = claimed.lease_expires_at.micros() - claimed.job.updated_at.micros();
        let left_micros = heartbeat.lease_expires_at.micros() - self.store.now().micros();
        if left_micros < lease_micros / 2 {
            tracing::warn!(job = %id, "stalled before the send; leaving it to the reconciler");
            return Ok(AttemptEnd::LeaseLost);
        }
        let end = match self.provider.send(&w.idempotency_key, &w.destination, w.amount.get()).await {
            Sent::Executed { txid } => {
                if self.crashes_at(CrashPoint::PayoutAfterSend) {
                    return Ok(AttemptEnd::Crashed);
                }
                payouts.payout_succeeded(id, Some(token), &txid, false).await?;
                AttemptEnd::Succeeded
            }
            Sent::Refused { code, message, retry_after_ms } => {
                let mut signal = fail(token, code, message, None);
                signal.retry_after_ms = retry_after_ms;
                payouts.payout_failed(id, signal).await?;
                AttemptEnd::Failed
            }
            Sent::NoAnswer { message } => {
                tracing::warn!(job = %id, %message, "no answer to a payout send; its outcome is unknown");
                payouts.payout_unknown(id, token, Some(&bounded(message))).await?;
                AttemptEnd::Unknown
            }
        };
        Ok(end)
    }

    /// One reconcile pass over at most `batch` unknown withdrawals; returns the ids it moved.
    pub async fn reconcile_pass(&self) -> Result<Vec<String>, StoreError> {
        let filter = WithdrawalFilter { state: Some(JobState::Unknown), ..WithdrawalFilter::default() };
        let after = *self.reconcile_after.lock().expect("cursor lock");
        let page = self.store.payouts().withdrawals(&filter, Page { after, limit: self.settings.batch.max(1) }).await?;
        *self.reconcile_after.lock().expect("cursor lock") = page.next_after.unwrap_or(0);
        let mut moved = Vec::new();
        for w in page.rows {
            match self.reconcile_one(&w).await {
                Ok(true) => moved.push(w.job.id.into()),
                Ok(false) => {}
                Err(e) => tracing::warn!(job = %w.job.id, error = %e, "reconcile failed; continuing"),
            }
        }
        Ok(moved)
    }

    async fn reconcile_one(&self, w: &Withdrawal) -> Result<bool, StoreError> {
        let id = &w.job.id;
        match self.provider.lookup(&w.idempotency_key).await {
            Lookup::Found { txid, returned } => {
                Ok(self.store.payouts().payout_succeeded(id, None, &txid, returned).await?.applied)
            }
            // Applied only once the kind's confirm window has passed since the job went unknown.
            Lookup::Absent => Ok(self.store.reconcile(id, Finding::Absent).await?.applied),
            Lookup::Failed { message } => {
                tracing::warn!(job = %w.job.id, %message, "provider unreachable; the withdrawal stays unknown");
                Ok(false)
            }
        }
    }

    /// One re-check pass (when `return_window` is set): succeeded withdrawals that young are asked
    /// whether they came back; dead ones whether an earlier send executed after all (then the
    /// success path takes the refunded hold back). Returns the ids it moved.
    pub async fn recheck_pass(&self) -> Result<Vec<String>, StoreError> {
        if self.settings.return_window.is_zero() {
            return Ok(Vec::new());
        }
        let since = self.store.now().micros().saturating_sub(self.settings.return_window.as_micros() as i64);
        // Succeeded: returns. Dead and cancelled (tried ones): an earlier send executed after all.
        let states = [JobState::Succeeded, JobState::Dead, JobState::Cancelled];
        let (which, after) = *self.recheck_after.lock().expect("cursor lock");
        let state = states[which % states.len()];
        let filter = WithdrawalFilter {
            state: Some(state),
            updated_since: Some(settle_core::Timestamp::from_micros(since)),
            ..WithdrawalFilter::default()
        };
        let page = self.store.payouts().withdrawals(&filter, Page { after, limit: self.settings.batch.max(1) }).await?;
        *self.recheck_after.lock().expect("cursor lock") = match page.next_after {
            Some(next) => (which, next),
            None => ((which + 1) % states.len(), 0),
        };
        let mut moved = Vec::new();
        for w in page.rows {
            // Never tried, or a late execution already recorded: nothing to ask.
            if state != JobState::Succeeded && (w.job.attempt == 0 || w.provider_txid.is_some()) {
                continue;
            }
            let id = &w.job.id;
            let applied = match (state, self.provider.lookup(&w.idempotency_key).await) {
                (JobState::Succeeded, Lookup::Found { returned: true, .. }) => self
                    .store
                    .payouts()
                    .payout_returned(id, ReturnSource::Provider, settle_store::SYSTEM_ACTOR)
                    .await
                    .map(|o| o.applied),
                (JobState::Dead | JobState::Cancelled, Lookup::Found { txid, returned }) => {
                    tracing::error!(job = %w.job.id, %txid, state = state.as_str(), "a closed withdrawal was executed after all");
                    let before = w.provider_txid.is_some();
                    self.store
                        .payouts()
                        .payout_succeeded(id, None, &txid, returned)
                        .await
                        .map(|o| o.applied || (!before && o.value.provider_txid.is_some()))
                }
                _ => Ok(false),
            };
            match applied {
                Ok(true) => moved.push(w.job.id.into()),
                Ok(false) => {}
                Err(e) => tracing::warn!(job = %w.job.id, error = %e, "re-check failed; continuing"),
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
                        tracing::debug!(count = done.len(), "payout pass made attempts");
                    }
                    done.len() as u32 >= self.settings.batch.clamp(1, limits::PAYOUTS_IN_FLIGHT_MAX)
                }
                Err(e) => {
                    tracing::warn!(error = %e, "payout pass failed; will try again");
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
                Ok(ids) if !ids.is_empty() => tracing::info!(count = ids.len(), "reconciled unknown withdrawals"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "withdrawal reconcile pass failed; will try again"),
            }
            match self.recheck_pass().await {
                Ok(ids) if !ids.is_empty() => tracing::info!(count = ids.len(), "re-check moved withdrawals"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "withdrawal re-check pass failed; will try again"),
            }
        }
    }
}

fn fail(token: &LeaseToken, code: FailCode, message: String, retryable: Option<bool>) -> FailSignal {
    FailSignal { lease_token: token.clone(), code, message: Some(bounded(message)), retryable, retry_after_ms: None }
}

/// A provider's words kept within the longest message the store takes.
fn bounded(mut message: String) -> String {
    if message.len() > limits::MESSAGE_LEN_MAX {
        let mut cut = limits::MESSAGE_LEN_MAX;
        while !message.is_char_boundary(cut) {
            cut -= 1;
        }
        message.truncate(cut);
    }
    message
}
