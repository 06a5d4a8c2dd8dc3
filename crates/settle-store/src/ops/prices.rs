//! Held items' prices on a success (docs/decisions/0022): checked against the items the success
//! decides before it writes anything, then applied with the item's move.

use super::{ItemCol, JobRow, item_from_row};
use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::{Costs, Item};
use settle_core::Credits;
use std::sync::LazyLock;

static ITEMS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM items WHERE job_id = $1 ORDER BY ord", ItemCol::LIST));

/// The job's items, for a success to check its prices against (the job's row is locked).
pub(crate) async fn job_items(db: &mut Db<'_>, job: &JobRow) -> Result<Vec<Item>, StoreError> {
    db.all(&ITEMS, args![&job.id]).await?.iter().map(item_from_row::<ItemCol>).collect()
}

/// Checks the items a success's `costs` name (when it names any) against the job's `items`:
/// refuses, before anything is written, a price below zero or for an item the job does not have,
/// and a price on a fixed item other than its cost (`Invalid`). Each held item the success moves is
/// checked as it moves (`price_of`). A price for a held item the success does not move changes
/// nothing: an item already priced keeps the price its first success gave it (the answer shows
/// it), one that stays unpriced (refunded by its own failure, cancelled) is not billed
/// (docs/decisions/0022).
pub(crate) fn check_costs(items: &[Item], costs: &Costs) -> Result<(), StoreError> {
    for (id, price) in &costs.0 {
        if price.is_negative() {
            return Err(StoreError::invalid(format!("the cost of item {id} must be zero or more")));
        }
        let Some(item) = items.iter().find(|i| &i.id == id) else {
            return Err(StoreError::invalid(format!("the job has no item {id}")));
        };
        if item.hold.is_none() && *price != item.cost {
            return Err(StoreError::invalid(format!(
                "item {id} has a fixed cost of {}, not {}",
                item.cost.get(),
                price.get()
            )));
        }
    }
    Ok(())
}

/// The price `costs` gives a held item a success is moving. Without one, or above the hold, the
/// success is refused — the operation's error rolls back every write it made, so nothing is written.
pub(crate) fn price_of(costs: &Costs, item: &str, hold: Credits) -> Result<Credits, StoreError> {
    let price = costs.0.iter().find(|(id, _)| id.as_str() == item).map(|(_, p)| *p);
    match price {
        None => Err(StoreError::CostRequired { item: item.to_owned(), hold: hold.get() }),
        Some(p) if p.is_negative() => Err(StoreError::invalid(format!("the cost of item {item} must be zero or more"))),
        Some(p) if p > hold => {
            Err(StoreError::CostExceedsHold { item: item.to_owned(), cost: p.get(), hold: hold.get() })
        }
        Some(p) => Ok(p),
    }
}
