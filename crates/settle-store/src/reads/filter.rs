//! The SQL of a job filter and of a token's scope (decision 0018), shared by every read that
//! lists jobs or what belongs to them.

use crate::db::{Engine, Value};
use crate::error::StoreError;
use crate::model::*;
use settle_core::ids::AccountId;
use settle_core::job::JobState;

/// The filter's WHERE clause (after `WHERE 1 = 1`) and its arguments, numbered from `$1`.
pub(crate) fn filter_sql(engine: Engine, filter: &JobFilter, a: &mut Vec<Value>) -> String {
    let mut sql = String::new();
    let mut add = |sql: &mut String, column: &str, v: Value| {
        a.push(v);
        sql.push_str(&format!(" AND {column} = ${}", a.len()));
    };
    // The state as a literal, one of the closed set's names: a partial index whose predicate is on
    // the state (`jobs_open`, migration 0033) serves no statement that binds it.
    if let Some(s) = filter.state {
        sql.push_str(&format!(" AND state = '{}'", s.as_str()));
        if s == JobState::Running {
            sql.push_str(running_seqs(engine));
        }
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
    if let Some(p) = filter.priority {
        add(&mut sql, "priority", i64::from(p).into());
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

/// ` AND job_seq IN (…)`: the running jobs' numbers (for lists, totals and the lease rescuer), read
/// from the two partial indexes that hold them — `jobs_running_kind` (every kind but withdrawals) and `jobs_rail` (withdrawals); between
/// them, every running job (decision 0036). No index holds the running jobs by state alone, and a
/// few running jobs among millions would otherwise be found by reading them all. SQLite, without
/// statistics, is told the first index.
pub(crate) fn running_seqs(engine: Engine) -> &'static str {
    match engine {
        Engine::Sqlite => {
            " AND job_seq IN (SELECT job_seq FROM jobs INDEXED BY jobs_running_kind \
             WHERE state = 'running' AND kind <> 'withdrawal' \
             UNION ALL SELECT job_seq FROM jobs WHERE kind = 'withdrawal' AND state = 'running')"
        }
        Engine::Postgres => {
            " AND job_seq IN (SELECT job_seq FROM jobs WHERE state = 'running' AND kind <> 'withdrawal' \
             UNION ALL SELECT job_seq FROM jobs WHERE kind = 'withdrawal' AND state = 'running')"
        }
    }
}

/// Whether a rail's list names its accounts exactly — by the filter's account, or by a scope of
/// exact ids only — so that `jobs_account` serves it in order.
pub(crate) fn names_accounts(account: Option<&AccountId>, scope: &settle_core::scope::Scope) -> bool {
    use settle_core::scope::AccountPattern;
    account.is_some()
        || scope.accounts.as_ref().is_some_and(|p| p.iter().all(|p| matches!(p, AccountPattern::Exact(_))))
}

/// The head of a rail's list (`kind` the rail's job kind, a constant of the closed set): its jobs
/// after `$1` (a job sequence number), in the state asked for, as a literal (`jobs_rail` and
/// `jobs_open` serve it in order, migration 0033). A list of every state in creation order walks
/// `job_seq` rather than sort all of the rail's jobs for each page — SQLite, without statistics,
/// would sort — unless its accounts are named (`names_accounts`: `jobs_account` serves it).
pub(crate) fn rail_list_sql(engine: Engine, kind: &'static str, state: Option<JobState>, by_account: bool) -> String {
    let walk = match (engine, state, by_account) {
        // The unique index on `job_seq` (the table's second constraint).
        (Engine::Sqlite, None, false) => " INDEXED BY sqlite_autoindex_jobs_2",
        _ => "",
    };
    let mut sql = format!("SELECT {} FROM jobs{walk} WHERE kind = '{kind}' AND job_seq > $1", crate::ops::JobCol::LIST);
    if let Some(s) = state {
        sql.push_str(&format!(" AND state = '{}'", s.as_str()));
    }
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
