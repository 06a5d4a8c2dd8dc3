//! `settle bench`: guarded transitions per second on a throwaway SQLite store, beside the
//! engine's own limit (empty commits of one row) measured in the same run.

use anyhow::Context;
use settle_core::Credits;
use settle_core::ids::*;
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
    concurrency: Vec<usize>,
    /// Largest write batch of the SQLite writer (1 disables batching).
    #[arg(long, value_delimiter = ',', default_value = "1,256")]
    batch: Vec<usize>,
    /// Durability settings to measure on SQLite: full, normal.
    #[arg(long, value_delimiter = ',', default_value = "full,normal")]
    sync: Vec<String>,
    /// Measure PostgreSQL instead: the URL of a server (each run gets a fresh database there).
    /// Durability is the server's own (`synchronous_commit=on` is forced on Settle's sessions).
    #[arg(long)]
    postgres: Option<String>,
}

pub async fn run(args: BenchArgs) -> anyhow::Result<()> {
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
    for &concurrency in &args.concurrency {
        let url = fresh_pg_database(server).await?;
        let options = StoreOptions { pg_max_connections: concurrency.clamp(1, 64) as u32, ..StoreOptions::default() };
        let store = Arc::new(SqlStore::open(&url, options).await?);
        let rate = drive(store.clone(), concurrency.max(1), args.jobs).await?;
        println!(
            "{concurrency:>11} {rate:>14.0} {raw:>16.0} {:>9.2}   (transaction retries: {})",
            rate / raw,
            store.tx_retries()
        );
    }
    Ok(())
}

async fn fresh_pg_database(server: &str) -> anyhow::Result<String> {
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
    let mut accounts = Vec::new();
    for a in 0..concurrency {
        let id = AccountId::parse(&format!("acct-{a}"))?;
        store.create_account(NewAccount { id: id.clone(), overdraft_limit: Credits::ZERO }).await?;
        store
            .grant(
                &id,
                NewGrant { id: RefId::parse(&format!("g-{a}"))?, amount: Credits::new(1_000_000_000), reason: None },
            )
            .await?;
        accounts.push(id);
    }
    let per_client = jobs / concurrency;
    let started = Instant::now();
    let mut handles = Vec::new();
    for (c, account) in accounts.into_iter().enumerate() {
        let store = store.clone();
        handles.push(tokio::spawn(async move {
            let kind = JobKind::parse("bench").expect("valid kind");
            for n in 0..per_client {
                let id = JobId::parse(&format!("j-{c}-{n}")).expect("valid id");
                let req = NewJob {
                    id: id.clone(),
                    account_id: account.clone(),
                    kind: kind.clone(),
                    items: vec![NewItem { id: ItemId::main(), cost: Credits::new(3) }],
                    payload: "null".into(),
                    max_attempts: None,
                    refund_on: None,
                    not_before: None,
                };
                store.create_job(req).await?;
                let claim = ClaimRequest {
                    worker: WorkerName::parse(&format!("w{c}")).expect("valid"),
                    kinds: vec![],
                    limit: 1,
                    lease_seconds: Some(30),
                };
                let claimed = store.claim(claim).await?;
                // Another client may have claimed this one; succeed whatever we got, then ours from any attempt.
                for got in &claimed {
                    store.succeed(&JobId::parse(&got.job.id).expect("valid"), Some(&got.lease_token)).await?;
                }
                if claimed.is_empty() {
                    store.succeed(&id, None).await?;
                }
            }
            Ok::<(), StoreError>(())
        }));
    }
    for h in handles {
        h.await.context("bench client")??;
    }
    let elapsed = started.elapsed().as_secs_f64();
    let report = store.audit().await?;
    anyhow::ensure!(report.ok(), "audit failed after the benchmark: {:?}", report.violations);
    Ok((per_client * concurrency * 3) as f64 / elapsed)
}

/// The engine's own limit: one-row INSERT transactions (BEGIN IMMEDIATE … COMMIT) on one
/// connection with the same durability — what a commit costs with no Settle logic at all.
async fn raw_commits_per_second(durability: Durability, n: usize) -> anyhow::Result<f64> {
    let dir = tempfile::tempdir()?;
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
