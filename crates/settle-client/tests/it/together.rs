//! The SDK worker sends the outcomes of jobs that finish together in one `POST /v1/reports`
//! (docs/design/reports.md §9), against a real server on both engines: every job ends as its
//! outcome says, the server counts fewer requests than reports, a report the route would refuse
//! whole goes alone without taking the others down, and the ledger audits clean.

use crate::common::call;

use serde_json::{Value, json};
use settle_client::{Client, ClientError, Failure, Handler, JobContext, JobReport, Outcome, Report, Signal, Worker};
use std::sync::Arc;
use tokio::sync::Barrier;
use tokio_util::sync::CancellationToken;

/// Each job's outcome is its payload's `outcome`; jobs are let go in waves of `wave`, so they
/// finish together.
struct Waves {
    barrier: Barrier,
}

#[async_trait::async_trait]
impl Handler for Waves {
    async fn run(&self, ctx: &JobContext) -> Outcome {
        self.barrier.wait().await;
        match ctx.job.payload["outcome"].as_str() {
            Some("fail") => Outcome::Failed(Failure {
                code: "BAD_INPUT".into(),
                message: "x".repeat(ctx.job.payload["message_bytes"].as_u64().unwrap_or(10) as usize),
                retryable: Some(false),
                retry_after_ms: None,
            }),
            Some("unknown") => Outcome::Unknown("the farm did not answer".into()),
            _ => Outcome::Succeeded(Some(json!({"done": ctx.job.id}))),
        }
    }
}

/// The value of every sample of `family` whose labels contain `labels`, summed.
async fn metric(http: &reqwest::Client, base: &str, family: &str, labels: &str) -> f64 {
    let text = http.get(format!("{base}/metrics")).send().await.unwrap().text().await.unwrap();
    text.lines()
        .filter(|l| l.starts_with(&format!("{family}{{")) && l.contains(labels))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

async fn until_settled(http: &reqwest::Client, base: &str, jobs: &[(String, &str)]) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    for (id, want) in jobs {
        loop {
            let (_, job) = call(http, reqwest::Method::GET, format!("{base}/v1/jobs/{id}"), None).await;
            if job["state"] == *want {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{id} is not {want}: {job}");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
}

/// A server on one engine with account `a` granted `amount`: the server, its base URL, a client.
async fn funded(postgres: bool, amount: i64) -> (crate::common::Served, String, reqwest::Client) {
    let served = crate::common::serve_on(postgres).await;
    let base = served.base.clone();
    let http = reqwest::Client::new();
    let (s, _) = call(&http, reqwest::Method::POST, format!("{base}/v1/accounts"), Some(json!({"id": "a"}))).await;
    assert_eq!(s, 201);
    let grant = json!({"id": "g", "amount": amount});
    let (s, _) = call(&http, reqwest::Method::POST, format!("{base}/v1/accounts/a/grants"), Some(grant)).await;
    assert_eq!(s, 201);
    (served, base, http)
}

async fn jobs_finishing_together_are_reported_together(postgres: bool) {
    let (served, base, http) = funded(postgres, 10_000).await;
    let mut expect = Vec::new();
    for i in 0..48 {
        let (outcome, state) = [("succeed", "succeeded"), ("fail", "dead"), ("unknown", "unknown")][i % 3];
        let id = format!("j{i:02}");
        let body = json!({"id": id, "account_id": "a", "kind": "render", "cost": 3,
                          "payload": {"outcome": outcome}, "max_attempts": 1});
        let (s, job) = call(&http, reqwest::Method::POST, format!("{base}/v1/jobs"), Some(body)).await;
        assert_eq!(s, 201, "{job}");
        expect.push((id, state));
    }
    let stop = CancellationToken::new();
    let mut worker = Worker::new(Client::new(&base, None), "together");
    (worker.concurrency, worker.wait_seconds, worker.lease_seconds) = (16, 1, Some(60));
    let running = tokio::spawn(worker.run(Arc::new(Waves { barrier: Barrier::new(16) }), stop.clone()));
    until_settled(&http, &base, &expect).await;
    stop.cancel();
    running.await.unwrap().unwrap();

    // 48 outcomes: some in requests of several (16 finish at once, at most 16 requests in flight).
    let carried = metric(&http, &base, "settle_reports_total", "").await;
    let requests = metric(&http, &base, "settle_http_requests_total", "route=\"/v1/reports\"").await;
    let alone = metric(&http, &base, "settle_http_requests_total", "/succeed\"").await
        + metric(&http, &base, "settle_http_requests_total", "/fail\"").await
        + metric(&http, &base, "settle_http_requests_total", "/unknown\"").await;
    assert_eq!(carried + alone, 48.0, "every outcome reported once: {carried} together, {alone} alone");
    assert!(requests >= 1.0 && requests < carried, "{carried} reports in {requests} requests");
    // Every refunded failure and each success's charge, as the single routes would have left them.
    let (_, account) = call(&http, reqwest::Method::GET, format!("{base}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 10_000 - 3 * 32, "the failures refunded, the rest charged: {account}");
    let (_, audit) = call(&http, reqwest::Method::GET, format!("{base}/v1/audit"), None).await;
    assert_eq!(audit["ok"], true, "{audit}");
    drop(served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_jobs_finishing_together_are_reported_together() {
    jobs_finishing_together_are_reported_together(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_jobs_finishing_together_are_reported_together() {
    jobs_finishing_together_are_reported_together(true).await;
}

/// `Client::reports`: each answer in order, a refused one its own error; an id that is no id is
/// not sent; a request the route refuses whole is the call's error, nothing written.
async fn many_reports_answer_one_by_one(postgres: bool) {
    let (served, base, http) = funded(postgres, 100).await;
    for id in ["x", "y"] {
        let body = json!({"id": id, "account_id": "a", "kind": "render", "cost": 10});
        assert_eq!(call(&http, reqwest::Method::POST, format!("{base}/v1/jobs"), Some(body)).await.0, 201);
    }
    let c = Client::new(&base, None);
    let jobs = c.claim("w", &[], 2, Some(30), 0).await.unwrap();
    let token = |id: &str| jobs.iter().find(|j| j.id == id).unwrap().lease_token.clone();
    let success = |id: &str, token: String| JobReport {
        job_id: id.into(),
        lease_token: token,
        signal: Signal::Succeed { result: None, costs: Default::default() },
    };
    let fail = |long: usize| JobReport {
        job_id: "y".into(),
        lease_token: token("y"),
        signal: Signal::Fail(Failure {
            code: "BAD_INPUT".into(),
            message: "m".repeat(long),
            retryable: Some(false),
            retry_after_ms: None,
        }),
    };

    // A message over the route's 2,000 bytes refuses the whole request: nothing is written.
    match c.reports(&[success("x", token("x")), fail(2_001)]).await {
        Err(ClientError::Api { status: 400, .. }) => {}
        other => panic!("{other:?}"),
    }
    let (_, x) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/x"), None).await;
    assert_eq!(x["state"], "running", "{x}");

    let bad_id = JobReport { job_id: "../x".into(), ..success("x", token("x")) };
    let body = json!({"id": "z", "account_id": "a", "kind": "render", "cost": 10});
    assert_eq!(call(&http, reqwest::Method::POST, format!("{base}/v1/jobs"), Some(body)).await.0, 201);
    let answers = c.reports(&[success("x", token("x")), bad_id, success("z", "never-issued".into()), fail(5)]).await;
    let answers = answers.unwrap();
    assert!(matches!(&answers[0], Ok(Report::Applied(v)) if v["state"] == "succeeded" && v["net"] == -10));
    assert!(matches!(&answers[1], Err(ClientError::InvalidId(_))), "{:?}", answers[1]);
    match &answers[2] {
        Err(ClientError::LeaseLost { details, .. }) => {
            assert_eq!((details["lease"].as_str(), details["state"].as_str()), (Some("never_issued"), Some("queued")))
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(&answers[3], Ok(Report::Applied(v)) if v["state"] == "dead"), "{:?}", answers[3]);
    // Sent again (an answer lost): each that took effect is a replay.
    let again = c.reports(&[success("x", token("x")), fail(5)]).await.unwrap();
    assert!(again.iter().all(|a| matches!(a, Ok(r) if r.is_replay())), "{again:?}");
    let (_, account) = call(&http, reqwest::Method::GET, format!("{base}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], 80, "x and z charged, y refunded: {account}");
    drop(served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_many_reports_answer_one_by_one() {
    many_reports_answer_one_by_one(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_many_reports_answer_one_by_one() {
    many_reports_answer_one_by_one(true).await;
}

/// A failure whose message the route would refuse whole goes by its own route (and is refused
/// there, alone); the jobs that finished with it are reported and end as they should.
async fn a_report_the_route_refuses_whole_goes_alone(postgres: bool) {
    let (served, base, http) = funded(postgres, 100).await;
    let mut expect = Vec::new();
    for i in 0..4 {
        let payload: Value =
            if i == 0 { json!({"outcome": "fail", "message_bytes": 2_001}) } else { json!({"outcome": "succeed"}) };
        let id = format!("k{i}");
        let body = json!({"id": id, "account_id": "a", "kind": "render", "cost": 1, "payload": payload});
        assert_eq!(call(&http, reqwest::Method::POST, format!("{base}/v1/jobs"), Some(body)).await.0, 201);
        if i > 0 {
            expect.push((id, "succeeded"));
        }
    }
    let stop = CancellationToken::new();
    let mut worker = Worker::new(Client::new(&base, None), "together");
    (worker.concurrency, worker.wait_seconds, worker.lease_seconds) = (4, 1, Some(60));
    let running = tokio::spawn(worker.run(Arc::new(Waves { barrier: Barrier::new(4) }), stop.clone()));
    until_settled(&http, &base, &expect).await;
    stop.cancel();
    running.await.unwrap().unwrap();
    // Its single route refused it (400, nothing written): the job waits for its lease to lapse.
    let (_, k0) = call(&http, reqwest::Method::GET, format!("{base}/v1/jobs/k0"), None).await;
    assert_eq!(k0["state"], "running", "{k0}");
    let refused = metric(&http, &base, "settle_http_requests_total", "/fail\",status=\"400\"").await;
    assert_eq!(refused, 1.0, "the long failure went alone");
    assert_eq!(metric(&http, &base, "settle_http_requests_total", "route=\"/v1/reports\",status=\"400\"").await, 0.0);
    drop(served);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_report_the_route_refuses_whole_goes_alone() {
    a_report_the_route_refuses_whole_goes_alone(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_report_the_route_refuses_whole_goes_alone() {
    a_report_the_route_refuses_whole_goes_alone(true).await;
}
