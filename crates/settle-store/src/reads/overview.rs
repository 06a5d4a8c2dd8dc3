//! The whole system at a glance: the console's overview (jobs by kind and state, what is due,
//! transitions per minute) and the counters `/metrics` shows; the operator action log.

use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::name;
use settle_core::Timestamp;
use settle_core::job::JobState;

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

pub(crate) async fn stats(db: &mut Db<'_>) -> Result<Stats, StoreError> {
    let jobs = db.all("SELECT state, COUNT(*) FROM jobs GROUP BY state ORDER BY state", args![]).await?;
    let entries = db.all("SELECT kind, COUNT(*) FROM ledger_entries GROUP BY kind ORDER BY kind", args![]).await?;
    let pairs = |rows: Vec<crate::db::Row>| -> Result<Vec<(String, i64)>, StoreError> {
        rows.iter().map(|r| Ok((r.text(0)?, r.i64(1)?))).collect()
    };
    Ok(Stats { jobs_by_state: pairs(jobs)?, entries_by_kind: pairs(entries)?, tx_retries: 0 })
}

/// The admin actions on a job (`job`) or an account (`account`), oldest first.
pub(crate) async fn actions(
    db: &mut Db<'_>,
    job: Option<&str>,
    account: Option<&str>,
) -> Result<Vec<crate::model::Action>, StoreError> {
    let rows = db
        .all(
            "SELECT id, at, actor, action, job_id, account_id, detail FROM actions \
             WHERE (CAST($1 AS TEXT) IS NULL OR job_id = $1) AND (CAST($2 AS TEXT) IS NULL OR account_id = $2) ORDER BY id LIMIT 1000",
            args![job, account],
        )
        .await?;
    rows.iter()
        .map(|r| {
            Ok(crate::model::Action {
                id: r.i64(0)?,
                at: Timestamp::from_micros(r.i64(1)?),
                actor: r.text(2)?,
                action: name(crate::model::ActionKind::parse_stored, "action", r.text(3)?)?,
                job_id: r.opt_text(4)?,
                account_id: r.opt_text(5)?,
                detail: r.text(6)?,
            })
        })
        .collect()
}
