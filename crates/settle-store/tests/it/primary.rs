//! Which PostgreSQL server Settle writes to (docs/decisions/0024, 0027): a formation's primary only
//! while it waits for a synchronous standby at COMMIT. The test cluster has no standby
//! (`synchronous_standby_names` is empty), so it stands for pg_auto_failover's `wait_primary` — a
//! primary just promoted, or one whose standbys are gone — whose acknowledged commits the next
//! failover can lose.

use settle_store::{SqlStore, StoreError, StoreOptions};
use sqlx::{ConnectOptions, Connection};
use std::str::FromStr;

/// `url` with its one host listed twice (`h:p,h:p`): a formation's URL, as far as Settle can tell.
fn listed_twice(url: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let authority_end = rest.find(['/', '?']).unwrap_or(rest.len());
    let (authority, tail) = rest.split_at(authority_end);
    let host = authority.rsplit_once('@').map_or(authority, |(_, h)| h);
    format!("{scheme}://{authority},{host}{tail}")
}

async fn tables(url: &str) -> i64 {
    let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    let n: i64 =
        sqlx::query_scalar("SELECT count(*) FROM information_schema.tables WHERE table_schema = current_schema()")
            .fetch_one(&mut c)
            .await
            .unwrap();
    c.close().await.unwrap();
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_formation_primary_without_a_synchronous_standby_takes_no_writes() {
    let url = settle_testkit::fresh_database().await;
    let formation = listed_twice(&url);
    // Several hosts: a formation, so its primary must replicate synchronously. None here does.
    let e = SqlStore::open(&formation, StoreOptions::default()).await.err().expect("refused");
    assert!(
        matches!(&e, StoreError::Unavailable(m) if m.contains("no writable PostgreSQL primary")
            && m.contains("synchronous_standby_names is empty")),
        "{e}"
    );
    assert_eq!(tables(&url).await, 0, "nothing was written");
    // The same asked of one host, a server of its own.
    let one = StoreOptions { pg_synchronous_standby: Some(true), ..StoreOptions::default() };
    let e = SqlStore::open(&url, one).await.err().expect("refused");
    assert!(matches!(&e, StoreError::Unavailable(m) if m.contains("no synchronous standby")), "{e}");
    assert_eq!(tables(&url).await, 0, "nothing was written");
    // An operator who accepts asynchronous commits says so; one host needs nothing said.
    let accepted = StoreOptions { pg_synchronous_standby: Some(false), ..StoreOptions::default() };
    drop(SqlStore::open(&formation, accepted).await.unwrap());
    drop(SqlStore::open(&url, StoreOptions::default()).await.unwrap());
    assert!(tables(&url).await > 0);
}

/// Each statement on its own (`ALTER SYSTEM` runs outside a transaction block).
async fn admin(url: &str, statements: &[&str]) {
    let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    for sql in statements {
        sqlx::raw_sql(sqlx::AssertSqlSafe(sql.to_string())).execute(&mut c).await.unwrap();
    }
    c.close().await.unwrap();
}

async fn accounts(url: &str, id: &str) -> i64 {
    let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    let n = sqlx::query_scalar("SELECT count(*) FROM accounts WHERE id = $1").bind(id).fetch_one(&mut c).await.unwrap();
    c.close().await.unwrap();
    n
}

/// Waits until a new session sees `synchronous_standby_names` as `value` (the reload has reached
/// the postmaster, so every connection made from now on has it).
async fn until_setting(url: &str, value: &str) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
        let now: String =
            sqlx::query_scalar("SELECT current_setting('synchronous_standby_names')").fetch_one(&mut c).await.unwrap();
        c.close().await.unwrap();
        if now == value {
            return;
        }
        assert!(std::time::Instant::now() < deadline, "the reload did not reach new sessions in 30 s");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
}

/// A server that stops waiting for a standby while Settle is connected, as pg_auto_failover turns
/// synchronous replication off: it sets `synchronous_standby_names = ''`, reloads, and cancels every
/// backend waiting for a standby — whose COMMIT PostgreSQL then answers with success and a warning.
/// A pooled connection is checked before each use, so nothing is written once the server stopped;
/// and a commit that was let go is answered `Unavailable` (it may be on one server only: the
/// outcome is unknown). A cluster of the test's own: the shared one must never wait for a standby.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_primary_that_stops_waiting_for_its_standby_is_left_at_once() {
    use settle_core::Credits;
    use settle_core::ids::AccountId;
    use settle_store::{NewAccount, SYSTEM_ACTOR, Store};
    let pg = settle_testkit::Cluster::start();
    let url = pg.url();
    // The schema first, on a server that waits for no standby.
    let setup = StoreOptions { pg_synchronous_standby: Some(false), ..StoreOptions::default() };
    drop(SqlStore::open(&url, setup).await.unwrap());
    // A standby named but never there: every COMMIT that wrote waits.
    let wait_for_nobody = ["ALTER SYSTEM SET synchronous_standby_names = 'nobody'", "SELECT pg_reload_conf()"];
    admin(&url, &wait_for_nobody).await;
    until_setting(&url, "nobody").await;
    let options = StoreOptions {
        pg_synchronous_standby: Some(true),
        pg_acquire_timeout: std::time::Duration::from_secs(2),
        ..StoreOptions::default()
    };
    let store = std::sync::Arc::new(SqlStore::open(&url, options).await.unwrap());
    let account =
        |id: &str| NewAccount { id: AccountId::parse(id).unwrap(), overdraft_limit: Credits::ZERO, max_running: None };

    // 1. The server stops waiting while Settle's connections sit in its pool: the next write is
    // refused before it begins, and writes nothing.
    admin(&url, &["ALTER SYSTEM SET synchronous_standby_names = ''", "SELECT pg_reload_conf()"]).await;
    until_setting(&url, "").await;
    let refused = store.create_account(account("after"), SYSTEM_ACTOR).await;
    assert!(matches!(&refused, Err(StoreError::Unavailable(_))), "{refused:?}");
    assert_eq!(accounts(&url, "after").await, 0, "nothing was written");

    // 2. It waits again, and stops while a COMMIT waits: the COMMIT it lets go is not taken for done.
    admin(&url, &wait_for_nobody).await;
    until_setting(&url, "nobody").await;
    let writer = store.clone();
    let waiting = tokio::spawn(async move { writer.create_account(account("let-go"), SYSTEM_ACTOR).await });
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    while !waiting_for_a_standby(&url).await {
        assert!(!waiting.is_finished(), "a commit was answered while no standby had it: {:?}", waiting.await);
        assert!(std::time::Instant::now() < deadline, "no COMMIT came to wait for the standby");
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    tokio::time::sleep(std::time::Duration::from_millis(1_200)).await;
    // What pg_auto_failover's keeper does when it turns synchronous replication off.
    admin(
        &url,
        &[
            "ALTER SYSTEM SET synchronous_standby_names = ''",
            "SELECT pg_reload_conf()",
            "SELECT pg_sleep(0.2)",
            "SELECT pg_cancel_backend(pid) FROM pg_stat_activity WHERE wait_event = 'SyncRep'",
        ],
    )
    .await;
    let let_go = tokio::time::timeout(std::time::Duration::from_secs(30), waiting).await.expect("answered").unwrap();
    assert!(matches!(&let_go, Err(StoreError::Unavailable(m)) if m.contains("outcome is unknown")), "{let_go:?}");
    // Committed on this server alone, and answered as unknown: the same request again settles it.
    assert_eq!(accounts(&url, "let-go").await, 1);
}

async fn waiting_for_a_standby(url: &str) -> bool {
    let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    let n: i64 = sqlx::query_scalar("SELECT count(*) FROM pg_stat_activity WHERE wait_event = 'SyncRep'")
        .fetch_one(&mut c)
        .await
        .unwrap();
    c.close().await.unwrap();
    n > 0
}
