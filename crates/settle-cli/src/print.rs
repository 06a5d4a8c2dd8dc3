//! Human-readable output for the operator commands and the demo.

/// `println!` for a command's output, as an `io::Result`: a reader that went away (`settle ledger … |
/// head -1`) ends the command quietly (`main` treats a broken pipe as the end), where `println!`
/// would panic.
macro_rules! out {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        writeln!(std::io::stdout().lock(), $($arg)*)
    }};
}
pub(crate) use out;

use settle_core::Timestamp;
use settle_core::ids::AccountId;
use settle_store::{AuditReport, Page, Store};

/// The column heads of `settle ledger`, on the store and through the API.
pub const LEDGER_HEADER: &str =
    "    seq  kind            amount   balance  job            item     created_at                  reason";

pub fn time(t: Timestamp) -> String {
    let nanos = i128::from(t.micros()) * 1_000;
    match time::OffsetDateTime::from_unix_timestamp_nanos(nanos) {
        Ok(dt) => dt.format(&time::format_description::well_known::Rfc3339).unwrap_or_else(|_| t.micros().to_string()),
        Err(_) => t.micros().to_string(),
    }
}

pub async fn ledger(store: &dyn Store, account: &AccountId) -> anyhow::Result<()> {
    let acc = store.account(account).await?;
    out!("  ledger of {} (overdraft limit {})", acc.id, acc.overdraft_limit)?;
    out!("{LEDGER_HEADER}")?;
    let mut page = Page { after: 0, limit: 1000 };
    loop {
        let p = store.ledger(account, page).await?;
        for e in &p.rows {
            out!(
                "  {:>5}  {:<13} {:>+8} {:>9}  {:<14} {:<8} {:<27} {}",
                e.seq,
                e.kind.as_str(),
                e.amount.get(),
                e.balance_after.get(),
                e.job_id.as_deref().unwrap_or("-"),
                e.item_id.as_deref().unwrap_or("-"),
                time(e.created_at),
                e.reason.as_deref().or(e.ref_id.as_deref()).unwrap_or("")
            )?;
        }
        match p.next_after {
            Some(after) => page.after = after,
            None => break,
        }
    }
    out!("  balance {}", acc.balance)?;
    Ok(())
}

pub fn audit(report: &AuditReport) -> std::io::Result<()> {
    let c = &report.checkpoint;
    if let Some(from) = &c.from {
        out!(
            "audit: from checkpoint {} of {} ({} entries proved then, {} now); the items of {} jobs checked",
            from.generation,
            from.taken_at.rfc3339(),
            from.entries,
            c.entries_covered,
            c.jobs_checked,
        )?;
    }
    if let Some(why) = &c.not_used {
        out!("audit: from the first entry: {why}")?;
    }
    audit_verdict(report)?;
    match &c.recorded {
        Some(Ok(mark)) => out!(
            "audit: checkpoint {} recorded ({} entries, {})",
            mark.generation,
            mark.entries,
            mark.taken_at.rfc3339()
        ),
        Some(Err(why)) => out!("audit: no checkpoint recorded: {why}"),
        None => Ok(()),
    }?;
    match &c.retired {
        Some(Ok(true)) => out!("audit: the checkpoint is retired: the next audit reads every row"),
        Some(Err(why)) => out!("audit: the checkpoint could not be retired: {why}"),
        _ => Ok(()),
    }
}

fn audit_verdict(report: &AuditReport) -> std::io::Result<()> {
    if report.ok() {
        return out!(
            "audit: clean ({} accounts, {} items, {} ledger entries checked; L1-L9 hold)",
            report.accounts_checked,
            report.items_checked,
            report.entries_checked
        );
    }
    out!("audit: {} violation(s)", report.violations.len())?;
    for v in &report.violations {
        let mut at = Vec::new();
        if let Some(a) = &v.account_id {
            at.push(format!("account {a}"));
        }
        if let Some(j) = &v.job_id {
            at.push(format!("job {j}"));
        }
        if let Some(i) = &v.item_id {
            at.push(format!("item {i}"));
        }
        out!("  {} [{}] {}", v.invariant, at.join(", "), v.message)?;
    }
    Ok(())
}
