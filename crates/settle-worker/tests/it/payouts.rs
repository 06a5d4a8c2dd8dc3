//! The payout processor against `settle-sim` over real HTTP, on both engines: a thousand
//! withdrawals through a provider that loses answers, goes down, rate-limits, hangs, refuses
//! addresses and returns payouts; crashes between "looked up" and "sent" and between "sent" and
//! "recorded"; and two processors on one PostgreSQL.

use settle_core::backoff::{BackoffPolicy, Jitter, SplitMix64};
use settle_core::crash::CrashPoint;
use settle_core::ids::*;
use settle_core::job::{JobState, Policies, RefundPolicy, RetryPolicy};
use settle_core::{Clock, Credits, FakeClock, SystemClock, Timestamp};
use settle_sim::{SimConfig, Transfer};
use settle_store::*;
use settle_worker::payouts::{AttemptEnd, HttpProvider, HttpProviderConfig, PayoutProcessor, PayoutSettings};
use settle_worker::{LoopSettings, Maintenance};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Clone, Copy, Debug)]
enum Engine {
    Sqlite,
    Postgres,
}

async fn url(engine: Engine, dir: &tempfile::TempDir) -> String {
    match engine {
        Engine::Sqlite => format!("sqlite://{}", dir.path().join("payouts.db").display()),
        Engine::Postgres => {
            settle_testkit::fresh_database_from_template(
                &settle_store::SqlStore::postgres_schema_id(),
                |url| async move { settle_store::SqlStore::migrate_postgres(&url).await.unwrap() },
            )
            .await
        }
    }
}

/// Withdrawals with short leases and windows, so a test sees every path in seconds.
fn policies(lease_seconds: u32, confirm_window_seconds: u64) -> Policies {
    let withdrawal = RetryPolicy {
        backoff: BackoffPolicy { backoff_ms_base: 100, backoff_ms_max: 1_000, jitter: Jitter::Full },
        attempts_max: 5,
        lease_seconds,
        confirm_window_seconds,
        refund_on: RefundPolicy::FinalFailure,
        ..RetryPolicy::default()
    };
    Policies { default: RetryPolicy::default(), kinds: BTreeMap::from([("withdrawal".to_owned(), withdrawal)]) }
}

async fn open(url: &str, clock: Arc<dyn Clock>, policy: Policies) -> Arc<SqlStore> {
    let options = StoreOptions { clock, policy, jitter_seed: 11, ..StoreOptions::default() };
    Arc::new(SqlStore::open(url, options).await.unwrap())
}

fn provider(sim: &settle_sim::Running, timeout_ms: u64) -> Arc<HttpProvider> {
    Arc::new(
        HttpProvider::new(&HttpProviderConfig {
            url: sim.url(),
            timeout: Duration::from_millis(timeout_ms),
            connect_timeout: Duration::from_millis(200),
        })
        .unwrap(),
    )
}

fn worker(name: &str) -> WorkerName {
    WorkerName::parse(name).unwrap()
}

async fn account(store: &SqlStore, id: &str, grant: i64) -> AccountId {
    let a = AccountId::parse(id).unwrap();
    store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    let g = NewGrant {
        id: RefId::parse(&format!("g-{id}")).unwrap(),
        amount: Credits::new(grant),
        reason: None,
        expires_at: None,
        priority: None,
    };
    store.grant(&a, g, settle_store::SYSTEM_ACTOR).await.unwrap();
    a
}

async fn withdraw(store: &SqlStore, id: &str, account: &AccountId, amount: i64, destination: &str) {
    let req = NewWithdrawal {
        id: JobId::parse(id).unwrap(),
        account_id: account.clone(),
        amount: Credits::new(amount),
        destination: Destination::parse(destination).unwrap(),
    };
    store.payouts().create_withdrawal(req).await.unwrap();
}

async fn all_withdrawals(store: &SqlStore) -> Vec<Withdrawal> {
    let mut out = Vec::new();
    let mut after = 0;
    loop {
        let page =
            store.payouts().withdrawals(&WithdrawalFilter::default(), Page { after, limit: 1_000 }).await.unwrap();
        out.extend(page.rows);
        match page.next_after {
            Some(n) => after = n,
            None => return out,
        }
    }
}

/// Every send of a key is preceded, for that key, by a lookup the provider answered "absent" — so
/// no key is ever sent again after a send whose answer was lost without a lookup first.
fn sends_follow_absent_lookups(log: &[settle_sim::LogEntry]) -> Result<(), String> {
    let mut last: BTreeMap<&str, &settle_sim::LogEntry> = BTreeMap::new();
    for entry in log {
        if entry.op == "send" {
            match last.get(entry.key.as_str()) {
                Some(prev) if prev.op == "lookup" && prev.fate == "absent" => {}
                other => return Err(format!("send #{} of {} follows {:?}", entry.seq, entry.key, other)),
            }
        }
        last.insert(entry.key.as_str(), entry);
    }
    Ok(())
}

async fn thousand_withdrawals(engine: Engine) {
    let dir = tempfile::tempdir().unwrap();
    let url = url(engine, &dir).await;
    let store = open(&url, Arc::new(SystemClock), policies(2, 2)).await;
    let sim = settle_sim::start(
        "127.0.0.1:0",
        SimConfig {
            seed: 2026,
            lose_answer: 0.20,
            hang: 0.02,
            hang_ms: 1_000,
            node_down: 0.10,
            down_period_ms: 300,
            rate_limit: 0.05,
            retry_after_seconds: 1,
            float: None,
            invalid_prefix: "invalid".into(),
            returns: 0.03,
            return_after_ms: 300,
        },
    )
    .await
    .unwrap();
    let mut rng = SplitMix64::new(7);
    let mut accounts = Vec::new();
    for i in 0..20 {
        accounts.push(account(&store, &format!("acct-{i}"), 1_000_000).await);
    }
    let mut amounts = BTreeMap::new();
    for i in 0..1_000 {
        let a = &accounts[i % accounts.len()];
        let amount = 1 + rng.below_inclusive(999) as i64;
        let destination = if rng.below_inclusive(99) < 3 { format!("invalid-{i}") } else { format!("dest-{i}") };
        let id = format!("w-{i:04}");
        withdraw(&store, &id, a, amount, &destination).await;
        amounts.insert(id, (a.clone(), amount));
    }
    let cancel = CancellationToken::new();
    let settings = PayoutSettings {
        every: Duration::from_millis(50),
        reconcile_every: Duration::from_millis(100),
        batch: 32,
        return_window: Duration::from_secs(600),
    };
    let mut loops =
        PayoutProcessor::new(store.clone(), provider(&sim, 300), worker("payouts-1"), settings).spawn(cancel.clone());
    let maintenance = LoopSettings {
        rescue_every: Duration::from_millis(100),
        sweep_every: Duration::from_secs(1),
        reconcile_every: Duration::from_secs(1),
        batch: 100,
    };
    loops.extend(Maintenance::new(store.clone(), maintenance).spawn(cancel.clone()));

    // Wait (with a deadline) until every withdrawal is final and every payout the provider returned
    // is returned in Settle too.
    let deadline = tokio::time::Instant::now() + Duration::from_secs(300);
    let withdrawals = loop {
        let ws = all_withdrawals(&store).await;
        let returned_at_sim: BTreeSet<String> =
            sim.sim.executed().transfers.into_iter().filter(|t| t.returned).map(|t| t.key).collect();
        let settled = ws.iter().all(|w| match w.job.state {
            JobState::Succeeded => !returned_at_sim.contains(&w.idempotency_key),
            JobState::Dead | JobState::Returned => true,
            _ => false,
        });
        if settled {
            break ws;
        }
        if tokio::time::Instant::now() > deadline {
            let open: Vec<_> =
                ws.iter().filter(|w| !w.job.state.is_terminal()).map(|w| (&w.job.id, w.job.state)).collect();
            panic!("not settled in time: {} open, e.g. {:?}", open.len(), &open[..open.len().min(5)]);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    cancel.cancel();
    for l in loops {
        l.await.unwrap();
    }

    let executed = sim.sim.executed();
    let by_key: BTreeMap<&str, &Transfer> = executed.transfers.iter().map(|t| (t.key.as_str(), t)).collect();
    assert_eq!(executed.concurrent_sends, 0, "two sends of one key were in flight at once");
    for t in &executed.transfers {
        assert_eq!(t.sends_after_executed, 0, "key {} was sent again after it executed", t.key);
    }
    sends_follow_absent_lookups(&sim.sim.log()).unwrap();
    let mut paid_by_settle = 0i64;
    let mut counts = BTreeMap::new();
    for w in &withdrawals {
        *counts.entry(w.job.state.as_str()).or_insert(0) += 1;
        let transfer = by_key.get(w.idempotency_key.as_str());
        match w.job.state {
            JobState::Succeeded | JobState::Returned => {
                let t = transfer.unwrap_or_else(|| panic!("{} succeeded without a transfer", w.job.id));
                assert_eq!(w.provider_txid.as_deref(), Some(t.txid.as_str()), "{}", w.job.id);
                assert_eq!((t.amount, t.destination.as_str()), (w.amount.get(), w.destination.as_str()));
                assert_eq!(t.returned, w.job.state == JobState::Returned, "{}", w.job.id);
                paid_by_settle += w.amount.get();
                let expected = if w.job.state == JobState::Returned { "returned" } else { "succeeded" };
                assert_eq!(w.job.items[0].state.as_str(), expected);
            }
            JobState::Dead => {
                assert!(transfer.is_none(), "{} is dead but was paid out", w.job.id);
                assert_eq!(w.job.items[0].state.as_str(), "refunded", "{}: the hold is refunded", w.job.id);
                assert_eq!(w.job.net.get(), 0, "{}: refunded exactly once", w.job.id);
            }
            other => panic!("{} ended {other:?}", w.job.id),
        }
    }
    assert_eq!(executed.total_paid, paid_by_settle, "the provider paid what Settle recorded as paid");
    assert_eq!(executed.transfers.len(), counts.get("succeeded").unwrap_or(&0) + counts.get("returned").unwrap_or(&0));
    // each account: its grant, less what was paid out and not returned
    for (i, a) in accounts.iter().enumerate() {
        let kept: i64 = withdrawals
            .iter()
            .filter(|w| w.job.account_id == a.as_str() && w.job.state == JobState::Succeeded)
            .map(|w| w.amount.get())
            .sum();
        assert_eq!(store.account(a).await.unwrap().balance.get(), 1_000_000 - kept, "account {i}");
    }
    let report = store.audit(None).await.unwrap();
    assert!(report.ok(), "{:#?}", report.violations);
    // the workload did what it says: lost answers, retries, refusals and returns all happened
    let log = sim.sim.log();
    let fates: BTreeSet<&str> = log.iter().map(|e| e.fate.as_str()).collect();
    for fate in ["cut", "node_down", "rate_limited", "invalid_address", "returned", "absent", "found"] {
        assert!(fates.contains(fate), "no {fate} in the run: {fates:?}");
    }
    assert!(
        counts.get("dead").copied().unwrap_or(0) > 0 && counts.get("returned").copied().unwrap_or(0) > 0,
        "{counts:?}"
    );
    let summary = store.failure_summary(&settle_core::scope::Scope::ALL).await.unwrap();
    assert!(
        summary.iter().any(|f| f.code == "INVALID_ADDRESS" && f.state == settle_store::FailureState::Dead),
        "{summary:?}"
    );
    assert_eq!(amounts.len(), withdrawals.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_thousand_withdrawals_through_a_faulty_provider() {
    thousand_withdrawals(Engine::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_thousand_withdrawals_through_a_faulty_provider() {
    thousand_withdrawals(Engine::Postgres).await;
}

/// `arm(point)` makes the processor stop there once, as if the process died.
#[derive(Default)]
struct Crasher {
    armed: Mutex<Option<CrashPoint>>,
    seen: Mutex<BTreeSet<CrashPoint>>,
}

impl CrashHook for Crasher {
    fn should_crash(&self, point: CrashPoint) -> bool {
        self.seen.lock().unwrap().insert(point);
        let mut armed = self.armed.lock().unwrap();
        if *armed == Some(point) {
            *armed = None;
            return true;
        }
        false
    }
}

/// Dies at `point` mid-attempt, restarts (a new store and processor on the same database), and
/// converges: exactly one send, one transfer, the withdrawal succeeded with its txid.
async fn crash_mid_payout(engine: Engine, point: CrashPoint) {
    let dir = tempfile::tempdir().unwrap();
    let url = url(engine, &dir).await;
    let clock = Arc::new(FakeClock::new(Timestamp::from_micros(1_767_225_600_000_000)));
    let sim = settle_sim::start("127.0.0.1:0", SimConfig::default()).await.unwrap();
    let (lease, window) = (30, 3_600);
    let settings = PayoutSettings { batch: 4, ..PayoutSettings::default() };
    let crasher = Arc::new(Crasher::default());
    {
        let store = open(&url, clock.clone(), policies(lease, window)).await;
        let a = account(&store, "a", 100).await;
        withdraw(&store, "w", &a, 40, "dest-1").await;
        let first = PayoutProcessor::new(store.clone(), provider(&sim, 2_000), worker("p-1"), settings)
            .with_crash_hook(crasher.clone());
        *crasher.armed.lock().unwrap() = Some(point);
        let ends = first.process_pass().await.unwrap();
        assert_eq!(ends, vec![("w".to_owned(), AttemptEnd::Crashed)]);
        let sent = sim.sim.log().iter().filter(|e| e.op == "send").count();
        assert_eq!(sent, usize::from(point == CrashPoint::PayoutAfterSend), "{point:?}");
    }
    // The restart: a new process on the same database; the dead one's lease runs out.
    let store = open(&url, clock.clone(), policies(lease, window)).await;
    let second = PayoutProcessor::new(store.clone(), provider(&sim, 2_000), worker("p-2"), settings)
        .with_crash_hook(crasher.clone());
    let maintenance = Maintenance::new(store.clone(), LoopSettings::default());
    assert!(second.process_pass().await.unwrap().is_empty(), "the lease is still held");
    clock.advance_seconds(31);
    assert_eq!(maintenance.rescue_pass().await.unwrap(), vec!["w".to_owned()]);
    // The send was marked before the request could leave: only the provider can tell now.
    let job = store.job(&JobId::parse("w").unwrap()).await.unwrap();
    assert_eq!(job.state, JobState::Unknown, "{point:?}");
    assert_eq!(job.items[0].state.as_str(), "charged", "the hold stays while unknown");
    let moved = second.reconcile_pass().await.unwrap();
    if point == CrashPoint::PayoutAfterLookup {
        // absent, inside the confirm window: nothing yet; after it, retried with the same key
        assert!(moved.is_empty());
        clock.advance_seconds(window);
        assert_eq!(second.reconcile_pass().await.unwrap(), vec!["w".to_owned()]);
        let job = store.job(&JobId::parse("w").unwrap()).await.unwrap();
        assert_eq!(
            (job.state, job.last_error.unwrap().code.as_str()),
            (JobState::Queued, "TIMEOUT_CONFIRMED_NOT_SENT")
        );
        clock.advance_seconds(5);
        assert_eq!(second.process_pass().await.unwrap(), vec![("w".to_owned(), AttemptEnd::Succeeded)]);
    } else {
        assert_eq!(moved, vec!["w".to_owned()]);
    }
    let w = store.payouts().withdrawal(&JobId::parse("w").unwrap()).await.unwrap();
    let executed = sim.sim.executed();
    assert_eq!(executed.transfers.len(), 1);
    assert_eq!(executed.transfers[0].sends, 1, "{point:?}: sent once");
    assert_eq!(
        (w.job.state, w.provider_txid.as_deref()),
        (JobState::Succeeded, Some(executed.transfers[0].txid.as_str()))
    );
    assert_eq!(store.account(&AccountId::parse("a").unwrap()).await.unwrap().balance.get(), 60);
    sends_follow_absent_lookups(&sim.sim.log()).unwrap();
    let report = store.audit(None).await.unwrap();
    assert!(report.ok(), "{:#?}", report.violations);
    assert!(crasher.seen.lock().unwrap().contains(&point));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_crash_between_lookup_and_send_sends_once() {
    crash_mid_payout(Engine::Sqlite, CrashPoint::PayoutAfterLookup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_crash_between_send_and_record_keeps_the_payout() {
    crash_mid_payout(Engine::Sqlite, CrashPoint::PayoutAfterSend).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_between_lookup_and_send_sends_once() {
    crash_mid_payout(Engine::Postgres, CrashPoint::PayoutAfterLookup).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_crash_between_send_and_record_keeps_the_payout() {
    crash_mid_payout(Engine::Postgres, CrashPoint::PayoutAfterSend).await;
}

#[test]
fn the_crash_tests_cover_every_payout_point() {
    // The four tests above name each point of CrashPoint::PAYOUT on each engine.
    assert_eq!(CrashPoint::PAYOUT, &[CrashPoint::PayoutAfterLookup, CrashPoint::PayoutAfterSend]);
}

/// Two processors, each with its own store (its own connection pool) on one PostgreSQL database,
/// against a provider that loses a third of its answers and hangs some sends: no key is ever in
/// flight twice, none is sent again after it executed, and every withdrawal settles.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_two_processors_never_send_one_key_at_once() {
    let url = settle_testkit::fresh_database().await;
    let sim = settle_sim::start(
        "127.0.0.1:0",
        SimConfig { seed: 9, lose_answer: 0.3, hang: 0.05, hang_ms: 800, ..SimConfig::default() },
    )
    .await
    .unwrap();
    let first = open(&url, Arc::new(SystemClock), policies(2, 2)).await;
    let second = open(&url, Arc::new(SystemClock), policies(2, 2)).await;
    let a = account(&first, "a", 1_000_000).await;
    for i in 0..200 {
        withdraw(&first, &format!("w-{i:03}"), &a, 10 + i, &format!("dest-{i}")).await;
    }
    let cancel = CancellationToken::new();
    let settings = PayoutSettings {
        every: Duration::from_millis(20),
        reconcile_every: Duration::from_millis(100),
        batch: 8,
        return_window: Duration::ZERO,
    };
    let mut loops = Vec::new();
    for (n, store) in [&first, &second].into_iter().enumerate() {
        let p = PayoutProcessor::new(store.clone(), provider(&sim, 300), worker(&format!("p-{n}")), settings);
        loops.extend(p.spawn(cancel.clone()));
        let m = LoopSettings { rescue_every: Duration::from_millis(100), ..LoopSettings::default() };
        loops.extend(Maintenance::new(store.clone(), m).spawn(cancel.clone()));
    }
    let deadline = tokio::time::Instant::now() + Duration::from_secs(180);
    let ws = loop {
        let ws = all_withdrawals(&first).await;
        if ws.iter().all(|w| w.job.state == JobState::Succeeded) {
            break ws;
        }
        assert!(tokio::time::Instant::now() < deadline, "not settled in time");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    cancel.cancel();
    for l in loops {
        l.await.unwrap();
    }
    let executed = sim.sim.executed();
    assert_eq!(executed.concurrent_sends, 0, "one key was in flight twice");
    assert!(executed.transfers.iter().all(|t| t.sends_after_executed == 0));
    assert_eq!(executed.transfers.len(), ws.len());
    sends_follow_absent_lookups(&sim.sim.log()).unwrap();
    let workers: BTreeSet<String> = {
        let mut names = BTreeSet::new();
        for w in &ws {
            for attempt in first.attempts(&w.job.id).await.unwrap() {
                names.insert(attempt.worker);
            }
        }
        names
    };
    assert_eq!(workers.len(), 2, "both processors worked: {workers:?}");
    let report = first.audit(None).await.unwrap();
    assert!(report.ok(), "{:#?}", report.violations);
}
