//! Every endpoint, status code and error code of `api-v1.md`, over real HTTP, on both engines.

use crate::kit::*;
use serde_json::json;
use settle_api::{Role, Tokens};
use settle_store::Store;
use std::sync::Arc;

macro_rules! on_both_engines {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(crate::kit::Engine::Sqlite).await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    super::$name(crate::kit::Engine::Postgres).await;
                }
            )*
        }
    };
}

on_both_engines!(
    accounts_grants_and_adjustments,
    ledger_pages,
    jobs_create_replay_conflict_and_insufficient_credits,
    job_requests_are_validated,
    jobs_list_and_get,
    worker_protocol_end_to_end,
    item_reports_and_artifacts,
    cancel_answers_200_202_and_409,
    requeue_and_attempts,
    unknown_and_failure_summary,
    events_and_long_polls,
    audit_and_operations,
    bodies_over_one_mebibyte_are_413,
    tokens_and_roles,
    fifty_concurrent_creates_make_one_job,
    fifty_concurrent_failures_refund_once,
    the_curl_walkthrough_of_the_readme,
    webhook_deliveries_are_visible_and_requeueable,
    a_replay_answers_the_job_as_it_is_now,
    a_lock_held_too_long_is_503_with_retry_after,
    admin_actions_record_their_actor,
);

async fn accounts_grants_and_adjustments(e: Engine) {
    let s = Server::start(e).await;
    let r = s.post("/v1/accounts", json!({"id": "alice", "overdraft_limit": 10})).await;
    assert_eq!((r.status, r.replayed), (201, false));
    assert_eq!(r.body["overdraft_limit"], 10);
    let r = s.post("/v1/accounts", json!({"overdraft_limit": 10, "id": "alice"})).await;
    assert_eq!((r.status, r.replayed), (200, true));
    let r = s.post("/v1/accounts", json!({"id": "alice"})).await;
    assert_eq!((r.status, code(&r)), (409, "idempotency_conflict"));
    for bad in [
        json!({"id": "a b"}),
        json!({"id": ""}),
        json!({"id": "x".repeat(129)}),
        json!({"id": 5}),
        json!({"id": "b", "extra": 1}),
        json!({"id": "b", "overdraft_limit": -1}),
        json!({}),
    ] {
        let r = s.post("/v1/accounts", bad.clone()).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{bad}");
    }
    assert_eq!(s.get("/v1/accounts/alice").await.body["balance"], 0);
    let r = s.get("/v1/accounts/nobody").await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
    assert_eq!(s.get("/v1/accounts/bad%20id").await.status, 400);

    let r = s.post("/v1/accounts/alice/grants", json!({"id": "g1", "amount": 100, "reason": "welcome"})).await;
    assert_eq!((r.status, r.body["kind"].as_str(), r.body["balance_after"].as_i64()), (201, Some("grant"), Some(100)));
    assert_eq!(r.body["hash"].as_str().unwrap().len(), 64);
    let r = s.post("/v1/accounts/alice/grants", json!({"id": "g1", "amount": 100, "reason": "welcome"})).await;
    assert_eq!((r.status, r.replayed), (200, true));
    let r = s.post("/v1/accounts/alice/grants", json!({"id": "g1", "amount": 101, "reason": "welcome"})).await;
    assert_eq!((r.status, code(&r)), (409, "idempotency_conflict"));
    // Grant ids are unique across accounts: reusing one on another account says so.
    assert_eq!(s.post("/v1/accounts", json!({"id": "bob"})).await.status, 201);
    let r = s.post("/v1/accounts/bob/grants", json!({"id": "g1", "amount": 100, "reason": "welcome"})).await;
    assert_eq!((r.status, code(&r)), (409, "idempotency_conflict"));
    assert!(r.body["error"]["message"].as_str().unwrap().contains("taken by another account"), "{}", r.body);
    for bad in [0, -1] {
        let r = s.post("/v1/accounts/alice/grants", json!({"id": "g2", "amount": bad})).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"));
    }
    let r = s.post("/v1/accounts/alice/grants", json!({"id": "g3", "amount": i64::MAX})).await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"), "overflow");
    let r = s
        .send("POST", "/v1/accounts/alice/grants", Some(json!({"id": "g4", "amount": 9223372036854775808u64})), None)
        .await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"), "beyond i64");
    let r = s.post("/v1/accounts/alice/grants", json!({"id": "g5", "amount": 1.5})).await;
    assert_eq!(r.status, 400);
    let r = s.post("/v1/accounts/nobody/grants", json!({"id": "g6", "amount": 1})).await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));

    let r = s.post("/v1/accounts/alice/adjustments", json!({"id": "a1", "amount": -30, "reason": "chargeback"})).await;
    assert_eq!((r.status, r.body["balance_after"].as_i64()), (201, Some(70)));
    let r = s.post("/v1/accounts/alice/adjustments", json!({"id": "a2", "amount": 5})).await;
    assert_eq!(r.status, 400, "reason is required");
    let r = s.post("/v1/accounts/alice/adjustments", json!({"id": "a3", "amount": 0, "reason": "x"})).await;
    assert_eq!(r.status, 400);
    assert_eq!(s.balance("alice").await, 70);
}

async fn ledger_pages(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 1000).await;
    for n in 0..4 {
        s.job(&format!("j{n}"), "a", 1).await;
    }
    let r = s.get("/v1/accounts/a/ledger?limit=2").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["entries"].as_array().unwrap().len(), 2);
    let next = r.body["next_after"].as_i64().unwrap();
    let r = s.get(&format!("/v1/accounts/a/ledger?after={next}&limit=10")).await;
    let kinds: Vec<&str> = r.body["entries"].as_array().unwrap().iter().map(|e| e["kind"].as_str().unwrap()).collect();
    assert_eq!(kinds, ["charge", "charge", "charge"]);
    assert!(r.body["next_after"].is_null());
    for bad in ["limit=0", "limit=1001", "after=-1", "limit=x", "colour=red"] {
        let r = s.get(&format!("/v1/accounts/a/ledger?{bad}")).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{bad}");
    }
    assert_eq!(s.get("/v1/accounts/nobody/ledger").await.status, 404);
}

async fn jobs_create_replay_conflict_and_insufficient_credits(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 50).await;
    let body = json!({"id": "j1", "account_id": "a", "kind": "render", "cost": 40, "payload": {"frames": [1, 2]}});
    let r = s.post("/v1/jobs", body.clone()).await;
    assert_eq!(r.status, 201);
    assert_eq!(r.body["state"], "queued");
    assert_eq!(r.body["net"], -40);
    assert_eq!(r.body["items"][0]["id"], "main");
    assert_eq!(r.body["items"][0]["state"], "charged");
    assert_eq!(r.body["payload"]["frames"][1], 2);
    let r = s.post("/v1/jobs", body.clone()).await;
    assert_eq!((r.status, r.replayed), (200, true));
    let mut other = body.clone();
    other["cost"] = json!(41);
    let r = s.post("/v1/jobs", other).await;
    assert_eq!((r.status, code(&r)), (409, "idempotency_conflict"));
    let r = s.post("/v1/jobs", json!({"id": "j2", "account_id": "a", "kind": "render", "items": [{"id": "x", "cost": 6}, {"id": "y", "cost": 5}]})).await;
    assert_eq!((r.status, code(&r)), (402, "insufficient_credits"));
    assert_eq!(s.get("/v1/jobs/j2").await.status, 404, "nothing written");
    assert_eq!(s.balance("a").await, 10);
    assert_eq!(s.get("/v1/accounts/a/ledger").await.body["entries"].as_array().unwrap().len(), 2);
    let r = s.post("/v1/jobs", json!({"id": "j3", "account_id": "nobody", "kind": "render", "cost": 1})).await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
}

async fn job_requests_are_validated(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 1000).await;
    let base = json!({"id": "j", "account_id": "a", "kind": "render"});
    let with = |extra: serde_json::Value| {
        let mut b = base.clone();
        for (k, v) in extra.as_object().unwrap() {
            b[k] = v.clone();
        }
        b
    };
    for bad in [
        with(json!({})),
        with(json!({"cost": 1, "items": [{"id": "x", "cost": 1}]})),
        with(json!({"cost": -1})),
        with(json!({"items": []})),
        with(json!({"items": [{"id": "x", "cost": 1}, {"id": "x", "cost": 2}]})),
        with(json!({"items": [{"id": "x", "cost": 1, "colour": "red"}]})),
        with(json!({"cost": 1, "refund_on": "sometimes"})),
        with(json!({"cost": 1, "not_before": "tomorrow"})),
        with(json!({"cost": 1, "max_attempts": 0})),
        with(json!({"cost": 1, "max_attempts": -3})),
        with(json!({"cost": 1, "kind": "bad kind"})),
        with(json!({"cost": 1, "id": "bad/id"})),
        with(json!({"cost": 1, "unknown": true})),
        with(json!({"items": [{"id": "x", "cost": i64::MAX}, {"id": "y", "cost": 1}]})),
    ] {
        let r = s.post("/v1/jobs", bad.clone()).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{bad}");
    }
    assert_eq!(s.balance("a").await, 1000, "a rejected request writes nothing");
    let r = s.post("/v1/jobs", with(json!({"cost": 0, "refund_on": "final_failure", "not_before": "2030-01-01T00:00:00Z", "max_attempts": 2}))).await;
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!(r.body["refund_on"], "final_failure");
    assert_eq!(r.body["not_before"], "2030-01-01T00:00:00Z");
    assert_eq!(r.body["max_attempts"], 2);
}

async fn jobs_list_and_get(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 1000).await;
    s.account("b", 1000).await;
    for n in 0..3 {
        s.job(&format!("a{n}"), "a", 1).await;
    }
    s.job("b0", "b", 1).await;
    let r = s.get("/v1/jobs?account_id=a&limit=2").await;
    assert_eq!(r.status, 200);
    assert_eq!(r.body["jobs"].as_array().unwrap().len(), 2);
    let next = r.body["next_after"].as_i64().unwrap();
    let r = s.get(&format!("/v1/jobs?account_id=a&after={next}")).await;
    assert_eq!(r.body["jobs"][0]["id"], "a2");
    assert!(r.body["next_after"].is_null());
    assert_eq!(s.get("/v1/jobs?state=queued&kind=render").await.body["jobs"].as_array().unwrap().len(), 4);
    assert_eq!(s.get("/v1/jobs?state=dead").await.body["jobs"].as_array().unwrap().len(), 0);
    for bad in ["state=sleeping", "fail_code=lower", "account_id=a%20b", "limit=0"] {
        assert_eq!(s.get(&format!("/v1/jobs?{bad}")).await.status, 400, "{bad}");
    }
    assert_eq!(s.get("/v1/jobs/a0").await.body["account_id"], "a");
    let r = s.get("/v1/jobs/missing").await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
}

async fn worker_protocol_end_to_end(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    s.job("render-1", "a", 40).await;
    let r =
        s.post("/v1/claims", json!({"worker": "gpu-7", "kinds": ["render"], "limit": 5, "lease_seconds": 60})).await;
    assert_eq!(r.status, 200);
    let jobs = r.body["jobs"].as_array().unwrap();
    assert_eq!(jobs.len(), 1);
    assert_eq!(jobs[0]["state"], "running");
    assert_eq!(jobs[0]["attempt"], 1);
    let token = jobs[0]["lease_token"].as_str().unwrap().to_owned();
    assert!(jobs[0]["lease_expires_at"].as_str().unwrap().ends_with('Z'));
    assert_eq!(s.post("/v1/claims", json!({"worker": "gpu-7"})).await.body["jobs"].as_array().unwrap().len(), 0);
    let r = s.post("/v1/jobs/render-1/heartbeat", json!({"lease_token": token})).await;
    assert_eq!((r.status, r.body["cancel_requested"].as_bool()), (200, Some(false)));
    let r = s.post("/v1/jobs/render-1/heartbeat", json!({"lease_token": "stale"})).await;
    assert_eq!((r.status, code(&r)), (409, "lease_lost"));
    // timeout → refund
    let r = s.post("/v1/jobs/render-1/fail", json!({"lease_token": token, "code": "TIMEOUT", "message": "30 s"})).await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("queued")));
    assert_eq!(r.body["last_error"]["code"], "TIMEOUT");
    assert_eq!(s.balance("a").await, 100);
    // a duplicate failure changes nothing
    let r = s.post("/v1/jobs/render-1/fail", json!({"lease_token": token, "code": "TIMEOUT"})).await;
    assert_eq!(r.status, 200);
    assert_eq!(s.balance("a").await, 100);
    // the late success reclaims, once
    let r = s.post("/v1/jobs/render-1/succeed", json!({"lease_token": token, "result": {"url": "s3://out"}})).await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("succeeded")));
    assert_eq!(r.body["items"][0]["is_reclaimed"], true);
    assert_eq!(r.body["result"]["url"], "s3://out");
    assert_eq!(s.post("/v1/jobs/render-1/succeed", json!({})).await.status, 200);
    assert_eq!(s.balance("a").await, 60);
    let r = s.post("/v1/jobs/render-1/fail", json!({"lease_token": token, "code": "lowercase"})).await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"));
    let r = s.post("/v1/jobs/render-1/fail", json!({"code": "TIMEOUT"})).await;
    assert_eq!(r.status, 400, "lease_token is required");
    for bad in [
        json!({"worker": ""}),
        json!({"worker": "w", "limit": 0}),
        json!({"worker": "w", "lease_seconds": 0}),
        json!({"worker": "w", "wait_seconds": 31}),
        json!({"worker": "w", "kinds": ["bad kind"]}),
    ] {
        assert_eq!(s.post("/v1/claims", bad.clone()).await.status, 400, "{bad}");
    }
    assert_eq!(s.post("/v1/jobs/missing/succeed", json!({})).await.status, 404);
}

async fn item_reports_and_artifacts(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    let r = s.post("/v1/jobs", json!({"id": "b", "account_id": "a", "kind": "render", "items": [{"id": "f1", "cost": 10}, {"id": "f2", "cost": 20}]})).await;
    assert_eq!(r.status, 201);
    let (_, token) = s.claim().await;
    let r = s.post("/v1/jobs/b/items/f1/succeed", json!({"lease_token": token})).await;
    assert_eq!(
        (r.status, r.body["item"]["state"].as_str(), r.body["cancel_requested"].as_bool()),
        (200, Some("succeeded"), Some(false))
    );
    let r = s
        .post("/v1/jobs/b/items/f2/fail", json!({"lease_token": token, "code": "BAD_FRAME", "message": "corrupt"}))
        .await;
    assert_eq!(
        (r.status, r.body["item"]["state"].as_str(), r.body["item"]["is_refunded"].as_bool()),
        (200, Some("refunded"), Some(true))
    );
    let r = s.post("/v1/jobs/b/items/f2/fail", json!({"lease_token": "old", "code": "BAD_FRAME"})).await;
    assert_eq!((r.status, code(&r)), (409, "lease_lost"));
    let r = s.post("/v1/jobs/b/items/nope/succeed", json!({"lease_token": token})).await;
    assert_eq!(r.status, 404);
    let r = s.post("/v1/jobs/b/items/f2/artifacts", json!({"lease_token": token, "key": "b/f2.png"})).await;
    assert_eq!((r.status, r.body["key"].as_str()), (201, Some("b/f2.png")));
    assert_eq!(r.body["path"], "b/f2/b/f2.png", "stored under the job's and item's own prefix");
    assert_eq!(
        s.post("/v1/jobs/b/items/f2/artifacts", json!({"lease_token": token, "key": "b/f2.png"})).await.status,
        200
    );
    for bad in ["../etc/passwd", "/etc/passwd", "a//b", "a/../b", "./a", ""] {
        let r = s.post("/v1/jobs/b/items/f2/artifacts", json!({"lease_token": token, "key": bad})).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{bad:?}");
    }
    let r = s.post("/v1/jobs/b/items/f2/artifacts", json!({"lease_token": "old", "key": "x"})).await;
    assert_eq!((r.status, code(&r)), (409, "lease_lost"));
    assert_eq!(s.balance("a").await, 90);
}

async fn cancel_answers_200_202_and_409(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    s.job("q", "a", 10).await;
    let r = s.post_empty("/v1/jobs/q/cancel").await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("cancelled")));
    assert_eq!(s.post_empty("/v1/jobs/q/cancel").await.status, 200, "idempotent");
    s.job("r", "a", 10).await;
    let (_, token) = s.claim().await;
    let r = s.post_empty("/v1/jobs/r/cancel").await;
    assert_eq!(
        (r.status, r.body["state"].as_str(), r.body["cancel_requested"].as_bool()),
        (202, Some("running"), Some(true))
    );
    assert_eq!(s.post("/v1/jobs/r/heartbeat", json!({"lease_token": token})).await.body["cancel_requested"], true);
    let r = s.post("/v1/jobs/r/fail", json!({"lease_token": token, "code": "CANCELLED"})).await;
    assert_eq!(r.body["state"], "cancelled");
    s.job("s", "a", 10).await;
    let (_, token) = s.claim().await;
    s.post("/v1/jobs/s/succeed", json!({"lease_token": token})).await;
    let r = s.post_empty("/v1/jobs/s/cancel").await;
    assert_eq!((r.status, code(&r)), (409, "job_finished"));
    s.job("u", "a", 10).await;
    let (_, token) = s.claim().await;
    s.post("/v1/jobs/u/unknown", json!({"lease_token": token})).await;
    let r = s.post_empty("/v1/jobs/u/cancel").await;
    assert_eq!((r.status, code(&r)), (409, "outcome_unknown"));
    assert_eq!(s.post_empty("/v1/jobs/missing/cancel").await.status, 404);
    assert_eq!(s.balance("a").await, 80);
}

async fn requeue_and_attempts(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    s.job("d", "a", 10).await;
    let (_, token) = s.claim().await;
    let r = s
        .post("/v1/jobs/d/fail", json!({"lease_token": token, "code": "INVALID_ADDRESS", "message": "no such bucket"}))
        .await;
    assert_eq!(r.body["state"], "dead");
    let r = s.post_empty("/v1/jobs/d/requeue").await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("queued")));
    let (_, token) = s.claim().await;
    let r = s.post_empty("/v1/jobs/d/requeue").await;
    assert_eq!((r.status, code(&r)), (409, "invalid_transition"));
    s.post("/v1/jobs/d/succeed", json!({"lease_token": token})).await;
    let r = s.get("/v1/jobs/d/attempts").await;
    let attempts = r.body["attempts"].as_array().unwrap();
    assert_eq!(attempts.len(), 2);
    assert_eq!(
        (attempts[0]["result"].as_str(), attempts[0]["fail_code"].as_str()),
        (Some("failed"), Some("INVALID_ADDRESS"))
    );
    assert_eq!(attempts[0]["message"], "no such bucket");
    assert_eq!(attempts[1]["result"], "succeeded");
    assert_eq!(attempts[1]["worker"], "w1");
    assert_eq!(s.get("/v1/jobs/missing/attempts").await.status, 404);
    assert_eq!(s.post_empty("/v1/jobs/missing/requeue").await.status, 404);
}

async fn unknown_and_failure_summary(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    s.job("u", "a", 10).await;
    let (_, token) = s.claim().await;
    let r = s.post("/v1/jobs/u/unknown", json!({"lease_token": token, "message": "no answer"})).await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("unknown")));
    assert_eq!(s.balance("a").await, 90, "unknown is not refunded");
    s.job("d", "a", 10).await;
    let (_, token) = s.claim().await;
    s.post("/v1/jobs/d/fail", json!({"lease_token": token, "code": "INSUFFICIENT"})).await;
    let r = s.get("/v1/failures/summary").await;
    assert_eq!(r.status, 200);
    let rows: Vec<(String, String, i64)> = r.body["by_code"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            (f["code"].as_str().unwrap().into(), f["state"].as_str().unwrap().into(), f["count"].as_i64().unwrap())
        })
        .collect();
    assert!(rows.contains(&("INSUFFICIENT".into(), "dead".into(), 1)), "{rows:?}");
    assert!(rows.iter().any(|r| r.1 == "unknown" && r.2 == 1), "{rows:?}");
}

async fn events_and_long_polls(e: Engine) {
    let s = Arc::new(Server::start(e).await);
    s.account("a", 100).await;
    let r = s.get("/v1/events?limit=2").await;
    assert_eq!(r.status, 200);
    let events = r.body["events"].as_array().unwrap();
    assert_eq!(events[0]["type"], "account.created");
    assert_eq!(events[1]["type"], "account.granted");
    assert_eq!(events[1]["data"]["amount"], 100);
    let last = r.body["next_after"].as_i64().unwrap();
    // a claim waiting for work returns as soon as a job arrives
    let waiter = {
        let s = s.clone();
        tokio::spawn(async move {
            let started = std::time::Instant::now();
            let r = s.post("/v1/claims", json!({"worker": "w", "wait_seconds": 10})).await;
            (r, started.elapsed())
        })
    };
    let events_waiter = {
        let s = s.clone();
        tokio::spawn(async move { s.get(&format!("/v1/events?after={last}&wait_seconds=10")).await })
    };
    s.until_long_polls_waiting(2).await;
    s.job("j", "a", 1).await;
    let (r, waited) = waiter.await.unwrap();
    assert_eq!(r.body["jobs"][0]["id"], "j");
    assert!(waited < std::time::Duration::from_secs(5), "the long-poll waited {waited:?}");
    let r = events_waiter.await.unwrap();
    assert_eq!(r.body["events"][0]["type"], "job.queued");
    // A cursor past the newest event is a store rewound under its reader (a restore): told so at
    // once, with the epoch and where to start again, not left waiting for events it would drop.
    let r = s.get("/v1/events?after=1000&wait_seconds=1").await;
    assert_eq!((r.status, r.body["error"]["code"].as_str()), (409, Some("cursor_ahead")), "{}", r.body);
    assert_eq!(r.body["error"]["details"]["epoch"], 1);
    assert_eq!(r.body["error"]["details"]["restart_after"], 0);
    assert_eq!(s.get("/v1/events?wait_seconds=31").await.status, 400);
}

async fn audit_and_operations(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    s.job("j", "a", 10).await;
    let r = s.get("/v1/audit").await;
    assert_eq!((r.status, r.body["ok"].as_bool()), (200, Some(true)));
    assert_eq!(r.body["accounts_checked"], 1);
    assert_eq!(r.body["violations"].as_array().unwrap().len(), 0);
    assert_eq!(s.get("/healthz").await.status, 200);
    assert_eq!(s.get("/readyz").await.status, 200);
    let r = s.get("/metrics").await;
    let text = r.body.as_str().unwrap().to_owned();
    for metric in [
        "settle_http_requests_total",
        "settle_jobs",
        "settle_ledger_entries",
        "settle_queue_depth",
        "settle_dead_letters",
        "settle_http_request_duration_seconds",
    ] {
        assert!(text.contains(metric), "{metric} missing");
    }
    let r = s.get("/openapi.json").await;
    assert!(r.body["paths"]["/v1/jobs/{id}/cancel"]["post"].is_object());
    // The API reference: a page, its scripts from this server (Redoc embedded, no CDN).
    let page = reqwest::get(format!("{}/docs", s.base)).await.unwrap();
    assert_eq!(page.status(), 200);
    let policy = page.headers()["content-security-policy"].to_str().unwrap().to_owned();
    assert!(policy.contains("script-src 'self'"), "{policy}");
    let html = page.text().await.unwrap();
    assert!(html.contains(r#"<script src="/docs/redoc.standalone.js">"#) && !html.contains("https://"), "{html}");
    let bundle = reqwest::get(format!("{}/docs/redoc.standalone.js", s.base)).await.unwrap();
    assert_eq!(bundle.headers()["content-type"], "text/javascript; charset=utf-8");
    assert!(bundle.bytes().await.unwrap().len() > 500_000, "the Redoc bundle is served whole");
    let r = s.get("/v1/nothing-here").await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
    assert_eq!(s.send("DELETE", "/v1/jobs/j", None, None).await.status, 405);
}

async fn bodies_over_one_mebibyte_are_413(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    let big = "x".repeat(1 << 20);
    let r =
        s.post("/v1/jobs", json!({"id": "j", "account_id": "a", "kind": "render", "cost": 1, "payload": big})).await;
    assert_eq!((r.status, code(&r)), (413, "payload_too_large"));
    assert_eq!(s.get("/v1/jobs/j").await.status, 404);
}

async fn tokens_and_roles(e: Engine) {
    let mut tokens = Tokens::default();
    tokens.add(Role::Admin, "admin-token-0123456789").unwrap();
    tokens.add(Role::Client, "client-token-0123456789").unwrap();
    tokens.add(Role::Worker, "worker-token-0123456789").unwrap();
    let s = Server::with_tokens(e, tokens).await;
    let (admin, client, worker) =
        (Some("admin-token-0123456789"), Some("client-token-0123456789"), Some("worker-token-0123456789"));
    let r = s.send("POST", "/v1/accounts", Some(json!({"id": "a"})), None).await;
    assert_eq!((r.status, code(&r)), (401, "unauthorized"));
    let r = s.send("POST", "/v1/accounts", Some(json!({"id": "a"})), Some("wrong-token-0123456789")).await;
    assert_eq!((r.status, code(&r)), (401, "unauthorized"));
    let r = s.send("POST", "/v1/accounts", Some(json!({"id": "a"})), client).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    // Authorization comes before the body is read: no token and a bad body is still 401.
    let r = s.send("POST", "/v1/accounts", Some(json!({"nonsense": true})), None).await;
    assert_eq!((r.status, code(&r)), (401, "unauthorized"));
    let r = s.send("POST", "/v1/jobs/bad%20id/fail", Some(json!({})), client).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    assert_eq!(s.send("POST", "/v1/accounts", Some(json!({"id": "a"})), admin).await.status, 201);
    assert_eq!(
        s.send("POST", "/v1/accounts/a/grants", Some(json!({"id": "g", "amount": 10})), admin).await.status,
        201
    );
    let job = json!({"id": "j", "account_id": "a", "kind": "render", "cost": 1});
    assert_eq!(s.send("POST", "/v1/jobs", Some(job.clone()), worker).await.status, 403);
    assert_eq!(s.send("POST", "/v1/jobs", Some(job), client).await.status, 201);
    assert_eq!(s.send("POST", "/v1/claims", Some(json!({"worker": "w"})), client).await.status, 403);
    assert_eq!(s.send("POST", "/v1/claims", Some(json!({"worker": "w"})), worker).await.status, 200);
    assert_eq!(s.send("GET", "/v1/audit", None, client).await.status, 403);
    assert_eq!(s.send("GET", "/v1/audit", None, admin).await.status, 200);
    assert_eq!(s.send("GET", "/v1/jobs/j", None, admin).await.status, 200, "admin includes client");
    assert_eq!(s.send("POST", "/v1/jobs/j/requeue", None, client).await.status, 403);
    assert_eq!(s.send("GET", "/healthz", None, None).await.status, 200, "health needs no token");
}

async fn fifty_concurrent_creates_make_one_job(e: Engine) {
    let s = Arc::new(Server::start(e).await);
    s.account("a", 1000).await;
    let body = json!({"id": "dup", "account_id": "a", "kind": "render", "items": [{"id": "x", "cost": 7}, {"id": "y", "cost": 3}]});
    let handles: Vec<_> = (0..50)
        .map(|_| {
            let (s, body) = (s.clone(), body.clone());
            tokio::spawn(async move { s.post("/v1/jobs", body).await })
        })
        .collect();
    let mut created = 0;
    let mut replayed = 0;
    for h in handles {
        let r = h.await.unwrap();
        match (r.status, r.replayed) {
            (201, false) => created += 1,
            (200, true) => replayed += 1,
            other => panic!("unexpected {other:?}: {}", r.body),
        }
    }
    assert_eq!((created, replayed), (1, 49));
    assert_eq!(s.balance("a").await, 990);
    assert_eq!(s.get("/v1/jobs").await.body["jobs"].as_array().unwrap().len(), 1);
    assert_eq!(s.get("/v1/audit").await.body["ok"], true);
}

async fn fifty_concurrent_failures_refund_once(e: Engine) {
    let s = Arc::new(Server::start(e).await);
    s.account("a", 100).await;
    s.job("j", "a", 40).await;
    let (_, token) = s.claim().await;
    let handles: Vec<_> = (0..50)
        .map(|_| {
            let (s, token) = (s.clone(), token.clone());
            tokio::spawn(async move {
                s.post("/v1/jobs/j/fail", json!({"lease_token": token, "code": "INVALID_ADDRESS"})).await
            })
        })
        .collect();
    for h in handles {
        assert_eq!(h.await.unwrap().status, 200);
    }
    assert_eq!(s.balance("a").await, 100);
    let entries = s.get("/v1/accounts/a/ledger").await.body["entries"].as_array().unwrap().clone();
    let refunds = entries.iter().filter(|e| e["kind"] == "refund").count();
    assert_eq!(refunds, 1);
    assert_eq!(s.get("/v1/audit").await.body["ok"], true);
}

/// The README's curl walk-through, step by step.
async fn the_curl_walkthrough_of_the_readme(e: Engine) {
    let s = Server::start(e).await;
    assert_eq!(s.post("/v1/accounts", json!({"id": "alice"})).await.status, 201);
    assert_eq!(s.post("/v1/accounts/alice/grants", json!({"id": "welcome", "amount": 100})).await.status, 201);
    assert_eq!(
        s.post("/v1/jobs", json!({"id": "render-1", "account_id": "alice", "kind": "render", "cost": 40})).await.status,
        201
    );
    let (_, token) = s.claim().await;
    let r = s.post("/v1/jobs/render-1/fail", json!({"lease_token": token, "code": "TIMEOUT"})).await;
    assert_eq!(r.body["state"], "queued");
    assert_eq!(s.balance("alice").await, 100);
    let r = s.post("/v1/jobs/render-1/succeed", json!({"lease_token": token})).await;
    assert_eq!(r.body["state"], "succeeded");
    let kinds: Vec<String> = s.get("/v1/accounts/alice/ledger").await.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| format!("{} {}", e["kind"].as_str().unwrap(), e["amount"]))
        .collect();
    assert_eq!(kinds, ["grant 100", "charge -40", "refund 40", "reclaim -40"]);
}

#[tokio::test]
async fn a_public_address_without_tokens_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("x.db").display());
    let store = Arc::new(settle_store::SqlStore::open(&url, settle_store::StoreOptions::default()).await.unwrap());
    let r = settle_api::Application::build("0.0.0.0:0", store.clone(), Tokens::default()).await;
    assert!(matches!(r, Err(settle_api::StartError::OpenWithoutTokens(_))));
    let mut tokens = Tokens::default();
    tokens.add(Role::Admin, "admin-token-0123456789").unwrap();
    assert!(settle_api::Application::build("0.0.0.0:0", store, tokens).await.is_ok());
}

/// The ledger going away is `503 unavailable`, not a 500.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_database_is_503_unavailable() {
    let s = Server::start(Engine::Postgres).await;
    assert_eq!(s.get("/readyz").await.status, 200);
    let name = s.database_url.rsplit('/').next().unwrap().to_owned();
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let mut admin =
        sqlx::postgres::PgConnectOptions::from_str(settle_testkit::server_url()).unwrap().connect().await.unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {name} WITH (FORCE)"))).execute(&mut admin).await.unwrap();
    admin.close().await.unwrap();
    let r = s.get("/readyz").await;
    assert_eq!((r.status, code(&r)), (503, "unavailable"), "{}", r.body);
    let r = s.post("/v1/accounts", json!({"id": "a"})).await;
    assert_eq!((r.status, code(&r)), (503, "unavailable"), "{}", r.body);
}

async fn webhook_deliveries_are_visible_and_requeueable(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    s.store_handle().webhooks().fan_out("ops", 100).await.unwrap();
    let r = s.get("/v1/webhooks/deliveries?endpoint=ops&state=pending").await;
    assert_eq!(r.status, 200);
    let rows = r.body["deliveries"].as_array().unwrap();
    assert_eq!(rows.len(), 2, "account.created and account.granted");
    assert_eq!(rows[0]["event"]["type"], "account.created");
    assert_eq!(rows[0]["attempts"], 0);
    let r = s.post_empty("/v1/webhooks/deliveries/ops/1/requeue").await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("pending")));
    assert_eq!(s.post_empty("/v1/webhooks/deliveries/ops/999/requeue").await.status, 404);
    assert_eq!(s.post_empty("/v1/webhooks/deliveries/bad%20id/1/requeue").await.status, 400);
    assert_eq!(s.get("/v1/webhooks/deliveries?state=lost").await.status, 400);
    let r = s.post_empty("/v1/webhooks/deliveries/ops/not-a-number/requeue").await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"), "a malformed path is the spec's JSON error");
    assert_eq!(s.get("/v1/webhooks/deliveries?endpoint=other").await.body["deliveries"].as_array().unwrap().len(), 0);
    let r = s.post_empty("/v1/webhooks/deliveries/ops/requeue").await;
    assert_eq!((r.status, r.body["requeued"].as_u64()), (200, Some(0)), "nothing is dead");
    assert_eq!(s.post_empty("/v1/webhooks/deliveries/bad%20id/requeue").await.status, 400);

    // One failed send opens a breaker of threshold 1: the list and /metrics say so; an admin closes it.
    let store = s.store_handle();
    let policy = settle_store::BreakerPolicy { failures: 1, open_ms: 60_000, open_ms_max: 60_000 };
    let claimed = store.webhooks().lease("ops", 1, 10_000, 5, policy).await.unwrap();
    let failed = settle_store::DeliveryReport::Failed {
        status: Some(500),
        error: "down".into(),
        retry_at: settle_store::Store::now(&*store),
        attempts_max: 5,
    };
    let token = claimed[0].lease_token.clone().unwrap();
    store.webhooks().report("ops", claimed[0].event.seq, &token, failed, policy).await.unwrap();
    let r = s.get("/v1/webhooks/deliveries?endpoint=other").await;
    let ops = &r.body["endpoints"][0];
    assert_eq!((ops["endpoint_id"].as_str(), ops["breaker"].as_str()), (Some("ops"), Some("open")), "{}", r.body);
    assert_eq!((ops["failures"].as_i64(), ops["opens"].as_i64()), (Some(1), Some(1)));
    assert!(ops["next_probe_at"].as_str().is_some(), "{ops}");
    let metrics = s.get("/metrics").await.body.as_str().unwrap().to_owned();
    assert!(metrics.contains("settle_webhook_breaker_open{endpoint=\"ops\"} 1"), "{metrics}");
    // Issue 41: the backlog and how long its oldest has waited are in /metrics.
    assert!(metrics.contains("settle_webhook_pending{endpoint=\"ops\"}"), "{metrics}");
    assert!(metrics.contains("settle_webhook_oldest_pending_seconds{endpoint=\"ops\"}"), "{metrics}");
    let r = s.post_empty("/v1/webhooks/endpoints/ops/breaker/close").await;
    assert_eq!((r.status, r.body["breaker"].as_str()), (200, Some("closed")), "{}", r.body);
    assert!(r.body["next_probe_at"].is_null());
    let metrics = s.get("/metrics").await.body.as_str().unwrap().to_owned();
    assert!(metrics.contains("settle_webhook_breaker_open{endpoint=\"ops\"} 0"), "{metrics}");
    assert_eq!(s.post_empty("/v1/webhooks/endpoints/nope/breaker/close").await.status, 404);
    assert_eq!(s.post_empty("/v1/webhooks/endpoints/bad%20id/breaker/close").await.status, 400);
}

/// docs/decisions/0011: a replayed create answers the resource as it is now.
async fn a_replay_answers_the_job_as_it_is_now(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    let create = json!({"id": "j", "account_id": "a", "kind": "render", "cost": 10});
    let first = s.post("/v1/jobs", create.clone()).await;
    assert_eq!(
        (first.status, first.body["state"].as_str(), first.body["attempt"].as_i64()),
        (201, Some("queued"), Some(0))
    );
    let (_, token) = s.claim().await;
    let r = s.post("/v1/jobs/j/fail", json!({"lease_token": token, "code": "NODE_DOWN"})).await;
    assert_eq!(r.status, 200);
    let replay = s.post("/v1/jobs", create).await;
    assert_eq!((replay.status, replay.replayed), (200, true));
    assert_eq!(replay.body, s.get("/v1/jobs/j").await.body, "the replay is the job as GET shows it now");
    assert_eq!((replay.body["attempt"].as_i64(), replay.body["net"].as_i64()), (Some(1), Some(0)));
    assert_eq!(replay.body["last_error"]["code"], "NODE_DOWN");
}

/// Another connection holds the lock a transition needs for longer than the store waits: the answer
/// is `503 unavailable` with `Retry-After` and nothing is written; once the lock is gone, the same
/// request works. (PostgreSQL: a row lock past `lock_timeout`; SQLite: the write lock past the busy
/// timeout.)
async fn a_lock_held_too_long_is_503_with_retry_after(e: Engine) {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let s = Server::with_options(e, Tokens::default(), |o| {
        o.pg_lock_timeout = std::time::Duration::from_millis(200);
        o.busy_timeout = std::time::Duration::from_millis(200);
    })
    .await;
    s.account("a", 100).await;
    s.job("j", "a", 10).await;
    let hold = match e {
        Engine::Postgres => "SELECT id FROM jobs WHERE id = 'j' FOR UPDATE",
        Engine::Sqlite => "UPDATE accounts SET balance = balance WHERE id = 'a'",
    };
    // The cancel while the lock is held, and the Retry-After of a second try.
    let attempt = || async {
        let r = s.send("POST", "/v1/jobs/j/cancel", None, None).await;
        (r.status, code(&r).to_owned(), retry_after(&s, "/v1/jobs/j/cancel").await)
    };
    let (status, code_seen, retry_after) = match e {
        Engine::Postgres => {
            let mut conn =
                sqlx::postgres::PgConnectOptions::from_str(&s.database_url).unwrap().connect().await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            sqlx::query(hold).execute(&mut *tx).await.unwrap();
            let seen = attempt().await;
            tx.rollback().await.unwrap();
            seen
        }
        Engine::Sqlite => {
            let mut conn =
                sqlx::sqlite::SqliteConnectOptions::from_str(&s.database_url).unwrap().connect().await.unwrap();
            let mut tx = conn.begin_with("BEGIN IMMEDIATE").await.unwrap();
            sqlx::query(hold).execute(&mut *tx).await.unwrap();
            let seen = attempt().await;
            tx.rollback().await.unwrap();
            seen
        }
    };
    assert_eq!(code_seen, "unavailable");
    assert_eq!((status, retry_after.as_deref()), (503, Some("1")));
    assert_eq!(s.get("/v1/jobs/j").await.body["state"], "queued", "nothing was written");
    let r = s.post_empty("/v1/jobs/j/cancel").await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("cancelled")));
    if matches!(e, Engine::Postgres) {
        let metrics = s.http.get(format!("{}/metrics", s.base)).send().await.unwrap().text().await.unwrap();
        assert!(metrics.contains("settle_store_busy_total"), "{metrics}");
    }
}

/// The `Retry-After` header of a POST, sent while the lock is still held.
async fn retry_after(s: &Server, path: &str) -> Option<String> {
    let r = s.http.post(format!("{}{path}", s.base)).send().await.unwrap();
    r.headers().get("retry-after").map(|v| v.to_str().unwrap().to_owned())
}

/// Admin actions are recorded with the name of the token that made them, in the same transaction.
async fn admin_actions_record_their_actor(e: Engine) {
    let hashed = {
        use sha2::Digest;
        hex::encode(sha2::Sha256::digest(b"alice-admin-token-0123"))
    };
    let file = format!(
        "admin sha256:{hashed} ops-alice\nclient client-token-0123456789 shop\nworker worker-token-0123456789 gpu\n"
    );
    let s = Server::with_tokens(e, Tokens::parse_file(&file).unwrap()).await;
    let (admin, client, worker) =
        (Some("alice-admin-token-0123"), Some("client-token-0123456789"), Some("worker-token-0123456789"));
    assert_eq!(s.send("POST", "/v1/accounts", Some(json!({"id": "a"})), admin).await.status, 201);
    let g = json!({"id": "g", "amount": 50});
    assert_eq!(s.send("POST", "/v1/accounts/a/grants", Some(g.clone()), admin).await.status, 201);
    assert_eq!(s.send("POST", "/v1/accounts/a/grants", Some(g), admin).await.status, 200, "a replay");
    let adj = json!({"id": "fix-1", "amount": -5, "reason": "chargeback"});
    assert_eq!(s.send("POST", "/v1/accounts/a/adjustments", Some(adj), admin).await.status, 201);
    let job = json!({"id": "j", "account_id": "a", "kind": "render", "cost": 10});
    assert_eq!(s.send("POST", "/v1/jobs", Some(job), client).await.status, 201);
    let c = s.send("POST", "/v1/claims", Some(json!({"worker": "w"})), worker).await;
    let token = c.body["jobs"][0]["lease_token"].as_str().unwrap().to_owned();
    let f = json!({"lease_token": token, "code": "INVALID_INPUT"});
    assert_eq!(s.send("POST", "/v1/jobs/j/fail", Some(f), worker).await.body["state"], "dead");
    assert_eq!(s.send("POST", "/v1/jobs/j/requeue", None, admin).await.status, 200);
    let store = s.store_handle();
    let jid = settle_core::ids::JobId::parse("j").unwrap();
    let on_job = store.operators().actions(Some(&jid), None).await.unwrap();
    assert_eq!(
        on_job.iter().map(|a| (a.action.as_str(), a.actor.as_str())).collect::<Vec<_>>(),
        vec![("job.requeue", "ops-alice")]
    );
    let acc = settle_core::ids::AccountId::parse("a").unwrap();
    let on_account = store.operators().actions(None, Some(&acc)).await.unwrap();
    let seen: Vec<(&str, &str)> = on_account.iter().map(|a| (a.action.as_str(), a.actor.as_str())).collect();
    assert_eq!(
        seen,
        vec![
            ("account.create", "ops-alice"),
            ("account.grant", "ops-alice"),
            ("account.adjust", "ops-alice"),
            ("job.requeue", "ops-alice")
        ],
        "the replayed grant is not a second action"
    );
    assert!(on_account[2].detail.contains("chargeback"));
}
