//! `settle serve` (the HTTP API plus the background loops) and `settle worker` (the loops alone),
//! until SIGINT or SIGTERM; requests in flight are finished first.

use crate::config::Config;
use anyhow::Context;
use settle_api::{Application, Tokens};
use settle_store::{ObjectArtifactStore, SqlStore, Store, StoreCheck, StoreOptions};
use settle_worker::payouts::{HttpProvider, HttpProviderConfig, PayoutProcessor, PayoutSettings};
use settle_worker::webhooks::Deliverer;
use settle_worker::{LoopSettings, Maintenance};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true, default_value = "sqlite://settle.db")]
    db: String,
    #[arg(long, env = "SETTLE_LISTEN", default_value = "127.0.0.1:7070")]
    listen: String,
    /// Bearer tokens: a file of `ROLE TOKEN` lines (roles admin, client, worker).
    #[arg(long, env = "SETTLE_TOKENS_FILE")]
    tokens: Option<std::path::PathBuf>,
    /// Where workers' artifacts live; teardown deletes those of undelivered items: a directory
    /// (`file:///srv/artifacts` or a path), `s3://bucket/prefix` (credentials, region and
    /// `AWS_ENDPOINT_URL` from the standard AWS environment variables) or `memory://`.
    #[arg(long, env = "SETTLE_ARTIFACTS", default_value = "settle-artifacts")]
    artifacts: String,
    /// Retry policy per job kind and the pace of the background loops (TOML; see `settle config`).
    #[arg(long, env = "SETTLE_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Signs the console's sessions (32 characters or more), so that every process serving one
    /// address accepts the others'; without it each process signs with a key of its own.
    #[arg(long, env = "SETTLE_CONSOLE_SECRET", hide_env_values = true)]
    console_secret: Option<String>,
    /// Do not apply migrations: refuse a schema older than this binary (migrations are then an
    /// explicit step, `settle migrate`, run once before a new release's processes start).
    #[arg(long, env = "SETTLE_NO_MIGRATE")]
    no_migrate: bool,
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true, default_value = "sqlite://settle.db")]
    db: String,
    #[arg(long, env = "SETTLE_ARTIFACTS", default_value = "settle-artifacts")]
    artifacts: String,
    #[arg(long, env = "SETTLE_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Do not apply migrations: refuse a schema older than this binary (migrations are then an
    /// explicit step, `settle migrate`, run once before a new release's processes start).
    #[arg(long, env = "SETTLE_NO_MIGRATE")]
    no_migrate: bool,
}

pub fn loop_settings(config: &Config) -> LoopSettings {
    LoopSettings {
        rescue_every: Duration::from_millis(config.loops.rescue_every_ms),
        sweep_every: Duration::from_millis(config.loops.sweep_every_ms),
        reconcile_every: Duration::from_millis(config.loops.reconcile_every_ms),
        batch: config.loops.batch,
    }
}

async fn open(db: &str, artifacts: &str, config: &Config, migrate: bool) -> anyhow::Result<Arc<SqlStore>> {
    let artifacts = ObjectArtifactStore::open(artifacts)?;
    anyhow::ensure!(
        !artifacts.is_memory(),
        "--artifacts memory:// is for tests in one process: workers elsewhere cannot write there"
    );
    match artifacts.check().await {
        Ok(()) => tracing::info!(artifacts = artifacts.location(), "artifact store"),
        Err(e @ StoreCheck::Misconfigured(_)) => return Err(e.into()),
        Err(e) => tracing::warn!("{e}; teardowns stay cancelling until it answers"),
    }
    let options = StoreOptions {
        policy: config.policies.clone(),
        pg_synchronous_standby: config.postgres.synchronous_standby.required(),
        artifacts: Some(Arc::new(artifacts)),
        migrate,
        ..StoreOptions::default()
    };
    Ok(Arc::new(SqlStore::open(db, options).await.with_context(|| format!("open {}", settle_store::redacted_url(db)))?))
}

/// How long shutdown waits for the loops to finish the send or pass they are in.
const LOOPS_STOP_WITHIN: Duration = Duration::from_secs(15);

async fn join_loops(loops: Vec<tokio::task::JoinHandle<()>>) {
    let all = async {
        for l in loops {
            let _ = l.await;
        }
    };
    if tokio::time::timeout(LOOPS_STOP_WITHIN, all).await.is_err() {
        tracing::warn!("background loops did not stop in time; leaving them (their leases will expire)");
    }
}

/// The payout processor, when a provider is configured; otherwise withdrawals wait queued (and
/// unknown ones stay unknown: no one can ask the provider).
fn payout_processor(store: &Arc<SqlStore>, config: &Config) -> anyhow::Result<Option<PayoutProcessor>> {
    let Some(p) = &config.provider else {
        tracing::warn!(
            "no payout provider configured ([provider] url or SETTLE_PROVIDER_URL): withdrawals are accepted and wait queued"
        );
        return Ok(None);
    };
    let provider = HttpProvider::new(&HttpProviderConfig {
        url: p.url.clone(),
        timeout: Duration::from_millis(p.timeout_ms),
        connect_timeout: Duration::from_millis(p.connect_timeout_ms),
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    let settings = PayoutSettings {
        every: Duration::from_millis(config.loops.payout_every_ms),
        reconcile_every: Duration::from_millis(config.loops.reconcile_every_ms),
        batch: config.loops.batch.min(settle_core::limits::PAYOUTS_IN_FLIGHT_MAX),
        return_window: Duration::from_secs(p.return_window_seconds),
    };
    // One name per process, in the attempt log: which processor made which attempt.
    let worker = settle_core::ids::WorkerName::parse(&format!("payouts@pid-{}", std::process::id()))?;
    tracing::info!(provider = %p.url, "payout processor running");
    Ok(Some(PayoutProcessor::new(store.clone() as Arc<dyn Store>, Arc::new(provider), worker, settings)))
}

/// The maintenance loops, the payout processor and one webhook deliverer per configured endpoint.
fn spawn_loops(
    store: &Arc<SqlStore>,
    config: &Config,
    cancel: &CancellationToken,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut handles = Maintenance::new(store.clone() as Arc<dyn Store>, loop_settings(config)).spawn(cancel.clone());
    if let Some(processor) = payout_processor(store, config)? {
        handles.extend(processor.spawn(cancel.clone()));
    }
    for (n, endpoint) in config.webhooks.iter().enumerate() {
        let seed = store.now().micros() as u64 ^ (n as u64).wrapping_mul(0x9E37_79B9);
        let deliverer =
            Deliverer::new(store.clone() as Arc<dyn Store>, endpoint.clone(), seed).map_err(|e| anyhow::anyhow!(e))?;
        handles.push(tokio::spawn(deliverer.run(cancel.clone())));
    }
    Ok(handles)
}

/// `settle worker`: the background loops alone, for any number of processes on one PostgreSQL.
pub async fn run_worker(args: WorkerArgs) -> anyhow::Result<()> {
    let config = Config::from_process_env(args.config.as_deref())?;
    let store = open(&args.db, &args.artifacts, &config, !args.no_migrate).await?;
    tracing::info!(db = %settle_store::redacted_url(&args.db), engine = store.engine_name(), "settle worker running the background loops");
    let cancel = CancellationToken::new();
    let loops = spawn_loops(&store, &config, &cancel)?;
    shutdown_signal(cancel.clone()).await;
    join_loops(loops).await;
    Ok(())
}

fn load_tokens(args: &ServeArgs) -> anyhow::Result<Tokens> {
    let mut tokens = match &args.tokens {
        Some(path) => {
            // Tokens are secrets: a file others may read is refused, not used.
            use std::os::unix::fs::PermissionsExt;
            let mode =
                std::fs::metadata(path).with_context(|| format!("read {}", path.display()))?.permissions().mode();
            anyhow::ensure!(
                mode & 0o007 == 0,
                "{} is open to every user (mode {:o}): chmod o-rwx (or 600) it; tokens are secrets",
                path.display(),
                mode & 0o777
            );
            let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
            let tokens = Tokens::parse_file(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
            // An empty file must not turn authentication off: that is what leaving out --tokens does.
            anyhow::ensure!(
                !tokens.is_empty(),
                "{} holds no token: add `ROLE TOKEN [NAME]` lines, or leave out --tokens to serve on loopback without authentication",
                path.display()
            );
            tokens
        }
        None => Tokens::default(),
    };
    if let Ok(env) = std::env::var("SETTLE_TOKENS") {
        let more = Tokens::parse_env(&env).map_err(|e| anyhow::anyhow!("SETTLE_TOKENS: {e}"))?;
        anyhow::ensure!(
            !more.is_empty(),
            "SETTLE_TOKENS is set but names no token: set role=token pairs, or unset it to serve on loopback without authentication"
        );
        anyhow::ensure!(tokens.is_empty() || more.is_empty(), "tokens come from a file or SETTLE_TOKENS, not both");
        if !more.is_empty() {
            tokens = more;
        }
    }
    Ok(tokens)
}

/// Resolves at SIGINT or SIGTERM.
pub async fn signalled() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = ctrl_c => {}
        _ = term => {}
    }
}

async fn shutdown_signal(cancel: CancellationToken) {
    signalled().await;
    tracing::info!("shutting down: finishing requests in flight");
    cancel.cancel();
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let tokens = load_tokens(&args)?;
    let config = Config::from_process_env(args.config.as_deref())?;
    // The address first: a start refused for it (taken, or open without tokens) writes nothing —
    // no database file, no artifact directory.
    let bound = Application::bind(&args.listen, &tokens).await?;
    settle_api::app::check_console_secret(args.console_secret.as_deref())?;
    let store = open(&args.db, &args.artifacts, &config, !args.no_migrate).await?;
    let app = Application::build_on(
        bound,
        store.clone() as Arc<dyn Store>,
        tokens,
        config.http.limits(),
        args.console_secret.as_deref(),
        config.provider.is_some(),
    )?;
    let db = settle_store::redacted_url(&args.db);
    tracing::info!(addr = %app.local_addr(), %db, engine = store.engine_name(), "settle serving API v1");
    eprintln!("settle: serving on http://{} ({db})", app.local_addr());
    eprintln!(
        "settle: the console is at http://{0}/console, the API reference at http://{0}/docs (/openapi.json)",
        app.local_addr()
    );
    match &config.provider {
        Some(p) => eprintln!("settle: paying out withdrawals through {}", settle_store::redacted_url(&p.url)),
        None => {
            eprintln!(
                "settle: no payout provider configured (SETTLE_PROVIDER_URL): withdrawals are accepted and wait queued"
            );
            // Nothing will ever ask a provider about these: say so, and how to end them.
            let unknown = settle_store::WithdrawalFilter {
                state: Some(settle_core::job::JobState::Unknown),
                ..Default::default()
            };
            let page = store.payouts().withdrawals(&unknown, settle_store::Page { after: 0, limit: 1_000 }).await?;
            if !page.rows.is_empty() {
                let more = if page.next_after.is_some() { " or more" } else { "" };
                eprintln!(
                    "settle: {}{more} withdrawals are unknown with no provider to ask: once their outcome is confirmed \
                     elsewhere, resolve each with POST /v1/withdrawals/{{id}}/resolve (admin)",
                    page.rows.len()
                );
                tracing::warn!(unknown = page.rows.len(), "unknown withdrawals with no payout provider to ask");
            }
        }
    }
    let cancel = CancellationToken::new();
    let loops = spawn_loops(&store, &config, &cancel)?;
    let signal_cancel = cancel.clone();
    app.run_until(async move {
        tokio::select! {
            _ = shutdown_signal(signal_cancel.clone()) => {}
            _ = signal_cancel.cancelled() => {}
        }
    })
    .await
    .context("serve")?;
    cancel.cancel();
    join_loops(loops).await;
    Ok(())
}
