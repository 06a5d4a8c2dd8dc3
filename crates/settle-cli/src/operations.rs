//! The operator's store commands: `settle migrate`, `settle copy`, `settle backup`, `settle restore`
//! (docs/operations/, decision 0029).

use crate::print;
use crate::print::out;
use anyhow::Context;
use settle_store::{SqlStore, Store, StoreOptions};
use std::path::Path;
use std::process::ExitCode;

/// Applies the schema's migrations and says which.
pub async fn migrate(db: &str) -> anyhow::Result<ExitCode> {
    let before = settle_store::SqlStore::schema_versions(db).await.unwrap_or_default();
    let store = SqlStore::open(db, StoreOptions::default())
        .await
        .with_context(|| format!("open {}", settle_store::redacted_url(db)))?;
    drop(store);
    let after = settle_store::SqlStore::schema_versions(db).await?;
    let applied: Vec<String> = after.iter().filter(|v| !before.contains(v)).map(|v| format!("{v:04}")).collect();
    let at = after.iter().max().copied().unwrap_or(0);
    if applied.is_empty() {
        out!("schema at migration {at:04}: up to date")?;
    } else {
        out!("schema at migration {at:04}: applied {}", applied.join(", "))?;
    }
    Ok(ExitCode::SUCCESS)
}

/// A consistent copy of a live embedded store.
pub fn backup(db: &str, to: &Path) -> anyhow::Result<ExitCode> {
    let r = settle_store::backup::backup(db, to)?;
    out!("backed up to {} ({} bytes): events up to {} of epoch {}", r.path.display(), r.bytes, r.last_seq, r.epoch)?;
    Ok(ExitCode::SUCCESS)
}

/// Puts a backup in place, raises the epoch, and audits what was put in place.
pub async fn restore(
    from: &Path,
    db: &str,
    options: &settle_store::backup::RestoreOptions,
) -> anyhow::Result<ExitCode> {
    let now = settle_core::clock::Clock::now(&settle_core::clock::SystemClock).micros();
    let r = settle_store::backup::restore(from, db, options, now)?;
    if let Some(aside) = &r.replaced {
        out!("the store that was there is kept at {}", aside.display())?;
    }
    out!(
        "restored {} from {}: events up to {}; new events are numbered from {} in epoch {}",
        r.path.display(),
        from.display(),
        r.last_seq,
        r.last_seq + 1,
        r.epoch
    )?;
    // The audit on what was put in place (and the migrations, if the backup is older).
    let store = SqlStore::open(db, StoreOptions::default())
        .await
        .with_context(|| format!("open {}", settle_store::redacted_url(db)))?;
    let report = store.audit(None).await.context("audit")?;
    print::audit(&report)?;
    Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Opens `url` as a store (for its checks and migrations) and closes it again.
async fn opened(url: &str, migrate: bool) -> anyhow::Result<SqlStore> {
    SqlStore::open(url, StoreOptions { migrate, ..StoreOptions::default() })
        .await
        .with_context(|| format!("open {}", settle_store::redacted_url(url)))
}

/// A whole store into an empty one; the audit on the target decides the exit code.
pub async fn copy(from: &str, to: &str) -> anyhow::Result<ExitCode> {
    anyhow::ensure!(from != to, "--from and --to name the same store");
    // The source must be a Settle store at this binary's schema (nothing is written to it); the
    // target is created and migrated if needed.
    drop(opened(from, false).await.context("the source")?);
    drop(opened(to, true).await.context("the target")?);
    let started = std::time::Instant::now();
    let report = settle_store::copy::copy(from, to, |table, rows| {
        eprintln!("copied {rows:>9} rows of {table}");
    })
    .await
    .context("copy")?;
    out!(
        "copied {} rows of {} tables from {} to {} in {:.1} s",
        report.rows(),
        report.tables.len(),
        settle_store::redacted_url(from),
        settle_store::redacted_url(to),
        started.elapsed().as_secs_f64()
    )?;
    let store = opened(to, true).await?;
    let audit = store.audit(Some(crate::progress::audit())).await.context("audit of the target")?;
    print::audit(&audit)?;
    Ok(if audit.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
