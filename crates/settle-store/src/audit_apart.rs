//! The audit's checks that read only tables of their own: withdrawals beside their jobs (L3, L6),
//! the event numbers and each event's and logged signal's job. They need neither of the audit's
//! passes, so they can run on one connection of the audit's snapshot while the other reads the
//! allocations (docs/design/audit-checkpoints.md §9). From a checkpoint (decision 0040), the event
//! checks read only the events numbered after it and those still waiting for their numbers: the
//! checkpoint's audit proved the others, as it proved the ledger's lines before it.

use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::{Invariant, Violation};
use std::sync::LazyLock;

pub(crate) fn v(
    invariant: Invariant,
    account: Option<&str>,
    job: Option<&str>,
    item: Option<&str>,
    message: String,
) -> Violation {
    Violation {
        invariant,
        account_id: account.map(str::to_owned),
        job_id: job.map(str::to_owned),
        item_id: item.map(str::to_owned),
        message,
    }
}

columns! {
    /// The `outbox` counter: the last event number given.
    CounterRow { value }
}

columns! {
    /// How many rows matched.
    HowManyRow { count = "COUNT(*)" }
}

columns! {
    /// A numbered stamp, and the places of its events.
    StampRow {
        stamp = "n.stamp", first_seq = "n.first_seq", last_seq = "n.last_seq", events = "COUNT(e.pos)",
        first_pos = "MIN(e.pos)", last_pos = "MAX(e.pos)",
    }
}

columns! {
    /// An event filed under a job it is not: its number (none while it waits for one), the job it
    /// names, the number it carries, and that job's number (none: no such job).
    MisfiledRow {
        seq = "n.first_seq + e.pos - 1", account_id = "e.account_id", job_id = "e.job_id", job_seq = "e.job_seq",
        jobs_seq = "j.job_seq",
    }
}

columns! {
    /// A logged signal filed under a job it is not: its row, the job it names, the number it
    /// carries, and that job's number (none: no such job).
    MisfiledSignalRow { id = "s.id", job_id = "s.job_id", job_seq = "s.job_seq", jobs_seq = "j.job_seq", account_id = "j.account_id" }
}

columns! {
    /// A withdrawal job beside its `withdrawals` row, and how many of its items were not returned.
    WithdrawalRow {
        job_id = "j.id", account_id = "j.account_id", kind = "j.kind", state = "j.state", cost = "j.cost", amount = "w.amount",
        returned_at = "w.returned_at", cash_after = "w.cash_after", debt_after = "w.debt_after",
        not_returned = "(SELECT COUNT(*) FROM items i WHERE i.job_id = j.id AND i.state <> 'returned')",
    }
}

/// What these checks found, each check's findings apart, so the report lists them where the audit
/// has always listed them.
#[derive(Default)]
pub(crate) struct Apart {
    pub withdrawals: Vec<Violation>,
    /// The event numbers, the events' jobs, the logged signals' jobs.
    pub feed: Vec<Violation>,
}

impl Apart {
    /// Every check; `after`: from a checkpoint, the last event number it proved.
    pub(crate) async fn run(db: &mut Db<'_>, after: Option<i64>) -> Result<Apart, StoreError> {
        let mut apart = Apart::default();
        withdrawals(db, &mut apart.withdrawals).await?;
        outbox(db, after, &mut apart.feed).await?;
        events_filed(db, after, &mut apart.feed).await?;
        signals_filed(db, &mut apart.feed).await?;
        Ok(apart)
    }
}

/// The withdrawals check's statement (plan-tested).
pub(crate) static WITHDRAWALS: LazyLock<String> = LazyLock::new(|| {
    // The withdrawal jobs by `jobs_rail` (its predicate is implied by the kind: both engines
    // read only those), then the rows beside a job of another kind: with an OR across the
    // join PostgreSQL read every job (0.12 s of 100,000 jobs, measured).
    format!(
        "SELECT {list} FROM jobs j LEFT JOIN withdrawals w ON w.job_id = j.id WHERE j.kind = 'withdrawal' \
         UNION ALL SELECT {list} FROM withdrawals w JOIN jobs j ON j.id = w.job_id WHERE j.kind <> 'withdrawal' \
         ORDER BY 1",
        list = WithdrawalRow::LIST
    )
});

/// Withdrawals: one row per withdrawal job, holding exactly the job's cost; `returned` exactly
/// when the return was recorded.
async fn withdrawals(db: &mut Db<'_>, found: &mut Vec<Violation>) -> Result<(), StoreError> {
    for r in &db.all(&WITHDRAWALS, args![]).await? {
        use WithdrawalRow as C;
        let (job, kind, state, cost) = (r.text(C::job_id)?, r.text(C::kind)?, r.text(C::state)?, r.i64(C::cost)?);
        let (amount, returned_at) = (r.opt_i64(C::amount)?, r.opt_i64(C::returned_at)?);
        let not_returned = r.i64(C::not_returned)?;
        let problem = if kind != settle_core::job::WITHDRAWAL_KIND || amount.is_none() {
            Some("a withdrawal row and a withdrawal job come together".to_owned())
        } else if amount != Some(cost) {
            Some(format!("withdrawal amount {amount:?} but the job holds {cost}"))
        } else if (state == "returned") != returned_at.is_some() {
            Some(format!("state {state} but returned_at {returned_at:?}"))
        } else if state == "returned" && not_returned > 0 {
            Some(format!("returned, but {not_returned} item(s) were not credited back"))
        } else {
            None
        };
        if let Some(message) = problem {
            found.push(v(Invariant::L3, None, Some(&job), None, message));
        }
        // L6, the cash rule: recorded by the withdrawal's own transaction (NULL before migration 19).
        if let (Some(cash), Some(debt)) = (r.opt_i64(C::cash_after)?, r.opt_i64(C::debt_after)?)
            && cash < debt
        {
            let message = format!(
                "the withdrawal left {cash} of never-expiring credit against a debt of {debt}: the overdraft left as cash"
            );
            let account = r.text(C::account_id)?;
            found.push(v(Invariant::L6, Some(&account), Some(&job), None, message));
        }
    }
    Ok(())
}

/// The event numbers, gap-free: each numbered stamp begins where the one before it ended, and
/// holds its events at places 1 ..= its count; no event is neither numbered nor waiting for its
/// number; every webhook delivery names a numbered event (docs/design/batch-plan.md §4a).
/// `after`: from a checkpoint, the last event number it proved: the stamps numbered after it, the
/// first beginning at the number after it.
async fn outbox(db: &mut Db<'_>, after: Option<i64>, found: &mut Vec<Violation>) -> Result<(), StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM stamp_numbers n LEFT JOIN events e ON e.stamp = n.stamp WHERE n.last_seq > $1 \
             GROUP BY n.stamp, n.first_seq, n.last_seq ORDER BY n.first_seq",
            StampRow::LIST
        )
    });
    static UNNUMBERED: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM events e WHERE NOT EXISTS (SELECT 1 FROM stamp_numbers n WHERE n.stamp = e.stamp) \
             AND NOT EXISTS (SELECT 1 FROM stamps_pending p WHERE p.stamp = e.stamp)",
            HowManyRow::LIST
        )
    });
    static DELIVERIES: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM webhook_deliveries \
             WHERE event_seq < 1 OR event_seq > (SELECT COALESCE(MAX(last_seq), 0) FROM stamp_numbers)",
            HowManyRow::LIST
        )
    });
    let mut expected = after.unwrap_or(0) + 1;
    db.each(&SQL, args![expected - 1], |r| {
        use StampRow as C;
        let (stamp, first, last) = (r.i64(C::stamp)?, r.i64(C::first_seq)?, r.i64(C::last_seq)?);
        if first != expected {
            found.push(v(Invariant::Seq, None, None, None, format!("event {first} follows {}", expected - 1)));
        }
        let (events, low, high) = (r.i64(C::events)?, r.opt_i64(C::first_pos)?, r.opt_i64(C::last_pos)?);
        if events != last - first + 1 || low != Some(1) || high != Some(events) {
            let message = format!("stamp {stamp} numbers events {first}..={last} but holds {events} events");
            found.push(v(Invariant::Seq, None, None, None, message));
        }
        expected = last + 1;
        Ok(())
    })
    .await?;
    let unnumbered = db.one(&UNNUMBERED, args![]).await?.i64(HowManyRow::count)?;
    if unnumbered > 0 {
        let message = format!("{unnumbered} events are neither numbered nor waiting for their numbers");
        found.push(v(Invariant::Seq, None, None, None, message));
    }
    let deliveries = db.one(&DELIVERIES, args![]).await?.i64(HowManyRow::count)?;
    if deliveries > 0 {
        found.push(v(Invariant::Seq, None, None, None, format!("{deliveries} webhook deliveries name no event")));
    }
    let counter = db.one("SELECT value FROM counters WHERE name = 'outbox'", args![]).await?.i64(CounterRow::value)?;
    if counter != expected - 1 {
        let message = format!("the outbox counter is at {counter} but the last event is {}", expected - 1);
        found.push(v(Invariant::Seq, None, None, None, message));
    }
    Ok(())
}

/// Every event that names a job names one that exists, and the `job_seq` it carries (migration
/// 0035: its job's number, read from the job's row by the INSERT) is that job's; an account's
/// event carries none. A wrong one (a hand edit, a copy from a bad source) would file the event
/// under another job's history. The first 100 are named, in number order (those waiting for
/// their numbers last). Joins, not a correlated lookup per event: PostgreSQL hashes `jobs` once.
/// `after`: from a checkpoint, the last event number it proved: only the events of stamps numbered
/// after it or waiting for their numbers (an event neither numbered nor waiting is already the
/// outbox check's finding), each stamp's events by the events' key.
async fn events_filed(db: &mut Db<'_>, after: Option<i64>, found: &mut Vec<Violation>) -> Result<(), StoreError> {
    const MISFILED: &str = "(e.job_id IS NULL AND e.job_seq IS NOT NULL) OR (e.job_id IS NOT NULL AND j.id IS NULL) \
         OR e.job_seq <> j.job_seq";
    const ORDER: &str =
        "ORDER BY CASE WHEN n.stamp IS NULL THEN 1 ELSE 0 END, n.first_seq + e.pos - 1, e.stamp, e.pos LIMIT 100";
    static ALL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM events e LEFT JOIN jobs j ON j.id = e.job_id LEFT JOIN stamp_numbers n ON n.stamp = e.stamp \
             WHERE {MISFILED} {ORDER}",
            MisfiledRow::LIST
        )
    });
    static AFTER: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM (SELECT stamp FROM stamp_numbers WHERE last_seq > $1 UNION SELECT stamp FROM stamps_pending) s \
             JOIN events e ON e.stamp = s.stamp LEFT JOIN jobs j ON j.id = e.job_id \
             LEFT JOIN stamp_numbers n ON n.stamp = e.stamp WHERE {MISFILED} {ORDER}",
            MisfiledRow::LIST
        )
    });
    let rows = match after {
        None => db.all(&ALL, args![]).await?,
        Some(after) => db.all(&AFTER, args![after]).await?,
    };
    for r in rows {
        use MisfiledRow as C;
        let event = match r.opt_i64(C::seq)? {
            Some(seq) => format!("event {seq}"),
            None => "an event waiting for its number".to_owned(),
        };
        let (job, job_seq, jobs_seq) = (r.opt_text(C::job_id)?, r.opt_i64(C::job_seq)?, r.opt_i64(C::jobs_seq)?);
        let message = match (&job, job_seq, jobs_seq) {
            (None, Some(n), _) => format!("{event} names no job but carries job_seq {n}"),
            (Some(id), _, None) => format!("{event} names job {id}, which does not exist"),
            (Some(id), Some(n), Some(m)) => format!("{event} names job {id} (job_seq {m}) but carries job_seq {n}"),
            _ => format!("{event} is filed under a job it is not"),
        };
        let account = r.text(C::account_id)?;
        found.push(v(Invariant::Seq, Some(&account), job.as_deref(), None, message));
    }
    Ok(())
}

/// Every logged signal names a job that exists and carries that job's number (migration 0036)
/// or none (logged before it, or by a process of 0.1.0); the first 100 that do not are named.
/// Sorted by an expression no index gives (`s.id + 0`), so PostgreSQL joins the tables whole
/// rather than walking the key and probing `jobs` for every signal of a clean store.
async fn signals_filed(db: &mut Db<'_>, found: &mut Vec<Violation>) -> Result<(), StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM signals s LEFT JOIN jobs j ON j.id = s.job_id \
             WHERE j.id IS NULL OR s.job_seq <> j.job_seq ORDER BY s.id + 0 LIMIT 100",
            MisfiledSignalRow::LIST
        )
    });
    for r in db.all(&SQL, args![]).await? {
        use MisfiledSignalRow as C;
        let (id, job) = (r.i64(C::id)?, r.text(C::job_id)?);
        let message = match (r.opt_i64(C::job_seq)?, r.opt_i64(C::jobs_seq)?) {
            (_, None) => format!("logged signal {id} names job {job}, which does not exist"),
            (n, Some(m)) => format!("logged signal {id} names job {job} (job_seq {m}) but carries job_seq {n:?}"),
        };
        let account = r.opt_text(C::account_id)?;
        found.push(v(Invariant::Seq, account.as_deref(), Some(&job), None, message));
    }
    Ok(())
}
