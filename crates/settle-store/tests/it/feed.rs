//! The event feed under many writers (spec §5, decision 0021): a consumer tailing `events(after)`
//! while writers commit never sees a gap, never sees an event below its cursor appear later, and
//! never misses one — what it read as it went is exactly the whole feed read again at the end, and
//! each job's events come in the order its transitions committed. On PostgreSQL events are
//! numbered after their commits by the sequencer, so this is where that numbering is tried.

use crate::kit::*;
use settle_core::history::EventKind;
use settle_core::scope::Scope;
use settle_store::*;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const WRITERS: usize = 8;
const JOBS_PER_WRITER: usize = 25;
const ACCOUNTS: usize = 4;

/// One writer: creates its jobs, and for each claims one due job, fails it (a refund), then
/// succeeds it with the same token (a reclaim) — four money-moving transitions that each lock an
/// account a neighbour writes to as well.
async fn writer(k: Arc<Kit>, w: usize) {
    for n in 0..JOBS_PER_WRITER {
        let account = acc(&format!("acct-{}", (w + n) % ACCOUNTS));
        k.store.create_job(new_job(&format!("j-{w}-{n}"), &account, 3)).await.unwrap();
        let claimed = k.store.claim(claim_req(&format!("w{w}"), 1)).await.unwrap();
        let Some(c) = claimed.into_iter().next() else { continue };
        match k.store.fail(&c.job.id, fail_sig(&c.lease_token, "TIMEOUT")).await {
            Ok(_) | Err(StoreError::LeaseLost(_)) => {}
            Err(e) => panic!("fail: {e}"),
        }
        k.store.succeed(&c.job.id, Reporter::of(Some(&c.lease_token)), None).await.unwrap();
    }
}

/// The reader: pages after its cursor until the writers are done and a page comes back empty.
/// Every page must start right after the cursor and run without a gap.
async fn tail(k: Arc<Kit>, writing: Arc<AtomicBool>) -> Vec<Event> {
    let mut seen: Vec<Event> = Vec::new();
    loop {
        let done = !writing.load(Ordering::SeqCst);
        let after = seen.last().map_or(0, |e| e.seq);
        let page = k.store.events(after, 100, &Scope::ALL).await.unwrap().rows;
        for (i, e) in page.iter().enumerate() {
            assert_eq!(e.seq, after + 1 + i as i64, "a gap, or an event below the cursor, after {after}");
        }
        if page.is_empty() && done {
            return seen;
        }
        seen.extend(page);
        tokio::task::yield_now().await;
    }
}

async fn a_tailing_reader_sees_every_event_once_in_order(engine: EngineKind) {
    let k = Kit::new(engine).await;
    for a in 0..ACCOUNTS {
        k.account(&format!("acct-{a}"), 1_000_000).await;
    }
    let k = Arc::new(k);
    let writing = Arc::new(AtomicBool::new(true));
    let reader = tokio::spawn(tail(k.clone(), writing.clone()));
    let writers: Vec<_> = (0..WRITERS).map(|w| tokio::spawn(writer(k.clone(), w))).collect();
    for w in writers {
        w.await.unwrap();
    }
    writing.store(false, Ordering::SeqCst);
    let tailed = reader.await.unwrap();
    let mut whole: Vec<Event> = Vec::new();
    loop {
        let after = whole.last().map_or(0, |e| e.seq);
        let page = k.store.events(after, 1000, &Scope::ALL).await.unwrap().rows;
        if page.is_empty() {
            break;
        }
        whole.extend(page);
    }
    let key = |e: &Event| (e.seq, e.kind, e.job_id.clone());
    assert_eq!(tailed.iter().map(key).collect::<Vec<_>>(), whole.iter().map(key).collect::<Vec<_>>());
    // Each job's transitions committed in this order (each waited for the one before on the job's
    // row), so its events must come in it.
    let mut by_job: HashMap<String, Vec<EventKind>> = HashMap::new();
    for e in &whole {
        if let Some(job) = &e.job_id {
            by_job.entry(job.clone()).or_default().push(e.kind);
        }
    }
    assert_eq!(by_job.len(), WRITERS * JOBS_PER_WRITER);
    let order = [EventKind::JobQueued, EventKind::JobClaimed, EventKind::JobRefunded, EventKind::JobReclaimed];
    for (job, kinds) in &by_job {
        let at: Vec<Option<usize>> = order.iter().map(|o| kinds.iter().position(|k| k == o)).collect();
        assert_eq!(at[0], Some(0), "{job}: created first: {kinds:?}");
        let present: Vec<usize> = at.into_iter().flatten().collect();
        assert!(present.is_sorted(), "{job}: events out of their commit order: {kinds:?}");
    }
    k.assert_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_a_tailing_reader_sees_every_event_once_in_order() {
    a_tailing_reader_sees_every_event_once_in_order(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_tailing_reader_sees_every_event_once_in_order() {
    a_tailing_reader_sees_every_event_once_in_order(EngineKind::Postgres).await;
}

/// Events a process committed and then died before numbering (PostgreSQL): nobody pokes the
/// sequencer for them, and no reader asks — the idle round of any process numbers them: this
/// release's (a stamp in `stamps_pending`, its events in `events`) and, during a rolling upgrade,
/// the previous release's (its events queued in `outbox_pending`: migration 0024).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_events_of_a_process_that_died_after_commit_are_numbered_by_the_idle_round() {
    let k = Kit::new(EngineKind::Postgres).await;
    k.account("a", 10).await;
    let wake = k.store.events_wake();
    for (release, sql) in [
        (
            "this release",
            "INSERT INTO events (stamp, pos, type, job_id, account_id, data, created_at) \
               VALUES (nextval('outbox_stamps'), 1, 'account.granted', NULL, 'a', '{\"amount\":1}', 0), \
                      (currval('outbox_stamps'), 2, 'account.adjusted', NULL, 'a', '{\"amount\":-1}', 0); \
             INSERT INTO stamps_pending (stamp, events, wakes) VALUES (currval('outbox_stamps'), 2, 0)",
        ),
        (
            "the previous release",
            "INSERT INTO outbox_pending (stamp, pos, type, job_id, account_id, data, created_at) \
               VALUES (nextval('outbox_stamps'), 1, 'account.granted', NULL, 'a', '{\"amount\":1}', 0), \
                      (currval('outbox_stamps'), 2, 'account.adjusted', NULL, 'a', '{\"amount\":-1}', 0)",
        ),
    ] {
        let before = k.event_types().await.len();
        let woken = wake.notified();
        tokio::pin!(woken);
        woken.as_mut().enable();
        k.raw_script(sql).await.unwrap();
        tokio::time::timeout(std::time::Duration::from_secs(5), woken)
            .await
            .unwrap_or_else(|_| panic!("an idle round numbered {release}'s events nobody asked for"));
        let events = k.event_types().await;
        assert_eq!(events.len(), before + 2, "{release}");
        assert_eq!(events[before..], ["account.granted", "account.adjusted"], "{release}");
    }
    let audit = k.store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

/// Operations that fail inside a batch after their events were numbered (a crash injected after
/// the outbox write, which rolls the operation back) and operations refused before (a charge the
/// balance cannot cover) give back the numbers they took: the creates that committed are numbered
/// one after another in the feed, one `job.queued` each, and the stored counters end where the
/// feed does (the audit).
async fn refused_operations_in_a_batch_leave_no_gap(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let poor = k.account("poor", 30).await;
    let before = k.store.events(0, 1000, &Scope::ALL).await.unwrap().rows.len() as i64;
    let k = Arc::new(k);
    let (mut created, mut crashed) = (0, 0);
    for round in 0..8 {
        // The next create to pass the point fails there, after its event was written.
        k.crasher.arm(settle_core::crash::CrashPoint::AfterOutbox);
        let creates: Vec<_> = (0..8)
            .map(|n| {
                let (k, poor) = (k.clone(), poor.clone());
                tokio::spawn(async move { k.store.create_job(new_job(&format!("j-{round}-{n}"), &poor, 1)).await })
            })
            .collect();
        for c in creates {
            match c.await.unwrap() {
                Ok(_) => created += 1,
                Err(StoreError::InsufficientCredits { .. }) => {}
                Err(StoreError::InjectedCrash(_)) => crashed += 1,
                Err(e) => panic!("create: {e}"),
            }
        }
    }
    assert_eq!(created, 30, "the balance covers exactly 30 one-credit jobs");
    assert!(crashed > 0);
    let events = k.store.events(before, 1000, &Scope::ALL).await.unwrap().rows;
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (before + 1..=before + created).collect::<Vec<i64>>());
    assert!(events.iter().all(|e| e.kind == EventKind::JobQueued));
    k.assert_clean().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn sqlite_refused_operations_in_a_batch_leave_no_gap() {
    refused_operations_in_a_batch_leave_no_gap(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_refused_operations_in_a_batch_leave_no_gap() {
    refused_operations_in_a_batch_leave_no_gap(EngineKind::Postgres).await;
}

/// SQLite: a batch's events go under one stamp past every stamp the store holds (docs/design/
/// batch-plan.md §16): past an older release's (minus its batch's first number, as §4a gave them),
/// past one copied from PostgreSQL (a sequence's, far ahead), and past a numbered stamp whose events
/// are gone (a damaged store the audit names) — so writing goes on, the feed whole and in order.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_batch_stamp_is_past_every_stamp_the_store_holds() {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let k = Kit::new(EngineKind::Sqlite).await;
    k.account("a", 10).await;
    let numbered = |stamp: &str| {
        format!(
            "INSERT INTO events (stamp, pos, type, job_id, account_id, data, created_at) \
               SELECT {stamp}, 1, 'account.granted', NULL, 'a', '{{\"amount\":1}}', 0 FROM counters WHERE name = 'outbox'; \
             INSERT INTO stamp_numbers (stamp, first_seq, last_seq) \
               SELECT {stamp}, value + 1, value + 1 FROM counters WHERE name = 'outbox'; \
             UPDATE counters SET value = value + 1 WHERE name = 'outbox'"
        )
    };
    let mut behind_our_back = Vec::new();
    for (n, stamp) in ["-(value + 1)", "5000"].into_iter().enumerate() {
        k.raw_script(&numbered(stamp)).await.unwrap();
        behind_our_back.push(k.store.events(0, 1000, &Scope::ALL).await.unwrap().rows.last().unwrap().seq);
        k.account(&format!("b{n}"), 5).await;
    }
    let events = k.store.events(0, 1000, &Scope::ALL).await.unwrap().rows;
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>(), "the feed is whole and in order");
    for seq in &behind_our_back {
        let e = &events[*seq as usize - 1];
        assert_eq!((e.kind.as_str(), e.account_id.as_str()), ("account.granted", "a"), "event {seq}");
    }
    let mut conn = sqlx::sqlite::SqliteConnectOptions::from_str(&k.url).unwrap().connect().await.unwrap();
    let stamps: Vec<i64> =
        sqlx::query_scalar("SELECT stamp FROM stamp_numbers ORDER BY first_seq").fetch_all(&mut conn).await.unwrap();
    conn.close().await.unwrap();
    let after = stamps.iter().position(|s| *s == 5000).expect("the copied stamp");
    assert_eq!(stamps[after + 1..].first(), Some(&5001), "the next batch's stamp follows the largest: {stamps:?}");
    assert!(stamps.iter().filter(|s| **s > 0).is_sorted(), "this release's stamps grow: {stamps:?}");
    let audit = k.store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);

    // A numbered stamp whose one event is gone, the one the next batch would take if only `events`
    // were asked: the audit names it, and writes with events go on under the stamp after it.
    k.raw_script(
        "INSERT INTO stamp_numbers (stamp, first_seq, last_seq) \
           SELECT (SELECT MAX(stamp) FROM events) + 1, value + 1, value + 1 FROM counters WHERE name = 'outbox'; \
         UPDATE counters SET value = value + 1 WHERE name = 'outbox'",
    )
    .await
    .unwrap();
    k.account("c", 5).await;
    let audit = k.store.audit(None).await.unwrap();
    let found: Vec<_> = audit.violations.iter().map(|v| v.message.as_str()).collect();
    assert!(found.len() == 1 && found[0].contains("but holds 0 events"), "{found:?}");
}
