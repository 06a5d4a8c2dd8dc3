//! Operations as an operator runs them (issue 42): `settle backup` of a store under load,
//! `settle restore` raising the epoch so receivers keep the events numbered again, and migrations
//! as an explicit step (`settle migrate`, `settle serve --no-migrate`).

use crate::common::{call, serve};
use serde_json::{Value, json};
use std::process::Command;

fn settle(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_settle")).args(args).env_remove("SETTLE_DATABASE_URL").output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

async fn events(http: &reqwest::Client, base: &str) -> Vec<Value> {
    let (status, page) = call(http, "GET", &format!("{base}/v1/events?after=0&limit=1000"), None).await;
    assert_eq!(status, 200, "{page}");
    page["events"].as_array().unwrap().clone()
}

/// A backup taken while requests write is one consistent state (the audit is clean, the events
/// gap-free); restored, the store numbers new events from where the backup stood under epoch 2,
/// and the events it held keep epoch 1 — what a receiver saw is still recognised, what it sees now
/// is new.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backup_under_writes_restores_consistent_and_the_epoch_is_raised() {
    let dir = tempfile::tempdir().unwrap();
    let db = format!("sqlite://{}", dir.path().join("live.db").display());
    let server = serve(Some(&db), None);
    let (base, http) = (server.base.clone(), reqwest::Client::new());
    assert_eq!(call(&http, "POST", &format!("{base}/v1/accounts"), Some(json!({"id": "a"}))).await.0, 201);
    let grant = json!({"id": "g", "amount": 1_000_000});
    assert_eq!(call(&http, "POST", &format!("{base}/v1/accounts/a/grants"), Some(grant)).await.0, 201);

    // Writers keep creating jobs while the backup is taken.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let writer = {
        let (base, http, stop) = (base.clone(), http.clone(), stop.clone());
        tokio::spawn(async move {
            let mut i = 0;
            // Until the backup is done, and 50 more after it.
            let mut after = 0;
            while after < 50 {
                let job = json!({"id": format!("j{i}"), "account_id": "a", "kind": "render", "cost": 3});
                assert_eq!(call(&http, "POST", &format!("{base}/v1/jobs"), Some(job)).await.0, 201);
                i += 1;
                if stop.load(std::sync::atomic::Ordering::SeqCst) {
                    after += 1;
                }
            }
        })
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let backup = dir.path().join("backup.db");
    let (code, out, err) = settle(&["backup", "--db", &db, "--to", backup.to_str().unwrap()]);
    stop.store(true, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("epoch 1"), "{out}");
    writer.await.unwrap();
    let (code, _, err) = settle(&["backup", "--db", &db, "--to", backup.to_str().unwrap()]);
    assert_ne!(code, 0, "a backup never overwrites: {err}");

    // Restored elsewhere: the audit is clean and the events gap-free, whatever moment it caught.
    let restored = format!("sqlite://{}", dir.path().join("restored.db").display());
    let (code, out, err) = settle(&["restore", "--from", backup.to_str().unwrap(), "--db", &restored]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("audit: clean") && out.contains("epoch 2"), "{out}");
    let (code, _, err) = settle(&["restore", "--from", backup.to_str().unwrap(), "--db", &restored]);
    assert_ne!(code, 0, "a store already there is not replaced without --replace: {err}");

    let live = events(&http, &base).await;
    drop(server);
    let server = serve(Some(&restored), None);
    let base = server.base.clone();
    let held = events(&http, &base).await;
    assert!(
        !held.is_empty() && held.len() < live.len(),
        "the backup caught the store mid-load: {} of {}",
        held.len(),
        live.len()
    );
    for (i, e) in held.iter().enumerate() {
        assert_eq!(e["seq"], i as i64 + 1, "gap-free");
        assert_eq!(e["epoch"], 1, "an event the backup held keeps its epoch");
        assert_eq!(e, &live[i], "the same event, byte for byte, as receivers saw it");
    }
    let last = held.len() as i64;
    let job = json!({"id": "after-restore", "account_id": "a", "kind": "render", "cost": 3});
    let (status, created) = call(&http, "POST", &format!("{base}/v1/jobs"), Some(job)).await;
    assert_eq!(status, 201, "{created}");
    let now = events(&http, &base).await;
    let new: Vec<_> = now.iter().filter(|e| e["seq"].as_i64().unwrap() > last).collect();
    assert!(!new.is_empty());
    for e in &new {
        assert_eq!(e["epoch"], 2, "numbered after the restore: {e}");
    }
    assert_eq!(new[0]["seq"], last + 1, "numbering goes on from where the backup stood");
    // A receiver that saw the lost timeline's event of the same number tells them apart.
    let lost = &live[last as usize];
    assert_eq!(lost["seq"], new[0]["seq"]);
    assert_ne!((&lost["epoch"], &lost["seq"]), (&new[0]["epoch"], &new[0]["seq"]));
}

/// `settle serve --no-migrate` refuses a schema older than its own (writing nothing); `settle
/// migrate` applies the migrations and says so; a second run has nothing to do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn migrations_are_an_explicit_step_when_asked() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.db");
    let db = format!("sqlite://{}", path.display());
    let (code, _, err) = settle(&["serve", "--db", &db, "--no-migrate", "--listen", "127.0.0.1:0"]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("settle migrate"), "{err}");
    let (code, out, err) = settle(&["migrate", "--db", &db]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("applied 0001"), "{out}");
    let (code, out, _) = settle(&["migrate", "--db", &db]);
    assert_eq!(code, 0);
    assert!(out.contains("up to date"), "{out}");
    let port = crate::common::free_port();
    let _server = crate::common::Process(
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["serve", "--db", &db, "--no-migrate", "--listen", &format!("127.0.0.1:{port}")])
            .current_dir(dir.path())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    crate::common::wait_for(port);
    let (status, _) = call(&reqwest::Client::new(), "GET", &format!("http://127.0.0.1:{port}/v1/events"), None).await;
    assert_eq!(status, 200, "a current schema serves with --no-migrate");
}
