//! Deterministic simulation (docs/decisions/0025): Settle's real store on a real SQLite file and its
//! real background passes, driven one step at a time from one seed on one thread, beside an
//! auditor that fails the run on any answer no correct Settle could give.
//!
//! - [`run`]: one seed, `steps` steps, then the drain (liveness); returns a [`Report`] with the
//!   trace hash and the first violation.
//! - `fakes`: the clock, the payout provider, the artifact store and the crash hook.
//! - `world`: what the clients and workers know, and the auditor's rules.

mod fakes;
mod steps;
mod world;

use fakes::{FNV_START, SimArtifacts, SimClock, SimCrash, SimProvider, fnv};
use settle_core::Timestamp;
use settle_core::backoff::SplitMix64;
use settle_core::ids::WorkerName;
use settle_store::{Durability, SqlStore, Store, StoreOptions};
use settle_worker::payouts::{PayoutProcessor, PayoutSettings};
use settle_worker::{LoopSettings, Maintenance};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use world::World;

/// A guard removed for the run (the broken-guard test; takes effect only when the crates are built
/// with the `broken-guards` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breakage {
    Store(settle_store::broken::Guard),
    /// The payout processor sends without looking the key up first.
    LookupBeforeSend,
}

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

/// A store and the passes over it, rebuilt after every crash.
struct Machine {
    store: Arc<SqlStore>,
    maintenance: Maintenance,
    payouts: PayoutProcessor,
}

/// What stays across crashes: the file, the fakes, the seed.
struct Rig {
    path: PathBuf,
    seed: u64,
    opens: u64,
    clock: Arc<SimClock>,
    provider: Arc<SimProvider>,
    artifacts: Arc<SimArtifacts>,
    crash: Arc<SimCrash>,
    broken: Option<Breakage>,
}

impl Rig {
    async fn open(&mut self) -> Result<Machine, String> {
        self.opens += 1;
        let mix = fnv(fnv(FNV_START, &self.seed.to_le_bytes()), &self.opens.to_le_bytes());
        let options = StoreOptions {
            clock: self.clock.clone(),
            jitter_seed: mix,
            // A new stream per open: the same stream again would hand out tokens and keys twice.
            token_seed: Some(mix ^ 0x5eed),
            // A kill of the process loses nothing committed either way; fsync would only cost time.
            durability: Durability::Normal,
            write_batch_max: 1,
            artifacts: Some(self.artifacts.clone()),
            crash: Some(self.crash.clone()),
            policy: world::policies(),
            broken: match self.broken {
                Some(Breakage::Store(g)) => Some(g),
                _ => None,
            },
            ..StoreOptions::default()
        };
        let url = format!("sqlite://{}", self.path.display());
        let store = Arc::new(SqlStore::open(&url, options).await.map_err(|e| format!("open: {e}"))?);
        let dyn_store: Arc<dyn Store> = store.clone();
        let settings = LoopSettings { batch: 50, ..LoopSettings::default() };
        let maintenance = Maintenance::new(dyn_store.clone(), settings);
        // One withdrawal per pass: a pass's attempts otherwise run together and finish in an order
        // the operating system picks.
        let payout_settings = PayoutSettings { batch: 1, ..PayoutSettings::default() };
        let worker = WorkerName::parse("payouts").expect("a worker name");
        let mut payouts = PayoutProcessor::new(dyn_store, self.provider.clone(), worker, payout_settings)
            .with_crash_hook(self.crash.clone());
        if self.broken == Some(Breakage::LookupBeforeSend) {
            payouts = payouts.without_lookup_before_send();
        }
        Ok(Machine { store, maintenance, payouts })
    }

    /// A crash: everything of the process goes; what committed stays in the file.
    async fn reopen(&mut self, m: Machine) -> Result<Machine, String> {
        let Machine { store, maintenance, payouts } = m;
        drop((maintenance, payouts));
        match Arc::try_unwrap(store) {
            Ok(store) => store.close().await,
            Err(_) => return Err("the store is still held after a crash".into()),
        }
        self.crash.disarm();
        self.open().await
    }
}

/// Runs one seed for `steps` steps in a fresh SQLite file under `dir`, then drains.
pub async fn run(seed: u64, steps: u32, dir: &Path) -> Result<Report, String> {
    run_broken(seed, steps, dir, None).await
}

/// `run`, with a guard removed (the broken-guard test).
pub async fn run_broken(seed: u64, steps: u32, dir: &Path, broken: Option<Breakage>) -> Result<Report, String> {
    let path = dir.join(format!("sim-{seed}.db"));
    let _ = std::fs::remove_file(&path);
    let mut rig = Rig {
        path,
        seed,
        opens: 0,
        clock: Arc::new(SimClock::new(Timestamp::from_micros(1_800_000_000_000_000))),
        provider: Arc::new(SimProvider::new(seed)),
        artifacts: Arc::new(SimArtifacts::new(seed ^ 0xa27)),
        crash: Arc::new(SimCrash::default()),
        broken,
    };
    let mut machine = rig.open().await?;
    let mut world = World::new(SplitMix64::new(seed));
    let mut crashes = 0;
    let mut violation = None;
    world.setup(&machine.store).await;
    for step in 1..=steps {
        let crashed = steps::step(&mut world, &machine, &rig).await;
        if crashed {
            crashes += 1;
            world.trace("crash: reopen");
            machine = rig.reopen(machine).await?;
            world.after_crash();
        }
        if let Err(what) = world.check(&machine.store, &rig.provider, &rig.artifacts, step % 25 == 0 || crashed).await {
            violation = Some(Violation { step, what });
            break;
        }
    }
    if violation.is_none()
        && let Err(what) = steps::drain(&mut world, &machine, &rig).await
    {
        violation = Some(Violation { step: steps + 1, what });
    }
    let jobs = world.jobs.len();
    let Machine { store, maintenance, payouts } = machine;
    drop((maintenance, payouts));
    if let Ok(store) = Arc::try_unwrap(store) {
        store.close().await;
    }
    if std::env::var_os("SETTLE_SIM_KEEP").is_some() {
        eprintln!("kept {}", rig.path.display());
    } else {
        let _ = std::fs::remove_file(&rig.path);
    }
    Ok(Report { seed, steps, trace_hash: world.hash, violation, crashes, jobs })
}
