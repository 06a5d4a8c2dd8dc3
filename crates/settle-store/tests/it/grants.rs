//! Expiring grants (issue 24, docs/decisions/0023): burn-down across priorities and expiries,
//! refunds home to live and expired grants, releases of held items, reclaims after an expiry, debt
//! met by new grants, withdrawals from credit that never expires, the expiry pass once whatever
//! races it — on both engines, L1–L6 clean after each.

use crate::kit::*;
use settle_core::ids::{AccountId, Destination, RefId};
use settle_core::{Clock, Credits, Timestamp};
use settle_store::*;
use std::sync::Arc;

const MINUTE: i64 = 60_000_000;

async fn grant(k: &Kit, account: &AccountId, id: &str, amount: i64, priority: Option<i64>, expires_in: Option<i64>) {
    let expires_at = expires_in.map(|us| Timestamp::from_micros(k.clock.now().micros() + us));
    let req =
        NewGrant { id: RefId::parse(id).unwrap(), amount: Credits::new(amount), reason: None, expires_at, priority };
    k.store.grant(account, req, SYSTEM_ACTOR).await.unwrap();
}

async fn open_account(k: &Kit, id: &str, overdraft: i64) -> AccountId {
    let a = acc(id);
    let req = NewAccount { id: a.clone(), overdraft_limit: Credits::new(overdraft), max_running: None };
    k.store.create_account(req, SYSTEM_ACTOR).await.unwrap();
    a
}

/// `(id, remaining, state)` of every grant of the account, in the order they were made.
async fn left(k: &Kit, account: &AccountId) -> Vec<(String, i64, &'static str)> {
    let page = Page { after: 0, limit: 1000 };
    let grants = k.store.grants(account, page).await.unwrap().rows;
    grants.into_iter().map(|g| (g.id, g.remaining.get(), g.state.as_str())).collect()
}

fn row(id: &str, remaining: i64, state: &'static str) -> (String, i64, &'static str) {
    (id.to_owned(), remaining, state)
}

/// `(grant, item, taken, given back)` of a job's allocations, in the order they were taken.
async fn paid_by(k: &Kit, job: &str) -> Vec<(Option<String>, Option<String>, i64, i64)> {
    let parts = k.store.allocations(&jid(job)).await.unwrap();
    parts.into_iter().map(|p| (p.grant_id, p.item_id, p.taken.get(), p.given_back.get())).collect()
}

fn part(grant: Option<&str>, item: &str, taken: i64, back: i64) -> (Option<String>, Option<String>, i64, i64) {
    (grant.map(str::to_owned), Some(item.to_owned()), taken, back)
}

async fn burn_down_follows_priority_then_expiry_then_age(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "never", 100, None, None).await;
    grant(&k, &a, "promo", 50, Some(10), Some(60 * MINUTE)).await;
    grant(&k, &a, "later", 100, None, Some(120 * MINUTE)).await;
    grant(&k, &a, "sooner", 30, None, Some(60 * MINUTE)).await;
    k.items_job("j", &a, &[60, 60]).await;
    assert_eq!(
        paid_by(&k, "j").await,
        [
            part(Some("promo"), "i0", 50, 0),
            part(Some("sooner"), "i0", 10, 0),
            part(Some("sooner"), "i1", 20, 0),
            part(Some("later"), "i1", 40, 0),
        ]
    );
    assert_eq!(
        left(&k, &a).await,
        [row("never", 100, "active"), row("promo", 0, "used"), row("later", 60, "active"), row("sooner", 0, "used")]
    );
    // A failure refunds each part to the grant it came from.
    let t = k.claim_one("j").await;
    k.fail("j", &t, "BAD_INPUT").await;
    assert_eq!(
        left(&k, &a).await,
        [
            row("never", 100, "active"),
            row("promo", 50, "active"),
            row("later", 100, "active"),
            row("sooner", 30, "active")
        ]
    );
    assert!(paid_by(&k, "j").await.iter().all(|p| p.2 == p.3), "every part given back");
    assert_eq!(k.balance(&a).await, 280);
    k.assert_clean().await;
}

async fn a_refund_to_an_expired_grant_expires_at_once(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "trial", 100, Some(0), Some(MINUTE)).await;
    grant(&k, &a, "bought", 100, None, None).await;
    k.job("j", &a, 80).await;
    let t = k.claim_one("j").await;
    k.clock.advance_seconds(61);
    assert_eq!(k.store.expire_grants(100).await.unwrap(), vec!["a".to_owned()]);
    assert_eq!(k.balance(&a).await, 100, "the trial's unused 20 expired");
    // Twice: nothing more.
    assert!(k.store.expire_grants(100).await.unwrap().is_empty());
    k.fail("j", &t, "BAD_INPUT").await;
    assert_eq!(k.balance(&a).await, 100, "the refund lands on the expired trial and expires with it");
    let kinds = k.ledger_kinds(&a).await;
    assert_eq!(
        kinds.iter().map(|(k, n)| (k.as_str(), *n)).collect::<Vec<_>>(),
        [("grant", 100), ("grant", 100), ("charge", -80), ("expire", -20), ("refund", 80), ("expire", -80)]
    );
    assert_eq!(left(&k, &a).await, [row("trial", 0, "expired"), row("bought", 100, "active")]);
    let events = k.store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    let expired: Vec<serde_json::Value> = events
        .iter()
        .filter(|e| e.kind == settle_core::history::EventKind::GrantExpired)
        .map(|e| serde_json::from_str(&e.data).unwrap())
        .collect();
    assert_eq!(expired.len(), 2, "{expired:?}");
    assert_eq!((expired[0]["grant"].as_str(), expired[0]["amount"].as_i64()), (Some("trial"), Some(20)));
    assert_eq!((expired[1]["amount"].as_i64(), expired[1]["on_return"].as_bool()), (Some(80), Some(true)));
    k.assert_clean().await;
}

async fn the_clock_expires_before_a_charge_counts_the_balance(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "trial", 100, None, Some(MINUTE)).await;
    grant(&k, &a, "bought", 50, None, None).await;
    k.clock.advance_seconds(61);
    // No pass has run, but the trial is past its instant: it does not pay.
    let e = k.store.create_job(new_job("big", &a, 120)).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientCredits { .. }), "{e:?}");
    k.job("small", &a, 40).await;
    assert_eq!(paid_by(&k, "small").await, [part(Some("bought"), "main", 40, 0)]);
    assert_eq!(k.balance(&a).await, 10, "the charge expired the trial first");
    assert_eq!(left(&k, &a).await, [row("trial", 0, "expired"), row("bought", 10, "active")]);
    assert!(k.store.expire_grants(100).await.unwrap().is_empty(), "nothing left for the pass");
    k.assert_clean().await;
}

async fn a_reclaim_after_an_expiry_takes_in_the_current_order(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "trial", 100, None, Some(MINUTE)).await;
    grant(&k, &a, "bought", 100, None, None).await;
    k.job("j", &a, 80).await;
    let t = k.claim_one("j").await;
    k.fail("j", &t, "TIMEOUT").await;
    assert_eq!(left(&k, &a).await, [row("trial", 100, "active"), row("bought", 100, "active")]);
    k.clock.advance_seconds(61);
    // The late success reclaims: the trial expires first, so the bought credit pays.
    assert!(k.store.succeed(&jid("j"), Reporter::of(Some(&t)), None).await.unwrap().applied);
    assert_eq!(k.balance(&a).await, 20);
    assert_eq!(left(&k, &a).await, [row("trial", 0, "expired"), row("bought", 20, "active")]);
    k.assert_clean().await;
}

async fn a_release_gives_back_the_last_taken_first(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "promo", 100, Some(0), None).await;
    grant(&k, &a, "bought", 100, None, None).await;
    k.store.create_job(held_job("h", &a, &[150])).await.unwrap();
    assert_eq!(paid_by(&k, "h").await, [part(Some("promo"), "i0", 100, 0), part(Some("bought"), "i0", 50, 0)]);
    let t = k.claim_one("h").await;
    let costs = Costs([(iid("i0"), Credits::new(30))].into_iter().collect());
    k.store.succeed_priced(&jid("h"), Reporter::of(Some(&t)), None, &costs).await.unwrap();
    // What charging 30 alone would have taken: 30 of the promo.
    assert_eq!(left(&k, &a).await, [row("promo", 70, "active"), row("bought", 100, "active")]);
    assert_eq!(k.balance(&a).await, 170);
    k.assert_clean().await;
}

async fn debt_is_paid_by_the_next_grant_and_given_back_to_it(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 100).await;
    k.job("j", &a, 60).await;
    assert_eq!(paid_by(&k, "j").await, [part(None, "main", 60, 0)], "the overdraft: debt");
    assert_eq!(k.balance(&a).await, -60);
    grant(&k, &a, "g", 100, None, None).await;
    assert_eq!(left(&k, &a).await, [row("g", 40, "active")], "the grant paid the debt first");
    assert_eq!(k.balance(&a).await, 40);
    k.assert_clean().await;
    // The charge the debt came from is refunded: the grant gets back what it paid.
    let t = k.claim_one("j").await;
    k.fail("j", &t, "BAD_INPUT").await;
    assert_eq!(left(&k, &a).await, [row("g", 100, "active")]);
    assert_eq!(k.balance(&a).await, 100);
    k.assert_clean().await;
}

/// Each debt part names what paid it: a refund of the first debt gives back the grant that paid
/// that debt, not the newest one (which has expired meanwhile).
async fn a_debt_refund_goes_back_to_the_grant_that_paid_it(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 200).await;
    k.job("first", &a, 100).await;
    grant(&k, &a, "lasting", 100, None, None).await;
    k.job("second", &a, 100).await;
    grant(&k, &a, "promo", 100, None, Some(MINUTE)).await;
    assert_eq!(k.balance(&a).await, 0);
    k.clock.advance_seconds(61);
    k.store.expire_grants(100).await.unwrap();
    let t = k.claim_one("first").await;
    k.fail("first", &t, "BAD_INPUT").await;
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(left(&k, &a).await, [row("lasting", 100, "active"), row("promo", 0, "expired")]);
    k.assert_clean().await;
    // The second debt's refund goes to the promo, which expired: it expires at once.
    let t = k.claim_one("second").await;
    k.fail("second", &t, "BAD_INPUT").await;
    assert_eq!(k.balance(&a).await, 100);
    k.assert_clean().await;
}

async fn a_refund_part_of_it_still_owed_lowers_the_debt(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 100).await;
    k.job("j", &a, 80).await;
    grant(&k, &a, "g", 30, None, None).await;
    assert_eq!(k.balance(&a).await, -50);
    let t = k.claim_one("j").await;
    k.fail("j", &t, "BAD_INPUT").await;
    // 50 of the refund forgives what was still owed, 30 goes back to the grant that paid.
    assert_eq!(k.balance(&a).await, 30);
    assert_eq!(left(&k, &a).await, [row("g", 30, "active")]);
    k.assert_clean().await;
}

async fn withdrawals_draw_only_on_credit_that_never_expires(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "trial", 100, Some(0), Some(60 * MINUTE)).await;
    grant(&k, &a, "bought", 50, None, None).await;
    let wd = |id: &str, amount: i64| NewWithdrawal {
        id: jid(id),
        account_id: a.clone(),
        amount: Credits::new(amount),
        destination: Destination::parse("acct-1").unwrap(),
    };
    let e = k.store.payouts().create_withdrawal(wd("w1", 80)).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientCash { available: 50, needed: 80 }), "{e:?}");
    assert_eq!(k.balance(&a).await, 150, "nothing written");
    k.store.payouts().create_withdrawal(wd("w2", 50)).await.unwrap();
    assert_eq!(paid_by(&k, "w2").await, [part(Some("bought"), "main", 50, 0)]);
    assert_eq!(left(&k, &a).await, [row("trial", 100, "active"), row("bought", 0, "used")]);
    k.assert_clean().await;
}

/// The cash rule (issue 41, semantics §1): cash 100, a trial of 50 and a debt of 50 on the overdraft
/// (for work delivered) make a balance of 100 — but only 50 of it is cash. A withdrawal of 100 would
/// leave the debt to be covered by the trial, which expires: the overdraft gone as cash.
async fn a_withdrawal_never_leaves_the_overdraft_as_cash(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 50).await;
    grant(&k, &a, "cash", 100, None, None).await;
    grant(&k, &a, "trial", 50, Some(90), Some(60 * MINUTE)).await;
    k.job("paid-by-cash", &a, 100).await;
    k.job("paid-by-trial", &a, 50).await;
    k.job("on-the-overdraft", &a, 50).await;
    let claimed = k.store.claim(claim_req("w1", 3)).await.unwrap();
    let delivered = claimed.iter().find(|c| c.job.id == "on-the-overdraft").unwrap();
    k.store.succeed(&jid("on-the-overdraft"), Reporter::of(Some(&delivered.lease_token)), None).await.unwrap();
    for job in ["paid-by-cash", "paid-by-trial"] {
        let c = claimed.iter().find(|c| c.job.id == job).unwrap();
        k.fail(job, &c.lease_token, "BAD_INPUT").await;
    }
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(left(&k, &a).await, [row("cash", 100, "active"), row("trial", 50, "active")]);
    let wd = |id: &str, amount: i64| NewWithdrawal {
        id: jid(id),
        account_id: a.clone(),
        amount: Credits::new(amount),
        destination: Destination::parse("acct-1").unwrap(),
    };
    let e = k.store.payouts().create_withdrawal(wd("w-all", 100)).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientCash { available: 50, needed: 100 }), "{e:?}");
    let e = k.store.payouts().create_withdrawal(wd("w-51", 51)).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientCash { available: 50, needed: 51 }), "{e:?}");
    assert_eq!(k.balance(&a).await, 100, "nothing written");
    assert!(k.store.job(&jid("w-all")).await.is_err(), "no withdrawal job was made");
    k.store.payouts().create_withdrawal(wd("w-50", 50)).await.unwrap();
    assert_eq!(left(&k, &a).await, [row("cash", 50, "active"), row("trial", 50, "active")]);
    k.assert_clean().await;
    // The trial expires: the balance is 0 — what is left of the cash pays exactly the debt.
    k.clock.advance_seconds(61 * 60);
    k.store.expire_grants(100).await.unwrap();
    assert_eq!(k.balance(&a).await, 0);
    k.assert_clean().await;
}

/// L6: a withdrawal whose recorded figures break the cash rule is reported by the audit.
async fn the_audit_reports_a_withdrawal_that_left_the_overdraft_as_cash(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "cash", 100, None, None).await;
    let wd = NewWithdrawal {
        id: jid("w"),
        account_id: a.clone(),
        amount: Credits::new(40),
        destination: Destination::parse("acct-1").unwrap(),
    };
    k.store.payouts().create_withdrawal(wd).await.unwrap();
    k.assert_clean().await;
    k.raw("UPDATE withdrawals SET debt_after = 61").await.unwrap();
    let report = k.store.audit(None).await.unwrap();
    let found: Vec<_> = report.violations.iter().map(|v| (v.invariant.as_str(), v.job_id.clone())).collect();
    assert_eq!(found, [("L6", Some("w".to_owned()))], "{:#?}", report.violations);
}

/// A dead withdrawal's late execution takes its amount back from credit that never expires — never
/// from a trial, which would turn promotional credit into cash — and goes into debt for the rest.
async fn a_late_payout_reclaims_from_credit_that_never_expires(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "bought", 100, None, None).await;
    let wd = NewWithdrawal {
        id: jid("w"),
        account_id: a.clone(),
        amount: Credits::new(100),
        destination: Destination::parse("acct-1").unwrap(),
    };
    k.store.payouts().create_withdrawal(wd).await.unwrap();
    let worker = settle_core::ids::WorkerName::parse("p").unwrap();
    let claimed = k.store.payouts().claim_payouts(&worker, 10).await.unwrap();
    k.store.payouts().payout_failed(&jid("w"), fail_sig(&claimed[0].lease_token, "INVALID_ADDRESS")).await.unwrap();
    assert_eq!(left(&k, &a).await, [row("bought", 100, "active")], "the dead withdrawal refunded home");
    grant(&k, &a, "trial", 100, Some(0), Some(60 * MINUTE)).await;
    // The provider executed it after all: 100 left as cash, taken from what was bought.
    k.store.payouts().payout_succeeded(&jid("w"), None, "tx-late", false).await.unwrap();
    assert_eq!(left(&k, &a).await, [row("bought", 0, "used"), row("trial", 100, "active")]);
    assert_eq!(paid_by(&k, "w").await.last().map(|p| p.0.clone()), Some(Some("bought".to_owned())));
    k.assert_clean().await;
}

async fn grant_terms_are_checked_and_replay(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = open_account(&k, "a", 0).await;
    let at = |us: i64| Some(Timestamp::from_micros(k.clock.now().micros() + us));
    let req = |expires_at, priority| NewGrant {
        id: RefId::parse("g").unwrap(),
        amount: Credits::new(10),
        reason: None,
        expires_at,
        priority,
    };
    for (expires_at, priority) in [(at(0), None), (at(-1), None), (None, Some(101)), (None, Some(-1))] {
        let e = k.store.grant(&a, req(expires_at, priority), SYSTEM_ACTOR).await.unwrap_err();
        assert!(matches!(e, StoreError::Invalid(_)), "{e:?}");
    }
    assert!(left(&k, &a).await.is_empty(), "nothing written");
    let first = k.store.grant(&a, req(at(MINUTE), Some(5)), SYSTEM_ACTOR).await.unwrap();
    assert!(!first.replayed);
    let again = k.store.grant(&a, req(at(MINUTE), Some(5)), SYSTEM_ACTOR).await.unwrap();
    assert!(again.replayed);
    for (expires_at, priority) in [(at(2 * MINUTE), Some(5)), (at(MINUTE), Some(6)), (None, Some(5))] {
        let e = k.store.grant(&a, req(expires_at, priority), SYSTEM_ACTOR).await.unwrap_err();
        assert!(matches!(e, StoreError::IdempotencyConflict { .. }), "{e:?}");
    }
    // A grant's replay after its expiry still answers.
    k.clock.advance_seconds(120);
    assert!(k.store.grant(&a, req(at(-MINUTE), Some(5)), SYSTEM_ACTOR).await.unwrap().replayed);
    // An explicit default priority is the same request as none.
    let plain = NewGrant { id: RefId::parse("p").unwrap(), ..req(None, None) };
    k.store.grant(&a, plain.clone(), SYSTEM_ACTOR).await.unwrap();
    assert!(k.store.grant(&a, NewGrant { priority: Some(50), ..plain }, SYSTEM_ACTOR).await.unwrap().replayed);
    k.assert_clean().await;
}

/// Two expiry passes at once, across the instant, with charges racing them: one `expire` entry
/// per grant, every credit accounted once.
async fn the_expiry_pass_twice_at_once_expires_once(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = open_account(&k, "a", 0).await;
    for i in 0..5 {
        grant(&k, &a, &format!("t{i}"), 100, None, Some(MINUTE)).await;
    }
    grant(&k, &a, "bought", 1_000, None, None).await;
    k.clock.advance_seconds(61);
    let passes: Vec<_> = (0..2)
        .map(|_| {
            let k = k.clone();
            tokio::spawn(async move { k.store.expire_grants(100).await.unwrap() })
        })
        .collect();
    let mut accounts = 0;
    for p in passes {
        accounts += p.await.unwrap().len();
    }
    assert_eq!(accounts, 1, "one pass expired the account's grants, the other found nothing due");
    let expires = k.ledger_kinds(&a).await.into_iter().filter(|(kind, _)| kind == "expire").count();
    assert_eq!(expires, 5);
    assert_eq!(k.balance(&a).await, 1_000);
    k.assert_clean().await;
}

/// 200 charges racing the instant their grant expires at: those that ran before it took from the
/// trial, the rest from what never expires; every credit is accounted once.
async fn charges_race_the_expiry_instant(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "trial", 150, Some(0), Some(MINUTE)).await;
    grant(&k, &a, "bought", 1_000, None, None).await;
    k.clock.advance_seconds(59);
    let mut tasks = Vec::new();
    for i in 0..200 {
        let k = k.clone();
        let a = a.clone();
        tasks.push(tokio::spawn(async move {
            if i == 100 {
                k.clock.advance_seconds(2);
            }
            if i % 50 == 0 {
                k.store.expire_grants(100).await.unwrap();
            }
            k.store.create_job(new_job(&format!("j{i}"), &a, 5)).await.map(|_| ())
        }));
    }
    let mut made = 0;
    for t in tasks {
        if t.await.unwrap().is_ok() {
            made += 1;
        }
    }
    k.store.expire_grants(100).await.unwrap();
    let grants = left(&k, &a).await;
    assert_eq!(grants[0].2, "expired");
    let trial_paid: i64 = {
        let mut sum = 0;
        for i in 0..200 {
            if let Ok(parts) = k.store.allocations(&jid(&format!("j{i}"))).await {
                sum +=
                    parts.iter().filter(|p| p.grant_id.as_deref() == Some("trial")).map(|p| p.taken.get()).sum::<i64>();
            }
        }
        sum
    };
    assert!(trial_paid <= 150);
    assert_eq!(k.balance(&a).await, 1_150 - 5 * made - (150 - trial_paid), "made {made}, trial paid {trial_paid}");
    k.assert_clean().await;
}

/// The cash rule under races (issue 41): withdrawals, charges and cancels (refunds) from two stores
/// on one database (two processes on PostgreSQL), across the trial's instant and expiry passes.
/// Every withdrawal accepted must have left never-expiring credit covering the debt (L6), and the
/// books must balance.
async fn the_cash_rule_holds_under_races(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = open_account(&k, "a", 100).await;
    grant(&k, &a, "cash", 300, None, None).await;
    grant(&k, &a, "trial", 200, Some(90), Some(MINUTE)).await;
    k.clock.advance_seconds(59);
    // A second process on PostgreSQL; SQLite's single file has one writer (the same store).
    let second = match engine {
        EngineKind::Postgres => {
            let options = StoreOptions { clock: k.clock.clone(), ..StoreOptions::default() };
            Some(Arc::new(SqlStore::open(&k.url, options).await.unwrap()))
        }
        EngineKind::Sqlite => None,
    };
    // 16 in flight: every one of them waits on the one account row, each holding a connection.
    let slots = Arc::new(tokio::sync::Semaphore::new(16));
    let mut tasks = Vec::new();
    for i in 0..160_i64 {
        let (k, a, second) = (k.clone(), a.clone(), second.clone());
        let slot = slots.clone().acquire_owned().await.unwrap();
        tasks.push(tokio::spawn(async move {
            let _slot = slot;
            let store: &SqlStore = match (&second, i % 2) {
                (Some(s), 1) => s,
                _ => &k.store,
            };
            if i == 80 {
                k.clock.advance_seconds(2);
            }
            if i % 40 == 0 {
                store.expire_grants(100).await.unwrap();
            }
            match i % 4 {
                0 => {
                    let wd = NewWithdrawal {
                        id: jid(&format!("w{i}")),
                        account_id: a.clone(),
                        amount: Credits::new(1 + i % 40),
                        destination: Destination::parse("acct-1").unwrap(),
                    };
                    match store.payouts().create_withdrawal(wd).await {
                        Ok(_) => "withdrawn",
                        Err(StoreError::InsufficientCash { .. } | StoreError::InsufficientBalance { .. }) => "refused",
                        Err(e) => panic!("withdrawal: {e}"),
                    }
                }
                n => {
                    let id = format!("j{i}");
                    match store.create_job(new_job(&id, &a, 1 + i % 20)).await {
                        Ok(_) if n == 1 => {
                            store.cancel(&jid(&id), None).await.unwrap();
                            "refunded"
                        }
                        Ok(_) => "charged",
                        Err(StoreError::InsufficientCredits { .. }) => "refused",
                        Err(e) => panic!("charge: {e}"),
                    }
                }
            }
        }));
    }
    let mut seen = std::collections::BTreeMap::new();
    for t in tasks {
        *seen.entry(t.await.unwrap()).or_insert(0) += 1;
    }
    k.store.expire_grants(100).await.unwrap();
    assert!(
        seen.get("withdrawn").copied().unwrap_or(0) > 0 && seen.get("refused").copied().unwrap_or(0) > 0,
        "{seen:?}"
    );
    k.assert_clean().await;
}

/// 50 refunds racing the instant their grant expires at, and expiry passes among them: each refund
/// lands on the live trial (which then expires with it) or on the expired one (expiring at once), so
/// the account ends with exactly what it bought, and every credit is accounted once.
async fn refunds_race_the_expiry(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "trial", 500, Some(0), Some(MINUTE)).await;
    grant(&k, &a, "bought", 300, None, None).await;
    for i in 0..50 {
        k.job(&format!("j{i}"), &a, 10).await;
    }
    let claimed = k.store.claim(claim_req("w", 100)).await.unwrap();
    assert_eq!(claimed.len(), 50);
    k.clock.advance_seconds(59);
    let mut tasks = Vec::new();
    for (i, c) in claimed.into_iter().enumerate() {
        let k = k.clone();
        tasks.push(tokio::spawn(async move {
            if i == 25 {
                k.clock.advance_seconds(2);
            }
            if i % 10 == 0 {
                k.store.expire_grants(100).await.unwrap();
            }
            k.store.fail(&c.job.id, fail_sig(&c.lease_token, "BAD_INPUT")).await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    k.store.expire_grants(100).await.unwrap();
    assert_eq!(k.balance(&a).await, 300, "the trial is gone, refunds and all; the bought credit is whole");
    assert_eq!(left(&k, &a).await, [row("trial", 0, "expired"), row("bought", 300, "active")]);
    k.assert_clean().await;
}

/// Two processes on one PostgreSQL: one refunds (on its lanes) while the other grants and runs the
/// expiry pass, all just after a trial's instant. Every refund and grant goes through — a posting
/// that missed because a grant was due never reports the miss as an overflow or a refusal once
/// another process has expired the grant (the miss is judged on the locked row).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_two_processes_race_refunds_and_grants_across_the_instant() {
    let k = Arc::new(Kit::new(EngineKind::Postgres).await);
    let a = open_account(&k, "a", 0).await;
    grant(&k, &a, "trial", 1_000, Some(0), Some(MINUTE)).await;
    for i in 0..40 {
        k.job(&format!("j{i}"), &a, 10).await;
    }
    let claimed = k.store.claim(claim_req("w", 100)).await.unwrap();
    let options = StoreOptions { clock: k.clock.clone(), policy: test_policy().into(), ..StoreOptions::default() };
    let other = Arc::new(SqlStore::open(&k.url, options).await.unwrap());
    k.clock.advance_seconds(61);
    let mut tasks = Vec::new();
    for c in claimed {
        let other = other.clone();
        tasks.push(tokio::spawn(async move {
            other.fail(&c.job.id, fail_sig(&c.lease_token, "BAD_INPUT")).await.map(drop)
        }));
    }
    for i in 0..10 {
        let (k, a) = (k.clone(), a.clone());
        tasks.push(tokio::spawn(async move {
            if i % 3 == 0 {
                k.store.expire_grants(100).await?;
            }
            let g = NewGrant {
                id: RefId::parse(&format!("g{i}")).unwrap(),
                amount: Credits::new(7),
                reason: None,
                expires_at: None,
                priority: None,
            };
            k.store.grant(&a, g, SYSTEM_ACTOR).await.map(drop)
        }));
    }
    for t in tasks {
        t.await.unwrap().unwrap();
    }
    assert_eq!(k.balance(&a).await, 70, "the trial expired with its refunds; the ten grants stay");
    k.assert_clean().await;
}

both_engines!(
    burn_down_follows_priority_then_expiry_then_age,
    a_refund_to_an_expired_grant_expires_at_once,
    the_clock_expires_before_a_charge_counts_the_balance,
    a_reclaim_after_an_expiry_takes_in_the_current_order,
    a_release_gives_back_the_last_taken_first,
    debt_is_paid_by_the_next_grant_and_given_back_to_it,
    a_debt_refund_goes_back_to_the_grant_that_paid_it,
    a_refund_part_of_it_still_owed_lowers_the_debt,
    withdrawals_draw_only_on_credit_that_never_expires,
    a_withdrawal_never_leaves_the_overdraft_as_cash,
    the_audit_reports_a_withdrawal_that_left_the_overdraft_as_cash,
    a_late_payout_reclaims_from_credit_that_never_expires,
    grant_terms_are_checked_and_replay,
    the_expiry_pass_twice_at_once_expires_once,
    charges_race_the_expiry_instant,
    refunds_race_the_expiry,
    the_cash_rule_holds_under_races,
);
