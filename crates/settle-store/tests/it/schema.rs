//! The two engines' schemas stay one schema: after every migration, SQLite and PostgreSQL have the
//! same tables, the same columns in each, and the same explicitly created indexes on the same columns,
//! a partial one under the same condition (compared as text, each engine's spelling made plain:
//! `condition`).
//! (Types differ by design — `bytea`/`BLOB`, `bigint`/`INTEGER` — and so do the names the engines give
//! to primary keys and column-level UNIQUE constraints, which are left out.) Indexes differ on
//! purpose: `ledger_entries_chain`, which SQLite replaced by a trigger of that name (migration 0034,
//! decision 0037); and SQLite files a job's ledger lines and allocations by its number (migration
//! 0037, decision 0039), where PostgreSQL keeps the indexes on its id whole. The test says exactly
//! that.

use settle_store::{SqlStore, StoreOptions};
use sqlx::{ConnectOptions, Connection, Row};
use std::collections::BTreeMap;
use std::str::FromStr;

/// An index: its name, its columns in order, and a partial one's condition (`condition`).
type Index = (String, Vec<String>, Option<String>);
type Schema = BTreeMap<String, (Vec<String>, Vec<Index>)>;

/// A partial index's condition as both engines would print it alike: PostgreSQL's casts
/// (`'dead'::text`, a number quoted before its cast: `'9223372036854775807'::bigint`) taken out,
/// keywords and names in lower case (literals as written), then its tree of ANDs and ORs written
/// with exactly one pair of parentheses around each (`tree`), so parentheses an engine adds or
/// leaves out change nothing and a different grouping changes the text.
fn condition(sql: &str) -> String {
    let mut out = String::new();
    let mut chars = sql.chars().peekable();
    while let Some(c) = chars.next() {
        match c {
            '\'' => {
                let mut literal = String::new();
                while let Some(c) = chars.next() {
                    if c == '\'' && chars.peek() == Some(&'\'') {
                        chars.next();
                        literal.push_str("''");
                    } else if c == '\'' {
                        break;
                    } else {
                        literal.push(c);
                    }
                }
                if chars.peek() == Some(&':') && literal.parse::<i64>().is_ok() {
                    out.push_str(&literal);
                } else {
                    out.push_str(&format!("'{literal}'"));
                }
            }
            ':' if chars.peek() == Some(&':') => {
                chars.next();
                while chars.peek().is_some_and(|c| c.is_alphanumeric() || *c == '_') {
                    chars.next();
                }
            }
            '(' | ')' => out.push_str(&format!(" {c} ")),
            c => out.extend(c.to_lowercase()),
        }
    }
    let tokens: Vec<&str> = out.split_whitespace().collect();
    let mut at = 0;
    let tree = Cond::read(&tokens, &mut at);
    assert_eq!(at, tokens.len(), "the whole condition is read: {sql}");
    tree.to_string()
}

/// A condition's tree: ANDs of ORs of leaves (a comparison, as its tokens), nested ANDs in an AND
/// (and ORs in an OR) made one level, since they mean the same.
enum Cond {
    Leaf(String),
    And(Vec<Cond>),
    Or(Vec<Cond>),
}

impl Cond {
    /// `a or b …` of `x and y …` of leaves and parenthesized conditions, from `tokens[*at]` up to a
    /// `)` it did not open, or the end.
    fn read(tokens: &[&str], at: &mut usize) -> Cond {
        let mut ors = Vec::new();
        loop {
            let mut ands = Vec::new();
            loop {
                let part = if tokens.get(*at) == Some(&"(") {
                    *at += 1;
                    let inner = Cond::read(tokens, at);
                    assert_eq!(tokens.get(*at), Some(&")"), "a closing parenthesis");
                    *at += 1;
                    // A parenthesized operand (PostgreSQL's `(kind)::text <> …`): the comparison
                    // goes on.
                    match (inner, tokens.get(*at)) {
                        (Cond::Leaf(left), Some(t)) if !["and", "or", ")"].contains(t) => {
                            Cond::Leaf(format!("{left} {}", Cond::leaf(tokens, at)))
                        }
                        (inner, _) => inner,
                    }
                } else {
                    Cond::Leaf(Cond::leaf(tokens, at))
                };
                match part {
                    Cond::And(inner) => ands.extend(inner),
                    part => ands.push(part),
                }
                if tokens.get(*at) != Some(&"and") {
                    break;
                }
                *at += 1;
            }
            match (ands.len(), ands.pop()) {
                (1, Some(Cond::Or(inner))) => ors.extend(inner),
                (1, Some(one)) => ors.push(one),
                (_, last) => {
                    ands.extend(last);
                    ors.push(Cond::And(ands));
                }
            }
            if tokens.get(*at) != Some(&"or") {
                break;
            }
            *at += 1;
        }
        if ors.len() == 1 { ors.remove(0) } else { Cond::Or(ors) }
    }
}

impl Cond {
    /// A comparison's tokens, up to an `and` or `or` outside its own parentheses or a `)` it did not
    /// open; its own parentheses left out (they group operands, never conditions, in an index's
    /// condition).
    fn leaf(tokens: &[&str], at: &mut usize) -> String {
        let (mut words, mut depth) = (Vec::new(), 0);
        while let Some(&t) = tokens.get(*at) {
            match t {
                "(" => depth += 1,
                ")" if depth == 0 => break,
                ")" => depth -= 1,
                "and" | "or" if depth == 0 => break,
                t => words.push(t),
            }
            *at += 1;
        }
        words.join(" ")
    }
}

impl std::fmt::Display for Cond {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (word, parts) = match self {
            Cond::Leaf(text) => return f.write_str(text),
            Cond::And(parts) => ("and", parts),
            Cond::Or(parts) => ("or", parts),
        };
        let parts: Vec<String> = parts.iter().map(|p| p.to_string()).collect();
        write!(f, "{word}({})", parts.join(", "))
    }
}

/// The condition's tree tells groupings apart and nothing else.
#[test]
fn conditions_compare_by_their_tree() {
    let pg = "((state = 'dead'::text) OR ((state = 'queued'::text) AND (last_error_code IS NOT NULL)))";
    assert_eq!(condition(pg), condition("state = 'dead' OR (state = 'queued' AND last_error_code IS NOT NULL)"));
    assert_eq!(condition(pg), "or(state = 'dead', and(state = 'queued', last_error_code is not null))");
    assert_ne!(condition("a = 1 AND (b = 1 OR c = 1)"), condition("(a = 1 AND b = 1) OR c = 1"));
    assert_ne!(condition("state = 'Dead'"), condition("state = 'dead'"));
    assert_eq!(condition("x < '9223372036854775807'::bigint"), condition("x < 9223372036854775807"));
    assert_eq!(condition("((a = 1) AND (b = 1)) AND c = 1"), condition("a = 1 AND b = 1 AND c = 1"));
    assert_eq!(condition("((kind)::text <> 'withdrawal'::text)"), condition("kind <> 'withdrawal'"));
}

/// The first column of every row of `sql` (with `bind` as `$1` when given), on SQLite.
async fn lite_names(c: &mut sqlx::SqliteConnection, sql: String, bind: Option<&str>) -> Vec<String> {
    let mut q = sqlx::query(sqlx::AssertSqlSafe(sql));
    if let Some(b) = bind {
        q = q.bind(b.to_owned());
    }
    q.fetch_all(c).await.unwrap().iter().map(|r| r.get(0)).collect()
}

/// The first column of every row of `sql` (with `bind` as `$1` when given), on PostgreSQL.
async fn pg_names(c: &mut sqlx::PgConnection, sql: &'static str, bind: Option<&str>) -> Vec<String> {
    let mut q = sqlx::query(sql);
    if let Some(b) = bind {
        q = q.bind(b.to_owned());
    }
    q.fetch_all(c).await.unwrap().iter().map(|r| r.get(0)).collect()
}

async fn sqlite_schema(url: &str) -> Schema {
    let mut c = sqlx::sqlite::SqliteConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    let tables = lite_names(
        &mut c,
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%' \
         AND name <> '_sqlx_migrations' ORDER BY name"
            .into(),
        None,
    )
    .await;
    let mut schema = Schema::new();
    for t in tables {
        let mut columns = lite_names(&mut c, format!("SELECT name FROM pragma_table_info('{t}')"), None).await;
        columns.sort();
        let names = lite_names(
            &mut c,
            "SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = $1 AND sql IS NOT NULL ORDER BY name"
                .into(),
            Some(&t),
        )
        .await;
        let mut indexes = Vec::new();
        for i in names {
            let cols =
                lite_names(&mut c, format!("SELECT name FROM pragma_index_info('{i}') ORDER BY seqno"), None).await;
            let sql = lite_names(&mut c, "SELECT sql FROM sqlite_master WHERE name = $1".into(), Some(&i)).await;
            let at = sql[0].find(" WHERE ");
            indexes.push((i, cols, at.map(|at| condition(&sql[0][at + " WHERE ".len()..]))));
        }
        schema.insert(t, (columns, indexes));
    }
    c.close().await.unwrap();
    schema
}

async fn postgres_schema(url: &str) -> Schema {
    let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    let tables = pg_names(
        &mut c,
        // Tables only: the views `outbox` and `outbox_pending` serve processes of the release before
        // migration 0024 during a rolling upgrade, and SQLite has no rolling upgrades.
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = current_schema() \
         AND table_type = 'BASE TABLE' AND table_name <> '_sqlx_migrations' ORDER BY 1",
        None,
    )
    .await;
    let mut schema = Schema::new();
    for t in tables {
        let mut columns = pg_names(
            &mut c,
            "SELECT column_name::text FROM information_schema.columns WHERE table_schema = current_schema() \
             AND table_name = $1",
            Some(&t),
        )
        .await;
        columns.sort();
        // Indexes that back no constraint: the ones made by CREATE INDEX.
        let rows = sqlx::query(
            "SELECT ic.relname::text, a.attname::text, pg_get_expr(x.indpred, x.indrelid) FROM pg_index x \
             JOIN pg_class ic ON ic.oid = x.indexrelid JOIN pg_class tc ON tc.oid = x.indrelid \
             JOIN LATERAL unnest(x.indkey) WITH ORDINALITY AS k(attnum, ord) ON true \
             JOIN pg_attribute a ON a.attrelid = tc.oid AND a.attnum = k.attnum \
             WHERE tc.relname = $1 AND tc.relnamespace = current_schema()::regnamespace \
             AND NOT EXISTS (SELECT 1 FROM pg_constraint con WHERE con.conindid = x.indexrelid) \
             ORDER BY 1, k.ord",
        )
        .bind(&t)
        .fetch_all(&mut c)
        .await
        .unwrap();
        let mut indexes: Vec<Index> = Vec::new();
        for r in &rows {
            let (name, column, predicate): (String, String, Option<String>) = (r.get(0), r.get(1), r.get(2));
            match indexes.last_mut() {
                Some((last, cols, _)) if *last == name => cols.push(column),
                _ => indexes.push((name, vec![column], predicate.as_deref().map(condition))),
            }
        }
        schema.insert(t, (columns, indexes));
    }
    c.close().await.unwrap();
    schema
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_and_postgres_have_the_same_tables_columns_and_indexes() {
    let dir = tempfile::tempdir().unwrap();
    let sqlite_url = format!("sqlite://{}", dir.path().join("schema.db").display());
    drop(SqlStore::open(&sqlite_url, StoreOptions::default()).await.unwrap());
    let pg_url = settle_testkit::fresh_database().await;
    drop(SqlStore::open(&pg_url, StoreOptions::default()).await.unwrap());
    let (lite, mut pg) = (sqlite_schema(&sqlite_url).await, postgres_schema(&pg_url).await);
    assert!(lite.contains_key("ledger_entries") && lite["ledger_entries"].1.len() >= 3, "the reader sees the schema");
    let partial = |s: &Schema| s["events"].1.iter().filter(|(_, _, c)| c.is_some()).count();
    assert_eq!((partial(&lite), partial(&pg)), (2, 2), "the readers see partial indexes' conditions");
    // PostgreSQL's unique index on (account_id, prev_hash) is SQLite's trigger: taken out here, and
    // each checked for on its own engine.
    let chain = ("ledger_entries_chain".to_owned(), vec!["account_id".to_owned(), "prev_hash".to_owned()], None);
    let ledger = &mut pg.get_mut("ledger_entries").expect("the ledger").1;
    let at = ledger.iter().position(|i| *i == chain).expect("PostgreSQL keeps ledger_entries_chain");
    ledger.remove(at);
    let mut c = sqlx::SqliteConnection::connect(&sqlite_url).await.unwrap();
    let triggers = lite_names(
        &mut c,
        "SELECT name FROM sqlite_master WHERE type = 'trigger' AND tbl_name IN ('ledger_entries', 'allocations', 'jobs') \
         ORDER BY name"
            .into(),
        None,
    )
    .await;
    let ours = [
        "ledger_entries_chain",
        "ledger_entries_job_seq",
        "allocations_job_seq",
        "allocations_keys_fixed",
        "jobs_keys_fixed",
    ];
    for t in ours {
        assert!(triggers.contains(&t.to_owned()), "SQLite's trigger {t}: {triggers:?}");
    }
    // A job's ledger lines and allocations: SQLite files them by the job's number, its guard checked
    // by the triggers above, and keeps the id's indexes for rows without one; PostgreSQL keeps the
    // id's indexes whole (migration 0037, decision 0039). Each engine's taken out here, checked.
    let strings = |v: &[&str]| v.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>();
    // (`allocations_item` has been partial on both engines since 0017: `job_id IS NOT NULL`.)
    let by_number = |table: &str, seq: (&str, &[&str]), id: (&str, &[&str]), whole: Option<&str>| {
        [
            (table.to_owned(), (seq.0.to_owned(), strings(seq.1), Some(condition("job_seq IS NOT NULL")))),
            (
                table.to_owned(),
                (id.0.to_owned(), strings(id.1), Some(condition("job_id IS NOT NULL AND job_seq IS NULL"))),
            ),
            (table.to_owned(), (id.0.to_owned(), strings(id.1), whole.map(condition))),
        ]
    };
    let money = [
        by_number(
            "ledger_entries",
            ("ledger_entries_job_seq", &["job_seq", "item_id", "kind"]),
            ("ledger_entries_item_kind", &["job_id", "item_id", "kind"]),
            None,
        ),
        by_number(
            "allocations",
            ("allocations_job_seq", &["job_seq", "item_id", "id"]),
            ("allocations_item", &["job_id", "item_id", "id"]),
            Some("job_id IS NOT NULL"),
        ),
    ];
    let mut lite = lite;
    for [(table, seq), (_, id), (_, whole)] in money {
        let indexes = &mut lite.get_mut(&table).expect("the table").1;
        for index in [seq, id] {
            let at = indexes.iter().position(|i| *i == index);
            indexes.remove(at.unwrap_or_else(|| panic!("SQLite's {index:?} in {indexes:?}")));
        }
        let indexes = &mut pg.get_mut(&table).expect("the table").1;
        let at = indexes.iter().position(|i| *i == whole);
        indexes.remove(at.unwrap_or_else(|| panic!("PostgreSQL's {whole:?} in {indexes:?}")));
    }
    assert_eq!(lite.keys().collect::<Vec<_>>(), pg.keys().collect::<Vec<_>>(), "tables");
    for (table, (columns, indexes)) in &lite {
        let (pg_columns, pg_indexes) = &pg[table];
        assert_eq!(columns, pg_columns, "columns of {table}");
        assert_eq!(indexes, pg_indexes, "indexes of {table}");
    }
}

/// A new SQLite store, migrated, and a plain connection to it (the directory lives as long as it).
async fn fresh_sqlite() -> (tempfile::TempDir, sqlx::SqliteConnection) {
    let dir = tempfile::tempdir().unwrap();
    let url = format!("sqlite://{}", dir.path().join("store.db").display());
    drop(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    let c = sqlx::sqlite::SqliteConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
    (dir, c)
}

/// SQLite builds a temporary b-tree for `x IN (a, b, c, …)` (three values or more) every time a
/// statement that evaluates it runs: in a CHECK, on every write of its column. Migration 0026 wrote
/// those CHECKs as comparisons; a write of each hot table's checked columns opens none.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_writes_of_checked_columns_build_no_temporary_table() {
    let (_dir, mut c) = fresh_sqlite().await;
    for sql in [
        "UPDATE jobs SET state = ?1, refund_on = ?2, cancel_requested = ?3 WHERE id = ?4",
        "UPDATE items SET state = ?1, refund_reason = ?2 WHERE job_id = ?3 AND item_id = ?4",
        "INSERT INTO ledger_entries (seq, account_id, kind, amount, balance_after, job_id, item_id, ref_id, \
         created_at, prev_hash, hash, account_seq) VALUES (?1, ?2, ?3, ?4, ?5, ?6, ?7, ?8, ?9, ?10, ?11, ?12)",
        "UPDATE grants SET origin = ?1 WHERE key = ?2",
        "UPDATE allocations SET kind = ?1 WHERE id = ?2",
        "UPDATE webhook_deliveries SET state = ?1 WHERE event_seq = ?2",
        "UPDATE webhook_breakers SET state = ?1 WHERE endpoint_id = ?2",
    ] {
        let program = sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN {sql}"))).fetch_all(&mut c).await.unwrap();
        let opcodes: Vec<String> = program.iter().map(|r| r.get::<String, _>(1)).collect();
        assert!(opcodes.iter().any(|o| o == "Halt"), "the program was read: {opcodes:?}");
        assert!(!opcodes.iter().any(|o| o == "OpenEphemeral"), "{sql} builds a temporary table");
    }
    c.close().await.unwrap();
}

/// SQLite's chain trigger (migration 0034, decision 0037) finds the line before by its position in
/// `ledger_entries_account_seq`: one seek, never a scan of the account's lines. The trigger's own
/// program is not shown by `EXPLAIN` of the INSERT, so its lookup is planned here as written in the
/// trigger, which the test first finds in the schema.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_chain_trigger_seeks_the_line_before_by_position() {
    let (_dir, mut c) = fresh_sqlite().await;
    let lookup =
        "SELECT hash FROM ledger_entries WHERE account_id = NEW.account_id AND account_seq = NEW.account_seq - 1";
    let trigger: String =
        sqlx::query("SELECT sql FROM sqlite_master WHERE type = 'trigger' AND name = 'ledger_entries_chain'")
            .fetch_one(&mut c)
            .await
            .unwrap()
            .get(0);
    assert!(trigger.contains(lookup), "the trigger reads the line before as planned here: {trigger}");
    let planned = lookup.replace("NEW.account_id", "?1").replace("NEW.account_seq", "?2");
    let plan =
        sqlx::query(sqlx::AssertSqlSafe(format!("EXPLAIN QUERY PLAN {planned}"))).fetch_all(&mut c).await.unwrap();
    let steps: Vec<String> = plan.iter().map(|r| r.get::<String, _>(3)).collect();
    assert_eq!(
        steps,
        ["SEARCH ledger_entries USING INDEX ledger_entries_account_seq (account_id=? AND account_seq=?)"],
        "{planned}"
    );
    c.close().await.unwrap();
}
