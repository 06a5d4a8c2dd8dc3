//! The Rust SDK's worker rides out a restart (issue 20, item 2): `settle serve` killed outright
//! (SIGKILL) under a running worker, down for longer than the lease, started again on the same
//! port and database. The worker goes on by itself and every job ends exactly once in the ledger.
//! A token the server refuses ends `Worker::run` with that error instead of retrying forever.

use crate::common::{Process, call, free_port, wait_for};
use serde_json::{Value, json};
use settle_client::{Client, ClientError, Flow, Handler, JobContext, Outcome, Worker};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const JOBS: usize = 6;

fn serve(dir: &std::path::Path, port: u16, tokens: Option<&str>) -> Process {
    let config = dir.join("settle.toml");
    std::fs::write(
        &config,
        "[defaults]\nbackoff_ms_base = 100\nbackoff_ms_max = 200\n[loops]\nrescue_every_ms = 200\nsweep_every_ms = 200\n",
    )
    .unwrap();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
    cmd.args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--config"])
        .arg(&config)
        .args(["--db", &format!("sqlite://{}", dir.join("settle.db").display())])
        .current_dir(dir)
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    if let Some(t) = tokens {
        cmd.env("SETTLE_TOKENS", t);
    }
    let p = Process(cmd.spawn().unwrap());
    wait_for(port);
    p
}

/// Two items per job, each a little work; stops at the item boundary when told to.
struct Frames {
    one_done: tokio::sync::Notify,
}

#[async_trait::async_trait]
impl Handler for Frames {
    async fn run(&self, ctx: &JobContext) -> Outcome {
        for item in ctx.job.items.iter().filter(|i| i.to_do()) {
            tokio::time::sleep(Duration::from_millis(150)).await;
            match ctx.item_done(&item.id).await {
                Ok(Flow::Continue) => {}
                Ok(Flow::Stop) => return Outcome::Cancelled,
                Err(e) => panic!("an item report failed for good: {e}"),
            }
        }
        self.one_done.notify_one();
        Outcome::Succeeded(None)
    }
}

async fn ledger(http: &reqwest::Client, base: &str) -> Vec<Value> {
    let (mut entries, mut after) = (Vec::new(), 0);
    loop {
        let (status, page) = call(http, "GET", &format!("{base}/v1/accounts/a/ledger?after={after}"), None).await;
        assert_eq!(status, 200, "{page}");
        entries.extend(page["entries"].as_array().unwrap().iter().cloned());
        match page["next_after"].as_i64() {
            Some(n) => after = n,
            None => return entries,
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_rides_out_a_restart_longer_than_its_lease() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let mut server = serve(dir.path(), port, None);
    let http = reqwest::Client::new();
    assert_eq!(call(&http, "POST", &format!("{base}/v1/accounts"), Some(json!({"id": "a"}))).await.0, 201);
    let grant = json!({"id": "g", "amount": 10_000});
    assert_eq!(call(&http, "POST", &format!("{base}/v1/accounts/a/grants"), Some(grant)).await.0, 201);
    for j in 0..JOBS {
        let job = json!({"id": format!("r{j}"), "account_id": "a", "kind": "render",
                         "items": [{"id": "f1", "cost": 10}, {"id": "f2", "cost": 20}]});
        assert_eq!(call(&http, "POST", &format!("{base}/v1/jobs"), Some(job)).await.0, 201);
    }

    let mut worker = Worker::new(Client::new(&base, None), "rust-restart");
    worker.concurrency = 2;
    worker.wait_seconds = 1;
    worker.lease_seconds = Some(2);
    worker.heartbeat_every = Duration::from_millis(500);
    let handler = Arc::new(Frames { one_done: tokio::sync::Notify::new() });
    let stop = CancellationToken::new();
    let running = tokio::spawn(worker.run(handler.clone(), stop.clone()));
    tokio::time::timeout(Duration::from_secs(20), handler.one_done.notified()).await.expect("a first job done");

    // Killed outright, down for twice the lease, started again on the same port and database.
    let _ = server.0.kill();
    let _ = server.0.wait();
    tokio::time::sleep(Duration::from_secs(4)).await;
    server = serve(dir.path(), port, None);

    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let mut states = Vec::new();
        for j in 0..JOBS {
            let (_, job) = call(&http, "GET", &format!("{base}/v1/jobs/r{j}"), None).await;
            states.push(job["state"].as_str().unwrap_or("?").to_owned());
        }
        if states.iter().all(|s| s == "succeeded") {
            break;
        }
        assert!(Instant::now() < deadline, "jobs did not all succeed after the restart: {states:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    stop.cancel();
    tokio::time::timeout(Duration::from_secs(30), running).await.expect("the worker stops").unwrap().unwrap();

    // Exactly once: one charge per item, every refund taken back, the audit clean.
    let entries = ledger(&http, &base).await;
    let kinds = |k: &str| entries.iter().filter(|e| e["kind"] == k).count();
    let charged: std::collections::BTreeSet<_> = entries
        .iter()
        .filter(|e| e["kind"] == "charge")
        .map(|e| (e["job_id"].to_string(), e["item_id"].to_string()))
        .collect();
    assert_eq!((kinds("charge"), charged.len()), (2 * JOBS, 2 * JOBS));
    assert_eq!(kinds("refund"), kinds("reclaim"), "every refund of the outage was taken back");
    let (_, account) = call(&http, "GET", &format!("{base}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 10_000 - 30 * JOBS as i64);
    let (_, audit) = call(&http, "GET", &format!("{base}/v1/audit"), None).await;
    assert_eq!(audit["ok"], true, "{audit}");
    drop(server);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refused_token_ends_the_worker_with_the_error() {
    let dir = tempfile::tempdir().unwrap();
    let port = free_port();
    let _server = serve(dir.path(), port, Some("worker:w=worker-token-0123456789"));
    let worker = Worker::new(Client::new(&format!("http://127.0.0.1:{port}"), Some("not-this-servers-token")), "w");
    struct Never;
    #[async_trait::async_trait]
    impl Handler for Never {
        async fn run(&self, _: &JobContext) -> Outcome {
            unreachable!("nothing is claimed with a refused token")
        }
    }
    let ended =
        tokio::time::timeout(Duration::from_secs(5), worker.run(Arc::new(Never), CancellationToken::new())).await;
    match ended {
        Ok(Err(ClientError::Api { status: 401, .. })) => {}
        other => panic!("expected the worker to end with 401: {other:?}"),
    }
}
