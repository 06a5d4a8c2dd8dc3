//! An account's auto top-up rule as the postings see it (docs/design/money-controls.md §4): its row,
//! its threshold in the account's alert band, and a line's crossing of it. Below both `ops::alerts`
//! (which crosses it with the alerts) and `ops::auto_top_ups` (which makes the top-ups and puts the
//! rule), so neither reaches into the other.

use crate::db::{Db, Row, args, columns};
use crate::error::StoreError;
use crate::model::{AlertSide, RuleState};
use std::sync::LazyLock;

columns! {
    /// An auto top-up rule as stored.
    RuleCol {
        below, credits, price, currency, customer, monthly_credits_max, state, side, generation, month_start,
        credits_this_month,
    }
}

/// A rule as its row says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Rule {
    pub below: i64,
    pub credits: i64,
    pub price: i64,
    pub currency: String,
    pub customer: String,
    pub monthly_credits_max: i64,
    pub state: RuleState,
    pub side: AlertSide,
    pub generation: i64,
    pub month_start: i64,
    pub credits_this_month: i64,
}

fn rule_of(r: &Row) -> Result<Rule, StoreError> {
    use RuleCol as C;
    let (state, side) = (r.text(C::state)?, r.text(C::side)?);
    Ok(Rule {
        below: r.i64(C::below)?,
        credits: r.i64(C::credits)?,
        price: r.i64(C::price)?,
        currency: r.text(C::currency)?,
        customer: r.text(C::customer)?,
        monthly_credits_max: r.i64(C::monthly_credits_max)?,
        state: RuleState::parse(&state).ok_or_else(|| StoreError::internal(format!("a rule in state {state}")))?,
        side: AlertSide::parse(&side).ok_or_else(|| StoreError::internal(format!("a rule on side {side}")))?,
        generation: r.i64(C::generation)?,
        month_start: r.i64(C::month_start)?,
        credits_this_month: r.i64(C::credits_this_month)?,
    })
}

static SELECT_RULE: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM auto_top_ups WHERE account_id = $1", RuleCol::LIST));

/// The account's rule, if it has one. Every writer of it holds the account row.
pub(crate) async fn read_rule(db: &mut Db<'_>, account_id: &str) -> Result<Option<Rule>, StoreError> {
    db.opt(&SELECT_RULE, args![account_id]).await?.map(|r| rule_of(&r)).transpose()
}

impl Rule {
    /// Where it stands in the account's band: its threshold and side.
    pub fn threshold(&self) -> (i64, AlertSide) {
        (self.below, self.side)
    }

    /// One line's balance after, against the threshold: true when it crossed it downward (the
    /// side goes `above → below`); the side follows the balance either way.
    pub fn cross(&mut self, after: i64) -> bool {
        match self.side {
            AlertSide::Above if after < self.below => {
                self.side = AlertSide::Below;
                true
            }
            AlertSide::Below if after >= self.below => {
                self.side = AlertSide::Above;
                false
            }
            _ => false,
        }
    }
}

/// Writes the side a posting left the rule on.
pub(crate) async fn write_side(db: &mut Db<'_>, account_id: &str, side: AlertSide) -> Result<(), StoreError> {
    let rows =
        db.exec("UPDATE auto_top_ups SET side = $2 WHERE account_id = $1", args![account_id, side.as_str()]).await?;
    super::guard_hit(rows, "rule side")
}
