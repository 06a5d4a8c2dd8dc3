//! A job as the simulated client and workers know it.

use settle_core::item::{ItemState, RefundReason};
use settle_store::LeaseToken;
use std::collections::{BTreeMap, BTreeSet};

/// A job as its client and workers know it.
#[derive(Debug, Default)]
pub struct SimJob {
    /// (item id, held)
    pub items: Vec<(String, bool)>,
    /// Every lease token a claim answered for it, oldest first.
    pub tokens: Vec<LeaseToken>,
    /// Artifacts a worker wrote for it: (item, path in the simulated store).
    pub artifacts: Vec<(String, String)>,
    /// Each item's state and refund reason as last seen.
    pub seen: BTreeMap<String, (ItemState, Option<RefundReason>)>,
    pub withdrawal: bool,
    /// Items an explicit item success was reported for: only that may reclaim an item its worker
    /// failed (spec §2).
    pub item_succeeded: BTreeSet<String>,
    /// The account it is for.
    pub account: String,
    /// What its client asked for each item: a fixed item's price, a held item's hold.
    pub prices: BTreeMap<String, i64>,
    /// Each item's amount at stake as last seen (`Item::cost`).
    pub costs: BTreeMap<String, i64>,
    /// Its refunds wait for the final failure (`refund_on = final_failure`): a cancel does not
    /// overrule its success (money may have left).
    pub final_failure: bool,
    /// A cancel of it was accepted while it ran (`202`): from then on no success completes it.
    pub cancel_accepted: bool,
    /// The labels its worker must have.
    pub requires: Vec<String>,
}
