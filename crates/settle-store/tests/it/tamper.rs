//! The audit's detectors, each shown alone: a ledger altered behind Settle's back in one way only,
//! and the audit names exactly that. And the database's own guards (unique indexes, triggers)
//! refusing the rows a bug or a person might write directly.

use crate::kit::*;
use settle_core::ids::RefId;
use settle_core::{Clock, Credits, Timestamp};
use settle_store::*;

per_engine!(
    a_changed_reason_breaks_only_the_hash_chain,
    a_changed_timestamp_breaks_only_the_hash_chain,
    a_deleted_entry_is_a_gap_in_the_sequence,
    a_deleted_entry_inside_a_chain_is_a_gap_in_its_positions,
    positions_out_of_seq_order_are_a_step_back,
    a_deleted_event_is_a_gap_in_the_outbox,
    an_event_under_another_jobs_number_is_named,
    an_event_naming_no_job_is_named,
    money_rows_under_another_jobs_number_are_named,
    money_rows_with_a_stray_number_or_none_are_named,
    money_rows_the_passes_cannot_meet_are_named,
    a_wrong_balance_is_l1,
    a_grant_with_more_left_than_it_gave_is_l5,
    an_allocation_that_took_less_is_l5,
    a_debt_nobody_owes_is_l5,
    a_take_after_its_grants_expiry_is_l5,
    a_settlement_of_another_accounts_debt_is_l5,
    a_settlement_of_a_debt_that_says_nothing_paid_is_l5,
    a_wrong_exposure_is_l1,
    a_wrong_held_is_l1,
    a_second_charge_is_l4,
    a_reclaim_without_a_refund_is_l4,
    a_balance_after_that_is_not_the_running_sum_is_l2,
    a_second_refund_is_l4,
    an_item_state_its_entries_do_not_match_is_l3,
    an_entry_for_another_amount_than_the_cost_is_l3,
    an_entry_on_another_account_than_the_jobs_is_l3,
    entries_of_a_missing_item_are_l3,
    balance_plus_held_past_the_largest_is_l1,
    a_withdrawal_row_that_disagrees_with_its_job_is_l3,
    the_database_refuses_duplicate_money_rows,
    a_link_to_no_predecessor_is_refused_or_found,
    a_second_release_is_l4,
    an_unpriced_held_item_off_its_hold_is_l3,
    the_database_refuses_a_price_above_the_hold,
    an_alert_on_the_wrong_side_is_l7,
    an_alert_band_its_sides_do_not_give_is_l7,
    a_limit_that_lost_a_posting_is_l8,
    limits_on_an_unmarked_account_are_l8,
);

/// Ledger: 1 grant b 5 · 2 grant a 100 · 3 charge j/i0 −10 · 4 refund j/i0 +10 · 5 charge k/i0 −7.
/// Job `j` was claimed and failed retryably (its item refunded, `a` exposed 10), `k` is charged.
async fn scenario(k: &Kit) {
    k.account("b", 5).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10]).await;
    let t = k.claim_one("j").await;
    k.fail("j", &t, "TIMEOUT").await;
    k.items_job("k", &a, &[7]).await;
    k.assert_clean().await;
}

/// Audits and returns the violations as (invariant, message).
async fn found(k: &Kit) -> Vec<(&'static str, String)> {
    let report = k.store.audit(None).await.unwrap();
    report.violations.into_iter().map(|v| (v.invariant.as_str(), v.message)).collect()
}

/// The audit finds exactly one violation, of `invariant`, whose message contains `says`.
async fn only(k: &Kit, invariant: &str, says: &str) {
    let found = found(k).await;
    assert_eq!(found.len(), 1, "exactly one violation expected: {found:#?}");
    assert_eq!(found[0].0, invariant, "{found:#?}");
    assert!(found[0].1.contains(says), "{found:#?}");
}

/// The audit finds exactly these violations, in this order: (invariant, part of its message).
async fn exactly(k: &Kit, want: &[(&str, &str)]) {
    let found = found(k).await;
    assert_eq!(found.len(), want.len(), "{found:#?}");
    for ((inv, says), (got, message)) in want.iter().zip(&found) {
        assert_eq!(inv, got, "{found:#?}");
        assert!(message.contains(says), "{found:#?}");
    }
}

async fn a_changed_reason_breaks_only_the_hash_chain(k: &Kit) {
    scenario(k).await;
    tamper(k, &format!("{} UPDATE ledger_entries SET reason = 'forged' WHERE seq = 2;", drop_ledger_guards(k))).await;
    only(k, "L2", "entry 2: hash chain does not verify").await;
}

async fn a_changed_timestamp_breaks_only_the_hash_chain(k: &Kit) {
    scenario(k).await;
    let sql = format!("{} UPDATE ledger_entries SET created_at = created_at + 1 WHERE seq = 3;", drop_ledger_guards(k));
    tamper(k, &sql).await;
    only(k, "L2", "entry 3: hash chain does not verify").await;
}

async fn a_deleted_entry_is_a_gap_in_the_sequence(k: &Kit) {
    scenario(k).await;
    // b's only entry, with b's balance covered up: sums, chains and items all still agree, but b
    // counts one entry its ledger no longer has.
    let sql = format!(
        "{} DELETE FROM ledger_entries WHERE seq = 1; UPDATE accounts SET balance = 0 WHERE id = 'b';",
        drop_ledger_guards(k)
    );
    tamper(k, &sql).await;
    // The balance covered up no longer matches what b's grant holds (L5).
    exactly(
        k,
        &[
            ("SEQ", "counts 1 entries but its chain ends at 0"),
            ("L5", "live grants hold 5, debt 0, but the balance is 0"),
        ],
    )
    .await;
}

async fn a_deleted_entry_inside_a_chain_is_a_gap_in_its_positions(k: &Kit) {
    scenario(k).await;
    // a's second entry: its positions jump (and its chain and balances no longer add up).
    let sql =
        format!("{} DELETE FROM ledger_entries WHERE account_id = 'a' AND account_seq = 2;", drop_ledger_guards(k));
    tamper(k, &sql).await;
    let found = found(k).await;
    assert!(found.iter().any(|(inv, m)| *inv == "SEQ" && m.contains("account_seq 3 follows 1")), "{found:#?}");
}

async fn positions_out_of_seq_order_are_a_step_back(k: &Kit) {
    scenario(k).await;
    // a's second and third entries swap places in the chain: in seq order, a step back.
    let sql = format!(
        "{} DROP INDEX ledger_entries_account_seq; \
         UPDATE ledger_entries SET account_seq = 5 - account_seq WHERE account_id = 'a' AND account_seq IN (2, 3);",
        drop_ledger_guards(k)
    );
    tamper(k, &sql).await;
    let found = found(k).await;
    assert!(found.iter().any(|(inv, m)| *inv == "SEQ" && m.contains("account_seq 2 follows 3")), "{found:#?}");
    assert!(k.store.operators().verify_chain(&acc("a")).await.unwrap().is_some(), "the chain's positions break");
}

async fn a_deleted_event_is_a_gap_in_the_outbox(k: &Kit) {
    scenario(k).await;
    // The event numbered 2: the stamp whose range holds it, at its place.
    tamper(
        k,
        "DELETE FROM events WHERE EXISTS (SELECT 1 FROM stamp_numbers n WHERE n.stamp = events.stamp \
         AND n.first_seq + events.pos - 1 = 2)",
    )
    .await;
    only(k, "SEQ", "numbers events 2..=2 but holds 0 events").await;
}

/// The number of `job`'s events in its history, as the store reads it.
async fn history_len(k: &Kit, job: &str) -> usize {
    k.store.job_history(&jid(job)).await.unwrap().events.len()
}

/// One event of job `j` filed under job `k`'s number (migration 0035): the audit names it, and
/// neither job's history shows it (a job's events are read by its number and its id).
async fn an_event_under_another_jobs_number_is_named(k: &Kit) {
    scenario(k).await;
    let (j, other) = (history_len(k, "j").await, history_len(k, "k").await);
    tamper(
        k,
        "UPDATE events SET job_seq = (SELECT job_seq FROM jobs WHERE id = 'k') \
         WHERE (stamp, pos) IN (SELECT stamp, pos FROM events WHERE job_id = 'j' ORDER BY stamp, pos LIMIT 1)",
    )
    .await;
    let found = found(k).await;
    assert_eq!(found.len(), 1, "{found:#?}");
    assert_eq!(found[0].0, "SEQ", "{found:#?}");
    assert!(
        found[0].1.contains("names job j (job_seq ") && found[0].1.contains(") but carries job_seq "),
        "{found:#?}"
    );
    assert_eq!((history_len(k, "j").await, history_len(k, "k").await), (j - 1, other));
}

/// An event naming a job that does not exist, and an account's event carrying a job's number.
async fn an_event_naming_no_job_is_named(k: &Kit) {
    scenario(k).await;
    tamper(
        k,
        "UPDATE events SET job_id = 'gone' \
         WHERE (stamp, pos) IN (SELECT stamp, pos FROM events WHERE job_id = 'k' ORDER BY stamp, pos LIMIT 1); \
         UPDATE events SET job_seq = 1 \
         WHERE (stamp, pos) IN (SELECT stamp, pos FROM events WHERE job_id IS NULL ORDER BY stamp, pos LIMIT 1)",
    )
    .await;
    let mut found = found(k).await;
    found.sort();
    assert_eq!(found.len(), 2, "{found:#?}");
    assert!(found.iter().all(|(inv, _)| *inv == "SEQ"), "{found:#?}");
    assert!(found.iter().any(|(_, m)| m.ends_with("names job gone, which does not exist")), "{found:#?}");
    assert!(found.iter().any(|(_, m)| m.ends_with("names no job but carries job_seq 1")), "{found:#?}");
}

/// Job `j`'s refund and the part that paid for its item filed under job `k`'s number (its charge
/// there would be refused: `k`'s item of the same id has its charge), behind the ledger's
/// UPDATE trigger and SQLite's on the parts' keys (migration 0037): the audit names both. (On
/// SQLite, which reads a job's lines by its number, the refund also shows up under `k`'s item of the
/// same id: L3/L4 say so besides.)
async fn money_rows_under_another_jobs_number_are_named(k: &Kit) {
    scenario(k).await;
    let keys = if k.is_sqlite() { "DROP TRIGGER allocations_keys_fixed;" } else { "" };
    let sql = format!(
        "{} {keys} UPDATE ledger_entries SET job_seq = (SELECT job_seq FROM jobs WHERE id = 'k') WHERE seq = 4; \
         UPDATE allocations SET job_seq = (SELECT job_seq FROM jobs WHERE id = 'k') \
         WHERE id = (SELECT MIN(id) FROM allocations WHERE job_id = 'j');",
        drop_ledger_guards(k)
    );
    tamper(k, &sql).await;
    let found = found(k).await;
    let seq: Vec<&String> = found.iter().filter(|(inv, _)| *inv == "SEQ").map(|(_, m)| m).collect();
    assert_eq!(seq.len(), 2, "{found:#?}");
    for (m, row) in seq.iter().zip(["ledger entry 4 ", "allocation "]) {
        assert!(
            m.starts_with(row) && m.contains("names job j but carries job_seq ") && m.ends_with(", job k's"),
            "{m}"
        );
    }
    if !k.is_sqlite() {
        assert_eq!(found.len(), 2, "PostgreSQL reads by the id: nothing else moved: {found:#?}");
    }
}

/// A grant's line carrying a job's number (it names no job), and job `k`'s part with its number
/// taken away (migration 0037): the audit looks for both though its passes meet neither where it
/// expects, and names them — the part only on SQLite, which files parts by number (PostgreSQL's
/// writers leave every number NULL).
async fn money_rows_with_a_stray_number_or_none_are_named(k: &Kit) {
    scenario(k).await;
    let keys = if k.is_sqlite() { "DROP TRIGGER allocations_keys_fixed;" } else { "" };
    let sql = format!(
        "{} {keys} UPDATE ledger_entries SET job_seq = 999999 WHERE seq = 2; \
         UPDATE allocations SET job_seq = NULL WHERE job_id = 'k';",
        drop_ledger_guards(k)
    );
    tamper(k, &sql).await;
    let mut want = vec![("SEQ", "ledger entry 2 names no job but carries job_seq 999999")];
    if k.is_sqlite() {
        want.push(("SEQ", "names job k but carries no job_seq"));
    }
    exactly(k, &want).await;
}

/// Job `k`'s charge with its number taken away, and its part under a number no job has (migration
/// 0037): neither is met by SQLite's items pass, which reads them by number, and the audit counts
/// what it met against what there is, and looks. On PostgreSQL only the part is wrong (its writers
/// leave the numbers NULL), and any number met sends the audit looking.
async fn money_rows_the_passes_cannot_meet_are_named(k: &Kit) {
    scenario(k).await;
    let keys = if k.is_sqlite() { "DROP TRIGGER allocations_keys_fixed;" } else { "" };
    let sql = format!(
        "{} {keys} UPDATE ledger_entries SET job_seq = NULL WHERE seq = 5; \
         UPDATE allocations SET job_seq = 999999 WHERE job_id = 'k';",
        drop_ledger_guards(k)
    );
    tamper(k, &sql).await;
    let found = found(k).await;
    let seq: Vec<&String> = found.iter().filter(|(inv, _)| *inv == "SEQ").map(|(_, m)| m).collect();
    let part = |m: &&String| {
        m.starts_with("allocation ") && m.ends_with(" names job k but carries job_seq 999999, which no job has")
    };
    if k.is_sqlite() {
        assert_eq!(seq.len(), 2, "{found:#?}");
        assert_eq!(seq[0], "ledger entry 5 names job k but carries no job_seq", "{found:#?}");
        assert!(part(&seq[1]), "{found:#?}");
    } else {
        assert_eq!(found.len(), 1, "{found:#?}");
        assert!(part(&seq[0]), "{found:#?}");
    }
}

/// SQLite's triggers (migration 0037) refuse a ledger line or allocation whose `job_seq` is not its
/// job's: none, another job's, a number no job has, or one on a row that names no job. Each is
/// otherwise a row the ledger takes (its next position, linked to its account's last line).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_the_database_refuses_a_money_row_without_its_jobs_number() {
    let k = Kit::new(EngineKind::Sqlite).await;
    scenario(&k).await;
    let line = |job_seq: &str, from: i64, kind: &str, ref_id: &str| {
        format!(
            "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, \
             ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq) SELECT 6, \
             (SELECT MAX(l.account_seq) + 1 FROM ledger_entries l WHERE l.account_id = e.account_id), account_id, \
             '{kind}', amount, balance_after, job_id, item_id, {ref_id}, reason, request_hash, created_at, \
             (SELECT l.hash FROM ledger_entries l WHERE l.account_id = e.account_id ORDER BY l.account_seq DESC LIMIT 1), \
             hash, {job_seq} FROM ledger_entries e WHERE seq = {from}"
        )
    };
    let part = |job_seq: &str| {
        format!(
            "INSERT INTO allocations (account_id, grant_key, kind, job_id, item_id, ref_id, account_seq, taken, \
             created_at, job_seq) SELECT account_id, grant_key, 'reclaim', job_id, item_id, ref_id, account_seq, taken, \
             created_at, {job_seq} FROM allocations WHERE job_id = 'k'"
        )
    };
    let j = "(SELECT job_seq FROM jobs WHERE id = 'j')";
    for (what, sql, says) in [
        ("a job's line without a number", line("NULL", 5, "reclaim", "ref_id"), "ledger entry whose job_seq"),
        ("a job's line under another job's", line(j, 5, "reclaim", "ref_id"), "ledger entry whose job_seq"),
        ("a job's line under no job's", line("999999", 5, "reclaim", "ref_id"), "ledger entry whose job_seq"),
        ("a grant with a job's number", line(j, 2, "grant", "'another'"), "ledger entry whose job_seq"),
        ("a part without a number", part("NULL"), "allocation whose job_seq"),
        ("a part under another job's", part(j), "allocation whose job_seq"),
    ] {
        let message = k.raw_script(&sql).await.expect_err(what).to_string();
        assert!(message.contains(says), "{what}: {message}");
    }
    // A job's id or number changed, or a part's job. (A REPLACE of a job's row fires no UPDATE
    // trigger: the audit names the lines and parts it leaves under a number no job has.)
    for (what, sql, says) in [
        ("a job's number changed", "UPDATE jobs SET job_seq = 999999 WHERE id = 'k'", "never change"),
        ("a job's id changed", "UPDATE jobs SET id = 'k2' WHERE id = 'k'", "never change"),
        ("a part moved", "UPDATE allocations SET job_id = 'j' WHERE job_id = 'k'", "never change"),
    ] {
        let message = k.raw_script(sql).await.expect_err(what).to_string();
        assert!(message.contains(says), "{what}: {message}");
    }
    // The same line under its own job's number is taken: the guard refuses the number alone.
    k.raw_script(&line("(SELECT job_seq FROM jobs WHERE id = 'k')", 5, "reclaim", "ref_id")).await.unwrap();
    // A REPLACE of k's row under a new number fires no trigger: the audit names the lines and the
    // part it leaves under a number no job has.
    k.raw_script(
        "CREATE TEMP TABLE k AS SELECT * FROM jobs WHERE id = 'k'; UPDATE k SET job_seq = 999999; \
         INSERT OR REPLACE INTO jobs SELECT * FROM k;",
    )
    .await
    .unwrap();
    let found = found(&k).await;
    let stranded = |m: &String| m.contains("names job k but carries job_seq ") && m.ends_with(", which no job has");
    assert!(
        found.iter().any(|(inv, m)| *inv == "SEQ" && m.starts_with("ledger entry 5 ") && stranded(m)),
        "{found:#?}"
    );
    assert!(found.iter().any(|(inv, m)| *inv == "SEQ" && m.starts_with("allocation ") && stranded(m)), "{found:#?}");
}

/// Account `a` (balance 93) with alerts at 50 (above) and 95 (below).
async fn alerted(k: &Kit) {
    scenario(k).await;
    let alerts = vec![("fifty".to_owned(), 50), ("ninety-five".to_owned(), 95)];
    k.store.set_alerts(&acc("a"), alerts, SYSTEM_ACTOR).await.unwrap();
    k.assert_clean().await;
}

async fn an_alert_on_the_wrong_side_is_l7(k: &Kit) {
    alerted(k).await;
    // The side flipped and the band with it (as a missed crossing would leave them): only the side
    // disagrees with the balance.
    tamper(
        k,
        "UPDATE account_alerts SET side = 'below' WHERE alert_id = 'fifty'; \
         UPDATE accounts SET alert_floor = NULL, alert_ceiling = 50 WHERE id = 'a'",
    )
    .await;
    only(k, "L7", "alert fifty (below 50) is on the below side of a balance of 93").await;
}

async fn an_alert_band_its_sides_do_not_give_is_l7(k: &Kit) {
    alerted(k).await;
    tamper(k, "UPDATE accounts SET alert_ceiling = 120 WHERE id = 'a'").await;
    only(k, "L7", "the alert band is Some(50)..Some(120), but the alerts' sides give Some(50)..Some(95)").await;
}

/// Account `a` with a day limit of 1,000 on every kind: the day spent 7 (10 charged, 10 refunded,
/// 7 charged).
async fn limited(k: &Kit) {
    scenario(k).await;
    let limit = NewLimit { period: settle_core::spend::Period::Day, amount: 1_000, kinds: Vec::new() };
    let stored = k.store.set_limits(&acc("a"), vec![limit], SYSTEM_ACTOR).await.unwrap();
    assert_eq!(stored[0].spent, 7);
    k.assert_clean().await;
}

async fn a_limit_that_lost_a_posting_is_l8(k: &Kit) {
    limited(k).await;
    // As a posting that was not counted would leave it: the next check would allow 1 too many.
    tamper(k, "UPDATE spend_limits SET spent = spent - 1 WHERE account_id = 'a'").await;
    only(k, "L8", "spend limit 0 (day from 2026-01-01T00:00:00Z) records 6 spent, but its period's ledger lines say 7")
        .await;
}

async fn limits_on_an_unmarked_account_are_l8(k: &Kit) {
    limited(k).await;
    // Unmarked, the account's creates would never be checked.
    tamper(k, "UPDATE accounts SET spend_limited = 0 WHERE id = 'a'").await;
    only(k, "L8", "has spend limits, not marked").await;
}

async fn a_wrong_balance_is_l1(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE accounts SET balance = balance + 1 WHERE id = 'a'").await;
    exactly(
        k,
        &[("L1", "balance 94 but entries sum to 93"), ("L5", "live grants hold 93, debt 0, but the balance is 94")],
    )
    .await;
}

async fn a_grant_with_more_left_than_it_gave_is_l5(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE grants SET remaining = remaining + 1 WHERE source_id = 'g-a'").await;
    exactly(
        k,
        &[
            ("L5", "grant g-a: amount 100 + returned 10 ≠ consumed 17 + expired 0 + remaining 94"),
            ("L5", "live grants hold 94, debt 0, but the balance is 93"),
        ],
    )
    .await;
}

async fn an_allocation_that_took_less_is_l5(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE allocations SET taken = taken - 1 WHERE job_id = 'k'").await;
    exactly(
        k,
        &[
            ("L5", "grant g-a: amount 100 + returned 10 ≠ consumed 16 + expired 0 + remaining 93"),
            ("L5", "its open parts hold 6, its state charged costs 7"),
        ],
    )
    .await;
}

async fn a_debt_nobody_owes_is_l5(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE accounts SET debt = 3 WHERE id = 'b'").await;
    exactly(
        k,
        &[("L5", "live grants hold 5, debt 3, but the balance is 5"), ("L5", "debt 3 but its unpaid debt parts are 0")],
    )
    .await;
}

/// A part taken from a grant, stamped (by hand) at its grant's expiry: credit already dead was
/// spent. Found by the allocations pass, which reads each part beside its grant.
async fn a_take_after_its_grants_expiry_is_l5(k: &Kit) {
    let a = acc("e");
    let req = NewAccount { id: a.clone(), overdraft_limit: Credits::new(0), max_running: None };
    k.store.create_account(req, SYSTEM_ACTOR).await.unwrap();
    let expires_at = Some(Timestamp::from_micros(k.clock.now().micros() + 60_000_000));
    let grant = NewGrant {
        id: RefId::parse("promo").unwrap(),
        amount: Credits::new(50),
        reason: None,
        expires_at,
        priority: None,
    };
    k.store.grant(&a, grant, SYSTEM_ACTOR).await.unwrap();
    k.items_job("t", &a, &[5]).await;
    k.assert_clean().await;
    tamper(
        k,
        "UPDATE allocations SET created_at = (SELECT expires_at FROM grants WHERE source_id = 'promo') WHERE job_id = 't'",
    )
    .await;
    only(k, "L5", "grant promo: 5 taken by a posting at").await;
}

async fn a_wrong_exposure_is_l1(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE accounts SET exposure = exposure + 1 WHERE id = 'a'").await;
    only(k, "L1", "exposure 11 but refunded items cost 10").await;
}

async fn a_wrong_held_is_l1(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE accounts SET held = held + 1 WHERE id = 'a'").await;
    only(k, "L1", "held 8 but the items that may still be credited back cost 7").await;
}

/// A copy of entry `from` as entry 6 of `kind`, with the guards that would refuse it dropped: the
/// unique index on (job, item, kind) (SQLite's on the job's number), and the chain's (PostgreSQL's
/// unique index, SQLite's trigger).
fn copy_entry(k: &Kit, from: i64, kind: &str) -> String {
    let drop = if k.is_sqlite() {
        "DROP INDEX ledger_entries_job_seq; DROP TRIGGER ledger_entries_chain;"
    } else {
        "DROP INDEX ledger_entries_item_kind; DROP INDEX ledger_entries_chain;"
    };
    format!(
        "{drop} INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, \
         ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq) SELECT 6, 100, account_id, '{kind}', amount, \
         balance_after, job_id, item_id, ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq \
         FROM ledger_entries WHERE seq = {from};"
    )
}

async fn a_second_charge_is_l4(k: &Kit) {
    scenario(k).await;
    tamper(k, &copy_entry(k, 5, "charge")).await;
    let found = found(k).await;
    assert!(found.iter().any(|(inv, m)| *inv == "L4" && m.contains("2 charges")), "{found:#?}");
}

async fn a_reclaim_without_a_refund_is_l4(k: &Kit) {
    scenario(k).await;
    tamper(k, &copy_entry(k, 5, "reclaim")).await;
    let found = found(k).await;
    assert!(
        found.iter().any(|(inv, m)| *inv == "L4" && m.contains("a reclaim without an earlier refund")),
        "{found:#?}"
    );
}

async fn a_balance_after_that_is_not_the_running_sum_is_l2(k: &Kit) {
    scenario(k).await;
    tamper(k, &format!("{} UPDATE ledger_entries SET balance_after = 0 WHERE seq = 3;", drop_ledger_guards(k))).await;
    let found = found(k).await;
    assert!(
        found.iter().any(|(inv, m)| *inv == "L2" && m.contains("entry 3: balance_after 0 but the running sum is 90")),
        "{found:#?}"
    );
}

/// The audit names `invariant` with a message containing `says` (among what else the tampering
/// breaks: these alterations cannot be hidden from the other checks).
async fn names(k: &Kit, invariant: &str, says: &str) {
    let found = found(k).await;
    assert!(found.iter().any(|(inv, m)| *inv == invariant && m.contains(says)), "{invariant} {says:?} in {found:#?}");
}

async fn a_second_refund_is_l4(k: &Kit) {
    scenario(k).await;
    tamper(k, &copy_entry(k, 4, "refund")).await;
    names(k, "L4", "1 charges, 2 refunds").await;
}

async fn an_item_state_its_entries_do_not_match_is_l3(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE items SET state = 'charged', refund_reason = NULL WHERE job_id = 'j'").await;
    names(k, "L3", "entries sum to 0 but state charged nets -10").await;
    names(k, "L3", "state charged has entries [Charge, Refund]").await;
}

async fn an_entry_for_another_amount_than_the_cost_is_l3(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE items SET cost = 8 WHERE job_id = 'k'").await;
    names(k, "L3", "Charge of -7 for an item of cost 8").await;
}

async fn an_entry_on_another_account_than_the_jobs_is_l3(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE jobs SET account_id = 'b' WHERE id = 'k'").await;
    names(k, "L3", "Charge posted to a, not the job's account b").await;
}

async fn entries_of_a_missing_item_are_l3(k: &Kit) {
    scenario(k).await;
    tamper(k, "DELETE FROM items WHERE job_id = 'k'").await;
    names(k, "L3", "ledger entries name an item that does not exist").await;
}

async fn balance_plus_held_past_the_largest_is_l1(k: &Kit) {
    scenario(k).await;
    tamper(k, "UPDATE accounts SET held = 2305843009213693952 WHERE id = 'a'").await;
    names(k, "L1", "balance 93 plus held 2305843009213693952 exceeds the largest balance").await;
}

async fn a_withdrawal_row_that_disagrees_with_its_job_is_l3(k: &Kit) {
    scenario(k).await;
    let w = NewWithdrawal {
        id: jid("w1"),
        account_id: acc("a"),
        amount: settle_core::Credits::new(20),
        destination: settle_core::ids::Destination::parse("acct-1").unwrap(),
    };
    k.store.payouts().create_withdrawal(w).await.unwrap();
    k.assert_clean().await;
    tamper(k, "UPDATE withdrawals SET amount = 21 WHERE job_id = 'w1'").await;
    only(k, "L3", "withdrawal amount Some(21) but the job holds 20").await;
}

/// The rows no code path may write, written directly: each refused by the database itself.
async fn the_database_refuses_duplicate_money_rows(k: &Kit) {
    scenario(k).await;
    // Each copy sits at its account's next position, after its account's last line (entry 5), unless
    // it is a fork, so exactly one guard stands in the way; the error names it (PostgreSQL's index
    // by name, SQLite's by its columns, SQLite's chain trigger by its message).
    let copy_at = |seq: i64, kind: &str, position: &str, prev: &str| {
        format!(
            "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, \
             ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq) SELECT 6, {position}, account_id, \
             '{kind}', amount, balance_after, job_id, item_id, ref_id, reason, request_hash, created_at, {prev}, hash, \
             job_seq FROM ledger_entries e WHERE seq = {seq}"
        )
    };
    let next = "(SELECT MAX(l.account_seq) + 1 FROM ledger_entries l WHERE l.account_id = e.account_id)";
    let copy = |seq: i64, kind: &str, prev: &str| copy_at(seq, kind, next, prev);
    let after_last = "(SELECT l.hash FROM ledger_entries l WHERE l.account_id = e.account_id \
                      ORDER BY l.account_seq DESC LIMIT 1)";
    let sqlite = k.is_sqlite();
    for (what, sql, pg_index, sqlite_columns) in [
        (
            "second charge",
            copy(5, "charge", after_last),
            "ledger_entries_item_kind",
            "ledger_entries.job_seq, ledger_entries.item_id, ledger_entries.kind",
        ),
        (
            "second refund",
            copy(4, "refund", after_last),
            "ledger_entries_item_kind",
            "ledger_entries.job_seq, ledger_entries.item_id, ledger_entries.kind",
        ),
        (
            "second grant of one ref",
            copy(2, "grant", after_last),
            "ledger_entries_ref",
            "ledger_entries.kind, ledger_entries.ref_id",
        ),
        (
            // After entry 5's predecessor, at the next position: PostgreSQL's unique index sees a
            // second line after one hash; SQLite's trigger a link that is not the line before's.
            "fork of the chain, at the next position",
            copy(5, "reclaim", "e.prev_hash"),
            "ledger_entries_chain",
            "is not the hash of its account's entry before it",
        ),
        (
            // After entry 5's predecessor, at entry 5's own position: the link is right for the
            // position, and the position is taken.
            "fork of the chain, at the same position",
            copy_at(5, "reclaim", "e.account_seq", "e.prev_hash"),
            // Both of PostgreSQL's unique indexes stand in the way: whichever it checks first.
            "ledger_entries_chain|ledger_entries_account_seq",
            "ledger_entries.account_id, ledger_entries.account_seq",
        ),
    ] {
        let message = k.raw_script(&sql).await.expect_err(what).to_string();
        let names = if sqlite { sqlite_columns } else { pg_index };
        assert!(names.split('|').any(|name| message.contains(name)), "{what}: {message}");
    }
    for (what, sql) in [
        ("update", "UPDATE ledger_entries SET amount = 0 WHERE seq = 3"),
        ("delete", "DELETE FROM ledger_entries WHERE seq = 3"),
    ] {
        let message = k.raw_script(sql).await.expect_err(what).to_string();
        assert!(message.contains("append-only"), "{what}: {message}");
    }
    if !k.is_sqlite() {
        let message = k.raw_script("TRUNCATE ledger_entries CASCADE").await.expect_err("truncate").to_string();
        assert!(message.contains("append-only"), "truncate: {message}");
    }
    k.assert_clean().await;
}

/// A line at its account's next position whose `prev_hash` is not its predecessor's hash (here
/// account b's line's), its own `hash` computed honestly over that link, so the link is its only
/// fault: SQLite's trigger refuses it (migration 0034); PostgreSQL's unique index on
/// `(account_id, prev_hash)` cannot, as no line of the account follows that hash, and the audit's
/// L2 names it (decision 0037).
async fn a_link_to_no_predecessor_is_refused_or_found(k: &Kit) {
    scenario(k).await;
    let page = Page { after: 0, limit: 100 };
    let last = k.store.ledger(&acc("a"), page).await.unwrap().rows.pop().expect("a's lines");
    assert_eq!(last.seq, 5, "{last:?}");
    let foreign = k.store.ledger(&acc("b"), page).await.unwrap().rows[0].hash;
    let fields = settle_core::ledger::EntryFields {
        seq: 6,
        account_id: "a",
        kind: settle_core::ledger::EntryKind::Reclaim,
        amount: last.amount.get(),
        balance_after: last.balance_after.get() + last.amount.get(),
        job_id: last.job_id.as_deref(),
        item_id: last.item_id.as_deref(),
        ref_id: last.ref_id.as_deref(),
        reason: last.reason.as_deref(),
        created_at: last.created_at.micros(),
    };
    let hash = settle_core::ledger::chain_hash(&foreign, &fields);
    let hex = |h: &[u8; 32]| h.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let blob = |h: &[u8; 32]| if k.is_sqlite() { format!("X'{}'", hex(h)) } else { format!("'\\x{}'::bytea", hex(h)) };
    let sql = format!(
        "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, \
         ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq) SELECT 6, account_seq + 1, account_id, 'reclaim', \
         amount, {}, job_id, item_id, ref_id, reason, request_hash, created_at, {}, {}, job_seq FROM ledger_entries WHERE seq = 5",
        fields.balance_after,
        blob(&foreign),
        blob(&hash)
    );
    if k.is_sqlite() {
        let message = k.raw_script(&sql).await.expect_err("a link to no predecessor").to_string();
        assert!(message.contains("is not the hash of its account's entry before it"), "{message}");
        k.assert_clean().await;
    } else {
        tamper(k, &sql).await;
        let found = found(k).await;
        let l2: Vec<&String> = found.iter().filter(|(inv, _)| *inv == "L2").map(|(_, m)| m).collect();
        assert_eq!(l2, ["entry 6: hash chain does not verify"], "the link, and only it, breaks L2: {found:#?}");
    }
}

/// Held items (decision 0022). Ledger: 1 grant a 100 · 2 charge h/main −40 · 3 release h/main +25
/// (priced at 15) · 4 charge g/main −30 (held, unpriced).
async fn held_scenario(k: &Kit) {
    let a = k.account("a", 100).await;
    let held = |id: &str, hold: i64| NewJob {
        items: vec![NewItem { id: iid("main"), price: Price::Hold(settle_core::Credits::new(hold)) }],
        ..new_job(id, &a, 0)
    };
    k.store.create_job(held("h", 40)).await.unwrap();
    let t = k.claim_one("h").await;
    let priced = Costs::main(settle_core::Credits::new(15));
    k.store.succeed_priced(&jid("h"), Reporter::of(Some(&t)), None, &priced).await.unwrap();
    k.store.create_job(held("g", 30)).await.unwrap();
    k.assert_clean().await;
}

async fn a_second_release_is_l4(k: &Kit) {
    held_scenario(k).await;
    tamper(k, &copy_entry(k, 3, "release")).await;
    names(k, "L4", "0 reclaims, 0 payout returns, 2 releases").await;
}

async fn an_unpriced_held_item_off_its_hold_is_l3(k: &Kit) {
    held_scenario(k).await;
    tamper(k, "UPDATE items SET cost = 20 WHERE job_id = 'g'").await;
    names(k, "L3", "state charged with cost 20 and hold 30").await;
}

async fn the_database_refuses_a_price_above_the_hold(k: &Kit) {
    held_scenario(k).await;
    let refused = k.raw("UPDATE items SET cost = 41 WHERE job_id = 'h'").await;
    assert!(refused.is_err(), "a price above the hold is refused by the database itself");
    k.assert_clean().await;
}

/// A PostgreSQL store (whose writers leave `job_seq` NULL on lines and parts) copies into SQLite,
/// which files them by their job's number (migration 0037): the copy fills each from its job's row,
/// and a refund on the copy finds the parts that paid for its item.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_store_copied_into_sqlite_has_its_money_filed_by_number() {
    let k = Kit::new(crate::kit::EngineKind::Postgres).await;
    scenario(&k).await;
    let dir = tempfile::tempdir().unwrap();
    let target = format!("sqlite://{}", dir.path().join("copy.db").display());
    drop(SqlStore::open(&target, StoreOptions::default()).await.unwrap());
    settle_store::copy::copy(&k.url, &target, |_, _| {}).await.expect("the copy");
    use sqlx::{Connection, Row};
    let mut c = sqlx::SqliteConnection::connect(&target).await.unwrap();
    let sql = "SELECT (SELECT COUNT(*) FROM ledger_entries e JOIN jobs j ON j.id = e.job_id WHERE e.job_seq = j.job_seq) \
               + (SELECT COUNT(*) FROM allocations a JOIN jobs j ON j.id = a.job_id WHERE a.job_seq = j.job_seq)";
    let filed: i64 = sqlx::query(sql).fetch_one(&mut c).await.unwrap().get(0);
    assert_eq!(filed, 3 + 2, "j's charge and refund and k's charge, and the parts of the two charges");
    c.close().await.unwrap();
    let store = SqlStore::open(&target, StoreOptions::default()).await.unwrap();
    let cancelled = store.cancel(&jid("k"), None).await.unwrap();
    assert!(matches!(cancelled, CancelOutcome::Cancelled(_)), "k cancelled, its item refunded: {cancelled:?}");
    let parts = store.allocations(&jid("k")).await.unwrap();
    assert!(!parts.is_empty() && parts.iter().all(|p| p.given_back == p.taken), "{parts:?}");
    let audit = store.audit(None).await.unwrap();
    assert!(audit.violations.is_empty(), "{:?}", audit.violations);
}

/// Decision 0037's one change of behaviour: a PostgreSQL store holding a line linked to no
/// predecessor (let in there, named by its audit) is not copied into SQLite, whose trigger refuses
/// that line. The copy fails naming the table and the refusal, and leaves the target empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_a_chain_that_does_not_link_is_not_copied_into_sqlite() {
    let k = Kit::new(crate::kit::EngineKind::Postgres).await;
    scenario(&k).await;
    // Entry 5's copy at a's next position, linked to account b's line: no PostgreSQL guard refuses it.
    tamper(
        &k,
        "INSERT INTO ledger_entries (seq, account_seq, account_id, kind, amount, balance_after, job_id, item_id, \
         ref_id, reason, request_hash, created_at, prev_hash, hash, job_seq) SELECT 6, account_seq + 1, account_id, 'reclaim', \
         amount, balance_after - 7, job_id, item_id, ref_id, reason, request_hash, created_at, \
         (SELECT b.hash FROM ledger_entries b WHERE b.seq = 1), hash, job_seq FROM ledger_entries WHERE seq = 5",
    )
    .await;
    let dir = tempfile::tempdir().unwrap();
    let target = format!("sqlite://{}", dir.path().join("copy.db").display());
    drop(SqlStore::open(&target, StoreOptions::default()).await.unwrap());
    let message = settle_store::copy::copy(&k.url, &target, |_, _| {}).await.expect_err("a broken chain").to_string();
    assert!(
        message.contains("the target refused a row of ledger_entries: ledger entry whose prev_hash is not the hash"),
        "{message}"
    );
    assert!(message.ends_with("nothing was copied"), "{message}");
    use sqlx::{Connection, Row};
    let mut c = sqlx::SqliteConnection::connect(&target).await.unwrap();
    for table in ["accounts", "jobs", "ledger_entries"] {
        let sql = format!("SELECT COUNT(*) FROM {table}");
        let n: i64 = sqlx::query(sqlx::AssertSqlSafe(sql)).fetch_one(&mut c).await.unwrap().get(0);
        assert_eq!(n, 0, "the copy left rows in {table}");
    }
}

/// Two overdrawn accounts, each debt (a debt part of 30) paid by a grant that came after it (a
/// settlement naming the part).
async fn settled_debts(k: &Kit) {
    for id in ["d", "o"] {
        let a = acc(id);
        let req = NewAccount { id: a.clone(), overdraft_limit: Credits::new(100), max_running: None };
        k.store.create_account(req, SYSTEM_ACTOR).await.unwrap();
        k.job(&format!("{id}-j"), &a, 30).await;
        let grant = NewGrant {
            id: RefId::parse(&format!("{id}-g")).unwrap(),
            amount: Credits::new(50),
            reason: None,
            expires_at: None,
            priority: None,
        };
        k.store.grant(&a, grant, SYSTEM_ACTOR).await.unwrap();
    }
    k.assert_clean().await;
}

/// Every `want` is among what the audit finds, and everything it finds is L5.
async fn finds_l5(k: &Kit, want: &[&str]) {
    let found = found(k).await;
    assert!(found.iter().all(|(inv, _)| *inv == "L5"), "{found:#?}");
    for says in want {
        assert!(found.iter().any(|(_, m)| m.contains(says)), "{says:?} not found: {found:#?}");
    }
}

/// A settlement moved (by hand) to pay another account's debt part: the part it names is one the
/// allocations pass kept (it says 30 paid).
async fn a_settlement_of_another_accounts_debt_is_l5(k: &Kit) {
    settled_debts(k).await;
    tamper(
        k,
        "UPDATE allocations SET paid_part = (SELECT id FROM allocations WHERE account_id = 'o' AND grant_key IS NULL) \
         WHERE account_id = 'd' AND paid_part IS NOT NULL",
    )
    .await;
    finds_l5(k, &["pays o's debt part", "says 30 paid, its settlements 0", "says 30 paid, its settlements 60"]).await;
}

/// A debt part that says nothing of it is paid (the pass does not keep such parts) while
/// settlements name it — its own account's, and one moved from another account: each settlement
/// is judged against the part, looked up by id after the pass.
async fn a_settlement_of_a_debt_that_says_nothing_paid_is_l5(k: &Kit) {
    settled_debts(k).await;
    tamper(
        k,
        "UPDATE allocations SET paid_part = (SELECT id FROM allocations WHERE account_id = 'd' AND grant_key IS NULL) \
         WHERE account_id = 'o' AND paid_part IS NOT NULL; \
         UPDATE allocations SET settled = 0, owed = 1 WHERE account_id = 'd' AND grant_key IS NULL",
    )
    .await;
    finds_l5(k, &["pays d's debt part", "says 0 paid, its settlements 60", "says 30 paid, its settlements 0"]).await;
}
