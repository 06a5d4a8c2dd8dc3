//! Settle opens an empty database or its own, and refuses another program's or a newer schema,
//! writing nothing (on PostgreSQL here; the CLI tests do the same for SQLite files as a user would).

use settle_store::{SqlStore, StoreError, StoreOptions};
use sqlx::{ConnectOptions, Connection, Row};
use std::str::FromStr;

async fn pg(url: &str) -> sqlx::PgConnection {
    sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap()
}

async fn tables(url: &str) -> Vec<String> {
    let mut c = pg(url).await;
    let rows = sqlx::query(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = current_schema() ORDER BY 1",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    rows.iter().map(|r| r.get::<String, _>(0)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_another_programs_database_and_writes_nothing() {
    let url = settle_testkit::fresh_database().await;
    let mut c = pg(&url).await;
    sqlx::raw_sql("CREATE TABLE customers (id bigint PRIMARY KEY, name text)").execute(&mut c).await.unwrap();
    c.close().await.unwrap();
    let e = SqlStore::open(&url, StoreOptions::default()).await.err().expect("refused");
    assert!(
        matches!(&e, StoreError::NotSettle(m) if m.contains("not a Settle database") && m.contains("customers")),
        "{e}"
    );
    assert_eq!(tables(&url).await, vec!["customers".to_owned()], "nothing was created");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_refuses_a_newer_settle_schema_and_reopens_its_own() {
    let url = settle_testkit::fresh_database().await;
    drop(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    // its own database opens again
    drop(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    let before = tables(&url).await;
    let mut c = pg(&url).await;
    sqlx::raw_sql(
        "INSERT INTO _sqlx_migrations (version, description, success, checksum, execution_time) \
         VALUES (9999, 'from the future', true, '\\x00', 0)",
    )
    .execute(&mut c)
    .await
    .unwrap();
    c.close().await.unwrap();
    let e = SqlStore::open(&url, StoreOptions::default()).await.err().expect("refused");
    assert!(matches!(&e, StoreError::NotSettle(m) if m.contains("newer than this binary")), "{e}");
    assert_eq!(tables(&url).await, before);
}
