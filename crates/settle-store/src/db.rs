//! A thin layer over one SQLite or PostgreSQL connection, so every transition is written once,
//! in SQL both engines read the same way (`$N` placeholders, `RETURNING`, `ON CONFLICT`).

use sqlx::postgres::{PgArguments, PgConnection, PgRow};
use sqlx::query::Query;
use sqlx::sqlite::{SqliteArguments, SqliteConnection, SqliteRow};
use sqlx::{AssertSqlSafe, Postgres, Row as _, Sqlite};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Engine {
    Sqlite,
    Postgres,
}

impl Engine {
    pub const fn name(self) -> &'static str {
        match self {
            Engine::Sqlite => "sqlite",
            Engine::Postgres => "postgres",
        }
    }
}

#[derive(Debug, Clone)]
pub(crate) enum Value {
    I64(i64),
    OptI64(Option<i64>),
    Text(String),
    OptText(Option<String>),
    Blob(Vec<u8>),
    OptBlob(Option<Vec<u8>>),
}

impl From<i64> for Value {
    fn from(v: i64) -> Value {
        Value::I64(v)
    }
}
impl From<Option<i64>> for Value {
    fn from(v: Option<i64>) -> Value {
        Value::OptI64(v)
    }
}
impl From<&str> for Value {
    fn from(v: &str) -> Value {
        Value::Text(v.to_owned())
    }
}
impl From<String> for Value {
    fn from(v: String) -> Value {
        Value::Text(v)
    }
}
impl From<&String> for Value {
    fn from(v: &String) -> Value {
        Value::Text(v.clone())
    }
}
impl From<Option<&str>> for Value {
    fn from(v: Option<&str>) -> Value {
        Value::OptText(v.map(str::to_owned))
    }
}
impl From<Option<String>> for Value {
    fn from(v: Option<String>) -> Value {
        Value::OptText(v)
    }
}
impl From<Option<Vec<u8>>> for Value {
    fn from(v: Option<Vec<u8>>) -> Value {
        Value::OptBlob(v)
    }
}
impl From<&[u8]> for Value {
    fn from(v: &[u8]) -> Value {
        Value::Blob(v.to_vec())
    }
}
impl From<&[u8; 32]> for Value {
    fn from(v: &[u8; 32]) -> Value {
        Value::Blob(v.to_vec())
    }
}

/// `args![a, b, c]` → `&[Value]`.
macro_rules! args {
    ($($e:expr),* $(,)?) => { &[$($crate::db::Value::from($e)),*][..] };
}
pub(crate) use args;

fn bind_sqlite<'q>(mut q: Query<'q, Sqlite, SqliteArguments>, args: &[Value]) -> Query<'q, Sqlite, SqliteArguments> {
    for a in args {
        q = match a.clone() {
            Value::I64(v) => q.bind(v),
            Value::OptI64(v) => q.bind(v),
            Value::Text(v) => q.bind(v),
            Value::OptText(v) => q.bind(v),
            Value::Blob(v) => q.bind(v),
            Value::OptBlob(v) => q.bind(v),
        };
    }
    q
}

fn bind_pg<'q>(mut q: Query<'q, Postgres, PgArguments>, args: &[Value]) -> Query<'q, Postgres, PgArguments> {
    for a in args {
        q = match a.clone() {
            Value::I64(v) => q.bind(v),
            Value::OptI64(v) => q.bind(v),
            Value::Text(v) => q.bind(v),
            Value::OptText(v) => q.bind(v),
            Value::Blob(v) => q.bind(v),
            Value::OptBlob(v) => q.bind(v),
        };
    }
    q
}

/// One result row, decoded by column position.
pub(crate) enum Row {
    Sqlite(SqliteRow),
    Pg(PgRow),
}

impl Row {
    pub fn i64(&self, i: usize) -> Result<i64, sqlx::Error> {
        match self {
            Row::Sqlite(r) => r.try_get(i),
            Row::Pg(r) => r.try_get(i),
        }
    }
    pub fn opt_i64(&self, i: usize) -> Result<Option<i64>, sqlx::Error> {
        match self {
            Row::Sqlite(r) => r.try_get(i),
            Row::Pg(r) => r.try_get(i),
        }
    }
    pub fn text(&self, i: usize) -> Result<String, sqlx::Error> {
        match self {
            Row::Sqlite(r) => r.try_get(i),
            Row::Pg(r) => r.try_get(i),
        }
    }
    pub fn opt_text(&self, i: usize) -> Result<Option<String>, sqlx::Error> {
        match self {
            Row::Sqlite(r) => r.try_get(i),
            Row::Pg(r) => r.try_get(i),
        }
    }
    pub fn blob(&self, i: usize) -> Result<Vec<u8>, sqlx::Error> {
        match self {
            Row::Sqlite(r) => r.try_get(i),
            Row::Pg(r) => r.try_get(i),
        }
    }
}

/// A connection inside an open transaction (or a read snapshot).
pub(crate) enum Db<'c> {
    Sqlite(&'c mut SqliteConnection),
    // Constructed by the PostgreSQL backend (issue 3); the SQL of `ops` already runs on both.
    #[allow(dead_code)]
    Pg(&'c mut PgConnection),
}

impl Db<'_> {
    pub fn engine(&self) -> Engine {
        match self {
            Db::Sqlite(_) => Engine::Sqlite,
            Db::Pg(_) => Engine::Postgres,
        }
    }

    /// Runs a statement; returns the number of rows it changed.
    pub async fn exec(&mut self, sql: &'static str, args: &[Value]) -> Result<u64, sqlx::Error> {
        match self {
            Db::Sqlite(c) => Ok(bind_sqlite(sqlx::query(sql), args).execute(&mut **c).await?.rows_affected()),
            Db::Pg(c) => Ok(bind_pg(sqlx::query(sql), args).execute(&mut **c).await?.rows_affected()),
        }
    }

    pub async fn opt(&mut self, sql: &'static str, args: &[Value]) -> Result<Option<Row>, sqlx::Error> {
        match self {
            Db::Sqlite(c) => Ok(bind_sqlite(sqlx::query(sql), args).fetch_optional(&mut **c).await?.map(Row::Sqlite)),
            Db::Pg(c) => Ok(bind_pg(sqlx::query(sql), args).fetch_optional(&mut **c).await?.map(Row::Pg)),
        }
    }

    pub async fn one(&mut self, sql: &'static str, args: &[Value]) -> Result<Row, sqlx::Error> {
        self.opt(sql, args).await?.ok_or(sqlx::Error::RowNotFound)
    }

    pub async fn all(&mut self, sql: &'static str, args: &[Value]) -> Result<Vec<Row>, sqlx::Error> {
        match self {
            Db::Sqlite(c) => Ok(bind_sqlite(sqlx::query(sql), args)
                .fetch_all(&mut **c)
                .await?
                .into_iter()
                .map(Row::Sqlite)
                .collect()),
            Db::Pg(c) => {
                Ok(bind_pg(sqlx::query(sql), args).fetch_all(&mut **c).await?.into_iter().map(Row::Pg).collect())
            }
        }
    }

    /// For statements assembled from constant fragments and `$N` placeholders only (list filters).
    pub async fn all_built(&mut self, sql: String, args: &[Value]) -> Result<Vec<Row>, sqlx::Error> {
        match self {
            Db::Sqlite(c) => Ok(bind_sqlite(sqlx::query(AssertSqlSafe(sql)), args)
                .fetch_all(&mut **c)
                .await?
                .into_iter()
                .map(Row::Sqlite)
                .collect()),
            Db::Pg(c) => Ok(bind_pg(sqlx::query(AssertSqlSafe(sql)), args)
                .fetch_all(&mut **c)
                .await?
                .into_iter()
                .map(Row::Pg)
                .collect()),
        }
    }

    pub async fn opt_built(&mut self, sql: String, args: &[Value]) -> Result<Option<Row>, sqlx::Error> {
        Ok(self.all_built(sql, args).await?.into_iter().next())
    }
}
