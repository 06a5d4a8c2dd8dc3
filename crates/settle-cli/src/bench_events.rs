//! `settle bench --events`: event latency, from a create's answer (its COMMIT came just before) to
//! a consumer reading its event from the feed — 0 when the consumer read it before the creator had
//! its answer (decision 0021: on PostgreSQL events are numbered after their commit by the
//! sequencer). The consumer tails `events(after)` as the HTTP long-poll does — a look, then a wait on
//! the store's wake-up (or 250 ms) when nothing new is there.

use crate::bench::{bench_job, fresh_pg_database};
use settle_core::Credits;
use settle_core::history::EventKind;
use settle_core::ids::*;
use settle_store::*;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// Creates per writer in each phase.
const CREATES_PER_WRITER: usize = 150;

pub async fn run_events(postgres: &Option<String>, writers: usize) -> anyhow::Result<()> {
    let dir = tempfile::tempdir()?;
    let (url, engine) = match postgres {
        Some(server) => (fresh_pg_database(server).await?, "PostgreSQL (synchronous_commit=on)"),
        None => (format!("sqlite://{}", dir.path().join("events.db").display()), "SQLite (synchronous=FULL)"),
    };
    let store = Arc::new(SqlStore::open(&url, StoreOptions::default()).await?);
    let writers = writers.max(1);
    println!(
        "settle bench --events: {engine}, a create answered → its event read by a tailing consumer, {CREATES_PER_WRITER} creates per writer"
    );
    println!("{:<22} {:>8} {:>10} {:>10} {:>10} {:>10}", "load", "writers", "creates/s", "p50", "p99", "max");
    let (peak, peak_lat) = phase(&store, writers, None, "peak").await?;
    let (idle, idle_lat) = phase(&store, 1, Some(Duration::from_millis(20)), "idle").await?;
    // Half of the peak rate, spread evenly over the writers.
    let pace = Duration::from_secs_f64(writers as f64 / (peak / 2.0).max(1.0));
    let (half, half_lat) = phase(&store, writers, Some(pace), "half").await?;
    for (load, w, rate, lat) in [
        ("idle (one every 20 ms)", 1, idle, idle_lat),
        ("half of peak", writers, half, half_lat),
        ("peak", writers, peak, peak_lat),
    ] {
        let at = |q: f64| lat[((lat.len() - 1) as f64 * q).round() as usize];
        println!("{load:<22} {w:>8} {rate:>10.0} {:>10.2?} {:>10.2?} {:>10.2?}", at(0.5), at(0.99), at(1.0));
    }
    Ok(())
}

/// One phase: `writers` tasks create jobs (one `job.queued` event each), every `pace` or as fast as
/// they can; a consumer tails the feed. Returns the creates per second and each event's latency,
/// sorted.
async fn phase(
    store: &Arc<SqlStore>,
    writers: usize,
    pace: Option<Duration>,
    run: &str,
) -> anyhow::Result<(f64, Vec<Duration>)> {
    let committed: Arc<Mutex<HashMap<String, Instant>>> = Arc::default();
    let writing = Arc::new(AtomicBool::new(true));
    let start_after = last_seq(store).await?;
    let reader = tokio::spawn(tail(store.clone(), start_after, writing.clone()));
    let started = Instant::now();
    let mut handles = Vec::new();
    for w in 0..writers {
        let (store, committed, run) = (store.clone(), committed.clone(), run.to_owned());
        handles.push(tokio::spawn(async move {
            let account = AccountId::parse(&format!("{run}-acct-{w}"))?;
            let new = NewAccount { id: account.clone(), overdraft_limit: Credits::ZERO, max_running: None };
            store.create_account(new, settle_store::SYSTEM_ACTOR).await?;
            let grant = NewGrant {
                id: RefId::parse(&format!("{run}-g-{w}"))?,
                amount: Credits::new(1 << 40),
                reason: None,
                expires_at: None,
                priority: None,
            };
            store.grant(&account, grant, settle_store::SYSTEM_ACTOR).await?;
            let mut next = Instant::now();
            for n in 0..CREATES_PER_WRITER {
                if let Some(pace) = pace {
                    tokio::time::sleep_until(next.into()).await;
                    next += pace;
                }
                let id = format!("{run}-{w}-{n}");
                store.create_job(bench_job(&id, &account, 1, None)?).await?;
                committed.lock().expect("committed").insert(id, Instant::now());
            }
            anyhow::Ok(())
        }));
    }
    for h in handles {
        h.await??;
    }
    let rate = (writers * CREATES_PER_WRITER) as f64 / started.elapsed().as_secs_f64();
    writing.store(false, Ordering::SeqCst);
    let seen = reader.await??;
    let committed = committed.lock().expect("committed");
    let mut latencies = Vec::with_capacity(committed.len());
    for (job, at) in committed.iter() {
        let read = seen.get(job).ok_or_else(|| anyhow::anyhow!("the consumer never read {job}'s event"))?;
        latencies.push(read.saturating_duration_since(*at));
    }
    latencies.sort();
    Ok((rate, latencies))
}

async fn last_seq(store: &SqlStore) -> anyhow::Result<i64> {
    let mut after = 0;
    loop {
        let page = store.events(after, 1000, &settle_core::scope::Scope::ALL).await?;
        match page.rows.last() {
            Some(e) => after = e.seq,
            None => return Ok(after),
        }
    }
}

/// The consumer: when each job's `job.queued` was first read. Ends once the writers are done and
/// a look finds nothing new.
async fn tail(
    store: Arc<SqlStore>,
    mut after: i64,
    writing: Arc<AtomicBool>,
) -> anyhow::Result<HashMap<String, Instant>> {
    let wake = store.events_wake();
    let mut seen = HashMap::new();
    loop {
        let done = !writing.load(Ordering::SeqCst);
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let page = store.events(after, 1000, &settle_core::scope::Scope::ALL).await?;
        let now = Instant::now();
        for e in &page.rows {
            if e.kind == EventKind::JobQueued
                && let Some(job) = &e.job_id
            {
                seen.entry(job.clone()).or_insert(now);
            }
            after = e.seq;
        }
        if page.rows.is_empty() {
            if done {
                return Ok(seen);
            }
            let _ = tokio::time::timeout(Duration::from_millis(250), notified).await;
        }
    }
}
