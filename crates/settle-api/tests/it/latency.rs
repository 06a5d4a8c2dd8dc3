//! Claim long-poll wake-ups: a claim waiting on `POST /v1/claims` is answered when a job becomes
//! due — created by another store (on PostgreSQL another connection pool, so the wake-up crosses
//! LISTEN/NOTIFY), or reaching its `not_before`. The test server re-checks only every 30 s, so an
//! answer inside the bound can only come from the wake-up path: a broken one fails here. How fast
//! it is, is measured by `settle bench --wake` (docs/performance.md), not by this test.

use crate::kit::*;
use serde_json::json;
use settle_core::Credits;
use settle_core::ids::*;
use settle_store::{NewItem, NewJob, Price, SqlStore, Store, StoreOptions};
use std::sync::Arc;
use std::time::{Duration, Instant};

const SAMPLES: usize = 5;
/// Far above any wake-up, far below the test server's 30 s re-check and the claims' 10 s wait.
const BOUND: Duration = Duration::from_secs(5);

fn job(id: &str, not_before: Option<settle_core::Timestamp>) -> NewJob {
    NewJob {
        id: JobId::parse(id).unwrap(),
        account_id: AccountId::parse("a").unwrap(),
        kind: JobKind::parse("render").unwrap(),
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(1)) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        refund_on: None,
        not_before,
        priority: None,
        requires: Default::default(),
    }
}

async fn wake_latency(e: Engine) {
    let s = Arc::new(Server::start(e).await);
    s.account("a", 1_000).await;
    // The other writer: for PostgreSQL a second store (its own pool) on the same database; for
    // SQLite, whose single writer lives in the server's process, the server's own API.
    let other: Option<SqlStore> = match e {
        Engine::Postgres => Some(SqlStore::open(&s.database_url, StoreOptions::default()).await.unwrap()),
        Engine::Sqlite => None,
    };
    if other.is_some() {
        // Both stores' listeners up before the first NOTIFY: one sent earlier would be lost, and
        // the server re-checks only every 30 s.
        settle_testkit::until_listening(&s.database_url, 2).await;
    }
    let mut created = Vec::new();
    let mut due = Vec::new();
    for n in 0..SAMPLES {
        // (1) a job created while a claim waits
        let waiter = {
            let s = s.clone();
            tokio::spawn(async move {
                let r = s.post("/v1/claims", json!({"worker": "w", "wait_seconds": 10})).await;
                (r, Instant::now())
            })
        };
        s.until_long_polls_waiting(1).await;
        let committed = Instant::now(); // just before the create is sent
        match &other {
            Some(store) => drop(store.create_job(job(&format!("c{n}"), None)).await.unwrap()),
            None => assert_eq!(
                s.post("/v1/jobs", json!({"id": format!("c{n}"), "account_id": "a", "kind": "render", "cost": 1}))
                    .await
                    .status,
                201
            ),
        }
        let (r, returned) = waiter.await.unwrap();
        assert_eq!(r.body["jobs"][0]["id"], format!("c{n}"));
        // From sending the create to the claim's answer: an upper bound that includes the create.
        created.push(returned.saturating_duration_since(committed));
        // (2) a job whose not_before arrives while a claim waits
        let not_before = settle_core::SystemClock.now_plus_millis(400);
        let store_for_due: &dyn Store = match &other {
            Some(st) => st,
            None => &*s.store_handle(),
        };
        store_for_due.create_job(job(&format!("d{n}"), Some(not_before))).await.unwrap();
        let r = s.post("/v1/claims", json!({"worker": "w", "wait_seconds": 10})).await;
        let returned = settle_core::SystemClock.now_micros();
        assert_eq!(r.body["jobs"][0]["id"], format!("d{n}"));
        due.push(Duration::from_micros(returned.saturating_sub(not_before.micros()) as u64));
    }
    assert!(created.iter().all(|d| *d < BOUND), "woken by a new job after {created:?}");
    assert!(due.iter().all(|d| *d < BOUND), "woken by not_before after {due:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_claim_long_poll_is_woken_not_polled() {
    wake_latency(Engine::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_claim_long_poll_is_woken_not_polled() {
    wake_latency(Engine::Postgres).await;
}
