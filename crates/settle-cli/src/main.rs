//! `settle`: the command-line entry point. Parses arguments, sets up logging, opens the store and
//! hands over to one command module. anyhow lives here and nowhere below.

mod bench;
mod bench_events;
mod config;
mod demo;
mod dst;
mod operations;
mod operator;
mod print;
mod progress;
mod remote;
mod secrets;
mod serve;
mod sim;

use anyhow::Context;
use clap::{Parser, Subcommand};
use settle_core::ids::AccountId;
use settle_store::{SqlStore, Store, StoreError, StoreOptions};
use std::process::ExitCode;

#[derive(Parser)]
#[command(name = "settle", version, about = "Settle: the credit ledger for pay-per-job platforms")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serves the HTTP API v1 and runs the background loops (lease rescue, teardown sweep, reconcile).
    Serve(serve::ServeArgs),
    /// Runs the background loops alone (any number of processes against one PostgreSQL).
    Worker(serve::WorkerArgs),
    /// Prints the effective configuration (file plus environment) as TOML.
    Config {
        #[arg(long, env = "SETTLE_CONFIG")]
        config: Option<std::path::PathBuf>,
    },
    /// Plays the seeds' stories on a throwaway embedded store, printing each step, the ledgers and the audit verdict.
    Demo {
        /// Play on this database instead of a throwaway file (it must be empty).
        #[arg(long)]
        db: Option<String>,
    },
    /// Applies the schema's migrations and exits (an explicit step before a new release's processes
    /// start with `--no-migrate`).
    Migrate {
        /// The store (default `sqlite://settle.db`, or the config file's `db`).
        #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true)]
        db: Option<String>,
        /// The configuration file whose `db` to migrate (what `settle serve --config` opens).
        #[arg(long, env = "SETTLE_CONFIG")]
        config: Option<std::path::PathBuf>,
    },
    /// A consistent copy of a live embedded store (SQLite's online backup API) into a new file.
    /// PostgreSQL: pg_dump or base backups (docs/operations/backup-and-restore.md).
    Backup {
        #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true, default_value = "sqlite://settle.db")]
        db: String,
        /// The backup file to write (refused if it exists).
        #[arg(long)]
        to: std::path::PathBuf,
    },
    /// Puts a backup in place as the embedded store and raises its epoch, so receivers that
    /// deduplicate by (epoch, seq) take the events it numbers again as new.
    Restore {
        /// The backup file.
        #[arg(long)]
        from: std::path::PathBuf,
        #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true, default_value = "sqlite://settle.db")]
        db: String,
        /// Replace a store already there (moved aside to PATH.replaced-<unix seconds>, never deleted).
        /// Refused while any process has it open: stop them first.
        #[arg(long)]
        replace: bool,
        /// The new epoch, when the store being replaced cannot tell its own (damaged or gone while
        /// receivers saw later epochs): higher than any epoch they have seen.
        #[arg(long)]
        epoch: Option<i64>,
    },
    /// Copies a whole store into an empty one, either engine to either engine, keeping every id,
    /// number, hash and event; ends with the audit on the target. Stop the processes writing to the
    /// source first (the copy reads one snapshot of it; what they write after is not copied).
    Copy {
        /// The store to copy (at this settle's schema: `settle migrate` it first).
        #[arg(long)]
        from: String,
        /// The empty store to copy into (created and migrated if needed).
        #[arg(long)]
        to: String,
    },
    /// Checks the ledger invariants L1–L9; prints violations and exits 1 if there are any.
    Audit {
        #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true, default_value = "sqlite://settle.db")]
        db: String,
        /// Start from the store's checkpoint (what the last audit run with --checkpoint proved): only
        /// the lines, parts and jobs written since are read again. Without a usable checkpoint (none;
        /// retired by an audit that found something; taken before a restore or an upgrade), from
        /// the first entry (docs/decisions/0040).
        #[arg(long)]
        from_checkpoint: bool,
        /// Record a checkpoint of this audit's snapshot when it finds nothing wrong.
        #[arg(long)]
        checkpoint: bool,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Prints an account's ledger with running balances.
    Ledger {
        account: String,
        #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true, default_value = "sqlite://settle.db")]
        db: String,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Lists or shows jobs.
    Jobs {
        #[command(subcommand)]
        cmd: operator::Jobs,
        #[arg(
            long,
            env = "SETTLE_DATABASE_URL",
            hide_env_values = true,
            default_value = "sqlite://settle.db",
            global = true
        )]
        db: String,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Shows an account with its grants.
    Accounts {
        #[command(subcommand)]
        cmd: operator::Accounts,
        #[arg(
            long,
            env = "SETTLE_DATABASE_URL",
            hide_env_values = true,
            default_value = "sqlite://settle.db",
            global = true
        )]
        db: String,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Lists or requeues dead letters.
    DeadLetters {
        #[command(subcommand)]
        cmd: operator::DeadLetters,
        #[arg(
            long,
            env = "SETTLE_DATABASE_URL",
            hide_env_values = true,
            default_value = "sqlite://settle.db",
            global = true
        )]
        db: String,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Lists or shows withdrawals (payouts), with their provider txids and attempts.
    Withdrawals {
        #[command(subcommand)]
        cmd: operator::Withdrawals,
        #[arg(
            long,
            env = "SETTLE_DATABASE_URL",
            hide_env_values = true,
            default_value = "sqlite://settle.db",
            global = true
        )]
        db: String,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Runs the payout provider simulator (provider-v1), the counterparty of demos and tests.
    ProviderSim(sim::SimArgs),
    /// Runs the funding provider simulator (funding-v1): charges for top-ups, declines, lost answers.
    FundingSim(sim::SimArgs),
    /// The deterministic simulator: Settle's store and passes under one seeded clock and scheduler,
    /// with an auditor (`--seed N` replays one run; `--seeds A..B` runs many).
    Sim(dst::DstArgs),
    /// Counts jobs now dead, unknown or waiting to retry, by fail code.
    Failures {
        #[arg(long, env = "SETTLE_DATABASE_URL", hide_env_values = true, default_value = "sqlite://settle.db")]
        db: String,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Prints the event outbox.
    Events {
        #[command(subcommand)]
        cmd: operator::Events,
        #[arg(
            long,
            env = "SETTLE_DATABASE_URL",
            hide_env_values = true,
            default_value = "sqlite://settle.db",
            global = true
        )]
        db: String,
        #[command(flatten)]
        api: remote::Api,
    },
    /// Measures guarded transitions per second on a throwaway store (see docs/performance.md).
    Bench(bench::BenchArgs),
}

/// mimalloc rather than the system's allocator: a request allocates many small values (rows, texts,
/// answers, sqlx's buffers) and frees them soon after, which glibc's malloc and free did with about
/// a tenth of the server's own CPU; Settle's instructions per transition fell 11 % on PostgreSQL
/// and 2.7 % on SQLite with it (docs/performance.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Serve(_) | Command::Worker(_) | Command::ProviderSim(_) | Command::FundingSim(_) => "info",
        // The simulator's faults are on purpose: what it finds, it prints.
        Command::Sim(_) => "off",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("SETTLE_LOG").unwrap_or_else(|_| default_level.into());
    // Structured JSON logs when nobody is watching a terminal.
    if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
        tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).init();
    } else {
        tracing_subscriber::fmt().json().with_env_filter(filter).with_writer(std::io::stderr).init();
    }
    let runtime = match tokio::runtime::Builder::new_multi_thread().enable_all().build() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match runtime.block_on(run(cli.command)) {
        Ok(code) => code,
        // The reader of the output went away (`settle events tail | head -1`): done, quietly.
        Err(e)
            if e.chain().any(|c| {
                c.downcast_ref::<std::io::Error>().is_some_and(|io| io.kind() == std::io::ErrorKind::BrokenPipe)
            }) =>
        {
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("error: {e:#}");
            // A database Settle must not open (not a database, another program's, a newer schema):
            // exit 2, as for a usage error — nothing was written.
            let refused = e.chain().any(|c| matches!(c.downcast_ref::<StoreError>(), Some(StoreError::NotSettle(_))));
            if refused { ExitCode::from(2) } else { ExitCode::FAILURE }
        }
    }
}

async fn run(command: Command) -> anyhow::Result<ExitCode> {
    match command {
        Command::Serve(args) => serve::run(args).await.map(|()| ExitCode::SUCCESS),
        Command::Worker(args) => serve::run_worker(args).await.map(|()| ExitCode::SUCCESS),
        Command::Config { config } => {
            print!("{}", config::Config::from_process_env(config.as_deref())?.to_toml());
            Ok(ExitCode::SUCCESS)
        }
        Command::Demo { db } => demo::run(db).await,
        Command::Migrate { db, config } => {
            let config = config::Config::from_process_env(config.as_deref())?;
            operations::migrate(&serve::database_url(db.as_deref(), &config)?).await
        }
        Command::Copy { from, to } => operations::copy(&from, &to).await,
        Command::Backup { db, to } => operations::backup(&db, &to),
        Command::Restore { from, db, replace, epoch } => {
            operations::restore(&from, &db, &settle_store::backup::RestoreOptions { replace, epoch }).await
        }
        Command::Audit { db, from_checkpoint, checkpoint, api } => {
            if let Some(r) = api.remote()? {
                if from_checkpoint || checkpoint {
                    anyhow::bail!(
                        "--from-checkpoint and --checkpoint audit a database (--db); the API's audit reads every row"
                    );
                }
                return Ok(if remote::audit(&r).await? { ExitCode::SUCCESS } else { ExitCode::from(1) });
            }
            let store = open_existing(&db).await?;
            let run = settle_store::AuditRun { from_checkpoint, record: checkpoint };
            let report = store.audit_with(run, Some(progress::audit())).await.context("audit")?;
            print::audit(&report)?;
            Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Ledger { account, db, api } => {
            if let Some(r) = api.remote()? {
                remote::ledger(&r, &account).await?;
                return Ok(ExitCode::SUCCESS);
            }
            let store = open_existing(&db).await?;
            let id = AccountId::parse(&account)?;
            print::ledger(&store, &id).await?;
            Ok(ExitCode::SUCCESS)
        }
        Command::Jobs { cmd, db, api } => {
            match api.remote()? {
                Some(r) => remote::jobs(&r, cmd).await?,
                None => operator::jobs(&open_existing(&db).await?, cmd).await?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Accounts { cmd, db, api } => {
            match api.remote()? {
                Some(r) => remote::accounts(&r, cmd).await?,
                None => operator::accounts(&open_existing(&db).await?, cmd).await?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::DeadLetters { cmd, db, api } => {
            let ok = match api.remote()? {
                Some(r) => remote::dead_letters(&r, cmd).await?,
                None => operator::dead_letters(&open_existing(&db).await?, cmd).await?,
            };
            Ok(if ok { ExitCode::SUCCESS } else { ExitCode::from(1) })
        }
        Command::Withdrawals { cmd, db, api } => {
            match api.remote()? {
                Some(r) => remote::withdrawals(&r, cmd).await?,
                None => operator::withdrawals(&open_existing(&db).await?, cmd).await?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::ProviderSim(args) => sim::run(args, &settle_sim::PROVIDER_V1).await.map(|()| ExitCode::SUCCESS),
        Command::FundingSim(args) => sim::run(args, &settle_sim::FUNDING_V1).await.map(|()| ExitCode::SUCCESS),
        Command::Sim(args) => dst::run(args).map(|ok| if ok { ExitCode::SUCCESS } else { ExitCode::from(1) }),
        Command::Failures { db, api } => {
            match api.remote()? {
                Some(r) => remote::failures(&r).await?,
                None => operator::failures(&open_existing(&db).await?).await?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Events { cmd, db, api } => {
            match api.remote()? {
                Some(r) => remote::events(&r, cmd).await?,
                None => operator::events(&open_existing(&db).await?, cmd).await?,
            }
            Ok(ExitCode::SUCCESS)
        }
        Command::Bench(args) if args.events => {
            bench_events::run_events(&args.postgres, args.concurrency.last().copied().unwrap_or(16))
                .await
                .map(|()| ExitCode::SUCCESS)
        }
        Command::Bench(args) => bench::run(args).await.map(|()| ExitCode::SUCCESS),
    }
}

/// Opens a store that must already exist (operator commands never create one by accident).
async fn open_existing(url: &str) -> anyhow::Result<SqlStore> {
    if let Some(path) = url.strip_prefix("sqlite://") {
        let path = path.split('?').next().unwrap_or(path);
        anyhow::ensure!(std::path::Path::new(path).exists(), "no database at {path}");
    }
    SqlStore::open(url, StoreOptions::default())
        .await
        .with_context(|| format!("open {}", settle_store::redacted_url(url)))
}
