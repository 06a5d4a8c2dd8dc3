//! `settle sim`: the deterministic simulator (crates/settle-dst, docs/decisions/0025) — one seed
//! replayed exactly, or a range of seeds until one fails.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

#[derive(clap::Args, Debug)]
pub struct DstArgs {
    /// One seed: the run is replayed exactly (the same trace hash every time).
    #[arg(long, conflicts_with = "seeds")]
    pub seed: Option<u64>,
    /// A range of seeds, both ends included (`1..1000`): runs each, stops at the first that fails.
    #[arg(long)]
    pub seeds: Option<String>,
    /// Steps per seed before the drain.
    #[arg(long, default_value_t = 200)]
    pub steps: u32,
}

fn range(s: &str) -> anyhow::Result<(u64, u64)> {
    let (a, b) = s.split_once("..").ok_or_else(|| anyhow::anyhow!("--seeds A..B, e.g. 1..1000"))?;
    let (a, b): (u64, u64) = (a.trim().parse()?, b.trim().parse()?);
    anyhow::ensure!(a <= b, "--seeds A..B needs A ≤ B");
    Ok((a, b))
}

/// Each seed runs on one thread with a single-threaded runtime, so no OS scheduler decides an order
/// inside a run; a range is shared out over two threads per core (each seed alone stays exactly
/// replayable), and the first failing seed in seed order is reported.
pub fn run(args: DstArgs) -> anyhow::Result<bool> {
    let (first, last) = match (&args.seed, &args.seeds) {
        (Some(s), _) => (*s, *s),
        (None, Some(r)) => range(r)?,
        (None, None) => anyhow::bail!("settle sim needs --seed N or --seeds A..B"),
    };
    let (steps, one) = (args.steps, args.seed.is_some());
    let temp = tempfile::tempdir()?;
    // `SETTLE_SIM_KEEP=DIR`: the databases are made there and kept, to read a failing run's.
    let dir =
        std::env::var_os("SETTLE_SIM_KEEP").map(std::path::PathBuf::from).unwrap_or_else(|| temp.path().to_owned());
    // Two seeds per core: a seed's thread waits on its store's threads (each SQLite connection runs
    // on one) for part of every step, and another seed's work fills it.
    let threads =
        (std::thread::available_parallelism().map_or(1, |n| n.get()) * 2).min((last - first + 1) as usize) as u64;
    let failed = Arc::new(AtomicU64::new(u64::MAX));
    let started = Instant::now();
    let handles: Vec<_> = (0..threads)
        .map(|t| {
            let (dir, failed) = (dir.clone(), failed.clone());
            std::thread::spawn(move || -> anyhow::Result<Vec<settle_dst::Report>> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                let mut reports = Vec::new();
                for seed in (first + t..=last).step_by(threads as usize) {
                    if seed > failed.load(Ordering::SeqCst) {
                        break;
                    }
                    let r = rt
                        .block_on(settle_dst::run(seed, steps, &dir))
                        .map_err(|e| anyhow::anyhow!("seed {seed}: {e}"))?;
                    if r.violation.is_some() {
                        failed.fetch_min(seed, Ordering::SeqCst);
                    }
                    reports.push(r);
                }
                Ok(reports)
            })
        })
        .collect();
    let mut reports = Vec::new();
    for h in handles {
        reports.extend(h.join().map_err(|_| anyhow::anyhow!("the simulator panicked"))??);
    }
    reports.sort_by_key(|r| r.seed);
    Ok(summarize(&reports, first, last, steps, one, started.elapsed().as_secs_f64()))
}

fn summarize(reports: &[settle_dst::Report], first: u64, last: u64, steps: u32, one: bool, secs: f64) -> bool {
    for r in reports {
        if one {
            println!(
                "seed {}: {steps} steps, {} crashes, {} jobs, trace {:016x}",
                r.seed, r.crashes, r.jobs, r.trace_hash
            );
        }
        if let Some(v) = &r.violation {
            println!("seed {} FAILED at step {}: {}", r.seed, v.step, v.what);
            println!("replay: settle sim --seed {} --steps {steps}", r.seed);
            if v.step <= steps {
                println!("shortest failing prefix: settle sim --seed {} --steps {}", r.seed, v.step);
            }
            return false;
        }
    }
    let runs = reports.len() as u64;
    let crashes: u64 = reports.iter().map(|r| u64::from(r.crashes)).sum();
    println!(
        "seeds {first}..{last}: {runs} runs of {steps} steps passed ({crashes} crashes) in {secs:.1} s — {:.0} steps/s, {:.0} seeds/min",
        (runs * u64::from(steps)) as f64 / secs,
        runs as f64 * 60.0 / secs
    );
    true
}
