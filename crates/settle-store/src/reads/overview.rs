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
    /// How many jobs of a kind are in a state, and how many of them are due (queued, no cancel
    /// asked, `not_before` passed: `$1`).
    KindStateCol {
        kind,
        state,
        jobs = "COUNT(*)",
        due = "CAST(SUM(CASE WHEN state = 'queued' AND cancel_requested = 0 AND not_before <= $1 THEN 1 ELSE 0 END) AS BIGINT)",
    }
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
    // One scan of `jobs` counts both: no index holds the queued jobs (migration 0033).
    for r in db.all(&JOBS, args![now.micros()]).await? {
        use KindStateCol as C;
        out.jobs.push((r.text(C::kind)?, name(JobState::parse, "job state", r.text(C::state)?)?, r.i64(C::jobs)?));
        out.due += r.i64(C::due)?;
    }
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
    /// The jobs of one kind, state and priority: how many, how many of them are due now (no
    /// cancel asked, `not_before` passed: `$1`) and since when the oldest due one has been due.
    GroupCol {
        kind,
        state,
        priority = "CAST(priority AS bigint)",
        jobs = "COUNT(*)",
        due = "CAST(SUM(CASE WHEN cancel_requested = 0 AND not_before <= $1 THEN 1 ELSE 0 END) AS BIGINT)",
        oldest_due = "MIN(CASE WHEN cancel_requested = 0 AND not_before <= $1 THEN not_before END)",
    }
}

impl KindQueue {
    /// Adds a group of queued jobs to this queue.
    fn add(&mut self, jobs: i64, due: i64, oldest_due: Option<Timestamp>) {
        self.queued += jobs;
        self.due += due;
        self.oldest_due_since = match (self.oldest_due_since, oldest_due) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
    }
}

pub(crate) async fn stats(db: &mut Db<'_>, now: Timestamp) -> Result<Stats, StoreError> {
    // One scan of `jobs` gives the counts by state, every kind's queue (a row for every kind the
    // store has jobs of, zero when none waits, so a drained queue reads 0, not its last depth)
    // and the queue by priority (only priorities some queued job has): no index holds the queued
    // jobs (migration 0033).
    static GROUPS: LazyLock<String> = LazyLock::new(|| {
        format!("SELECT {} FROM jobs GROUP BY kind, state, priority ORDER BY kind, state, priority", GroupCol::LIST)
    });
    static ENTRIES: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM ledger_entries GROUP BY kind ORDER BY kind", KindCountCol::LIST));
    let mut by_state = std::collections::BTreeMap::<String, i64>::new();
    let mut queues: Vec<KindQueue> = Vec::new();
    let mut priorities = std::collections::BTreeMap::<i64, KindQueue>::new();
    for r in &db.all(&GROUPS, args![now.micros()]).await? {
        use GroupCol as C;
        let (kind, state, jobs) = (r.text(C::kind)?, r.text(C::state)?, r.i64(C::jobs)?);
        let (due, oldest_due) = (r.i64(C::due)?, r.opt_i64(C::oldest_due)?.map(Timestamp::from_micros));
        if queues.last().is_none_or(|q| q.kind != kind) {
            queues.push(KindQueue { kind: kind.clone(), queued: 0, due: 0, oldest_due_since: None });
        }
        if state == JobState::Queued.as_str() {
            let priority = r.i64(C::priority)?;
            let empty = KindQueue { kind: priority.to_string(), queued: 0, due: 0, oldest_due_since: None };
            priorities.entry(priority).or_insert(empty).add(jobs, due, oldest_due);
            queues.last_mut().expect("pushed above").add(jobs, due, oldest_due);
        }
        *by_state.entry(state).or_default() += jobs;
    }
    let entries_by_kind = (db.all(&ENTRIES, args![]).await?.iter())
        .map(|r| Ok((r.text(KindCountCol::kind)?, r.i64(KindCountCol::entries)?)))
        .collect::<Result<_, StoreError>>()?;
    Ok(Stats {
        jobs_by_state: by_state.into_iter().collect(),
        entries_by_kind,
        queues,
        priorities: priorities.into_values().collect(),
        tx_retries: 0,
    })
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
