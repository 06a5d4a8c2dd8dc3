//! The README's payout walk-through, as a user runs it: `settle provider-sim` and `settle serve`
//! as two processes, withdrawals made with HTTP, the provider losing half its answers.

use crate::common::{Process, call, free_port, wait_for};
use serde_json::json;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdrawals_through_settle_serve_and_provider_sim() {
    let dir = tempfile::tempdir().unwrap();
    let (sim_port, port) = (free_port(), free_port());
    let _sim = Process(
        Command::new(env!("CARGO_BIN_EXE_settle"))
            .args(["provider-sim", "--listen", &format!("127.0.0.1:{sim_port}"), "--seed", "3", "--lose-answer", "0.5"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let config = dir.path().join("settle.toml");
    std::fs::write(
        &config,
        "[kinds.withdrawal]\nlease_seconds = 5\nconfirm_window_seconds = 5\nbackoff_ms_base = 100\n\n\
         [provider]\ntimeout_ms = 1000\nconnect_timeout_ms = 500\n\n\
         [loops]\npayout_every_ms = 100\nreconcile_every_ms = 200\nrescue_every_ms = 200\n",
    )
    .unwrap();
    let serve = Command::new(env!("CARGO_BIN_EXE_settle"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}"), "--config"])
        .arg(&config)
        .current_dir(dir.path())
        .env_remove("SETTLE_DATABASE_URL")
        .env_remove("SETTLE_TOKENS")
        .env("SETTLE_PROVIDER_URL", format!("http://127.0.0.1:{sim_port}"))
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let _serve = Process(serve);
    wait_for(sim_port);
    wait_for(port);
    let (s, http) = (format!("http://127.0.0.1:{port}"), reqwest::Client::new());
    assert_eq!(call(&http, "POST", &format!("{s}/v1/accounts"), Some(json!({"id": "alice"}))).await.0, 201);
    let grant = json!({"id": "g", "amount": 1000});
    assert_eq!(call(&http, "POST", &format!("{s}/v1/accounts/alice/grants"), Some(grant)).await.0, 201);
    for i in 0..10 {
        let to = if i == 9 { "invalid-iban".to_owned() } else { format!("DE{i:020}") };
        let body = json!({"id": format!("w{i}"), "account_id": "alice", "amount": 10 + i, "destination": to});
        let (status, w) = call(&http, "POST", &format!("{s}/v1/withdrawals"), Some(body)).await;
        assert_eq!(status, 201, "{w}");
    }
    let deadline = Instant::now() + Duration::from_secs(60);
    let list = loop {
        let (_, list) = call(&http, "GET", &format!("{s}/v1/withdrawals"), None).await;
        let done =
            list["withdrawals"].as_array().unwrap().iter().all(|w| w["state"] == "succeeded" || w["state"] == "dead");
        if done {
            break list;
        }
        assert!(Instant::now() < deadline, "withdrawals did not settle: {list}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    let (_, executed) = call(&http, "GET", &format!("http://127.0.0.1:{sim_port}/v1/executed"), None).await;
    let mut paid = 0;
    for w in list["withdrawals"].as_array().unwrap() {
        let t = executed["transfers"].as_array().unwrap().iter().find(|t| t["key"] == w["idempotency_key"]);
        match w["state"].as_str() {
            Some("succeeded") => {
                let t = t.unwrap_or_else(|| panic!("{w} succeeded without a transfer"));
                assert_eq!((&t["txid"], &t["sends"]), (&w["provider_txid"], &json!(1)), "{w}");
                paid += w["amount"].as_i64().unwrap();
            }
            _ => assert!(t.is_none() && w["id"] == "w9" && w["net"] == 0, "{w}"),
        }
    }
    assert_eq!(executed["total_paid"].as_i64(), Some(paid));
    let (_, alice) = call(&http, "GET", &format!("{s}/v1/accounts/alice"), None).await;
    assert_eq!(alice["balance"].as_i64(), Some(1000 - paid));
    let (_, attempts) = call(&http, "GET", &format!("{s}/v1/jobs/w9/attempts"), None).await;
    assert_eq!(attempts["attempts"][0]["fail_code"], "INVALID_ADDRESS");
    let (_, log) = call(&http, "GET", &format!("http://127.0.0.1:{sim_port}/v1/log"), None).await;
    assert!(log["requests"].as_array().unwrap().iter().any(|r| r["fate"] == "cut"), "no answer was lost: {log}");
    let (_, audit) = call(&http, "GET", &format!("{s}/v1/audit"), None).await;
    assert_eq!(audit["ok"], true, "{audit}");
}
