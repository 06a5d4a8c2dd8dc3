//! Expiring grants over HTTP (issue 24, docs/decisions/0023): a grant's `expires_at` and `priority`,
//! the account's grants listed, and every bad term a clear 400 that writes nothing — on both engines.

use crate::kit::*;
use serde_json::{Value, json};

on_both_engines!(grants_carry_terms_and_are_listed, bad_terms_write_nothing);

/// RFC 3339, `seconds` from now.
fn in_seconds(seconds: i64) -> String {
    let now = settle_core::Clock::now(&settle_core::SystemClock).micros();
    settle_core::Timestamp::from_micros(now + seconds * 1_000_000).rfc3339()
}

async fn grants_carry_terms_and_are_listed(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 100).await;
    let trial = in_seconds(3_600);
    let body = json!({"id": "trial", "amount": 50, "expires_at": trial, "priority": 10});
    let r = s.post("/v1/accounts/a/grants", body.clone()).await;
    assert_eq!(r.status, 201, "{}", r.body);
    assert_eq!((r.body["kind"].as_str(), r.body["amount"].as_i64()), (Some("grant"), Some(50)));
    let r = s.post("/v1/accounts/a/grants", body).await;
    assert_eq!((r.status, r.replayed), (200, true));
    let r = s.post("/v1/jobs", json!({"id": "j", "account_id": "a", "kind": "render", "cost": 30})).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let r = s.get("/v1/accounts/a/grants").await;
    assert_eq!(r.status, 200, "{}", r.body);
    let grants = r.body["grants"].as_array().unwrap().clone();
    let shown: Vec<(&str, i64, i64, &str, i64)> = grants
        .iter()
        .map(|g| {
            let (id, amount, remaining) =
                (g["id"].as_str().unwrap(), g["amount"].as_i64().unwrap(), g["remaining"].as_i64().unwrap());
            (id, amount, remaining, g["state"].as_str().unwrap(), g["priority"].as_i64().unwrap())
        })
        .collect();
    // The trial goes first (priority 10): the job took 30 of it.
    assert_eq!(shown, [("g-a", 100, 100, "active", 50), ("trial", 50, 20, "active", 10)]);
    assert_eq!(grants[0]["expires_at"], Value::Null);
    assert_eq!(grants[1]["expires_at"].as_str().map(|t| t.get(..19)), Some(trial.get(..19)));
    let r = s.get("/v1/accounts/nobody/grants").await;
    assert_eq!(r.status, 404, "{}", r.body);
}

async fn bad_terms_write_nothing(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 100).await;
    let before = s.get("/v1/accounts/a/ledger").await.body["entries"].clone();
    for (body, says) in [
        (json!({"id": "g1", "amount": 5, "expires_at": in_seconds(-60)}), "future"),
        (json!({"id": "g1", "amount": 5, "expires_at": "next tuesday"}), "RFC 3339"),
        (json!({"id": "g1", "amount": 5, "expires_at": 1767225600}), ""),
        (json!({"id": "g1", "amount": 5, "priority": 101}), "priority"),
        (json!({"id": "g1", "amount": 5, "priority": -1}), "priority"),
        (json!({"id": "g1", "amount": 5, "priority": 2.5}), ""),
        (json!({"id": "g1", "amount": 5, "expires": in_seconds(60)}), "expires"),
    ] {
        let r = s.post("/v1/accounts/a/grants", body.clone()).await;
        assert!(r.status == 400 || r.status == 422, "{body}: {} {}", r.status, r.body);
        let message = r.body["error"]["message"].as_str().unwrap_or_default().to_lowercase();
        assert!(message.contains(&says.to_lowercase()), "{body}: {}", r.body);
    }
    assert_eq!(s.get("/v1/accounts/a/ledger").await.body["entries"], before, "nothing written");
    assert_eq!(s.get("/v1/accounts/a/grants").await.body["grants"].as_array().unwrap().len(), 1);
}
