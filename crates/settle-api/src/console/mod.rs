//! The operator console at `/console`: where did a customer's credits go, what happened to a job,
//! and what is stuck — and, for admin tokens, the actions that unstick it.
//!
//! Server-rendered HTML (`pages`), sessions and CSRF (`session`); every read and action goes
//! through the same `Store` the API uses. Every action is a POST carrying the session's CSRF token,
//! refused (`403`) for client tokens, and recorded in the action log with the token's name.

pub mod key;
pub mod pages;
mod query;
pub mod session;

use crate::auth::Role;
use crate::error::ApiError;
use crate::state::AppState;
use axum::Router;
use axum::extract::{Form, FromRequest, Path, Query, Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{Html, IntoResponse, Redirect, Response};
use axum::routing::{get, post};
use maud::Markup;
use serde::Deserialize;
use session::Session;
use settle_core::Timestamp;
use settle_core::ids::{AccountId, JobId, JobKind};
use settle_core::job::JobState;
use settle_core::job::Rail;
use settle_core::ledger::EntryKind;
use settle_store::{DeliveryFilter, JobFilter, Page, StoreError, TopUpFilter, WithdrawalFilter};

pub use key::SessionKey;
pub use query::{BULK_MAX, EntriesQuery, JobAction, JobsQuery};
use query::{nonempty, urlencode};

/// Jobs a page lists.
const PAGE_JOBS: u32 = 100;

const CSS: &str = include_str!("../../assets/console/console.css");
const JS: &str = include_str!("../../assets/console/console.js");

/// Pages run only this server's scripts and styles, and cannot be framed.
const POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; \
     connect-src 'self'; form-action 'self'; frame-ancestors 'none'; base-uri 'none'";

pub fn router(state: AppState) -> Router {
    Router::new()
        .route("/console", get(overview))
        .route("/console/", get(|| async { Redirect::permanent("/console") }))
        .route("/console/login", get(login_form).post(login))
        .route("/console/logout", post(logout))
        .route("/console/find", get(find))
        .route("/console/jobs", get(jobs))
        .route("/console/jobs/{id}", get(job))
        .route("/console/jobs/{id}/{action}", post(job_action))
        .route("/console/bulk", get(bulk_confirm).post(bulk))
        .route("/console/accounts", get(accounts))
        .route("/console/accounts/{id}", get(account))
        .route("/console/withdrawals", get(withdrawals))
        .route("/console/top-ups", get(top_ups))
        .route("/console/webhooks", get(webhooks))
        .route("/console/webhooks/{endpoint}/{seq}/requeue", post(requeue_delivery))
        .route("/console/audit", post(audit))
        .route("/console/assets/console.css", get(|| async { asset("text/css; charset=utf-8", CSS) }))
        .route("/console/assets/console.js", get(|| async { asset("text/javascript; charset=utf-8", JS) }))
        .layer(axum::middleware::from_fn_with_state(state.clone(), guard))
        .with_state(state)
}

/// Before any console page (the loopback-mode `Host` rule is the whole router's, `host.rs`): every
/// POST only from this console's own pages (`Origin`, `Sec-Fetch-Site`: no cross-site sign-in or
/// action even with a cookie); and the request rate of the API, in the bucket of the session's
/// token — one bucket per token however many sessions it opens. Requests without a session share
/// the anonymous bucket; a sign-in is charged to the token it presents when that token is valid
/// (`login`), so a flood of bad sign-ins or 401s cannot lock an operator out.
async fn guard(State(s): State<AppState>, req: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let headers = req.headers();
    let host = crate::host::request_host(&req).unwrap_or("");
    if req.method() == axum::http::Method::POST && !same_origin(headers, host) {
        tracing::warn!(%host, "cross-site console POST refused");
        return error_page(
            None,
            ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "Console forms are accepted from this console's own pages only.",
            ),
        )
        .into_response();
    }
    // Signing in is charged in `login`; the sign-in page and the assets are never limited, so a
    // flood of bad tokens cannot keep an operator from the form.
    let path = req.uri().path();
    let unlimited = path == "/console/login" || path.starts_with("/console/assets/");
    if !s.tokens.is_empty() && !unlimited {
        let key = session::session_of(&s, headers).and_then(|open| open.token);
        if let Err(wait) = s.limiter.admit(key) {
            metrics::counter!("settle_http_rate_limited_total").increment(1);
            return ApiError::rate_limited(wait).into_response();
        }
    }
    next.run(req).await
}

/// The scheme the browser used: `https` behind a proxy that says so, else this server's `http`.
fn scheme(headers: &HeaderMap) -> &'static str {
    if headers.get("x-forwarded-proto").and_then(|v| v.to_str().ok()) == Some("https") { "https" } else { "http" }
}

/// A POST a browser says is same-origin: `Sec-Fetch-Site` (sent by every current browser) is
/// `same-origin` when present, and `Origin`, when present, is exactly this scheme and host.
/// Clients that send neither (curl, tests) are not browsers a cross-site page could drive.
fn same_origin(headers: &HeaderMap, host: &str) -> bool {
    let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if site.is_some_and(|s| s != "same-origin" && s != "none") {
        return false;
    }
    match headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) {
        None => true,
        Some(origin) => origin
            .split_once("://")
            .is_some_and(|(sch, rest)| sch == scheme(headers) && !host.is_empty() && rest == host),
    }
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    ([(header::CONTENT_TYPE, content_type), (header::CACHE_CONTROL, "no-cache")], body).into_response()
}

/// A page: HTML with the console's security headers.
fn page(status: StatusCode, markup: Markup) -> Response {
    (
        status,
        [
            (header::CONTENT_SECURITY_POLICY, POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "same-origin"),
            (header::CACHE_CONTROL, "no-store"),
            // For browsers that predate `frame-ancestors`.
            (header::X_FRAME_OPTIONS, "DENY"),
        ],
        Html(markup.into_string()),
    )
        .into_response()
}

/// An error as a page, with the status the API would answer.
fn error_page(session: Option<&Session>, e: impl Into<ApiError>) -> Refused {
    let e = e.into();
    let title = match e.status {
        StatusCode::NOT_FOUND => "Not found",
        StatusCode::FORBIDDEN => "Not allowed",
        StatusCode::CONFLICT => "Not possible now",
        StatusCode::BAD_REQUEST => "Not understood",
        _ => "Something went wrong",
    };
    Refused(Box::new(page(e.status, pages::message(session, title, &e.message))))
}

/// A page that answers instead of the one asked for (an error, a refusal), boxed: a response is
/// large for an error variant.
struct Refused(Box<Response>);

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        *self.0
    }
}

type PageResult = Result<Response, Refused>;

/// A console form. One that cannot be read (a field missing, a number that is none) is answered
/// with a console page saying so (400), not the extractor's plain text.
struct ConsoleForm<T>(T);

impl<T: serde::de::DeserializeOwned, S: Send + Sync> FromRequest<S> for ConsoleForm<T> {
    type Rejection = Refused;

    async fn from_request(req: Request, state: &S) -> Result<Self, Refused> {
        match Form::<T>::from_request(req, state).await {
            Ok(Form(value)) => Ok(ConsoleForm(value)),
            Err(e) => Err(error_page(
                None,
                ApiError::new(
                    StatusCode::BAD_REQUEST,
                    "invalid_request",
                    format!("The form could not be read ({}); go back and submit it again.", e.body_text()),
                ),
            )),
        }
    }
}

/// What every action checks first: the CSRF token of this session, and an admin token.
fn may_act(session: &Session, csrf: &str) -> Result<(), Refused> {
    if !session.csrf_ok(csrf) {
        tracing::warn!(actor = %session.actor, "console POST without this session's CSRF token refused");
        return Err(error_page(
            Some(session),
            ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "The form is stale or did not come from this console; reload the page.",
            ),
        ));
    }
    if !session.can_act() {
        tracing::info!(actor = %session.actor, "console action by a read-only token refused");
        return Err(error_page(
            Some(session),
            ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "This token may look, not act: actions need an admin token.",
            ),
        ));
    }
    Ok(())
}

#[derive(Deserialize)]
struct CsrfForm {
    #[serde(default)]
    csrf: String,
}

// ----- signing in ------------------------------------------------------------------------------

async fn login_form(State(s): State<AppState>) -> Response {
    if s.tokens.is_empty() {
        return Redirect::to("/console").into_response();
    }
    page(StatusCode::OK, pages::login(None))
}

#[derive(Deserialize)]
struct LoginForm {
    #[serde(default)]
    token: String,
}

async fn login(State(s): State<AppState>, headers: HeaderMap, ConsoleForm(f): ConsoleForm<LoginForm>) -> Response {
    if s.tokens.is_empty() {
        return Redirect::to("/console").into_response();
    }
    let refused = |why: &str| page(StatusCode::UNAUTHORIZED, pages::login(Some(why)));
    let actor = s.tokens.actor_of(&f.token);
    // A valid token signs in on its own bucket; a guess takes from the anonymous one.
    let key = actor.as_ref().map(|_| crate::auth::Tokens::digest_of(&f.token));
    if let Err(wait) = s.limiter.admit(key) {
        metrics::counter!("settle_http_rate_limited_total").increment(1);
        return ApiError::rate_limited(wait).into_response();
    }
    let Some(actor) = actor else {
        tracing::warn!("console sign-in with an unknown token refused");
        // Slows guessing; tokens are long random strings, so this is a courtesy, not the defence.
        tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        return refused("That token is not valid here.");
    };
    if actor.role == Role::Worker {
        return refused("Worker tokens do not open the console: sign in with an admin or client token.");
    }
    tracing::info!(actor = %actor, role = actor.role.name(), "console sign-in");
    let https = scheme(&headers) == "https";
    let digest = crate::auth::Tokens::digest_of(&f.token);
    let value = s.console_key.issue(&actor, &digest, session::now_unix() + session::SESSION_SECONDS);
    ([(header::SET_COOKIE, session::set_cookie(&value, https))], Redirect::to("/console")).into_response()
}

async fn logout(State(s): State<AppState>, session: Session, ConsoleForm(f): ConsoleForm<CsrfForm>) -> Response {
    if !session.csrf_ok(&f.csrf) {
        return error_page(
            Some(&session),
            ApiError::new(StatusCode::FORBIDDEN, "forbidden", "Reload the page and sign out again."),
        )
        .into_response();
    }
    if let Err(e) = session.sign_out(&s.console_key, s.store.as_ref(), session::now_unix()).await {
        // Not recorded: say so rather than pretend the cookie is dead everywhere.
        return error_page(Some(&session), e).into_response();
    }
    tracing::info!(actor = %session.actor, "console sign-out");
    ([(header::SET_COOKIE, session::clear_cookie())], Redirect::to("/console/login")).into_response()
}

// ----- reading --------------------------------------------------------------------------------

async fn overview(State(s): State<AppState>, session: Session) -> PageResult {
    // The overview counts every account's jobs: a scoped token sees its own in the jobs list.
    if !session.actor.scope.is_all() {
        return Ok(Redirect::to("/console/jobs").into_response());
    }
    let since = s.store.now().minus_seconds(3_600);
    let err = |e: StoreError| error_page(Some(&session), e);
    let o = s.store.operators().overview(since).await.map_err(err)?;
    let failures = s.store.failure_summary(&settle_core::scope::Scope::ALL).await.map_err(err)?;
    let webhooks = webhook_summary(&s).await.map_err(err)?;
    Ok(page(StatusCode::OK, pages::overview(&session, &o, &failures, &webhooks)))
}

async fn webhook_summary(s: &AppState) -> Result<pages::WebhookSummary, StoreError> {
    let backlog = s.store.webhooks().backlog().await?;
    let mut endpoints: Vec<(String, String, i64, i64)> = s
        .store
        .webhooks()
        .breakers()
        .await?
        .into_iter()
        .map(|b| (b.endpoint_id, b.state.as_str().to_owned(), 0, 0))
        .collect();
    for b in backlog {
        match endpoints.iter_mut().find(|e| e.0 == b.endpoint_id) {
            Some(e) => (e.2, e.3) = (b.pending, b.dead),
            None => endpoints.push((b.endpoint_id, "closed".into(), b.pending, b.dead)),
        }
    }
    endpoints.sort();
    Ok(pages::WebhookSummary { endpoints })
}

#[derive(Deserialize)]
struct FindQuery {
    #[serde(default)]
    q: String,
}

/// The search box: a job id, else an account id, else the jobs whose id starts with it (each page
/// then shows only what the session's scope names).
async fn find(State(s): State<AppState>, session: Session, Query(f): Query<FindQuery>) -> Response {
    let q = f.q.trim();
    let scope = &session.actor.scope;
    if let Ok(id) = JobId::parse(q)
        && s.store.job(&id).await.is_ok_and(|j| scope.job(j.account_id.as_str(), j.kind.as_str()))
    {
        return Redirect::to(&format!("/console/jobs/{q}")).into_response();
    }
    if let Ok(id) = AccountId::parse(q)
        && scope.account(id.as_str())
        && s.store.account(&id).await.is_ok()
    {
        return Redirect::to(&format!("/console/accounts/{q}")).into_response();
    }
    Redirect::to(&format!("/console/jobs?prefix={}", urlencode(q))).into_response()
}

/// The most jobs whose net the jobs page adds up (a sum over each one's ledger entries).
const NET_JOBS_MAX: i64 = 10_000;

async fn jobs(State(s): State<AppState>, session: Session, Query(q): Query<JobsQuery>) -> PageResult {
    let err = |e: ApiError| error_page(Some(&session), e);
    let filter = q.filter(&session.actor.scope).map_err(err)?;
    let page = s
        .store
        .jobs(&filter, Page { after: q.after.unwrap_or(0), limit: PAGE_JOBS })
        .await
        .map_err(|e| err(e.into()))?;
    let mut totals = s.store.operators().job_totals(&filter, false).await.map_err(|e| err(e.into()))?;
    // What the matches cost their accounts now (after refunds and releases) reads each one's
    // entries: worked out for up to `NET_JOBS_MAX` of them, else the page gives their prices only.
    if totals.jobs <= NET_JOBS_MAX {
        totals = s.store.operators().job_totals(&filter, true).await.map_err(|e| err(e.into()))?;
    }
    // Dead withdrawals among the matches: a bulk requeue passes over them, so the page says so (or
    // offers no requeue at all when they are all it would touch).
    let withdrawals = if filter.state == Some(JobState::Dead) && totals.jobs > 0 {
        let kind = JobKind::parse(settle_core::job::WITHDRAWAL_KIND).expect("a valid kind");
        match &filter.kind {
            Some(k) if *k != kind => 0,
            _ => {
                let only = JobFilter { kind: Some(kind), ..filter.clone() };
                s.store.operators().job_totals(&only, false).await.map_err(|e| err(e.into()))?.jobs
            }
        }
    } else {
        0
    };
    Ok(self::page(StatusCode::OK, pages::jobs(&session, &q, &page.rows, page.next_after, &totals, withdrawals)))
}

fn job_id(session: &Session, id: &str) -> Result<JobId, Refused> {
    JobId::parse(id).map_err(|_| error_page(Some(session), ApiError::not_found("No job has that id.")))
}

async fn job(State(s): State<AppState>, session: Session, Path(id): Path<String>) -> PageResult {
    let id = job_id(&session, &id)?;
    let err = |e: StoreError| error_page(Some(&session), e);
    let job = s.store.job(&id).await.map_err(err)?;
    if !session.actor.scope.job(job.account_id.as_str(), job.kind.as_str()) {
        return Err(err(StoreError::not_found("job", id.as_str())));
    }
    let attempts = s.store.attempts(&id).await.map_err(err)?;
    let signals = s.store.signals(&id).await.map_err(err)?;
    let history = s.store.operators().job_history(&id).await.map_err(err)?;
    let actions = s.store.operators().actions(Some(&id), None).await.map_err(err)?;
    let paid_by = s.store.allocations(&id).await.map_err(err)?;
    // A withdrawal's page shows where the money goes and what the provider knows it by.
    let withdrawal = if job.kind.as_str() == settle_core::job::WITHDRAWAL_KIND {
        Some(s.store.payouts().withdrawal(&id).await.map_err(err)?)
    } else {
        None
    };
    // A top-up's: what it buys, from whom, and what the funding provider confirmed.
    let top_up = if job.kind.as_str() == settle_core::job::TOP_UP_KIND {
        Some(s.store.funding().top_up(&id).await.map_err(err)?)
    } else {
        None
    };
    // A queued job that requires labels: has any worker shown them lately?
    let unmatched = if job.state == settle_core::job::JobState::Queued && !job.requires.is_empty() {
        let since = s.store.now().minus_seconds(pages::LABELS_SEEN_WINDOW_SECONDS);
        let seen = s.store.worker_labels_since(since).await.map_err(err)?;
        !seen.iter().any(|have| job.requires.covered_by(have))
    } else {
        false
    };
    // A queued job whose account is capped: how many of the account's jobs run against the cap.
    let reserved = settle_core::job::Rail::of(job.kind.as_str()).is_reserved();
    let capped = if job.state == settle_core::job::JobState::Queued && !reserved {
        let account = s.store.account(&job.account_id).await.map_err(err)?;
        match account.max_running {
            Some(cap) => {
                let filter = settle_store::JobFilter {
                    state: Some(settle_core::job::JobState::Running),
                    account_id: Some(job.account_id.clone()),
                    ..settle_store::JobFilter::ALL
                };
                let limit = u32::try_from(cap + 1).unwrap_or(u32::MAX).min(settle_core::limits::PAGE_LIMIT_MAX);
                let running = s.store.jobs(&filter, settle_store::Page { after: 0, limit }).await.map_err(err)?;
                Some((cap, running.rows.len()))
            }
            None => None,
        }
    } else {
        None
    };
    let p = pages::JobPage {
        job: &job,
        attempts: &attempts,
        signals: &signals,
        history: &history,
        actions: &actions,
        withdrawal: withdrawal.as_ref(),
        top_up: top_up.as_ref(),
        paid_by: &paid_by,
        unmatched,
        capped,
    };
    Ok(page(StatusCode::OK, pages::job(&session, &p)))
}

fn parse_since(s: &str) -> Option<Timestamp> {
    Timestamp::parse_rfc3339(s)
        .or_else(|| Timestamp::parse_rfc3339(&format!("{s}:00Z")))
        .or_else(|| Timestamp::parse_rfc3339(&format!("{s}Z")))
}

async fn account(
    State(s): State<AppState>,
    session: Session,
    Path(id): Path<String>,
    Query(q): Query<EntriesQuery>,
) -> PageResult {
    let err = |e: ApiError| error_page(Some(&session), e);
    let id = AccountId::parse(&id).map_err(|_| err(ApiError::not_found("No account has that id.")))?;
    if !session.actor.scope.account(id.as_str()) {
        return Err(err(StoreError::not_found("account", id.as_str()).into()));
    }
    let kind = nonempty(&q.kind)
        .map(|k| EntryKind::parse(k).ok_or_else(|| ApiError::invalid("Unknown entry kind.")))
        .transpose()
        .map_err(err)?;
    let since = nonempty(&q.since)
        .map(|t| parse_since(t).ok_or_else(|| ApiError::invalid("The time is not a time (YYYY-MM-DDTHH:MM, UTC).")))
        .transpose()
        .map_err(err)?;
    let detail = s.store.operators().account_detail(&id).await.map_err(|e| err(e.into()))?;
    // Recomputing the chain reads every entry of the account: only when asked.
    let chain = match q.chain {
        Some(true) => Some(s.store.operators().verify_chain(&id).await.map_err(|e| err(e.into()))?),
        _ => None,
    };
    let page = Page { after: q.after.unwrap_or(0), limit: PAGE_JOBS };
    let entries = s.store.operators().entries(&id, kind, since, page).await.map_err(|e| err(e.into()))?;
    let actions = s.store.operators().actions(None, Some(&id)).await.map_err(|e| err(e.into()))?;
    let grants = s.store.grants(&id, Page { after: 0, limit: 1000 }).await.map_err(|e| err(e.into()))?;
    let alerts = s.store.alerts(&id).await.map_err(|e| err(e.into()))?;
    let limits = s.store.limits(&id).await.map_err(|e| err(e.into()))?;
    let rule = match s.store.funding().auto_top_up(&id).await {
        Ok(rule) => Some(rule),
        Err(StoreError::NotFound { .. }) => None,
        Err(e) => return Err(err(e.into())),
    };
    let p = pages::AccountPage {
        detail: &detail,
        chain,
        grants: &grants.rows,
        alerts: &alerts,
        limits: &limits,
        rule: rule.as_ref(),
        entries: &entries.rows,
        next: entries.next_after,
        actions: &actions,
    };
    Ok(self::page(StatusCode::OK, pages::account(&session, &p, &q)))
}

#[derive(Deserialize)]
struct AfterQuery {
    after: Option<i64>,
}

#[derive(Deserialize)]
struct AccountsQuery {
    after: Option<String>,
}

/// The accounts the session's token sees, in id order.
async fn accounts(State(s): State<AppState>, session: Session, Query(q): Query<AccountsQuery>) -> PageResult {
    let err = |e: ApiError| error_page(Some(&session), e);
    let after = nonempty(&q.after)
        .map(|a| AccountId::parse(a).map_err(|_| ApiError::invalid("The cursor is not an account id.")))
        .transpose()
        .map_err(err)?;
    let p = s.store.accounts(&session.actor.scope, after.as_ref(), PAGE_JOBS).await.map_err(|e| err(e.into()))?;
    Ok(page(StatusCode::OK, pages::accounts(&session, &p.rows, p.next_after.as_deref())))
}

async fn top_ups(State(s): State<AppState>, session: Session, Query(q): Query<AfterQuery>) -> PageResult {
    let filter = TopUpFilter { scope: session.actor.scope.clone(), ..TopUpFilter::default() };
    let page = Page { after: q.after.unwrap_or(0), limit: PAGE_JOBS };
    let p = s.store.funding().top_ups(&filter, page).await.map_err(|e| error_page(Some(&session), e))?;
    Ok(self::page(StatusCode::OK, pages::top_ups(&session, &p.rows, p.next_after)))
}

async fn withdrawals(State(s): State<AppState>, session: Session, Query(q): Query<AfterQuery>) -> PageResult {
    let filter =
        WithdrawalFilter { state: None, account_id: None, updated_since: None, scope: session.actor.scope.clone() };
    let page = Page { after: q.after.unwrap_or(0), limit: PAGE_JOBS };
    let p = s.store.payouts().withdrawals(&filter, page).await.map_err(|e| error_page(Some(&session), e))?;
    Ok(self::page(StatusCode::OK, pages::withdrawals(&session, &p.rows, p.next_after)))
}

async fn webhooks(State(s): State<AppState>, session: Session) -> PageResult {
    let err = |e: StoreError| error_page(Some(&session), e);
    // Deliveries carry every account's events: not for a scoped token.
    if !session.actor.scope.is_all() {
        return Err(error_page(
            Some(&session),
            ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "This token's scope does not include the webhook deliveries.",
            ),
        ));
    }
    let summary = webhook_summary(&s).await.map_err(err)?;
    let filter = DeliveryFilter { endpoint_id: None, state: Some(settle_store::DeliveryState::Dead) };
    let dead = s.store.webhooks().deliveries(&filter, 0, PAGE_JOBS).await.map_err(err)?;
    Ok(page(StatusCode::OK, pages::webhooks(&session, &summary, &dead.rows)))
}

// ----- acting ---------------------------------------------------------------------------------

/// Requeue or cancel one job, as the job page's buttons ask.
async fn job_action(
    State(s): State<AppState>,
    session: Session,
    Path((id, action)): Path<(String, String)>,
    ConsoleForm(f): ConsoleForm<CsrfForm>,
) -> PageResult {
    may_act(&session, &f.csrf)?;
    let id = job_id(&session, &id)?;
    let actor = session.actor.name.as_str();
    let done = match JobAction::parse(&action) {
        Some(JobAction::Requeue) => s.store.requeue(&id, actor).await.map(drop),
        Some(JobAction::Cancel) => s.store.cancel(&id, Some(actor)).await.map(drop),
        None => return Err(error_page(Some(&session), ApiError::not_found("No such action."))),
    };
    done.map_err(|e| error_page(Some(&session), e))?;
    tracing::info!(actor = %session.actor, job = %id, action, "console: job action");
    Ok(Redirect::to(&format!("/console/jobs/{id}")).into_response())
}

async fn requeue_delivery(
    State(s): State<AppState>,
    session: Session,
    Path((endpoint, seq)): Path<(String, i64)>,
    ConsoleForm(f): ConsoleForm<CsrfForm>,
) -> PageResult {
    may_act(&session, &f.csrf)?;
    s.store
        .webhooks()
        .requeue_one(&endpoint, seq, &session.actor.name)
        .await
        .map_err(|e| error_page(Some(&session), e))?;
    Ok(Redirect::to("/console/webhooks").into_response())
}

async fn audit(State(s): State<AppState>, session: Session, ConsoleForm(f): ConsoleForm<CsrfForm>) -> PageResult {
    may_act(&session, &f.csrf)?;
    let report = s.store.audit(None).await.map_err(|e| error_page(Some(&session), e))?;
    let detail = serde_json::json!({
        "ok": report.violations.is_empty(),
        "violations": report.violations.len(),
        "accounts_checked": report.accounts_checked,
        "entries_checked": report.entries_checked,
    });
    s.store
        .operators()
        .record_action(&session.actor.name, settle_store::ActionKind::LedgerAudit, detail)
        .await
        .map_err(|e| error_page(Some(&session), e))?;
    tracing::info!(actor = %session.actor, ok = report.violations.is_empty(), "console: audit");
    Ok(page(StatusCode::OK, pages::audit(&session, &report)))
}

#[derive(Deserialize)]
struct BulkQuery {
    action: String,
    #[serde(flatten)]
    jobs: JobsQuery,
}

fn bulk_action(session: &Session, action: &str) -> Result<JobAction, Refused> {
    JobAction::parse(action)
        .ok_or_else(|| error_page(Some(session), ApiError::invalid("A bulk action is requeue or cancel.")))
}

/// The filter a bulk action may take: requeue only dead jobs, cancel only queued or running ones.
fn bulk_filter(session: &Session, action: JobAction, q: &JobsQuery) -> Result<JobFilter, Refused> {
    let filter = q.filter(&session.actor.scope).map_err(|e| error_page(Some(session), e))?;
    let allowed = match action {
        JobAction::Requeue => filter.state == Some(JobState::Dead),
        JobAction::Cancel => matches!(filter.state, Some(JobState::Queued | JobState::Running)),
    };
    if !allowed {
        let why = if action == JobAction::Requeue {
            "Bulk requeue takes dead jobs: filter by state dead."
        } else {
            "Bulk cancel takes queued or running jobs: filter by one of those states."
        };
        return Err(error_page(Some(session), ApiError::invalid(why)));
    }
    Ok(filter)
}

async fn bulk_confirm(State(s): State<AppState>, session: Session, Query(q): Query<BulkQuery>) -> PageResult {
    if !session.can_act() {
        return Err(error_page(
            Some(&session),
            ApiError::new(StatusCode::FORBIDDEN, "forbidden", "Bulk actions need an admin token."),
        ));
    }
    let action = bulk_action(&session, &q.action)?;
    let filter = bulk_filter(&session, action, &q.jobs)?;
    let totals = s.store.operators().job_totals(&filter, true).await.map_err(|e| error_page(Some(&session), e))?;
    Ok(page(StatusCode::OK, pages::bulk_confirm(&session, action, &filter, &q.jobs.filter_query(), &totals)))
}

#[derive(Deserialize)]
struct BulkForm {
    #[serde(default)]
    csrf: String,
    action: String,
    /// The filter as a query string (`state=dead&kind=render`), as the confirmation page carried it.
    filter: String,
    /// How many jobs the confirmation said, and the newest of them: the action takes no job
    /// created since, and is refused if more match now than were confirmed.
    expected: i64,
    until: i64,
}

/// Acts on the jobs the confirmation counted (the filter, up to the newest job it saw), at most
/// `BULK_MAX` per submission, each in its own transaction recorded in the action log, walking
/// them in creation order. Jobs the action cannot move (a withdrawal, a running job already asked
/// to cancel) are passed over and listed.
async fn bulk(State(s): State<AppState>, session: Session, ConsoleForm(f): ConsoleForm<BulkForm>) -> PageResult {
    may_act(&session, &f.csrf)?;
    let action = bulk_action(&session, &f.action)?;
    let q: JobsQuery = serde_urlencoded_query(&f.filter).map_err(|e| error_page(Some(&session), e))?;
    let mut filter = bulk_filter(&session, action, &q)?;
    filter.until_seq = Some(f.until);
    let err = |e: StoreError| error_page(Some(&session), e);
    let now = s.store.operators().job_totals(&filter, false).await.map_err(err)?;
    if now.jobs > f.expected {
        return Err(error_page(
            Some(&session),
            ApiError::new(
                StatusCode::CONFLICT,
                "conflict",
                format!(
                    "{} jobs match now, not the {} you confirmed: nothing was done. Look at the list again and confirm anew.",
                    now.jobs, f.expected
                ),
            ),
        ));
    }
    let named = filter.kind.as_ref().map(|k| settle_core::job::Rail::of(k.as_str()));
    let (mut done, mut skipped, mut after, mut more) = (0u64, Vec::new(), 0i64, false);
    'pages: loop {
        let page = s.store.jobs(&filter, Page { after, limit: 200 }).await.map_err(err)?;
        for job in &page.rows {
            if done >= u64::from(BULK_MAX) {
                more = true;
                break 'pages;
            }
            let rail = settle_core::job::Rail::of(job.kind.as_str());
            let passed_over = match (rail, action) {
                // Its hold was refunded when it died: a re-run is a new withdrawal with a new key.
                (Rail::Payout, JobAction::Requeue) => {
                    Some("a dead withdrawal is never requeued (its hold was refunded): create a new withdrawal")
                }
                (Rail::Funding, JobAction::Requeue) => {
                    Some("a dead top-up is never requeued (its card was declined or it gave up): create a new top-up")
                }
                (Rail::Payout, _) if named != Some(rail) => {
                    Some("a withdrawal: act on withdrawals with a filter of kind withdrawal")
                }
                (Rail::Funding, _) if named != Some(rail) => {
                    Some("a top-up: act on top-ups with a filter of kind top_up")
                }
                _ => None,
            };
            let passed_over = if passed_over.is_some() {
                passed_over
            } else if action == JobAction::Cancel && job.cancel_requested {
                Some("already asked to cancel; it stops at its next item boundary")
            } else {
                None
            };
            if let Some(why) = passed_over {
                skipped.push((job.id.clone(), why.to_owned()));
                continue;
            }
            let outcome = match action {
                JobAction::Requeue => s.store.requeue(&job.id, &session.actor.name).await.map(drop),
                JobAction::Cancel => s.store.cancel(&job.id, Some(&session.actor.name)).await.map(drop),
            };
            match outcome {
                Ok(()) => done += 1,
                Err(e) => skipped.push((job.id.clone(), ApiError::from(e).message)),
            }
        }
        match page.next_after {
            Some(next) => after = next,
            None => break,
        }
    }
    tracing::info!(actor = %session.actor, action = action.as_str(), filter = %f.filter, done, skipped = skipped.len(), more, "console: bulk action");
    Ok(page(StatusCode::OK, pages::bulk_done(&session, action, done, &skipped, more)))
}

fn serde_urlencoded_query(text: &str) -> Result<JobsQuery, ApiError> {
    let uri: axum::http::Uri =
        format!("/?{text}").parse().map_err(|_| ApiError::invalid("The filter is not a query string."))?;
    Query::<JobsQuery>::try_from_uri(&uri).map(|q| q.0).map_err(|_| ApiError::invalid("The filter is not valid."))
}
