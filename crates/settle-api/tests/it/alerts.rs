//! Balance alerts over HTTP (issue 45, api-v1 "Money controls"): `PUT`/`GET
//! /v1/accounts/{id}/alerts`, the events in `/v1/events` once per crossing, and every bad set a
//! clear 400 that writes nothing — on both engines.

use crate::kit::*;
use serde_json::{Value, json};

on_both_engines!(alerts_are_set_read_and_fire_once_per_crossing, bad_alert_sets_write_nothing);

async fn alert_events(s: &Server) -> Vec<Value> {
    let r = s.get("/v1/events?after=0&limit=1000").await;
    assert_eq!(r.status, 200, "{}", r.body);
    r.body["events"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["type"].as_str().is_some_and(|t| t.starts_with("account.balance_")))
        .cloned()
        .collect()
}

async fn alerts_are_set_read_and_fire_once_per_crossing(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 1_000).await;
    let r = s.send("PUT", "/v1/accounts/a/alerts", Some(json!({"alerts": [{"id": "low", "below": 500}]})), None).await;
    assert_eq!(r.status, 200, "{}", r.body);
    assert_eq!(r.body, json!({"alerts": [{"id": "low", "below": 500, "side": "above"}]}));
    assert_eq!(s.get("/v1/accounts/a/alerts").await.body, r.body);
    for n in 0..4 {
        s.job(&format!("j{n}"), "a", 200).await;
    }
    let events = alert_events(&s).await;
    assert_eq!(events.len(), 1, "once below, nothing more: {events:?}");
    let e = &events[0];
    assert_eq!((e["type"].as_str(), e["account_id"].as_str()), (Some("account.balance_low"), Some("a")));
    assert_eq!(e["data"]["alert"], "low");
    assert_eq!(e["data"]["below"], 500);
    assert_eq!((e["data"]["balance_before"].as_i64(), e["data"]["balance_after"].as_i64()), (Some(600), Some(400)));
    // The entry that crossed: its seq, its balance.
    let ledger = s.get("/v1/accounts/a/ledger").await.body["entries"].clone();
    let crossed = ledger.as_array().unwrap().iter().find(|x| x["seq"] == e["data"]["ledger_seq"]).unwrap().clone();
    assert_eq!(crossed["balance_after"], 400);
    assert_eq!(s.get("/v1/accounts/a/alerts").await.body["alerts"][0]["side"], "below");
    let r = s.post("/v1/accounts/a/grants", json!({"id": "top", "amount": 500})).await;
    assert_eq!(r.status, 201, "{}", r.body);
    let events = alert_events(&s).await;
    assert_eq!(events.len(), 2);
    assert_eq!(events[1]["type"], "account.balance_recovered");
    assert_eq!(events[1]["data"]["balance_after"], 700);
    let r = s.get("/v1/accounts/nobody/alerts").await;
    assert_eq!(r.status, 404, "{}", r.body);
}

async fn bad_alert_sets_write_nothing(engine: Engine) {
    let s = Server::start(engine).await;
    s.account("a", 1_000).await;
    let good = json!({"alerts": [{"id": "low", "below": 500}]});
    assert_eq!(s.send("PUT", "/v1/accounts/a/alerts", Some(good), None).await.status, 200);
    let many: Vec<Value> = (0..17).map(|n| json!({"id": format!("a{n}"), "below": 10 + n})).collect();
    for body in [
        json!({"alerts": [{"id": "z", "below": 0}]}),
        json!({"alerts": [{"id": "z", "below": -1}]}),
        json!({"alerts": [{"id": "z", "below": 2.5}]}),
        json!({"alerts": [{"id": "z", "below": 9_223_372_036_854_775_807i64}]}),
        json!({"alerts": [{"id": "z", "below": 5}, {"id": "z", "below": 6}]}),
        json!({"alerts": [{"id": "", "below": 5}]}),
        json!({"alerts": [{"id": "z", "below": 5, "above": 9}]}),
        json!({"alerts": [{"id": "z"}]}),
        json!({"alert": []}),
        json!({"alerts": many}),
    ] {
        let r = s.send("PUT", "/v1/accounts/a/alerts", Some(body.clone()), None).await;
        assert!(r.status == 400 || r.status == 422, "{body}: {} {}", r.status, r.body);
    }
    let r = s.send("PUT", "/v1/accounts/nobody/alerts", Some(json!({"alerts": []})), None).await;
    assert_eq!(r.status, 404, "{}", r.body);
    assert_eq!(
        s.get("/v1/accounts/a/alerts").await.body,
        json!({"alerts": [{"id": "low", "below": 500, "side": "above"}]}),
        "the set is as it was"
    );
}
