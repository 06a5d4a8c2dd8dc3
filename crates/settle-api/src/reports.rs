//! `POST /v1/reports`: many worker signals in one request (docs/design/reports.md, decision 0041).
//! Each report calls the store operation its single route calls — its own guarded transition, its
//! own transaction or lane operation, answered after its own COMMIT — and gets the answer that
//! route would have given. The request is refused whole, with nothing written, only for what the
//! single routes refuse before the store: the body's shape, ids, tokens, codes and messages.

use crate::auth::Actor;
use crate::dto;
use crate::error::{ApiError, ErrorDetail};
use crate::extract::{Auth, Json, WorkerRole};
use crate::handlers::{costs, id, mark, ok, seen_job, token};
use crate::state::AppState;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use settle_core::ids::{FailCode, JobId};
use settle_core::limits;
use settle_store as store;
use std::collections::HashSet;
use std::sync::{Arc, LazyLock};
use std::time::Duration;
use tokio::sync::Semaphore;

/// At most this many reports per request: what one claim can hand out.
pub const REPORTS_MAX: usize = limits::CLAIM_LIMIT_MAX as usize;

/// Reports running at once in this process, over every request: a request takes room for all of
/// its reports in one step (never part of it, so two requests cannot each hold part and wait for
/// the rest), and its reports run together, so one lane's batch can take them at once.
const IN_FLIGHT_MAX: usize = 1_024;
static IN_FLIGHT: LazyLock<Arc<Semaphore>> = LazyLock::new(|| Arc::new(Semaphore::new(IN_FLIGHT_MAX)));

/// How long a request waits for that room before it is answered `503` with nothing written.
const ROOM_WAIT: Duration = Duration::from_secs(5);

/// A report checked as its single route checks its body, before any report runs.
struct Checked {
    job: JobId,
    signal: Signal,
}

enum Signal {
    Succeed { token: store::LeaseToken, result: Option<serde_json::Value>, costs: store::Costs },
    Fail(store::FailSignal),
    Release(store::LeaseToken),
    Unknown(store::LeaseToken, Option<String>),
    Heartbeat(store::LeaseToken),
}

impl Signal {
    fn kind(&self) -> &'static str {
        match self {
            Signal::Succeed { .. } => "succeed",
            Signal::Fail(_) => "fail",
            Signal::Release(_) => "release",
            Signal::Unknown(..) => "unknown",
            Signal::Heartbeat(_) => "heartbeat",
        }
    }
}

/// Report many signals at once
///
/// For a worker that claimed several jobs: their successes, failures, releases, unknowns and
/// heartbeats in one request, each on another job. Each report is its own guarded transition, as
/// if sent to its single route (`/v1/jobs/{id}/succeed`, `fail`, `release`, `unknown`,
/// `heartbeat`), and its result is what that route would have answered: its status, and the job in
/// brief, the heartbeat, or the error (with `lease_lost`'s `details`). Results come in the
/// request's order; a report refused leaves the others standing. A report still running after 50 s
/// is answered `503`: it may yet take effect, so send it again. The whole request is refused (`400`,
/// nothing written) when it holds no report or more than 100, the same job twice, or a report its
/// route would refuse for its shape (a success here always carries its lease token: an operator's
/// success is a request of its own). Each report counts against the token's request rate. A request
/// whose answer was lost is sent again as it was: each route's replay rule makes it converge.
#[utoipa::path(post, path = "/v1/reports", tag = "workers", request_body = dto::Reports,
    responses((status = 200, description = "every report's result, in the request's order", body = dto::ReportResults)))]
pub async fn reports(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    headers: HeaderMap,
    Json(b): Json<dto::Reports>,
) -> Result<Response, ApiError> {
    let n = b.reports.len();
    if n == 0 || n > REPORTS_MAX {
        return Err(ApiError::invalid(format!("A request carries 1 to {REPORTS_MAX} reports.")));
    }
    let mut seen = HashSet::with_capacity(n);
    let mut checked = Vec::with_capacity(n);
    for (i, r) in b.reports.into_iter().enumerate() {
        let c = check(r).map_err(|e| ApiError { message: format!("Report {i}: {}", e.message), ..e })?;
        if !seen.insert(c.job.as_str().to_owned()) {
            return Err(ApiError::invalid(format!(
                "Report {i}: job {} is reported twice; a request carries one report per job.",
                c.job.as_str()
            )));
        }
        checked.push(c);
    }
    // The door took one request from the token's bucket; the other reports take theirs here.
    if n > 1 && !s.tokens.is_empty() {
        let key = s.tokens.identify(&headers);
        if let Err(wait) = s.limiter.admit_more(key, n - 1) {
            metrics::counter!("settle_http_rate_limited_total").increment(1);
            return Err(ApiError::rate_limited(wait));
        }
    }
    let room = IN_FLIGHT.clone().acquire_many_owned(n as u32);
    let room = match tokio::time::timeout(ROOM_WAIT, room).await {
        Ok(Ok(permit)) => Arc::new(permit),
        _ => return Err(ApiError::unavailable("Too many reports are running; nothing was written. Retry shortly.")),
    };
    // Each report runs in a task of its own, to its end: a request dropped (its client gone, the
    // server's request limit) leaves no report half run, and its after-commit steps are taken.
    let deadline = tokio::time::Instant::now() + s.reports_deadline;
    let running: Vec<_> = checked
        .into_iter()
        .map(|c| {
            let (s, actor, room) = (s.clone(), auth.actor.clone(), room.clone());
            let job_id = c.job.as_str().to_owned();
            let kind = c.signal.kind();
            let task = tokio::spawn(async move {
                let result = run(&s, &actor, c).await;
                drop(room);
                result
            });
            (job_id, kind, task)
        })
        .collect();
    let mut results = Vec::with_capacity(n);
    for (job_id, kind, task) in running {
        let result = match tokio::time::timeout_at(deadline, task).await {
            Ok(Ok(result)) => result,
            Ok(Err(_panicked)) => refused(
                job_id,
                ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "internal", "An internal error occurred."),
            ),
            Err(_late) => refused(
                job_id,
                ApiError::unavailable("The report did not finish in time; it may yet take effect: send it again."),
            ),
        };
        metrics::counter!("settle_reports_total", "kind" => kind, "status" => result.status.to_string()).increment(1);
        results.push(result);
    }
    Ok(ok(dto::ReportResults { results }))
}

fn refused(job_id: String, e: ApiError) -> dto::ReportResult {
    dto::ReportResult {
        job_id,
        status: e.status.as_u16(),
        replayed: None,
        job: None,
        heartbeat: None,
        error: Some(ErrorDetail { code: e.code.to_owned(), message: e.message, details: e.details }),
    }
}

fn check(r: dto::Report) -> Result<Checked, ApiError> {
    let message = |m: Option<String>| match m {
        Some(m) if m.len() > limits::MESSAGE_LEN_MAX => {
            Err(ApiError::invalid(format!("The message is longer than {} bytes.", limits::MESSAGE_LEN_MAX)))
        }
        m => Ok(m),
    };
    let (job, signal) = match r {
        dto::Report::Succeed { job_id, lease_token, result, cost, costs: prices } => {
            (job_id, Signal::Succeed { token: token(lease_token)?, result, costs: costs(cost, prices)? })
        }
        dto::Report::Fail { job_id, lease_token, code, message: m, retryable, retry_after_ms } => {
            let signal = store::FailSignal {
                lease_token: token(lease_token)?,
                code: id(FailCode::parse, &code)?,
                message: message(m)?,
                retryable,
                retry_after_ms,
            };
            (job_id, Signal::Fail(signal))
        }
        dto::Report::Release { job_id, lease_token } => (job_id, Signal::Release(token(lease_token)?)),
        dto::Report::Unknown { job_id, lease_token, message: m } => {
            (job_id, Signal::Unknown(token(lease_token)?, message(m)?))
        }
        dto::Report::Heartbeat { job_id, lease_token } => (job_id, Signal::Heartbeat(token(lease_token)?)),
    };
    Ok(Checked { job: id(JobId::parse, &job)?, signal })
}

/// One report, as its single route runs it after the body was accepted.
async fn run(s: &AppState, actor: &Actor, c: Checked) -> dto::ReportResult {
    let job_id = c.job.as_str().to_owned();
    let answered = async {
        // A worker token scoped to kinds reports only on jobs of those kinds.
        seen_job(s, actor, &c.job).await?;
        let st = &s.store;
        let (kind, out) = match c.signal {
            Signal::Succeed { token, result, costs } => {
                ("succeed", st.succeed_priced(&c.job, store::Reporter::Lease(&token), result, &costs).await?)
            }
            Signal::Fail(signal) => ("fail", st.fail(&c.job, signal).await?),
            Signal::Release(token) => ("release", st.release(&c.job, &token).await?),
            Signal::Unknown(token, m) => ("unknown", st.mark_unknown(&c.job, &token, m.as_deref()).await?),
            Signal::Heartbeat(token) => {
                let hb = st.heartbeat(&c.job, &token).await?;
                let heartbeat = dto::Heartbeat {
                    lease_expires_at: dto::rfc3339(hb.lease_expires_at),
                    cancel_requested: hb.cancel_requested,
                };
                return Ok((None, None, Some(heartbeat)));
            }
        };
        mark(kind, out.applied);
        let job = dto::JobBrief::from(dto::Job::from(out.value));
        Ok::<_, ApiError>((Some(!out.applied), Some(job), None))
    };
    match answered.await {
        Ok((replayed, job, heartbeat)) => {
            dto::ReportResult { job_id, status: 200, replayed, job, heartbeat, error: None }
        }
        Err(e) => refused(job_id, e),
    }
}
