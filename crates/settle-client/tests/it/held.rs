//! The SDK prices held jobs (issue 23, docs/decisions/0022) against a real server on both engines:
//! a worker's handler reports what the work used and the rest of the hold is released; an item is
//! priced by its report; and a success that arrives after the lease timed out and the hold was
//! refunded recovers the job at the price it reports.

use crate::common::call;

use serde_json::{Value, json};
use settle_client::{Client, Costs, Flow, Handler, JobContext, Outcome, Worker};
use settle_store::Store;
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// Prices each job at what its payload says it used: a job with a hold at `used`, each item of a
/// batch at `used` too, reported item by item.
struct Meter;

#[async_trait::async_trait]
impl Handler for Meter {
    async fn run(&self, ctx: &JobContext) -> Outcome {
        let used = ctx.job.payload["used"].as_i64().unwrap_or(0);
        if ctx.job.items.len() > 1 {
            for item in ctx.job.items.iter().filter(|i| i.to_do()) {
                if ctx.item_done_at(&item.id, Some(used)).await.expect("item report") == Flow::Stop {
                    return Outcome::Cancelled;
                }
            }
            return Outcome::Succeeded(None);
        }
        Outcome::Priced(Some(json!({"seconds": used})), Costs::from([("main".to_owned(), used)]))
    }
}

async fn until_done(http: &reqwest::Client, base: &str, job: &str) -> Value {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let (_, j) = call(http, reqwest::Method::GET, format!("{base}/v1/jobs/{job}"), None).await;
        if j["state"] == "succeeded" {
            return j;
        }
        assert!(std::time::Instant::now() < deadline, "the job did not end: {j}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    }
}

async fn workers_price_held_jobs(postgres: bool) {
    let served = crate::common::serve_on(postgres).await;
    let base = served.base.clone();
    let http = reqwest::Client::new();
    let post = reqwest::Method::POST;
    assert_eq!(call(&http, post.clone(), format!("{base}/v1/accounts"), Some(json!({"id": "a"}))).await.0, 201);
    let grant = json!({"id": "g", "amount": 1000});
    assert_eq!(call(&http, post.clone(), format!("{base}/v1/accounts/a/grants"), Some(grant)).await.0, 201);
    let render = json!({"id": "render", "account_id": "a", "kind": "render", "hold": 100, "payload": {"used": 37}});
    assert_eq!(call(&http, post.clone(), format!("{base}/v1/jobs"), Some(render)).await.0, 201);
    let items: Vec<Value> = (0..3).map(|f| json!({"id": format!("frame-{f}"), "hold": 10})).collect();
    let batch = json!({"id": "batch", "account_id": "a", "kind": "render", "items": items, "payload": {"used": 4}});
    assert_eq!(call(&http, post.clone(), format!("{base}/v1/jobs"), Some(batch)).await.0, 201);

    let stop = CancellationToken::new();
    let mut worker = Worker::new(Client::new(&base, None), "meter");
    worker.wait_seconds = 1;
    let running = tokio::spawn(worker.run(Arc::new(Meter), stop.clone()));
    let render = until_done(&http, &base, "render").await;
    let batch = until_done(&http, &base, "batch").await;
    stop.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(
        (render["cost"].clone(), render["hold"].clone(), render["net"].clone()),
        (json!(37), json!(100), json!(-37))
    );
    assert_eq!((batch["cost"].clone(), batch["net"].clone()), (json!(12), json!(-12)));

    // A success after the lease timed out and the rescuer refunded the hold: recovered at its price.
    let late = json!({"id": "late", "account_id": "a", "kind": "render", "hold": 100});
    assert_eq!(call(&http, post.clone(), format!("{base}/v1/jobs"), Some(late)).await.0, 201);
    let client = Client::new(&base, None);
    let claimed = client.claim("slow", &[], 1, Some(1), 1).await.unwrap();
    let token = claimed[0].lease_token.clone();
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    assert_eq!(served.store.rescue_expired_leases(10).await.unwrap(), ["late"]);
    let (_, refunded) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/late"), None).await;
    assert_eq!(refunded["net"], 0, "the hold was refunded: {refunded}");
    let costs = Costs::from([("main".to_owned(), 41)]);
    let report = client.succeed_priced("late", &token, None, &costs).await.unwrap();
    let job = report.value();
    assert_eq!(
        (job["state"].clone(), job["cost"].clone(), job["net"].clone()),
        (json!("succeeded"), json!(41), json!(-41))
    );
    let (_, account) = call(&http, reqwest::Method::GET, format!("{base}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 1000 - 37 - 12 - 41, "{account}");
    let (_, audit) = call(&http, reqwest::Method::GET, format!("{base}/v1/audit"), None).await;
    assert_eq!(audit["ok"], true, "{audit}");
    drop(served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_workers_price_held_jobs() {
    workers_price_held_jobs(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_workers_price_held_jobs() {
    workers_price_held_jobs(true).await;
}
