//! The multi-tenant claim, stage 1 (issue 44, semantics §3a, docs/design/fair-claims.md §4):
//! priority first, accounts in turn within a priority, labels that choose the worker — on both
//! engines.

use crate::kit::*;
use settle_core::ids::{AccountId, JobKind, Labels};
use settle_core::job::JobState;
use settle_store::*;

fn job_at(id: &str, account: &AccountId, priority: Option<u8>, requires: &[&str]) -> NewJob {
    let mut j = new_job(id, account, 1);
    j.priority = priority;
    j.requires = Labels::parse(requires, 8).unwrap();
    j
}

fn worker(labels: &[&str]) -> ClaimRequest {
    let mut r = claim_req("w", 1);
    r.labels = Labels::parse(labels, 64).unwrap();
    r
}

/// Claims one job at a time until none is given; the ids in the order claimed.
async fn drain(k: &Kit, req: &ClaimRequest) -> Vec<String> {
    let mut order = Vec::new();
    loop {
        let got = k.store.claim(req.clone()).await.unwrap();
        let Some(c) = got.first() else { return order };
        order.push(c.job.id.to_string());
    }
}

async fn a_lower_priority_number_is_claimed_first(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    for (id, p) in [("late", Some(90)), ("first", Some(0)), ("plain", None), ("soon", Some(10))] {
        let made = k.store.create_job(job_at(id, &a, p, &[])).await.unwrap().value;
        assert_eq!(made.priority, p.unwrap_or(50));
        assert_eq!(k.get(id).await.priority, made.priority, "the priority is stored");
    }
    assert_eq!(drain(&k, &worker(&[])).await, ["first", "soon", "plain", "late"]);
    k.assert_clean().await;
}

/// §3a: one account's burst delays another account's next job by at most one job per account
/// with work due, not by the burst — whenever the other job arrives.
async fn a_burst_delays_another_account_by_one_turn(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let (a, b, c) = (k.account("a", 1_000).await, k.account("b", 100).await, k.account("c", 100).await);
    for n in 0..40 {
        k.store.create_job(job_at(&format!("a{n:02}"), &a, None, &[])).await.unwrap();
    }
    k.store.create_job(job_at("b0", &b, None, &[])).await.unwrap();
    k.store.create_job(job_at("c0", &c, None, &[])).await.unwrap();
    let w = worker(&[]);
    let mut order = Vec::new();
    for _ in 0..10 {
        order.push(k.store.claim(w.clone()).await.unwrap()[0].job.id.to_string());
    }
    assert_eq!(order[..3], ["a00", "b0", "c0"], "b and c wait one job of a's burst, not the burst");
    // Mid-burst, b comes back: its job waits for a's next one, no more.
    k.store.create_job(job_at("b1", &b, None, &[])).await.unwrap();
    let next: Vec<String> = {
        let mut v = Vec::new();
        for _ in 0..2 {
            v.push(k.store.claim(w.clone()).await.unwrap()[0].job.id.to_string());
        }
        v
    };
    assert!(next.contains(&"b1".to_owned()), "b's new job came within one turn: {next:?}");
    let rest = drain(&k, &w).await;
    assert_eq!(order.len() + next.len() + rest.len(), 43, "every job claimed once");
    // Within an account, creation order.
    let a_order: Vec<&String> = order.iter().chain(&next).chain(&rest).filter(|id| id.starts_with('a')).collect();
    let mut sorted = a_order.clone();
    sorted.sort();
    assert_eq!(a_order, sorted);
    k.assert_clean().await;
}

async fn labels_choose_the_worker(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    let made = k.store.create_job(job_at("gpu", &a, None, &["region:eu", "gpu:a100", "gpu:a100"])).await.unwrap();
    assert_eq!(made.value.requires.text(), "gpu:a100 region:eu", "stored sorted, each once");
    k.store.create_job(job_at("any", &a, None, &[])).await.unwrap();
    // A worker without the labels takes the job that needs none, and then nothing.
    assert_eq!(drain(&k, &worker(&["gpu:a100"])).await, ["any"]);
    assert_state(&k.get("gpu").await, JobState::Queued);
    // One with every required label (and more) takes it.
    assert_eq!(drain(&k, &worker(&["region:eu", "cpu:big", "gpu:a100"])).await, ["gpu"]);
    k.assert_clean().await;
}

/// A failed job waits out its backoff outside its line, then joins it again: claimed then, not
/// before, and a kind filter still holds.
async fn a_retry_waits_then_joins_its_line(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    k.store.create_job(job_at("r", &a, Some(5), &[])).await.unwrap();
    let t = k.claim_one("r").await;
    let failed = k.fail("r", &t, "TIMEOUT").await.value;
    assert_state(&failed, JobState::Queued);
    assert!(k.store.claim(worker(&[])).await.unwrap().is_empty(), "not before its backoff");
    k.clock.advance_seconds(5);
    let mut other = worker(&[]);
    other.kinds = vec![JobKind::parse("other").unwrap()];
    assert!(k.store.claim(other).await.unwrap().is_empty(), "another kind's worker");
    let got = k.store.claim(worker(&[])).await.unwrap();
    assert_eq!(got.len(), 1);
    assert_eq!((got[0].job.id.as_str(), got[0].job.attempt, got[0].job.priority), ("r", 2, 5));
    k.assert_clean().await;
}

/// Jobs queued by a release before this one (no turn: as the migration leaves them) are lined by
/// the first claim that finds nothing else, and keep their order.
async fn waiting_jobs_are_lined_by_a_claim(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    for id in ["w1", "w2", "w3"] {
        k.store.create_job(job_at(id, &a, None, &[])).await.unwrap();
    }
    k.raw("UPDATE jobs SET turn = NULL").await.unwrap();
    assert_eq!(drain(&k, &worker(&[])).await, ["w1", "w2", "w3"]);
    k.assert_clean().await;
}

async fn bad_priorities_and_labels_write_nothing(engine: EngineKind) {
    let k = Kit::new(engine).await;
    let a = k.account("a", 1_000).await;
    let too_high = k.store.create_job(job_at("x", &a, Some(101), &[])).await;
    assert!(matches!(too_high, Err(StoreError::Invalid(_))), "{too_high:?}");
    let nine: Vec<String> = (0..9).map(|i| format!("l{i}")).collect();
    let mut many = new_job("x", &a, 1);
    many.requires = Labels::parse(&nine, 64).unwrap();
    assert!(matches!(k.store.create_job(many).await, Err(StoreError::Invalid(_))));
    assert_eq!(k.balance(&a).await, 1_000, "nothing charged");
    assert!(k.store.job(&jid("x")).await.is_err(), "nothing written");
    // An explicit default replays a create that named none; another priority is a conflict.
    k.store.create_job(job_at("p", &a, None, &["gpu"])).await.unwrap();
    assert!(k.store.create_job(job_at("p", &a, Some(50), &["gpu"])).await.unwrap().replayed);
    let other = k.store.create_job(job_at("p", &a, Some(49), &["gpu"])).await;
    assert!(matches!(other, Err(StoreError::IdempotencyConflict { .. })), "{other:?}");
    let fewer = k.store.create_job(job_at("p", &a, None, &[])).await;
    assert!(matches!(fewer, Err(StoreError::IdempotencyConflict { .. })), "{fewer:?}");
    k.assert_clean().await;
}

both_engines!(
    a_lower_priority_number_is_claimed_first,
    a_burst_delays_another_account_by_one_turn,
    labels_choose_the_worker,
    a_retry_waits_then_joins_its_line,
    waiting_jobs_are_lined_by_a_claim,
    bad_priorities_and_labels_write_nothing,
);
