//! The SDK against a real server: a cancel that arrives mid-batch stops the worker at the next item
//! boundary — the item in hand is reported, no later item is, the job ends `cancelled`, and only
//! the items done stay charged.

use crate::common::call;

use serde_json::{Value, json};
use settle_client::{Client, Flow, Handler, JobContext, Outcome, Worker};
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;

/// Reports items in order; before reporting item `frame-2` it tells the test and waits until the
/// test has cancelled the job.
struct Batch {
    /// The item before whose report the handler pauses.
    pause_at: &'static str,
    reported: Mutex<Vec<String>>,
    at_frame_2: Notify,
    cancelled: Notify,
}

impl Batch {
    fn pausing_at_frame_2() -> Arc<Batch> {
        Arc::new(Batch {
            pause_at: "frame-2",
            reported: Mutex::new(Vec::new()),
            at_frame_2: Notify::new(),
            cancelled: Notify::new(),
        })
    }
}

/// Account `a` with 100 credits, and the job `batch` of `frames` items of 5 credits each (`extra`
/// fields added to the job's body).
async fn account_and_batch(http: &reqwest::Client, base: &str, frames: usize, extra: Value) {
    let post = reqwest::Method::POST;
    assert_eq!(call(http, post.clone(), format!("{base}/v1/accounts"), Some(json!({"id": "a"}))).await.0, 201);
    let grant = json!({"id": "g", "amount": 100});
    assert_eq!(call(http, post.clone(), format!("{base}/v1/accounts/a/grants"), Some(grant)).await.0, 201);
    let items: Vec<Value> = (0..frames).map(|f| json!({"id": format!("frame-{f}"), "cost": 5})).collect();
    let mut job = json!({"id": "batch", "account_id": "a", "kind": "render", "items": items});
    if let (Some(job), Some(extra)) = (job.as_object_mut(), extra.as_object()) {
        job.extend(extra.clone());
    }
    assert_eq!(call(http, post, format!("{base}/v1/jobs"), Some(job)).await.0, 201);
}

#[async_trait::async_trait]
impl Handler for Batch {
    async fn run(&self, ctx: &JobContext) -> Outcome {
        for item in ctx.job.items.iter().filter(|i| i.to_do()) {
            if item.id == self.pause_at {
                self.at_frame_2.notify_one();
                self.cancelled.notified().await;
            }
            let flow = ctx.item_done(&item.id).await.expect("item report");
            self.reported.lock().unwrap().push(item.id.clone());
            if flow == Flow::Stop {
                return Outcome::Cancelled;
            }
        }
        Outcome::Succeeded(None)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancel_stops_the_worker_at_the_next_item_boundary() {
    let served = crate::common::serve().await;
    let base = served.base.clone();

    let http = reqwest::Client::new();
    account_and_batch(&http, &base, 6, json!({})).await;

    let handler = Batch::pausing_at_frame_2();
    let stop = CancellationToken::new();
    let mut worker = Worker::new(Client::new(&base, None), "sdk");
    worker.wait_seconds = 1;
    worker.concurrency = 1;
    let running = tokio::spawn(worker.run(handler.clone(), stop.clone()));

    handler.at_frame_2.notified().await;
    let (status, cancelled) = call(&http, reqwest::Method::POST, format!("{base}/v1/jobs/batch/cancel"), None).await;
    assert_eq!(status, 202, "{cancelled}");
    handler.cancelled.notify_one();

    // The worker reports its outcome; the job ends cancelled.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let job = loop {
        let (_, job) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/batch"), None).await;
        if job["state"] == "cancelled" {
            break job;
        }
        assert!(std::time::Instant::now() < deadline, "the job did not end: {job}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    stop.cancel();
    running.await.unwrap().unwrap();
    // The item in hand when the cancel came was reported; none after it.
    assert_eq!(*handler.reported.lock().unwrap(), ["frame-0", "frame-1", "frame-2"]);
    let states: Vec<(&str, &str)> = job["items"]
        .as_array()
        .unwrap()
        .iter()
        .map(|i| (i["id"].as_str().unwrap(), i["state"].as_str().unwrap()))
        .collect();
    assert_eq!(
        states,
        [
            ("frame-0", "succeeded"),
            ("frame-1", "succeeded"),
            ("frame-2", "succeeded"),
            ("frame-3", "cancelled"),
            ("frame-4", "cancelled"),
            ("frame-5", "cancelled"),
        ]
    );
    let (_, account) = call(&http, reqwest::Method::GET, format!("{base}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 100 - 3 * 5, "only the items done stay charged: {account}");
    drop(served);
}

/// A stop mid-batch (the machine is being taken away: SIGTERM in a worker process) ends the job in
/// hand at the next item boundary too — but releases it: queued again, due at once, the attempt
/// closed `released` and not counted, nothing refunded; the next worker does only what is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_releases_the_job_at_the_next_item_boundary() {
    let served = crate::common::serve().await;
    let base = served.base.clone();
    let http = reqwest::Client::new();
    account_and_batch(&http, &base, 6, json!({"max_attempts": 1})).await;

    let handler = Batch::pausing_at_frame_2();
    let stop = CancellationToken::new();
    let mut worker = Worker::new(Client::new(&base, None), "preempted");
    worker.wait_seconds = 1;
    worker.concurrency = 1;
    let running = tokio::spawn(worker.run(handler.clone(), stop.clone()));
    handler.at_frame_2.notified().await;
    stop.cancel();
    handler.cancelled.notify_one();
    running.await.unwrap().unwrap();

    assert_eq!(*handler.reported.lock().unwrap(), ["frame-0", "frame-1", "frame-2"]);
    let (_, job) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/batch"), None).await;
    assert_eq!(job["state"], "queued", "{job}");
    let (_, attempts) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/batch/attempts"), None).await;
    assert_eq!(attempts["attempts"][0]["result"], "released", "{attempts}");
    let (_, account) = call(&http, reqwest::Method::GET, format!("{base}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 100 - 6 * 5, "nothing refunded: {account}");

    // The next worker does the three frames left; the release did not use up the one attempt.
    let after = Batch::pausing_at_frame_2();
    let stop = CancellationToken::new();
    let mut worker = Worker::new(Client::new(&base, None), "next");
    worker.wait_seconds = 1;
    let running = tokio::spawn(worker.run(after.clone(), stop.clone()));
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let job = loop {
        let (_, job) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/batch"), None).await;
        if job["state"] == "succeeded" {
            break job;
        }
        assert!(std::time::Instant::now() < deadline, "the job did not end: {job}");
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    stop.cancel();
    running.await.unwrap().unwrap();
    assert_eq!(*after.reported.lock().unwrap(), ["frame-3", "frame-4", "frame-5"]);
    assert_eq!(job["attempt"], 2);
    drop(served);
}

/// A stop that comes while the last item is being done lets the job finish: every item reported,
/// releasing it would leave finished work queued for a worker that may never come.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stop_during_the_last_item_lets_the_job_finish() {
    let served = crate::common::serve().await;
    let base = served.base.clone();
    let http = reqwest::Client::new();
    account_and_batch(&http, &base, 3, json!({})).await;
    let handler = Batch::pausing_at_frame_2();
    let stop = CancellationToken::new();
    let mut worker = Worker::new(Client::new(&base, None), "preempted");
    worker.wait_seconds = 1;
    let running = tokio::spawn(worker.run(handler.clone(), stop.clone()));
    handler.at_frame_2.notified().await;
    stop.cancel();
    handler.cancelled.notify_one();
    running.await.unwrap().unwrap();
    assert_eq!(*handler.reported.lock().unwrap(), ["frame-0", "frame-1", "frame-2"]);
    let (_, job) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/batch"), None).await;
    assert_eq!(job["state"], "succeeded", "{job}");
    drop(served);
}
