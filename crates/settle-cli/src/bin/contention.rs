//! One OS process of the multi-process contention test (`tests/it/contention.rs`): claims jobs from a
//! shared PostgreSQL and plays every kind of signal on them, duplicates included — success, retryable
//! and final failures, late success after a refund, cancels, unknown outcomes, item reports,
//! abandoned leases — plus the maintenance passes (lease rescue, teardown sweep).
//!
//! Usage: `settle-contention DB_URL WORKER_NAME SEED JOBS` (jobs are `job-0` … `job-{JOBS-1}`).
//! Prints one line per claim, `claim JOB ATTEMPT TOKEN`, and `done` when no job is left moving.

use settle_core::backoff::{BackoffPolicy, Jitter, SplitMix64};
use settle_core::ids::*;
use settle_core::job::{JobState, RetryPolicy};
use settle_store::*;
use std::time::{Duration, Instant};

/// Short, so the abandoned leases of the play are rescued within the run; a process that stalls
/// longer loses its lease like any worker would, and its late signals get the answers the play
/// accepts (`ok_or_benign`).
const LEASE_SECONDS: u32 = 3;
/// Inside nextest's own limit (3 minutes, .config/nextest.toml), so a stuck run fails here, saying why.
const DEADLINE: Duration = Duration::from_secs(150);

fn h(s: &str) -> u64 {
    // FNV-1a: the same job gets the same first action in every process.
    s.bytes().fold(0xcbf2_9ce4_8422_2325, |acc, b| (acc ^ u64::from(b)).wrapping_mul(0x100_0000_01b3))
}

fn sig(token: &LeaseToken, code: &str, retry_after_ms: Option<u64>) -> FailSignal {
    FailSignal {
        lease_token: token.clone(),
        code: FailCode::parse(code).expect("valid code"),
        message: Some(format!("{code} from the contention worker")),
        retryable: None,
        retry_after_ms,
    }
}

fn ok_or_benign<T>(r: Result<T, StoreError>) -> Result<(), StoreError> {
    match r {
        Ok(_) => Ok(()),
        Err(
            StoreError::LeaseLost(_)
            | StoreError::JobFinished(_)
            | StoreError::OutcomeUnknown(_)
            | StoreError::InvalidTransition { .. },
        ) => Ok(()),
        Err(e) => Err(e),
    }
}

async fn play(store: &SqlStore, c: &ClaimedJob, rng: &mut SplitMix64) -> Result<(), StoreError> {
    let id = &c.job.id;
    let t = &c.lease_token;
    let action = if c.job.attempt == 1 { h(c.job.id.as_str()) % 100 } else { rng.below_inclusive(99) };
    let twice = rng.below_inclusive(1) == 1;
    match action {
        0..=29 => {
            ok_or_benign(store.succeed(id, settle_store::Reporter::of(Some(t)), None).await)?;
            if twice {
                ok_or_benign(store.succeed(id, settle_store::Reporter::of(Some(t)), None).await)?;
                ok_or_benign(store.succeed(id, settle_store::Reporter::of(None), None).await)?;
            }
        }
        30..=44 => {
            ok_or_benign(store.fail(id, sig(t, "TIMEOUT", None)).await)?;
            if twice {
                ok_or_benign(store.fail(id, sig(t, "TIMEOUT", None)).await)?;
            }
        }
        45..=54 => {
            ok_or_benign(store.fail(id, sig(t, "INVALID_ADDRESS", None)).await)?;
            ok_or_benign(store.fail(id, sig(t, "INVALID_ADDRESS", None)).await)?;
        }
        55..=64 => {
            // timed out and refunded … and then the result lands: reclaimed once
            ok_or_benign(store.fail(id, sig(t, "TIMEOUT", None)).await)?;
            ok_or_benign(store.succeed(id, settle_store::Reporter::of(Some(t)), None).await)?;
            if twice {
                ok_or_benign(store.succeed(id, settle_store::Reporter::of(Some(t)), None).await)?;
            }
        }
        65..=74 => {
            // A cancel may meet a job another process already finished or left unknown: both are
            // answers, not failures of this process.
            ok_or_benign(store.cancel(id, None).await)?;
            if twice {
                ok_or_benign(store.cancel(id, None).await)?;
            }
            ok_or_benign(store.item_succeed(id, &c.job.items[0].id, t).await)?;
            ok_or_benign(store.fail(id, sig(t, "CANCELLED", None)).await)?;
        }
        75..=79 if c.job.attempt == 1 => {
            ok_or_benign(store.mark_unknown(id, t, Some("no answer")).await)?;
            if twice {
                ok_or_benign(store.mark_unknown(id, t, Some("no answer")).await)?;
            }
        }
        80..=89 => {
            ok_or_benign(store.item_succeed(id, &c.job.items[0].id, t).await)?;
            if let Some(second) = c.job.items.get(1) {
                let second = &second.id;
                ok_or_benign(
                    store.item_fail(id, second, t, &FailCode::parse("BAD_FRAME").expect("valid"), None).await,
                )?;
                ok_or_benign(
                    store.item_fail(id, second, t, &FailCode::parse("BAD_FRAME").expect("valid"), None).await,
                )?;
            }
            ok_or_benign(store.succeed(id, settle_store::Reporter::of(Some(t)), None).await)?;
        }
        90..=94 if c.job.attempt == 1 => {
            // The worker hangs past its lease: the rescuer of some process takes it back.
        }
        _ => {
            ok_or_benign(store.fail(id, sig(t, "RATE_LIMITED", Some(50))).await)?;
        }
    }
    Ok(())
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let [_, url, worker, seed, jobs] = args.as_slice() else {
        return Err("usage: settle-contention DB_URL WORKER SEED JOBS".into());
    };
    let (seed, jobs): (u64, usize) = (seed.parse()?, jobs.parse()?);
    let policy = RetryPolicy {
        backoff: BackoffPolicy { backoff_ms_base: 20, backoff_ms_max: 200, jitter: Jitter::Full },
        ..RetryPolicy::default()
    };
    let store = SqlStore::open(
        url,
        StoreOptions { policy: policy.into(), jitter_seed: seed, pg_max_connections: 4, ..StoreOptions::default() },
    )
    .await?;
    let mut rng = SplitMix64::new(seed);
    let worker_name = WorkerName::parse(worker)?;
    let started = Instant::now();
    let mut round = 0u64;
    loop {
        round += 1;
        if started.elapsed() > DEADLINE {
            return Err("deadline passed with jobs still moving".into());
        }
        let claimed = store
            .claim(ClaimRequest {
                worker: worker_name.clone(),
                kinds: vec![],
                limit: 4,
                lease_seconds: Some(LEASE_SECONDS),
                labels: Default::default(),
            })
            .await?;
        for c in &claimed {
            println!("claim {} {} {}", c.job.id, c.job.attempt, c.lease_token.0);
        }
        for c in &claimed {
            play(&store, c, &mut rng).await?;
        }
        // Duplicates from outside: a re-sent create (must replay) and a stray cancel.
        if rng.below_inclusive(19) == 0 {
            let n = rng.below_inclusive(jobs as u64 - 1);
            let id = JobId::parse(&format!("job-{n}"))?;
            let job = store.job(&id).await?;
            if job.state == JobState::Queued && job.attempt == 0 {
                ok_or_benign(store.cancel(&id, None).await)?;
            }
        }
        if round.is_multiple_of(5) || claimed.is_empty() {
            store.rescue_expired_leases(50).await?;
            store.resume_teardowns(50).await?;
        }
        if claimed.is_empty() {
            let moving = [JobState::Queued, JobState::Running, JobState::Cancelling];
            let mut any = false;
            for state in moving {
                let filter = JobFilter { state: Some(state), ..JobFilter::ALL };
                if !store.jobs(&filter, Page { after: 0, limit: 1 }).await?.rows.is_empty() {
                    any = true;
                }
            }
            if !any {
                println!("done {worker} retries {}", store.tx_retries());
                return Ok(());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}
