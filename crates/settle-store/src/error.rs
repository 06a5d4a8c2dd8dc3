//! Store errors: what callers branch on. Engine errors stay inside `Internal`.

use settle_core::MoneyError;
use settle_core::ids::IdError;

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("invalid request: {0}")]
    Invalid(String),
    #[error("{what} {id} not found")]
    NotFound { what: &'static str, id: String },
    #[error("insufficient credits: balance {balance}, overdraft limit {overdraft_limit}, needed {needed}")]
    InsufficientCredits { balance: i64, overdraft_limit: i64, needed: i64 },
    #[error(
        "insufficient credits for a withdrawal: balance {balance}, needed {needed}; a withdrawal never draws on the overdraft"
    )]
    InsufficientBalance { balance: i64, needed: i64 },
    /// A withdrawal larger than the account's cash: its credit that never expires, less its debt
    /// (semantics §1; promotional, expiring credit is never cash, docs/decisions/0023). Nothing was
    /// written.
    #[error(
        "insufficient credits for a withdrawal: {available} of the {needed} needed is cash (credit that never expires, less what the account owes); credit with an expiry is never withdrawn and never pays for one"
    )]
    InsufficientCash { available: i64, needed: i64 },
    /// A create (or a withdrawal a limit names) that would take a spend limit's period over its
    /// amount (spec §4a): the first such limit, its period's spend and what is left. Nothing was
    /// written.
    #[error(
        "spend limit exceeded: the {} limit of {} has {} spent this {}, {} left, and this needs {}",
        exceeded.period.as_str(), exceeded.amount, exceeded.spent, exceeded.period.as_str(), exceeded.remaining, exceeded.needed
    )]
    SpendLimitExceeded { exceeded: Box<crate::model::LimitExceeded> },
    #[error("{what} {id} already exists with a different request")]
    IdempotencyConflict { what: &'static str, id: String },
    /// A worker's report re-sent with another body than the one that took effect (a `fail` with
    /// another code): nothing was written.
    #[error("{0}")]
    ReportConflict(String),
    /// A success that decides a held item without its price (docs/decisions/0022): nothing written.
    #[error("item {item} is held: its success must say what it cost (0 up to its hold of {hold})")]
    CostRequired { item: String, hold: i64 },
    /// A held item's reported price above its hold: nothing written.
    #[error("item {item} cost {cost} exceeds its hold of {hold}")]
    CostExceedsHold { item: String, cost: i64, hold: i64 },
    #[error("the {what} id {id} is taken by another account's {what}; {what} ids are unique across all accounts")]
    IdTaken { what: &'static str, id: String },
    #[error("job {0} is finished")]
    JobFinished(String),
    #[error("job {0} has an unknown outcome; reconcile it first")]
    OutcomeUnknown(String),
    /// A worker's report refused because its lease is gone: what became of the job and of the
    /// attempt whose token it was (issue 20, decision 0019). Nothing but the signal log was written.
    #[error("{0}")]
    LeaseLost(Box<crate::model::LeaseLost>),
    #[error("job {job} cannot {action} in state {state}")]
    InvalidTransition { job: String, action: &'static str, state: String },
    #[error("credit arithmetic overflow")]
    Overflow,
    /// An event cursor past every event the store has numbered: the store was restored from a
    /// backup and numbers events again, under a new epoch, from `restart_after + 1` (decision 0029).
    #[error(
        "the cursor {after} is past the last event ({last}): the store was restored and numbers events again \
         from {} in epoch {epoch}; read from after={restart_after} and deduplicate by (epoch, seq)",
        restart_after + 1
    )]
    CursorAhead { after: i64, last: i64, epoch: i64, restart_after: i64 },
    #[error("artifact cleanup failed for job {job}: {message}")]
    CleanupFailed { job: String, message: String },
    #[error("injected crash at {0}")]
    InjectedCrash(&'static str),
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// A lock or statement timeout: the ledger is there but busy; nothing was written.
    #[error("the ledger is busy: {0}")]
    Busy(String),
    /// A PostgreSQL serialization failure, deadlock or concurrent create; retried inside the store
    /// and seen by callers only when the retries run out.
    #[error("transaction conflict, retry: {0}")]
    Retryable(String),
    /// The database is not one Settle may open: not a database, another program's, or a newer
    /// Settle schema. Nothing was written.
    #[error("{0}")]
    NotSettle(String),
    #[error("internal store error: {0}")]
    Internal(String),
}

impl StoreError {
    pub fn invalid(message: impl Into<String>) -> StoreError {
        StoreError::Invalid(message.into())
    }
    pub fn not_found(what: &'static str, id: impl Into<String>) -> StoreError {
        StoreError::NotFound { what, id: id.into() }
    }
    pub fn internal(message: impl std::fmt::Display) -> StoreError {
        StoreError::Internal(message.to_string())
    }
}

impl From<IdError> for StoreError {
    fn from(e: IdError) -> StoreError {
        StoreError::Invalid(e.to_string())
    }
}

impl From<MoneyError> for StoreError {
    fn from(_: MoneyError) -> StoreError {
        StoreError::Overflow
    }
}

/// SQLite `SQLITE_CONSTRAINT_DATATYPE`: a STRICT column refused a value, which is how an
/// integer overflow (promoted to REAL) surfaces. PostgreSQL says `22003`.
const SQLITE_CONSTRAINT_DATATYPE: &str = "3091";
const PG_NUMERIC_VALUE_OUT_OF_RANGE: &str = "22003";

/// PostgreSQL SQLSTATEs after which the whole transaction is retried: serialization failure and
/// deadlock; nothing of the transaction committed.
const PG_RETRYABLE: [&str; 2] = ["40001", "40P01"];
const PG_UNIQUE_VIOLATION: &str = "23505";
/// Unique constraints a concurrent create of the same id can hit; the retry sees the row and
/// answers a replay. Any other unique violation is an invariant breach and is not retried.
const PG_CREATE_RACES: [&str; 3] = ["accounts_pkey", "jobs_pkey", "ledger_entries_ref"];

/// PostgreSQL answers that mean "the database is not there for us now", not "your request is
/// wrong": connection exceptions (class 08), shutdown (57P01–57P03), too many connections (53300),
/// a database that does not exist (3D000), and a read-only transaction (25006: the server is a
/// standby now, after a failover — docs/decisions/0024).
fn is_unavailable_sqlstate(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "53300" | "3D000" | "25006")
}

/// PostgreSQL's lock timeout (`55P03`) and statement timeout (`57014`), and SQLite's busy answers
/// (`SQLITE_BUSY` and its extended codes): a transaction waited too long and was rolled back.
fn is_busy_code(code: &str) -> bool {
    matches!(code, "55P03" | "57014" | "5" | "261" | "517" | "773")
}

fn is_retryable_db(e: &sqlx::Error) -> bool {
    let sqlx::Error::Database(db) = e else { return false };
    match db.code().as_deref() {
        Some(c) if PG_RETRYABLE.contains(&c) => true,
        Some(PG_UNIQUE_VIOLATION) => db.constraint().is_some_and(|c| PG_CREATE_RACES.contains(&c)),
        _ => false,
    }
}

impl StoreError {
    /// Whether a PostgreSQL transaction that failed with this error may be retried whole.
    pub fn is_pg_retryable(&self) -> bool {
        matches!(self, StoreError::Retryable(_))
    }

    /// A failed COMMIT. A refused commit (serialization) is retryable; a lost connection leaves the
    /// outcome unknown to us, which callers must not take for "nothing happened".
    pub(crate) fn from_commit(e: sqlx::Error) -> StoreError {
        if is_retryable_db(&e) {
            return StoreError::Retryable(e.to_string());
        }
        match e {
            // The server went away while the COMMIT waited (a shutdown while it waited for the
            // standby, a demotion): it may have committed.
            sqlx::Error::Database(ref db) if db.code().is_some_and(|c| is_unavailable_sqlstate(&c)) => {
                StoreError::Unavailable(format!("commit outcome unknown: {e}"))
            }
            sqlx::Error::Database(_) => StoreError::Internal(e.to_string()),
            other => StoreError::Unavailable(format!("commit outcome unknown: {other}")),
        }
    }
}

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> StoreError {
        if is_retryable_db(&e) {
            return StoreError::Retryable(e.to_string());
        }
        if let sqlx::Error::Database(db) = &e {
            let code = db.code();
            if matches!(code.as_deref(), Some(SQLITE_CONSTRAINT_DATATYPE) | Some(PG_NUMERIC_VALUE_OUT_OF_RANGE)) {
                return StoreError::Overflow;
            }
        }
        if let sqlx::Error::Database(db) = &e
            && db.code().is_some_and(|c| is_unavailable_sqlstate(&c))
        {
            return StoreError::Unavailable(e.to_string());
        }
        if let sqlx::Error::Database(db) = &e
            && db.code().is_some_and(|c| is_busy_code(&c))
        {
            return StoreError::Busy(e.to_string());
        }
        match e {
            sqlx::Error::PoolTimedOut | sqlx::Error::PoolClosed | sqlx::Error::Io(_) | sqlx::Error::Protocol(_) => {
                StoreError::Unavailable(e.to_string())
            }
            other => StoreError::Internal(other.to_string()),
        }
    }
}

impl StoreError {
    /// An error of the SQLite writer's connection (rusqlite), classified as `From<sqlx::Error>`
    /// classifies the same codes: an integer overflow refused by a STRICT column is `Overflow`, a busy
    /// database `Busy`, a full disk or an I/O error `Unavailable` (nothing was written).
    pub(crate) fn from_sqlite(e: rusqlite::Error) -> StoreError {
        if let rusqlite::Error::SqliteFailure(failure, _) = &e {
            let extended = failure.extended_code.to_string();
            if extended == SQLITE_CONSTRAINT_DATATYPE {
                return StoreError::Overflow;
            }
            if is_busy_code(&extended) {
                return StoreError::Busy(e.to_string());
            }
            if matches!(
                failure.code,
                rusqlite::ErrorCode::DiskFull
                    | rusqlite::ErrorCode::SystemIoFailure
                    | rusqlite::ErrorCode::CannotOpen
                    | rusqlite::ErrorCode::ReadOnly
            ) {
                return StoreError::Unavailable(e.to_string());
            }
        }
        StoreError::Internal(e.to_string())
    }
}
