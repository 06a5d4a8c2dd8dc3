//! The audit from a checkpoint (decision 0040): it reads only what was written since the last
//! clean audit recorded one, and finds what the full audit finds there; an audit that finds
//! anything retires the checkpoint; one of another schema version is not started from. (The
//! test kit's clean check runs it after every scenario of the suite, and the simulator after every
//! full check: there, a job moved without a line or event naming it would leave its sums short.)

use crate::kit::*;
use settle_store::*;

per_engine!(
    the_next_audit_reads_only_what_came_after,
    a_new_line_off_its_items_cost_is_found,
    a_rewritten_anchor_is_found,
    an_item_moved_without_its_line_is_found,
    an_old_item_moved_behind_settles_back_is_found_by_the_full_audit,
    a_wrong_exposure_is_found,
    an_audit_that_finds_anything_retires_the_checkpoint,
    a_checkpoint_of_another_schema_is_not_started_from,
    when_many_jobs_were_touched_every_job_is_read,
    a_checkpoint_write_that_dies_leaves_the_one_before,
);

const FROM: AuditRun = AuditRun { from_checkpoint: true, record: false };

/// Accounts `a` (100) and `b` (5); job `o` succeeded, job `j` failed (its item refunded), job `k`
/// charged; a clean audit, which records the checkpoint the tests start from (six lines). Returns
/// the token of `j`'s failed attempt.
async fn before(k: &Kit) -> LeaseToken {
    k.account("b", 5).await;
    let a = k.account("a", 100).await;
    k.items_job("o", &a, &[5]).await;
    let t = k.claim_one("o").await;
    k.store.succeed(&jid("o"), Reporter::of(Some(&t)), None).await.unwrap();
    k.items_job("j", &a, &[10]).await;
    let t = k.claim_one("j").await;
    k.fail("j", &t, "TIMEOUT").await;
    k.items_job("k", &a, &[7]).await;
    numbered(k).await;
    k.assert_clean().await;
    t
}

/// Every event committed so far numbered (PostgreSQL numbers them after their commit): a stamp
/// numbered only after a checkpoint was recorded counts its job as touched in the next audit from
/// it, which is sound (it reads more, never less) but not the count these tests expect.
async fn numbered(k: &Kit) {
    k.store.events(0, 1, &settle_core::scope::Scope::ALL).await.unwrap();
}

/// After the checkpoint (five lines): job `m` (two items) created, `k` and `m` claimed, `m` failed;
/// `j`'s failed attempt reports success after all (its refund reclaimed). `o` is not touched.
async fn after(k: &Kit, j: &LeaseToken) {
    k.items_job("m", &acc("a"), &[3, 4]).await;
    let claimed = k.store.claim(claim_req("w1", 2)).await.unwrap();
    let ids: Vec<&str> = claimed.iter().map(|c| c.job.id.as_str()).collect();
    assert_eq!(ids, ["k", "m"]);
    k.fail("m", &claimed[1].lease_token, "TIMEOUT").await;
    k.store.succeed(&jid("j"), Reporter::of(Some(j)), None).await.unwrap();
}

/// The violations of an audit run as `run`, as (invariant, message), sorted.
async fn found(k: &Kit, run: AuditRun) -> Vec<(&'static str, String)> {
    let report = k.store.audit_with(run, None).await.unwrap();
    let mut found: Vec<_> = report.violations.into_iter().map(|v| (v.invariant.as_str(), v.message)).collect();
    found.sort();
    found
}

/// The audit from the checkpoint finds a violation of `invariant` saying `says` (and is run first:
/// the full audit after it retires the checkpoint).
async fn from_finds(k: &Kit, invariant: &str, says: &str) -> Vec<(&'static str, String)> {
    let from = found(k, FROM).await;
    assert!(from.iter().any(|(i, m)| *i == invariant && m.contains(says)), "{invariant} {says}: {from:#?}");
    from
}

async fn the_next_audit_reads_only_what_came_after(k: &Kit) {
    let j = before(k).await;
    after(k, &j).await;
    let full = k.store.audit(None).await.unwrap();
    let from = k.store.audit_with(FROM, None).await.unwrap();
    assert!(full.ok() && from.ok(), "{full:#?} {from:#?}");
    let c = &from.checkpoint;
    let mark = c.from.expect("started from the checkpoint");
    // Before: b's grant, a's grant, o's charge, j's charge and refund, k's charge. After: m's two
    // charges and refunds, j's reclaim.
    assert_eq!((mark.entries, c.entries_covered), (6, 11), "{c:?}");
    assert_eq!(full.entries_checked, 11);
    assert_eq!(from.entries_checked, 5, "only the lines since: {from:#?}");
    // j, k (claimed) and m were touched: their items checked again; o's sums taken from the checkpoint.
    assert_eq!((c.jobs_checked, from.items_checked), (3, 4), "{c:?}");
    assert_eq!((full.items_checked, full.checkpoint.jobs_checked), (5, 0));
    // Recorded again, the next audit from it has nothing to read.
    numbered(k).await;
    k.assert_clean().await;
    let quiet = k.store.audit_with(FROM, None).await.unwrap();
    assert!(quiet.ok(), "{quiet:#?}");
    assert_eq!((quiet.entries_checked, quiet.items_checked, quiet.checkpoint.jobs_checked), (0, 0, 0));
    assert_eq!(quiet.checkpoint.entries_covered, 11);
}

/// A line written after the checkpoint, altered: the audit from it finds what the full audit finds.
async fn a_new_line_off_its_items_cost_is_found(k: &Kit) {
    let j = before(k).await;
    after(k, &j).await;
    let sql = format!(
        "{} UPDATE ledger_entries SET amount = amount - 1, balance_after = balance_after - 1 \
         WHERE job_id = 'm' AND item_id = 'i1' AND kind = 'charge';",
        drop_ledger_guards(k)
    );
    tamper(k, &sql).await;
    let from = from_finds(k, "L3", "Charge of -5 for an item of cost 4").await;
    assert_eq!(from, found(k, AuditRun::default()).await);
}

/// The line at an account's checkpoint position rewritten (its reason), the chain after it left as
/// it was: only the anchor's own hash shows it, and the audit from the checkpoint checks it.
async fn a_rewritten_anchor_is_found(k: &Kit) {
    let j = before(k).await;
    after(k, &j).await;
    let sql = format!(
        "{} UPDATE ledger_entries SET reason = 'forged' WHERE account_id = 'b' AND account_seq = 1;",
        drop_ledger_guards(k)
    );
    tamper(k, &sql).await;
    from_finds(k, "L2", "at position 1 is not the one the checkpoint proved").await;
    let full = found(k, AuditRun::default()).await;
    assert!(full.iter().any(|(i, m)| *i == "L2" && m.contains("hash chain does not verify")), "{full:#?}");
}

/// An item of a job touched since the checkpoint, moved without its line: found.
async fn an_item_moved_without_its_line_is_found(k: &Kit) {
    let j = before(k).await;
    after(k, &j).await;
    tamper(k, "UPDATE items SET state = 'charged', refund_reason = NULL WHERE job_id = 'm' AND item_id = 'i0'").await;
    from_finds(k, "L3", "entries sum to 0 but state charged nets -3").await;
}

/// What the checkpoint trusts: an item of a job nothing touched since, moved by hand with no line
/// and no event. The audit from the checkpoint does not read that job again; the full audit does,
/// finds it, and retires the checkpoint, so the routine audit cannot go on past it.
async fn an_old_item_moved_behind_settles_back_is_found_by_the_full_audit(k: &Kit) {
    let j = before(k).await;
    after(k, &j).await;
    tamper(k, "UPDATE items SET state = 'refunded', refund_reason = 'job_failed' WHERE job_id = 'o'").await;
    assert_eq!(found(k, FROM).await, [], "the checkpoint's trust");
    let full = k.store.audit(None).await.unwrap();
    let says = "entries sum to -5 but state refunded nets 0";
    assert!(full.violations.iter().any(|v| v.message.contains(says)), "{full:#?}");
    assert_eq!(full.checkpoint.retired, Some(Ok(true)));
    let from = found(k, FROM).await;
    assert!(from.iter().any(|(_, m)| m.contains(says)), "read from the first entry again: {from:#?}");
}

async fn a_wrong_exposure_is_found(k: &Kit) {
    let j = before(k).await;
    after(k, &j).await;
    tamper(k, "UPDATE accounts SET exposure = exposure + 1 WHERE id = 'a'").await;
    from_finds(k, "L1", "exposure 8 but refunded items cost 7").await;
}

/// Any audit that finds something retires the checkpoint, the plain one too: the next audit from
/// it reads every row, until a clean audit records one again.
async fn an_audit_that_finds_anything_retires_the_checkpoint(k: &Kit) {
    before(k).await;
    tamper(k, "UPDATE accounts SET held = held + 1 WHERE id = 'a'").await;
    let report = k.store.audit(None).await.unwrap();
    assert!(!report.ok());
    assert_eq!(report.checkpoint.retired, Some(Ok(true)));
    k.raw_script("UPDATE accounts SET held = held - 1 WHERE id = 'a'").await.unwrap();
    let from = k.store.audit_with(FROM, None).await.unwrap();
    assert!(from.ok(), "{from:#?}");
    assert_eq!(from.checkpoint.from, None);
    let why = from.checkpoint.not_used.clone().unwrap_or_default();
    assert!(why.starts_with("the checkpoint was retired"), "{why}");
    assert_eq!(from.entries_checked, 6, "every row");
    k.assert_clean().await;
    assert!(k.store.audit_with(FROM, None).await.unwrap().checkpoint.from.is_some());
}

/// A checkpoint taken at another schema version (an upgrade since) is not started from, and a new
/// one replaces it.
async fn a_checkpoint_of_another_schema_is_not_started_from(k: &Kit) {
    before(k).await;
    k.raw_script("UPDATE audit_checkpoint SET schema_version = schema_version - 1").await.unwrap();
    let run = AuditRun { from_checkpoint: true, record: true };
    let report = k.store.audit_with(run, None).await.unwrap();
    assert!(report.ok(), "{report:#?}");
    assert_eq!(report.checkpoint.from, None);
    assert!(report.checkpoint.not_used.as_deref().unwrap_or_default().contains("upgraded since"), "{report:#?}");
    assert_eq!(report.entries_checked, 6);
    let generation = report.checkpoint.recorded.clone().unwrap().unwrap().generation;
    let next = k.store.audit_with(FROM, None).await.unwrap();
    assert_eq!(next.checkpoint.from.map(|m| m.generation), Some(generation));
    assert_eq!(next.entries_checked, 0);
}

/// More jobs touched since the checkpoint than max(a quarter of all, 1,024): pass B reads every
/// job (one statement per job would cost more), and so finds even an untouched job moved by hand;
/// the checkpoint it records then holds every job's sums.
async fn when_many_jobs_were_touched_every_job_is_read(k: &Kit) {
    before(k).await;
    for n in 0..1_100 {
        k.items_job(&format!("n{n}"), &acc("a"), &[0]).await;
    }
    let run = AuditRun { from_checkpoint: true, record: true };
    let clean = k.store.audit_with(run, None).await.unwrap();
    assert!(clean.ok(), "{clean:#?}");
    assert!(clean.checkpoint.from.is_some());
    assert_eq!((clean.checkpoint.jobs_checked, clean.items_checked), (1_103, 1_103));
    assert!(matches!(clean.checkpoint.recorded, Some(Ok(_))));
    k.assert_clean().await;
    for n in 1_100..2_300 {
        k.items_job(&format!("n{n}"), &acc("a"), &[0]).await;
    }
    tamper(k, "UPDATE items SET state = 'refunded', refund_reason = 'job_failed' WHERE job_id = 'o'").await;
    let from = found(k, FROM).await;
    assert!(from.iter().any(|(_, m)| m.contains("entries sum to -5 but state refunded nets 0")), "{from:#?}");
}

/// The process dies inside the transaction that records a checkpoint: nothing of it is written,
/// the audit's verdict stands ("not recorded"), the checkpoint before it is still the one audits
/// start from, and the next audit that records one converges (its generation the next).
async fn a_checkpoint_write_that_dies_leaves_the_one_before(k: &Kit) {
    let j = before(k).await;
    let generation = k.store.audit_with(FROM, None).await.unwrap().checkpoint.from.unwrap().generation;
    after(k, &j).await;
    let run = AuditRun { from_checkpoint: true, record: true };
    k.crasher.arm(settle_core::crash::CrashPoint::BeforeCommit);
    let died = k.store.audit_with(run, None).await.unwrap();
    assert!(!k.crasher.disarm(), "the armed point fired");
    assert!(died.ok(), "{died:#?}");
    assert!(matches!(&died.checkpoint.recorded, Some(Err(why)) if why.contains("could not be written")), "{died:#?}");
    let still = k.store.audit_with(FROM, None).await.unwrap();
    assert_eq!(still.checkpoint.from.map(|m| m.generation), Some(generation));
    assert_eq!(still.entries_checked, 5, "the lines since the checkpoint before, read again");
    let again = k.store.audit_with(run, None).await.unwrap();
    assert_eq!(again.checkpoint.recorded.clone().unwrap().unwrap().generation, generation + 1);
    assert_eq!(k.store.audit_with(FROM, None).await.unwrap().entries_checked, 0);
    k.assert_clean().await;
}
