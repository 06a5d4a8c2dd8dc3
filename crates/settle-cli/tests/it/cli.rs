//! The `settle` binary, run as a user would: demo, audit (clean and tampered), ledger.

use std::process::Command;

/// Runs `settle ARGS` in a folder of its own (what it makes by default, such as `settle serve`'s
/// artifact directory, lands there and goes with it).
fn settle(args: &[&str]) -> (i32, String, String) {
    let cwd = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(args)
        .current_dir(cwd.path())
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_ARTIFACTS")
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn demo_plays_the_stories_and_ends_clean() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("demo.db").display());
    let (code, out, err) = settle(&["demo", "--db", &url]);
    assert_eq!(code, 0, "{out}\n{err}");
    assert!(out.contains("audit: clean"), "{out}");
    // The recovered render: charge, refund, reclaim and nothing more.
    let render: Vec<&str> = out
        .lines()
        .filter(|l| {
            l.split_whitespace().next().is_some_and(|seq| seq.parse::<u64>().is_ok()) && l.contains(" render-1 ")
        })
        .collect();
    let kinds: Vec<&str> = render.iter().map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(kinds, ["charge", "refund", "reclaim"], "{render:#?}");
    assert!(render[0].contains("-40") && render[1].contains("+40") && render[2].contains("-40"));
    // Issue 23: the held render captured at 37 with 63 released; the timed-out one recovered at 41.
    let lines = |job: &str| -> Vec<(String, String)> {
        out.lines()
            .filter(|l| l.split_whitespace().next().is_some_and(|seq| seq.parse::<u64>().is_ok()))
            .filter(|l| l.contains(&format!(" {job} ")))
            .map(|l| {
                let f: Vec<&str> = l.split_whitespace().collect();
                (f[1].to_owned(), f[2].to_owned())
            })
            .collect()
    };
    let pairs = |v: &[(&str, &str)]| v.iter().map(|(a, b)| (a.to_string(), b.to_string())).collect::<Vec<_>>();
    assert_eq!(lines("render-held"), pairs(&[("charge", "-100"), ("release", "+63")]), "{out}");
    assert_eq!(lines("render-late"), pairs(&[("charge", "-100"), ("refund", "+100"), ("reclaim", "-41")]), "{out}");
    // Seed 003: the running batch cancelled mid-way by the Rust SDK worker over HTTP.
    for line in [
        "items delivered and kept charged  3 (15 credits), their artifacts kept: 3",
        "items refunded                    5 (25 credits)",
        "artifacts deleted                 1",
        "alice's balance                   380 -> 405",
    ] {
        assert!(out.contains(line), "{line:?} missing from:\n{out}");
    }
    // The audit and ledger commands work on what the demo left behind.
    let (code, out, _) = settle(&["audit", "--db", &url]);
    assert_eq!(code, 0, "{out}");
    let (code, out, _) = settle(&["ledger", "alice", "--db", &url]);
    assert_eq!(code, 0);
    assert!(out.contains("balance 405"), "{out}");
    // batch-2: a charge per frame, then a refund for each of the five frames never delivered.
    let batch: Vec<(String, String, String)> = out
        .lines()
        .filter(|l| l.contains(" batch-2 "))
        .map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f[1].to_owned(), f[2].to_owned(), f[5].to_owned())
        })
        .collect();
    let mut expected: Vec<(String, String, String)> =
        (1..=8).map(|i| ("charge".to_owned(), "-5".to_owned(), format!("frame-{i}"))).collect();
    expected.extend((4..=8).map(|i| ("refund".to_owned(), "+5".to_owned(), format!("frame-{i}"))));
    assert_eq!(batch, expected, "{out}");
    // Seed 001: the payouts, each found in one state, the returned one credited back once.
    let (code, out, _) = settle(&["withdrawals", "list", "--db", &url]);
    assert_eq!(code, 0, "{out}");
    for (id, state) in [
        ("payout-lost", "succeeded"),
        ("payout-bad", "dead"),
        ("payout-retry", "succeeded"),
        ("payout-back", "returned"),
    ] {
        let line = out.lines().find(|l| l.starts_with(id)).unwrap_or_else(|| panic!("{id} missing: {out}"));
        assert_eq!(line.split_whitespace().nth(1), Some(state), "{line}");
    }
    let (code, out, _) = settle(&["withdrawals", "show", "payout-retry", "--db", &url]);
    assert_eq!(code, 0);
    assert!(out.contains("NODE_DOWN") && out.contains("succeeded"), "{out}");
    let (_, out, _) = settle(&["ledger", "bob", "--db", &url]);
    let back: Vec<&str> = out.lines().filter(|l| l.contains(" payout-back ")).collect();
    let kinds: Vec<&str> = back.iter().map(|l| l.split_whitespace().nth(1).unwrap()).collect();
    assert_eq!(kinds, ["charge", "payout_return"], "{out}");
    assert!(out.contains("balance 830"), "{out}");
    let (code, out, _) = settle(&["failures", "--db", &url]);
    assert_eq!(code, 0);
    assert!(out.contains("INVALID_ADDRESS"), "{out}");
}

#[test]
fn audit_names_a_ledger_altered_behind_settles_back() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.db");
    let url = format!("sqlite://{}", path.display());
    assert_eq!(settle(&["demo", "--db", &url]).0, 0);
    let tamper = |sql: &str| {
        let st = Command::new("python3")
            .args([
                "-c",
                "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.executescript(sys.argv[2]); c.commit()",
            ])
            .arg(&path)
            .arg(sql)
            .status()
            .unwrap();
        assert!(st.success());
    };
    // With the trigger in place the database itself refuses.
    let refused = Command::new("python3")
        .args(["-c", "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute('UPDATE ledger_entries SET amount = 0 WHERE seq = 3')"])
        .arg(&path)
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("append-only"));
    tamper("DROP TRIGGER ledger_entries_no_update; UPDATE ledger_entries SET amount = 0 WHERE seq = 3;");
    let (code, out, _) = settle(&["audit", "--db", &url]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("L1") && out.contains("L3") && out.contains("render-1"), "{out}");
}

#[test]
fn operator_commands_refuse_a_missing_database() {
    let (code, _, err) = settle(&["audit", "--db", "sqlite:///nonexistent/settle.db"]);
    assert_eq!(code, 1);
    assert!(err.contains("no database"), "{err}");
}

#[test]
fn serve_finishes_requests_in_flight_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut server = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .current_dir(dir.path())
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let base = format!("http://127.0.0.1:{port}");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    while Command::new("curl")
        .args(["-fs", &format!("{base}/healthz")])
        .output()
        .map(|o| !o.status.success())
        .unwrap_or(true)
    {
        assert!(std::time::Instant::now() < deadline, "settle serve did not come up");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    // A claim that long-polls for 20 s is in flight when SIGTERM arrives; it must still be answered.
    let claim = std::thread::spawn({
        let base = base.clone();
        move || {
            Command::new("curl")
                .args(["-s", "-o", "/dev/null", "-w", "%{http_code}", "-XPOST", &format!("{base}/v1/claims")])
                .args(["-H", "content-type: application/json", "-d", r#"{"worker":"w","wait_seconds":20}"#])
                .output()
                .unwrap()
        }
    });
    // SIGTERM only once the claim is waiting in the server (its gauge says so), however slow the
    // machine is to start curl.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let metrics = Command::new("curl").args(["-fs", &format!("{base}/metrics")]).output().unwrap();
        if String::from_utf8_lossy(&metrics.stdout).lines().any(|l| l == "settle_http_long_polls_waiting 1") {
            break;
        }
        assert!(std::time::Instant::now() < deadline, "the claim never started waiting");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(!claim.is_finished(), "the claim must still be waiting when SIGTERM arrives");
    let st = Command::new("kill").args(["-TERM", &server.id().to_string()]).status().unwrap();
    assert!(st.success());
    let answered = claim.join().unwrap();
    assert_eq!(String::from_utf8_lossy(&answered.stdout), "200");
    let status = server.wait().unwrap();
    assert!(status.success(), "settle serve exited with {status}");
    assert!(dir.path().join("settle.db").exists(), "the embedded default is sqlite://settle.db");
}

#[test]
fn operator_commands_read_and_requeue() {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("ops.db").display());
    assert_eq!(settle(&["demo", "--db", &url]).0, 0);
    let (code, out, _) = settle(&["jobs", "list", "--db", &url, "--state", "dead"]);
    assert_eq!(code, 0);
    assert!(out.contains("transcribe-1") && !out.contains("render-1"), "{out}");
    let (code, out, _) = settle(&["jobs", "show", "export-1", "--db", &url]);
    assert_eq!(code, 0);
    assert!(out.contains("attempt  1") && out.contains("INVALID_ADDRESS") && out.contains("succeeded"), "{out}");
    // A held item shows its hold and the price its success gave it.
    let (code, out, _) = settle(&["jobs", "show", "render-late", "--db", &url]);
    assert_eq!(code, 0);
    assert!(out.contains("cost     41 of a hold of 100") && out.contains("reclaimed"), "{out}");
    let (_, out, _) = settle(&["dead-letters", "list", "--db", &url]);
    assert!(out.contains("transcribe-1"), "{out}");
    let (_, out, _) = settle(&["failures", "--db", &url]);
    assert!(out.contains("INVALID_INPUT") && out.contains("dead"), "{out}");
    let (code, out, _) = settle(&["dead-letters", "requeue", "transcribe-1", "--db", &url]);
    assert_eq!(code, 0, "{out}");
    let (code, out, _) = settle(&["dead-letters", "requeue", "render-1", "--db", &url]);
    assert_eq!(code, 1, "a job that is not dead is refused: {out}");
    let (_, out, _) = settle(&["events", "tail", "--db", &url]);
    assert!(out.contains("job.requeued") && out.contains("account.granted"), "{out}");
    let (code, out, _) = settle(&["config"]);
    assert_eq!(code, 0);
    assert!(out.contains("[defaults]") && out.contains("attempts_max = 5"), "{out}");
    assert_eq!(settle(&["audit", "--db", &url]).0, 0);
}

/// A database that is not Settle's is refused at start with exit code 2, and left as it was.
#[test]
fn a_database_that_is_not_settles_is_refused_and_left_alone() {
    let dir = tempfile::tempdir().unwrap();
    let sha = |p: &std::path::Path| std::fs::read(p).unwrap();
    // another program's SQLite file
    let other = dir.path().join("other.db");
    let made = Command::new("python3")
        .args(["-c", "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute('CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)'); c.execute(\"INSERT INTO users (name) VALUES ('ada')\"); c.commit()"])
        .arg(&other)
        .status()
        .unwrap();
    assert!(made.success());
    // a file that is not a database at all
    let text = dir.path().join("notes.db");
    std::fs::write(&text, "these are my notes, not a database\n").unwrap();
    for (path, says) in [(&other, "not a Settle database"), (&text, "not an SQLite database")] {
        let before = sha(path);
        let url = format!("sqlite://{}", path.display());
        for args in [vec!["serve", "--listen", "127.0.0.1:0", "--db", &url], vec!["audit", "--db", &url]] {
            let (code, out, err) = settle(&args);
            assert_eq!(code, 2, "{args:?}: {out}{err}");
            assert!(err.contains(says), "{args:?}: {err}");
        }
        assert_eq!(sha(path), before, "{} was changed", path.display());
        let siblings: Vec<_> = std::fs::read_dir(dir.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
        assert!(!siblings.iter().any(|n| n.to_string_lossy().ends_with("-wal")), "{siblings:?}");
    }
    // a Settle database whose schema is newer than this binary
    let newer = dir.path().join("newer.db");
    let url = format!("sqlite://{}", newer.display());
    assert_eq!(settle(&["demo", "--db", &url]).0, 0);
    let bumped = Command::new("python3")
        .args(["-c", "import sqlite3,sys; c=sqlite3.connect(sys.argv[1]); c.execute(\"INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) VALUES (9999, 'from the future', 1, x'00', 0)\"); c.commit()"])
        .arg(&newer)
        .status()
        .unwrap();
    assert!(bumped.success());
    let (code, _, err) = settle(&["serve", "--listen", "127.0.0.1:0", "--db", &url]);
    assert_eq!(code, 2, "{err}");
    assert!(err.contains("newer than this binary"), "{err}");
    // an empty file is a new database; a Settle database opens and is marked as Settle's
    let empty = dir.path().join("empty.db");
    std::fs::write(&empty, b"").unwrap();
    let url = format!("sqlite://{}", empty.display());
    assert_eq!(settle(&["demo", "--db", &url]).0, 0);
    assert_eq!(settle(&["audit", "--db", &url]).0, 0);
    let app_id = Command::new("python3")
        .args([
            "-c",
            "import sqlite3,sys; print(sqlite3.connect(sys.argv[1]).execute('PRAGMA application_id').fetchone()[0])",
        ])
        .arg(&empty)
        .output()
        .unwrap();
    assert_eq!(String::from_utf8_lossy(&app_id.stdout).trim(), (0x5345_544C_i64).to_string());
}

/// Tokens are secrets: a token file every user can read, or a short token, stops `settle serve`.
#[test]
fn serve_refuses_an_open_token_file_and_short_tokens() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    std::fs::write(&file, "admin admin-token-0123456789\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o644)).unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let path = file.display().to_string();
    let (code, _, err) = settle(&["serve", "--listen", "127.0.0.1:0", "--db", &db, "--tokens", &path]);
    assert_ne!(code, 0);
    assert!(err.contains("open to every user"), "{err}");
    std::fs::write(&file, "admin short\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (code, _, err) = settle(&["serve", "--listen", "127.0.0.1:0", "--db", &db, "--tokens", &path]);
    assert_ne!(code, 0);
    assert!(err.contains("at least 16 characters"), "{err}");
}

/// Issue 19, item 12: a token file that names no token does not turn authentication off; nor
/// does a SETTLE_TOKENS that is set but empty.
#[test]
fn serve_refuses_a_token_file_without_tokens() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("tokens");
    std::fs::write(&file, "# every token was removed during a rotation\n\n").unwrap();
    std::fs::set_permissions(&file, std::fs::Permissions::from_mode(0o600)).unwrap();
    let db = format!("sqlite://{}", dir.path().join("t.db").display());
    let path = file.display().to_string();
    let (code, _, err) = settle(&["serve", "--listen", "0.0.0.0:0", "--db", &db, "--tokens", &path]);
    assert_ne!(code, 0);
    assert!(err.contains("holds no token"), "{err}");
    let out = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["serve", "--listen", "127.0.0.1:0", "--db", &db])
        .current_dir(dir.path())
        .env("SETTLE_TOKENS", " , ")
        .output()
        .unwrap();
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("names no token"), "{out:?}");
}

/// Issue 19, item 10: the database password never reaches the start line, the logs, an error
/// or `--help` (which shows environment values unless told not to).
#[test]
fn the_database_password_is_never_printed() {
    const SECRET: &str = "pg-s3cret-pw";
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    // Nothing listens there: `open …` fails, naming the database without its password.
    let unreachable = format!("postgres://settle:{SECRET}@127.0.0.1:{port}/settle?connect_timeout=2");
    let (code, out, err) = settle(&["serve", "--listen", "127.0.0.1:0", "--db", &unreachable]);
    assert_ne!(code, 0);
    assert!(err.contains("postgres://settle:***@127.0.0.1"), "{err}");
    assert!(!out.contains(SECRET) && !err.contains(SECRET), "{out}\n{err}");
    let help = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["serve", "--help"])
        .env("SETTLE_DATABASE_URL", &unreachable)
        .output()
        .unwrap();
    assert!(!String::from_utf8_lossy(&help.stdout).contains(SECRET), "--help shows the password");
    // A real server, reached with a password it does not check (the test cluster trusts loopback):
    // the start line and the JSON log name the database without it.
    let rt = tokio::runtime::Runtime::new().unwrap();
    let url = rt.block_on(settle_testkit::fresh_database());
    let with_password = url.replacen("://postgres@", &format!("://postgres:{SECRET}@"), 1);
    assert_ne!(with_password, url, "the test database's URL has a user: {url}");
    let dir = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let mut child = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--db", &with_password])
        .current_dir(dir.path())
        .env_remove("SETTLE_TOKENS")
        // stderr is a pipe, so the log is JSON.
        .env("SETTLE_LOG", "info")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Answering /healthz: past the start line, which is printed before serving begins.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !Command::new("curl")
        .args(["-fs", &format!("http://127.0.0.1:{port}/healthz")])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        assert!(std::time::Instant::now() < deadline, "settle serve did not come up");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = Command::new("kill").args(["-TERM", &child.id().to_string()]).status();
    let _ = child.wait();
    let mut out = String::new();
    let mut err = String::new();
    use std::io::Read;
    child.stdout.take().unwrap().read_to_string(&mut out).unwrap();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(err.contains("settle: serving on") && err.contains(":***@"), "{err}");
    assert!(!out.contains(SECRET) && !err.contains(SECRET), "{out}\n{err}");
}

/// Issue 41: a reader that goes away (`settle ledger … | head -1`) ends the command quietly, with
/// exit 0 and no panic — for a listing and for the event tail that would otherwise wait on.
#[test]
fn a_closed_pipe_ends_the_output_quietly() {
    use std::io::{BufRead, BufReader};
    use std::process::Stdio;
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("pipe.db").display());
    assert_eq!(settle(&["demo", "--db", &url]).0, 0);
    for args in [vec!["ledger", "alice", "--db", &url], vec!["events", "tail", "--db", &url]] {
        let mut child = Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut first = String::new();
        BufReader::new(child.stdout.take().unwrap()).read_line(&mut first).unwrap();
        assert!(!first.is_empty(), "{args:?} printed nothing");
        // The reader is gone (its end of the pipe dropped with the BufReader).
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(0), "{args:?}: {err}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
    }
}

/// Issue 41: a start refused for its address — open to the network without tokens, or taken —
/// writes nothing (no database file, no artifact directory), and says why once.
#[test]
fn a_start_refused_for_its_address_writes_nothing() {
    let cwd = tempfile::tempdir().unwrap();
    let run = |listen: &str| {
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["serve", "--listen", listen])
            .current_dir(cwd.path())
            .env_remove("SETTLE_DATABASE_URL")
            .env_remove("SETTLE_ARTIFACTS")
            .env_remove("SETTLE_TOKENS")
            .output()
            .unwrap()
    };
    let out = run("0.0.0.0:0");
    assert_ne!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stderr).contains("without tokens"), "{out:?}");
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let out = run(&taken.local_addr().unwrap().to_string());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_ne!(out.status.code(), Some(0));
    assert_eq!(err.matches("Address already in use").count(), 1, "{err}");
    let left: Vec<_> = std::fs::read_dir(cwd.path()).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert!(left.is_empty(), "a refused start wrote {left:?}");
}
