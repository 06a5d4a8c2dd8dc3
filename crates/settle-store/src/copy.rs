//! `settle copy`: a whole store into an empty one, either engine to either engine (issue 42,
//! decision 0029). Every row of every table goes across as it is — ids, `seq`, `account_seq`,
//! hashes, events, attempts, grants, allocations — read from one snapshot of the source and
//! written in one transaction on the target, so the target holds all of it or none. The numbering
//! state (the `counters` rows, PostgreSQL's sequences) is set from what was copied, so the target
//! numbers on from where the source stood.

use crate::error::StoreError;
use futures_util::TryStreamExt;
use sqlx::postgres::{PgConnectOptions, PgRow};
use sqlx::sqlite::{SqliteConnectOptions, SqliteRow};
use sqlx::{ConnectOptions, Row, TypeInfo, ValueRef};
use std::str::FromStr;

/// The tables copied, in an order every foreign key allows, each with the order its rows go in
/// (an allocation may name an earlier one). `counters` is not copied but set from the data;
/// `_sqlx_migrations` is each store's own.
pub const TABLES: &[(&str, &str)] = &[
    ("accounts", "id"),
    ("account_alerts", "account_id, alert_id"),
    ("spend_limits", "account_id, limit_no"),
    ("spend_limit_kinds", "account_id, limit_no, kind"),
    ("grants", "key"),
    ("jobs", "job_seq"),
    ("items", "job_id, ord, item_id"),
    ("attempts", "job_id, attempt_no"),
    ("signals", "id"),
    ("artifacts", "job_id, item_id, key"),
    ("withdrawals", "job_id"),
    ("top_ups", "job_id"),
    ("auto_top_ups", "account_id"),
    ("allocations", "id"),
    ("ledger_entries", "seq"),
    ("events", "stamp, pos"),
    ("stamp_numbers", "stamp"),
    ("stamps_pending", "stamp"),
    ("webhook_cursors", "endpoint_id"),
    ("webhook_breakers", "endpoint_id"),
    ("webhook_deliveries", "endpoint_id, event_seq"),
    ("actions", "id"),
    ("teardown_retries", "job_id"),
    ("console_signouts", "nonce"),
    ("store_epochs", "epoch"),
    ("worker_labels", "labels"),
];

/// Tables a new store fills itself (a migration's seed rows): replaced by the source's, not a
/// reason to call the target non-empty.
const SEEDED: &[&str] = &["store_epochs"];

/// PostgreSQL identity columns (`GENERATED ALWAYS`): inserted with `OVERRIDING SYSTEM VALUE`, and
/// their sequences moved past what was copied.
const IDENTITY: &[(&str, &str)] = &[("signals", "id"), ("actions", "id"), ("grants", "key"), ("allocations", "id")];

/// Each store's own, never carried: its migrations, and its audit checkpoint (decision 0040: what
/// an audit proved of that store; the target's own audit, which `copy` ends with, proves it again).
const OWN: &[&str] = &["_sqlx_migrations", "audit_checkpoint", "audit_checkpoint_accounts", "audit_checkpoint_jobs"];

/// A table `copy` carries, sets from the data (`counters`), or leaves to each store.
fn known_table(t: &str) -> bool {
    t == "counters" || OWN.contains(&t) || TABLES.iter().any(|(n, _)| *n == t)
}

/// One value, as both engines store them.
#[derive(Debug, Clone, PartialEq)]
enum Cell {
    Null,
    Int(i64),
    Text(String),
    Bytes(Vec<u8>),
}

/// How many rows of each table went across.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CopyReport {
    pub tables: Vec<(String, u64)>,
}

impl CopyReport {
    pub fn rows(&self) -> u64 {
        self.tables.iter().map(|(_, n)| n).sum()
    }
}

fn fail(what: impl std::fmt::Display) -> StoreError {
    StoreError::invalid(what.to_string())
}

/// A connection to one side, as raw SQL.
enum Side {
    Lite(sqlx::SqliteConnection),
    Pg(sqlx::PgConnection),
}

impl Side {
    async fn connect(url: &str) -> Result<Side, StoreError> {
        if url.starts_with("sqlite:") {
            let options = SqliteConnectOptions::from_str(url).map_err(fail)?.foreign_keys(true);
            Ok(Side::Lite(options.connect().await?))
        } else {
            Ok(Side::Pg(PgConnectOptions::from_str(url).map_err(fail)?.connect().await?))
        }
    }

    async fn execute(&mut self, sql: &str) -> Result<(), StoreError> {
        let sql = sqlx::AssertSqlSafe(sql.to_owned());
        match self {
            Side::Lite(c) => {
                sqlx::raw_sql(sql).execute(c).await?;
            }
            Side::Pg(c) => {
                sqlx::raw_sql(sql).execute(c).await?;
            }
        }
        Ok(())
    }

    /// The table's columns, in order, with their declared types (lower case).
    async fn columns(&mut self, table: &str) -> Result<Vec<(String, String)>, StoreError> {
        let cols: Vec<(String, String)> = match self {
            Side::Lite(c) => {
                let sql = sqlx::AssertSqlSafe(format!("SELECT name, type FROM pragma_table_info('{table}')"));
                sqlx::query_as(sql).fetch_all(c).await?
            }
            Side::Pg(c) => {
                sqlx::query_as(
                    "SELECT column_name::text, data_type::text FROM information_schema.columns \
                     WHERE table_schema = current_schema() AND table_name = $1 ORDER BY ordinal_position",
                )
                .bind(table)
                .fetch_all(c)
                .await?
            }
        };
        Ok(cols.into_iter().map(|(n, t)| (n, t.to_ascii_lowercase())).collect())
    }

    async fn tables(&mut self) -> Result<Vec<String>, StoreError> {
        Ok(match self {
            Side::Lite(c) => {
                sqlx::query_scalar(
                    "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' ORDER BY name",
                )
                .fetch_all(c)
                .await?
            }
            Side::Pg(c) => {
                sqlx::query_scalar(
                    "SELECT table_name::text FROM information_schema.tables \
                     WHERE table_schema = current_schema() AND table_type = 'BASE TABLE' ORDER BY 1",
                )
                .fetch_all(c)
                .await?
            }
        })
    }

    async fn has_rows(&mut self, table: &str) -> Result<bool, StoreError> {
        let sql = sqlx::AssertSqlSafe(format!("SELECT EXISTS (SELECT 1 FROM {table})"));
        Ok(match self {
            Side::Lite(c) => sqlx::query_scalar::<_, bool>(sql).fetch_one(c).await?,
            Side::Pg(c) => sqlx::query_scalar::<_, bool>(sql).fetch_one(c).await?,
        })
    }

    fn is_pg(&self) -> bool {
        matches!(self, Side::Pg(_))
    }
}

fn lite_cells(row: &SqliteRow) -> Result<Vec<Cell>, StoreError> {
    (0..row.len())
        .map(|i| {
            let raw = row.try_get_raw(i)?;
            if raw.is_null() {
                return Ok(Cell::Null);
            }
            Ok(match raw.type_info().name() {
                "INTEGER" | "BIGINT" | "INT8" | "BOOLEAN" => Cell::Int(row.try_get::<i64, _>(i)?),
                "TEXT" => Cell::Text(row.try_get::<String, _>(i)?),
                "BLOB" => Cell::Bytes(row.try_get::<Vec<u8>, _>(i)?),
                other => return Err(fail(format!("column {i}: a value of type {other}, which Settle never stores"))),
            })
        })
        .collect()
}

fn pg_cells(row: &PgRow) -> Result<Vec<Cell>, StoreError> {
    (0..row.len())
        .map(|i| {
            let raw = row.try_get_raw(i)?;
            if raw.is_null() {
                return Ok(Cell::Null);
            }
            Ok(match raw.type_info().name() {
                "INT8" => Cell::Int(row.try_get::<i64, _>(i)?),
                "INT4" => Cell::Int(i64::from(row.try_get::<i32, _>(i)?)),
                "INT2" => Cell::Int(i64::from(row.try_get::<i16, _>(i)?)),
                "BOOL" => Cell::Int(i64::from(row.try_get::<bool, _>(i)?)),
                "TEXT" | "VARCHAR" => Cell::Text(row.try_get::<String, _>(i)?),
                "BYTEA" => Cell::Bytes(row.try_get::<Vec<u8>, _>(i)?),
                other => return Err(fail(format!("column {i}: a value of type {other}, which Settle never stores"))),
            })
        })
        .collect()
}

/// Inserts `rows` into `table` on the target, in one statement.
async fn insert(
    target: &mut Side,
    table: &str,
    columns: &[(String, String)],
    rows: &[Vec<Cell>],
) -> Result<(), StoreError> {
    if rows.is_empty() {
        return Ok(());
    }
    let names: Vec<&str> = columns.iter().map(|(n, _)| n.as_str()).collect();
    let mut sql = format!("INSERT INTO {table} ({})", names.join(", "));
    if target.is_pg() && IDENTITY.iter().any(|(t, _)| *t == table) {
        sql.push_str(" OVERRIDING SYSTEM VALUE");
    }
    sql.push_str(" VALUES ");
    let mut n = 0;
    for (r, _) in rows.iter().enumerate() {
        if r > 0 {
            sql.push_str(", ");
        }
        let params: Vec<String> = (0..columns.len())
            .map(|_| {
                n += 1;
                format!("${n}")
            })
            .collect();
        sql.push_str(&format!("({})", params.join(", ")));
    }
    let sql = sqlx::AssertSqlSafe(sql);
    match target {
        Side::Lite(c) => {
            let mut q = sqlx::query(sql);
            for row in rows {
                for cell in row {
                    q = match cell {
                        Cell::Null => q.bind(None::<i64>),
                        Cell::Int(v) => q.bind(*v),
                        Cell::Text(v) => q.bind(v.clone()),
                        Cell::Bytes(v) => q.bind(v.clone()),
                    };
                }
            }
            q.execute(c).await.map_err(|e| refused(table, e))?;
        }
        Side::Pg(c) => {
            let mut q = sqlx::query(sql);
            for row in rows {
                for (cell, (name, ty)) in row.iter().zip(columns) {
                    q = match (cell, ty.as_str()) {
                        (Cell::Null, "integer") => q.bind(None::<i32>),
                        (Cell::Null, "bigint") => q.bind(None::<i64>),
                        (Cell::Null, "bytea") => q.bind(None::<Vec<u8>>),
                        (Cell::Null, _) => q.bind(None::<String>),
                        (Cell::Int(v), "integer") => {
                            q.bind(i32::try_from(*v).map_err(|_| fail(format!("{table}.{name}: {v} is too large")))?)
                        }
                        (Cell::Int(v), _) => q.bind(*v),
                        (Cell::Text(v), _) => q.bind(v.clone()),
                        (Cell::Bytes(v), _) => q.bind(v.clone()),
                    };
                }
            }
            q.execute(c).await.map_err(|e| refused(table, e))?;
        }
    }
    Ok(())
}

/// A row of the source the target's own rules refuse (a constraint, or SQLite's chain trigger: a
/// source whose ledger does not link, decision 0037), said with its table; the copy is rolled back.
/// Any other error (a connection lost) is passed on as it is.
fn refused(table: &str, e: sqlx::Error) -> StoreError {
    match e {
        sqlx::Error::Database(d) => {
            fail(format!("the target refused a row of {table}: {}; nothing was copied", d.message()))
        }
        other => other.into(),
    }
}

/// Rows per INSERT: under both engines' limit on parameters.
fn chunk_rows(columns: usize) -> usize {
    (30_000 / columns.max(1)).clamp(1, 500)
}

/// Tables whose `job_seq` SQLite files a job's rows by and PostgreSQL's writers leave NULL
/// (migration 0037, decision 0039).
const FILED_BY_NUMBER: &[&str] = &["ledger_entries", "allocations"];

/// The source's SELECT of `table`'s `columns` in `order`. Into SQLite, whose triggers refuse a job's
/// line or part without its job's number, the tables of `FILED_BY_NUMBER` take the number from the
/// job's row where the source left it NULL (a PostgreSQL store); every other row goes as it is.
fn select(table: &str, order: &str, columns: &[(String, String)], into_sqlite: bool) -> String {
    if !(into_sqlite && FILED_BY_NUMBER.contains(&table)) {
        let names: Vec<&str> = columns.iter().map(|(n, _)| n.as_str()).collect();
        return format!("SELECT {} FROM {table} ORDER BY {order}", names.join(", "));
    }
    let names: Vec<String> = columns
        .iter()
        .map(|(n, _)| if n == "job_seq" { "COALESCE(t.job_seq, j.job_seq)".to_owned() } else { format!("t.{n}") })
        .collect();
    let order: Vec<String> = order.split(", ").map(|c| format!("t.{c}")).collect();
    format!(
        "SELECT {} FROM {table} t LEFT JOIN jobs j ON j.id = t.job_id ORDER BY {}",
        names.join(", "),
        order.join(", ")
    )
}

/// Copies `table` from the source's snapshot to the target; returns how many rows.
async fn copy_table(
    source: &mut Side,
    target: &mut Side,
    table: &str,
    order: &str,
    columns: &[(String, String)],
) -> Result<u64, StoreError> {
    let select = sqlx::AssertSqlSafe(select(table, order, columns, !target.is_pg()));
    let per = chunk_rows(columns.len());
    let mut chunk: Vec<Vec<Cell>> = Vec::with_capacity(per);
    let mut copied = 0u64;
    match source {
        Side::Lite(c) => {
            let mut rows = sqlx::query(select).fetch(c);
            while let Some(row) = rows.try_next().await? {
                chunk.push(lite_cells(&row)?);
                if chunk.len() == per {
                    insert(target, table, columns, &chunk).await?;
                    copied += chunk.len() as u64;
                    chunk.clear();
                }
            }
        }
        Side::Pg(c) => {
            let mut rows = sqlx::query(select).fetch(c);
            while let Some(row) = rows.try_next().await? {
                chunk.push(pg_cells(&row)?);
                if chunk.len() == per {
                    insert(target, table, columns, &chunk).await?;
                    copied += chunk.len() as u64;
                    chunk.clear();
                }
            }
        }
    }
    insert(target, table, columns, &chunk).await?;
    Ok(copied + chunk.len() as u64)
}

/// The numbering state of the target, set from what it now holds: the `counters` rows, and on
/// PostgreSQL its sequences (ledger and job numbers, outbox stamps, identity columns).
async fn renumber(target: &mut Side) -> Result<(), StoreError> {
    if !target.is_pg() {
        // Events the source's sequencer had not numbered yet: SQLite has no sequencer, so they are
        // numbered here, after every numbered one, in stamp order (as a pass would have).
        target
            .execute(
                "INSERT INTO stamp_numbers (stamp, first_seq, last_seq) \
                   SELECT stamp, base + SUM(events) OVER (ORDER BY stamp) - events + 1, base + SUM(events) OVER (ORDER BY stamp) \
                   FROM stamps_pending, (SELECT COALESCE(MAX(last_seq), 0) AS base FROM stamp_numbers) AS b; \
                 DELETE FROM stamps_pending",
            )
            .await?;
    }
    target
        .execute(
            "UPDATE counters SET value = (SELECT COALESCE(MAX(seq), 0) FROM ledger_entries) WHERE name = 'ledger'; \
             UPDATE counters SET value = (SELECT COALESCE(MAX(last_seq), 0) FROM stamp_numbers) WHERE name = 'outbox'; \
             UPDATE counters SET value = (SELECT COALESCE(MAX(job_seq), 0) FROM jobs) WHERE name = 'job'",
        )
        .await?;
    if target.is_pg() {
        let mut sql = String::from(
            "SELECT setval('ledger_seq_numbers', GREATEST((SELECT MAX(seq) FROM ledger_entries), 1), \
               (SELECT MAX(seq) FROM ledger_entries) IS NOT NULL); \
             SELECT setval('job_seq_numbers', GREATEST((SELECT MAX(job_seq) FROM jobs), 1), \
               (SELECT MAX(job_seq) FROM jobs) IS NOT NULL); \
             SELECT setval('outbox_stamps', GREATEST((SELECT MAX(stamp) FROM events), 1), \
               COALESCE((SELECT MAX(stamp) FROM events), 0) > 0);",
        );
        for (table, column) in IDENTITY {
            sql.push_str(&format!(
                " SELECT setval(pg_get_serial_sequence('{table}', '{column}'), \
                 GREATEST((SELECT MAX({column}) FROM {table}), 1), (SELECT MAX({column}) FROM {table}) IS NOT NULL);"
            ));
        }
        target.execute(&sql).await?;
    }
    Ok(())
}

/// Checks both stores have the same tables and columns, and every table is one Settle copies.
async fn same_schema(source: &mut Side, target: &mut Side) -> Result<Vec<Vec<(String, String)>>, StoreError> {
    for side in [&mut *source, &mut *target] {
        if let Some(t) = side.tables().await?.iter().find(|t| !known_table(t)) {
            return Err(fail(format!("table {t} is not one settle copy knows: copy with the settle that made it")));
        }
    }
    let mut columns = Vec::new();
    for (table, _) in TABLES {
        let theirs = source.columns(table).await?;
        let ours = target.columns(table).await?;
        let names =
            |c: &[(String, String)]| c.iter().map(|(n, _)| n.clone()).collect::<std::collections::BTreeSet<_>>();
        if names(&theirs) != names(&ours) {
            return Err(fail(format!("table {table} has other columns in the source than in the target")));
        }
        columns.push(ours);
    }
    Ok(columns)
}

/// Copies the store at `from` into the empty store at `to` (both already at this binary's schema).
/// `progress` hears each table as it is done. Writes nothing to the target unless all of it.
pub async fn copy(from: &str, to: &str, mut progress: impl FnMut(&str, u64)) -> Result<CopyReport, StoreError> {
    let mut source = Side::connect(from).await?;
    let mut target = Side::connect(to).await?;
    let columns = same_schema(&mut source, &mut target).await?;
    for (table, _) in TABLES.iter().filter(|(t, _)| !SEEDED.contains(t)) {
        if target.has_rows(table).await? {
            return Err(fail(format!(
                "the target is not empty (its {table} has rows): settle copy writes only into an empty store"
            )));
        }
    }
    // One snapshot of the source for every table.
    source.execute(if source.is_pg() { "BEGIN ISOLATION LEVEL REPEATABLE READ READ ONLY" } else { "BEGIN" }).await?;
    target.execute("BEGIN").await?;
    let copied = async {
        let mut report = CopyReport::default();
        for ((table, order), columns) in TABLES.iter().zip(&columns) {
            if SEEDED.contains(table) {
                target.execute(&format!("DELETE FROM {table}")).await?;
            }
            let n = copy_table(&mut source, &mut target, table, order, columns).await?;
            progress(table, n);
            report.tables.push(((*table).to_owned(), n));
        }
        renumber(&mut target).await?;
        // A checkpoint the empty target's own audit recorded proves nothing of what came across.
        for table in ["audit_checkpoint_jobs", "audit_checkpoint_accounts", "audit_checkpoint"] {
            target.execute(&format!("DELETE FROM {table}")).await?;
        }
        Ok::<CopyReport, StoreError>(report)
    }
    .await;
    let _ = source.execute("ROLLBACK").await;
    match copied {
        Ok(report) => {
            target.execute("COMMIT").await?;
            Ok(report)
        }
        Err(e) => {
            let _ = target.execute("ROLLBACK").await;
            Err(e)
        }
    }
}

/// Whether every table Settle has is one `copy` carries (or sets from the data): a new table
/// added without a place in `TABLES` fails this.
pub async fn covers_every_table(url: &str) -> Result<Vec<String>, StoreError> {
    let mut side = Side::connect(url).await?;
    Ok(side.tables().await?.into_iter().filter(|t| !known_table(t)).collect())
}
