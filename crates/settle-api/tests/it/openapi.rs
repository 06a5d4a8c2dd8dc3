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
        ("/v1/top-ups", "post"),
        ("/v1/top-ups", "get"),
        ("/v1/top-ups/{id}", "get"),
        ("/v1/accounts/{id}/auto-top-up", "put"),
        ("/v1/accounts/{id}/auto-top-up", "get"),
        ("/v1/accounts/{id}/auto-top-up", "delete"),
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

#[test]
fn every_operation_has_a_summary_and_a_description() {
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    let mut bare = Vec::new();
    let mut count = 0;
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            count += 1;
            let text = |field: &str| op.get(field).and_then(|v| v.as_str()).map(str::trim).unwrap_or("");
            let (summary, description) = (text("summary"), text("description"));
            if summary.is_empty() || description.is_empty() || summary == description {
                bare.push(format!("{method} {path}"));
            }
        }
    }
    assert!(count >= 30, "only {count} operations: the document lost its paths");
    assert!(bare.is_empty(), "operations without both a summary and a distinct description: {bare:?}");
}

#[test]
fn every_schema_field_has_a_description() {
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    let mut bare = Vec::new();
    let schemas = doc["components"]["schemas"].as_object().unwrap();
    for (name, schema) in schemas {
        // A flattened type (`Withdrawal`, `ClaimedJob`) is an `allOf` of its parts.
        let parts: Vec<&serde_json::Value> = match schema.get("allOf").and_then(|a| a.as_array()) {
            Some(all) => all.iter().collect(),
            None => vec![schema],
        };
        for part in parts {
            for (field, property) in part.get("properties").and_then(|p| p.as_object()).into_iter().flatten() {
                let has = |v: &serde_json::Value| {
                    v.get("description").and_then(|d| d.as_str()).is_some_and(|d| !d.trim().is_empty())
                };
                // An optional reference carries its description on the reference (`oneOf`).
                let variants = property.get("oneOf").and_then(|o| o.as_array());
                let described = has(property) || variants.is_some_and(|v| v.iter().any(has))
                    // A list of a described schema: the list's items are that schema.
                    || property.get("items").is_some_and(|i| i.get("$ref").is_some() && has(property));
                if !described {
                    bare.push(format!("{name}.{field}"));
                }
            }
        }
    }
    assert!(schemas.len() >= 20, "only {} schemas", schemas.len());
    assert!(bare.is_empty(), "schema fields without a description: {bare:?}");
}

#[test]
fn every_query_parameter_has_a_description() {
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    let mut bare = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for (method, op) in item.as_object().unwrap() {
            for p in op.get("parameters").and_then(|p| p.as_array()).into_iter().flatten() {
                let described = p.get("description").and_then(|d| d.as_str()).is_some_and(|d| !d.trim().is_empty());
                if p["in"] == "query" && !described {
                    bare.push(format!("{method} {path} ?{}", p["name"].as_str().unwrap_or("?")));
                }
            }
        }
    }
    assert!(bare.is_empty(), "query parameters without a description: {bare:?}");
}

/// Issue 20: the contract ships with Settle (`docs/api.md`) and names every operation the server
/// describes at `/openapi.json`.
#[test]
fn docs_api_md_names_every_operation_of_the_openapi_document() {
    let doc = serde_json::to_value(settle_api::openapi()).unwrap();
    let text = std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/../../../docs/api.md")).unwrap();
    let mut missing = Vec::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        for method in ["get", "post", "put", "patch", "delete"] {
            if item.get(method).is_some() {
                let op = format!("`{} {path}`", method.to_uppercase());
                if !text.contains(&op) {
                    missing.push(op);
                }
            }
        }
    }
    assert!(missing.is_empty(), "docs/api.md does not name {missing:?}");
}
