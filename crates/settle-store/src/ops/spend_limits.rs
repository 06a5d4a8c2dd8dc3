//! Spend limits (spec §4a, docs/design/money-controls.md §3): per UTC day or month, optionally per
//! job kind, checked before a create's charge is written and counted by every posting.
//!
//! Each limit row carries the spend of one period (`period_start`, `spent`), rolled forward by the
//! period's first posting. The account's `spend_limited` flag comes back from every guarded balance
//! UPDATE, so an account without limits never reads them; the checked debits (creates, withdrawals)
//! match only an account without limits, so one with limits misses, is read locked, and is checked
//! before anything is written. Every write of a limit row happens with the account row held.

use super::Cx;
use crate::db::{Db, Engine, args, columns};
use crate::error::StoreError;
use crate::model::{LimitExceeded, NewLimit, SpendLimit};
use settle_core::spend::{Period, Room};
use settle_core::{Timestamp, job, limits};
use std::sync::LazyLock;

/// At most this many limits per account, and kinds per limit.
pub(crate) const LIMITS_MAX: usize = 16;
pub(crate) const LIMIT_KINDS_MAX: usize = 16;

/// The kinds a limit row covers, as a condition on the row (`spend_limits` under its own name) and
/// a job kind `{kind}`.
fn covers(kind: &str) -> String {
    format!(
        "((spend_limits.all_kinds = 1 AND {kind} <> '{withdrawal}') OR EXISTS (SELECT 1 FROM spend_limit_kinds k \
         WHERE k.account_id = spend_limits.account_id AND k.limit_no = spend_limits.limit_no AND k.kind = {kind}))",
        withdrawal = job::WITHDRAWAL_KIND,
    )
}

/// The start of a limit's period at `$3` (a day's start) or `$4` (a month's).
const START: &str = "(CASE spend_limits.period WHEN 'day' THEN $3 ELSE $4 END)";

/// A posting's spend `$5`, of a job of kind `$2`, counted in each limit of account `$1` covering
/// it: added to the row's period when the posting is in it, starting the row's next period when
/// the posting is later, left out when it is earlier (a clock behind: the posting is dated in a
/// period the row no longer carries, and the audit reads the row's own window).
static COUNT: LazyLock<[String; 2]> = LazyLock::new(|| {
    let sql = |greatest: &str| {
        format!(
            "UPDATE spend_limits SET spent = CASE WHEN period_start = {START} THEN spent + $5 \
             WHEN period_start < {START} THEN $5 ELSE spent END, period_start = {greatest}(period_start, {START}) \
             WHERE account_id = $1 AND {}",
            covers("$2")
        )
    };
    [sql("MAX"), sql("GREATEST")]
});

columns! {
    /// A limit of an account, with the spend of the period its row carries.
    LimitRowCol { limit_no, period, amount, all_kinds, period_start, spent }
}

/// The limits of account `$1` covering a job of kind `$2`, in order.
static COVERING: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM spend_limits WHERE account_id = $1 AND {} ORDER BY limit_no",
        LimitRowCol::LIST,
        covers("$2")
    )
});

static ALL_LIMITS: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM spend_limits WHERE account_id = $1 ORDER BY limit_no", LimitRowCol::LIST));

columns! {
    /// A kind a limit names.
    KindCol { limit_no, kind }
}

/// The kinds of account `$1`'s limits, and of its limit `$2`.
static KINDS: LazyLock<[String; 2]> = LazyLock::new(|| {
    let sql = format!("SELECT {} FROM spend_limit_kinds WHERE account_id = $1", KindCol::LIST);
    [format!("{sql} ORDER BY limit_no, kind"), format!("{sql} AND limit_no = $2 ORDER BY kind")]
});

columns! {
    /// What the ledger's lines say a limit spent in a window: their net (negative spend).
    NetCol { net = "CAST(COALESCE(SUM(e.amount), 0) AS BIGINT)" }
}

/// The net of account `$1`'s job lines dated in `[$3, $4)` whose job's kind limit `$2` covers,
/// among its entries from `account_seq` `$5` on. The same lines `spend::counts` and `covers` say.
static LEDGER_NET: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM spend_limits JOIN ledger_entries e ON e.account_id = spend_limits.account_id \
         JOIN jobs j ON j.id = e.job_id \
         WHERE spend_limits.account_id = $1 AND spend_limits.limit_no = $2 AND e.account_seq >= $5 \
         AND e.created_at >= $3 AND e.created_at < $4 AND e.kind IN ('charge', 'refund', 'reclaim', 'release', 'payout_return') AND {}",
        NetCol::LIST,
        covers("j.kind")
    )
});

/// One limit row as stored.
#[derive(Debug, Clone)]
struct Row {
    limit_no: i64,
    period: Period,
    amount: i64,
    all_kinds: bool,
    period_start: i64,
    spent: i64,
}

fn row(r: &crate::db::Row) -> Result<Row, StoreError> {
    let period = r.text(LimitRowCol::period)?;
    Ok(Row {
        limit_no: r.i64(LimitRowCol::limit_no)?,
        period: Period::parse(&period)
            .ok_or_else(|| StoreError::internal(format!("a spend limit of an unknown period: {period}")))?,
        amount: r.i64(LimitRowCol::amount)?,
        all_kinds: r.i64(LimitRowCol::all_kinds)? == 1,
        period_start: r.i64(LimitRowCol::period_start)?,
        spent: r.i64(LimitRowCol::spent)?,
    })
}

/// After a posting's balance change, on the account row it holds: its spend counted in the limits
/// covering its job's kind — when the account has limits (`limited`, from the balance UPDATE).
pub(crate) async fn after_posting(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    limited: bool,
    job_kind: Option<&str>,
    x: i64,
) -> Result<(), StoreError> {
    let Some(kind) = job_kind.filter(|_| limited && x != 0) else { return Ok(()) };
    let sql = match db.engine() {
        Engine::Sqlite => &COUNT[0],
        Engine::Postgres => &COUNT[1],
    };
    let (day, month) = (Period::Day.start(cx.now).micros(), Period::Month.start(cx.now).micros());
    db.exec(sql, args![account_id, kind, day, month, x]).await?;
    Ok(())
}

/// A charge of `x` for a job of kind `kind`, on an account with limits whose row this transaction
/// holds: refused (`spend_limit_exceeded`, nothing written) when it would take a covering limit's
/// period over its amount. A broken guard (`crate::broken::Guard::SpendLimit`) lets it through.
pub(crate) async fn check(db: &mut Db<'_>, cx: &Cx, account_id: &str, kind: &str, x: i64) -> Result<(), StoreError> {
    if x <= 0 || cx.broken(crate::broken::Guard::SpendLimit) {
        return Ok(());
    }
    let rows = db.all(&COVERING, args![account_id, kind]).await?;
    for r in &rows {
        let limit = row(r)?;
        let spent = spent_at(&limit, cx.now);
        let room = Room { amount: limit.amount, spent };
        if !room.fits(x) {
            let kinds = kinds_of(db, account_id, &limit).await?;
            return Err(StoreError::SpendLimitExceeded {
                exceeded: Box::new(LimitExceeded {
                    period: limit.period,
                    amount: limit.amount,
                    kinds,
                    spent,
                    remaining: room.remaining(),
                    needed: x,
                }),
            });
        }
    }
    Ok(())
}

columns! {
    /// Whether an account has spend limits.
    FlagCol { spend_limited }
}

static FLAG: LazyLock<[String; 2]> = LazyLock::new(|| {
    let sql = format!("SELECT {} FROM accounts WHERE id = $1", FlagCol::LIST);
    [sql.clone(), format!("{sql} FOR NO KEY UPDATE")]
});

/// `check`, for a create that writes its job row before its charge (SQLite's creates, withdrawals
/// on both engines): run first, so a refusal writes nothing. The account is read (on PostgreSQL
/// locked only when it has limits; its job row is new, so the lock order holds); the charge's own
/// balance UPDATE checks again on the locked row, so a limit put in between is not missed.
pub(crate) async fn check_first(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    kind: &str,
    x: i64,
) -> Result<(), StoreError> {
    if x <= 0 {
        return Ok(());
    }
    let limited = |r: Option<crate::db::Row>| -> Result<bool, StoreError> {
        Ok(r.map(|r| r.i64(FlagCol::spend_limited)).transpose()? == Some(1))
    };
    if !limited(db.opt(&FLAG[0], args![account_id]).await?)? {
        return Ok(());
    }
    if db.engine() == Engine::Postgres && !limited(db.opt(&FLAG[1], args![account_id]).await?)? {
        return Ok(());
    }
    check(db, cx, account_id, kind, x).await
}

/// A limit's spend as a charge at `now` meets it: its row's, unless the row carries an earlier
/// period (nothing was posted in this one yet: 0). A row of a later period (this process's clock
/// behind the one that rolled it) is taken as it is — the stricter reading, and no ledger scan
/// under the account's lock.
fn spent_at(limit: &Row, now: Timestamp) -> i64 {
    if limit.period_start < limit.period.start(now).micros() { 0 } else { limit.spent }
}

/// What the ledger says limit `limit_no` of an account spent in `[from, to)`, reading its entries
/// from `first` (`first_dated_from`) on.
async fn ledger_spend(
    db: &mut Db<'_>,
    account_id: &str,
    limit_no: i64,
    (from, to): (i64, i64),
    first: i64,
) -> Result<i64, StoreError> {
    let net = db.one(&LEDGER_NET, args![account_id, limit_no, from, to, first]).await?.i64(NetCol::net)?;
    net.checked_neg().ok_or(StoreError::Overflow)
}

/// How far apart the clocks of the processes sharing a store may be: an entry dated at `t` follows
/// every entry of its account dated before `t − CLOCK_SKEW_MAX` (docs/design/money-controls.md §3).
const CLOCK_SKEW_MAX_MICROS: i64 = 3_600 * 1_000_000;

columns! {
    /// When an entry was written.
    DatedCol { created_at }
}

static DATED: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM ledger_entries WHERE account_id = $1 AND account_seq = $2", DatedCol::LIST)
});

async fn dated(db: &mut Db<'_>, account_id: &str, account_seq: i64) -> Result<i64, StoreError> {
    let row = db.opt(&DATED, args![account_id, account_seq]).await?;
    row.ok_or_else(|| StoreError::internal(format!("account {account_id} has no ledger entry {account_seq}")))?
        .i64(DatedCol::created_at)
}

/// The first of an account's entries (`1..=last`) that may be dated at or after `from`: found by
/// halving over `account_seq` (a point read each, on the account's chain index), not by reading
/// the account's whole ledger, as entries follow their dates to within the clocks' skew.
async fn first_dated_from(db: &mut Db<'_>, account_id: &str, last: i64, from: i64) -> Result<i64, StoreError> {
    let from = from.saturating_sub(CLOCK_SKEW_MAX_MICROS);
    let (mut lo, mut hi) = (1_i64, last + 1);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if dated(db, account_id, mid).await? < from {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

async fn kinds_of(db: &mut Db<'_>, account_id: &str, limit: &Row) -> Result<Vec<String>, StoreError> {
    if limit.all_kinds {
        return Ok(Vec::new());
    }
    let rows = db.all(&KINDS[1], args![account_id, limit.limit_no]).await?;
    rows.iter().map(|r| r.text(KindCol::kind)).collect()
}

/// Checks a set of limits as asked: at most 16, amounts in `1..=BALANCE_MAX`, each limit's kinds
/// of the id charset, unique, at most 16.
fn check_asked(asked: &[NewLimit]) -> Result<(), StoreError> {
    if asked.len() > LIMITS_MAX {
        return Err(StoreError::invalid(format!("at most {LIMITS_MAX} spend limits per account")));
    }
    for (i, limit) in asked.iter().enumerate() {
        if !(1..=limits::BALANCE_MAX).contains(&limit.amount) {
            return Err(StoreError::invalid(format!(
                "spend limit {i}: amount must be between 1 and {}",
                limits::BALANCE_MAX
            )));
        }
        if limit.kinds.len() > LIMIT_KINDS_MAX {
            return Err(StoreError::invalid(format!("spend limit {i}: at most {LIMIT_KINDS_MAX} kinds")));
        }
        for (k, kind) in limit.kinds.iter().enumerate() {
            settle_core::ids::JobKind::parse(kind)
                .map_err(|e| StoreError::invalid(format!("spend limit {i}: kind: {e}")))?;
            if limit.kinds[..k].contains(kind) {
                return Err(StoreError::invalid(format!("spend limit {i}: kind {kind} is given twice")));
            }
        }
    }
    Ok(())
}

columns! {
    /// An account's row, read locked: its entries so far.
    LockedCol { last_account_seq }
}

/// The account row, locked as a posting locks it (SQLite's one writer needs no lock).
static LOCK_ACCOUNT: LazyLock<[String; 2]> = LazyLock::new(|| {
    let sql = format!("SELECT {} FROM accounts WHERE id = $1", LockedCol::LIST);
    [sql.clone(), format!("{sql} FOR NO KEY UPDATE")]
});

/// `PUT /v1/accounts/{id}/limits`: replaces the account's limits, each starting from what the
/// ledger says its current period spent (read with the account row locked, so no posting is in
/// flight and every one before is visible). Answers the limits as stored, and whether anything
/// changed.
pub(crate) async fn set_limits(
    db: &mut Db<'_>,
    cx: &Cx,
    account_id: &str,
    asked: &[NewLimit],
) -> Result<(Vec<SpendLimit>, bool), StoreError> {
    check_asked(asked)?;
    if let Some(pending) = &cx.pending
        && !super::lock_pending(pending).lines.is_empty()
    {
        return Err(StoreError::internal("limits put after queued ledger lines would not count them"));
    }
    let sql = match db.engine() {
        Engine::Sqlite => &LOCK_ACCOUNT[0],
        Engine::Postgres => &LOCK_ACCOUNT[1],
    };
    let Some(account) = db.opt(sql, args![account_id]).await? else {
        return Err(StoreError::NotFound { what: "account", id: account_id.to_owned() });
    };
    let last = account.i64(LockedCol::last_account_seq)?;
    // The newest entry's date: a limit starts in its period when that is later than now's (this
    // process's clock behind the one that wrote it), so no later roll-forward drops it.
    let newest = if last > 0 { dated(db, account_id, last).await? } else { i64::MIN };
    let before = read(db, cx, account_id).await?;
    let same = before.len() == asked.len()
        && before.iter().zip(asked).all(|(b, a)| (b.period, b.amount, &b.kinds) == (a.period, a.amount, &a.kinds));
    if same {
        return Ok((before, false));
    }
    db.exec("DELETE FROM spend_limit_kinds WHERE account_id = $1", args![account_id]).await?;
    db.exec("DELETE FROM spend_limits WHERE account_id = $1", args![account_id]).await?;
    let mut firsts: Vec<(i64, i64)> = Vec::new();
    for (no, limit) in asked.iter().enumerate() {
        let at = cx.now.max(Timestamp::from_micros(newest));
        let (no, start, end) = (no as i64, limit.period.start(at).micros(), limit.period.next(at).micros());
        db.exec(
            "INSERT INTO spend_limits (account_id, limit_no, period, amount, all_kinds, period_start, spent) \
             VALUES ($1, $2, $3, $4, $5, $6, 0)",
            args![account_id, no, limit.period.as_str(), limit.amount, i64::from(limit.kinds.is_empty()), start],
        )
        .await?;
        for kind in &limit.kinds {
            db.exec(
                "INSERT INTO spend_limit_kinds (account_id, limit_no, kind) VALUES ($1, $2, $3)",
                args![account_id, no, kind.as_str()],
            )
            .await?;
        }
        let first = match firsts.iter().find(|(s, _)| *s == start) {
            Some(&(_, first)) => first,
            None => {
                let first = first_dated_from(db, account_id, last, start).await?;
                firsts.push((start, first));
                first
            }
        };
        let spent = ledger_spend(db, account_id, no, (start, end), first).await?;
        if spent != 0 {
            let rows = db
                .exec(
                    "UPDATE spend_limits SET spent = $3 WHERE account_id = $1 AND limit_no = $2",
                    args![account_id, no, spent],
                )
                .await?;
            super::guard_hit(rows, "spend limit")?;
        }
    }
    let rows = db
        .exec("UPDATE accounts SET spend_limited = $2 WHERE id = $1", args![account_id, i64::from(!asked.is_empty())])
        .await?;
    super::guard_hit(rows, "account spend_limited")?;
    // A crash here loses the whole replacement; the PUT re-sent replaces again (crash suite).
    cx.point(settle_core::crash::CrashPoint::AfterGuard)?;
    Ok((read(db, cx, account_id).await?, true))
}

/// An account's limits with their current period's spend, in order.
async fn read(db: &mut Db<'_>, cx: &Cx, account_id: &str) -> Result<Vec<SpendLimit>, StoreError> {
    let rows = db.all(&ALL_LIMITS, args![account_id]).await?;
    let kinds = db.all(&KINDS[0], args![account_id]).await?;
    let mut out = Vec::with_capacity(rows.len());
    for r in &rows {
        let limit = row(r)?;
        let mut named = Vec::new();
        for k in &kinds {
            if k.i64(KindCol::limit_no)? == limit.limit_no {
                named.push(k.text(KindCol::kind)?);
            }
        }
        let spent = spent_at(&limit, cx.now);
        out.push(SpendLimit {
            period: limit.period,
            amount: limit.amount,
            kinds: named,
            spent,
            resets_at: limit.period.next(cx.now.max(Timestamp::from_micros(limit.period_start))),
        });
    }
    Ok(out)
}

/// An account's limits (`NotFound` for an unknown account).
pub(crate) async fn spend_limits(db: &mut Db<'_>, cx: &Cx, account_id: &str) -> Result<Vec<SpendLimit>, StoreError> {
    if db.opt(&LOCK_ACCOUNT[0], args![account_id]).await?.is_none() {
        return Err(StoreError::NotFound { what: "account", id: account_id.to_owned() });
    }
    read(db, cx, account_id).await
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limit(amount: i64, kinds: &[&str]) -> NewLimit {
        NewLimit { period: Period::Day, amount, kinds: kinds.iter().map(|k| (*k).to_owned()).collect() }
    }

    #[test]
    fn a_set_of_limits_is_checked() {
        assert!(check_asked(&[limit(1, &[])]).is_ok());
        assert!(check_asked(&[limit(0, &[])]).is_err());
        assert!(check_asked(&[limit(-5, &[])]).is_err());
        assert!(check_asked(&[limit(limits::BALANCE_MAX + 1, &[])]).is_err());
        assert!(check_asked(&[limit(5, &["render", "render"])]).is_err());
        assert!(check_asked(&[limit(5, &[""])]).is_err());
        assert!(check_asked(&[limit(5, &["render", "withdrawal"])]).is_ok());
        let kinds: Vec<String> = (0..17).map(|i| format!("k{i}")).collect();
        let many = NewLimit { period: Period::Month, amount: 5, kinds };
        assert!(check_asked(std::slice::from_ref(&many)).is_err());
        let limits: Vec<NewLimit> = (0..17).map(|i| limit(10 + i, &[])).collect();
        assert!(check_asked(&limits).is_err());
        assert!(check_asked(&limits[..16]).is_ok());
    }
}
