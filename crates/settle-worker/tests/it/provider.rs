//! The HTTP provider adapter reads `provider-v1` strictly: only the protocol's answers count, and
//! anything else is "no answer" for a send and "nothing learned" for a lookup — never a success.
//! Checked against a stub that answers each way, and against `settle-sim`'s faults.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use settle_sim::{Forced, SimConfig};
use settle_worker::payouts::{HttpProvider, HttpProviderConfig, Lookup, Provider, Sent};
use std::time::Duration;

fn adapter(url: String, timeout_ms: u64) -> HttpProvider {
    HttpProvider::new(&HttpProviderConfig {
        url,
        timeout: Duration::from_millis(timeout_ms),
        connect_timeout: Duration::from_millis(200),
    })
    .unwrap()
}

/// A provider whose every answer is chosen by the key: `/v1/transactions/{key}` for lookups, and the
/// send's key picks the send's answer.
async fn stub() -> String {
    async fn answer(key: &str) -> Response {
        let json = |status: StatusCode, body: &str| {
            (status, [("content-type", "application/json")], body.to_owned()).into_response()
        };
        match key {
            "garbage" => json(StatusCode::OK, "{not json"),
            "no-txid" => json(StatusCode::OK, r#"{"status":"executed"}"#),
            "odd-status" => json(StatusCode::OK, r#"{"txid":"t1","status":"pending"}"#),
            "returned" => json(StatusCode::OK, r#"{"txid":"t2","status":"returned"}"#),
            "found" => json(StatusCode::OK, r#"{"txid":"t3"}"#),
            "json-404" => json(StatusCode::NOT_FOUND, r#"{"code":"NOT_FOUND","message":"no"}"#),
            "empty-404" => StatusCode::NOT_FOUND.into_response(),
            "html-404" => (StatusCode::NOT_FOUND, [("content-type", "text/html")], "<h1>nginx</h1>").into_response(),
            "unknown-code" => json(StatusCode::BAD_REQUEST, r#"{"code":"SOMETHING_NEW","message":"?"}"#),
            "timeout-code" => json(StatusCode::GATEWAY_TIMEOUT, r#"{"code":"TIMEOUT","message":"node timed out"}"#),
            "bare-500" => StatusCode::INTERNAL_SERVER_ERROR.into_response(),
            "invalid" => json(StatusCode::UNPROCESSABLE_ENTITY, r#"{"code":"INVALID_ADDRESS","message":"no such"}"#),
            "limited" => {
                let mut r = json(StatusCode::TOO_MANY_REQUESTS, r#"{"code":"RATE_LIMITED","message":"slow"}"#);
                r.headers_mut().insert("retry-after", "7".parse().unwrap());
                r
            }
            "huge" => json(StatusCode::OK, &format!(r#"{{"txid":"t4","pad":"{}"}}"#, "x".repeat(200_000))),
            "redirect" => (StatusCode::FOUND, [("location", "/v1/transactions/found")]).into_response(),
            _ => StatusCode::IM_A_TEAPOT.into_response(),
        }
    }
    let app = axum::Router::new()
        .route(
            "/v1/transactions/{key}",
            axum::routing::get(
                |axum::extract::Path(key): axum::extract::Path<String>| async move { answer(&key).await },
            ),
        )
        .route(
            "/v1/transactions",
            axum::routing::post(|body: axum::Json<serde_json::Value>| async move {
                answer(body["key"].as_str().unwrap_or("")).await
            }),
        );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    url
}

#[tokio::test]
async fn lookups_count_only_protocol_answers() {
    let p = adapter(stub().await, 2_000);
    assert_eq!(p.lookup("found").await, Lookup::Found { id: "t3".into(), returned: false });
    assert_eq!(p.lookup("returned").await, Lookup::Found { id: "t2".into(), returned: true });
    assert_eq!(p.lookup("json-404").await, Lookup::Absent);
    assert_eq!(p.lookup("empty-404").await, Lookup::Absent);
    for key in ["html-404", "garbage", "no-txid", "odd-status", "limited", "bare-500", "huge", "redirect", "teapot"] {
        assert!(matches!(p.lookup(key).await, Lookup::Failed { .. }), "{key}");
    }
}

#[tokio::test]
async fn sends_are_definitive_only_for_protocol_codes() {
    let p = adapter(stub().await, 2_000);
    assert_eq!(p.send("found", "d", 1).await, Sent::Executed { id: "t3".into() });
    match p.send("invalid", "d", 1).await {
        Sent::Refused { code, retry_after_ms: None, .. } => assert_eq!(code.as_str(), "INVALID_ADDRESS"),
        other => panic!("{other:?}"),
    }
    match p.send("limited", "d", 1).await {
        Sent::Refused { code, retry_after_ms, .. } => {
            assert_eq!((code.as_str(), retry_after_ms), ("RATE_LIMITED", Some(7_000)))
        }
        other => panic!("{other:?}"),
    }
    // Outside the protocol, or a provider that does not know either: the outcome is unknown.
    for key in ["garbage", "no-txid", "unknown-code", "timeout-code", "bare-500", "huge", "redirect", "teapot"] {
        assert!(matches!(p.send(key, "d", 1).await, Sent::NoAnswer { .. }), "{key}");
    }
}

#[tokio::test]
async fn no_connection_is_not_sent_but_a_timeout_is_unknown() {
    // Nothing listens: the request never left.
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let closed = adapter(format!("http://127.0.0.1:{port}"), 500);
    match closed.send("k", "d", 1).await {
        Sent::Refused { code, .. } => assert_eq!(code.as_str(), "UNAVAILABLE"),
        other => panic!("{other:?}"),
    }
    assert!(matches!(closed.lookup("k").await, Lookup::Failed { .. }));
    // The simulator hangs past the caller's timeout: no answer.
    let sim = settle_sim::start("127.0.0.1:0", SimConfig { hang: 1.0, hang_ms: 2_000, ..SimConfig::default() })
        .await
        .unwrap();
    let p = adapter(sim.url(), 200);
    assert!(matches!(p.send("k", "dest", 5).await, Sent::NoAnswer { .. }));
}

#[tokio::test]
async fn the_simulator_pays_each_key_once_and_misbehaves_on_demand() {
    let sim = settle_sim::start("127.0.0.1:0", SimConfig { float: Some(100), ..SimConfig::default() }).await.unwrap();
    let p = adapter(sim.url(), 2_000);
    assert_eq!(p.lookup("a").await, Lookup::Absent);
    let Sent::Executed { id: txid } = p.send("a", "dest-a", 60).await else { panic!("not executed") };
    // the same key again: the same txid, no money moves
    assert_eq!(p.send("a", "dest-a", 60).await, Sent::Executed { id: txid.clone() });
    assert_eq!(p.lookup("a").await, Lookup::Found { id: txid.clone(), returned: false });
    match p.send("b", "dest-b", 60).await {
        Sent::Refused { code, .. } => assert_eq!(code.as_str(), "INSUFFICIENT", "the float is 100"),
        other => panic!("{other:?}"),
    }
    match p.send("c", "invalid-x", 1).await {
        Sent::Refused { code, .. } => assert_eq!(code.as_str(), "INVALID_ADDRESS"),
        other => panic!("{other:?}"),
    }
    sim.sim.force(Some(Forced::NodeDown));
    match p.send("d", "dest-d", 1).await {
        Sent::Refused { code, .. } => assert_eq!(code.as_str(), "NODE_DOWN"),
        other => panic!("{other:?}"),
    }
    sim.sim.force(Some(Forced::LoseAnswers));
    assert!(matches!(p.send("e", "dest-e", 1).await, Sent::NoAnswer { .. }));
    sim.sim.force(None);
    assert!(matches!(p.lookup("e").await, Lookup::Found { .. }), "the cut send was executed");
    assert!(sim.sim.return_transfer("a"));
    assert_eq!(p.lookup("a").await, Lookup::Found { id: txid, returned: true });
    let executed = sim.sim.executed();
    assert_eq!(executed.total_paid, 61);
    let a = executed.transfers.iter().find(|t| t.key == "a").unwrap();
    assert_eq!((a.sends, a.sends_after_executed, a.returned), (2, 1, true));
}
