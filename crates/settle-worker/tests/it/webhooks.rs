//! A real receiver (an HTTP server on port 0) that is down for its first requests gets every outbox
//! event, exactly as the outbox holds it, in order per job, signed; a tampered body fails to verify.

use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use settle_core::backoff::{BackoffPolicy, Jitter};
use settle_core::history::EventKind;
use settle_core::ids::*;
use settle_core::signature::{self, SignatureError};
use settle_core::{Clock, Credits};
use settle_store::*;
use settle_worker::webhooks::{Deliverer, Endpoint, event_body};
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

const SECRET: &str = "whsec-0123456789abcdef";

#[derive(Default)]
struct Receiver {
    /// Requests refused before the receiver comes up.
    down_for: Mutex<u32>,
    got: Mutex<Vec<(String, i64, Vec<u8>)>>,
    /// The event seq of every request, answered or refused.
    tried: Mutex<Vec<i64>>,
    /// The query strings the requests came with (deliverers racing tell themselves apart by it).
    senders: Mutex<std::collections::BTreeSet<String>>,
    /// Bodies holding this text are refused, always.
    refuse: Mutex<Option<String>>,
    /// How long each answer takes (a slow receiver), and how many requests were in flight at most.
    delay: Mutex<Duration>,
    in_flight: std::sync::atomic::AtomicU32,
    in_flight_max: std::sync::atomic::AtomicU32,
}

async fn receive(
    State(r): State<Arc<Receiver>>,
    axum::extract::RawQuery(query): axum::extract::RawQuery,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> StatusCode {
    r.senders.lock().unwrap().insert(query.unwrap_or_default());
    let seq = headers.get("settle-event-seq").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(-1);
    r.tried.lock().unwrap().push(seq);
    {
        let mut down = r.down_for.lock().unwrap();
        if *down > 0 {
            *down -= 1;
            return StatusCode::SERVICE_UNAVAILABLE;
        }
    }
    let delay = *r.delay.lock().unwrap();
    if !delay.is_zero() {
        use std::sync::atomic::Ordering::SeqCst;
        let now = r.in_flight.fetch_add(1, SeqCst) + 1;
        r.in_flight_max.fetch_max(now, SeqCst);
        tokio::time::sleep(delay).await;
        r.in_flight.fetch_sub(1, SeqCst);
    }
    if r.refuse.lock().unwrap().as_ref().is_some_and(|t| String::from_utf8_lossy(&body).contains(t.as_str())) {
        return StatusCode::UNPROCESSABLE_ENTITY;
    }
    let sig = headers.get("settle-signature").and_then(|v| v.to_str().ok()).unwrap_or("").to_owned();
    r.got.lock().unwrap().push((sig, seq, body.to_vec()));
    StatusCode::OK
}

/// A SQLite file in `dir`, or a fresh PostgreSQL database.
async fn database(engine: &str, dir: &tempfile::TempDir) -> String {
    match engine {
        "sqlite" => format!("sqlite://{}", dir.path().join("w.db").display()),
        _ => {
            settle_testkit::fresh_database_from_template(
                &settle_store::SqlStore::postgres_schema_id(),
                |url| async move { settle_store::SqlStore::migrate_postgres(&url).await.unwrap() },
            )
            .await
        }
    }
}

/// Serves `app` on a free port; returns its address.
async fn serve(app: axum::Router) -> std::net::SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    addr
}

/// A receiver at `/hook`.
async fn serve_receiver(receiver: Arc<Receiver>) -> std::net::SocketAddr {
    serve(axum::Router::new().route("/hook", axum::routing::post(receive)).with_state(receiver)).await
}

async fn scenario(store: &SqlStore) {
    let a = AccountId::parse("a").unwrap();
    store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    store
        .grant(
            &a,
            NewGrant {
                id: RefId::parse("g").unwrap(),
                amount: Credits::new(100),
                reason: None,
                expires_at: None,
                priority: None,
            },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    for n in 0..3 {
        let id = JobId::parse(&format!("j{n}")).unwrap();
        let req = NewJob {
            id: id.clone(),
            account_id: a.clone(),
            kind: JobKind::parse("render").unwrap(),
            items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(10)) }],
            payload: serde_json::Value::Null,
            max_attempts: None,
            refund_on: None,
            not_before: None,
            priority: None,
            requires: Default::default(),
        };
        store.create_job(req).await.unwrap();
        let c = store
            .claim(ClaimRequest {
                worker: WorkerName::parse("w").unwrap(),
                kinds: vec![],
                limit: 1,
                lease_seconds: None,
                labels: Default::default(),
            })
            .await
            .unwrap();
        let token = &c[0].lease_token;
        let fail = FailSignal {
            lease_token: token.clone(),
            code: FailCode::parse("TIMEOUT").unwrap(),
            message: None,
            retryable: None,
            retry_after_ms: None,
        };
        store.fail(&id, fail).await.unwrap();
        store.succeed(&id, settle_store::Reporter::of(Some(token)), None).await.unwrap();
    }
}

async fn deliver_everything(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = database(engine, &dir).await;
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    scenario(&store).await;

    let receiver = Arc::new(Receiver { down_for: Mutex::new(3), ..Receiver::default() });
    let addr = serve_receiver(receiver.clone()).await;

    let mut endpoint = Endpoint::new("ops", &format!("http://{addr}/hook"), SECRET);
    endpoint.backoff = BackoffPolicy { backoff_ms_base: 10, backoff_ms_max: 40, jitter: Jitter::None };
    endpoint.timeout = Duration::from_secs(5);
    endpoint.start_from = StartFrom::Beginning;
    let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
    let outbox = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    loop {
        deliverer.pass().await.unwrap();
        let pending = store
            .webhooks()
            .deliveries(
                &DeliveryFilter { endpoint_id: Some("ops".into()), state: Some(settle_store::DeliveryState::Pending) },
                0,
                1000,
            )
            .await
            .unwrap();
        if pending.rows.is_empty() && !receiver.got.lock().unwrap().is_empty() {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "deliveries still pending: {}", pending.rows.len());
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let got = receiver.got.lock().unwrap().clone();
    // Every event, exactly once here (nothing crashed), exactly as the outbox holds it, signed.
    let by_seq: BTreeMap<i64, &Vec<u8>> = got.iter().map(|(_, seq, body)| (*seq, body)).collect();
    assert_eq!(by_seq.len(), outbox.len());
    assert_eq!(got.len(), outbox.len(), "no duplicates without a crash");
    for e in &outbox {
        assert_eq!(by_seq[&e.seq], &event_body(e), "event {} differs from the outbox", e.seq);
        let body: serde_json::Value = serde_json::from_slice(by_seq[&e.seq]).unwrap();
        assert_eq!((body["seq"].as_i64(), body["type"].as_str()), (Some(e.seq), Some(e.kind.as_str())));
    }
    let now = store.now().micros() / 1_000_000;
    for (sig, _, body) in &got {
        assert_eq!(signature::verify(SECRET, sig, body, now, 300), Ok(()));
    }
    // In order per job.
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for (_, seq, body) in &got {
        let v: serde_json::Value = serde_json::from_slice(body).unwrap();
        let key = v["job_id"].as_str().map(str::to_owned).unwrap_or_else(|| format!("account:{}", v["account_id"]));
        let prev = last.insert(key.clone(), *seq);
        assert!(prev.is_none_or(|p| p < *seq), "{key}: {seq} after {prev:?}");
    }
    // The first attempts failed and were retried: attempts are recorded.
    let delivered = store
        .webhooks()
        .deliveries(
            &DeliveryFilter { endpoint_id: Some("ops".into()), state: Some(settle_store::DeliveryState::Delivered) },
            0,
            1000,
        )
        .await
        .unwrap();
    assert!(delivered.rows.iter().any(|d| d.attempts > 1), "the receiver was down for the first attempts");
    // A tampered body does not verify.
    let (sig, _, body) = &got[0];
    let mut tampered = body.clone();
    let at = tampered.iter().position(|b| b.is_ascii_digit()).unwrap();
    tampered[at] = if tampered[at] == b'9' { b'8' } else { tampered[at] + 1 };
    assert_eq!(signature::verify(SECRET, sig, &tampered, now, 300), Err(SignatureError::Mismatch));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_webhooks_deliver_every_event_in_order_signed() {
    deliver_everything("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_webhooks_deliver_every_event_in_order_signed() {
    deliver_everything("postgres").await;
}

/// A receiver that never comes up: deliveries die at the cap, block their job's later events,
/// and a requeue puts them back in line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dead_deliveries_block_their_job_until_requeued() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    scenario(&store).await;
    let receiver = Arc::new(Receiver { down_for: Mutex::new(u32::MAX), ..Receiver::default() });
    let addr = serve_receiver(receiver.clone()).await;
    let mut endpoint = Endpoint::new("ops", &format!("http://{addr}/hook"), SECRET);
    endpoint.backoff = BackoffPolicy { backoff_ms_base: 1, backoff_ms_max: 2, jitter: Jitter::None };
    endpoint.attempts_max = 2;
    // Dead-lettering itself, without the breaker pausing the endpoint first.
    endpoint.breaker.failures = 0;
    endpoint.start_from = StartFrom::Beginning;
    let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
    for _ in 0..20 {
        deliverer.pass().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let filter = |state: &str| DeliveryFilter {
        endpoint_id: Some("ops".into()),
        state: Some(settle_store::DeliveryState::parse(state).expect("a delivery state")),
    };
    let dead = store.webhooks().deliveries(&filter("dead"), 0, 1000).await.unwrap().rows;
    assert!(!dead.is_empty());
    assert!(dead.iter().all(|d| d.attempts == 2 && d.last_status == Some(503)));
    let pending = store.webhooks().deliveries(&filter("pending"), 0, 1000).await.unwrap().rows;
    assert!(!pending.is_empty(), "each job has later events behind its dead head");
    assert!(pending.iter().all(|d| d.attempts == 0), "later events of a job wait behind its dead head");
    // The receiver comes up; requeue the dead ones and everything goes through.
    *receiver.down_for.lock().unwrap() = 0;
    // One call requeues them all (bounded per call), and is recorded with who made it.
    assert_eq!(store.webhooks().requeue_dead("ops", 1000, "ops-alice").await.unwrap(), dead.len() as u64);
    assert_eq!(store.webhooks().requeue_dead("ops", 1000, "ops-alice").await.unwrap(), 0);
    let actions = store.operators().actions(None, None).await.unwrap();
    assert!(
        actions.iter().any(|a| a.action == settle_store::ActionKind::WebhookRequeueDead && a.actor == "ops-alice"),
        "{actions:?}"
    );
    assert!(
        store.webhooks().requeue_one("ops", dead[0].event.seq, "system").await.is_ok(),
        "requeue of a pending one answers it"
    );
    for _ in 0..20 {
        deliverer.pass().await.unwrap();
    }
    let outbox = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows.len();
    assert_eq!(store.webhooks().deliveries(&filter("delivered"), 0, 1000).await.unwrap().rows.len(), outbox);
    assert!(matches!(
        store.webhooks().requeue_one("ops", 1, "system").await,
        Err(StoreError::InvalidTransition { .. })
    ));
    assert!(matches!(store.webhooks().requeue_one("ops", 10_000, "system").await, Err(StoreError::NotFound { .. })));
}

/// Issue 41: a job's line and an account's line never meet. A client names its job
/// `account:acme-alice` on its own account; the receiver refuses that job's event for good. Alice's
/// own account events behind it are delivered all the same (they once waited in the same line,
/// until an admin requeued another tenant's delivery).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_named_like_an_account_does_not_hold_back_its_events() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    for a in ["mallory", "acme-alice"] {
        let id = AccountId::parse(a).unwrap();
        store
            .create_account(
                NewAccount { id: id.clone(), overdraft_limit: Credits::ZERO, max_running: None },
                SYSTEM_ACTOR,
            )
            .await
            .unwrap();
        let grant = NewGrant {
            id: RefId::parse(&format!("g-{a}")).unwrap(),
            amount: Credits::new(100),
            reason: None,
            expires_at: None,
            priority: None,
        };
        store.grant(&id, grant, SYSTEM_ACTOR).await.unwrap();
    }
    let job = NewJob {
        id: JobId::parse("account:acme-alice").unwrap(),
        account_id: AccountId::parse("mallory").unwrap(),
        kind: JobKind::parse("render").unwrap(),
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(10)) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        refund_on: None,
        not_before: None,
        priority: None,
        requires: Default::default(),
    };
    store.create_job(job).await.unwrap();
    let later = NewGrant {
        id: RefId::parse("g-alice-later").unwrap(),
        amount: Credits::new(5),
        reason: None,
        expires_at: None,
        priority: None,
    };
    store.grant(&AccountId::parse("acme-alice").unwrap(), later, SYSTEM_ACTOR).await.unwrap();
    let receiver = Arc::new(Receiver::default());
    *receiver.refuse.lock().unwrap() = Some("\"job_id\":\"account:acme-alice\"".to_owned());
    let addr = serve_receiver(receiver.clone()).await;
    let mut endpoint = Endpoint::new("ops", &format!("http://{addr}/hook"), SECRET);
    endpoint.backoff = BackoffPolicy { backoff_ms_base: 1, backoff_ms_max: 2, jitter: Jitter::None };
    endpoint.attempts_max = 2;
    endpoint.breaker.failures = 0;
    endpoint.start_from = StartFrom::Beginning;
    let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
    for _ in 0..20 {
        deliverer.pass().await.unwrap();
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let got: Vec<String> =
        receiver.got.lock().unwrap().iter().map(|(_, _, b)| String::from_utf8_lossy(b).into_owned()).collect();
    assert!(got.iter().any(|b| b.contains("g-alice-later")), "alice's later grant was held back: {got:#?}");
    let filter = DeliveryFilter { endpoint_id: Some("ops".into()), state: Some(settle_store::DeliveryState::Dead) };
    let dead = store.webhooks().deliveries(&filter, 0, 1000).await.unwrap().rows;
    assert_eq!(dead.len(), 1, "only the refused job event: {dead:?}");
}

/// Issue 41: a slow receiver (0.2 s an answer) no longer caps its endpoint at one delivery in flight:
/// different lines go out together, each line still in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_receiver_gets_different_lines_at_once_each_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    scenario(&store).await;
    let receiver = Arc::new(Receiver::default());
    *receiver.delay.lock().unwrap() = Duration::from_millis(200);
    let addr = serve_receiver(receiver.clone()).await;
    let mut endpoint = Endpoint::new("ops", &format!("http://{addr}/hook"), SECRET);
    endpoint.start_from = StartFrom::Beginning;
    let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
    let started = std::time::Instant::now();
    for _ in 0..50 {
        deliverer.pass().await.unwrap();
        let filter =
            DeliveryFilter { endpoint_id: Some("ops".into()), state: Some(settle_store::DeliveryState::Pending) };
        if store.webhooks().deliveries(&filter, 0, 1000).await.unwrap().rows.is_empty() {
            break;
        }
    }
    let outbox = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    let got = receiver.got.lock().unwrap().clone();
    assert_eq!(got.len(), outbox.len(), "every event delivered");
    let max = receiver.in_flight_max.load(std::sync::atomic::Ordering::SeqCst);
    assert!(max >= 2, "one delivery at a time ({max}) for {} events in {:?}", got.len(), started.elapsed());
    // Each line (a job's events, an account's own) arrives in seq order.
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for (_, seq, body) in &got {
        let e: serde_json::Value = serde_json::from_slice(body).unwrap();
        let line = match e["job_id"].as_str() {
            Some(j) => format!("job {j}"),
            None => format!("account {}", e["account_id"].as_str().unwrap()),
        };
        let before = last.insert(line.clone(), *seq);
        assert!(before.is_none_or(|b| b < *seq), "line {line}: {seq} after {before:?}");
    }
}

#[tokio::test]
async fn an_endpoint_without_a_bounded_timeout_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    for timeout in [Duration::ZERO, Duration::from_millis(99), Duration::from_secs(61)] {
        let mut endpoint = Endpoint::new("ops", "http://127.0.0.1:9/hook", SECRET);
        endpoint.timeout = timeout;
        assert!(Deliverer::new(store.clone(), endpoint, 1).is_err(), "{timeout:?} accepted");
    }
}

/// The sender's client has its timeout and follows no redirect: a receiver that hangs is a failed
/// attempt after the timeout, and a 307 is a failed attempt whose target never hears the event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hanging_receiver_times_out_and_a_redirect_is_not_followed() {
    let target_hits = Arc::new(Mutex::new(0u32));
    let hits = target_hits.clone();
    let app = axum::Router::new()
        .route(
            "/slow",
            axum::routing::post(|| async {
                tokio::time::sleep(Duration::from_secs(30)).await;
                StatusCode::OK
            }),
        )
        .route("/moved", axum::routing::post(|| async { (StatusCode::TEMPORARY_REDIRECT, [("location", "/target")]) }))
        .route(
            "/target",
            axum::routing::post(move || {
                let hits = hits.clone();
                async move {
                    *hits.lock().unwrap() += 1;
                    StatusCode::OK
                }
            }),
        );
    let addr = serve(app).await;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    store
        .create_account(
            NewAccount { id: AccountId::parse("a").unwrap(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    for (id, path) in [("slow", "/slow"), ("moved", "/moved")] {
        let mut endpoint = Endpoint::new(id, &format!("http://{addr}{path}"), SECRET);
        endpoint.timeout = Duration::from_millis(300);
        endpoint.start_from = StartFrom::Beginning;
        let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
        tokio::time::timeout(Duration::from_secs(10), deliverer.pass()).await.expect("the pass ends").unwrap();
        let filter = DeliveryFilter { endpoint_id: Some(id.into()), state: None };
        let d = store.webhooks().deliveries(&filter, 0, 10).await.unwrap().rows;
        assert_eq!((d.len(), d[0].state.as_str(), d[0].attempts), (1, "pending", 1), "{id}: {d:?}");
        match id {
            "slow" => {
                let error = d[0].last_error.clone().unwrap_or_default();
                assert!(d[0].last_status.is_none() && error.contains("timed out"), "{id}: {d:?}");
            }
            _ => assert_eq!(d[0].last_status, Some(307), "{d:?}"),
        }
    }
    assert_eq!(*target_hits.lock().unwrap(), 0, "the redirect was not followed");
}

/// An endpoint added to a running deployment gets the events from now on, not the whole history;
/// one that asks for the beginning gets all; an endpoint that has begun keeps its place.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_new_endpoint_starts_from_now_unless_told_otherwise() {
    starts_from_now("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_new_endpoint_starts_from_now_unless_told_otherwise() {
    starts_from_now("postgres").await;
}

async fn starts_from_now(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = database(engine, &dir).await;
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    scenario(&store).await;
    let history = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows.len();
    assert!(history > 5);
    let unreachable = "http://127.0.0.1:9/hook";
    let mut beginning = Endpoint::new("all", unreachable, SECRET);
    beginning.start_from = StartFrom::Beginning;
    let now = Endpoint::new("new", unreachable, SECRET);
    assert_eq!(now.start_from, StartFrom::Now, "now is the default");
    for e in [beginning, now] {
        let d = Deliverer::new(store.clone(), e, 1).unwrap();
        d.pass().await.unwrap();
    }
    let count = |id: &str| {
        let store = store.clone();
        let filter = DeliveryFilter { endpoint_id: Some(id.into()), state: None };
        async move { store.webhooks().deliveries(&filter, 0, 1000).await.unwrap().rows.len() }
    };
    assert_eq!((count("all").await, count("new").await), (history, 0));
    store
        .create_account(
            NewAccount { id: AccountId::parse("later").unwrap(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    let mut again = Endpoint::new("new", unreachable, SECRET);
    again.start_from = StartFrom::Beginning;
    Deliverer::new(store.clone(), again, 1).unwrap().pass().await.unwrap();
    assert_eq!(count("new").await, 1, "the endpoint had begun: it continues with the new event only");
}

/// Delivered rows are pruned once past the endpoint's retention; nothing is delivered again, and
/// rows not yet delivered are kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_delivered_rows_are_pruned_after_retention() {
    pruned_after_retention("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_delivered_rows_are_pruned_after_retention() {
    pruned_after_retention("postgres").await;
}

async fn pruned_after_retention(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = database(engine, &dir).await;
    let clock = Arc::new(settle_core::FakeClock::new(settle_core::Timestamp::from_micros(1_767_225_600_000_000)));
    let options = StoreOptions { clock: clock.clone(), ..StoreOptions::default() };
    let store = Arc::new(SqlStore::open(&url, options).await.unwrap());
    scenario(&store).await;
    let receiver = Arc::new(Receiver::default());
    let addr = serve_receiver(receiver.clone()).await;
    let mut endpoint = Endpoint::new("ops", &format!("http://{addr}/hook"), SECRET);
    endpoint.start_from = StartFrom::Beginning;
    endpoint.retention = Duration::from_secs(3_600);
    let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
    let history = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows.len();
    while deliverer.pass().await.unwrap() > 0 {}
    let all = DeliveryFilter { endpoint_id: Some("ops".into()), state: None };
    assert_eq!(store.webhooks().deliveries(&all, 0, 1000).await.unwrap().rows.len(), history);
    // Inside the retention: kept. Past it: pruned, and the next pass delivers nothing again.
    clock.advance_seconds(3_599);
    deliverer.pass().await.unwrap();
    assert_eq!(store.webhooks().deliveries(&all, 0, 1000).await.unwrap().rows.len(), history);
    clock.advance_seconds(2);
    store
        .create_account(
            NewAccount { id: AccountId::parse("later").unwrap(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    deliverer.pass().await.unwrap();
    let left = store.webhooks().deliveries(&all, 0, 1000).await.unwrap().rows;
    assert_eq!(left.len(), 1, "only the new event's row: {left:?}");
    assert_eq!(left[0].event.kind, EventKind::AccountCreated);
    assert_eq!(receiver.got.lock().unwrap().len(), history + 1, "every event delivered once");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_failing_endpoint_is_paused_by_its_breaker_and_probed() {
    breaker_pauses_and_probes("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_failing_endpoint_is_paused_by_its_breaker_and_probed() {
    breaker_pauses_and_probes("postgres").await;
}

/// Sum of attempts over the endpoint's deliveries.
async fn attempts(store: &SqlStore) -> u32 {
    let all = DeliveryFilter { endpoint_id: Some("ops".into()), state: None };
    store.webhooks().deliveries(&all, 0, 1000).await.unwrap().rows.iter().map(|d| d.attempts).sum()
}

async fn breaker(store: &SqlStore) -> BreakerStatus {
    store.webhooks().breakers().await.unwrap().into_iter().find(|b| b.endpoint_id == "ops").unwrap()
}

async fn breaker_pauses_and_probes(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = database(engine, &dir).await;
    let clock = Arc::new(settle_core::FakeClock::new(settle_core::Timestamp::from_micros(1_767_225_600_000_000)));
    let options = StoreOptions { clock: clock.clone(), ..StoreOptions::default() };
    let store = Arc::new(SqlStore::open(&url, options).await.unwrap());
    scenario(&store).await;
    let receiver = Arc::new(Receiver { down_for: Mutex::new(u32::MAX), ..Receiver::default() });
    let addr = serve_receiver(receiver.clone()).await;
    let mut endpoint = Endpoint::new("ops", &format!("http://{addr}/hook"), SECRET);
    endpoint.start_from = StartFrom::Beginning;
    endpoint.backoff = BackoffPolicy { backoff_ms_base: 1, backoff_ms_max: 2, jitter: Jitter::None };
    endpoint.attempts_max = 4;
    let policy = BreakerPolicy { failures: 3, open_ms: 10_000, open_ms_max: 40_000 };
    endpoint.breaker = policy;
    let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
    let tried = || receiver.tried.lock().unwrap().len();

    // Four jobs' lines (the account's and three jobs') are due: the third failure opens the
    // breaker and the fourth head is not tried. Nothing more is sent, pass after pass.
    deliverer.pass().await.unwrap();
    assert_eq!(tried(), 3);
    assert_eq!(attempts(&store).await, 3);
    let b = breaker(&store).await;
    assert_eq!((b.state.as_str(), b.failures, b.opens), ("open", 3, 1), "{b:?}");
    assert_eq!(b.next_probe_at, Some(clock.now().plus_millis(10_000)));
    clock.advance_seconds(9);
    for _ in 0..3 {
        deliverer.pass().await.unwrap();
    }
    assert_eq!(tried(), 3, "an open breaker sends nothing before its probe is due");

    // Due: one probe. It fails: open again for twice as long, and the probed delivery keeps its
    // attempt budget (a probe tests the endpoint, not the delivery).
    clock.advance_seconds(1);
    deliverer.pass().await.unwrap();
    assert_eq!(tried(), 4);
    assert_eq!(attempts(&store).await, 3);
    let b = breaker(&store).await;
    assert_eq!((b.state.as_str(), b.opens), ("open", 2), "{b:?}");
    assert_eq!(b.next_probe_at, Some(clock.now().plus_millis(20_000)));

    // Probes rotate: each due probe takes the next delivery after the last one probed.
    let mut probed = vec![*receiver.tried.lock().unwrap().last().unwrap()];
    for pause in [20, 40, 40] {
        clock.advance_seconds(pause);
        deliverer.pass().await.unwrap();
        probed.push(*receiver.tried.lock().unwrap().last().unwrap());
    }
    assert_eq!(tried(), 7);
    assert_eq!(breaker(&store).await.opens, 5);
    assert_eq!(breaker(&store).await.next_probe_at, Some(clock.now().plus_millis(40_000)), "capped at open_ms_max");
    let distinct: std::collections::BTreeSet<i64> = probed.iter().copied().collect();
    assert!(distinct.len() >= 3, "probes rotate through the due deliveries: {probed:?}");
    let dead = DeliveryFilter { endpoint_id: Some("ops".into()), state: Some(settle_store::DeliveryState::Dead) };
    assert!(store.webhooks().deliveries(&dead, 0, 1000).await.unwrap().rows.is_empty(), "probes kill nothing");

    // Only one probe at a time, whoever asks: a second claim while it is out gets nothing; a
    // probe whose sender died (its lease lapsed) lets the next one through.
    clock.advance_seconds(40);
    let probe = store.webhooks().lease("ops", 10, 1_000, 4, policy).await.unwrap();
    assert_eq!(probe.len(), 1, "a half-open breaker lets one delivery through");
    assert_eq!(breaker(&store).await.state, settle_store::BreakerState::HalfOpen);
    assert!(store.webhooks().lease("ops", 10, 1_000, 4, policy).await.unwrap().is_empty());
    clock.advance_seconds(2);
    let next = store.webhooks().lease("ops", 10, 1_000, 4, policy).await.unwrap();
    assert_eq!(next.len(), 1, "the lapsed probe is replaced");
    // The first prober reports late: its lease was taken over, so nothing moves.
    let late =
        DeliveryReport::Failed { status: Some(503), error: "late".into(), retry_at: clock.now(), attempts_max: 4 };
    let first_token = probe[0].lease_token.clone().unwrap();
    if probe[0].event.seq != next[0].event.seq {
        // A different delivery: its own lease lapsed but was not taken over, so its report applies
        // to the delivery; the breaker is not its to move.
        store.webhooks().report("ops", probe[0].event.seq, &first_token, late.clone(), policy).await.unwrap();
    } else {
        assert!(!store.webhooks().report("ops", probe[0].event.seq, &first_token, late.clone(), policy).await.unwrap());
    }
    assert_eq!(
        breaker(&store).await.state,
        settle_store::BreakerState::HalfOpen,
        "only the current probe's report moves the breaker"
    );
    let token = next[0].lease_token.clone().unwrap();
    assert!(store.webhooks().report("ops", next[0].event.seq, &token, late, policy).await.unwrap());
    assert_eq!(breaker(&store).await.state, settle_store::BreakerState::Open);

    // The receiver comes back: the next probe succeeds, the breaker closes and everything goes.
    *receiver.down_for.lock().unwrap() = 0;
    clock.advance_seconds(40);
    while deliverer.pass().await.unwrap() > 0 {
        clock.advance_seconds(1);
    }
    let b = breaker(&store).await;
    assert_eq!((b.state.as_str(), b.failures, b.opens, b.next_probe_at), ("closed", 0, 0, None), "{b:?}");
    let outbox = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows.len();
    let delivered =
        DeliveryFilter { endpoint_id: Some("ops".into()), state: Some(settle_store::DeliveryState::Delivered) };
    assert_eq!(store.webhooks().deliveries(&delivered, 0, 1000).await.unwrap().rows.len(), outbox);
    assert_eq!(receiver.got.lock().unwrap().len(), outbox);

    // An admin may close it by hand (recorded); an unknown endpoint is 404.
    assert!(matches!(store.webhooks().close_breaker("nope", "ops-alice").await, Err(StoreError::NotFound { .. })));
    assert_eq!(
        store.webhooks().close_breaker("ops", "ops-alice").await.unwrap().state,
        settle_store::BreakerState::Closed
    );
    let actions = store.operators().actions(None, None).await.unwrap();
    assert!(
        actions.iter().any(|a| a.action == settle_store::ActionKind::WebhookCloseBreaker && a.actor == "ops-alice"),
        "{actions:?}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_deliverers_racing_on_one_endpoint_deliver_each_event_once_in_order() {
    deliverers_race("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_deliverers_racing_on_one_endpoint_deliver_each_event_once_in_order() {
    deliverers_race("postgres").await;
}

/// Four deliverers — on PostgreSQL four stores, each its own pool, as four processes would be —
/// pass over one endpoint at once: every event arrives exactly once (no lease lapses here), and in
/// order per job.
async fn deliverers_race(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = database(engine, &dir).await;
    let first = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    for round in 0..4 {
        scenario_named(&first, round).await;
    }
    let outbox = first.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    let receiver = Arc::new(Receiver::default());
    let addr = serve_receiver(receiver.clone()).await;
    let done = tokio_util::sync::CancellationToken::new();
    let mut handles = Vec::new();
    for n in 0..4u64 {
        let store = match engine {
            "sqlite" => first.clone(),
            _ => Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap()),
        };
        // One endpoint; each deliverer's URL says which one sent.
        let mut endpoint = Endpoint::new("ops", &format!("http://{addr}/hook?d={n}"), SECRET);
        endpoint.start_from = StartFrom::Beginning;
        let deliverer = Deliverer::new(store, endpoint, n).unwrap();
        let done = done.clone();
        handles.push(tokio::spawn(async move {
            while !done.is_cancelled() {
                deliverer.pass().await.unwrap();
                tokio::task::yield_now().await;
            }
        }));
    }
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while receiver.got.lock().unwrap().len() < outbox.len() {
        assert!(std::time::Instant::now() < deadline, "not every event was delivered");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Every pass in flight finishes before the count is read, so a duplicate send would show.
    done.cancel();
    for h in handles {
        h.await.unwrap();
    }
    let got: Vec<i64> = receiver.got.lock().unwrap().iter().map(|(_, seq, _)| *seq).collect();
    let mut sorted = got.clone();
    sorted.sort();
    assert_eq!(sorted, outbox.iter().map(|e| e.seq).collect::<Vec<_>>(), "each event exactly once");
    // In order per job: for every job, the seqs arrived in increasing order.
    let key = |seq: i64| {
        let e = outbox.iter().find(|e| e.seq == seq).unwrap();
        e.job_id.clone().unwrap_or_else(|| format!("account:{}", e.account_id))
    };
    let mut last: BTreeMap<String, i64> = BTreeMap::new();
    for seq in got {
        let k = key(seq);
        assert!(last.get(&k).is_none_or(|prev| *prev < seq), "{k}: {seq} arrived after a later event");
        last.insert(k, seq);
    }
    assert!(last.len() > 4, "several jobs' lines were delivered: {last:?}");
    let senders = receiver.senders.lock().unwrap().clone();
    assert!(senders.len() >= 2, "the deliverers really raced: only {senders:?} sent");
}

/// `scenario` on account `a{round}` with jobs `r{round}-j{n}`.
async fn scenario_named(store: &SqlStore, round: u32) {
    let a = AccountId::parse(&format!("a{round}")).unwrap();
    store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    let grant = NewGrant {
        id: RefId::parse(&format!("g{round}")).unwrap(),
        amount: Credits::new(100),
        reason: None,
        expires_at: None,
        priority: None,
    };
    store.grant(&a, grant, settle_store::SYSTEM_ACTOR).await.unwrap();
    for n in 0..3 {
        let id = JobId::parse(&format!("r{round}-j{n}")).unwrap();
        let req = NewJob {
            id: id.clone(),
            account_id: a.clone(),
            kind: JobKind::parse("render").unwrap(),
            items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(10)) }],
            payload: serde_json::Value::Null,
            max_attempts: None,
            refund_on: None,
            not_before: None,
            priority: None,
            requires: Default::default(),
        };
        store.create_job(req).await.unwrap();
        store.cancel(&id, None).await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_lapsed_lease_is_sent_again_and_counts_toward_the_cap() {
    lapsed_leases("sqlite").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_lapsed_lease_is_sent_again_and_counts_toward_the_cap() {
    lapsed_leases("postgres").await;
}

/// A sender that dies mid-send (claims, never reports): once its lease lapses the delivery is
/// claimed again (sent again — at least once), the dead sender's late report changes nothing, and
/// a delivery whose senders keep dying reaches the attempt cap and goes dead.
async fn lapsed_leases(engine: &str) {
    let dir = tempfile::tempdir().unwrap();
    let url = database(engine, &dir).await;
    let clock = Arc::new(settle_core::FakeClock::new(settle_core::Timestamp::from_micros(1_767_225_600_000_000)));
    let store = SqlStore::open(&url, StoreOptions { clock: clock.clone(), ..StoreOptions::default() }).await.unwrap();
    store
        .create_account(
            NewAccount { id: AccountId::parse("a").unwrap(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    store.webhooks().start("ops", StartFrom::Beginning).await.unwrap();
    store.webhooks().fan_out("ops", 100).await.unwrap();
    let no_breaker = BreakerPolicy { failures: 0, ..BreakerPolicy::default() };
    let claim = || store.webhooks().lease("ops", 1, 1_000, 2, no_breaker);
    let first = claim().await.unwrap();
    assert_eq!((first.len(), first[0].attempts), (1, 1));
    assert!(claim().await.unwrap().is_empty(), "leased: nobody else sends it");
    clock.advance_seconds(2);
    let second = claim().await.unwrap();
    assert_eq!((second.len(), second[0].event.seq, second[0].attempts), (1, first[0].event.seq, 2), "sent again");
    let late = DeliveryReport::Delivered { status: 200 };
    let stale = first[0].lease_token.clone().unwrap();
    assert!(!store.webhooks().report("ops", first[0].event.seq, &stale, late, no_breaker).await.unwrap());
    // The second sender dies too: the cap (2) is reached through lapsed leases alone.
    clock.advance_seconds(2);
    assert!(claim().await.unwrap().is_empty());
    let dead = DeliveryFilter { endpoint_id: Some("ops".into()), state: Some(settle_store::DeliveryState::Dead) };
    let dead = store.webhooks().deliveries(&dead, 0, 100).await.unwrap().rows;
    assert_eq!(dead.len(), 1);
    assert_eq!((dead[0].attempts, dead[0].last_error.as_deref()), (2, Some("the sender stopped mid-send")));
}

/// Issue 19, item 5: a failed send's error names what went wrong, never the URL (reqwest's error
/// text carries it, credentials and all), since `last_error` is shown to client-role readers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_send_never_records_the_url_or_its_credentials() {
    // A port nothing listens on: bind one, then let it go.
    let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    store
        .create_account(
            NewAccount { id: AccountId::parse("a").unwrap(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    let target = format!("http://hook-user:hook-password-42@{free}/secret-path?key=query-secret");
    let mut endpoint = Endpoint::new("ops", &target, SECRET);
    endpoint.start_from = StartFrom::Beginning;
    let deliverer = Deliverer::new(store.clone(), endpoint, 1).unwrap();
    tokio::time::timeout(Duration::from_secs(10), deliverer.pass()).await.expect("the pass ends").unwrap();
    let filter = DeliveryFilter { endpoint_id: Some("ops".into()), state: None };
    let d = store.webhooks().deliveries(&filter, 0, 10).await.unwrap().rows;
    let error = d[0].last_error.clone().unwrap_or_default();
    assert!(error.starts_with("send failed") && !error.is_empty(), "{error}");
    for secret in ["hook-password-42", "hook-user", "secret-path", "query-secret", &free.port().to_string()] {
        assert!(!error.contains(secret), "{secret:?} in {error:?}");
    }
}

/// Issue 19, item 15: link-local and cloud-metadata targets are refused unless the endpoint opts
/// in by name; the resolver drops such addresses for names too.
#[tokio::test]
async fn link_local_and_metadata_targets_are_refused_unless_allowed() {
    use settle_worker::webhooks::{check_target, is_metadata_or_link_local};
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    for target in [
        "http://169.254.169.254/latest/meta-data/",
        "http://169.254.0.1:8080/hook",
        "http://[fe80::1]/hook",
        "http://[fd00:ec2::254]/hook",
        "http://[::ffff:169.254.169.254]/hook",
        "http://100.100.100.200/hook",
        "http://metadata.google.internal/computeMetadata/v1/",
        "http://METADATA.google.internal./x",
    ] {
        assert!(check_target(target, false).is_err(), "{target}");
        let endpoint = Endpoint::new("ops", target, SECRET);
        let refused = Deliverer::new(store.clone(), endpoint, 1).err().unwrap_or_default();
        assert!(refused.contains("link-local"), "{target}: {refused}");
        let mut allowed = Endpoint::new("ops", target, SECRET);
        allowed.allow_link_local = true;
        assert!(Deliverer::new(store.clone(), allowed, 1).is_ok(), "{target} opted in");
    }
    for fine in ["http://127.0.0.1:9/hook", "https://hooks.example.test/settle", "http://10.0.0.7/hook"] {
        assert!(check_target(fine, false).is_ok(), "{fine}");
    }
    assert!(check_target("ftp://example.test/", true).is_err());
    for (ip, forbidden) in [
        ("169.254.169.254", true),
        ("169.254.255.255", true),
        ("fe80::abcd", true),
        ("febf::1", true),
        ("fec0::1", false),
        ("169.253.255.255", false),
        ("127.0.0.1", false),
        ("8.8.8.8", false),
    ] {
        assert_eq!(is_metadata_or_link_local(ip.parse().unwrap()), forbidden, "{ip}");
    }
}
