//! Top-ups (issue 45, docs/design/money-controls.md §4 and §11), written once against the `Store`
//! and `Funding` traits and run on both engines like the conformance suite; each check ends with
//! the audit (L1's `held` counts the open top-ups' reservations, L9 their charges and grants).

use crate::kit::*;
use settle_core::currency::Currency;
use settle_core::history::AttemptResult;
use settle_core::ids::*;
use settle_core::job::{JobState, RefundPolicy};
use settle_core::{Credits, limits};
use settle_store::*;

conformance!(
    create_reserves_nothing_charged_and_replays,
    bad_top_ups_write_nothing,
    a_grant_id_is_one_namespace_with_top_ups,
    the_top_up_kind_is_reserved_for_the_funding_processor,
    a_confirmed_charge_grants_once,
    a_decline_kills_it_and_gives_the_reservation_back,
    a_failed_lookup_spends_no_attempt,
    lease_expiry_after_the_charge_started_is_unknown,
    a_late_charge_of_a_closed_top_up_is_granted,
    a_queued_top_up_is_cancelled_a_running_one_is_not,
    the_reservation_keeps_the_bound,
    a_crossing_buys_once_and_waits_while_one_is_open,
    a_declined_rule_top_up_pauses_the_rule,
    the_month_count_skips_and_starts_again,
    bad_rules_write_nothing_and_a_deleted_rule_buys_nothing,
    an_earlier_rules_dead_top_up_pauses_nothing,
);

fn rule(below: i64, credits: i64, monthly_credits_max: i64) -> NewAutoTopUp {
    NewAutoTopUp {
        below,
        credits: Credits::new(credits),
        price: 999,
        currency: Currency::parse("USD").unwrap(),
        customer: Customer::parse("cus_rule").unwrap(),
        monthly_credits_max,
    }
}

/// The account's top-ups made by its rule, in creation order.
async fn rule_top_ups(k: &Kit, a: &AccountId) -> Vec<TopUp> {
    let filter = TopUpFilter { account_id: Some(a.clone()), ..TopUpFilter::default() };
    let all = k.store.funding().top_ups(&filter, Page { after: 0, limit: 100 }).await.unwrap().rows;
    all.into_iter().filter(|t| t.rule).collect()
}

/// The funding processor's answer to the one top-up it claims: charged (granted) or declined.
async fn settle_one(k: &Kit, charged: bool) -> JobId {
    let (id, token) = claim_top_up_any(k).await;
    if charged {
        k.store.funding().top_up_succeeded(&id, Some(&token), &format!("ch_{id}")).await.unwrap();
    } else {
        k.store.funding().top_up_failed(&id, declined(&token, "CARD_DECLINED", false)).await.unwrap();
    }
    id
}

fn new_top_up(id: &str, account: &AccountId, credits: i64, price: i64) -> NewTopUp {
    NewTopUp {
        id: jid(id),
        account_id: account.clone(),
        credits: Credits::new(credits),
        price,
        currency: Currency::parse("usd").unwrap(),
        customer: Customer::parse("cus_1").unwrap(),
    }
}

async fn buy(k: &Kit, id: &str, account: &AccountId, credits: i64) -> TopUp {
    k.store.funding().create_top_up(new_top_up(id, account, credits, 999)).await.unwrap().value
}

fn admin_grant(id: &str, amount: i64) -> NewGrant {
    NewGrant {
        id: RefId::parse(id).unwrap(),
        amount: Credits::new(amount),
        reason: None,
        expires_at: None,
        priority: None,
    }
}

fn data(e: &Event) -> serde_json::Value {
    serde_json::from_str(&e.data).unwrap()
}

async fn events(k: &Kit) -> Vec<Event> {
    k.store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows
}

fn processor() -> WorkerName {
    WorkerName::parse("funding").unwrap()
}

/// Claims exactly the top-up `id` through the funding processor's door.
async fn claim_top_up(k: &Kit, id: &str) -> LeaseToken {
    let claimed = k.store.funding().claim_top_ups(&processor(), 10).await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.job.id.as_str()).collect::<Vec<_>>(), vec![id]);
    claimed[0].lease_token.clone()
}

fn declined(token: &LeaseToken, code: &str, retryable: bool) -> FailSignal {
    FailSignal { retryable: Some(retryable), ..fail_sig(token, code) }
}

/// The audit judges `held` (L1, with the open top-ups' reservations) and each top-up (L9) now.
async fn audited(k: &Kit) {
    k.assert_clean().await;
}

async fn create_reserves_nothing_charged_and_replays(k: &Kit) {
    let a = k.account("a", 100).await;
    let t = buy(k, "t1", &a, 500).await;
    assert_eq!(
        (t.job.kind.as_str(), t.job.state, t.job.refund_on, t.job.cost.get()),
        ("top_up", JobState::Queued, RefundPolicy::FinalFailure, 0)
    );
    assert_eq!((t.credits.get(), t.price, t.currency.as_str(), t.customer.as_str()), (500, 999, "USD", "cus_1"));
    assert_eq!((t.provider_charge_id.as_deref(), t.grant_id.as_deref(), t.rule), (None, None, false));
    assert!(t.idempotency_key.starts_with("tu_") && t.idempotency_key.len() > 20, "{}", t.idempotency_key);
    // nothing is charged to the account; the credits are reserved under its bound
    assert_eq!(k.balance(&a).await, 100);
    audited(k).await;
    // a replay (the currency in any case) answers the stored top-up; another body is a conflict
    let mut again = new_top_up("t1", &a, 500, 999);
    again.currency = Currency::parse("USD").unwrap();
    let replay = k.store.funding().create_top_up(again).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value.idempotency_key, t.idempotency_key);
    let e = k.store.funding().create_top_up(new_top_up("t1", &a, 500, 1000)).await.unwrap_err();
    assert!(matches!(e, StoreError::IdempotencyConflict { .. }), "{e:?}");
    // a job's id is not a top-up's
    k.job("r", &a, 5).await;
    let e = k.store.funding().create_top_up(new_top_up("r", &a, 500, 999)).await.unwrap_err();
    assert!(matches!(e, StoreError::IdempotencyConflict { .. }), "{e:?}");
    let events: Vec<String> = k.event_types().await;
    assert!(events.iter().any(|e| e == "top_up.queued"), "{events:?}");
}

async fn bad_top_ups_write_nothing(k: &Kit) {
    let a = k.account("a", 100).await;
    let before = events(k).await.len();
    for (credits, price) in
        [(0, 1), (-5, 1), (limits::TOP_UP_CREDITS_MAX + 1, 1), (5, -1), (5, limits::TOP_UP_PRICE_MAX + 1)]
    {
        let e = k.store.funding().create_top_up(new_top_up("t", &a, credits, price)).await.unwrap_err();
        assert!(matches!(e, StoreError::Invalid(_)), "{credits} for {price}: {e:?}");
    }
    let e = k.store.funding().create_top_up(new_top_up("t", &acc("nobody"), 5, 1)).await.unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }), "{e:?}");
    assert!(matches!(k.store.funding().top_up(&jid("t")).await, Err(StoreError::NotFound { .. })));
    assert_eq!(events(k).await.len(), before);
    assert_eq!(k.balance(&a).await, 100);
    audited(k).await;
    for bad in ["", "XXX", "dollars", "US"] {
        assert!(Currency::parse(bad).is_none(), "{bad}");
    }
    assert!(Customer::parse(" cus").is_err() && Customer::parse("").is_err());
}

async fn a_grant_id_is_one_namespace_with_top_ups(k: &Kit) {
    let a = k.account("a", 100).await;
    let b = k.account("b", 0).await;
    k.store.grant(&a, admin_grant("g1", 10), SYSTEM_ACTOR).await.unwrap();
    // a top-up may not take an admin grant's id (its grant would), on any account
    let e = k.store.funding().create_top_up(new_top_up("g1", &b, 5, 1)).await.unwrap_err();
    assert!(matches!(e, StoreError::IdTaken { .. }), "{e:?}");
    // nor an admin grant a top-up's, open or paid
    buy(k, "t1", &a, 50).await;
    let e = k.store.grant(&b, admin_grant("t1", 5), SYSTEM_ACTOR).await.unwrap_err();
    assert!(matches!(e, StoreError::IdTaken { .. }), "{e:?}");
    assert_eq!(k.balance(&b).await, 0);
}

async fn the_top_up_kind_is_reserved_for_the_funding_processor(k: &Kit) {
    let a = k.account("a", 100).await;
    buy(k, "t", &a, 50).await;
    k.job("r", &a, 5).await;
    // workers never get it, the payout processor neither
    let claimed = k.store.claim(claim_req("w1", 10)).await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.job.id.as_str()).collect::<Vec<_>>(), vec!["r"]);
    assert!(k.store.payouts().claim_payouts(&processor(), 10).await.unwrap().is_empty());
    let tr = claimed[0].lease_token.clone();
    let t = claim_top_up(k, "t").await;
    let refused = |e: StoreError| assert!(matches!(e, StoreError::InvalidTransition { .. }), "{e:?}");
    // worker and payout signals on a top-up, and funding signals on another job, are refused
    refused(k.store.succeed(&jid("t"), settle_store::Reporter::of(None), None).await.unwrap_err());
    refused(k.store.fail(&jid("t"), fail_sig(&t, "NODE_DOWN")).await.unwrap_err());
    refused(k.store.mark_unknown(&jid("t"), &t, None).await.unwrap_err());
    refused(k.store.heartbeat(&jid("t"), &t).await.unwrap_err());
    refused(k.store.item_succeed(&jid("t"), &ItemId::main(), &t).await.unwrap_err());
    refused(k.store.release(&jid("t"), &t).await.unwrap_err());
    refused(k.store.payouts().payout_failed(&jid("t"), fail_sig(&t, "NODE_DOWN")).await.unwrap_err());
    refused(k.store.payouts().payout_succeeded(&jid("t"), Some(&t), "tx", false).await.unwrap_err());
    refused(k.store.funding().top_up_failed(&jid("r"), fail_sig(&tr, "NODE_DOWN")).await.unwrap_err());
    refused(k.store.funding().top_up_succeeded(&jid("r"), Some(&tr), "ch").await.unwrap_err());
    refused(k.store.funding().top_up_heartbeat(&jid("r"), &tr).await.unwrap_err());
    // an admin's success would skip the grant; the generic reconciler may not judge it
    refused(k.store.succeed(&jid("t"), settle_store::Reporter::Operator("ops"), None).await.unwrap_err());
    assert_state(&k.get("t").await, JobState::Running);
    // a dead top-up is not requeued: buying again is a new top-up
    let dead = k.store.funding().top_up_failed(&jid("t"), declined(&t, "CARD_DECLINED", false)).await.unwrap();
    assert_state(&dead.value, JobState::Dead);
    refused(k.store.requeue(&jid("t"), SYSTEM_ACTOR).await.unwrap_err());
    assert!(!k.store.reconcile(&jid("t"), Finding::Present).await.unwrap().applied);
}

async fn a_confirmed_charge_grants_once(k: &Kit) {
    let a = k.account("a", 100).await;
    buy(k, "t", &a, 500).await;
    let t = claim_top_up(k, "t").await;
    let hb = k.store.funding().top_up_heartbeat(&jid("t"), &t).await.unwrap();
    assert!(!hb.cancel_requested);
    let out = k.store.funding().top_up_succeeded(&jid("t"), Some(&t), "ch_1").await.unwrap();
    assert!(out.applied);
    let v = out.value;
    assert_eq!(
        (v.job.state, v.provider_charge_id.as_deref(), v.grant_id.as_deref()),
        (JobState::Succeeded, Some("ch_1"), Some("t"))
    );
    assert_eq!(k.balance(&a).await, 600);
    audited(k).await;
    assert_eq!(k.store.attempts(&jid("t")).await.unwrap()[0].result, Some(AttemptResult::Succeeded));
    // the same charge found again (a lookup, the reconciler): nothing more
    for token in [Some(&t), None] {
        let again = k.store.funding().top_up_succeeded(&jid("t"), token, "ch_1").await.unwrap();
        assert!(!again.applied);
    }
    let again = k.store.funding().top_up_succeeded(&jid("t"), None, "ch_other").await.unwrap();
    assert_eq!((again.applied, again.value.provider_charge_id.as_deref()), (false, Some("ch_1")));
    assert_eq!(k.balance(&a).await, 600);
    let grants = k.store.grants(&a, Page { after: 0, limit: 10 }).await.unwrap().rows;
    let bought: Vec<_> = grants.iter().filter(|g| g.origin == "top_up").collect();
    assert_eq!(bought.len(), 1);
    assert_eq!((bought[0].id.as_str(), bought[0].amount.get(), bought[0].expires_at), ("t", 500, None));
    let events: Vec<String> = k.event_types().await;
    assert_eq!(events.iter().filter(|e| *e == "top_up.succeeded").count(), 1, "{events:?}");
    // the bought credit pays for work
    k.job("r", &a, 550).await;
    assert_eq!(k.balance(&a).await, 50);
}

async fn a_decline_kills_it_and_gives_the_reservation_back(k: &Kit) {
    let a = k.account("a", 100).await;
    buy(k, "t", &a, 500).await;
    let t = claim_top_up(k, "t").await;
    k.store.funding().top_up_heartbeat(&jid("t"), &t).await.unwrap();
    let out = k.store.funding().top_up_failed(&jid("t"), declined(&t, "CARD_DECLINED", false)).await.unwrap();
    assert_state(&out.value, JobState::Dead);
    assert_eq!(out.value.last_error.as_ref().map(|e| e.code.as_str()), Some("CARD_DECLINED"));
    assert_eq!(k.balance(&a).await, 100);
    audited(k).await;
    let events = events(k).await;
    let failed: Vec<_> = events.iter().filter(|e| e.kind.as_str() == "top_up.failed").collect();
    assert_eq!(failed.len(), 1);
    assert_eq!(data(failed[0])["code"], "CARD_DECLINED");
    // a retryable refusal goes back to the queue, still reserved
    buy(k, "t2", &a, 7).await;
    let t2 = claim_top_up(k, "t2").await;
    let out = k.store.funding().top_up_failed(&jid("t2"), declined(&t2, "PROCESSOR_DOWN", true)).await.unwrap();
    assert_state(&out.value, JobState::Queued);
    audited(k).await;
}

async fn a_failed_lookup_spends_no_attempt(k: &Kit) {
    let a = k.account("a", 100).await;
    buy(k, "t", &a, 5).await;
    for _ in 0..8 {
        let t = claim_top_up(k, "t").await;
        let signal = declined(&t, "LOOKUP_FAILED", true);
        assert_state(&k.store.funding().top_up_failed(&jid("t"), signal).await.unwrap().value, JobState::Queued);
        k.clock.advance_seconds(3_600);
    }
    audited(k).await;
}

async fn lease_expiry_after_the_charge_started_is_unknown(k: &Kit) {
    let a = k.account("a", 100).await;
    buy(k, "t", &a, 40).await;
    // attempt 1 dies before its charge started: nothing can have been charged, so it is retried
    claim_top_up(k, "t").await;
    k.clock.advance_seconds(31);
    assert_eq!(k.store.rescue_expired_leases(10).await.unwrap(), vec!["t".to_owned()]);
    assert_state(&k.get("t").await, JobState::Queued);
    // attempt 2 marks its charge, then dies: the customer may have been charged
    k.clock.advance_seconds(600);
    let t = claim_top_up(k, "t").await;
    k.store.funding().top_up_heartbeat(&jid("t"), &t).await.unwrap();
    k.clock.advance_seconds(31);
    assert_eq!(k.store.rescue_expired_leases(10).await.unwrap(), vec!["t".to_owned()]);
    assert_state(&k.get("t").await, JobState::Unknown);
    audited(k).await;
    // the funding reconciler finds the charge: granted
    let out = k.store.funding().top_up_succeeded(&jid("t"), None, "ch_9").await.unwrap();
    assert!(out.applied);
    assert_eq!((out.value.job.state, k.balance(&a).await), (JobState::Succeeded, 140));
}

async fn a_late_charge_of_a_closed_top_up_is_granted(k: &Kit) {
    let a = k.account("a", 100).await;
    buy(k, "t", &a, 30).await;
    let t = claim_top_up(k, "t").await;
    k.store.funding().top_up_failed(&jid("t"), declined(&t, "INSUFFICIENT_FUNDS", false)).await.unwrap();
    audited(k).await;
    // the provider charged after all (found by a re-check): the customer paid, the credits are theirs
    let out = k.store.funding().top_up_succeeded(&jid("t"), None, "ch_late").await.unwrap();
    assert!(out.applied);
    assert_eq!((out.value.grant_id.as_deref(), k.balance(&a).await), (Some("t"), 130));
    // a cancelled one: granted, reported as a late charge, left cancelled
    buy(k, "c", &a, 20).await;
    k.store.cancel(&jid("c"), None).await.unwrap();
    assert_state(&k.get("c").await, JobState::Cancelled);
    let out = k.store.funding().top_up_succeeded(&jid("c"), None, "ch_c").await.unwrap();
    assert_eq!((out.value.job.state, k.balance(&a).await), (JobState::Cancelled, 150));
    let events = events(k).await;
    assert!(events.iter().any(|e| e.kind.as_str() == "top_up.late_charge" && data(e)["state"] == "cancelled"));
}

async fn a_queued_top_up_is_cancelled_a_running_one_is_not(k: &Kit) {
    let a = k.account("a", 100).await;
    buy(k, "q", &a, 10).await;
    k.store.cancel(&jid("q"), None).await.unwrap();
    assert_state(&k.get("q").await, JobState::Cancelled);
    audited(k).await;
    buy(k, "r", &a, 10).await;
    claim_top_up(k, "r").await;
    let e = k.store.cancel(&jid("r"), None).await.unwrap_err();
    assert!(matches!(e, StoreError::InvalidTransition { .. }), "{e:?}");
    audited(k).await;
}

async fn the_reservation_keeps_the_bound(k: &Kit) {
    let a = k.account("a", limits::BALANCE_MAX - 100).await;
    buy(k, "t1", &a, 60).await;
    // 60 reserved: 41 more would pass the bound when both are granted
    let e = k.store.funding().create_top_up(new_top_up("t2", &a, 41, 1)).await.unwrap_err();
    assert!(matches!(e, StoreError::Overflow), "{e:?}");
    assert!(matches!(k.store.funding().top_up(&jid("t2")).await, Err(StoreError::NotFound { .. })));
    buy(k, "t3", &a, 40).await;
    // so every confirmed charge can be granted
    for id in ["t1", "t3"] {
        let t = claim_top_up_any(k).await;
        k.store.funding().top_up_succeeded(&t.0, Some(&t.1), &format!("ch_{id}")).await.unwrap();
    }
    assert_eq!(k.balance(&a).await, limits::BALANCE_MAX);
    audited(k).await;
}

async fn claim_top_up_any(k: &Kit) -> (JobId, LeaseToken) {
    let claimed = k.store.funding().claim_top_ups(&processor(), 1).await.unwrap();
    (claimed[0].job.id.clone(), claimed[0].lease_token.clone())
}

async fn a_crossing_buys_once_and_waits_while_one_is_open(k: &Kit) {
    let a = k.account("a", 1_000).await;
    let put = k.store.funding().put_auto_top_up(&a, rule(500, 1_000, 10_000), SYSTEM_ACTOR).await.unwrap();
    assert_eq!((put.state, put.credits_this_month), (RuleState::Active, 0));
    // above the threshold: nothing
    k.job("j1", &a, 400).await;
    assert!(rule_top_ups(k, &a).await.is_empty());
    // 600 → 300 crosses it: one top-up, in the same transaction as the charge
    k.job("j2", &a, 300).await;
    let made = rule_top_ups(k, &a).await;
    assert_eq!(made.len(), 1);
    assert_eq!((made[0].credits.get(), made[0].price, made[0].job.state), (1_000, 999, JobState::Queued));
    // further below: no second crossing, and one top-up is open anyway
    k.job("j3", &a, 100).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 1);
    // up (a grant) and down again while it is open: a crossing, skipped — never a second in flight
    k.store.grant(&a, admin_grant("g-up", 500), SYSTEM_ACTOR).await.unwrap();
    k.job("j3b", &a, 500).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 1);
    let skipped: Vec<serde_json::Value> =
        events(k).await.iter().filter(|e| e.kind.as_str() == "top_up.rule_skipped").map(data).collect();
    assert_eq!(skipped.iter().map(|d| d["reason"].clone()).collect::<Vec<_>>(), vec!["in_flight"]);
    assert_eq!(k.store.funding().auto_top_up(&a).await.unwrap().credits_this_month, 1_000);
    // charged: 200 + 1000 = 1200 is above again; 1200 → 300 crosses again: a second top-up
    settle_one(k, true).await;
    assert_eq!(k.balance(&a).await, 1_200);
    k.job("j4", &a, 900).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 2);
    assert_eq!(k.store.funding().auto_top_up(&a).await.unwrap().credits_this_month, 2_000);
    // more creates while one is open: none makes another
    for n in 0..20 {
        k.job(&format!("r{n}"), &a, 1).await;
    }
    assert_eq!(rule_top_ups(k, &a).await.len(), 2);
    let events = k.event_types().await;
    assert_eq!(events.iter().filter(|e| *e == "top_up.queued").count(), 2, "{events:?}");
}

async fn a_declined_rule_top_up_pauses_the_rule(k: &Kit) {
    let a = k.account("a", 1_000).await;
    k.store.funding().put_auto_top_up(&a, rule(500, 300, 10_000), SYSTEM_ACTOR).await.unwrap();
    k.job("j1", &a, 600).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 1);
    settle_one(k, false).await;
    let paused = k.store.funding().auto_top_up(&a).await.unwrap();
    assert_eq!((paused.state, paused.credits_this_month), (RuleState::Paused, 0));
    assert!(k.event_types().await.iter().any(|e| e == "top_up.rule_paused"));
    // back above and down again: a paused rule buys nothing — no loop on a declined card
    k.store.grant(&a, admin_grant("g2", 500), SYSTEM_ACTOR).await.unwrap();
    k.job("j2", &a, 600).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 1);
    // put again (below the threshold now): active, and it fires nothing until the next crossing
    let again = k.store.funding().put_auto_top_up(&a, rule(500, 300, 10_000), SYSTEM_ACTOR).await.unwrap();
    assert_eq!(again.state, RuleState::Active);
    k.job("j3", &a, 10).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 1);
    k.store.grant(&a, admin_grant("g3", 500), SYSTEM_ACTOR).await.unwrap();
    k.job("j4", &a, 500).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 2);
}

async fn the_month_count_skips_and_starts_again(k: &Kit) {
    let a = k.account("a", 1_000).await;
    k.store.funding().put_auto_top_up(&a, rule(500, 400, 400), SYSTEM_ACTOR).await.unwrap();
    k.job("j1", &a, 600).await;
    settle_one(k, true).await;
    assert_eq!(k.balance(&a).await, 800);
    // the month's 400 are bought: the next crossing is skipped, with its reason
    k.job("j2", &a, 400).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 1);
    let events = events(k).await;
    let skipped: Vec<_> = events.iter().filter(|e| e.kind.as_str() == "top_up.rule_skipped").collect();
    assert_eq!(skipped.len(), 1);
    assert_eq!(data(skipped[0])["reason"], "monthly_credits_max");
    // next month: the count starts again
    let shown = k.store.funding().auto_top_up(&a).await.unwrap();
    k.clock.set(shown.month_resets_at);
    assert_eq!(k.store.funding().auto_top_up(&a).await.unwrap().credits_this_month, 0);
    k.store.grant(&a, admin_grant("g2", 500), SYSTEM_ACTOR).await.unwrap();
    k.job("j3", &a, 600).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 2);
    assert_eq!(k.store.funding().auto_top_up(&a).await.unwrap().credits_this_month, 400);
}

async fn bad_rules_write_nothing_and_a_deleted_rule_buys_nothing(k: &Kit) {
    let a = k.account("a", 1_000).await;
    for bad in [rule(0, 5, 5), rule(-1, 5, 5), rule(500, 0, 5), rule(500, 10, 5), rule(limits::BALANCE_MAX + 1, 5, 5)] {
        let e = k.store.funding().put_auto_top_up(&a, bad.clone(), SYSTEM_ACTOR).await.unwrap_err();
        assert!(matches!(e, StoreError::Invalid(_)), "{bad:?}: {e:?}");
    }
    assert!(matches!(k.store.funding().auto_top_up(&a).await, Err(StoreError::NotFound { .. })));
    let e = k.store.funding().put_auto_top_up(&acc("nobody"), rule(5, 5, 5), SYSTEM_ACTOR).await.unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }), "{e:?}");
    k.store.funding().put_auto_top_up(&a, rule(500, 300, 10_000), SYSTEM_ACTOR).await.unwrap();
    assert!(k.store.funding().delete_auto_top_up(&a, SYSTEM_ACTOR).await.unwrap());
    assert!(!k.store.funding().delete_auto_top_up(&a, SYSTEM_ACTOR).await.unwrap());
    k.job("j1", &a, 600).await;
    assert!(rule_top_ups(k, &a).await.is_empty());
}

async fn an_earlier_rules_dead_top_up_pauses_nothing(k: &Kit) {
    let a = k.account("a", 1_000).await;
    k.store.funding().put_auto_top_up(&a, rule(500, 300, 10_000), SYSTEM_ACTOR).await.unwrap();
    k.job("j1", &a, 600).await;
    assert_eq!(rule_top_ups(k, &a).await.len(), 1);
    // deleted and put anew (another card) while the first rule's top-up is still open
    k.store.funding().delete_auto_top_up(&a, SYSTEM_ACTOR).await.unwrap();
    let mut other = rule(500, 300, 10_000);
    other.customer = Customer::parse("cus_other").unwrap();
    k.store.funding().put_auto_top_up(&a, other.clone(), SYSTEM_ACTOR).await.unwrap();
    settle_one(k, false).await;
    assert_eq!(k.store.funding().auto_top_up(&a).await.unwrap().state, RuleState::Active);
    assert!(!k.event_types().await.iter().any(|e| e == "top_up.rule_paused"));
    // the same rule put again changes nothing
    let before = k.event_types().await.len();
    k.store.funding().put_auto_top_up(&a, other, SYSTEM_ACTOR).await.unwrap();
    assert_eq!(k.event_types().await.len(), before);
}

/// 60 creates race down through the rule's threshold, committed in shared batches: the balance
/// crosses it once, so exactly one top-up is made, whatever the batches' order.
async fn racing_creates_cross_the_rule_once(engine: EngineKind) {
    let k = std::sync::Arc::new(Kit::new(engine).await);
    let a = k.account("a", 1_000).await;
    k.store.funding().put_auto_top_up(&a, rule(500, 300, 10_000), SYSTEM_ACTOR).await.unwrap();
    let tasks: Vec<_> = (0..60)
        .map(|n| {
            let (k, a) = (k.clone(), a.clone());
            tokio::spawn(async move { k.store.create_job(new_job(&format!("j{n}"), &a, 15)).await })
        })
        .collect();
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(rule_top_ups(&k, &a).await.len(), 1);
    k.assert_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_racing_creates_cross_the_rule_once() {
    racing_creates_cross_the_rule_once(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_racing_creates_cross_the_rule_once() {
    racing_creates_cross_the_rule_once(EngineKind::Postgres).await;
}
