//! `settle serve`: the HTTP API on an embedded SQLite file by default, plus the maintenance loops,
//! until SIGINT or SIGTERM; requests in flight are finished first.

use anyhow::Context;
use settle_api::{Application, Tokens};
use settle_store::{FsArtifactStore, SqlStore, Store, StoreOptions};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// How often the maintenance loop looks for expired leases and unfinished teardowns, and how many
/// jobs one pass takes at most (the next pass takes the rest).
const MAINTENANCE_EVERY: Duration = Duration::from_secs(1);
const MAINTENANCE_BATCH: u32 = 100;

#[derive(clap::Args)]
pub struct ServeArgs {
    #[arg(long, env = "SETTLE_DATABASE_URL", default_value = "sqlite://settle.db")]
    db: String,
    #[arg(long, env = "SETTLE_LISTEN", default_value = "127.0.0.1:7070")]
    listen: String,
    /// Bearer tokens: a file of `ROLE TOKEN` lines (roles admin, client, worker).
    #[arg(long, env = "SETTLE_TOKENS_FILE")]
    tokens: Option<std::path::PathBuf>,
    /// Where workers' artifacts live; teardown deletes those of undelivered items.
    #[arg(long, env = "SETTLE_ARTIFACTS", default_value = "settle-artifacts")]
    artifacts: std::path::PathBuf,
}

fn load_tokens(args: &ServeArgs) -> anyhow::Result<Tokens> {
    let mut tokens = match &args.tokens {
        Some(path) => {
            let text = std::fs::read_to_string(path).with_context(|| format!("read {}", path.display()))?;
            Tokens::parse_file(&text).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?
        }
        None => Tokens::default(),
    };
    if let Ok(env) = std::env::var("SETTLE_TOKENS") {
        let more = Tokens::parse_env(&env).map_err(|e| anyhow::anyhow!("SETTLE_TOKENS: {e}"))?;
        anyhow::ensure!(tokens.is_empty() || more.is_empty(), "tokens come from a file or SETTLE_TOKENS, not both");
        if !more.is_empty() {
            tokens = more;
        }
    }
    Ok(tokens)
}

async fn shutdown_signal(cancel: CancellationToken) {
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
    tracing::info!("shutting down: finishing requests in flight");
    cancel.cancel();
}

async fn maintenance(store: Arc<SqlStore>, cancel: CancellationToken) {
    loop {
        tokio::select! {
            _ = cancel.cancelled() => return,
            _ = tokio::time::sleep(MAINTENANCE_EVERY) => {}
        }
        match store.rescue_expired_leases(MAINTENANCE_BATCH).await {
            Ok(ids) if !ids.is_empty() => tracing::info!(count = ids.len(), "rescued jobs with expired leases"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "lease rescue pass failed"),
        }
        match store.resume_teardowns(MAINTENANCE_BATCH).await {
            Ok(ids) if !ids.is_empty() => tracing::info!(count = ids.len(), "finished interrupted teardowns"),
            Ok(_) => {}
            Err(e) => tracing::warn!(error = %e, "teardown sweep failed"),
        }
    }
}

pub async fn run(args: ServeArgs) -> anyhow::Result<()> {
    let tokens = load_tokens(&args)?;
    let options =
        StoreOptions { artifacts: Some(Arc::new(FsArtifactStore::new(&args.artifacts))), ..StoreOptions::default() };
    let store = Arc::new(SqlStore::open(&args.db, options).await.with_context(|| format!("open {}", args.db))?);
    let app = Application::build(&args.listen, store.clone() as Arc<dyn Store>, tokens).await?;
    tracing::info!(addr = %app.local_addr(), db = %args.db, engine = store.engine_name(), "settle serving API v1");
    eprintln!("settle: serving on http://{} ({})", app.local_addr(), args.db);
    let cancel = CancellationToken::new();
    let loops = tokio::spawn(maintenance(store.clone(), cancel.clone()));
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
    let _ = loops.await;
    Ok(())
}
