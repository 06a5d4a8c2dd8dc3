//! `settle bench`: guarded transitions per second on a throwaway SQLite store, beside the
//! engine's own limit (empty commits of one row) measured in the same run.

use anyhow::Context;
use settle_core::ids::*;
use settle_core::{Credits, Timestamp};
use settle_store::*;
use sqlx::{ConnectOptions, Connection};
use std::str::FromStr;
use std::sync::Arc;
use std::time::Instant;

#[derive(clap::Args)]
pub struct BenchArgs {
    /// Jobs per configuration; each is created, claimed and succeeded (3 guarded transitions).
    #[arg(long, default_value_t = 2_000)]
    jobs: usize,
    /// Concurrent clients.
    #[arg(long, value_delimiter = ',', default_value = "1,32")]
    pub concurrency: Vec<usize>,
    /// Largest write batch of the SQLite writer (1 disables batching).
    #[arg(long, value_delimiter = ',', default_value = "1,256")]
    batch: Vec<usize>,
    /// Durability settings to measure on SQLite: full, normal.
    #[arg(long, value_delimiter = ',', default_value = "full,normal")]
    sync: Vec<String>,
    /// Measure PostgreSQL instead: the URL of a server (each run gets a fresh database there).
    /// Durability is the server's own (`synchronous_commit=on` is forced on Settle's sessions).
    #[arg(long)]
    pub postgres: Option<String>,
    /// Measure claim long-poll wake-up latency instead (over HTTP; with --postgres the job is
    /// created by a second store, so the wake-up crosses LISTEN/NOTIFY).
    #[arg(long)]
    wake: bool,
    /// Wake-ups measured per case with --wake.
    #[arg(long, default_value_t = 50)]
    samples: usize,
    /// Measure event latency instead: from a create's commit to its event being read by a consumer
    /// tailing the feed as the HTTP long-poll does (SQLite, or --postgres), p50/p99 when idle, at
    /// half of the peak create rate and at the peak (--concurrency's last value writers).
    #[arg(long)]
    pub events: bool,
    /// Print only the engine's own one-row durable commit rate (SQLite `synchronous=FULL` in a
    /// file under --dir, or the --postgres server) and stop: the yardstick of scripts/bench-http.
    #[arg(long)]
    raw_commits: bool,
    /// Measure the cost of a transition as the ledger grows: fill one store (SQLite FULL, or a
    /// fresh database on the --postgres server) to each of these numbers of ledger entries (jobs of
    /// 10 items: one job per 10 entries) and measure transitions/s (--concurrency's last value,
    /// --jobs jobs), the full audit and the audit from a checkpoint at each.
    #[arg(long, value_delimiter = ',')]
    scale: Vec<u64>,
    /// With --scale or --console: keep the filled store (its path is printed at the end), to run
    /// `settle audit`, a profiler or `EXPLAIN` on it.
    #[arg(long)]
    keep: bool,
    /// Measure the operator console's pages instead: fill a SQLite store (FULL) with this many jobs
    /// of 10 items (a tenth of them dead, the rest queued for later) and time each page, served by
    /// `settle serve`'s own router over loopback HTTP.
    #[arg(long)]
    console: Option<u64>,
    /// Measure teardown instead: for each number N, a batch of N items with one 1 KiB artifact each
    /// is cancelled while running and the worker's CANCELLED report runs the teardown (refunds,
    /// the artifacts deleted, the terminal state); beside it, the store's own delete of N fresh keys.
    #[arg(long, value_delimiter = ',')]
    teardown: Vec<usize>,
    /// The artifact store of --teardown, as `settle serve --artifacts` names it (`s3://…` with the
    /// AWS environment); a directory under --dir if not given.
    #[arg(long)]
    artifacts: Option<String>,
    /// Measure the cost of a held job's capture beside a plain success instead: the same create →
    /// claim → succeed story, once with fixed-price jobs and once with held ones (a hold of 10
    /// priced at 3 by the success: a release entry each), SQLite (FULL, in --dir) or --postgres.
    #[arg(long)]
    held: bool,
    /// Measure the cost of a charge as an account's active grants grow instead: for each number N,
    /// every client's account holds N grants (mixed priorities and expiries, the head of the
    /// burn-down order paying every charge) and runs create → claim → succeed, SQLite (FULL, in
    /// --dir) or --postgres (docs/decisions/0023).
    #[arg(long, value_delimiter = ',')]
    grants: Vec<usize>,
    /// Where --raw-commits puts its SQLite file (a real disk, not tmpfs, or fsync costs nothing).
    #[arg(long, default_value = ".")]
    dir: std::path::PathBuf,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
    if args.wake {
        return run_wake(&args).await;
    }
    if !args.scale.is_empty() {
        return run_scale(&args).await;
    }
    if let Some(jobs) = args.console {
        return run_console(&args, jobs).await;
    }
    if !args.teardown.is_empty() {
        return run_teardown(&args).await;
    }
    if args.held {
        return run_held(&args).await;
    }
    if !args.grants.is_empty() {
        return run_grants(&args).await;
    }
    if args.raw_commits {
        let rate = match &args.postgres {
            Some(server) => pg_raw_commits_per_second(server, 2_000).await?,
            None => raw_commits_per_second_in(&args.dir, Durability::Full, 2_000).await?,
        };
        println!("{rate:.0}");
        return Ok(());
    }
    if let Some(server) = &args.postgres {
        return run_postgres(&args, server).await;
    }
    println!(
        "settle bench: SQLite (WAL), {} jobs per row, 3 guarded transitions per job (create+charge, claim, succeed)",
        args.jobs
    );
    println!(
        "{:<8} {:>6} {:>11} {:>14} {:>16} {:>9}",
        "sync", "batch", "concurrency", "transitions/s", "raw commits/s", "ratio"
    );
    for sync in &args.sync {
        let durability = match sync.as_str() {
            "full" => Durability::Full,
            "normal" => Durability::Normal,
            other => anyhow::bail!("unknown sync setting {other}: use full or normal"),
        };
        let raw = raw_commits_per_second(durability, 2_000).await?;
        for &batch in &args.batch {
            for &concurrency in &args.concurrency {
                let rate = transitions_per_second(durability, batch, concurrency.max(1), args.jobs).await?;
                println!("{sync:<8} {batch:>6} {concurrency:>11} {rate:>14.0} {raw:>16.0} {:>9.2}", rate / raw);
            }
        }
    }
    Ok(())
}

async fn run_postgres(args: &BenchArgs, server: &str) -> anyhow::Result<()> {
    println!(
        "settle bench: PostgreSQL at {server}, {} jobs per row, 3 guarded transitions per job (create+charge, claim, succeed)",
        args.jobs
    );
    println!("{:>11} {:>14} {:>16} {:>9}", "concurrency", "transitions/s", "raw commits/s", "ratio");
    let raw = pg_raw_commits_per_second(server, 2_000).await?;
    // `SETTLE_POSTGRES_SYNCHRONOUS_STANDBY=required` measures a formation's per-use check against
    // its primary's own URL (docs/decisions/0027).
    let synchronous = crate::config::Config::from_process_env(None)?.postgres.synchronous_standby.required();
    for &concurrency in &args.concurrency {
        let url = fresh_pg_database(server).await?;
        let options = StoreOptions {
            pg_max_connections: concurrency.clamp(1, 64) as u32,
            pg_synchronous_standby: synchronous,
            ..StoreOptions::default()
        };
        let store = Arc::new(SqlStore::open(&url, options).await?);
        let rate = drive(store.clone(), concurrency.max(1), args.jobs).await?;
        let plan = store.plan_counts();
        println!(
            "{concurrency:>11} {rate:>14.0} {raw:>16.0} {:>9.2}   (transaction retries: {}; batch plan: {} read ahead, {} skipped)",
            rate / raw,
            store.tx_retries(),
            plan.ahead,
            plan.skipped,
        );
    }
    Ok(())
}

/// Claim long-poll wake-ups over HTTP: from just before a job is created (on PostgreSQL by a second
/// store with its own pool) to the waiting claim's answer, and from a job's `not_before` to the
/// answer. The server's fallback re-check is set to 60 s, so only the wake-up path can answer.
async fn run_wake(args: &BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (url, engine) = match &args.postgres {
        Some(server) => (fresh_pg_database(server).await?, "PostgreSQL"),
        None => (format!("sqlite://{}", dir.path().join("wake.db").display()), "SQLite"),
    };
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await?);
    let other = match &args.postgres {
        Some(_) => Some(SqlStore::open(&url, StoreOptions::default()).await?),
        None => None,
    };
    let limits = settle_api::HttpLimits { long_poll_recheck: std::time::Duration::from_secs(60), ..Default::default() };
    let app = settle_api::Application::build_with(
        "127.0.0.1:0",
        store.clone() as Arc<dyn Store>,
        settle_api::Tokens::default(),
        limits,
    )
    .await?;
    let base = format!("http://{}", app.local_addr());
    let stop = tokio_util::sync::CancellationToken::new();
    let server = tokio::spawn(app.run_until(stop.clone().cancelled_owned()));
    let account = AccountId::parse("bench")?;
    store
        .create_account(
            NewAccount { id: account.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await?;
    let grant = NewGrant {
        id: RefId::parse("g")?,
        amount: Credits::new(1_000_000),
        reason: None,
        expires_at: None,
        priority: None,
    };
    store.grant(&account, grant, settle_store::SYSTEM_ACTOR).await?;
    let writer: &SqlStore = other.as_ref().unwrap_or(&store);
    let http = reqwest::Client::new();
    let job = |id: String, not_before| bench_job(&id, &account, 1, not_before);
    let (mut created, mut due) = (Vec::new(), Vec::new());
    for n in 0..args.samples.max(1) {
        let waiter = {
            let (http, base) = (http.clone(), base.clone());
            tokio::spawn(async move {
                let r = http
                    .post(format!("{base}/v1/claims"))
                    .json(&serde_json::json!({"worker": "bench", "wait_seconds": 30}))
                    .send()
                    .await;
                (r, Instant::now())
            })
        };
        wait_for_long_poll(&http, &base).await?;
        let sent = Instant::now();
        writer.create_job(job(format!("c{n}"), None)?).await?;
        let (answer, at) = waiter.await?;
        anyhow::ensure!(answer?.status().is_success(), "the claim failed");
        created.push(at.saturating_duration_since(sent));
        let not_before = settle_core::SystemClock.now_plus_millis(300);
        writer.create_job(job(format!("d{n}"), Some(not_before))?).await?;
        let r = http
            .post(format!("{base}/v1/claims"))
            .json(&serde_json::json!({"worker": "bench", "wait_seconds": 30}))
            .send()
            .await?;
        let answered = settle_core::SystemClock.now_micros();
        anyhow::ensure!(r.status().is_success(), "the claim failed");
        due.push(std::time::Duration::from_micros(answered.saturating_sub(not_before.micros()).max(0) as u64));
    }
    stop.cancel();
    server.await??;
    let line = |what: &str, mut v: Vec<std::time::Duration>| {
        v.sort();
        let at = |q: f64| v[((v.len() - 1) as f64 * q).round() as usize];
        println!("{what:<34} p50 {:>9.2?}  p99 {:>9.2?}  max {:>9.2?}", at(0.5), at(0.99), at(1.0));
    };
    println!(
        "settle bench --wake: {engine}, {} samples, claim long-poll over HTTP (fallback re-check 60 s)",
        args.samples.max(1)
    );
    line(if other.is_some() { "woken by a create (LISTEN/NOTIFY)" } else { "woken by a create (in process)" }, created);
    line("woken by not_before", due);
    Ok(())
}

/// Waits until the server shows a long-poll waiting (`settle_http_long_polls_waiting`).
async fn wait_for_long_poll(http: &reqwest::Client, base: &str) -> anyhow::Result<()> {
    let deadline = Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let text = http.get(format!("{base}/metrics")).send().await?.text().await?;
        if text.lines().any(|l| l == "settle_http_long_polls_waiting 1") {
            return Ok(());
        }
        anyhow::ensure!(Instant::now() < deadline, "the claim never started waiting");
        tokio::time::sleep(std::time::Duration::from_millis(2)).await;
    }
}

/// A job of kind `bench` with one item of `cost`.
pub(crate) fn bench_job(
    id: &str,
    account: &AccountId,
    cost: i64,
    not_before: Option<settle_core::Timestamp>,
) -> anyhow::Result<NewJob> {
    Ok(NewJob {
        id: JobId::parse(id)?,
        account_id: account.clone(),
        kind: JobKind::parse("bench")?,
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::new(cost)) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        refund_on: None,
        not_before,
        priority: None,
        requires: Default::default(),
    })
}

pub(crate) async fn fresh_pg_database(server: &str) -> anyhow::Result<String> {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(0);
    let mut conn = sqlx::postgres::PgConnectOptions::from_str(server)?.connect().await?;
    let name = format!("settle_bench_{}_{}", std::process::id(), N.fetch_add(1, Ordering::Relaxed));
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE IF EXISTS {name}"))).execute(&mut conn).await?;
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}"))).execute(&mut conn).await?;
    conn.close().await?;
    let (base, _) = server.rsplit_once('/').context("the server url must name a database, e.g. …/postgres")?;
    Ok(format!("{base}/{name}"))
}

/// PostgreSQL's own limit on this server: one-row INSERT transactions on one connection,
/// `synchronous_commit=on`.
async fn pg_raw_commits_per_second(server: &str, n: usize) -> anyhow::Result<f64> {
    let url = fresh_pg_database(server).await?;
    let mut conn =
        sqlx::postgres::PgConnectOptions::from_str(&url)?.options([("synchronous_commit", "on")]).connect().await?;
    sqlx::raw_sql("CREATE TABLE t (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, v bigint NOT NULL)")
        .execute(&mut conn)
        .await?;
    let started = Instant::now();
    for i in 0..n {
        sqlx::raw_sql("BEGIN").execute(&mut conn).await?;
        sqlx::query("INSERT INTO t (v) VALUES ($1)").bind(i as i64).execute(&mut conn).await?;
        sqlx::raw_sql("COMMIT").execute(&mut conn).await?;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    conn.close().await?;
    Ok(rate)
}

async fn transitions_per_second(
    durability: Durability,
    batch: usize,
    concurrency: usize,
    jobs: usize,
) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
    let url = format!("sqlite://{}", dir.path().join("bench.db").display());
    let store = Arc::new(
        SqlStore::open(&url, StoreOptions { durability, write_batch_max: batch, ..StoreOptions::default() }).await?,
    );
    drive(store, concurrency, jobs).await
}

/// `concurrency` clients, each with its own account, create, claim and succeed `jobs` jobs in all;
/// returns guarded transitions per second, after checking the audit.
async fn drive(store: Arc<SqlStore>, concurrency: usize, jobs: usize) -> anyhow::Result<f64> {
    drive_on(store, concurrency, jobs, "").await
}

/// `drive`, with ids prefixed by `run` so it can run again on the same store.
async fn drive_on(store: Arc<SqlStore>, concurrency: usize, jobs: usize, run: &str) -> anyhow::Result<f64> {
    drive_priced(store, concurrency, jobs, run, false, 1).await
}

/// Gives `account` `grants` grants of 10^9: the first (priority 0, never expiring) is the head of
/// the burn-down order; the rest have priorities 1–100 and expiries a year or more away.
async fn fill_grants(store: &SqlStore, account: &AccountId, run: &str, a: usize, grants: usize) -> anyhow::Result<()> {
    let now = settle_core::Clock::now(&settle_core::SystemClock);
    for g in 0..grants {
        let (priority, expires_at) = match g {
            0 => (0, None),
            _ => {
                let days = 365 + (g * 7 % 365) as i64;
                (1 + (g * 37 % 100) as i64, Some(Timestamp::from_micros(now.micros() + days * 86_400_000_000)))
            }
        };
        let req = NewGrant {
            id: RefId::parse(&format!("{run}g-{a}-{g}"))?,
            amount: Credits::new(1_000_000_000),
            reason: None,
            expires_at: if grants == 1 { None } else { expires_at },
            priority: Some(priority),
        };
        store.grant(account, req, settle_store::SYSTEM_ACTOR).await?;
    }
    Ok(())
}

/// `drive_on`; with `held`, each job holds 10 and its success prices it at 3 (7 released); each
/// client's account holds `grants` grants (`fill_grants`), made before the clock starts.
async fn drive_priced(
    store: Arc<SqlStore>,
    concurrency: usize,
    jobs: usize,
    run: &str,
    held: bool,
    grants: usize,
) -> anyhow::Result<f64> {
    let mut fills = Vec::new();
    for a in 0..concurrency {
        let (store, run) = (store.clone(), run.to_owned());
        fills.push(tokio::spawn(async move {
            let id = AccountId::parse(&format!("{run}acct-{a}"))?;
            let account = NewAccount { id: id.clone(), overdraft_limit: Credits::ZERO, max_running: None };
            store.create_account(account, settle_store::SYSTEM_ACTOR).await?;
            fill_grants(&store, &id, &run, a, grants.max(1)).await?;
            Ok::<AccountId, anyhow::Error>(id)
        }));
    }
    let mut accounts = Vec::new();
    for f in fills {
        accounts.push(f.await.context("bench setup")??);
    }
    let per_client = jobs / concurrency;
    let started = Instant::now();
    let mut handles = Vec::new();
    for (c, account) in accounts.into_iter().enumerate() {
        let store = store.clone();
        let run = run.to_owned();
        handles.push(tokio::spawn(async move {
            let kind = JobKind::parse("bench").expect("valid kind");
            let price = if held { Price::Hold(Credits::new(10)) } else { Price::Cost(Credits::new(3)) };
            let costs = if held { Costs::main(Credits::new(3)) } else { Costs::default() };
            for n in 0..per_client {
                let id = JobId::parse(&format!("{run}j-{c}-{n}")).expect("valid id");
                let req = NewJob {
                    id: id.clone(),
                    account_id: account.clone(),
                    kind: kind.clone(),
                    items: vec![NewItem { id: ItemId::main(), price }],
                    payload: serde_json::Value::Null,
                    max_attempts: None,
                    refund_on: None,
                    not_before: None,
                    priority: None,
                    requires: Default::default(),
                };
                store.create_job(req).await?;
                let claim = ClaimRequest {
                    worker: WorkerName::parse(&format!("w{c}")).expect("valid"),
                    kinds: vec![],
                    limit: 1,
                    lease_seconds: Some(30),
                    labels: Default::default(),
                };
                let claimed = store.claim(claim).await?;
                // Another client may have claimed this one; succeed whatever we got, then ours from any attempt.
                for got in &claimed {
                    let by = settle_store::Reporter::of(Some(&got.lease_token));
                    store.succeed_priced(&got.job.id, by, None, &costs).await?;
                }
                if claimed.is_empty() {
                    store.succeed_priced(&id, settle_store::Reporter::of(None), None, &costs).await?;
                }
            }
            Ok::<(), StoreError>(())
        }));
    }
    for h in handles {
        h.await.context("bench client")??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let report = store.audit(None).await?;
    anyhow::ensure!(report.ok(), "audit failed after the benchmark: {:?}", report.violations);
    Ok((per_client * concurrency * 3) as f64 / elapsed)
}

/// A fresh store for one configuration of a story: a database of its own on --postgres, or a
/// SQLite file (FULL) in `dir`.
async fn story_store(args: &BenchArgs, dir: &std::path::Path, concurrency: usize) -> anyhow::Result<Arc<SqlStore>> {
    Ok(Arc::new(match &args.postgres {
        Some(server) => {
            let url = fresh_pg_database(server).await?;
            let options =
                StoreOptions { pg_max_connections: concurrency.clamp(1, 64) as u32, ..StoreOptions::default() };
            SqlStore::open(&url, options).await?
        }
        None => {
            SqlStore::open(&format!("sqlite://{}", dir.join("story.db").display()), StoreOptions::default()).await?
        }
    }))
}

/// `settle bench --held`: a held job's capture (a release entry more) beside a plain success.
async fn run_held(args: &BenchArgs) -> anyhow::Result<()> {
    let concurrency = args.concurrency.last().copied().unwrap_or(32).max(1);
    let engine = match &args.postgres {
        Some(server) => format!("PostgreSQL at {server} (synchronous_commit=on)"),
        None => format!("SQLite (WAL, synchronous=FULL) in {}", args.dir.display()),
    };
    println!(
        "settle bench --held: {engine}, {} jobs, {concurrency} clients, create → claim → succeed; held jobs hold 10 \
         and are priced at 3 (a release of 7 each)",
        args.jobs
    );
    println!("{:<8} {:>14} {:>9}", "jobs", "transitions/s", "ratio");
    let mut plain = 0.0;
    for held in [false, true] {
        let dir = tempfile::tempdir_in(&args.dir)?;
        let store = story_store(args, dir.path(), concurrency).await?;
        let rate = drive_priced(store, concurrency, args.jobs, "", held, 1).await?;
        if !held {
            plain = rate;
        }
        let name = if held { "held" } else { "plain" };
        println!("{name:<8} {rate:>14.0} {:>9.2}", rate / plain);
    }
    Ok(())
}

/// `settle bench --grants`: the same story as an account's active grants grow.
async fn run_grants(args: &BenchArgs) -> anyhow::Result<()> {
    let concurrency = args.concurrency.last().copied().unwrap_or(32).max(1);
    let engine = match &args.postgres {
        Some(server) => format!("PostgreSQL at {server} (synchronous_commit=on)"),
        None => format!("SQLite (WAL, synchronous=FULL) in {}", args.dir.display()),
    };
    println!(
        "settle bench --grants: {engine}, {} jobs of 3 credits, {concurrency} clients (an account each), \
         create → claim → succeed; each account holds N active grants, the head of the order paying",
        args.jobs
    );
    println!("{:<8} {:>14} {:>9}", "grants", "transitions/s", "÷ first");
    let mut first = None;
    for &n in &args.grants {
        let dir = tempfile::tempdir_in(&args.dir)?;
        let store = story_store(args, dir.path(), concurrency).await?;
        let rate = drive_priced(store, concurrency, args.jobs, "", false, n).await?;
        let base = *first.get_or_insert(rate);
        println!("{n:<8} {rate:>14.0} {:>9.2}", rate / base);
    }
    Ok(())
}

/// `settle bench --scale`: per-transition cost and audit speed as the ledger grows.
async fn run_scale(args: &BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir_in(&args.dir)?;
    let concurrency = args.concurrency.last().copied().unwrap_or(32).max(1);
    let (url, engine) = match &args.postgres {
        Some(server) => (fresh_pg_database(server).await?, format!("PostgreSQL at {server} (a fresh database)")),
        None => (
            format!("sqlite://{}", dir.path().join("scale.db").display()),
            format!("SQLite (WAL, synchronous=FULL) in {}", args.dir.display()),
        ),
    };
    let options = StoreOptions { pg_max_connections: concurrency.clamp(1, 64) as u32, ..StoreOptions::default() };
    let store = Arc::new(SqlStore::open(&url, options).await?);
    println!(
        "settle bench --scale: {engine}, filled with jobs of 10 items; at each size a \
         checkpoint recorded (a full audit and its write: `record s`), {} jobs created, claimed, succeeded by \
         {concurrency} clients (3 transitions each), then a full audit and the audit from the checkpoint \
         (decision 0040); entries/s: the store's entries over the audit's time",
        args.jobs
    );
    println!(
        "{:>12} {:>10} {:>14} {:>11} {:>9} {:>11} {:>16} {:>9} {:>16}",
        "entries",
        "jobs",
        "transitions/s",
        "µs/transition",
        "record s",
        "audit s",
        "audit entries/s",
        "from s",
        "from entries/s"
    );
    let fill = AccountId::parse("fill")?;
    store
        .create_account(
            NewAccount { id: fill.clone(), overdraft_limit: Credits::new(1 << 60), max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await?;
    let mut filled: u64 = 0;
    let mut round = 0;
    for &target in &args.scale {
        filled += fill_to(&store, &fill, target.saturating_sub(filled) / 10, round).await?;
        settle_fill(&url).await?;
        round += 1;
        let (rate, record_secs, secs, from_secs) = scale_round(&store, concurrency, args.jobs, round).await?;
        let stats = store.stats().await?;
        let entries: i64 = stats.entries_by_kind.iter().map(|(_, n)| *n).sum();
        let jobs: i64 = stats.jobs_by_state.iter().map(|(_, n)| *n).sum();
        println!(
            "{entries:>12} {jobs:>10} {rate:>14.0} {:>11.0} {record_secs:>9.2} {secs:>11.2} {:>16.0} {from_secs:>9.3} {:>16.0}",
            1e6 / rate,
            entries as f64 / secs,
            entries as f64 / from_secs
        );
    }
    if args.keep {
        match &args.postgres {
            Some(_) => println!("kept: {url}"),
            None => println!("kept: {}", dir.keep().join("scale.db").display()),
        }
    }
    Ok(())
}

/// `--scale`'s fill: 32 tasks creating `needed` jobs of 10 one-credit items on `fill` (never due);
/// returns the entries added.
async fn fill_to(store: &Arc<SqlStore>, fill: &AccountId, needed: u64, round: u32) -> anyhow::Result<u64> {
    let per_task = needed.div_ceil(32);
    let progress = Arc::new(crate::progress::Progress::new(&format!("fill {round}"), needed));
    let mut tasks = Vec::new();
    for t in 0..32u64 {
        let (store, fill, progress) = (store.clone(), fill.clone(), progress.clone());
        let count = per_task.min(needed.saturating_sub(t * per_task));
        tasks.push(tokio::spawn(async move {
            let kind = JobKind::parse("fill").expect("valid kind");
            // Never due: a backlog that is there, not one the measured claims must skip over.
            let later = store.now().plus_seconds(10 * 365 * 24 * 3600);
            for n in 0..count {
                let items = (0..10)
                    .map(|i| NewItem {
                        id: ItemId::parse(&format!("i{i}")).expect("valid"),
                        price: Price::Cost(Credits::new(1)),
                    })
                    .collect();
                let req = NewJob {
                    id: JobId::parse(&format!("f{round}-{t}-{n}")).expect("valid id"),
                    account_id: fill.clone(),
                    kind: kind.clone(),
                    items,
                    payload: serde_json::Value::Null,
                    max_attempts: None,
                    refund_on: None,
                    not_before: Some(later),
                    priority: None,
                    requires: Default::default(),
                };
                store.create_job(req).await?;
                progress.inc(1);
            }
            Ok::<u64, StoreError>(count * 10)
        }));
    }
    let mut filled = 0;
    for t in tasks {
        filled += t.await.context("fill task")??;
    }
    progress.finish();
    Ok(filled)
}

/// After a fill, before the measurement: SQLite's WAL copied back into the database, so the
/// measurement does not share the disk with that checkpoint; PostgreSQL's tables analyzed and
/// vacuumed, as autovacuum would have done by then on a store that grew over time.
async fn settle_fill(url: &str) -> anyhow::Result<()> {
    if url.starts_with("sqlite:") {
        let mut conn = sqlx::sqlite::SqliteConnectOptions::from_str(url)?.connect().await?;
        sqlx::raw_sql("PRAGMA wal_checkpoint(TRUNCATE)").execute(&mut conn).await?;
        conn.close().await?;
    } else {
        let mut conn = sqlx::postgres::PgConnectOptions::from_str(url)?.connect().await?;
        sqlx::raw_sql("VACUUM (ANALYZE)").execute(&mut conn).await?;
        // Only a superuser (or pg_checkpoint) may; without it the server's own checkpoints run.
        let _ = sqlx::raw_sql("CHECKPOINT").execute(&mut conn).await;
        conn.close().await?;
    }
    Ok(())
}

/// One size of `--scale`: a checkpoint recorded, `jobs` jobs driven, then the full audit and the
/// audit from the checkpoint. Returns transitions/s and the three audits' seconds.
async fn scale_round(
    store: &Arc<SqlStore>,
    concurrency: usize,
    jobs: usize,
    round: u32,
) -> anyhow::Result<(f64, f64, f64, f64)> {
    let started = Instant::now();
    let recorded = store.audit_with(AuditRun { from_checkpoint: false, record: true }, None).await?;
    let record_secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(matches!(recorded.checkpoint.recorded, Some(Ok(_))), "no checkpoint: {recorded:?}");
    let rate = drive_on(store.clone(), concurrency, jobs, &format!("s{round}")).await?;
    let started = Instant::now();
    let report = store.audit(None).await?;
    let secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(report.ok(), "audit failed: {:?}", report.violations);
    let started = Instant::now();
    let from = store.audit_with(AuditRun { from_checkpoint: true, record: false }, None).await?;
    let from_secs = started.elapsed().as_secs_f64();
    anyhow::ensure!(from.ok(), "audit from the checkpoint failed: {:?}", from.violations);
    anyhow::ensure!(from.checkpoint.from.is_some(), "not from the checkpoint: {:?}", from.checkpoint);
    Ok((rate, record_secs, secs, from_secs))
}

/// `settle bench --console N`: how long the console's pages take with N jobs in the store.
/// `--teardown`: the cost of a cancelled batch's teardown as its artifacts grow, on one store
/// (SQLite FULL under --dir), beside the artifact store's own bulk delete of as many keys.
async fn run_teardown(args: &BenchArgs) -> anyhow::Result<()> {
    let dir = tempfile::tempdir_in(&args.dir)?;
    let artifacts = Arc::new(match &args.artifacts {
        Some(location) => ObjectArtifactStore::open(location)?,
        None => ObjectArtifactStore::local(dir.path().join("artifacts"))?,
    });
    artifacts.check().await?;
    let url = format!("sqlite://{}", dir.path().join("teardown.db").display());
    let options = StoreOptions { artifacts: Some(artifacts.clone()), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await?;
    let a = AccountId::parse("bench")?;
    store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::new(1 << 40), max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await?;
    println!("settle bench --teardown: SQLite (FULL), artifact store {}", artifacts.location());
    println!("  one artifact of 1 KiB per item; teardown = the CANCELLED report through the terminal state");
    println!("{:>7} {:>13} {:>13} {:>15} {:>9}", "items", "teardown ms", "raw del ms", "teardown keys/s", "vs raw");
    let worker = WorkerName::parse("bench")?;
    for (round, &n) in args.teardown.iter().enumerate() {
        let id = JobId::parse(&format!("teardown-{round}"))?;
        let items =
            (0..n).map(|i| Ok(NewItem { id: ItemId::parse(&format!("i{i}"))?, price: Price::Cost(Credits::new(1)) }));
        let req = NewJob {
            id: id.clone(),
            account_id: a.clone(),
            kind: JobKind::parse("render")?,
            items: items.collect::<anyhow::Result<_>>()?,
            payload: serde_json::Value::Null,
            max_attempts: None,
            refund_on: None,
            not_before: None,
            priority: None,
            requires: Default::default(),
        };
        store.create_job(req).await?;
        let claim = ClaimRequest {
            worker: worker.clone(),
            kinds: vec![],
            limit: 1,
            lease_seconds: Some(600),
            labels: Default::default(),
        };
        let token = store.claim(claim).await?.pop().context("the job is due")?.lease_token;
        let key = ArtifactKey::parse("out.bin")?;
        for i in 0..n {
            let item = ItemId::parse(&format!("i{i}"))?;
            store.register_artifact(&id, &item, &token, NewArtifact { key: key.clone() }).await?;
            artifacts.put(&key.path_in(id.as_str(), item.as_str()), vec![7; 1024]).await.map_err(anyhow::Error::msg)?;
        }
        store.cancel(&id, None).await?;
        let signal = FailSignal {
            lease_token: token,
            code: FailCode::parse("CANCELLED")?,
            message: None,
            retryable: None,
            retry_after_ms: None,
        };
        let started = Instant::now();
        let job = store.fail(&id, signal).await?.value;
        let teardown = started.elapsed();
        anyhow::ensure!(job.state == settle_core::job::JobState::Cancelled, "the teardown did not finish: {job:?}");
        let raw: Vec<String> = (0..n).map(|i| format!("raw-{round}/{i}/out.bin")).collect();
        for k in &raw {
            artifacts.put(k, vec![7; 1024]).await.map_err(anyhow::Error::msg)?;
        }
        let started = Instant::now();
        artifacts.delete_all(&raw).await.map_err(anyhow::Error::msg)?;
        let raw_delete = started.elapsed();
        println!(
            "{n:>7} {:>13.1} {:>13.1} {:>15.0} {:>8.2}×",
            teardown.as_secs_f64() * 1e3,
            raw_delete.as_secs_f64() * 1e3,
            n as f64 / teardown.as_secs_f64(),
            raw_delete.as_secs_f64() / teardown.as_secs_f64()
        );
    }
    Ok(())
}

/// `jobs` jobs of 10 items on `fill`, from 32 tasks; a tenth of them claimed, failed and dead (the
/// dead-letter pages have work to show), the rest not due for ten years.
async fn fill_console(store: &Arc<SqlStore>, fill: &AccountId, jobs: u64) -> anyhow::Result<()> {
    let mut tasks = Vec::new();
    let per_task = jobs.div_ceil(32);
    let progress = Arc::new(crate::progress::Progress::new("fill jobs", jobs));
    for t in 0..32u64 {
        let (store, fill, progress) = (store.clone(), fill.clone(), progress.clone());
        let count = per_task.min(jobs.saturating_sub(t * per_task));
        tasks.push(tokio::spawn(async move {
            let later = store.now().plus_seconds(10 * 365 * 24 * 3600);
            for n in 0..count {
                // A tenth of them fail and die: the dead-letter page has work to show.
                let dead = n % 10 == 0;
                let kind = JobKind::parse(if dead { "render" } else { "fill" }).expect("valid kind");
                let items = (0..10)
                    .map(|i| NewItem {
                        id: ItemId::parse(&format!("i{i}")).expect("valid"),
                        price: Price::Cost(Credits::new(1)),
                    })
                    .collect();
                let id = JobId::parse(&format!("job-{t}-{n}")).expect("valid id");
                let req = NewJob {
                    id: id.clone(),
                    account_id: fill.clone(),
                    kind: kind.clone(),
                    items,
                    payload: serde_json::Value::Null,
                    max_attempts: Some(1),
                    refund_on: None,
                    not_before: if dead { None } else { Some(later) },
                    priority: None,
                    requires: Default::default(),
                };
                store.create_job(req).await?;
                progress.inc(1);
                if dead {
                    let worker = WorkerName::parse("bench")?;
                    let claimed = store
                        .claim(ClaimRequest {
                            worker,
                            kinds: vec![kind],
                            limit: 1,
                            lease_seconds: None,
                            labels: Default::default(),
                        })
                        .await?;
                    for c in claimed {
                        let signal = FailSignal {
                            lease_token: c.lease_token,
                            code: FailCode::parse("TIMEOUT")?,
                            message: None,
                            retryable: Some(false),
                            retry_after_ms: None,
                        };
                        store.fail(&c.job.id, signal).await?;
                    }
                }
            }
            Ok::<(), anyhow::Error>(())
        }));
    }
    for t in tasks {
        t.await.context("fill task")??;
    }
    progress.finish();
    Ok(())
}

async fn run_console(args: &BenchArgs, jobs: u64) -> anyhow::Result<()> {
    let dir = tempfile::tempdir_in(&args.dir)?;
    let url = format!("sqlite://{}", dir.path().join("console.db").display());
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await?);
    let fill = AccountId::parse("fill")?;
    store
        .create_account(
            NewAccount { id: fill.clone(), overdraft_limit: Credits::new(1 << 60), max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await?;
    let started = Instant::now();
    fill_console(&store, &fill, jobs).await?;
    let stats = store.stats().await?;
    let entries: i64 = stats.entries_by_kind.iter().map(|(_, n)| *n).sum();
    println!(
        "settle bench --console: SQLite (WAL, FULL) in {}: {jobs} jobs of 10 items ({entries} ledger entries), filled in {:.0} s; \
         each page fetched 30 times over loopback HTTP from the server's own router, no tokens (loopback)",
        args.dir.display(),
        started.elapsed().as_secs_f64()
    );
    let app =
        settle_api::Application::build("127.0.0.1:0", store.clone() as Arc<dyn Store>, settle_api::Tokens::default())
            .await?;
    let base = format!("http://{}", app.local_addr());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    let http = reqwest::Client::new();
    println!("{:<44} {:>8} {:>8} {:>8} {:>10}", "page", "p50 ms", "p99 ms", "max ms", "bytes");
    let pages = [
        "/console",
        "/console/jobs",
        "/console/jobs?state=dead",
        "/console/jobs?kind=render&state=dead&after=5000",
        "/console/jobs?prefix=job-7-",
        "/console/jobs/job-3-10",
        "/console/accounts/fill",
        "/console/bulk?action=requeue&state=dead",
    ];
    for path in pages {
        let mut times = Vec::new();
        let mut bytes = 0;
        for _ in 0..30 {
            let t = Instant::now();
            let r = http.get(format!("{base}{path}")).send().await?;
            anyhow::ensure!(r.status().is_success(), "{path}: {}", r.status());
            bytes = r.bytes().await?.len();
            times.push(t.elapsed().as_secs_f64() * 1e3);
        }
        times.sort_by(f64::total_cmp);
        let pct = |p: f64| times[((times.len() - 1) as f64 * p).round() as usize];
        println!("{path:<44} {:>8.1} {:>8.1} {:>8.1} {bytes:>10}", pct(0.5), pct(0.99), times[times.len() - 1]);
    }
    let _ = stop.send(());
    server.await??;
    if args.keep {
        drop(store);
        let kept = dir.keep();
        println!("kept: {}", kept.join("console.db").display());
    }
    Ok(())
}

/// The engine's own limit: one-row INSERT transactions (BEGIN IMMEDIATE … COMMIT) on one
/// connection with the same durability — what a commit costs with no Settle logic at all.
async fn raw_commits_per_second(durability: Durability, n: usize) -> anyhow::Result<f64> {
    raw_commits_per_second_in(&std::env::temp_dir(), durability, n).await
}

async fn raw_commits_per_second_in(parent: &std::path::Path, durability: Durability, n: usize) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir_in(parent)?;
    let url = format!("sqlite://{}", dir.path().join("raw.db").display());
    let mut conn = sqlx::sqlite::SqliteConnectOptions::from_str(&url)?
        .create_if_missing(true)
        .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
        .synchronous(match durability {
            Durability::Full => sqlx::sqlite::SqliteSynchronous::Full,
            Durability::Normal => sqlx::sqlite::SqliteSynchronous::Normal,
        })
        .connect()
        .await?;
    sqlx::raw_sql("CREATE TABLE t (id INTEGER PRIMARY KEY, v INTEGER NOT NULL) STRICT").execute(&mut conn).await?;
    let started = Instant::now();
    for i in 0..n {
        sqlx::raw_sql("BEGIN IMMEDIATE").execute(&mut conn).await?;
        sqlx::query("INSERT INTO t (v) VALUES ($1)").bind(i as i64).execute(&mut conn).await?;
        sqlx::raw_sql("COMMIT").execute(&mut conn).await?;
    }
    let rate = n as f64 / started.elapsed().as_secs_f64();
    conn.close().await?;
    Ok(rate)
}
