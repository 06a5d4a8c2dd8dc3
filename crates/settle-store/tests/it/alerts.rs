//! Balance alerts (issue 45, spec §4a, docs/design/money-controls.md §2): edge-triggered in the
//! posting's own transaction — one `account.balance_low` per crossing down, one
//! `account.balance_recovered` per crossing up, nothing while the balance stays on one side
//! (Blnk's monitors fired on every debit once below), exactly the ledger's crossings in order when
//! many postings race in one batch, on both engines; a refund of a failed job crosses too; setting
//! alerts fires nothing; bad sets write nothing.

use crate::kit::*;
use settle_core::Credits;
use settle_core::history::EventKind;
use settle_core::ids::{AccountId, RefId};
use settle_store::*;
use std::sync::Arc;

fn set(alerts: &[(&str, i64)]) -> Vec<(String, i64)> {
    alerts.iter().map(|(id, below)| (id.to_string(), *below)).collect()
}

/// The alert events of `account`, in feed order: (type, data).
async fn alert_events(k: &Kit, account: &AccountId) -> Vec<(EventKind, serde_json::Value)> {
    let page = k.store.events(0, 10_000, &settle_core::scope::Scope::ALL).await.unwrap();
    page.rows
        .into_iter()
        .filter(|e| e.account_id == account.as_str())
        .filter(|e| matches!(e.kind, EventKind::AccountBalanceLow | EventKind::AccountBalanceRecovered))
        .map(|e| (e.kind, serde_json::from_str(&e.data).unwrap()))
        .collect()
}

/// The crossings the account's ledger says happened since entry `from` (exclusive), for alerts
/// `alerts` on the sides they had then: what the events must be, in order.
async fn crossings_in_ledger(
    k: &Kit,
    account: &AccountId,
    from: i64,
    alerts: &[(&str, i64)],
    start: i64,
) -> Vec<(EventKind, String, i64, i64)> {
    let entries = k.store.ledger(account, Page { after: 0, limit: 10_000 }).await.unwrap().rows;
    let mut above: Vec<bool> = alerts.iter().map(|(_, below)| start >= *below).collect();
    let mut out = Vec::new();
    let mut sorted: Vec<(usize, &(&str, i64))> = alerts.iter().enumerate().collect();
    sorted.sort_by_key(|(_, (id, below))| (*below, *id));
    for e in entries.iter().filter(|e| e.account_seq > from) {
        let after = e.balance_after.get();
        let falling = e.amount.is_negative();
        let order: Vec<&(usize, &(&str, i64))> =
            if falling { sorted.iter().rev().collect() } else { sorted.iter().collect() };
        for (i, (id, below)) in order {
            if above[*i] && after < *below {
                above[*i] = false;
                out.push((EventKind::AccountBalanceLow, id.to_string(), after, e.seq));
            } else if !above[*i] && after >= *below {
                above[*i] = true;
                out.push((EventKind::AccountBalanceRecovered, id.to_string(), after, e.seq));
            }
        }
    }
    out
}

fn seen(events: &[(EventKind, serde_json::Value)]) -> Vec<(EventKind, String, i64, i64)> {
    events
        .iter()
        .map(|(kind, d)| {
            (
                *kind,
                d["alert"].as_str().unwrap().to_owned(),
                d["balance_after"].as_i64().unwrap(),
                d["ledger_seq"].as_i64().unwrap(),
            )
        })
        .collect()
}

async fn grant(k: &Kit, account: &AccountId, id: &str, amount: i64) {
    let g = NewGrant {
        id: RefId::parse(id).unwrap(),
        amount: Credits::new(amount),
        reason: None,
        expires_at: None,
        priority: None,
    };
    k.store.grant(account, g, SYSTEM_ACTOR).await.unwrap();
}

async fn alerts_fire_once_per_crossing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    let stored = k.store.set_alerts(&a, set(&[("low", 500), ("empty", 100)]), SYSTEM_ACTOR).await.unwrap();
    assert_eq!(
        stored.iter().map(|x| (x.id.as_str(), x.below, x.side)).collect::<Vec<_>>(),
        [("empty", 100, AlertSide::Above), ("low", 500, AlertSide::Above)],
        "in threshold order, each on the side the balance is on"
    );
    assert!(alert_events(&k, &a).await.is_empty(), "setting alerts fires nothing");
    // Down by 100 at a time to 0: `low` fires once, at 400; `empty` once, at 0.
    for n in 0..10 {
        k.job(&format!("j{n}"), &a, 100).await;
    }
    let events = alert_events(&k, &a).await;
    let got: Vec<(EventKind, &str, i64, i64)> = events
        .iter()
        .map(|(kind, d)| {
            (
                *kind,
                d["alert"].as_str().unwrap(),
                d["balance_before"].as_i64().unwrap(),
                d["balance_after"].as_i64().unwrap(),
            )
        })
        .collect();
    assert_eq!(
        got,
        [(EventKind::AccountBalanceLow, "low", 500, 400), (EventKind::AccountBalanceLow, "empty", 100, 0)],
        "one event per crossing, none while below"
    );
    // One grant lifts it over both: recovered, lowest threshold first.
    grant(&k, &a, "top", 700).await;
    let events = alert_events(&k, &a).await;
    assert_eq!(events.len(), 4, "{events:?}");
    assert_eq!(events[2].0, EventKind::AccountBalanceRecovered);
    assert_eq!((events[2].1["alert"].as_str(), events[3].1["alert"].as_str()), (Some("empty"), Some("low")));
    assert_eq!(events[3].1["balance_after"], 700);
    // Every event names the entry that crossed: its seq, and that entry's balance.
    assert_eq!(seen(&events), crossings_in_ledger(&k, &a, 1, &[("low", 500), ("empty", 100)], 1_000).await);
    let stored = k.store.alerts(&a).await.unwrap();
    assert!(stored.iter().all(|x| x.side == AlertSide::Above), "{stored:?}");
    k.assert_clean().await;
}

/// A failed job's refund crosses back (on PostgreSQL the plan's failure statement, which posts on
/// its own) and a success's reclaim crosses down again.
async fn refunds_and_reclaims_cross_too(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 400).await;
    k.store.set_alerts(&a, set(&[("low", 200)]), SYSTEM_ACTOR).await.unwrap();
    k.job("j", &a, 300).await;
    let token = k.claim_one("j").await;
    k.fail("j", &token, "TIMEOUT").await;
    assert_eq!(k.balance(&a).await, 400, "the failure refunded");
    // The late success reclaims: down again.
    k.store.succeed(&jid("j"), Reporter::of(Some(&token)), None).await.unwrap();
    assert_eq!(k.balance(&a).await, 100);
    let events = alert_events(&k, &a).await;
    let kinds: Vec<EventKind> = events.iter().map(|e| e.0).collect();
    assert_eq!(
        kinds,
        [EventKind::AccountBalanceLow, EventKind::AccountBalanceRecovered, EventKind::AccountBalanceLow],
        "{events:?}"
    );
    assert_eq!(seen(&events), crossings_in_ledger(&k, &a, 1, &[("low", 200)], 400).await);
    k.assert_clean().await;
}

/// Many postings racing on one account — creates, failures that refund, grants — commit in shared
/// batches: the events are exactly the crossings the ledger shows, in its order, each naming its
/// entry. Nothing repeats while below.
async fn racing_postings_produce_exactly_the_ledgers_crossings(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = k.account("a", 1_000).await;
    let start_seq = k.store.ledger(&a, Page { after: 0, limit: 100 }).await.unwrap().rows.len() as i64;
    let alerts = [("half", 500), ("low", 200), ("zero", 1)];
    k.store.set_alerts(&a, set(&alerts), SYSTEM_ACTOR).await.unwrap();
    let mut tasks = Vec::new();
    // 40 charges of 60 against 1,000 and five grants of 250: more than the credit, so the balance
    // must fall under every threshold above 60 at least once, whatever order the race takes.
    for n in 0..45 {
        let (k, a) = (k.clone(), a.clone());
        tasks.push(tokio::spawn(async move {
            match n % 9 {
                // Grants now and then lift it back over the thresholds.
                8 => grant(&k, &a, &format!("g{n}"), 250).await,
                _ => {
                    let _ = k.store.create_job(new_job(&format!("j{n}"), &a, 60)).await;
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let events = alert_events(&k, &a).await;
    let want = crossings_in_ledger(&k, &a, start_seq, &alerts, 1_000).await;
    assert!(!want.is_empty(), "the story crosses some thresholds");
    assert_eq!(seen(&events), want);
    k.assert_clean().await;
}

async fn bad_alerts_write_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.set_alerts(&a, set(&[("low", 500)]), SYSTEM_ACTOR).await.unwrap();
    let many: Vec<(String, i64)> = (0..17).map(|n| (format!("a{n}"), 10 + n)).collect();
    for bad in [
        set(&[("zero", 0)]),
        set(&[("negative", -5)]),
        set(&[("huge", (1 << 61) + 1)]),
        set(&[("twice", 5), ("twice", 6)]),
        set(&[("", 5)]),
        set(&[("has space", 5)]),
        many,
    ] {
        let r = k.store.set_alerts(&a, bad.clone(), SYSTEM_ACTOR).await;
        assert!(matches!(r, Err(StoreError::Invalid(_))), "{bad:?}: {r:?}");
    }
    let r = k.store.set_alerts(&acc("nobody"), set(&[("low", 5)]), SYSTEM_ACTOR).await;
    assert!(matches!(r, Err(StoreError::NotFound { .. })), "{r:?}");
    assert!(matches!(k.store.alerts(&acc("nobody")).await, Err(StoreError::NotFound { .. })));
    let stored = k.store.alerts(&a).await.unwrap();
    assert_eq!(stored.len(), 1, "the set is as it was: {stored:?}");
    // An empty set removes them; a posting after it fires nothing.
    assert!(k.store.set_alerts(&a, Vec::new(), SYSTEM_ACTOR).await.unwrap().is_empty());
    k.job("j", &a, 900).await;
    assert!(alert_events(&k, &a).await.is_empty());
    k.assert_clean().await;
}

/// An alert set while the balance is already below it fires nothing, and fires on the way back.
async fn an_alert_set_below_fires_only_on_recovery(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    let stored = k.store.set_alerts(&a, set(&[("low", 500)]), SYSTEM_ACTOR).await.unwrap();
    assert_eq!(stored[0].side, AlertSide::Below);
    k.job("j", &a, 50).await;
    assert!(alert_events(&k, &a).await.is_empty(), "already below: nothing");
    grant(&k, &a, "top", 450).await;
    let events = alert_events(&k, &a).await;
    assert_eq!(events.len(), 1);
    assert_eq!(events[0].0, EventKind::AccountBalanceRecovered);
    assert_eq!(events[0].1["balance_before"], 50);
    assert_eq!(events[0].1["balance_after"], 500);
    k.assert_clean().await;
}

both_engines!(
    alerts_fire_once_per_crossing,
    refunds_and_reclaims_cross_too,
    racing_postings_produce_exactly_the_ledgers_crossings,
    bad_alerts_write_nothing,
    an_alert_set_below_fires_only_on_recovery,
);
