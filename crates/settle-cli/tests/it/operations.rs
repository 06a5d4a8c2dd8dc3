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
    // A consumer whose cursor is past what the restored store numbered is told where to go on.
    let ahead = live.last().unwrap()["seq"].as_i64().unwrap() + 5;
    let (status, body) = call(&http, "GET", &format!("{base}/v1/events?after={ahead}"), None).await;
    assert_eq!((status, body["error"]["code"].as_str()), (409, Some("cursor_ahead")), "{body}");
    assert_eq!(body["error"]["details"]["restart_after"], last, "{body}");
    assert_eq!(body["error"]["details"]["epoch"], 2, "{body}");

    // Not over a store a process has open; once it is stopped, the old store is kept aside and the
    // epoch rises past both.
    let replace = ["restore", "--from", backup.to_str().unwrap(), "--db", &restored, "--replace"];
    let (code, _, err) = settle(&replace);
    assert_ne!(code, 0);
    assert!(err.contains("in use"), "{err}");
    drop(server);
    let (code, out, err) = settle(&replace);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("epoch 3") && out.contains("kept at"), "{out}");
    let kept: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().into_string().unwrap())
        .filter(|n| n.starts_with("restored.db.replaced-"))
        .collect();
    assert_eq!(kept.len(), 1, "{kept:?}");
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(&backup).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "a backup is private");
    // An epoch given by hand must be above those in use.
    let (code, _, err) =
        settle(&["restore", "--from", backup.to_str().unwrap(), "--db", &restored, "--replace", "--epoch", "2"]);
    assert_ne!(code, 0);
    assert!(err.contains("not above"), "{err}");
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
    assert!(!path.exists(), "a refused start writes nothing, not even an empty file");
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

/// A rolling upgrade on PostgreSQL (docs/operations/upgrade.md): a newer release's migration lands
/// (`settle migrate` with the new binary; here a migration from the future and a column it adds)
/// while an older process serves. The old process goes on serving — migrations only add — but an
/// old process that starts afterwards refuses, naming the fix, rather than serve beside new ones.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_old_process_meets_a_newer_schema() {
    let db = settle_testkit::fresh_database().await;
    let (code, _, err) = settle(&["migrate", "--db", &db]);
    assert_eq!(code, 0, "{err}");
    let dir = tempfile::tempdir().unwrap();
    let port = crate::common::free_port();
    let _old = crate::common::Process(
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["serve", "--db", &db, "--no-migrate", "--listen", &format!("127.0.0.1:{port}")])
            .current_dir(dir.path())
            .env_remove("SETTLE_TOKENS")
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap(),
    );
    crate::common::wait_for(port);
    let http = reqwest::Client::new();
    let base = format!("http://127.0.0.1:{port}");
    let (status, _) = call(&http, "POST", &format!("{base}/v1/accounts"), Some(json!({"id": "before"}))).await;
    assert_eq!(status, 201);

    // The newer release migrates: a column added, its migration recorded.
    let pool = sqlx::PgPool::connect(&db).await.unwrap();
    sqlx::query("ALTER TABLE accounts ADD COLUMN note_from_the_future text").execute(&pool).await.unwrap();
    sqlx::query(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (9999, 'from the future', true, '\\x00'::bytea, 0)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool.close().await;

    // The old process still serves, reads and writes.
    let (status, _) = call(&http, "POST", &format!("{base}/v1/accounts"), Some(json!({"id": "during"}))).await;
    assert_eq!(status, 201, "an old process keeps serving after a migration that only adds");
    let grant = json!({"id": "g", "amount": 5});
    let (status, _) = call(&http, "POST", &format!("{base}/v1/accounts/during/grants"), Some(grant)).await;
    assert_eq!(status, 201);
    let (status, page) = call(&http, "GET", &format!("{base}/v1/accounts"), None).await;
    assert_eq!((status, page["accounts"].as_array().map(Vec::len)), (200, Some(2)), "{page}");

    // An old process that starts now refuses, with or without --no-migrate; so does its migrate.
    for args in [
        vec!["serve", "--db", &db, "--listen", "127.0.0.1:0"],
        vec!["serve", "--db", &db, "--no-migrate", "--listen", "127.0.0.1:0"],
        vec!["migrate", "--db", &db],
    ] {
        let (code, _, err) = settle(&args);
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains("newer than this binary") && err.contains("run a newer settle"), "{args:?}: {err}");
    }
}

/// Every row of every table `settle copy` carries, as text, in a fixed order (SQLite side).
fn dump(path: &std::path::Path) -> Vec<(String, Vec<String>)> {
    let conn = rusqlite::Connection::open(path).unwrap();
    let mut tables = Vec::new();
    for (table, order) in settle_store::copy::TABLES.iter().chain(&[("counters", "name")]) {
        let mut stmt = conn.prepare(&format!("SELECT * FROM {table} ORDER BY {order}")).unwrap();
        let n = stmt.column_count();
        let rows: Vec<String> = stmt
            .query_map([], |r| Ok((0..n).map(|i| format!("{:?}", r.get_ref(i).unwrap())).collect::<Vec<_>>().join("|")))
            .unwrap()
            .map(Result::unwrap)
            .collect();
        tables.push(((*table).to_owned(), rows));
    }
    tables
}

/// The store every story of `settle demo` makes goes from SQLite to PostgreSQL and back: the
/// second SQLite store holds exactly the rows of the first — ids, numbers, hashes, events,
/// attempts, grants, allocations, deliveries — and each copy ends with a clean audit. A target
/// that is not empty is refused, writing nothing.
#[test]
fn a_demo_store_goes_to_postgresql_and_back_row_for_row() {
    let dir = tempfile::tempdir().unwrap();
    let first = dir.path().join("first.db");
    let first_url = format!("sqlite://{}", first.display());
    let (code, out, err) = settle(&["demo", "--db", &first_url]);
    assert_eq!(code, 0, "{out}{err}");
    // The rows the demo's stories leave empty, as a server with a webhook endpoint, a stuck
    // teardown and a signed-out console would have them (one of each, with NULLs and bytes).
    rusqlite::Connection::open(&first)
        .unwrap()
        .execute_batch(
            "INSERT INTO webhook_cursors VALUES ('ops', 3); \
             INSERT INTO webhook_breakers VALUES ('ops', 'half_open', 5, 2, 1700, 3, 'probe', 1800, 1600); \
             INSERT INTO webhook_deliveries VALUES ('ops', 1, 'account alice', 'delivered', 1, 10, NULL, NULL, 200, NULL, 11, 9, 11); \
             INSERT INTO webhook_deliveries VALUES ('ops', 2, 'account alice', 'dead', 8, 20, NULL, NULL, 500, 'down', NULL, 9, 20); \
             INSERT INTO webhook_deliveries VALUES ('ops', 3, 'job render-1', 'pending', 0, 30, 'lease', 40, NULL, NULL, NULL, 9, 30); \
             INSERT INTO teardown_retries SELECT id, 3, 99, 'the store refused', 98 FROM jobs LIMIT 1; \
             INSERT INTO console_signouts VALUES ('nonce-1', 4102444800);",
        )
        .unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let pg = rt.block_on(settle_testkit::fresh_database());

    let (code, out, err) = settle(&["copy", "--from", &first_url, "--to", &pg]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("audit: clean"), "{out}");
    assert!(err.contains("rows of ledger_entries") && err.contains("rows of events"), "progress: {err}");
    // Not into a store that holds anything.
    let (code, out, err) = settle(&["copy", "--from", &first_url, "--to", &pg]);
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("not empty"), "{err}");

    let second = dir.path().join("second.db");
    let second_url = format!("sqlite://{}", second.display());
    let (code, out, err) = settle(&["copy", "--from", &pg, "--to", &second_url]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("audit: clean"), "{out}");
    let (a, b) = (dump(&first), dump(&second));
    for ((table, rows_a), (_, rows_b)) in a.iter().zip(&b) {
        assert_eq!(rows_a, rows_b, "{table} went across row for row");
    }
    assert!(
        a.iter().find(|(t, _)| t == "ledger_entries").is_some_and(|(_, r)| r.len() > 10),
        "the demo wrote a ledger"
    );
    for (table, rows) in &a {
        // Pending stamps are PostgreSQL's, before a pass numbers them; SQLite numbers as it commits.
        // The demo's workers claim without labels: no label set to remember.
        if !["outbox_pending", "stamps_pending", "worker_labels"].contains(&table.as_str()) {
            assert!(!rows.is_empty(), "{table} has rows to copy");
        }
    }

    // The copy numbers on where the source stood: a new job on the second store.
    let server = crate::common::serve(Some(&second_url), None);
    let http = reqwest::Client::new();
    let before = rt.block_on(events(&http, &server.base)).len() as i64;
    let (_, accounts) = rt.block_on(call(&http, "GET", &format!("{}/v1/accounts", server.base), None));
    let id = accounts["accounts"][0]["id"].as_str().expect("the demo made accounts").to_owned();
    let grant = json!({"id": "after-copy", "amount": 5});
    let (status, body) =
        rt.block_on(call(&http, "POST", &format!("{}/v1/accounts/{id}/grants", server.base), Some(grant)));
    assert_eq!(status, 201, "{body}");
    let after = rt.block_on(events(&http, &server.base));
    assert_eq!(after.last().unwrap()["seq"], before + 1, "{:?}", after.last());
}
