//! Issue 19: least privilege for tokens (decision 0018). A client token scoped to accounts or job
//! kinds sees and moves only those, on every route, in the API and the console; a worker token
//! scoped to kinds claims and reports only those. Every route, in and out of scope, both engines.

use crate::kit::*;
use serde_json::{Value, json};
use settle_api::{Role, Tokens};
use settle_core::scope::Scope;

on_both_engines!(
    an_account_scoped_client_sees_and_moves_only_its_accounts,
    a_kind_scoped_client_sees_and_moves_only_its_kinds,
    a_kind_scoped_worker_claims_and_reports_only_its_kinds,
    a_scoped_console_session_sees_only_its_scope,
);

const ADMIN: &str = "admin-token-for-scope-tests";
const ACME: &str = "acme-client-token-scoped";
const RENDER: &str = "render-client-token-scoped";
const GPU: &str = "render-worker-token-scoped";
const WORKER: &str = "any-worker-token-unscoped";

async fn server(e: Engine) -> Server {
    let mut t = Tokens::default();
    t.add_named(Role::Admin, ADMIN, "ops").unwrap();
    t.add_scoped(Role::Client, ACME, "acme", Scope::parse_words(["accounts=acme-*"]).unwrap()).unwrap();
    t.add_scoped(Role::Client, RENDER, "render", Scope::parse_words(["kinds=render"]).unwrap()).unwrap();
    t.add_scoped(Role::Worker, GPU, "gpu", Scope::parse_words(["kinds=render"]).unwrap()).unwrap();
    t.add_named(Role::Worker, WORKER, "any").unwrap();
    let mut s = Server::with_tokens(e, t).await;
    s.token = Some(ADMIN.to_owned());
    // acme-1 and globex, each with a render and a thumb job and a withdrawal; a dead job each.
    for a in ["acme-1", "globex"] {
        s.account(a, 1_000).await;
        for kind in ["render", "thumb"] {
            let r = s
                .post("/v1/jobs", json!({"id": format!("{a}-{kind}"), "account_id": a, "kind": kind, "cost": 10}))
                .await;
            assert_eq!(r.status, 201, "{}", r.body);
        }
        let r = s
            .post(
                "/v1/withdrawals",
                json!({"id": format!("{a}-wd"), "account_id": a, "amount": 5, "destination": "DE89"}),
            )
            .await;
        assert_eq!(r.status, 201);
        let r = s
            .post(
                "/v1/jobs",
                json!({"id": format!("{a}-dead"), "account_id": a, "kind": "render", "cost": 1, "max_attempts": 1}),
            )
            .await;
        assert_eq!(r.status, 201);
    }
    // The render jobs, claimed by an unscoped worker: the two `-dead` fail for good, the other
    // two wait to retry.
    let r = s
        .send("POST", "/v1/claims", Some(json!({"worker": "w", "kinds": ["render"], "limit": 10})), Some(WORKER))
        .await;
    assert_eq!(r.body["jobs"].as_array().unwrap().len(), 4, "{}", r.body);
    for j in r.body["jobs"].as_array().unwrap() {
        let id = j["id"].as_str().unwrap();
        let body = if id.ends_with("-dead") {
            json!({"lease_token": j["lease_token"], "code": "INVALID_INPUT", "retryable": false})
        } else {
            json!({"lease_token": j["lease_token"], "code": "NODE_DOWN", "retryable": true})
        };
        let r = s.send("POST", &format!("/v1/jobs/{id}/fail"), Some(body), Some(WORKER)).await;
        assert_eq!(r.status, 200, "{}", r.body);
    }
    s
}

async fn as_(s: &Server, token: &str, method: &str, path: &str, body: Option<Value>) -> Reply {
    s.send(method, path, body, Some(token)).await
}

fn ids(v: &Value, key: &str) -> Vec<String> {
    let mut ids: Vec<String> =
        v[key].as_array().unwrap().iter().map(|j| j["id"].as_str().unwrap().to_owned()).collect();
    ids.sort();
    ids
}

async fn an_account_scoped_client_sees_and_moves_only_its_accounts(e: Engine) {
    let s = server(e).await;
    // Reads: in scope 200, out of scope 404 as if absent.
    for (path, inside) in [
        ("/v1/accounts/acme-1", true),
        ("/v1/accounts/globex", false),
        ("/v1/accounts/acme-1/ledger", true),
        ("/v1/accounts/globex/ledger", false),
        ("/v1/jobs/acme-1-render", true),
        ("/v1/jobs/globex-render", false),
        ("/v1/jobs/acme-1-thumb/attempts", true),
        ("/v1/jobs/globex-thumb/attempts", false),
        ("/v1/withdrawals/acme-1-wd", true),
        ("/v1/withdrawals/globex-wd", false),
    ] {
        let r = as_(&s, ACME, "GET", path, None).await;
        assert_eq!(r.status, if inside { 200 } else { 404 }, "{path}: {}", r.body);
        if !inside {
            assert_eq!(code(&r), "not_found");
        }
    }
    // Lists hold only the scope, whatever the filter asks.
    let r = as_(&s, ACME, "GET", "/v1/accounts", None).await;
    assert_eq!((r.status, ids(&r.body, "accounts")), (200, vec!["acme-1".to_owned()]), "{}", r.body);
    let r = as_(&s, ACME, "GET", "/v1/accounts?after=acme-1", None).await;
    assert!(ids(&r.body, "accounts").is_empty());
    let r = s.get("/v1/accounts").await;
    assert_eq!(ids(&r.body, "accounts"), ["acme-1", "globex"]);
    let r = as_(&s, ACME, "GET", "/v1/jobs?limit=1000", None).await;
    assert_eq!(ids(&r.body, "jobs"), ["acme-1-dead", "acme-1-render", "acme-1-thumb", "acme-1-wd"]);
    let r = as_(&s, ACME, "GET", "/v1/jobs?account_id=globex", None).await;
    assert!(ids(&r.body, "jobs").is_empty());
    let r = as_(&s, ACME, "GET", "/v1/withdrawals", None).await;
    assert_eq!(ids(&r.body, "withdrawals"), ["acme-1-wd"]);
    let r = as_(&s, ACME, "GET", "/v1/failures/summary", None).await;
    let total: i64 = r.body["by_code"].as_array().unwrap().iter().map(|c| c["count"].as_i64().unwrap()).sum();
    assert_eq!(total, 2, "acme's dead job and its retrying render: {}", r.body);
    let all = s.get("/v1/failures/summary").await;
    let everyone: i64 = all.body["by_code"].as_array().unwrap().iter().map(|c| c["count"].as_i64().unwrap()).sum();
    assert_eq!(everyone, 4);
    let r = as_(&s, ACME, "GET", "/v1/events?limit=1000", None).await;
    let events = r.body["events"].as_array().unwrap();
    assert!(!events.is_empty() && events.iter().all(|e| e["account_id"] == "acme-1"), "{}", r.body);
    // Issue 41: a page says how far it looked. Past acme's last event lie only others': the empty
    // page's cursor moves past them (a consumer never rescans them), and from there it is caught up.
    let last_acme = events.last().unwrap()["seq"].as_i64().unwrap();
    let top = s.get("/v1/events?limit=1000").await.body["events"].as_array().unwrap().last().unwrap()["seq"].clone();
    assert!(top.as_i64().unwrap() > last_acme, "globex's events come after acme's");
    let r = as_(&s, ACME, "GET", &format!("/v1/events?after={last_acme}"), None).await;
    assert_eq!(
        (r.body["events"].as_array().unwrap().len(), r.body["next_after"].clone()),
        (0, top.clone()),
        "{}",
        r.body
    );
    let r = as_(&s, ACME, "GET", &format!("/v1/events?after={top}&wait_seconds=0"), None).await;
    assert_eq!(r.body["next_after"], Value::Null, "caught up: {}", r.body);
    // Writes: out of scope refused (403) and nothing written.
    let r = as_(
        &s,
        ACME,
        "POST",
        "/v1/jobs",
        Some(json!({"id": "x1", "account_id": "globex", "kind": "render", "cost": 1})),
    )
    .await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    let r = as_(
        &s,
        ACME,
        "POST",
        "/v1/withdrawals",
        Some(json!({"id": "x2", "account_id": "globex", "amount": 1, "destination": "attacker"})),
    )
    .await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    for id in ["x1", "x2"] {
        assert_eq!(s.get(&format!("/v1/jobs/{id}")).await.status, 404, "{id} was not written");
    }
    let r = as_(&s, ACME, "POST", "/v1/jobs/globex-thumb/cancel", None).await;
    assert_eq!((r.status, code(&r)), (404, "not_found"));
    assert_eq!(s.get("/v1/jobs/globex-thumb").await.body["state"], "queued");
    assert_eq!(s.balance("globex").await, 1_000 - 10 - 10 - 5 - 1 + 1 + 10);
    // In scope, the same requests work.
    let r = as_(
        &s,
        ACME,
        "POST",
        "/v1/jobs",
        Some(json!({"id": "x3", "account_id": "acme-2", "kind": "render", "cost": 1})),
    )
    .await;
    assert_eq!((r.status, code(&r)), (404, "not_found"), "acme-2 is in scope but does not exist");
    let r = as_(
        &s,
        ACME,
        "POST",
        "/v1/jobs",
        Some(json!({"id": "x3", "account_id": "acme-1", "kind": "render", "cost": 1})),
    )
    .await;
    assert_eq!(r.status, 201);
    let r = as_(&s, ACME, "POST", "/v1/jobs/acme-1-thumb/cancel", None).await;
    assert_eq!((r.status, r.body["state"].as_str()), (200, Some("cancelled")));
    let r = as_(
        &s,
        ACME,
        "POST",
        "/v1/withdrawals",
        Some(json!({"id": "x4", "account_id": "acme-1", "amount": 1, "destination": "DE89"})),
    )
    .await;
    assert_eq!(r.status, 201);
    // Admin routes stay admin's.
    for (method, path) in
        [("GET", "/v1/audit"), ("POST", "/v1/jobs/acme-1-dead/requeue"), ("GET", "/v1/webhooks/deliveries")]
    {
        assert_eq!(as_(&s, ACME, method, path, None).await.status, 403, "{path}");
    }
}

async fn a_kind_scoped_client_sees_and_moves_only_its_kinds(e: Engine) {
    let s = server(e).await;
    for (path, inside) in [
        ("/v1/jobs/globex-render", true),
        ("/v1/jobs/globex-thumb", false),
        ("/v1/jobs/acme-1-thumb/attempts", false),
        ("/v1/withdrawals/acme-1-wd", false),
        ("/v1/accounts/globex", true),
    ] {
        let r = as_(&s, RENDER, "GET", path, None).await;
        assert_eq!(r.status, if inside { 200 } else { 404 }, "{path}: {}", r.body);
    }
    let r = as_(&s, RENDER, "GET", "/v1/jobs?limit=1000", None).await;
    assert_eq!(ids(&r.body, "jobs"), ["acme-1-dead", "acme-1-render", "globex-dead", "globex-render"]);
    let r = as_(&s, RENDER, "GET", "/v1/jobs?kind=thumb", None).await;
    assert!(ids(&r.body, "jobs").is_empty());
    assert!(ids(&as_(&s, RENDER, "GET", "/v1/withdrawals", None).await.body, "withdrawals").is_empty());
    let r = as_(
        &s,
        RENDER,
        "POST",
        "/v1/jobs",
        Some(json!({"id": "y1", "account_id": "globex", "kind": "thumb", "cost": 1})),
    )
    .await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    let r = as_(
        &s,
        RENDER,
        "POST",
        "/v1/withdrawals",
        Some(json!({"id": "y2", "account_id": "globex", "amount": 1, "destination": "x"})),
    )
    .await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"), "a withdrawal is a kind too");
    let r = as_(&s, RENDER, "POST", "/v1/jobs/globex-thumb/cancel", None).await;
    assert_eq!(r.status, 404);
    let r = as_(
        &s,
        RENDER,
        "POST",
        "/v1/jobs",
        Some(json!({"id": "y3", "account_id": "globex", "kind": "render", "cost": 1})),
    )
    .await;
    assert_eq!(r.status, 201);
    // Events: render jobs' and the accounts' own (grants), never a thumb job's or a withdrawal's.
    let r = as_(&s, RENDER, "GET", "/v1/events?limit=1000", None).await;
    for ev in r.body["events"].as_array().unwrap() {
        let job = ev["job_id"].as_str().unwrap_or("");
        assert!(job.is_empty() || job.contains("render") || job.contains("dead") || job == "y3", "{ev}");
    }
}

async fn a_kind_scoped_worker_claims_and_reports_only_its_kinds(e: Engine) {
    let s = server(e).await;
    let r = as_(&s, GPU, "POST", "/v1/claims", Some(json!({"worker": "gpu-1", "kinds": ["thumb"]}))).await;
    assert_eq!((r.status, code(&r)), (403, "forbidden"));
    let r = as_(&s, GPU, "POST", "/v1/claims", Some(json!({"worker": "gpu-1", "kinds": ["render", "thumb"]}))).await;
    assert_eq!(r.status, 403, "every kind asked for must be in scope");
    // Asking for nothing means its own kinds: a render job, never one of the two due thumbs.
    let r = s.post("/v1/jobs", json!({"id": "due-render", "account_id": "globex", "kind": "render", "cost": 1})).await;
    assert_eq!(r.status, 201);
    let r = as_(&s, GPU, "POST", "/v1/claims", Some(json!({"worker": "gpu-1", "limit": 10}))).await;
    assert_eq!(r.status, 200);
    let claimed = r.body["jobs"].as_array().unwrap();
    assert!(claimed.iter().any(|j| j["id"] == "due-render"), "{}", r.body);
    assert!(claimed.iter().all(|j| j["kind"] == "render"), "{}", r.body);
    // An unscoped worker takes a thumb job; the scoped one cannot report on it.
    let r = as_(&s, WORKER, "POST", "/v1/claims", Some(json!({"worker": "any", "kinds": ["thumb"]}))).await;
    let thumb = &r.body["jobs"][0];
    let (id, token) = (thumb["id"].as_str().unwrap(), thumb["lease_token"].as_str().unwrap());
    for (path, body) in [
        (format!("/v1/jobs/{id}/heartbeat"), json!({"lease_token": token})),
        (format!("/v1/jobs/{id}/fail"), json!({"lease_token": token, "code": "NODE_DOWN"})),
        (format!("/v1/jobs/{id}/unknown"), json!({"lease_token": token})),
        (format!("/v1/jobs/{id}/succeed"), json!({"lease_token": token})),
        (format!("/v1/jobs/{id}/items/main/succeed"), json!({"lease_token": token})),
        (format!("/v1/jobs/{id}/items/main/fail"), json!({"lease_token": token, "code": "NODE_DOWN"})),
        (format!("/v1/jobs/{id}/items/main/artifacts"), json!({"lease_token": token, "key": "out.png"})),
    ] {
        let r = as_(&s, GPU, "POST", &path, Some(body)).await;
        assert_eq!((r.status, code(&r)), (404, "not_found"), "{path}");
    }
    let job = s.get(&format!("/v1/jobs/{id}")).await.body;
    assert_eq!((job["state"].as_str(), job["items"][0]["state"].as_str()), (Some("running"), Some("charged")));
    let r = as_(&s, WORKER, "POST", &format!("/v1/jobs/{id}/succeed"), Some(json!({"lease_token": token}))).await;
    assert_eq!(r.status, 200, "its own worker still reports");
}

async fn a_scoped_console_session_sees_only_its_scope(e: Engine) {
    let s = server(e).await;
    let b = reqwest::Client::builder().cookie_store(true).redirect(reqwest::redirect::Policy::none()).build().unwrap();
    let r = b.post(format!("{}/console/login", s.base)).form(&[("token", ACME)]).send().await.unwrap();
    assert_eq!(r.status(), 303);
    let get = |path: &str| {
        let url = format!("{}{path}", s.base);
        let b = b.clone();
        async move {
            let r = b.get(url).send().await.unwrap();
            (r.status().as_u16(), r.text().await.unwrap())
        }
    };
    let (status, _) = get("/console").await;
    assert_eq!(status, 303, "the all-accounts overview is not for a scoped token");
    let (status, html) = get("/console/jobs").await;
    assert_eq!(status, 200);
    assert!(html.contains("acme-1-render") && !html.contains("globex"), "{html}");
    let (status, html) = get("/console/jobs?account=globex").await;
    assert!(status == 200 && !html.contains("globex-render"));
    for (path, expected) in [
        ("/console/jobs/acme-1-render", 200),
        ("/console/jobs/globex-render", 404),
        ("/console/accounts/acme-1", 200),
        ("/console/accounts/globex", 404),
        ("/console/webhooks", 403),
    ] {
        assert_eq!(get(path).await.0, expected, "{path}");
    }
    let (status, html) = get("/console/withdrawals").await;
    assert!(status == 200 && html.contains("acme-1-wd") && !html.contains("globex-wd"), "{html}");
    // The search box does not tell a job outside the scope from one that does not exist.
    let r = b.get(format!("{}/console/find?q=globex-render", s.base)).send().await.unwrap();
    assert_eq!(r.headers()["location"], "/console/jobs?prefix=globex-render");
    let r = b.get(format!("{}/console/find?q=acme-1-render", s.base)).send().await.unwrap();
    assert_eq!(r.headers()["location"], "/console/jobs/acme-1-render");
}
