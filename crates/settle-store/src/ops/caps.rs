//! Caps (docs/design/fair-claims.md §9–§10): `max_running` on an account and on a job kind. A
//! worker's claim takes a line's next job in one statement when neither its account nor its kind
//! is capped; a capped candidate — locked by that statement, not moved — is decided alone: one
//! claimer per capped scope at a time (a transaction-scoped advisory try-lock, never a wait), its
//! running jobs counted in the guarded UPDATE that claims it (a statement after the lock, so it sees
//! every earlier holder's commit). An account at its cap has its lined jobs of the line parked
//! (`parked = 1`: queued, neither lined nor waiting); the unpark pass lets them wait again once the
//! account is below its cap. The cap itself cannot change while a claim runs: every PostgreSQL
//! write transaction holds the cap gate shared, a cap change holds it exclusive.

use super::lines::LineKey;
use crate::db::{Db, Engine, Row, Value, args, columns};
use crate::error::StoreError;
use settle_core::job;
use std::sync::LazyLock;

/// How many of a line's first jobs a claim with a skip set looks at: the skipped accounts' jobs
/// never make it walk the line.
const WINDOW: i64 = 256;
/// Most lined jobs of one account one park takes out of a line.
const PARK_MAX: i64 = 256;
/// Most parked jobs one unpark pass lets wait again, in all, and most accounts it looks at.
const UNPARK_MAX: i64 = 256;
const UNPARK_ACCOUNTS_MAX: usize = 16;
/// The advisory lock classes of one claimer per capped scope (two-key form, `hashtext` of the id).
const ACCOUNT_LOCK_CLASS: i32 = 0x5e79;
const KIND_LOCK_CLASS: i32 = 0x5e7a;

columns! {
    /// A capped candidate, after the job's columns and the attempts count on PostgreSQL.
    CandidateCol { candidate, candidate_account, candidate_cap }
}

/// A line's next job as the first statement found it.
pub(crate) enum Take {
    /// Claimed: the job's row (PostgreSQL: with its attempts count).
    Claimed(Row),
    /// Its account or kind is capped: locked by this transaction (PostgreSQL), decided by [`decide`].
    Capped(Candidate),
    /// Nothing to take (for this claim) in the line.
    Empty,
}

pub(crate) struct Candidate {
    pub id: String,
    pub account_id: String,
    pub account_cap: Option<i64>,
}

/// What [`decide`] did with a capped candidate.
pub(crate) enum Decision {
    Claimed(Row),
    /// Another claim is deciding for the account (or the kind) now: skip it for this claim.
    AccountBusy,
    KindBusy,
    /// At its cap: the account's lined jobs of the line are parked; skip it.
    AccountFull,
    KindFull,
}

/// The claim's SET, shared by the statements that claim.
const CLAIM_SET: &str = "state = 'running', attempt = attempt + 1, lease_token = $2, lease_expires_at = $3, \
                         lease_worker = $4, lease_seconds = $5, updated_at = $1, turn = NULL, parked = 0";
/// A lined job that may be claimed now.
const CLAIMABLE: &str = "state = 'queued' AND turn IS NOT NULL AND cancel_requested = 0 AND not_before <= $1";

fn qualified(prefix: &str) -> String {
    super::JobCol::LIST.split(", ").map(|c| format!("{prefix}.{c}")).collect::<Vec<_>>().join(", ")
}

/// PostgreSQL's first statement: the line's next job (`$6`–`$8` the line; `$9` 1 when the kind is
/// capped; with a skip set, `$10` the accounts to skip, among the line's first `WINDOW` jobs only),
/// locked; claimed at once, with its attempt, when neither its account nor its kind is capped.
fn take_pg(skip: bool) -> String {
    let line = "priority = $6 AND kind = $7 AND requires = $8";
    let pick = if skip {
        format!(
            "SELECT id, account_id FROM jobs WHERE id IN (SELECT w.id FROM (SELECT id, account_id FROM jobs \
             WHERE {line} AND state = 'queued' AND turn IS NOT NULL ORDER BY turn, job_seq LIMIT {WINDOW}) w \
             WHERE w.account_id <> ALL($10::text[])) AND {CLAIMABLE} ORDER BY turn, job_seq LIMIT 1 \
             FOR UPDATE SKIP LOCKED"
        )
    } else {
        format!(
            "SELECT id, account_id FROM jobs WHERE {line} AND {CLAIMABLE} ORDER BY turn, job_seq LIMIT 1 FOR UPDATE SKIP LOCKED"
        )
    };
    format!(
        "WITH j AS MATERIALIZED ({pick}), \
         a AS MATERIALIZED (SELECT accounts.max_running FROM accounts JOIN j ON accounts.id = j.account_id), \
         c AS (UPDATE jobs SET {CLAIM_SET} FROM j WHERE jobs.id = j.id AND $9 = 0 \
               AND NOT EXISTS (SELECT 1 FROM a WHERE a.max_running IS NOT NULL) \
               AND jobs.state = 'queued' AND jobs.turn IS NOT NULL AND jobs.cancel_requested = 0 \
               AND jobs.not_before <= $1 RETURNING {}), \
         att AS (INSERT INTO attempts (job_id, attempt_no, worker, lease_token, started_at) \
                 SELECT id, attempt, $4, $2, $1 FROM c RETURNING 1) \
         SELECT {}, (SELECT count(*) FROM att) AS attempts, j.id AS candidate, j.account_id AS candidate_account, \
                (SELECT max_running FROM a) AS candidate_cap FROM j LEFT JOIN c ON true",
        qualified("jobs"),
        qualified("c"),
    )
}

/// SQLite's first statement (one writer: nothing moves between it and the claim): the line's next
/// job and its account's cap; `$9` the accounts to skip (JSON), among the line's first `WINDOW`.
fn take_sqlite(skip: bool) -> String {
    let line = "priority = $6 AND kind = $7 AND requires = $8";
    let from = if skip {
        format!(
            "(SELECT id, account_id, turn, job_seq, cancel_requested, not_before, state FROM jobs INDEXED BY jobs_line \
             WHERE {line} AND state = 'queued' AND turn IS NOT NULL ORDER BY turn, job_seq LIMIT {WINDOW}) j \
             WHERE j.account_id NOT IN (SELECT value FROM json_each($9)) AND"
        )
    } else {
        format!("jobs j INDEXED BY jobs_line WHERE {line} AND")
    };
    format!(
        "SELECT j.id AS candidate, j.account_id AS candidate_account, \
                (SELECT a.max_running FROM accounts a WHERE a.id = j.account_id) AS candidate_cap \
         FROM {from} j.state = 'queued' AND j.turn IS NOT NULL AND j.cancel_requested = 0 AND j.not_before <= $1 \
         ORDER BY j.turn, j.job_seq LIMIT 1"
    )
}

static TAKE: LazyLock<[String; 4]> =
    LazyLock::new(|| [take_sqlite(false), take_sqlite(true), take_pg(false), take_pg(true)]);

/// The line's next job for this claim: claimed when uncapped (PostgreSQL, one statement), else the
/// candidate. `base` is the claim's `$1`–`$5`.
pub(crate) async fn take(
    db: &mut Db<'_>,
    line: &LineKey,
    base: &[Value],
    skip: &[String],
    kind_capped: bool,
) -> Result<Take, StoreError> {
    let mut a = base.to_vec();
    a.extend([line.priority.into(), line.kind.as_str().into(), line.requires.as_str().into()]);
    let row = match db.engine() {
        Engine::Postgres => {
            a.push(Value::from(i64::from(kind_capped)));
            if !skip.is_empty() {
                a.push(Value::Texts(skip.to_vec()));
            }
            db.opt(&TAKE[2 + usize::from(!skip.is_empty())], &a).await?
        }
        Engine::Sqlite => {
            if !skip.is_empty() {
                a.push(serde_json::to_string(skip).expect("strings serialize").into());
            }
            db.opt(&TAKE[usize::from(!skip.is_empty())], &a).await?
        }
    };
    let Some(row) = row else { return Ok(Take::Empty) };
    let offset = match db.engine() {
        Engine::Postgres => super::JobCol::COUNT + 1,
        Engine::Sqlite => 0,
    };
    let at = |c: CandidateCol| Shifted(offset, c);
    if db.engine() == Engine::Postgres && row.opt_text(super::JobCol::id)?.is_some() {
        return Ok(Take::Claimed(row));
    }
    let candidate = Candidate {
        id: row.text(at(CandidateCol::candidate))?,
        account_id: row.text(at(CandidateCol::candidate_account))?,
        account_cap: row.opt_i64(at(CandidateCol::candidate_cap))?,
    };
    if db.engine() == Engine::Sqlite && candidate.account_cap.is_none() && !kind_capped {
        // SQLite's uncapped claim: the candidate, by id, with no cap to count.
        return match claim_by_id(db, base, &candidate, None, line, None).await? {
            Some(row) => Ok(Take::Claimed(row)),
            None => Err(StoreError::internal("a candidate SQLite's one writer had just read could not be claimed")),
        };
    }
    Ok(Take::Capped(candidate))
}

/// PostgreSQL's take of several jobs of a line at once (docs/design/fair-claims.md §11), while no
/// account has a cap (one probe of `accounts_capped`): up to `$9` of the line's claimable jobs in
/// `(turn, job_seq)` order, locked, claimed in one UPDATE, the n-th with the n-th token of `$10`,
/// each with its attempt. Rows in pick order, each with the attempts the statement opened; one row
/// of NULL job columns when it claimed none; `capped` 1 when it took none because a cap exists.
static TAKE_MANY_PG: LazyLock<String> = LazyLock::new(|| {
    let line = "priority = $6 AND kind = $7 AND requires = $8";
    // Each job's token by its place in the pick. The UPDATE finds its rows by id (`= ANY`, the
    // primary key): under a generic plan `LIMIT $9` is guessed at a tenth of the line, which a join
    // would meet with a scan of `jobs`.
    let place = "(SELECT ok.k FROM ok WHERE ok.id = jobs.id)";
    let set = CLAIM_SET.replace("lease_token = $2", &format!("lease_token = ($10::text[])[{place}::int]"));
    assert_ne!(set, CLAIM_SET, "the claim's SET names its token");
    format!(
        "WITH capped AS MATERIALIZED (SELECT EXISTS (SELECT 1 FROM accounts WHERE max_running IS NOT NULL) AS yes), \
         j AS MATERIALIZED (SELECT id, turn, job_seq FROM jobs WHERE {line} AND {CLAIMABLE} \
                            AND NOT (SELECT yes FROM capped) \
                            ORDER BY turn, job_seq LIMIT $9 FOR UPDATE SKIP LOCKED), \
         ok AS MATERIALIZED (SELECT id, row_number() OVER (ORDER BY turn, job_seq) AS k FROM j), \
         c AS (UPDATE jobs SET {set} WHERE jobs.id = ANY (ARRAY(SELECT id FROM ok)) \
               AND jobs.state = 'queued' AND jobs.turn IS NOT NULL AND jobs.cancel_requested = 0 \
               AND jobs.not_before <= $1 RETURNING {}, {place} AS k), \
         att AS (INSERT INTO attempts (job_id, attempt_no, worker, lease_token, started_at) \
                 SELECT id, attempt, $4, lease_token, $1 FROM c RETURNING 1) \
         SELECT {}, (SELECT count(*) FROM att) AS attempts, CAST(CASE WHEN capped.yes THEN 1 ELSE 0 END AS bigint) AS capped \
         FROM capped LEFT JOIN c ON true ORDER BY c.k",
        qualified("jobs"),
        qualified("c"),
    )
});

/// [`TAKE_MANY_PG`]'s `capped`, after the job's columns and the attempts count.
#[derive(Clone, Copy)]
struct CappedCol;

impl crate::db::Col for CappedCol {
    fn at(self) -> usize {
        super::JobCol::COUNT + 1
    }
}

/// What [`take_many`] took.
pub(crate) struct Many {
    /// The jobs claimed, in pick order, each row with the attempts count after the job's columns.
    pub rows: Vec<Row>,
    /// None was taken because some account has a cap: the line is for the take of one job.
    pub capped: bool,
}

/// Up to `tokens.len()` of the line's next jobs, claimed in one statement (PostgreSQL, while no
/// account has a cap). `base` is the claim's `$1`–`$5`, its lease already the line's kind's.
pub(crate) async fn take_many(
    db: &mut Db<'_>,
    line: &LineKey,
    base: &[Value],
    tokens: Vec<String>,
) -> Result<Many, StoreError> {
    let mut a = base.to_vec();
    let want = i64::try_from(tokens.len()).unwrap_or(i64::MAX);
    a.extend([line.priority.into(), line.kind.as_str().into(), line.requires.as_str().into()]);
    a.extend([Value::from(want), Value::Texts(tokens)]);
    let mut rows = db.all(&TAKE_MANY_PG, &a).await?;
    let capped = match rows.first() {
        Some(r) => r.i64(CappedCol)? == 1,
        None => return Err(StoreError::internal("the claim of several jobs answered no row")),
    };
    if rows.first().map(|r| r.opt_text(super::JobCol::id)).transpose()?.flatten().is_none() {
        rows.clear();
    }
    Ok(Many { rows, capped })
}

/// A column `offset` places after the start of a row.
#[derive(Clone, Copy)]
struct Shifted(usize, CandidateCol);

impl crate::db::Col for Shifted {
    fn at(self) -> usize {
        self.0 + self.1 as usize
    }
}

/// The claim of one candidate by id, guarded as every claim and, for each cap given, by its scope's
/// running count (at most the cap's entries read): `None` when a cap is full. `$6` the job, `$7`
/// the account and `$8` its cap, `$9` the kind and `$10` its cap (-1: none).
fn claim_by_id_sql(engine: Engine) -> String {
    let (max, acct_index, kind_index) = match engine {
        Engine::Postgres => ("GREATEST", "", ""),
        Engine::Sqlite => ("MAX", " INDEXED BY jobs_running_account", " INDEXED BY jobs_running_kind"),
    };
    let update = format!(
        "UPDATE jobs SET {CLAIM_SET} WHERE id = $6 AND {CLAIMABLE} \
         AND ($8 < 0 OR (SELECT count(*) FROM (SELECT 1 FROM jobs{acct_index} WHERE account_id = $7 \
              AND state = 'running' AND {w} LIMIT {max}($8, 0)) r) < $8) \
         AND ($10 < 0 OR (SELECT count(*) FROM (SELECT 1 FROM jobs{kind_index} WHERE kind = $9 \
              AND state = 'running' AND {w} LIMIT {max}($10, 0)) r) < $10) \
         RETURNING {cols}",
        w = job::not_reserved("kind"),
        cols = super::JobCol::LIST,
    );
    match engine {
        Engine::Sqlite => update,
        Engine::Postgres => format!(
            "WITH c AS ({update}), att AS (INSERT INTO attempts (job_id, attempt_no, worker, lease_token, started_at) \
             SELECT id, attempt, $4, $2, $1 FROM c RETURNING 1) \
             SELECT {}, (SELECT count(*) FROM att) AS attempts FROM c",
            super::JobCol::LIST
        ),
    }
}

static CLAIM_BY_ID: LazyLock<[String; 2]> =
    LazyLock::new(|| [claim_by_id_sql(Engine::Sqlite), claim_by_id_sql(Engine::Postgres)]);

async fn claim_by_id(
    db: &mut Db<'_>,
    base: &[Value],
    c: &Candidate,
    account_cap: Option<i64>,
    line: &LineKey,
    kind_cap: Option<i64>,
) -> Result<Option<Row>, StoreError> {
    let mut a = base.to_vec();
    a.extend([
        Value::from(c.id.as_str()),
        c.account_id.as_str().into(),
        account_cap.unwrap_or(-1).into(),
        line.kind.as_str().into(),
        kind_cap.unwrap_or(-1).into(),
    ]);
    let sql = match db.engine() {
        Engine::Sqlite => &CLAIM_BY_ID[0],
        Engine::Postgres => &CLAIM_BY_ID[1],
    };
    db.opt(sql, &a).await
}

/// Decides a capped candidate: claims it when below every cap, else says why not (and parks the
/// account's lined jobs of the line when the account is at its cap).
pub(crate) async fn decide(
    db: &mut Db<'_>,
    cx: &super::Cx,
    base: &[Value],
    c: &Candidate,
    line: &LineKey,
    kind_cap: Option<i64>,
) -> Result<Decision, StoreError> {
    if db.engine() == Engine::Postgres {
        // One claimer per capped scope: try-locks, held to the transaction's end, never waited for.
        static TRY: LazyLock<String> = LazyLock::new(|| {
            format!(
                "SELECT CAST(CASE WHEN $2 = 1 THEN (CASE WHEN pg_try_advisory_xact_lock({ACCOUNT_LOCK_CLASS}, hashtext($1)) \
                 THEN 1 ELSE 0 END) ELSE 1 END AS bigint) AS account_ok, \
                 CAST(CASE WHEN $4 = 1 THEN (CASE WHEN pg_try_advisory_xact_lock({KIND_LOCK_CLASS}, hashtext($3)) \
                 THEN 1 ELSE 0 END) ELSE 1 END AS bigint) AS kind_ok"
            )
        });
        columns! {
            /// Whether each try-lock was got.
            LockCol { account_ok, kind_ok }
        }
        let row = db
            .one(
                &TRY,
                args![
                    c.account_id.as_str(),
                    i64::from(c.account_cap.is_some()),
                    line.kind.as_str(),
                    i64::from(kind_cap.is_some())
                ],
            )
            .await?;
        if row.i64(LockCol::account_ok)? == 0 {
            return Ok(Decision::AccountBusy);
        }
        if row.i64(LockCol::kind_ok)? == 0 {
            return Ok(Decision::KindBusy);
        }
    }
    // The simulator's broken variant counts nothing (crate::broken).
    let (account_cap, counted_kind_cap) = match cx.broken(crate::broken::Guard::Cap) {
        true => (None, None),
        false => (c.account_cap, kind_cap),
    };
    if let Some(row) = claim_by_id(db, base, c, account_cap, line, counted_kind_cap).await? {
        return Ok(Decision::Claimed(row));
    }
    // A cap is full (the candidate is this transaction's: nothing else moved it). Which one:
    let account_full = match (c.account_cap, kind_cap) {
        (Some(_), None) => true,
        (None, _) => false,
        (Some(cap), Some(_)) => running_of_account(db, &c.account_id, cap).await? >= cap,
    };
    if !account_full {
        return Ok(Decision::KindFull);
    }
    park(db, line, &c.account_id).await?;
    Ok(Decision::AccountFull)
}

/// The account's running jobs, counted up to `cap`.
async fn running_of_account(db: &mut Db<'_>, account: &str, cap: i64) -> Result<i64, StoreError> {
    static SQL: LazyLock<[String; 2]> = LazyLock::new(|| {
        let sql = |index: &str| {
            format!(
                "SELECT count(*) AS n FROM (SELECT 1 FROM jobs{index} WHERE account_id = $1 AND state = 'running' \
                 AND {} LIMIT $2) r",
                job::not_reserved("kind")
            )
        };
        [sql(" INDEXED BY jobs_running_account"), sql("")]
    });
    columns! {
        /// A count.
        CountCol { n }
    }
    let sql = match db.engine() {
        Engine::Sqlite => &SQL[0],
        Engine::Postgres => &SQL[1],
    };
    db.one(sql, args![account, cap.max(0)]).await?.i64(CountCol::n)
}

/// Parks up to `PARK_MAX` of the account's lined jobs of the line, lowest turn first.
async fn park(db: &mut Db<'_>, line: &LineKey, account: &str) -> Result<u64, StoreError> {
    static SQL: LazyLock<[String; 2]> = LazyLock::new(|| {
        let sql = |index: &str| {
            format!(
                "UPDATE jobs SET turn = NULL, parked = 1 WHERE id IN (SELECT id FROM jobs{index} WHERE priority = $1 \
                 AND kind = $2 AND requires = $3 AND account_id = $4 AND state = 'queued' AND turn IS NOT NULL \
                 ORDER BY turn LIMIT {PARK_MAX})"
            )
        };
        [
            // SQLite's one writer: nothing moves the rows it just read (a guard here would make it
            // walk every queued job, as the line-up's would: fair-claims.md §8).
            sql(" INDEXED BY jobs_line_account"),
            // PostgreSQL picks the rows once, in a materialized CTE: a `LIMIT … SKIP LOCKED`
            // subquery under `IN` may be run again (a re-checked row) and pick other rows.
            format!(
                "WITH picked AS MATERIALIZED (SELECT id FROM jobs WHERE priority = $1 AND kind = $2 AND requires = $3 \
                 AND account_id = $4 AND state = 'queued' AND turn IS NOT NULL ORDER BY turn LIMIT {PARK_MAX} \
                 FOR UPDATE SKIP LOCKED) \
                 UPDATE jobs SET turn = NULL, parked = 1 FROM picked WHERE jobs.id = picked.id \
                 AND jobs.state = 'queued' AND jobs.turn IS NOT NULL"
            ),
        ]
    });
    let sql = match db.engine() {
        Engine::Sqlite => &SQL[0],
        Engine::Postgres => &SQL[1],
    };
    db.exec(sql, args![line.priority, line.kind.as_str(), line.requires.as_str(), account]).await
}

/// The unpark pass: for up to `UNPARK_ACCOUNTS_MAX` accounts with parked jobs, after `after` (the
/// process's rotation), as many of each one's parked jobs as it is below its cap (no cap now: as
/// many as the pass may), best priority, then `not_before`, then creation order, wait again — the
/// line-up that follows lines them. At most `UNPARK_MAX` jobs in all. Returns how many it unparked
/// and where the next pass starts.
pub(crate) async fn unpark(db: &mut Db<'_>, after: &str) -> Result<(u64, String), StoreError> {
    let accounts = parked_accounts(db, after).await?;
    let next =
        if accounts.len() < UNPARK_ACCOUNTS_MAX { String::new() } else { accounts.last().cloned().unwrap_or_default() };
    let mut budget = UNPARK_MAX;
    let mut unparked = 0;
    for account in accounts {
        if budget == 0 {
            break;
        }
        let free = match cap_of(db, &account).await? {
            None => budget,
            Some(cap) => (cap - running_of_account(db, &account, cap).await?).clamp(0, budget),
        };
        if free == 0 {
            continue;
        }
        const SQL: [&str; 2] = [
            "UPDATE jobs SET parked = 0 WHERE id IN (SELECT id FROM jobs INDEXED BY jobs_parked \
                 WHERE account_id = $1 AND state = 'queued' AND parked = 1 \
                 ORDER BY priority, not_before, job_seq LIMIT $2)",
            // Picked once, in a materialized CTE: a `LIMIT … SKIP LOCKED` subquery under `IN`
            // may be run again for a re-checked row and pick others, unparking past the
            // budget (a later pass then met a negative LIMIT: claims answered 500).
            "WITH picked AS MATERIALIZED (SELECT id FROM jobs WHERE account_id = $1 AND state = 'queued' \
                 AND parked = 1 ORDER BY priority, not_before, job_seq LIMIT $2 FOR UPDATE SKIP LOCKED) \
                 UPDATE jobs SET parked = 0 FROM picked WHERE jobs.id = picked.id \
                 AND jobs.state = 'queued' AND jobs.parked = 1",
        ];
        let sql = match db.engine() {
            Engine::Sqlite => SQL[0],
            Engine::Postgres => SQL[1],
        };
        let n = db.exec(sql, args![account.as_str(), free]).await?;
        // Never below zero, whatever a statement reports: the next account's LIMIT is `budget`.
        budget = budget.saturating_sub(i64::try_from(n).unwrap_or(i64::MAX)).max(0);
        unparked += n;
    }
    Ok((unparked, next))
}

async fn cap_of(db: &mut Db<'_>, account: &str) -> Result<Option<i64>, StoreError> {
    columns! {
        /// An account's cap.
        CapCol { max_running }
    }
    let row = db.opt("SELECT max_running FROM accounts WHERE id = $1", args![account]).await?;
    row.map(|r| r.opt_i64(CapCol::max_running)).transpose().map(Option::flatten)
}

/// Accounts with parked jobs after `after`, in id order, at most `UNPARK_ACCOUNTS_MAX` (a skip scan
/// of `jobs_parked`: one probe each).
async fn parked_accounts(db: &mut Db<'_>, after: &str) -> Result<Vec<String>, StoreError> {
    columns! {
        /// An account id.
        AccountIdCol { account_id }
    }
    const PARKED: &str = "state = 'queued' AND parked = 1";
    match db.engine() {
        Engine::Postgres => {
            static SQL: LazyLock<String> = LazyLock::new(|| {
                format!(
                    "WITH RECURSIVE p AS (\
                       (SELECT account_id FROM jobs WHERE {PARKED} AND account_id > $1 ORDER BY account_id LIMIT 1) \
                       UNION ALL \
                       SELECT n.account_id FROM p CROSS JOIN LATERAL (SELECT account_id FROM jobs WHERE {PARKED} \
                         AND account_id > p.account_id ORDER BY account_id LIMIT 1) n) \
                     SELECT account_id FROM p LIMIT {UNPARK_ACCOUNTS_MAX}"
                )
            });
            db.all(&SQL, args![after]).await?.iter().map(|r| r.text(AccountIdCol::account_id)).collect()
        }
        Engine::Sqlite => {
            static SQL: LazyLock<String> = LazyLock::new(|| {
                format!(
                    "SELECT account_id FROM jobs INDEXED BY jobs_parked WHERE {PARKED} AND account_id > $1 \
                     ORDER BY account_id LIMIT 1"
                )
            });
            let mut out = Vec::new();
            let mut after = after.to_owned();
            while out.len() < UNPARK_ACCOUNTS_MAX {
                let Some(row) = db.opt(&SQL, args![after.as_str()]).await? else { break };
                after = row.text(AccountIdCol::account_id)?;
                out.push(after.clone());
            }
            Ok(out)
        }
    }
}

#[cfg(test)]
mod tests {
    /// The claim of several jobs under the generic plan the write lanes use (`force_generic_plan`:
    /// `LIMIT $9` unknown to the planner), on a line one account's backlog of 50,000 jobs fills:
    /// the pick walks `jobs_line` in order and stops, the claimed rows are found by their key, and
    /// the capped accounts by `accounts_capped`: no scan of either table.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn postgres_the_take_of_several_walks_the_line_in_order_under_a_generic_plan() {
        use sqlx::{ConnectOptions, Connection, Row};
        use std::str::FromStr;
        let url = settle_testkit::fresh_database().await;
        let store = crate::SqlStore::open(&url, crate::StoreOptions::default()).await.unwrap();
        let big = settle_core::ids::AccountId::parse("big").unwrap();
        let new = crate::NewAccount { id: big, overdraft_limit: settle_core::Credits::ZERO, max_running: None };
        crate::Store::create_account(&store, new, crate::SYSTEM_ACTOR).await.unwrap();
        drop(store);
        let mut c = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        let fill = "INSERT INTO jobs (id, job_seq, account_id, kind, state, cost, attempt, budget_base, max_attempts, \
                    refund_on, cancel_requested, not_before, lease_seconds, payload, request_hash, created_at, updated_at, \
                    priority, requires, turn) \
                    SELECT 'big-' || i, 1000000000000 + i, 'big', 'render', 'queued', 1, 0, 0, 5, 'failure', 0, 0, 30, \
                    'null', decode(repeat('00', 32), 'hex'), 0, 0, 50, '', i FROM generate_series(0, 49999) AS i; \
                    INSERT INTO accounts SELECT (jsonb_populate_record(NULL::accounts, \
                    to_jsonb(a) || jsonb_build_object('id', 'other-' || g))).* \
                    FROM accounts a, generate_series(1, 20000) g WHERE a.id = 'big'; \
                    ANALYZE jobs; ANALYZE accounts; SET plan_cache_mode = force_generic_plan";
        sqlx::raw_sql(fill).execute(&mut c).await.unwrap();
        let prepare = format!(
            "PREPARE many (bigint, text, bigint, text, bigint, bigint, text, text, bigint, text[]) AS {}",
            super::TAKE_MANY_PG.as_str()
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(prepare)).execute(&mut c).await.unwrap();
        let explain =
            "EXPLAIN EXECUTE many(1, 't', 2, 'w', 30, 50, 'render', '', 8, ARRAY['a','b','c','d','e','f','g','h'])";
        let plan = sqlx::raw_sql(explain).fetch_all(&mut c).await.unwrap();
        let plan: Vec<String> = plan.iter().map(|r| r.get::<String, _>(0)).collect();
        for index in ["Index Scan using jobs_line on jobs", "Index Scan using jobs_pkey on jobs", "accounts_capped"] {
            assert!(plan.iter().any(|l| l.contains(index)), "{index}: {plan:#?}");
        }
        for whole in ["Seq Scan on jobs", "Bitmap Heap Scan on jobs", "Seq Scan on accounts"] {
            assert!(!plan.iter().any(|l| l.contains(whole)), "{whole}: {plan:#?}");
        }
        c.close().await.unwrap();
    }
}
