//! `settle demo`: the seeds' stories, played end to end on a throwaway embedded store with a
//! virtual clock, each step printed, then the ledger with running balances and the audit verdict.

use crate::print;
use anyhow::{Context, ensure};
use settle_core::backoff::{BackoffPolicy, Jitter};
use settle_core::ids::*;
use settle_core::job::{JobState, Policies, RefundPolicy, RetryPolicy, WITHDRAWAL_KIND};
use settle_core::{Clock, Credits, FakeClock, SystemClock, Timestamp};
use settle_store::*;
use std::process::ExitCode;
use std::sync::Arc;

struct Demo {
    store: Arc<SqlStore>,
    clock: Arc<FakeClock>,
    start: Timestamp,
}

impl Demo {
    fn say(&self, what: impl AsRef<str>) {
        let elapsed_s = (self.clock.now().micros() - self.start.micros()) as f64 / 1e6;
        println!("  [t+{elapsed_s:>6.1}s] {}", what.as_ref());
    }

    async fn claim(&self, worker: &str) -> anyhow::Result<ClaimedJob> {
        let req = ClaimRequest {
            worker: WorkerName::parse(worker)?,
            kinds: vec![],
            limit: 1,
            lease_seconds: Some(30),
            labels: Default::default(),
        };
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
                .map(|(i, c)| Ok(NewItem { id: ItemId::parse(i)?, price: Price::Cost(Credits::new(*c)) }))
                .collect::<anyhow::Result<_>>()?,
            payload: serde_json::Value::Null,
            max_attempts: None,
            refund_on: None,
            not_before: None,
            priority: None,
            requires: Default::default(),
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
    let withdrawal = RetryPolicy { refund_on: RefundPolicy::FinalFailure, ..policy.clone() };
    let artifacts = Arc::new(ObjectArtifactStore::local(dir.path().join("artifacts"))?);
    let options = StoreOptions {
        clock: clock.clone(),
        policy: Policies { default: policy, kinds: [(WITHDRAWAL_KIND.to_owned(), withdrawal)].into() },
        jitter_seed: 1,
        artifacts: Some(artifacts.clone()),
        ..StoreOptions::default()
    };
    let store = Arc::new(
        SqlStore::open(&url, options).await.with_context(|| format!("open {}", settle_store::redacted_url(&url)))?,
    );
    println!(
        "Settle demo on {} (virtual clock; refunds on failure, backoff 1 s doubling, 5 attempts)\n",
        settle_store::redacted_url(&url)
    );
    let d = Demo { store, clock, start };
    let alice = AccountId::parse("alice")?;
    d.store
        .create_account(
            NewAccount { id: alice.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await?;
    d.store
        .grant(
            &alice,
            NewGrant {
                id: RefId::parse("welcome")?,
                amount: Credits::new(500),
                reason: Some("welcome credits".into()),
                expires_at: None,
                priority: None,
            },
            settle_store::SYSTEM_ACTOR,
        )
        .await?;
    d.say("account alice created and granted 500 credits");
    d.store.set_alerts(&alice, vec![("low".to_owned(), 450)], settle_store::SYSTEM_ACTOR).await?;
    d.say("a balance alert on alice: low, below 450 (fires once per crossing)");

    late_success(&d, &alice).await?;
    racing_failures(&d, &alice).await?;
    retried_with_backoff(&d, &alice).await?;
    dead_letter_requeued(&d, &alice).await?;
    queued_batch_cancelled(&d, &alice).await?;

    running_batch(&d, &alice, artifacts).await?;

    payouts(&d).await?;

    priced_at_the_end(&d).await?;

    credits_that_expire(&d).await?;

    spend_limited(&d).await?;

    top_ups(&d).await?;

    alerts_fired(&d, &alice).await?;

    println!("\nThe ledger (append-only; the balance is the sum of its rows):");
    print::ledger(d.store.as_ref(), &alice).await?;
    let report = d.store.audit(None).await?;
    println!();
    print::audit(&report)?;
    Ok(if report.ok() { ExitCode::SUCCESS } else { ExitCode::from(1) })
}

/// Alice's balance alert, as the stories crossed it: one event per crossing, each naming the entry
/// that crossed, never one per posting while below (decision 0033).
async fn alerts_fired(d: &Demo, alice: &AccountId) -> anyhow::Result<()> {
    use settle_core::history::EventKind;
    println!("\nalice's balance alert (low, below 450), each crossing once:");
    let events = d.store.events(0, 10_000, &settle_core::scope::Scope::ALL).await?;
    let crossings = events.rows.iter().filter(|e| {
        e.account_id == alice.as_str()
            && matches!(e.kind, EventKind::AccountBalanceLow | EventKind::AccountBalanceRecovered)
    });
    for e in crossings {
        let data: serde_json::Value = serde_json::from_str(&e.data)?;
        println!(
            "  {:<26} {} → {} (ledger entry {})",
            e.kind.as_str(),
            data["balance_before"],
            data["balance_after"],
            data["ledger_seq"]
        );
    }
    Ok(())
}

/// Seed 002: the render that times out at 30 s, is refunded, and recovers at 32 s.
async fn late_success(d: &Demo, alice: &AccountId) -> anyhow::Result<()> {
    println!("\n1. The render that times out at 30 s, is refunded, and recovers at 32 s");
    d.job("render-1", alice, &[("main", 40)]).await?;
    let c = d.claim("gpu-worker-7").await?;
    d.clock.advance_seconds(30);
    let j =
        d.store.fail(&JobId::parse("render-1")?, fail(&c.lease_token, "TIMEOUT", "no result after 30 s")?).await?.value;
    d.say(format!(
        "worker times out: render-1 is {} and refunded; balance {}",
        j.state.as_str(),
        d.balance(alice).await?
    ));
    d.clock.advance_seconds(2);
    let j = d
        .store
        .succeed(&JobId::parse("render-1")?, settle_store::Reporter::of(Some(&c.lease_token)), None)
        .await?
        .value;
    d.say(format!(
        "the GPU's result lands at 32 s: render-1 is {}, the refund reclaimed; balance {}",
        j.state.as_str(),
        d.balance(alice).await?
    ));
    let again =
        d.store.succeed(&JobId::parse("render-1")?, settle_store::Reporter::of(Some(&c.lease_token)), None).await?;
    d.say(format!("the same success delivered again: applied = {} (no second reclaim)", again.applied));
    ensure!(j.net.get() == -40 && !again.applied, "render-1 must net -40");
    Ok(())
}

/// Two failure signals for one attempt race: one refund.
async fn racing_failures(d: &Demo, alice: &AccountId) -> anyhow::Result<()> {
    println!("\n2. Two failure signals for one attempt race: one refund");
    d.job("transcribe-1", alice, &[("main", 25)]).await?;
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
    d.say(format!("balance {} — refunded once", d.balance(alice).await?));
    Ok(())
}

/// A retryable failure, retried with backoff, then succeeding.
async fn retried_with_backoff(d: &Demo, alice: &AccountId) -> anyhow::Result<()> {
    println!("\n3. A retryable failure, retried with backoff, then succeeding");
    d.job("image-1", alice, &[("main", 10)]).await?;
    let c = d.claim("gpu-worker-7").await?;
    let j =
        d.store.fail(&JobId::parse("image-1")?, fail(&c.lease_token, "NODE_DOWN", "GPU node went away")?).await?.value;
    let wait = (j.not_before.micros() - d.clock.now().micros()) / 1_000;
    d.say(format!("NODE_DOWN is retryable: image-1 back to {} with not_before +{wait} ms, refunded", j.state.as_str()));
    let none = d
        .store
        .claim(ClaimRequest {
            worker: WorkerName::parse("eager")?,
            kinds: vec![],
            limit: 1,
            lease_seconds: Some(30),
            labels: Default::default(),
        })
        .await?;
    d.say(format!("a claim before the backoff ends finds {} job(s)", none.len()));
    d.clock.advance_millis(wait as u64);
    let c = d.claim("gpu-worker-9").await?;
    let j =
        d.store.succeed(&JobId::parse("image-1")?, settle_store::Reporter::of(Some(&c.lease_token)), None).await?.value;
    d.say(format!("attempt {} succeeds: image-1 is {}, refund reclaimed", j.attempt, j.state.as_str()));
    Ok(())
}

/// A non-retryable failure goes to dead letters; a person requeues it.
async fn dead_letter_requeued(d: &Demo, alice: &AccountId) -> anyhow::Result<()> {
    println!("\n4. A non-retryable failure goes to dead letters; a person requeues it");
    d.job("export-1", alice, &[("main", 30)]).await?;
    let c = d.claim("cpu-worker-2").await?;
    let j = d
        .store
        .fail(&JobId::parse("export-1")?, fail(&c.lease_token, "INVALID_ADDRESS", "bucket does not exist")?)
        .await?
        .value;
    d.say(format!(
        "INVALID_ADDRESS is not retryable: export-1 is {}, refunded; balance {}",
        j.state.as_str(),
        d.balance(alice).await?
    ));
    for f in d.store.failure_summary(&settle_core::scope::Scope::ALL).await? {
        d.say(format!("failure summary: {} {} × {}", f.code, f.state, f.count));
    }
    d.clock.advance_seconds(600);
    let j = d.store.requeue(&JobId::parse("export-1")?, settle_store::SYSTEM_ACTOR).await?;
    d.say(format!("operator fixed the bucket and requeued export-1: {} with a fresh budget", j.state.as_str()));
    let c = d.claim("cpu-worker-2").await?;
    let j = d
        .store
        .succeed(&JobId::parse("export-1")?, settle_store::Reporter::of(Some(&c.lease_token)), None)
        .await?
        .value;
    d.say(format!("export-1 {} on attempt {}; refund reclaimed", j.state.as_str(), j.attempt));
    for a in d.store.attempts(&JobId::parse("export-1")?).await? {
        d.say(format!(
            "  attempt {} by {}: {} {}",
            a.attempt_no,
            a.worker,
            a.result.map_or("open", |r| r.as_str()),
            a.fail_code.as_deref().unwrap_or("")
        ));
    }
    Ok(())
}

/// A batch cancelled while queued: every item refunded at once.
async fn queued_batch_cancelled(d: &Demo, alice: &AccountId) -> anyhow::Result<()> {
    println!("\n5. A batch cancelled while queued: every item refunded at once");
    d.job("batch-1", alice, &[("frame-1", 5), ("frame-2", 5), ("frame-3", 5), ("frame-4", 5)]).await?;
    let out = d.store.cancel(&JobId::parse("batch-1")?, None).await?;
    let j = out.job();
    ensure!(j.state == JobState::Cancelled, "batch-1 must be cancelled");
    d.say(format!(
        "cancel answered 200: batch-1 is {}, items {:?}; balance {}",
        j.state.as_str(),
        j.items.iter().map(|i| i.state.as_str()).collect::<Vec<_>>(),
        d.balance(alice).await?
    ));
    Ok(())
}

/// Seed 003: a running batch cancelled mid-way. The worker is the Rust SDK's, in this process,
/// talking to Settle over HTTP (the API served on a loopback port over the demo's store); it
/// writes each frame to the artifact store before reporting it.
async fn running_batch(d: &Demo, alice: &AccountId, artifacts: Arc<ObjectArtifactStore>) -> anyhow::Result<()> {
    use settle_client::{Client, Worker};
    use std::time::Duration;
    use tokio::sync::oneshot;
    println!("\n6. A running batch cancelled mid-way (seed 003): the worker stops at the item boundary");
    let app = settle_api::Application::build_with(
        "127.0.0.1:0",
        d.store.clone() as Arc<dyn Store>,
        settle_api::Tokens::default(),
        settle_api::HttpLimits::default(),
    )
    .await?;
    let base = format!("http://{}", app.local_addr());
    let (stop_serving, stopped) = oneshot::channel::<()>();
    let server = tokio::spawn(app.run_until(async move {
        let _ = stopped.await;
    }));
    let frames: Vec<(String, i64)> = (1..=8).map(|i| (format!("frame-{i}"), 5)).collect();
    let frames: Vec<(&str, i64)> = frames.iter().map(|(id, c)| (id.as_str(), *c)).collect();
    d.job("batch-2", alice, &frames).await?;
    let before = d.balance(alice).await?;

    let (rendering, rendering_seen) = oneshot::channel();
    let (cancel_sent, cancel_seen) = oneshot::channel();
    let handler = Arc::new(FrameRenderer {
        artifacts: artifacts.clone(),
        slow: "frame-4",
        rendering: std::sync::Mutex::new(Some(rendering)),
        cancel_sent: tokio::sync::Mutex::new(Some(cancel_seen)),
        written: std::sync::Mutex::new(Vec::new()),
    });
    let mut worker = Worker::new(Client::new(&base, None), "gpu-worker-3");
    (worker.concurrency, worker.wait_seconds, worker.lease_seconds) = (1, 1, Some(30));
    worker.heartbeat_every = Duration::from_millis(50);
    let stop = tokio_util::sync::CancellationToken::new();
    let running = tokio::spawn(worker.run(handler.clone(), stop.clone()));
    d.say(format!("gpu-worker-3 (the Rust SDK, over HTTP at {base}) claims batch-2 and renders frame by frame"));

    // Bounded: a worker that never reaches frame-4 (a failed write, a refused claim) ends the demo
    // with an error instead of a wait.
    tokio::time::timeout(Duration::from_secs(30), rendering_seen)
        .await
        .context("the worker did not reach frame-4 within 30 s")?
        .context("the worker stopped before frame-4")?;
    d.say("frames 1-3 written to the artifact store and reported delivered; frame-4 is rendering");
    let id = JobId::parse("batch-2")?;
    let out = d.store.cancel(&id, None).await?;
    ensure!(
        matches!(out, CancelOutcome::Accepted(ref j) if j.state == JobState::Running),
        "a running job's cancel is accepted"
    );
    d.say(format!(
        "the customer cancels batch-2: 202 accepted — still running, cancel requested, nothing refunded yet (balance {})",
        d.balance(alice).await?
    ));
    let _ = cancel_sent.send(());
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let job = loop {
        let job = d.store.job(&id).await?;
        if job.state.is_terminal() {
            break job;
        }
        ensure!(std::time::Instant::now() < deadline, "batch-2 did not end: {}", job.state.as_str());
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    stop.cancel();
    running.await??;
    let _ = stop_serving.send(());
    server.await??;
    d.say("the heartbeat brought the cancel; at the item boundary the worker did not deliver frame-4 and reported CANCELLED");
    d.say(format!(
        "teardown: refunds with their markers in one transaction, undelivered frames' artifacts deleted, then {} — last",
        job.state.as_str()
    ));

    let delivered: Vec<_> = job.items.iter().filter(|i| i.state == settle_core::item::ItemState::Succeeded).collect();
    let refunded: Vec<_> = job.items.iter().filter(|i| i.refund_reason.is_some()).collect();
    let written = handler.written.lock().expect("not poisoned").clone();
    let (mut kept, mut deleted) = (0, 0);
    for path in &written {
        if artifacts.exists(path).await.map_err(|e| anyhow::anyhow!(e))? { kept += 1 } else { deleted += 1 }
    }
    let charged: i64 = delivered.iter().map(|i| i.cost.get()).sum();
    let back: i64 = refunded.iter().map(|i| i.cost.get()).sum();
    println!("\n   batch-2's final totals:");
    println!(
        "     items delivered and kept charged  {} ({charged} credits), their artifacts kept: {kept}",
        delivered.len()
    );
    println!("     items refunded                    {} ({back} credits)", refunded.len());
    println!("     artifacts deleted                 {deleted} (frame-4's output, rendered but never delivered)");
    println!("     alice's balance                   {before} -> {}", d.balance(alice).await?);
    ensure!(
        job.state == JobState::Cancelled && delivered.len() == 3 && refunded.len() == 5 && kept == 3 && deleted == 1,
        "seed 003's totals: 3 delivered and kept, 5 refunded, frame-4's artifact deleted"
    );
    ensure!(job.net.get() == -charged, "batch-2 nets the delivered frames only");
    Ok(())
}

/// The demo's render worker: for each frame, register its artifact (before writing it, so a
/// teardown knows it), write it, then report the frame at the item boundary — unless a cancel
/// came first. `slow` is the frame during which the customer cancels.
struct FrameRenderer {
    artifacts: Arc<ObjectArtifactStore>,
    slow: &'static str,
    rendering: std::sync::Mutex<Option<tokio::sync::oneshot::Sender<()>>>,
    cancel_sent: tokio::sync::Mutex<Option<tokio::sync::oneshot::Receiver<()>>>,
    written: std::sync::Mutex<Vec<String>>,
}

#[async_trait::async_trait]
impl settle_client::Handler for FrameRenderer {
    async fn run(&self, ctx: &settle_client::JobContext) -> settle_client::Outcome {
        use settle_client::{Failure, Flow, Outcome};
        let failed = |e: String| {
            Outcome::Failed(Failure {
                code: "UNAVAILABLE".into(),
                message: e,
                retryable: Some(true),
                retry_after_ms: None,
            })
        };
        for item in ctx.job.items.iter().filter(|i| i.to_do()) {
            if ctx.cancel_requested() {
                return Outcome::Cancelled;
            }
            let path = match ctx.register_artifact(&item.id, "frame.png").await {
                Ok(path) => path,
                Err(e) => return failed(e.to_string()),
            };
            if let Err(e) = self.artifacts.put(&path, format!("pixels of {}", item.id).into_bytes()).await {
                return failed(e);
            }
            self.written.lock().expect("not poisoned").push(path);
            if item.id == self.slow {
                // This frame renders long: the customer cancels meanwhile, and a heartbeat
                // brings the cancel before the frame is done.
                if let Some(tx) = self.rendering.lock().expect("not poisoned").take() {
                    let _ = tx.send(());
                }
                if let Some(rx) = self.cancel_sent.lock().await.take() {
                    let _ = rx.await;
                }
                let deadline = tokio::time::Instant::now() + std::time::Duration::from_secs(10);
                while !ctx.cancel_requested() && tokio::time::Instant::now() < deadline {
                    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
                }
            }
            // The item boundary: deliver the frame, unless a cancel came first.
            if ctx.cancel_requested() {
                return Outcome::Cancelled;
            }
            match ctx.item_done(&item.id).await {
                Ok(Flow::Continue) => {}
                Ok(Flow::Stop) => return Outcome::Cancelled,
                Err(e) => return failed(e.to_string()),
            }
        }
        Outcome::Succeeded(None)
    }
}

/// Seed 001: payouts through a provider (the simulator, in process) that loses an answer, refuses an
/// address, goes down and sends a paid payout back.
async fn payouts(d: &Demo) -> anyhow::Result<()> {
    println!(
        "\n7. Payouts (seed 001): one idempotency key per request, a lookup before every send, UNKNOWN for a lost answer"
    );
    let (sim, processor, bob) = payouts_setup(d).await?;
    payouts_stories(d, &sim, &processor, &bob).await?;
    payouts_report(d, &sim.sim, &bob).await?;
    sim.task.abort();
    Ok(())
}

/// The provider simulator, a payout processor against it, and bob with 1000 credits.
async fn payouts_setup(
    d: &Demo,
) -> anyhow::Result<(settle_sim::Running, settle_worker::payouts::PayoutProcessor, AccountId)> {
    use settle_sim::SimConfig;
    use settle_worker::payouts::{HttpProvider, HttpProviderConfig, PayoutProcessor, PayoutSettings};
    let sim = settle_sim::start("127.0.0.1:0", SimConfig::default()).await.context("start the provider simulator")?;
    let provider = HttpProvider::new(&HttpProviderConfig {
        url: sim.url(),
        timeout: std::time::Duration::from_secs(5),
        connect_timeout: std::time::Duration::from_secs(1),
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    let settings =
        PayoutSettings { batch: 4, return_window: std::time::Duration::from_secs(86_400), ..PayoutSettings::default() };
    let processor = PayoutProcessor::new(
        d.store.clone() as Arc<dyn Store>,
        Arc::new(provider),
        WorkerName::parse("payouts")?,
        settings,
    );
    let bob = AccountId::parse("bob")?;
    d.store
        .create_account(
            NewAccount { id: bob.clone(), overdraft_limit: Credits::ZERO, max_running: None },
            settle_store::SYSTEM_ACTOR,
        )
        .await?;
    let grant = NewGrant {
        id: RefId::parse("bob-salary")?,
        amount: Credits::new(1_000),
        reason: None,
        expires_at: None,
        priority: None,
    };
    d.store.grant(&bob, grant, settle_store::SYSTEM_ACTOR).await?;
    d.say(format!("account bob granted 1000 credits; the provider simulator listens on {}", sim.url()));
    Ok((sim, processor, bob))
}

/// The payouts' stories: (a) a lost answer, (b) a refused address, (c) a node down, (d) a return.
async fn payouts_stories(
    d: &Demo,
    sim: &settle_sim::Running,
    processor: &settle_worker::payouts::PayoutProcessor,
    bob: &AccountId,
) -> anyhow::Result<()> {
    use settle_sim::Forced;
    use settle_worker::payouts::AttemptEnd;
    let withdraw = |id: &'static str, amount: i64, to: &'static str| {
        let bob = bob.clone();
        async move {
            let req = NewWithdrawal {
                id: JobId::parse(id)?,
                account_id: bob,
                amount: Credits::new(amount),
                destination: Destination::parse(to)?,
            };
            let w = d.store.payouts().create_withdrawal(req).await?.value;
            d.say(format!("{id}: {amount} to {to}, held at once (key {})", w.idempotency_key));
            anyhow::Ok(w)
        }
    };
    let show = |id: &'static str| async move {
        let w = d.store.payouts().withdrawal(&JobId::parse(id)?).await?;
        let balance = d.balance(&w.job.account_id).await?;
        d.say(format!(
            "{id} is {}; provider txid {}; bob's balance {balance}",
            w.job.state.as_str(),
            w.provider_txid.as_deref().unwrap_or("-")
        ));
        anyhow::Ok(w)
    };

    // (a) the answer is lost after the provider executed the payout
    withdraw("payout-lost", 100, "acct-bob-1").await?;
    sim.sim.force(Some(Forced::LoseAnswers));
    let ends = processor.process_pass().await?;
    sim.sim.force(None);
    ensure!(
        ends == vec![("payout-lost".to_owned(), AttemptEnd::Unknown)],
        "the lost answer must leave it unknown: {ends:?}"
    );
    d.say("the provider executed the send but the connection was cut: UNKNOWN, not failed — never retried, still held");
    show("payout-lost").await?;
    d.clock.advance_seconds(10);
    let moved = processor.reconcile_pass().await?;
    ensure!(moved == vec!["payout-lost".to_owned()], "the reconciler must find it");
    d.say("the reconciler asks the provider by key: found — it went out once");
    let w = show("payout-lost").await?;
    ensure!(w.job.state == JobState::Succeeded && w.provider_txid.is_some(), "payout-lost must succeed with its txid");

    // (b) a refused address: definitive, the hold comes back
    withdraw("payout-bad", 50, "invalid-acct-9").await?;
    processor.process_pass().await?;
    d.say("the provider answers INVALID_ADDRESS: not retryable, dead, the hold refunded");
    let w = show("payout-bad").await?;
    ensure!(w.job.state == JobState::Dead && w.job.net.get() == 0, "payout-bad must be dead and refunded");

    // (c) the payout node is down, then back
    withdraw("payout-retry", 70, "acct-bob-2").await?;
    sim.sim.force(Some(Forced::NodeDown));
    processor.process_pass().await?;
    sim.sim.force(None);
    let j = d.store.job(&JobId::parse("payout-retry")?).await?;
    let wait_ms = (j.not_before.micros() - d.clock.now().micros()).max(0) as u64 / 1_000;
    d.say(format!(
        "NODE_DOWN is retryable: payout-retry is {} with not_before +{wait_ms} ms, still held",
        j.state.as_str()
    ));
    d.clock.advance_millis(wait_ms);
    processor.process_pass().await?;
    let w = show("payout-retry").await?;
    ensure!(w.job.state == JobState::Succeeded && w.job.attempt == 2, "payout-retry must succeed on attempt 2");

    // (d) paid, then sent back by the receiving side
    let w = withdraw("payout-back", 30, "acct-bob-3").await?;
    processor.process_pass().await?;
    show("payout-back").await?;
    ensure!(sim.sim.return_transfer(&w.idempotency_key), "the simulator must have paid payout-back");
    d.clock.advance_seconds(3_600);
    let moved = processor.recheck_pass().await?;
    ensure!(moved == vec!["payout-back".to_owned()], "the re-check must see the return: {moved:?}");
    d.say("an hour later the bank has sent it back: the re-check sees it returned, one payout_return credit");
    let w = show("payout-back").await?;
    ensure!(w.job.state == JobState::Returned && w.job.net.get() == 0, "payout-back must be returned");

    Ok(())
}

/// What the payouts left: what the provider paid, the failures by code, the attempt log, the ledger.
async fn payouts_report(d: &Demo, sim: &settle_sim::Sim, bob: &AccountId) -> anyhow::Result<()> {
    let executed = sim.executed();
    ensure!(executed.total_paid == 200 && executed.transfers.iter().all(|t| t.sends == 1), "each payout sent once");
    d.say(format!(
        "the provider paid out {} in {} transfers, each key sent once",
        executed.total_paid,
        executed.transfers.len()
    ));
    println!("\n   Failures by code (the seed's GROUP BY fail_code):");
    for f in d.store.failure_summary(&settle_core::scope::Scope::ALL).await? {
        println!("     {:<28} {:<9} {}", f.code, f.state, f.count);
    }
    println!("\n   The attempt log: when and why it failed, when it went through:");
    for id in ["payout-lost", "payout-bad", "payout-retry", "payout-back"] {
        for a in d.store.attempts(&JobId::parse(id)?).await? {
            println!(
                "     {id:<13} attempt {} {:<10} {:<16} {}",
                a.attempt_no,
                a.result.map_or("open", |r| r.as_str()),
                a.fail_code.as_deref().unwrap_or(""),
                a.message.as_deref().unwrap_or("")
            );
        }
    }
    println!("\n   Bob's ledger:");
    print::ledger(d.store.as_ref(), bob).await?;
    Ok(())
}

/// Issue 23: work priced by what it used. A hold is charged at create; the worker's success says
/// the price and the rest is released; a timed-out job is refunded its hold and its late success
/// reclaims only the price.
async fn priced_at_the_end(d: &Demo) -> anyhow::Result<()> {
    println!("\n8. Priced at the end (issue 23): renders billed by the GPU-second, 1 credit a second");
    let carol = AccountId::parse("carol")?;
    let s = &d.store;
    s.create_account(
        NewAccount { id: carol.clone(), overdraft_limit: Credits::ZERO, max_running: None },
        settle_store::SYSTEM_ACTOR,
    )
    .await?;
    let grant = NewGrant {
        id: RefId::parse("carol-credits")?,
        amount: Credits::new(300),
        reason: None,
        expires_at: None,
        priority: None,
    };
    s.grant(&carol, grant, settle_store::SYSTEM_ACTOR).await?;
    d.say("account carol created and granted 300 credits");
    let held = |id: &str| -> anyhow::Result<NewJob> {
        Ok(NewJob {
            id: JobId::parse(id)?,
            account_id: carol.clone(),
            kind: JobKind::parse("render")?,
            items: vec![NewItem { id: ItemId::main(), price: Price::Hold(Credits::new(100)) }],
            payload: serde_json::Value::Null,
            max_attempts: None,
            refund_on: None,
            not_before: None,
            priority: None,
            requires: Default::default(),
        })
    };
    let main_at = |cost: i64| Costs::main(Credits::new(cost));
    s.create_job(held("render-held")?).await?;
    d.say(format!("render-held submitted with a hold of 100 credits; balance {}", d.balance(&carol).await?));
    let c = d.claim("gpu-worker-7").await?;
    d.clock.advance_seconds(37);
    let by = settle_store::Reporter::of(Some(&c.lease_token));
    let j = s.succeed_priced(&JobId::parse("render-held")?, by, None, &main_at(37)).await?.value;
    d.say(format!("done after 37 s: captured 37, released 63; balance {}", d.balance(&carol).await?));
    ensure!(j.net.get() == -37, "render-held must net -37");

    s.create_job(held("render-late")?).await?;
    let c = d.claim("gpu-worker-8").await?;
    d.clock.advance_seconds(30);
    let id = JobId::parse("render-late")?;
    s.fail(&id, fail(&c.lease_token, "TIMEOUT", "no result after 30 s")?).await?;
    d.say(format!("render-late times out at 30 s: its hold is refunded; balance {}", d.balance(&carol).await?));
    d.clock.advance_seconds(11);
    let by = settle_store::Reporter::of(Some(&c.lease_token));
    let j = s.succeed_priced(&id, by, None, &main_at(41)).await?.value;
    d.say(format!("its result lands at 41 s: recovered at 41, not 100; balance {}", d.balance(&carol).await?));
    let again = s.succeed_priced(&id, by, None, &main_at(55)).await?;
    d.say(format!(
        "the same success again, saying 55: applied = {}, the price stays {}",
        again.applied,
        again.value.items[0].cost.get()
    ));
    ensure!(j.net.get() == -41 && !again.applied, "render-late must net -41");
    println!("\n   Carol's ledger:");
    print::ledger(s.as_ref(), &carol).await
}

/// Issue 24: a trial that expires with part of it unused, spent before the bought credits, and a
/// refund that lands on it after it expired — expiring at once instead of reviving it.
async fn credits_that_expire(d: &Demo) -> anyhow::Result<()> {
    println!("\n9. Credits that expire (issue 24): a 100-credit trial for one hour, spent first");
    let dave = AccountId::parse("dave")?;
    let s = &d.store;
    s.create_account(
        NewAccount { id: dave.clone(), overdraft_limit: Credits::ZERO, max_running: None },
        settle_store::SYSTEM_ACTOR,
    )
    .await?;
    let hour = Timestamp::from_micros(d.clock.now().micros() + 3_600_000_000);
    let trial = NewGrant {
        id: RefId::parse("dave-trial")?,
        amount: Credits::new(100),
        reason: Some("trial".into()),
        expires_at: Some(hour),
        priority: Some(10),
    };
    s.grant(&dave, trial, settle_store::SYSTEM_ACTOR).await?;
    let bought = NewGrant {
        id: RefId::parse("dave-pack")?,
        amount: Credits::new(200),
        reason: None,
        expires_at: None,
        priority: None,
    };
    s.grant(&dave, bought, settle_store::SYSTEM_ACTOR).await?;
    d.say(format!(
        "account dave: a trial of 100 (priority 10, expires in an hour) and a pack of 200 bought; balance {}",
        d.balance(&dave).await?
    ));
    d.job("clip-1", &dave, &[("main", 30)]).await?;
    let c = d.claim("gpu-worker-9").await?;
    d.say("clip-1's 30 credits came from the trial: priority 10 is spent before the pack's default of 50");
    d.clock.advance_seconds(3_600);
    let expired = s.expire_grants(100).await?;
    d.say(format!(
        "an hour on, the expiry pass closes the trial on {}: its unused 70 expire; balance {}",
        expired.join(", "),
        d.balance(&dave).await?
    ));
    let id = JobId::parse("clip-1")?;
    s.fail(&id, fail(&c.lease_token, "BAD_INPUT", "the source clip is corrupt")?).await?;
    d.say(format!(
        "clip-1 fails for good: its 30 go back to the trial they came from — expired, so they expire at once; balance {}",
        d.balance(&dave).await?
    ));
    ensure!(d.balance(&dave).await? == 200, "dave keeps exactly the pack he bought");
    for g in s.grants(&dave, Page { after: 0, limit: 10 }).await?.rows {
        d.say(format!("grant {}: {} of {} left, {}", g.id, g.remaining.get(), g.amount.get(), g.state.as_str()));
    }
    println!("\n   Dave's ledger:");
    print::ledger(s.as_ref(), &dave).await
}

/// Issue 45: a daily spend limit on renders, checked before the charge is written: a render past it
/// is refused whole, a failure's refund gives its room back, and the next render fits.
async fn spend_limited(d: &Demo) -> anyhow::Result<()> {
    println!("\n10. A spend limit (issue 45): erin may spend 100 credits a day on renders");
    let erin = AccountId::parse("erin")?;
    let s = &d.store;
    s.create_account(
        NewAccount { id: erin.clone(), overdraft_limit: Credits::ZERO, max_running: None },
        settle_store::SYSTEM_ACTOR,
    )
    .await?;
    let pack = NewGrant {
        id: RefId::parse("erin-pack")?,
        amount: Credits::new(1_000),
        reason: None,
        expires_at: None,
        priority: None,
    };
    s.grant(&erin, pack, settle_store::SYSTEM_ACTOR).await?;
    let limit = NewLimit { period: settle_core::spend::Period::Day, amount: 100, kinds: vec!["render".into()] };
    s.set_limits(&erin, vec![limit], settle_store::SYSTEM_ACTOR).await?;
    d.say(format!("account erin: 1000 credits, a day limit of 100 on renders; balance {}", d.balance(&erin).await?));
    d.job("erin-1", &erin, &[("main", 60)]).await?;
    match d.job("erin-2", &erin, &[("main", 50)]).await {
        Err(e) => match e.downcast_ref::<StoreError>() {
            Some(StoreError::SpendLimitExceeded { exceeded }) => d.say(format!(
                "erin-2 (50 credits) refused before anything is written: spend_limit_exceeded, {} spent today, {} left",
                exceeded.spent, exceeded.remaining
            )),
            _ => return Err(e),
        },
        Ok(_) => anyhow::bail!("a render past erin's limit was accepted"),
    }
    let c = d.claim("gpu-worker-10").await?;
    s.fail(&JobId::parse("erin-1")?, fail(&c.lease_token, "BAD_INPUT", "the prompt was empty")?).await?;
    d.say("erin-1 fails for good: its refund gives the 60 back to today's spend");
    d.job("erin-2", &erin, &[("main", 50)]).await?;
    let limits = s.limits(&erin).await?;
    ensure!(limits[0].spent == 50, "erin's day spent exactly what the ledger says");
    d.say(format!(
        "erin-2 fits now: today's spend {} of {}, the limit resets at {}",
        limits[0].spent,
        limits[0].amount,
        limits[0].resets_at.rfc3339()
    ));
    Ok(())
}

/// Issue 45, top-ups: credits bought through a funding provider, granted only by a confirmed charge,
/// exactly once — a lost answer never charges twice, a declined card never loops.
async fn top_ups(d: &Demo) -> anyhow::Result<()> {
    use settle_sim::{FUNDING_V1, Forced, SimConfig};
    use settle_worker::funding::{FundingProcessor, HttpFunding, HttpProviderConfig};
    use settle_worker::payouts::AttemptEnd;
    println!("\n11. Top-ups (issue 45): frank buys credits; only a confirmed charge grants them, once");
    let config = SimConfig { invalid_prefix: "declined".into(), ..SimConfig::default() };
    let sim = settle_sim::start_speaking("127.0.0.1:0", config, &FUNDING_V1).await?;
    let funding = HttpFunding::new(&HttpProviderConfig {
        url: sim.url(),
        timeout: std::time::Duration::from_secs(5),
        connect_timeout: std::time::Duration::from_secs(1),
    })
    .map_err(|e| anyhow::anyhow!(e))?;
    let store = d.store.clone() as Arc<dyn Store>;
    let processor = FundingProcessor::new(store, Arc::new(funding), WorkerName::parse("funding")?, Default::default());
    let frank = AccountId::parse("frank")?;
    let s = &d.store;
    s.create_account(
        NewAccount { id: frank.clone(), overdraft_limit: Credits::ZERO, max_running: None },
        settle_store::SYSTEM_ACTOR,
    )
    .await?;
    let buy = |id: &'static str, customer: &'static str| {
        let frank = frank.clone();
        async move {
            let req = NewTopUp {
                id: JobId::parse(id)?,
                account_id: frank,
                credits: Credits::new(500),
                price: 499,
                currency: settle_core::currency::Currency::parse("EUR").context("a currency")?,
                customer: settle_core::ids::Customer::parse(customer)?,
            };
            let t = s.funding().create_top_up(req).await?.value;
            d.say(format!(
                "{id}: 500 credits for EUR 4.99 from {customer} (key {}), nothing charged to frank",
                t.idempotency_key
            ));
            anyhow::Ok(t)
        }
    };
    buy("topup-1", "cus_frank").await?;
    sim.sim.force(Some(Forced::LoseAnswers));
    let ends = processor.process_pass().await?;
    sim.sim.force(None);
    ensure!(ends == vec![("topup-1".to_owned(), AttemptEnd::Unknown)], "a lost answer leaves it unknown: {ends:?}");
    d.say(format!(
        "the card was charged but the answer was lost: UNKNOWN, no credit yet; frank has {}",
        d.balance(&frank).await?
    ));
    let moved = processor.reconcile_pass().await?;
    ensure!(moved == vec!["topup-1".to_owned()], "the reconciler must find the charge");
    let t = s.funding().top_up(&JobId::parse("topup-1")?).await?;
    ensure!(t.job.state == JobState::Succeeded && t.grant_id.is_some(), "topup-1 must be granted");
    d.say(format!(
        "the reconciler asks by key: charged once ({}); the grant topup-1 is written with it; frank has {}",
        t.provider_charge_id.as_deref().unwrap_or("-"),
        d.balance(&frank).await?
    ));
    buy("topup-2", "declined-frank").await?;
    processor.process_pass().await?;
    let t = s.funding().top_up(&JobId::parse("topup-2")?).await?;
    ensure!(t.job.state == JobState::Dead && t.grant_id.is_none(), "a declined card ends the top-up");
    d.say(format!(
        "topup-2: CARD_DECLINED — dead at once, never charged again, nothing granted; frank has {}",
        d.balance(&frank).await?
    ));
    let executed = sim.sim.executed();
    ensure!(executed.transfers.len() == 1 && executed.transfers[0].sends == 1, "one charge, sent once");
    auto_top_up(d, &processor, &frank).await?;
    sim.task.abort();
    Ok(())
}

/// Frank's auto top-up rule: a render that takes his balance under 300 buys 500, once; when his
/// new card declines, the rule pauses instead of charging in a loop.
async fn auto_top_up(
    d: &Demo,
    processor: &settle_worker::funding::FundingProcessor,
    frank: &AccountId,
) -> anyhow::Result<()> {
    let s = &d.store;
    let rule = |customer: &str| -> anyhow::Result<NewAutoTopUp> {
        Ok(NewAutoTopUp {
            below: 300,
            credits: Credits::new(500),
            price: 499,
            currency: settle_core::currency::Currency::parse("EUR").context("a currency")?,
            customer: settle_core::ids::Customer::parse(customer)?,
            monthly_credits_max: 2_000,
        })
    };
    s.funding().put_auto_top_up(frank, rule("cus_frank")?, settle_store::SYSTEM_ACTOR).await?;
    d.say("frank's auto top-up rule: under 300, buy 500 for EUR 4.99 (at most 2000 a month)");
    d.job("frank-1", frank, &[("main", 300)]).await?;
    processor.process_pass().await?;
    let r = s.funding().auto_top_up(frank).await?;
    ensure!(d.balance(frank).await? == 700 && r.credits_this_month == 500, "the rule must have bought 500 once");
    d.say(format!(
        "frank-1 took 500 → 200, under 300: the rule's top-up was made in that transaction and charged; frank has {}",
        d.balance(frank).await?
    ));
    s.funding().put_auto_top_up(frank, rule("declined-frank")?, settle_store::SYSTEM_ACTOR).await?;
    d.job("frank-2", frank, &[("main", 500)]).await?;
    processor.process_pass().await?;
    let r = s.funding().auto_top_up(frank).await?;
    ensure!(r.state == settle_store::RuleState::Paused, "a declined rule top-up pauses its rule");
    d.say(format!(
        "with a card that declines, frank-2's crossing buys once, the charge is declined and the rule pauses — never tried again until frank puts it again; frank has {}",
        d.balance(frank).await?
    ));
    Ok(())
}
