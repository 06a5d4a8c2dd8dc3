//! `settle serve` (the HTTP API plus the background loops) and `settle worker` (the loops alone),
//! until SIGINT or SIGTERM; requests in flight are finished first.

use crate::config::Config;
use anyhow::Context;
use settle_api::{Application, LiveTokens, Tokens};
use settle_store::{ObjectArtifactStore, SqlStore, Store, StoreCheck, StoreOptions};
use settle_worker::funding::{FundingProcessor, HttpFunding};
use settle_worker::payouts::{HttpProvider, HttpProviderConfig, PayoutProcessor};
use settle_worker::processor::ProcessorSettings;
use settle_worker::webhooks::{Deliverer, Endpoint};
use settle_worker::{LoopSettings, Maintenance};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(clap::Args)]
pub struct ServeArgs {
    /// The store (default `sqlite://settle.db`, or the config file's `db`). A PostgreSQL password
    /// may come from SETTLE_DATABASE_PASSWORD[_FILE] instead of the URL.
    #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true)]
    db: Option<String>,
    /// Where the API listens (default 127.0.0.1:7070, or the config file's `listen`).
    #[arg(long, env = "SETTLE_LISTEN")]
    listen: Option<String>,
    /// Bearer tokens: a file of `ROLE TOKEN` lines (roles admin, client, worker), or the config
    /// file's `tokens_file`. Re-read on SIGHUP.
    #[arg(long, env = "SETTLE_TOKENS_FILE")]
    tokens: Option<std::path::PathBuf>,
    /// Where workers' artifacts live; teardown deletes those of undelivered items: a directory
    /// (`file:///srv/artifacts` or a path), `s3://bucket/prefix` (credentials, region and
    /// `AWS_ENDPOINT_URL` from the standard AWS environment variables) or `memory://` (default
    /// `settle-artifacts`, or the config file's `artifacts`).
    #[arg(long, env = "SETTLE_ARTIFACTS")]
    artifacts: Option<String>,
    /// Retry policy per job kind, the pace of the background loops, webhooks, and where to serve
    /// (TOML; docs/configuration.md; `settle config` prints the result).
    #[arg(long, env = "SETTLE_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Signs the console's sessions (32 characters or more), so that every process serving one
    /// address accepts the others'; without it each process signs with a key of its own. Or
    /// SETTLE_CONSOLE_SECRET_FILE.
    #[arg(long, env = "SETTLE_CONSOLE_SECRET", hide_env_values = true)]
    console_secret: Option<String>,
    /// Do not apply migrations: refuse a schema older than this binary (migrations are then an
    /// explicit step, `settle migrate`, run once before a new release's processes start).
    #[arg(long, env = "SETTLE_NO_MIGRATE")]
    no_migrate: bool,
}

#[derive(clap::Args)]
pub struct WorkerArgs {
    #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true)]
    db: Option<String>,
    #[arg(long, env = "SETTLE_ARTIFACTS")]
    artifacts: Option<String>,
    #[arg(long, env = "SETTLE_CONFIG")]
    config: Option<std::path::PathBuf>,
    /// Do not apply migrations: refuse a schema older than this binary (migrations are then an
    /// explicit step, `settle migrate`, run once before a new release's processes start).
    #[arg(long, env = "SETTLE_NO_MIGRATE")]
    no_migrate: bool,
}

/// The store's URL: the flag (or SETTLE_DATABASE_URL), else the config file's, else the default;
/// with the password from SETTLE_DATABASE_PASSWORD[_FILE] when that is set.
pub fn database_url(flag: Option<&str>, config: &Config) -> anyhow::Result<String> {
    let url = config.server.db(flag);
    match crate::secrets::from_env(&crate::secrets::settle_env(), "SETTLE_DATABASE_PASSWORD")? {
        Some(password) => crate::secrets::with_password(&url, &password),
        None => Ok(url),
    }
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

/// Waits for `loops` to stop, `LOOPS_STOP_WITHIN` at most; false if some are left running (their
/// leases expire in the store, so what they held is taken up again).
async fn join_loops(loops: Vec<tokio::task::JoinHandle<()>>) -> bool {
    let all = async {
        for l in loops {
            let _ = l.await;
        }
    };
    if tokio::time::timeout(LOOPS_STOP_WITHIN, all).await.is_err() {
        tracing::warn!("background loops did not stop in time; leaving them (their leases will expire)");
        return false;
    }
    true
}

/// A processor's settings, its provider's client settings and its name in the attempt log (one
/// per process: which processor made which attempt).
fn processor_parts(
    p: &crate::config::Provider,
    config: &Config,
    name: &str,
) -> anyhow::Result<(HttpProviderConfig, ProcessorSettings, settle_core::ids::WorkerName)> {
    let client = HttpProviderConfig {
        url: p.url.clone(),
        timeout: Duration::from_millis(p.timeout_ms),
        connect_timeout: Duration::from_millis(p.connect_timeout_ms),
    };
    let settings = ProcessorSettings {
        every: Duration::from_millis(config.loops.payout_every_ms),
        reconcile_every: Duration::from_millis(config.loops.reconcile_every_ms),
        batch: config.loops.batch.min(settle_core::limits::PAYOUTS_IN_FLIGHT_MAX),
        return_window: Duration::from_secs(p.return_window_seconds),
    };
    let worker = settle_core::ids::WorkerName::parse(&format!("{name}@pid-{}", std::process::id()))?;
    Ok((client, settings, worker))
}

/// The maintenance loops, the payout and funding processors (each when its provider is
/// configured; otherwise its jobs wait queued, and unknown ones stay unknown: no one can ask), and
/// one webhook deliverer per configured endpoint.
fn spawn_loops(
    store: &Arc<SqlStore>,
    config: &Config,
    cancel: &CancellationToken,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut handles = Maintenance::new(store.clone() as Arc<dyn Store>, loop_settings(config)).spawn(cancel.clone());
    let dyn_store = store.clone() as Arc<dyn Store>;
    match &config.provider {
        Some(p) => {
            let (client, settings, worker) = processor_parts(p, config, "payouts")?;
            let provider = Arc::new(HttpProvider::new(&client).map_err(|e| anyhow::anyhow!(e))?);
            tracing::info!(provider = %p.url, "payout processor running");
            handles.extend(PayoutProcessor::new(dyn_store.clone(), provider, worker, settings).spawn(cancel.clone()));
        }
        None => tracing::warn!(
            "no payout provider configured ([provider] url or SETTLE_PROVIDER_URL): withdrawals are accepted and wait queued"
        ),
    }
    match &config.funding {
        Some(p) => {
            let (client, settings, worker) = processor_parts(p, config, "funding")?;
            let provider = Arc::new(HttpFunding::new(&client).map_err(|e| anyhow::anyhow!(e))?);
            tracing::info!(provider = %p.url, "funding processor running");
            handles.extend(FundingProcessor::new(dyn_store, provider, worker, settings).spawn(cancel.clone()));
        }
        None => tracing::info!(
            "no funding provider configured ([funding] url or SETTLE_FUNDING_URL): top-ups are accepted and wait queued"
        ),
    }
    Ok(handles)
}

/// One webhook deliverer per configured endpoint. A new list (SIGHUP) replaces them: an endpoint
/// gone or changed is stopped — the send in hand finished, its lease kept or let go in the store —
/// before one with the new settings starts; an unchanged one goes on untouched.
struct Deliverers {
    store: Arc<SqlStore>,
    cancel: CancellationToken,
    running: BTreeMap<String, (Endpoint, CancellationToken, tokio::task::JoinHandle<()>)>,
}

/// The deliverers a new endpoint list needs, made (the part that can fail) before anything stops.
struct NewDeliverers {
    keep: Vec<Endpoint>,
    start: Vec<(Endpoint, Deliverer)>,
}

impl Deliverers {
    fn new(store: Arc<SqlStore>, cancel: CancellationToken) -> Deliverers {
        Deliverers { store, cancel, running: BTreeMap::new() }
    }

    /// Makes a deliverer for every endpoint that is new or changed; touches nothing running.
    fn prepare(&self, endpoints: &[Endpoint]) -> anyhow::Result<NewDeliverers> {
        let mut next = NewDeliverers { keep: Vec::new(), start: Vec::new() };
        for (n, endpoint) in endpoints.iter().enumerate() {
            if self.running.get(&endpoint.id).is_some_and(|(old, _, _)| old == endpoint) {
                next.keep.push(endpoint.clone());
                continue;
            }
            let seed = self.store.now().micros() as u64 ^ (n as u64).wrapping_mul(0x9E37_79B9);
            let deliverer = Deliverer::new(self.store.clone() as Arc<dyn Store>, endpoint.clone(), seed)
                .map_err(|e| anyhow::anyhow!("[[webhooks]] {}: {e}", endpoint.id))?;
            next.start.push((endpoint.clone(), deliverer));
        }
        Ok(next)
    }

    /// Stops what `next` does not keep (all at once, each finishing its send) and starts the rest.
    async fn commit(&mut self, next: NewDeliverers) {
        let stopping: Vec<String> =
            self.running.keys().filter(|id| !next.keep.iter().any(|e| &e.id == *id)).cloned().collect();
        let mut handles = Vec::new();
        for id in &stopping {
            if let Some((_, cancel, handle)) = self.running.remove(id) {
                cancel.cancel();
                handles.push(handle);
            }
        }
        if !handles.is_empty() {
            let stopped = join_loops(handles).await;
            tracing::info!(endpoints = ?stopping, stopped, "webhook deliverers replaced or removed");
        }
        for (endpoint, deliverer) in next.start {
            let cancel = self.cancel.child_token();
            let handle = tokio::spawn(deliverer.run(cancel.clone()));
            tracing::info!(endpoint = %endpoint.id, "webhook deliverer running");
            self.running.insert(endpoint.id.clone(), (endpoint, cancel, handle));
        }
    }

    async fn stop(self) {
        for (_, cancel, _) in self.running.values() {
            cancel.cancel();
        }
        join_loops(self.running.into_values().map(|(_, _, handle)| handle).collect()).await;
    }
}

/// What SIGHUP re-reads: the tokens (`serve`: the tokens file or SETTLE_TOKENS, and the metrics
/// token) and the webhook endpoints, from the same sources the process started with. Any other
/// setting needs a restart.
struct Reload {
    config: Option<std::path::PathBuf>,
    /// The live tokens and the `--tokens` flag (None for `settle worker`).
    tokens: Option<(LiveTokens, Option<std::path::PathBuf>)>,
    deliverers: Deliverers,
}

impl Reload {
    /// All of it, or none: the configuration is read and checked, the tokens parsed and every new
    /// deliverer made before anything is replaced; what follows cannot fail.
    async fn once(&mut self) -> anyhow::Result<String> {
        let config = Config::from_process_env(self.config.as_deref())?;
        let tokens = match &self.tokens {
            Some((live, flag)) => {
                let tokens = load_tokens(config.server.tokens_file(flag.as_deref()).as_deref())?;
                anyhow::ensure!(
                    live.is_empty() == tokens.is_empty(),
                    "a reload cannot turn authentication on or off (restart for that)"
                );
                Some(tokens)
            }
            None => None,
        };
        let next = self.deliverers.prepare(&config.webhooks)?;
        let mut said = Vec::new();
        if let (Some((live, _)), Some(tokens)) = (&self.tokens, tokens) {
            let n = tokens.len();
            live.replace(tokens).map_err(|e| anyhow::anyhow!(e))?;
            said.push(format!("{n} tokens"));
        }
        self.deliverers.commit(next).await;
        said.push(format!("{} webhook endpoints", config.webhooks.len()));
        Ok(said.join(", "))
    }
}

/// SIGHUP, caught from the first moment of a start: its default action ends the process, and a
/// `systemctl reload` during a long start (migrations) would otherwise stop the service for good.
/// One that arrives before the reloads begin is kept and handled once they do.
fn catch_hangups() -> Option<tokio::signal::unix::Signal> {
    use tokio::signal::unix::{SignalKind, signal};
    match signal(SignalKind::hangup()) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(error = %e, "SIGHUP cannot be caught here: tokens and webhooks are read at start only");
            None
        }
    }
}

/// Re-reads on every SIGHUP until `cancel`; hands the deliverers back for shutdown.
async fn reload_on_hangup(
    mut reload: Reload,
    hangups: Option<tokio::signal::unix::Signal>,
    cancel: CancellationToken,
) -> Deliverers {
    let Some(mut hangups) = hangups else {
        cancel.cancelled().await;
        return reload.deliverers;
    };
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return reload.deliverers,
            _ = hangups.recv() => match reload.once().await {
                Ok(what) => {
                    tracing::info!(%what, "SIGHUP: reloaded");
                    eprintln!("settle: SIGHUP: reloaded {what}");
                }
                Err(e) => {
                    tracing::error!(error = %format!("{e:#}"), "SIGHUP: nothing reloaded; the running settings stay");
                    eprintln!("settle: SIGHUP: nothing reloaded ({e:#}); the running settings stay");
                }
            },
        }
    }
}

/// `settle worker`: the background loops alone, for any number of processes on one PostgreSQL.
pub async fn run_worker(args: WorkerArgs) -> anyhow::Result<()> {
    let hangups = catch_hangups();
    let config = Config::from_process_env(args.config.as_deref())?;
    let db = database_url(args.db.as_deref(), &config)?;
    let artifacts = config.server.artifacts(args.artifacts.as_deref());
    let store = open(&db, &artifacts, &config, !args.no_migrate).await?;
    tracing::info!(db = %settle_store::redacted_url(&db), engine = store.engine_name(), "settle worker running the background loops");
    let cancel = CancellationToken::new();
    let loops = spawn_loops(&store, &config, &cancel)?;
    let mut deliverers = Deliverers::new(store.clone(), cancel.clone());
    let first = deliverers.prepare(&config.webhooks)?;
    deliverers.commit(first).await;
    let reload = Reload { config: args.config.clone(), tokens: None, deliverers };
    let reloads = tokio::spawn(reload_on_hangup(reload, hangups, cancel.clone()));
    shutdown_signal(cancel.clone()).await;
    join_loops(loops).await;
    if let Ok(deliverers) = reloads.await {
        deliverers.stop().await;
    }
    Ok(())
}

/// The tokens `serve` checks: the tokens file or SETTLE_TOKENS (not both; neither is loopback
/// mode), and the metrics token (SETTLE_METRICS_TOKEN[_FILE]).
fn load_tokens(file: Option<&std::path::Path>) -> anyhow::Result<Tokens> {
    let mut tokens = match file {
        Some(path) => {
            // Tokens are secrets: a file others may read is refused, not used.
            let text = crate::secrets::read(path, "the tokens file")?;
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
    let env = crate::secrets::settle_env();
    if let Some(text) = env.get("SETTLE_TOKENS") {
        let more = Tokens::parse_env(text).map_err(|e| anyhow::anyhow!("SETTLE_TOKENS: {e}"))?;
        anyhow::ensure!(
            !more.is_empty(),
            "SETTLE_TOKENS is set but names no token: set role=token pairs, or unset it to serve on loopback without authentication"
        );
        anyhow::ensure!(tokens.is_empty(), "tokens come from a file or SETTLE_TOKENS, not both");
        tokens = more;
    }
    if let Some(token) = crate::secrets::from_env(&env, "SETTLE_METRICS_TOKEN")? {
        tokens.set_metrics_token(&token).map_err(|e| anyhow::anyhow!("SETTLE_METRICS_TOKEN: {e}"))?;
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
    let hangups = catch_hangups();
    let config = Config::from_process_env(args.config.as_deref())?;
    let tokens = load_tokens(config.server.tokens_file(args.tokens.as_deref()).as_deref())?;
    let db_url = database_url(args.db.as_deref(), &config)?;
    let console_secret = match args.console_secret {
        Some(secret) => {
            let env = crate::secrets::settle_env();
            anyhow::ensure!(
                !env.contains_key("SETTLE_CONSOLE_SECRET_FILE"),
                "the console secret and SETTLE_CONSOLE_SECRET_FILE are both given: give it one way"
            );
            Some(secret)
        }
        None => crate::secrets::from_env(&crate::secrets::settle_env(), "SETTLE_CONSOLE_SECRET")?,
    };
    // The address first: a start refused for it (taken, or open without tokens) writes nothing —
    // no database file, no artifact directory.
    let bound = Application::bind(&config.server.listen(args.listen.as_deref()), &tokens).await?;
    settle_api::app::check_console_secret(console_secret.as_deref())?;
    let store = open(&db_url, &config.server.artifacts(args.artifacts.as_deref()), &config, !args.no_migrate).await?;
    let app = Application::build_on(
        bound,
        store.clone() as Arc<dyn Store>,
        tokens,
        config.http.limits(),
        console_secret.as_deref(),
        config.provider.is_some(),
    )?;
    let db = settle_store::redacted_url(&db_url);
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
    let mut deliverers = Deliverers::new(store.clone(), cancel.clone());
    let first = deliverers.prepare(&config.webhooks)?;
    deliverers.commit(first).await;
    let reload = Reload { config: args.config.clone(), tokens: Some((app.tokens(), args.tokens.clone())), deliverers };
    let reloads = tokio::spawn(reload_on_hangup(reload, hangups, cancel.clone()));
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
    if let Ok(deliverers) = reloads.await {
        deliverers.stop().await;
    }
    Ok(())
}
