//! A thin layer over one SQLite or PostgreSQL connection, so every transition is written once,
//! in SQL both engines read the same way (`$N` placeholders, `RETURNING`, `ON CONFLICT`).

use crate::error::StoreError;
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
    // Arrays, for PostgreSQL's `unnest($1::bigint[], …)` multi-row inserts only.
    I64s(Vec<i64>),
    OptI64s(Vec<Option<i64>>),
    Texts(Vec<String>),
    OptTexts(Vec<Option<String>>),
    OptBlobs(Vec<Option<Vec<u8>>>),
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

/// A typed id binds as its text (`args![&job.id]`).
macro_rules! value_from_id {
    ($($id:ident),+) => {$(
        impl From<&settle_core::ids::$id> for Value {
            fn from(v: &settle_core::ids::$id) -> Value {
                Value::Text(v.as_str().to_owned())
            }
        }
    )+};
}
value_from_id!(AccountId, JobId, ItemId, JobKind);

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
            Value::I64s(_) | Value::OptI64s(_) | Value::Texts(_) | Value::OptTexts(_) | Value::OptBlobs(_) => {
                unreachable!("arrays are bound on PostgreSQL only")
            }
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
            Value::I64s(v) => q.bind(v),
            Value::OptI64s(v) => q.bind(v),
            Value::Texts(v) => q.bind(v),
            Value::OptTexts(v) => q.bind(v),
            Value::OptBlobs(v) => q.bind(v),
        };
    }
    q
}

/// A column of a result row: a variant of a [`columns!`] enum, so every row is decoded by column
/// name from the list it was selected with. (There is deliberately no `Col` for a bare position.)
pub(crate) trait Col {
    fn at(self) -> usize;
}

/// A row's column list, written once: `columns!(JobCol { id, account_id, … })` defines an enum
/// whose variants are the columns (`row.text(JobCol::id)`) and `JobCol::LIST`, the list to select
/// (or return) them in that order. A column may name the SQL that selects it (`entry_kind =
/// "e.kind"` for joins, `total = "COUNT(*)"` for a computed one); `list_with` swaps one column's
/// SQL at run time.
macro_rules! columns {
    (@sql $col:ident) => { stringify!($col) };
    (@sql $col:ident = $sql:literal) => { $sql };
    ($(#[$meta:meta])* $vis:vis $name:ident {
        $first:ident $(= $first_sql:literal)? $(, $rest:ident $(= $rest_sql:literal)?)* $(,)?
    }) => {
        $(#[$meta])*
        #[allow(non_camel_case_types, dead_code)]
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        $vis enum $name {
            $first,
            $($rest,)*
        }

        #[allow(dead_code)]
        impl $name {
            /// The columns, comma-separated, in the order the variants name them.
            pub const LIST: &'static str =
                concat!(columns!(@sql $first $(= $first_sql)?) $(, ", ", columns!(@sql $rest $(= $rest_sql)?))*);
            /// How many columns `LIST` has.
            pub const COUNT: usize = [stringify!($first) $(, stringify!($rest))*].len();
            /// `LIST`, with `column` selected by `sql` instead: for a column whose SQL depends on
            /// the engine or on what was asked.
            pub fn list_with(column: Self, sql: &str) -> String {
                [
                    ($name::$first, columns!(@sql $first $(= $first_sql)?)),
                    $(($name::$rest, columns!(@sql $rest $(= $rest_sql)?)),)*
                ]
                .map(|(c, default)| if c == column { sql } else { default })
                .join(", ")
            }
        }

        impl $crate::db::Col for $name {
            fn at(self) -> usize {
                self as usize
            }
        }
    };
}
pub(crate) use columns;

/// A column set that carries every column of the set `B`, under the same names, beside columns
/// of its own (a join, a fingerprint, a sum): a row of it is decoded by `B`'s decoder, which reads
/// `B`'s columns through `of` (`entry_from_row::<CreditCol>`). Every set holds itself; [`holds!`]
/// writes the others.
pub(crate) trait Holds<B>: Col + Copy {
    fn of(column: B) -> Self;
}

impl<C: Col + Copy> Holds<C> for C {
    fn of(column: C) -> C {
        column
    }
}

/// `holds!(DeliveryCol: EventCol { seq, kind, … })`: `DeliveryCol` holds every column of
/// `EventCol` under the same name (the match is exhaustive, so a column left out does not compile).
macro_rules! holds {
    ($set:ident: $base:ident { $($col:ident),+ $(,)? }) => {
        impl $crate::db::Holds<$base> for $set {
            fn of(column: $base) -> $set {
                match column {
                    $($base::$col => $set::$col,)+
                }
            }
        }
    };
}
pub(crate) use holds;

/// One result row, decoded by column (see [`Col`]).
pub(crate) enum Row {
    Sqlite(SqliteRow),
    Pg(PgRow),
    /// A row read by the SQLite writer (rusqlite), copied out of the statement.
    Lite(Vec<rusqlite::types::Value>),
}

fn lite_value(r: &[rusqlite::types::Value], i: usize) -> Result<&rusqlite::types::Value, StoreError> {
    r.get(i).ok_or_else(|| StoreError::internal(format!("no column {i}")))
}

fn lite_type(i: usize, v: &rusqlite::types::Value, want: &str) -> StoreError {
    StoreError::internal(format!("column {i} is {:?}, not {want}", v.data_type()))
}

impl Row {
    // The typed reads by column are [`Cells`]'s, over this row: one set of them for both.
    pub fn i64(&self, c: impl Col) -> Result<i64, StoreError> {
        Cells::Row(self).i64(c)
    }
    pub fn opt_i64(&self, c: impl Col) -> Result<Option<i64>, StoreError> {
        Cells::Row(self).opt_i64(c)
    }
    pub fn text(&self, c: impl Col) -> Result<String, StoreError> {
        Cells::Row(self).text(c)
    }
    pub fn opt_text(&self, c: impl Col) -> Result<Option<String>, StoreError> {
        Cells::Row(self).opt_text(c)
    }
    fn opt_i64_at(&self, i: usize) -> Result<Option<i64>, StoreError> {
        match self {
            Row::Sqlite(r) => Ok(r.try_get(i)?),
            Row::Pg(r) => Ok(r.try_get(i)?),
            Row::Lite(r) => match lite_value(r, i)? {
                rusqlite::types::Value::Integer(v) => Ok(Some(*v)),
                rusqlite::types::Value::Null => Ok(None),
                v => Err(lite_type(i, v, "an integer")),
            },
        }
    }
    /// A text column, borrowed from the row (for [`Cells`]).
    fn opt_str_at(&self, i: usize) -> Result<Option<&str>, StoreError> {
        match self {
            Row::Sqlite(r) => Ok(r.try_get(i)?),
            Row::Pg(r) => Ok(r.try_get(i)?),
            Row::Lite(r) => match lite_value(r, i)? {
                rusqlite::types::Value::Text(v) => Ok(Some(v.as_str())),
                rusqlite::types::Value::Null => Ok(None),
                v => Err(lite_type(i, v, "text")),
            },
        }
    }
    /// A blob column, borrowed from the row (for [`Cells`]).
    fn bytes_at(&self, i: usize) -> Result<&[u8], StoreError> {
        match self {
            Row::Sqlite(r) => Ok(r.try_get(i)?),
            Row::Pg(r) => Ok(r.try_get(i)?),
            Row::Lite(r) => match lite_value(r, i)? {
                rusqlite::types::Value::Blob(v) => Ok(v.as_slice()),
                v => Err(lite_type(i, v, "a blob")),
            },
        }
    }
    pub fn opt_blob(&self, c: impl Col) -> Result<Option<Vec<u8>>, StoreError> {
        let i = c.at();
        match self {
            Row::Sqlite(r) => Ok(r.try_get(i)?),
            Row::Pg(r) => Ok(r.try_get(i)?),
            Row::Lite(r) => match lite_value(r, i)? {
                rusqlite::types::Value::Blob(v) => Ok(Some(v.clone())),
                rusqlite::types::Value::Null => Ok(None),
                v => Err(lite_type(i, v, "a blob")),
            },
        }
    }
    pub fn blob(&self, c: impl Col) -> Result<Vec<u8>, StoreError> {
        let i = c.at();
        match self {
            Row::Sqlite(r) => Ok(r.try_get(i)?),
            Row::Pg(r) => Ok(r.try_get(i)?),
            Row::Lite(r) => match lite_value(r, i)? {
                rusqlite::types::Value::Blob(v) => Ok(v.clone()),
                v => Err(lite_type(i, v, "a blob")),
            },
        }
    }
}

/// A row as [`Db::each`] streams it: on SQLite's own connections borrowed from the statement, so a
/// pass over a million rows copies no column out (the audit); elsewhere the decoded row.
pub(crate) enum Cells<'r> {
    Row(&'r Row),
    Lite(&'r rusqlite::Row<'r>),
    /// A row of PostgreSQL's binary `COPY … TO STDOUT` ([`Db::each_copied`]): each column's bytes
    /// in `data` as (start, length), length -1 for NULL.
    Copied {
        data: &'r [u8],
        fields: &'r [(usize, i32)],
    },
}

/// One column of a copied row: its bytes, `None` for NULL.
fn copied<'r>(data: &'r [u8], fields: &[(usize, i32)], i: usize) -> Result<Option<&'r [u8]>, StoreError> {
    let &(start, len) = fields.get(i).ok_or_else(|| StoreError::internal(format!("no column {i}")))?;
    Ok(usize::try_from(len).ok().map(|len| &data[start..start + len]))
}

impl Cells<'_> {
    fn lite<'a>(r: &'a rusqlite::Row<'_>, i: usize) -> Result<rusqlite::types::ValueRef<'a>, StoreError> {
        r.get_ref(i).map_err(StoreError::from_sqlite)
    }
    fn lite_type(i: usize, v: rusqlite::types::ValueRef<'_>, want: &str) -> StoreError {
        StoreError::internal(format!("column {i} is {:?}, not {want}", v.data_type()))
    }
    pub fn i64(&self, c: impl Col) -> Result<i64, StoreError> {
        let i = c.at();
        self.opt_i64_at(i)?.ok_or_else(|| StoreError::internal(format!("column {i} is NULL")))
    }
    pub fn opt_i64(&self, c: impl Col) -> Result<Option<i64>, StoreError> {
        self.opt_i64_at(c.at())
    }
    fn opt_i64_at(&self, i: usize) -> Result<Option<i64>, StoreError> {
        use rusqlite::types::ValueRef;
        match self {
            Cells::Row(r) => r.opt_i64_at(i),
            Cells::Lite(r) => match Self::lite(r, i)? {
                ValueRef::Integer(v) => Ok(Some(v)),
                ValueRef::Null => Ok(None),
                v => Err(Self::lite_type(i, v, "an integer")),
            },
            // A `bigint` is 8 bytes, big-endian: any other length is another type (an `integer`,
            // a `numeric`), refused as `try_get` refuses it.
            Cells::Copied { data, fields } => match copied(data, fields, i)? {
                Some(v) => <[u8; 8]>::try_from(v)
                    .map(|b| Some(i64::from_be_bytes(b)))
                    .map_err(|_| StoreError::internal(format!("column {i} is {} bytes, not a bigint", v.len()))),
                None => Ok(None),
            },
        }
    }
    pub fn text(&self, c: impl Col) -> Result<String, StoreError> {
        self.str(c).map(str::to_owned)
    }
    pub fn opt_text(&self, c: impl Col) -> Result<Option<String>, StoreError> {
        Ok(self.opt_str(c)?.map(str::to_owned))
    }
    pub fn str(&self, c: impl Col) -> Result<&str, StoreError> {
        let i = c.at();
        self.opt_str_at(i)?.ok_or_else(|| StoreError::internal(format!("column {i} is NULL")))
    }
    pub fn opt_str(&self, c: impl Col) -> Result<Option<&str>, StoreError> {
        self.opt_str_at(c.at())
    }
    fn opt_str_at(&self, i: usize) -> Result<Option<&str>, StoreError> {
        use rusqlite::types::ValueRef;
        match self {
            Cells::Row(r) => r.opt_str_at(i),
            Cells::Lite(r) => match Self::lite(r, i)? {
                ValueRef::Text(v) => std::str::from_utf8(v)
                    .map(Some)
                    .map_err(|e| StoreError::internal(format!("column {i} is not UTF-8: {e}"))),
                ValueRef::Null => Ok(None),
                v => Err(Self::lite_type(i, v, "text")),
            },
            Cells::Copied { data, fields } => match copied(data, fields, i)? {
                Some(v) => std::str::from_utf8(v)
                    .map(Some)
                    .map_err(|e| StoreError::internal(format!("column {i} is not UTF-8: {e}"))),
                None => Ok(None),
            },
        }
    }
    pub fn bytes(&self, c: impl Col) -> Result<&[u8], StoreError> {
        let i = c.at();
        match self {
            Cells::Row(r) => r.bytes_at(i),
            Cells::Lite(r) => match Self::lite(r, i)? {
                rusqlite::types::ValueRef::Blob(v) => Ok(v),
                v => Err(Self::lite_type(i, v, "a blob")),
            },
            Cells::Copied { data, fields } => {
                copied(data, fields, i)?.ok_or_else(|| StoreError::internal(format!("column {i} is NULL")))
            }
        }
    }
}

/// A connection inside an open transaction (or a read snapshot), and whether the statements run
/// through it changed anything (docs/design/batches-without-savepoints.md): a batch runs its
/// operations without a savepoint each, so an operation that fails must be known to have changed
/// nothing before the others may commit beside it.
pub(crate) struct Db<'c> {
    conn: Conn<'c>,
    touched: bool,
}

enum Conn<'c> {
    Sqlite(&'c mut SqliteConnection),
    Pg(&'c mut PgConnection),
    /// The SQLite writer's own connection (rusqlite, on the writer's thread): every statement runs
    /// in place, prepared once and cached, with no hop to another thread.
    Lite(&'c mut rusqlite::Connection),
}

/// What a statement may do, by its text, failing closed: anything not known to read only, or to
/// change only the rows it counts, counts as a change whenever it runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Effect {
    /// A `SELECT` with no `INTO`, no `INSERT`/`UPDATE`/`DELETE`/`MERGE` (row locks aside: `FOR
    /// UPDATE`, `FOR NO KEY UPDATE`) and no function but those in [`READ_ONLY_CALLS`].
    Reads,
    /// A plain `INSERT`, `UPDATE` or `DELETE` (no `WITH`): it changed rows exactly when it counted
    /// some (`returning`: the rows it returns are the rows it changed).
    Counts { returning: bool },
    /// Anything else (`WITH`, `NOTIFY`, `SET`, `LOCK`, `TRUNCATE`, a call nobody listed).
    Unknown,
}

/// Words a read-only `SELECT` may follow with `(`: SQL keywords and functions that change nothing.
/// `nextval` is among them: a sequence is outside every transaction (a savepoint never undid it).
const READ_ONLY_CALLS: &[&str] = &[
    "select",
    "in",
    "exists",
    "any",
    "all",
    "values",
    "as",
    "over",
    "filter",
    "cast",
    "and",
    "or",
    "not",
    "from",
    "where",
    "on",
    "join",
    "using",
    "then",
    "else",
    "when",
    "case",
    "by",
    "coalesce",
    "count",
    "max",
    "min",
    "sum",
    "abs",
    "unnest",
    "nextval",
    "least",
    "greatest",
    "length",
    "substr",
    "lower",
    "upper",
    "row_number",
    "array_agg",
    "string_agg",
    "json_agg",
    "json_build_array",
    "ifnull",
    "nullif",
    "pg_snapshot_xmin",
    "pg_current_snapshot",
    "pg_current_xact_id",
    "bigint",
    "int8",
    "text",
    "array",
    "row",
    "with",
    "is",
    "like",
];

/// The words of `sql` (letters, digits, `_`), each with whether `(` follows it.
fn words(sql: &str) -> impl Iterator<Item = (&str, bool)> {
    let bytes = sql.as_bytes();
    let is_word = |b: u8| b.is_ascii_alphanumeric() || b == b'_';
    let mut at = 0;
    std::iter::from_fn(move || {
        while at < bytes.len() && !is_word(bytes[at]) {
            at += 1;
        }
        if at == bytes.len() {
            return None;
        }
        let start = at;
        while at < bytes.len() && is_word(bytes[at]) {
            at += 1;
        }
        let next = bytes[at..].iter().find(|b| !b.is_ascii_whitespace());
        Some((&sql[start..at], next == Some(&b'(')))
    })
}

pub(crate) fn effect(sql: &str) -> Effect {
    let mut all = words(sql);
    let Some((first, _)) = all.next() else { return Effect::Unknown };
    let is = |w: &str, k: &str| w.eq_ignore_ascii_case(k);
    if ["INSERT", "UPDATE", "DELETE"].iter().any(|k| is(first, k)) {
        return Effect::Counts { returning: words(sql).any(|(w, _)| is(w, "RETURNING")) };
    }
    if !is(first, "SELECT") {
        return Effect::Unknown;
    }
    let mut previous = "";
    for (word, call) in words(sql).skip(1) {
        let locking = is(previous, "FOR") || is(previous, "KEY");
        let writes =
            ["INSERT", "DELETE", "MERGE", "INTO"].iter().any(|k| is(word, k)) || (is(word, "UPDATE") && !locking);
        let unknown_call = call && !READ_ONLY_CALLS.iter().any(|k| is(word, k));
        if writes || unknown_call {
            return Effect::Unknown;
        }
        previous = word;
    }
    Effect::Reads
}

/// `effect(sql)` of a statement whose text is `'static`, worked out once per thread (8.5 % of the
/// SQLite writer's instructions when worked out on every run). The text's address
/// and length name it for the life of the process; a built statement's text is freed and its
/// address reused, so built statements are never looked up here.
fn static_effect(sql: &'static str) -> Effect {
    use std::cell::RefCell;
    use std::collections::HashMap;
    thread_local! {
        static KNOWN: RefCell<HashMap<(usize, usize), Effect>> = RefCell::new(HashMap::new());
    }
    KNOWN.with(|known| *known.borrow_mut().entry((sql.as_ptr() as usize, sql.len())).or_insert_with(|| effect(sql)))
}

/// Whether a statement that ran changed anything: `counted` rows changed (`exec`) or returned
/// (the queries), `exec` telling which; `effect` is the statement's.
fn changed(effect: Effect, counted: u64, exec: bool) -> bool {
    match effect {
        Effect::Reads => false,
        Effect::Counts { returning } if exec || returning => counted > 0,
        Effect::Counts { .. } | Effect::Unknown => true,
    }
}

impl<'c> Db<'c> {
    pub fn sqlite(conn: &'c mut SqliteConnection) -> Db<'c> {
        Db { conn: Conn::Sqlite(conn), touched: false }
    }

    pub fn pg(conn: &'c mut PgConnection) -> Db<'c> {
        Db { conn: Conn::Pg(conn), touched: false }
    }

    pub fn lite(conn: &'c mut rusqlite::Connection) -> Db<'c> {
        Db { conn: Conn::Lite(conn), touched: false }
    }

    /// Whether a statement run through this `Db` may have changed a row: one that wrote a row, one
    /// that may write and failed (PostgreSQL aborts the transaction; SQLite undoes the statement,
    /// counted all the same), or a data-modifying `WITH`. The SQLite writer also compares the
    /// engine's own `total_changes`.
    pub fn touched(&self) -> bool {
        self.touched
    }
}

impl Db<'_> {
    pub fn engine(&self) -> Engine {
        match self.conn {
            Conn::Sqlite(_) | Conn::Lite(_) => Engine::Sqlite,
            Conn::Pg(_) => Engine::Postgres,
        }
    }

    /// Notes what a statement did: an error, or the rows it changed or returned.
    fn note<T>(
        &mut self,
        effect: Effect,
        result: Result<T, StoreError>,
        exec: bool,
        rows: impl FnOnce(&T) -> u64,
    ) -> Result<T, StoreError> {
        match &result {
            Ok(v) => self.touched |= changed(effect, rows(v), exec),
            Err(_) => self.touched = true,
        }
        result
    }

    /// Runs a statement; returns the number of rows it changed.
    pub async fn exec(&mut self, sql: &'static str, args: &[Value]) -> Result<u64, StoreError> {
        let result = match &mut self.conn {
            Conn::Sqlite(c) => bind_sqlite(sqlx::query(sql), args)
                .execute(&mut **c)
                .await
                .map(|r| r.rows_affected())
                .map_err(StoreError::from),
            Conn::Pg(c) => bind_pg(sqlx::query(sql), args)
                .execute(&mut **c)
                .await
                .map(|r| r.rows_affected())
                .map_err(StoreError::from),
            Conn::Lite(c) => lite_exec(c, sql, args),
        };
        self.note(static_effect(sql), result, true, |n| *n)
    }

    pub async fn opt(&mut self, sql: &'static str, args: &[Value]) -> Result<Option<Row>, StoreError> {
        let result = match &mut self.conn {
            Conn::Sqlite(c) => bind_sqlite(sqlx::query(sql), args)
                .fetch_optional(&mut **c)
                .await
                .map(|r| r.map(Row::Sqlite))
                .map_err(StoreError::from),
            Conn::Pg(c) => bind_pg(sqlx::query(sql), args)
                .fetch_optional(&mut **c)
                .await
                .map(|r| r.map(Row::Pg))
                .map_err(StoreError::from),
            Conn::Lite(c) => lite_query(c, sql, args, 1).map(|rows| rows.into_iter().next()),
        };
        self.note(static_effect(sql), result, false, |r| u64::from(r.is_some()))
    }

    pub async fn one(&mut self, sql: &'static str, args: &[Value]) -> Result<Row, StoreError> {
        self.opt(sql, args).await?.ok_or_else(|| StoreError::internal(format!("no row from {sql}")))
    }

    pub async fn all(&mut self, sql: &'static str, args: &[Value]) -> Result<Vec<Row>, StoreError> {
        self.all_of(sql, static_effect(sql), args).await
    }

    /// For statements assembled from constant fragments and `$N` placeholders only (list filters).
    pub async fn all_built(&mut self, sql: String, args: &[Value]) -> Result<Vec<Row>, StoreError> {
        self.all_of(&sql, effect(&sql), args).await
    }

    async fn all_of(&mut self, sql: &str, effect: Effect, args: &[Value]) -> Result<Vec<Row>, StoreError> {
        let result = match &mut self.conn {
            Conn::Sqlite(c) => bind_sqlite(sqlx::query(AssertSqlSafe(sql.to_owned())), args)
                .fetch_all(&mut **c)
                .await
                .map(|rows| rows.into_iter().map(Row::Sqlite).collect())
                .map_err(StoreError::from),
            Conn::Pg(c) => bind_pg(sqlx::query(AssertSqlSafe(sql.to_owned())), args)
                .fetch_all(&mut **c)
                .await
                .map(|rows| rows.into_iter().map(Row::Pg).collect())
                .map_err(StoreError::from),
            Conn::Lite(c) => lite_query(c, sql, args, usize::MAX),
        };
        self.note(effect, result, false, |r: &Vec<Row>| r.len() as u64)
    }

    /// [`Db::each`] for a statement with no parameters that reads many rows: on PostgreSQL it runs
    /// as a binary `COPY (…) TO STDOUT`, and each row's columns are read from its bytes, without
    /// the per-column type machinery of a result row (most of the client's time in the audit's
    /// pass over a million allocations, measured: docs/performance.md). Elsewhere, `each`.
    /// A statement built at run time (`Cow::Owned`) is for PostgreSQL only.
    pub async fn each_copied(
        &mut self,
        sql: std::borrow::Cow<'static, str>,
        mut f: impl FnMut(&Cells<'_>) -> Result<(), StoreError> + Send,
    ) -> Result<u64, StoreError> {
        use futures_util::TryStreamExt;
        let Conn::Pg(c) = &mut self.conn else {
            return match sql {
                std::borrow::Cow::Borrowed(sql) => self.each(sql, &[], f).await,
                std::borrow::Cow::Owned(_) => Err(StoreError::internal("a built statement is read by COPY only")),
            };
        };
        let sql = sql.as_ref();
        let copy = format!("COPY ({sql}) TO STDOUT (FORMAT binary)");
        let mut n = 0;
        let streamed: Result<(), StoreError> = async {
            let mut chunks = c.copy_out_raw(&copy).await?;
            let mut rows = CopyRows::default();
            while let Some(chunk) = chunks.try_next().await? {
                rows.buf.extend_from_slice(&chunk);
                n += rows.take(&mut f)?;
            }
            rows.finished()
        }
        .await;
        self.note(effect(sql), streamed.map(|()| n), false, |n| *n)
    }

    /// Streams the rows of `sql` through `f`, one at a time (nothing is collected); returns how many.
    pub async fn each(
        &mut self,
        sql: &'static str,
        args: &[Value],
        mut f: impl FnMut(&Cells<'_>) -> Result<(), StoreError> + Send,
    ) -> Result<u64, StoreError> {
        use futures_util::TryStreamExt;
        let mut n = 0;
        let streamed: Result<(), StoreError> = async {
            match &mut self.conn {
                Conn::Sqlite(c) => {
                    let mut rows = bind_sqlite(sqlx::query(sql), args).fetch(&mut **c);
                    while let Some(r) = rows.try_next().await? {
                        f(&Cells::Row(&Row::Sqlite(r)))?;
                        n += 1;
                    }
                }
                Conn::Pg(c) => {
                    let mut rows = bind_pg(sqlx::query(sql), args).fetch(&mut **c);
                    while let Some(r) = rows.try_next().await? {
                        f(&Cells::Row(&Row::Pg(r)))?;
                        n += 1;
                    }
                }
                Conn::Lite(c) => {
                    let mut stmt = c.prepare_cached(sql).map_err(StoreError::from_sqlite)?;
                    lite_bind(&mut stmt, args)?;
                    let mut rows = stmt.raw_query();
                    while let Some(row) = rows.next().map_err(StoreError::from_sqlite)? {
                        f(&Cells::Lite(row))?;
                        n += 1;
                    }
                }
            }
            Ok(())
        }
        .await;
        // A stream cut short by `f` may have stopped inside a statement that writes: counted.
        self.note(static_effect(sql), streamed.map(|()| n), false, |n| *n)
    }

    pub async fn opt_built(&mut self, sql: String, args: &[Value]) -> Result<Option<Row>, StoreError> {
        Ok(self.all_built(sql, args).await?.into_iter().next())
    }
}

/// Binds `args` to a rusqlite statement by the number in each `$N` placeholder (a placeholder may
/// repeat, and SQLite numbers parameters in order of first appearance, not by their names).
fn lite_bind(stmt: &mut rusqlite::CachedStatement<'_>, args: &[Value]) -> Result<(), StoreError> {
    use rusqlite::types::Null;
    for index in 1..=stmt.parameter_count() {
        let name = stmt.parameter_name(index).unwrap_or("");
        let n: usize = name
            .strip_prefix('$')
            .and_then(|d| d.parse().ok())
            .ok_or_else(|| StoreError::internal(format!("unsupported placeholder {name:?}")))?;
        let arg = args.get(n - 1).ok_or_else(|| StoreError::internal(format!("no argument for ${n}")))?;
        let bound = match arg {
            Value::I64(v) => stmt.raw_bind_parameter(index, v),
            Value::OptI64(Some(v)) => stmt.raw_bind_parameter(index, v),
            Value::Text(v) | Value::OptText(Some(v)) => stmt.raw_bind_parameter(index, v.as_str()),
            Value::Blob(v) | Value::OptBlob(Some(v)) => stmt.raw_bind_parameter(index, v.as_slice()),
            Value::OptI64(None) | Value::OptText(None) | Value::OptBlob(None) => stmt.raw_bind_parameter(index, Null),
            Value::I64s(_) | Value::OptI64s(_) | Value::Texts(_) | Value::OptTexts(_) | Value::OptBlobs(_) => {
                return Err(StoreError::internal("arrays are bound on PostgreSQL only"));
            }
        };
        bound.map_err(StoreError::from_sqlite)?;
    }
    Ok(())
}

fn lite_exec(c: &rusqlite::Connection, sql: &str, args: &[Value]) -> Result<u64, StoreError> {
    let mut stmt = c.prepare_cached(sql).map_err(StoreError::from_sqlite)?;
    lite_bind(&mut stmt, args)?;
    // A statement that writes nothing changed nothing (`changes()` would still report the last write).
    let writes = !stmt.readonly();
    let mut rows = stmt.raw_query();
    // Steps the statement to its end (a `RETURNING` clause yields rows that are not read here).
    while rows.next().map_err(StoreError::from_sqlite)?.is_some() {}
    drop(rows);
    Ok(if writes { c.changes() } else { 0 })
}

fn lite_query(c: &rusqlite::Connection, sql: &str, args: &[Value], max: usize) -> Result<Vec<Row>, StoreError> {
    let mut stmt = c.prepare_cached(sql).map_err(StoreError::from_sqlite)?;
    lite_bind(&mut stmt, args)?;
    let columns = stmt.column_count();
    let mut out = Vec::new();
    let mut rows = stmt.raw_query();
    while let Some(row) = rows.next().map_err(StoreError::from_sqlite)? {
        if out.len() < max {
            let values = (0..columns)
                .map(|i| row.get::<_, rusqlite::types::Value>(i))
                .collect::<Result<Vec<_>, _>>()
                .map_err(StoreError::from_sqlite)?;
            out.push(Row::Lite(values));
        }
    }
    Ok(out)
}

/// A database URL fit for a log line or an error message: a password — in the authority
/// (`user:secret@host`) or a `password=` parameter — replaced by `***`.
pub fn redacted_url(url: &str) -> String {
    // The user info is everything between `://` and the last `@`, so a raw `@`, `/`, `?` or `#`
    // in the password hides with it.
    let unauthored = match url.split_once("://") {
        Some((scheme, rest)) => match rest.rsplit_once('@') {
            Some((userinfo, host)) => match userinfo.split_once(':') {
                Some((user, _)) => format!("{scheme}://{user}:***@{host}"),
                None => url.to_owned(),
            },
            None => url.to_owned(),
        },
        None => url.to_owned(),
    };
    let (head, query) = match unauthored.split_once('?') {
        Some((head, query)) => (head.to_owned(), Some(query.to_owned())),
        None => (unauthored, None),
    };
    let mut out = head;
    if let Some(query) = query {
        let params: Vec<String> = query
            .split('&')
            .map(|p| match p.split_once('=') {
                Some((k, _)) if k.eq_ignore_ascii_case("password") => format!("{k}=***"),
                _ => p.to_owned(),
            })
            .collect();
        out.push('?');
        out.push_str(&params.join("&"));
    }
    out
}

#[cfg(test)]
mod redaction_tests {
    use super::redacted_url;

    #[test]
    fn passwords_never_reach_a_log_line() {
        for (url, shown) in [
            ("postgres://settle:s3cret@db:5432/settle", "postgres://settle:***@db:5432/settle"),
            (
                "postgres://settle:p@ss/w0rd@db/settle?sslmode=require",
                "postgres://settle:***@db/settle?sslmode=require",
            ),
            ("postgres://db/settle?user=u&password=s3cret&x=1", "postgres://db/settle?user=u&password=***&x=1"),
            ("postgres://settle@db/settle", "postgres://settle@db/settle"),
            ("postgres://u:pa?ss#w0rd@db/settle", "postgres://u:***@db/settle"),
            ("sqlite://settle.db", "sqlite://settle.db"),
            ("sqlite:///var/lib/settle/settle.db", "sqlite:///var/lib/settle/settle.db"),
        ] {
            assert_eq!(redacted_url(url), shown, "{url}");
            assert!(!redacted_url(url).contains("s3cret") && !redacted_url(url).contains("w0rd"));
        }
    }
}

#[cfg(test)]
mod effect_tests {
    use super::{Effect, changed, effect, static_effect};

    #[test]
    fn only_plain_reads_and_counted_writes_are_trusted() {
        for sql in [
            "SELECT id, state FROM jobs WHERE id = $1 FOR UPDATE",
            "SELECT a.balance FROM accounts a WHERE a.id = $1 FOR NO KEY UPDATE",
            "select updated_at, count(*) from jobs where id in ($1, $2)",
            "SELECT nextval('ledger_seq_numbers') FROM unnest($1::bigint[])",
            "SELECT 1 FROM accounts WHERE id = $1",
        ] {
            assert_eq!(effect(sql), Effect::Reads, "{sql}");
        }
        for sql in [
            "SELECT pg_notify('settle_events', '')",
            "SELECT setval('job_seq_numbers', 5)",
            "SELECT set_config('x', 'y', true)",
            "SELECT pg_advisory_xact_lock(1)",
            "SELECT * INTO copy FROM jobs",
            "SELECT my_function($1)",
            "WITH moved AS (UPDATE items SET state = 'x' RETURNING id) SELECT count(*) FROM moved",
            "/* c */ WITH x AS (DELETE FROM jobs RETURNING id) SELECT 1",
            "NOTIFY settle_wake",
            "TRUNCATE jobs",
            "SET LOCAL lock_timeout = '1s'",
            "LOCK TABLE jobs",
        ] {
            assert_eq!(effect(sql), Effect::Unknown, "{sql}");
            assert!(changed(effect(sql), 0, true) && changed(effect(sql), 0, false), "{sql}");
        }
        let update = "UPDATE jobs SET state = 'x' WHERE id = $1 AND state = 'y'";
        assert_eq!(effect(update), Effect::Counts { returning: false });
        assert!(!changed(effect(update), 0, true) && changed(effect(update), 1, true));
        // Sent as a query without RETURNING: the rows it returns say nothing of what it changed.
        assert!(changed(effect(update), 0, false));
        let insert = "INSERT INTO jobs (id) VALUES ($1) ON CONFLICT DO NOTHING RETURNING id";
        assert!(!changed(effect(insert), 0, false) && changed(effect(insert), 1, false));
        // Remembered per statement text, each its own, whichever is asked first.
        for _ in 0..2 {
            assert_eq!(static_effect(update), Effect::Counts { returning: false });
            assert_eq!(static_effect(insert), Effect::Counts { returning: true });
            assert_eq!(static_effect("SELECT id FROM jobs"), Effect::Reads);
            assert_eq!(static_effect("NOTIFY settle_wake"), Effect::Unknown);
        }
    }
}

/// The rows of a binary `COPY … TO STDOUT` as its chunks come (a chunk need not end where a row
/// does): the signature and header, then per row a 16-bit count of columns and each column as a
/// 32-bit length (-1: NULL) and its bytes, then -1 for the end (PostgreSQL's "Binary Format").
#[derive(Default)]
struct CopyRows {
    buf: Vec<u8>,
    header: bool,
    ended: bool,
    fields: Vec<(usize, i32)>,
}

const COPY_SIGNATURE: &[u8] = b"PGCOPY\n\xff\r\n\0";

impl CopyRows {
    /// Every whole row in the buffer, to `f`; the rest kept for the next chunk. Returns the rows.
    fn take(&mut self, f: &mut impl FnMut(&Cells<'_>) -> Result<(), StoreError>) -> Result<u64, StoreError> {
        let mut at = 0;
        let mut n = 0;
        if !self.header {
            let Some(len) = self.header_len()? else { return Ok(0) };
            at = len;
            self.header = true;
        }
        while !self.ended {
            match self.row(at)? {
                None => break,
                Some((end, true)) => (at, self.ended) = (end, true),
                Some((end, false)) => {
                    f(&Cells::Copied { data: &self.buf, fields: &self.fields })?;
                    n += 1;
                    at = end;
                }
            }
        }
        self.buf.drain(..at);
        Ok(n)
    }

    /// The header's length, once it is all in the buffer.
    fn header_len(&self) -> Result<Option<usize>, StoreError> {
        let fixed = COPY_SIGNATURE.len() + 8;
        if self.buf.len() < fixed {
            return Ok(None);
        }
        if &self.buf[..COPY_SIGNATURE.len()] != COPY_SIGNATURE {
            return Err(StoreError::internal("a copy without the binary format's signature"));
        }
        // The flags' high half is what a reader must refuse when it does not know it (bit 16: the
        // rows carry OIDs).
        let at = COPY_SIGNATURE.len();
        if u32::from_be_bytes([self.buf[at], self.buf[at + 1], self.buf[at + 2], self.buf[at + 3]]) >> 16 != 0 {
            return Err(StoreError::internal("a copy with header flags this reader does not know"));
        }
        let extension =
            u32::from_be_bytes([self.buf[fixed - 4], self.buf[fixed - 3], self.buf[fixed - 2], self.buf[fixed - 1]]);
        let len = fixed + extension as usize;
        Ok((self.buf.len() >= len).then_some(len))
    }

    /// The row at `at` into `fields`: where it ends and whether it is the end marker, or `None`
    /// when it is not all in the buffer yet.
    fn row(&mut self, at: usize) -> Result<Option<(usize, bool)>, StoreError> {
        let buf = &self.buf;
        let Some(count) = buf.get(at..at + 2) else { return Ok(None) };
        let count = i16::from_be_bytes([count[0], count[1]]);
        self.fields.clear();
        let mut p = at + 2;
        if count == -1 {
            return Ok(Some((p, true)));
        }
        let count =
            usize::try_from(count).map_err(|_| StoreError::internal(format!("a copied row of {count} columns")))?;
        for _ in 0..count {
            let Some(len) = buf.get(p..p + 4) else { return Ok(None) };
            let len = i32::from_be_bytes([len[0], len[1], len[2], len[3]]);
            p += 4;
            self.fields.push((p, len));
            match usize::try_from(len) {
                Ok(len) if buf.len() < p + len => return Ok(None),
                Ok(len) => p += len,
                Err(_) if len == -1 => {}
                Err(_) => return Err(StoreError::internal(format!("a copied column of length {len}"))),
            }
        }
        Ok(Some((p, false)))
    }

    /// The copy ended where the format says it does: the header, whole rows, the end marker.
    fn finished(&self) -> Result<(), StoreError> {
        match self.ended && self.buf.is_empty() {
            true => Ok(()),
            false => Err(StoreError::internal("a copy ended before its end marker")),
        }
    }
}

#[cfg(test)]
mod copy_tests {
    use super::{COPY_SIGNATURE, Cells, CopyRows};
    use crate::error::StoreError;

    /// A binary copy of rows of (bigint, text) as PostgreSQL writes it, NULLs as `None`.
    fn copy_of(rows: &[(Option<i64>, Option<&str>)]) -> Vec<u8> {
        let mut out = COPY_SIGNATURE.to_vec();
        out.extend(0i32.to_be_bytes()); // flags
        out.extend(4u32.to_be_bytes()); // a header extension of 4 bytes, skipped
        out.extend([9, 9, 9, 9]);
        for (n, s) in rows {
            out.extend(2i16.to_be_bytes());
            match n {
                Some(n) => out.extend(8i32.to_be_bytes().into_iter().chain(n.to_be_bytes())),
                None => out.extend((-1i32).to_be_bytes()),
            }
            match s {
                Some(s) => out.extend((s.len() as i32).to_be_bytes().into_iter().chain(s.bytes())),
                None => out.extend((-1i32).to_be_bytes()),
            }
        }
        out.extend((-1i16).to_be_bytes());
        out
    }

    /// The rows read back from `bytes` cut into chunks of `size`.
    type Read = Vec<(Option<i64>, Option<String>)>;

    fn read(bytes: &[u8], size: usize) -> Result<Read, StoreError> {
        let mut rows = CopyRows::default();
        let mut got = Vec::new();
        for chunk in bytes.chunks(size) {
            rows.buf.extend_from_slice(chunk);
            rows.take(&mut |r: &Cells<'_>| {
                got.push((r.opt_i64(C::N)?, r.opt_text(C::S)?));
                Ok(())
            })?;
        }
        rows.finished().map(|()| got)
    }

    #[derive(Clone, Copy)]
    enum C {
        N,
        S,
    }
    impl crate::db::Col for C {
        fn at(self) -> usize {
            self as usize
        }
    }

    #[test]
    fn a_binary_copy_reads_back_whatever_its_chunks() {
        let rows = [(Some(-7), Some("é")), (None, Some("")), (Some(i64::MAX), None), (Some(0), Some("job-1"))];
        let bytes = copy_of(&rows);
        let want: Vec<_> = rows.iter().map(|(n, s)| (*n, s.map(str::to_owned))).collect();
        for size in [1, 2, 3, 7, 19, bytes.len()] {
            assert_eq!(read(&bytes, size).unwrap(), want, "chunks of {size}");
        }
        assert_eq!(read(&copy_of(&[]), 5).unwrap(), vec![]);
    }

    #[test]
    fn a_copy_cut_short_or_of_another_shape_is_refused() {
        let bytes = copy_of(&[(Some(1), Some("a"))]);
        assert!(read(&bytes[..bytes.len() - 2], 4).is_err(), "no end marker");
        assert!(read(&bytes[..bytes.len() - 5], 4).is_err(), "a row cut short");
        let mut wrong = bytes.clone();
        wrong[0] = b'X';
        assert!(read(&wrong, 64).is_err(), "no signature");
        // An `integer` (4 bytes) where a bigint is read: refused, as `try_get` refuses it.
        let mut int4 = COPY_SIGNATURE.to_vec();
        int4.extend(0i32.to_be_bytes().into_iter().chain(0u32.to_be_bytes()));
        int4.extend(2i16.to_be_bytes().into_iter().chain(4i32.to_be_bytes()).chain(5i32.to_be_bytes()));
        int4.extend((-1i32).to_be_bytes().into_iter().chain((-1i16).to_be_bytes()));
        assert!(read(&int4, 64).is_err());
        // A length below -1, and header flags a reader must refuse (bit 16: OIDs).
        let mut negative = COPY_SIGNATURE.to_vec();
        negative.extend(0i32.to_be_bytes().into_iter().chain(0u32.to_be_bytes()));
        negative.extend(1i16.to_be_bytes().into_iter().chain((-2i32).to_be_bytes()).chain((-1i16).to_be_bytes()));
        assert!(read(&negative, 64).is_err());
        let mut oids = copy_of(&[]);
        oids[COPY_SIGNATURE.len() + 1] = 1;
        assert!(read(&oids, 64).is_err());
    }
}
