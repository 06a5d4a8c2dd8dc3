//! Artifacts in S3, as an operator runs it: `settle serve --artifacts s3://bucket/prefix` against a
//! real S3 API (moto's server, started by the test kit) configured by the standard AWS variables,
//! with a proxy in front that refuses deletes for a while — every delete, then one key of each bulk
//! delete. The cancelled batch stays `cancelling` while the store refuses, then the sweeper ends it
//! `cancelled` with every undelivered item's artifact gone and the delivered item's kept. The worker
//! writes with plain S3 requests, nothing of Settle's on its way.

use crate::common::{Process, call, free_port, wait_for};
use axum::body::Bytes;
use axum::http::{HeaderMap, Method, StatusCode, Uri};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use settle_testkit::s3;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

/// An HTTP proxy in front of the S3 server. In `REFUSE` mode it answers deletes (DELETE, and the
/// bulk `POST ?delete`) with S3's AccessDenied; in `ONE_KEY` mode it answers a bulk delete with
/// S3's partial answer — the first key refused, the others reported deleted (and left as they are);
/// `FORWARD` passes everything on.
struct Proxy {
    upstream: String,
    mode: AtomicU8,
    refused: AtomicUsize,
    http: reqwest::Client,
}

const FORWARD: u8 = 0;
const REFUSE: u8 = 1;
const ONE_KEY: u8 = 2;

/// The `<Key>`s of a bulk delete's body.
fn keys_of(body: &[u8]) -> Vec<String> {
    let text = String::from_utf8_lossy(body);
    text.split("<Key>").skip(1).filter_map(|k| k.split_once("</Key>").map(|(k, _)| k.to_owned())).collect()
}

async fn forward(proxy: Arc<Proxy>, method: Method, uri: Uri, headers: HeaderMap, body: Bytes) -> Response {
    let bulk_delete =
        method == Method::POST && uri.query().is_some_and(|q| q.split('&').any(|p| p == "delete" || p == "delete="));
    let mode = proxy.mode.load(Ordering::SeqCst);
    if (method == Method::DELETE || bulk_delete) && mode == REFUSE {
        proxy.refused.fetch_add(1, Ordering::SeqCst);
        let xml = "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>AccessDenied</Code><Message>Access Denied</Message></Error>";
        return (StatusCode::FORBIDDEN, [("content-type", "application/xml")], xml).into_response();
    }
    if bulk_delete && mode == ONE_KEY {
        proxy.refused.fetch_add(1, Ordering::SeqCst);
        let mut xml = String::from(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<DeleteResult xmlns=\"http://s3.amazonaws.com/doc/2006-03-01/\">",
        );
        for (i, key) in keys_of(&body).iter().enumerate() {
            if i == 0 {
                xml += &format!(
                    "<Error><Key>{key}</Key><Code>AccessDenied</Code><Message>Access Denied</Message></Error>"
                );
            } else {
                xml += &format!("<Deleted><Key>{key}</Key></Deleted>");
            }
        }
        xml += "</DeleteResult>";
        return (StatusCode::OK, [("content-type", "application/xml")], xml).into_response();
    }
    let path = uri.path_and_query().map(|p| p.as_str()).unwrap_or("/");
    let mut req = proxy.http.request(method, format!("{}{path}", proxy.upstream)).body(body);
    for (name, value) in &headers {
        if name != "host" {
            req = req.header(name, value);
        }
    }
    let answer = match req.send().await {
        Ok(a) => a,
        Err(e) => return (StatusCode::BAD_GATEWAY, e.to_string()).into_response(),
    };
    let (status, mut headers) = (answer.status(), answer.headers().clone());
    let body = answer.bytes().await.unwrap_or_default();
    headers.remove("transfer-encoding");
    headers.remove("content-length");
    (status, headers, body).into_response()
}

async fn start_proxy(upstream: &str) -> (Arc<Proxy>, String) {
    let proxy = Arc::new(Proxy {
        upstream: upstream.to_owned(),
        mode: AtomicU8::new(FORWARD),
        refused: AtomicUsize::new(0),
        http: reqwest::Client::new(),
    });
    let p = proxy.clone();
    let app = axum::Router::new().fallback(move |method: Method, uri: Uri, headers: HeaderMap, body: Bytes| {
        forward(p.clone(), method, uri, headers, body)
    });
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (proxy, base)
}

fn serve_with_s3(dir: &std::path::Path, artifacts: &str, endpoint: &str) -> Command {
    let config = dir.join("settle.toml");
    std::fs::write(&config, "[loops]\nsweep_every_ms = 100\nrescue_every_ms = 200\n").unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
    cmd.args(["serve", "--artifacts", artifacts, "--config"])
        .arg(&config)
        .current_dir(dir)
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .env_remove("SETTLE_ARTIFACTS")
        // Only the test's S3 settings: none of the machine's own.
        .env_remove("AWS_SESSION_TOKEN")
        .env_remove("AWS_PROFILE")
        .env_remove("AWS_DEFAULT_REGION")
        .env_remove("AWS_ENDPOINT")
        .env_remove("AWS_ENDPOINT_URL_S3")
        .env("AWS_ENDPOINT_URL", endpoint)
        .env("AWS_ACCESS_KEY_ID", "testing")
        .env("AWS_SECRET_ACCESS_KEY", "testing")
        .env("AWS_REGION", "us-east-1");
    cmd
}

async fn state(http: &reqwest::Client, base: &str, job: &str) -> String {
    let (status, j) = call(http, "GET", &format!("{base}/v1/jobs/{job}"), None).await;
    assert_eq!(status, 200, "{j}");
    j["state"].as_str().unwrap().to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_batch_deletes_its_s3_artifacts_once_the_store_accepts_deletes() {
    let bucket = s3::fresh_bucket();
    let (proxy, via) = start_proxy(&bucket.endpoint).await;
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _serve = Process(
        serve_with_s3(dir.path(), &bucket.url("renders"), &via)
            .args(["--listen", &format!("127.0.0.1:{port}")])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(port);
    let (s, http) = (format!("http://127.0.0.1:{port}"), reqwest::Client::new());

    assert_eq!(call(&http, "POST", &format!("{s}/v1/accounts"), Some(json!({"id": "a"}))).await.0, 201);
    let grant = json!({"id": "g", "amount": 100});
    assert_eq!(call(&http, "POST", &format!("{s}/v1/accounts/a/grants"), Some(grant)).await.0, 201);
    let items: Vec<_> = (1..=3).map(|i| json!({"id": format!("f{i}"), "cost": 10})).collect();
    let job = json!({"id": "b", "account_id": "a", "kind": "render", "items": items});
    assert_eq!(call(&http, "POST", &format!("{s}/v1/jobs"), Some(job)).await.0, 201);
    let (status, claim) = call(&http, "POST", &format!("{s}/v1/claims"), Some(json!({"worker": "w1"}))).await;
    assert_eq!(status, 200, "{claim}");
    let token = claim["jobs"][0]["lease_token"].as_str().unwrap().to_owned();

    // f1 is delivered with its frame; f2 is under way with a frame and a log.
    let mut paths = Vec::new();
    for (item, key) in [("f1", "frame.png"), ("f2", "frame.png"), ("f2", "logs/render.txt")] {
        let body = json!({"lease_token": token, "key": key});
        let (status, a) = call(&http, "POST", &format!("{s}/v1/jobs/b/items/{item}/artifacts"), Some(body)).await;
        assert_eq!(status, 201, "{a}");
        // The worker's own S3 client writes under the configured prefix, at the answer's path.
        let object = format!("renders/{}", a["path"].as_str().unwrap());
        bucket.put(&object, format!("{item}/{key}").as_bytes());
        paths.push(object);
    }
    let (status, r) =
        call(&http, "POST", &format!("{s}/v1/jobs/b/items/f1/succeed"), Some(json!({"lease_token": token}))).await;
    assert_eq!(status, 200, "{r}");

    // The store refuses deletes; the cancel arrives and the worker stops at the item boundary.
    proxy.mode.store(REFUSE, Ordering::SeqCst);
    let (status, r) = call(&http, "POST", &format!("{s}/v1/jobs/b/cancel"), None).await;
    assert_eq!((status, r["cancel_requested"].as_bool()), (202, Some(true)), "{r}");
    let body = json!({"lease_token": token, "code": "CANCELLED"});
    let (status, r) = call(&http, "POST", &format!("{s}/v1/jobs/b/fail"), Some(body)).await;
    assert_eq!(status, 200, "{r}");
    assert_eq!(r["state"], "cancelling", "the refunds are in; the artifacts are not deleted: {r}");
    let (_, account) = call(&http, "GET", &format!("{s}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 90, "f2 and f3 refunded in step 1, f1 kept charged");

    // The sweeper keeps trying while the store refuses (after 1 s, then 2 s: a capped backoff);
    // nothing is deleted and the job waits.
    let seen = proxy.refused.load(Ordering::SeqCst);
    let deadline = Instant::now() + Duration::from_secs(20);
    while proxy.refused.load(Ordering::SeqCst) < seen + 2 {
        assert!(Instant::now() < deadline, "the sweeper did not retry the teardown");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(state(&http, &s, "b").await, "cancelling");
    for p in &paths {
        assert!(bucket.exists(p), "{p} still there while deletes are refused");
    }

    // The store refuses one key of each bulk delete (answering 200 with the others deleted): a
    // partial delete is no delete, and the job still waits. A cancel sent again tries at once.
    proxy.mode.store(ONE_KEY, Ordering::SeqCst);
    let seen = proxy.refused.load(Ordering::SeqCst);
    let (status, r) = call(&http, "POST", &format!("{s}/v1/jobs/b/cancel"), None).await;
    assert_eq!((status, r["state"].as_str()), (202, Some("cancelling")), "one key refused: not done: {r}");
    assert!(proxy.refused.load(Ordering::SeqCst) > seen, "the cancel tried the delete");

    // The store accepts deletes again: the next try finishes the teardown, terminal state last.
    proxy.mode.store(FORWARD, Ordering::SeqCst);
    let (status, r) = call(&http, "POST", &format!("{s}/v1/jobs/b/cancel"), None).await;
    assert_eq!((status, r["state"].as_str()), (200, Some("cancelled")), "{r}");
    assert!(bucket.exists(&paths[0]), "the delivered item's artifact is kept");
    for p in &paths[1..] {
        assert!(!bucket.exists(p), "{p} deleted");
    }
    let (_, account) = call(&http, "GET", &format!("{s}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 90);
    let (_, events) = call(&http, "GET", &format!("{s}/v1/events?after=0&limit=100"), None).await;
    let cancelled = events["events"].as_array().unwrap().iter().filter(|e| e["type"] == "job.cancelled").count();
    assert_eq!(cancelled, 1, "{events}");
}

/// `settle serve` on `artifacts` with the S3 server at `endpoint`: its exit and stderr (it must
/// refuse to start).
async fn refused_start(artifacts: &str, endpoint: &str) -> String {
    let dir = tempfile::tempdir().unwrap();
    let mut cmd = serve_with_s3(dir.path(), artifacts, endpoint);
    cmd.args(["--listen", &format!("127.0.0.1:{}", free_port())]);
    let out = tokio::task::spawn_blocking(move || cmd.output().unwrap()).await.unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(!out.status.success(), "started on {artifacts}: {stderr}");
    stderr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_refuses_a_store_it_cannot_delete_from() {
    let bucket = s3::fresh_bucket();
    let err = refused_start("s3://no-such-bucket-for-settle/renders", &bucket.endpoint).await;
    assert!(err.contains("misconfigured") && err.contains("NoSuchBucket"), "{err}");
    // The bucket is there but refuses Settle's deletes (a policy, wrong credentials).
    let (proxy, via) = start_proxy(&bucket.endpoint).await;
    proxy.mode.store(REFUSE, Ordering::SeqCst);
    let err = refused_start(&bucket.url("renders"), &via).await;
    assert!(err.contains("misconfigured") && err.contains("AccessDenied"), "{err}");
    let err = refused_start("ftp://elsewhere/x", &bucket.endpoint).await;
    assert!(err.contains("unknown scheme ftp://"), "{err}");
    let err = refused_start("memory://", &bucket.endpoint).await;
    assert!(err.contains("memory:// is for tests"), "{err}");
}
