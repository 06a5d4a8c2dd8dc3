//! An example worker built on the `settle-client` SDK: it renders the frames of a job one item at a
//! time, and its jobs' payloads can ask it to misbehave, so the tests can play every story:
//!
//! `{"sleep_ms": 20, "fail": "NODE_DOWN", "fail_attempts": 1, "fail_item": "frame-2", "unknown": true}`
//! - `sleep_ms`: work per item;
//! - `fail` / `fail_attempts`: fail the job with that code on its first N attempts (the server decides
//!   whether the code retries);
//! - `fail_item`: report that item failed (it is refunded; the job goes on);
//! - `unknown`: on the first attempt, report an unknown outcome;
//! - `no_items`: do the whole job in one go (sleep) and report only its success.
//!
//! Usage: `settle-example-worker URL NAME [--token T] [--concurrency N] [--heartbeat-ms MS]
//! [--lease-seconds S] [--reports-per-request N] [--exit-when-idle]` — with `--exit-when-idle` it stops once no job is
//! queued, running or cancelling; `--reports-per-request 1` sends each job's outcome by its own route.

use serde_json::Value;
use settle_client::{Client, Failure, Flow, Handler, JobContext, Outcome, Worker};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

struct Frames;

#[async_trait::async_trait]
impl Handler for Frames {
    async fn run(&self, ctx: &JobContext) -> Outcome {
        let p = &ctx.job.payload;
        let sleep = Duration::from_millis(p["sleep_ms"].as_u64().unwrap_or(10));
        if let Some(code) = p["fail"].as_str()
            && u64::from(ctx.job.attempt) <= p["fail_attempts"].as_u64().unwrap_or(u64::MAX)
        {
            tokio::time::sleep(sleep).await;
            return Outcome::Failed(Failure {
                code: code.to_owned(),
                message: "asked to fail".into(),
                retryable: None,
                retry_after_ms: Some(50),
            });
        }
        if p["unknown"].as_bool() == Some(true) && ctx.job.attempt == 1 {
            return Outcome::Unknown("the render farm did not answer".into());
        }
        if p["no_items"].as_bool() == Some(true) {
            // Whole-job work: no item reports; the success decides the items.
            tokio::time::sleep(sleep).await;
            return Outcome::Succeeded(None);
        }
        let mut done = 0;
        for item in &ctx.job.items {
            if !item.to_do() {
                continue;
            }
            // A cancel (the job ends) or this worker stopping (the job is released).
            if ctx.stopping() {
                return Outcome::Cancelled;
            }
            tokio::time::sleep(sleep).await;
            let flow = if p["fail_item"].as_str() == Some(item.id.as_str()) {
                ctx.item_failed(&item.id, "BAD_FRAME", "the frame could not be rendered").await
            } else {
                ctx.item_done(&item.id).await
            };
            match flow {
                Ok(Flow::Continue) => done += 1,
                Ok(Flow::Stop) => return Outcome::Cancelled,
                Err(e) => {
                    return Outcome::Failed(Failure {
                        code: "UNAVAILABLE".into(),
                        message: e.to_string(),
                        retryable: Some(true),
                        retry_after_ms: None,
                    });
                }
            }
        }
        Outcome::Succeeded(Some(serde_json::json!({"frames": done})))
    }
}

async fn idle(url: &str, token: Option<&str>) -> bool {
    let http = reqwest::Client::new();
    for state in ["queued", "running", "cancelling"] {
        let mut req = http.get(format!("{url}/v1/jobs?state={state}&limit=1"));
        if let Some(t) = token {
            req = req.bearer_auth(t);
        }
        let Ok(resp) = req.send().await else { return false };
        let Ok(v) = resp.json::<Value>().await else { return false };
        if v["jobs"].as_array().is_none_or(|j| !j.is_empty()) {
            return false;
        }
    }
    true
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::from_default_env())
        .with_writer(std::io::stderr)
        .init();
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (Some(url), Some(name)) = (args.first(), args.get(1)) else {
        eprintln!(
            "usage: settle-example-worker URL NAME [--token T] [--concurrency N] [--heartbeat-ms MS] \
             [--reports-per-request N] [--exit-when-idle]"
        );
        std::process::exit(2);
    };
    let flag = |f: &str| args.iter().position(|a| a == f).and_then(|i| args.get(i + 1)).cloned();
    let token = flag("--token");
    let client = Client::new(url, token.as_deref());
    let mut worker = Worker::new(client, name);
    worker.concurrency = flag("--concurrency").and_then(|v| v.parse().ok()).unwrap_or(4);
    worker.heartbeat_every =
        Duration::from_millis(flag("--heartbeat-ms").and_then(|v| v.parse().ok()).unwrap_or(1_000));
    worker.wait_seconds = 1;
    if let Some(n) = flag("--reports-per-request").and_then(|v| v.parse().ok()) {
        worker.reports_per_request = n;
    }
    let stop = CancellationToken::new();
    if args.iter().any(|a| a == "--exit-when-idle") {
        let (stop, url, token) = (stop.clone(), url.clone(), token.clone());
        tokio::spawn(async move {
            let mut quiet = 0;
            loop {
                tokio::time::sleep(Duration::from_millis(300)).await;
                quiet = if idle(&url, token.as_deref()).await { quiet + 1 } else { 0 };
                if quiet >= 3 {
                    stop.cancel();
                    return;
                }
            }
        });
    }
    // SIGINT or SIGTERM: stop claiming; the job in hand is released at its next item boundary.
    let signalled = stop.clone();
    tokio::spawn(async move {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = async { match term.as_mut() { Some(t) => { t.recv().await; } None => std::future::pending().await } } => {}
        }
        signalled.cancel();
    });
    if let Err(e) = worker.run(Arc::new(Frames), stop).await {
        eprintln!("{name}: {e}");
        std::process::exit(1);
    }
    println!("{name}: done");
}
