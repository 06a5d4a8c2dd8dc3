//! `/metrics`: every family Settle exports, described once (`# HELP`, and `# TYPE` from the kind it
//! is recorded as), and the reads behind the gauges that come from the store.
//!
//! A family that counts since the process started is a counter (`*_total`), even when its value
//! comes from elsewhere (the store's retry count, the PostgreSQL connection's): set with
//! `absolute`, so Prometheus's `rate()` and reset detection work on it. A labelled gauge read from
//! the store is set for every label it had before too, so a drained queue reads 0, not its last
//! depth.

use crate::error::ApiError;
use crate::state::AppState;
use settle_store as store;
use std::collections::BTreeSet;
use std::sync::Mutex;

/// How a family is recorded.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Kind {
    Counter,
    Gauge,
    Histogram,
}

/// Every family `/metrics` may show: its name, how it is recorded and what it means.
pub const FAMILIES: &[(&str, Kind, &str)] = &[
    (
        "settle_up",
        Kind::Gauge,
        "1 when the last read of the store's aggregates succeeded, 0 while the database is away",
    ),
    ("settle_http_requests_total", Kind::Counter, "HTTP requests answered, by route and status"),
    ("settle_http_request_duration_seconds", Kind::Histogram, "Time to answer an HTTP request, by route"),
    ("settle_http_long_polls_waiting", Kind::Gauge, "Long-polls (claims, events) waiting now"),
    (
        "settle_http_long_polls_refused_total",
        Kind::Counter,
        "Long-polls answered at once: the token had too many waiting",
    ),
    ("settle_http_rate_limited_total", Kind::Counter, "Requests refused 429 rate_limited"),
    (
        "settle_http_rate_buckets",
        Kind::Gauge,
        "Rate-limit buckets kept (one per token seen, and one for requests without)",
    ),
    (
        "settle_transitions_total",
        Kind::Counter,
        "Guarded transitions asked for, by kind and whether they changed anything",
    ),
    (
        "settle_reports_total",
        Kind::Counter,
        "Reports carried by POST /v1/reports, by kind and the status each was answered",
    ),
    ("settle_store_busy_total", Kind::Counter, "Requests answered 503 because the store was busy"),
    (
        "settle_store_tx_retries_total",
        Kind::Counter,
        "Database transactions retried (serialization failure, deadlock) since the process started",
    ),
    (
        "settle_metrics_store_reads_total",
        Kind::Counter,
        "Reads of the store's aggregates for /metrics (at most one per 5 s)",
    ),
    ("settle_pg_connections_opened_total", Kind::Counter, "PostgreSQL connections opened since the process started"),
    (
        "settle_pg_failover_signals_total",
        Kind::Counter,
        "Answers that said the PostgreSQL server is no longer the primary",
    ),
    ("settle_pg_primary_changes_total", Kind::Counter, "Times the PostgreSQL primary written to changed"),
    (
        "settle_pg_batch_plan_total",
        Kind::Counter,
        "Write batches' plan: jobs locked and read ahead, skipped (held elsewhere, run alone), phase 1s failed",
    ),
    ("settle_pg_batches_total", Kind::Counter, "Write batches the PostgreSQL lanes ran (optimistic)"),
    ("settle_pg_batch_operations_total", Kind::Counter, "Operations in those batches"),
    (
        "settle_pg_batch_intents_total",
        Kind::Counter,
        "Intents a batch read ahead: failures, successes, and those sharing their account with another of the batch",
    ),
    ("settle_jobs", Kind::Gauge, "Jobs by state"),
    ("settle_ledger_entries", Kind::Gauge, "Ledger entries by kind"),
    ("settle_queue_depth", Kind::Gauge, "Jobs queued, by kind, due or not"),
    ("settle_queue_due", Kind::Gauge, "Jobs a claim could take now, by kind"),
    (
        "settle_queue_oldest_due_seconds",
        Kind::Gauge,
        "How long the longest-waiting due job of a kind has been due (0: none is)",
    ),
    ("settle_queue_depth_by_priority", Kind::Gauge, "Jobs queued, by priority, due or not"),
    ("settle_queue_due_by_priority", Kind::Gauge, "Jobs a claim could take now, by priority"),
    (
        "settle_queue_oldest_due_seconds_by_priority",
        Kind::Gauge,
        "How long the longest-waiting due job of a priority has been due (0: none is)",
    ),
    ("settle_dead_letters", Kind::Gauge, "Jobs dead, waiting for an operator"),
    ("settle_webhook_breaker_open", Kind::Gauge, "1 while an endpoint's circuit breaker is open or probing"),
    ("settle_webhook_pending", Kind::Gauge, "Deliveries waiting to be sent, by endpoint"),
    ("settle_webhook_dead", Kind::Gauge, "Deliveries given up on, by endpoint (an admin requeues them)"),
    (
        "settle_webhook_oldest_pending_seconds",
        Kind::Gauge,
        "How long an endpoint's oldest waiting delivery has waited (0: none waits)",
    ),
];

/// Registers every family's description with the installed recorder.
pub fn describe() {
    for &(name, kind, help) in FAMILIES {
        match kind {
            Kind::Counter => metrics::describe_counter!(name, help),
            Kind::Gauge => metrics::describe_gauge!(name, help),
            Kind::Histogram => metrics::describe_histogram!(name, help),
        }
    }
}

/// The counters kept in memory by the store's PostgreSQL connections: current on every scrape,
/// and there while the database is away.
pub fn read_connection_counters(s: &AppState) {
    let db = s.store.database_stats();
    metrics::counter!("settle_pg_connections_opened_total").absolute(db.connections_opened);
    metrics::counter!("settle_pg_failover_signals_total").absolute(db.failover_signals);
    metrics::counter!("settle_pg_primary_changes_total").absolute(db.primary_changes);
    metrics::counter!("settle_pg_batch_plan_total", "outcome" => "read_ahead").absolute(db.plan.ahead);
    metrics::counter!("settle_pg_batch_plan_total", "outcome" => "skipped").absolute(db.plan.skipped);
    metrics::counter!("settle_pg_batch_plan_total", "outcome" => "failed").absolute(db.plan.failed);
    metrics::counter!("settle_pg_batches_total").absolute(db.plan.batches);
    metrics::counter!("settle_pg_batch_operations_total").absolute(db.plan.operations);
    metrics::counter!("settle_pg_batch_intents_total", "kind" => "fail").absolute(db.plan.fails);
    metrics::counter!("settle_pg_batch_intents_total", "kind" => "succeed").absolute(db.plan.succeeds);
    metrics::counter!("settle_pg_batch_intents_total", "kind" => "shared_account").absolute(db.plan.shared_account);
}

/// The gauges that come from the store's whole-table aggregates (jobs by state and kind, entries by
/// kind).
pub async fn read_store_gauges(s: &AppState) -> Result<(), ApiError> {
    metrics::counter!("settle_metrics_store_reads_total").increment(1);
    let stats = s.store.stats().await?;
    for state in settle_core::job::JobState::ALL {
        let n = stats.jobs_by_state.iter().find(|(name, _)| name == state.as_str()).map_or(0, |(_, n)| *n);
        metrics::gauge!("settle_jobs", "state" => state.as_str()).set(n as f64);
    }
    for (kind, n) in &stats.entries_by_kind {
        metrics::gauge!("settle_ledger_entries", "kind" => kind.clone()).set(*n as f64);
    }
    let now = s.store.now();
    for q in labelled_queues(stats.queues) {
        let kind = q.kind.clone();
        metrics::gauge!("settle_queue_depth", "kind" => kind.clone()).set(q.queued as f64);
        metrics::gauge!("settle_queue_due", "kind" => kind.clone()).set(q.due as f64);
        let waited = q.oldest_due_since.map_or(0.0, |t| seconds_since(now, t));
        metrics::gauge!("settle_queue_oldest_due_seconds", "kind" => kind).set(waited);
    }
    for q in shown_priorities(stats.priorities) {
        let priority = q.kind.clone();
        metrics::gauge!("settle_queue_depth_by_priority", "priority" => priority.clone()).set(q.queued as f64);
        metrics::gauge!("settle_queue_due_by_priority", "priority" => priority.clone()).set(q.due as f64);
        let waited = q.oldest_due_since.map_or(0.0, |t| seconds_since(now, t));
        metrics::gauge!("settle_queue_oldest_due_seconds_by_priority", "priority" => priority).set(waited);
    }
    let dead = stats.jobs_by_state.iter().find(|(name, _)| name == "dead").map_or(0, |(_, n)| *n);
    metrics::gauge!("settle_dead_letters").set(dead as f64);
    metrics::counter!("settle_store_tx_retries_total", "engine" => s.store.engine_name()).absolute(stats.tx_retries);
    Ok(())
}

/// Most kinds `/metrics` labels one by one: kinds are clients' words, and every label is a series
/// a monitoring system keeps.
pub const KINDS_LABELLED: usize = 50;

/// The queues to show: the `KINDS_LABELLED` with the most queued jobs under their own names, the
/// rest summed as `other`, and a kind shown last time but not now at zero (or it would keep its
/// last figures for ever).
fn labelled_queues(mut queues: Vec<store::KindQueue>) -> Vec<store::KindQueue> {
    static SHOWN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    queues.sort_by(|a, b| b.queued.cmp(&a.queued).then_with(|| a.kind.cmp(&b.kind)));
    if queues.len() > KINDS_LABELLED {
        let rest = queues.split_off(KINDS_LABELLED - 1);
        let mut other = store::KindQueue { kind: "other".into(), queued: 0, due: 0, oldest_due_since: None };
        for q in rest {
            other.queued += q.queued;
            other.due += q.due;
            other.oldest_due_since = match (other.oldest_due_since, q.oldest_due_since) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            };
        }
        queues.push(other);
    }
    let mut shown = SHOWN.lock().unwrap_or_else(|e| e.into_inner());
    let now: BTreeSet<String> = queues.iter().map(|q| q.kind.clone()).collect();
    for gone in shown.difference(&now) {
        queues.push(store::KindQueue { kind: gone.clone(), queued: 0, due: 0, oldest_due_since: None });
    }
    *shown = now;
    queues
}

/// The priorities to show: those with queued jobs now, and at zero those shown last time but not
/// now (a priority is one of 101 values: no series cap is needed).
fn shown_priorities(mut queues: Vec<store::KindQueue>) -> Vec<store::KindQueue> {
    static SHOWN: Mutex<BTreeSet<String>> = Mutex::new(BTreeSet::new());
    let mut shown = SHOWN.lock().unwrap_or_else(|e| e.into_inner());
    let now: BTreeSet<String> = queues.iter().map(|q| q.kind.clone()).collect();
    for gone in shown.difference(&now) {
        queues.push(store::KindQueue { kind: gone.clone(), queued: 0, due: 0, oldest_due_since: None });
    }
    *shown = now;
    queues
}

/// Each configured endpoint's breaker and backlog; one with nothing waiting reads 0.
pub async fn read_webhook_gauges(s: &AppState) {
    let Ok(breakers) = s.store.webhooks().breakers().await else { return };
    let mut endpoints = BTreeSet::new();
    for b in breakers {
        let open = if b.state == store::BreakerState::Closed { 0.0 } else { 1.0 };
        metrics::gauge!("settle_webhook_breaker_open", "endpoint" => b.endpoint_id.clone()).set(open);
        endpoints.insert(b.endpoint_id);
    }
    let Ok(backlog) = s.store.webhooks().backlog().await else { return };
    let now = s.store.now();
    for b in backlog {
        endpoints.remove(&b.endpoint_id);
        let endpoint = b.endpoint_id;
        metrics::gauge!("settle_webhook_pending", "endpoint" => endpoint.clone()).set(b.pending as f64);
        metrics::gauge!("settle_webhook_dead", "endpoint" => endpoint.clone()).set(b.dead as f64);
        let age = b.oldest_pending_at.map_or(0.0, |t| seconds_since(now, t));
        metrics::gauge!("settle_webhook_oldest_pending_seconds", "endpoint" => endpoint).set(age);
    }
    // Endpoints whose backlog drained: no row, so they would keep their last figures.
    for endpoint in endpoints {
        metrics::gauge!("settle_webhook_pending", "endpoint" => endpoint.clone()).set(0.0);
        metrics::gauge!("settle_webhook_dead", "endpoint" => endpoint.clone()).set(0.0);
        metrics::gauge!("settle_webhook_oldest_pending_seconds", "endpoint" => endpoint).set(0.0);
    }
}

fn seconds_since(now: settle_core::Timestamp, then: settle_core::Timestamp) -> f64 {
    (now.micros() - then.micros()).max(0) as f64 / 1e6
}
