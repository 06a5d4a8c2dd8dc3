//! Slow and idle clients, tried as a slowloris would: half a request head per connection. The
//! server closes such connections once the header-read timeout passes, keeps answering `/healthz`
//! meanwhile, and closes connections past its cap at once.

use settle_api::{Application, HttpLimits, Tokens};
use settle_store::{SqlStore, Store, StoreOptions};
use std::sync::Arc;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

async fn start(limits: HttpLimits) -> (String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("limits.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    let app = Application::build_with("127.0.0.1:0", store as Arc<dyn Store>, Tokens::default(), limits).await.unwrap();
    let addr = app.local_addr().to_string();
    tokio::spawn(app.run_until(std::future::pending()));
    (addr, dir)
}

/// Half a request head: the request line and one header, never the blank line that ends it.
async fn half_head(addr: &str) -> TcpStream {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.write_all(b"POST /v1/jobs HTTP/1.1\r\nHost: x\r\n").await.unwrap();
    s
}

/// Whether the server closed the connection before `deadline` (a read of 0 bytes or an error).
async fn closed_within(s: &mut TcpStream, deadline: Duration) -> bool {
    let mut buf = [0u8; 512];
    match tokio::time::timeout(deadline, s.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => true,
        // Anything the server says first (a 408) is fine; then it must close.
        Ok(Ok(_)) => matches!(tokio::time::timeout(deadline, s.read(&mut buf)).await, Ok(Ok(0)) | Ok(Err(_))),
        Err(_) => false,
    }
}

async fn healthz(addr: &str) -> u16 {
    reqwest::get(format!("http://{addr}/healthz")).await.map(|r| r.status().as_u16()).unwrap_or(0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_sent_heads_are_closed_while_healthz_answers() {
    let limits = HttpLimits { header_read_timeout: Duration::from_millis(500), ..HttpLimits::default() };
    let (addr, _dir) = start(limits).await;
    let mut slow = Vec::new();
    for _ in 0..50 {
        slow.push(half_head(&addr).await);
    }
    assert_eq!(healthz(&addr).await, 200, "the server still answers beside 50 slow clients");
    for (n, s) in slow.iter_mut().enumerate() {
        assert!(closed_within(s, Duration::from_secs(10)).await, "slow connection {n} is still open");
    }
    assert_eq!(healthz(&addr).await, 200);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_past_the_cap_are_closed_at_once() {
    let limits =
        HttpLimits { header_read_timeout: Duration::from_secs(30), max_connections: 5, ..HttpLimits::default() };
    let (addr, _dir) = start(limits).await;
    let mut held = Vec::new();
    for _ in 0..5 {
        held.push(half_head(&addr).await);
    }
    // The sixth gets no answer: it is closed as soon as it is accepted.
    let mut extra = TcpStream::connect(&addr).await.unwrap();
    let _ = extra.write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n").await;
    let mut buf = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), extra.read_to_end(&mut buf)).await;
    assert!(read.is_ok(), "the extra connection was not closed");
    assert!(buf.is_empty(), "the extra connection was answered: {}", String::from_utf8_lossy(&buf));
    // One slow client leaves: its place is free again.
    drop(held.pop());
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    while healthz(&addr).await != 200 {
        assert!(tokio::time::Instant::now() < deadline, "no room after a connection closed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn tokens() -> Tokens {
    let mut t = Tokens::default();
    t.add(settle_api::Role::Admin, "admin-token-0123456789").unwrap();
    t.add(settle_api::Role::Client, "client-token-0123456789").unwrap();
    t.add(settle_api::Role::Worker, "worker-token-0123456789").unwrap();
    t
}

async fn start_with_tokens(limits: HttpLimits) -> (String, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("limits.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    let app = Application::build_with("127.0.0.1:0", store as Arc<dyn Store>, tokens(), limits).await.unwrap();
    let addr = app.local_addr().to_string();
    tokio::spawn(app.run_until(std::future::pending()));
    (addr, dir)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_token_has_its_own_request_rate() {
    let abuse = settle_api::AbuseLimits { requests_per_second: 2.0, burst: 5.0, long_polls: 4 };
    let (addr, _dir) = start_with_tokens(HttpLimits { abuse, ..HttpLimits::default() }).await;
    let http = reqwest::Client::new();
    let get = |token: &'static str| {
        let http = http.clone();
        let url = format!("http://{addr}/v1/failures/summary");
        async move { http.get(url).bearer_auth(token).send().await.unwrap() }
    };
    let mut limited = None;
    for _ in 0..12 {
        let r = get("client-token-0123456789").await;
        if r.status() == 429 {
            limited = Some(r);
            break;
        }
        assert_eq!(r.status(), 200);
    }
    let r = limited.expect("the client token was never limited");
    assert!(r.headers().get("retry-after").is_some());
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "rate_limited");
    assert_eq!(get("admin-token-0123456789").await.status(), 200, "another token is not limited by it");
    for _ in 0..20 {
        assert_eq!(healthz(&addr).await, 200, "probes are never limited");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_token_past_its_long_polls_is_answered_at_once() {
    let abuse = settle_api::AbuseLimits { requests_per_second: 0.0, burst: 1.0, long_polls: 1 };
    let (addr, _dir) = start_with_tokens(HttpLimits { abuse, ..HttpLimits::default() }).await;
    let http = reqwest::Client::new();
    let claim = |http: reqwest::Client| {
        let url = format!("http://{addr}/v1/claims");
        async move {
            http.post(url)
                .bearer_auth("worker-token-0123456789")
                .json(&serde_json::json!({"worker": "w", "wait_seconds": 20}))
                .send()
                .await
                .unwrap()
                .status()
        }
    };
    // Two long-polls of one token with one place: whichever comes second is answered at once,
    // while the other waits.
    let mut a = tokio::spawn(claim(http.clone()));
    let mut b = tokio::spawn(claim(http.clone()));
    let (done, mut waiting) = tokio::select! {
        r = &mut a => (r, b),
        r = &mut b => (r, a),
        _ = tokio::time::sleep(Duration::from_secs(15)) => panic!("neither long-poll was answered at once"),
    };
    assert_eq!(done.unwrap(), 200);
    assert!(tokio::time::timeout(Duration::from_millis(200), &mut waiting).await.is_err(), "the other still waits");
    let metrics = http.get(format!("http://{addr}/metrics")).send().await.unwrap().text().await.unwrap();
    assert!(metrics.contains("settle_http_long_polls_refused_total"), "{metrics}");
    waiting.abort();
}
