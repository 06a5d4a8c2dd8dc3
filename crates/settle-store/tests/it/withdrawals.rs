//! Withdrawals, written once against the `Store` and `Payouts` traits and run on both engines like
//! the conformance suite (its `conformance!` macro); each check ends with the audit (L1–L6, including
//! `payout_return`).

use crate::kit::*;
use settle_core::history::AttemptResult;
use settle_core::ids::*;
use settle_core::job::{JobState, RefundPolicy};
use settle_core::{Credits, limits};
use settle_store::*;

conformance!(
    create_holds_the_amount_and_replays,
    bad_withdrawals_write_nothing,
    the_withdrawal_kind_is_reserved_for_the_processor,
    lease_expiry_retries_before_the_send_and_is_unknown_after,
    success_keeps_the_txid_and_a_return_credits_once,
    failures_follow_the_provider_codes,
    confirmed_absent_never_dead_letters,
    cancel_of_a_tried_withdrawal_asks_the_provider_first,
    a_late_execution_of_a_dead_withdrawal_takes_the_hold_back,
    withdrawals_list_by_state,
    a_list_by_state_is_every_job_in_that_state,
    payout_returns_can_never_overflow,
    withdrawals_never_draw_on_the_overdraft,
    an_operator_resolves_an_unknown_withdrawal_once,
);

fn new_withdrawal(id: &str, account: &AccountId, amount: i64, destination: &str) -> NewWithdrawal {
    NewWithdrawal {
        id: jid(id),
        account_id: account.clone(),
        amount: Credits::new(amount),
        destination: Destination::parse(destination).unwrap(),
    }
}

async fn withdraw(k: &Kit, id: &str, account: &AccountId, amount: i64) -> Withdrawal {
    k.store.payouts().create_withdrawal(new_withdrawal(id, account, amount, "acct-1")).await.unwrap().value
}

/// Claims exactly the withdrawal `id` through the payout processor's door.
async fn claim_payout(k: &Kit, id: &str) -> LeaseToken {
    let claimed = k.store.payouts().claim_payouts(&WorkerName::parse("payouts").unwrap(), 10).await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.job.id.as_str()).collect::<Vec<_>>(), vec![id]);
    claimed[0].lease_token.clone()
}

async fn payout_fail(k: &Kit, id: &str, token: &LeaseToken, c: &str) -> Job {
    k.store.payouts().payout_failed(&jid(id), fail_sig(token, c)).await.unwrap().value
}

async fn create_holds_the_amount_and_replays(k: &Kit) {
    let a = k.account("a", 100).await;
    let w = withdraw(k, "w1", &a, 40).await;
    assert_eq!(
        (w.job.kind.as_str(), w.job.state, w.job.refund_on),
        ("withdrawal", JobState::Queued, RefundPolicy::FinalFailure)
    );
    assert_eq!((w.amount.get(), w.destination.as_str(), w.provider_txid.as_deref()), (40, "acct-1", None));
    assert!(w.idempotency_key.starts_with("wd_") && w.idempotency_key.len() > 20, "{}", w.idempotency_key);
    assert_eq!(k.balance(&a).await, 60);
    assert_eq!(k.ledger_kinds(&a).await, vec![("grant".to_owned(), 100), ("charge".to_owned(), -40)]);
    // a replay answers the stored withdrawal: the same key, nothing written
    let again = k.store.payouts().create_withdrawal(new_withdrawal("w1", &a, 40, "acct-1")).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value.idempotency_key, w.idempotency_key);
    assert_eq!(k.balance(&a).await, 60);
    // the same id with another body, or as a plain job: a conflict
    for other in [new_withdrawal("w1", &a, 41, "acct-1"), new_withdrawal("w1", &a, 40, "acct-2")] {
        let e = k.store.payouts().create_withdrawal(other).await.unwrap_err();
        assert!(matches!(e, StoreError::IdempotencyConflict { .. }), "{e:?}");
    }
    let e = k.store.create_job(new_job("w1", &a, 40)).await.unwrap_err();
    assert!(matches!(e, StoreError::IdempotencyConflict { .. }), "{e:?}");
    let j = k.job("j1", &a, 5).await;
    let e = k.store.payouts().create_withdrawal(new_withdrawal("j1", &a, 5, "acct-1")).await.unwrap_err();
    assert!(matches!(e, StoreError::IdempotencyConflict { .. }), "{e:?}");
    assert!(matches!(k.store.payouts().withdrawal(&j.id).await, Err(StoreError::NotFound { .. })));
}

async fn bad_withdrawals_write_nothing(k: &Kit) {
    let a = k.account("a", 100).await;
    let before = (k.ledger_kinds(&a).await, k.event_types().await);
    for (amount, overflow) in [(0, false), (-5, false), (limits::BALANCE_MAX + 1, true), (i64::MAX, true)] {
        let e = k.store.payouts().create_withdrawal(new_withdrawal("bad", &a, amount, "acct-1")).await.unwrap_err();
        assert_eq!(matches!(e, StoreError::Overflow), overflow, "{amount}: {e:?}");
        assert!(overflow || matches!(e, StoreError::Invalid(_)), "{amount}: {e:?}");
    }
    let e = k.store.payouts().create_withdrawal(new_withdrawal("bad", &a, 101, "acct-1")).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientBalance { needed: 101, .. }), "{e:?}");
    let e = k.store.payouts().create_withdrawal(new_withdrawal("bad", &acc("nobody"), 1, "acct-1")).await.unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }), "{e:?}");
    assert!(matches!(k.store.payouts().withdrawal(&jid("bad")).await, Err(StoreError::NotFound { .. })));
    assert_eq!((k.ledger_kinds(&a).await, k.event_types().await), before);
    assert_eq!(k.balance(&a).await, 100);
}

async fn the_withdrawal_kind_is_reserved_for_the_processor(k: &Kit) {
    let a = k.account("a", 100).await;
    let mut plain = new_job("x", &a, 5);
    plain.kind = JobKind::parse("withdrawal").unwrap();
    assert!(matches!(k.store.create_job(plain).await, Err(StoreError::Invalid(_))));
    // so is a top-up's (the funding rail): never created nor claimed as work
    let mut bought = new_job("x", &a, 0);
    bought.kind = JobKind::parse("top_up").unwrap();
    assert!(matches!(k.store.create_job(bought).await, Err(StoreError::Invalid(_))));
    let named = ClaimRequest { kinds: vec![JobKind::parse("top_up").unwrap()], ..claim_req("w1", 10) };
    assert!(matches!(k.store.claim(named).await, Err(StoreError::Invalid(_))));
    withdraw(k, "w", &a, 10).await;
    k.job("r", &a, 5).await;
    // workers never get it, and may not ask for it
    let claimed = k.store.claim(claim_req("w1", 10)).await.unwrap();
    assert_eq!(claimed.iter().map(|c| c.job.id.as_str()).collect::<Vec<_>>(), vec!["r"]);
    let named = ClaimRequest { kinds: vec![JobKind::parse("withdrawal").unwrap()], ..claim_req("w1", 10) };
    assert!(matches!(k.store.claim(named).await, Err(StoreError::Invalid(_))));
    let tr = claimed[0].lease_token.clone();
    let t = claim_payout(k, "w").await;
    // worker signals on a withdrawal, and payout signals on another job, are refused
    let refused = |e: StoreError| assert!(matches!(e, StoreError::InvalidTransition { .. }), "{e:?}");
    refused(k.store.succeed(&jid("w"), settle_store::Reporter::of(None), None).await.unwrap_err());
    refused(k.store.fail(&jid("w"), fail_sig(&t, "NODE_DOWN")).await.unwrap_err());
    refused(k.store.mark_unknown(&jid("w"), &t, None).await.unwrap_err());
    refused(k.store.heartbeat(&jid("w"), &t).await.unwrap_err());
    refused(k.store.item_succeed(&jid("w"), &ItemId::main(), &t).await.unwrap_err());
    refused(k.store.payouts().payout_failed(&jid("r"), fail_sig(&tr, "NODE_DOWN")).await.unwrap_err());
    refused(k.store.payouts().payout_succeeded(&jid("r"), Some(&tr), "tx", false).await.unwrap_err());
    refused(k.store.payouts().payout_heartbeat(&jid("r"), &tr).await.unwrap_err());
    assert_state(&k.get("w").await, JobState::Running);
    assert_state(&k.get("r").await, JobState::Running);
    // a dead withdrawal is not requeued: its hold was refunded (a re-run is a new withdrawal)
    assert_state(&payout_fail(k, "w", &t, "INVALID_ADDRESS").await, JobState::Dead);
    refused(k.store.requeue(&jid("w"), settle_store::SYSTEM_ACTOR).await.unwrap_err());
    assert_eq!(k.balance(&a).await, 95);
}

async fn lease_expiry_retries_before_the_send_and_is_unknown_after(k: &Kit) {
    let a = k.account("a", 100).await;
    withdraw(k, "w", &a, 10).await;
    // attempt 1 dies before its send started: nothing can have left, so it is retried
    claim_payout(k, "w").await;
    k.clock.advance_seconds(31);
    assert_eq!(k.store.rescue_expired_leases(10).await.unwrap(), vec!["w".to_owned()]);
    let j = k.get("w").await;
    assert_state(&j, JobState::Queued);
    assert_eq!((j.last_error.unwrap().code.as_str(), states(&k.get("w").await)), ("LEASE_EXPIRED", vec!["charged"]));
    // attempt 2 marks its send, then dies: the payout may have left, so it is unknown, held
    k.clock.advance_seconds(600);
    let t = claim_payout(k, "w").await;
    let hb = k.store.payouts().payout_heartbeat(&jid("w"), &t).await.unwrap();
    assert!(!hb.cancel_requested);
    k.clock.advance_seconds(31);
    assert_eq!(k.store.rescue_expired_leases(10).await.unwrap(), vec!["w".to_owned()]);
    let j = k.get("w").await;
    assert_state(&j, JobState::Unknown);
    assert_eq!((states(&j), k.balance(&a).await), (vec!["charged"], 90));
    let attempts = k.store.attempts(&jid("w")).await.unwrap();
    assert_eq!(attempts.iter().map(|a| a.result).collect::<Vec<_>>(), vec![Some(AttemptResult::LeaseExpired); 2]);
    // the generic reconciler's "absent" is not how a payout is resolved… the processor's lookup is
    assert!(k.store.payouts().claim_payouts(&WorkerName::parse("p").unwrap(), 10).await.unwrap().is_empty());
}

async fn success_keeps_the_txid_and_a_return_credits_once(k: &Kit) {
    let a = k.account("a", 100).await;
    withdraw(k, "w", &a, 40).await;
    let t = claim_payout(k, "w").await;
    let out = k.store.payouts().payout_succeeded(&jid("w"), Some(&t), "tx-1", false).await.unwrap();
    assert!(out.applied);
    assert_eq!((out.value.job.state, out.value.provider_txid.as_deref()), (JobState::Succeeded, Some("tx-1")));
    assert_eq!(k.store.attempts(&jid("w")).await.unwrap()[0].result, Some(AttemptResult::Succeeded));
    // a duplicate report changes nothing and keeps the first txid
    let again = k.store.payouts().payout_succeeded(&jid("w"), Some(&t), "tx-other", false).await.unwrap();
    assert!(!again.applied);
    assert_eq!(again.value.provider_txid.as_deref(), Some("tx-1"));
    assert_eq!(k.balance(&a).await, 60);
    // the payout came back: credited once
    let r =
        k.store.payouts().payout_returned(&jid("w"), ReturnSource::Admin, settle_store::SYSTEM_ACTOR).await.unwrap();
    assert!(r.applied);
    assert_eq!(
        (r.value.job.state, states(&r.value.job), r.value.job.net.get()),
        (JobState::Returned, vec!["returned"], 0)
    );
    assert!(r.value.returned_at.is_some());
    assert!(
        !k.store
            .payouts()
            .payout_returned(&jid("w"), ReturnSource::Provider, settle_store::SYSTEM_ACTOR)
            .await
            .unwrap()
            .applied
    );
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(
        k.ledger_kinds(&a).await,
        vec![("grant".to_owned(), 100), ("charge".to_owned(), -40), ("payout_return".to_owned(), 40)]
    );
    assert!(k.event_types().await.contains(&"withdrawal.returned".to_owned()));
    assert!(matches!(k.store.cancel(&jid("w"), None).await, Err(StoreError::JobFinished(_))));
    // only a succeeded withdrawal can come back; only a withdrawal is one
    withdraw(k, "q", &a, 10).await;
    let e = k
        .store
        .payouts()
        .payout_returned(&jid("q"), ReturnSource::Admin, settle_store::SYSTEM_ACTOR)
        .await
        .unwrap_err();
    assert!(matches!(e, StoreError::InvalidTransition { .. }), "{e:?}");
    k.job("r", &a, 1).await;
    assert!(matches!(
        k.store.payouts().payout_returned(&jid("r"), ReturnSource::Admin, settle_store::SYSTEM_ACTOR).await,
        Err(StoreError::NotFound { .. })
    ));
    // found as already returned by the provider: success and return in one transaction
    k.clock.advance_seconds(1);
    let t = claim_payout(k, "q").await;
    let both = k.store.payouts().payout_succeeded(&jid("q"), Some(&t), "tx-2", true).await.unwrap();
    assert_eq!((both.value.job.state, both.value.provider_txid.as_deref()), (JobState::Returned, Some("tx-2")));
    assert_eq!(k.balance(&a).await, 99);
    let report = k.store.audit(None).await.unwrap();
    assert_eq!(report.entries_checked, k.ledger_kinds(&a).await.len() as u64, "the audit reads every entry");
}

async fn failures_follow_the_provider_codes(k: &Kit) {
    let a = k.account("a", 100).await;
    withdraw(k, "w", &a, 10).await;
    // NODE_DOWN retries, holding the amount (final_failure)
    let t = claim_payout(k, "w").await;
    let j = payout_fail(k, "w", &t, "NODE_DOWN").await;
    assert_state(&j, JobState::Queued);
    assert_eq!((states(&j), k.balance(&a).await), (vec!["charged"], 90));
    // a lookup that got no answer learned nothing: retried past the attempt budget, never dead
    for _ in 0..5 {
        k.clock.advance_seconds(600);
        let t = claim_payout(k, "w").await;
        assert_state(&payout_fail(k, "w", &t, "LOOKUP_FAILED").await, JobState::Queued);
    }
    assert_eq!(k.balance(&a).await, 90);
    // …and does not count later either: a definitive retryable refusal still retries (budget 3)
    k.clock.advance_seconds(600);
    let t = claim_payout(k, "w").await;
    assert_state(&payout_fail(k, "w", &t, "NODE_DOWN").await, JobState::Queued);
    // INVALID_ADDRESS is definitive: dead, the hold refunded once
    k.clock.advance_seconds(600);
    let t = claim_payout(k, "w").await;
    let j = payout_fail(k, "w", &t, "INVALID_ADDRESS").await;
    assert_state(&j, JobState::Dead);
    assert_eq!((states(&j), k.balance(&a).await), (vec!["refunded"], 100));
    let summary = k.store.failure_summary(&settle_core::scope::Scope::ALL).await.unwrap();
    assert!(
        summary
            .iter()
            .any(|f| f.code == "INVALID_ADDRESS" && f.state == settle_store::FailureState::Dead && f.count == 1),
        "{summary:?}"
    );
    let codes: Vec<_> = k.store.attempts(&jid("w")).await.unwrap().into_iter().map(|a| a.fail_code).collect();
    assert_eq!(codes.first().cloned().flatten().as_deref(), Some("NODE_DOWN"));
    assert_eq!(codes.last().cloned().flatten().as_deref(), Some("INVALID_ADDRESS"));
}

async fn confirmed_absent_never_dead_letters(k: &Kit) {
    let a = k.account("a", 100).await;
    withdraw(k, "w", &a, 10).await;
    // more rounds than the kind's attempts (3): each send goes unanswered, each is confirmed absent
    for round in 0..4 {
        let t = claim_payout(k, "w").await;
        k.store.payouts().payout_heartbeat(&jid("w"), &t).await.unwrap();
        assert_state(
            &k.store.payouts().payout_unknown(&jid("w"), &t, Some("timeout")).await.unwrap().value,
            JobState::Unknown,
        );
        k.clock.advance_seconds(3_599);
        assert!(
            !k.store.reconcile(&jid("w"), Finding::Absent).await.unwrap().applied,
            "round {round}: inside the window"
        );
        k.clock.advance_seconds(1);
        let j = k.store.reconcile(&jid("w"), Finding::Absent).await.unwrap().value;
        assert_state(&j, JobState::Queued);
        assert_eq!(j.last_error.unwrap().code, "TIMEOUT_CONFIRMED_NOT_SENT");
        assert_eq!(k.balance(&a).await, 90, "round {round}: the hold stays");
        k.clock.advance_seconds(600);
    }
    // a withdrawal found at the provider is recorded with its txid, not by a bare "present"
    let t = claim_payout(k, "w").await;
    k.store.payouts().payout_unknown(&jid("w"), &t, None).await.unwrap();
    assert!(matches!(k.store.reconcile(&jid("w"), Finding::Present).await, Err(StoreError::Invalid(_))));
    let w = k.store.payouts().payout_succeeded(&jid("w"), None, "tx-late", false).await.unwrap().value;
    assert_eq!((w.job.state, w.provider_txid.as_deref()), (JobState::Succeeded, Some("tx-late")));
    assert_eq!(k.balance(&a).await, 90);
}

async fn cancel_of_a_tried_withdrawal_asks_the_provider_first(k: &Kit) {
    let a = k.account("a", 100).await;
    // never tried: nothing can have left, cancelled at once with the hold refunded
    withdraw(k, "fresh", &a, 10).await;
    let c = k.store.cancel(&jid("fresh"), None).await.unwrap();
    assert!(matches!(c, CancelOutcome::Cancelled(ref j) if states(j) == vec!["cancelled"]), "{c:?}");
    // tried once: the cancel is a request the processor carries out after its lookup
    withdraw(k, "w", &a, 10).await;
    let t = claim_payout(k, "w").await;
    payout_fail(k, "w", &t, "NODE_DOWN").await;
    let c = k.store.cancel(&jid("w"), None).await.unwrap();
    assert!(matches!(c, CancelOutcome::Accepted(ref j) if j.state == JobState::Queued && j.cancel_requested), "{c:?}");
    assert_eq!(k.balance(&a).await, 90);
    k.clock.advance_seconds(600);
    let t = claim_payout(k, "w").await;
    // the lookup failed: the cancel waits for an attempt that can ask
    assert_state(&payout_fail(k, "w", &t, "LOOKUP_FAILED").await, JobState::Queued);
    k.clock.advance_seconds(600);
    let t = claim_payout(k, "w").await;
    assert!(k.store.payouts().payout_heartbeat(&jid("w"), &t).await.unwrap().cancel_requested);
    let j = payout_fail(k, "w", &t, "CANCELLED").await;
    assert_state(&j, JobState::Cancelled);
    assert_eq!((states(&j), k.balance(&a).await), (vec!["cancelled"], 100));
    // a dead withdrawal stays dead: its hold was refunded already
    withdraw(k, "d", &a, 10).await;
    let t = claim_payout(k, "d").await;
    payout_fail(k, "d", &t, "INSUFFICIENT").await;
    assert!(matches!(k.store.cancel(&jid("d"), None).await, Err(StoreError::JobFinished(_))));
}

async fn a_late_execution_of_a_dead_withdrawal_takes_the_hold_back(k: &Kit) {
    let a = k.account("a", 100).await;
    withdraw(k, "w", &a, 30).await;
    let t = claim_payout(k, "w").await;
    assert_state(&payout_fail(k, "w", &t, "INVALID_ADDRESS").await, JobState::Dead);
    assert_eq!(k.balance(&a).await, 100);
    // the re-check finds the key executed after all: the money left, so the refund is reclaimed
    let w = k.store.payouts().payout_succeeded(&jid("w"), None, "tx-late", false).await.unwrap().value;
    assert_eq!(
        (w.job.state, states(&w.job), w.provider_txid.as_deref()),
        (JobState::Succeeded, vec!["reclaimed"], Some("tx-late"))
    );
    assert_eq!(k.balance(&a).await, 70);
    // and if it then comes back, the return credits the reclaimed amount, once
    let r = k
        .store
        .payouts()
        .payout_returned(&jid("w"), ReturnSource::Provider, settle_store::SYSTEM_ACTOR)
        .await
        .unwrap()
        .value;
    assert_eq!((r.job.state, states(&r.job), r.job.net.get()), (JobState::Returned, vec!["returned"], 0));
    assert_eq!(k.balance(&a).await, 100);
    let kinds: Vec<String> = k.ledger_kinds(&a).await.into_iter().map(|(kind, _)| kind).collect();
    assert_eq!(kinds, vec!["grant", "charge", "refund", "reclaim", "payout_return"]);
    // a cancelled withdrawal cannot take a success: the txid is reported, never dropped silently
    withdraw(k, "c", &a, 5).await;
    k.store.cancel(&jid("c"), None).await.unwrap();
    let out = k.store.payouts().payout_succeeded(&jid("c"), None, "tx-c", false).await.unwrap();
    assert!(!out.applied);
    assert_eq!((out.value.job.state, out.value.provider_txid.as_deref()), (JobState::Cancelled, Some("tx-c")));
    assert_eq!(late_executions(k).await, 1);
    // reported once: the re-check finding it again changes nothing
    assert!(!k.store.payouts().payout_succeeded(&jid("c"), None, "tx-c", false).await.unwrap().applied);
    assert_eq!(late_executions(k).await, 1);
    // a teardown under way (its refund committed, then the process died) meets a found transfer: no
    // panic, the txid kept and reported, the teardown finished
    withdraw(k, "t", &a, 5).await;
    k.crasher.arm(settle_core::crash::CrashPoint::TeardownAfterRefund);
    assert!(matches!(k.store.cancel(&jid("t"), None).await, Err(StoreError::InjectedCrash(_))));
    assert_state(&k.get("t").await, JobState::Cancelling);
    let out = k.store.payouts().payout_succeeded(&jid("t"), None, "tx-t", false).await.unwrap();
    assert_eq!(
        (out.applied, out.value.job.state, out.value.provider_txid.as_deref()),
        (false, JobState::Cancelled, Some("tx-t"))
    );
    assert_eq!(late_executions(k).await, 2);
}

async fn withdrawals_list_by_state(k: &Kit) {
    let a = k.account("a", 100).await;
    for i in 0..5 {
        withdraw(k, &format!("w{i}"), &a, 1).await;
    }
    k.job("r", &a, 1).await;
    let t = claim_payout_any(k).await;
    k.store.payouts().payout_succeeded(&jid(&t.0), Some(&t.1), "tx", false).await.unwrap();
    let all = k.store.payouts().withdrawals(&WithdrawalFilter::default(), Page { after: 0, limit: 3 }).await.unwrap();
    assert_eq!(all.rows.iter().map(|w| w.job.id.as_str()).collect::<Vec<_>>(), vec!["w0", "w1", "w2"]);
    let rest = k
        .store
        .payouts()
        .withdrawals(&WithdrawalFilter::default(), Page { after: all.next_after.unwrap(), limit: 3 })
        .await
        .unwrap();
    assert_eq!((rest.rows.len(), rest.next_after), (2, None));
    let queued = WithdrawalFilter { state: Some(JobState::Queued), ..WithdrawalFilter::default() };
    assert_eq!(k.store.payouts().withdrawals(&queued, Page::FIRST).await.unwrap().rows.len(), 4);
}

/// Every job and every withdrawal in a state, listed by that state (pages of 2) and counted, is what
/// the list of all jobs holds in that state — with jobs of every rail running, waiting, retrying,
/// dead and done: each state's list reads a different index since migration 0033 (decision 0036),
/// and the running ones two.
async fn a_list_by_state_is_every_job_in_that_state(k: &Kit) {
    let a = k.account("a", 1_000).await;
    let b = k.account("b", 1_000).await;
    for (id, account) in [("w-run", &a), ("w-done", &b), ("w-wait", &a)] {
        withdraw(k, id, account, 5).await;
    }
    let _running = claim_payout_any(k).await;
    let (done, token) = claim_payout_any(k).await;
    k.store.payouts().payout_succeeded(&jid(&done), Some(&token), "tx-1", false).await.unwrap();
    let mut tokens = std::collections::HashMap::new();
    for (id, account) in [("r", &b), ("d", &a), ("t", &b), ("s", &a)] {
        k.job(id, account, 3).await;
        tokens.insert(id, k.claim_one(id).await);
    }
    k.job("q", &a, 3).await;
    k.fail("d", &tokens["d"], "BAD_INPUT").await;
    k.fail("t", &tokens["t"], "TIMEOUT").await;
    k.store.succeed(&jid("s"), settle_store::Reporter::of(Some(&tokens["s"])), None).await.unwrap();
    let all = k.store.jobs(&JobFilter::ALL, Page { after: 0, limit: 100 }).await.unwrap().rows;
    let of = |state: JobState, account: Option<&AccountId>| -> Vec<String> {
        (all.iter().filter(|j| j.state == state && account.is_none_or(|a| j.account_id == *a)))
            .map(|j| j.id.to_string())
            .collect()
    };
    assert_eq!(of(JobState::Running, None), ["w-run", "r"]);
    assert_eq!(of(JobState::Queued, None), ["w-wait", "t", "q"]);
    assert_eq!(of(JobState::Dead, None), ["d"]);
    for state in JobState::ALL {
        for account in [None, Some(&a)] {
            let filter = JobFilter { state: Some(state), account_id: account.cloned(), ..JobFilter::ALL };
            let mut listed = Vec::new();
            let mut after = 0;
            loop {
                let page = k.store.jobs(&filter, Page { after, limit: 2 }).await.unwrap();
                listed.extend(page.rows.iter().map(|j| j.id.to_string()));
                match page.next_after {
                    Some(n) => after = n,
                    None => break,
                }
            }
            let expected = of(state, account);
            assert_eq!(listed, expected, "{state} (account {account:?})");
            let totals = k.store.operators().job_totals(&filter, true).await.unwrap();
            assert_eq!(totals.jobs, expected.len() as i64, "{state} counted (account {account:?})");
        }
        let rail = WithdrawalFilter { state: Some(state), ..WithdrawalFilter::default() };
        let withdrawals = k.store.payouts().withdrawals(&rail, Page::FIRST).await.unwrap().rows;
        let expected: Vec<String> = of(state, None).into_iter().filter(|id| id.starts_with("w-")).collect();
        assert_eq!(withdrawals.iter().map(|w| w.job.id.to_string()).collect::<Vec<_>>(), expected, "{state}");
    }
    k.assert_clean().await;
}

async fn claim_payout_any(k: &Kit) -> (String, LeaseToken) {
    let claimed = k.store.payouts().claim_payouts(&WorkerName::parse("payouts").unwrap(), 1).await.unwrap();
    (claimed[0].job.id.to_string(), claimed[0].lease_token.clone())
}

async fn late_executions(k: &Kit) -> usize {
    k.event_types().await.iter().filter(|t| *t == "withdrawal.late_execution").count()
}

async fn payout_returns_can_never_overflow(k: &Kit) {
    let big = limits::BALANCE_MAX;
    let a = k.account("a", big).await;
    withdraw(k, "w", &a, big).await;
    let t = claim_payout(k, "w").await;
    k.store.payouts().payout_succeeded(&jid("w"), Some(&t), "tx", false).await.unwrap();
    assert_eq!(k.balance(&a).await, 0);
    // The paid amount may still come back: a grant that would not fit beside it is refused.
    let g = NewGrant {
        id: RefId::parse("g2").unwrap(),
        amount: Credits::new(big),
        reason: None,
        expires_at: None,
        priority: None,
    };
    assert!(matches!(k.store.grant(&a, g, settle_store::SYSTEM_ACTOR).await, Err(StoreError::Overflow)));
    let back =
        k.store.payouts().payout_returned(&jid("w"), ReturnSource::Admin, settle_store::SYSTEM_ACTOR).await.unwrap();
    assert_eq!((back.value.job.state, k.balance(&a).await), (JobState::Returned, big));
}

/// Issue 19, item 6: an overdraft is a credit line for work, not cash (decision 0017).
async fn withdrawals_never_draw_on_the_overdraft(k: &Kit) {
    let a = acc("od");
    k.store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::new(500), max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    let before = (k.ledger_kinds(&a).await, k.event_types().await);
    let e = k.store.payouts().create_withdrawal(new_withdrawal("w-od", &a, 500, "attacker")).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientBalance { balance: 0, needed: 500 }), "{e:?}");
    let e = k.store.payouts().create_withdrawal(new_withdrawal("w-od", &a, 1, "attacker")).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientBalance { .. }), "{e:?}");
    assert_eq!((k.ledger_kinds(&a).await, k.event_types().await), before, "nothing written");
    // The overdraft still serves work: a job may take the balance to -500.
    k.job("work", &a, 500).await;
    assert_eq!(k.balance(&a).await, -500);
    k.store
        .grant(
            &a,
            NewGrant {
                id: RefId::parse("g-od").unwrap(),
                amount: Credits::new(700),
                reason: None,
                expires_at: None,
                priority: None,
            },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    assert_eq!(k.balance(&a).await, 200);
    // Only what is there: 200, not 200 + the overdraft.
    let e = k.store.payouts().create_withdrawal(new_withdrawal("w-big", &a, 201, "acct-1")).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientBalance { balance: 200, needed: 201 }), "{e:?}");
    let w = withdraw(k, "w-ok", &a, 200).await;
    assert_eq!((w.amount.get(), k.balance(&a).await), (200, 0));
    let e = k.store.payouts().create_withdrawal(new_withdrawal("w-more", &a, 1, "acct-1")).await.unwrap_err();
    assert!(matches!(e, StoreError::InsufficientBalance { balance: 0, needed: 1 }), "{e:?}");
    // A withdrawal the provider refused for good hands its hold back, and it can be withdrawn again.
    let t = claim_payout(k, "w-ok").await;
    payout_fail(k, "w-ok", &t, "INVALID_ADDRESS").await;
    assert_eq!(k.balance(&a).await, 200);
    assert_eq!(withdraw(k, "w-again", &a, 200).await.amount.get(), 200);
}

/// A withdrawal made `unknown`: claimed, its send marked, no answer.
async fn unknown_withdrawal(k: &Kit, id: &str, account: &AccountId, amount: i64) {
    withdraw(k, id, account, amount).await;
    let t = claim_payout(k, id).await;
    k.store.payouts().payout_heartbeat(&jid(id), &t).await.unwrap();
    k.store.payouts().payout_unknown(&jid(id), &t, Some("no answer")).await.unwrap();
    assert_state(&k.get(id).await, JobState::Unknown);
}

/// Issue 19, item 15: an operator's "confirmed sent, txid X" or "confirmed not sent" for an
/// unknown withdrawal: one guarded transition, recorded in the action log, never twice.
async fn an_operator_resolves_an_unknown_withdrawal_once(k: &Kit) {
    let a = k.account("a", 100).await;
    unknown_withdrawal(k, "sent", &a, 30).await;
    unknown_withdrawal(k, "not-sent", &a, 20).await;
    assert_eq!(k.balance(&a).await, 50);
    let sent = |txid: &str| Resolution {
        outcome: ResolvedOutcome::Sent { provider_txid: txid.to_owned() },
        reason: "provider dashboard, ticket OPS-7".into(),
    };
    let not_sent = Resolution { outcome: ResolvedOutcome::NotSent, reason: "bank statement of 2026-12-01".into() };
    // Bad input writes nothing.
    for bad in [
        Resolution { reason: " ".into(), ..not_sent.clone() },
        Resolution { reason: "r".repeat(limits::MESSAGE_LEN_MAX + 1), ..not_sent.clone() },
        sent(""),
        sent("tx\n1"),
    ] {
        let e = k.store.payouts().payout_resolve(&jid("sent"), bad, "ops").await.unwrap_err();
        assert!(matches!(e, StoreError::Invalid(_)), "{e:?}");
    }
    let e = k.store.payouts().payout_resolve(&jid("nobody"), not_sent.clone(), "ops").await.unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }), "{e:?}");
    let j = k.job("plain", &a, 1).await;
    let e = k.store.payouts().payout_resolve(&j.id, not_sent.clone(), "ops").await.unwrap_err();
    assert!(matches!(e, StoreError::NotFound { .. }), "a job is no withdrawal: {e:?}");
    assert_state(&k.get("sent").await, JobState::Unknown);
    // Sent: the success path with the txid; the hold stays spent.
    let w = k.store.payouts().payout_resolve(&jid("sent"), sent("tx-77"), "ops-ana").await.unwrap();
    assert!(w.applied);
    assert_eq!((w.value.job.state, w.value.provider_txid.as_deref()), (JobState::Succeeded, Some("tx-77")));
    // Not sent: dead, the hold refunded, the code saying who decided.
    let w = k.store.payouts().payout_resolve(&jid("not-sent"), not_sent.clone(), "ops-ana").await.unwrap();
    assert_eq!(w.value.job.state, JobState::Dead);
    assert_eq!(w.value.job.last_error.as_ref().unwrap().code.as_str(), "CONFIRMED_NOT_SENT");
    assert_eq!(k.balance(&a).await, 69, "100 - 30 sent - 1 for the plain job");
    // Once: a second resolution (or one racing the reconciler) changes nothing.
    for (id, r) in [("sent", not_sent.clone()), ("not-sent", sent("tx-78")), ("sent", sent("tx-77"))] {
        let e = k.store.payouts().payout_resolve(&jid(id), r, "ops-bo").await.unwrap_err();
        assert!(matches!(e, StoreError::InvalidTransition { .. }), "{id}: {e:?}");
    }
    assert_eq!(k.balance(&a).await, 69);
    let actions = k.store.operators().actions(None, Some(&a)).await.unwrap();
    let resolved: Vec<(&str, &str)> = actions
        .iter()
        .filter(|x| x.action == settle_store::ActionKind::WithdrawalResolve)
        .map(|x| (x.actor.as_str(), x.job_id.as_deref().unwrap_or("")))
        .collect();
    assert_eq!(resolved, vec![("ops-ana", "sent"), ("ops-ana", "not-sent")]);
}
