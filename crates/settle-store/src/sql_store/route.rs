//! Which PostgreSQL write lane an operation goes to: its account's (`engine::postgres::Lanes`), so
//! the operations of one account share batches instead of waiting for each other's row locks.
//! Operations named by a job find the job's account in a bounded cache that creates and claims fill,
//! or read it once. Routing decides only where an operation queues: a miss or a stale slot costs
//! some lock waiting, never a wrong answer (every transition still locks and guards its rows).

use settle_core::limits;
use std::sync::Mutex;

/// Where an operation's writes land.
pub(crate) enum Route<'a> {
    /// On this account's rows (and its jobs').
    Account(&'a str),
    /// On this job's rows, and its account's.
    Job(&'a str),
    /// On no one account's (claims, maintenance scans, webhook bookkeeping).
    Any,
}

/// Job → account, direct-mapped: one slot per hash of the job id, a newer job overwriting an older
/// one in its slot. A slot keeps the job id it answers for, so a lookup never answers another job.
pub(crate) struct JobAccounts {
    slots: Mutex<Vec<Option<Slot>>>,
}

/// A job id and its account's.
type Slot = (Box<str>, Box<str>);

fn fnv(s: &str) -> u64 {
    s.bytes().fold(0xcbf2_9ce4_8422_2325_u64, |h, b| (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

impl JobAccounts {
    pub fn new() -> JobAccounts {
        JobAccounts { slots: Mutex::new(vec![None; limits::JOB_ACCOUNTS_CACHED]) }
    }

    fn slot(job: &str) -> usize {
        (fnv(job) % limits::JOB_ACCOUNTS_CACHED as u64) as usize
    }

    pub fn remember(&self, job: &str, account: &str) {
        let mut slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        slots[Self::slot(job)] = Some((job.into(), account.into()));
    }

    pub fn get(&self, job: &str) -> Option<String> {
        let slots = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        match &slots[Self::slot(job)] {
            Some((j, a)) if &**j == job => Some(a.to_string()),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::JobAccounts;

    #[test]
    fn a_slot_answers_only_for_its_own_job() {
        let cache = JobAccounts::new();
        assert_eq!(cache.get("j1"), None);
        cache.remember("j1", "a");
        assert_eq!(cache.get("j1").as_deref(), Some("a"));
        // Jobs that share j1's slot replace it; none of them is ever answered with j1's account.
        let slot = JobAccounts::slot("j1");
        let other = (0..1_000_000).map(|n| format!("k{n}")).find(|k| JobAccounts::slot(k) == slot).unwrap();
        assert_eq!(cache.get(&other), None);
        cache.remember(&other, "b");
        assert_eq!(cache.get("j1"), None);
        assert_eq!(cache.get(&other).as_deref(), Some("b"));
    }
}
