//! The auditor's own account of the money (TigerBeetle's auditor predicts every balance): from what
//! the clients asked for and the item states the jobs show, what each account's balance must be —
//! worked out without the store's sums, so a movement the ledger made twice, or missed, or made
//! for the wrong amount shows up at the step that made it.
//!
//! An account's balance = what was granted to it − what expired of it + each of its items' net:
//! `charged` costs what it was charged (a fixed item its price, a held item its hold),
//! `succeeded` and `reclaimed` cost the price (a fixed item's own, a held item's given by the worker:
//! 0 or 1 here, never above the hold), `refunded`, `cancelled` and `returned` cost nothing — so a
//! recovered job ends at −cost and an undelivered one at 0. What expired is read from the ledger's
//! `expire` entries: which grant a charge drew on is the store's choice (L5 checks it), the total
//! is not.

use crate::sim_job::SimJob;
use settle_core::ids::AccountId;
use settle_core::item::ItemState;
use settle_core::ledger::EntryKind;
use settle_store::{Page, SqlStore, Store};
use std::collections::{BTreeMap, BTreeSet};

/// What the auditor knows of each account's money.
#[derive(Debug, Default)]
pub struct Books {
    /// Granted, by account: each grant the store accepted.
    pub granted: BTreeMap<String, i64>,
    /// Taken by expiry so far, by account (read from its `expire` entries).
    expired: BTreeMap<String, i64>,
    /// How far each account's ledger has been read (an entry `seq`).
    read_to: BTreeMap<String, i64>,
}

impl Books {
    pub fn granted(&mut self, account: &str, amount: i64) {
        *self.granted.entry(account.to_owned()).or_default() += amount;
    }
}

impl Books {
    /// Every account in `accounts`: its balance against the prediction; and every item's amount
    /// against what its client and worker asked for.
    pub async fn check(
        &mut self,
        jobs: &BTreeMap<String, SimJob>,
        store: &SqlStore,
        accounts: &BTreeSet<String>,
    ) -> Result<(), String> {
        if accounts.is_empty() {
            return Ok(());
        }
        let mut predicted: BTreeMap<String, i64> = BTreeMap::new();
        for (id, job) in jobs {
            for (item, (state, _)) in &job.seen {
                let asked =
                    job.prices.get(item).copied().ok_or_else(|| format!("job {id} has an item {item} nobody made"))?;
                let held = job.items.iter().any(|(i, h)| i == item && *h);
                let cost = job.costs.get(item).copied().unwrap_or(asked);
                let priced = matches!(state, ItemState::Succeeded | ItemState::Reclaimed);
                let right = match (held, priced) {
                    (true, true) => (0..=asked.min(1)).contains(&cost),
                    _ => cost == asked,
                };
                if !right {
                    return Err(format!("job {id} item {item} ({state:?}) carries {cost}; its client asked {asked}"));
                }
                let net = match state {
                    ItemState::Charged | ItemState::Succeeded | ItemState::Reclaimed => -cost,
                    ItemState::Refunded | ItemState::Cancelled | ItemState::Returned => 0,
                };
                *predicted.entry(job.account.clone()).or_default() += net;
            }
        }
        for account in accounts {
            let id = AccountId::parse(account).expect("an account id");
            let have = store.account(&id).await.map_err(|e| format!("read account {account}: {e}"))?.balance.get();
            let granted = self.granted.get(account).copied().unwrap_or(0);
            let items = predicted.get(account).copied().unwrap_or(0);
            let mut expired = self.expired.get(account).copied().unwrap_or(0);
            // Expiry is the one movement the auditor does not predict: its entries are read when
            // the balance says something moved beyond the prediction (reading them every step
            // would add the same entries, only sooner).
            if have != granted - expired + items {
                expired = self.read_expired(store, account).await?;
            }
            let want = granted - expired + items;
            if have != want {
                return Err(format!(
                    "account {account}'s balance is {have}; granted {granted}, expired {expired} and its items' \
                     states make it {want}"
                ));
            }
        }
        Ok(())
    }

    /// What expiry has taken from `account` so far, reading only its entries not read before.
    async fn read_expired(&mut self, store: &SqlStore, account: &str) -> Result<i64, String> {
        let id = AccountId::parse(account).expect("an account id");
        let mut after = self.read_to.get(account).copied().unwrap_or(0);
        loop {
            let page = store.ledger(&id, Page { after, limit: 500 }).await.map_err(|e| format!("ledger: {e}"))?;
            for e in &page.rows {
                if e.kind == EntryKind::Expire {
                    *self.expired.entry(account.to_owned()).or_default() -= e.amount.get();
                }
                after = e.seq;
            }
            if page.next_after.is_none() {
                break;
            }
        }
        self.read_to.insert(account.to_owned(), after);
        Ok(self.expired.get(account).copied().unwrap_or(0))
    }
}
