//! Caps across processes (issue 44, decision 0032): two `settle serve` processes on one PostgreSQL,
//! eight HTTP workers racing between them; an account capped at 2 and a kind capped at 3 by the
//! configuration. A monitor reads the committed running counts all along: neither ever passes its
//! cap, and both are reached (the race was real).

use crate::common::{call, serve};
use serde_json::json;
use settle_core::job::JobState;
use settle_store::{JobFilter, Page, SqlStore, Store, StoreOptions};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

async fn running(store: &SqlStore, filter: JobFilter) -> usize {
    let filter = JobFilter { state: Some(JobState::Running), ..filter };
    store.jobs(&filter, Page { after: 0, limit: 1_000 }).await.unwrap().rows.len()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn racing_workers_in_two_processes_never_pass_a_cap() {
    let url = settle_testkit::fresh_database().await;
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("settle.toml");
    std::fs::write(&config, "[kinds.batch]\nmax_running = 3\n").unwrap();
    let servers = [serve(Some(&url), Some(&config)), serve(Some(&url), Some(&config))];
    let bases: Vec<String> = servers.iter().map(|s| s.base.clone()).collect();
    let http = reqwest::Client::new();
    let base = &bases[0];
    let (status, made) =
        call(&http, "POST", &format!("{base}/v1/accounts"), Some(json!({"id": "a", "max_running": 2}))).await;
    assert_eq!((status, &made["max_running"]), (201, &json!(2)), "{made}");
    assert_eq!(call(&http, "POST", &format!("{base}/v1/accounts"), Some(json!({"id": "b"}))).await.0, 201);
    for a in ["a", "b"] {
        let grant = json!({"id": format!("g-{a}"), "amount": 1_000_000});
        assert_eq!(call(&http, "POST", &format!("{base}/v1/accounts/{a}/grants"), Some(grant)).await.0, 201);
    }
    for n in 0..60 {
        let (account, kind) = match n % 3 {
            0 => ("a", "render"),
            1 => ("b", "batch"),
            _ => ("b", "render"),
        };
        let job = json!({"id": format!("j{n}"), "account_id": account, "kind": kind, "cost": 1});
        assert_eq!(call(&http, "POST", &format!("{}/v1/jobs", bases[n % 2]), Some(job)).await.0, 201);
    }
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    let stop = Arc::new(AtomicBool::new(false));
    let (worst_a, worst_batch) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let monitor = {
        let (store, stop, worst_a, worst_batch) = (store.clone(), stop.clone(), worst_a.clone(), worst_batch.clone());
        tokio::spawn(async move {
            let a = JobFilter { account_id: Some(settle_core::ids::AccountId::parse("a").unwrap()), ..JobFilter::ALL };
            let batch = JobFilter { kind: Some(settle_core::ids::JobKind::parse("batch").unwrap()), ..JobFilter::ALL };
            while !stop.load(Ordering::Relaxed) {
                worst_a.fetch_max(running(&store, a.clone()).await, Ordering::Relaxed);
                worst_batch.fetch_max(running(&store, batch.clone()).await, Ordering::Relaxed);
            }
        })
    };
    let done = Arc::new(AtomicUsize::new(0));
    let workers: Vec<_> = (0..8)
        .map(|w| {
            let (base, http, done) = (bases[w % 2].clone(), http.clone(), done.clone());
            tokio::spawn(async move {
                for _ in 0..400 {
                    if done.load(Ordering::Relaxed) >= 60 {
                        return;
                    }
                    let claim = json!({"worker": format!("w{w}"), "limit": 1, "wait_seconds": 1});
                    let (status, got) = call(&http, "POST", &format!("{base}/v1/claims"), Some(claim)).await;
                    assert_eq!(status, 200, "{got}");
                    for j in got["jobs"].as_array().unwrap() {
                        tokio::time::sleep(Duration::from_millis(20)).await;
                        let (id, token) = (j["id"].as_str().unwrap(), j["lease_token"].as_str().unwrap());
                        let url = format!("{base}/v1/jobs/{id}/succeed");
                        let (status, body) = call(&http, "POST", &url, Some(json!({"lease_token": token}))).await;
                        assert_eq!(status, 200, "{body}");
                        done.fetch_add(1, Ordering::Relaxed);
                    }
                }
            })
        })
        .collect();
    for w in workers {
        w.await.unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    monitor.await.unwrap();
    assert_eq!(done.load(Ordering::Relaxed), 60, "every job ran: parked work came back");
    let (a, batch) = (worst_a.load(Ordering::Relaxed), worst_batch.load(Ordering::Relaxed));
    assert!(a <= 2 && batch <= 3, "a cap was passed: account a ran {a} (cap 2), kind batch {batch} (cap 3)");
    assert!(a == 2 && batch >= 2, "the caps were reached: a ran {a}, batch {batch}");
    let audit = store.audit(None).await.unwrap();
    assert!(audit.ok(), "{:?}", audit.violations);
}
