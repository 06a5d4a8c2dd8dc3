//! The auto top-up rule (spec §4a, docs/design/money-controls.md §4, §11.3, §11.8): at most one
//! per account. Its `below` is one more threshold of the account's alert band (`ops::alerts`), so
//! a posting that does not cross it pays nothing for it. A line that takes the balance from at or
//! above `below` to under it records the crossing in the operation's context; after the
//! operation's last posting, still in its transaction, `after_operation` makes the top-up — unless
//! the rule is paused or was put again since, a top-up of the account is open, the month's count
//! would pass `monthly_credits_max`, or the balance could not hold the credits: each a skip with
//! `top_up.rule_skipped`, never an error. A rule top-up that dies pauses its rule (`ops::top_up_close`).

use super::Cx;
use super::top_up_rule::{Rule, read_rule};
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::*;
use settle_core::history::EventKind;
use settle_core::spend::Period;
use settle_core::{Credits, Timestamp, limits};
use std::sync::LazyLock;

/// Runs after every operation, in its transaction: the top-ups its postings' crossings make.
/// One operation buys at most once per rule, however many times its lines crossed it.
pub(crate) async fn after_operation(db: &mut Db<'_>, cx: &Cx) -> Result<(), StoreError> {
    let mut crossed = std::mem::take(&mut *cx.crossings.lock().expect("crossings lock"));
    crossed.sort();
    crossed.dedup();
    for (account, generation) in crossed {
        make(db, cx, &account, generation).await?;
    }
    Ok(())
}

columns! {
    /// What the bound allows: the balance and what it may still be credited.
    RoomCol { balance, held }
}

/// The top-up of one crossing, or the reason there is none. The account row is held (the posting
/// that crossed took it), so the reads here are exact.
async fn make(db: &mut Db<'_>, cx: &Cx, account_id: &str, generation: i64) -> Result<(), StoreError> {
    let Some(rule) = read_rule(db, account_id).await? else { return Ok(()) };
    if rule.generation != generation || rule.state != RuleState::Active {
        return Ok(());
    }
    let month = Period::Month.start(cx.now).micros();
    let counted = if rule.month_start < month { 0 } else { rule.credits_this_month };
    // What the rule buys with, as stored: a value this release no longer takes (a withdrawn
    // currency) is a skip, never an error in the operation that crossed.
    let terms = (
        settle_core::currency::Currency::parse(&rule.currency),
        settle_core::ids::Customer::parse(&rule.customer).ok(),
        settle_core::ids::AccountId::parse(account_id).ok(),
    );
    static ROOM: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", RoomCol::LIST));
    let room = db.one(&ROOM, args![account_id]).await?;
    let (balance, held) = (room.i64(RoomCol::balance)?, room.i64(RoomCol::held)?);
    let open = db.opt("SELECT 1 AS open FROM top_ups WHERE account_id = $1 AND open = 1", args![account_id]).await?;
    let skip = if rule.month_start > month {
        // A process whose clock is behind another's that already counted the next month: its
        // top-up would fall outside the month it is counted in.
        Some("clock_behind")
    } else if terms.0.is_none() || terms.1.is_none() || terms.2.is_none() {
        Some("invalid_rule")
    } else if open.is_some() {
        Some("in_flight")
    } else if counted + rule.credits > rule.monthly_credits_max {
        Some("monthly_credits_max")
    } else if i128::from(balance) + i128::from(held) + i128::from(rule.credits) > i128::from(limits::BALANCE_MAX) {
        Some("balance_bound")
    } else {
        None
    };
    if let Some(reason) = skip {
        let data = serde_json::json!({
            "reason": reason, "below": rule.below, "credits": rule.credits,
            "credits_this_month": counted, "monthly_credits_max": rule.monthly_credits_max,
        });
        return super::emit(db, cx, EventKind::TopUpRuleSkipped, None, account_id, data).await;
    }
    let (Some(currency), Some(customer), Some(account)) = terms else { return Ok(()) };
    let req = NewTopUp {
        id: settle_core::ids::JobId::parse(&format!("auto_{}", cx.token().simple()))
            .map_err(|e| StoreError::internal(format!("a rule top-up's id: {e}")))?,
        account_id: account,
        credits: Credits::new(rule.credits),
        price: rule.price,
        currency,
        customer,
    };
    super::top_ups::create_top_up(db, cx, &req, Some(generation)).await?;
    let rows = db
        .exec(
            "UPDATE auto_top_ups SET month_start = $2, credits_this_month = $3 WHERE account_id = $1 AND generation = $4",
            args![account_id, month, counted + rule.credits, generation],
        )
        .await?;
    super::guard_hit(rows, "rule's month")
}

/// The highest rule generation any of the account's top-ups carries (0: none).
async fn last_generation(db: &mut Db<'_>, account_id: &str) -> Result<i64, StoreError> {
    columns! {
        LastCol { g }
    }
    static SQL: LazyLock<String> = LazyLock::new(|| {
        "SELECT CAST(COALESCE(MAX(rule_generation), 0) AS BIGINT) AS g FROM top_ups WHERE account_id = $1 \
         AND rule_generation IS NOT NULL"
            .to_owned()
    });
    db.one(&SQL, args![account_id]).await?.i64(LastCol::g)
}

/// What the rule's top-ups created since `month_start` are buying or bought (open, or charged).
async fn recount(db: &mut Db<'_>, account_id: &str, month_start: i64) -> Result<i64, StoreError> {
    columns! {
        CountCol { n }
    }
    static SQL: LazyLock<String> = LazyLock::new(|| {
        "SELECT CAST(COALESCE(SUM(credits), 0) AS BIGINT) AS n FROM top_ups WHERE account_id = $1 \
         AND rule_generation IS NOT NULL AND created_at >= $2 AND (open = 1 OR provider_charge_id IS NOT NULL)"
            .to_owned()
    });
    db.one(&SQL, args![account_id, month_start]).await?.i64(CountCol::n)
}

fn check(new: &NewAutoTopUp) -> Result<(), StoreError> {
    if !(1..=limits::BALANCE_MAX).contains(&new.below) {
        return Err(StoreError::invalid(format!("below must be between 1 and {}", limits::BALANCE_MAX)));
    }
    if !(1..=limits::TOP_UP_CREDITS_MAX).contains(&new.credits.get()) {
        return Err(StoreError::invalid(format!("credits must be 1 to {} (2^53)", limits::TOP_UP_CREDITS_MAX)));
    }
    if !(0..=limits::TOP_UP_PRICE_MAX).contains(&new.price) {
        return Err(StoreError::invalid(format!("price must be 0 to {} (2^53) minor units", limits::TOP_UP_PRICE_MAX)));
    }
    if new.monthly_credits_max < new.credits.get() || new.monthly_credits_max > limits::BALANCE_MAX {
        return Err(StoreError::invalid(format!(
            "monthly_credits_max must be at least credits ({}) and at most {}",
            new.credits.get(),
            limits::BALANCE_MAX
        )));
    }
    Ok(())
}

/// `PUT /v1/accounts/{id}/auto-top-up`: the rule, `active`, on the side the balance is on now (read
/// with the row locked; nothing fires, even when already below). The same rule put again while
/// active changes nothing; anything else (a paused rule turned on again) is a new generation, so
/// the death of an earlier rule's top-up pauses nothing. The month's count is recounted from the
/// top-ups, never reset. Answers the rule and whether anything changed.
pub(crate) async fn put_rule(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    new: &NewAutoTopUp,
) -> Result<(AutoTopUp, bool), StoreError> {
    check(new)?;
    let balance = super::alerts::locked_balance(db, account_id).await?;
    let old = read_rule(db, account_id).await?;
    let month = Period::Month.start(cx.now).micros();
    let side = if balance >= new.below { AlertSide::Above } else { AlertSide::Below };
    // The same rule put again while active changes nothing (its side, generation and month stay).
    if let Some(o) = &old
        && o.state == RuleState::Active
        && (o.below, o.credits, o.price, o.currency.as_str(), o.customer.as_str(), o.monthly_credits_max)
            == (
                new.below,
                new.credits.get(),
                new.price,
                new.currency.as_str(),
                new.customer.as_str(),
                new.monthly_credits_max,
            )
    {
        return Ok((shown(account_id, o, cx.now)?, false));
    }
    // Past every generation the account's rules had, a deleted one's too: a top-up of an earlier
    // rule never pauses this one.
    let generation = old.as_ref().map_or(0, |o| o.generation).max(last_generation(db, account_id).await?) + 1;
    let rule = Rule {
        below: new.below,
        credits: new.credits.get(),
        price: new.price,
        currency: new.currency.as_str().to_owned(),
        customer: new.customer.as_str().to_owned(),
        monthly_credits_max: new.monthly_credits_max,
        state: RuleState::Active,
        side,
        generation,
        month_start: month,
        credits_this_month: recount(db, account_id, month).await?,
    };
    db.exec("DELETE FROM auto_top_ups WHERE account_id = $1", args![account_id]).await?;
    db.exec(
        "INSERT INTO auto_top_ups (account_id, below, credits, price, currency, customer, monthly_credits_max, state, \
         side, generation, month_start, credits_this_month, updated_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13)",
        args![
            account_id,
            rule.below,
            rule.credits,
            rule.price,
            rule.currency.as_str(),
            rule.customer.as_str(),
            rule.monthly_credits_max,
            rule.state.as_str(),
            rule.side.as_str(),
            rule.generation,
            rule.month_start,
            rule.credits_this_month,
            cx.now.micros()
        ],
    )
    .await?;
    super::alerts::rewrite_band(db, account_id, Some(rule.threshold())).await?;
    cx.point(settle_core::crash::CrashPoint::AfterGuard)?;
    Ok((shown(account_id, &rule, cx.now)?, true))
}

/// `DELETE /v1/accounts/{id}/auto-top-up`: the rule goes (a top-up it made goes on). Whether there
/// was one.
pub(crate) async fn delete_rule(db: &mut Db<'_>, cx: &Cx, account_id: &str) -> Result<bool, StoreError> {
    super::alerts::locked_balance(db, account_id).await?;
    let rows = db.exec("DELETE FROM auto_top_ups WHERE account_id = $1", args![account_id]).await?;
    if rows > 0 {
        super::alerts::rewrite_band(db, account_id, None).await?;
        cx.point(settle_core::crash::CrashPoint::AfterGuard)?;
    }
    Ok(rows > 0)
}

/// `GET /v1/accounts/{id}/auto-top-up`: `NotFound` without a rule (or an account).
pub(crate) async fn rule(db: &mut Db<'_>, cx: &Cx, account_id: &str) -> Result<AutoTopUp, StoreError> {
    match read_rule(db, account_id).await? {
        Some(r) => shown(account_id, &r, cx.now),
        None => Err(StoreError::not_found("auto top-up rule of account", account_id)),
    }
}

/// The rule as the API shows it: a month's count that has not been rolled forward yet shows 0.
fn shown(account_id: &str, r: &Rule, now: Timestamp) -> Result<AutoTopUp, StoreError> {
    let month = Period::Month.start(now);
    Ok(AutoTopUp {
        account_id: settle_core::ids::AccountId::parse(account_id)
            .map_err(|e| StoreError::internal(format!("an account id: {e}")))?,
        below: r.below,
        credits: Credits::new(r.credits),
        price: r.price,
        currency: r.currency.clone(),
        customer: r.customer.clone(),
        monthly_credits_max: r.monthly_credits_max,
        state: r.state,
        credits_this_month: if r.month_start < month.micros() { 0 } else { r.credits_this_month },
        month_resets_at: Period::Month.next(month),
    })
}

/// A rule's row for the audit (L9): its account's rule top-ups of its month must sum to its count.
pub(crate) async fn audit_counts(db: &mut Db<'_>) -> Result<Vec<(String, i64, i64)>, StoreError> {
    columns! {
        RuleCountCol { account_id, month_start, credits_this_month }
    }
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM auto_top_ups ORDER BY account_id", RuleCountCol::LIST));
    let mut out = Vec::new();
    for r in db.all(&SQL, args![]).await? {
        let (account, start) = (r.text(RuleCountCol::account_id)?, r.i64(RuleCountCol::month_start)?);
        let counted = recount(db, &account, start).await?;
        let stored = r.i64(RuleCountCol::credits_this_month)?;
        out.push((account, stored, counted));
    }
    Ok(out)
}
