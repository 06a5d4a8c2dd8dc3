//! PostgreSQL high availability, tried as an operator meets it (docs/operations/high-availability.md):
//! two `settle serve` processes on one pg_auto_failover formation (a primary, two synchronous
//! standbys) and `settle provider-sim`, clients running the seed-000 story, batch cancels and
//! withdrawals against both; under that load a standby is killed, then a planned switchover runs,
//! then the primary's PostgreSQL and keeper are killed with SIGKILL. Neither Settle process is
//! restarted. Afterwards: no `500` was ever answered (only `2xx`, `503` and the story's own
//! refusals); every write answered `2xx` is there; no job was claimed twice; the simulator executed
//! each withdrawal key with one send; `settle audit` is clean on the new primary. The time from each
//! fault to the first `2xx` write after it is printed.

use crate::common::{Process, call, free_port, wait_for};
use serde_json::{Value, json};
use settle_testkit::formation::Formation;
use std::collections::{BTreeMap, BTreeSet};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const GRANT: i64 = 1_000_000_000;
const ACCOUNTS: usize = 4;
const CLIENTS: usize = 6;

/// Every answer the clients got, and what was acknowledged.
#[derive(Default)]
struct Log {
    /// (when the request was sent, when answered, status, which server) of every write.
    writes: Vec<(Instant, Instant, u16, usize)>,
    /// Answers that are never right: a 5xx other than 503, or no answer at all.
    wrong: Vec<String>,
    /// Story jobs whose late success was acknowledged, and those whose failure was.
    succeeded: BTreeSet<String>,
    failed: BTreeSet<String>,
    /// Jobs whose create was acknowledged, and batch jobs whose cancel was.
    created: BTreeSet<String>,
    cancelled: BTreeSet<String>,
    /// Every claim answered: job → tokens.
    claims: BTreeMap<String, Vec<String>>,
    withdrawals: BTreeSet<String>,
}

struct Load {
    servers: Vec<String>,
    log: Mutex<Log>,
    stop: AtomicBool,
    started: Instant,
    /// Each client's iteration, for the report of where a fault found the load.
    progress: Vec<AtomicUsize>,
}

impl Load {
    /// Records an answer the story never accepts, with when it came: the test fails on it once the
    /// phase ends, with the formation's events beside it (a panic here would end only this client).
    fn wrong(&self, what: String) {
        let at = self.started.elapsed().as_secs_f64();
        self.log.lock().unwrap().wrong.push(format!("at {at:.1} s: {what}"));
    }

    fn iterations(&self) -> Vec<usize> {
        self.progress.iter().map(|p| p.load(Ordering::Relaxed)).collect()
    }

    /// After a phase: where each client was, and a failure with the monitor's events beside the
    /// wrong answers if there were any.
    fn checked(&self, formation: &Formation, phase: &str) {
        println!(
            "{phase} (at {:.1} s; the clients at iterations {:?})",
            self.started.elapsed().as_secs_f64(),
            self.iterations()
        );
        let wrong = self.log.lock().unwrap().wrong.clone();
        if !wrong.is_empty() {
            println!("the monitor's last events:\n{}", formation.events(40));
            panic!("answers that are never right, by the end of {phase}: {:#?}", &wrong[..wrong.len().min(10)]);
        }
    }

    /// A write, sent again (same body) after each `503` until another answer: a client that
    /// retries as Settle's `Retry-After` asks. Returns the final status and body.
    async fn write(&self, http: &reqwest::Client, server: usize, path: &str, body: Value) -> Option<(u16, Value)> {
        loop {
            let sent = Instant::now();
            let url = format!("{}{path}", self.servers[server]);
            let answer = http.post(&url).json(&body).send().await;
            let (status, value) = match answer {
                Ok(r) => {
                    let status = r.status().as_u16();
                    (status, r.json::<Value>().await.unwrap_or(Value::Null))
                }
                Err(e) => {
                    self.wrong(format!("POST {path}: no answer: {e}"));
                    return None;
                }
            };
            self.log.lock().unwrap().writes.push((sent, Instant::now(), status, server));
            if status >= 500 && status != 503 {
                self.wrong(format!("POST {path} {body} to server {server}: {status} {value}"));
                return None;
            }
            if status != 503 {
                return Some((status, value));
            }
            if self.stop.load(Ordering::Relaxed) {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }

    /// The seed-000 story: create, claim, fail `TIMEOUT` (not retryable), late success with the
    /// same lease token (a refund, then a reclaim).
    async fn story(&self, http: &reqwest::Client, client: usize, i: usize) {
        let server = (client + i) % self.servers.len();
        let id = format!("s{client}-{i}");
        let account = format!("acct{}", client % ACCOUNTS);
        let body = json!({"id": id, "account_id": account, "kind": "render", "cost": 10, "max_attempts": 1});
        let Some((status, answer)) = self.write(http, server, "/v1/jobs", body).await else { return };
        if !matches!(status, 200 | 201) {
            return self.wrong(format!("create {id} through server {server}: {status} {answer}"));
        }
        self.log.lock().unwrap().created.insert(id);
        let claim = json!({"worker": format!("w{client}"), "kinds": ["render"], "limit": 1, "lease_seconds": 600});
        let Some((status, claimed)) = self.write(http, server, "/v1/claims", claim).await else { return };
        if status != 200 {
            return self.wrong(format!("claim through server {server}: {status} {claimed}"));
        }
        let Some(job) = claimed["jobs"].as_array().and_then(|j| j.first()).cloned() else { return };
        let (job, token) = (job["id"].as_str().unwrap().to_owned(), job["lease_token"].as_str().unwrap().to_owned());
        self.log.lock().unwrap().claims.entry(job.clone()).or_default().push(token.clone());
        let fail = json!({"lease_token": token, "code": "TIMEOUT", "retryable": false});
        let Some((status, answer)) = self.write(http, server, &format!("/v1/jobs/{job}/fail"), fail).await else {
            return;
        };
        if status != 200 {
            return self
                .wrong(format!("fail {job} (claimed by client {client} through server {server}): {status} {answer}"));
        }
        self.log.lock().unwrap().failed.insert(job.clone());
        let late = json!({"lease_token": token});
        let Some((status, answer)) = self.write(http, server, &format!("/v1/jobs/{job}/succeed"), late).await else {
            return;
        };
        if status != 200 {
            return self.wrong(format!("late succeed {job} through server {server}: {status} {answer}"));
        }
        self.log.lock().unwrap().succeeded.insert(job);
    }

    /// A batch of three items nobody works on, cancelled at once: every item refunded.
    async fn batch(&self, http: &reqwest::Client, client: usize, i: usize) {
        let server = (client + i + 1) % self.servers.len();
        let id = format!("b{client}-{i}");
        let items: Vec<Value> = (0..3).map(|n| json!({"id": format!("i{n}"), "cost": 2})).collect();
        let body =
            json!({"id": id, "account_id": format!("acct{}", client % ACCOUNTS), "kind": "batch", "items": items});
        let Some((status, answer)) = self.write(http, server, "/v1/jobs", body).await else { return };
        if !matches!(status, 200 | 201) {
            return self.wrong(format!("create {id} through server {server}: {status} {answer}"));
        }
        self.log.lock().unwrap().created.insert(id.clone());
        let Some((status, answer)) = self.write(http, server, &format!("/v1/jobs/{id}/cancel"), json!({})).await else {
            return;
        };
        if status != 200 {
            return self.wrong(format!("cancel {id} through server {server}: {status} {answer}"));
        }
        self.log.lock().unwrap().cancelled.insert(id);
    }

    async fn withdrawal(&self, http: &reqwest::Client, client: usize, i: usize) {
        let id = format!("w{client}-{i}");
        let body = json!({"id": id, "account_id": format!("acct{}", client % ACCOUNTS), "amount": 7, "destination": format!("DE{i:020}")});
        let server = i % self.servers.len();
        let Some((status, w)) = self.write(http, server, "/v1/withdrawals", body).await else {
            return;
        };
        if !matches!(status, 200 | 201) {
            return self.wrong(format!("withdrawal {id} through server {server}: {status} {w}"));
        }
        self.log.lock().unwrap().withdrawals.insert(id);
    }

    /// `2xx` writes answered to requests sent after `t`; the first one's delay from `t`.
    fn first_ok_after(&self, t: Instant) -> Option<Duration> {
        let log = self.log.lock().unwrap();
        log.writes
            .iter()
            .filter(|(sent, _, status, _)| *sent >= t && (200..300).contains(status))
            .map(|(_, answered, _, _)| answered.duration_since(t))
            .min()
    }

    fn oks_after(&self, t: Instant) -> usize {
        let log = self.log.lock().unwrap();
        log.writes.iter().filter(|(sent, _, status, _)| *sent >= t && (200..300).contains(status)).count()
    }

    /// The longest time after `t` without a `2xx` write answered (from `t` to the first, and
    /// between any two).
    fn longest_gap(&self, t: Instant) -> Duration {
        let log = self.log.lock().unwrap();
        let mut answered: Vec<Instant> =
            log.writes.iter().filter(|w| w.1 >= t && (200..300).contains(&w.2)).map(|w| w.1).collect();
        answered.sort();
        let mut last = t;
        let mut longest = Duration::ZERO;
        for a in answered {
            longest = longest.max(a.duration_since(last));
            last = a;
        }
        longest
    }

    /// Whether server `server` answered a `2xx` write sent after `t`.
    fn served_after(&self, t: Instant, server: usize) -> bool {
        let log = self.log.lock().unwrap();
        log.writes.iter().any(|w| w.0 >= t && w.3 == server && (200..300).contains(&w.2))
    }
}

fn start_load(load: &Arc<Load>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..CLIENTS)
        .map(|client| {
            let load = load.clone();
            tokio::spawn(async move {
                // Longer than the server's own 60 s request limit: Settle answers first.
                let http = reqwest::Client::builder().timeout(Duration::from_secs(90)).build().unwrap();
                for i in 0.. {
                    if load.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    load.progress[client].store(i, Ordering::Relaxed);
                    match i % 5 {
                        0..=2 => load.story(&http, client, i).await,
                        3 => load.batch(&http, client, i).await,
                        _ => load.withdrawal(&http, client, i).await,
                    }
                }
            })
        })
        .collect()
}

/// Waits (polling) until `n` more `2xx` writes were answered to requests sent after `t`.
async fn until_oks(load: &Load, formation: &Formation, t: Instant, n: usize, secs: u64, what: &str) -> Duration {
    let deadline = t + Duration::from_secs(secs);
    while load.oks_after(t) < n {
        if Instant::now() >= deadline {
            load.checked(formation, what);
            panic!(
                "{what}: only {} writes acknowledged in {secs} s\nthe monitor's last events:\n{}",
                load.oks_after(t),
                formation.events(40)
            );
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    load.first_ok_after(t).expect("a 2xx")
}

fn serve(url: &str, config: &std::path::Path, provider: u16, dir: &std::path::Path) -> (Child, String) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--db", url, "--config"])
        .arg(config)
        .current_dir(dir)
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .env("SETTLE_PROVIDER_URL", format!("http://127.0.0.1:{provider}"))
        .stdout(Stdio::null())
        .stderr(Stdio::from(std::fs::File::create(dir.join(format!("serve-{port}.log"))).unwrap()))
        .spawn()
        .unwrap();
    wait_for(port);
    (child, format!("http://127.0.0.1:{port}"))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settle_rides_out_a_standby_loss_a_switchover_and_a_primary_killed_under_load() {
    let mut formation = Formation::start();
    let url = formation.url();
    let keep = std::env::var_os("SETTLE_KEEP_FORMATION").is_some();
    let dir = tempfile::Builder::new().disable_cleanup(keep).tempdir().unwrap();
    if keep {
        eprintln!("the servers' logs are kept at {}", dir.path().display());
    }
    let sim_port = free_port();
    let _sim = Process(
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["provider-sim", "--listen", &format!("127.0.0.1:{sim_port}"), "--seed", "7", "--lose-answer", "0.3"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(sim_port);
    let config = dir.path().join("settle.toml");
    std::fs::write(
        &config,
        "[kinds.withdrawal]\nlease_seconds = 5\nconfirm_window_seconds = 5\nbackoff_ms_base = 100\n\n\
         [provider]\ntimeout_ms = 1000\nconnect_timeout_ms = 500\n\n\
         [loops]\npayout_every_ms = 100\nreconcile_every_ms = 200\nrescue_every_ms = 200\n",
    )
    .unwrap();
    let (a, base_a) = serve(&url, &config, sim_port, dir.path());
    let (b, base_b) = serve(&url, &config, sim_port, dir.path());
    let (_a, _b) = (Process(a), Process(b));
    let http = reqwest::Client::new();
    for n in 0..ACCOUNTS {
        let id = format!("acct{n}");
        assert_eq!(call(&http, "POST", &format!("{base_a}/v1/accounts"), Some(json!({"id": id}))).await.0, 201);
        let grant = json!({"id": format!("g{n}"), "amount": GRANT});
        assert_eq!(call(&http, "POST", &format!("{base_b}/v1/accounts/{id}/grants"), Some(grant)).await.0, 201);
    }
    let load = Arc::new(Load {
        servers: vec![base_a.clone(), base_b.clone()],
        log: Mutex::default(),
        stop: AtomicBool::new(false),
        started: Instant::now(),
        progress: (0..CLIENTS).map(|_| AtomicUsize::new(0)).collect(),
    });
    no_acknowledgement_without_a_standby(&formation, &url).await;
    let tasks = start_load(&load);
    until_oks(&load, &formation, Instant::now(), 100, 60, "writes before any fault").await;
    load.checked(&formation, "writes before any fault");

    // 1. A standby lost: the other one keeps a second copy of every commit, so writes go on.
    let standby = settled_secondaries(&formation)[0];
    let t = Instant::now();
    formation.kill(standby);
    until_oks(&load, &formation, t, 100, 60, "writes with a standby down").await;
    let gap = load.longest_gap(t).as_secs_f64();
    load.checked(
        &formation,
        &format!("standby node{standby} killed (SIGKILL): longest time without a 2xx write {gap:.2} s"),
    );
    formation.run(standby);
    formation.wait(120, "two secondaries again", |s| {
        s.iter().filter(|n| n.reported == "secondary" && n.assigned == "secondary").count() == 2
    });

    // 2. A planned switchover, once both standbys have caught up (formation.rs, `wait_caught_up`).
    formation.wait_caught_up(2, 120);
    let before = formation.primary().expect("a primary");
    let t = Instant::now();
    formation.switchover();
    formation.wait(240, "a new primary", |s| {
        s.iter().any(|n| {
            n.reported == n.assigned
                && (n.reported == "primary" || n.reported == "wait_primary")
                && n.name != format!("node{before}")
        })
    });
    until_oks(&load, &formation, t, 100, 240, "writes after the switchover").await;
    let gap = load.longest_gap(t).as_secs_f64();
    load.checked(&formation, &format!("switchover from node{before}: longest time without a 2xx write {gap:.2} s"));

    // 3. The primary's PostgreSQL and keeper killed (SIGKILL), once the old primary is back as a
    // standby (two standbys again, so the promotion has a candidate that is caught up).
    settled_secondaries(&formation);
    let primary = formation.primary().expect("a primary");
    let t = Instant::now();
    formation.kill(primary);
    // When the monitor has another node take writes: the formation's part of the outage.
    let promoted = loop {
        let writable = tokio::task::block_in_place(|| formation.writable());
        if writable.is_some_and(|n| n != primary) {
            break t.elapsed();
        }
        assert!(t.elapsed() < Duration::from_secs(180), "no node was promoted in 180 s:\n{}", formation.events(40));
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    let first = until_oks(&load, &formation, t, 100, 180, "writes after the primary was killed").await;
    load.checked(
        &formation,
        &format!(
            "primary node{primary} killed (SIGKILL): a standby promoted after {:.2} s, the first 2xx write after {:.2} s",
            promoted.as_secs_f64(),
            first.as_secs_f64()
        ),
    );
    // Both processes came back by themselves, and LISTEN for wake-ups on the new primary.
    let new_primary = formation.writable().expect("a primary after the failover");
    settle_testkit::until_listening(&formation.node_url(new_primary), 2).await;
    for server in 0..2 {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !load.served_after(t, server) {
            assert!(Instant::now() < deadline, "settle serve #{server} served no write after the failover");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    load.stop.store(true, Ordering::Relaxed);
    for task in tasks {
        task.await.unwrap();
    }
    check(&load, &http, &base_a, &base_b, sim_port, &url).await;
}

/// Waits until the formation has a primary and two settled secondaries; returns the secondaries.
fn settled_secondaries(formation: &Formation) -> Vec<usize> {
    formation.wait(240, "a primary and two secondaries", |s| {
        let settled = |state: &str| s.iter().filter(|n| n.reported == state && n.assigned == state).count();
        settled("primary") == 1 && settled("secondary") == 2
    });
    formation.secondaries()
}

/// With both standbys stopped, a COMMIT waits — it is not acknowledged — even when Settle's
/// statement timeout is short: a timeout that cancelled the wait for the standby would make
/// PostgreSQL answer success for a commit only the primary holds (decision 0024). Once a standby
/// answers again, the commit completes and is acknowledged.
async fn no_acknowledgement_without_a_standby(formation: &Formation, url: &str) {
    use settle_store::{NewAccount, SYSTEM_ACTOR, SqlStore, Store, StoreOptions};
    let options = StoreOptions { pg_statement_timeout: Duration::from_millis(200), ..StoreOptions::default() };
    let store = Arc::new(SqlStore::open(url, options).await.unwrap());
    let standbys = settled_secondaries(formation);
    for &n in &standbys {
        formation.pause(n);
    }
    let writer = store.clone();
    let write = tokio::spawn(async move {
        let id = settle_core::ids::AccountId::parse("unacknowledged").unwrap();
        writer
            .create_account(
                NewAccount { id, overdraft_limit: settle_core::Credits::ZERO, max_running: None },
                SYSTEM_ACTOR,
            )
            .await
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    let early = write.is_finished();
    for &n in &standbys {
        formation.resume(n);
    }
    if early {
        panic!("a commit was answered while no standby had it: {:?}", write.await);
    }
    let answered = tokio::time::timeout(Duration::from_secs(60), write).await.expect("the commit completes").unwrap();
    assert!(answered.is_ok(), "{answered:?}");
}

/// What must hold afterwards, read through both processes (neither was restarted).
async fn check(load: &Load, http: &reqwest::Client, a: &str, b: &str, sim_port: u16, url: &str) {
    let log = std::mem::take(&mut *load.log.lock().unwrap());
    assert!(log.wrong.is_empty(), "answers that are never right: {:#?}", &log.wrong[..log.wrong.len().min(10)]);
    for (job, tokens) in &log.claims {
        assert_eq!(tokens.len(), 1, "job {job} was claimed more than once: {tokens:?}");
    }
    for id in &log.created {
        let (status, job) = call(http, "GET", &format!("{a}/v1/jobs/{id}"), None).await;
        assert_eq!(status, 200, "acknowledged job {id} is missing: {job}");
        if log.succeeded.contains(id) {
            assert_eq!((&job["state"], &job["net"]), (&json!("succeeded"), &json!(-10)), "{job}");
        } else if log.failed.contains(id) {
            assert!(job["state"] == "dead" || job["state"] == "succeeded", "{job}");
        }
        if log.cancelled.contains(id) {
            assert_eq!((&job["state"], &job["net"]), (&json!("cancelled"), &json!(0)), "{job}");
        }
        let (_, attempts) = call(http, "GET", &format!("{b}/v1/jobs/{id}/attempts"), None).await;
        assert!(attempts["attempts"].as_array().unwrap().len() <= 1, "{id}: {attempts}");
    }
    // Every acknowledged withdrawal ends sent once or refused, never sent twice.
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut settled = Vec::new();
    for id in &log.withdrawals {
        loop {
            let (status, w) = call(http, "GET", &format!("{b}/v1/withdrawals/{id}"), None).await;
            assert_eq!(status, 200, "acknowledged withdrawal {id} is missing: {w}");
            if w["state"] == "succeeded" || w["state"] == "dead" {
                settled.push(w);
                break;
            }
            assert!(Instant::now() < deadline, "withdrawal {id} did not settle: {w}");
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let (_, executed) = call(http, "GET", &format!("http://127.0.0.1:{sim_port}/v1/executed"), None).await;
    let transfers = executed["transfers"].as_array().unwrap();
    for t in transfers {
        assert_eq!(t["sends"], 1, "a withdrawal key was sent more than once: {t}");
    }
    for w in &settled {
        let sent = transfers.iter().filter(|t| t["key"] == w["idempotency_key"]).count();
        let expected = usize::from(w["state"] == "succeeded");
        assert_eq!(sent, expected, "{w}");
    }
    let audit = Command::new(env!("CARGO_BIN_EXE_settle")).args(["audit", "--db", url]).output().unwrap();
    assert!(
        audit.status.success(),
        "audit on the new primary: {}{}",
        String::from_utf8_lossy(&audit.stdout),
        String::from_utf8_lossy(&audit.stderr)
    );
    println!(
        "{} writes answered ({} 2xx, {} 503); {} jobs, {} withdrawals acknowledged",
        log.writes.len(),
        log.writes.iter().filter(|w| (200..300).contains(&w.2)).count(),
        log.writes.iter().filter(|w| w.2 == 503).count(),
        log.created.len(),
        log.withdrawals.len()
    );
}
