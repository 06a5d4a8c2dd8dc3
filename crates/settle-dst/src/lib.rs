//! Deterministic simulation (docs/decisions/0025): Settle's real store on a real SQLite file and its
//! real background passes, driven one step at a time from one seed on one thread, beside an
//! auditor that fails the run on any answer no correct Settle could give.
//!
//! - [`run`]: one seed, `steps` steps, then the drain (liveness); returns a [`Report`] with the
//!   trace hash and the first violation.
//! - `fakes`: the clock, the payout provider, the artifact store and the crash hook;
//! - `machine`: the store and its passes, and what outlives a crash;
//! - `steps`: what a step does, and the drain.
//! - `world`: what the clients and workers know, and the auditor's rules;
//! - `money`: the auditor's own prediction of every balance;
//! - `hooks`: webhook delivery through the store, and its rules (order per job, lost leases);
//! - `tape`: the seeded random stream, the trace hash, the rules answers broke;
//! - `sim_job`: a job as its client and workers know it.

mod fakes;
mod hooks;
mod machine;
mod money;
mod sim_job;
mod steps;
mod tape;
mod world;

use fakes::{SimArtifacts, SimClock, SimCrash, SimProvider};
pub use machine::Breakage;
use machine::{Machine, Rig};
use settle_core::Timestamp;
use settle_core::backoff::SplitMix64;
use settle_store::{SqlStore, StoreOptions};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use world::World;

/// The first rule a run broke: at which step, and how.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub step: u32,
    pub what: String,
}

#[derive(Debug, Clone)]
pub struct Report {
    pub seed: u64,
    pub steps: u32,
    /// FNV-1a over every step and its answer: equal for equal runs.
    pub trace_hash: u64,
    pub violation: Option<Violation>,
    /// Steps that were crashes (the store dropped and reopened).
    pub crashes: u32,
    pub jobs: usize,
}

/// Runs one seed for `steps` steps in a fresh SQLite file under `dir`, then drains.
pub async fn run(seed: u64, steps: u32, dir: &Path) -> Result<Report, String> {
    run_inner(seed, steps, dir, None, None).await
}

/// `run`, with every trace line (prefixed by its step) written to `last` as it is made, for a
/// watcher to tell where a run that stopped moving stands.
pub async fn run_watched(seed: u64, steps: u32, dir: &Path, last: Arc<Mutex<String>>) -> Result<Report, String> {
    run_inner(seed, steps, dir, None, Some(last)).await
}

/// `run`, with a guard removed (the broken-guard test).
pub async fn run_broken(seed: u64, steps: u32, dir: &Path, broken: Option<Breakage>) -> Result<Report, String> {
    run_inner(seed, steps, dir, broken, None).await
}

async fn run_inner(
    seed: u64,
    steps: u32,
    dir: &Path,
    broken: Option<Breakage>,
    last: Option<Arc<Mutex<String>>>,
) -> Result<Report, String> {
    let path = dir.join(format!("sim-{seed}.db"));
    remove_database(&path);
    fresh_store(dir, &path).await?;
    let mut rig = Rig {
        path,
        seed,
        opens: 0,
        clock: Arc::new(SimClock::new(Timestamp::from_micros(1_800_000_000_000_000))),
        provider: Arc::new(SimProvider::new(seed)),
        funding: Arc::new(fakes::SimFunding::new(seed ^ 0xf00d)),
        artifacts: Arc::new(SimArtifacts::new(seed ^ 0xa27)),
        crash: Arc::new(SimCrash::default()),
        broken,
    };
    let mut machine = rig.open().await?;
    let mut world = World::new(SplitMix64::new(seed));
    world.tape.last = last;
    let mut crashes = 0;
    let mut violation = None;
    world.setup(&machine.store).await;
    for step in 1..=steps {
        world.tape.step = step;
        let crashed = steps::step(&mut world, &machine, &rig).await;
        if crashed {
            crashes += 1;
            world.trace("crash: reopen");
            machine = rig.reopen(machine).await?;
            world.after_crash();
        }
        if let Err(what) =
            world.check(&machine.store, (&rig.provider, &rig.funding), &rig.artifacts, step % 50 == 0 || crashed).await
        {
            violation = Some(Violation { step, what });
            break;
        }
    }
    world.tape.step = steps + 1;
    if violation.is_none()
        && let Err(what) = steps::drain(&mut world, &machine, &rig).await
    {
        violation = Some(Violation { step: steps + 1, what });
    }
    let jobs = world.jobs.len();
    let Machine { store, maintenance, payouts, funding } = machine;
    drop((maintenance, payouts, funding));
    if let Ok(store) = Arc::try_unwrap(store) {
        store.close().await;
    }
    if std::env::var_os("SETTLE_SIM_KEEP").is_some() {
        eprintln!("kept {}", rig.path.display());
    } else {
        remove_database(&rig.path);
    }
    Ok(Report { seed, steps, trace_hash: world.tape.hash, violation, crashes, jobs })
}

/// The database file and its WAL and shared-memory files: a thousand seeds' WAL files left behind
/// would fill the temp dir with gigabytes.
/// Writes at `path` a store with every migration applied and nothing else: a copy of one made once
/// per folder and process. Migrating a new file for each seed took about a tenth of the simulator's
/// CPU (docs/testing.md); the copy of the closed file is the bytes the migrations wrote.
async fn fresh_store(dir: &Path, path: &Path) -> Result<(), String> {
    static MADE: tokio::sync::Mutex<Vec<PathBuf>> = tokio::sync::Mutex::const_new(Vec::new());
    let empty = dir.join("sim-empty.db");
    {
        let mut made = MADE.lock().await;
        if !made.contains(&empty) || !empty.exists() {
            remove_database(&empty);
            let url = format!("sqlite://{}", empty.display());
            let store =
                SqlStore::open(&url, StoreOptions::default()).await.map_err(|e| format!("the empty store: {e}"))?;
            store.close().await;
            // Closed, every page is in the file itself: no log is left beside it to copy.
            let mut wal = empty.as_os_str().to_owned();
            wal.push("-wal");
            if std::fs::metadata(&wal).is_ok_and(|m| m.len() > 0) {
                return Err("the empty store left a write-ahead log after it closed".into());
            }
            made.push(empty.clone());
        }
    }
    std::fs::copy(&empty, path).map_err(|e| format!("copy of the empty store to {}: {e}", path.display()))?;
    Ok(())
}

fn remove_database(path: &Path) {
    for suffix in ["", "-wal", "-shm"] {
        let mut name = path.as_os_str().to_owned();
        name.push(suffix);
        let _ = std::fs::remove_file(&name);
    }
}
