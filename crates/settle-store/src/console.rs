//! Reads for the operator console: the overview, what a filter would touch, a job's history and an
//! account with its holds and chain. Each runs on one read snapshot.

use crate::db::{Db, Value, args};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, entry_from_row};
use crate::reads::name;
use settle_core::Timestamp;
use settle_core::job::JobState;
use settle_core::ledger::{EntryFields, EntryKind, GENESIS_HASH, Hash32, chain_hash};

/// The filter's WHERE clause (after `WHERE 1 = 1`) and its arguments, numbered from `$1`.
pub(crate) fn filter_sql(filter: &JobFilter, a: &mut Vec<Value>) -> String {
    let mut sql = String::new();
    let mut add = |sql: &mut String, column: &str, v: Value| {
        a.push(v);
        sql.push_str(&format!(" AND {column} = ${}", a.len()));
    };
    if let Some(s) = filter.state {
        add(&mut sql, "state", s.as_str().into());
    }
    if let Some(k) = &filter.kind {
        add(&mut sql, "kind", k.as_str().into());
    }
    if let Some(acc) = &filter.account_id {
        add(&mut sql, "account_id", acc.as_str().into());
    }
    if let Some(code) = &filter.fail_code {
        add(&mut sql, "last_error_code", code.as_str().into());
    }
    if let Some(until) = filter.until_seq {
        a.push(Value::I64(until));
        sql.push_str(&format!(" AND job_seq <= ${}", a.len()));
    }
    if let Some(prefix) = &filter.id_prefix {
        // `substr`, not LIKE: `_` is both an id character and a LIKE wildcard.
        a.push(Value::I64(prefix.chars().count() as i64));
        a.push(prefix.as_str().into());
        sql.push_str(&format!(" AND substr(id, 1, CAST(${} AS integer)) = ${}", a.len() - 1, a.len()));
    }
    sql.push_str(&scope_sql(&filter.scope, a, "account_id", Kinds::Column("kind")));
    sql
}

/// Where a row's job kind is: a column of the row (jobs), or the kind of the job the row names,
/// if it names one (events).
pub(crate) enum Kinds<'a> {
    Column(&'a str),
    OfJob(&'a str),
}

/// ` AND …` keeping only rows a scope names (nothing for an unscoped token): the account column
/// equal to an exact id or starting with a prefix (`substr`, not LIKE: `_` is an id character),
/// and the kind among the scope's kinds.
pub(crate) fn scope_sql(
    scope: &settle_core::scope::Scope,
    a: &mut Vec<Value>,
    account: &str,
    kinds: Kinds<'_>,
) -> String {
    use settle_core::scope::AccountPattern;
    let mut sql = String::new();
    if let Some(patterns) = &scope.accounts {
        let mut any = Vec::new();
        for p in patterns {
            match p {
                AccountPattern::Exact(id) => {
                    a.push(id.as_str().into());
                    any.push(format!("{account} = ${}", a.len()));
                }
                AccountPattern::Prefix(prefix) => {
                    a.push(Value::I64(prefix.chars().count() as i64));
                    a.push(prefix.as_str().into());
                    any.push(format!("substr({account}, 1, CAST(${} AS integer)) = ${}", a.len() - 1, a.len()));
                }
            }
        }
        sql.push_str(&format!(" AND ({})", any.join(" OR ")));
    }
    if let Some(list) = &scope.kinds {
        let mut places = Vec::new();
        for k in list {
            a.push(k.as_str().into());
            places.push(format!("${}", a.len()));
        }
        let places = places.join(", ");
        match kinds {
            Kinds::Column(c) => sql.push_str(&format!(" AND {c} IN ({places})")),
            Kinds::OfJob(c) => sql.push_str(&format!(
                " AND ({c} IS NULL OR {c} IN (SELECT scoped.id FROM jobs AS scoped WHERE scoped.kind IN ({places})))"
            )),
        }
    }
    sql
}

/// Refuses a prefix that no id could start with (ids are 1-128 of `[A-Za-z0-9_.:-]`).
pub(crate) fn check_filter(filter: &JobFilter) -> Result<(), StoreError> {
    if let Some(prefix) = &filter.id_prefix {
        let ok = !prefix.is_empty()
            && prefix.len() <= settle_core::limits::ID_LEN_MAX
            && prefix.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '-'));
        if !ok {
            return Err(StoreError::invalid("an id prefix is 1 to 128 characters of [A-Za-z0-9_.:-]"));
        }
    }
    Ok(())
}

pub(crate) async fn job_totals(db: &mut Db<'_>, filter: &JobFilter, net: bool) -> Result<JobTotals, StoreError> {
    let mut a = Vec::new();
    let net_sql = if net {
        "CAST(COALESCE(SUM((SELECT COALESCE(SUM(amount), 0) FROM ledger_entries e WHERE e.job_id = jobs.id)), 0) AS bigint)"
    } else {
        "0"
    };
    let sql = format!(
        "SELECT COUNT(*), CAST(COALESCE(SUM(cost), 0) AS bigint), {net_sql}, COALESCE(MAX(job_seq), 0) FROM jobs WHERE 1 = 1{}",
        filter_sql(filter, &mut a)
    );
    let row = db.opt_built(sql, &a).await?.ok_or_else(|| StoreError::internal("no totals row"))?;
    Ok(JobTotals {
        jobs: row.i64(0)?,
        cost: row.i64(1)?,
        net: if net { Some(row.i64(2)?) } else { None },
        last_seq: row.i64(3)?,
    })
}

pub(crate) async fn overview(db: &mut Db<'_>, now: Timestamp, since: Timestamp) -> Result<Overview, StoreError> {
    let mut out = Overview::default();
    for r in db.all("SELECT kind, state, COUNT(*) FROM jobs GROUP BY kind, state ORDER BY kind, state", args![]).await?
    {
        out.jobs.push((r.text(0)?, name(JobState::parse, "job state", r.text(1)?)?, r.i64(2)?));
    }
    out.due = db
        .one(
            "SELECT COUNT(*) FROM jobs WHERE state = 'queued' AND cancel_requested = 0 AND not_before <= $1",
            args![now.micros()],
        )
        .await?
        .i64(0)?;
    // The newest events by sequence (commit order), counted per minute back to `since`.
    let newest = db.one("SELECT COALESCE(MAX(seq), 0) FROM outbox", args![]).await?.i64(0)?;
    let from = (newest - OVERVIEW_EVENTS_MAX).max(0);
    let minute = 60_000_000;
    let first_minute = since.micros().div_euclid(minute);
    let minutes = (now.micros().div_euclid(minute) - first_minute + 1).clamp(1, 24 * 60) as usize;
    let mut counts = vec![0i64; minutes];
    let mut oldest_seen = i64::MAX;
    // Counted by the engine, a row per minute (times are positive, so `/` is a floor).
    let rows = db
        .all(
            "SELECT created_at / 60000000, COUNT(*), MIN(created_at) FROM outbox WHERE seq > $1 GROUP BY created_at / 60000000",
            args![from],
        )
        .await?;
    for r in &rows {
        let (m, n) = (r.i64(0)? - first_minute, r.i64(1)?);
        oldest_seen = oldest_seen.min(r.i64(2)?);
        if (0..minutes as i64).contains(&m) {
            counts[m as usize] += n;
        }
    }
    out.per_minute_truncated = from > 0 && oldest_seen > since.micros();
    out.per_minute = counts
        .into_iter()
        .enumerate()
        .map(|(i, n)| (Timestamp::from_micros((first_minute + i as i64) * minute), n))
        .collect();
    Ok(out)
}

pub(crate) async fn job_history(db: &mut Db<'_>, cx: &ops::Cx, id: &str) -> Result<JobHistory, StoreError> {
    ops::must_read_job(db, cx, id).await?;
    let entries = db
        .all_built(
            format!("SELECT {} FROM ledger_entries WHERE job_id = $1 ORDER BY seq", ops::EntryCol::LIST),
            args![id],
        )
        .await?
        .iter()
        .map(entry_from_row)
        .collect::<Result<Vec<_>, _>>()?;
    let events = db
        .all(
            "SELECT seq, type, job_id, account_id, data, created_at FROM outbox WHERE job_id = $1 ORDER BY seq LIMIT 1000",
            args![id],
        )
        .await?
        .iter()
        .map(|r| crate::webhooks::event_from_row(r, 0))
        .collect::<Result<Vec<_>, _>>()?;
    let artifacts = db
        .all(
            "SELECT item_id, key, COALESCE(path, key), created_at FROM artifacts WHERE job_id = $1 \
             ORDER BY created_at, item_id, key",
            args![id],
        )
        .await?
        .iter()
        .map(|r| {
            Ok(ArtifactRecord {
                item_id: r.text(0)?,
                key: r.text(1)?,
                path: r.text(2)?,
                created_at: Timestamp::from_micros(r.i64(3)?),
            })
        })
        .collect::<Result<Vec<_>, StoreError>>()?;
    let signals_unlogged = db.one("SELECT signals_unlogged FROM jobs WHERE id = $1", args![id]).await?.i64(0)?;
    Ok(JobHistory { entries, events, artifacts, signals_unlogged })
}

pub(crate) async fn account_detail(db: &mut Db<'_>, id: &str) -> Result<AccountDetail, StoreError> {
    let row = db.opt(&ops::SELECT_ACCOUNT, args![id]).await?.ok_or_else(|| StoreError::not_found("account", id))?;
    let account = ops::account_from_row(&row)?;
    let holds = db.one("SELECT held, exposure FROM accounts WHERE id = $1", args![id]).await?;
    let entries = db.one("SELECT COUNT(*) FROM ledger_entries WHERE account_id = $1", args![id]).await?.i64(0)?;
    let pending = db
        .one(
            "SELECT CAST(COALESCE(SUM(i.cost), 0) AS bigint) FROM items i JOIN jobs j ON j.id = i.job_id \
             WHERE j.account_id = $1 AND i.state = 'charged'",
            args![id],
        )
        .await?
        .i64(0)?;
    Ok(AccountDetail { account, held: holds.i64(0)?, exposure: holds.i64(1)?, pending, entries })
}

/// The account's chain recomputed from genesis, as the audit does for every account.
pub(crate) async fn verify_chain(db: &mut Db<'_>, id: &str) -> Result<Option<i64>, StoreError> {
    db.opt("SELECT id FROM accounts WHERE id = $1", args![id])
        .await?
        .ok_or_else(|| StoreError::not_found("account", id))?;
    let (mut prev, mut chain_break): (Hash32, Option<i64>) = (GENESIS_HASH, None);
    db.each(
        "SELECT seq, kind, amount, balance_after, job_id, item_id, ref_id, reason, created_at, prev_hash, hash \
         FROM ledger_entries WHERE account_id = $1 ORDER BY seq",
        args![id],
        |r| {
            let seq = r.i64(0)?;
            let kind = name(EntryKind::parse, "entry kind", r.text(1)?)?;
            let (job_id, item_id, ref_id, reason) = (r.opt_text(4)?, r.opt_text(5)?, r.opt_text(6)?, r.opt_text(7)?);
            let fields = EntryFields {
                seq,
                account_id: id,
                kind,
                amount: r.i64(2)?,
                balance_after: r.i64(3)?,
                job_id: job_id.as_deref(),
                item_id: item_id.as_deref(),
                ref_id: ref_id.as_deref(),
                reason: reason.as_deref(),
                created_at: r.i64(8)?,
            };
            let (stored_prev, stored) = (r.blob(9)?, r.blob(10)?);
            let computed = chain_hash(&prev, &fields);
            if chain_break.is_none()
                && (stored_prev.as_slice() != prev.as_slice() || stored.as_slice() != computed.as_slice())
            {
                chain_break = Some(seq);
            }
            prev = stored.as_slice().try_into().unwrap_or(computed);
            Ok(())
        },
    )
    .await?;
    Ok(chain_break)
}

/// One page of an account's entries, optionally of one kind and from a time on, in `seq` order.
pub(crate) async fn entries(
    db: &mut Db<'_>,
    account: &str,
    kind: Option<EntryKind>,
    since: Option<Timestamp>,
    page: Page,
) -> Result<Paged<LedgerEntry>, StoreError> {
    db.opt("SELECT id FROM accounts WHERE id = $1", args![account])
        .await?
        .ok_or_else(|| StoreError::not_found("account", account))?;
    let limit = i64::from(page.limit.clamp(1, settle_core::limits::PAGE_LIMIT_MAX));
    let rows = db
        .all_built(
            format!(
                "SELECT {} FROM ledger_entries WHERE account_id = $1 AND seq > $2 \
                 AND (CAST($3 AS TEXT) IS NULL OR kind = $3) AND created_at >= $4 ORDER BY seq LIMIT $5",
                ops::EntryCol::LIST
            ),
            args![account, page.after, kind.map(|k| k.as_str()), since.map_or(i64::MIN, |t| t.micros()), limit],
        )
        .await?;
    let entries = rows.iter().map(entry_from_row).collect::<Result<Vec<_>, _>>()?;
    let next = if entries.len() as i64 == limit { entries.last().map(|e| e.seq) } else { None };
    Ok(Paged { rows: entries, next_after: next })
}

/// Undelivered webhook deliveries by endpoint: (endpoint, pending, dead).
pub(crate) async fn webhook_backlog(db: &mut Db<'_>) -> Result<Vec<(String, i64, i64)>, StoreError> {
    let rows = db
        .all(
            "SELECT endpoint_id, \
             CAST(SUM(CASE WHEN state = 'pending' THEN 1 ELSE 0 END) AS bigint), \
             CAST(SUM(CASE WHEN state = 'dead' THEN 1 ELSE 0 END) AS bigint) \
             FROM webhook_deliveries WHERE state <> 'delivered' GROUP BY endpoint_id ORDER BY endpoint_id",
            args![],
        )
        .await?;
    rows.iter().map(|r| Ok((r.text(0)?, r.i64(1)?, r.i64(2)?))).collect()
}
