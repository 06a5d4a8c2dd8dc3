//! `POST /v1/withdrawals` and its reads, over real HTTP on both engines: holds, replays, bad input
//! that writes nothing, roles, the reserved kind, and an admin's return.

use crate::kit::*;
use serde_json::{Value, json};
use settle_api::{Role, Tokens};
use settle_core::ids::{JobId, WorkerName};
use settle_store::Store;

on_both_engines!(
    withdrawals_hold_replay_and_read,
    bad_withdrawals_are_4xx_and_write_nothing,
    withdrawal_roles,
    withdrawals_are_not_for_workers,
    an_admin_records_a_return_once,
);

fn body(id: &str, amount: Value, destination: Value) -> Value {
    json!({"id": id, "account_id": "alice", "amount": amount, "destination": destination})
}

async fn withdrawals_hold_replay_and_read(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 100).await;
    let r = s.post("/v1/withdrawals", body("w1", json!(40), json!("acct-42"))).await;
    assert_eq!((r.status, r.replayed), (201, false), "{}", r.body);
    let w = r.body;
    assert_eq!(
        (w["kind"].as_str(), w["state"].as_str(), w["refund_on"].as_str()),
        (Some("withdrawal"), Some("queued"), Some("final_failure"))
    );
    assert_eq!(
        (w["amount"].as_i64(), w["destination"].as_str(), w["cost"].as_i64()),
        (Some(40), Some("acct-42"), Some(40))
    );
    assert!(w["idempotency_key"].as_str().unwrap().starts_with("wd_"));
    assert!(w["provider_txid"].is_null() && w["returned_at"].is_null());
    assert_eq!(s.balance("alice").await, 60);
    let again = s.post("/v1/withdrawals", body("w1", json!(40), json!("acct-42"))).await;
    assert_eq!((again.status, again.replayed), (200, true));
    assert_eq!(again.body["idempotency_key"], w["idempotency_key"], "the key is made once");
    let other = s.post("/v1/withdrawals", body("w1", json!(40), json!("acct-43"))).await;
    assert_eq!((other.status, code(&other)), (409, "idempotency_conflict"));
    assert_eq!(s.balance("alice").await, 60);
    let got = s.get("/v1/withdrawals/w1").await;
    assert_eq!((got.status, &got.body["idempotency_key"]), (200, &w["idempotency_key"]));
    assert_eq!(s.get("/v1/jobs/w1").await.body["kind"], "withdrawal");
    assert_eq!(s.get("/v1/jobs/w1/attempts").await.body["attempts"], json!([]));
    s.job("plain", "alice", 1).await;
    let r = s.get("/v1/withdrawals/plain").await;
    assert_eq!((r.status, code(&r)), (404, "not_found"), "a plain job is not a withdrawal");
    assert_eq!(s.get("/v1/withdrawals/nope").await.status, 404);
    let list = s.get("/v1/withdrawals?state=queued").await;
    assert_eq!(list.body["withdrawals"].as_array().unwrap().len(), 1);
    assert!(list.body["next_after"].is_null());
    assert_eq!(s.get("/v1/withdrawals?state=succeeded").await.body["withdrawals"], json!([]));
    assert_eq!(s.get("/v1/withdrawals?state=nonsense").await.status, 400);
    assert_eq!(s.get("/v1/withdrawals?colour=red").await.status, 400);
}

async fn bad_withdrawals_are_4xx_and_write_nothing(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 100).await;
    let events_before = s.get("/v1/events?limit=1000").await.body["events"].as_array().unwrap().len();
    let long = "d".repeat(257);
    for bad in [
        body("w", json!(0), json!("acct")),
        body("w", json!(-5), json!("acct")),
        body("w", json!(2_305_843_009_213_693_953_i64), json!("acct")),
        body("w", json!(i64::MAX), json!("acct")),
        body("w", json!("10"), json!("acct")),
        body("w", json!(1.5), json!("acct")),
        body("w", json!(18_446_744_073_709_551_615_u64), json!("acct")),
        body("w", json!(10), json!("")),
        body("w", json!(10), json!(long)),
        body("w", json!(10), json!(" lead")),
        body("w", json!(10), json!("tab\there")),
        body("w", json!(10), json!("naïve")),
        body("w", json!(10), json!(null)),
        json!({"id": "w", "account_id": "alice", "amount": 10}),
        json!({"id": "w", "account_id": "alice", "destination": "acct"}),
        json!({"account_id": "alice", "amount": 10, "destination": "acct"}),
        json!({"id": "w", "account_id": "alice", "amount": 10, "destination": "acct", "memo": "hi"}),
        json!({"id": "a b", "account_id": "alice", "amount": 10, "destination": "acct"}),
        json!({"id": "w", "account_id": "alice", "amount": 10, "destination": "acct", "kind": "withdrawal"}),
    ] {
        let r = s.post("/v1/withdrawals", bad.clone()).await;
        assert_eq!((r.status, code(&r)), (400, "invalid_request"), "{bad}: {}", r.body);
    }
    let r = s.post("/v1/withdrawals", body("w", json!(101), json!("acct"))).await;
    assert_eq!((r.status, code(&r)), (402, "insufficient_credits"));
    let r =
        s.post("/v1/withdrawals", json!({"id": "w", "account_id": "bob", "amount": 1, "destination": "acct"})).await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
    let r = s.send("POST", "/v1/withdrawals", Some(json!("not an object")), None).await;
    assert_eq!(r.status, 400);
    assert_eq!(s.get("/v1/withdrawals/w").await.status, 404);
    assert_eq!(s.balance("alice").await, 100);
    let ledger = s.get("/v1/accounts/alice/ledger").await.body["entries"].as_array().unwrap().len();
    assert_eq!(ledger, 1, "only the grant");
    let events_after = s.get("/v1/events?limit=1000").await.body["events"].as_array().unwrap().len();
    assert_eq!(events_after, events_before);
}

async fn withdrawal_roles(e: Engine) {
    let mut tokens = Tokens::default();
    tokens.add(Role::Admin, "admin-token-0123456789").unwrap();
    tokens.add(Role::Client, "client-token-0123456789").unwrap();
    tokens.add(Role::Worker, "worker-token-0123456789").unwrap();
    let s = Server::with_tokens(e, tokens).await;
    let (admin, client, worker) =
        (Some("admin-token-0123456789"), Some("client-token-0123456789"), Some("worker-token-0123456789"));
    assert_eq!(s.send("POST", "/v1/accounts", Some(json!({"id": "alice"})), admin).await.status, 201);
    let g = json!({"id": "g", "amount": 50});
    assert_eq!(s.send("POST", "/v1/accounts/alice/grants", Some(g), admin).await.status, 201);
    let w = body("w", json!(10), json!("acct"));
    let r = s.send("POST", "/v1/withdrawals", Some(w.clone()), None).await;
    assert_eq!((r.status, code(&r)), (401, "unauthorized"));
    let r = s.send("POST", "/v1/withdrawals", Some(w.clone()), worker).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    assert_eq!(s.send("POST", "/v1/withdrawals", Some(w), client).await.status, 201);
    assert_eq!(s.send("GET", "/v1/withdrawals/w", None, worker).await.status, 403);
    assert_eq!(s.send("GET", "/v1/withdrawals/w", None, client).await.status, 200);
    let r = s.send("POST", "/v1/withdrawals/w/returned", None, client).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    let r = s.send("POST", "/v1/withdrawals/w/returned", None, admin).await;
    assert_eq!((r.status, code(&r)), (409, "invalid_transition"), "a queued withdrawal was not paid out");
}

async fn withdrawals_are_not_for_workers(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 100).await;
    let r = s.post("/v1/jobs", json!({"id": "j", "account_id": "alice", "kind": "withdrawal", "cost": 5})).await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"), "the kind is reserved");
    assert_eq!(s.post("/v1/withdrawals", body("w", json!(10), json!("acct"))).await.status, 201);
    let r = s.post("/v1/claims", json!({"worker": "w1"})).await;
    assert_eq!((r.status, &r.body["jobs"]), (200, &json!([])), "workers never get a withdrawal");
    let r = s.post("/v1/claims", json!({"worker": "w1", "kinds": ["withdrawal"]})).await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"));
    for (path, b) in [
        ("/v1/jobs/w/succeed", json!({})),
        ("/v1/jobs/w/fail", json!({"lease_token": "t", "code": "NODE_DOWN"})),
        ("/v1/jobs/w/unknown", json!({"lease_token": "t"})),
    ] {
        let r = s.post(path, b).await;
        assert_eq!((r.status, code(&r)), (409, "invalid_transition"), "{path}");
    }
    let w = s.get("/v1/withdrawals/w").await.body;
    assert_eq!((w["state"].as_str(), w["attempt"].as_i64()), (Some("queued"), Some(0)));
    assert_eq!(s.balance("alice").await, 90);
}

async fn an_admin_records_a_return_once(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 100).await;
    assert_eq!(s.post("/v1/withdrawals", body("w", json!(40), json!("acct"))).await.status, 201);
    // The payout processor's part, through the store the server uses.
    let store = s.store_handle();
    let claimed = store.payouts().claim_payouts(&WorkerName::parse("payouts").unwrap(), 1).await.unwrap();
    let id = JobId::parse("w").unwrap();
    store.payouts().payout_succeeded(&id, Some(&claimed[0].lease_token), "tx-1", false).await.unwrap();
    let w = s.get("/v1/withdrawals/w").await.body;
    assert_eq!((w["state"].as_str(), w["provider_txid"].as_str()), (Some("succeeded"), Some("tx-1")));
    assert_eq!(s.balance("alice").await, 60);
    let r = s.post_empty("/v1/withdrawals/w/returned").await;
    assert_eq!((r.status, r.body["state"].as_str(), r.body["net"].as_i64()), (200, Some("returned"), Some(0)));
    assert!(r.body["returned_at"].is_string());
    let again = s.post_empty("/v1/withdrawals/w/returned").await;
    assert_eq!((again.status, again.body["state"].as_str()), (200, Some("returned")));
    assert_eq!(s.balance("alice").await, 100);
    let kinds: Vec<String> = s.get("/v1/accounts/alice/ledger").await.body["entries"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["kind"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(kinds, vec!["grant", "charge", "payout_return"]);
    assert_eq!(s.get("/v1/audit").await.body["ok"], true);
    let r = s.post_empty("/v1/withdrawals/nope/returned").await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
    let r = s.post_empty("/v1/jobs/w/cancel").await;
    assert_eq!((r.status, code(&r)), (409, "job_finished"));
    let types: Vec<String> = store
        .events(0, 1000, &settle_core::scope::Scope::ALL)
        .await
        .unwrap()
        .rows
        .into_iter()
        .map(|e| e.kind.as_str().to_owned())
        .collect();
    assert!(types.contains(&"withdrawal.returned".to_owned()));
}
