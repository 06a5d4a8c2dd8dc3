//! What the simulation puts where the world would be: a clock the scheduler moves, a payout
//! provider and an artifact store that keep a log and fail as the seed says, and a crash hook the
//! scheduler arms.

use settle_core::backoff::SplitMix64;
use settle_core::crash::CrashPoint;
use settle_core::{Clock, Timestamp};
use settle_store::{ArtifactStore, CrashHook};
use settle_worker::funding::FundingProvider;
use settle_worker::payouts::{Lookup, Provider, Sent};
use std::collections::{BTreeMap, BTreeSet};
use std::sync::Mutex;

/// The store's clock: moved by the scheduler only.
#[derive(Debug)]
pub struct SimClock(Mutex<Timestamp>);

impl SimClock {
    pub fn new(start: Timestamp) -> SimClock {
        SimClock(Mutex::new(start))
    }
    pub fn advance_ms(&self, ms: u64) {
        let mut now = self.0.lock().unwrap();
        *now = now.plus_millis(ms);
    }
}

impl Clock for SimClock {
    fn now(&self) -> Timestamp {
        *self.0.lock().unwrap()
    }
}

/// FNV-1a, for mixing seeds and hashing traces (stable across runs and platforms).
pub fn fnv(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}
pub const FNV_START: u64 = 0xcbf2_9ce4_8422_2325;

/// One call the provider saw, or a hung request it carried out later.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Lookup {
        key: String,
        absent: bool,
    },
    Send {
        key: String,
        executed: bool,
    },
    /// A send that hung (its caller heard nothing) carried out now.
    Late {
        key: String,
        executed: bool,
    },
}

/// The payout provider: transfers by idempotency key, executed at most once each (a second send of
/// an executed key is answered with the same transfer, as provider-v1 does), every call logged.
/// Each send's fate is drawn from `(seed, key, how many sends of that key before)`: refused (node
/// down, or for good), executed and answered, executed with the answer lost, or hung — no answer, and carried
/// out at some later moment the scheduler picks (`run_hung`), possibly after Settle gave up on it.
pub struct SimProvider {
    seed: u64,
    state: Mutex<ProviderState>,
}

#[derive(Default)]
struct ProviderState {
    executed: BTreeMap<String, i64>,
    sends: BTreeMap<String, u32>,
    log: Vec<Call>,
    down: bool,
    /// Sends that hung, oldest first: (key, amount).
    hung: Vec<(String, i64)>,
}

impl SimProvider {
    pub fn new(seed: u64) -> SimProvider {
        SimProvider { seed, state: Mutex::default() }
    }
    /// Every call so far, in order.
    pub fn log(&self) -> Vec<Call> {
        self.state.lock().unwrap().log.clone()
    }
    pub fn executed(&self) -> BTreeMap<String, i64> {
        self.state.lock().unwrap().executed.clone()
    }
    pub fn set_down(&self, down: bool) {
        self.state.lock().unwrap().down = down;
    }
    /// Carries out the hung sends `pick` chooses (by their place in line); returns how many ran.
    pub fn run_hung(&self, mut pick: impl FnMut(usize) -> bool) -> usize {
        let mut s = self.state.lock().unwrap();
        let hung = std::mem::take(&mut s.hung);
        let mut ran = 0;
        for (n, (key, amount)) in hung.into_iter().enumerate() {
            if !pick(n) {
                s.hung.push((key, amount));
                continue;
            }
            ran += 1;
            let executed = !s.executed.contains_key(&key);
            s.executed.entry(key.clone()).or_insert(amount);
            s.log.push(Call::Late { key, executed });
        }
        ran
    }
    pub fn hung(&self) -> usize {
        self.state.lock().unwrap().hung.len()
    }
}

#[async_trait::async_trait]
impl Provider for SimProvider {
    async fn lookup(&self, key: &str) -> Lookup {
        let mut s = self.state.lock().unwrap();
        if s.down {
            return Lookup::Failed { message: "down".into() };
        }
        let absent = !s.executed.contains_key(key);
        s.log.push(Call::Lookup { key: key.to_owned(), absent });
        if absent { Lookup::Absent } else { Lookup::Found { id: format!("tx-{key}"), returned: false } }
    }

    async fn send(&self, key: &str, _destination: &str, amount: i64) -> Sent {
        let mut s = self.state.lock().unwrap();
        let n = *s.sends.entry(key.to_owned()).and_modify(|n| *n += 1).or_insert(1);
        let mut rng = SplitMix64::new(fnv(fnv(self.seed, key.as_bytes()), &n.to_le_bytes()));
        let fate = rng.below_inclusive(9);
        let already = s.executed.contains_key(key);
        if s.down || (fate == 0 && !already) {
            s.log.push(Call::Send { key: key.to_owned(), executed: false });
            let code = settle_core::ids::FailCode::parse("NODE_DOWN").expect("a code");
            return Sent::Refused { code, message: "node down".into(), retry_after_ms: None };
        }
        // A definitive refusal (one send in ten): the withdrawal dies and its hold is refunded,
        // though a request of it that hung may still be carried out.
        if fate == 8 && !already {
            s.log.push(Call::Send { key: key.to_owned(), executed: false });
            let code = settle_core::ids::FailCode::parse("INSUFFICIENT").expect("a code");
            return Sent::Refused { code, message: "insufficient funds at the provider".into(), retry_after_ms: None };
        }
        // Hung (one send in ten): no answer now; carried out later, or never.
        if fate == 9 && !already {
            s.log.push(Call::Send { key: key.to_owned(), executed: false });
            s.hung.push((key.to_owned(), amount));
            return Sent::NoAnswer { message: "no answer: the request hung".into() };
        }
        s.executed.entry(key.to_owned()).or_insert(amount);
        s.log.push(Call::Send { key: key.to_owned(), executed: !already });
        let txid = format!("tx-{key}");
        // Executed, but the answer lost (three sends in ten).
        if fate <= 3 { Sent::NoAnswer { message: "answer lost".into() } } else { Sent::Executed { id: txid } }
    }
}

/// The funding provider (`funding-v1`): charges by idempotency key, made at most once each (a second
/// charge of a charged key answers the same charge), every call logged. Each charge's fate is drawn
/// from `(seed, key, how many charges of that key before)`: the processor down, the card declined (one
/// in five),
/// charged and answered, charged with the answer lost, or hung — carried out later, or never.
pub struct SimFunding {
    seed: u64,
    state: Mutex<FundingState>,
}

#[derive(Default)]
struct FundingState {
    charged: BTreeMap<String, i64>,
    charges: BTreeMap<String, u32>,
    log: Vec<Call>,
    hung: Vec<(String, i64)>,
}

impl SimFunding {
    pub fn new(seed: u64) -> SimFunding {
        SimFunding { seed, state: Mutex::default() }
    }
    pub fn log(&self) -> Vec<Call> {
        self.state.lock().unwrap().log.clone()
    }
    /// Every key charged, with its amount.
    pub fn charged(&self) -> BTreeMap<String, i64> {
        self.state.lock().unwrap().charged.clone()
    }
    /// Carries out the hung charges `pick` chooses; returns how many ran.
    pub fn run_hung(&self, mut pick: impl FnMut(usize) -> bool) -> usize {
        let mut s = self.state.lock().unwrap();
        let hung = std::mem::take(&mut s.hung);
        let mut ran = 0;
        for (n, (key, amount)) in hung.into_iter().enumerate() {
            if !pick(n) {
                s.hung.push((key, amount));
                continue;
            }
            ran += 1;
            let executed = !s.charged.contains_key(&key);
            s.charged.entry(key.clone()).or_insert(amount);
            s.log.push(Call::Late { key, executed });
        }
        ran
    }
    pub fn hung(&self) -> usize {
        self.state.lock().unwrap().hung.len()
    }
}

#[async_trait::async_trait]
impl FundingProvider for SimFunding {
    async fn lookup(&self, key: &str) -> Lookup {
        let mut s = self.state.lock().unwrap();
        let absent = !s.charged.contains_key(key);
        s.log.push(Call::Lookup { key: key.to_owned(), absent });
        if absent { Lookup::Absent } else { Lookup::Found { id: format!("ch-{key}"), returned: false } }
    }

    async fn charge(&self, key: &str, _customer: &str, amount: i64, _currency: &str) -> Sent {
        let mut s = self.state.lock().unwrap();
        let n = *s.charges.entry(key.to_owned()).and_modify(|n| *n += 1).or_insert(1);
        let mut rng = SplitMix64::new(fnv(fnv(self.seed, key.as_bytes()), &n.to_le_bytes()));
        let fate = rng.below_inclusive(9);
        let already = s.charged.contains_key(key);
        let refused = |code: &str, message: &str| Sent::Refused {
            code: settle_core::ids::FailCode::parse(code).expect("a code"),
            message: message.into(),
            retry_after_ms: None,
        };
        if fate == 0 && !already {
            s.log.push(Call::Send { key: key.to_owned(), executed: false });
            return refused("PROCESSOR_DOWN", "the processor is down");
        }
        // A declined card (one charge in five): the top-up dies, and a rule's pauses.
        if (fate == 7 || fate == 8) && !already {
            s.log.push(Call::Send { key: key.to_owned(), executed: false });
            return refused("CARD_DECLINED", "declined");
        }
        if fate == 9 && !already {
            s.log.push(Call::Send { key: key.to_owned(), executed: false });
            s.hung.push((key.to_owned(), amount));
            return Sent::NoAnswer { message: "no answer: the request hung".into() };
        }
        s.charged.entry(key.to_owned()).or_insert(amount);
        s.log.push(Call::Send { key: key.to_owned(), executed: !already });
        if fate <= 3 {
            Sent::NoAnswer { message: "answer lost".into() }
        } else {
            Sent::Executed { id: format!("ch-{key}") }
        }
    }
}

/// Every send in `log` from `from` on came right after a lookup of its key that found it absent
/// (a hung request carried out meanwhile is the provider's doing, not a call); returns how far it read.
pub fn sends_follow_absent_lookups(log: &[Call], from: usize, what: &str) -> Result<usize, String> {
    for (i, call) in log.iter().enumerate().skip(from) {
        if let Call::Send { key, .. } = call {
            let before = log[..i].iter().rev().find(|c| match c {
                Call::Lookup { key: k, .. } | Call::Send { key: k, .. } => k == key,
                Call::Late { .. } => false,
            });
            if !matches!(before, Some(Call::Lookup { absent: true, .. })) {
                return Err(format!(
                    "{what} key {key} was sent without a lookup that found it absent just before: {before:?}"
                ));
            }
        }
    }
    Ok(log.len())
}

/// Artifacts in memory: the keys written, minus those deleted; deletes fail by the seed.
pub struct SimArtifacts {
    state: Mutex<(BTreeSet<String>, SplitMix64)>,
}

impl SimArtifacts {
    pub fn new(seed: u64) -> SimArtifacts {
        SimArtifacts { state: Mutex::new((BTreeSet::new(), SplitMix64::new(seed))) }
    }
    pub fn put(&self, key: &str) {
        self.state.lock().unwrap().0.insert(key.to_owned());
    }
    pub fn has(&self, key: &str) -> bool {
        self.state.lock().unwrap().0.contains(key)
    }
}

#[async_trait::async_trait]
impl ArtifactStore for SimArtifacts {
    fn location(&self) -> String {
        "memory://settle-dst".into()
    }
    async fn delete(&self, key: &str) -> Result<(), String> {
        let mut s = self.state.lock().unwrap();
        if s.1.below_inclusive(4) == 0 {
            return Err("the artifact store did not answer".into());
        }
        s.0.remove(key);
        Ok(())
    }
}

/// Fires once, at the armed point, then disarms.
#[derive(Default)]
pub struct SimCrash(Mutex<Option<CrashPoint>>);

impl SimCrash {
    pub fn arm(&self, point: CrashPoint) {
        *self.0.lock().unwrap() = Some(point);
    }
    pub fn disarm(&self) {
        *self.0.lock().unwrap() = None;
    }
}

impl CrashHook for SimCrash {
    fn should_crash(&self, point: CrashPoint) -> bool {
        let mut armed = self.0.lock().unwrap();
        if *armed == Some(point) {
            *armed = None;
            return true;
        }
        false
    }
}
