//! Faults below Settle, tried as a user meets them: the PostgreSQL server killed (`-m immediate`)
//! and restarted under load, and the SQLite database's disk filling up under load. Either way
//! Settle answers `503` (never `500`) while the database is away, loses nothing it acknowledged,
//! recovers by itself, and the ledger stays audit-clean.

use crate::common::{call, serve};
use serde_json::{Value, json};
use std::collections::BTreeMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::Mutex;

const GRANT: i64 = 100_000_000;

/// What one create was answered: an HTTP status, or no answer at all (connection cut).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Answer {
    Status(u16),
    NoAnswer,
}

struct Load {
    /// job id → (cost, every answer it got, in order)
    sent: Mutex<BTreeMap<String, (i64, Vec<Answer>)>>,
    stop: AtomicBool,
}

fn job_body(id: &str, cost: i64) -> Value {
    json!({"id": id, "account_id": "a", "kind": "render", "items": [{"id": "frame", "cost": cost}]})
}

async fn create(http: &reqwest::Client, base: &str, id: &str, cost: i64) -> Answer {
    match http.post(format!("{base}/v1/jobs")).json(&job_body(id, cost)).send().await {
        Ok(r) => Answer::Status(r.status().as_u16()),
        Err(_) => Answer::NoAnswer,
    }
}

/// `clients` tasks creating jobs with fresh ids until `load.stop`.
fn start_load(base: &str, clients: usize, load: &Arc<Load>) -> Vec<tokio::task::JoinHandle<()>> {
    (0..clients)
        .map(|c| {
            let (base, load) = (base.to_owned(), load.clone());
            tokio::spawn(async move {
                let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
                for i in 0.. {
                    if load.stop.load(Ordering::Relaxed) {
                        return;
                    }
                    let (id, cost) = (format!("c{c}-{i}"), 1 + (i % 7));
                    let answer = create(&http, &base, &id, cost).await;
                    load.sent.lock().await.insert(id, (cost, vec![answer]));
                    if answer != Answer::Status(201) {
                        // Do not spin while the database is away.
                        tokio::time::sleep(Duration::from_millis(20)).await;
                    }
                }
            })
        })
        .collect()
}

async fn count(load: &Load, answer: Answer) -> usize {
    load.sent.lock().await.values().filter(|(_, a)| a.contains(&answer)).count()
}

/// Waits until `cond` holds, at most `secs`; panics with `what` otherwise.
async fn until<F: AsyncFn() -> bool>(secs: u64, what: &str, cond: F) {
    let deadline = Instant::now() + Duration::from_secs(secs);
    while !cond().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// After the fault: every create was answered, and only `201` or `503` — never a `500`, never a
/// cut connection; every job not acknowledged is sent again with the same body (again after a
/// `503`, as a client would) and answers `201` (it was not written) or `200` (it was, and this is
/// its replay); every
/// acknowledged job is there; the balance is the grant minus every job's cost, exactly.
async fn check_nothing_lost(http: &reqwest::Client, s: &crate::common::Serve, load: &Load) {
    let base = &s.base;
    let mut sent = load.sent.lock().await;
    for (id, (_, answers)) in sent.iter() {
        for a in answers {
            assert!(matches!(a, Answer::Status(201 | 503)), "{id} was answered {a:?}");
        }
    }
    let mut total = 0;
    for (id, (cost, answers)) in sent.iter_mut() {
        total += *cost;
        if answers.contains(&Answer::Status(201)) {
            let (status, job) = call(http, "GET", &format!("{base}/v1/jobs/{id}"), None).await;
            assert_eq!(status, 200, "acknowledged job {id} is missing: {job}");
            assert_eq!(job["state"], "queued", "{job}");
        } else {
            // Sent again as a client does: a 503 says "try again" (the store may still be settling
            // what the full disk left, a checkpoint or a reopened writer), so a few more tries,
            // spaced out, before the answer must be 201 (not written) or 200 (written: a replay).
            let mut again = create(http, base, id, *cost).await;
            for _ in 0..20 {
                if again != Answer::Status(503) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
                again = create(http, base, id, *cost).await;
            }
            if !matches!(again, Answer::Status(200 | 201)) {
                let (_, body) = call(http, "POST", &format!("{base}/v1/jobs"), Some(job_body(id, *cost))).await;
                let log = s.log();
                let tail: Vec<&str> = log.lines().rev().take(40).collect();
                panic!(
                    "{id} sent again: {again:?} {body}\nthe server's last log lines, newest first:\n{}",
                    tail.join("\n")
                );
            }
            answers.push(again);
        }
    }
    let (_, account) = call(http, "GET", &format!("{base}/v1/accounts/a"), None).await;
    assert_eq!(account["balance"], GRANT - total, "{account}");
}

/// Once the fault is undone: 100 more creates are acknowledged (Settle recovered by itself), the
/// load stops, nothing acknowledged is lost, the server stops cleanly and the audit is clean.
async fn recovers_losing_nothing(
    load: &Load,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    acknowledged_before: usize,
    http: &reqwest::Client,
    s: &mut crate::common::Serve,
    db: &str,
) {
    until(60, "creates after the fault was undone", || async {
        count(load, Answer::Status(201)).await >= acknowledged_before + 100
    })
    .await;
    load.stop.store(true, Ordering::Relaxed);
    for t in tasks {
        t.await.unwrap();
    }
    check_nothing_lost(http, s, load).await;
    assert!(s.stop(), "settle serve did not stop cleanly");
    audit(db);
}

async fn open_account(http: &reqwest::Client, base: &str) {
    assert_eq!(call(http, "POST", &format!("{base}/v1/accounts"), Some(json!({"id": "a"}))).await.0, 201);
    let grant = json!({"id": "g", "amount": GRANT});
    assert_eq!(call(http, "POST", &format!("{base}/v1/accounts/a/grants"), Some(grant)).await.0, 201);
}

fn audit(db: &str) {
    let out = Command::new(env!("CARGO_BIN_EXE_settle")).args(["audit", "--db", db]).output().unwrap();
    assert!(
        out.status.success(),
        "audit: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_killed_and_restarted_under_load() {
    let pg = settle_testkit::Cluster::start();
    let db = pg.url();
    let mut s = serve(Some(&db), None);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
    open_account(&http, &s.base).await;

    let load = Arc::new(Load { sent: Mutex::new(BTreeMap::new()), stop: AtomicBool::new(false) });
    let tasks = start_load(&s.base, 8, &load);
    until(60, "creates before the kill", || async { count(&load, Answer::Status(201)).await >= 100 }).await;
    pg.kill();
    until(60, "503s while the database is down", || async { count(&load, Answer::Status(503)).await >= 20 }).await;
    // The process stays up and says the database is away.
    let (ready, _) = call(&http, "GET", &format!("{}/readyz", s.base), None).await;
    assert_eq!(ready, 503);
    let acknowledged_before = count(&load, Answer::Status(201)).await;
    pg.up();
    recovers_losing_nothing(&load, tasks, acknowledged_before, &http, &mut s, &db).await;
}

/// Mounts a tmpfs of `mb` MiB at `dir` (root only); unmounts on drop.
struct Tmpfs(std::path::PathBuf);

impl Tmpfs {
    fn mount(dir: &std::path::Path, mb: u32) -> Tmpfs {
        let st = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={mb}m"), "settle-test", dir.to_str().unwrap()])
            .status()
            .unwrap();
        assert!(st.success(), "mount -t tmpfs failed");
        Tmpfs(dir.to_owned())
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Fills the file system holding `path` with one file until the disk is full.
fn fill(path: &std::path::Path) {
    use std::io::Write;
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0u8; 64 * 1024];
    while f.write_all(&chunk).is_ok() {}
    // The last partial chunk, byte by byte in small pieces, so nothing is left over.
    while f.write_all(&chunk[..512]).is_ok() {}
    let _ = f.sync_all();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_on_a_disk_that_fills_up() {
    let root = Command::new("id").arg("-u").output().map(|o| o.stdout == b"0\n").unwrap_or(false);
    if !root {
        // A real full disk needs a file system of its own: a tmpfs, which only root may mount.
        assert!(std::env::var("CI").is_err(), "under CI this test must run as root (it mounts a tmpfs)");
        eprintln!("SKIPPED sqlite_on_a_disk_that_fills_up: not root, cannot mount a tmpfs");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("disk");
    std::fs::create_dir(&mnt).unwrap();
    // Room for the database and the WAL the load writes before the fill (tens of MB; under a steady
    // load the WAL grows to ~200 MB: engine/sqlite.rs), so that the filler, not the WAL, is what
    // fills the disk.
    let _tmpfs = Tmpfs::mount(&mnt, 256);
    let db = format!("sqlite://{}", mnt.join("settle.db").display());
    let mut s = serve(Some(&db), None);
    let http = reqwest::Client::builder().timeout(Duration::from_secs(20)).build().unwrap();
    open_account(&http, &s.base).await;

    let load = Arc::new(Load { sent: Mutex::new(BTreeMap::new()), stop: AtomicBool::new(false) });
    let tasks = start_load(&s.base, 8, &load);
    until(60, "creates before the disk fills", || async { count(&load, Answer::Status(201)).await >= 100 }).await;
    let filler = mnt.join("filler");
    fill(&filler);
    until(60, "503s on the full disk", || async { count(&load, Answer::Status(503)).await >= 20 }).await;
    let (health, _) = call(&http, "GET", &format!("{}/healthz", s.base), None).await;
    assert_eq!(health, 200, "the process is alive while its disk is full");
    let acknowledged_before = count(&load, Answer::Status(201)).await;
    // The operator frees a little (8 MiB): less than the WAL took while the disk filled, so the
    // store recovers only if the room goes to its checkpoint first, not to more WAL.
    let f = std::fs::OpenOptions::new().write(true).open(&filler).unwrap();
    let len = f.metadata().unwrap().len();
    f.set_len(len.saturating_sub(8 << 20)).unwrap();
    drop(f);
    recovers_losing_nothing(&load, tasks, acknowledged_before, &http, &mut s, &db).await;
    let path = mnt.join("settle.db");
    let check = Command::new("python3")
        .args([
            "-c",
            "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('PRAGMA integrity_check').fetchone()[0])",
        ])
        .arg(&path)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&check.stdout).trim(), "ok");
}
