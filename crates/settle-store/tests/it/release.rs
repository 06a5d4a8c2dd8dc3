//! Release (issue 41, semantics §3 "Release"): a worker that must stop hands the job back at an item
//! boundary — queued, due at once, no money moved, the attempt closed `released` and not counted —
//! on both engines.

use crate::kit::*;
use settle_core::Clock;
use settle_core::history::AttemptResult;
use settle_core::job::JobState;
use settle_store::*;

fn results(attempts: &[Attempt]) -> Vec<Option<&'static str>> {
    attempts.iter().map(|a| a.result.map(|r| r.as_str())).collect()
}

async fn a_release_requeues_at_once_and_does_not_count(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    let mut req = items_job("j", &a, &[10, 10, 10]);
    req.max_attempts = Some(1);
    k.store.create_job(req).await.unwrap();
    // Three workers in turn deliver one item each and are taken away: three releases.
    for (n, item) in ["i0", "i1", "i2"].into_iter().enumerate() {
        let t = k.claim_one("j").await;
        k.store.item_succeed(&jid("j"), &iid(item), &t).await.unwrap();
        let out = k.store.release(&jid("j"), &t).await.unwrap();
        assert!(out.applied);
        assert_state(&out.value, JobState::Queued);
        assert_eq!(out.value.not_before, k.clock.now(), "due at once");
        assert_eq!(out.value.attempt, n as u32 + 1);
        // A re-send is a replay: nothing changes.
        let again = k.store.release(&jid("j"), &t).await.unwrap();
        assert!(!again.applied);
        assert_eq!(again.value.state, JobState::Queued);
    }
    assert_eq!(k.balance(&a).await, 70, "no money moved");
    assert_eq!(k.ledger_kinds(&a).await.len(), 4, "the grant and three charges");
    // The fourth attempt is the first that counts: its retryable failure ends the job (max 1).
    let t = k.claim_one("j").await;
    let failed = k.fail("j", &t, "TIMEOUT").await.value;
    assert_state(&failed, JobState::Dead);
    let attempts = k.store.attempts(&jid("j")).await.unwrap();
    assert_eq!(results(&attempts), [Some("released"), Some("released"), Some("released"), Some("failed")]);
    assert!(k.event_types().await.iter().filter(|t| *t == "job.released").count() == 3);
    k.assert_clean().await;
}

async fn a_release_with_a_stale_token_changes_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.job("j", &a, 10).await;
    let t1 = k.claim_one("j").await;
    k.fail("j", &t1, "TIMEOUT").await;
    k.clock.advance_seconds(600);
    let t2 = k.claim_one("j").await;
    assert!(matches!(k.store.release(&jid("j"), &t1).await, Err(StoreError::LeaseLost(_))));
    let never = LeaseToken("never-issued".into());
    assert!(matches!(k.store.release(&jid("j"), &never).await, Err(StoreError::LeaseLost(_))));
    assert_state(&k.get("j").await, JobState::Running);
    // A release after a fail of the same attempt is refused too: the fail took effect.
    k.fail("j", &t2, "TIMEOUT").await;
    assert!(matches!(k.store.release(&jid("j"), &t2).await, Err(StoreError::LeaseLost(_))));
    let ghost = jid("ghost");
    assert!(matches!(k.store.release(&ghost, &t2).await, Err(StoreError::NotFound { .. })));
    k.assert_clean().await;
}

/// A cancel requested while the worker ran: its release is the stop the cancel asked for, and the
/// job is torn down — a release never puts back a job its client cancelled.
async fn a_release_after_a_cancel_request_tears_down(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 10]).await;
    let t = k.claim_one("j").await;
    k.store.item_succeed(&jid("j"), &iid("i0"), &t).await.unwrap();
    assert!(matches!(k.store.cancel(&jid("j"), None).await.unwrap(), CancelOutcome::Accepted(_)));
    let out = k.store.release(&jid("j"), &t).await.unwrap();
    assert_state(&out.value, JobState::Cancelled);
    assert_eq!(states(&out.value), ["succeeded", "cancelled"], "the delivered item keeps its charge");
    assert_eq!(k.balance(&a).await, 90);
    let attempts = k.store.attempts(&jid("j")).await.unwrap();
    assert_eq!(attempts[0].result, Some(AttemptResult::Cancelled));
    k.assert_clean().await;
}

both_engines!(
    a_release_requeues_at_once_and_does_not_count,
    a_release_with_a_stale_token_changes_nothing,
    a_release_after_a_cancel_request_tears_down,
    no_artifact_is_registered_after_a_lapse_or_a_cancel_request,
);

/// Issue 41: nothing is registered that a teardown could miss — no artifact after the lease lapsed
/// (before the rescuer came), none after a cancel was requested.
async fn no_artifact_is_registered_after_a_lapse_or_a_cancel_request(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 100).await;
    k.items_job("j", &a, &[10, 10]).await;
    let t = k.claim_one("j").await;
    let key = || NewArtifact { key: settle_core::ids::ArtifactKey::parse("out.png").unwrap() };
    assert!(k.store.register_artifact(&jid("j"), &iid("i0"), &t, key()).await.unwrap(), "a live lease registers");
    k.clock.advance_seconds(3_600);
    let lapsed = k.store.register_artifact(&jid("j"), &iid("i1"), &t, key()).await;
    assert!(matches!(lapsed, Err(StoreError::LeaseLost(_))), "{lapsed:?}");
    // The rescuer retries it; the next attempt's cancel request refuses registrations too.
    k.store.rescue_expired_leases(100).await.unwrap();
    k.clock.advance_seconds(600);
    let t2 = k.claim_one("j").await;
    assert!(matches!(k.store.cancel(&jid("j"), None).await.unwrap(), CancelOutcome::Accepted(_)));
    let refused = k.store.register_artifact(&jid("j"), &iid("i1"), &t2, key()).await;
    assert!(matches!(refused, Err(StoreError::InvalidTransition { .. })), "{refused:?}");
    let history = k.store.operators().job_history(&jid("j")).await.unwrap();
    assert_eq!(history.artifacts.len(), 1, "only the one registered in time");
    k.assert_clean().await;
}
