//! `settle sim`: the deterministic simulator (crates/settle-dst, docs/decisions/0025) — one seed
//! replayed exactly, or a range of seeds until one fails.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

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
    let watch = Arc::new(Watch::new(threads as usize, last - first + 1));
    let started = Instant::now();
    let handles: Vec<std::thread::JoinHandle<_>> = (0..threads)
        .map(|t| {
            let (dir, failed, watch) = (dir.clone(), failed.clone(), watch.clone());
            let named = std::thread::Builder::new().name(format!("sim-seeds-{t}"));
            named.spawn(move || -> anyhow::Result<Vec<settle_dst::Report>> {
                let rt = tokio::runtime::Builder::new_current_thread().enable_all().build()?;
                let mut reports = Vec::new();
                for seed in (first + t..=last).step_by(threads as usize) {
                    if seed > failed.load(Ordering::SeqCst) {
                        break;
                    }
                    watch.running[t as usize].store(seed, Ordering::SeqCst);
                    let last = watch.last[t as usize].clone();
                    let r = rt.block_on(settle_dst::run_watched(seed, steps, &dir, last)).map_err(|e| {
                        failed.fetch_min(seed, Ordering::SeqCst);
                        anyhow::anyhow!("seed {seed}: {e}")
                    })?;
                    watch.running[t as usize].store(0, Ordering::SeqCst);
                    watch.done.fetch_add(1, Ordering::SeqCst);
                    if r.violation.is_some() {
                        failed.fetch_min(seed, Ordering::SeqCst);
                    }
                    reports.push(r);
                }
                Ok(reports)
            })
        })
        .collect::<Result<_, _>>()?;
    let watchdog = (!one).then(|| {
        let watch = watch.clone();
        std::thread::spawn(move || watch.run())
    });
    let mut reports = Vec::new();
    let mut joined = Ok(());
    for h in handles {
        match h.join().map_err(|_| anyhow::anyhow!("the simulator panicked")) {
            Ok(Ok(r)) => reports.extend(r),
            Ok(Err(e)) | Err(e) => joined = joined.and(Err(e)),
        }
    }
    watch.finished.store(true, Ordering::SeqCst);
    if let Some(w) = watchdog {
        // Woken at once, not at its next look: a short range would otherwise wait up to a tick.
        w.thread().unpark();
        let _ = w.join();
    }
    joined?;
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

/// Watches a range's progress from a thread of its own. Every `TICK` it looks how many seeds have
/// finished; each minute it says so on stderr; after `STALL_TICKS` looks in a row with no seed
/// finished (a seed takes a second or two) it prints which seeds are running and what every thread
/// of the process is waiting in, and ends the process: a hung seed fails the run with its number
/// instead of running into CI's time limit. Counted in looks, not in elapsed time, so a machine
/// paused and resumed does not count as a stall.
struct Watch {
    running: Vec<AtomicU64>,
    /// Each thread's seed's newest trace line (`settle_dst::run_watched`).
    last: Vec<Arc<Mutex<String>>>,
    done: AtomicU64,
    total: u64,
    finished: AtomicBool,
}

const TICK: Duration = Duration::from_secs(5);
const REPORT_TICKS: u32 = 12;
const STALL_TICKS: u32 = 24;

impl Watch {
    fn new(threads: usize, total: u64) -> Watch {
        Watch {
            running: (0..threads).map(|_| AtomicU64::new(0)).collect(),
            last: (0..threads).map(|_| Arc::default()).collect(),
            done: AtomicU64::new(0),
            total,
            finished: AtomicBool::new(false),
        }
    }

    fn running(&self) -> Vec<u64> {
        self.running.iter().map(|s| s.load(Ordering::SeqCst)).filter(|&s| s != 0).collect()
    }

    fn run(&self) {
        let (mut ticks, mut still, mut last_done) = (0u32, 0u32, 0u64);
        loop {
            std::thread::park_timeout(TICK);
            if self.finished.load(Ordering::SeqCst) {
                return;
            }
            ticks += 1;
            let done = self.done.load(Ordering::SeqCst);
            still = if done == last_done { still + 1 } else { 0 };
            last_done = done;
            if ticks % REPORT_TICKS == 0 {
                eprintln!("settle sim: {done} of {} seeds done; running {:?}", self.total, self.running());
            }
            if still == STALL_TICKS {
                let report = self.stall_report();
                // Kept in the temp dir too (a log may show only its tail; `.ci/run` leaves the
                // simulator's temp dir behind when it fails).
                let kept = std::env::temp_dir().join(format!("settle-sim-stall-{}.txt", std::process::id()));
                let kept = match std::fs::write(&kept, &report) {
                    Ok(()) => format!("this report is kept in {}\n", kept.display()),
                    Err(_) => String::new(),
                };
                eprint!("{report}{kept}");
                std::process::exit(3);
            }
        }
    }

    /// The native stacks first (long), the summary last, where a log's tail shows it.
    fn stall_report(&self) -> String {
        let mut out = native_stacks();
        out.push_str("settle sim: the process's threads:\n");
        out.push_str(&threads_now());
        out.push_str(&format!("settle sim: no seed finished in {} s; stuck:\n", (TICK * STALL_TICKS).as_secs()));
        for (seed, last) in self.running.iter().zip(&self.last) {
            let seed = seed.load(Ordering::SeqCst);
            if seed != 0 {
                let last = last.lock().unwrap_or_else(|p| p.into_inner());
                out.push_str(&format!("  seed {seed}, its last answer: {last}\n"));
            }
        }
        out.push_str("replay one alone: settle sim --seed N\n");
        out
    }
}

/// Every thread's native stack, from gdb when it is installed (it attaches to this process for a
/// moment); nothing otherwise. Written to a file, not a pipe: while gdb holds the process stopped,
/// no thread of it could drain a pipe, and gdb would block on a full one.
fn native_stacks() -> String {
    let Ok(file) = tempfile::NamedTempFile::new() else { return String::new() };
    let Ok(out) = file.reopen() else { return String::new() };
    let pid = std::process::id().to_string();
    let ran = std::process::Command::new("gdb")
        .args(["-p", &pid, "-batch", "-nx", "-ex", "thread apply all bt 30"])
        .stdin(std::process::Stdio::null())
        .stdout(out)
        .stderr(std::process::Stdio::null())
        .status();
    match ran {
        Ok(_) => std::fs::read_to_string(file.path()).unwrap_or_default(),
        Err(_) => String::new(),
    }
}

/// Every thread of this process: its name, its scheduler state and the kernel function it sleeps
/// in (Linux's /proc; elsewhere, nothing).
fn threads_now() -> String {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else { return String::new() };
    let mut out = String::new();
    for task in tasks.flatten() {
        let path = task.path();
        let read = |f: &str| std::fs::read_to_string(path.join(f)).unwrap_or_default();
        let stat = read("stat");
        // The state follows the name's closing parenthesis.
        let state = stat.rsplit_once(") ").and_then(|(_, rest)| rest.split(' ').next()).unwrap_or("?").to_owned();
        out.push_str(&format!(
            "  {:>7} {:<24} state {state} wchan {} syscall {}\n",
            task.file_name().to_string_lossy(),
            read("comm").trim(),
            read("wchan").trim(),
            read("syscall").split(' ').next().unwrap_or("").trim(),
        ));
    }
    out
}
