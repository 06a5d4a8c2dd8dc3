//! The operator commands through the API (issue 42, part 8): `--url` and `--token` (or `SETTLE_URL`,
//! `SETTLE_TOKEN`) instead of `--db`. They print what the store-side commands print, refuse what
//! the token's role may not do, and what they change is recorded under the token's name.

use crate::common::{call, free_port, wait_for};
use serde_json::json;
use std::os::unix::fs::PermissionsExt;
use std::process::{Command, Stdio};

const ADMIN: &str = "admin-token-for-operator-tests";
const CLIENT: &str = "client-token-for-operator-tests";

/// `settle ARGS` with no SETTLE_ variable but `env`.
fn settle(args: &[&str], env: &[(&str, &str)]) -> (i32, String, String) {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_settle"));
    for (k, _) in std::env::vars().filter(|(k, _)| k.starts_with("SETTLE_")) {
        cmd.env_remove(k);
    }
    for (k, v) in env {
        cmd.env(k, v);
    }
    let out = cmd.args(args).output().unwrap();
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    (out.status.code().unwrap_or(-1), text(&out.stdout), text(&out.stderr))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operator_commands_through_the_api_print_the_same_and_act_as_the_token() {
    let dir = tempfile::tempdir().unwrap();
    let tokens = dir.path().join("tokens");
    std::fs::write(&tokens, format!("admin {ADMIN} ops-alice\nclient {CLIENT} platform\n")).unwrap();
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o600)).unwrap();
    let db = format!("sqlite://{}/s.db", dir.path().display());
    let port = free_port();
    let _server = crate::common::Process(
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args([
                "serve",
                "--db",
                &db,
                "--tokens",
                tokens.to_str().unwrap(),
                "--listen",
                &format!("127.0.0.1:{port}"),
            ])
            .current_dir(dir.path())
            .env_remove("SETTLE_TOKENS")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    wait_for(port);
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::builder()
        .default_headers(
            [(reqwest::header::AUTHORIZATION, format!("Bearer {ADMIN}").parse().unwrap())].into_iter().collect(),
        )
        .build()
        .unwrap();
    for (path, body) in [
        ("/v1/accounts", json!({"id": "acme"})),
        ("/v1/accounts/acme/grants", json!({"id": "welcome", "amount": 100})),
        ("/v1/jobs", json!({"id": "render-1", "account_id": "acme", "kind": "render", "cost": 30, "max_attempts": 1})),
    ] {
        assert_eq!(call(&http, "POST", &format!("{base}{path}"), Some(body)).await.0, 201);
    }
    let (_, claimed) = call(&http, "POST", &format!("{base}/v1/claims"), Some(json!({"worker": "gpu-1"}))).await;
    let token = claimed["jobs"][0]["lease_token"].as_str().unwrap().to_owned();
    let fail = json!({"lease_token": token, "code": "OOM", "retryable": false});
    assert_eq!(call(&http, "POST", &format!("{base}/v1/jobs/render-1/fail"), Some(fail)).await.0, 200);

    let api: &[(&str, &str)] = &[("SETTLE_URL", &base), ("SETTLE_TOKEN", ADMIN)];
    // The same lines from the API as from the store.
    for args in [vec!["ledger", "acme"], vec!["jobs", "list"], vec!["dead-letters", "list"], vec!["failures"]] {
        let (code, remote, err) = settle(&args, api);
        assert_eq!(code, 0, "{args:?}: {err}");
        let mut local = args.clone();
        local.extend(["--db", &db]);
        let (_, store, _) = settle(&local, &[]);
        assert_eq!(remote, store, "{args:?} through the API and on the store");
    }
    let (code, out, err) = settle(&["audit", "--url", &base, "--token", ADMIN], &[]);
    assert_eq!(code, 0, "{err}");
    assert!(out.starts_with("audit: clean"), "{out}");
    let (_, out, _) = settle(&["accounts", "show", "acme"], api);
    assert!(out.starts_with("acme  balance 100") && out.contains("welcome"), "{out}");
    let (_, out, _) = settle(&["jobs", "show", "render-1"], api);
    assert!(out.contains("render-1") && out.contains("attempt  1 gpu-1") && out.contains("OOM"), "{out}");
    let (code, _, err) = settle(&["jobs", "show", "render-1", "--url", &base, "--token", CLIENT], &[]);
    assert_ne!(code, 0, "a job's history names tokens: admin only");
    assert!(err.contains("403"), "{err}");
    let (_, remote, _) = settle(&["events", "tail"], api);
    assert!(remote.contains("job.dead") || remote.contains("job.failed"), "{remote}");
    let (_, store, _) = settle(&["events", "tail", "--db", &db], &[]);
    let columns = |text: &str| -> Vec<String> {
        text.lines().map(|l| l.split_whitespace().take(4).collect::<Vec<_>>().join(" ")).collect()
    };
    assert_eq!(columns(&remote), columns(&store), "seq, time, type and job, as on the store");

    // A client token may read but not requeue: refused, exit 1, nothing moved.
    let (code, out, _) = settle(&["dead-letters", "requeue", "render-1", "--url", &base, "--token", CLIENT], &[]);
    assert_eq!(code, 1, "{out}");
    assert!(out.contains("not requeued: 403"), "{out}");
    // The admin token requeues, and the action log names the token, not `cli`.
    let (code, out, err) = settle(&["dead-letters", "requeue", "render-1"], api);
    assert_eq!(code, 0, "{out}{err}");
    assert!(out.contains("render-1: requeued (queued)"), "{out}");
    let (_, out, _) = settle(&["jobs", "show", "render-1", "--db", &db], &[]);
    assert!(out.lines().any(|l| l.contains("action job.requeue") && l.contains("by ops-alice")), "{out}");
    // A late signal after the requeue: ignored, and shown so through the API as on the store.
    let late = json!({"lease_token": token, "code": "OOM"});
    let (status, _) = call(&http, "POST", &format!("{base}/v1/jobs/render-1/fail"), Some(late)).await;
    assert!(matches!(status, 200 | 409), "{status}");
    let (code, remote, err) = settle(&["jobs", "show", "render-1"], api);
    assert_eq!(code, 0, "{err}");
    // The job line's attempt count: the API's is attempts started, the store's those of the
    // current budget (a requeue starts a new one); every other character is the same.
    let budgetless = |text: &str| text.replacen("attempt 1/1", "attempt 0/1", 1);
    let store = settle(&["jobs", "show", "render-1", "--db", &db], &[]).1;
    assert_eq!(budgetless(&remote), store, "jobs show, API and store");
    assert!(remote.contains("paid     30 by grant welcome") && remote.contains("by ops-alice"), "{remote}");
    assert!(remote.lines().any(|l| l.starts_with("  signal fail")), "the late signal is shown: {remote}");

    // Bad input is refused before anything is sent, or by the server with its reason.
    let (code, _, err) = settle(&["failures", "--token", ADMIN], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("--token (SETTLE_TOKEN) is for --url"), "{err}");
    let (code, _, err) = settle(&["ledger", "nobody"], api);
    assert_ne!(code, 0);
    assert!(err.contains("404") && err.contains("not_found"), "{err}");
    let (code, _, err) = settle(&["ledger", "acme", "--url", &base, "--token", "not-a-token-of-this-server"], &[]);
    assert_ne!(code, 0);
    assert!(err.contains("401"), "{err}");
}
