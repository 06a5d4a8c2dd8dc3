//! The machine under simulation: the store and its passes (rebuilt after every crash), and the
//! rig that outlives crashes (the file, the fakes, the seed).

use crate::fakes::{FNV_START, SimArtifacts, SimClock, SimCrash, SimFunding, SimProvider, fnv};
use crate::world;
use settle_core::ids::WorkerName;
use settle_store::{Durability, SqlStore, Store, StoreOptions};
use settle_worker::funding::FundingProcessor;
use settle_worker::payouts::{PayoutProcessor, PayoutSettings};
use settle_worker::{LoopSettings, Maintenance};
use std::path::PathBuf;
use std::sync::Arc;

/// A guard removed for the run (the broken-guard test; takes effect only when the crates are built
/// with the `broken-guards` feature).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Breakage {
    Store(settle_store::broken::Guard),
    /// The payout processor sends without looking the key up first.
    LookupBeforeSend,
    /// The funding processor charges without looking the key up first.
    FundingLookupBeforeSend,
}

/// A store and the passes over it, rebuilt after every crash.
pub struct Machine {
    pub store: Arc<SqlStore>,
    pub maintenance: Maintenance,
    pub payouts: PayoutProcessor,
    pub funding: FundingProcessor,
}

/// What stays across crashes: the file, the fakes, the seed.
pub struct Rig {
    pub path: PathBuf,
    pub seed: u64,
    pub opens: u64,
    pub clock: Arc<SimClock>,
    pub provider: Arc<SimProvider>,
    pub funding: Arc<SimFunding>,
    pub artifacts: Arc<SimArtifacts>,
    pub crash: Arc<SimCrash>,
    pub broken: Option<Breakage>,
}

impl Rig {
    pub async fn open(&mut self) -> Result<Machine, String> {
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
            sqlite_readers: 1,
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
        // the operating system picks. The re-check looks back 30 days, past any run's simulated
        // time, so a hung send carried out after Settle gave up on it is found (decision 0010 §8).
        let payout_settings = PayoutSettings {
            batch: 1,
            return_window: std::time::Duration::from_secs(30 * 24 * 3_600),
            ..PayoutSettings::default()
        };
        let worker = WorkerName::parse("payouts").expect("a worker name");
        let mut payouts = PayoutProcessor::new(dyn_store.clone(), self.provider.clone(), worker, payout_settings)
            .with_crash_hook(self.crash.clone());
        if self.broken == Some(Breakage::LookupBeforeSend) {
            payouts = payouts.without_lookup_before_send();
        }
        let worker = WorkerName::parse("funding").expect("a worker name");
        let mut funding = FundingProcessor::new(dyn_store, self.funding.clone(), worker, payout_settings)
            .with_crash_hook(self.crash.clone());
        if self.broken == Some(Breakage::FundingLookupBeforeSend) {
            funding = funding.without_lookup_before_send();
        }
        Ok(Machine { store, maintenance, payouts, funding })
    }

    /// A crash: everything of the process goes; what committed stays in the file.
    pub async fn reopen(&mut self, m: Machine) -> Result<Machine, String> {
        let Machine { store, maintenance, payouts, funding } = m;
        drop((maintenance, payouts, funding));
        match Arc::try_unwrap(store) {
            Ok(store) => store.close().await,
            Err(_) => return Err("the store is still held after a crash".into()),
        }
        self.crash.disarm();
        self.open().await
    }
}
