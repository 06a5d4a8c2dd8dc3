//! Lines and turns (docs/design/fair-claims.md §4): a queued job due to run is **lined** — it holds a
//! `turn` in its line, `(priority, kind, requires)` — or **waiting** (`turn` NULL: not due yet, or
//! back in `queued` after a claim, which clears the turn). A claim takes the lowest `(turn, job_seq)`
//! of a line its worker can take; a job's turn is derived from the jobs lined now (its line's front,
//! or one past its account's last turn there), so one account's burst holds one turn per job while
//! another account's next job starts at the front. Nothing here is shared between transactions but
//! the job rows: the lines with work are found from the `jobs_line` index itself.

use crate::db::{Db, Engine, Value, args, columns};
use crate::error::StoreError;
use settle_core::Timestamp;
use settle_core::ids::Labels;
use settle_core::job;
use std::collections::HashMap;
use std::sync::LazyLock;

/// One line: what one worker can take at one priority.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) struct LineKey {
    pub priority: i64,
    pub kind: String,
    /// `Labels::text`.
    pub requires: String,
}

/// How old the list of lines may be before a claim reads it again (µs of the store's clock).
const LINES_FRESH_MICROS: i64 = 25_000;
/// How often a claiming process lines up due waiting jobs even when its claims find work.
const LINE_UP_EVERY_MICROS: i64 = 100_000;
/// How often a process writes that a worker label set claimed.
const LABELS_SEEN_EVERY_MICROS: i64 = 60_000_000;
/// Most jobs one line-up statement lines.
const LINE_UP_MAX: i64 = 256;
/// Most lines one read takes (a bound on a claim's work, whatever the data): more lines than this
/// are read a page at a time, one page per refresh, every line seen within a few refreshes.
const LINES_MAX: usize = 1_000;
/// The advisory lock (PostgreSQL's two-key form, Settle's class) one line-up at a time holds:
/// two at once would each give one account the same next turns.
const LINE_UP_LOCK: (i32, i32) = (0x5e77, 44);

/// A store's view of its lines, kept by the process between claims: the lines that had lined jobs
/// when last read, and the order this process last served each (a worker that can take several
/// lines takes them in turn).
#[derive(Debug, Default)]
pub(crate) struct Lines {
    known: Vec<LineKey>,
    /// Where the next page starts, when the last read stopped at `LINES_MAX`.
    page_after: Option<LineKey>,
    read_at: Option<i64>,
    lined_up_at: Option<i64>,
    served: HashMap<LineKey, u64>,
    serves: u64,
    /// When this process last wrote each worker label set's `last_seen`.
    labels_seen: HashMap<String, i64>,
    /// Where this process's next unpark pass starts (an account id; empty: the first).
    pub unpark_after: String,
}

impl Lines {
    pub fn is_fresh(&self, now: Timestamp) -> bool {
        self.read_at.is_some_and(|at| now.micros() - at < LINES_FRESH_MICROS && now.micros() >= at)
    }

    /// Where the next read starts (`None`: the first line).
    pub fn page_after(&self) -> Option<&LineKey> {
        self.page_after.as_ref()
    }

    /// A page of lines read after `page_after`, in key order: the known lines of the range it
    /// covers are replaced by it (a full page covers up to its last line, a short one to the end),
    /// the others kept until their page is read.
    pub fn replace(&mut self, now: Timestamp, mut page: Vec<LineKey>) {
        page.sort();
        page.dedup();
        let from = self.page_after.take();
        let full = page.len() >= LINES_MAX;
        let to = if full { page.last().cloned() } else { None };
        self.known.retain(|l| from.as_ref().is_some_and(|f| l <= f) || to.as_ref().is_some_and(|t| l > t));
        self.known.extend(page);
        self.known.sort();
        self.known.dedup();
        self.page_after = to;
        self.read_at = Some(now.micros());
    }

    /// A line this process has just put a job in.
    pub fn add(&mut self, line: LineKey) {
        if let Err(at) = self.known.binary_search(&line) {
            self.known.insert(at, line);
        }
    }

    /// Whether this process should line up due waiting jobs now, even with work in its lines.
    pub fn line_up_due(&self, now: Timestamp) -> bool {
        self.lined_up_at.is_none_or(|at| now.micros() - at >= LINE_UP_EVERY_MICROS || now.micros() < at)
    }

    pub fn lined_up(&mut self, now: Timestamp) {
        self.lined_up_at = Some(now.micros());
    }

    /// Whether a claim with these labels should write their `last_seen` (once a minute per set).
    pub fn labels_due(&mut self, labels: &str, now: Timestamp) -> bool {
        let due = self
            .labels_seen
            .get(labels)
            .is_none_or(|at| now.micros() - at >= LABELS_SEEN_EVERY_MICROS || now.micros() < *at);
        if due {
            self.labels_seen.insert(labels.to_owned(), now.micros());
        }
        due
    }

    pub fn served(&mut self, line: &LineKey) {
        self.serves += 1;
        self.served.insert(line.clone(), self.serves);
    }

    /// The lines a claim may take from, in the order to try: lowest priority number first, then
    /// the line this process served longest ago (never: first), then the line's key.
    pub fn for_claim(&self, kinds: &[settle_core::ids::JobKind], labels: &Labels) -> Vec<LineKey> {
        let mut lines: Vec<&LineKey> = (self.known.iter())
            .filter(|l| match kinds.is_empty() {
                true => !job::Rail::of(&l.kind).is_reserved(),
                false => kinds.iter().any(|k| k.as_str() == l.kind),
            })
            .filter(|l| Labels::stored(&l.requires).covered_by(labels))
            .collect();
        lines.sort_by_key(|l| (l.priority, self.served.get(*l).copied().unwrap_or(0), (*l).clone()));
        lines.into_iter().cloned().collect()
    }
}

columns! {
    /// A line's key.
    LineCol { priority, kind, requires }
}

fn line_key(r: &crate::db::Row) -> Result<LineKey, StoreError> {
    Ok(LineKey {
        priority: r.i64(LineCol::priority)?,
        kind: r.text(LineCol::kind)?,
        requires: r.text(LineCol::requires)?,
    })
}

/// Lined jobs, the index's predicate.
const LINED: &str = "state = 'queued' AND turn IS NOT NULL";

/// PostgreSQL: every line with lined jobs, one index probe each (a skip scan of `jobs_line`).
static LINES_PG: LazyLock<String> = LazyLock::new(|| {
    format!(
        "WITH RECURSIVE l AS (\
           (SELECT priority, kind, requires FROM jobs WHERE {LINED} \
            AND (priority, kind, requires) > ($1::bigint, $2::text, $3::text) \
            ORDER BY priority, kind, requires LIMIT 1) \
           UNION ALL \
           SELECT n.priority, n.kind, n.requires FROM l CROSS JOIN LATERAL \
             (SELECT priority, kind, requires FROM jobs WHERE {LINED} \
              AND (priority, kind, requires) > (l.priority, l.kind, l.requires) \
              ORDER BY priority, kind, requires LIMIT 1) n) \
         SELECT CAST(priority AS bigint) AS priority, kind, requires FROM l LIMIT {LINES_MAX}"
    )
});

/// SQLite: the next line after one, the same skip scan a probe at a time (in process, no round
/// trip). Three seeks, not one row-value comparison: SQLite seeks `(priority, kind, requires) > (…)`
/// by its first column and walks every entry of the line it starts in (195 ms past a line of a
/// million jobs); each of these seeks past its equal prefix.
static NEXT_LINE_SQLITE: LazyLock<String> = LazyLock::new(|| {
    let from = format!("FROM jobs INDEXED BY jobs_line WHERE {LINED}");
    format!(
        "SELECT * FROM (SELECT priority, kind, requires {from} AND priority = $1 AND kind = $2 AND requires > $3 \
                        ORDER BY requires LIMIT 1) \
         UNION ALL SELECT * FROM (SELECT priority, kind, requires {from} AND priority = $1 AND kind > $2 \
                        ORDER BY kind, requires LIMIT 1) \
         UNION ALL SELECT * FROM (SELECT priority, kind, requires {from} AND priority > $1 \
                        ORDER BY priority, kind, requires LIMIT 1) \
         LIMIT 1"
    )
});

/// The lines that have lined jobs after `after` (all: `None`), in key order, at most `LINES_MAX`.
pub(crate) async fn active_lines(db: &mut Db<'_>, after: Option<&LineKey>) -> Result<Vec<LineKey>, StoreError> {
    let first = LineKey { priority: -1, kind: String::new(), requires: String::new() };
    let after = after.unwrap_or(&first);
    match db.engine() {
        Engine::Postgres => {
            let args = [Value::from(after.priority), after.kind.as_str().into(), after.requires.as_str().into()];
            db.all(&LINES_PG, &args).await?.iter().map(line_key).collect()
        }
        Engine::Sqlite => {
            let mut lines = Vec::new();
            let mut after = after.clone();
            while lines.len() < LINES_MAX {
                let args = [Value::from(after.priority), after.kind.as_str().into(), after.requires.as_str().into()];
                let Some(row) = db.opt(&NEXT_LINE_SQLITE, &args).await? else { break };
                after = line_key(&row)?;
                lines.push(after.clone());
            }
            Ok(lines)
        }
    }
}

/// The turn of each job a line-up lines, from its group's base (the line's front, or one past its
/// account's last turn there) and its place in the group; `$1` now, `$2` the most to line.
/// The UPDATE finds its rows by id (`IN`), never by joining `jobs` to them: SQLite would walk
/// every queued job to join, and with the guard `{GUARD}` in its WHERE it would still walk them
/// (by `jobs_due` until migration 0033), so SQLite — one writer: nothing can move the rows it just read — writes unguarded;
/// PostgreSQL guards the rows it locked. `{LOCK}`: PostgreSQL's `FOR UPDATE SKIP LOCKED` (a job another transaction holds is lined by a
/// later line-up), nothing on SQLite; `{GREATEST}` the engine's two-argument maximum.
const LINE_UP: &str = "\
    WITH {ONE_AT_A_TIME} w AS (SELECT id, priority, kind, requires, account_id, not_before, job_seq FROM jobs {WAITING} \
               WHERE state = 'queued' AND turn IS NULL AND parked = 0 AND {NOT_RESERVED} AND not_before <= $1 {ALONE} \
               ORDER BY not_before, job_seq LIMIT $2 {LOCK}), \
    g AS (SELECT priority, kind, requires, account_id, {GREATEST}(\
            COALESCE((SELECT x.turn FROM jobs x WHERE x.priority = d.priority AND x.kind = d.kind \
                      AND x.requires = d.requires AND x.state = 'queued' AND x.turn IS NOT NULL \
                      ORDER BY x.turn LIMIT 1), 0), \
            COALESCE((SELECT MAX(x.turn) + 1 FROM jobs x WHERE x.priority = d.priority AND x.kind = d.kind \
                      AND x.requires = d.requires AND x.account_id = d.account_id AND x.state = 'queued' \
                      AND x.turn IS NOT NULL), 0)) AS base \
          FROM (SELECT DISTINCT priority, kind, requires, account_id FROM w) d), \
    r AS (SELECT w.id, g.base + ROW_NUMBER() OVER (PARTITION BY w.priority, w.kind, w.requires, w.account_id \
                                                   ORDER BY w.not_before, w.job_seq) - 1 AS turn \
          FROM w JOIN g ON g.priority = w.priority AND g.kind = w.kind AND g.requires = w.requires \
                        AND g.account_id = w.account_id) \
    UPDATE jobs SET turn = (SELECT r.turn FROM r WHERE r.id = jobs.id) \
    WHERE jobs.id IN (SELECT r.id FROM r) {GUARD} \
    RETURNING {PRIORITY}, {KIND}, {REQUIRES}";

static LINE_UP_PG: LazyLock<String> = LazyLock::new(|| {
    let (class, key) = LINE_UP_LOCK;
    LINE_UP
        .replace(
            "{ONE_AT_A_TIME}",
            &format!("alone AS MATERIALIZED (SELECT pg_try_advisory_xact_lock({class}, {key}) AS ok),"),
        )
        .replace("{ALONE}", "AND (SELECT ok FROM alone)")
        .replace("{WAITING}", "")
        .replace("{GUARD}", "AND jobs.state = 'queued' AND jobs.turn IS NULL AND jobs.parked = 0")
        .replace("{NOT_RESERVED}", &job::not_reserved("kind"))
        .replace("{LOCK}", "FOR UPDATE SKIP LOCKED")
        .replace("{GREATEST}", "GREATEST")
        .replace("{PRIORITY}", "CAST(jobs.priority AS bigint) AS priority")
        .replace("{KIND}", "jobs.kind")
        .replace("{REQUIRES}", "jobs.requires")
});
static LINE_UP_SQLITE: LazyLock<String> = LazyLock::new(|| {
    LINE_UP
        .replace("{ONE_AT_A_TIME}", "")
        .replace("{ALONE}", "")
        // Without statistics SQLite would walk every queued job (by `jobs_due` until migration 0033): named.
        .replace("{WAITING}", "INDEXED BY jobs_waiting_unparked")
        .replace("{GUARD}", "")
        .replace("{NOT_RESERVED}", &job::not_reserved("kind"))
        .replace("{LOCK}", "")
        .replace("{GREATEST}", "MAX")
        .replace("{PRIORITY}", "priority")
        .replace("{KIND}", "kind")
        .replace("{REQUIRES}", "requires")
});

/// Lines up to `LINE_UP_MAX` waiting jobs that are due, oldest due first; the lines they joined.
pub(crate) async fn line_up(db: &mut Db<'_>, now: Timestamp) -> Result<Vec<LineKey>, StoreError> {
    let sql = match db.engine() {
        Engine::Postgres => &*LINE_UP_PG,
        Engine::Sqlite => &*LINE_UP_SQLITE,
    };
    let mut lines: Vec<LineKey> =
        db.all(sql, args![now.micros(), LINE_UP_MAX]).await?.iter().map(line_key).collect::<Result<_, _>>()?;
    lines.sort();
    lines.dedup();
    Ok(lines)
}

/// Notes that a worker claimed with `labels` now (`worker_labels`).
pub(crate) async fn labels_seen(db: &mut Db<'_>, labels: &str, now: Timestamp) -> Result<(), StoreError> {
    static SQL: LazyLock<[String; 2]> = LazyLock::new(|| {
        let sql = |g: &str| {
            format!(
                "INSERT INTO worker_labels (labels, last_seen) VALUES ($1, $2) ON CONFLICT (labels) \
                 DO UPDATE SET last_seen = {g}(worker_labels.last_seen, excluded.last_seen)"
            )
        };
        [sql("MAX"), sql("GREATEST")]
    });
    let sql = match db.engine() {
        Engine::Sqlite => &SQL[0],
        Engine::Postgres => &SQL[1],
    };
    db.exec(sql, args![labels, now.micros()]).await?;
    Ok(())
}

/// The label sets workers claimed with since `since`.
pub(crate) async fn labels_seen_since(db: &mut Db<'_>, since: Timestamp) -> Result<Vec<Labels>, StoreError> {
    columns! {
        /// A worker label set.
        SeenCol { labels }
    }
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM worker_labels WHERE last_seen >= $1 ORDER BY labels", SeenCol::LIST));
    db.all(&SQL, args![since.micros()]).await?.iter().map(|r| Ok(Labels::stored(&r.text(SeenCol::labels)?))).collect()
}
