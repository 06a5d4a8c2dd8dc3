//! `settle sim`: the deterministic simulator (crates/settle-dst, docs/decisions/0025) — one seed
//! replayed exactly, or a range of seeds until one fails.

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

/// Runs on a thread of its own with a single-threaded runtime: no OS scheduler decides an order.
pub fn run(args: DstArgs) -> anyhow::Result<bool> {
    let (first, last) = match (&args.seed, &args.seeds) {
        (Some(s), _) => (*s, *s),
        (None, Some(r)) => range(r)?,
        (None, None) => anyhow::bail!("settle sim needs --seed N or --seeds A..B"),
    };
    let steps = args.steps;
    let one = args.seed.is_some();
    std::thread::spawn(move || -> anyhow::Result<bool> {
        let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
        rt.block_on(seeds(first, last, steps, one))
    })
    .join()
    .map_err(|_| anyhow::anyhow!("the simulator panicked"))?
}

async fn seeds(first: u64, last: u64, steps: u32, one: bool) -> anyhow::Result<bool> {
    let temp = tempfile::tempdir()?;
    // `SETTLE_SIM_KEEP=DIR`: the databases are made there and kept, to read a failing run's.
    let kept = std::env::var_os("SETTLE_SIM_KEEP").map(std::path::PathBuf::from);
    let dir = kept.as_deref().unwrap_or(temp.path());
    let started = Instant::now();
    let (mut runs, mut crashes) = (0u64, 0u64);
    for seed in first..=last {
        let report = settle_dst::run(seed, steps, dir).await.map_err(|e| anyhow::anyhow!("seed {seed}: {e}"))?;
        runs += 1;
        crashes += u64::from(report.crashes);
        if one {
            println!(
                "seed {seed}: {steps} steps, {} crashes, {} jobs, trace {:016x}",
                report.crashes, report.jobs, report.trace_hash
            );
        }
        if let Some(v) = report.violation {
            println!("seed {seed} FAILED at step {}: {}", v.step, v.what);
            println!("replay: settle sim --seed {seed} --steps {steps}");
            if v.step <= steps {
                println!("shortest failing prefix: settle sim --seed {seed} --steps {}", v.step);
            }
            return Ok(false);
        }
    }
    let secs = started.elapsed().as_secs_f64();
    let total = runs * u64::from(steps);
    println!(
        "seeds {first}..{last}: {runs} runs of {steps} steps passed ({crashes} crashes) in {secs:.1} s — {:.0} steps/s, {:.0} seeds/min",
        total as f64 / secs,
        runs as f64 * 60.0 / secs
    );
    Ok(true)
}
