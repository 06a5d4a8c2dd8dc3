//! A database made by the release before migration 0014 (worker answers) opens with this one, on
//! both engines: the migration applies, the chains verify, the audit is clean, and a re-send from
//! an attempt that closed before the upgrade is refused, never replayed (decision 0019).

use crate::kit::*;
use settle_core::Credits;
use settle_core::ids::{AccountId, RefId};
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

/// Takes a database back to before migration 0017 (grants, decision 0023).
pub(crate) const UNDO_17: &str = "DROP TABLE allocations; DROP TABLE grants; DROP INDEX accounts_next_expiry; \
     ALTER TABLE accounts DROP COLUMN next_expiry; ALTER TABLE accounts DROP COLUMN debt; \
     ALTER TABLE accounts RENAME COLUMN last_account_seq TO entries; DELETE FROM _sqlx_migrations WHERE version = 17";

/// Every entry of `account`, in `seq` order.
async fn all_entries(store: &SqlStore, account: &settle_core::ids::AccountId) -> Vec<LedgerEntry> {
    let page = Page { after: 0, limit: 1000 };
    store.ledger(account, page).await.unwrap().rows
}

/// A database made by the release before migration 0015 (numbering without a global row,
/// decision 0021) opens with this one, on both engines: its entries get their `account_seq` in
/// their old order, the chains verify unchanged, the audit is clean, and new entries continue each
/// chain (positions on from the count, `seq` above every old one) — events go on gap-free.
async fn from_before_migration_15(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let (a, b) = (k.account("a", 100).await, k.account("b", 50).await);
    // Entries of a and b interleaved in the one sequence the previous release numbered.
    k.items_job("ja", &a, &[10, 20]).await;
    k.items_job("jb", &b, &[5]).await;
    let t = k.claim_one("ja").await;
    k.fail("ja", &t, "TIMEOUT").await;
    let events_before = k.event_types().await.len();
    // The previous release's schema: migration 0015's columns, tables and record gone; the ledger
    // counter where that release kept it.
    k.raw_script(&undo_26(&k)).await.unwrap();
    k.raw_script(undo_25(&k)).await.unwrap();
    k.raw_script(undo_24(&k)).await.unwrap();
    k.raw_script(UNDO_17).await.unwrap();
    let back = if k.is_sqlite() {
        "ALTER TABLE items DROP COLUMN hold; DELETE FROM _sqlx_migrations WHERE version = 16; \
         DROP TRIGGER ledger_entries_account_seq; DROP INDEX ledger_entries_account_seq; \
         ALTER TABLE ledger_entries DROP COLUMN account_seq; ALTER TABLE accounts DROP COLUMN entries; \
         DROP TABLE outbox_pending; DELETE FROM _sqlx_migrations WHERE version = 15"
    } else {
        "ALTER TABLE items DROP COLUMN hold; DELETE FROM _sqlx_migrations WHERE version = 16; \
         ALTER TABLE ledger_entries DROP COLUMN account_seq; ALTER TABLE accounts DROP COLUMN entries; \
         DROP TABLE outbox_pending; DROP SEQUENCE ledger_seq_numbers; DROP SEQUENCE outbox_stamps; \
         UPDATE counters SET value = (SELECT MAX(seq) FROM ledger_entries) WHERE name = 'ledger'; \
         DELETE FROM _sqlx_migrations WHERE version = 15"
    };
    k.raw_script(back).await.unwrap();
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    for account in [&a, &b] {
        assert_eq!(store.operators().verify_chain(account).await.unwrap(), None, "the hash chain verifies");
    }
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    let old = all_entries(&store, &a).await;
    assert_eq!(old.iter().map(|e| e.account_seq).collect::<Vec<_>>(), (1..=old.len() as i64).collect::<Vec<_>>());
    let last_seq = old.iter().chain(&all_entries(&store, &b).await).map(|e| e.seq).max().unwrap();
    // New entries continue both chains.
    assert!(store.succeed(&jid("ja"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().applied);
    store.create_job(new_job("jb2", &b, 7)).await.unwrap();
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    for (account, grew) in [(&a, 2), (&b, 1)] {
        let entries = all_entries(&store, account).await;
        let positions: Vec<i64> = entries.iter().map(|e| e.account_seq).collect();
        assert_eq!(positions, (1..=entries.len() as i64).collect::<Vec<_>>(), "positions 1, 2, 3, … in seq order");
        let new: Vec<&LedgerEntry> = entries.iter().filter(|e| e.seq > last_seq).collect();
        assert_eq!(new.len(), grew, "{entries:?}");
        assert_eq!(store.operators().verify_chain(account).await.unwrap(), None);
    }
    assert_eq!(store.account(&a).await.unwrap().balance.get(), 70);
    // Events go on from where the previous release stopped, gap-free.
    let events = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    assert!(events.len() > events_before);
    let seqs: Vec<i64> = events.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=events.len() as i64).collect::<Vec<_>>());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_15_opens_and_continues_its_chains() {
    from_before_migration_15(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_15_opens_and_continues_its_chains() {
    from_before_migration_15(EngineKind::Postgres).await;
}

/// A database made by the release before migration 0016 (held items, decision 0022) opens with
/// this one, on both engines: SQLite's ledger is rebuilt with its rows unchanged, the chains verify,
/// the audit is clean, the old jobs answer as before (a fixed cost, no hold), and held jobs then
/// continue the same chains.
async fn from_before_migration_16(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("ja", &a, &[10, 20]).await;
    let t = k.claim_one("ja").await;
    k.fail("ja", &t, "TIMEOUT").await;
    // 0034 undone first and so run again after 0016 (whose SQLite rebuild of the ledger makes the
    // chain index again): the store ends on the schema this release ships.
    k.raw_script(&undo_37(&k)).await.unwrap();
    k.raw_script(UNDO_36).await.unwrap();
    k.raw_script(&undo_35(&k)).await.unwrap();
    k.raw_script(undo_34(&k)).await.unwrap();
    let back = if k.is_sqlite() {
        "ALTER TABLE items DROP COLUMN hold; DELETE FROM _sqlx_migrations WHERE version = 16"
    } else {
        "ALTER TABLE items DROP COLUMN hold; \
         ALTER TABLE ledger_entries DROP CONSTRAINT ledger_entries_kind_check, \
           ADD CONSTRAINT ledger_entries_kind_check \
           CHECK (kind IN ('grant', 'charge', 'refund', 'reclaim', 'adjustment', 'payout_return')), \
           DROP CONSTRAINT ledger_entries_ref_check, \
           ADD CONSTRAINT ledger_entries_ref_check CHECK ((kind IN ('grant', 'adjustment')) = (ref_id IS NOT NULL)), \
           DROP CONSTRAINT ledger_entries_job_check, \
           ADD CONSTRAINT ledger_entries_job_check CHECK ((kind IN ('charge', 'refund', 'reclaim', 'payout_return')) \
             = (job_id IS NOT NULL AND item_id IS NOT NULL)); \
         DELETE FROM _sqlx_migrations WHERE version = 16"
    };
    k.raw_script(back).await.unwrap();
    let before = all_entries(&k.store, &a).await;
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    assert_eq!(all_entries(&store, &a).await, before, "every entry as it was: numbers, positions, hashes");
    assert_eq!(store.operators().verify_chain(&a).await.unwrap(), None);
    let old = store.job(&jid("ja")).await.unwrap();
    assert!(old.items.iter().all(|i| i.hold.is_none() && i.priced_cost().is_some()), "{old:?}");
    let held = NewJob {
        items: vec![NewItem { id: iid("main"), price: Price::Hold(settle_core::Credits::new(40)) }],
        ..new_job("jh", &a, 0)
    };
    store.create_job(held).await.unwrap();
    store.succeed(&jid("ja"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    let claimed = store.claim(claim_req("w2", 1)).await.unwrap();
    let by = settle_store::Reporter::of(Some(&claimed[0].lease_token));
    let priced = Costs::main(settle_core::Credits::new(15));
    store.succeed_priced(&jid("jh"), by, None, &priced).await.unwrap();
    let entries = all_entries(&store, &a).await;
    let positions: Vec<i64> = entries.iter().map(|e| e.account_seq).collect();
    assert_eq!(positions, (1..=entries.len() as i64).collect::<Vec<_>>());
    assert_eq!(entries.last().unwrap().kind, settle_core::ledger::EntryKind::Release);
    assert_eq!(store.operators().verify_chain(&a).await.unwrap(), None);
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    assert_eq!(store.account(&a).await.unwrap().balance.get(), 100 - 30 - 15);
    if url.starts_with("sqlite:") {
        use sqlx::{Connection, Row};
        let mut c = sqlx::SqliteConnection::connect(&url).await.unwrap();
        let guards: Vec<(String, String)> =
            (sqlx::query("SELECT type, name FROM sqlite_master WHERE name = 'ledger_entries_chain' ORDER BY type")
                .fetch_all(&mut c)
                .await
                .unwrap()
                .iter())
            .map(|r| (r.get(0), r.get(1)))
            .collect();
        assert_eq!(guards, [("trigger".to_owned(), "ledger_entries_chain".to_owned())], "0034 ran after 0016");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_16_opens_and_continues_its_chains() {
    from_before_migration_16(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_16_opens_and_continues_its_chains() {
    from_before_migration_16(EngineKind::Postgres).await;
}

/// A database made by the release before migration 0017 (grants, decision 0023) opens with this
/// one, on both engines: each account's balance and what it could still get back become its opening
/// grant (an overdrawn account's debt a debt part), L1–L5 hold, a refund of a charge made before the
/// upgrade goes back to the opening grant, and a new grant pays the old debt first.
async fn from_before_migration_17(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("ja", &a, &[10, 20]).await;
    let b = acc("b");
    k.store
        .create_account(
            NewAccount { id: b.clone(), overdraft_limit: Credits::new(50), max_running: None },
            SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    k.job("jb", &b, 30).await;
    k.raw_script(&undo_26(&k)).await.unwrap();
    k.raw_script(undo_25(&k)).await.unwrap();
    k.raw_script(UNDO_17).await.unwrap();
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
    let grants = |account: AccountId| {
        let store = &store;
        async move {
            let rows = store.grants(&account, Page { after: 0, limit: 100 }).await.unwrap().rows;
            rows.into_iter().map(|g| (g.id, g.origin, g.amount.get(), g.remaining.get())).collect::<Vec<_>>()
        }
    };
    assert_eq!(grants(a.clone()).await, [("a".to_owned(), "opening".to_owned(), 100, 70)]);
    // b spent 30 on the overdraft: its charge may still come back (the opening grant holds it), and
    // its -30 is debt.
    assert_eq!(grants(b.clone()).await, [("b".to_owned(), "opening".to_owned(), 30, 0)]);
    // A refund of a charge made before the upgrade goes back to the opening grant.
    let claimed = store.claim(claim_req("w", 1)).await.unwrap();
    store.fail(&jid("ja"), fail_sig(&claimed[0].lease_token, "BAD_INPUT")).await.unwrap();
    assert_eq!(grants(a.clone()).await, [("a".to_owned(), "opening".to_owned(), 100, 100)]);
    // The old debt is paid by b's next grant.
    let g = NewGrant {
        id: RefId::parse("gb").unwrap(),
        amount: Credits::new(50),
        reason: None,
        expires_at: None,
        priority: None,
    };
    store.grant(&b, g, SYSTEM_ACTOR).await.unwrap();
    assert_eq!(
        grants(b.clone()).await,
        [("b".to_owned(), "opening".to_owned(), 30, 0), ("gb".to_owned(), "grant".to_owned(), 50, 20)]
    );
    assert_eq!(store.account(&b).await.unwrap().balance.get(), 20);
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_17_opens_with_opening_grants() {
    from_before_migration_17(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_17_opens_with_opening_grants() {
    from_before_migration_17(EngineKind::Postgres).await;
}

/// A database made by the release before migration 0018 (`outbox_pending` kept from autovacuum's
/// truncation: docs/design/fewer-statements.md) opens with this one: the migration applies, the
/// chains verify, new entries continue them (the flush now writes lines and events in one
/// statement), and the audit is clean.
async fn from_before_migration_18(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t1 = k.claim_one("j").await;
    k.fail("j", &t1, "TIMEOUT").await;
    k.raw_script(&undo_26(&k)).await.unwrap();
    k.raw_script(undo_25(&k)).await.unwrap();
    k.raw_script(undo_24(&k)).await.unwrap();
    let undo = if k.is_sqlite() {
        "DELETE FROM _sqlx_migrations WHERE version = 18"
    } else {
        "ALTER TABLE outbox_pending RESET (vacuum_truncate); DELETE FROM _sqlx_migrations WHERE version = 18"
    };
    k.raw_script(undo).await.unwrap();
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    assert_eq!(store.operators().verify_chain(&a).await.unwrap(), None, "the hash chain verifies");
    // New entries on the same account: a late success reclaims the refund, then a new job charges.
    assert!(store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t1)), None).await.unwrap().applied);
    store.create_job(items_job("j2", &a, &[5, 6, 7])).await.unwrap();
    assert_eq!(store.operators().verify_chain(&a).await.unwrap(), None, "new entries continue the chain");
    assert!(store.audit(None).await.unwrap().violations.is_empty());
    assert_eq!(store.account(&a).await.unwrap().balance.get(), 100 - 30 - 18);
    // On PostgreSQL migration 0018 kept `outbox_pending` from autovacuum's truncation; since 0024
    // the table is a view and `stamps_pending` is kept the same way.
    if !url.starts_with("sqlite:") {
        use sqlx::{ConnectOptions, Connection};
        use std::str::FromStr;
        let mut c = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        let kept: bool = sqlx::query_scalar(
            "SELECT EXISTS (SELECT 1 FROM pg_class c, pg_options_to_table(c.reloptions) o \
             WHERE c.oid = 'stamps_pending'::regclass AND o.option_name = 'vacuum_truncate' \
             AND o.option_value IN ('off', 'false'))",
        )
        .fetch_one(&mut c)
        .await
        .unwrap();
        c.close().await.unwrap();
        assert!(kept, "stamps_pending is not truncated by autovacuum");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_18_opens_and_continues_its_chains() {
    from_before_migration_18(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_18_opens_and_continues_its_chains() {
    from_before_migration_18(EngineKind::Postgres).await;
}

/// The order keys of `url`'s webhook deliveries, by event: (seq, key, state).
async fn order_keys(url: &str) -> Vec<(i64, String, String)> {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let sql = "SELECT event_seq, order_key, state FROM webhook_deliveries ORDER BY event_seq";
    if url.starts_with("sqlite:") {
        let mut c = sqlx::sqlite::SqliteConnectOptions::from_str(url).unwrap().connect().await.unwrap();
        let rows = sqlx::query_as(sql).fetch_all(&mut c).await.unwrap();
        c.close().await.unwrap();
        rows
    } else {
        let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
        let rows = sqlx::query_as(sql).fetch_all(&mut c).await.unwrap();
        c.close().await.unwrap();
        rows
    }
}

/// Migration 0020 re-keys the deliveries not yet delivered from their outbox events (a job named
/// `account:a` no longer shares the account's line); delivered ones keep their key (decision 0028 §5).
async fn from_before_migration_20(engine: EngineKind) {
    use settle_store::{DeliveryReport, StartFrom};
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.job("account:a", &a, 10).await;
    k.store.webhooks().start("ops", StartFrom::Beginning).await.unwrap();
    k.store.webhooks().fan_out("ops", 100).await.unwrap();
    let no_breaker = settle_store::BreakerPolicy { failures: 0, open_ms: 1, open_ms_max: 1 };
    let first = k.store.webhooks().lease("ops", 1, 1_000, 10, no_breaker).await.unwrap().remove(0);
    let delivered = DeliveryReport::Delivered { status: 200 };
    let token = first.lease_token.as_ref().unwrap();
    k.store.webhooks().report("ops", first.event.seq, token, delivered, no_breaker).await.unwrap();
    let now = order_keys(&k.url).await;
    assert!(now.len() >= 2 && now[0].2 == "delivered", "the grant delivered, the job's events pending: {now:?}");
    // The release before 0020: keys were the job's id, or `account:` and the account's id.
    k.raw_script(&undo_26(&k)).await.unwrap();
    k.raw_script(undo_25(&k)).await.unwrap();
    k.raw_script(undo_24(&k)).await.unwrap();
    k.raw_script(
        "UPDATE webhook_deliveries SET order_key = CASE WHEN order_key LIKE 'job %' THEN substr(order_key, 5) \
         ELSE 'account:' || substr(order_key, 9) END; \
         DROP TABLE store_epochs; DROP TABLE teardown_retries; DROP TABLE console_signouts; \
         DELETE FROM _sqlx_migrations WHERE version >= 20",
    )
    .await
    .unwrap();
    let old = order_keys(&k.url).await;
    assert!(old.iter().all(|(_, key, _)| key == "account:a"), "both lines were one: {old:?}");
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let _store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    let upgraded = order_keys(&url).await;
    for ((seq, key, state), (_, before, _)) in upgraded.iter().zip(&now) {
        if state == "delivered" {
            assert_eq!(key, "account:a", "a delivered row is never looked at again");
        } else {
            assert_eq!(key, before, "event {seq} is back in its own line");
        }
    }
    assert!(upgraded.iter().any(|(_, key, _)| key == "job account:a"), "{upgraded:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_20_rekeys_its_pending_deliveries() {
    from_before_migration_20(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_20_rekeys_its_pending_deliveries() {
    from_before_migration_20(EngineKind::Postgres).await;
}

/// Takes a database back to before migration 0024 (each event written once): the numbered events
/// back in `outbox`, pending stamps back in `outbox_pending`, the delivery's foreign key back.
fn undo_24(k: &Kit) -> &'static str {
    if k.is_sqlite() {
        "CREATE TABLE outbox (seq INTEGER PRIMARY KEY, type TEXT NOT NULL, job_id TEXT, account_id TEXT NOT NULL, \
           data TEXT NOT NULL, created_at INTEGER NOT NULL) STRICT; \
         INSERT INTO outbox SELECT n.first_seq + e.pos - 1, e.type, e.job_id, e.account_id, e.data, e.created_at \
           FROM stamp_numbers n JOIN events e ON e.stamp = n.stamp; \
         CREATE INDEX outbox_job ON outbox (job_id, seq); \
         CREATE TABLE outbox_pending (stamp INTEGER NOT NULL, pos INTEGER NOT NULL, type TEXT NOT NULL, job_id TEXT, \
           account_id TEXT NOT NULL, data TEXT NOT NULL, created_at INTEGER NOT NULL, PRIMARY KEY (stamp, pos)) STRICT; \
         DROP TABLE events; DROP TABLE stamp_numbers; DROP TABLE stamps_pending; \
         DELETE FROM _sqlx_migrations WHERE version = 24"
    } else {
        "DROP VIEW outbox; DROP FUNCTION outbox_numbered_by_an_old_pass(); \
         DROP VIEW outbox_pending; DROP FUNCTION outbox_pending_queued_by_an_old_writer(); \
         CREATE TABLE outbox_pending (stamp bigint NOT NULL, pos bigint NOT NULL, type text NOT NULL, job_id text, \
           account_id text NOT NULL, data text NOT NULL, created_at bigint NOT NULL, PRIMARY KEY (stamp, pos)); \
         CREATE TABLE outbox (seq bigint PRIMARY KEY, type text NOT NULL, job_id text, account_id text NOT NULL, \
           data text NOT NULL, created_at bigint NOT NULL); \
         INSERT INTO outbox SELECT n.first_seq + e.pos - 1, e.type, e.job_id, e.account_id, e.data, e.created_at \
           FROM stamp_numbers n JOIN events e ON e.stamp = n.stamp; \
         INSERT INTO outbox_pending SELECT e.* FROM events e JOIN stamps_pending p ON p.stamp = e.stamp; \
         CREATE INDEX outbox_job ON outbox (job_id, seq); \
         ALTER TABLE webhook_deliveries ADD FOREIGN KEY (event_seq) REFERENCES outbox (seq); \
         DROP TABLE events; DROP TABLE stamp_numbers; DROP TABLE stamps_pending; \
         DELETE FROM _sqlx_migrations WHERE version = 24"
    }
}

/// The feed as (seq, type, job), from the first event.
async fn feed(store: &SqlStore) -> Vec<(i64, String, Option<String>)> {
    let rows = store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    rows.into_iter().map(|e| (e.seq, e.kind.as_str().to_owned(), e.job_id)).collect()
}

/// A database made by the release before migration 0024 (each event written once, issue 43) opens
/// with this one, on both engines: its events keep their numbers, a
/// webhook delivery still finds its event, the audit is clean, and new events are numbered on,
/// gap-free. On PostgreSQL, events a process of the previous release queued in `outbox_pending`
/// and never numbered are numbered after the migration; and while a process of that release still
/// runs, its writers' events are numbered by this release's passes (its own pass finds nothing
/// pending and fails nowhere).
async fn from_before_migration_24(engine: EngineKind) {
    use settle_store::StartFrom;
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    k.fail("j", &t, "TIMEOUT").await;
    k.store.webhooks().start("ops", StartFrom::Beginning).await.unwrap();
    k.store.webhooks().fan_out("ops", 100).await.unwrap();
    let before = feed(&k.store).await;
    let deliveries = k.store.webhooks().deliveries(&Default::default(), 0, 100).await.unwrap().rows;
    assert_eq!(deliveries.len(), before.len());
    k.raw_script(&undo_26(&k)).await.unwrap();
    k.raw_script(undo_25(&k)).await.unwrap();
    k.raw_script(undo_24(&k)).await.unwrap();
    if !k.is_sqlite() {
        // A previous-release process committed events and died before its pass.
        k.raw_script(
            "INSERT INTO outbox_pending (stamp, pos, type, job_id, account_id, data, created_at) \
             VALUES (nextval('outbox_stamps'), 1, 'account.granted', NULL, 'a', '{}', 0)",
        )
        .await
        .unwrap();
    }
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    let after = feed(&store).await;
    assert_eq!(after[..before.len()], before[..], "every event keeps its number");
    let legacy = usize::from(!url.starts_with("sqlite:"));
    assert_eq!(after.len(), before.len() + legacy, "{after:?}");
    let now = store.webhooks().deliveries(&Default::default(), 0, 100).await.unwrap().rows;
    assert_eq!(
        now.iter().map(|d| (d.event.seq, d.event.kind)).collect::<Vec<_>>(),
        deliveries.iter().map(|d| (d.event.seq, d.event.kind)).collect::<Vec<_>>(),
        "each delivery finds its event"
    );
    assert!(store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().applied);
    let more = feed(&store).await;
    assert!(more.len() > after.len());
    assert!(more.iter().enumerate().all(|(i, e)| e.0 == i as i64 + 1), "gap-free: {more:?}");
    if !url.starts_with("sqlite:") {
        // A writer of the previous release queues an event (its statement's shape), and a pass of
        // that release (its statement as it was) runs: it finds nothing, and this release's pass
        // numbers the event.
        use sqlx::{ConnectOptions, Connection};
        use std::str::FromStr;
        let mut c = sqlx::postgres::PgConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        let mut tx = c.begin().await.unwrap();
        sqlx::query(
            "INSERT INTO outbox_pending (stamp, pos, type, job_id, account_id, data, created_at) \
             VALUES (nextval('outbox_stamps'), 1, 'account.adjusted', NULL, 'a', '{}', 0)",
        )
        .execute(&mut *tx)
        .await
        .unwrap();
        tx.commit().await.unwrap();
        let mut tx = c.begin().await.unwrap();
        let last: i64 = sqlx::query_scalar("SELECT value FROM counters WHERE name = 'outbox' FOR UPDATE")
            .fetch_one(&mut *tx)
            .await
            .unwrap();
        let moved: i64 = sqlx::query_scalar(OLD_PASS).bind(last).bind(100i64).fetch_one(&mut *tx).await.unwrap();
        tx.commit().await.unwrap();
        c.close().await.unwrap();
        assert_eq!(moved, 0, "the old pass finds nothing pending");
        let last_feed = feed(&store).await;
        assert_eq!(last_feed.last().map(|e| (e.0, e.1.as_str())), Some((more.len() as i64 + 1, "account.adjusted")));
    }
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

/// The previous release's pass (ops/outbox.rs before migration 0024), as it was sent.
const OLD_PASS: &str = "WITH todo AS (SELECT stamp FROM outbox_pending GROUP BY stamp ORDER BY stamp LIMIT $2), \
     moved AS (DELETE FROM outbox_pending p USING todo WHERE p.stamp = todo.stamp \
               RETURNING p.stamp, p.pos, p.type, p.job_id, p.account_id, p.data, p.created_at), \
     numbered AS (SELECT $1 + row_number() OVER (ORDER BY stamp, pos) AS seq, stamp, type, job_id, account_id, \
                  data, created_at FROM moved), \
     ins AS (INSERT INTO outbox (seq, type, job_id, account_id, data, created_at) \
             SELECT seq, type, job_id, account_id, data, created_at FROM numbered RETURNING seq, type), \
     bump AS (UPDATE counters SET value = (SELECT MAX(seq) FROM ins) \
              WHERE name = 'outbox' AND EXISTS (SELECT 1 FROM ins) RETURNING value) \
     SELECT (SELECT COUNT(*) FROM ins)";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_24_keeps_its_event_numbers() {
    from_before_migration_24(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_24_keeps_its_event_numbers() {
    from_before_migration_24(EngineKind::Postgres).await;
}

/// Takes a database back to before migration 0025 (the hot tables' first change): the burn-down
/// index on `remaining` again, no `spent`, the reference index over every line.
fn undo_25(k: &Kit) -> &'static str {
    if k.is_sqlite() {
        "DROP INDEX grants_burn; ALTER TABLE grants DROP COLUMN spent; \
         DROP INDEX allocations_unpaid; ALTER TABLE allocations DROP COLUMN owed; \
         CREATE INDEX allocations_unpaid ON allocations (account_id, id) WHERE grant_key IS NULL AND taken > given_back + settled; \
         CREATE INDEX grants_burn ON grants (account_id, priority, expiry_key, key) WHERE remaining > 0 AND expired_at IS NULL; \
         DROP INDEX ledger_entries_ref; CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id); \
         CREATE INDEX ledger_entries_account ON ledger_entries (account_id, seq); \
         DELETE FROM _sqlx_migrations WHERE version = 25"
    } else {
        "DROP INDEX grants_burn; ALTER TABLE grants DROP COLUMN spent; ALTER TABLE grants RESET (fillfactor); \
         DROP INDEX allocations_unpaid; ALTER TABLE allocations DROP COLUMN owed; ALTER TABLE allocations RESET (fillfactor); \
         CREATE INDEX allocations_unpaid ON allocations (account_id, id) WHERE grant_key IS NULL AND taken > given_back + settled; \
         CREATE INDEX grants_burn ON grants (account_id, priority, expiry_key, key) WHERE remaining > 0 AND expired_at IS NULL; \
         DROP INDEX ledger_entries_ref; CREATE UNIQUE INDEX ledger_entries_ref ON ledger_entries (kind, ref_id); \
         CREATE INDEX ledger_entries_account ON ledger_entries (account_id, seq); \
         DELETE FROM _sqlx_migrations WHERE version = 25"
    }
}

/// A database made by the release before migration 0025 opens with this one, on both engines:
/// each grant is marked spent exactly when nothing remains, charges still burn down in order (a
/// spent grant is skipped, a refund brings it back), and the audit is clean.
async fn from_before_migration_25(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 10).await;
    let g = NewGrant {
        id: RefId::parse("g2").unwrap(),
        amount: Credits::new(30),
        reason: None,
        expires_at: None,
        priority: None,
    };
    k.store.grant(&a, g, SYSTEM_ACTOR).await.unwrap();
    // The first grant used up, the second partly.
    k.job("spent", &a, 15).await;
    // An account on its overdraft: a debt part with all of it unpaid.
    let b = acc("b");
    k.store
        .create_account(
            NewAccount { id: b.clone(), overdraft_limit: Credits::new(50), max_running: None },
            SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    k.job("owing", &b, 15).await;
    k.raw_script(&undo_26(&k)).await.unwrap();
    k.raw_script(undo_25(&k)).await.unwrap();
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    async fn grants(store: &SqlStore, a: &AccountId) -> Vec<(String, i64)> {
        let rows = store.grants(a, Page { after: 0, limit: 100 }).await.unwrap().rows;
        rows.into_iter().map(|g| (g.id, g.remaining.get())).collect()
    }
    assert_eq!(grants(&store, &a).await, [("g-a".to_owned(), 0), ("g2".to_owned(), 25)]);
    assert!(store.audit(None).await.unwrap().violations.is_empty());
    // A charge skips the spent grant; a refund brings the first back to life; the next charge
    // takes from it first again (it is first in the burn order).
    store.create_job(new_job("j2", &a, 5)).await.unwrap();
    assert_eq!(grants(&store, &a).await, [("g-a".to_owned(), 0), ("g2".to_owned(), 20)]);
    let claimed = store.claim(claim_req("w", 1)).await.unwrap();
    assert_eq!(claimed[0].job.id, "spent");
    store.fail(&claimed[0].job.id, fail_sig(&claimed[0].lease_token, "BAD_INPUT")).await.unwrap();
    assert_eq!(grants(&store, &a).await, [("g-a".to_owned(), 10), ("g2".to_owned(), 25)]);
    store.create_job(new_job("j3", &a, 1)).await.unwrap();
    assert_eq!(grants(&store, &a).await, [("g-a".to_owned(), 9), ("g2".to_owned(), 25)]);
    // The old debt part is found as owed: a grant pays it first.
    let g = NewGrant {
        id: RefId::parse("gb").unwrap(),
        amount: Credits::new(10),
        reason: None,
        expires_at: None,
        priority: None,
    };
    store.grant(&b, g, SYSTEM_ACTOR).await.unwrap();
    assert_eq!(grants(&store, &b).await, [("gb".to_owned(), 0)], "the grant paid the debt");
    assert_eq!(store.account(&b).await.unwrap().balance.get(), -5);
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_25_marks_its_spent_grants() {
    from_before_migration_25(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_25_marks_its_spent_grants() {
    from_before_migration_25(EngineKind::Postgres).await;
}

/// Back to before migration 0033: `jobs_due` in place of `jobs_open` and `jobs_rail`, and 0027's
/// `jobs_waiting` back.
const UNDO_33: &str = "DROP INDEX jobs_open; DROP INDEX jobs_rail; CREATE INDEX jobs_due ON jobs (state, not_before, job_seq); \
     CREATE INDEX jobs_waiting ON jobs (not_before, job_seq) WHERE state = 'queued' AND turn IS NULL AND kind <> 'withdrawal'; \
     DELETE FROM _sqlx_migrations WHERE version = 33;";

/// Back to before migration 0034: SQLite's chain trigger is the unique index on
/// `(account_id, prev_hash)` again (PostgreSQL's 0034 changed nothing).
fn undo_34(k: &Kit) -> &'static str {
    if k.is_sqlite() {
        "DROP TRIGGER ledger_entries_chain; CREATE UNIQUE INDEX ledger_entries_chain ON ledger_entries (account_id, prev_hash); \
         DELETE FROM _sqlx_migrations WHERE version = 34;"
    } else {
        "DELETE FROM _sqlx_migrations WHERE version = 34;"
    }
}

/// Back to before migration 0038: no audit checkpoint (its three tables are read and written only
/// by `settle audit`).
const UNDO_38: &str = "DROP TABLE audit_checkpoint; DROP TABLE audit_checkpoint_accounts; \
     DROP TABLE audit_checkpoint_jobs; DELETE FROM _sqlx_migrations WHERE version = 38;";

/// Back to before migration 0039: no index of the capped accounts (read only by PostgreSQL's claim
/// of several jobs at once).
const UNDO_39: &str = "DROP INDEX accounts_capped; DELETE FROM _sqlx_migrations WHERE version = 39;";

/// Back to before migration 0037 — and so first before 0039 and 0038: ledger lines and allocations without
/// `job_seq`, SQLite's indexes on the id whole again and its four triggers gone.
fn undo_37(k: &Kit) -> String {
    let undo_37 = if k.is_sqlite() {
        "DROP TRIGGER ledger_entries_job_seq; DROP TRIGGER allocations_job_seq; \
         DROP TRIGGER jobs_keys_fixed; DROP TRIGGER allocations_keys_fixed; \
         DROP INDEX ledger_entries_job_seq; DROP INDEX ledger_entries_item_kind; \
         DROP INDEX allocations_job_seq; DROP INDEX allocations_item; \
         DROP TRIGGER ledger_entries_no_update; \
         ALTER TABLE ledger_entries DROP COLUMN job_seq; ALTER TABLE allocations DROP COLUMN job_seq; \
         CREATE TRIGGER ledger_entries_no_update BEFORE UPDATE ON ledger_entries \
         BEGIN SELECT RAISE(ABORT, 'ledger_entries is append-only'); END; \
         CREATE UNIQUE INDEX ledger_entries_item_kind ON ledger_entries (job_id, item_id, kind); \
         CREATE INDEX allocations_item ON allocations (job_id, item_id, id) WHERE job_id IS NOT NULL; \
         DELETE FROM _sqlx_migrations WHERE version = 37;"
    } else {
        "ALTER TABLE ledger_entries DROP COLUMN job_seq; ALTER TABLE allocations DROP COLUMN job_seq; \
         DELETE FROM _sqlx_migrations WHERE version = 37;"
    };
    format!("{UNDO_39} {UNDO_38} {undo_37}")
}

/// Back to before migration 0036: logged signals without `job_seq`, `signals_job` over all of them.
const UNDO_36: &str = "DROP INDEX signals_job_seq; DROP INDEX signals_job; ALTER TABLE signals DROP COLUMN job_seq; \
     CREATE INDEX signals_job ON signals (job_id, id); DELETE FROM _sqlx_migrations WHERE version = 36;";

/// Back to before migration 0035: events without `job_seq`, `events_job` over every event again,
/// and on PostgreSQL 0024's functions for 0.1.0's writers as 0024 wrote them.
fn undo_35(k: &Kit) -> String {
    let events = "DROP INDEX events_job_seq; DROP INDEX events_job; ALTER TABLE events DROP COLUMN job_seq; \
                  CREATE INDEX events_job ON events (job_id, stamp, pos); DELETE FROM _sqlx_migrations WHERE version = 35;";
    if k.is_sqlite() {
        return events.to_owned();
    }
    // 0024's two functions, cut from the migration as it is.
    let m = include_str!("../../migrations/postgres/0024_events_written_once.sql");
    let functions: Vec<String> = m
        .match_indices("CREATE FUNCTION ")
        .map(|(at, _)| {
            let end = at + m[at..].find("\n$$;").expect("a function's end") + "\n$$;".len();
            m[at..end].replacen("CREATE FUNCTION", "CREATE OR REPLACE FUNCTION", 1)
        })
        .collect();
    assert_eq!(functions.len(), 2, "0024's two functions");
    format!("{events} {}", functions.join(" "))
}

/// Back to before migration 0031 (and 0032 to 0036): no top-ups nor rules, grant origins
/// without `top_up`.
fn undo_31(k: &Kit) -> String {
    let undo_32_31 = if k.is_sqlite() {
        "DROP INDEX top_ups_rule; DROP INDEX top_ups_one_open_rule; DROP TABLE auto_top_ups; DELETE FROM _sqlx_migrations WHERE version = 32; \
         DROP TABLE top_ups; PRAGMA writable_schema = ON; UPDATE sqlite_schema SET sql = replace(sql, \
         'CHECK (origin = ''grant'' OR origin = ''adjustment'' OR origin = ''opening'' OR origin = ''top_up'')', \
         'CHECK (origin = ''grant'' OR origin = ''adjustment'' OR origin = ''opening'')') \
         WHERE type = 'table' AND name = 'grants'; PRAGMA writable_schema = OFF; \
         CREATE TABLE settle_schema_reread (x INTEGER); DROP TABLE settle_schema_reread; \
         DELETE FROM _sqlx_migrations WHERE version = 31;"
    } else {
        "DROP INDEX top_ups_rule; DROP INDEX top_ups_one_open_rule; DROP TABLE auto_top_ups; DELETE FROM _sqlx_migrations WHERE version = 32; \
         DROP TABLE top_ups; ALTER DOMAIN grant_origin DROP CONSTRAINT grant_origin_check; \
         ALTER DOMAIN grant_origin ADD CONSTRAINT grant_origin_check \
         CHECK (VALUE IN ('grant', 'adjustment', 'opening')) NOT VALID; \
         DELETE FROM _sqlx_migrations WHERE version = 31;"
    };
    format!("{} {UNDO_36} {} {} {UNDO_33} {undo_32_31}", undo_37(k), undo_35(k), undo_34(k))
}

/// Back to before migration 0026 — and so first before 0031, 0030, 0029, 0028 and 0027 (their
/// columns, tables and indexes gone).
fn undo_26(k: &Kit) -> String {
    let undo_31 = undo_31(k);
    let undo_30 = "DROP TABLE spend_limit_kinds; DROP TABLE spend_limits; ALTER TABLE accounts DROP COLUMN spend_limited; \
                   DELETE FROM _sqlx_migrations WHERE version = 30;";
    let undo_29 = "DROP TABLE account_alerts; ALTER TABLE accounts DROP COLUMN alert_floor; \
                   ALTER TABLE accounts DROP COLUMN alert_ceiling; DELETE FROM _sqlx_migrations WHERE version = 29;";
    let undo_28 = "DROP INDEX jobs_running_account; DROP INDEX jobs_running_kind; DROP INDEX jobs_parked; \
                   DROP INDEX jobs_waiting_unparked; ALTER TABLE jobs DROP COLUMN parked; \
                   ALTER TABLE accounts DROP COLUMN max_running; DELETE FROM _sqlx_migrations WHERE version = 28;";
    let undo_28 =
        if k.is_sqlite() { undo_28.to_owned() } else { format!("{undo_28} DROP DOMAIN account_max_running;") };
    let undo_27 = "DROP TABLE worker_labels; DROP INDEX jobs_line; DROP INDEX jobs_line_account; DROP INDEX jobs_waiting; \
                   ALTER TABLE jobs DROP COLUMN turn; ALTER TABLE jobs DROP COLUMN requires; \
                   ALTER TABLE jobs DROP COLUMN priority; DELETE FROM _sqlx_migrations WHERE version = 27;";
    if k.is_sqlite() {
        format!("{undo_31} {undo_30} {undo_29} {undo_28} {undo_27} {}", undo_26_sqlite())
    } else {
        format!("{undo_31} {undo_30} {undo_29} {undo_28} {undo_27} DROP DOMAIN job_priority; {UNDO_26}")
    }
}

/// SQLite's migration 0026 replaces each CHECK's text (a literal `'CHECK (…)'`, the text before)
/// with another (the next such literal, the text after): the same replacements the other way round.
fn undo_26_sqlite() -> String {
    let forward = include_str!("../../migrations/sqlite/0026_domains.sql");
    // Each literal as written in the SQL (quotes inside it doubled), up to its closing quote.
    let mut literals = Vec::new();
    let mut rest = forward;
    while let Some(at) = rest.find("'CHECK") {
        let body = &rest[at + 1..];
        let mut end = 0;
        let bytes = body.as_bytes();
        while end < bytes.len() {
            match (bytes[end], bytes.get(end + 1)) {
                (b'\'', Some(b'\'')) => end += 2,
                (b'\'', _) => break,
                _ => end += 1,
            }
        }
        literals.push(&body[..end]);
        rest = &body[end..];
    }
    assert!(literals.len() >= 14 && literals.len() % 2 == 0, "pairs of texts: {literals:?}");
    let mut sql = String::from("PRAGMA writable_schema = ON;");
    for pair in literals.chunks(2) {
        let (before, after) = (pair[0], pair[1]);
        sql.push_str(&format!(
            " UPDATE sqlite_schema SET sql = replace(sql, '{after}', '{before}') WHERE type = 'table';"
        ));
    }
    sql.push_str(
        " PRAGMA writable_schema = OFF; CREATE TABLE reread (x INTEGER); DROP TABLE reread; \
         DELETE FROM _sqlx_migrations WHERE version = 26",
    );
    sql
}

/// Takes a PostgreSQL database back to before migration 0026: the single-column CHECKs as table
/// constraints again, no domains.
const UNDO_26: &str = "
    ALTER TABLE jobs ALTER COLUMN state TYPE text, ALTER COLUMN refund_on TYPE text,
        ALTER COLUMN cancel_requested TYPE bigint, ALTER COLUMN cost TYPE bigint, ALTER COLUMN max_attempts TYPE bigint,
        ADD CONSTRAINT jobs_state_check CHECK (state IN ('queued', 'running', 'unknown', 'cancelling', 'succeeded', 'dead', 'cancelled', 'returned')),
        ADD CONSTRAINT jobs_refund_on_check CHECK (refund_on IN ('failure', 'final_failure')),
        ADD CONSTRAINT jobs_cancel_requested_check CHECK (cancel_requested IN (0, 1)),
        ADD CONSTRAINT jobs_cost_check CHECK (cost >= 0), ADD CONSTRAINT jobs_max_attempts_check CHECK (max_attempts >= 1);
    ALTER TABLE items ALTER COLUMN state TYPE text, ALTER COLUMN refund_reason TYPE text, ALTER COLUMN cost TYPE bigint,
        ADD CONSTRAINT items_state_check CHECK (state IN ('charged', 'succeeded', 'refunded', 'reclaimed', 'cancelled', 'returned')),
        ADD CONSTRAINT items_refund_reason_check CHECK (refund_reason IN ('job_failed', 'item_failed', 'cancelled')),
        ADD CONSTRAINT items_cost_check CHECK (cost >= 0);
    ALTER TABLE accounts ALTER COLUMN debt TYPE bigint, ALTER COLUMN last_account_seq TYPE bigint,
        ALTER COLUMN exposure TYPE bigint, ALTER COLUMN held TYPE bigint, ALTER COLUMN overdraft_limit TYPE bigint,
        ADD CONSTRAINT accounts_debt_check CHECK (debt >= 0), ADD CONSTRAINT accounts_entries_check CHECK (last_account_seq >= 0),
        ADD CONSTRAINT accounts_exposure_check CHECK (exposure >= 0), ADD CONSTRAINT accounts_held_check CHECK (held >= 0),
        ADD CONSTRAINT accounts_overdraft_limit_check CHECK (overdraft_limit >= 0);
    ALTER TABLE ledger_entries ALTER COLUMN account_seq TYPE bigint,
        ADD CONSTRAINT ledger_entries_account_seq_check CHECK (account_seq >= 1);
    ALTER TABLE grants ALTER COLUMN origin TYPE text, ALTER COLUMN amount TYPE bigint, ALTER COLUMN remaining TYPE bigint,
        ALTER COLUMN priority TYPE bigint,
        ADD CONSTRAINT grants_origin_check CHECK (origin IN ('grant', 'adjustment', 'opening')),
        ADD CONSTRAINT grants_amount_check CHECK (amount >= 0), ADD CONSTRAINT grants_remaining_check CHECK (remaining >= 0),
        ADD CONSTRAINT grants_priority_check CHECK (priority >= 0 AND priority <= 100);
    ALTER TABLE allocations ALTER COLUMN kind TYPE text, ALTER COLUMN account_seq TYPE bigint, ALTER COLUMN taken TYPE bigint,
        ALTER COLUMN given_back TYPE bigint, ALTER COLUMN settled TYPE bigint,
        ADD CONSTRAINT allocations_kind_check CHECK (kind IN ('charge', 'reclaim', 'adjustment', 'settle_debt', 'opening')),
        ADD CONSTRAINT allocations_account_seq_check CHECK (account_seq >= 0), ADD CONSTRAINT allocations_taken_check CHECK (taken > 0),
        ADD CONSTRAINT allocations_given_back_check CHECK (given_back >= 0), ADD CONSTRAINT allocations_settled_check CHECK (settled >= 0);
    DROP DOMAIN credits, positive_count, position_from_zero, position_from_one, flag, grant_priority, job_state, refund_on,
        item_state, refund_reason, grant_origin, allocation_kind;
    DELETE FROM _sqlx_migrations WHERE version = 26";

/// A PostgreSQL database made by the release before migration 0026 opens with this one: its rows
/// keep their heap (no table rewritten), the audit is clean, jobs go on, and each domain refuses
/// what its table CHECK refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_database_from_before_migration_26_takes_domains_and_refuses_what_it_refused() {
    async fn heap(url: &str) -> String {
        use sqlx::{ConnectOptions, Connection};
        use std::str::FromStr;
        let mut conn = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
        let files: String = sqlx::query_scalar(
            "SELECT string_agg(relname || ':' || relfilenode, ',' ORDER BY relname) FROM pg_class \
             WHERE relname IN ('jobs', 'items', 'accounts', 'ledger_entries', 'allocations', 'ledger_entries_account_seq', 'jobs_pkey')",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        conn.close().await.unwrap();
        files
    }
    let k = Kit::new(EngineKind::Postgres).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    k.raw_script(&undo_26(&k)).await.unwrap();
    let before = heap(&k.url).await;
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    assert_eq!(heap(&url).await, before, "no table or hot index rewritten");
    assert!(store.audit(None).await.unwrap().violations.is_empty());
    store.fail(&jid("j"), fail_sig(&t, "BAD_INPUT")).await.unwrap();
    assert_eq!(store.account(&a).await.unwrap().balance.get(), 100);
    // Each refused by the domain that took its column's CHECK (named in the error).
    for (bad, domain) in [
        ("UPDATE jobs SET state = 'lost'", "job_state_check"),
        ("UPDATE jobs SET cost = -1", "credits_check"),
        ("UPDATE jobs SET cancel_requested = 2", "flag_check"),
        ("UPDATE jobs SET max_attempts = 0", "positive_count_check"),
        ("UPDATE jobs SET refund_on = 'never'", "refund_on_check"),
        ("UPDATE items SET state = 'gone'", "item_state_check"),
        ("UPDATE items SET refund_reason = 'whim'", "refund_reason_check"),
        ("UPDATE accounts SET held = -1", "credits_check"),
        ("UPDATE accounts SET overdraft_limit = -5", "credits_check"),
        // In the same implicit transaction as the statement that fails: the trigger stays.
        (
            "DROP TRIGGER ledger_entries_no_update ON ledger_entries; UPDATE ledger_entries SET account_seq = 0",
            "position_from_one_check",
        ),
        ("UPDATE grants SET priority = 101", "grant_priority_check"),
        ("UPDATE grants SET origin = 'gift'", "grant_origin_check"),
        ("UPDATE allocations SET kind = 'loan'", "allocation_kind_check"),
        ("UPDATE allocations SET taken = 0", "positive_count_check"),
    ] {
        let e = raw_script_at(&url, bad).await.expect_err(bad);
        assert!(e.to_string().contains(&format!("violates check constraint \"{domain}\"")), "{bad}: {e}");
    }
    assert!(store.audit(None).await.unwrap().violations.is_empty());
}

/// How many temporary tables SQLite's programs for writes of the hot tables' checked columns build.
async fn sqlite_temporary_tables(url: &str) -> usize {
    use sqlx::{ConnectOptions, Connection, Row};
    use std::str::FromStr;
    let mut c = sqlx::sqlite::SqliteConnectOptions::from_str(url).unwrap().connect().await.unwrap();
    let mut n = 0;
    for sql in [
        "EXPLAIN UPDATE jobs SET state = ?1 WHERE id = ?2",
        "EXPLAIN UPDATE items SET state = ?1, refund_reason = ?2 WHERE job_id = ?3 AND item_id = ?4",
        "EXPLAIN UPDATE allocations SET kind = ?1 WHERE id = ?2",
    ] {
        let rows = sqlx::query(sql).fetch_all(&mut c).await.unwrap();
        n += rows.iter().filter(|r| r.get::<String, _>(1) == "OpenEphemeral").count();
    }
    c.close().await.unwrap();
    n
}

/// A SQLite database made by the release before migration 0026 opens with this one: its CHECKs
/// are compared value by value instead of through a temporary table, the file's integrity holds,
/// jobs go on, and every CHECK refuses what it refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_database_from_before_migration_26_compares_and_refuses_what_it_refused() {
    let k = Kit::new(EngineKind::Sqlite).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    k.raw_script(&undo_26(&k)).await.unwrap();
    assert!(sqlite_temporary_tables(&k.url).await >= 3, "the release before built one per IN list");
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    assert_eq!(sqlite_temporary_tables(&url).await, 0);
    store.fail(&jid("j"), fail_sig(&t, "BAD_INPUT")).await.unwrap();
    assert_eq!(store.account(&a).await.unwrap().balance.get(), 100);
    assert!(store.audit(None).await.unwrap().violations.is_empty());
    {
        use sqlx::{ConnectOptions, Connection};
        use std::str::FromStr;
        let mut c = sqlx::sqlite::SqliteConnectOptions::from_str(&url).unwrap().connect().await.unwrap();
        let found: Vec<String> = sqlx::query_scalar("PRAGMA integrity_check").fetch_all(&mut c).await.unwrap();
        assert_eq!(found, ["ok"]);
        c.close().await.unwrap();
    }
    // Each refused by its column's CHECK as migration 0026 wrote it (SQLite names the expression).
    for (bad, check) in [
        ("UPDATE jobs SET state = 'lost'", "state = 'queued' OR"),
        ("UPDATE items SET state = 'gone'", "state = 'charged' OR"),
        ("UPDATE items SET refund_reason = 'whim'", "refund_reason = 'job_failed' OR"),
        ("UPDATE grants SET origin = 'gift'", "origin = 'grant' OR"),
        ("UPDATE allocations SET kind = 'loan'", "kind = 'charge' OR"),
        // The trigger goes with this file; nothing after this reads it.
        ("DROP TRIGGER ledger_entries_no_update; UPDATE ledger_entries SET kind = 'gift'", "kind = 'grant' OR"),
    ] {
        let e = raw_script_at(&url, bad).await.expect_err(bad);
        assert!(e.to_string().contains("CHECK constraint failed") && e.to_string().contains(check), "{bad}: {e}");
    }
}

/// Attempt `token`'s failure re-sent to job `j` of a reopened store: whether it was applied.
async fn fail_j_again(store: &SqlStore, token: &LeaseToken) -> bool {
    store.fail(&jid("j"), fail_sig(token, "TIMEOUT")).await.unwrap().applied
}

/// The `job_seq` each row of `job` in `from` (its alias `e`) carries, in the order of `order`, and
/// the job's own number.
async fn job_seqs(url: &str, job: &str, from: &str, order: &str) -> (Vec<Option<i64>>, i64) {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let events = format!("SELECT e.job_seq FROM {from} WHERE e.job_id = $1 ORDER BY {order}");
    let events = sqlx::AssertSqlSafe(events.as_str());
    let own = "SELECT job_seq FROM jobs WHERE id = $1";
    if url.starts_with("sqlite:") {
        let mut c = sqlx::sqlite::SqliteConnectOptions::from_str(url).unwrap().connect().await.unwrap();
        let seqs = sqlx::query_scalar(events).bind(job).fetch_all(&mut c).await.unwrap();
        let own = sqlx::query_scalar(own).bind(job).fetch_one(&mut c).await.unwrap();
        c.close().await.unwrap();
        (seqs, own)
    } else {
        let mut c = sqlx::postgres::PgConnectOptions::from_str(url).unwrap().connect().await.unwrap();
        let seqs = sqlx::query_scalar(events).bind(job).fetch_all(&mut c).await.unwrap();
        let own = sqlx::query_scalar(own).bind(job).fetch_one(&mut c).await.unwrap();
        c.close().await.unwrap();
        (seqs, own)
    }
}

/// A database made by the release before migrations 0035 and 0036 (a job's events and logged
/// signals found by its number) opens with this one, on both engines: a job whose history spans the
/// migrations shows all of it (its events, and its signal log likewise),
/// in number order — its old events (no number: nothing is backfilled) and its new ones (its
/// number, read from its row) — and the audit is clean. On PostgreSQL a writer of 0.1.0 (its
/// INSERT into `outbox_pending`, routed by 0024's function as 0035 replaced it) files its event
/// under the job's number too.
async fn from_before_migration_35(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    k.fail("j", &t, "TIMEOUT").await;
    // The failure re-sent: a replay, logged — one short of the log's bound, which the job's log
    // then reaches across the migration (0036: the bound counts the rows from before too).
    let max = settle_core::limits::SIGNALS_LOGGED_MAX;
    for _ in 1..max {
        assert!(!k.fail("j", &t, "TIMEOUT").await.applied);
    }
    let before = k.store.job_history(&jid("j")).await.unwrap().events;
    assert!(before.len() >= 3, "{before:?}");
    k.raw_script(&undo_37(&k)).await.unwrap();
    k.raw_script(UNDO_36).await.unwrap();
    k.raw_script(&undo_35(&k)).await.unwrap();
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    async fn history(store: &SqlStore) -> Vec<(i64, String)> {
        let events = store.job_history(&jid("j")).await.unwrap().events;
        events.into_iter().map(|e| (e.seq, e.kind.as_str().to_owned())).collect()
    }
    let old: Vec<_> = before.iter().map(|e| (e.seq, e.kind.as_str().to_owned())).collect();
    assert_eq!(history(&store).await, old, "the old events, found by the job's id");
    // The late success: the refund taken back, the job succeeded.
    assert!(store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().applied);
    let mut now = history(&store).await;
    assert_eq!(now[..old.len()], old[..], "the old events first");
    let kinds: Vec<_> = now[old.len()..].iter().map(|e| e.1.as_str()).collect();
    assert_eq!(kinds, ["job.reclaimed", "job.succeeded"], "{now:?}");
    if !url.starts_with("sqlite:") {
        // A writer of 0.1.0 queues an event of the job; this release's pass numbers it.
        raw_script_at(
            &url,
            "INSERT INTO outbox_pending (stamp, pos, type, job_id, account_id, data, created_at) \
             VALUES (nextval('outbox_stamps'), 1, 'job.requeued', 'j', 'a', '{}', 0)",
        )
        .await
        .unwrap();
        let done = now.len();
        for _ in 0..500 {
            now = history(&store).await;
            if now.len() > done {
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
        assert_eq!(now.len(), done + 1, "{now:?}");
        assert_eq!(now[done].1, "job.requeued");
    }
    assert!(now.windows(2).all(|w| w[0].0 < w[1].0), "in number order: {now:?}");
    let (seqs, own) =
        job_seqs(&url, "j", "events e JOIN stamp_numbers n ON n.stamp = e.stamp", "n.first_seq + e.pos").await;
    assert_eq!(seqs[..old.len()], vec![None; old.len()][..], "nothing backfilled");
    assert!(seqs[old.len()..].iter().all(|s| *s == Some(own)), "the new ones under the job's number: {seqs:?}");
    // Its signal log (0036): the replays logged before, the late success after, in that order; the
    // log now full, two more replays are counted, not kept.
    use settle_core::history::SignalEffect;
    let two_more = [fail_j_again(&store, &t).await, fail_j_again(&store, &t).await];
    assert_eq!(two_more, [false, false]);
    let signals = store.signals(&jid("j")).await.unwrap();
    let effects: Vec<_> = signals.iter().map(|s| s.effect).collect();
    let mut want = vec![SignalEffect::Noop; max - 1];
    want.push(SignalEffect::Recovered);
    assert_eq!(effects, want);
    assert_eq!(store.operators().job_history(&jid("j")).await.unwrap().signals_unlogged, 2);
    let (seqs, _) = job_seqs(&url, "j", "signals e", "e.id").await;
    let mut want = vec![None; max - 1];
    want.push(Some(own));
    assert_eq!(seqs, want, "the old ones as they were, the new one under the job's number");
    if !url.starts_with("sqlite:") {
        // A process of 0.1.0 logs a signal (its INSERT, without the number): it is listed.
        raw_script_at(
            &url,
            "INSERT INTO signals (job_id, attempt_no, signal, fail_code, message, effect, received_at) \
             VALUES ('j', 1, 'fail', 'TIMEOUT', NULL, 'stale', 0)",
        )
        .await
        .unwrap();
        let signals = store.signals(&jid("j")).await.unwrap();
        assert_eq!((signals.len(), signals.last().map(|s| s.effect)), (max + 1, Some(SignalEffect::Stale)));
    }
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

/// A database made by the release before migration 0037 (SQLite files a job's ledger lines and
/// allocations by its number) opens with this one, on both engines: on SQLite every line and part of
/// a job has its job's number afterwards (PostgreSQL's stay NULL), a job charged before it fails
/// after it with its parts given back, its lines read as before, a second charge of an item charged
/// before it is refused by the database (L4 across the migration), and the audit is clean — also
/// after a first run of the migration died before its commit.
async fn from_before_migration_37(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    let before = k.store.job_history(&jid("j")).await.unwrap().entries;
    assert_eq!(before.len(), 2, "two charges: {before:?}");
    k.raw_script(&undo_37(&k)).await.unwrap();
    // A process that dies inside the migration: its transaction (the backfill written, the indexes
    // built, the triggers made) rolled back. The store is as the previous release left it, and the
    // next open runs the migration again from the start.
    let migration = if k.is_sqlite() {
        include_str!("../../migrations/sqlite/0037_money_by_job_seq.sql")
    } else {
        include_str!("../../migrations/postgres/0037_money_by_job_seq.sql")
    };
    k.raw_script(&format!("BEGIN; {migration} ROLLBACK;")).await.unwrap();
    let Kit { store, clock, url, dir: _dir, .. } = k;
    drop(store);
    let options = StoreOptions { clock, policy: test_policy().into(), ..StoreOptions::default() };
    let store = SqlStore::open(&url, options).await.expect("the previous release's database opens");
    let sqlite = url.starts_with("sqlite:");
    let (lines, own) = job_seqs(&url, "j", "ledger_entries e", "e.seq").await;
    let (parts, _) = job_seqs(&url, "j", "allocations e", "e.id").await;
    let filed = if sqlite { Some(own) } else { None };
    assert_eq!(lines, vec![filed; 2], "the lines from before");
    assert_eq!(parts, vec![filed; 2], "the parts from before");
    assert_eq!(store.job_history(&jid("j")).await.unwrap().entries, before, "its lines, read as before");
    // A second charge of item i0, as a person might write it: the database refuses it.
    let charge = "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, \
         ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq) SELECT 99, \
         (SELECT MAX(l.account_seq) + 1 FROM ledger_entries l WHERE l.account_id = e.account_id), account_id, kind, \
         amount, balance_after, job_id, item_id, ref_id, reason, request_hash, created_at, \
         (SELECT l.hash FROM ledger_entries l WHERE l.account_id = e.account_id ORDER BY l.account_seq DESC LIMIT 1), \
         hash, job_seq FROM ledger_entries e WHERE job_id = 'j' ORDER BY seq LIMIT 1";
    let message = raw_script_at(&url, charge).await.expect_err("a second charge").to_string();
    let guard = if sqlite {
        "ledger_entries.job_seq, ledger_entries.item_id, ledger_entries.kind"
    } else {
        "ledger_entries_item_kind"
    };
    assert!(message.contains(guard), "{message}");
    // The failure after it: both items refunded, each part given back to the grant that paid it.
    assert!(store.fail(&jid("j"), fail_sig(&t, "TIMEOUT")).await.unwrap().applied);
    let (lines, _) = job_seqs(&url, "j", "ledger_entries e", "e.seq").await;
    assert_eq!(lines, vec![filed; 4], "the refunds filed as the charges are");
    let parts = store.allocations(&jid("j")).await.unwrap();
    assert_eq!(parts.len(), 2, "{parts:?}");
    assert!(parts.iter().all(|p| p.given_back == p.taken), "every part given back: {parts:?}");
    let job = store.job(&jid("j")).await.unwrap();
    assert_eq!(job.net.get(), 0, "{job:?}");
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_store_from_before_migration_37_files_its_money_by_job_number() {
    from_before_migration_37(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_store_from_before_migration_37_keeps_its_money_by_job_id() {
    from_before_migration_37(EngineKind::Postgres).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_a_job_whose_history_spans_migrations_35_and_36_shows_all_of_it() {
    from_before_migration_35(EngineKind::Sqlite).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_job_whose_history_spans_migrations_35_and_36_shows_all_of_it() {
    from_before_migration_35(EngineKind::Postgres).await;
}
