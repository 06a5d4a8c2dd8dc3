//! `POST /v1/reports` (decision 0041): many worker signals in one request, each its own guarded
//! transition answered as its single route would answer it; refused whole, with nothing written,
//! only for what the single routes refuse before the store. Over real HTTP, both engines.

use crate::kit::*;
use serde_json::{Value, json};
use settle_api::{AbuseLimits, HttpLimits, Role, Tokens};
use settle_core::scope::Scope;

on_both_engines!(
    each_report_is_answered_as_its_single_route,
    a_report_sent_again_converges,
    a_request_refused_whole_writes_nothing,
    the_reports_count_against_the_token_rate,
    a_scoped_worker_reports_only_its_kinds,
    a_report_not_finished_by_the_deadline_is_answered_503_and_runs_to_its_end,
);

const WORKER: &str = "worker-token-for-reports-01";
const ADMIN: &str = "admin-token-for-reports-0001";

async fn server(e: Engine) -> Server {
    let mut t = Tokens::default();
    t.add(Role::Admin, ADMIN).unwrap();
    t.add(Role::Worker, WORKER).unwrap();
    let mut s = Server::with_tokens(e, t).await;
    s.token = Some(ADMIN.into());
    s.account("acme", 1_000).await;
    s
}

/// `n` jobs of cost 10 on `acme`, claimed by one worker: (job id, lease token), in id order.
async fn claimed(s: &Server, n: usize) -> Vec<(String, String)> {
    for i in 0..n {
        let r = s
            .post(
                "/v1/jobs",
                json!({"id": format!("j{i}"), "account_id": "acme", "kind": "render",
                                             "cost": 10, "max_attempts": 3}),
            )
            .await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let r = s.send("POST", "/v1/claims", Some(json!({"worker": "w1", "limit": n})), Some(WORKER)).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let mut out: Vec<(String, String)> = r.body["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| (j["id"].as_str().unwrap().to_owned(), j["lease_token"].as_str().unwrap().to_owned()))
        .collect();
    out.sort();
    assert_eq!(out.len(), n);
    out
}

async fn report(s: &Server, reports: Value) -> Reply {
    s.send("POST", "/v1/reports", Some(json!({ "reports": reports })), Some(WORKER)).await
}

fn results(r: &Reply) -> &Vec<Value> {
    assert_eq!(r.status, 200, "{}", r.body);
    r.body["results"].as_array().unwrap()
}

/// A mix of every kind of report, one refused for its token and one for its job, answered in the
/// request's order with what each single route answers; the money moved once, by the failure.
async fn each_report_is_answered_as_its_single_route(e: Engine) {
    let s = server(e).await;
    let jobs = claimed(&s, 6).await;
    assert_eq!(s.balance("acme").await, 940);
    let t = |i: usize| jobs[i].1.clone();
    let r = report(
        &s,
        json!([
            {"job_id": "j0", "outcome": "succeed", "lease_token": t(0), "result": {"frames": 3}},
            {"job_id": "j1", "outcome": "fail", "lease_token": t(1), "code": "OOM", "retryable": false},
            {"job_id": "j2", "outcome": "release", "lease_token": t(2)},
            {"job_id": "j3", "outcome": "unknown", "lease_token": t(3), "message": "the answer was lost"},
            {"job_id": "j4", "outcome": "heartbeat", "lease_token": t(4)},
            {"job_id": "j5", "outcome": "fail", "lease_token": "never-issued-token", "code": "OOM"},
            {"job_id": "nope", "outcome": "succeed", "lease_token": t(0)},
        ]),
    )
    .await;
    let got = results(&r);
    let ids: Vec<&str> = got.iter().map(|x| x["job_id"].as_str().unwrap()).collect();
    assert_eq!(ids, ["j0", "j1", "j2", "j3", "j4", "j5", "nope"], "in the request's order");
    let states: Vec<&str> = got[..4].iter().map(|x| x["job"]["state"].as_str().unwrap()).collect();
    assert_eq!(states, ["succeeded", "dead", "queued", "unknown"]);
    for x in &got[..4] {
        assert_eq!((x["status"].as_u64(), x["replayed"].as_bool()), (Some(200), Some(false)), "{x}");
        assert!(x.get("error").is_none() && x["job"].get("payload").is_none(), "a job in brief: {x}");
    }
    assert_eq!(got[1]["job"]["last_error"]["code"], "OOM");
    assert_eq!(got[1]["job"]["net"], 0, "the failure refunded its charge");
    assert_eq!(got[4]["status"], 200);
    assert!(got[4]["heartbeat"]["lease_expires_at"].is_string() && got[4].get("replayed").is_none(), "{}", got[4]);
    assert_eq!((got[5]["status"].as_u64(), got[5]["error"]["code"].as_str()), (Some(409), Some("lease_lost")));
    assert_eq!(got[5]["error"]["details"]["lease"], "never_issued", "the single route's details");
    assert_eq!((got[6]["status"].as_u64(), got[6]["error"]["code"].as_str()), (Some(404), Some("not_found")));
    assert_eq!(s.balance("acme").await, 950, "one refund, of the failed job");
    // Each job is as its single route would have left it, and the single routes agree.
    let single = s
        .send(
            "POST",
            "/v1/jobs/j1/fail",
            Some(json!({"lease_token": t(1), "code": "OOM",
                                                                  "retryable": false})),
            Some(WORKER),
        )
        .await;
    assert_eq!((single.status, single.replayed, single.body["state"].as_str()), (200, true, Some("dead")));
    let single = s
        .send(
            "POST",
            "/v1/jobs/j5/fail",
            Some(json!({"lease_token": "never-issued-token",
                                                                  "code": "OOM"})),
            Some(WORKER),
        )
        .await;
    assert_eq!((single.status, &single.body["error"]), (409, &got[5]["error"]));
    assert_eq!(s.get("/v1/jobs/j5").await.body["state"], "running", "a refused report wrote nothing");
    assert_eq!(s.get("/v1/jobs/j0").await.body["result"], json!({"frames": 3}));
}

/// The same request sent again after its answer was lost: every report that took effect is a
/// replay, nothing moves twice.
async fn a_report_sent_again_converges(e: Engine) {
    let s = server(e).await;
    let jobs = claimed(&s, 4).await;
    let body = json!([
        {"job_id": "j0", "outcome": "succeed", "lease_token": jobs[0].1},
        {"job_id": "j1", "outcome": "fail", "lease_token": jobs[1].1, "code": "TIMEOUT", "retryable": false},
        {"job_id": "j2", "outcome": "release", "lease_token": jobs[2].1},
        {"job_id": "j3", "outcome": "unknown", "lease_token": jobs[3].1},
    ]);
    let first = report(&s, body.clone()).await;
    assert!(results(&first).iter().all(|x| x["replayed"] == false), "{}", first.body);
    let balance = s.balance("acme").await;
    let ledger = s.get("/v1/accounts/acme/ledger").await.body["entries"].as_array().unwrap().len();
    let again = report(&s, body).await;
    for (a, b) in results(&first).iter().zip(results(&again)) {
        assert_eq!((b["status"].as_u64(), b["replayed"].as_bool()), (Some(200), Some(true)), "{b}");
        assert_eq!(a["job"]["state"], b["job"]["state"]);
    }
    assert_eq!(s.balance("acme").await, balance);
    assert_eq!(s.get("/v1/accounts/acme/ledger").await.body["entries"].as_array().unwrap().len(), ledger);
}

/// A report still running at the request's deadline is answered `503` on its own ("it may yet take
/// effect: send it again"), runs to its end anyway, and the request sent again is answered as
/// replays, nothing written twice. The deadline is zero here, so no report can be answered in time.
async fn a_report_not_finished_by_the_deadline_is_answered_503_and_runs_to_its_end(e: Engine) {
    let mut t = Tokens::default();
    t.add(Role::Admin, ADMIN).unwrap();
    t.add(Role::Worker, WORKER).unwrap();
    let limits = HttpLimits { reports_deadline: std::time::Duration::ZERO, ..HttpLimits::default() };
    let mut s = Server::with_limits(e, t, |_| {}, limits).await;
    s.token = Some(ADMIN.into());
    s.account("acme", 1_000).await;
    let jobs = claimed(&s, 3).await;
    let body = json!([
        {"job_id": "j0", "outcome": "succeed", "lease_token": jobs[0].1},
        {"job_id": "j1", "outcome": "fail", "lease_token": jobs[1].1, "code": "TIMEOUT", "retryable": false},
        {"job_id": "j2", "outcome": "unknown", "lease_token": jobs[2].1},
    ]);
    let late = report(&s, body.clone()).await;
    assert_eq!(late.status, 200, "{}", late.body);
    // A report whose task ended before the handler first looked at it is answered with its
    // outcome even at a zero deadline (the deadline is checked after a first look; under load one
    // of three once was): each answer is the 503 or the report's own outcome, and most are 503.
    let mut unavailable = 0;
    for (r, state) in results(&late).iter().zip(["succeeded", "dead", "unknown"]) {
        if r["status"].as_u64() == Some(200) {
            assert_eq!(r["job"]["state"], state, "{r}");
            continue;
        }
        assert_eq!((r["status"].as_u64(), r["error"]["code"].as_str()), (Some(503), Some("unavailable")), "{r}");
        assert!(r["error"]["message"].as_str().unwrap().contains("may yet take effect"), "{r}");
        unavailable += 1;
    }
    assert!(unavailable > 0, "no report answered 503 at a zero deadline: {}", late.body);
    // Each report ran to its end after its answer.
    for (j, state) in [("j0", "succeeded"), ("j1", "dead"), ("j2", "unknown")] {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
        loop {
            let job = s.get(&format!("/v1/jobs/{j}")).await.body;
            if job["state"] == state {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "{j} is not {state}: {job}");
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }
    let (balance, lines) = (s.balance("acme").await, s.get("/v1/accounts/acme/ledger").await.body["entries"].clone());
    assert_eq!(balance, 1_000 - 20, "j0 and j2 charged, j1 refunded");
    // Sent again as the answer said: each is a replay (answered `503` again only if still late, which
    // a zero deadline makes every time — so the single routes answer the re-send here).
    for (j, outcome, extra) in [
        ("j0", "succeed", json!({})),
        ("j1", "fail", json!({"code": "TIMEOUT", "retryable": false})),
        ("j2", "unknown", json!({})),
    ] {
        let mut b = extra;
        b["lease_token"] = json!(jobs.iter().find(|(id, _)| id == j).unwrap().1);
        let r = s.send("POST", &format!("/v1/jobs/{j}/{outcome}"), Some(b), Some(WORKER)).await;
        assert_eq!(r.status, 200, "{j}: {}", r.body);
        assert!(r.replayed, "{j}: {}", r.body);
    }
    assert_eq!(s.balance("acme").await, balance);
    assert_eq!(s.get("/v1/accounts/acme/ledger").await.body["entries"], lines, "nothing written twice");
}

/// What the single routes refuse before the store refuses the whole request: `400`, and not one
/// report of it ran.
async fn a_request_refused_whole_writes_nothing(e: Engine) {
    let s = server(e).await;
    let jobs = claimed(&s, 2).await;
    let ok = json!({"job_id": "j0", "outcome": "succeed", "lease_token": jobs[0].1});
    let many: Vec<Value> = (0..101)
        .map(|i| {
            json!({"job_id": format!("x{i}"), "outcome": "heartbeat",
                                                     "lease_token": "t"})
        })
        .collect();
    let refused = [
        (json!([]), "1 to 100"),
        (Value::Array(many), "1 to 100"),
        (json!([ok, {"job_id": "j0", "outcome": "heartbeat", "lease_token": jobs[0].1}]), "twice"),
        (
            json!([ok, {"job_id": "j1", "outcome": "fail", "lease_token": jobs[1].1, "code": "OOM", "colour": 1}]),
            "colour",
        ),
        (json!([ok, {"job_id": "j1", "outcome": "explode", "lease_token": jobs[1].1}]), "explode"),
        (json!([ok, {"job_id": "j1", "outcome": "succeed"}]), "lease_token"),
        (
            json!([ok, {"job_id": "j1", "outcome": "fail", "lease_token": jobs[1].1, "code": "out of memory"}]),
            "Report 1",
        ),
        (
            json!([ok, {"job_id": "j1", "outcome": "unknown", "lease_token": jobs[1].1, "message": "m".repeat(2_001)}]),
            "2000 bytes",
        ),
        (json!([ok, {"job_id": "../j1", "outcome": "release", "lease_token": jobs[1].1}]), "Report 1"),
        (
            json!([ok, {"job_id": "j1", "outcome": "succeed", "lease_token": jobs[1].1, "cost": 1, "costs": {}}]),
            "at most one",
        ),
        (json!([ok, {"job_id": "j1", "outcome": "heartbeat", "lease_token": ""}]), "lease_token"),
    ];
    for (reports, says) in refused {
        let r = report(&s, reports).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{}", r.body);
        let message = r.body["error"]["message"].as_str().unwrap();
        assert!(message.contains(says), "{says:?} not in {message:?}");
    }
    let r = s.send("POST", "/v1/reports", Some(json!({"reports": [ok], "extra": true})), Some(WORKER)).await;
    assert_eq!(r.status, 400, "{}", r.body);
    let r = s.send("POST", "/v1/reports", Some(json!({"reports": [ok]})), Some("not-a-token-of-this-server")).await;
    assert_eq!(r.status, 401, "{}", r.body);
    for j in ["j0", "j1"] {
        assert_eq!(s.get(&format!("/v1/jobs/{j}")).await.body["state"], "running", "{j} untouched");
    }
    assert_eq!(s.balance("acme").await, 980);
}

/// A request of `n` reports takes `n` from the token's bucket, all or none.
async fn the_reports_count_against_the_token_rate(e: Engine) {
    let mut t = Tokens::default();
    t.add(Role::Admin, ADMIN).unwrap();
    t.add(Role::Worker, WORKER).unwrap();
    let limits = HttpLimits {
        abuse: AbuseLimits { requests_per_second: 0.01, burst: 8.0, long_polls: 4 },
        ..HttpLimits::default()
    };
    let mut s = Server::with_limits(e, t, |_| {}, limits).await;
    s.token = Some(ADMIN.into());
    s.account("acme", 1_000).await;
    for i in 0..5 {
        let r =
            s.post("/v1/jobs", json!({"id": format!("j{i}"), "account_id": "acme", "kind": "render", "cost": 1})).await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    // The worker's bucket: 8. One claim leaves 7; a request of five reports leaves 2, and the next
    // five find two.
    let r = s.send("POST", "/v1/claims", Some(json!({"worker": "w", "limit": 5})), Some(WORKER)).await;
    let tokens: Vec<(String, String)> = r.body["jobs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|j| (j["id"].as_str().unwrap().to_owned(), j["lease_token"].as_str().unwrap().to_owned()))
        .collect();
    let body: Vec<Value> =
        tokens.iter().map(|(id, t)| json!({"job_id": id, "outcome": "succeed", "lease_token": t})).collect();
    let one_more = json!([{"job_id": tokens[0].0, "outcome": "heartbeat", "lease_token": tokens[0].1},
                          {"job_id": tokens[1].0, "outcome": "heartbeat", "lease_token": tokens[1].1},
                          {"job_id": tokens[2].0, "outcome": "heartbeat", "lease_token": tokens[2].1},
                          {"job_id": tokens[3].0, "outcome": "heartbeat", "lease_token": tokens[3].1},
                          {"job_id": tokens[4].0, "outcome": "heartbeat", "lease_token": tokens[4].1}]);
    let r = report(&s, Value::Array(body)).await;
    assert!(results(&r).iter().all(|x| x["job"]["state"] == "succeeded"), "{}", r.body);
    let r = report(&s, one_more).await;
    assert_eq!((r.status, code(&r)), (429, "rate_limited"), "{}", r.body);
    // The refused request took only the door's one: one is left for the next request.
    let r = s.send("POST", "/v1/claims", Some(json!({"worker": "w"})), Some(WORKER)).await;
    assert_eq!(r.status, 200, "the refused reports took nothing from the bucket: {}", r.body);
}

/// A worker token scoped to a kind: a report on another kind's job is `404` on its own, as on the
/// single route; the others take effect.
async fn a_scoped_worker_reports_only_its_kinds(e: Engine) {
    const GPU: &str = "render-worker-token-scoped-01";
    let mut t = Tokens::default();
    t.add(Role::Admin, ADMIN).unwrap();
    t.add(Role::Worker, WORKER).unwrap();
    t.add_scoped(Role::Worker, GPU, "gpu", Scope::parse_words(["kinds=render"]).unwrap()).unwrap();
    let mut s = Server::with_tokens(e, t).await;
    s.token = Some(ADMIN.into());
    s.account("acme", 1_000).await;
    for (id, kind) in [("r1", "render"), ("m1", "mail")] {
        let r = s.post("/v1/jobs", json!({"id": id, "account_id": "acme", "kind": kind, "cost": 5})).await;
        assert_eq!(r.status, 201, "{}", r.body);
    }
    let r = s.send("POST", "/v1/claims", Some(json!({"worker": "w", "limit": 2})), Some(WORKER)).await;
    let token =
        |id: &str| r.body["jobs"].as_array().unwrap().iter().find(|j| j["id"] == id).unwrap()["lease_token"].clone();
    let body = json!({"reports": [
        {"job_id": "m1", "outcome": "succeed", "lease_token": token("m1")},
        {"job_id": "r1", "outcome": "succeed", "lease_token": token("r1")},
    ]});
    let out = s.send("POST", "/v1/reports", Some(body), Some(GPU)).await;
    let got = results(&out);
    assert_eq!((got[0]["status"].as_u64(), got[0]["error"]["code"].as_str()), (Some(404), Some("not_found")));
    assert_eq!(got[1]["job"]["state"], "succeeded");
    assert_eq!(s.get("/v1/jobs/m1").await.body["state"], "running");
}
