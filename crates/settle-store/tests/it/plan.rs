//! The batch plan's phase 1 on PostgreSQL (docs/design/batch-plan.md §12): a lane's batch runs its
//! intents (a worker's failure, a success with a lease token) first, their jobs locked and read in
//! two statements. Each test gathers a batch of chosen operations (`pg_batch_gather`) and checks
//! the answers, the rows, the ledger (the audit) and what phase 1 counted.

use crate::kit::*;
use settle_core::crash::CrashPoint;
use settle_core::ids::AccountId;
use settle_core::job::JobState;
use settle_core::ledger::EntryKind;
use settle_store::*;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A PostgreSQL store whose lanes gather batches while `gate` holds more than one, an account `a`
/// holding 1,000, and `n` jobs `j0`, `j1`, … of two items (10 and 20) on it, each claimed.
struct Setup {
    k: Arc<Kit>,
    gate: Arc<AtomicUsize>,
    a: AccountId,
    tokens: Vec<LeaseToken>,
}

async fn setup(n: usize) -> Setup {
    let gate = Arc::new(AtomicUsize::new(0));
    let g = gate.clone();
    let k = Kit::tuned(EngineKind::Postgres, test_policy(), limits_batch(), move |o| o.pg_batch_gather = Some(g)).await;
    let a = k.account("a", 1_000).await;
    let tokens = running_jobs(&k, &a, "j", n).await;
    Setup { k: Arc::new(k), gate, a, tokens }
}

/// `n` jobs `{prefix}0`, `{prefix}1`, … of two items (10 and 20) on `account`, each claimed: their
/// tokens, in order.
async fn running_jobs(k: &Kit, account: &AccountId, prefix: &str, n: usize) -> Vec<LeaseToken> {
    let mut tokens = Vec::new();
    for i in 0..n {
        let id = format!("{prefix}{i}");
        k.items_job(&id, account, &[10, 20]).await;
        tokens.push(k.claim_one(&id).await);
    }
    tokens
}

type Answer = Result<Outcome<Job>, StoreError>;

fn failing(k: &Arc<Kit>, id: &str, token: &LeaseToken, message: String) -> tokio::task::JoinHandle<Answer> {
    let (k, id, token) = (k.clone(), id.to_owned(), token.clone());
    tokio::spawn(async move {
        let signal = FailSignal { message: Some(message), ..fail_sig(&token, "TIMEOUT") };
        k.store.fail(&jid(&id), signal).await
    })
}

fn succeeding(k: &Arc<Kit>, id: &str, token: &LeaseToken) -> tokio::task::JoinHandle<Answer> {
    let (k, id, token) = (k.clone(), id.to_owned(), token.clone());
    tokio::spawn(async move { k.store.succeed(&jid(&id), Reporter::Lease(&token), None).await })
}

/// The answers of `ops`, sent while the gate was open for all of them (set before they were
/// sent: the lane holds the first until all wait), in order; the gate shut again after.
async fn one_batch(gate: &AtomicUsize, ops: Vec<tokio::task::JoinHandle<Answer>>) -> Vec<Answer> {
    let mut answers = Vec::new();
    for op in ops {
        answers.push(op.await.unwrap());
    }
    gate.store(0, Ordering::Relaxed);
    answers
}

/// How many lines of `kind` the account's ledger holds for `job`.
async fn lines(k: &Kit, account: &AccountId, job: &str, kind: EntryKind) -> usize {
    let page = k.store.ledger(account, Page { after: 0, limit: 1000 }).await.unwrap();
    page.rows.iter().filter(|e| e.kind == kind && e.job_id.as_deref() == Some(job)).count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_batch_of_failures_and_successes_is_locked_and_read_ahead() {
    let Setup { k, gate, a, tokens } = setup(6).await;
    let before = k.store.plan_counts();
    gate.store(6, Ordering::Relaxed);
    let ops = (0..6)
        .map(|i| {
            let id = format!("j{i}");
            if i % 2 == 0 { failing(&k, &id, &tokens[i], "lost".into()) } else { succeeding(&k, &id, &tokens[i]) }
        })
        .collect();
    let answers = one_batch(&gate, ops).await;
    for (i, answer) in answers.into_iter().enumerate() {
        let outcome = answer.unwrap_or_else(|e| panic!("j{i}: {e}"));
        assert!(outcome.applied, "j{i} was not applied");
        let want = if i % 2 == 0 { JobState::Queued } else { JobState::Succeeded };
        assert_state(&outcome.value, want);
        assert_eq!(k.get(&format!("j{i}")).await, outcome.value, "j{i}: the answer is the job as stored");
    }
    let counted = k.store.plan_counts();
    assert_eq!(counted.ahead - before.ahead, 6, "all six read ahead in one batch: {counted:?}");
    assert_eq!(counted.skipped, before.skipped);
    // Three jobs of 30 charged and refunded, three of 30 charged and delivered.
    assert_eq!(k.balance(&a).await, 1_000 - 90);
    for i in (0..6).step_by(2) {
        assert_eq!(lines(&k, &a, &format!("j{i}"), EntryKind::Refund).await, 2, "j{i}'s two items refunded once");
    }
    k.assert_clean().await;
}

/// Intents beside operations that are not (a cancel and a repeated failure of an intent's job, a
/// failure refused before it locks anything, then the same job's valid failure): every answer is
/// one of the orders the batch could have run in, nothing is refunded twice, the audit is clean.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_intents_beside_other_operations_on_their_jobs() {
    let Setup { k, gate, a, tokens } = setup(4).await;
    gate.store(7, Ordering::Relaxed);
    let ops = vec![
        // j0: a cancel that arrived before its failure.
        {
            let k = k.clone();
            tokio::spawn(async move {
                k.store.cancel(&jid("j0"), None).await.map(|c| Outcome { value: c.job().clone(), applied: true })
            })
        },
        failing(&k, "j0", &tokens[0], "lost".into()),
        // j1: the same failure twice (a retried request).
        failing(&k, "j1", &tokens[1], "lost".into()),
        failing(&k, "j1", &tokens[1], "lost".into()),
        // j2: a success refused before it locks anything (its result too large), then a failure.
        {
            let (k, token) = (k.clone(), tokens[2].clone());
            let result = serde_json::Value::String("x".repeat(settle_core::limits::PAYLOAD_BYTES_MAX + 1));
            tokio::spawn(async move { k.store.succeed(&jid("j2"), Reporter::Lease(&token), Some(result)).await })
        },
        failing(&k, "j2", &tokens[2], "lost".into()),
        // j3: a success with a token no attempt held.
        succeeding(&k, "j3", &LeaseToken("not-a-token".into())),
    ];
    let answers = one_batch(&gate, ops).await;
    let j0 = k.get("j0").await;
    assert!(matches!(j0.state, JobState::Cancelled | JobState::Cancelling | JobState::Queued), "j0: {:?}", j0.state);
    // The two copies of j1's failure reach the lane in either order: one applies, the other is its replay.
    let j1: Vec<bool> = answers[2..4].iter().map(|a| a.as_ref().unwrap().applied).collect();
    assert_eq!(j1.iter().filter(|applied| **applied).count(), 1, "j1: {j1:?}");
    assert!(matches!(answers[4], Err(StoreError::Invalid(_))), "{:?}", answers[4]);
    assert!(answers[5].as_ref().unwrap().applied, "j2's valid failure applies");
    assert!(matches!(answers[6], Err(StoreError::LeaseLost(_))), "{:?}", answers[6]);
    for job in ["j0", "j1", "j2"] {
        assert!(lines(&k, &a, job, EntryKind::Refund).await <= 2, "{job} refunded at most once per item");
    }
    assert_eq!(lines(&k, &a, "j1", EntryKind::Refund).await, 2);
    assert!(k.store.plan_counts().ahead >= 2, "{:?}", k.store.plan_counts());
    k.assert_clean().await;
}

/// An intent whose job another transaction holds is not waited for inside the batch: it runs
/// alone after it, and waits there for the lock as any operation alone does.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_an_intent_whose_job_is_held_elsewhere_runs_alone() {
    use sqlx::{ConnectOptions, Connection};
    use std::str::FromStr;
    let Setup { k, gate, tokens, .. } = setup(3).await;
    let mut other = sqlx::postgres::PgConnectOptions::from_str(&k.url).unwrap().connect().await.unwrap();
    let mut held = other.begin().await.unwrap();
    sqlx::query("SELECT 1 FROM jobs WHERE id = 'j0' FOR UPDATE").execute(&mut *held).await.unwrap();
    let before = k.store.plan_counts();
    gate.store(3, Ordering::Relaxed);
    let j0 = failing(&k, "j0", &tokens[0], "lost".into());
    let (j1, j2) = (failing(&k, "j1", &tokens[1], "lost".into()), succeeding(&k, "j2", &tokens[2]));
    assert!(j1.await.unwrap().unwrap().applied);
    assert!(j2.await.unwrap().unwrap().applied);
    gate.store(0, Ordering::Relaxed);
    assert!(!j0.is_finished(), "j0 waits for the lock held elsewhere");
    let counted = k.store.plan_counts();
    assert_eq!((counted.ahead - before.ahead, counted.skipped - before.skipped), (2, 1), "{counted:?}");
    held.rollback().await.unwrap();
    assert_state(&j0.await.unwrap().unwrap().value, JobState::Queued);
    k.assert_clean().await;
}

/// A planned operation that dies after it wrote, at each crash point its path passes, rolls its
/// batch back, and the others run again careful (without phase 1): the crashed one is answered with
/// its crash and its job is as it was; its failure sent again converges to where the others are.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn postgres_a_batch_read_ahead_that_dies_rolls_back_and_converges() {
    let Setup { k, gate, a, .. } = setup(0).await;
    let points = [CrashPoint::AfterGuard, CrashPoint::AfterLedger, CrashPoint::AfterOutbox, CrashPoint::BeforeCommit];
    for (round, point) in points.into_iter().enumerate() {
        let prefix = format!("r{round}-j");
        let tokens = running_jobs(&k, &a, &prefix, 4).await;
        k.crasher.arm(point);
        gate.store(4, Ordering::Relaxed);
        let ops = (0..4).map(|i| failing(&k, &format!("{prefix}{i}"), &tokens[i], "lost".into())).collect();
        let answers = one_batch(&gate, ops).await;
        let crashed: Vec<usize> = (0..4).filter(|i| matches!(answers[*i], Err(StoreError::InjectedCrash(_)))).collect();
        assert_eq!(crashed.len(), 1, "{point:?}: {answers:?}");
        for (i, answer) in answers.iter().enumerate() {
            let id = format!("{prefix}{i}");
            if crashed.contains(&i) {
                let job = k.get(&id).await;
                assert_state(&job, JobState::Running);
                assert_eq!(states(&job), ["charged", "charged"], "{point:?}: nothing of {id}'s failure stayed");
                let again = failing(&k, &id, &tokens[i], "lost".into()).await.unwrap().unwrap();
                assert!(again.applied, "{point:?}: {id}'s failure sent again applies");
            } else {
                assert!(answer.as_ref().unwrap().applied, "{point:?}: {id}");
            }
            assert_state(&k.get(&id).await, JobState::Queued);
            assert_eq!(lines(&k, &a, &id, EntryKind::Refund).await, 2, "{point:?}: {id} refunded once");
        }
        // Every round's four jobs charged 30 each and refunded.
        assert_eq!(k.balance(&a).await, 1_000, "{point:?}");
        k.assert_clean().await;
    }
}
