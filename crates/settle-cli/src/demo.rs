//! `settle demo`: the seeds' stories, played end to end on a throwaway embedded store with a
//! virtual clock, each step printed, then the ledger with running balances and the audit verdict.

use crate::print;
use anyhow::{Context, ensure};
use settle_core::backoff::{BackoffPolicy, Jitter};
use settle_core::ids::*;
use settle_core::job::{JobState, RetryPolicy};
use settle_core::{Clock, Credits, FakeClock, SystemClock, Timestamp};
use settle_store::*;
use std::process::ExitCode;
use std::sync::Arc;

struct Demo {
    store: SqlStore,
    clock: Arc<FakeClock>,
    start: Timestamp,
}

impl Demo {
    fn say(&self, what: impl AsRef<str>) {
        let elapsed_s = (self.clock.now().micros() - self.start.micros()) as f64 / 1e6;
        println!("  [t+{elapsed_s:>6.1}s] {}", what.as_ref());
    }

    async fn claim(&self, worker: &str) -> anyhow::Result<ClaimedJob> {
        let req = ClaimRequest { worker: WorkerName::parse(worker)?, kinds: vec![], limit: 1, lease_seconds: Some(30) };
        let mut got = self.store.claim(req).await?;
        ensure!(got.len() == 1, "expected one job to be due");
        let c = got.remove(0);
        self.say(format!("{worker} claims {} (attempt {}, lease until +30s)", c.job.id, c.job.attempt));
        Ok(c)
    }

    async fn job(&self, id: &str, account: &AccountId, items: &[(&str, i64)]) -> anyhow::Result<Job> {
        let req = NewJob {
            id: JobId::parse(id)?,
            account_id: account.clone(),
            kind: JobKind::parse("render")?,
            items: items
                .iter()
                .map(|(i, c)| Ok(NewItem { id: ItemId::parse(i)?, cost: Credits::new(*c) }))
                .collect::<anyhow::Result<_>>()?,
            payload: "null".into(),
            max_attempts: None,
            refund_on: None,
            not_before: None,
        };
        let job = self.store.create_job(req).await?.value;
        self.say(format!("{id} submitted for {} credits ({} item(s)) — charged up front", job.cost, job.items.len()));
        Ok(job)
    }

    async fn balance(&self, account: &AccountId) -> anyhow::Result<i64> {
        Ok(self.store.account(account).await?.balance.get())
    }
}

fn fail(token: &LeaseToken, code: &str, message: &str) -> anyhow::Result<FailSignal> {
    Ok(FailSignal {
        lease_token: token.clone(),
        code: FailCode::parse(code)?,
        message: Some(message.into()),
        retryable: None,
        retry_after_ms: None,
    })
}

pub async fn run(db: Option<String>) -> anyhow::Result<ExitCode> {
    let dir = tempfile::tempdir().context("temp dir")?;
    let url = db.unwrap_or_else(|| format!("sqlite://{}", dir.path().join("demo.db").display()));
    let start = SystemClock.now();
    let clock = Arc::new(FakeClock::new(start));
    let policy = RetryPolicy {
        backoff: BackoffPolicy { backoff_ms_base: 1_000, backoff_ms_max: 600_000, jitter: Jitter::None },
        ..RetryPolicy::default()
    };
    let options = StoreOptions {
        clock: clock.clone(),
        policy: policy.into(),
        jitter_seed: 1,
        artifacts: Some(Arc::new(FsArtifactStore::new(dir.path().join("artifacts")))),
        ..StoreOptions::default()
    };
    let store = SqlStore::open(&url, options).await.with_context(|| format!("open {url}"))?;
    println!("Settle demo on {url} (virtual clock; refunds on failure, backoff 1 s doubling, 5 attempts)\n");
    let d = Demo { store, clock, start };
    let alice = AccountId::parse("alice")?;
    d.store.create_account(NewAccount { id: alice.clone(), overdraft_limit: Credits::ZERO }).await?;
    d.store
        .grant(
            &alice,
            NewGrant {
                id: RefId::parse("welcome")?,
                amount: Credits::new(500),
                reason: Some("welcome credits".into()),
            },
        )
        .await?;
    d.say("account alice created and granted 500 credits");

    println!("\n1. The render that times out at 30 s, is refunded, and recovers at 32 s");
    d.job("render-1", &alice, &[("main", 40)]).await?;
    let c = d.claim("gpu-worker-7").await?;
    d.clock.advance_seconds(30);
    let j =
        d.store.fail(&JobId::parse("render-1")?, fail(&c.lease_token, "TIMEOUT", "no result after 30 s")?).await?.value;
    d.say(format!(
        "worker times out: render-1 is {} and refunded; balance {}",
        j.state.as_str(),
        d.balance(&alice).await?
    ));
    d.clock.advance_seconds(2);
    let j = d.store.succeed(&JobId::parse("render-1")?, Some(&c.lease_token)).await?.value;
    d.say(format!(
        "the GPU's result lands at 32 s: render-1 is {}, the refund reclaimed; balance {}",
        j.state.as_str(),
        d.balance(&alice).await?
    ));
    let again = d.store.succeed(&JobId::parse("render-1")?, Some(&c.lease_token)).await?;
    d.say(format!("the same success delivered again: applied = {} (no second reclaim)", again.applied));
    ensure!(j.net.get() == -40 && !again.applied, "render-1 must net -40");

    println!("\n2. Two failure signals for one attempt race: one refund");
    d.job("transcribe-1", &alice, &[("main", 25)]).await?;
    let c = d.claim("cpu-worker-2").await?;
    let id = JobId::parse("transcribe-1")?;
    let (a, b) = tokio::join!(
        d.store.fail(&id, fail(&c.lease_token, "INVALID_INPUT", "timeout callback")?),
        d.store.fail(&id, fail(&c.lease_token, "INVALID_INPUT", "error callback")?)
    );
    let (a, b) = (a?, b?);
    d.say(format!(
        "two failure signals at once: applied = {} and {}; transcribe-1 is {}",
        a.applied,
        b.applied,
        a.value.state.as_str()
    ));
    ensure!(a.applied ^ b.applied, "exactly one failure applies");
    d.say(format!("balance {} — refunded once", d.balance(&alice).await?));

    println!("\n3. A retryable failure, retried with backoff, then succeeding");
    d.job("image-1", &alice, &[("main", 10)]).await?;
    let c = d.claim("gpu-worker-7").await?;
    let j =
        d.store.fail(&JobId::parse("image-1")?, fail(&c.lease_token, "NODE_DOWN", "GPU node went away")?).await?.value;
    let wait = (j.not_before.micros() - d.clock.now().micros()) / 1_000;
    d.say(format!("NODE_DOWN is retryable: image-1 back to {} with not_before +{wait} ms, refunded", j.state.as_str()));
    let none = d
        .store
        .claim(ClaimRequest { worker: WorkerName::parse("eager")?, kinds: vec![], limit: 1, lease_seconds: Some(30) })
        .await?;
    d.say(format!("a claim before the backoff ends finds {} job(s)", none.len()));
    d.clock.advance_millis(wait as u64);
    let c = d.claim("gpu-worker-9").await?;
    let j = d.store.succeed(&JobId::parse("image-1")?, Some(&c.lease_token)).await?.value;
    d.say(format!("attempt {} succeeds: image-1 is {}, refund reclaimed", j.attempt, j.state.as_str()));

    println!("\n4. A non-retryable failure goes to dead letters; a person requeues it");
    d.job("export-1", &alice, &[("main", 30)]).await?;
    let c = d.claim("cpu-worker-2").await?;
    let j = d
        .store
        .fail(&JobId::parse("export-1")?, fail(&c.lease_token, "INVALID_ADDRESS", "bucket does not exist")?)
        .await?
        .value;
    d.say(format!(
        "INVALID_ADDRESS is not retryable: export-1 is {}, refunded; balance {}",
        j.state.as_str(),
        d.balance(&alice).await?
    ));
    for f in d.store.failure_summary().await? {
        d.say(format!("failure summary: {} {} × {}", f.code, f.state, f.count));
    }
    d.clock.advance_seconds(600);
    let j = d.store.requeue(&JobId::parse("export-1")?).await?;
    d.say(format!("operator fixed the bucket and requeued export-1: {} with a fresh budget", j.state.as_str()));
    let c = d.claim("cpu-worker-2").await?;
    let j = d.store.succeed(&JobId::parse("export-1")?, Some(&c.lease_token)).await?.value;
    d.say(format!("export-1 {} on attempt {}; refund reclaimed", j.state.as_str(), j.attempt));
    for a in d.store.attempts(&JobId::parse("export-1")?).await? {
        d.say(format!(
            "  attempt {} by {}: {} {}",
            a.attempt_no,
            a.worker,
            a.result.as_deref().unwrap_or("open"),
            a.fail_code.as_deref().unwrap_or("")
        ));
    }

    println!("\n5. A batch cancelled while queued: every item refunded");
    d.job("batch-1", &alice, &[("frame-1", 5), ("frame-2", 5), ("frame-3", 5), ("frame-4", 5)]).await?;
    let out = d.store.cancel(&JobId::parse("batch-1")?).await?;
    let j = out.job();
    ensure!(j.state == JobState::Cancelled, "batch-1 must be cancelled");
    d.say(format!(
        "cancel answered 200: batch-1 is {}, items {:?}; balance {}",
        j.state.as_str(),
        j.items.iter().map(|i| i.state.as_str()).collect::<Vec<_>>(),
        d.balance(&alice).await?
    ));

    println!("\nThe ledger (append-only; the balance is the sum of its rows):");
    print::ledger(&d.store, &alice).await?;
    let report = d.store.audit().await?;
    println!();
    print::audit(&report);
    Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}
