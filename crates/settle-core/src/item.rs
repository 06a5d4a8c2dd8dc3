//! The billable item's money state machine (spec §2), as a pure table.
//!
//! ```text
//!               fail                 succeed
//!   charged ───────────► refunded ─────────────► reclaimed
//!      │  └── succeed ──► succeeded ──── return ───► returned   (payouts only; also from
//!      └───── cancel ───► cancelled                              reclaimed: a late execution)
//! ```
//! A store applies an arrow as one guarded `UPDATE items … WHERE state = <from>`; every pair
//! this table does not list is a no-op.

use crate::ledger::EntryKind;
use crate::money::{Credits, MoneyError};

crate::names! {
    /// A billable item's money state (spec §2).
    pub ItemState {
        Charged = "charged",
        Succeeded = "succeeded",
        Refunded = "refunded",
        Reclaimed = "reclaimed",
        Cancelled = "cancelled",
        /// A paid-out withdrawal that the receiving side sent back: the amount is credited again.
        Returned = "returned",
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ItemSignal {
    Fail,
    Succeed,
    Cancel,
    /// The provider reports an executed payout as returned (withdrawals only).
    Return,
}

impl ItemSignal {
    pub const ALL: [ItemSignal; 4] = [ItemSignal::Fail, ItemSignal::Succeed, ItemSignal::Cancel, ItemSignal::Return];
}

/// One edge of the machine: where it starts, where it ends, and the ledger row it writes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Arrow {
    pub from: ItemState,
    pub to: ItemState,
    pub entry: Option<EntryKind>,
}

crate::names! {
    /// Why an item was refunded. A job-level success reclaims only `JobFailed` refunds: items the
    /// worker itself reported as failed were not delivered (spec §2).
    pub RefundReason {
        JobFailed = "job_failed",
        ItemFailed = "item_failed",
        Cancelled = "cancelled",
    }
}

impl ItemState {
    /// No job signal moves the item any more. (A succeeded payout may still be returned by the
    /// provider: that is the one arrow out of `succeeded`, and it is not a job signal.)
    pub const fn is_terminal(self) -> bool {
        matches!(self, ItemState::Succeeded | ItemState::Reclaimed | ItemState::Cancelled | ItemState::Returned)
    }

    /// A refund was written for this item at some point.
    pub const fn is_refunded(self) -> bool {
        matches!(self, ItemState::Refunded | ItemState::Reclaimed | ItemState::Cancelled)
    }

    pub const fn is_reclaimed(self) -> bool {
        matches!(self, ItemState::Reclaimed)
    }

    /// Whether a later transition may still credit this item's cost back: a charged item (refund,
    /// cancel) and, for a payout (`returnable`), a paid one (return). An account's `held` is the sum
    /// of these; grants keep `balance + held ≤ BALANCE_MAX`, so no refund or return can overflow.
    pub const fn is_held(self, returnable: bool) -> bool {
        match self {
            ItemState::Charged => true,
            ItemState::Succeeded | ItemState::Reclaimed => returnable,
            ItemState::Refunded | ItemState::Cancelled | ItemState::Returned => false,
        }
    }

    /// The item's net effect on the balance in this state (invariant L3).
    pub fn net(self, cost: Credits) -> Result<Credits, MoneyError> {
        match self {
            ItemState::Charged | ItemState::Succeeded | ItemState::Reclaimed => cost.checked_neg(),
            ItemState::Refunded | ItemState::Cancelled | ItemState::Returned => Ok(Credits::ZERO),
        }
    }
}

/// The arrow a signal takes from a state, or `None` for a no-op.
pub const fn arrow(state: ItemState, signal: ItemSignal) -> Option<Arrow> {
    use ItemSignal as S;
    use ItemState as I;
    let (to, entry) = match (state, signal) {
        (I::Charged, S::Fail) => (I::Refunded, Some(EntryKind::Refund)),
        (I::Charged, S::Succeed) => (I::Succeeded, None),
        (I::Charged, S::Cancel) => (I::Cancelled, Some(EntryKind::Refund)),
        (I::Refunded, S::Succeed) => (I::Reclaimed, Some(EntryKind::Reclaim)),
        (I::Succeeded, S::Return) | (I::Reclaimed, S::Return) => (I::Returned, Some(EntryKind::PayoutReturn)),
        _ => return None,
    };
    Some(Arrow { from: state, to, entry })
}

/// The signed ledger amount of an arrow's entry for an item of `cost`.
pub fn entry_amount(kind: EntryKind, cost: Credits) -> Result<Credits, MoneyError> {
    match kind {
        EntryKind::Refund | EntryKind::PayoutReturn | EntryKind::Release => Ok(cost),
        EntryKind::Charge | EntryKind::Reclaim | EntryKind::Expire => cost.checked_neg(),
        EntryKind::Grant | EntryKind::Adjustment => Ok(cost),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_arrow_keeps_the_net_consistent_with_its_entry() {
        let cost = Credits::new(40);
        for state in ItemState::ALL {
            for signal in ItemSignal::ALL {
                let Some(a) = arrow(state, signal) else { continue };
                let before = a.from.net(cost).unwrap();
                let after = a.to.net(cost).unwrap();
                let written = a.entry.map(|k| entry_amount(k, cost).unwrap()).unwrap_or_default();
                assert_eq!(before.checked_add(written).unwrap(), after, "{state:?} {signal:?}");
            }
        }
    }

    #[test]
    fn terminal_states_have_no_arrows() {
        for state in ItemState::ALL.into_iter().filter(|s| s.is_terminal()) {
            for signal in [ItemSignal::Fail, ItemSignal::Succeed, ItemSignal::Cancel] {
                assert_eq!(arrow(state, signal), None);
            }
        }
    }

    #[test]
    fn only_a_paid_item_can_be_returned_and_only_once() {
        // Paid: succeeded, or reclaimed (refunded, then found executed after all).
        for state in ItemState::ALL {
            let a = arrow(state, ItemSignal::Return);
            assert_eq!(a.is_some(), matches!(state, ItemState::Succeeded | ItemState::Reclaimed), "{state:?}");
        }
        assert_eq!(arrow(ItemState::Returned, ItemSignal::Return), None);
        assert_eq!(ItemState::Returned.net(Credits::new(40)).unwrap(), Credits::ZERO);
    }

    #[test]
    fn every_credit_leaves_balance_plus_held_unchanged() {
        // A credit (refund, return) moves cost from `held` to the balance; nothing else grows the sum.
        let cost = Credits::new(40);
        for returnable in [false, true] {
            for state in ItemState::ALL {
                for signal in ItemSignal::ALL {
                    // Only payouts are returned, and a payout's paid item is returnable.
                    if signal == ItemSignal::Return && !returnable {
                        continue;
                    }
                    let Some(a) = arrow(state, signal) else { continue };
                    let written = a.entry.map(|k| entry_amount(k, cost).unwrap().get()).unwrap_or(0);
                    let held = |s: ItemState| if s.is_held(returnable) { cost.get() } else { 0 };
                    let change = written + held(a.to) - held(a.from);
                    assert!(
                        change <= 0,
                        "{state:?} {signal:?} returnable={returnable}: balance + held grows by {change}"
                    );
                    if written > 0 {
                        assert_eq!(change, 0, "{state:?} {signal:?}: a credit comes out of held");
                    }
                }
            }
        }
    }

    #[test]
    fn refunded_only_moves_on_success() {
        assert_eq!(arrow(ItemState::Refunded, ItemSignal::Fail), None);
        assert_eq!(arrow(ItemState::Refunded, ItemSignal::Cancel), None);
        assert_eq!(arrow(ItemState::Refunded, ItemSignal::Succeed).unwrap().to, ItemState::Reclaimed);
    }

    /// The whole item state machine, every (state, signal) pair: the spec's table, pinned.
    #[test]
    fn the_arrow_table_is_exactly_the_spec() {
        use ItemSignal as S;
        use ItemState as I;
        let expected = |state, signal| match (state, signal) {
            (I::Charged, S::Fail) => Some((I::Refunded, Some(EntryKind::Refund))),
            (I::Charged, S::Succeed) => Some((I::Succeeded, None)),
            (I::Charged, S::Cancel) => Some((I::Cancelled, Some(EntryKind::Refund))),
            (I::Refunded, S::Succeed) => Some((I::Reclaimed, Some(EntryKind::Reclaim))),
            (I::Succeeded, S::Return) | (I::Reclaimed, S::Return) => Some((I::Returned, Some(EntryKind::PayoutReturn))),
            _ => None,
        };
        let mut arrows = 0;
        for state in ItemState::ALL {
            for signal in ItemSignal::ALL {
                let got = arrow(state, signal).map(|a| {
                    assert_eq!(a.from, state);
                    (a.to, a.entry)
                });
                assert_eq!(got, expected(state, signal), "{state:?} {signal:?}");
                arrows += usize::from(got.is_some());
            }
        }
        assert_eq!(arrows, 6);
    }

    #[test]
    fn names_are_the_wire_and_storage_format() {
        let names: Vec<&str> = ItemState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(names, ["charged", "succeeded", "refunded", "reclaimed", "cancelled", "returned"]);
        for s in ItemState::ALL {
            assert_eq!(ItemState::parse(s.as_str()), Some(s));
        }
        assert_eq!(ItemState::parse("charge"), None);
        for (r, name) in [
            (RefundReason::JobFailed, "job_failed"),
            (RefundReason::ItemFailed, "item_failed"),
            (RefundReason::Cancelled, "cancelled"),
        ] {
            assert_eq!((r.as_str(), RefundReason::parse(name)), (name, Some(r)));
        }
        assert_eq!(RefundReason::parse("failed"), None);
    }

    #[test]
    fn what_each_state_says_of_itself() {
        use ItemState as I;
        // (state, terminal, refunded at some point, reclaimed)
        for (s, terminal, refunded, reclaimed) in [
            (I::Charged, false, false, false),
            (I::Succeeded, true, false, false),
            (I::Refunded, false, true, false),
            (I::Reclaimed, true, true, true),
            (I::Cancelled, true, true, false),
            (I::Returned, true, false, false),
        ] {
            assert_eq!((s.is_terminal(), s.is_refunded(), s.is_reclaimed()), (terminal, refunded, reclaimed), "{s:?}");
        }
    }
}
