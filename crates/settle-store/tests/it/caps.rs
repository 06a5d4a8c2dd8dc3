//! Caps (issue 44, semantics §3a, docs/design/fair-claims.md §9–§10): an account's and a kind's
//! `max_running` — never passed by a claim, on both engines; a lowered or added cap stops new
//! claims until the scope is below it; parked work comes back when a slot frees; claimers racing in
//! two stores on one PostgreSQL never pass a cap, a cap lowered mid-claim included.

use crate::kit::*;
use settle_core::Credits;
use settle_core::ids::AccountId;
use settle_core::job::{JobState, RetryPolicy};
use settle_store::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

async fn capped(k: &Kit, id: &str, cap: Option<i64>) -> AccountId {
    let a = acc(id);
    let new = NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: cap };
    k.store.create_account(new, SYSTEM_ACTOR).await.unwrap();
    let grant = NewGrant {
        id: settle_core::ids::RefId::parse(&format!("g-{id}")).unwrap(),
        amount: Credits::new(1_000_000),
        reason: None,
        expires_at: None,
        priority: None,
    };
    k.store.grant(&a, grant, SYSTEM_ACTOR).await.unwrap();
    a
}

async fn set_cap(k: &Kit, a: &AccountId, cap: Option<i64>) -> Account {
    let changes = AccountChanges { overdraft_limit: None, max_running: Some(cap) };
    k.store.update_account(a, changes, SYSTEM_ACTOR).await.unwrap()
}

/// Claims up to `n` jobs; the claimed ones.
async fn claim(k: &Kit, n: u32) -> Vec<ClaimedJob> {
    k.store.claim(claim_req("w", n)).await.unwrap()
}

async fn running_of(store: &SqlStore, a: &AccountId) -> usize {
    let q = JobFilter { state: Some(JobState::Running), account_id: Some(a.clone()), ..JobFilter::ALL };
    store.jobs(&q, Page { after: 0, limit: 1_000 }).await.unwrap().rows.len()
}

async fn finish(k: &Kit, c: &ClaimedJob) {
    k.store.succeed(&c.job.id, Reporter::of(Some(&c.lease_token)), None).await.unwrap();
}

/// Past the claims' line-up pace (100 ms), so the next claim lines up and unparks.
fn later(k: &Kit) {
    k.clock.advance_millis(150);
}

async fn an_account_never_runs_more_than_its_cap(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = capped(&k, "a", Some(2)).await;
    let b = capped(&k, "b", None).await;
    for n in 0..10 {
        k.job(&format!("a{n}"), &a, 1).await;
    }
    for n in 0..3 {
        k.job(&format!("b{n}"), &b, 1).await;
    }
    let got = claim(&k, 20).await;
    let of_a: Vec<&ClaimedJob> = got.iter().filter(|c| c.job.account_id == a).collect();
    assert_eq!(
        of_a.len(),
        2,
        "a runs its cap, no more: {:?}",
        got.iter().map(|c| c.job.id.as_str()).collect::<Vec<_>>()
    );
    assert_eq!(got.len(), 5, "b's jobs are not held back by a's cap");
    assert_eq!(k.store.account(&a).await.unwrap().max_running, Some(2));
    later(&k);
    assert!(claim(&k, 20).await.is_empty(), "nothing more while a is at its cap");
    // One of a's finishes: one more of a's starts — the next in creation order.
    finish(&k, of_a[0]).await;
    later(&k);
    let next = claim(&k, 20).await;
    assert_eq!(next.len(), 1, "one slot freed, one job: {next:?}");
    assert_eq!(next[0].job.id.as_str(), "a2");
    assert_eq!(running_of(&k.store, &a).await, 2);
    k.assert_clean().await;
}

/// A cap lowered below what runs: running jobs finish, nothing new starts until the account is
/// below it. Removed: the parked jobs come back.
async fn a_lowered_cap_stops_new_claims_until_below_it(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = capped(&k, "a", Some(3)).await;
    for n in 0..6 {
        k.job(&format!("a{n}"), &a, 1).await;
    }
    let run = claim(&k, 10).await;
    assert_eq!(run.len(), 3);
    assert_eq!(set_cap(&k, &a, Some(1)).await.max_running, Some(1));
    for (i, c) in run.iter().enumerate() {
        later(&k);
        assert!(claim(&k, 10).await.is_empty(), "{} running, cap 1: nothing starts", 3 - i);
        finish(&k, c).await;
    }
    later(&k);
    assert_eq!(claim(&k, 10).await.len(), 1, "below the cap again: one starts");
    set_cap(&k, &a, None).await;
    later(&k);
    assert_eq!(claim(&k, 10).await.len(), 2, "no cap: the rest start");
    k.assert_clean().await;
}

/// A cap put on an account whose jobs already run counts them: nothing starts until below it.
async fn a_cap_added_while_jobs_run_counts_them(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = capped(&k, "a", None).await;
    for n in 0..5 {
        k.job(&format!("a{n}"), &a, 1).await;
    }
    let run = claim(&k, 3).await;
    assert_eq!(run.len(), 3);
    set_cap(&k, &a, Some(2)).await;
    later(&k);
    assert!(claim(&k, 10).await.is_empty());
    finish(&k, &run[0]).await;
    later(&k);
    assert!(claim(&k, 10).await.is_empty(), "2 running, cap 2");
    finish(&k, &run[1]).await;
    later(&k);
    assert_eq!(claim(&k, 10).await.len(), 1);
    // A cap of 0 pauses the account; its jobs are not lost.
    set_cap(&k, &a, Some(0)).await;
    later(&k);
    assert!(claim(&k, 10).await.is_empty());
    assert_eq!(k.get("a4").await.state, JobState::Queued);
    k.assert_clean().await;
}

/// A kind's cap (`[kinds.NAME] max_running`) holds across accounts.
async fn a_kind_cap_holds_across_accounts(engine: EngineKind) {
    let mut policy = test_policy();
    let render = RetryPolicy { max_running: Some(2), ..policy.clone() };
    let k = Kit::tuned(engine, policy.clone(), limits_batch(), |o| {
        let mut p: settle_core::job::Policies = std::mem::take(&mut policy).into();
        p.kinds.insert("render".into(), render);
        o.policy = p;
    })
    .await;
    let (a, b) = (capped(&k, "a", None).await, capped(&k, "b", None).await);
    for n in 0..3 {
        k.job(&format!("a{n}"), &a, 1).await;
        k.job(&format!("b{n}"), &b, 1).await;
    }
    let got = claim(&k, 10).await;
    assert_eq!(got.len(), 2, "the kind runs its cap: {got:?}");
    later(&k);
    assert!(claim(&k, 10).await.is_empty());
    finish(&k, &got[0]).await;
    later(&k);
    assert_eq!(claim(&k, 10).await.len(), 1);
    k.assert_clean().await;
}

/// Bad caps are refused whole: nothing written.
async fn bad_caps_write_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    for cap in [-1, 10_001] {
        let new = NewAccount { id: acc("x"), overdraft_limit: Credits::ZERO, max_running: Some(cap) };
        let out = k.store.create_account(new, SYSTEM_ACTOR).await;
        assert!(matches!(out, Err(StoreError::Invalid(_))), "{cap}: {out:?}");
    }
    assert!(k.store.account(&acc("x")).await.is_err(), "no account made");
    let a = capped(&k, "a", Some(4)).await;
    let changes = AccountChanges { overdraft_limit: None, max_running: Some(Some(10_001)) };
    assert!(matches!(k.store.update_account(&a, changes, SYSTEM_ACTOR).await, Err(StoreError::Invalid(_))));
    let changes = AccountChanges { overdraft_limit: Some(Credits::new(-5)), max_running: Some(None) };
    assert!(matches!(k.store.update_account(&a, changes, SYSTEM_ACTOR).await, Err(StoreError::Invalid(_))));
    assert_eq!(k.store.account(&a).await.unwrap().max_running, Some(4), "unchanged");
    let changes = AccountChanges { overdraft_limit: None, max_running: Some(Some(1)) };
    let nobody = k.store.update_account(&acc("nobody"), changes, SYSTEM_ACTOR).await;
    assert!(matches!(nobody, Err(StoreError::NotFound { .. })), "{nobody:?}");
    // A create that names a cap replays only with the same cap.
    let again = NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: Some(4) };
    assert!(k.store.create_account(again, SYSTEM_ACTOR).await.unwrap().replayed);
    let other = NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: Some(5) };
    assert!(matches!(k.store.create_account(other, SYSTEM_ACTOR).await, Err(StoreError::IdempotencyConflict { .. })));
    k.assert_clean().await;
}

both_engines!(
    an_account_never_runs_more_than_its_cap,
    a_lowered_cap_stops_new_claims_until_below_it,
    a_cap_added_while_jobs_run_counts_them,
    a_kind_cap_holds_across_accounts,
    bad_caps_write_nothing,
);

/// Claimers in two stores (two processes' worth: separate pools and caches) race on one capped
/// account on PostgreSQL; a monitor reads the committed running count throughout, and it never
/// passes the cap. Then the cap is lowered while they race, holding their jobs: no claim that
/// begins after the change returns starts one of the account's jobs.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_claimers_in_two_stores_never_pass_a_cap() {
    let k = Kit::new(EngineKind::Postgres).await;
    let options = || StoreOptions { clock: k.clock.clone(), ..StoreOptions::default() };
    let one = Arc::new(SqlStore::open(&k.url, options()).await.unwrap());
    let other = Arc::new(SqlStore::open(&k.url, options()).await.unwrap());
    let a = capped(&k, "a", Some(3)).await;
    let b = capped(&k, "b", None).await;
    for n in 0..120 {
        k.job(&format!("a{n:03}"), &a, 1).await;
        if n % 4 == 0 {
            k.job(&format!("b{n:03}"), &b, 1).await;
        }
    }
    let stores: [Arc<SqlStore>; 2] = [one, other.clone()];
    let stop = Arc::new(AtomicBool::new(false));
    let worst = Arc::new(AtomicUsize::new(0));
    let mut tasks = Vec::new();
    for i in 0..8 {
        let store = stores[i % 2].clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            while !stop.load(Ordering::Relaxed) {
                for c in store.claim(claim_req(&format!("w{i}"), 2)).await.unwrap() {
                    tokio::time::sleep(std::time::Duration::from_millis(2)).await;
                    store.succeed(&c.job.id, Reporter::of(Some(&c.lease_token)), None).await.unwrap();
                    done += 1;
                }
            }
            done
        }));
    }
    let monitor = {
        let (store, a, stop, worst) = (other.clone(), a.clone(), stop.clone(), worst.clone());
        tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                worst.fetch_max(running_of(&store, &a).await, Ordering::Relaxed);
            }
        })
    };
    // The wall clock drives these claims' line-ups; the kit's clock stands still, so move it.
    let clock = k.clock.clone();
    let ticking = Arc::new(AtomicBool::new(true));
    let ticker = {
        let ticking = ticking.clone();
        tokio::spawn(async move {
            while ticking.load(Ordering::Relaxed) {
                clock.advance_millis(50);
                tokio::time::sleep(std::time::Duration::from_millis(5)).await;
            }
        })
    };
    tokio::time::sleep(std::time::Duration::from_secs(4)).await;
    stop.store(true, Ordering::Relaxed);
    let done: usize = futures_done(tasks).await;
    monitor.await.unwrap();
    assert!(done >= 40, "the claimers got work done: {done}");
    assert!(worst.load(Ordering::Relaxed) <= 3, "running passed the cap: {}", worst.load(Ordering::Relaxed));
    assert!(worst.load(Ordering::Relaxed) >= 2, "the race was real: the account ran several at once");

    // A cap lowered while claimers race and hold what they take.
    for n in 0..10 {
        k.job(&format!("late{n}"), &a, 1).await;
    }
    let after_change = Arc::new(AtomicBool::new(false));
    let late_claims = Arc::new(AtomicUsize::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..6 {
        let store = stores[i % 2].clone();
        let (stop, after_change, late_claims, a) = (stop.clone(), after_change.clone(), late_claims.clone(), a.clone());
        tasks.push(tokio::spawn(async move {
            while !stop.load(Ordering::Relaxed) {
                let began_after = after_change.load(Ordering::SeqCst);
                let got = store.claim(claim_req(&format!("h{i}"), 1)).await.unwrap();
                if began_after && got.iter().any(|c| c.job.account_id == a) {
                    late_claims.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(std::time::Duration::from_millis(1)).await;
            }
            0
        }));
    }
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let before = running_of(&k.store, &a).await;
    set_cap(&k, &a, Some(1)).await;
    after_change.store(true, Ordering::SeqCst);
    // The claims in flight when the cap changed committed before the change did (the cap gate):
    // what runs now is all that will run until the holders let go.
    let at_change = running_of(&k.store, &a).await;
    tokio::time::sleep(std::time::Duration::from_millis(500)).await;
    stop.store(true, Ordering::Relaxed);
    futures_done(tasks).await;
    ticking.store(false, Ordering::Relaxed);
    ticker.await.unwrap();
    assert!(before >= 2, "jobs ran when the cap was lowered: {before}");
    assert_eq!(late_claims.load(Ordering::SeqCst), 0, "a claim begun after the cap change started a job");
    assert!(running_of(&k.store, &a).await <= at_change, "a job of the account started after the cap change");
    k.assert_clean().await;
}

async fn futures_done(tasks: Vec<tokio::task::JoinHandle<usize>>) -> usize {
    let mut total = 0;
    for t in tasks {
        total += t.await.unwrap();
    }
    total
}

/// Caps on many accounts with jobs parked behind them, then removed while claimers in two stores
/// race, as `scripts/bench-http`'s round trip after its capped mix did: every claim is answered
/// and every parked job runs. An unpark pass's `LIMIT … SKIP LOCKED` under `IN` could be run
/// again for a re-checked row and unpark past the pass's budget; the next account's LIMIT then
/// went negative, and claims failed (500 over HTTP).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_caps_removed_while_claimers_race_unpark_everything() {
    let k = Kit::new(EngineKind::Postgres).await;
    let options = || StoreOptions { clock: k.clock.clone(), ..StoreOptions::default() };
    let stores = [
        Arc::new(SqlStore::open(&k.url, options()).await.unwrap()),
        Arc::new(SqlStore::open(&k.url, options()).await.unwrap()),
    ];
    let mut accounts = Vec::new();
    for i in 0..24 {
        let a = capped(&k, &format!("p{i:02}"), Some(1)).await;
        for n in 0..20 {
            k.job(&format!("p{i:02}-{n:02}"), &a, 1).await;
        }
        accounts.push(a);
    }
    // One running per account; the claims behind it park the rest.
    let mut held = Vec::new();
    for _ in 0..8 {
        held.extend(claim(&k, 100).await);
        later(&k);
    }
    assert_eq!(held.len(), accounts.len(), "one job per capped account runs");
    for a in &accounts {
        set_cap(&k, a, None).await;
    }
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for i in 0..12 {
        let (store, stop, clock) = (stores[i % 2].clone(), stop.clone(), k.clock.clone());
        tasks.push(tokio::spawn(async move {
            let mut done = 0;
            while !stop.load(Ordering::Relaxed) {
                let got = store.claim(claim_req(&format!("r{i}"), 8)).await.expect("a claim is answered");
                for c in got {
                    store.succeed(&c.job.id, Reporter::of(Some(&c.lease_token)), None).await.unwrap();
                    done += 1;
                }
                clock.advance_millis(20);
            }
            done
        }));
    }
    let all = accounts.len() * 20;
    for _ in 0..200 {
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        let q = JobFilter { state: Some(JobState::Succeeded), ..JobFilter::ALL };
        if k.store.jobs(&q, Page { after: 0, limit: 1_000 }).await.unwrap().rows.len() + held.len() >= all {
            break;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let done = futures_done(tasks).await;
    assert_eq!(done + held.len(), all, "every parked job ran once the caps were gone");
    for c in &held {
        finish(&k, c).await;
    }
    k.assert_clean().await;
}
