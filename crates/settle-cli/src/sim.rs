//! `settle provider-sim`: the payout provider simulator (crate `settle-sim`), until SIGINT or SIGTERM.

use anyhow::Context;
use settle_sim::SimConfig;

#[derive(clap::Args)]
pub struct SimArgs {
    #[arg(long, default_value = "127.0.0.1:7071")]
    listen: String,
    /// Seed of the simulator's random faults (the same seed, the same faults for the same requests).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Share of sends executed and then answered with a cut connection.
    #[arg(long, default_value_t = 0.0)]
    lose_answer: f64,
    /// Share of sends that hang past the caller's timeout (half of them executed first).
    #[arg(long, default_value_t = 0.0)]
    hang: f64,
    #[arg(long, default_value_t = 15_000)]
    hang_ms: u64,
    /// Share of time the payout node is down (NODE_DOWN to sends), in periods of --down-period-ms.
    #[arg(long, default_value_t = 0.0)]
    node_down: f64,
    #[arg(long, default_value_t = 500)]
    down_period_ms: u64,
    /// Share of requests answered RATE_LIMITED with Retry-After: --retry-after-seconds.
    #[arg(long, default_value_t = 0.0)]
    rate_limit: f64,
    #[arg(long, default_value_t = 1)]
    retry_after_seconds: u64,
    /// The most the simulator pays out in all; beyond it sends are INSUFFICIENT.
    #[arg(long)]
    float: Option<i64>,
    /// Destinations starting with this are refused (INVALID_ADDRESS).
    #[arg(long, default_value = "invalid")]
    invalid_prefix: String,
    /// Share of executed payouts returned --return-after-ms later.
    #[arg(long, default_value_t = 0.0)]
    returns: f64,
    #[arg(long, default_value_t = 60_000)]
    return_after_ms: u64,
}

fn share(name: &str, v: f64) -> anyhow::Result<f64> {
    anyhow::ensure!((0.0..=1.0).contains(&v), "--{name} is a share between 0 and 1");
    Ok(v)
}

pub async fn run(a: SimArgs) -> anyhow::Result<()> {
    anyhow::ensure!(
        share("lose-answer", a.lose_answer)? + share("hang", a.hang)? <= 1.0,
        "--lose-answer + --hang is at most 1"
    );
    let config = SimConfig {
        seed: a.seed,
        lose_answer: a.lose_answer,
        hang: a.hang,
        hang_ms: a.hang_ms,
        node_down: share("node-down", a.node_down)?,
        down_period_ms: a.down_period_ms.max(1),
        rate_limit: share("rate-limit", a.rate_limit)?,
        retry_after_seconds: a.retry_after_seconds,
        float: a.float,
        invalid_prefix: a.invalid_prefix,
        returns: share("returns", a.returns)?,
        return_after_ms: a.return_after_ms,
    };
    let running = settle_sim::start(&a.listen, config).await.with_context(|| format!("listen on {}", a.listen))?;
    eprintln!(
        "settle provider-sim: provider-v1 on {} (GET /v1/executed lists what it paid out, GET /v1/log every request)",
        running.url()
    );
    crate::serve::signalled().await;
    running.task.abort();
    Ok(())
}
