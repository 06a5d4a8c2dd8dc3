//! The background passes on a real SQLite store with a fake clock.

use async_trait::async_trait;
use settle_core::backoff::{BackoffPolicy, Jitter};
use settle_core::ids::*;
use settle_core::job::{JobState, RetryPolicy};
use settle_core::{Credits, FakeClock, Timestamp};
use settle_store::*;
use settle_worker::{LoopSettings, Maintenance, OutcomeChecker};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering};

struct Fixture {
    store: Arc<SqlStore>,
    clock: Arc<FakeClock>,
    _dir: tempfile::TempDir,
}

async fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let clock = Arc::new(FakeClock::new(Timestamp::from_micros(1_767_225_600_000_000)));
    let policy = RetryPolicy {
        backoff: BackoffPolicy { backoff_ms_base: 1_000, backoff_ms_max: 60_000, jitter: Jitter::None },
        ..RetryPolicy::default()
    };
    let url = format!("sqlite://{}", dir.path().join("w.db").display());
    let options =
        StoreOptions { clock: clock.clone(), policy: policy.into(), jitter_seed: 1, ..StoreOptions::default() };
    let store = Arc::new(SqlStore::open(&url, options).await.unwrap());
    let a = AccountId::parse("a").unwrap();
    store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    store
        .grant(
            &a,
            NewGrant {
                id: RefId::parse("g").unwrap(),
                amount: Credits::new(100),
                reason: None,
                expires_at: None,
                priority: None,
            },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    Fixture { store, clock, _dir: dir }
}

async fn unknown_job(f: &Fixture, id: &str, kind: &str) {
    let req = NewJob {
        id: JobId::parse(id).unwrap(),
        account_id: AccountId::parse("a").unwrap(),
        kind: JobKind::parse(kind).unwrap(),
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(10)) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        refund_on: None,
        not_before: None,
        priority: None,
        requires: Default::default(),
    };
    f.store.create_job(req).await.unwrap();
    let c = f
        .store
        .claim(ClaimRequest {
            worker: WorkerName::parse("w").unwrap(),
            kinds: vec![JobKind::parse(kind).unwrap()],
            limit: 1,
            lease_seconds: None,
            labels: Default::default(),
        })
        .await
        .unwrap();
    f.store.mark_unknown(&JobId::parse(id).unwrap(), &c[0].lease_token, None).await.unwrap();
}

struct Provider {
    answer: Option<Finding>,
    calls: AtomicU32,
}

#[async_trait]
impl OutcomeChecker for Provider {
    async fn check(&self, _job: &Job) -> Result<Option<Finding>, String> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        match self.answer {
            Some(f) => Ok(Some(f)),
            None => Err("provider down".into()),
        }
    }
}

#[tokio::test]
async fn reconciler_waits_for_the_confirm_window_then_retries_as_not_sent() {
    let f = fixture().await;
    unknown_job(&f, "u", "render").await;
    let m = Maintenance::new(f.store.clone(), LoopSettings::default());
    assert!(m.reconcile_pass().await.unwrap().is_empty(), "inside the confirm window nothing happens");
    f.clock.advance_seconds(3_600);
    assert_eq!(m.reconcile_pass().await.unwrap(), ["u"]);
    let j = f.store.job(&JobId::parse("u").unwrap()).await.unwrap();
    assert_eq!(j.state, JobState::Queued);
    assert_eq!(j.last_error.unwrap().code, "TIMEOUT_CONFIRMED_NOT_SENT");
    assert_eq!(f.store.account(&AccountId::parse("a").unwrap()).await.unwrap().balance.get(), 100);
}

#[tokio::test]
async fn reconciler_asks_the_kinds_checker() {
    let f = fixture().await;
    unknown_job(&f, "p1", "payout").await;
    unknown_job(&f, "p2", "other").await;
    let found = Arc::new(Provider { answer: Some(Finding::Present), calls: AtomicU32::new(0) });
    let m = Maintenance::new(f.store.clone(), LoopSettings::default()).with_checker("payout", found.clone());
    assert_eq!(m.reconcile_pass().await.unwrap(), ["p1"], "found at once, no window to wait for");
    assert_eq!(found.calls.load(Ordering::SeqCst), 1);
    assert_eq!(f.store.job(&JobId::parse("p1").unwrap()).await.unwrap().state, JobState::Succeeded);
    assert_eq!(f.store.job(&JobId::parse("p2").unwrap()).await.unwrap().state, JobState::Unknown);
    // A checker that cannot answer leaves the job unknown, even past the window.
    unknown_job(&f, "p3", "payout").await;
    let down = Arc::new(Provider { answer: None, calls: AtomicU32::new(0) });
    let m = Maintenance::new(f.store.clone(), LoopSettings::default()).with_checker("payout", down.clone());
    f.clock.advance_seconds(7_200);
    let resolved = m.reconcile_pass().await.unwrap();
    assert_eq!(resolved, ["p2"], "p2 has no checker: absent after the window; p3 waits for its provider");
    assert_eq!(f.store.job(&JobId::parse("p3").unwrap()).await.unwrap().state, JobState::Unknown);
    assert!(down.calls.load(Ordering::SeqCst) >= 1);
}

#[tokio::test]
async fn rescue_and_sweep_passes_move_jobs() {
    let f = fixture().await;
    let req = NewJob {
        id: JobId::parse("r").unwrap(),
        account_id: AccountId::parse("a").unwrap(),
        kind: JobKind::parse("render").unwrap(),
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(10)) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        refund_on: None,
        not_before: None,
        priority: None,
        requires: Default::default(),
    };
    f.store.create_job(req).await.unwrap();
    f.store
        .claim(ClaimRequest {
            worker: WorkerName::parse("w").unwrap(),
            kinds: vec![],
            limit: 1,
            lease_seconds: None,
            labels: Default::default(),
        })
        .await
        .unwrap();
    let m = Maintenance::new(f.store.clone(), LoopSettings::default());
    assert!(m.rescue_pass().await.unwrap().is_empty());
    f.clock.advance_seconds(30);
    assert_eq!(m.rescue_pass().await.unwrap(), ["r"]);
    assert!(m.sweep_pass().await.unwrap().is_empty());
    let j = f.store.job(&JobId::parse("r").unwrap()).await.unwrap();
    assert_eq!((j.state, j.last_error.unwrap().code.as_str()), (JobState::Queued, "LEASE_EXPIRED"));
}

/// Unknown jobs no one can resolve yet (the provider cannot tell) must not hide the ones behind them.
#[tokio::test]
async fn reconcile_passes_walk_past_jobs_that_cannot_be_resolved() {
    let f = fixture().await;
    for n in 0..3 {
        unknown_job(&f, &format!("stuck{n}"), "payout").await;
    }
    unknown_job(&f, "behind", "render").await;
    let down = Arc::new(Provider { answer: None, calls: AtomicU32::new(0) });
    let settings = LoopSettings { batch: 2, ..LoopSettings::default() };
    let m = Maintenance::new(f.store.clone(), settings).with_checker("payout", down);
    f.clock.advance_seconds(3_600);
    let mut resolved = Vec::new();
    for _ in 0..3 {
        resolved.extend(m.reconcile_pass().await.unwrap());
    }
    assert_eq!(resolved, ["behind"]);
    assert_eq!(f.store.job(&JobId::parse("behind").unwrap()).await.unwrap().state, JobState::Queued);
}
