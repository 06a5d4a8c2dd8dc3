//! Spend limits over HTTP (issue 45, api-v1 "Money controls"): `PUT`/`GET
//! /v1/accounts/{id}/limits`, a create past a limit `402 spend_limit_exceeded` with the limit, its
//! spend and what is left, writing nothing; racing creates over HTTP never pass it; every bad set a
//! clear 400 that writes nothing — on both engines.

use crate::kit::*;
use serde_json::{Value, json};

on_both_engines!(
    limits_are_set_read_and_refuse_creates_past_them,
    racing_creates_over_http_never_pass_a_limit,
    bad_limit_sets_write_nothing
);

async fn limits_are_set_read_and_refuse_creates_past_them(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 1_000).await;
    let body =
        json!({"limits": [{"period": "day", "amount": 100}, {"period": "month", "amount": 500, "kinds": ["render"]}]});
    let r = s.send("PUT", "/v1/accounts/a/limits", Some(body), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body["limits"][0]["period"], "day");
    assert_eq!(r.body["limits"][0]["kinds"], json!([]));
    assert_eq!(r.body["limits"][0]["spent"], 0);
    assert_eq!(r.body["limits"][1]["kinds"], json!(["render"]));
    assert!(r.body["limits"][0]["resets_at"].as_str().is_some_and(|t| t.ends_with("T00:00:00Z")), "{}", r.body);
    assert_eq!(s.get("/v1/accounts/a/limits").await.body, r.body);
    let r = s.post("/v1/jobs", json!({"id": "j1", "account_id": "a", "kind": "transcribe", "cost": 60})).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let (balance, entries) = (s.balance("a").await, ledger_len(&s).await);
    let r = s.post("/v1/jobs", json!({"id": "j2", "account_id": "a", "kind": "render", "cost": 41})).await;
    assert_eq!((r.status, code(&r)), (402, "spend_limit_exceeded"), "{}", r.body);
    let d = &r.body["error"]["details"];
    assert_eq!((d["period"].as_str(), d["amount"].as_i64()), (Some("day"), Some(100)));
    assert_eq!((d["spent"].as_i64(), d["remaining"].as_i64(), d["needed"].as_i64()), (Some(60), Some(40), Some(41)));
    assert_eq!(s.get("/v1/jobs/j2").await.status, 404, "nothing written");
    assert_eq!((s.balance("a").await, ledger_len(&s).await), (balance, entries));
    let r = s.post("/v1/jobs", json!({"id": "j2", "account_id": "a", "kind": "render", "cost": 40})).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let limits = s.get("/v1/accounts/a/limits").await.body;
    assert_eq!((limits["limits"][0]["spent"].as_i64(), limits["limits"][1]["spent"].as_i64()), (Some(100), Some(40)));
    assert_eq!(s.get("/v1/accounts/nobody/limits").await.status, 404);
}

async fn ledger_len(s: &Server) -> usize {
    s.get("/v1/accounts/a/ledger").await.body["entries"].as_array().unwrap().len()
}

/// 60 creates of 9 race over HTTP on a day limit of 200: exactly ⌊200/9⌋ = 22 answer 201.
async fn racing_creates_over_http_never_pass_a_limit(engine: Engine) {
    let s = std::sync::Arc::new(Server::start(engine).await);
    s.account("a", 10_000).await;
    let r =
        s.send("PUT", "/v1/accounts/a/limits", Some(json!({"limits": [{"period": "day", "amount": 200}]})), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    let tasks: Vec<_> = (0..60)
        .map(|n| {
            let s = s.clone();
            tokio::spawn(async move {
                let r = s
                    .post("/v1/jobs", json!({"id": format!("j{n}"), "account_id": "a", "kind": "render", "cost": 9}))
                    .await;
                (r.status, code(&r).to_owned())
            })
        })
        .collect();
    let mut created = 0;
    for t in tasks {
        match t.await.unwrap() {
            (201, _) => created += 1,
            (402, c) if c == "spend_limit_exceeded" => {}
            other => panic!("create: {other:?}"),
        }
    }
    assert_eq!(created, 22);
    assert_eq!(s.get("/v1/accounts/a/limits").await.body["limits"][0]["spent"], 198);
}

async fn bad_limit_sets_write_nothing(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 1_000).await;
    let good = json!({"limits": [{"period": "day", "amount": 500}]});
    assert_eq!(s.send("PUT", "/v1/accounts/a/limits", Some(good), None).await.status, 200);
    let many: Vec<Value> = (0..17).map(|n| json!({"period": "day", "amount": 10 + n})).collect();
    let kinds: Vec<String> = (0..17).map(|n| format!("k{n}")).collect();
    for body in [
        json!({"limits": [{"period": "day", "amount": 0}]}),
        json!({"limits": [{"period": "day", "amount": -1}]}),
        json!({"limits": [{"period": "day", "amount": 2.5}]}),
        json!({"limits": [{"period": "day", "amount": 9_223_372_036_854_775_807i64}]}),
        json!({"limits": [{"period": "week", "amount": 5}]}),
        json!({"limits": [{"period": "day", "amount": 5, "kinds": ["render", "render"]}]}),
        json!({"limits": [{"period": "day", "amount": 5, "kinds": [""]}]}),
        json!({"limits": [{"period": "day", "amount": 5, "kinds": kinds}]}),
        json!({"limits": [{"period": "day", "amount": 5, "every": "day"}]}),
        json!({"limits": [{"amount": 5}]}),
        json!({"limit": []}),
        json!({"limits": many}),
    ] {
        let r = s.send("PUT", "/v1/accounts/a/limits", Some(body.clone()), None).await;
        assert!(r.status == 400 || r.status == 422, "{body}: {} {}", r.status, r.body);
    }
    let r = s.send("PUT", "/v1/accounts/nobody/limits", Some(json!({"limits": []})), None).await;
    assert_eq!(r.status, 404, "{}", r.body);
    let now = s.get("/v1/accounts/a/limits").await.body;
    assert_eq!(now["limits"].as_array().unwrap().len(), 1, "the set is as it was: {now}");
    assert_eq!(now["limits"][0]["amount"], 500);
}
