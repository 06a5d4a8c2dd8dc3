//! The OpenAPI document is generated from the code; this snapshot turns any drift into a failing
//! test (accept a deliberate change with `cargo insta review`).

#[test]
fn openapi_document_snapshot() {
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    insta::assert_json_snapshot!("openapi", doc);
}

#[test]
fn openapi_lists_every_path_of_the_spec() {
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    let paths = doc["paths"].as_object().unwrap();
    for (path, method) in [
        ("/v1/accounts", "post"),
        ("/v1/accounts/{id}", "get"),
        ("/v1/accounts/{id}/grants", "post"),
        ("/v1/accounts/{id}/adjustments", "post"),
        ("/v1/accounts/{id}/ledger", "get"),
        ("/v1/jobs", "post"),
        ("/v1/jobs", "get"),
        ("/v1/jobs/{id}", "get"),
        ("/v1/jobs/{id}/attempts", "get"),
        ("/v1/jobs/{id}/cancel", "post"),
        ("/v1/jobs/{id}/requeue", "post"),
        ("/v1/claims", "post"),
        ("/v1/jobs/{id}/heartbeat", "post"),
        ("/v1/jobs/{id}/succeed", "post"),
        ("/v1/jobs/{id}/fail", "post"),
        ("/v1/jobs/{id}/unknown", "post"),
        ("/v1/jobs/{id}/items/{item}/succeed", "post"),
        ("/v1/jobs/{id}/items/{item}/fail", "post"),
        ("/v1/jobs/{id}/items/{item}/artifacts", "post"),
        ("/v1/withdrawals", "post"),
        ("/v1/withdrawals", "get"),
        ("/v1/withdrawals/{id}", "get"),
        ("/v1/withdrawals/{id}/returned", "post"),
        ("/v1/failures/summary", "get"),
        ("/v1/events", "get"),
        ("/v1/audit", "get"),
        ("/healthz", "get"),
        ("/readyz", "get"),
        ("/metrics", "get"),
    ] {
        assert!(paths.get(path).and_then(|p| p.get(method)).is_some(), "{method} {path} missing");
    }
}
