//! The item arrows of `settle_core::item`, applied to a job's items with their ledger lines and the
//! account's held and exposed amounts, in the caller's transaction.

use super::allocations::Spend;
use super::{BalanceCheck, Cx, Holds, JobRow, Line, Posting, guard_hit, post, price_of};
use crate::broken::Guard;
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::Costs;
use settle_core::Credits;
use settle_core::item::{self, ItemSignal, ItemState, RefundReason};
use settle_core::job::{self};
use settle_core::ledger::EntryKind;
use std::sync::LazyLock;

columns! {
    /// An item a transition moved, with its place in the job (ledger rows follow the items' order)
    /// and its hold if it is held.
    MovedCol { item_id, cost, ord, hold }
}

static MOVE_ONE: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE items SET state = $3, refund_reason = COALESCE($4, refund_reason), decided_attempt = $6 \
         WHERE job_id = $1 AND item_id = $2 AND state = $5 RETURNING {}",
        MovedCol::LIST
    )
});
static RECLAIM_ALL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE items SET state = $2 WHERE job_id = $1 AND state = $3 AND refund_reason <> 'item_failed' \
         RETURNING {}",
        MovedCol::LIST
    )
});
/// `MOVE_ONE` and `MOVE_ALL` without their state check, and `RECLAIM_ALL` without its: what the
/// simulator's broken-guard tests run instead (`crate::broken`).
static MOVE_ONE_ANY: LazyLock<String> =
    LazyLock::new(|| MOVE_ONE.replace("AND state = $5", "AND CAST($5 AS TEXT) IS NOT NULL"));
static MOVE_ALL_ANY: LazyLock<String> =
    LazyLock::new(|| MOVE_ALL.replace("AND state = $4", "AND CAST($4 AS TEXT) IS NOT NULL"));
static RECLAIM_ANY: LazyLock<String> =
    LazyLock::new(|| RECLAIM_ALL.replace("AND state = $3", "AND CAST($3 AS TEXT) IS NOT NULL"));
static MOVE_ALL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE items SET state = $2, refund_reason = COALESCE($3, refund_reason) \
         WHERE job_id = $1 AND state = $4 RETURNING {}",
        MovedCol::LIST
    )
});
/// A held item's price, fixed by the success that just delivered it (it still holds its hold).
const PRICE: &str = "UPDATE items SET cost = $3 WHERE job_id = $1 AND item_id = $2 AND state = $4 \
     AND hold IS NOT NULL AND cost = hold";

/// Which items `move_items` moves, and how.
pub(crate) struct Move<'a> {
    /// The items in this state, along the arrow `signal` takes from it.
    pub from: ItemState,
    pub signal: ItemSignal,
    /// Only this item (an item report).
    pub only_item: Option<&'a str>,
    /// Why a refund happened.
    pub reason: Option<RefundReason>,
    /// The prices of the held items a success moves.
    pub costs: &'a Costs,
}

static NO_COSTS: LazyLock<Costs> = LazyLock::new(Costs::default);

impl<'a> Move<'a> {
    /// Every item of the job in `from`, along `signal`'s arrow.
    pub fn all(from: ItemState, signal: ItemSignal) -> Move<'a> {
        Move { from, signal, only_item: None, reason: None, costs: &NO_COSTS }
    }
    pub fn only(self, item: &'a str) -> Move<'a> {
        Move { only_item: Some(item), ..self }
    }
    pub fn because(self, reason: Option<RefundReason>) -> Move<'a> {
        Move { reason, ..self }
    }
    pub fn priced(self, costs: &'a Costs) -> Move<'a> {
        Move { costs, ..self }
    }
}

/// An item a transition moved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Moved {
    pub id: String,
    /// What its entry moved: the cost refunded, reclaimed or returned; for a delivery, its price.
    pub cost: Credits,
    /// A held item's hold.
    pub hold: Option<Credits>,
    /// What a held item's delivery released (zero otherwise).
    pub released: Credits,
}

impl Moved {
    /// A held item's part of a success event: its hold, price and release.
    pub fn priced(&self) -> Option<serde_json::Value> {
        let hold = self.hold?;
        Some(
            serde_json::json!({ "id": self.id, "hold": hold.get(), "cost": self.cost.get(), "released": self.released.get() }),
        )
    }
}

/// Applies `signal` to every item of `job_id` in the arrow's `from` state (optionally only
/// `only_item`, and for reclaims only refunds that a job-level success may take back), writing one
/// ledger row per item that actually moved. A success prices each held item it moves at its price
/// in `costs` (checked beforehand by `check_costs`): delivered from `charged`, the rest of its hold
/// is released; reclaimed from `refunded`, the reclaim takes the price. Returns the moved items in
/// the job's item order.
pub(crate) async fn move_items(db: &mut Db<'_>, cx: &Cx, job: &JobRow, m: Move<'_>) -> Result<Vec<Moved>, StoreError> {
    let Move { from, signal, only_item, reason, costs } = m;
    let arrow = item::arrow(from, signal).expect("move_items is called only on listed arrows");
    let (to, from_s, why) = (arrow.to.as_str(), from.as_str(), reason.map(|r| r.as_str()));
    let refund = matches!(signal, ItemSignal::Fail | ItemSignal::Cancel);
    let any_state = refund && cx.broken(Guard::RefundState);
    let (move_one, move_all) = if any_state { (&*MOVE_ONE_ANY, &*MOVE_ALL_ANY) } else { (&*MOVE_ONE, &*MOVE_ALL) };
    let reclaim = if cx.broken(Guard::ReclaimAfterRefund) { &*RECLAIM_ANY } else { &*RECLAIM_ALL };
    let rows = match (only_item, signal) {
        // An item report: its attempt is kept, so its re-send is told from a stale one.
        (Some(item_id), _) => db.all(move_one, args![&job.id, item_id, to, why, from_s, job.attempt]).await?,
        // A job-level success reclaims every refund except those of items the worker itself failed.
        (None, ItemSignal::Succeed) if from == ItemState::Refunded => {
            db.all(reclaim, args![&job.id, to, from_s]).await?
        }
        (None, _) => db.all(move_all, args![&job.id, to, why, from_s]).await?,
    };
    let mut found = Vec::with_capacity(rows.len());
    for r in &rows {
        let hold = r.opt_i64(MovedCol::hold)?.map(Credits::new);
        found.push((r.i64(MovedCol::ord)?, r.text(MovedCol::item_id)?, Credits::new(r.i64(MovedCol::cost)?), hold));
    }
    // RETURNING order is unspecified; ledger rows follow the job's item order on both engines.
    found.sort();
    // What a later transition could still credit back (refund, return), and what a later success
    // could still reclaim, move with the balance in one statement: by what was at stake before.
    let at_stake = Credits::checked_sum(found.iter().map(|f| f.2))?;
    let returnable = job.kind == job::WITHDRAWAL_KIND;
    let held_step = i64::from(arrow.to.is_held(returnable)) - i64::from(arrow.from.is_held(returnable));
    let mut holds = Holds::default();
    if held_step != 0 && !found.is_empty() {
        holds.held = if held_step > 0 { at_stake } else { at_stake.checked_neg()? }.get();
    }
    holds.exposure = match (arrow.from, arrow.to) {
        (_, ItemState::Refunded) => at_stake.get(),
        (ItemState::Refunded, _) => at_stake.checked_neg()?.get(),
        _ => 0,
    };
    let mut moved = Vec::with_capacity(found.len());
    for (_, id, stake, hold) in found {
        let (cost, released) = match hold {
            Some(hold) if signal == ItemSignal::Succeed => {
                let price = price_of(costs, &id, hold)?;
                let rows = db.exec(PRICE, args![&job.id, &id, price.get(), to]).await?;
                guard_hit(rows, "held item price")?;
                let released = if from == ItemState::Charged { stake.checked_sub(price)? } else { Credits::ZERO };
                (price, released)
            }
            _ => (stake, Credits::ZERO),
        };
        moved.push(Moved { id, cost, hold, released });
    }
    let mut lines = Vec::new();
    for m in &moved {
        let line = |kind, amount| Line {
            kind,
            amount,
            job_id: Some(job.id.as_str()),
            job_seq: Some(job.job_seq),
            item_id: Some(m.id.as_str()),
            ref_id: None,
            reason: reason.map(|r| r.as_str()),
            request_hash: None,
        };
        if let Some(kind) = arrow.entry {
            lines.push(line(kind, item::entry_amount(kind, m.cost)?));
        }
        if m.released.is_positive() {
            lines.push(line(EntryKind::Release, m.released));
        }
    }
    // A withdrawal's item moves cash: its reclaim (the payout went out after all) takes only from
    // credit that never expires (docs/decisions/0023).
    let spend = if returnable { Spend::Cash } else { Spend::Any };
    post(
        db,
        cx,
        Posting {
            account_id: &job.account_id,
            job_kind: Some(&job.kind),
            check: BalanceCheck::Never,
            lines: &lines,
            holds,
        },
        spend,
    )
    .await?;
    Ok(moved)
}

pub(crate) fn sum(moved: &[Moved]) -> Result<Credits, StoreError> {
    Ok(Credits::checked_sum(moved.iter().map(|m| m.cost))?)
}
