//! The operator commands through the API (`--url`, `--token`; `SETTLE_URL`, `SETTLE_TOKEN`) instead
//! of the store: what they change is recorded under the token's name, and no database credential
//! leaves the servers. The same lines as on the store (operator.rs, print.rs), from the API's
//! answers (a job's history from `GET /v1/jobs/{id}/history`, an admin read). An account's debt,
//! holds and exposure are not in the API (the console shows them): `accounts show` prints its
//! balance and grants. A job line's attempt count is the API's (attempts started over all budgets);
//! on the store it counts the current budget (a requeue starts a new one).

use crate::operator::{Accounts, DeadLetters, Events, Jobs, Withdrawals};
use crate::print::out;
use anyhow::{Context, bail};
use serde_json::{Value, json};

/// `--url` and `--token`: the operator commands through a server's API instead of its store.
#[derive(clap::Args, Clone, Default)]
pub struct Api {
    /// Through the API of the server at this address instead of the store (`--db`): what the
    /// command changes is recorded under the token's name.
    #[arg(long, env = "SETTLE_URL", global = true)]
    pub url: Option<String>,
    /// The bearer token for `--url` (an admin token for requeue and abandon-cleanup).
    #[arg(long, env = "SETTLE_TOKEN", hide_env_values = true, global = true)]
    pub token: Option<String>,
}

impl Api {
    /// The server to speak to, when `--url` names one.
    pub fn remote(&self) -> anyhow::Result<Option<Remote>> {
        match (&self.url, &self.token) {
            (Some(url), token) => Remote::new(url, token.clone()).map(Some),
            (None, Some(_)) => bail!("--token (SETTLE_TOKEN) is for --url (SETTLE_URL): name the server"),
            (None, None) => Ok(None),
        }
    }
}

/// A Settle server and the token that speaks to it.
pub struct Remote {
    http: reqwest::Client,
    base: String,
    token: Option<String>,
}

/// One path segment or query value, percent-encoded (ids may hold `:` and `@`).
fn enc(s: &str) -> String {
    crate::secrets::percent_encode(s)
}

impl Remote {
    pub fn new(url: &str, token: Option<String>) -> anyhow::Result<Remote> {
        anyhow::ensure!(
            url.starts_with("http://") || url.starts_with("https://"),
            "--url is the server's address, http:// or https://"
        );
        // Long enough for an events long-poll (30 s) and an audit of a large store.
        let http = reqwest::Client::builder().timeout(std::time::Duration::from_secs(300)).build()?;
        Ok(Remote { http, base: url.trim_end_matches('/').to_owned(), token })
    }

    async fn send(&self, method: reqwest::Method, path: &str, body: Option<Value>) -> anyhow::Result<Value> {
        let mut req = self.http.request(method, format!("{}{path}", self.base));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        if let Some(b) = body {
            req = req.json(&b);
        }
        let r = req.send().await.with_context(|| format!("{}{path}", self.base))?;
        let status = r.status();
        let v: Value = r.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            let code = v["error"]["code"].as_str().unwrap_or("error");
            let message = v["error"]["message"].as_str().unwrap_or("");
            bail!("{} {path}: {} {code}: {message}", status.as_u16(), status.canonical_reason().unwrap_or(""));
        }
        Ok(v)
    }

    async fn get(&self, path: &str) -> anyhow::Result<Value> {
        self.send(reqwest::Method::GET, path, None).await
    }

    async fn post(&self, path: &str, body: Value) -> anyhow::Result<Value> {
        self.send(reqwest::Method::POST, path, Some(body)).await
    }

    /// Every row of a paged list, `limit` at most.
    async fn all(&self, path: &str, key: &str, limit: u32) -> anyhow::Result<Vec<Value>> {
        let sep = if path.contains('?') { '&' } else { '?' };
        let mut rows = Vec::new();
        let mut after = 0i64;
        loop {
            let page = self.get(&format!("{path}{sep}after={after}&limit={}", limit.clamp(1, 1000))).await?;
            rows.extend(page[key].as_array().cloned().unwrap_or_default());
            match page["next_after"].as_i64() {
                Some(a) if (rows.len() as u32) < limit => after = a,
                _ => break,
            }
        }
        rows.truncate(limit as usize);
        Ok(rows)
    }
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap_or("-")
}

/// A number as a number: `Value`'s Display ignores a width, and the columns would drift.
fn n(v: &Value) -> i64 {
    v.as_i64().unwrap_or(0)
}

fn job_line(j: &Value) -> String {
    let err = j["last_error"]["code"].as_str().map(|c| format!(" {c}")).unwrap_or_default();
    let charged = j["cost"].as_i64().or(j["hold"].as_i64()).unwrap_or(0);
    format!(
        "{:<24} {:<10} {:<11} {:<12} charged {:>6} net {:>7} attempt {}/{}{}{}",
        s(&j["id"]),
        s(&j["kind"]),
        s(&j["state"]),
        s(&j["account_id"]),
        charged,
        j["net"].as_i64().unwrap_or(0),
        j["attempt"].as_u64().unwrap_or(0),
        j["max_attempts"].as_u64().unwrap_or(0),
        if j["cancel_requested"].as_bool() == Some(true) { " cancel-requested" } else { "" },
        err
    )
}

pub async fn ledger(r: &Remote, account: &str) -> anyhow::Result<()> {
    let acc = r.get(&format!("/v1/accounts/{}", enc(account))).await?;
    out!("  ledger of {} (overdraft limit {})", s(&acc["id"]), n(&acc["overdraft_limit"]))?;
    out!("{}", crate::print::LEDGER_HEADER)?;
    for e in r.all(&format!("/v1/accounts/{}/ledger", enc(account)), "entries", u32::MAX).await? {
        out!(
            "  {:>5}  {:<13} {:>+8} {:>9}  {:<14} {:<8} {:<27} {}",
            n(&e["seq"]),
            s(&e["kind"]),
            e["amount"].as_i64().unwrap_or(0),
            n(&e["balance_after"]),
            s(&e["job_id"]),
            s(&e["item_id"]),
            s(&e["created_at"]),
            e["reason"].as_str().or(e["id"].as_str()).unwrap_or("")
        )?;
    }
    out!("  balance {}", n(&acc["balance"]))?;
    Ok(())
}

pub async fn jobs(r: &Remote, cmd: Jobs) -> anyhow::Result<()> {
    match cmd {
        Jobs::List { state, kind, account, fail_code, limit } => {
            let mut q = String::from("/v1/jobs?");
            for (k, v) in [("state", state), ("kind", kind), ("account_id", account), ("fail_code", fail_code)] {
                if let Some(v) = v {
                    q.push_str(&format!("{k}={}&", enc(&v)));
                }
            }
            for j in r.all(q.trim_end_matches(['&', '?']), "jobs", limit).await? {
                out!("{}", job_line(&j))?;
            }
        }
        Jobs::Show { id } => show_job(r, &id).await?,
        Jobs::AbandonCleanup { id, reason } => {
            let j = r.post(&format!("/v1/jobs/{}/abandon-cleanup", enc(&id)), json!({ "reason": reason })).await?;
            out!("{}", job_line(&j))?;
        }
    }
    Ok(())
}

async fn show_job(r: &Remote, id: &str) -> anyhow::Result<()> {
    let j = r.get(&format!("/v1/jobs/{}", enc(id))).await?;
    out!("{}", job_line(&j))?;
    out!(
        "  refund_on {}  not_before {}  created {}  updated {}",
        s(&j["refund_on"]),
        s(&j["not_before"]),
        s(&j["created_at"]),
        s(&j["updated_at"])
    )?;
    if let Some(code) = j["last_error"]["code"].as_str() {
        out!("  last error {code}: {}", j["last_error"]["message"].as_str().unwrap_or(""))?;
    }
    for i in j["items"].as_array().into_iter().flatten() {
        let price = match (i["hold"].as_i64(), i["cost"].as_i64()) {
            (None, c) => format!("cost {:>6}", c.unwrap_or(0)),
            (Some(h), Some(c)) => format!("cost {c:>6} of a hold of {h}"),
            (Some(h), None) => format!("held {h:>6}, not priced"),
        };
        out!(
            "  item {:<16} {price} {:<10} {}",
            s(&i["id"]),
            s(&i["state"]),
            i["refund_reason"].as_str().unwrap_or("")
        )?;
    }
    let history = r.get(&format!("/v1/jobs/{}/history", enc(id))).await?;
    for p in history["allocations"].as_array().into_iter().flatten() {
        let from = match (p["grant_id"].as_str(), p["origin"].as_str()) {
            (None, _) => "debt (no grant covered it)".to_owned(),
            (Some(g), Some("opening")) => format!("the opening balance of {g}"),
            (Some(g), origin) => format!("{} {g}", origin.unwrap_or("grant")),
        };
        out!(
            "  paid {:>6} by {from:<32} {:<8} item {:<12} given back {}",
            n(&p["taken"]),
            s(&p["kind"]),
            s(&p["item_id"]),
            n(&p["given_back"])
        )?;
    }
    let attempts = r.get(&format!("/v1/jobs/{}/attempts", enc(id))).await?;
    for a in attempts["attempts"].as_array().into_iter().flatten() {
        out!(
            "  attempt {:>2} {:<16} started {} finished {} {} {} {}",
            n(&a["attempt_no"]),
            s(&a["worker"]),
            s(&a["started_at"]),
            s(&a["finished_at"]),
            a["result"].as_str().unwrap_or("open"),
            a["fail_code"].as_str().unwrap_or(""),
            a["message"].as_str().unwrap_or("")
        )?;
    }
    for a in history["actions"].as_array().into_iter().flatten() {
        out!("  action {:<20} by {:<16} at {} {}", s(&a["action"]), s(&a["actor"]), s(&a["at"]), a["detail"])?;
    }
    for g in history["signals"].as_array().into_iter().flatten() {
        out!(
            "  signal {:<12} {:<9} attempt {} at {} {} {}",
            s(&g["signal"]),
            s(&g["effect"]),
            g["attempt_no"].as_u64().map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
            s(&g["received_at"]),
            g["fail_code"].as_str().unwrap_or(""),
            g["message"].as_str().unwrap_or("")
        )?;
    }
    Ok(())
}

pub async fn accounts(r: &Remote, cmd: Accounts) -> anyhow::Result<()> {
    let Accounts::Show { id } = cmd;
    let a = r.get(&format!("/v1/accounts/{}", enc(&id))).await?;
    out!("{}  balance {}  overdraft limit {}", s(&a["id"]), a["balance"], n(&a["overdraft_limit"]))?;
    if let Some(cap) = a["max_running"].as_i64() {
        out!("  at most {cap} jobs running at once (max_running)")?;
    }
    for g in r.all(&format!("/v1/accounts/{}/grants", enc(&id)), "grants", u32::MAX).await? {
        let expiry = match (g["expires_at"].as_str(), g["state"].as_str()) {
            (None, _) => "never expires".to_owned(),
            (Some(at), Some("expired")) => format!("expired {at}"),
            (Some(at), _) => format!("expires {at}"),
        };
        out!(
            "  {:<10} {:<24} amount {:>8}  left {:>8}  priority {:>3}  {:<8} {}",
            s(&g["origin"]),
            s(&g["id"]),
            n(&g["amount"]),
            n(&g["remaining"]),
            n(&g["priority"]),
            s(&g["state"]),
            expiry
        )?;
    }
    Ok(())
}

pub async fn withdrawals(r: &Remote, cmd: Withdrawals) -> anyhow::Result<()> {
    match cmd {
        Withdrawals::List { state, account, limit } => {
            let mut q = String::from("/v1/withdrawals?");
            for (k, v) in [("state", state), ("account_id", account)] {
                if let Some(v) = v {
                    q.push_str(&format!("{k}={}&", enc(&v)));
                }
            }
            out!("{}", crate::operator::WITHDRAWALS_HEADER)?;
            for w in r.all(q.trim_end_matches(['&', '?']), "withdrawals", limit).await? {
                out!(
                    "{:<24} {:<10} {:<12} {:>9} {:<24} {:<22} {}",
                    s(&w["job"]["id"]),
                    s(&w["job"]["state"]),
                    s(&w["job"]["account_id"]),
                    n(&w["amount"]),
                    s(&w["provider_txid"]),
                    s(&w["job"]["last_error"]["code"]),
                    s(&w["destination"])
                )?;
            }
        }
        Withdrawals::Show { id } => {
            let w = r.get(&format!("/v1/withdrawals/{}", enc(&id))).await?;
            out!(
                "{}  amount {}  to {}  key {}  txid {}{}",
                s(&w["job"]["id"]),
                n(&w["amount"]),
                s(&w["destination"]),
                s(&w["idempotency_key"]),
                s(&w["provider_txid"]),
                w["returned_at"].as_str().map(|t| format!("  returned {t}")).unwrap_or_default()
            )?;
            show_job(r, &id).await?;
        }
    }
    Ok(())
}

pub async fn dead_letters(r: &Remote, cmd: DeadLetters) -> anyhow::Result<bool> {
    match cmd {
        DeadLetters::List { limit } => {
            for j in r.all("/v1/jobs?state=dead", "jobs", limit).await? {
                out!("{}", job_line(&j))?;
            }
            Ok(true)
        }
        DeadLetters::Requeue { ids } => {
            anyhow::ensure!(!ids.is_empty(), "name the jobs to requeue");
            let mut all_ok = true;
            for id in ids {
                match r.send(reqwest::Method::POST, &format!("/v1/jobs/{}/requeue", enc(&id)), None).await {
                    Ok(j) => out!("{id}: requeued ({})", s(&j["state"]))?,
                    Err(e) => {
                        all_ok = false;
                        out!("{id}: not requeued: {e}")?;
                    }
                }
            }
            Ok(all_ok)
        }
    }
}

pub async fn failures(r: &Remote) -> anyhow::Result<()> {
    out!("{:<32} {:<9} {:>7}", "code", "state", "jobs")?;
    for f in r.get("/v1/failures/summary").await?["by_code"].as_array().into_iter().flatten() {
        out!("{:<32} {:<9} {:>7}", s(&f["code"]), s(&f["state"]), n(&f["count"]))?;
    }
    Ok(())
}

pub async fn events(r: &Remote, cmd: Events) -> anyhow::Result<()> {
    let Events::Tail { mut after, follow } = cmd;
    loop {
        let wait = if follow { 25 } else { 0 };
        let page = r.get(&format!("/v1/events?after={after}&limit=1000&wait_seconds={wait}")).await?;
        for e in page["events"].as_array().into_iter().flatten() {
            out!(
                "{:>8} {} {:<22} {:<16} {}",
                n(&e["seq"]),
                s(&e["created_at"]),
                s(&e["type"]),
                s(&e["job_id"]),
                e["data"]
            )?;
            after = e["seq"].as_i64().unwrap_or(after);
        }
        match page["next_after"].as_i64() {
            // A page that looked past other tenants' events moves the cursor on (issue 41).
            Some(next) => after = after.max(next),
            None if !follow => return Ok(()),
            None => {}
        }
    }
}

pub async fn audit(r: &Remote) -> anyhow::Result<bool> {
    let a = r.get("/v1/audit").await?;
    let ok = a["ok"].as_bool() == Some(true);
    if ok {
        out!(
            "audit: clean ({} accounts, {} items checked; L1-L9 hold)",
            n(&a["accounts_checked"]),
            a["items_checked"]
        )?;
        return Ok(true);
    }
    let violations = a["violations"].as_array().cloned().unwrap_or_default();
    out!("audit: {} violation(s)", violations.len())?;
    for v in &violations {
        let mut at = Vec::new();
        for (what, key) in [("account", "account_id"), ("job", "job_id"), ("item", "item_id")] {
            if let Some(x) = v[key].as_str() {
                at.push(format!("{what} {x}"));
            }
        }
        out!("  {} [{}] {}", s(&v["invariant"]), at.join(", "), s(&v["message"]))?;
    }
    Ok(false)
}
