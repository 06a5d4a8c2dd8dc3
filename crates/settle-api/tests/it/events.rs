//! One event, one body: a webhook delivery sends exactly the bytes `GET /v1/events` and the
//! deliveries list show for that event.

use crate::kit::*;
use serde_json::json;
use settle_core::Timestamp;
use settle_store::{Event, Store};
use settle_worker::webhooks::event_body;

on_both_engines!(a_webhook_body_is_the_events_entry_byte_for_byte);

async fn raw(s: &Server, path: &str) -> String {
    s.http.get(format!("{}{path}", s.base)).send().await.unwrap().text().await.unwrap()
}

async fn a_webhook_body_is_the_events_entry_byte_for_byte(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 100).await;
    s.job("j1", "a", 10).await;
    let store = s.store_handle();
    let events = store.events(0, 100, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    assert_eq!(events.len(), 3);
    let page = raw(&s, "/v1/events").await;
    store.webhooks().fan_out("ops", 100).await.unwrap();
    let deliveries = raw(&s, "/v1/webhooks/deliveries?endpoint=ops").await;
    for event in &events {
        let body = String::from_utf8(event_body(event)).unwrap();
        assert!(page.contains(&body), "event {} differs:\n webhook {body}\n events  {page}", event.seq);
        assert!(deliveries.contains(&body), "event {} differs in the deliveries list", event.seq);
    }
    let r = s.get("/v1/events").await;
    assert_eq!(r.body["events"][0]["type"], json!("account.created"));
}

#[test]
fn whole_seconds_and_trailing_zeros_read_the_same_in_both() {
    for micros in [1_767_225_600_000_000, 1_767_225_600_120_000, 1_767_225_600_000_001] {
        let event = Event {
            seq: 7,
            kind: settle_core::history::EventKind::JobQueued,
            job_id: Some("j".into()),
            account_id: "a".into(),
            data: r#"{"kind":"render","cost":10,"items":1}"#.into(),
            created_at: Timestamp::from_micros(micros),
            epoch: 1,
        };
        let page =
            serde_json::to_string(&settle_api::dto::EventPage { events: vec![event.envelope()], next_after: None })
                .unwrap();
        let body = String::from_utf8(event_body(&event)).unwrap();
        assert!(page.contains(&body), "{page}\n{body}");
    }
}
