//! The auditor finds bugs (issue 26): with one guard that matters removed at a time, a run of
//! seeds fails within 1,000 of them, and the test says after how many. The guards are removable in
//! test builds (settle-dst's dev-dependencies turn on `broken-guards`).

use settle_dst::Breakage;
use settle_store::broken::Guard;

const STEPS: u32 = 200;

/// The first seed (from 1) whose run the auditor fails, with what it found.
fn seeds_to_failure(broken: Breakage) -> (u64, String) {
    let dir = tempfile::tempdir().unwrap();
    let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
    for seed in 1..=1000 {
        let r = rt.block_on(settle_dst::run_broken(seed, STEPS, dir.path(), Some(broken))).unwrap();
        if let Some(v) = r.violation {
            return (seed, format!("step {}: {}", v.step, v.what));
        }
    }
    panic!("{broken:?}: no violation in 1000 seeds");
}

fn caught(broken: Breakage) {
    let (seeds, what) = seeds_to_failure(broken);
    println!("{broken:?}: caught at seed {seeds} ({what})");
}

#[test]
fn without_the_refund_guards_state_check() {
    caught(Breakage::Store(Guard::RefundState));
}

#[test]
fn without_the_reclaim_after_refund_check() {
    caught(Breakage::Store(Guard::ReclaimAfterRefund));
}

#[test]
fn without_the_lease_check() {
    caught(Breakage::Store(Guard::Lease));
}

#[test]
fn without_the_lookup_before_send() {
    caught(Breakage::LookupBeforeSend);
}

#[test]
fn without_teardowns_terminal_state_last() {
    caught(Breakage::Store(Guard::TeardownOrder));
}

#[test]
fn without_webhook_head_of_line() {
    caught(Breakage::Store(Guard::WebhookOrder));
}

#[test]
fn without_the_cash_rule() {
    caught(Breakage::Store(Guard::CashRule));
}

#[test]
fn without_the_expiry_clock_on_balance_updates() {
    caught(Breakage::Store(Guard::ExpiryClock));
}

#[test]
fn without_completion_conditional_on_no_cancel() {
    caught(Breakage::Store(Guard::CancelWins));
}

#[test]
fn without_the_cap_count_on_a_capped_claim() {
    caught(Breakage::Store(Guard::Cap));
}

#[test]
fn without_the_alerts_edge() {
    caught(Breakage::Store(Guard::AlertEdge));
}

#[test]
fn without_the_spend_limit_check() {
    caught(Breakage::Store(Guard::SpendLimit));
}

#[test]
fn without_the_lookup_before_a_charge() {
    caught(Breakage::FundingLookupBeforeSend);
}

#[test]
fn without_the_rules_pause_on_a_dead_top_up() {
    caught(Breakage::Store(Guard::RulePause));
}
