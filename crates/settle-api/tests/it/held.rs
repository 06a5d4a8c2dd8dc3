//! Held items over HTTP (issue 23, docs/decisions/0022): a job made with `hold`, priced by its
//! success; every malformed or impossible price a clear 4xx that writes nothing (ledger, outbox and
//! job unchanged), on both engines.

use crate::kit::*;
use serde_json::{Value, json};

on_both_engines!(
    a_held_job_is_priced_by_its_success,
    bad_holds_and_prices_write_nothing,
    accounts_listed_answers_ended_events_shaped,
);

async fn ledger(s: &Server, account: &str) -> Value {
    s.get(&format!("/v1/accounts/{account}/ledger")).await.body["entries"].clone()
}

async fn events(s: &Server) -> Value {
    s.get("/v1/events?limit=1000").await.body["events"].clone()
}

async fn a_held_job_is_priced_by_its_success(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 1_000).await;
    let r = s.post("/v1/jobs", json!({"id": "render-1", "account_id": "a", "kind": "render", "hold": 100})).await;
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!((r.body["cost"].clone(), r.body["hold"].clone()), (Value::Null, json!(100)));
    assert_eq!(r.body["items"][0]["hold"], 100);
    assert_eq!(r.body["items"][0]["cost"], Value::Null);
    assert_eq!(s.balance("a").await, 900);
    let (id, token) = s.claim().await;
    let r = s.post(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": token, "cost": 37})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.body["cost"].clone(), r.body["net"].clone()), (json!(37), json!(-37)));
    assert_eq!(r.body["items"][0]["cost"], 37);
    assert_eq!(s.balance("a").await, 963);
    let entries = ledger(&s, "a").await;
    let last = &entries.as_array().unwrap()[2];
    assert_eq!((last["kind"].as_str(), last["amount"].as_i64()), (Some("release"), Some(63)));
    // Re-sent with another price: a replay, the first price stays.
    let r = s.post(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": token, "cost": 50})).await;
    assert_eq!((r.status, r.replayed), (200, true));
    assert_eq!(r.body["cost"], 37);
    // Items: a fixed item and a held one in one job, priced by `costs` and by an item report.
    let body = json!({"id": "batch-1", "account_id": "a", "kind": "render",
        "items": [{"id": "frame-1", "cost": 10}, {"id": "frame-2", "hold": 30}, {"id": "frame-3", "hold": 20}]});
    assert_eq!(s.post("/v1/jobs", body).await.status, 201);
    let (id, token) = s.claim().await;
    let r = s.post(&format!("/v1/jobs/{id}/items/frame-2/succeed"), json!({"lease_token": token, "cost": 12})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!((r.body["item"]["cost"].clone(), r.body["item"]["hold"].clone()), (json!(12), json!(30)));
    let r = s.post(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": token, "costs": {"frame-3": 20}})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (r.body["cost"].clone(), r.body["hold"].clone(), r.body["net"].clone()),
        (json!(42), json!(50), json!(-42))
    );
    let audit = s.get("/v1/audit").await;
    assert_eq!(audit.status, 200, "{}", audit.body);
    assert_eq!(audit.body["ok"], true, "{}", audit.body);
}

async fn bad_holds_and_prices_write_nothing(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 1_000).await;
    let job = |extra: Value| {
        let mut b = json!({"id": "j", "account_id": "a", "kind": "render"});
        b.as_object_mut().unwrap().extend(extra.as_object().unwrap().clone());
        b
    };
    let before = (ledger(&s, "a").await, events(&s).await);
    for (body, status) in [
        (job(json!({"hold": 0})), 400),
        (job(json!({"hold": -5})), 400),
        (job(json!({"hold": 10, "cost": 10})), 400),
        (job(json!({})), 400),
        (job(json!({"items": [{"id": "x", "hold": 5, "cost": 5}]})), 400),
        (job(json!({"items": [{"id": "x"}]})), 400),
        (job(json!({"items": [{"id": "x", "hold": 0}]})), 400),
        (job(json!({"hold": i64::MAX})), 400),
        (job(json!({"items": [{"id": "x", "hold": i64::MAX}, {"id": "y", "hold": i64::MAX}]})), 400),
        (job(json!({"hold": 5_000})), 402),
        (job(json!({"hold": 10, "holds": 3})), 400),
    ] {
        let r = s.post("/v1/jobs", body.clone()).await;
        assert_eq!(r.status, status, "{body}: {}", r.body);
    }
    assert_eq!((ledger(&s, "a").await, events(&s).await), before, "refused creates write nothing");
    let r = s
        .post(
            "/v1/jobs",
            json!({"id": "h", "account_id": "a", "kind": "render",
        "items": [{"id": "main", "hold": 100}, {"id": "fixed", "cost": 7}]}),
        )
        .await;
    assert_eq!(r.status, 201, "{}", r.body);
    let (id, token) = s.claim().await;
    let before = (ledger(&s, "a").await, events(&s).await, s.get(&format!("/v1/jobs/{id}")).await.body);
    let path = format!("/v1/jobs/{id}/succeed");
    for (body, status, code_) in [
        (json!({"lease_token": token}), 422, "cost_required"),
        (json!({"lease_token": token, "cost": 101}), 422, "cost_exceeds_hold"),
        (json!({"lease_token": token, "cost": -1}), 400, "invalid_request"),
        (json!({"lease_token": token, "cost": 5, "costs": {"main": 5}}), 400, "invalid_request"),
        (json!({"lease_token": token, "costs": {"main": 5, "nope": 1}}), 400, "invalid_request"),
        (json!({"lease_token": token, "costs": {"main": 5, "fixed": 8}}), 400, "invalid_request"),
        (json!({"lease_token": token, "costs": {"main": "5"}}), 400, "invalid_request"),
        (json!({"lease_token": token, "cost": 5, "price": 5}), 400, "invalid_request"),
    ] {
        let r = s.post(&path, body.clone()).await;
        assert_eq!((r.status, code(&r)), (status, code_), "{body}: {}", r.body);
    }
    let item = format!("/v1/jobs/{id}/items/main/succeed");
    for (body, status, code_) in [
        (json!({"lease_token": token}), 422, "cost_required"),
        (json!({"lease_token": token, "cost": 100_000}), 422, "cost_exceeds_hold"),
        (json!({"lease_token": token, "cost": -3}), 400, "invalid_request"),
    ] {
        let r = s.post(&item, body.clone()).await;
        assert_eq!((r.status, code(&r)), (status, code_), "{body}: {}", r.body);
    }
    let after = (ledger(&s, "a").await, events(&s).await, s.get(&format!("/v1/jobs/{id}")).await.body);
    assert_eq!(after, before, "refused successes write nothing");
    // A fixed item's own cost is accepted.
    let r = s.post(&path, json!({"lease_token": token, "costs": {"main": 64, "fixed": 7}})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["net"], -71);
}

/// Issue 41: `GET /v1/accounts` pages in id order by the last id; every JSON answer ends with a
/// newline (consecutive curl outputs stay apart); a held job's `job.queued` says what is held and
/// what is priced; event times are RFC 3339 as everywhere; the attempt log shows a recovery.
async fn accounts_listed_answers_ended_events_shaped(engine: Engine) {
    let s = Server::start(engine).await;
    for a in ["c", "a", "b"] {
        s.account(a, 1_000).await;
    }
    let r = s.get("/v1/accounts?limit=2").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let ids: Vec<&str> = r.body["accounts"].as_array().unwrap().iter().map(|a| a["id"].as_str().unwrap()).collect();
    assert_eq!((ids, r.body["next_after"].clone()), (vec!["a", "b"], json!("b")));
    let r = s.get("/v1/accounts?limit=2&after=b").await;
    assert_eq!((r.body["accounts"][0]["balance"].clone(), r.body["next_after"].clone()), (json!(1_000), Value::Null));
    assert_eq!(s.get("/v1/accounts?after=..").await.status, 400);
    assert_eq!(s.get("/v1/accounts?limit=0").await.status, 400);
    assert_eq!(s.get("/v1/accounts?cursor=1").await.status, 400);
    // The raw bodies: one line each, ended.
    let http = reqwest::Client::new();
    for path in ["/v1/accounts/a", "/v1/accounts/nobody", "/v1/accounts"] {
        let text = http.get(format!("{}{path}", s.base)).send().await.unwrap().text().await.unwrap();
        assert!(text.ends_with("}\n") && text.matches('\n').count() == 1, "{path}: {text:?}");
    }
    let r = s.post("/v1/jobs", json!({"id": "held", "account_id": "a", "kind": "render", "hold": 100})).await;
    assert_eq!(r.status, 201);
    let queued = events(&s).await.as_array().unwrap().iter().find(|e| e["type"] == "job.queued").cloned().unwrap();
    assert_eq!(
        (queued["data"]["charged"].clone(), queued["data"]["cost"].clone(), queued["data"]["hold"].clone()),
        (json!(100), json!(0), json!(100)),
        "{queued}"
    );
    // A timeout, then the late success of the same attempt: the attempt says it recovered the job.
    let (id, token) = s.claim().await;
    let r = s.post(&format!("/v1/jobs/{id}/fail"), json!({"lease_token": token, "code": "TIMEOUT"})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let retry = events(&s).await.as_array().unwrap().iter().find(|e| e["type"] == "job.retry_scheduled").cloned();
    let not_before = retry.unwrap()["data"]["not_before"].clone();
    assert!(not_before.as_str().is_some_and(|t| t.ends_with('Z') && t.contains('T')), "{not_before}");
    let r = s.post(&format!("/v1/jobs/{id}/succeed"), json!({"lease_token": token, "cost": 10})).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let attempts = s.get(&format!("/v1/jobs/{id}/attempts")).await.body;
    let first = &attempts["attempts"][0];
    assert_eq!(first["result"], "failed", "{attempts}");
    assert!(first["recovered_at"].as_str().is_some_and(|t| t.ends_with('Z')), "{attempts}");
}
