//! Operator commands over the same store: jobs, dead letters, failures, events.

use crate::print;
use crate::print::out;
use anyhow::Context;
use settle_core::ids::*;
use settle_core::job::JobState;
use settle_store::{Job, JobFilter, Page, Store, WithdrawalFilter};
use std::time::Duration;

#[derive(clap::Subcommand)]
pub enum Jobs {
    /// Jobs, newest last, with optional filters.
    List {
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        kind: Option<String>,
        #[arg(long)]
        account: Option<String>,
        #[arg(long)]
        fail_code: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// One job: its items, attempts and the signals that changed nothing.
    Show { id: String },
    /// Finishes the teardown of a job stuck `cancelling` without its artifact cleanup; the
    /// artifacts left are named in the job's `job.cancelled` event and in the action log.
    AbandonCleanup {
        id: String,
        /// Why the cleanup is given up (recorded in the action log).
        #[arg(long)]
        reason: String,
    },
}

#[derive(clap::Subcommand)]
pub enum Accounts {
    /// One account: its balance, debt and holds, and its grants — what each has left and when it
    /// expires, in the order charges take from them.
    Show { id: String },
}

#[derive(clap::Subcommand)]
pub enum Withdrawals {
    /// Withdrawals, oldest first, with optional filters.
    List {
        #[arg(long)]
        state: Option<String>,
        #[arg(long)]
        account: Option<String>,
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// One withdrawal: its key, txid, hold, and every attempt — when and why it failed, when it went through.
    Show { id: String },
}

#[derive(clap::Subcommand)]
pub enum DeadLetters {
    /// Jobs in dead letters, with their last error.
    List {
        #[arg(long, default_value_t = 100)]
        limit: u32,
    },
    /// Puts dead jobs back in the queue with a fresh attempt budget.
    Requeue { ids: Vec<String> },
}

#[derive(clap::Subcommand)]
pub enum Events {
    /// Events after a sequence number; with --follow, keeps printing new ones.
    Tail {
        #[arg(long, default_value_t = 0)]
        after: i64,
        #[arg(long)]
        follow: bool,
    },
}

/// The column heads of `settle withdrawals list`, on the store and through the API.
pub const WITHDRAWALS_HEADER: &str = "id                       state      account         amount provider txid            last error             destination";

fn job_line(j: &Job) -> String {
    let err = j.last_error.as_ref().map(|e| format!(" {}", e.code)).unwrap_or_default();
    format!(
        "{:<24} {:<10} {:<11} {:<12} charged {:>6} net {:>7} attempt {}/{}{}{}",
        j.id,
        j.kind,
        j.state.as_str(),
        j.account_id,
        j.cost,
        j.net,
        j.attempt - j.budget_base,
        j.max_attempts,
        if j.cancel_requested { " cancel-requested" } else { "" },
        err
    )
}

pub async fn jobs(store: &dyn Store, cmd: Jobs) -> anyhow::Result<()> {
    match cmd {
        Jobs::List { state, kind, account, fail_code, limit } => {
            let filter = JobFilter {
                state: state.as_deref().map(|s| JobState::parse(s).context("unknown state")).transpose()?,
                kind: kind.as_deref().map(JobKind::parse).transpose()?,
                account_id: account.as_deref().map(AccountId::parse).transpose()?,
                fail_code: fail_code.as_deref().map(FailCode::parse).transpose()?,
                priority: None,
                id_prefix: None,
                until_seq: None,
                scope: settle_core::scope::Scope::ALL,
            };
            let mut page = Page { after: 0, limit: limit.clamp(1, 1000) };
            let mut shown = 0u32;
            loop {
                let p = store.jobs(&filter, page).await?;
                for j in &p.rows {
                    out!("{}", job_line(j))?;
                    shown += 1;
                }
                match p.next_after {
                    Some(a) if shown < limit => page.after = a,
                    _ => break,
                }
            }
        }
        Jobs::Show { id } => show_job(store, &id).await?,
        Jobs::AbandonCleanup { id, reason } => {
            let j = store.abandon_cleanup(&JobId::parse(&id)?, "cli", &reason).await?;
            out!("{}", job_line(&j))?;
        }
    }
    Ok(())
}

/// `settle jobs show`: the job, its items, who paid, its attempts, actions and signals.
async fn show_job(store: &dyn Store, id: &str) -> anyhow::Result<()> {
    let id = JobId::parse(id)?;
    let j = store.job(&id).await?;
    out!("{}", job_line(&j))?;
    out!(
        "  refund_on {}  not_before {}  created {}  updated {}",
        j.refund_on.as_str(),
        print::time(j.not_before),
        print::time(j.created_at),
        print::time(j.updated_at)
    )?;
    if let Some(e) = &j.last_error {
        out!("  last error {}: {}", e.code, e.message.as_deref().unwrap_or(""))?;
    }
    if let Some(r) = store.cleanup_retry(&id).await? {
        out!("  cleanup failed {} times, last at {}: {}", r.failures, print::time(r.failed_at), r.last_error)?;
        if j.state == JobState::Cancelling {
            let next = print::time(r.retry_at);
            out!("  cleanup next try {next} (or: settle jobs abandon-cleanup {} --reason ...)", j.id)?;
        }
    }
    for i in &j.items {
        // A held item (decision 0022): its hold, and its price once a success gave it one.
        let price = match (i.hold, i.priced_cost()) {
            (None, _) => format!("cost {:>6}", i.cost.get()),
            (Some(h), Some(c)) => format!("cost {:>6} of a hold of {}", c.get(), h.get()),
            (Some(h), None) => format!("held {:>6}, not priced", h.get()),
        };
        out!("  item {:<16} {price} {:<10} {}", i.id, i.state.as_str(), i.refund_reason.map_or("", |r| r.as_str()))?;
    }
    // Which grants paid (docs/decisions/0023), and what of it went back.
    for p in store.allocations(&id).await? {
        let from = match (&p.grant_id, p.kind.as_str()) {
            (None, _) => "debt (no grant covered it)".to_owned(),
            (Some(g), _) if p.origin.as_deref() == Some("opening") => format!("the opening balance of {g}"),
            (Some(g), _) => format!("{} {g}", p.origin.as_deref().unwrap_or("grant")),
        };
        out!(
            "  paid {:>6} by {from:<32} {:<8} item {:<12} given back {}",
            p.taken.get(),
            p.kind,
            p.item_id.as_deref().unwrap_or("-"),
            p.given_back.get()
        )?;
    }
    for a in store.attempts(&id).await? {
        out!(
            "  attempt {:>2} {:<16} started {} finished {} {} {} {}",
            a.attempt_no,
            a.worker,
            print::time(a.started_at),
            a.finished_at.map(print::time).unwrap_or_else(|| "-".into()),
            a.result.map_or("open", |r| r.as_str()),
            a.fail_code.as_deref().unwrap_or(""),
            a.message.as_deref().unwrap_or("")
        )?;
    }
    for a in store.operators().actions(Some(&id), None).await? {
        out!("  action {:<20} by {:<16} at {} {}", a.action, a.actor, print::time(a.at), a.detail)?;
    }
    for s in store.signals(&id).await? {
        out!(
            "  signal {:<12} {:<9} attempt {} at {} {} {}",
            s.signal,
            s.effect,
            s.attempt_no.map(|n| n.to_string()).unwrap_or_else(|| "-".into()),
            print::time(s.received_at),
            s.fail_code.as_deref().unwrap_or(""),
            s.message.as_deref().unwrap_or("")
        )?;
    }
    Ok(())
}

pub async fn accounts(store: &dyn Store, cmd: Accounts) -> anyhow::Result<()> {
    match cmd {
        Accounts::Show { id } => {
            let id = AccountId::parse(&id)?;
            let d = store.operators().account_detail(&id).await?;
            out!(
                "{}  balance {}  overdraft limit {}  debt {}  held {}  exposure {}  entries {}",
                d.account.id,
                d.account.balance.get(),
                d.account.overdraft_limit.get(),
                d.debt,
                d.held,
                d.exposure,
                d.entries
            )?;
            if let Some(cap) = d.account.max_running {
                out!("  at most {cap} jobs running at once (max_running)")?;
            }
            let mut page = Page { after: 0, limit: 1000 };
            loop {
                let p = store.grants(&id, page).await?;
                for g in &p.rows {
                    out!(
                        "  {:<10} {:<24} amount {:>8}  left {:>8}  priority {:>3}  {:<8} {}",
                        g.origin,
                        g.id,
                        g.amount.get(),
                        g.remaining.get(),
                        g.priority,
                        g.state.as_str(),
                        match (g.expires_at, g.expired_at) {
                            (None, _) => "never expires".to_owned(),
                            (Some(at), None) => format!("expires {}", print::time(at)),
                            (Some(at), Some(_)) => format!("expired {}", print::time(at)),
                        }
                    )?;
                }
                match p.next_after {
                    Some(a) => page.after = a,
                    None => break,
                }
            }
        }
    }
    Ok(())
}

pub async fn withdrawals(store: &dyn Store, cmd: Withdrawals) -> anyhow::Result<()> {
    match cmd {
        Withdrawals::List { state, account, limit } => {
            let filter = WithdrawalFilter {
                state: state.as_deref().map(|s| JobState::parse(s).context("unknown state")).transpose()?,
                account_id: account.as_deref().map(AccountId::parse).transpose()?,
                updated_since: None,
                scope: settle_core::scope::Scope::ALL,
            };
            out!("{WITHDRAWALS_HEADER}")?;
            let mut page = Page { after: 0, limit: limit.clamp(1, 1000) };
            let mut shown = 0u32;
            loop {
                let p = store.payouts().withdrawals(&filter, page).await?;
                for w in &p.rows {
                    out!(
                        "{:<24} {:<10} {:<12} {:>9} {:<24} {:<22} {}",
                        // As text: the id types' Display ignores a width (the columns drifted).
                        w.job.id.as_str(),
                        w.job.state.as_str(),
                        w.job.account_id.as_str(),
                        w.amount.get(),
                        w.provider_txid.as_deref().unwrap_or("-"),
                        w.job.last_error.as_ref().map(|e| e.code.as_str()).unwrap_or("-"),
                        w.destination
                    )?;
                    shown += 1;
                }
                match p.next_after {
                    Some(a) if shown < limit => page.after = a,
                    _ => break,
                }
            }
        }
        Withdrawals::Show { id } => {
            let w = store.payouts().withdrawal(&JobId::parse(&id)?).await?;
            out!(
                "{}  amount {}  to {}  key {}  txid {}{}",
                w.job.id,
                w.amount,
                w.destination,
                w.idempotency_key,
                w.provider_txid.as_deref().unwrap_or("-"),
                w.returned_at.map(|t| format!("  returned {}", print::time(t))).unwrap_or_default()
            )?;
            jobs(store, Jobs::Show { id }).await?;
        }
    }
    Ok(())
}

pub async fn dead_letters(store: &dyn Store, cmd: DeadLetters) -> anyhow::Result<bool> {
    match cmd {
        DeadLetters::List { limit } => {
            let filter = JobFilter { state: Some(JobState::Dead), ..JobFilter::ALL };
            for j in store.jobs(&filter, Page { after: 0, limit: limit.clamp(1, 1000) }).await?.rows {
                out!("{}", job_line(&j))?;
            }
            Ok(true)
        }
        DeadLetters::Requeue { ids } => {
            anyhow::ensure!(!ids.is_empty(), "name the jobs to requeue");
            let mut all_ok = true;
            for id in ids {
                match store.requeue(&JobId::parse(&id)?, "cli").await {
                    Ok(j) => out!("{id}: requeued ({})", j.state.as_str())?,
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

pub async fn failures(store: &dyn Store) -> anyhow::Result<()> {
    out!("{:<32} {:<9} {:>7}", "code", "state", "jobs")?;
    for f in store.failure_summary(&settle_core::scope::Scope::ALL).await? {
        out!("{:<32} {:<9} {:>7}", f.code, f.state, f.count)?;
    }
    Ok(())
}

pub async fn events(store: &dyn Store, cmd: Events) -> anyhow::Result<()> {
    let Events::Tail { mut after, follow } = cmd;
    loop {
        let page = store.events(after, 1000, &settle_core::scope::Scope::ALL).await?;
        for e in &page.rows {
            out!(
                "{:>8} {} {:<22} {:<16} {}",
                e.seq,
                print::time(e.created_at),
                e.kind,
                e.job_id.as_deref().unwrap_or("-"),
                e.data
            )?;
            after = e.seq;
        }
        if page.next_after.is_some() {
            continue;
        }
        if !follow {
            return Ok(());
        }
        let wake = store.events_wake();
        tokio::select! {
            _ = wake.notified() => {}
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
        }
    }
}
