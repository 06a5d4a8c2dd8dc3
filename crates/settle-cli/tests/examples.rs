//! The example workers — Rust (settle-client SDK) and Python (standard library only) — each
//! complete a batch of jobs against a real `settle serve`.

use serde_json::{Value, json};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct Serve {
    pub child: Child,
    pub base: String,
    _dir: Option<tempfile::TempDir>,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

pub fn serve(db: Option<&str>, config: Option<&std::path::Path>) -> Serve {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}")]).current_dir(dir.path());
    if let Some(db) = db {
        cmd.args(["--db", db]);
    }
    if let Some(c) = config {
        cmd.arg("--config").arg(c);
    }
    let child = cmd
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
        assert!(Instant::now() < deadline, "settle serve did not come up");
        std::thread::sleep(Duration::from_millis(50));
    }
    Serve { child, base, _dir: Some(dir) }
}

pub async fn call(http: &reqwest::Client, method: &str, url: &str, body: Option<Value>) -> (u16, Value) {
    let mut req = http.request(reqwest::Method::from_bytes(method.as_bytes()).unwrap(), url);
    if let Some(b) = body {
        req = req.json(&b);
    }
    let resp = req.send().await.unwrap();
    let status = resp.status().as_u16();
    (status, resp.json().await.unwrap_or(Value::Null))
}

async fn batch(http: &reqwest::Client, base: &str, prefix: &str, n: usize) {
    for i in 0..n {
        let items: Vec<Value> = (0..3).map(|f| json!({"id": format!("frame-{f}"), "cost": 2})).collect();
        let (status, body) = call(
            http,
            "POST",
            &format!("{base}/v1/jobs"),
            Some(json!({"id": format!("{prefix}-{i}"), "account_id": "a", "kind": "render", "items": items, "payload": {"sleep_ms": 5}})),
        )
        .await;
        assert_eq!(status, 201, "{body}");
    }
}

async fn states(http: &reqwest::Client, base: &str, prefix: &str) -> Vec<(String, String, Value)> {
    let (_, body) = call(http, "GET", &format!("{base}/v1/jobs?limit=1000"), None).await;
    body["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|j| j["id"].as_str().unwrap().starts_with(prefix))
        .map(|j| (j["id"].as_str().unwrap().to_owned(), j["state"].as_str().unwrap().to_owned(), j["result"].clone()))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rust_and_python_example_workers_complete_a_batch() {
    let s = serve(None, None);
    let http = reqwest::Client::new();
    assert_eq!(call(&http, "POST", &format!("{}/v1/accounts", s.base), Some(json!({"id": "a"}))).await.0, 201);
    assert_eq!(
        call(&http, "POST", &format!("{}/v1/accounts/a/grants", s.base), Some(json!({"id": "g", "amount": 1000})))
            .await
            .0,
        201
    );

    batch(&http, &s.base, "rust", 12).await;
    let out = tokio::task::spawn_blocking({
        let base = s.base.clone();
        move || {
            Command::new(env!("CARGO_BIN_EXE_settle-example-worker"))
                .args([&base, "rust-worker", "--exit-when-idle"])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let done = states(&http, &s.base, "rust").await;
    assert_eq!(done.len(), 12);
    assert!(done.iter().all(|(_, st, r)| st == "succeeded" && r["frames"] == 3), "{done:?}");

    batch(&http, &s.base, "py", 8).await;
    let out = tokio::task::spawn_blocking({
        let base = s.base.clone();
        move || {
            Command::new("python3")
                .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/../../examples/python/worker.py"))
                .args([&base, "py-worker", "--exit-when-idle"])
                .output()
                .unwrap()
        }
    })
    .await
    .unwrap();
    assert!(out.status.success(), "{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    let done = states(&http, &s.base, "py").await;
    assert_eq!(done.len(), 8);
    assert!(done.iter().all(|(_, st, r)| st == "succeeded" && r["worker"] == "python"), "{done:?}");

    let (_, audit) = call(&http, "GET", &format!("{}/v1/audit", s.base), None).await;
    assert_eq!(audit["ok"], true, "{audit}");
    let (_, acc) = call(&http, "GET", &format!("{}/v1/accounts/a", s.base), None).await;
    assert_eq!(acc["balance"], 1000 - 20 * 6);
}
