//! A claim of several jobs (docs/design/fair-claims.md §11): on PostgreSQL, several jobs of one line
//! in one statement while no account has a cap. The same jobs in the same order as one job at a
//! time (SQLite's claim, and PostgreSQL's with a cap somewhere), each with its own lease token and
//! attempt, and never one job to two claimers.

use crate::kit::*;
use settle_core::ids::AccountId;
use settle_store::*;
use std::sync::Arc;

/// Six accounts' bursts of different sizes, made in an interleaved order.
async fn bursts(k: &Kit) -> Vec<AccountId> {
    let mut accounts = Vec::new();
    for i in 0..6 {
        accounts.push(k.account(&format!("a{i}"), 1_000).await);
    }
    for n in 0..12 {
        for (i, a) in accounts.iter().enumerate() {
            if n < 2 + 2 * i {
                k.job(&format!("a{i}-{n:02}"), a, 1).await;
            }
        }
    }
    accounts
}

/// Every job, claimed `limit` at a time: the ids in the order answered, each checked to hold its
/// own lease (a heartbeat with its token) and to have its attempt open.
async fn claim_all(k: &Kit, limit: u32) -> Vec<String> {
    let mut order = Vec::new();
    loop {
        let got = k.store.claim(claim_req("w", limit)).await.unwrap();
        if got.is_empty() {
            return order;
        }
        assert!(got.len() <= limit as usize);
        for c in got {
            let beat = k.store.heartbeat(&c.job.id, &c.lease_token).await;
            assert!(beat.is_ok(), "{}'s own token holds its lease: {beat:?}", c.job.id);
            let attempts = k.store.attempts(&c.job.id).await.unwrap();
            assert_eq!(attempts.len(), 1, "{}: {attempts:?}", c.job.id);
            assert_eq!((attempts[0].attempt_no, attempts[0].result), (1, None));
            assert_eq!(c.job.attempt, 1);
            order.push(c.job.id.to_string());
        }
    }
}

/// Claims of 8 hand out the jobs in the order claims of one do, on each engine.
async fn claims_of_eight_take_the_order_of_claims_of_one(engine: EngineKind) {
    let one = Kit::new(engine).await;
    bursts(&one).await;
    let by_one = claim_all(&one, 1).await;
    let eight = Kit::new(engine).await;
    bursts(&eight).await;
    let by_eight = claim_all(&eight, 8).await;
    assert_eq!(by_one.len(), 42);
    assert_eq!(by_eight, by_one);
    eight.assert_clean().await;
}

/// With a cap on one account, every claim takes one job at a time (PostgreSQL: the statement of
/// several finds the cap first): the cap holds, and the others' order is unchanged.
async fn a_cap_anywhere_claims_one_at_a_time(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let accounts = bursts(&k).await;
    let changes = AccountChanges { overdraft_limit: None, max_running: Some(Some(1)) };
    k.store.update_account(&accounts[5], changes, SYSTEM_ACTOR).await.unwrap();
    let got = k.store.claim(claim_req("w", 100)).await.unwrap();
    let of_a5 = got.iter().filter(|c| c.job.account_id == accounts[5]).count();
    assert_eq!(of_a5, 1, "a5 is capped at one running job");
    assert_eq!(got.len(), 42 - 12 + 1, "every other job, and one of a5's");
    k.assert_clean().await;
}

/// A claim of several that dies at any point of its transaction (after a job's guard, after its
/// event, before the commit) leaves every job queued with no attempt; run again, it claims the
/// same jobs as a claim that never died.
async fn a_claim_of_several_that_dies_leaves_nothing_and_runs_again(engine: EngineKind) {
    use settle_core::crash::CrashPoint;
    let clean = Kit::new(engine).await;
    bursts(&clean).await;
    let want: Vec<String> =
        clean.store.claim(claim_req("w", 8)).await.unwrap().iter().map(|c| c.job.id.to_string()).collect();
    for point in [CrashPoint::AfterGuard, CrashPoint::AfterOutbox, CrashPoint::BeforeCommit] {
        let k = Kit::new(engine).await;
        bursts(&k).await;
        k.crasher.arm(point);
        assert!(k.store.claim(claim_req("w", 8)).await.is_err(), "{point:?}: the claim died");
        assert!(!k.crasher.disarm(), "{point:?} was reached");
        for id in &want {
            let job = k.get(id).await;
            assert_eq!((job.state, job.attempt), (settle_core::job::JobState::Queued, 0), "{point:?}: {id}");
            assert!(k.store.attempts(&job.id).await.unwrap().is_empty(), "{point:?}: {id}");
        }
        let again: Vec<String> =
            k.store.claim(claim_req("w", 8)).await.unwrap().iter().map(|c| c.job.id.to_string()).collect();
        assert_eq!(again, want, "{point:?}");
        k.assert_clean().await;
    }
}

both_engines!(
    claims_of_eight_take_the_order_of_claims_of_one,
    a_cap_anywhere_claims_one_at_a_time,
    a_claim_of_several_that_dies_leaves_nothing_and_runs_again,
);

/// Claimers in two stores on one PostgreSQL ledger, claiming 8 at a time: no job is given twice,
/// each answer's token holds its job's lease (its success is taken), and every job runs once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_claimers_of_eight_in_two_stores_never_share_a_job() {
    let k = Kit::new(EngineKind::Postgres).await;
    let options = || StoreOptions { clock: k.clock.clone(), ..StoreOptions::default() };
    let stores = [
        Arc::new(SqlStore::open(&k.url, options()).await.unwrap()),
        Arc::new(SqlStore::open(&k.url, options()).await.unwrap()),
    ];
    for i in 0..8 {
        let a = k.account(&format!("p{i}"), 1_000).await;
        for n in 0..40 {
            k.job(&format!("p{i}-{n:02}"), &a, 1).await;
        }
    }
    let mut tasks = Vec::new();
    for i in 0..8 {
        let store = stores[i % 2].clone();
        tasks.push(tokio::spawn(async move {
            let mut mine = Vec::new();
            loop {
                let got = store.claim(claim_req(&format!("r{i}"), 8)).await.expect("a claim is answered");
                if got.is_empty() {
                    return mine;
                }
                for c in got {
                    let done = store.succeed(&c.job.id, Reporter::of(Some(&c.lease_token)), None).await;
                    assert!(done.is_ok_and(|d| d.applied), "{}: its token is its lease", c.job.id);
                    mine.push(c.job.id.to_string());
                }
            }
        }));
    }
    let mut all = Vec::new();
    for t in tasks {
        all.extend(t.await.unwrap());
    }
    let claimed = all.len();
    all.sort();
    all.dedup();
    assert_eq!((claimed, all.len()), (320, 320), "every job claimed once");
    k.assert_clean().await;
}
