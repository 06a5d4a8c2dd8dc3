//! The whole system at a glance: the console's overview (jobs by kind and state, what is due,
//! transitions per minute) and the counters `/metrics` shows; the operator action log.

use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::name;
use settle_core::Timestamp;
use settle_core::job::JobState;
use std::sync::LazyLock;

columns! {
    /// How many jobs of a kind are in a state.
    KindStateCol { kind, state, jobs = "COUNT(*)" }
}

columns! {
    /// How many rows a statement counts.
    CountCol { count = "COUNT(*)" }
}

columns! {
    /// The newest outbox event's number (0 for none).
    NewestCol { seq = "COALESCE(MAX(last_seq), 0)" }
}

columns! {
    /// The outbox events of one minute: how many, and the first one's time.
    MinuteCol { minute = "e.created_at / 60000000", events = "COUNT(*)", first_at = "MIN(e.created_at)" }
}

columns! {
    /// How many jobs are in a state.
    StateCountCol { state, jobs = "COUNT(*)" }
}

columns! {
    /// How many ledger entries are of a kind.
    KindCountCol { kind, entries = "COUNT(*)" }
}

columns! {
    /// A row of the action log.
    ActionCol { id, at, actor, action, job_id, account_id, detail }
}

pub(crate) async fn overview(db: &mut Db<'_>, now: Timestamp, since: Timestamp) -> Result<Overview, StoreError> {
    static JOBS: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM jobs GROUP BY kind, state ORDER BY kind, state", KindStateCol::LIST));
    static DUE: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM jobs WHERE state = 'queued' AND cancel_requested = 0 AND not_before <= $1",
            CountCol::LIST
        )
    });
    static NEWEST: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM stamp_numbers", NewestCol::LIST));
    // Counted by the engine, a row per minute (times are positive, so `/` is a floor).
    static PER_MINUTE: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM {} WHERE n.last_seq > $1 AND e.pos > $1 - n.first_seq + 1 GROUP BY e.created_at / 60000000",
            MinuteCol::LIST,
            crate::ops::EVENTS
        )
    });
    let mut out = Overview::default();
    for r in db.all(&JOBS, args![]).await? {
        use KindStateCol as C;
        out.jobs.push((r.text(C::kind)?, name(JobState::parse, "job state", r.text(C::state)?)?, r.i64(C::jobs)?));
    }
    out.due = db.one(&DUE, args![now.micros()]).await?.i64(CountCol::count)?;
    // The newest events by sequence (commit order), counted per minute back to `since`.
    let newest = db.one(&NEWEST, args![]).await?.i64(NewestCol::seq)?;
    let from = (newest - OVERVIEW_EVENTS_MAX).max(0);
    let minute = 60_000_000;
    let first_minute = since.micros().div_euclid(minute);
    let minutes = (now.micros().div_euclid(minute) - first_minute + 1).clamp(1, 24 * 60) as usize;
    let mut counts = vec![0i64; minutes];
    let mut oldest_seen = i64::MAX;
    for r in &db.all(&PER_MINUTE, args![from]).await? {
        let (m, n) = (r.i64(MinuteCol::minute)? - first_minute, r.i64(MinuteCol::events)?);
        oldest_seen = oldest_seen.min(r.i64(MinuteCol::first_at)?);
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

columns! {
    /// One kind's queue: every job of the kind gives the kind a row (zero when none waits, so a
    /// drained queue reads 0, not its last depth), how many are queued, how many of those are due
    /// now (claimable: no cancel asked, `not_before` passed) and since when the oldest due one has
    /// been due.
    QueueCol {
        kind,
        queued = "CAST(SUM(CASE WHEN state = 'queued' THEN 1 ELSE 0 END) AS BIGINT)",
        due = "CAST(SUM(CASE WHEN state = 'queued' AND cancel_requested = 0 AND not_before <= $1 THEN 1 ELSE 0 END) AS BIGINT)",
        oldest_due = "MIN(CASE WHEN state = 'queued' AND cancel_requested = 0 AND not_before <= $1 THEN not_before END)"
    }
}

/// One queue's row (a kind's, or a priority's in the `kind` column).
fn kind_queue(r: &crate::db::Row) -> Result<KindQueue, StoreError> {
    Ok(KindQueue {
        kind: r.text(QueueCol::kind)?,
        queued: r.i64(QueueCol::queued)?,
        due: r.i64(QueueCol::due)?,
        oldest_due_since: r.opt_i64(QueueCol::oldest_due)?.map(Timestamp::from_micros),
    })
}

pub(crate) async fn stats(db: &mut Db<'_>, now: Timestamp) -> Result<Stats, StoreError> {
    static JOBS: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM jobs GROUP BY state ORDER BY state", StateCountCol::LIST));
    static ENTRIES: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM ledger_entries GROUP BY kind ORDER BY kind", KindCountCol::LIST));
    let jobs_by_state = (db.all(&JOBS, args![]).await?.iter())
        .map(|r| Ok((r.text(StateCountCol::state)?, r.i64(StateCountCol::jobs)?)))
        .collect::<Result<_, StoreError>>()?;
    let entries_by_kind = (db.all(&ENTRIES, args![]).await?.iter())
        .map(|r| Ok((r.text(KindCountCol::kind)?, r.i64(KindCountCol::entries)?)))
        .collect::<Result<_, StoreError>>()?;
    static QUEUES: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM jobs GROUP BY kind ORDER BY kind", QueueCol::LIST));
    let queues =
        (db.all(&QUEUES, args![now.micros()]).await?.iter()).map(kind_queue).collect::<Result<_, StoreError>>()?;
    // By priority, the queued jobs only (the partial indexes hold them; a priority with none
    // queued is not listed).
    static PRIORITIES: LazyLock<String> = LazyLock::new(|| {
        let list = QueueCol::list_with(QueueCol::kind, "CAST(CAST(priority AS bigint) AS text)");
        format!("SELECT {list} FROM jobs WHERE state = 'queued' GROUP BY priority ORDER BY priority")
    });
    let priorities =
        (db.all(&PRIORITIES, args![now.micros()]).await?.iter()).map(kind_queue).collect::<Result<_, StoreError>>()?;
    Ok(Stats { jobs_by_state, entries_by_kind, queues, priorities, tx_retries: 0 })
}

/// The admin actions on a job (`job`) or an account (`account`), oldest first.
pub(crate) async fn actions(
    db: &mut Db<'_>,
    job: Option<&str>,
    account: Option<&str>,
) -> Result<Vec<crate::model::Action>, StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM actions WHERE (CAST($1 AS TEXT) IS NULL OR job_id = $1) \
             AND (CAST($2 AS TEXT) IS NULL OR account_id = $2) ORDER BY id LIMIT 1000",
            ActionCol::LIST
        )
    });
    let rows = db.all(&SQL, args![job, account]).await?;
    rows.iter()
        .map(|r| {
            use ActionCol as C;
            Ok(crate::model::Action {
                id: r.i64(C::id)?,
                at: Timestamp::from_micros(r.i64(C::at)?),
                actor: r.text(C::actor)?,
                action: name(crate::model::ActionKind::parse_stored, "action", r.text(C::action)?)?,
                job_id: r.opt_text(C::job_id)?,
                account_id: r.opt_text(C::account_id)?,
                detail: r.text(C::detail)?,
            })
        })
        .collect()
}
