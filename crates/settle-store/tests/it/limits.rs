//! Spend limits (issue 45, spec §4a, docs/design/money-controls.md §3): checked before a create's
//! charge is written — a create past a period's limit is `spend_limit_exceeded` and writes nothing
//! (the caps that overshoot after the work ran: a $5 cap charged $12.52) — counted by every posting
//! (refunds give back, reclaims count and are never refused), per UTC day and month of the injected
//! clock, per kind; racing creates never pass a limit, in one store's batches and across two stores
//! on PostgreSQL; a limit put mid-period starts from the ledger; bad sets write nothing.

use crate::kit::*;
use settle_core::Timestamp;
use settle_core::scope::Scope;
use settle_core::spend::Period;
use settle_store::*;
use std::sync::Arc;

const DAY: u64 = 24 * 3_600;

fn limit(period: Period, amount: i64, kinds: &[&str]) -> NewLimit {
    NewLimit { period, amount, kinds: kinds.iter().map(|k| (*k).to_owned()).collect() }
}

fn kind_job(id: &str, account: &settle_core::ids::AccountId, kind: &str, cost: i64) -> NewJob {
    NewJob { kind: settle_core::ids::JobKind::parse(kind).unwrap(), ..new_job(id, account, cost) }
}

/// The refusal, whole.
fn exceeded(r: Result<Created<Job>, StoreError>) -> LimitExceeded {
    match r {
        Err(StoreError::SpendLimitExceeded { exceeded }) => *exceeded,
        other => panic!("expected spend_limit_exceeded, got {other:?}"),
    }
}

/// How many of racing creates passed; every other must have been refused by a limit.
async fn passed(tasks: Vec<tokio::task::JoinHandle<Result<Created<Job>, StoreError>>>) -> usize {
    let mut created = 0;
    for t in tasks {
        match t.await.unwrap() {
            Ok(_) => created += 1,
            Err(StoreError::SpendLimitExceeded { .. }) => {}
            Err(e) => panic!("create: {e}"),
        }
    }
    created
}

async fn spent(k: &Kit, account: &settle_core::ids::AccountId) -> Vec<i64> {
    k.store.limits(account).await.unwrap().iter().map(|l| l.spent).collect()
}

async fn a_create_past_the_limit_is_refused_and_writes_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 10_000).await;
    let stored = k.store.set_limits(&a, vec![limit(Period::Day, 100, &[])], SYSTEM_ACTOR).await.unwrap();
    assert_eq!(stored.len(), 1);
    assert_eq!((stored[0].spent, stored[0].resets_at), (0, Timestamp::from_micros(T0 + DAY as i64 * 1_000_000)));
    k.job("j1", &a, 40).await;
    k.job("j2", &a, 40).await;
    assert_eq!(spent(&k, &a).await, [80]);
    let (balance, entries, events) = (
        k.balance(&a).await,
        k.ledger_kinds(&a).await.len(),
        k.store.events(0, 1_000, &Scope::ALL).await.unwrap().rows.len(),
    );
    let refused = exceeded(k.store.create_job(new_job("j3", &a, 30)).await);
    assert_eq!(
        refused,
        LimitExceeded { period: Period::Day, amount: 100, kinds: vec![], spent: 80, remaining: 20, needed: 30 }
    );
    // Nothing written: no job, no line, no event, the balance and the limit as they were.
    assert!(matches!(k.store.job(&jid("j3")).await, Err(StoreError::NotFound { .. })));
    assert_eq!(k.balance(&a).await, balance);
    assert_eq!(k.ledger_kinds(&a).await.len(), entries);
    assert_eq!(k.store.events(0, 1_000, &Scope::ALL).await.unwrap().rows.len(), events);
    assert_eq!(spent(&k, &a).await, [80]);
    // Exactly up to the limit passes; a free job always does.
    k.job("j3", &a, 20).await;
    k.job("free", &a, 0).await;
    exceeded(k.store.create_job(new_job("j4", &a, 1)).await);
    // The next UTC day starts again.
    k.clock.advance_seconds(DAY);
    k.job("j4", &a, 100).await;
    let limits = k.store.limits(&a).await.unwrap();
    assert_eq!((limits[0].spent, limits[0].resets_at), (100, Timestamp::from_micros(T0 + 2 * DAY as i64 * 1_000_000)));
    k.assert_clean().await;
}

/// A failure's refund gives its spend back, so the room comes back; the late success's reclaim is
/// never refused and counts, even past the limit; after it, creates are refused.
async fn refunds_give_back_and_reclaims_count(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 10_000).await;
    k.store.set_limits(&a, vec![limit(Period::Day, 100, &[])], SYSTEM_ACTOR).await.unwrap();
    k.job("j", &a, 100).await;
    let token = k.claim_one("j").await;
    k.fail("j", &token, "TIMEOUT").await;
    assert_eq!(spent(&k, &a).await, [0], "the failure refunded");
    k.job("j2", &a, 100).await;
    k.store.succeed(&jid("j"), Reporter::of(Some(&token)), None).await.unwrap();
    assert_eq!(spent(&k, &a).await, [200], "the reclaim counts, past the limit");
    let refused = exceeded(k.store.create_job(new_job("j3", &a, 1)).await);
    assert_eq!((refused.spent, refused.remaining), (200, 0));
    k.assert_clean().await;
}

/// A limit naming kinds counts only them; one naming none counts every kind but withdrawals,
/// which count only where named. Day and month limits both hold.
async fn limits_count_their_kinds_and_periods(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 10_000).await;
    let limits = vec![
        limit(Period::Day, 50, &["render"]),
        limit(Period::Month, 700, &[]),
        limit(Period::Day, 10, &["withdrawal"]),
    ];
    k.store.set_limits(&a, limits, SYSTEM_ACTOR).await.unwrap();
    k.store.create_job(kind_job("r1", &a, "render", 50)).await.unwrap();
    let refused = exceeded(k.store.create_job(kind_job("r2", &a, "render", 1)).await);
    assert_eq!(refused.kinds, ["render"]);
    k.store.create_job(kind_job("t1", &a, "transcribe", 600)).await.unwrap();
    assert_eq!(spent(&k, &a).await, [50, 650, 0]);
    let refused = exceeded(k.store.create_job(kind_job("t2", &a, "transcribe", 51)).await);
    assert_eq!((refused.period, refused.remaining), (Period::Month, 50));
    // Withdrawals: only the limit naming them.
    let w = |id: &str, amount| NewWithdrawal {
        id: settle_core::ids::JobId::parse(id).unwrap(),
        account_id: a.clone(),
        amount: settle_core::Credits::new(amount),
        destination: settle_core::ids::Destination::parse("acct-1").unwrap(),
    };
    let r = k.store.payouts().create_withdrawal(w("w1", 11)).await;
    assert!(matches!(r, Err(StoreError::SpendLimitExceeded { .. })), "{r:?}");
    assert!(matches!(k.store.job(&jid("w1")).await, Err(StoreError::NotFound { .. })), "nothing written");
    k.store.payouts().create_withdrawal(w("w1", 10)).await.unwrap();
    assert_eq!(spent(&k, &a).await, [50, 650, 10]);
    // A new day: the day limits start again, the month's does not.
    k.clock.advance_seconds(DAY);
    k.store.create_job(kind_job("r2", &a, "render", 50)).await.unwrap();
    assert_eq!(spent(&k, &a).await, [50, 700, 0]);
    k.assert_clean().await;
}

/// A limit put mid-period starts from what the period's ledger says was spent — yesterday's
/// charges not in a day limit, this month's in a month limit — and a refund given back today of
/// yesterday's charge makes today's spend negative: the day may spend it again.
async fn a_limit_put_mid_period_starts_from_the_ledger(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 10_000).await;
    k.job("old", &a, 300).await;
    k.clock.advance_seconds(DAY);
    k.job("j1", &a, 70).await;
    k.job("j2", &a, 40).await;
    let token = k.claim_one("old").await;
    k.fail("old", &token, "TIMEOUT").await;
    let limits = vec![limit(Period::Day, 100, &[]), limit(Period::Month, 1_000, &[])];
    let stored = k.store.set_limits(&a, limits, SYSTEM_ACTOR).await.unwrap();
    assert_eq!(stored.iter().map(|l| l.spent).collect::<Vec<_>>(), [-190, 110]);
    let refused = exceeded(k.store.create_job(new_job("j3", &a, 291)).await);
    assert_eq!((refused.spent, refused.remaining), (-190, 290));
    k.job("j3", &a, 290).await;
    // Putting the same set again changes nothing; an empty set removes them all.
    let again = k.store.set_limits(&a, stored.iter().map(|l| limit(l.period, l.amount, &[])).collect(), SYSTEM_ACTOR);
    assert_eq!(again.await.unwrap().iter().map(|l| l.spent).collect::<Vec<_>>(), [100, 400]);
    assert!(k.store.set_limits(&a, Vec::new(), SYSTEM_ACTOR).await.unwrap().is_empty());
    k.job("big", &a, 5_000).await;
    k.assert_clean().await;
}

/// 200 creates race on one account with a day limit of 500, each charging 7, committed in shared
/// batches: exactly ⌊500/7⌋ = 71 pass, the rest are refused, and the feed has no gap.
async fn racing_creates_never_pass_a_limit(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = k.account("a", 100_000).await;
    k.store.set_limits(&a, vec![limit(Period::Day, 500, &[])], SYSTEM_ACTOR).await.unwrap();
    let before = k.store.events(0, 10_000, &Scope::ALL).await.unwrap().rows.len() as i64;
    let tasks: Vec<_> = (0..200)
        .map(|n| {
            let (k, a) = (k.clone(), a.clone());
            tokio::spawn(async move { k.store.create_job(new_job(&format!("j{n}"), &a, 7)).await })
        })
        .collect();
    let created = passed(tasks).await;
    assert_eq!(created, 71);
    assert_eq!(spent(&k, &a).await, [497]);
    let events = k.store.events(before, 10_000, &Scope::ALL).await.unwrap().rows;
    assert_eq!(events.iter().map(|e| e.seq).collect::<Vec<_>>(), (before + 1..=before + 71).collect::<Vec<_>>());
    k.assert_clean().await;
}

async fn bad_limits_write_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.set_limits(&a, vec![limit(Period::Day, 500, &[])], SYSTEM_ACTOR).await.unwrap();
    let many_kinds: Vec<String> = (0..17).map(|n| format!("k{n}")).collect();
    let many_kinds: Vec<&str> = many_kinds.iter().map(String::as_str).collect();
    for bad in [
        vec![limit(Period::Day, 0, &[])],
        vec![limit(Period::Day, -5, &[])],
        vec![limit(Period::Month, (1 << 61) + 1, &[])],
        vec![limit(Period::Day, 5, &["render", "render"])],
        vec![limit(Period::Day, 5, &["has space"])],
        vec![limit(Period::Day, 5, &many_kinds)],
        (0..17).map(|n| limit(Period::Day, 10 + n, &[])).collect(),
    ] {
        let r = k.store.set_limits(&a, bad.clone(), SYSTEM_ACTOR).await;
        assert!(matches!(r, Err(StoreError::Invalid(_))), "{bad:?}: {r:?}");
    }
    let r = k.store.set_limits(&acc("nobody"), vec![limit(Period::Day, 5, &[])], SYSTEM_ACTOR).await;
    assert!(matches!(r, Err(StoreError::NotFound { .. })), "{r:?}");
    assert!(matches!(k.store.limits(&acc("nobody")).await, Err(StoreError::NotFound { .. })));
    let stored = k.store.limits(&a).await.unwrap();
    assert_eq!((stored.len(), stored[0].amount), (1, 500), "the set is as it was");
    k.assert_clean().await;
}

both_engines!(
    a_create_past_the_limit_is_refused_and_writes_nothing,
    refunds_give_back_and_reclaims_count,
    limits_count_their_kinds_and_periods,
    a_limit_put_mid_period_starts_from_the_ledger,
    racing_creates_never_pass_a_limit,
    bad_limits_write_nothing,
);

/// Creates in two stores (two processes' worth: separate pools, lanes and batches) race on one
/// account's limit on PostgreSQL: exactly what the limit allows passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_creates_in_two_stores_never_pass_a_limit() {
    let k = Kit::new(EngineKind::Postgres).await;
    let options = || StoreOptions { clock: k.clock.clone(), ..StoreOptions::default() };
    let stores = [
        Arc::new(SqlStore::open(&k.url, options()).await.unwrap()),
        Arc::new(SqlStore::open(&k.url, options()).await.unwrap()),
    ];
    let a = k.account("a", 100_000).await;
    k.store.set_limits(&a, vec![limit(Period::Day, 1_000, &[])], SYSTEM_ACTOR).await.unwrap();
    let tasks: Vec<_> = (0..200)
        .map(|n| {
            let (store, a) = (stores[n % 2].clone(), a.clone());
            tokio::spawn(async move { store.create_job(new_job(&format!("j{n}"), &a, 13)).await })
        })
        .collect();
    let created = passed(tasks).await;
    assert_eq!(created, 76, "⌊1000/13⌋");
    assert_eq!(spent(&k, &a).await, [988]);
    k.assert_clean().await;
}
