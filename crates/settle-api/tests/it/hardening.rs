//! Issue 19 (hardening II): what an attacker with a browser, a client token or a proxy could do,
//! each reproduced from outside over real HTTP and refused or bounded.

use crate::kit::*;
use serde_json::json;
use settle_api::{Role, Tokens};
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

on_both_engines!(
    dot_ids_are_refused_everywhere,
    a_rerouted_dot_segment_reaches_no_route,
    loopback_mode_answers_loopback_hosts_only,
    list_pages_have_a_byte_budget,
    withdrawals_are_refused_on_the_overdraft,
);

/// A request written by hand, so no URL client removes its dot segments; the status it got.
async fn raw(base: &str, head: &str) -> (u16, String) {
    let addr = base.trim_start_matches("http://");
    let mut s = tokio::net::TcpStream::connect(addr).await.unwrap();
    s.write_all(head.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    let _ = tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer)).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, text)
}

async fn dot_ids_are_refused_everywhere(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    for dots in [".", ".."] {
        for (path, body) in [
            ("/v1/accounts", json!({"id": dots})),
            ("/v1/accounts/a/grants", json!({"id": dots, "amount": 1})),
            ("/v1/accounts/a/adjustments", json!({"id": dots, "amount": 1, "reason": "x"})),
            ("/v1/jobs", json!({"id": dots, "account_id": "a", "kind": "render", "cost": 1})),
            ("/v1/jobs", json!({"id": "j", "account_id": "a", "kind": dots, "cost": 1})),
            (
                "/v1/jobs",
                json!({"id": "j", "account_id": "a", "kind": "render", "items": [{"id": dots, "cost": 1}, {"id": "b", "cost": 1}]}),
            ),
            ("/v1/withdrawals", json!({"id": dots, "account_id": "a", "amount": 1, "destination": "x"})),
        ] {
            let r = s.post(path, body.clone()).await;
            assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{path} {body}");
            assert!(r.body["error"]["message"].as_str().unwrap().contains("'..'"), "{}", r.body);
        }
    }
    assert_eq!(s.balance("a").await, 100, "nothing was written");
    assert_eq!(s.get("/v1/jobs").await.body["jobs"].as_array().unwrap().len(), 0);
    // Names with dots that are not whole segments stay valid ids.
    for fine in ["...", ".a", "a..b"] {
        let r = s.post("/v1/jobs", json!({"id": fine, "account_id": "a", "kind": "render", "cost": 1})).await;
        assert_eq!(r.status, 201, "{fine}: {}", r.body);
    }
}

/// What a browser, Node or reqwest would send for `items/../succeed`, and what a raw request
/// carrying the dots gets: with the old rule the first succeeded the whole job.
async fn a_rerouted_dot_segment_reaches_no_route(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    let r = s.post("/v1/jobs", json!({"id": "j", "account_id": "a", "kind": "render", "items": [{"id": "x", "cost": 10}, {"id": "y", "cost": 10}]})).await;
    assert_eq!(r.status, 201);
    let (_, token) = s.claim().await;
    // Every WHATWG-style parser removes the segment: this is why the id must not exist.
    let url = reqwest::Url::parse(&format!("{}/v1/jobs/j/items/../succeed", s.base)).unwrap();
    assert_eq!(url.path(), "/v1/jobs/j/succeed");
    let url = reqwest::Url::parse(&format!("{}/v1/jobs/j/items/%2e%2e/succeed", s.base)).unwrap();
    assert_eq!(url.path(), "/v1/jobs/j/succeed", "percent-encoded dots are removed too");
    // Sent as is, the dots name an item, and `..` is no item id.
    let body = format!(r#"{{"lease_token":"{token}"}}"#);
    for path in ["/v1/jobs/j/items/../succeed", "/v1/jobs/j/items/%2e%2e/succeed", "/v1/jobs/j/items/./fail"] {
        let head = format!(
            "POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        let (status, text) = raw(&s.base, &head).await;
        assert_eq!(status, 400, "{path}: {text}");
    }
    let job = s.get("/v1/jobs/j").await.body;
    assert_eq!(job["state"], "running", "{job}");
    assert!(job["items"].as_array().unwrap().iter().all(|i| i["state"] == "charged"), "{job}");
}

/// DNS rebinding: a page on `attacker.example` resolving to 127.0.0.1 reaches the loopback server
/// with its own name in `Host`. Without tokens, only loopback names are answered, on every route.
async fn loopback_mode_answers_loopback_hosts_only(e: Engine) {
    let s = Server::start(e).await;
    let port = s.base.rsplit(':').next().unwrap().to_owned();
    let http = reqwest::Client::builder().redirect(reqwest::redirect::Policy::none()).build().unwrap();
    for host in [
        format!("attacker.example:{port}"),
        "attacker.example".to_owned(),
        format!("127.attacker.example:{port}"),
        format!("127.0.0.1.nip.io:{port}"),
        format!("localhost.attacker.example:{port}"),
        format!("10.1.2.3:{port}"),
    ] {
        let r = http
            .post(format!("{}/v1/accounts", s.base))
            .header("host", &host)
            .json(&json!({"id": "mallory"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{host}");
        let body: serde_json::Value = r.json().await.unwrap();
        assert_eq!(body["error"]["code"], "forbidden", "{host}");
        for path in ["/console", "/v1/audit", "/openapi.json", "/docs"] {
            let r = http.get(format!("{}{path}", s.base)).header("host", &host).send().await.unwrap();
            assert_eq!(r.status(), 403, "{host} {path}");
        }
        let r = http
            .post(format!("{}/v1/withdrawals", s.base))
            .header("host", &host)
            .json(&json!({"id": "w", "account_id": "mallory", "amount": 1, "destination": "attacker-wallet"}))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{host}");
    }
    assert_eq!(s.get("/v1/accounts/mallory").await.status, 404, "nothing was created");
    // A page elsewhere posting a form to the loopback address (its Host is loopback): refused.
    s.account("acme", 100).await;
    s.job("j1", "acme", 10).await;
    for (header, value) in [
        ("origin", "http://attacker.example".to_owned()),
        ("origin", "null".to_owned()),
        ("sec-fetch-site", "cross-site".to_owned()),
        ("sec-fetch-site", "same-site".to_owned()),
    ] {
        let r = http.post(format!("{}/v1/jobs/j1/cancel", s.base)).header(header, &value).send().await.unwrap();
        assert_eq!(r.status(), 403, "{header}: {value}");
    }
    assert_eq!(s.get("/v1/jobs/j1").await.body["state"], "queued");
    let own = format!("http://127.0.0.1:{port}");
    let r = http.post(format!("{}/v1/jobs/j1/cancel", s.base)).header("origin", own).send().await.unwrap();
    assert_eq!(r.status(), 200, "a page of this server may");
    assert_eq!(s.get("/v1/jobs/j1").await.body["state"], "cancelled");
    for host in [format!("127.0.0.1:{port}"), format!("localhost:{port}"), format!("[::1]:{port}"), "127.0.0.1".into()]
    {
        let r = http.get(format!("{}/v1/jobs", s.base)).header("host", &host).send().await.unwrap();
        assert_eq!(r.status(), 200, "{host}");
        let r = http.get(format!("{}/console", s.base)).header("host", &host).send().await.unwrap();
        assert_eq!(r.status(), 200, "{host}");
    }
    // With tokens the Host rule does not apply (the tokens are the defence), so a proxy's name works.
    let mut tokens = Tokens::default();
    tokens.add_named(Role::Admin, "admin-token-for-host-tests", "ops").unwrap();
    let t = Server::with_tokens(e, tokens).await;
    let r = http
        .get(format!("{}/v1/jobs", t.base))
        .header("host", "settle.internal.example")
        .bearer_auth("admin-token-for-host-tests")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
}

/// 150 jobs of 1,000 zero-cost items and 256 KiB payloads: `limit=1000` answered 54.8 MB before.
async fn list_pages_have_a_byte_budget(e: Engine) {
    use settle_core::limits::{
        ITEM_BYTES_ESTIMATE, JOB_BYTES_OVERHEAD, JOB_ITEMS_MAX, PAGE_BYTES_MAX, PAYLOAD_BYTES_MAX,
    };
    let s = Server::start(e).await;
    s.account("fat", 0).await;
    let payload = json!({ "blob": "p".repeat(PAYLOAD_BYTES_MAX - 64) });
    let items: Vec<serde_json::Value> =
        (0..JOB_ITEMS_MAX).map(|i| json!({"id": format!("item-{i:04}"), "cost": 0})).collect();
    let jobs = 150;
    for n in 0..jobs {
        let r = s
            .post(
                "/v1/jobs",
                json!({"id": format!("fat-{n:03}"), "account_id": "fat", "kind": "render", "items": items, "payload": payload}),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    // One job's answer, at most: what a page may exceed its budget by.
    let one = s.get("/v1/jobs/fat-000").await.body.to_string().len();
    let estimate =
        (PAYLOAD_BYTES_MAX as i64 + JOB_ITEMS_MAX as i64 * ITEM_BYTES_ESTIMATE + JOB_BYTES_OVERHEAD) as usize;
    assert!(one <= estimate, "the estimate covers a job's answer: {one} > {estimate}");
    let mut seen = Vec::new();
    let mut after = 0;
    let mut pages = 0;
    loop {
        let r = s.http.get(format!("{}/v1/jobs?limit=1000&after={after}", s.base)).send().await.unwrap();
        assert_eq!(r.status(), 200);
        let bytes = r.bytes().await.unwrap();
        assert!(bytes.len() <= PAGE_BYTES_MAX as usize + one, "a page of {} bytes", bytes.len());
        let page: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        let rows = page["jobs"].as_array().unwrap();
        assert!(!rows.is_empty() || page["next_after"].is_null());
        seen.extend(rows.iter().map(|j| j["id"].as_str().unwrap().to_owned()));
        pages += 1;
        match page["next_after"].as_i64() {
            Some(next) => after = next,
            None => break,
        }
    }
    let expected: Vec<String> = (0..jobs).map(|n| format!("fat-{n:03}")).collect();
    assert_eq!(seen, expected, "every job once, in order, across the pages");
    assert!(pages > 10, "{pages} pages");
    // Small jobs still come 1,000 to a page.
    s.account("thin", 0).await;
    for n in 0..3 {
        s.job(&format!("thin-{n}"), "thin", 0).await;
    }
    let r = s.get("/v1/jobs?account_id=thin&limit=1000").await;
    assert_eq!((r.body["jobs"].as_array().unwrap().len(), r.body["next_after"].is_null()), (3, true));
}

async fn withdrawals_are_refused_on_the_overdraft(e: Engine) {
    let s = Server::start(e).await;
    assert_eq!(s.post("/v1/accounts", json!({"id": "od", "overdraft_limit": 500})).await.status, 201);
    let r = s
        .post(
            "/v1/withdrawals",
            json!({"id": "w1", "account_id": "od", "amount": 500, "destination": "attacker-wallet"}),
        )
        .await;
    assert_eq!((r.status, code(&r)), (402, "insufficient_credits"), "{}", r.body);
    assert!(r.body["error"]["message"].as_str().unwrap().contains("never draws on the overdraft"), "{}", r.body);
    assert_eq!(s.get("/v1/withdrawals/w1").await.status, 404);
    assert_eq!(s.balance("od").await, 0);
    // Work may still use it.
    s.job("work", "od", 500).await;
    assert_eq!(s.balance("od").await, -500);
}

/// Issue 19, item 8: a peer holding half-sent heads fills only its own share of the connections.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_peer_cannot_take_every_connection() {
    let limits = settle_api::HttpLimits {
        header_read_timeout: Duration::from_secs(30),
        max_connections: 20,
        max_connections_per_peer: 5,
        ..settle_api::HttpLimits::default()
    };
    let s = Server::with_limits(Engine::Sqlite, Tokens::default(), |_| {}, limits).await;
    let addr: std::net::SocketAddr = s.base.trim_start_matches("http://").parse().unwrap();
    let connect_from = |source: [u8; 4]| async move {
        let socket = tokio::net::TcpSocket::new_v4().unwrap();
        socket.bind(std::net::SocketAddr::from((source, 0))).unwrap();
        socket.connect(addr).await.unwrap()
    };
    // 20 half heads from one address: 5 are held, the others closed at once.
    let mut held = Vec::new();
    for _ in 0..20 {
        let mut c = connect_from([127, 0, 0, 1]).await;
        let _ = c.write_all(b"POST /v1/jobs HTTP/1.1\r\nHost: 127.0.0.1\r\n").await;
        held.push(c);
    }
    let mut closed = 0;
    for c in held.iter_mut() {
        let mut buf = [0u8; 64];
        if let Ok(Ok(0) | Err(_)) = tokio::time::timeout(Duration::from_millis(500), c.read(&mut buf)).await {
            closed += 1;
        }
    }
    assert_eq!(closed, 15, "past its share, a peer's connections are closed");
    // Another peer (an operator) still gets in.
    let mut admin = connect_from([127, 0, 0, 2]).await;
    admin.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), admin.read_to_end(&mut answer)).await.unwrap().unwrap();
    assert!(String::from_utf8_lossy(&answer).starts_with("HTTP/1.1 200"), "{}", String::from_utf8_lossy(&answer));
}

const ADMIN: &str = "admin-token-for-hardening-tests";
const CLIENT: &str = "client-token-for-hardening-tests";

fn tokens() -> Tokens {
    let mut tokens = Tokens::default();
    tokens.add_named(Role::Admin, ADMIN, "ops").unwrap();
    tokens.add_named(Role::Client, CLIENT, "support").unwrap();
    tokens
}

fn browser() -> reqwest::Client {
    reqwest::Client::builder().cookie_store(true).redirect(reqwest::redirect::Policy::none()).build().unwrap()
}

/// Issue 19, item 7: cheap 401s cannot lock an operator out of signing in; sessions of one token
/// share that token's bucket; the limiter keeps one bucket per token, however many sign-ins.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limits_keep_their_buckets_apart() {
    let limits = settle_api::HttpLimits {
        abuse: settle_api::AbuseLimits { requests_per_second: 0.001, burst: 10.0, long_polls: 4 },
        ..settle_api::HttpLimits::default()
    };
    let s = Server::with_limits(Engine::Sqlite, tokens(), |_| {}, limits).await;
    // An attacker empties the anonymous bucket with bad tokens and bad sign-ins.
    let mut limited = 0;
    for n in 0..30 {
        let r = s.send("GET", "/v1/jobs", None, Some(&format!("wrong-token-{n:016}"))).await;
        limited += u32::from(r.status == 429);
    }
    assert!(limited >= 20, "{limited}");
    let r = reqwest::Client::new().post(format!("{}/console/login", s.base)).form(&[("token", "guess")]).send().await;
    assert_eq!(r.unwrap().status(), 429, "guesses stay limited");
    for path in ["/console/login", "/console/assets/console.css"] {
        let r = reqwest::get(format!("{}{path}", s.base)).await.unwrap();
        assert_eq!(r.status(), 200, "{path} is never limited");
    }
    // The operator still signs in, twice (two browsers).
    let (a, b) = (browser(), browser());
    for br in [&a, &b] {
        let r = br.post(format!("{}/console/login", s.base)).form(&[("token", ADMIN)]).send().await.unwrap();
        assert_eq!(r.status(), 303, "a valid token signs in whatever the anonymous bucket holds");
    }
    // The two sessions and the token's API calls share one bucket of 10: two sign-ins took 2.
    let mut ok = 2;
    for n in 0..20 {
        let status = match n % 3 {
            0 => a.get(format!("{}/console/jobs", s.base)).send().await.unwrap().status().as_u16(),
            1 => b.get(format!("{}/console/jobs", s.base)).send().await.unwrap().status().as_u16(),
            _ => s.send("GET", "/v1/jobs", None, Some(ADMIN)).await.status,
        };
        ok += u32::from(status == 200);
    }
    assert_eq!(ok, 10, "one bucket for the token, not one per session");
    // The client token's bucket is untouched.
    assert_eq!(s.send("GET", "/v1/jobs", None, Some(CLIENT)).await.status, 200);
    let metrics = s.get("/metrics").await.body.as_str().unwrap().to_owned();
    let buckets = metrics
        .lines()
        .find_map(|l| l.strip_prefix("settle_http_rate_buckets "))
        .and_then(|v| v.trim().parse::<f64>().ok())
        .expect("the bucket gauge");
    assert!(buckets <= 3.0, "two tokens and the anonymous bucket, not one per sign-in: {buckets}");
}

/// Issue 19, item 11: `/metrics` needs no token, so its whole-table aggregates are read at most
/// once per refresh period, however often it is scraped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_read_the_store_at_most_once_per_refresh() {
    let s = Server::start(Engine::Sqlite).await;
    let reads = |text: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix("settle_metrics_store_reads_total "))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .unwrap_or(0.0)
    };
    let scrapes: Vec<_> = (0..40).map(|_| s.get("/metrics")).collect();
    for r in futures_util::future::join_all(scrapes).await {
        assert_eq!(r.status, 200);
    }
    let text = s.get("/metrics").await.body.as_str().unwrap().to_owned();
    assert!(reads(&text) >= 1.0 && reads(&text) <= 2.0, "41 scrapes read the store {} times", reads(&text));
    assert!(text.contains("settle_jobs{state=\"queued\"} 0"), "{text}");
}

/// Issue 19, items 3 and 13: the console's Origin check includes the scheme; two live sessions in
/// one request trust neither; pages cannot be framed by old browsers either.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn console_origin_cookies_and_framing() {
    let s = Server::with_tokens(Engine::Sqlite, tokens()).await;
    s.send("POST", "/v1/accounts", Some(json!({"id": "acme"})), Some(ADMIN)).await;
    let b = browser();
    let r = b.post(format!("{}/console/login", s.base)).form(&[("token", ADMIN)]).send().await.unwrap();
    assert_eq!(r.status(), 303);
    let r = b.get(format!("{}/console", s.base)).send().await.unwrap();
    assert_eq!(r.headers().get("x-frame-options").map(|v| v.to_str().unwrap()), Some("DENY"));
    let html = r.text().await.unwrap();
    let marker = r#"name="csrf" value=""#;
    let csrf = html[html.find(marker).unwrap() + marker.len()..].split('"').next().unwrap().to_owned();
    let host = s.base.trim_start_matches("http://").to_owned();
    let audit = format!("{}/console/audit", s.base);
    let post = |origin: String| b.post(&audit).header("origin", origin).form(&[("csrf", csrf.as_str())]).send();
    assert_eq!(post(format!("https://{host}")).await.unwrap().status(), 403, "another scheme is another origin");
    assert_eq!(post(format!("http://{host}")).await.unwrap().status(), 200, "this origin");
    // A cookie planted on a more specific path (a client token's own session) comes first.
    let planted = sign_in_cookie(&s, CLIENT).await;
    let mine = sign_in_cookie(&s, ADMIN).await;
    let both = format!("settle_console={planted}; settle_console={mine}");
    let r = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .get(format!("{}/console/jobs", s.base))
        .header("cookie", both)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 303, "two live sessions: neither is used");
    assert_eq!(r.headers()["location"], "/console/login");
    let r = reqwest::Client::new()
        .get(format!("{}/console/jobs", s.base))
        .header("cookie", format!("settle_console={mine}; settle_console={mine}"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "the same session twice is still that session");
}

/// A new session's cookie value, from the sign-in's `Set-Cookie`.
async fn sign_in_cookie(s: &Server, token: &str) -> String {
    let r = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .build()
        .unwrap()
        .post(format!("{}/console/login", s.base))
        .form(&[("token", token)])
        .send()
        .await
        .unwrap();
    let set = r.headers()["set-cookie"].to_str().unwrap().to_owned();
    set.trim_start_matches("settle_console=").split(';').next().unwrap().to_owned()
}

/// Makes every queued withdrawal unknown through the payout processor's door (claimed, send
/// marked, no answer).
async fn unknown_withdrawals(store: &dyn settle_store::Store) {
    let worker = settle_core::ids::WorkerName::parse("payouts").unwrap();
    for c in store.payouts().claim_payouts(&worker, 10).await.unwrap() {
        let job = &c.job.id;
        store.payouts().payout_heartbeat(job, &c.lease_token).await.unwrap();
        store.payouts().payout_unknown(job, &c.lease_token, Some("no answer")).await.unwrap();
    }
}

/// Issue 19, item 15: an admin records the outcome of an unknown withdrawal whose provider is
/// gone; a client cannot, bad bodies write nothing, and a server with a provider refuses.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_resolves_an_unknown_withdrawal_when_no_provider_can_answer() {
    let mut s = Server::with_tokens(Engine::Sqlite, tokens()).await;
    s.token = Some(ADMIN.to_owned());
    s.account("acme", 100).await;
    for id in ["w1", "w2"] {
        let r = s
            .post("/v1/withdrawals", json!({"id": id, "account_id": "acme", "amount": 10, "destination": "DE89"}))
            .await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let store = s.store_handle();
    unknown_withdrawals(&*store).await;
    let r = s
        .send(
            "POST",
            "/v1/withdrawals/w1/resolve",
            Some(json!({"outcome": "not_sent", "reason": "statement"})),
            Some(CLIENT),
        )
        .await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    for bad in [
        json!({"outcome": "sent", "reason": "x"}),
        json!({"outcome": "not_sent", "provider_txid": "tx", "reason": "x"}),
        json!({"outcome": "maybe", "reason": "x"}),
        json!({"outcome": "not_sent"}),
        json!({"outcome": "not_sent", "reason": ""}),
        json!({"outcome": "not_sent", "reason": "x", "force": true}),
    ] {
        let r = s.post("/v1/withdrawals/w1/resolve", bad.clone()).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{bad}");
    }
    assert_eq!(s.get("/v1/withdrawals/w1").await.body["state"], "unknown");
    let r = s
        .post("/v1/withdrawals/w1/resolve", json!({"outcome": "sent", "provider_txid": "tx-1", "reason": "dashboard"}))
        .await;
    assert_eq!(
        (r.status, r.body["state"].as_str(), r.body["provider_txid"].as_str()),
        (200, Some("succeeded"), Some("tx-1"))
    );
    let r = s.post("/v1/withdrawals/w2/resolve", json!({"outcome": "not_sent", "reason": "statement"})).await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("dead")), "{}", r.body);
    assert_eq!(s.balance("acme").await, 90, "w1 paid, w2's hold refunded");
    let r = s.post("/v1/withdrawals/w2/resolve", json!({"outcome": "not_sent", "reason": "again"})).await;
    assert_eq!((r.status, code(&r)), (409, "invalid_transition"), "only from unknown");
    // A server that pays out through a provider (here over the same store) leaves unknown
    // withdrawals to its reconciler.
    let app = settle_api::Application::build_full(
        "127.0.0.1:0",
        store.clone() as std::sync::Arc<dyn settle_store::Store>,
        tokens(),
        settle_api::HttpLimits::default(),
        None,
        true,
    )
    .await
    .unwrap();
    let base = format!("http://{}", app.local_addr());
    tokio::spawn(app.run_until(std::future::pending()));
    let r =
        s.post("/v1/withdrawals", json!({"id": "w3", "account_id": "acme", "amount": 10, "destination": "DE89"})).await;
    assert_eq!(r.status, 201);
    unknown_withdrawals(&*store).await;
    let r = reqwest::Client::new()
        .post(format!("{base}/v1/withdrawals/w3/resolve"))
        .bearer_auth(ADMIN)
        .json(&json!({"outcome": "not_sent", "reason": "statement"}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 409);
    let body: serde_json::Value = r.json().await.unwrap();
    assert!(body["error"]["message"].as_str().unwrap().contains("reconciler"), "{body}");
}
