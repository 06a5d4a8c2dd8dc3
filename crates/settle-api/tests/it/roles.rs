//! Every operation × every role: no token is `401`, a token of another role `403`, the operation's
//! own role and `admin` get past authorization — whatever the body. The table is the contract
//! (api-v1's role column); an operation the OpenAPI document has and the table lacks fails here.

use crate::kit::*;
use serde_json::json;
use settle_api::{Role, Tokens};

/// Who may call each operation; `None` is public.
const TABLE: &[(&str, &str, Option<Role>)] = &[
    ("POST", "/v1/accounts", Some(Role::Admin)),
    ("GET", "/v1/accounts/{id}", Some(Role::Client)),
    ("PATCH", "/v1/accounts/{id}", Some(Role::Admin)),
    ("PUT", "/v1/accounts/{id}/alerts", Some(Role::Client)),
    ("GET", "/v1/accounts/{id}/alerts", Some(Role::Client)),
    ("PUT", "/v1/accounts/{id}/limits", Some(Role::Client)),
    ("GET", "/v1/accounts/{id}/limits", Some(Role::Client)),
    ("POST", "/v1/accounts/{id}/grants", Some(Role::Admin)),
    ("GET", "/v1/accounts/{id}/grants", Some(Role::Client)),
    ("POST", "/v1/accounts/{id}/adjustments", Some(Role::Admin)),
    ("GET", "/v1/accounts/{id}/ledger", Some(Role::Client)),
    ("POST", "/v1/jobs", Some(Role::Client)),
    ("GET", "/v1/jobs/{id}", Some(Role::Client)),
    ("GET", "/v1/jobs", Some(Role::Client)),
    ("GET", "/v1/jobs/{id}/attempts", Some(Role::Client)),
    ("GET", "/v1/jobs/{id}/history", Some(Role::Admin)),
    ("POST", "/v1/jobs/{id}/cancel", Some(Role::Client)),
    ("POST", "/v1/jobs/{id}/requeue", Some(Role::Admin)),
    ("POST", "/v1/jobs/{id}/abandon-cleanup", Some(Role::Admin)),
    ("POST", "/v1/claims", Some(Role::Worker)),
    ("POST", "/v1/jobs/{id}/heartbeat", Some(Role::Worker)),
    ("POST", "/v1/jobs/{id}/succeed", Some(Role::Worker)),
    ("POST", "/v1/jobs/{id}/fail", Some(Role::Worker)),
    ("POST", "/v1/jobs/{id}/unknown", Some(Role::Worker)),
    ("POST", "/v1/jobs/{id}/release", Some(Role::Worker)),
    ("POST", "/v1/reports", Some(Role::Worker)),
    ("GET", "/v1/accounts", Some(Role::Client)),
    ("POST", "/v1/jobs/{id}/items/{item}/succeed", Some(Role::Worker)),
    ("POST", "/v1/jobs/{id}/items/{item}/fail", Some(Role::Worker)),
    ("POST", "/v1/jobs/{id}/items/{item}/artifacts", Some(Role::Worker)),
    ("POST", "/v1/withdrawals", Some(Role::Client)),
    ("GET", "/v1/withdrawals/{id}", Some(Role::Client)),
    ("GET", "/v1/withdrawals", Some(Role::Client)),
    ("POST", "/v1/withdrawals/{id}/returned", Some(Role::Admin)),
    ("POST", "/v1/withdrawals/{id}/resolve", Some(Role::Admin)),
    ("POST", "/v1/top-ups", Some(Role::Client)),
    ("PUT", "/v1/accounts/{id}/auto-top-up", Some(Role::Client)),
    ("GET", "/v1/accounts/{id}/auto-top-up", Some(Role::Client)),
    ("DELETE", "/v1/accounts/{id}/auto-top-up", Some(Role::Client)),
    ("GET", "/v1/top-ups/{id}", Some(Role::Client)),
    ("GET", "/v1/top-ups", Some(Role::Client)),
    ("GET", "/v1/failures/summary", Some(Role::Client)),
    ("GET", "/v1/events", Some(Role::Client)),
    ("GET", "/v1/webhooks/deliveries", Some(Role::Admin)),
    ("POST", "/v1/webhooks/endpoints/{endpoint}/breaker/close", Some(Role::Admin)),
    ("POST", "/v1/webhooks/deliveries/{endpoint}/{seq}/requeue", Some(Role::Admin)),
    ("POST", "/v1/webhooks/deliveries/{endpoint}/requeue", Some(Role::Admin)),
    ("GET", "/v1/audit", Some(Role::Admin)),
    ("GET", "/healthz", None),
    ("GET", "/readyz", None),
    ("GET", "/metrics", None),
];

const ADMIN: &str = "admin-token-0123456789";
const CLIENT: &str = "client-token-0123456789";
const WORKER: &str = "worker-token-0123456789";

fn token(role: Role) -> &'static str {
    match role {
        Role::Admin => ADMIN,
        Role::Client => CLIENT,
        Role::Worker => WORKER,
    }
}

#[test]
fn the_table_names_every_operation_of_the_openapi_document() {
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    let mut documented: Vec<(String, String)> = Vec::new();
    for (path, ops) in doc["paths"].as_object().unwrap() {
        for method in ops.as_object().unwrap().keys() {
            documented.push((method.to_uppercase(), path.clone()));
        }
    }
    documented.sort();
    let mut tabled: Vec<(String, String)> = TABLE.iter().map(|(m, p, _)| (m.to_string(), p.to_string())).collect();
    tabled.sort();
    assert_eq!(tabled, documented);
}

async fn every_operation_by_every_role(e: Engine) {
    let mut tokens = Tokens::default();
    tokens.add(Role::Admin, ADMIN).unwrap();
    tokens.add(Role::Client, CLIENT).unwrap();
    tokens.add(Role::Worker, WORKER).unwrap();
    let s = Server::with_tokens(e, tokens).await;
    for (method, template, needed) in TABLE {
        let path =
            template.replace("{seq}", "1").replace("{endpoint}", "ops").replace("{item}", "main").replace("{id}", "x");
        // A body that is valid JSON but not what any operation takes: authorization comes first.
        // (`succeed` with a token: without one it is an operator's act, admin only — decision 0019.)
        let body = (*method == "POST" || *method == "PATCH" || *method == "PUT").then(|| {
            if template.ends_with("}/succeed") && template.starts_with("/v1/jobs/") {
                json!({"lease_token": "some-token"})
            } else {
                json!({})
            }
        });
        let status = |r: &Reply| r.status;
        let anonymous = s.send(method, &path, body.clone(), None).await;
        let Some(needed) = needed else {
            assert!(![401, 403].contains(&status(&anonymous)), "{method} {path} is public: {}", anonymous.body);
            continue;
        };
        assert_eq!(anonymous.status, 401, "{method} {path} without a token: {}", anonymous.body);
        let wrong = s.send(method, &path, body.clone(), Some("not-a-token-0123456789")).await;
        assert_eq!(wrong.status, 401, "{method} {path} with an unknown token");
        for role in [Role::Admin, Role::Client, Role::Worker] {
            let r = s.send(method, &path, body.clone(), Some(token(role))).await;
            let allowed = role == Role::Admin || role == *needed;
            if allowed {
                assert!(![401, 403].contains(&r.status), "{method} {path} as {}: {} {}", role.name(), r.status, r.body);
            } else {
                assert_eq!(r.status, 403, "{method} {path} as {}: {}", role.name(), r.body);
                assert_eq!(r.body["error"]["code"], "forbidden");
            }
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_every_operation_by_every_role() {
    every_operation_by_every_role(Engine::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_every_operation_by_every_role() {
    every_operation_by_every_role(Engine::Postgres).await;
}
