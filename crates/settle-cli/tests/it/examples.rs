//! The example workers — Rust (settle-client SDK) and Python (standard library only) — each
//! complete a batch of jobs against a real `settle serve`.

use crate::common::{Process, call, serve};
use serde_json::{Value, json};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

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
    // A job whose first attempt fails: the retry must redo the items the failure refunded.
    let items: Vec<Value> = (0..3).map(|f| json!({"id": format!("frame-{f}"), "cost": 2})).collect();
    let retry = json!({"id": "rust-retry", "account_id": "a", "kind": "render", "items": items, "payload": {"sleep_ms": 5, "fail": "NODE_DOWN", "fail_attempts": 1}});
    assert_eq!(call(&http, "POST", &format!("{}/v1/jobs", s.base), Some(retry)).await.0, 201);
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
    assert_eq!(done.len(), 13);
    assert!(done.iter().all(|(_, st, r)| st == "succeeded" && r["frames"] == 3), "{done:?}");

    batch(&http, &s.base, "py", 8).await;
    let items: Vec<Value> = (0..3).map(|f| json!({"id": format!("frame-{f}"), "cost": 2})).collect();
    let retry = json!({"id": "py-retry", "account_id": "a", "kind": "render", "items": items, "payload": {"sleep_ms": 5, "fail": "NODE_DOWN", "fail_attempts": 1}});
    assert_eq!(call(&http, "POST", &format!("{}/v1/jobs", s.base), Some(retry)).await.0, 201);
    let out = tokio::task::spawn_blocking({
        let base = s.base.clone();
        move || {
            Command::new(settle_testkit::python::with_client())
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
    assert_eq!(done.len(), 9);
    assert!(done.iter().all(|(_, st, r)| st == "succeeded" && r["worker"] == "python" && r["frames"] == 3), "{done:?}");

    let (_, audit) = call(&http, "GET", &format!("{}/v1/audit", s.base), None).await;
    assert_eq!(audit["ok"], true, "{audit}");
    let (_, acc) = call(&http, "GET", &format!("{}/v1/accounts/a", s.base), None).await;
    assert_eq!(acc["balance"], 1000 - 22 * 6);
    for id in ["rust-retry", "py-retry"] {
        let (_, retried) = call(&http, "GET", &format!("{}/v1/jobs/{id}", s.base), None).await;
        assert_eq!(retried["attempt"], 2);
        assert!(retried["items"].as_array().unwrap().iter().all(|i| i["state"] == "reclaimed"), "{retried}");
    }
}

fn spawn(bin: &str, args: &[&str]) -> Child {
    Command::new(bin)
        .args(args)
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Soak on PostgreSQL: 2 `settle serve` + 3 `settle worker` processes and three example workers
/// (one of them too slow to heartbeat within its lease) work jobs that fail retryably, fail for
/// good, come back unknown, fail an item, hang past their lease and answer late, and are
/// cancelled mid-batch. Every job must end, the audit be clean, and each balance be exact.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn soak_two_servers_three_workers_on_postgres() {
    const JOBS: usize = 600;
    const ACCOUNTS: usize = 8;
    const GRANT: i64 = 100_000;
    let db = settle_testkit::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("settle.toml");
    std::fs::write(
        &config,
        "[defaults]\nlease_seconds = 2\nbackoff_ms_base = 50\nbackoff_ms_max = 400\nconfirm_window_seconds = 2\n\n\
         [loops]\nrescue_every_ms = 200\nsweep_every_ms = 200\nreconcile_every_ms = 300\n",
    )
    .unwrap();
    let a = serve(Some(&db), Some(&config));
    let b = serve(Some(&db), Some(&config));
    let settle = env!("CARGO_BIN_EXE_settle");
    let worker = env!("CARGO_BIN_EXE_settle-example-worker");
    let cfg = config.to_str().unwrap();
    let mut procs: Vec<Process> = Vec::new();
    for _ in 0..3 {
        procs.push(Process(spawn(settle, &["worker", "--db", &db, "--config", cfg])));
    }
    procs.push(Process(spawn(worker, &[&a.base, "fast-a", "--heartbeat-ms", "400", "--concurrency", "6"])));
    procs.push(Process(spawn(worker, &[&b.base, "fast-b", "--heartbeat-ms", "400", "--concurrency", "6"])));
    // Heartbeats every 10 s against a 2 s lease: its long jobs are rescued, and it answers late.
    procs.push(Process(spawn(worker, &[&a.base, "slow", "--heartbeat-ms", "10000", "--concurrency", "3"])));

    let http = reqwest::Client::new();
    for acc in 0..ACCOUNTS {
        assert_eq!(
            call(&http, "POST", &format!("{}/v1/accounts", a.base), Some(json!({"id": format!("acct-{acc}")}))).await.0,
            201
        );
        let grant = json!({"id": format!("grant-{acc}"), "amount": GRANT});
        assert_eq!(call(&http, "POST", &format!("{}/v1/accounts/acct-{acc}/grants", b.base), Some(grant)).await.0, 201);
    }
    let mut to_cancel = Vec::new();
    for n in 0..JOBS {
        let items: Vec<Value> =
            (0..3).map(|f| json!({"id": format!("frame-{f}"), "cost": 1 + (n % 5) as i64})).collect();
        let payload = match n % 10 {
            0..=3 => json!({"sleep_ms": 5}),
            4 => json!({"sleep_ms": 5, "fail": "NODE_DOWN", "fail_attempts": 2}),
            5 => json!({"sleep_ms": 5, "fail": "INVALID_ADDRESS"}),
            6 => json!({"sleep_ms": 5, "unknown": true}),
            7 => json!({"sleep_ms": 5, "fail_item": "frame-1"}),
            8 => json!({"sleep_ms": 2500, "no_items": true}),
            _ => {
                to_cancel.push(format!("job-{n}"));
                json!({"sleep_ms": 400})
            }
        };
        let base = if n % 2 == 0 { &a.base } else { &b.base };
        let body = json!({"id": format!("job-{n}"), "account_id": format!("acct-{}", n % ACCOUNTS), "kind": "render", "items": items, "payload": payload});
        let (status, reply) = call(&http, "POST", &format!("{base}/v1/jobs"), Some(body.clone())).await;
        assert_eq!(status, 201, "{reply}");
        if n % 7 == 0 {
            let (status, _) = call(&http, "POST", &format!("{base}/v1/jobs"), Some(body)).await;
            assert_eq!(status, 200, "a re-sent create replays");
        }
    }
    // Cancel the slow batches mid-run: once each is running (202), or before it starts (200).
    // Inside nextest's own limit (3 minutes), so a stuck soak fails here, saying why.
    let deadline = Instant::now() + Duration::from_secs(150);
    for id in &to_cancel {
        loop {
            let (status, job) = call(&http, "POST", &format!("{}/v1/jobs/{id}/cancel", b.base), None).await;
            match status {
                200 | 202 => break,
                409 if job["error"]["code"] == "job_finished" => break,
                _ => {}
            }
            assert!(Instant::now() < deadline, "cancel of {id}: {status} {job}");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    // Wait until every job has ended.
    loop {
        let (_, body) = call(&http, "GET", &format!("{}/v1/jobs?limit=1000", a.base), None).await;
        let jobs = body["jobs"].as_array().unwrap().clone();
        let moving: Vec<&Value> =
            jobs.iter().filter(|j| !matches!(j["state"].as_str(), Some("succeeded" | "dead" | "cancelled"))).collect();
        if jobs.len() == JOBS && moving.is_empty() {
            let count = |s: &str| jobs.iter().filter(|j| j["state"] == s).count();
            println!(
                "soak: succeeded {}, dead {}, cancelled {}",
                count("succeeded"),
                count("dead"),
                count("cancelled")
            );
            assert!(count("dead") >= JOBS / 10, "INVALID_ADDRESS jobs end dead");
            assert!(count("cancelled") > 0);
            // Balances: grants minus the cost of every item whose net is −cost.
            for acc in 0..ACCOUNTS {
                let owed: i64 = jobs
                    .iter()
                    .filter(|j| j["account_id"] == format!("acct-{acc}"))
                    .flat_map(|j| j["items"].as_array().unwrap().clone())
                    .filter(|i| matches!(i["state"].as_str(), Some("charged" | "succeeded" | "reclaimed")))
                    .map(|i| i["cost"].as_i64().unwrap())
                    .sum();
                let (_, account) = call(&http, "GET", &format!("{}/v1/accounts/acct-{acc}", b.base), None).await;
                assert_eq!(account["balance"].as_i64().unwrap(), GRANT - owed, "acct-{acc}");
            }
            break;
        }
        assert!(
            Instant::now() < deadline,
            "jobs still moving: {:?}",
            moving.iter().take(5).map(|j| (&j["id"], &j["state"])).collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    drop(procs);
    let audit = Command::new(settle).args(["audit", "--db", &db]).output().unwrap();
    assert!(audit.status.success(), "{}", String::from_utf8_lossy(&audit.stdout));
    // The slow worker's leases expired and were rescued.
    let (_, body) = call(&http, "GET", &format!("{}/v1/jobs?limit=1000&fail_code=LEASE_EXPIRED", a.base), None).await;
    let rescued = body["jobs"].as_array().unwrap().len();
    let mut lease_expired_attempts = 0;
    for n in (8..JOBS).step_by(10) {
        let (_, att) = call(&http, "GET", &format!("{}/v1/jobs/job-{n}/attempts", a.base), None).await;
        lease_expired_attempts +=
            att["attempts"].as_array().unwrap().iter().filter(|x| x["result"] == "lease_expired").count();
    }
    println!(
        "soak: {lease_expired_attempts} leases expired on the long jobs ({rescued} jobs still show LEASE_EXPIRED)"
    );
    assert!(lease_expired_attempts > 0, "the slow worker never lost a lease: the soak did not exercise the rescuer");
}
