//! Many OS processes, one PostgreSQL ledger: 4 `settle-contention` processes work 2,000 jobs over
//! 20 accounts at once, sending every kind of signal and duplicates of each. Afterwards the ledger
//! must be exact: every job ended (or deliberately `unknown`), `settle audit` clean, each balance
//! equal to grants minus the items whose net is −cost, no item refunded or reclaimed twice, one
//! winner per claim, and no job ever held under two unexpired leases at once. Meanwhile this process
//! tails the event feed the four write to (each numbering its own events after its commits,
//! decision 0021): it never meets a gap or an event below its cursor, and what it read as it went is
//! the whole feed read again at the end.

use settle_core::Credits;
use settle_core::history::AttemptResult;
use settle_core::ids::*;
use settle_core::item::ItemState;
use settle_core::job::JobState;
use settle_core::ledger::EntryKind;
use settle_store::*;
use std::collections::{HashMap, HashSet};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

const PROCESSES: usize = 4;
const JOBS: usize = 2_000;
const ACCOUNTS: usize = 20;
const GRANT: i64 = 1_000_000;
const LEASE_MICROS: i64 = 2_000_000;

fn settle(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_settle")).args(args).env_remove("SETTLE_DATABASE_URL").output().unwrap()
}

async fn all_jobs(store: &SqlStore) -> Vec<Job> {
    let mut out = Vec::new();
    let mut page = Page { after: 0, limit: 1000 };
    loop {
        let p = store.jobs(&JobFilter::ALL, page).await.unwrap();
        out.extend(p.rows);
        match p.next_after {
            Some(a) => page.after = a,
            None => return out,
        }
    }
}

/// Pages the feed after its cursor until `writing` is off and a page comes back empty; every page
/// must start right after the cursor and run without a gap.
async fn tail_events(store: Arc<SqlStore>, writing: Arc<AtomicBool>) -> Vec<(i64, String, Option<String>)> {
    let mut seen: Vec<(i64, String, Option<String>)> = Vec::new();
    loop {
        let done = !writing.load(Ordering::SeqCst);
        let after = seen.last().map_or(0, |e| e.0);
        let page = store.events(after, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
        for (i, e) in page.iter().enumerate() {
            assert_eq!(e.seq, after + 1 + i as i64, "a gap, or an event below the cursor, after {after}");
        }
        if page.is_empty() && done {
            return seen;
        }
        seen.extend(page.into_iter().map(|e| (e.seq, e.kind.as_str().to_owned(), e.job_id)));
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn four_processes_share_one_postgres_ledger() {
    let url = settle_testkit::fresh_database().await;
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    let accounts: Vec<AccountId> = (0..ACCOUNTS).map(|a| AccountId::parse(&format!("acct-{a}")).unwrap()).collect();
    for a in &accounts {
        store
            .create_account(
                NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: None },
                settle_store::SYSTEM_ACTOR,
            )
            .await
            .unwrap();
        store
            .grant(
                a,
                NewGrant {
                    id: RefId::parse(&format!("grant-{a}")).unwrap(),
                    amount: Credits::new(GRANT),
                    reason: None,
                    expires_at: None,
                    priority: None,
                },
                settle_store::SYSTEM_ACTOR,
            )
            .await
            .unwrap();
    }
    let new_job = |n: usize| {
        let items: Vec<NewItem> = if n.is_multiple_of(3) {
            (0..3)
                .map(|i| NewItem {
                    id: ItemId::parse(&format!("frame-{i}")).unwrap(),
                    price: Price::Cost(Credits::new(1 + (n % 7) as i64)),
                })
                .collect()
        } else {
            vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(5 + (n % 40) as i64)) }]
        };
        NewJob {
            id: JobId::parse(&format!("job-{n}")).unwrap(),
            account_id: accounts[n % ACCOUNTS].clone(),
            kind: JobKind::parse("render").unwrap(),
            items,
            payload: serde_json::json!({ "n": n }),
            max_attempts: None,
            refund_on: None,
            not_before: None,
            priority: None,
            requires: Default::default(),
        }
    };
    for n in 0..JOBS {
        assert!(!store.create_job(new_job(n)).await.unwrap().replayed);
    }
    let writing = Arc::new(AtomicBool::new(true));
    let reader = tokio::spawn(tail_events(store.clone(), writing.clone()));
    // Spawn the workers while duplicate creates arrive.
    let children: Vec<_> = (0..PROCESSES)
        .map(|p| {
            Command::new(env!("CARGO_BIN_EXE_settle-contention"))
                .args([url.as_str(), &format!("proc-{p}"), &(p as u64 * 7919 + 1).to_string(), &JOBS.to_string()])
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    for n in (0..JOBS).step_by(10) {
        assert!(store.create_job(new_job(n)).await.unwrap().replayed, "a re-sent create replays");
    }
    let mut claims: HashMap<(String, u32), String> = HashMap::new();
    let mut claims_per_job: HashMap<String, u32> = HashMap::new();
    for child in children {
        // Waited for off the runtime's threads, so the reader goes on meanwhile.
        let out = tokio::task::spawn_blocking(move || child.wait_with_output()).await.unwrap().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "a worker failed: {}\n{}",
            String::from_utf8_lossy(&out.stderr),
            stdout.lines().last().unwrap_or("")
        );
        assert!(stdout.lines().any(|l| l.starts_with("done ")), "worker did not finish");
        for line in stdout.lines().filter(|l| l.starts_with("claim ")) {
            let parts: Vec<&str> = line.split_whitespace().collect();
            let (job, attempt, token) = (parts[1].to_owned(), parts[2].parse::<u32>().unwrap(), parts[3].to_owned());
            assert!(claims.insert((job.clone(), attempt), token).is_none(), "two winners for {job} attempt {attempt}");
            *claims_per_job.entry(job).or_default() += 1;
        }
    }
    writing.store(false, Ordering::SeqCst);
    let tailed = reader.await.unwrap();
    let mut whole = Vec::new();
    loop {
        let after = whole.last().map_or(0, |e: &(i64, String, Option<String>)| e.0);
        let page = store.events(after, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
        if page.is_empty() {
            break;
        }
        whole.extend(page.into_iter().map(|e| (e.seq, e.kind.as_str().to_owned(), e.job_id)));
    }
    assert!(whole.len() > JOBS, "every job's events are in the feed");
    assert!(
        tailed == whole,
        "the feed as tailed ({} events) is not the feed read whole ({})",
        tailed.len(),
        whole.len()
    );
    // Every job ended, or was deliberately left unknown.
    let jobs = all_jobs(&store).await;
    assert_eq!(jobs.len(), JOBS);
    let mut by_state: HashMap<&str, usize> = HashMap::new();
    for j in &jobs {
        assert!(j.state.is_terminal() || j.state == JobState::Unknown, "{} left {:?}", j.id, j.state);
        *by_state.entry(j.state.as_str()).or_default() += 1;
    }
    println!("final states: {by_state:?}; claims {}", claims.len());
    for s in ["succeeded", "dead", "cancelled", "unknown"] {
        assert!(by_state.get(s).copied().unwrap_or(0) > 0, "no job ended {s}: the workload did not exercise it");
    }
    // settle audit, as an operator would run it.
    let audit = settle(&["audit", "--db", &url]);
    assert!(audit.status.success(), "{}", String::from_utf8_lossy(&audit.stdout));
    // Balances: grants minus the cost of every item whose net is −cost.
    for a in &accounts {
        let owed: i64 = jobs
            .iter()
            .filter(|j| j.account_id == a.as_str())
            .flat_map(|j| j.items.iter())
            .filter(|i| matches!(i.state, ItemState::Charged | ItemState::Succeeded | ItemState::Reclaimed))
            .map(|i| i.cost.get())
            .sum();
        assert_eq!(store.account(a).await.unwrap().balance.get(), GRANT - owed, "balance of {a}");
        // No item with two refunds or two reclaims.
        let mut seen = HashSet::new();
        let mut page = Page { after: 0, limit: 1000 };
        loop {
            let p = store.ledger(a, page).await.unwrap();
            for e in &p.rows {
                if matches!(e.kind, EntryKind::Refund | EntryKind::Reclaim | EntryKind::Charge) {
                    assert!(
                        seen.insert((e.job_id.clone(), e.item_id.clone(), e.kind)),
                        "double {:?} for {:?}/{:?}",
                        e.kind,
                        e.job_id,
                        e.item_id
                    );
                }
            }
            match p.next_after {
                Some(n) => page.after = n,
                None => break,
            }
        }
    }
    // Leases: every attempt was claimed by exactly one process, and a job's next attempt began only
    // after the previous one ended — or, for a lost worker, after its lease had expired.
    let mut lease_expired = 0;
    for j in &jobs {
        let attempts = store.attempts(&j.id).await.unwrap();
        lease_expired += attempts.iter().filter(|a| a.result == Some(AttemptResult::LeaseExpired)).count();
        assert_eq!(
            attempts.len() as u32,
            claims_per_job.get(j.id.as_str()).copied().unwrap_or(0),
            "claims of {}",
            j.id
        );
        for pair in attempts.windows(2) {
            let (a, b) = (&pair[0], &pair[1]);
            let free_from = match a.result {
                Some(AttemptResult::LeaseExpired) => a.started_at.micros() + LEASE_MICROS,
                Some(_) => a.finished_at.expect("closed attempts have an end").micros(),
                None => panic!("{}: attempt {} still open while attempt {} started", j.id, a.attempt_no, b.attempt_no),
            };
            assert!(
                b.started_at.micros() >= free_from,
                "{}: attempt {} began under attempt {}'s lease",
                j.id,
                b.attempt_no,
                a.attempt_no
            );
        }
    }
    assert!(lease_expired > 0, "no lease expired: the workload did not exercise the rescuer");
    let reclaimed = jobs.iter().flat_map(|j| j.items.iter()).filter(|i| i.state == ItemState::Reclaimed).count();
    assert!(reclaimed > 0, "no refund was reclaimed: the workload did not exercise late success");
}

#[test]
fn two_processes_starting_at_once_share_one_schema() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = rt.block_on(settle_testkit::fresh_database());
    let spawn = || Command::new(env!("CARGO_BIN_EXE_settle")).args(["audit", "--db", &url]).output();
    let (a, b) = std::thread::scope(|s| {
        let a = s.spawn(spawn);
        let b = s.spawn(spawn);
        (a.join().unwrap().unwrap(), b.join().unwrap().unwrap())
    });
    for out in [&a, &b] {
        assert!(
            out.status.success(),
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    rt.block_on(async {
        use sqlx::{ConnectOptions, Connection, Row};
        use std::str::FromStr;
        let mut conn = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        let applied: i64 =
            sqlx::query("SELECT COUNT(*) FROM _sqlx_migrations").fetch_one(&mut conn).await.unwrap().get(0);
        let files = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/../settle-store/migrations/postgres"))
            .unwrap()
            .count();
        assert_eq!(applied, files as i64, "every migration applied exactly once");
        let ledgers: i64 = sqlx::query("SELECT COUNT(*) FROM pg_tables WHERE tablename = 'ledger_entries'")
            .fetch_one(&mut conn)
            .await
            .unwrap()
            .get(0);
        assert_eq!(ledgers, 1);
        conn.close().await.unwrap();
    });
}

#[test]
fn demo_audit_and_ledger_run_on_postgres() {
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = rt.block_on(settle_testkit::fresh_database());
    let demo = settle(&["demo", "--db", &url]);
    let out = String::from_utf8_lossy(&demo.stdout);
    assert!(demo.status.success(), "{out}{}", String::from_utf8_lossy(&demo.stderr));
    assert!(out.contains("audit: clean"));
    assert!(settle(&["audit", "--db", &url]).status.success());
    let ledger = settle(&["ledger", "alice", "--db", &url]);
    assert!(String::from_utf8_lossy(&ledger.stdout).contains("balance 405"));
}
