//! Held items (issue 23, docs/decisions/0022): an item made with a hold is charged the hold; the
//! first success prices it (0 ≤ cost ≤ hold) and releases the rest; a failure refunds the hold and a
//! late success reclaims the price. Every arrow with every signal twice, refusals that write
//! nothing, and the races — on both engines, the audit clean after each.

use crate::kit::*;
use settle_core::Credits;
use settle_core::ids::AccountId;
use settle_core::item::ItemState;
use settle_core::job::JobState;
use settle_store::*;
use std::sync::Arc;

fn costs(pairs: &[(&str, i64)]) -> Costs {
    Costs(pairs.iter().map(|(i, c)| (iid(i), Credits::new(*c))).collect())
}

/// What a refusal must leave untouched: the ledger, the outbox and the job.
async fn snapshot(k: &Kit, account: &AccountId, job: &str) -> (Vec<(String, i64)>, Vec<String>, Job) {
    (k.ledger_kinds(account).await, k.event_types().await, k.get(job).await)
}

async fn capture_releases_the_rest(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    let job = k.store.create_job(held_job("h", &a, &[100])).await.unwrap().value;
    assert_eq!((job.items[0].hold, job.items[0].priced_cost()), (Some(Credits::new(100)), None));
    assert_eq!(k.balance(&a).await, 900, "the hold is taken at create");
    let t = k.claim_one("h").await;
    let done = k.store.succeed_priced(&jid("h"), Reporter::of(Some(&t)), None, &costs(&[("i0", 37)])).await.unwrap();
    assert!(done.applied);
    let item = &done.value.items[0];
    assert_eq!(
        (item.state, item.cost, item.priced_cost()),
        (ItemState::Succeeded, Credits::new(37), Some(Credits::new(37)))
    );
    assert_eq!(done.value.net.get(), -37);
    assert_eq!(k.balance(&a).await, 963);
    let kinds = k.ledger_kinds(&a).await;
    assert_eq!(&kinds[1..], [("charge".to_owned(), -100), ("release".to_owned(), 63)]);
    let succeeded = k.store.events(0, 100, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    let data: serde_json::Value = serde_json::from_str(&succeeded.last().unwrap().data).unwrap();
    assert_eq!(data["items"], serde_json::json!([{ "id": "i0", "hold": 100, "cost": 37, "released": 63 }]));
    // The same success again: a replay; with another price: still a replay, the price stays 37.
    for price in [37, 50] {
        let again = k.store.succeed_priced(&jid("h"), Reporter::of(Some(&t)), None, &costs(&[("i0", price)])).await;
        let again = again.unwrap();
        assert!(!again.applied);
        assert_eq!(again.value.items[0].cost, Credits::new(37));
    }
    // A failure after the success changes nothing.
    assert!(matches!(k.store.fail(&jid("h"), fail_sig(&t, "TIMEOUT")).await, Err(StoreError::LeaseLost(_))));
    assert_eq!(k.ledger_kinds(&a).await.len(), 3);
    k.assert_clean().await;
}

async fn capture_at_the_hold_releases_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.create_job(held_job("h", &a, &[100])).await.unwrap();
    let t = k.claim_one("h").await;
    k.store.succeed_priced(&jid("h"), Reporter::of(Some(&t)), None, &costs(&[("i0", 100)])).await.unwrap();
    assert_eq!(k.ledger_kinds(&a).await.last().unwrap(), &("charge".to_owned(), -100));
    k.assert_clean().await;
    // And at zero: the whole hold comes back.
    k.store.create_job(held_job("z", &a, &[40])).await.unwrap();
    let t = k.claim_one("z").await;
    k.store.succeed_priced(&jid("z"), Reporter::of(Some(&t)), None, &costs(&[("i0", 0)])).await.unwrap();
    assert_eq!(k.ledger_kinds(&a).await.last().unwrap(), &("release".to_owned(), 40));
    assert_eq!(k.get("z").await.net.get(), 0);
    k.assert_clean().await;
}

async fn a_bad_price_writes_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.create_job(held_job("h", &a, &[100])).await.unwrap();
    let t = k.claim_one("h").await;
    let before = snapshot(&k, &a, "h").await;
    let by = Reporter::of(Some(&t));
    let missing = k.store.succeed(&jid("h"), by, None).await;
    assert!(matches!(missing, Err(StoreError::CostRequired { hold: 100, .. })), "{missing:?}");
    let over = k.store.succeed_priced(&jid("h"), by, None, &costs(&[("i0", 101)])).await;
    assert!(matches!(over, Err(StoreError::CostExceedsHold { cost: 101, hold: 100, .. })), "{over:?}");
    let negative = k.store.succeed_priced(&jid("h"), by, None, &costs(&[("i0", -1)])).await;
    assert!(matches!(negative, Err(StoreError::Invalid(_))), "{negative:?}");
    let unknown = k.store.succeed_priced(&jid("h"), by, None, &costs(&[("i0", 5), ("nope", 1)])).await;
    assert!(matches!(unknown, Err(StoreError::Invalid(_))), "{unknown:?}");
    let item = k.store.item_succeed(&jid("h"), &iid("i0"), &t).await;
    assert!(matches!(item, Err(StoreError::CostRequired { .. })), "{item:?}");
    let item = k.store.item_succeed_priced(&jid("h"), &iid("i0"), &t, Some(Credits::new(1_000))).await;
    assert!(matches!(item, Err(StoreError::CostExceedsHold { .. })), "{item:?}");
    assert_eq!(snapshot(&k, &a, "h").await, before, "a refused success writes nothing");
    assert_eq!(k.get("h").await.state, JobState::Running);
    // Holds: zero, negative, and more than the largest balance are refused at create.
    for hold in [0, -5, settle_core::limits::BALANCE_MAX + 1] {
        let r = k.store.create_job(held_job("bad", &a, &[hold])).await;
        assert!(matches!(r, Err(StoreError::Invalid(_) | StoreError::Overflow)), "hold {hold}: {r:?}");
    }
    // A hold the balance cannot cover: 402, nothing written.
    let poor = k.store.create_job(held_job("poor", &a, &[10_000])).await;
    assert!(matches!(poor, Err(StoreError::InsufficientCredits { .. })), "{poor:?}");
    assert_eq!(snapshot(&k, &a, "h").await, before);
    k.assert_clean().await;
}

async fn a_timeout_refunds_the_hold_and_a_late_success_reclaims_the_price(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.create_job(held_job("h", &a, &[100])).await.unwrap();
    let t = k.claim_one("h").await;
    k.fail("h", &t, "TIMEOUT").await;
    assert_eq!(k.balance(&a).await, 1_000, "the hold is refunded");
    assert_eq!(k.get("h").await.items[0].priced_cost(), None);
    let late = k.store.succeed_priced(&jid("h"), Reporter::of(Some(&t)), None, &costs(&[("i0", 41)])).await.unwrap();
    assert!(late.applied);
    let item = &late.value.items[0];
    assert_eq!((item.state, item.priced_cost()), (ItemState::Reclaimed, Some(Credits::new(41))));
    assert_eq!(late.value.net.get(), -41);
    assert_eq!(k.balance(&a).await, 959);
    let kinds = k.ledger_kinds(&a).await;
    assert_eq!(&kinds[1..], [("charge".to_owned(), -100), ("refund".to_owned(), 100), ("reclaim".to_owned(), -41)]);
    k.assert_clean().await;
}

async fn items_mix_fixed_and_held(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    let req = NewJob {
        items: vec![
            NewItem { id: iid("fixed"), price: Price::Cost(Credits::new(10)) },
            NewItem { id: iid("gpu"), price: Price::Hold(Credits::new(80)) },
            NewItem { id: iid("bad"), price: Price::Hold(Credits::new(30)) },
            NewItem { id: iid("cancelled"), price: Price::Hold(Credits::new(5)) },
        ],
        ..new_job("m", &a, 0)
    };
    k.store.create_job(req).await.unwrap();
    assert_eq!(k.balance(&a).await, 1_000 - 125);
    let t = k.claim_one("m").await;
    // Each arrow twice: the second is a replay.
    for _ in 0..2 {
        let r = k.store.item_succeed_priced(&jid("m"), &iid("gpu"), &t, Some(Credits::new(55))).await.unwrap();
        assert_eq!(r.item.priced_cost(), Some(Credits::new(55)));
        let r = k.store.item_fail(&jid("m"), &iid("bad"), &t, &code("OOM"), None).await.unwrap();
        assert_eq!(r.item.state, ItemState::Refunded);
    }
    // A fixed item's price, if given, must be its cost.
    let wrong = k.store.item_succeed_priced(&jid("m"), &iid("fixed"), &t, Some(Credits::new(11))).await;
    assert!(matches!(wrong, Err(StoreError::Invalid(_))), "{wrong:?}");
    k.store.item_succeed_priced(&jid("m"), &iid("fixed"), &t, Some(Credits::new(10))).await.unwrap();
    // The job's success decides the last held item; the item that failed stays refunded, unbilled.
    let missing = k.store.succeed(&jid("m"), Reporter::of(Some(&t)), None).await;
    assert!(matches!(missing, Err(StoreError::CostRequired { .. })), "{missing:?}");
    let done = k
        .store
        .succeed_priced(&jid("m"), Reporter::of(Some(&t)), None, &costs(&[("cancelled", 2), ("bad", 30)]))
        .await
        .unwrap();
    let by_id = |id: &str| done.value.items.iter().find(|i| i.id.as_str() == id).unwrap().clone();
    assert_eq!(by_id("bad").state, ItemState::Refunded);
    assert_eq!(by_id("bad").priced_cost(), None);
    assert_eq!(by_id("cancelled").priced_cost(), Some(Credits::new(2)));
    assert_eq!(done.value.net.get(), -(10 + 55 + 2));
    k.assert_clean().await;
}

/// An earlier attempt's failure refunded the holds; the next attempt delivers each item, reported
/// one by one (twice each): each is reclaimed at its own price.
async fn a_retry_reclaims_each_item_at_its_price(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.create_job(held_job("h", &a, &[100, 50])).await.unwrap();
    let t1 = k.claim_one("h").await;
    k.fail("h", &t1, "NODE_DOWN").await;
    assert_eq!(k.balance(&a).await, 1_000);
    k.clock.advance_seconds(60);
    let t2 = k.claim_one("h").await;
    for _ in 0..2 {
        let r = k.store.item_succeed_priced(&jid("h"), &iid("i0"), &t2, Some(Credits::new(20))).await.unwrap();
        assert_eq!((r.item.state, r.item.priced_cost()), (ItemState::Reclaimed, Some(Credits::new(20))));
    }
    let done = k.store.succeed_priced(&jid("h"), Reporter::of(Some(&t2)), None, &costs(&[("i1", 50)])).await.unwrap();
    assert_eq!(done.value.net.get(), -70);
    let kinds = k.ledger_kinds(&a).await;
    let reclaims: Vec<i64> = kinds.iter().filter(|(kind, _)| kind == "reclaim").map(|(_, n)| *n).collect();
    assert_eq!(reclaims, [-20, -50]);
    k.assert_clean().await;
}

async fn a_cancel_refunds_the_hold(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.create_job(held_job("h", &a, &[100, 20])).await.unwrap();
    for _ in 0..2 {
        k.store.cancel(&jid("h"), None).await.ok();
    }
    let job = k.get("h").await;
    assert_eq!(job.state, JobState::Cancelled);
    assert_eq!(job.net.get(), 0);
    assert_eq!(k.balance(&a).await, 1_000);
    k.assert_clean().await;
}

/// 50 successes of one held item at once, each with another price: exactly one prices it, with
/// one of the reported prices, and at most one release is written.
async fn fifty_successes_price_once(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = k.account("a", 1_000).await;
    k.store.create_job(held_job("h", &a, &[100])).await.unwrap();
    let t = k.claim_one("h").await;
    let tasks: Vec<_> = (0..50i64)
        .map(|n| {
            let (k, t) = (k.clone(), t.clone());
            tokio::spawn(async move {
                let by = Reporter::of(Some(&t));
                if n % 2 == 0 {
                    k.store.succeed_priced(&jid("h"), by, None, &costs(&[("i0", n)])).await.map(|o| o.applied)
                } else {
                    k.store
                        .item_succeed_priced(&jid("h"), &iid("i0"), &t, Some(Credits::new(n)))
                        .await
                        .map(|r| r.applied)
                }
            })
        })
        .collect();
    let mut applied = 0;
    for task in tasks {
        // An item report after the job's success ended the lease is refused (decision 0019).
        match task.await.unwrap() {
            Ok(true) => applied += 1,
            Ok(false) | Err(StoreError::LeaseLost(_)) => {}
            Err(e) => panic!("success: {e}"),
        }
    }
    let item = k.get("h").await.items[0].clone();
    let price = item.priced_cost().expect("priced").get();
    assert!((0..50).contains(&price));
    let releases = k.ledger_kinds(&a).await.into_iter().filter(|(kind, _)| kind == "release").count();
    assert!(releases <= 1);
    assert!(applied >= 1, "a success took effect");
    k.assert_clean().await;
}

/// A late success racing the lease rescuer, capture racing cancel, a failure racing a success:
/// each ends with the item at its price (−A) or refunded (0), never −N or −2A.
async fn races_end_at_the_price_or_nothing(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = k.account("a", 100_000).await;
    for round in 0..12 {
        let id = format!("r{round}");
        k.store.create_job(held_job(&id, &a, &[100])).await.unwrap();
        let t = k.claim_one(&id).await;
        if round % 3 == 0 {
            // The lease lapses: the rescuer refunds while the worker's late success arrives.
            k.clock.advance_seconds(3_600);
        }
        let (k1, k2, id1, id2, t1, t2) = (k.clone(), k.clone(), id.clone(), id.clone(), t.clone(), t.clone());
        let success = tokio::spawn(async move {
            k1.store.succeed_priced(&jid(&id1), Reporter::of(Some(&t1)), None, &costs(&[("i0", 37)])).await.map(drop)
        });
        let other = tokio::spawn(async move {
            match round % 3 {
                0 => k2.store.rescue_expired_leases(100).await.map(drop),
                1 => k2.store.cancel(&jid(&id2), None).await.map(drop),
                _ => k2.store.fail(&jid(&id2), fail_sig(&t2, "TIMEOUT")).await.map(drop),
            }
        });
        let (s, o) = (success.await.unwrap(), other.await.unwrap());
        assert!(matches!(s, Ok(()) | Err(StoreError::LeaseLost(_) | StoreError::InvalidTransition { .. })), "{s:?}");
        assert!(matches!(o, Ok(()) | Err(StoreError::LeaseLost(_) | StoreError::JobFinished(_))), "{o:?}");
        // A cancel that won sends the success to teardown; finish it.
        k.store.resume_teardowns(100).await.unwrap();
        let job = k.get(&id).await;
        assert!([0, -37].contains(&job.net.get()), "{id}: net {} in {:?}", job.net.get(), job.state);
    }
    k.assert_clean().await;
}

both_engines!(
    capture_releases_the_rest,
    capture_at_the_hold_releases_nothing,
    a_bad_price_writes_nothing,
    a_timeout_refunds_the_hold_and_a_late_success_reclaims_the_price,
    items_mix_fixed_and_held,
    a_cancel_refunds_the_hold,
    a_retry_reclaims_each_item_at_its_price,
    fifty_successes_price_once,
    races_end_at_the_price_or_nothing,
);
