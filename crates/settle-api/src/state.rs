//! What every handler shares: the store, the tokens, the limits, the console's key (below the
//! router, the handlers and the extractors, which all take it).

use crate::auth::LiveTokens;
use crate::console::SessionKey;
use metrics_exporter_prometheus::PrometheusHandle;
use settle_store::Store;
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Clone)]
pub struct AppState {
    pub store: Arc<dyn Store>,
    /// Replaced whole by SIGHUP (`Application::tokens`).
    pub tokens: LiveTokens,
    pub metrics: PrometheusHandle,
    pub limiter: Arc<crate::limits::Limiter>,
    pub long_poll_recheck: Duration,
    /// `HttpLimits::reports_deadline`.
    pub reports_deadline: Duration,
    /// Signs the console's sessions (made at startup).
    pub console_key: SessionKey,
    /// When `/metrics` last read the store's aggregates: they are read at most once per
    /// `METRICS_REFRESH`, by one request at a time, however often `/metrics` is asked.
    pub gauges_read_at: Arc<tokio::sync::Mutex<Option<Instant>>>,
    /// Whether this server pays out through a provider: then only the reconciler, which asks it,
    /// resolves `unknown` withdrawals, and an operator's resolution is refused.
    pub payout_provider: bool,
}

/// How old the store's aggregates in `/metrics` may be: `/metrics` needs no token, and the
/// aggregates scan whole tables, so they are not read again for every request.
pub const METRICS_REFRESH: Duration = Duration::from_secs(5);
