//! The item arrows of `settle_core::item`, applied to a job's items with their ledger lines and the
//! account's held and exposed amounts, in the caller's transaction.

use super::{BalanceCheck, Cx, Holds, JobRow, Line, post};
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use settle_core::Credits;
use settle_core::item::{self, ItemSignal, ItemState, RefundReason};
use settle_core::job::{self};
use std::sync::LazyLock;

columns! {
    /// An item a transition moved, with its place in the job (ledger rows follow the items' order).
    MovedCol { item_id, cost, ord }
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
static MOVE_ALL: LazyLock<String> = LazyLock::new(|| {
    format!(
        "UPDATE items SET state = $2, refund_reason = COALESCE($3, refund_reason) \
         WHERE job_id = $1 AND state = $4 RETURNING {}",
        MovedCol::LIST
    )
});

/// Applies `signal` to every item of `job_id` in the arrow's `from` state (optionally only
/// `only_item`, and for reclaims only refunds that a job-level success may take back), writing one
/// ledger row per item that actually moved. Returns the moved items with their entries.
pub(crate) async fn move_items(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    from: ItemState,
    signal: ItemSignal,
    only_item: Option<&str>,
    reason: Option<RefundReason>,
) -> Result<Vec<(String, Credits)>, StoreError> {
    let arrow = item::arrow(from, signal).expect("move_items is called only on listed arrows");
    let (to, from_s, why) = (arrow.to.as_str(), from.as_str(), reason.map(|r| r.as_str()));
    let rows = match (only_item, signal) {
        // An item report: its attempt is kept, so its re-send is told from a stale one.
        (Some(item_id), _) => db.all(&MOVE_ONE, args![&job.id, item_id, to, why, from_s, job.attempt]).await?,
        // A job-level success reclaims every refund except those of items the worker itself failed.
        (None, ItemSignal::Succeed) if from == ItemState::Refunded => {
            db.all(&RECLAIM_ALL, args![&job.id, to, from_s]).await?
        }
        (None, _) => db.all(&MOVE_ALL, args![&job.id, to, why, from_s]).await?,
    };
    let mut moved = Vec::with_capacity(rows.len());
    for r in &rows {
        moved.push((r.i64(MovedCol::ord)?, r.text(MovedCol::item_id)?, Credits::new(r.i64(MovedCol::cost)?)));
    }
    // RETURNING order is unspecified; ledger rows follow the job's item order on both engines.
    moved.sort();
    let moved: Vec<(String, Credits)> = moved.into_iter().map(|(_, id, cost)| (id, cost)).collect();
    // What a later transition could still credit back (refund, return), and what a later success
    // could still reclaim, move with the balance in one statement.
    let returnable = job.kind == job::WITHDRAWAL_KIND;
    let held_step = i64::from(arrow.to.is_held(returnable)) - i64::from(arrow.from.is_held(returnable));
    let mut holds = Holds::default();
    if held_step != 0 && !moved.is_empty() {
        holds.held = if held_step > 0 { sum(&moved)? } else { sum(&moved)?.checked_neg()? }.get();
    }
    holds.exposure = match (arrow.from, arrow.to) {
        (_, ItemState::Refunded) => sum(&moved)?.get(),
        (ItemState::Refunded, _) => sum(&moved)?.checked_neg()?.get(),
        _ => 0,
    };
    let lines = match arrow.entry {
        Some(kind) => moved
            .iter()
            .map(|(item_id, cost)| {
                Ok(Line {
                    kind,
                    amount: item::entry_amount(kind, *cost)?,
                    job_id: Some(job.id.as_str()),
                    item_id: Some(item_id.as_str()),
                    ref_id: None,
                    reason: reason.map(|r| r.as_str()),
                    request_hash: None,
                })
            })
            .collect::<Result<Vec<_>, StoreError>>()?,
        None => Vec::new(),
    };
    post(db, cx, &job.account_id, BalanceCheck::Never, &lines, holds).await?;
    Ok(moved)
}

pub(crate) fn sum(moved: &[(String, Credits)]) -> Result<Credits, StoreError> {
    Ok(Credits::checked_sum(moved.iter().map(|(_, c)| *c))?)
}
