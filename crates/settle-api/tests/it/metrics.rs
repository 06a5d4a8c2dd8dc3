//! `/metrics` explains itself (issue 42, part 9): every family has `# HELP` and the `# TYPE` it is
//! (a `*_total` is a counter), each kind's queue shows its depth, what is due now and how long the
//! oldest due job has waited, a drained queue reads 0, and a metrics token closes the page.

use crate::kit::*;
use serde_json::json;
use settle_api::Tokens;
use std::collections::BTreeMap;

const ADMIN: &str = "admin-token-for-metrics-tests";

on_both_engines!(each_kind_has_its_queue_and_every_family_explains_itself);

/// `name{labels} value` lines of the exposition, by name and labels.
fn samples(text: &str) -> BTreeMap<String, f64> {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.trim().is_empty())
        .filter_map(|l| l.rsplit_once(' ').and_then(|(k, v)| Some((k.to_owned(), v.parse().ok()?))))
        .collect()
}

async fn each_kind_has_its_queue_and_every_family_explains_itself(e: Engine) {
    let s = Server::start(e).await;
    s.account("a", 1_000).await;
    let later = (time::OffsetDateTime::now_utc() + time::Duration::hours(1))
        .format(&time::format_description::well_known::Rfc3339)
        .unwrap();
    for (id, kind, not_before) in [
        ("r1", "render", None),
        ("r2", "render", None),
        ("r3", "render", Some(later.as_str())),
        ("t1", "transcribe", None),
    ] {
        let mut job = json!({"id": id, "account_id": "a", "kind": kind, "cost": 1});
        if id == "r2" {
            job["priority"] = json!(7);
        }
        if let Some(at) = not_before {
            job["not_before"] = json!(at);
        }
        assert_eq!(s.post("/v1/jobs", job).await.status, 201);
    }
    let r = s.post("/v1/claims", json!({"worker": "w", "kinds": ["transcribe"]})).await;
    assert_eq!(r.body["jobs"][0]["id"], "t1", "{}", r.body);
    tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;

    let r = s.get("/metrics").await;
    assert_eq!(r.status, 200);
    let text = r.body.as_str().unwrap().to_owned();
    let m = samples(&text);
    assert_eq!(m[r#"settle_queue_depth{kind="render"}"#], 3.0, "{text}");
    assert_eq!(m[r#"settle_queue_due{kind="render"}"#], 2.0, "the one not before an hour from now is not due");
    let waited = m[r#"settle_queue_oldest_due_seconds{kind="render"}"#];
    assert!((1.0..60.0).contains(&waited), "render's oldest due job has waited {waited} s");
    // transcribe's only job is running: its queue reads 0, not absent.
    assert_eq!(m[r#"settle_queue_depth{kind="transcribe"}"#], 0.0, "{text}");
    assert_eq!(m[r#"settle_queue_oldest_due_seconds{kind="transcribe"}"#], 0.0);
    // By priority (issue 44): r2 alone at 7, r1 and r3 (not due) at 50; t1 runs.
    assert_eq!(m[r#"settle_queue_depth_by_priority{priority="7"}"#], 1.0, "{text}");
    assert_eq!(m[r#"settle_queue_depth_by_priority{priority="50"}"#], 2.0, "{text}");
    assert_eq!(m[r#"settle_queue_due_by_priority{priority="50"}"#], 1.0, "{text}");
    assert!(m[r#"settle_queue_oldest_due_seconds_by_priority{priority="7"}"#] >= 1.0, "{text}");
    // Every state has its gauge, 0 when no job is in it.
    assert_eq!(m[r#"settle_jobs{state="running"}"#], 1.0);
    assert_eq!(m[r#"settle_jobs{state="dead"}"#], 0.0);

    // Every family shown has its help and type; counters are counters.
    let mut types = BTreeMap::new();
    let mut helped = Vec::new();
    for line in text.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap();
            types.insert(name.to_owned(), kind.to_owned());
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap();
            assert!(!help.trim().is_empty(), "{name} has an empty help");
            helped.push(name.to_owned());
        }
    }
    assert!(types.len() >= 12, "{text}");
    for (name, kind) in &types {
        assert!(helped.contains(name), "{name} has no # HELP line");
        assert_eq!(name.ends_with("_total"), kind == "counter", "{name} is typed {kind}");
    }
    for (name, kind, _) in settle_api::telemetry::FAMILIES {
        if let Some(shown) = types.get(*name) {
            let expected = match kind {
                settle_api::telemetry::Kind::Counter => "counter",
                settle_api::telemetry::Kind::Gauge => "gauge",
                settle_api::telemetry::Kind::Histogram => "histogram",
            };
            assert_eq!(shown, expected, "{name}");
        }
    }
    for name in types.keys() {
        assert!(settle_api::telemetry::FAMILIES.iter().any(|(n, _, _)| n == name), "{name} is not in FAMILIES");
    }
}

/// With a metrics token, `/metrics` answers only to it; no role's token stands in for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_metrics_token_closes_the_page() {
    let mut tokens = Tokens::default();
    tokens.add(settle_api::Role::Admin, ADMIN).unwrap();
    tokens.set_metrics_token("prometheus-scrapes-here").unwrap();
    let s = Server::with_tokens(Engine::Sqlite, tokens).await;
    assert_eq!(s.send("GET", "/metrics", None, None).await.status, 401);
    assert_eq!(
        s.send("GET", "/metrics", None, Some(ADMIN)).await.status,
        401,
        "an admin token is not the metrics token"
    );
    let r = s.send("GET", "/metrics", None, Some("prometheus-scrapes-here")).await;
    assert_eq!(r.status, 200);
    assert!(r.body.as_str().unwrap().contains("# HELP settle_up "));
    // The probes stay open.
    assert_eq!(s.send("GET", "/healthz", None, None).await.status, 200);
    assert!(Tokens::default().set_metrics_token("short").is_err());
}

/// Kinds are clients' words: past `KINDS_LABELLED` of them, the ones with the fewest queued jobs are
/// summed as `kind="other"`, so a client cannot grow the series without bound.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kinds_past_the_cap_are_summed_as_other() {
    let s = Server::start(Engine::Sqlite).await;
    s.account("a", 10_000).await;
    let cap = settle_api::telemetry::KINDS_LABELLED;
    for n in 0..cap + 5 {
        // kind-000 has the most queued jobs (two), the rest one each.
        let copies = if n == 0 { 2 } else { 1 };
        for c in 0..copies {
            let job = json!({"id": format!("j{n}-{c}"), "account_id": "a", "kind": format!("kind-{n:03}"), "cost": 1});
            assert_eq!(s.post("/v1/jobs", job).await.status, 201);
        }
    }
    let text = s.get("/metrics").await.body.as_str().unwrap().to_owned();
    let depth: Vec<(&str, f64)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("settle_queue_depth{kind=\""))
        .filter_map(|l| l.split_once("\"} ").map(|(k, v)| (k, v.parse().unwrap())))
        .collect();
    assert_eq!(depth.len(), cap, "{depth:?}");
    assert!(depth.contains(&("kind-000", 2.0)), "the busiest kind keeps its name");
    let other = depth.iter().find(|(k, _)| *k == "other").map(|(_, v)| *v);
    assert_eq!(other, Some(6.0), "the {} kinds past the cap, one job each", 6);
    assert_eq!(depth.iter().map(|(_, v)| v).sum::<f64>(), (cap + 6) as f64, "nothing lost in the sum");
}
