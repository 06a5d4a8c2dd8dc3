//! Progress of long work (`settle audit`, the fills of `settle bench`): a bar (indicatif) when
//! stderr is a terminal; otherwise a plain line at most every 5 seconds, so logs and CI output stay
//! line-oriented.

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::io::IsTerminal;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How often the line-oriented form prints.
const LINE_EVERY: Duration = Duration::from_secs(5);

pub struct Progress {
    label: String,
    bar: Option<ProgressBar>,
    lines: Mutex<Lines>,
}

struct Lines {
    started: Instant,
    printed: Instant,
    done: u64,
    total: u64,
}

impl Progress {
    /// Progress of `total` units of `label` (a bar on a terminal).
    pub fn new(label: &str, total: u64) -> Progress {
        let bar = std::io::stderr().is_terminal().then(|| {
            let bar = ProgressBar::with_draw_target(Some(total), ProgressDrawTarget::stderr());
            bar.set_style(
                ProgressStyle::with_template("{prefix:>12} [{bar:40}] {human_pos}/{human_len} {per_sec} eta {eta}")
                    .expect("a valid template")
                    .progress_chars("=> "),
            );
            bar.set_prefix(label.to_owned());
            bar
        });
        let now = Instant::now();
        Progress {
            label: label.to_owned(),
            bar,
            lines: Mutex::new(Lines { started: now, printed: now, done: 0, total }),
        }
    }

    /// `done` units of the total are done now; `total` may grow as the work learns its size.
    pub fn set(&self, done: u64, total: u64) {
        if let Some(bar) = &self.bar {
            bar.set_length(total.max(done));
            bar.set_position(done);
            return;
        }
        let mut lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
        (lines.done, lines.total) = (done, total.max(done));
        if lines.printed.elapsed() >= LINE_EVERY {
            lines.printed = Instant::now();
            let rate = done as f64 / lines.started.elapsed().as_secs_f64().max(1e-9);
            eprintln!("{}: {done} of {} ({rate:.0}/s)", self.label, lines.total);
        }
    }

    /// Adds `n` done units.
    pub fn inc(&self, n: u64) {
        match &self.bar {
            Some(bar) => bar.inc(n),
            None => {
                let (done, total) = {
                    let lines = self.lines.lock().unwrap_or_else(|p| p.into_inner());
                    (lines.done + n, lines.total)
                };
                self.set(done, total);
            }
        }
    }

    /// Clears the bar (the caller prints the result).
    pub fn finish(&self) {
        if let Some(bar) = &self.bar {
            bar.finish_and_clear();
        }
    }
}

/// The audit's progress callback: one bar per phase (ledger, items, outbox).
pub fn audit() -> std::sync::Arc<dyn Fn(settle_store::AuditProgress) + Send + Sync> {
    let current: Mutex<Option<(&'static str, Progress)>> = Mutex::new(None);
    std::sync::Arc::new(move |p: settle_store::AuditProgress| {
        let mut current = current.lock().unwrap_or_else(|e| e.into_inner());
        if current.as_ref().is_none_or(|(phase, _)| *phase != p.phase) {
            if let Some((_, old)) = current.take() {
                old.finish();
            }
            *current = Some((p.phase, Progress::new(&format!("audit {}", p.phase), p.total)));
        }
        if let Some((_, bar)) = current.as_ref() {
            bar.set(p.done, p.total);
        }
    })
}
