//! Balance alerts (spec §4a, docs/design/money-controls.md §2): an account's named thresholds,
//! edge-triggered in the posting's own transaction.
//!
//! Each alert stores the side of its threshold the balance is on; the account stores the *band*
//! those sides give (`alert_floor ≤ balance < alert_ceiling`). Every guarded balance UPDATE returns
//! the band, so a posting that stays inside it costs nothing more; one whose lines leave it reads
//! the account's alerts on the row it holds, fires one event per crossing in the order the balance
//! passes them, and writes the new sides and band before anything else can touch the account.

use super::top_up_rule::{read_rule, write_side};
use super::{Cx, emit_at_line};
use crate::db::{Db, Engine, args, columns};
use crate::error::StoreError;
use crate::model::{Alert, AlertSide, RuleState};
use settle_core::history::EventKind;
use settle_core::limits;
use std::sync::LazyLock;

/// At most this many alerts per account (spec).
pub(crate) const ALERTS_MAX: usize = 16;

/// What an account's alerts' sides give: a balance below `floor` or at or above `ceiling` has
/// crossed one of them (`None`: no bound that way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Band {
    pub floor: Option<i64>,
    pub ceiling: Option<i64>,
}

impl Band {
    fn holds(self, balance: i64) -> bool {
        self.floor.is_none_or(|f| balance >= f) && self.ceiling.is_none_or(|c| balance < c)
    }

    /// The band of a set of alerts as their sides stand.
    fn of(alerts: &[Alert]) -> Band {
        let floor = alerts.iter().filter(|a| a.side == AlertSide::Above).map(|a| a.below).max();
        let ceiling = alerts.iter().filter(|a| a.side == AlertSide::Below).map(|a| a.below).min();
        Band { floor, ceiling }
    }

    /// The band with the auto top-up rule's threshold as one more (`ops::top_up_rule`).
    fn with(self, rule: Option<(i64, AlertSide)>) -> Band {
        match rule {
            None => self,
            Some((below, AlertSide::Above)) => Band { floor: self.floor.max(Some(below)), ..self },
            Some((below, AlertSide::Below)) => {
                Band { ceiling: Some(self.ceiling.map_or(below, |c| c.min(below))), ..self }
            }
        }
    }
}

/// One ledger line of a posting, as the alerts see it: the balance after it, its amount, and where
/// it is in the ledger — its `seq` when the line is already numbered (SQLite, lines written at
/// once), else its `account_seq`, for the flush to number (PostgreSQL's queued lines).
#[derive(Debug, Clone, Copy)]
pub(crate) struct LineAt {
    pub balance_after: i64,
    pub amount: i64,
    pub seq: Option<i64>,
    pub account_seq: i64,
}

columns! {
    /// An alert of an account.
    AlertCol { alert_id, below, side }
}

static SELECT_ALERTS: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM account_alerts WHERE account_id = $1 ORDER BY below, alert_id", AlertCol::LIST)
});

async fn read(db: &mut Db<'_>, account_id: &str) -> Result<Vec<Alert>, StoreError> {
    let rows = db.all(&SELECT_ALERTS, args![account_id]).await?;
    rows.iter()
        .map(|r| {
            let side = r.text(AlertCol::side)?;
            Ok(Alert {
                id: r.text(AlertCol::alert_id)?,
                below: r.i64(AlertCol::below)?,
                side: AlertSide::parse(&side)
                    .ok_or_else(|| StoreError::internal(format!("an alert on an unknown side: {side}")))?,
            })
        })
        .collect()
}

/// After a posting's balance change (`band` as its UPDATE returned it, `lines` in posting order):
/// the crossings, if any line left the band. Runs on the account row the posting holds.
pub(crate) async fn after_posting(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    band: Band,
    lines: &[LineAt],
) -> Result<(), StoreError> {
    let level = cx.broken(crate::broken::Guard::AlertEdge);
    if !level && lines.iter().all(|l| band.holds(l.balance_after)) {
        return Ok(());
    }
    let mut alerts = read(db, account_id).await?;
    let before: Vec<AlertSide> = alerts.iter().map(|a| a.side).collect();
    let mut rule = read_rule(db, account_id).await?;
    let rule_was = rule.as_ref().map(|r| r.side);
    for line in lines {
        cross(db, cx, account_id, &mut alerts, line, level).await?;
        // The rule's crossing makes its top-up after the operation's last posting
        // (`ops::auto_top_ups::after_operation`): here it is only recorded.
        if let Some(r) = rule.as_mut()
            && r.cross(line.balance_after)
            && r.state == RuleState::Active
        {
            cx.crossings.lock().expect("crossings lock").push((account_id.to_owned(), r.generation));
        }
    }
    if let Some(r) = &rule
        && Some(r.side) != rule_was
    {
        write_side(db, account_id, r.side).await?;
    }
    for (alert, was) in alerts.iter().zip(before) {
        if alert.side != was {
            let rows = db
                .exec(
                    "UPDATE account_alerts SET side = $3 WHERE account_id = $1 AND alert_id = $2 AND side = $4",
                    args![account_id, alert.id.as_str(), alert.side.as_str(), was.as_str()],
                )
                .await?;
            super::guard_hit(rows, "alert side")?;
        }
    }
    write_band(db, account_id, Band::of(&alerts).with(rule.map(|r| r.threshold()))).await
}

/// The crossings of one line, in the order its balance change passes the thresholds: falling,
/// the highest first; rising, the lowest first (`alerts` is sorted by threshold, then id).
/// `level` (a broken guard, for the simulator): fire on every line under a threshold.
async fn cross(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    alerts: &mut [Alert],
    line: &LineAt,
    level: bool,
) -> Result<(), StoreError> {
    let after = line.balance_after;
    let before = after - line.amount;
    let order: Vec<usize> =
        if line.amount < 0 { (0..alerts.len()).rev().collect() } else { (0..alerts.len()).collect() };
    for i in order {
        let alert = &mut alerts[i];
        let (side, kind) = match alert.side {
            AlertSide::Above if after < alert.below => (AlertSide::Below, EventKind::AccountBalanceLow),
            AlertSide::Below if level && after < alert.below => (AlertSide::Below, EventKind::AccountBalanceLow),
            AlertSide::Below if after >= alert.below => (AlertSide::Above, EventKind::AccountBalanceRecovered),
            _ => continue,
        };
        alert.side = side;
        let data = serde_json::json!({
            "alert": alert.id, "below": alert.below, "balance_before": before, "balance_after": after,
            "ledger_seq": line.seq,
        });
        emit_at_line(db, cx, kind, account_id, data, (line.seq, line.account_seq)).await?;
    }
    Ok(())
}

async fn write_band(db: &mut Db<'_>, account_id: &str, band: Band) -> Result<(), StoreError> {
    let rows = db
        .exec(
            "UPDATE accounts SET alert_floor = $2, alert_ceiling = $3 WHERE id = $1",
            args![account_id, band.floor, band.ceiling],
        )
        .await?;
    super::guard_hit(rows, "account band")
}

/// Checks a set of alerts as asked: at most 16, ids unique and of the id charset, thresholds in
/// `1..=BALANCE_MAX`.
fn check(alerts: &[(String, i64)]) -> Result<(), StoreError> {
    if alerts.len() > ALERTS_MAX {
        return Err(StoreError::invalid(format!("at most {ALERTS_MAX} alerts per account")));
    }
    for (i, (id, below)) in alerts.iter().enumerate() {
        settle_core::ids::RefId::parse(id).map_err(|e| StoreError::invalid(format!("alert id: {e}")))?;
        if alerts[..i].iter().any(|(other, _)| other == id) {
            return Err(StoreError::invalid(format!("alert id {id} is given twice")));
        }
        if !(1..=limits::BALANCE_MAX).contains(below) {
            return Err(StoreError::invalid(format!(
                "alert {id}: below must be between 1 and {}",
                limits::BALANCE_MAX
            )));
        }
    }
    Ok(())
}

columns! {
    /// An account's balance, read with its row locked.
    LockedBalanceCol { balance }
}

/// The account row, locked as a posting locks it (SQLite's one writer needs no lock).
static LOCK_BALANCE: LazyLock<[String; 2]> = LazyLock::new(|| {
    let sql = format!("SELECT {} FROM accounts WHERE id = $1", LockedBalanceCol::LIST);
    [sql.clone(), format!("{sql} FOR NO KEY UPDATE")]
});

/// The account's balance, its row locked as a posting locks it; `NotFound` for an unknown account.
pub(crate) async fn locked_balance(db: &mut Db<'_>, account_id: &str) -> Result<i64, StoreError> {
    let sql = match db.engine() {
        Engine::Sqlite => &LOCK_BALANCE[0],
        Engine::Postgres => &LOCK_BALANCE[1],
    };
    let Some(row) = db.opt(sql, args![account_id]).await? else {
        return Err(StoreError::NotFound { what: "account", id: account_id.to_owned() });
    };
    row.i64(LockedBalanceCol::balance)
}

/// The band again, from the account's alerts and `rule`'s threshold (a rule put or deleted).
pub(crate) async fn rewrite_band(
    db: &mut Db<'_>,
    account_id: &str,
    rule: Option<(i64, AlertSide)>,
) -> Result<(), StoreError> {
    let alerts = read(db, account_id).await?;
    write_band(db, account_id, Band::of(&alerts).with(rule)).await
}

/// `PUT /v1/accounts/{id}/alerts`: replaces the account's alerts, each on the side the balance is
/// on now (read with the row locked, so no posting moves it meanwhile); fires nothing. Answers the
/// alerts as stored, and whether anything changed.
pub(crate) async fn set_alerts(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    asked: &[(String, i64)],
) -> Result<(Vec<Alert>, bool), StoreError> {
    check(asked)?;
    let balance = locked_balance(db, account_id).await?;
    let before = read(db, account_id).await?;
    let mut alerts: Vec<Alert> = asked
        .iter()
        .map(|(id, below)| Alert {
            id: id.clone(),
            below: *below,
            side: if balance >= *below { AlertSide::Above } else { AlertSide::Below },
        })
        .collect();
    alerts.sort_by(|a, b| (a.below, &a.id).cmp(&(b.below, &b.id)));
    if alerts == before {
        return Ok((alerts, false));
    }
    db.exec("DELETE FROM account_alerts WHERE account_id = $1", args![account_id]).await?;
    for a in &alerts {
        db.exec(
            "INSERT INTO account_alerts (account_id, alert_id, below, side) VALUES ($1, $2, $3, $4)",
            args![account_id, a.id.as_str(), a.below, a.side.as_str()],
        )
        .await?;
    }
    let rule = read_rule(db, account_id).await?;
    write_band(db, account_id, Band::of(&alerts).with(rule.map(|r| r.threshold()))).await?;
    // A crash here loses the whole replacement; the PUT re-sent replaces again (crash suite).
    cx.point(settle_core::crash::CrashPoint::AfterGuard)?;
    Ok((alerts, true))
}

/// An account's alerts, as stored (`NotFound` for an unknown account).
pub(crate) async fn alerts(db: &mut Db<'_>, account_id: &str) -> Result<Vec<Alert>, StoreError> {
    if db.opt(&LOCK_BALANCE[0], args![account_id]).await?.is_none() {
        return Err(StoreError::NotFound { what: "account", id: account_id.to_owned() });
    }
    read(db, account_id).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alert(id: &str, below: i64, side: AlertSide) -> Alert {
        Alert { id: id.into(), below, side }
    }

    #[test]
    fn the_band_is_what_the_sides_give() {
        assert_eq!(Band::of(&[]), Band::default());
        let alerts =
            [alert("a", 10, AlertSide::Above), alert("b", 50, AlertSide::Above), alert("c", 100, AlertSide::Below)];
        let band = Band::of(&alerts);
        assert_eq!(band, Band { floor: Some(50), ceiling: Some(100) });
        assert!(band.holds(50) && band.holds(99));
        assert!(!band.holds(49) && !band.holds(100));
        assert!(Band::default().holds(i64::MIN) && Band::default().holds(i64::MAX));
    }

    #[test]
    fn a_set_of_alerts_is_checked() {
        assert!(check(&[("low".into(), 1)]).is_ok());
        assert!(check(&[("low".into(), 0)]).is_err());
        assert!(check(&[("low".into(), -5)]).is_err());
        assert!(check(&[("low".into(), limits::BALANCE_MAX + 1)]).is_err());
        assert!(check(&[("low".into(), 5), ("low".into(), 6)]).is_err());
        assert!(check(&[("".into(), 5)]).is_err());
        let many: Vec<(String, i64)> = (0..17).map(|i| (format!("a{i}"), 10 + i)).collect();
        assert!(check(&many).is_err());
        assert!(check(&many[..16]).is_ok());
    }
}
