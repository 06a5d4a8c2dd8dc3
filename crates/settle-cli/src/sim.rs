//! `settle provider-sim` and `settle funding-sim`: the payout and funding provider simulators (crate
//! `settle-sim`, one simulator speaking either protocol), until SIGINT or SIGTERM.

use anyhow::Context;
use settle_sim::SimConfig;

#[derive(clap::Args)]
pub struct SimArgs {
    /// Where to listen (provider-sim: 127.0.0.1:7071, funding-sim: 127.0.0.1:7072).
    #[arg(long)]
    listen: Option<String>,
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
    /// Share of time the provider is down (NODE_DOWN, PROCESSOR_DOWN to sends), in periods of --down-period-ms.
    #[arg(long, default_value_t = 0.0)]
    node_down: f64,
    #[arg(long, default_value_t = 500)]
    down_period_ms: u64,
    /// Share of requests answered RATE_LIMITED with Retry-After: --retry-after-seconds.
    #[arg(long, default_value_t = 0.0)]
    rate_limit: f64,
    #[arg(long, default_value_t = 1)]
    retry_after_seconds: u64,
    /// The most the simulator pays out (charges) in all; beyond it sends are INSUFFICIENT (INSUFFICIENT_FUNDS).
    #[arg(long)]
    float: Option<i64>,
    /// Destinations (customers) starting with this are refused: INVALID_ADDRESS (CARD_DECLINED).
    /// Customers starting with `nocard` have no payment method (NO_PAYMENT_METHOD).
    #[arg(long)]
    invalid_prefix: Option<String>,
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

/// `settle provider-sim` (`provider-v1`) or `settle funding-sim` (`funding-v1`).
pub async fn run(a: SimArgs, protocol: &'static settle_sim::Protocol) -> anyhow::Result<()> {
    let (invalid_default, listen_default) =
        if protocol.currency { ("declined", "127.0.0.1:7072") } else { ("invalid", "127.0.0.1:7071") };
    let listen = a.listen.clone().unwrap_or_else(|| listen_default.to_owned());
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
        invalid_prefix: a.invalid_prefix.unwrap_or_else(|| invalid_default.to_owned()),
        returns: share("returns", a.returns)?,
        return_after_ms: a.return_after_ms,
    };
    let running =
        settle_sim::start_speaking(&listen, config, protocol).await.with_context(|| format!("listen on {listen}"))?;
    eprintln!(
        "settle {}: {} on {} (GET /v1/executed lists what it executed, GET /v1/log every request)",
        if protocol.currency { "funding-sim" } else { "provider-sim" },
        protocol.name,
        running.url()
    );
    crate::serve::signalled().await;
    running.task.abort();
    Ok(())
}
