//! `POST /v1/top-ups` and its reads, over real HTTP on both engines: nothing charged to the
//! account, replays, bad input that writes nothing, roles (a free top-up is an admin's), scopes,
//! and the reserved kind that workers never see.

use crate::kit::*;
use serde_json::{Value, json};
use settle_api::{Role, Tokens};
use settle_core::scope::Scope;

on_both_engines!(
    top_ups_create_replay_and_read,
    bad_top_ups_are_4xx_and_write_nothing,
    top_up_roles_and_scopes,
    top_ups_are_not_for_workers,
    an_auto_top_up_rule_is_put_read_and_deleted,
);

fn body(id: &str, credits: Value, price: Value, currency: Value) -> Value {
    json!({"id": id, "account_id": "alice", "credits": credits, "price": price, "currency": currency, "customer": "cus_alice"})
}

async fn top_ups_create_replay_and_read(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 100).await;
    let r = s.post("/v1/top-ups", body("t1", json!(500), json!(499), json!("eur"))).await;
    assert_eq!((r.status, r.replayed), (201, false), "{}", r.body);
    let t = r.body;
    assert_eq!(
        (t["kind"].as_str(), t["state"].as_str(), t["refund_on"].as_str(), t["cost"].as_i64()),
        (Some("top_up"), Some("queued"), Some("final_failure"), Some(0))
    );
    assert_eq!(
        (t["credits"].as_i64(), t["price"].as_i64(), t["currency"].as_str(), t["customer"].as_str()),
        (Some(500), Some(499), Some("EUR"), Some("cus_alice"))
    );
    assert!(t["idempotency_key"].as_str().unwrap().starts_with("tu_"));
    assert!(t["provider_charge_id"].is_null() && t["grant_id"].is_null() && t["rule"] == json!(false));
    assert_eq!(s.balance("alice").await, 100, "nothing is charged to the account");
    // the same body (the currency in capitals) is a replay; another is a conflict
    let again = s.post("/v1/top-ups", body("t1", json!(500), json!(499), json!("EUR"))).await;
    assert_eq!((again.status, again.replayed), (200, true));
    assert_eq!(again.body["idempotency_key"], t["idempotency_key"], "the key is made once");
    let other = s.post("/v1/top-ups", body("t1", json!(500), json!(500), json!("EUR"))).await;
    assert_eq!((other.status, code(&other)), (409, "idempotency_conflict"));
    let got = s.get("/v1/top-ups/t1").await;
    assert_eq!((got.status, &got.body["idempotency_key"]), (200, &t["idempotency_key"]));
    s.job("plain", "alice", 1).await;
    let r = s.get("/v1/top-ups/plain").await;
    assert_eq!((r.status, code(&r)), (404, "not_found"), "a plain job is not a top-up");
    let list = s.get("/v1/top-ups?state=queued&account_id=alice").await;
    assert_eq!(list.body["top_ups"].as_array().unwrap().len(), 1);
    assert_eq!(s.get("/v1/top-ups?state=succeeded").await.body["top_ups"], json!([]));
    assert_eq!(s.get("/v1/top-ups?state=nonsense").await.status, 400);
    assert_eq!(s.get("/v1/top-ups?colour=red").await.status, 400);
    // a queued top-up is cancelled
    let r = s.post("/v1/jobs/t1/cancel", json!({})).await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("cancelled")), "{}", r.body);
    let events: Vec<String> = s.get("/v1/events?limit=1000").await.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["type"].as_str().unwrap().to_owned())
        .collect();
    assert!(events.contains(&"top_up.queued".to_owned()) && events.contains(&"top_up.failed".to_owned()), "{events:?}");
}

async fn bad_top_ups_are_4xx_and_write_nothing(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 100).await;
    let events_before = s.get("/v1/events?limit=1000").await.body["events"].as_array().unwrap().len();
    let max = 9_007_199_254_740_992_i64;
    for (b, status) in [
        (body("t", json!(0), json!(1), json!("USD")), 400),
        (body("t", json!(-5), json!(1), json!("USD")), 400),
        (body("t", json!(max + 1), json!(1), json!("USD")), 400),
        (body("t", json!(2.5), json!(1), json!("USD")), 400),
        (body("t", json!(5), json!(-1), json!("USD")), 400),
        (body("t", json!(5), json!(max + 1), json!("USD")), 400),
        (body("t", json!(5), json!("1"), json!("USD")), 400),
        (body("t", json!(5), json!(1), json!("XXX")), 400),
        (body("t", json!(5), json!(1), json!("dollars")), 400),
        (body("t", json!(5), json!(1), json!("")), 400),
        (json!({"id": "t", "account_id": "alice", "credits": 5, "price": 1, "currency": "USD", "customer": " x"}), 400),
        (json!({"id": "t", "account_id": "alice", "credits": 5, "price": 1, "currency": "USD"}), 400),
        (
            json!({"id": "t", "account_id": "alice", "credits": 5, "price": 1, "currency": "USD", "customer": "c", "colour": 1}),
            400,
        ),
        (json!({"id": "t", "account_id": "nobody", "credits": 5, "price": 1, "currency": "USD", "customer": "c"}), 404),
        (json!({"id": "..", "account_id": "alice", "credits": 5, "price": 1, "currency": "USD", "customer": "c"}), 400),
    ] {
        let r = s.post("/v1/top-ups", b.clone()).await;
        assert_eq!(r.status, status, "{b}: {}", r.body);
    }
    // an admin grant's id is not a top-up's
    let g = s.post("/v1/accounts/alice/grants", json!({"id": "g1", "amount": 5})).await;
    assert_eq!(g.status, 201);
    let r = s.post("/v1/top-ups", body("g1", json!(5), json!(1), json!("USD"))).await;
    assert_eq!((r.status, code(&r)), (409, "idempotency_conflict"), "the id is an admin grant's");
    let events_after = s.get("/v1/events?limit=1000").await.body["events"].as_array().unwrap().len();
    assert_eq!(events_after, events_before + 1, "only the grant's event");
    assert_eq!(s.get("/v1/top-ups").await.body["top_ups"], json!([]));
    assert_eq!(s.balance("alice").await, 105);
}

async fn top_up_roles_and_scopes(e: Engine) {
    let mut tokens = Tokens::default();
    tokens.add(Role::Admin, "admin-token-0123456789").unwrap();
    tokens.add(Role::Client, "client-token-0123456789").unwrap();
    tokens.add(Role::Worker, "worker-token-0123456789").unwrap();
    let render = Scope::parse_words(["kinds=render"]).unwrap();
    tokens.add_scoped(Role::Client, "render-client-0123456789", "render", render).unwrap();
    let acme = Scope::parse_words(["accounts=acme-*", "kinds=top_up"]).unwrap();
    tokens.add_scoped(Role::Client, "acme-client-0123456789", "acme", acme).unwrap();
    let tenant = Scope::parse_words(["accounts=acme-*"]).unwrap();
    tokens.add_scoped(Role::Client, "tenant-client-0123456789", "tenant", tenant).unwrap();
    let s = Server::with_tokens(e, tokens).await;
    let (admin, client, worker) =
        (Some("admin-token-0123456789"), Some("client-token-0123456789"), Some("worker-token-0123456789"));
    for a in ["alice", "acme-1"] {
        assert_eq!(s.send("POST", "/v1/accounts", Some(json!({"id": a})), admin).await.status, 201);
    }
    let t = body("t", json!(10), json!(99), json!("USD"));
    assert_eq!(s.send("POST", "/v1/top-ups", Some(t.clone()), None).await.status, 401);
    let r = s.send("POST", "/v1/top-ups", Some(t.clone()), worker).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    // a token scoped to other kinds may not buy
    let r = s.send("POST", "/v1/top-ups", Some(t.clone()), Some("render-client-0123456789")).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    assert_eq!(s.send("POST", "/v1/top-ups", Some(t), client).await.status, 201);
    // a free top-up gives credit away: an admin's only
    let free = body("free", json!(10), json!(0), json!("USD"));
    let r = s.send("POST", "/v1/top-ups", Some(free.clone()), client).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    assert_eq!(s.send("POST", "/v1/top-ups", Some(free), admin).await.status, 201);
    // a token scoped to accounts alone does not charge customers: top_up must be named
    let mine =
        json!({"id": "a0", "account_id": "acme-1", "credits": 5, "price": 1, "currency": "USD", "customer": "c"});
    let r = s.send("POST", "/v1/top-ups", Some(mine), Some("tenant-client-0123456789")).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    // a scoped client buys for its own accounts only, and sees only those
    let acme = Some("acme-client-0123456789");
    let mine =
        json!({"id": "a1", "account_id": "acme-1", "credits": 5, "price": 1, "currency": "USD", "customer": "c"});
    assert_eq!(s.send("POST", "/v1/top-ups", Some(mine), acme).await.status, 201);
    let r = s.send("POST", "/v1/top-ups", Some(body("a2", json!(5), json!(1), json!("USD"))), acme).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    assert_eq!(s.send("GET", "/v1/top-ups/t", None, acme).await.status, 404);
    let list = s.send("GET", "/v1/top-ups", None, acme).await;
    let ids: Vec<&str> = list.body["top_ups"].as_array().unwrap().iter().map(|t| t["id"].as_str().unwrap()).collect();
    assert_eq!(ids, vec!["a1"]);
    assert_eq!(s.send("GET", "/v1/top-ups/t", None, worker).await.status, 403);
}

async fn top_ups_are_not_for_workers(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 100).await;
    let r = s.post("/v1/jobs", json!({"id": "j", "account_id": "alice", "kind": "top_up", "cost": 0})).await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"), "the kind is reserved");
    assert_eq!(s.post("/v1/top-ups", body("t", json!(10), json!(99), json!("USD"))).await.status, 201);
    let r = s.post("/v1/claims", json!({"worker": "w1"})).await;
    assert_eq!((r.status, &r.body["jobs"]), (200, &json!([])), "workers never get a top-up");
    let r = s.post("/v1/claims", json!({"worker": "w1", "kinds": ["top_up"]})).await;
    assert_eq!((r.status, code(&r)), (400, "invalid_request"));
    let token = json!({"lease_token": "00000000-0000-0000-0000-000000000000"});
    for path in
        ["/v1/jobs/t/succeed", "/v1/jobs/t/fail", "/v1/jobs/t/heartbeat", "/v1/jobs/t/unknown", "/v1/jobs/t/release"]
    {
        let mut b = token.clone();
        if path.ends_with("fail") {
            b["code"] = json!("NODE_DOWN");
        }
        let r = s.post(path, b).await;
        assert!(r.status == 409 || r.status == 400, "{path}: {} {}", r.status, r.body);
    }
    let r = s.post("/v1/jobs/t/requeue", json!({})).await;
    assert_eq!(r.status, 409, "{}", r.body);
    assert_eq!(s.get("/v1/jobs/t").await.body["state"], "queued");
}

async fn an_auto_top_up_rule_is_put_read_and_deleted(e: Engine) {
    let s = Server::start(e).await;
    s.account("alice", 1_000).await;
    let r = s.get("/v1/accounts/alice/auto-top-up").await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
    let rule = json!({"below": 500, "credits": 1000, "price": 999, "currency": "usd", "customer": "cus_alice", "monthly_credits_max": 5000});
    let r = s.send("PUT", "/v1/accounts/alice/auto-top-up", Some(rule.clone()), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(
        (r.body["state"].as_str(), r.body["currency"].as_str(), r.body["credits_this_month"].as_i64()),
        (Some("active"), Some("USD"), Some(0))
    );
    assert!(r.body["month_resets_at"].as_str().unwrap().ends_with("T00:00:00Z"));
    assert_eq!(s.get("/v1/accounts/alice/auto-top-up").await.body, r.body);
    // a create that crosses it buys, in its own transaction
    s.job("j1", "alice", 600).await;
    let bought = s.get("/v1/top-ups?account_id=alice").await.body["top_ups"].clone();
    assert_eq!(bought.as_array().unwrap().len(), 1, "{bought}");
    assert_eq!((bought[0]["rule"].as_bool(), bought[0]["credits"].as_i64()), (Some(true), Some(1000)));
    assert_eq!(s.get("/v1/accounts/alice/auto-top-up").await.body["credits_this_month"], 1000);
    for bad in [
        json!({"below": 0, "credits": 5, "price": 1, "currency": "USD", "customer": "c", "monthly_credits_max": 5}),
        json!({"below": 5, "credits": 0, "price": 1, "currency": "USD", "customer": "c", "monthly_credits_max": 5}),
        json!({"below": 5, "credits": 10, "price": 1, "currency": "USD", "customer": "c", "monthly_credits_max": 5}),
        json!({"below": 5, "credits": 5, "price": 1, "currency": "XYZ", "customer": "c", "monthly_credits_max": 5}),
        json!({"below": 5, "credits": 5, "price": -1, "currency": "USD", "customer": "c", "monthly_credits_max": 5}),
        json!({"below": 5, "credits": 5, "price": 1, "currency": "USD", "customer": "c"}),
        json!({"below": 5, "credits": 5, "price": 1, "currency": "USD", "customer": "c", "monthly_credits_max": 5, "x": 1}),
    ] {
        let r = s.send("PUT", "/v1/accounts/alice/auto-top-up", Some(bad.clone()), None).await;
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
    }
    assert_eq!(s.get("/v1/accounts/alice/auto-top-up").await.body["below"], 500, "a bad rule changed nothing");
    let r = s.send("PUT", "/v1/accounts/nobody/auto-top-up", Some(rule), None).await;
    assert_eq!(r.status, 404);
    assert_eq!(s.send("DELETE", "/v1/accounts/alice/auto-top-up", None, None).await.status, 204);
    assert_eq!(s.send("DELETE", "/v1/accounts/alice/auto-top-up", None, None).await.status, 204);
    assert_eq!(s.get("/v1/accounts/alice/auto-top-up").await.status, 404);
    assert_eq!(s.get("/v1/audit").await.body["ok"], true);
}
