//! The conformance suite: every check is written once against the `Store` trait (plus the kit's
//! clock and raw-SQL door) and instantiated for every engine by `conformance!`.
//! Each check ends with `assert_clean` — the audit (L1–L6, gap-free sequences) after every scenario.

use crate::kit::*;
use settle_core::history::{AttemptResult, EventKind, Signal, SignalEffect};
use settle_core::ids::*;
use settle_core::item::{ItemState, RefundReason};
use settle_core::job::{JobState, RefundPolicy};
use settle_core::{Credits, Timestamp};
use settle_store::*;

macro_rules! conformance {
    ($($name:ident),* $(,)?) => {
        mod sqlite {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let k = crate::kit::Kit::new(crate::kit::EngineKind::Sqlite).await;
                    super::$name(&k).await;
                    k.assert_clean().await;
                }
            )*
        }
        mod postgres {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn $name() {
                    let k = crate::kit::Kit::new(crate::kit::EngineKind::Postgres).await;
                    super::$name(&k).await;
                    k.assert_clean().await;
                }
            )*
        }
    };
}

conformance!(
    account_create_is_idempotent_by_id,
    grant_validates_and_replays,
    grant_overflow_writes_nothing,
    adjustment_needs_a_reason_and_may_be_negative,
    job_create_charges_every_item_and_replays,
    payloads_and_results_are_kept_canonical,
    insufficient_credits_write_nothing,
    overdraft_allows_a_negative_balance,
    job_create_rejects_bad_items,
    unknown_ids_are_not_found,
    item_arrows_and_their_no_ops,
    item_reports_need_the_current_lease,
    claim_respects_not_before_kinds_and_limit,
    heartbeat_extends_and_reports_cancel,
    succeed_from_running_decides_items,
    a_page_of_jobs_is_each_job_read_alone,
    succeed_after_refund_reclaims_once,
    succeed_from_unknown_and_dead_recovers,
    job_success_keeps_item_failures_refunded,
    succeed_after_cancel_requested_tears_down,
    retryable_failure_requeues_with_backoff_and_refunds,
    final_failure_holds_the_charge_until_dead,
    non_retryable_failure_is_dead_with_refund,
    last_attempt_goes_dead,
    signal_retryable_overrides_the_list,
    retry_after_overrides_backoff,
    lease_expiry_requeues_and_late_success_reclaims,
    cancel_requested_then_fail_tears_down,
    cancel_requested_then_lease_expiry_tears_down,
    unknown_is_not_refunded_and_reconciles,
    cancel_queued_refunds_and_cleans_artifacts,
    cancelling_one_job_leaves_another_jobs_artifact_of_the_same_key,
    cancel_with_failing_cleanup_stays_cancelling,
    an_operator_finishes_a_teardown_that_cannot_clean_up,
    cancel_running_only_sets_the_flag,
    cancel_table_for_finished_states,
    unknown_with_a_cancel_request_reconciles_to_teardown,
    final_failure_success_wins_over_a_cancel_request,
    requeue_dead_gives_a_fresh_budget,
    no_op_pairs_change_nothing,
    stale_tokens_change_nothing_and_are_logged,
    the_signal_log_is_bounded_per_job,
    backoff_schedule_under_a_fake_clock,
    failure_summary_groups_by_code,
    events_and_ledger_pages_are_ordered,
    ledger_rejects_update_and_delete,
    audit_names_tampering,
    stale_lease_signals_are_logged_though_refused,
    item_failure_after_a_job_refund_is_not_reclaimed,
    final_failure_lease_expiry_after_cancel_is_unknown,
    reclaims_can_never_overflow,
    refunds_can_never_overflow,
    the_audit_checks_what_is_held,
    rescue_passes_never_starve_behind_failing_jobs,
    sweep_passes_never_starve_behind_failing_jobs,
    a_claim_returns_at_most_its_limit,
);

async fn account_create_is_idempotent_by_id(k: &Kit) {
    let req = NewAccount { id: acc("a"), overdraft_limit: Credits::new(5), max_running: None };
    let first = k.store.create_account(req.clone(), settle_store::SYSTEM_ACTOR).await.unwrap();
    assert!(!first.replayed);
    assert_eq!(first.value.balance, Credits::ZERO);
    let again = k.store.create_account(req.clone(), settle_store::SYSTEM_ACTOR).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value, first.value);
    let other = k
        .store
        .create_account(NewAccount { overdraft_limit: Credits::new(6), ..req }, settle_store::SYSTEM_ACTOR)
        .await;
    assert!(matches!(other, Err(StoreError::IdempotencyConflict { .. })), "{other:?}");
    let negative = k
        .store
        .create_account(
            NewAccount { id: acc("b"), overdraft_limit: Credits::new(-1), max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await;
    assert!(matches!(negative, Err(StoreError::Invalid(_))));
    assert!(matches!(k.store.account(&acc("b")).await, Err(StoreError::NotFound { .. })));
}

async fn grant_validates_and_replays(k: &Kit) {
    let a = k.account("a", 0).await;
    let g = NewGrant {
        id: RefId::parse("g1").unwrap(),
        amount: Credits::new(100),
        reason: Some("welcome".into()),
        expires_at: None,
        priority: None,
    };
    let first = k.store.grant(&a, g.clone(), settle_store::SYSTEM_ACTOR).await.unwrap();
    assert!(!first.replayed);
    assert_eq!((first.value.amount.get(), first.value.balance_after.get()), (100, 100));
    let again = k.store.grant(&a, g.clone(), settle_store::SYSTEM_ACTOR).await.unwrap();
    assert!(again.replayed);
    assert_eq!(again.value, first.value);
    let conflict =
        k.store.grant(&a, NewGrant { amount: Credits::new(101), ..g.clone() }, settle_store::SYSTEM_ACTOR).await;
    assert!(matches!(conflict, Err(StoreError::IdempotencyConflict { .. })));
    for bad in [0, -5] {
        let r = k
            .store
            .grant(
                &a,
                NewGrant {
                    id: RefId::parse("g2").unwrap(),
                    amount: Credits::new(bad),
                    reason: None,
                    expires_at: None,
                    priority: None,
                },
                settle_store::SYSTEM_ACTOR,
            )
            .await;
        assert!(matches!(r, Err(StoreError::Invalid(_))), "{bad}");
    }
    let missing = k
        .store
        .grant(&acc("nobody"), NewGrant { id: RefId::parse("g3").unwrap(), ..g }, settle_store::SYSTEM_ACTOR)
        .await;
    assert!(matches!(missing, Err(StoreError::NotFound { .. })), "{missing:?}");
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(k.ledger_kinds(&a).await.len(), 1);
}

async fn grant_overflow_writes_nothing(k: &Kit) {
    let a = k.account("a", settle_core::limits::BALANCE_MAX).await;
    let events = k.event_types().await.len();
    for amount in [1, i64::MAX] {
        let r = k
            .store
            .grant(
                &a,
                NewGrant {
                    id: RefId::parse(&format!("big{amount}")).unwrap(),
                    amount: Credits::new(amount),
                    reason: None,
                    expires_at: None,
                    priority: None,
                },
                settle_store::SYSTEM_ACTOR,
            )
            .await;
        assert!(matches!(r, Err(StoreError::Overflow)), "{r:?}");
    }
    let r = k
        .store
        .adjust(
            &a,
            NewAdjustment { id: RefId::parse("adj").unwrap(), amount: Credits::new(i64::MIN), reason: "x".into() },
            settle_store::SYSTEM_ACTOR,
        )
        .await;
    assert!(matches!(r, Err(StoreError::Overflow)), "{r:?}");
    assert_eq!(k.balance(&a).await, settle_core::limits::BALANCE_MAX);
    assert_eq!(k.ledger_kinds(&a).await.len(), 1);
    assert_eq!(k.event_types().await.len(), events);
    // A job whose items sum past i64 is refused before anything is written.
    let r = k.store.create_job(items_job("j", &a, &[i64::MAX, 1])).await;
    assert!(matches!(r, Err(StoreError::Overflow)), "{r:?}");
}

async fn adjustment_needs_a_reason_and_may_be_negative(k: &Kit) {
    let a = k.account("a", 10).await;
    let no_reason = k
        .store
        .adjust(
            &a,
            NewAdjustment { id: RefId::parse("x1").unwrap(), amount: Credits::new(5), reason: String::new() },
            settle_store::SYSTEM_ACTOR,
        )
        .await;
    assert!(matches!(no_reason, Err(StoreError::Invalid(_))));
    let zero = k
        .store
        .adjust(
            &a,
            NewAdjustment { id: RefId::parse("x1").unwrap(), amount: Credits::ZERO, reason: "r".into() },
            settle_store::SYSTEM_ACTOR,
        )
        .await;
    assert!(matches!(zero, Err(StoreError::Invalid(_))));
    let down = k
        .store
        .adjust(
            &a,
            NewAdjustment { id: RefId::parse("x2").unwrap(), amount: Credits::new(-25), reason: "chargeback".into() },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    assert_eq!(down.value.balance_after.get(), -15);
    assert_eq!(down.value.reason.as_deref(), Some("chargeback"));
    assert_eq!(k.ledger_kinds(&a).await, vec![("grant".into(), 10), ("adjustment".into(), -25)]);
    assert_eq!(k.event_types().await, ["account.created", "account.granted", "account.adjusted"]);
}

async fn job_create_charges_every_item_and_replays(k: &Kit) {
    let a = k.account("a", 100).await;
    let job = k.job("j1", &a, 40).await;
    assert_state(&job, JobState::Queued);
    assert_eq!((job.cost.get(), job.net.get(), job.attempt, job.max_attempts), (40, -40, 0, 3));
    assert_eq!(job.items.len(), 1);
    assert_eq!(job.items[0].id, "main");
    assert_eq!(job.items[0].state, ItemState::Charged);
    let batch = k.items_job("j2", &a, &[10, 20, 0]).await;
    assert_eq!((batch.cost.get(), batch.net.get()), (30, -30));
    assert_eq!(k.balance(&a).await, 30);
    assert_eq!(
        k.ledger_kinds(&a).await,
        vec![
            ("grant".into(), 100),
            ("charge".into(), -40),
            ("charge".into(), -10),
            ("charge".into(), -20),
            ("charge".into(), 0)
        ]
    );
    let replay = k.store.create_job(new_job("j1", &a, 40)).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, job);
    let conflict = k.store.create_job(new_job("j1", &a, 41)).await;
    assert!(matches!(conflict, Err(StoreError::IdempotencyConflict { .. })));
    let mut other_payload = new_job("j1", &a, 40);
    other_payload.payload = serde_json::json!({ "x": 1 });
    assert!(matches!(k.store.create_job(other_payload).await, Err(StoreError::IdempotencyConflict { .. })));
    assert_eq!(k.balance(&a).await, 30);
    assert_eq!(k.event_types().await.iter().filter(|t| *t == "job.queued").count(), 2);
}

/// The store keeps JSON with its object keys sorted (`canonical_json`): a create re-sent with its
/// keys in another order is the same request, and a success's result is stored the same way.
async fn payloads_and_results_are_kept_canonical(k: &Kit) {
    let a = k.account("a", 100).await;
    let mut req = new_job("j", &a, 10);
    req.payload = serde_json::from_str(r#"{"b":1,"a":{"d":[{"f":2,"e":1}],"c":null}}"#).unwrap();
    let created = k.store.create_job(req.clone()).await.unwrap();
    assert_eq!(created.value.payload, r#"{"a":{"c":null,"d":[{"e":1,"f":2}]},"b":1}"#);
    req.payload = serde_json::from_str(r#"{"a":{"c":null,"d":[{"e":1,"f":2}]},"b":1}"#).unwrap();
    let replay = k.store.create_job(req).await.unwrap();
    assert!(replay.replayed);
    assert_eq!(replay.value, created.value);
    let t = k.claim_one("j").await;
    let result = serde_json::json!({ "z": [3, { "y": true, "x": "s" }], "w": 0.5 });
    let done = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), Some(result)).await.unwrap();
    assert_eq!(done.value.result.as_deref(), Some(r#"{"w":0.5,"z":[3,{"x":"s","y":true}]}"#));
    assert_eq!(k.get("j").await.payload, created.value.payload);
}

async fn insufficient_credits_write_nothing(k: &Kit) {
    let a = k.account("a", 50).await;
    let before_events = k.event_types().await.len();
    let r = k.store.create_job(items_job("j", &a, &[30, 30])).await;
    match r {
        Err(StoreError::InsufficientCredits { balance, needed, .. }) => assert_eq!((balance, needed), (50, 60)),
        other => panic!("{other:?}"),
    }
    assert!(matches!(k.store.job(&jid("j")).await, Err(StoreError::NotFound { .. })));
    assert_eq!(k.balance(&a).await, 50);
    assert_eq!(k.ledger_kinds(&a).await.len(), 1);
    assert_eq!(k.event_types().await.len(), before_events);
    // The same id may be used once the balance allows it: a failed create left no trace.
    k.store
        .grant(
            &a,
            NewGrant {
                id: RefId::parse("more").unwrap(),
                amount: Credits::new(10),
                reason: None,
                expires_at: None,
                priority: None,
            },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    k.store.create_job(items_job("j", &a, &[30, 30])).await.unwrap();
    assert_eq!(k.balance(&a).await, 0);
}

async fn overdraft_allows_a_negative_balance(k: &Kit) {
    let a = acc("a");
    k.store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::new(20), max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    k.job("j1", &a, 15).await;
    assert_eq!(k.balance(&a).await, -15);
    let r = k.store.create_job(new_job("j2", &a, 6)).await;
    assert!(matches!(r, Err(StoreError::InsufficientCredits { .. })));
    k.job("j3", &a, 5).await;
    assert_eq!(k.balance(&a).await, -20);
}

async fn job_create_rejects_bad_items(k: &Kit) {
    let a = k.account("a", 100).await;
    let mut dup = items_job("j", &a, &[1, 2]);
    dup.items[1].id = dup.items[0].id.clone();
    let mut empty = items_job("j", &a, &[]);
    empty.items.clear();
    let negative = items_job("j", &a, &[5, -1]);
    let mut attempts = new_job("j", &a, 1);
    attempts.max_attempts = Some(0);
    let too_many = items_job("j", &a, &vec![0; settle_core::limits::JOB_ITEMS_MAX + 1]);
    for bad in [dup, empty, negative, attempts, too_many] {
        assert!(matches!(k.store.create_job(bad).await, Err(StoreError::Invalid(_))));
    }
    assert_eq!(k.balance(&a).await, 100);
    assert!(matches!(k.store.job(&jid("j")).await, Err(StoreError::NotFound { .. })));
}

async fn unknown_ids_are_not_found(k: &Kit) {
    let ghost = jid("ghost");
    let t = LeaseToken("t".into());
    assert!(matches!(k.store.create_job(new_job("j", &acc("nobody"), 1)).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(k.store.job(&ghost).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(
        k.store.succeed(&ghost, settle_store::Reporter::of(None), None).await,
        Err(StoreError::NotFound { .. })
    ));
    assert!(matches!(k.store.fail(&ghost, fail_sig(&t, "TIMEOUT")).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(k.store.cancel(&ghost, None).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(k.store.heartbeat(&ghost, &t).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(k.store.requeue(&ghost, settle_store::SYSTEM_ACTOR).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(k.store.attempts(&ghost).await, Err(StoreError::NotFound { .. })));
    assert!(matches!(k.store.ledger(&acc("nobody"), Page::FIRST).await, Err(StoreError::NotFound { .. })));
    let a = k.account("a", 10).await;
    k.job("j", &a, 1).await;
    let token = k.claim_one("j").await;
    assert!(matches!(k.store.item_succeed(&jid("j"), &iid("nope"), &token).await, Err(StoreError::NotFound { .. })));
}

/// Every arrow of §2 at item level, and every no-op pair on items.
async fn item_arrows_and_their_no_ops(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20, 30, 40]).await;
    let t = k.claim_one("j").await;
    let j = jid("j");
    // charged → succeeded (no ledger row)
    let r = k.store.item_succeed(&j, &iid("i0"), &t).await.unwrap();
    assert!(r.applied && r.item.state == ItemState::Succeeded && !r.cancel_requested);
    // succeeded + fail: a failure of a delivered item contradicts it (decision 0019)
    let r = k.store.item_fail(&j, &iid("i0"), &t, &code("TIMEOUT"), None).await;
    assert!(matches!(r, Err(StoreError::InvalidTransition { .. })), "{r:?}");
    // the same success again is a replay
    let r = k.store.item_succeed(&j, &iid("i0"), &t).await.unwrap();
    assert!(!r.applied && r.item.state == ItemState::Succeeded);
    // charged → refunded (+20), and a second failure does nothing
    let r = k.store.item_fail(&j, &iid("i1"), &t, &code("TIMEOUT"), Some("gpu lost")).await.unwrap();
    assert!(r.applied && r.item.state == ItemState::Refunded);
    assert_eq!(r.item.refund_reason, Some(RefundReason::ItemFailed));
    assert!(!k.store.item_fail(&j, &iid("i1"), &t, &code("TIMEOUT"), None).await.unwrap().applied);
    // refunded → reclaimed (−20), and a second success does nothing
    let r = k.store.item_succeed(&j, &iid("i1"), &t).await.unwrap();
    assert!(r.applied && r.item.state == ItemState::Reclaimed);
    assert!(!k.store.item_succeed(&j, &iid("i1"), &t).await.unwrap().applied);
    let r = k.store.item_fail(&j, &iid("i1"), &t, &code("TIMEOUT"), None).await;
    assert!(matches!(r, Err(StoreError::InvalidTransition { .. })), "a delivered item cannot fail: {r:?}");
    // charged → cancelled (+30, +40) through a cancel that the worker acknowledges
    assert!(matches!(k.store.cancel(&j, None).await.unwrap(), CancelOutcome::Accepted(_)));
    let r = k.store.item_succeed(&j, &iid("i0"), &t).await.unwrap();
    assert!(r.cancel_requested, "item reports tell the worker about the cancel");
    let done = k.store.fail(&j, fail_sig(&t, "CANCELLED")).await.unwrap().value;
    assert_state(&done, JobState::Cancelled);
    assert_eq!(states(&done), ["succeeded", "reclaimed", "cancelled", "cancelled"]);
    assert_eq!(done.net.get(), -30);
    assert_eq!(k.balance(&a).await, 70);
    let kinds: Vec<_> = k.ledger_kinds(&a).await.into_iter().skip(1).collect();
    assert_eq!(
        kinds,
        vec![
            ("charge".into(), -10),
            ("charge".into(), -20),
            ("charge".into(), -30),
            ("charge".into(), -40),
            ("refund".into(), 20),
            ("reclaim".into(), -20),
            ("refund".into(), 30),
            ("refund".into(), 40)
        ]
    );
    // cancelled is terminal for items: nothing moves it
    assert!(matches!(k.store.item_succeed(&j, &iid("i2"), &t).await, Err(StoreError::LeaseLost(_))));
}

async fn item_reports_need_the_current_lease(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 10]).await;
    let t1 = k.claim_one("j").await;
    k.fail("j", &t1, "TIMEOUT").await;
    k.clock.advance_seconds(5);
    let t2 = k.claim_one("j").await;
    let j = jid("j");
    for r in [
        k.store.item_succeed(&j, &iid("i0"), &t1).await.map(|_| ()),
        k.store.item_fail(&j, &iid("i0"), &t1, &code("TIMEOUT"), None).await.map(|_| ()),
        k.store
            .register_artifact(&j, &iid("i0"), &t1, NewArtifact { key: ArtifactKey::parse("x/y").unwrap() })
            .await
            .map(|_| ()),
        k.store.heartbeat(&j, &t1).await.map(|_| ()),
    ] {
        assert!(matches!(r, Err(StoreError::LeaseLost(_))), "{r:?}");
    }
    let job = k.get("j").await;
    assert_eq!(states(&job), ["refunded", "refunded"]);
    // With the current lease, an item success reclaims the job-level refund of that item.
    let r = k.store.item_succeed(&j, &iid("i0"), &t2).await.unwrap();
    assert_eq!(r.item.state, ItemState::Reclaimed);
    assert_eq!(k.balance(&a).await, 90);
}

async fn claim_respects_not_before_kinds_and_limit(k: &Kit) {
    let a = k.account("a", 100).await;
    let mut later = new_job("later", &a, 1);
    later.not_before = Some(Timestamp::from_micros(T0).plus_seconds(60));
    k.store.create_job(later).await.unwrap();
    let mut other = new_job("mail", &a, 1);
    other.kind = JobKind::parse("email").unwrap();
    k.store.create_job(other).await.unwrap();
    k.job("r1", &a, 1).await;
    k.job("r2", &a, 1).await;
    let mut req = claim_req("w1", 10);
    req.kinds = vec![JobKind::parse("render").unwrap()];
    let got = k.store.claim(req.clone()).await.unwrap();
    let ids: Vec<_> = got.iter().map(|c| c.job.id.as_str()).collect();
    assert_eq!(ids, ["r1", "r2"]);
    for c in &got {
        assert_state(&c.job, JobState::Running);
        assert_eq!(c.job.attempt, 1);
        assert_eq!(c.lease_expires_at, Timestamp::from_micros(T0).plus_seconds(30));
    }
    assert_ne!(got[0].lease_token, got[1].lease_token);
    assert!(k.store.claim(req.clone()).await.unwrap().is_empty());
    k.clock.advance_seconds(60);
    let got = k.store.claim(req).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].job.id, "later");
    let got = k.store.claim(claim_req("w2", 5)).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!(got[0].job.id, "mail");
    let attempts = k.store.attempts(&jid("r1")).await.unwrap();
    assert_eq!(attempts.len(), 1);
    assert_eq!((attempts[0].attempt_no, attempts[0].worker.as_str(), attempts[0].result), (1, "w1", None));
    for bad in
        [ClaimRequest { limit: 0, ..claim_req("w", 1) }, ClaimRequest { lease_seconds: Some(0), ..claim_req("w", 1) }]
    {
        assert!(matches!(k.store.claim(bad).await, Err(StoreError::Invalid(_))));
    }
}

/// More due jobs than the limit: a claim takes exactly `limit`, oldest first, and the rest stay
/// queued for the next; a limit above `CLAIM_LIMIT_MAX` is refused and claims nothing.
async fn a_claim_returns_at_most_its_limit(k: &Kit) {
    let a = k.account("a", 1_000).await;
    for n in 0..7 {
        k.job(&format!("j{n}"), &a, 1).await;
    }
    let got = k.store.claim(claim_req("w", 3)).await.unwrap();
    let ids: Vec<_> = got.iter().map(|c| c.job.id.as_str()).collect();
    assert_eq!(ids, ["j0", "j1", "j2"]);
    let max = settle_core::limits::CLAIM_LIMIT_MAX;
    let refused = k.store.claim(claim_req("w", max + 1)).await;
    assert!(matches!(refused, Err(StoreError::Invalid(_))), "{refused:?}");
    assert_eq!(k.get("j3").await.state, JobState::Queued, "a refused claim leases nothing");
    let got = k.store.claim(claim_req("w", max)).await.unwrap();
    assert_eq!(got.len(), 4, "the rest, however high the limit");
    assert!(k.store.claim(claim_req("w", 1)).await.unwrap().is_empty());
}

async fn heartbeat_extends_and_reports_cancel(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t = k.claim_one("j").await;
    k.clock.advance_seconds(20);
    let hb = k.store.heartbeat(&jid("j"), &t).await.unwrap();
    assert_eq!(hb.lease_expires_at, Timestamp::from_micros(T0).plus_seconds(50));
    assert!(!hb.cancel_requested);
    k.store.cancel(&jid("j"), None).await.unwrap();
    assert!(k.store.heartbeat(&jid("j"), &t).await.unwrap().cancel_requested);
    assert!(matches!(k.store.heartbeat(&jid("j"), &LeaseToken("forged".into())).await, Err(StoreError::LeaseLost(_))));
}

async fn succeed_from_running_decides_items(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    let out = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    assert!(out.applied);
    assert_state(&out.value, JobState::Succeeded);
    assert_eq!(states(&out.value), ["succeeded", "succeeded"]);
    assert_eq!((out.value.net.get(), k.balance(&a).await), (-30, 70));
    let att = k.store.attempts(&jid("j")).await.unwrap();
    assert_eq!(att[0].result, Some(AttemptResult::Succeeded));
    assert!(att[0].finished_at.is_some());
    assert!(k.event_types().await.contains(&"job.succeeded".to_string()));
}

/// A page of jobs reads its items and nets for the whole page at once (`attach_all`): each job on
/// it is exactly the job read alone — items in order, states, nets after refunds and reclaims, held
/// items — whatever the page's length (a page of one takes the single read).
async fn a_page_of_jobs_is_each_job_read_alone(k: &Kit) {
    let a = k.account("a", 1_000).await;
    let b = k.account("b", 1_000).await;
    k.items_job("m", &a, &[3, 4, 5]).await;
    let t = k.claim_one("m").await;
    k.store.item_fail(&jid("m"), &iid("i1"), &t, &code("BAD_INPUT"), None).await.unwrap();
    k.store.succeed(&jid("m"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    k.job("r", &b, 7).await;
    let t = k.claim_one("r").await;
    k.fail("r", &t, "TIMEOUT").await;
    k.store.succeed(&jid("r"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    k.store.create_job(held_job("h", &a, &[10, 20])).await.unwrap();
    k.items_job("q", &b, &[1, 2, 30]).await;
    let alone: Vec<Job> = futures_util::future::join_all(["m", "r", "h", "q"].map(|id| k.get(id))).await;
    assert_eq!(alone.iter().map(|j| j.net.get()).collect::<Vec<_>>(), [-8, -7, -30, -33]);
    for limit in [100, 3, 1] {
        let mut listed = Vec::new();
        let mut after = 0;
        loop {
            let page = k.store.jobs(&JobFilter::ALL, Page { after, limit }).await.unwrap();
            listed.extend(page.rows);
            match page.next_after {
                Some(n) => after = n,
                None => break,
            }
        }
        assert_eq!(listed, alone, "pages of {limit}");
    }
}

/// The seed's story: timeout at 30 s → refund; the GPU finishes at 32 s → reclaim, once.
async fn succeed_after_refund_reclaims_once(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("render-1", &a, 40).await;
    let t = k.claim_one("render-1").await;
    k.clock.advance_seconds(30);
    let failed = k.fail("render-1", &t, "TIMEOUT").await.value;
    assert_state(&failed, JobState::Queued);
    assert_eq!(k.balance(&a).await, 100);
    k.clock.advance_seconds(2);
    let late = k.store.succeed(&jid("render-1"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    assert!(late.applied);
    assert_state(&late.value, JobState::Succeeded);
    assert_eq!(states(&late.value), ["reclaimed"]);
    for _ in 0..3 {
        assert!(!k.store.succeed(&jid("render-1"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().applied);
        assert!(!k.store.succeed(&jid("render-1"), settle_store::Reporter::of(None), None).await.unwrap().applied);
    }
    assert_eq!(k.balance(&a).await, 60);
    let kinds: Vec<_> = k.ledger_kinds(&a).await.into_iter().skip(1).collect();
    assert_eq!(kinds, vec![("charge".into(), -40), ("refund".into(), 40), ("reclaim".into(), -40)]);
    let signals = k.store.signals(&jid("render-1")).await.unwrap();
    assert!(signals.iter().any(|s| s.effect == SignalEffect::Recovered && s.attempt_no == Some(1)), "{signals:?}");
}

async fn succeed_from_unknown_and_dead_recovers(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("u", &a, 10).await;
    let t = k.claim_one("u").await;
    k.store.mark_unknown(&jid("u"), &t, Some("no answer")).await.unwrap();
    let u = k.store.succeed(&jid("u"), settle_store::Reporter::of(None), None).await.unwrap().value;
    assert_state(&u, JobState::Succeeded);
    assert_eq!(states(&u), ["succeeded"]);
    k.job("d", &a, 10).await;
    let t = k.claim_one("d").await;
    k.fail("d", &t, "INVALID_ADDRESS").await;
    assert_eq!(k.balance(&a).await, 90);
    let d = k.store.succeed(&jid("d"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().value;
    assert_state(&d, JobState::Succeeded);
    assert_eq!(states(&d), ["reclaimed"]);
    assert_eq!(k.balance(&a).await, 80);
    let att = k.store.attempts(&jid("d")).await.unwrap();
    assert_eq!(att[0].result, Some(AttemptResult::Failed), "the support log keeps the failure");
}

async fn job_success_keeps_item_failures_refunded(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20, 30]).await;
    let t = k.claim_one("j").await;
    k.store.item_fail(&jid("j"), &iid("i1"), &t, &code("INVALID_INPUT"), None).await.unwrap();
    let done = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().value;
    assert_eq!(states(&done), ["succeeded", "refunded", "succeeded"]);
    assert_eq!(done.items[1].refund_reason, Some(RefundReason::ItemFailed));
    assert_eq!(k.balance(&a).await, 60);
}

async fn succeed_after_cancel_requested_tears_down(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    k.store.item_succeed(&jid("j"), &iid("i0"), &t).await.unwrap();
    k.store.cancel(&jid("j"), None).await.unwrap();
    let out = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    assert_state(&out.value, JobState::Cancelled);
    assert_eq!(states(&out.value), ["succeeded", "cancelled"]);
    assert_eq!(k.balance(&a).await, 90);
    // A success after the cancel changes nothing: its own re-send is a replay, an operator's is
    // refused (the job is finished).
    assert!(!k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().applied);
    assert!(matches!(
        k.store.succeed(&jid("j"), settle_store::Reporter::of(None), None).await,
        Err(StoreError::JobFinished(_))
    ));
    assert_eq!(k.balance(&a).await, 90);
    assert_eq!(k.store.attempts(&jid("j")).await.unwrap()[0].result, Some(AttemptResult::Cancelled));
}

async fn retryable_failure_requeues_with_backoff_and_refunds(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 40).await;
    let t = k.claim_one("j").await;
    k.clock.advance_seconds(3);
    let out = k.fail("j", &t, "NODE_DOWN").await;
    assert!(out.applied);
    let j = out.value;
    assert_state(&j, JobState::Queued);
    assert_eq!(j.not_before, Timestamp::from_micros(T0).plus_seconds(3).plus_millis(1_000));
    assert_eq!(j.last_error.as_ref().map(|e| e.code.as_str()), Some("NODE_DOWN"));
    assert_eq!(states(&j), ["refunded"]);
    assert_eq!(j.items[0].refund_reason, Some(RefundReason::JobFailed));
    assert_eq!(k.balance(&a).await, 100);
    assert!(k.store.claim(claim_req("w", 1)).await.unwrap().is_empty(), "not before its backoff");
    k.clock.advance_seconds(1);
    let t2 = k.claim_one("j").await;
    let done = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t2)), None).await.unwrap().value;
    assert_eq!((states(&done), done.attempt), (vec!["reclaimed"], 2));
    assert_eq!(k.balance(&a).await, 60);
    let types = k.event_types().await;
    for t in ["job.refunded", "job.retry_scheduled", "job.reclaimed", "job.succeeded"] {
        assert!(types.contains(&t.to_string()), "{t} missing from {types:?}");
    }
}

async fn final_failure_holds_the_charge_until_dead(k: &Kit) {
    let a = k.account("a", 100).await;
    k.store.create_job(with_policy(new_job("w", &a, 40), RefundPolicy::FinalFailure)).await.unwrap();
    for attempt in 1..=3 {
        let t = k.claim_one("w").await;
        let j = k.fail("w", &t, "NODE_DOWN").await.value;
        if attempt < 3 {
            assert_state(&j, JobState::Queued);
            assert_eq!(states(&j), ["charged"]);
            assert_eq!(k.balance(&a).await, 60, "held while retries continue");
            k.clock.advance_seconds(600);
        } else {
            assert_state(&j, JobState::Dead);
            assert_eq!(states(&j), ["refunded"]);
            assert_eq!(k.balance(&a).await, 100);
        }
    }
    // succeed from a held (queued) final_failure job: no refund happened, so nothing is reclaimed
    k.store.create_job(with_policy(new_job("w2", &a, 10), RefundPolicy::FinalFailure)).await.unwrap();
    let t = k.claim_one("w2").await;
    k.fail("w2", &t, "NODE_DOWN").await;
    let j = k.store.succeed(&jid("w2"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().value;
    assert_eq!(states(&j), ["succeeded"]);
    assert_eq!(k.balance(&a).await, 90);
}

async fn non_retryable_failure_is_dead_with_refund(k: &Kit) {
    let a = k.account("a", 100).await;
    for (id, policy) in [("f", RefundPolicy::Failure), ("ff", RefundPolicy::FinalFailure)] {
        k.store.create_job(with_policy(new_job(id, &a, 25), policy)).await.unwrap();
        let t = k.claim_one(id).await;
        let j = k.fail(id, &t, "INVALID_ADDRESS").await.value;
        assert_state(&j, JobState::Dead);
        assert_eq!(states(&j), ["refunded"]);
    }
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(k.event_types().await.iter().filter(|t| *t == "job.dead").count(), 2);
}

async fn last_attempt_goes_dead(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    for attempt in 1..=3u32 {
        let t = k.claim_one("j").await;
        let j = k.fail("j", &t, "TIMEOUT").await.value;
        assert_eq!(j.attempt, attempt);
        assert_state(&j, if attempt < 3 { JobState::Queued } else { JobState::Dead });
        k.clock.advance_seconds(600);
    }
    let att = k.store.attempts(&jid("j")).await.unwrap();
    assert_eq!(att.len(), 3);
    assert!(att.iter().all(|a| a.result == Some(AttemptResult::Failed) && a.fail_code.as_deref() == Some("TIMEOUT")));
    assert_eq!(k.balance(&a).await, 100);
}

async fn signal_retryable_overrides_the_list(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t = k.claim_one("j").await;
    let mut s = fail_sig(&t, "INVALID_ADDRESS");
    s.retryable = Some(true);
    assert_state(&k.store.fail(&jid("j"), s).await.unwrap().value, JobState::Queued);
    k.clock.advance_seconds(5);
    let t = k.claim_one("j").await;
    let mut s = fail_sig(&t, "NODE_DOWN");
    s.retryable = Some(false);
    assert_state(&k.store.fail(&jid("j"), s).await.unwrap().value, JobState::Dead);
}

async fn retry_after_overrides_backoff(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t = k.claim_one("j").await;
    let mut s = fail_sig(&t, "RATE_LIMITED");
    s.retry_after_ms = Some(42_000);
    let j = k.store.fail(&jid("j"), s).await.unwrap().value;
    assert_eq!(j.not_before, Timestamp::from_micros(T0).plus_millis(42_000));
}

async fn lease_expiry_requeues_and_late_success_reclaims(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 40).await;
    let t = k.claim_one("j").await;
    k.clock.advance_seconds(29);
    assert!(k.store.rescue_expired_leases(10).await.unwrap().is_empty(), "lease still valid");
    k.clock.advance_seconds(1);
    assert_eq!(k.store.rescue_expired_leases(10).await.unwrap(), ["j"]);
    let j = k.get("j").await;
    assert_state(&j, JobState::Queued);
    assert_eq!(j.last_error.as_ref().unwrap().code, "LEASE_EXPIRED");
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(k.store.attempts(&jid("j")).await.unwrap()[0].result, Some(AttemptResult::LeaseExpired));
    // The lost worker's heartbeat and failure are refused (its lease expired); its success
    // recovers the job.
    let expired = |r: Result<_, StoreError>| matches!(r, Err(StoreError::LeaseLost(l)) if l.lease() == "expired");
    assert!(expired(k.store.heartbeat(&jid("j"), &t).await.map(drop)));
    assert!(expired(k.store.fail(&jid("j"), fail_sig(&t, "TIMEOUT")).await.map(drop)));
    let done = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().value;
    assert_state(&done, JobState::Succeeded);
    assert_eq!(k.balance(&a).await, 60);
    assert!(k.store.rescue_expired_leases(10).await.unwrap().is_empty());
}

async fn cancel_requested_then_fail_tears_down(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20, 30]).await;
    let t = k.claim_one("j").await;
    k.store.item_succeed(&jid("j"), &iid("i0"), &t).await.unwrap();
    let accepted = k.store.cancel(&jid("j"), None).await.unwrap();
    assert!(matches!(accepted, CancelOutcome::Accepted(ref j) if j.cancel_requested && j.state == JobState::Running));
    // Any code, even a retryable one, ends in teardown: never retried, never dead.
    let j = k.fail("j", &t, "NODE_DOWN").await.value;
    assert_state(&j, JobState::Cancelled);
    assert_eq!(states(&j), ["succeeded", "cancelled", "cancelled"]);
    assert_eq!(k.balance(&a).await, 90);
    let types = k.event_types().await;
    assert_eq!(types.iter().filter(|t| *t == "job.cancelled").count(), 1);
    assert!(!types.contains(&"job.retry_scheduled".to_string()));
}

async fn cancel_requested_then_lease_expiry_tears_down(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    k.claim_one("j").await;
    k.store.cancel(&jid("j"), None).await.unwrap();
    k.clock.advance_seconds(31);
    assert_eq!(k.store.rescue_expired_leases(10).await.unwrap(), ["j"]);
    let j = k.get("j").await;
    assert_state(&j, JobState::Cancelled);
    assert_eq!(k.balance(&a).await, 100);
    // The attempt log says why the attempt ended: its lease ran out, not a worker's cancel.
    let attempts = k.store.attempts(&jid("j")).await.unwrap();
    assert_eq!(
        (attempts[0].result, attempts[0].fail_code.as_deref()),
        (Some(AttemptResult::LeaseExpired), Some("LEASE_EXPIRED"))
    );
}

async fn unknown_is_not_refunded_and_reconciles(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("p", &a, 10).await;
    let t = k.claim_one("p").await;
    let u = k.store.mark_unknown(&jid("p"), &t, Some("timeout after send")).await.unwrap().value;
    assert_state(&u, JobState::Unknown);
    assert_eq!((states(&u), k.balance(&a).await), (vec!["charged"], 90));
    assert!(k.store.claim(claim_req("w", 5)).await.unwrap().is_empty(), "unknown is never retried automatically");
    assert!(k.store.rescue_expired_leases(10).await.unwrap().is_empty());
    assert_eq!(k.store.attempts(&jid("p")).await.unwrap()[0].result, Some(AttemptResult::Unknown));
    // absent, but inside the confirm window: nothing yet
    k.clock.advance_seconds(3_599);
    assert!(!k.store.reconcile(&jid("p"), Finding::Absent).await.unwrap().applied);
    k.clock.advance_seconds(1);
    let r = k.store.reconcile(&jid("p"), Finding::Absent).await.unwrap();
    assert!(r.applied);
    assert_state(&r.value, JobState::Queued);
    assert_eq!(r.value.last_error.as_ref().unwrap().code, "TIMEOUT_CONFIRMED_NOT_SENT");
    assert_eq!(k.balance(&a).await, 100);
    // second job: the external system has it
    k.job("q", &a, 10).await;
    k.clock.advance_seconds(1);
    let claimed = k.store.claim(ClaimRequest { kinds: vec![], ..claim_req("w", 5) }).await.unwrap();
    let tq = claimed.iter().find(|c| c.job.id == "q").unwrap().lease_token.clone();
    k.store.mark_unknown(&jid("q"), &tq, None).await.unwrap();
    let r = k.store.reconcile(&jid("q"), Finding::Present).await.unwrap();
    assert_state(&r.value, JobState::Succeeded);
    assert!(!k.store.reconcile(&jid("q"), Finding::Present).await.unwrap().applied);
    // The reconciler's success is no signal of an attempt (issue 20: the console listed it as a
    // "recovered" signal of attempt "?" under the signals that changed nothing).
    assert!(k.store.signals(&jid("q")).await.unwrap().is_empty());
}

async fn cancel_queued_refunds_and_cleans_artifacts(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    // attempt 1 registers artifacts, then fails retryably: its refunded items' artifacts must be
    // cleaned by a later cancel too (the marker is "undelivered", not "still charged").
    let t = k.claim_one("j").await;
    let root = k.dir.path().join("artifacts");
    for (item, key) in [("i0", "j/a0"), ("i1", "j/a1")] {
        // The worker stores it under the job's and item's own prefix.
        let path = root.join(ArtifactKey::parse(key).unwrap().path_in("j", item));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(path, b"x").unwrap();
        assert!(
            k.store
                .register_artifact(&jid("j"), &iid(item), &t, NewArtifact { key: ArtifactKey::parse(key).unwrap() })
                .await
                .unwrap()
        );
    }
    assert!(
        !k.store
            .register_artifact(&jid("j"), &iid("i0"), &t, NewArtifact { key: ArtifactKey::parse("j/a0").unwrap() })
            .await
            .unwrap()
    );
    k.store.item_succeed(&jid("j"), &iid("i0"), &t).await.unwrap();
    k.fail("j", &t, "NODE_DOWN").await;
    let out = k.store.cancel(&jid("j"), None).await.unwrap();
    let CancelOutcome::Cancelled(j) = out else { panic!("{out:?}") };
    assert_eq!(states(&j), ["succeeded", "refunded"]);
    assert!(root.join("j/i0/j/a0").exists(), "delivered item keeps its artifact");
    assert!(!root.join("j/i1/j/a1").exists(), "undelivered item's artifact is deleted");
    assert_eq!(k.balance(&a).await, 90);
    let last = k.store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows.pop().unwrap();
    assert_eq!(last.kind, EventKind::JobCancelled, "the terminal event is written last");
    // a fresh queued job is refunded item by item
    k.items_job("q", &a, &[5, 5]).await;
    let CancelOutcome::Cancelled(q) = k.store.cancel(&jid("q"), None).await.unwrap() else { panic!() };
    assert_eq!(states(&q), ["cancelled", "cancelled"]);
    assert_eq!(k.balance(&a).await, 90);
}

async fn cancelling_one_job_leaves_another_jobs_artifact_of_the_same_key(k: &Kit) {
    let a = k.account("a", 100).await;
    let root = k.dir.path().join("artifacts");
    let key = ArtifactKey::parse("out/result.bin").unwrap();
    let mut tokens = Vec::new();
    for job in ["x", "y"] {
        k.items_job(job, &a, &[10]).await;
        let t = k.claim_one(job).await;
        let path = root.join(key.path_in(job, "i0"));
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        std::fs::write(&path, job.as_bytes()).unwrap();
        assert!(k.store.register_artifact(&jid(job), &iid("i0"), &t, NewArtifact { key: key.clone() }).await.unwrap());
        tokens.push(t);
    }
    // x fails (refunded, queued for a retry) and is cancelled: its artifact goes, y's stays.
    k.fail("x", &tokens[0], "NODE_DOWN").await;
    let CancelOutcome::Cancelled(x) = k.store.cancel(&jid("x"), None).await.unwrap() else { panic!() };
    assert_eq!(states(&x), ["refunded"]);
    assert!(!root.join("x/i0/out/result.bin").exists(), "the cancelled job's artifact is deleted");
    assert_eq!(
        std::fs::read(root.join("y/i0/out/result.bin")).unwrap(),
        b"y",
        "another job's artifact of the same key is untouched"
    );
    let history = k.store.operators().job_history(&jid("y")).await.unwrap();
    assert_eq!(history.artifacts[0].path, "y/i0/out/result.bin");
}

async fn cancel_with_failing_cleanup_stays_cancelling(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    k.store
        .register_artifact(&jid("j"), &iid("i1"), &t, NewArtifact { key: ArtifactKey::parse("j/out").unwrap() })
        .await
        .unwrap();
    k.store.cancel(&jid("j"), None).await.unwrap();
    k.artifacts.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    let j = k.fail("j", &t, "CANCELLED").await.value;
    assert_state(&j, JobState::Cancelling);
    assert_eq!(k.balance(&a).await, 100, "refunds committed in step 1");
    // cancel again: still failing → 202 with the job cancelling
    assert!(
        matches!(k.store.cancel(&jid("j"), None).await.unwrap(), CancelOutcome::Accepted(ref j) if j.state == JobState::Cancelling)
    );
    // Two failures so far (the fail's teardown, the cancel's): the next try waits 2 s.
    let retry = k.store.cleanup_retry(&jid("j")).await.unwrap().expect("failures recorded");
    assert_eq!(retry.failures, 2);
    assert!(retry.last_error.contains("artifact store unavailable"), "{}", retry.last_error);
    assert!(k.store.resume_teardowns(10).await.unwrap().is_empty(), "the sweeper waits for the retry time");
    k.clock.advance_seconds(2);
    assert!(k.store.resume_teardowns(10).await.unwrap().is_empty());
    assert_eq!(k.store.cleanup_retry(&jid("j")).await.unwrap().unwrap().failures, 3, "tried again and failed");
    // The backoff doubles and is capped at an hour: one try an hour, not one a second.
    for _ in 0..20 {
        k.clock.advance_seconds(3_600);
        assert!(k.store.resume_teardowns(10).await.unwrap().is_empty());
    }
    let retry = k.store.cleanup_retry(&jid("j")).await.unwrap().unwrap();
    assert_eq!(retry.failures, 23);
    assert_eq!(retry.retry_at.micros() - retry.failed_at.micros(), 3_600_000_000);
    k.artifacts.fail.store(false, std::sync::atomic::Ordering::SeqCst);
    assert!(k.store.resume_teardowns(10).await.unwrap().is_empty(), "not before its retry time");
    k.clock.advance_seconds(3_600);
    assert_eq!(k.store.resume_teardowns(10).await.unwrap(), ["j"]);
    assert_state(&k.get("j").await, JobState::Cancelled);
    assert!(matches!(k.store.cancel(&jid("j"), None).await.unwrap(), CancelOutcome::Cancelled(_)));
    assert_eq!(k.balance(&a).await, 100);
    assert_eq!(k.event_types().await.iter().filter(|t| *t == "job.cancelled").count(), 1);
}

async fn an_operator_finishes_a_teardown_that_cannot_clean_up(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t = k.claim_one("j").await;
    let key = NewArtifact { key: ArtifactKey::parse("out").unwrap() };
    k.store.register_artifact(&jid("j"), &iid("i1"), &t, key).await.unwrap();
    // Not from a state other than cancelling, and never without a reason.
    let refused = k.store.abandon_cleanup(&jid("j"), "ops", "the bucket is gone").await;
    assert!(matches!(refused, Err(StoreError::InvalidTransition { .. })), "{refused:?}");
    k.artifacts.fail.store(true, std::sync::atomic::Ordering::SeqCst);
    k.store.cancel(&jid("j"), None).await.unwrap();
    assert_state(&k.fail("j", &t, "CANCELLED").await.value, JobState::Cancelling);
    assert!(matches!(k.store.abandon_cleanup(&jid("j"), "ops", "  ").await, Err(StoreError::Invalid(_))));
    assert_state(&k.get("j").await, JobState::Cancelling);
    let done = k.store.abandon_cleanup(&jid("j"), "ops", "the bucket is gone").await.unwrap();
    assert_state(&done, JobState::Cancelled);
    assert_eq!(k.balance(&a).await, 100, "the refunds of step 1 stand");
    let events = k.store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap().rows;
    let cancelled: Vec<_> = events.iter().filter(|e| e.kind == EventKind::JobCancelled).collect();
    assert_eq!(cancelled.len(), 1);
    let data: serde_json::Value = serde_json::from_str(&cancelled[0].data).unwrap();
    assert_eq!(data["artifacts_left"], serde_json::json!(["j/i1/out"]));
    // A re-sent request is answered with the job and records nothing more.
    assert_state(&k.store.abandon_cleanup(&jid("j"), "ops", "again").await.unwrap(), JobState::Cancelled);
    let actions = k.store.operators().actions(Some(&jid("j")), None).await.unwrap();
    let abandoned: Vec<_> =
        actions.iter().filter(|a| a.action == settle_store::ActionKind::JobAbandonCleanup).collect();
    assert_eq!(abandoned.len(), 1);
    assert_eq!(abandoned[0].actor, "ops");
    let detail: serde_json::Value = serde_json::from_str(&abandoned[0].detail).unwrap();
    assert_eq!(detail["reason"], "the bucket is gone");
    assert_eq!(detail["artifacts_left"], serde_json::json!(["j/i1/out"]));
    assert_eq!(detail["failures"], 1);
    // The sweeper leaves it alone: nothing is cancelling.
    k.clock.advance_seconds(3_600);
    assert!(k.store.resume_teardowns(10).await.unwrap().is_empty());
    assert_eq!(k.event_types().await.iter().filter(|t| *t == "job.cancelled").count(), 1);
}

async fn cancel_running_only_sets_the_flag(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t = k.claim_one("j").await;
    for _ in 0..2 {
        let CancelOutcome::Accepted(j) = k.store.cancel(&jid("j"), None).await.unwrap() else { panic!() };
        assert!(j.cancel_requested);
        assert_state(&j, JobState::Running);
        assert_eq!(states(&j), ["charged"]);
    }
    assert_eq!(k.event_types().await.iter().filter(|t| *t == "job.cancel_requested").count(), 1);
    assert_eq!(k.balance(&a).await, 90);
    k.fail("j", &t, "CANCELLED").await;
    assert_eq!(k.balance(&a).await, 100);
}

async fn cancel_table_for_finished_states(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("s", &a, 10).await;
    let t = k.claim_one("s").await;
    k.store.succeed(&jid("s"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    assert!(matches!(k.store.cancel(&jid("s"), None).await, Err(StoreError::JobFinished(_))));
    k.job("u", &a, 10).await;
    let t = k.claim_one("u").await;
    k.store.mark_unknown(&jid("u"), &t, None).await.unwrap();
    assert!(matches!(k.store.cancel(&jid("u"), None).await, Err(StoreError::OutcomeUnknown(_))));
    k.job("d", &a, 10).await;
    let t = k.claim_one("d").await;
    k.fail("d", &t, "INVALID_ADDRESS").await;
    let CancelOutcome::Cancelled(d) = k.store.cancel(&jid("d"), None).await.unwrap() else { panic!() };
    assert_eq!(states(&d), ["refunded"]);
    assert!(matches!(k.store.cancel(&jid("d"), None).await.unwrap(), CancelOutcome::Cancelled(_)));
    // a cancelled job can be neither requeued nor recovered
    assert!(matches!(
        k.store.requeue(&jid("d"), settle_store::SYSTEM_ACTOR).await,
        Err(StoreError::InvalidTransition { .. })
    ));
    assert!(matches!(
        k.store.succeed(&jid("d"), settle_store::Reporter::of(None), None).await,
        Err(StoreError::JobFinished(_))
    ));
    assert_eq!(k.balance(&a).await, 80);
}

async fn requeue_dead_gives_a_fresh_budget(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t = k.claim_one("j").await;
    k.fail("j", &t, "INVALID_ADDRESS").await;
    let j = k.store.requeue(&jid("j"), settle_store::SYSTEM_ACTOR).await.unwrap();
    assert_state(&j, JobState::Queued);
    assert_eq!(states(&j), ["refunded"], "refunded items stay refunded");
    // re-sent after a lost answer: the same job again, nothing moves
    assert_eq!(k.store.requeue(&jid("j"), settle_store::SYSTEM_ACTOR).await.unwrap(), j);
    k.job("fresh", &a, 1).await;
    assert!(matches!(
        k.store.requeue(&jid("fresh"), settle_store::SYSTEM_ACTOR).await,
        Err(StoreError::InvalidTransition { .. })
    ));
    k.store.cancel(&jid("fresh"), None).await.unwrap();
    for n in 0..3 {
        let t = k.claim_one("j").await;
        let j = k.fail("j", &t, "TIMEOUT").await.value;
        assert_state(&j, if n < 2 { JobState::Queued } else { JobState::Dead });
        k.clock.advance_seconds(600);
    }
    k.store.requeue(&jid("j"), settle_store::SYSTEM_ACTOR).await.unwrap();
    let t = k.claim_one("j").await;
    let j = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().value;
    assert_eq!((states(&j), j.attempt), (vec!["reclaimed"], 5));
    assert!(matches!(
        k.store.requeue(&jid("j"), settle_store::SYSTEM_ACTOR).await,
        Err(StoreError::InvalidTransition { .. })
    ));
    assert_eq!(k.balance(&a).await, 90);
}

async fn no_op_pairs_change_nothing(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 40).await;
    let t = k.claim_one("j").await;
    // two failure signals for one attempt: one refund (the same one re-sent is a replay; another
    // code is a conflict, decision 0019)
    assert!(k.fail("j", &t, "TIMEOUT").await.applied);
    assert!(!k.fail("j", &t, "TIMEOUT").await.applied);
    let other = k.store.fail(&jid("j"), fail_sig(&t, "NODE_DOWN")).await;
    assert!(matches!(other, Err(StoreError::ReportConflict(_))), "{other:?}");
    assert_eq!(k.balance(&a).await, 100);
    // success, then a stale failure, then a second success: one reclaim
    k.store.succeed(&jid("j"), settle_store::Reporter::of(None), None).await.unwrap();
    assert!(!k.fail("j", &t, "TIMEOUT").await.applied);
    assert!(!k.store.succeed(&jid("j"), settle_store::Reporter::of(None), None).await.unwrap().applied);
    assert_eq!(k.balance(&a).await, 60);
    assert!(matches!(k.store.mark_unknown(&jid("j"), &t, None).await, Err(StoreError::LeaseLost(_))));
    assert!(!k.store.reconcile(&jid("j"), Finding::Absent).await.unwrap().applied);
    assert_state(&k.get("j").await, JobState::Succeeded);
    let kinds: Vec<_> = k.ledger_kinds(&a).await.into_iter().skip(1).collect();
    assert_eq!(kinds, vec![("charge".into(), -40), ("refund".into(), 40), ("reclaim".into(), -40)]);
}

async fn stale_tokens_change_nothing_and_are_logged(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t1 = k.claim_one("j").await;
    k.fail("j", &t1, "TIMEOUT").await;
    k.clock.advance_seconds(5);
    let t2 = k.claim_one("j").await;
    let before = k.get("j").await;
    // Attempt 1's failure re-sent is a replay; its `unknown` is refused.
    assert!(!k.fail("j", &t1, "TIMEOUT").await.applied);
    assert!(matches!(k.store.mark_unknown(&jid("j"), &t1, None).await, Err(StoreError::LeaseLost(_))));
    assert_eq!(k.get("j").await, before);
    let sig = k.store.signals(&jid("j")).await.unwrap();
    let effects: Vec<_> = sig.iter().map(|s| (s.effect, s.attempt_no)).collect();
    assert_eq!(effects, [(SignalEffect::Noop, Some(1)), (SignalEffect::Stale, Some(1))]);
    assert!(k.fail("j", &t2, "TIMEOUT").await.applied);
}

/// Issue 19, item 9: a worker looping on a stale token cannot grow a job's signal log without
/// bound; past `SIGNALS_LOGGED_MAX` signals are counted, not kept.
async fn the_signal_log_is_bounded_per_job(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t1 = k.claim_one("j").await;
    k.fail("j", &t1, "TIMEOUT").await;
    k.clock.advance_seconds(5);
    let t2 = k.claim_one("j").await;
    let before = k.get("j").await;
    let extra = 37;
    for _ in 0..settle_core::limits::SIGNALS_LOGGED_MAX + extra {
        assert!(matches!(k.store.mark_unknown(&jid("j"), &t1, None).await, Err(StoreError::LeaseLost(_))));
    }
    assert_eq!(k.get("j").await, before, "stale signals change nothing");
    let sig = k.store.signals(&jid("j")).await.unwrap();
    assert_eq!(sig.len(), settle_core::limits::SIGNALS_LOGGED_MAX);
    assert!(sig.iter().all(|s| s.effect == SignalEffect::Stale));
    let history = k.store.operators().job_history(&jid("j")).await.unwrap();
    assert_eq!(history.signals_unlogged, extra as i64);
    // Another job's log is its own.
    k.job("k", &a, 10).await;
    assert_eq!(k.store.operators().job_history(&jid("k")).await.unwrap().signals_unlogged, 0);
    assert!(k.fail("j", &t2, "TIMEOUT").await.applied, "the current attempt still reports");
    // The lost attempt's late success is kept past the bound: it is what support asks about.
    assert!(k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t1)), None).await.unwrap().applied);
    let sig = k.store.signals(&jid("j")).await.unwrap();
    assert_eq!(sig.len(), settle_core::limits::SIGNALS_LOGGED_MAX + 1);
    assert_eq!(sig.last().map(|s| s.effect), Some(SignalEffect::Recovered));
}

async fn backoff_schedule_under_a_fake_clock(k: &Kit) {
    let a = k.account("a", 100).await;
    let mut j = new_job("j", &a, 1);
    j.max_attempts = Some(12);
    k.store.create_job(j).await.unwrap();
    let mut delays = Vec::new();
    for _ in 0..11 {
        let t = k.claim_one("j").await;
        let now = Timestamp::from_micros(T0 + (k.get("j").await.updated_at.micros() - T0));
        let j = k.fail("j", &t, "TIMEOUT").await.value;
        delays.push((j.not_before.micros() - now.micros()) / 1_000);
        k.clock.set(j.not_before);
    }
    assert_eq!(delays, [1_000, 2_000, 4_000, 8_000, 16_000, 32_000, 64_000, 128_000, 256_000, 512_000, 600_000]);
}

async fn failure_summary_groups_by_code(k: &Kit) {
    let a = k.account("a", 100).await;
    for (id, c) in [("d1", "INVALID_ADDRESS"), ("d2", "INVALID_ADDRESS"), ("r1", "NODE_DOWN"), ("u1", "")] {
        k.job(id, &a, 1).await;
        let t = k.claim_one(id).await;
        if c.is_empty() {
            k.store.mark_unknown(&jid(id), &t, None).await.unwrap();
        } else {
            k.fail(id, &t, c).await;
        }
    }
    let summary = k.store.failure_summary(&settle_core::scope::Scope::ALL).await.unwrap();
    let rows: Vec<_> = summary.iter().map(|f| (f.code.as_str(), f.state.as_str(), f.count)).collect();
    assert_eq!(rows, [("INVALID_ADDRESS", "dead", 2), ("NODE_DOWN", "retrying", 1), ("NONE", "unknown", 1)]);
}

async fn events_and_ledger_pages_are_ordered(k: &Kit) {
    let a = k.account("a", 1000).await;
    for i in 0..7 {
        k.job(&format!("j{i}"), &a, 1).await;
    }
    let mut seen = Vec::new();
    let mut after = 0;
    loop {
        let page = k.store.ledger(&a, Page { after, limit: 3 }).await.unwrap();
        seen.extend(page.rows.iter().map(|e| e.seq));
        match page.next_after {
            Some(n) => after = n,
            None => break,
        }
    }
    assert_eq!(seen, (1..=8).collect::<Vec<i64>>());
    let events = k.store.events(0, 1000, &settle_core::scope::Scope::ALL).await.unwrap();
    let seqs: Vec<i64> = events.rows.iter().map(|e| e.seq).collect();
    assert_eq!(seqs, (1..=seqs.len() as i64).collect::<Vec<_>>());
    assert_eq!(events.next_after, None);
    let page = k.store.events(2, 3, &settle_core::scope::Scope::ALL).await.unwrap();
    assert_eq!(page.rows.iter().map(|e| e.seq).collect::<Vec<_>>(), [3, 4, 5]);
    assert_eq!(page.next_after, Some(5));
    let jobs = k
        .store
        .jobs(&JobFilter { account_id: Some(a.clone()), ..JobFilter::ALL }, Page { after: 0, limit: 5 })
        .await
        .unwrap();
    assert_eq!(jobs.rows.len(), 5);
    let rest = k.store.jobs(&JobFilter::ALL, Page { after: jobs.next_after.unwrap(), limit: 5 }).await.unwrap();
    assert_eq!(rest.rows.len(), 2);
    assert_eq!(rest.next_after, None);
    // A cursor that is no entry of the account (another account's, or a number never given) begins
    // the page exactly after it, whatever the account's entries around it.
    let b = k.account("b", 1000).await;
    for i in 0..5 {
        k.job(&format!("a{i}"), &a, 1).await;
        k.job(&format!("b{i}"), &b, 1).await;
    }
    let all: Vec<i64> =
        k.store.ledger(&a, Page { after: 0, limit: 100 }).await.unwrap().rows.iter().map(|e| e.seq).collect();
    let b_seqs: Vec<i64> =
        k.store.ledger(&b, Page { after: 0, limit: 100 }).await.unwrap().rows.iter().map(|e| e.seq).collect();
    for after in b_seqs.iter().copied().chain([0, 1_000_000]) {
        let page = k.store.ledger(&a, Page { after, limit: 100 }).await.unwrap();
        let want: Vec<i64> = all.iter().copied().filter(|s| *s > after).collect();
        assert_eq!(page.rows.iter().map(|e| e.seq).collect::<Vec<_>>(), want, "after {after}");
    }
}

async fn ledger_rejects_update_and_delete(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    for sql in [
        "UPDATE ledger_entries SET amount = amount + 1",
        "DELETE FROM ledger_entries",
        "UPDATE ledger_entries SET hash = prev_hash WHERE seq = 1",
    ] {
        let r = k.raw(sql).await;
        assert!(r.is_err(), "{sql} succeeded");
        assert!(r.unwrap_err().to_string().contains("append-only"));
    }
    assert_eq!(k.ledger_kinds(&a).await.len(), 2);
}

async fn audit_names_tampering(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    k.drop_update_trigger().await;
    k.raw("UPDATE ledger_entries SET amount = -9 WHERE kind = 'charge'").await.unwrap();
    let report = k.store.audit(None).await.unwrap();
    let found: Vec<_> = report.violations.iter().map(|v| v.invariant.as_str()).collect();
    for inv in ["L1", "L2", "L3"] {
        assert!(found.contains(&inv), "{inv} not reported in {:#?}", report.violations);
    }
    // Put it back so the suite's closing audit sees a consistent ledger again.
    k.raw("UPDATE ledger_entries SET amount = -10 WHERE kind = 'charge'").await.unwrap();
}

async fn unknown_with_a_cancel_request_reconciles_to_teardown(k: &Kit) {
    let a = k.account("a", 100).await;
    for (id, finding) in [("found", Finding::Present), ("absent", Finding::Absent)] {
        k.job(id, &a, 10).await;
        let t = k.claim_one(id).await;
        k.store.cancel(&jid(id), None).await.unwrap();
        let u = k.store.mark_unknown(&jid(id), &t, None).await.unwrap().value;
        assert!(u.cancel_requested && u.state == JobState::Unknown);
        assert!(matches!(k.store.cancel(&jid(id), None).await, Err(StoreError::OutcomeUnknown(_))));
        k.clock.advance_seconds(3_600);
        let r = k.store.reconcile(&jid(id), finding).await.unwrap();
        assert!(r.applied);
        assert_state(&r.value, JobState::Cancelled);
    }
    assert_eq!(k.balance(&a).await, 100);
}

async fn final_failure_success_wins_over_a_cancel_request(k: &Kit) {
    let a = k.account("a", 100).await;
    k.store.create_job(with_policy(new_job("payout", &a, 30), RefundPolicy::FinalFailure)).await.unwrap();
    let t = k.claim_one("payout").await;
    k.store.cancel(&jid("payout"), None).await.unwrap();
    let j = k.store.succeed(&jid("payout"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().value;
    assert_state(&j, JobState::Succeeded);
    assert_eq!(k.balance(&a).await, 70, "money that left is not handed back");
    k.store.create_job(with_policy(new_job("payout2", &a, 30), RefundPolicy::FinalFailure)).await.unwrap();
    let t = k.claim_one("payout2").await;
    k.store.cancel(&jid("payout2"), None).await.unwrap();
    k.store.mark_unknown(&jid("payout2"), &t, None).await.unwrap();
    let j = k.store.reconcile(&jid("payout2"), Finding::Present).await.unwrap().value;
    assert_state(&j, JobState::Succeeded);
    assert_eq!(k.balance(&a).await, 40);
}

async fn stale_lease_signals_are_logged_though_refused(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10]).await;
    let t1 = k.claim_one("j").await;
    k.fail("j", &t1, "TIMEOUT").await;
    k.clock.advance_seconds(5);
    k.claim_one("j").await;
    // A token no attempt held is refused and writes nothing (decision 0019)…
    let forged = LeaseToken("forged".into());
    let never = |r: Result<(), StoreError>| matches!(r, Err(StoreError::LeaseLost(l)) if l.lease() == "never_issued");
    assert!(never(k.store.heartbeat(&jid("j"), &forged).await.map(drop)));
    assert!(never(k.store.item_succeed(&jid("j"), &iid("i0"), &forged).await.map(drop)));
    let artifact = NewArtifact { key: ArtifactKey::parse("x").unwrap() };
    assert!(never(k.store.register_artifact(&jid("j"), &iid("i0"), &forged, artifact.clone()).await.map(drop)));
    assert!(k.store.signals(&jid("j")).await.unwrap().is_empty());
    // …an earlier attempt's is refused and logged.
    assert!(matches!(k.store.heartbeat(&jid("j"), &t1).await, Err(StoreError::LeaseLost(_))));
    assert!(matches!(k.store.item_succeed(&jid("j"), &iid("i0"), &t1).await, Err(StoreError::LeaseLost(_))));
    assert!(matches!(
        k.store.register_artifact(&jid("j"), &iid("i0"), &t1, artifact).await,
        Err(StoreError::LeaseLost(_))
    ));
    let logged: Vec<_> = k.store.signals(&jid("j")).await.unwrap().into_iter().map(|s| (s.signal, s.effect)).collect();
    let stale = |s: Signal| (s, SignalEffect::Stale);
    assert_eq!(logged, vec![stale(Signal::Heartbeat), stale(Signal::ItemSucceed), stale(Signal::Artifact)]);
}

async fn item_failure_after_a_job_refund_is_not_reclaimed(k: &Kit) {
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 20]).await;
    let t1 = k.claim_one("j").await;
    k.fail("j", &t1, "TIMEOUT").await;
    k.clock.advance_seconds(5);
    let t2 = k.claim_one("j").await;
    let r = k.store.item_fail(&jid("j"), &iid("i1"), &t2, &code("BAD_FRAME"), None).await.unwrap();
    assert!(r.applied);
    assert_eq!((r.item.state, r.item.refund_reason), (ItemState::Refunded, Some(RefundReason::ItemFailed)));
    let done = k.store.succeed(&jid("j"), settle_store::Reporter::of(Some(&t2)), None).await.unwrap().value;
    assert_eq!(states(&done), ["reclaimed", "refunded"], "the item the worker failed stays refunded");
    assert_eq!(k.balance(&a).await, 90);
}

async fn final_failure_lease_expiry_after_cancel_is_unknown(k: &Kit) {
    let a = k.account("a", 100).await;
    k.store.create_job(with_policy(new_job("payout", &a, 30), RefundPolicy::FinalFailure)).await.unwrap();
    let t = k.claim_one("payout").await;
    k.store.cancel(&jid("payout"), None).await.unwrap();
    k.clock.advance_seconds(31);
    assert_eq!(k.store.rescue_expired_leases(10).await.unwrap(), ["payout"]);
    let j = k.get("payout").await;
    assert_state(&j, JobState::Unknown);
    assert_eq!(k.balance(&a).await, 70, "money that may have left is not handed back");
    assert_eq!(k.store.attempts(&jid("payout")).await.unwrap()[0].result, Some(AttemptResult::LeaseExpired));
    // the worker's late success (the payout went through) is accepted
    assert_state(
        &k.store.succeed(&jid("payout"), settle_store::Reporter::of(Some(&t)), None).await.unwrap().value,
        JobState::Succeeded,
    );
    assert_eq!(k.balance(&a).await, 70);
}

async fn reclaims_can_never_overflow(k: &Kit) {
    let big = settle_core::limits::BALANCE_MAX;
    let a = acc("a");
    k.store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::new(big), max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    k.job("j1", &a, big).await;
    let t = k.claim_one("j1").await;
    k.fail("j1", &t, "TIMEOUT").await;
    assert_eq!(k.balance(&a).await, 0);
    // The refund may still be reclaimed: spending it again could later take the balance past i64.
    let r = k.store.create_job(new_job("j2", &a, big)).await;
    assert!(matches!(r, Err(StoreError::InsufficientCredits { .. })), "{r:?}");
    let r = k
        .store
        .adjust(
            &a,
            NewAdjustment { id: RefId::parse("x").unwrap(), amount: Credits::new(-1), reason: "fee".into() },
            settle_store::SYSTEM_ACTOR,
        )
        .await;
    assert!(matches!(r, Err(StoreError::Overflow)), "{r:?}");
    k.store.succeed(&jid("j1"), settle_store::Reporter::of(Some(&t)), None).await.unwrap();
    assert_eq!(k.balance(&a).await, -big);
    // A grant is bounded only upwards.
    k.store
        .grant(
            &a,
            NewGrant {
                id: RefId::parse("g").unwrap(),
                amount: Credits::new(5),
                reason: None,
                expires_at: None,
                priority: None,
            },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    assert_eq!(k.balance(&a).await, 5 - big);
}

async fn refunds_can_never_overflow(k: &Kit) {
    // The issue's case: four jobs of cost 2^61 on an account granted 2^61 each time. Before `held`,
    // every grant was accepted and the fourth refund overflowed: that job could never end.
    let big = settle_core::limits::BALANCE_MAX;
    let a = acc("a");
    k.store
        .create_account(
            NewAccount { id: a.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await
        .unwrap();
    let mut tokens = Vec::new();
    for i in 0..4 {
        let g = NewGrant {
            id: RefId::parse(&format!("g{i}")).unwrap(),
            amount: Credits::new(big),
            reason: None,
            expires_at: None,
            priority: None,
        };
        let granted = k.store.grant(&a, g, settle_store::SYSTEM_ACTOR).await;
        // Only the first grant fits: the outstanding charge may still come back as a refund.
        assert_eq!(granted.is_ok(), i == 0, "grant {i}: {granted:?}");
        if let Err(e) = granted {
            assert!(matches!(e, StoreError::Overflow), "{e:?}");
        }
        let created = k.store.create_job(new_job(&format!("j{i}"), &a, big)).await;
        assert_eq!(created.is_ok(), i == 0, "job {i}: {created:?}");
        if i == 0 {
            tokens.push(k.claim_one("j0").await);
        }
    }
    // Every outstanding job can still fail and be refunded.
    let j = k.fail("j0", &tokens[0], "INVALID_INPUT").await.value;
    assert_state(&j, JobState::Dead);
    assert_eq!(k.balance(&a).await, big);
    // With nothing held, the balance is what bounds a grant.
    let g = NewGrant {
        id: RefId::parse("g-more").unwrap(),
        amount: Credits::new(1),
        reason: None,
        expires_at: None,
        priority: None,
    };
    assert!(matches!(k.store.grant(&a, g, settle_store::SYSTEM_ACTOR).await, Err(StoreError::Overflow)));
    // A positive adjustment is bounded the same way; a negative one frees room.
    let adj = |id: &str, amount: i64| NewAdjustment {
        id: RefId::parse(id).unwrap(),
        amount: Credits::new(amount),
        reason: "fix".into(),
    };
    assert!(matches!(k.store.adjust(&a, adj("x1", 1), settle_store::SYSTEM_ACTOR).await, Err(StoreError::Overflow)));
    k.store.adjust(&a, adj("x2", -5), settle_store::SYSTEM_ACTOR).await.unwrap();
    k.store.adjust(&a, adj("x3", 5), settle_store::SYSTEM_ACTOR).await.unwrap();
}

async fn the_audit_checks_what_is_held(k: &Kit) {
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    k.raw("UPDATE accounts SET held = 3 WHERE id = 'a'").await.unwrap();
    let report = k.store.audit(None).await.unwrap();
    assert!(
        report.violations.iter().any(|v| v.invariant.as_str() == "L1" && v.message.contains("held 3")),
        "{:#?}",
        report.violations
    );
    k.raw("UPDATE accounts SET held = 10 WHERE id = 'a'").await.unwrap();
}

async fn rescue_passes_never_starve_behind_failing_jobs(k: &Kit) {
    // Eight running jobs whose rescue fails every time (their account's `held` was tampered with, so
    // the refund's update is refused), then one whose rescue works, expired last. A pass takes five.
    let bad = k.account("bad", 1_000).await;
    let good = k.account("good", 1_000).await;
    for i in 0..8 {
        k.job(&format!("b{i}"), &bad, 10).await;
        k.claim_one(&format!("b{i}")).await;
    }
    k.clock.advance_seconds(1);
    k.job("g", &good, 10).await;
    k.claim_one("g").await;
    k.raw("UPDATE accounts SET held = 0 WHERE id = 'bad'").await.unwrap();
    k.clock.advance_seconds(60);
    let mut rescued = Vec::new();
    for _ in 0..3 {
        rescued.extend(k.store.rescue_expired_leases(5).await.unwrap());
    }
    assert_eq!(rescued, vec!["g".to_owned()], "the good job is reached within the passes that cover all");
    assert_state(&k.get("g").await, JobState::Queued);
    // Put `held` back; the stuck ones are then rescued like any other.
    k.raw("UPDATE accounts SET held = 80 WHERE id = 'bad'").await.unwrap();
    let mut rest = Vec::new();
    for _ in 0..3 {
        rest.extend(k.store.rescue_expired_leases(5).await.unwrap());
    }
    assert_eq!(rest.len(), 8, "{rest:?}");
}

async fn sweep_passes_never_starve_behind_failing_jobs(k: &Kit) {
    // Eight teardowns whose artifacts the store refuses to delete, then one it can finish.
    let a = k.account("a", 1_000).await;
    *k.artifacts.fail_prefix.lock().unwrap() = Some(String::new());
    for (i, id) in (0..9).map(|i| (i, if i < 8 { format!("b{i}") } else { "g".to_owned() })) {
        k.job(&id, &a, 10).await;
        let t = k.claim_one(&id).await;
        let key = if i < 8 { format!("bad/{id}") } else { format!("good/{id}") };
        let artifact = NewArtifact { key: ArtifactKey::parse(&key).unwrap() };
        k.store.register_artifact(&jid(&id), &ItemId::main(), &t, artifact).await.unwrap();
        k.store.cancel(&jid(&id), None).await.unwrap();
        k.fail(&id, &t, "CANCELLED").await;
        assert_state(&k.get(&id).await, JobState::Cancelling);
    }
    // Paths are {job}/{item}/{key}: the eight bad jobs are b0..b7, the good one g.
    *k.artifacts.fail_prefix.lock().unwrap() = Some("b".into());
    // Each failed once: the sweeper's next try is a second on (decision 0028 §6).
    assert!(k.store.resume_teardowns(5).await.unwrap().is_empty(), "not before the retry time");
    k.clock.advance_seconds(1);
    let mut finished = Vec::new();
    for _ in 0..3 {
        finished.extend(k.store.resume_teardowns(5).await.unwrap());
    }
    assert_eq!(finished, vec!["g".to_owned()], "the good teardown is reached within the passes that cover all");
    *k.artifacts.fail_prefix.lock().unwrap() = None;
    k.clock.advance_seconds(2);
    let mut rest = Vec::new();
    for _ in 0..3 {
        rest.extend(k.store.resume_teardowns(5).await.unwrap());
    }
    assert_eq!(rest.len(), 8, "{rest:?}");
}
