//! Race tests: 32 concurrent tasks send the same job a mix of fail / succeed / cancel / claim
//! signals, over many jobs and seeded interleavings. Whatever the order, the ledger must show
//! at most one refund and one reclaim per item, one claim winner per attempt, and audit clean.

use crate::kit::*;
use settle_core::backoff::SplitMix64;
use settle_core::job::JobState;
use settle_core::ledger::EntryKind;
use settle_store::*;
use std::collections::HashMap;
use std::sync::Arc;

const TASKS: usize = 32;
const JOBS: usize = 40;

#[derive(Clone, Copy, Debug)]
enum Signal {
    FailRetryable,
    FailFinal,
    SucceedWithToken,
    SucceedNoToken,
    Cancel,
    Claim,
    ItemFail,
}

const SIGNALS: [Signal; 7] = [
    Signal::FailRetryable,
    Signal::FailFinal,
    Signal::SucceedWithToken,
    Signal::SucceedNoToken,
    Signal::Cancel,
    Signal::Claim,
    Signal::ItemFail,
];

async fn send(store: &SqlStore, job: &str, token: &LeaseToken, s: Signal) -> Option<ClaimedJob> {
    let id = jid(job);
    match s {
        Signal::FailRetryable => drop(store.fail(&id, fail_sig(token, "TIMEOUT")).await.unwrap()),
        Signal::FailFinal => drop(store.fail(&id, fail_sig(token, "INVALID_ADDRESS")).await.unwrap()),
        Signal::SucceedWithToken => drop(store.succeed(&id, Some(token)).await.unwrap()),
        Signal::SucceedNoToken => drop(store.succeed(&id, None).await.unwrap()),
        Signal::Cancel => match store.cancel(&id).await {
            Ok(_) | Err(StoreError::JobFinished(_)) | Err(StoreError::OutcomeUnknown(_)) => {}
            Err(e) => panic!("cancel: {e}"),
        },
        Signal::Claim => return store.claim(claim_req("racer", 1)).await.unwrap().into_iter().next(),
        Signal::ItemFail => match store.item_fail(&id, &iid("i0"), token, &code("TIMEOUT"), None).await {
            Ok(_) | Err(StoreError::LeaseLost(_)) => {}
            Err(e) => panic!("item fail: {e}"),
        },
    }
    None
}

/// One job at a time (so a claim can only win that job), 32 tasks of seeded signal mixes.
async fn signals_race(k: Arc<Kit>, seed: u64) {
    let a = k.account("a", 1_000_000).await;
    let mut rng = SplitMix64::new(seed);
    for n in 0..JOBS {
        let id = format!("job-{n}");
        k.items_job(&id, &a, &[10, 20]).await;
        let token = k.claim_one(&id).await;
        let mut handles = Vec::with_capacity(TASKS);
        for _ in 0..TASKS {
            let signal = SIGNALS[rng.below_inclusive(SIGNALS.len() as u64 - 1) as usize];
            let (k, id, token) = (k.clone(), id.clone(), token.clone());
            handles.push(tokio::spawn(async move { send(&k.store, &id, &token, signal).await }));
        }
        let mut claims_by_attempt: HashMap<u32, usize> = HashMap::new();
        for h in handles {
            if let Some(c) = h.await.unwrap() {
                assert_eq!(c.job.id, id);
                *claims_by_attempt.entry(c.job.attempt).or_default() += 1;
            }
        }
        assert!(claims_by_attempt.values().all(|n| *n == 1), "two winners for one attempt: {claims_by_attempt:?}");
        // Drain: whatever state the race left, bring the job to an end so the next job is alone.
        let job = k.get(&id).await;
        match job.state {
            JobState::Queued | JobState::Running | JobState::Unknown | JobState::Dead => {
                let _ = k.store.succeed(&jid(&id), None).await.unwrap();
            }
            _ => {}
        }
        let job = k.get(&id).await;
        if job.state == JobState::Running {
            // cancel won the race for a running job: the worker acknowledges it
            let t = k.store.attempts(&jid(&id)).await.unwrap().len();
            assert!(t >= 1);
            k.store.cancel(&jid(&id)).await.unwrap();
        }
        let job = k.get(&id).await;
        if job.state == JobState::Running {
            k.clock.advance_seconds(31);
            k.store.rescue_expired_leases(100).await.unwrap();
        }
        let job = k.get(&id).await;
        assert!(job.state.is_terminal(), "{id} left {:?}", job.state);
    }
    // Per item: at most one refund and one reclaim, whatever the interleaving.
    let entries = k.store.ledger(&a, Page { after: 0, limit: 1000 }).await.unwrap();
    let mut all = entries.rows;
    let mut next = entries.next_after;
    while let Some(after) = next {
        let p = k.store.ledger(&a, Page { after, limit: 1000 }).await.unwrap();
        all.extend(p.rows);
        next = p.next_after;
    }
    let mut per_item: HashMap<(String, String, EntryKind), usize> = HashMap::new();
    for e in &all {
        if let (Some(j), Some(i)) = (&e.job_id, &e.item_id) {
            *per_item.entry((j.clone(), i.clone(), e.kind)).or_default() += 1;
        }
    }
    assert!(per_item.values().all(|n| *n == 1), "an item has two entries of one kind");
    k.assert_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_thirty_two_signals_race_seed_1() {
    signals_race(Arc::new(Kit::new(EngineKind::Sqlite).await), 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_thirty_two_signals_race_seed_2() {
    signals_race(Arc::new(Kit::new(EngineKind::Sqlite).await), 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_thirty_two_signals_race_seed_1() {
    signals_race(Arc::new(Kit::new(EngineKind::Postgres).await), 1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_thirty_two_signals_race_seed_2() {
    signals_race(Arc::new(Kit::new(EngineKind::Postgres).await), 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_thirty_two_signals_race_unbatched() {
    let k = Kit::with(EngineKind::Sqlite, test_policy(), 1).await;
    signals_race(Arc::new(k), 3).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_one_claim_winner_per_job() {
    one_claim_winner_per_job(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_one_claim_winner_per_job() {
    one_claim_winner_per_job(EngineKind::Postgres).await;
}

/// 32 claimers against 50 due jobs: every job claimed exactly once.
async fn one_claim_winner_per_job(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = k.account("a", 1_000).await;
    for n in 0..50 {
        k.job(&format!("j{n}"), &a, 1).await;
    }
    let mut handles = Vec::new();
    for t in 0..TASKS {
        let k = k.clone();
        handles.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = k.store.claim(claim_req(&format!("w{t}"), 2)).await.unwrap();
                if got.is_empty() {
                    break mine;
                }
                mine.extend(got.into_iter().map(|c| c.job.id));
            }
        }));
    }
    let mut all = Vec::new();
    for h in handles {
        all.extend(h.await.unwrap());
    }
    all.sort();
    let before = all.len();
    all.dedup();
    assert_eq!((before, all.len()), (50, 50));
    k.assert_clean().await;
}

/// The lease rescuer racing the lost worker's completion (River #1302): whichever commits first,
/// the job ends `succeeded` with its charge standing, and the completion is never undone.
async fn rescuer_races_completion(engine: EngineKind) {
    let k = Arc::new(Kit::new(engine).await);
    let a = k.account("a", 1_000_000).await;
    for n in 0..60 {
        let id = format!("r{n}");
        k.job(&id, &a, 10).await;
        let token = k.claim_one(&id).await;
        k.clock.advance_seconds(31);
        let (k1, k2, id1, t1) = (k.clone(), k.clone(), id.clone(), token.clone());
        // Alternate which side is spawned first so both orders happen.
        let (done, rescued) = if n % 2 == 0 {
            let a = tokio::spawn(async move { k1.store.succeed(&jid(&id1), Some(&t1)).await.unwrap() });
            let b = tokio::spawn(async move { k2.store.rescue_expired_leases(10).await.unwrap() });
            (a.await.unwrap(), b.await.unwrap())
        } else {
            let b = tokio::spawn(async move { k2.store.rescue_expired_leases(10).await.unwrap() });
            let a = tokio::spawn(async move { k1.store.succeed(&jid(&id1), Some(&t1)).await.unwrap() });
            (a.await.unwrap(), b.await.unwrap())
        };
        assert!(done.applied, "the completion is accepted from the lost attempt");
        let job = k.get(&id).await;
        assert_eq!(job.state, JobState::Succeeded, "{id} after rescue {rescued:?}");
        assert_eq!(job.net.get(), -10);
        // A rescue pass afterwards never touches the completed job.
        k.clock.advance_seconds(31);
        assert!(k.store.rescue_expired_leases(10).await.unwrap().is_empty());
        assert_eq!(k.get(&id).await.state, JobState::Succeeded);
    }
    k.assert_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_rescuer_races_completion() {
    rescuer_races_completion(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_rescuer_races_completion() {
    rescuer_races_completion(EngineKind::Postgres).await;
}

/// The LISTEN connection for wake-ups must not take one of the pool's connections: a store with a
/// single connection still writes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_store_with_one_connection_still_writes() {
    let url = settle_testkit::fresh_database().await;
    let options = StoreOptions { pg_max_connections: 1, ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(200)).await; // let the listener connect
    let a = acc("solo");
    let r = tokio::time::timeout(
        std::time::Duration::from_secs(10),
        store.create_account(NewAccount { id: a.clone(), overdraft_limit: settle_core::Credits::ZERO }),
    )
    .await
    .expect("a write with one pooled connection must not wait for the listener");
    assert!(r.is_ok());
    assert_eq!(store.account(&a).await.unwrap().balance.get(), 0);
}
