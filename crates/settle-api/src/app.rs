//! The service: state, router, layers, and `Application` (bind, then serve until shutdown).

use crate::auth::{LiveTokens, Tokens};
use crate::error::ApiError;
use crate::handlers as h;
pub use crate::state::{AppState, METRICS_REFRESH};
use axum::Router;
use axum::extract::{DefaultBodyLimit, MatchedPath, Request, State};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use settle_store::Store;
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;
use tower_http::catch_panic::CatchPanicLayer;
use tower_http::sensitive_headers::SetSensitiveRequestHeadersLayer;
use tower_http::trace::TraceLayer;
use utoipa::OpenApi;
use utoipa_axum::router::OpenApiRouter;
use utoipa_axum::routes;

/// The largest request body: the spec's 1 MiB; larger is `413 payload_too_large`.
pub const BODY_BYTES_MAX: usize = 1 << 20;
/// A request still running after this is answered `503` (long-polls wait at most 30 s).
pub const REQUEST_SECONDS_MAX: u64 = 60;

/// What one slow or idle client may hold: a connection that does not finish its request head in
/// `header_read_timeout` (also the idle time allowed between requests on a kept-alive connection)
/// is closed; a body not read within `body_read_timeout` ends the request; past `max_connections`
/// open connections, or `max_connections_per_peer` from one IP address, a new one is closed at
/// once — so one peer holding half-sent heads cannot lock everyone else out. Behind a reverse
/// proxy every connection comes from the proxy's address: there the proxy must bound each client
/// itself, and `max_connections_per_peer` is set to `max_connections` (docs/design/http.md).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct HttpLimits {
    pub header_read_timeout: Duration,
    pub body_read_timeout: Duration,
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    /// Per-token request rate and long-polls.
    pub abuse: crate::limits::AbuseLimits,
    /// How often a waiting long-poll looks again when nothing wakes it. Wake-ups (a commit in this
    /// process, or a NOTIFY from another) answer it at once; this is only the safety net.
    pub long_poll_recheck: Duration,
    /// How long `POST /v1/reports` waits for its reports: one not finished by then is answered
    /// `503` on its own ("it may yet take effect"), and runs on to its end. At most 50 s, inside
    /// the server's 60 s request limit, so a report still running is answered on its own instead
    /// of the whole request timing out.
    pub reports_deadline: Duration,
}

impl Default for HttpLimits {
    fn default() -> HttpLimits {
        HttpLimits {
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_connections: 1_024,
            max_connections_per_peer: 256,
            abuse: crate::limits::AbuseLimits::default(),
            long_poll_recheck: Duration::from_millis(settle_core::limits::POLL_INTERVAL_MS),
            reports_deadline: Duration::from_secs(50),
        }
    }
}

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Settle API",
        version = "1",
        description = "The credit ledger for pay-per-job platforms (api-v1).",
        license(name = "Apache-2.0", identifier = "Apache-2.0")
    ),
    modifiers(&BearerAuth),
    security(("bearer" = []))
)]
struct BaseOpenApi;

struct BearerAuth;

impl utoipa::Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

/// The installed Prometheus recorder (one per process).
pub fn metrics_handle() -> PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE
        .get_or_init(|| {
            let recorder = PrometheusBuilder::new()
                .set_buckets_for_metric(
                    Matcher::Full("settle_http_request_duration_seconds".into()),
                    &[0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0],
                )
                .expect("valid buckets")
                .build_recorder();
            let handle = recorder.handle();
            // Another recorder may already be installed (tests build many apps in one process).
            let _ = metrics::set_global_recorder(recorder);
            crate::telemetry::describe();
            handle
        })
        .clone()
}

fn api_router() -> OpenApiRouter<AppState> {
    OpenApiRouter::with_openapi(BaseOpenApi::openapi())
        .routes(routes!(h::create_account, h::list_accounts))
        .routes(routes!(h::get_account, h::update_account))
        .routes(routes!(h::put_alerts, h::get_alerts))
        .routes(routes!(h::put_limits, h::get_limits))
        .routes(routes!(h::put_auto_top_up, h::get_auto_top_up, h::delete_auto_top_up))
        .routes(routes!(h::create_grant, h::list_grants))
        .routes(routes!(h::create_adjustment))
        .routes(routes!(h::get_ledger))
        .routes(routes!(h::create_job, h::list_jobs))
        .routes(routes!(h::get_job))
        .routes(routes!(h::attempts))
        .routes(routes!(h::job_history))
        .routes(routes!(h::cancel))
        .routes(routes!(h::requeue))
        .routes(routes!(h::abandon_cleanup))
        .routes(routes!(h::claim))
        .routes(routes!(h::heartbeat))
        .routes(routes!(h::succeed))
        .routes(routes!(h::fail))
        .routes(routes!(h::unknown))
        .routes(routes!(h::release))
        .routes(routes!(crate::reports::reports))
        .routes(routes!(h::item_succeed))
        .routes(routes!(h::item_fail))
        .routes(routes!(h::register_artifact))
        .routes(routes!(h::create_withdrawal, h::list_withdrawals))
        .routes(routes!(h::get_withdrawal))
        .routes(routes!(h::withdrawal_returned))
        .routes(routes!(h::resolve_withdrawal))
        .routes(routes!(h::create_top_up, h::list_top_ups))
        .routes(routes!(h::get_top_up))
        .routes(routes!(h::failure_summary))
        .routes(routes!(h::events))
        .routes(routes!(h::audit))
        .routes(routes!(h::webhook_deliveries))
        .routes(routes!(h::requeue_delivery))
        .routes(routes!(h::requeue_dead_deliveries))
        .routes(routes!(h::close_breaker))
        .routes(routes!(h::healthz))
        .routes(routes!(h::readyz))
        .routes(routes!(h::metrics))
}

/// The OpenAPI document, generated from the handlers (served at `/openapi.json`).
pub fn openapi() -> utoipa::openapi::OpenApi {
    use utoipa::openapi::{ContentBuilder, Ref, ResponseBuilder};
    let (_, mut doc) = api_router().split_for_parts();
    // Answers any operation may give: bad input, auth, an oversized body, an unavailable ledger.
    let error = |what: &str| {
        ResponseBuilder::new()
            .description(what)
            .content("application/json", ContentBuilder::new().schema(Some(Ref::from_schema_name("ErrorBody"))).build())
            .build()
    };
    for (path, item) in doc.paths.paths.iter_mut() {
        let ops = [&mut item.get, &mut item.post];
        for op in ops.into_iter().flatten() {
            let open = matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics");
            let mut common = vec![("500", "internal error"), ("503", "unavailable")];
            if !open {
                common.extend([
                    ("400", "invalid_request"),
                    ("401", "unauthorized"),
                    ("403", "forbidden"),
                    ("413", "payload_too_large"),
                ]);
            }
            common.push(("429", "rate_limited"));
            for (status, what) in common {
                op.responses.responses.entry(status.to_owned()).or_insert_with(|| error(what).into());
            }
        }
        // Operations without auth.
        if matches!(path.as_str(), "/healthz" | "/readyz" | "/metrics")
            && let Some(op) = item.get.as_mut()
        {
            op.security = Some(vec![utoipa::openapi::security::SecurityRequirement::default()]);
        }
    }
    doc
}

async fn record(matched: Option<MatchedPath>, req: Request, next: Next) -> Response {
    let route = matched.map(|m| m.as_str().to_owned()).unwrap_or_else(|| "unmatched".to_owned());
    let started = Instant::now();
    let response = next.run(req).await;
    let status = response.status().as_u16().to_string();
    metrics::counter!("settle_http_requests_total", "route" => route.clone(), "status" => status).increment(1);
    metrics::histogram!("settle_http_request_duration_seconds", "route" => route)
        .record(started.elapsed().as_secs_f64());
    response
}

/// The per-token request rate: past it, `429 rate_limited` with `Retry-After`, before any work.
async fn rate_limit(State(state): State<AppState>, req: Request, next: Next) -> Response {
    // Loopback mode (no tokens) has no one to tell apart; probes are never limited.
    let path = req.uri().path();
    if state.tokens.is_empty() || matches!(path, "/healthz" | "/readyz" | "/metrics") {
        return next.run(req).await;
    }
    let key = state.tokens.identify(req.headers());
    match state.limiter.admit(key) {
        Ok(()) => next.run(req).await,
        Err(wait) => {
            metrics::counter!("settle_http_rate_limited_total").increment(1);
            ApiError::rate_limited(wait).into_response()
        }
    }
}

async fn fallback() -> ApiError {
    ApiError::not_found("No such route.")
}

/// Answers that the framework or a layer produced without a body (405, the timeout's 503) get the
/// spec's JSON error body.
async fn json_errors(req: Request, next: Next) -> Response {
    let response = next.run(req).await;
    if response.headers().get("content-type").is_some() {
        return response;
    }
    match response.status() {
        axum::http::StatusCode::METHOD_NOT_ALLOWED => ApiError::new(
            axum::http::StatusCode::METHOD_NOT_ALLOWED,
            "invalid_request",
            "This route does not take that method.",
        )
        .into_response(),
        axum::http::StatusCode::SERVICE_UNAVAILABLE => {
            ApiError::unavailable("The request took too long; retry shortly.").into_response()
        }
        _ => response,
    }
}

async fn openapi_json(State(doc): State<Arc<serde_json::Value>>) -> Response {
    crate::answer::json(axum::http::StatusCode::OK, &*doc)
}

fn panic_response(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    tracing::error!("a request handler panicked");
    ApiError::new(axum::http::StatusCode::INTERNAL_SERVER_ERROR, "internal", "An internal error occurred.")
        .into_response()
}

pub fn router(state: AppState) -> Router {
    router_with(state, HttpLimits::default())
}

fn router_with(state: AppState, limits: HttpLimits) -> Router {
    let (api, _) = api_router().split_for_parts();
    let doc = Arc::new(serde_json::to_value(openapi()).expect("the OpenAPI document serializes"));
    let docs = Router::new()
        .route("/openapi.json", axum::routing::get(openapi_json))
        .with_state(doc)
        .merge(crate::reference::router());
    let limited = middleware::from_fn_with_state(state.clone(), rate_limit);
    let loopback_only = middleware::from_fn_with_state(state.clone(), crate::host::loopback_only);
    let console = crate::console::router(state.clone());
    api.layer(limited)
        .with_state(state)
        .merge(docs)
        .merge(console)
        .fallback(fallback)
        .layer(loopback_only)
        .layer(DefaultBodyLimit::max(BODY_BYTES_MAX))
        .layer(tower_http::timeout::RequestBodyTimeoutLayer::new(limits.body_read_timeout))
        .layer(tower_http::timeout::TimeoutLayer::with_status_code(
            axum::http::StatusCode::SERVICE_UNAVAILABLE,
            Duration::from_secs(REQUEST_SECONDS_MAX),
        ))
        .layer(middleware::from_fn(json_errors))
        .layer(middleware::from_fn(record))
        .layer(SetSensitiveRequestHeadersLayer::new([axum::http::header::AUTHORIZATION]))
        .layer(TraceLayer::new_for_http())
        .layer(CatchPanicLayer::custom(panic_response))
}

/// A bound server: `build` binds (port 0 picks a free one), `run_until` serves until `shutdown`
/// resolves, then finishes the requests in flight.
pub struct Application {
    listener: TcpListener,
    router: Router,
    limits: HttpLimits,
    tokens: LiveTokens,
}

#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("refusing to listen on {0} without tokens: configure tokens, or listen on a loopback address")]
    OpenWithoutTokens(SocketAddr),
    #[error("{0}")]
    ConsoleSecret(String),
    /// Its `source` is the bind's error (shown once, by whoever prints the chain).
    #[error("cannot listen on {addr}")]
    Bind { addr: String, source: std::io::Error },
}

/// Refuses a console secret `build_on` would refuse, before anything is written.
pub fn check_console_secret(console_secret: Option<&str>) -> Result<(), StartError> {
    match console_secret {
        Some(secret) => crate::console::SessionKey::from_secret(secret).map(drop).map_err(StartError::ConsoleSecret),
        None => Ok(()),
    }
}

/// A listener bound and allowed (`Application::bind`): what `settle serve` holds before it opens
/// its store, so a start refused for its address writes nothing.
pub struct Bound(TcpListener);

impl Application {
    pub async fn build(listen: &str, store: Arc<dyn Store>, tokens: Tokens) -> Result<Application, StartError> {
        Application::build_with(listen, store, tokens, HttpLimits::default()).await
    }

    pub async fn build_with(
        listen: &str,
        store: Arc<dyn Store>,
        tokens: Tokens,
        limits: HttpLimits,
    ) -> Result<Application, StartError> {
        Application::build_full(listen, store, tokens, limits, None, false).await
    }

    /// As `build_with`; `console_secret` (at least 32 characters) signs console sessions so that
    /// every process configured with it accepts the others' (else each process has its own key);
    /// `payout_provider` says whether this process pays out through a provider.
    pub async fn build_full(
        listen: &str,
        store: Arc<dyn Store>,
        tokens: Tokens,
        limits: HttpLimits,
        console_secret: Option<&str>,
        payout_provider: bool,
    ) -> Result<Application, StartError> {
        let bound = Application::bind(listen, &tokens).await?;
        Application::build_on(bound, store, tokens, limits, console_secret, payout_provider)
    }

    /// Binds `listen` and checks it may serve there with `tokens` (none: a loopback address only).
    pub async fn bind(listen: &str, tokens: &Tokens) -> Result<Bound, StartError> {
        let listener =
            TcpListener::bind(listen).await.map_err(|source| StartError::Bind { addr: listen.to_owned(), source })?;
        let addr = listener.local_addr().map_err(|source| StartError::Bind { addr: listen.to_owned(), source })?;
        if tokens.is_empty() {
            if !addr.ip().is_loopback() {
                return Err(StartError::OpenWithoutTokens(addr));
            }
            tracing::warn!(%addr, "no tokens configured: serving without authentication on a loopback address only");
        }
        Ok(Bound(listener))
    }

    /// `build_full` on a listener `bind` gave.
    pub fn build_on(
        Bound(listener): Bound,
        store: Arc<dyn Store>,
        tokens: Tokens,
        limits: HttpLimits,
        console_secret: Option<&str>,
        payout_provider: bool,
    ) -> Result<Application, StartError> {
        let console_key = match console_secret {
            Some(secret) => crate::console::SessionKey::from_secret(secret).map_err(StartError::ConsoleSecret)?,
            None => crate::console::SessionKey::random(),
        };
        let limiter = Arc::new(crate::limits::Limiter::new(limits.abuse));
        let tokens = LiveTokens::new(tokens);
        let state = AppState {
            store,
            tokens: tokens.clone(),
            metrics: metrics_handle(),
            limiter,
            long_poll_recheck: limits.long_poll_recheck.max(Duration::from_millis(1)),
            reports_deadline: limits.reports_deadline.min(Duration::from_secs(50)),
            console_key,
            gauges_read_at: Arc::default(),
            payout_provider,
        };
        Ok(Application { listener, router: router_with(state, limits), limits, tokens })
    }

    /// The tokens it checks: `replace` them while it serves (the CLI does on SIGHUP).
    pub fn tokens(&self) -> LiveTokens {
        self.tokens.clone()
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener.local_addr().expect("a bound listener has an address")
    }

    /// Serves until `shutdown`, then stops accepting and finishes the requests in flight. Every
    /// connection gets the header-read timer, and at most `max_connections` are open at once.
    pub async fn run_until(self, shutdown: impl Future<Output = ()> + Send + 'static) -> std::io::Result<()> {
        use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
        let Application { listener, router, limits, .. } = self;
        let mut builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
        builder.http1().timer(TokioTimer::new()).header_read_timeout(limits.header_read_timeout).keep_alive(true);
        builder.http2().timer(TokioTimer::new()).keep_alive_interval(Some(limits.header_read_timeout));
        let graceful = hyper_util::server::graceful::GracefulShutdown::new();
        let open = Arc::new(tokio::sync::Semaphore::new(limits.max_connections.max(1)));
        let peers = Arc::new(PeerCounts::new(limits.max_connections_per_peer.max(1)));
        tokio::pin!(shutdown);
        loop {
            let accepted = tokio::select! {
                _ = &mut shutdown => break,
                accepted = listener.accept() => accepted,
            };
            let (stream, peer) = match accepted {
                Ok(accepted) => accepted,
                Err(e) => {
                    // Out of file descriptors, or a connection reset before accept: wait a little.
                    tracing::warn!(error = %e, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            };
            let Some(peer_slot) = peers.clone().enter(peer_key(peer.ip())) else {
                tracing::warn!(peer = %peer.ip(), max = limits.max_connections_per_peer, "too many open connections from one peer; closing a new one");
                drop(stream);
                continue;
            };
            let Ok(permit) = open.clone().try_acquire_owned() else {
                tracing::warn!(max = limits.max_connections, "too many open connections; closing a new one");
                drop(stream);
                continue;
            };
            let service = hyper_util::service::TowerToHyperService::new(router.clone());
            let connection = builder.serve_connection_with_upgrades(TokioIo::new(stream), service).into_owned();
            let connection = graceful.watch(connection);
            tokio::spawn(async move {
                let _ = connection.await;
                drop(permit);
                drop(peer_slot);
            });
        }
        drop(listener);
        graceful.shutdown().await;
        Ok(())
    }
}

/// Whose connections count together: an IPv4 address (an IPv4-mapped IPv6 one as itself), or an
/// IPv6 /64 — one host is usually given a whole /64, and could otherwise be 2^64 peers.
fn peer_key(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip.to_canonical() {
        std::net::IpAddr::V6(v6) => {
            let s = v6.segments();
            std::net::IpAddr::V6(std::net::Ipv6Addr::new(s[0], s[1], s[2], s[3], 0, 0, 0, 0))
        }
        v4 => v4,
    }
}

/// Open connections per peer address. An entry lives only while its peer has a connection open,
/// so the map holds at most `max_connections` entries.
struct PeerCounts {
    max: usize,
    open: std::sync::Mutex<std::collections::HashMap<std::net::IpAddr, usize>>,
}

/// One open connection of a peer; dropping it gives the place back.
struct PeerSlot {
    peers: Arc<PeerCounts>,
    ip: std::net::IpAddr,
}

impl PeerCounts {
    fn new(max: usize) -> PeerCounts {
        PeerCounts { max, open: std::sync::Mutex::new(std::collections::HashMap::new()) }
    }

    fn enter(self: Arc<PeerCounts>, ip: std::net::IpAddr) -> Option<PeerSlot> {
        let mut open = self.open.lock().unwrap_or_else(|p| p.into_inner());
        let n = open.entry(ip).or_insert(0);
        if *n >= self.max {
            return None;
        }
        *n += 1;
        drop(open);
        Some(PeerSlot { peers: self, ip })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut open = self.peers.open.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(n) = open.get_mut(&self.ip) {
            *n -= 1;
            if *n == 0 {
                open.remove(&self.ip);
            }
        }
    }
}
