//! A database made by the release before migration 0014 (worker answers) opens with this one, on
//! both engines: the migration applies, the chains verify, the audit is clean, and a re-send from
//! an attempt that closed before the upgrade is refused, never replayed (decision 0019).

use crate::kit::*;
use settle_store::*;

async fn from_before_migration_14(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t1 = k.claim_one("j").await;
    k.store.item_succeed(&jid("j"), &iid("i0"), &t1).await.unwrap();
    k.fail("j", &t1, "TIMEOUT").await;
    k.clock.advance_seconds(5);
    let t2 = k.claim_one("j").await;
    // The previous release's schema: migration 0014's columns and its record gone.
    k.raw_script(
        "ALTER TABLE attempts DROP COLUMN reported; ALTER TABLE attempts DROP COLUMN sent_code; \
         ALTER TABLE attempts DROP COLUMN expired_at; ALTER TABLE attempts DROP COLUMN success_at; \
         ALTER TABLE items DROP COLUMN decided_attempt; DELETE FROM _sqlx_migrations WHERE version = 14",
    )
    .await
    .unwrap();
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    assert_eq!(store.operators().verify_chain(&a).await.unwrap(), None, "the hash chain verifies");
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    // Attempt 1 reported before the upgrade: its re-sent failure is refused, not replayed.
    let r = store.fail(&jid("j"), fail_sig(&t1, "TIMEOUT")).await;
    assert!(matches!(r, Err(StoreError::LeaseLost(_))), "{r:?}");
    // The running attempt goes on as before, and the late success still recovers once.
    assert!(store.item_succeed(&jid("j"), &iid("i1"), &t2).await.unwrap().applied);
    assert!(store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t2)), None).await.unwrap().applied);
    assert!(store.audit(None).await.unwrap().violations.is_empty());
    assert_eq!(store.account(&a).await.unwrap().balance.get(), 70);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_14_opens_and_verifies() {
    from_before_migration_14(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_14_opens_and_verifies() {
    from_before_migration_14(EngineKind::Postgres).await;
}
