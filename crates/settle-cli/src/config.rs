//! The configuration file (TOML) and its environment overrides: where to serve and what to open,
//! the retry policy per job kind, the pace of the background loops, HTTP limits, the payout
//! provider and webhook endpoints. Every setting, its variable and its default are in
//! `docs/configuration.md` (a test holds the two together); `settle config` prints the effective
//! result.

use anyhow::{Context, bail};
use serde::{Deserialize, Serialize};
use settle_core::backoff::Jitter;
use settle_core::ids::{FailCode, JobKind};
use settle_core::job::{Policies, RefundPolicy, RetryPolicy, TOP_UP_KIND, WITHDRAWAL_KIND};
use settle_core::limits;
use std::collections::BTreeMap;

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PolicyFile {
    pub attempts_max: Option<u32>,
    pub backoff_ms_base: Option<u64>,
    pub backoff_ms_max: Option<u64>,
    pub jitter: Option<String>,
    pub retryable_codes: Option<Vec<String>>,
    pub lease_seconds: Option<u32>,
    pub confirm_window_seconds: Option<u64>,
    pub refund_on: Option<String>,
    /// A kind's cap on running jobs (`[kinds.NAME]` only; docs/design/fair-claims.md §9).
    pub max_running: Option<i64>,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Loops {
    pub rescue_every_ms: u64,
    pub sweep_every_ms: u64,
    pub reconcile_every_ms: u64,
    pub payout_every_ms: u64,
    /// Most jobs one pass of a loop takes; the next pass takes the rest.
    pub batch: u32,
}

impl Default for Loops {
    fn default() -> Loops {
        Loops {
            rescue_every_ms: 1_000,
            sweep_every_ms: 1_000,
            reconcile_every_ms: 10_000,
            payout_every_ms: 1_000,
            batch: 100,
        }
    }
}

/// `[postgres]`: what Settle asks of the PostgreSQL server it writes to.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Postgres {
    pub synchronous_standby: SynchronousStandby,
}

/// Whether Settle writes only to a primary that waits for a synchronous standby at COMMIT
/// (docs/decisions/0027): a failover loses what an asynchronous primary acknowledged.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum SynchronousStandby {
    /// Required when the URL lists several hosts (a formation), not for one.
    #[default]
    Auto,
    /// Required of one host too: a formation behind a proxy or a virtual IP.
    Required,
    /// Never: the operator accepts losing the last acknowledged writes in a failover.
    Off,
}

impl SynchronousStandby {
    /// The store's option (`None`: decided by the URL's host count).
    pub fn required(self) -> Option<bool> {
        match self {
            SynchronousStandby::Auto => None,
            SynchronousStandby::Required => Some(true),
            SynchronousStandby::Off => Some(false),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Http {
    pub header_read_timeout_ms: u64,
    pub body_read_timeout_ms: u64,
    pub max_connections: usize,
    pub max_connections_per_peer: usize,
    pub requests_per_second_per_token: f64,
    pub burst_per_token: f64,
    pub long_polls_per_token: usize,
}

impl Default for Http {
    fn default() -> Http {
        let d = settle_api::HttpLimits::default();
        Http {
            header_read_timeout_ms: d.header_read_timeout.as_millis() as u64,
            body_read_timeout_ms: d.body_read_timeout.as_millis() as u64,
            max_connections: d.max_connections,
            max_connections_per_peer: d.max_connections_per_peer,
            requests_per_second_per_token: d.abuse.requests_per_second,
            burst_per_token: d.abuse.burst,
            long_polls_per_token: d.abuse.long_polls,
        }
    }
}

impl Http {
    pub fn limits(&self) -> settle_api::HttpLimits {
        settle_api::HttpLimits {
            header_read_timeout: std::time::Duration::from_millis(self.header_read_timeout_ms),
            body_read_timeout: std::time::Duration::from_millis(self.body_read_timeout_ms),
            max_connections: self.max_connections,
            max_connections_per_peer: self.max_connections_per_peer,
            abuse: settle_api::AbuseLimits {
                requests_per_second: self.requests_per_second_per_token,
                burst: self.burst_per_token,
                long_polls: self.long_polls_per_token,
            },
            ..settle_api::HttpLimits::default()
        }
    }
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProviderFile {
    pub url: Option<String>,
    pub timeout_ms: Option<u64>,
    pub connect_timeout_ms: Option<u64>,
    pub return_window_seconds: Option<u64>,
}

/// A provider (`[provider]` for payouts, `[funding]` for top-ups), when one is configured.
/// `return_window_seconds`: how long closed jobs are asked about again (a payout sent back, a
/// late execution or charge).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Provider {
    pub url: String,
    pub timeout_ms: u64,
    pub connect_timeout_ms: u64,
    pub return_window_seconds: u64,
}

#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookFile {
    pub id: String,
    pub url: String,
    /// The signing secret, or `secret_file` (a file holding it); `SETTLE_WEBHOOK_<ID>_SECRET` or
    /// `…_SECRET_FILE` in the environment wins over both.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub secret_file: Option<std::path::PathBuf>,
    #[serde(default)]
    pub attempts_max: Option<u32>,
    #[serde(default)]
    pub backoff_ms_base: Option<u64>,
    #[serde(default)]
    pub backoff_ms_max: Option<u64>,
    #[serde(default)]
    pub timeout_ms: Option<u64>,
    /// Where a new endpoint begins: "now" (the default) or "beginning" (the whole outbox).
    #[serde(default)]
    pub start_from: Option<String>,
    /// How long delivered rows are kept before they are pruned (default 168 hours).
    #[serde(default)]
    pub retention_hours: Option<u64>,
    /// This endpoint may reach a link-local or cloud-metadata address (refused otherwise).
    #[serde(default)]
    pub allow_link_local: bool,
    /// Consecutive failed sends that open the endpoint's circuit breaker (default 5; 0 = none).
    #[serde(default)]
    pub breaker_failures: Option<u32>,
    /// The first pause of an open breaker (default 30 000 ms), doubled per failed probe.
    #[serde(default)]
    pub breaker_open_ms: Option<u64>,
    /// The longest pause (default 600 000 ms).
    #[serde(default)]
    pub breaker_open_ms_max: Option<u64>,
}

#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ConfigFile {
    /// Where `settle serve` listens (`--listen`, `SETTLE_LISTEN` win over it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub listen: Option<String>,
    /// The store's URL (`--db`, `SETTLE_DATABASE_URL` win over it). No password here: that comes
    /// from `SETTLE_DATABASE_PASSWORD_FILE`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub db: Option<String>,
    /// Where workers' artifacts live (`--artifacts`, `SETTLE_ARTIFACTS` win over it).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub artifacts: Option<String>,
    /// The tokens file (`--tokens`, `SETTLE_TOKENS_FILE` win over it); re-read on SIGHUP.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tokens_file: Option<std::path::PathBuf>,
    pub defaults: PolicyFile,
    pub kinds: BTreeMap<String, PolicyFile>,
    pub loops: Loops,
    pub http: Http,
    pub postgres: Postgres,
    pub provider: ProviderFile,
    pub funding: ProviderFile,
    pub webhooks: Vec<WebhookFile>,
}

/// Where the process serves and keeps its store: each from its flag or environment variable
/// first, then the file, then the default.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Server {
    pub listen: Option<String>,
    pub db: Option<String>,
    pub artifacts: Option<String>,
    pub tokens_file: Option<std::path::PathBuf>,
}

pub const DEFAULT_LISTEN: &str = "127.0.0.1:7070";
pub const DEFAULT_DB: &str = "sqlite://settle.db";
pub const DEFAULT_ARTIFACTS: &str = "settle-artifacts";

impl Server {
    /// The listen address: `flag` (or its environment variable), else the file's, else the default.
    pub fn listen(&self, flag: Option<&str>) -> String {
        flag.or(self.listen.as_deref()).unwrap_or(DEFAULT_LISTEN).to_owned()
    }

    pub fn db(&self, flag: Option<&str>) -> String {
        flag.or(self.db.as_deref()).unwrap_or(DEFAULT_DB).to_owned()
    }

    pub fn artifacts(&self, flag: Option<&str>) -> String {
        flag.or(self.artifacts.as_deref()).unwrap_or(DEFAULT_ARTIFACTS).to_owned()
    }

    pub fn tokens_file(&self, flag: Option<&std::path::Path>) -> Option<std::path::PathBuf> {
        flag.map(ToOwned::to_owned).or_else(|| self.tokens_file.clone())
    }
}

#[derive(Debug, Clone)]
pub struct Config {
    pub server: Server,
    pub policies: Policies,
    pub loops: Loops,
    pub http: Http,
    pub postgres: Postgres,
    pub provider: Option<Provider>,
    /// The funding provider of top-ups (`[funding]`, `SETTLE_FUNDING_URL`).
    pub funding: Option<Provider>,
    pub webhooks: Vec<settle_worker::webhooks::Endpoint>,
}

/// `[provider]` or `[funding]` (`section`).
fn provider(f: &ProviderFile, section: &str) -> anyhow::Result<Option<Provider>> {
    let Some(url) = &f.url else {
        if f.timeout_ms.is_some() || f.connect_timeout_ms.is_some() || f.return_window_seconds.is_some() {
            bail!("[{section}] needs a url");
        }
        return Ok(None);
    };
    if !(url.starts_with("http://") || url.starts_with("https://")) {
        bail!("[{section}] url must be http:// or https://");
    }
    let timeout_ms = f.timeout_ms.unwrap_or(limits::PROVIDER_TIMEOUT_MS_DEFAULT);
    let connect_timeout_ms =
        f.connect_timeout_ms.unwrap_or(limits::PROVIDER_CONNECT_TIMEOUT_MS_DEFAULT.min(timeout_ms));
    let bounds = limits::PROVIDER_TIMEOUT_MS_MIN..=limits::PROVIDER_TIMEOUT_MS_MAX;
    if !bounds.contains(&timeout_ms) || !bounds.contains(&connect_timeout_ms) || connect_timeout_ms > timeout_ms {
        bail!(
            "[{section}] timeout_ms and connect_timeout_ms are between {} and {} ms, the connect timeout at most the whole",
            limits::PROVIDER_TIMEOUT_MS_MIN,
            limits::PROVIDER_TIMEOUT_MS_MAX
        );
    }
    Ok(Some(Provider {
        url: url.clone(),
        timeout_ms,
        connect_timeout_ms,
        // Funding: a charge that landed after its top-up was closed is still found (and granted).
        return_window_seconds: f.return_window_seconds.unwrap_or(if section == "funding" { 86_400 } else { 0 }),
    }))
}

/// What withdrawals start from before `[kinds.withdrawal]`: the defaults, held until final failure,
/// with a longer budget, so a provider outage of a minute does not dead-letter (and refund) them.
fn withdrawal_base(default: &RetryPolicy) -> RetryPolicy {
    let mut p = default.clone();
    p.refund_on = RefundPolicy::FinalFailure;
    p.attempts_max = p.attempts_max.max(8);
    p.backoff.backoff_ms_base = p.backoff.backoff_ms_base.max(5_000).min(p.backoff.backoff_ms_max);
    p
}

/// The processors' kinds: never handed back while the provider may still act, and a lease long
/// enough for a call to end inside it.
fn check_rails(
    kinds: &BTreeMap<String, RetryPolicy>,
    provider: &Option<Provider>,
    funding: &Option<Provider>,
) -> anyhow::Result<()> {
    for (kind, section, p) in [(WITHDRAWAL_KIND, "provider", provider), (TOP_UP_KIND, "funding", funding)] {
        let policy = &kinds[kind];
        if policy.refund_on != RefundPolicy::FinalFailure {
            bail!(
                "[kinds.{kind}].refund_on is always \"final_failure\": nothing is handed back while the provider may still act"
            );
        }
        if let Some(p) = p
            && u64::from(policy.lease_seconds) * 1_000 < 2 * p.timeout_ms + 1_000
        {
            bail!(
                "[kinds.{kind}].lease_seconds ({}) must be at least 2 × [{section}].timeout_ms + 1 s, so a send ends inside its lease",
                policy.lease_seconds
            );
        }
    }
    Ok(())
}

/// What top-ups start from before `[kinds.top_up]`: as withdrawals (never closed while a charge
/// may still be confirmed, a longer budget), with the funding protocol's retryable codes.
fn top_up_base(default: &RetryPolicy) -> RetryPolicy {
    let mut p = withdrawal_base(default);
    let codes = ["PROCESSOR_DOWN", "RATE_LIMITED", "UNAVAILABLE", "LEASE_EXPIRED", "TIMEOUT_CONFIRMED_NOT_CHARGED"];
    p.retryable_codes = codes.iter().map(|c| FailCode::parse(c).expect("valid codes")).collect();
    p
}

/// An endpoint's signing secret: from `SETTLE_WEBHOOK_<ID>_SECRET[_FILE]`, else the file's
/// `secret` or `secret_file` (exactly one of them).
fn webhook_secret(w: &WebhookFile, env: &BTreeMap<String, String>) -> anyhow::Result<String> {
    let var = format!("SETTLE_WEBHOOK_{}_SECRET", env_name(&w.id));
    if let Some(secret) = crate::secrets::from_env(env, &var)? {
        return Ok(secret);
    }
    match (&w.secret, &w.secret_file) {
        (Some(secret), None) => Ok(secret.clone()),
        (None, Some(path)) => crate::secrets::read(path, &format!("[[webhooks]] {} secret_file", w.id)),
        (Some(_), Some(_)) => bail!("[[webhooks]] {}: secret or secret_file, not both", w.id),
        (None, None) => bail!("[[webhooks]] {}: no secret (secret, secret_file, {var} or {var}_FILE)", w.id),
    }
}

fn endpoint(w: &WebhookFile, env: &BTreeMap<String, String>) -> anyhow::Result<settle_worker::webhooks::Endpoint> {
    JobKind::parse(&w.id).with_context(|| format!("[[webhooks]] id {:?}", w.id))?;
    if !(w.url.starts_with("http://") || w.url.starts_with("https://")) {
        bail!("[[webhooks]] {}: url must be http:// or https://", w.id);
    }
    let secret = webhook_secret(w, env)?;
    if secret.len() < 16 {
        bail!("[[webhooks]] {}: the secret must be at least 16 characters", w.id);
    }
    settle_worker::webhooks::check_target(&w.url, w.allow_link_local)
        .map_err(|e| anyhow::anyhow!("[[webhooks]] {}: {e}", w.id))?;
    let mut e = settle_worker::webhooks::Endpoint::new(&w.id, &w.url, &secret);
    e.allow_link_local = w.allow_link_local;
    if let Some(n) = w.attempts_max {
        if n == 0 {
            bail!("[[webhooks]] {}: attempts_max must be at least 1", w.id);
        }
        e.attempts_max = n;
    }
    if let Some(ms) = w.backoff_ms_base {
        e.backoff.backoff_ms_base = ms;
    }
    if let Some(ms) = w.backoff_ms_max {
        e.backoff.backoff_ms_max = ms;
    }
    if e.backoff.backoff_ms_base == 0 || e.backoff.backoff_ms_base > e.backoff.backoff_ms_max {
        bail!("[[webhooks]] {}: backoff_ms_base must be at least 1 and at most backoff_ms_max", w.id);
    }
    if let Some(ms) = w.timeout_ms {
        e.timeout = std::time::Duration::from_millis(ms.clamp(100, 60_000));
    }
    if let Some(h) = w.retention_hours {
        if h == 0 {
            bail!("[[webhooks]] {}: retention_hours must be at least 1", w.id);
        }
        e.retention = std::time::Duration::from_secs(h.saturating_mul(3_600));
    }
    if let Some(n) = w.breaker_failures {
        e.breaker.failures = n;
    }
    if let Some(ms) = w.breaker_open_ms {
        e.breaker.open_ms = ms;
    }
    if let Some(ms) = w.breaker_open_ms_max {
        e.breaker.open_ms_max = ms;
    }
    if e.breaker.open_ms == 0 || e.breaker.open_ms > e.breaker.open_ms_max {
        bail!("[[webhooks]] {}: breaker_open_ms must be at least 1 and at most breaker_open_ms_max", w.id);
    }
    e.start_from = match w.start_from.as_deref() {
        None | Some("now") => settle_store::StartFrom::Now,
        Some("beginning") => settle_store::StartFrom::Beginning,
        Some(other) => bail!("[[webhooks]] {}: start_from is \"now\" or \"beginning\", not {other:?}", w.id),
    };
    Ok(e)
}

fn apply(base: &RetryPolicy, f: &PolicyFile, what: &str) -> anyhow::Result<RetryPolicy> {
    let mut p = base.clone();
    if let Some(n) = f.attempts_max {
        if !(1..=limits::ATTEMPTS_MAX_LIMIT).contains(&n) {
            bail!("{what}.attempts_max must be between 1 and {}", limits::ATTEMPTS_MAX_LIMIT);
        }
        p.attempts_max = n;
    }
    if let Some(ms) = f.backoff_ms_base {
        p.backoff.backoff_ms_base = ms;
    }
    if let Some(ms) = f.backoff_ms_max {
        p.backoff.backoff_ms_max = ms;
    }
    if p.backoff.backoff_ms_base == 0 || p.backoff.backoff_ms_base > p.backoff.backoff_ms_max {
        bail!("{what}: backoff_ms_base must be at least 1 and at most backoff_ms_max");
    }
    if let Some(j) = &f.jitter {
        p.backoff.jitter = match j.as_str() {
            "full" => Jitter::Full,
            "none" => Jitter::None,
            other => bail!("{what}.jitter is \"full\" or \"none\", not {other:?}"),
        };
    }
    if let Some(codes) = &f.retryable_codes {
        p.retryable_codes = codes
            .iter()
            .map(|c| FailCode::parse(c))
            .collect::<Result<_, _>>()
            .with_context(|| format!("{what}.retryable_codes"))?;
    }
    if let Some(s) = f.lease_seconds {
        if !(limits::LEASE_SECONDS_MIN..=limits::LEASE_SECONDS_MAX).contains(&s) {
            bail!(
                "{what}.lease_seconds must be between {} and {}",
                limits::LEASE_SECONDS_MIN,
                limits::LEASE_SECONDS_MAX
            );
        }
        p.lease_seconds = s;
    }
    if let Some(s) = f.confirm_window_seconds {
        p.confirm_window_seconds = s;
    }
    if p.confirm_window_seconds < u64::from(p.lease_seconds) {
        bail!(
            "{what}: confirm_window_seconds must be at least lease_seconds (an unknown outcome needs time to surface)"
        );
    }
    if let Some(r) = &f.refund_on {
        p.refund_on =
            RefundPolicy::parse(r).with_context(|| format!("{what}.refund_on is \"failure\" or \"final_failure\""))?;
    }
    if let Some(cap) = f.max_running {
        if !(0..=limits::MAX_RUNNING_MAX).contains(&cap) {
            bail!("{what}.max_running must be between 0 and {}", limits::MAX_RUNNING_MAX);
        }
        p.max_running = Some(cap);
    }
    Ok(p)
}

/// The fields `env_overrides` reads after its prefix.
const POLICY_FIELDS: [&str; 9] = [
    "ATTEMPTS_MAX",
    "BACKOFF_MS_BASE",
    "BACKOFF_MS_MAX",
    "JITTER",
    "RETRYABLE_CODES",
    "LEASE_SECONDS",
    "CONFIRM_WINDOW_SECONDS",
    "REFUND_ON",
    "MAX_RUNNING",
];

/// Every `SETTLE_KIND_…` variable must name a kind of the configuration and one of its fields: one
/// that does not would be dropped in silence (an environment variable cannot spell a kind's exact
/// name — `render-4k` and `render_4k` are both `RENDER_4K` — so it cannot add a kind).
fn check_kind_variables(kinds: &BTreeMap<String, PolicyFile>, env: &BTreeMap<String, String>) -> anyhow::Result<()> {
    for name in env.keys().filter(|k| k.starts_with("SETTLE_KIND_")) {
        let known = kinds.keys().any(|kind| {
            let prefix = format!("SETTLE_KIND_{}_", env_name(kind));
            name.strip_prefix(&prefix).is_some_and(|field| POLICY_FIELDS.contains(&field))
        });
        if !known {
            let named: Vec<String> = kinds.keys().map(|k| format!("[kinds.{k}]")).collect();
            bail!(
                "{name} names no kind of the configuration and one of its fields ({}): a kind is configured \
                 by naming it in the config file ({} now), and the variable then overrides its field",
                POLICY_FIELDS.join(", "),
                named.join(", ")
            );
        }
    }
    Ok(())
}

fn env_overrides(prefix: &str, f: &mut PolicyFile, env: &BTreeMap<String, String>) -> anyhow::Result<()> {
    let get = |field: &str| env.get(&format!("{prefix}{field}"));
    let num = |field: &str| -> anyhow::Result<Option<u64>> {
        get(field).map(|v| v.parse::<u64>().with_context(|| format!("{prefix}{field}={v}"))).transpose()
    };
    if let Some(v) = num("ATTEMPTS_MAX")? {
        f.attempts_max = Some(u32::try_from(v)?);
    }
    if let Some(v) = num("BACKOFF_MS_BASE")? {
        f.backoff_ms_base = Some(v);
    }
    if let Some(v) = num("BACKOFF_MS_MAX")? {
        f.backoff_ms_max = Some(v);
    }
    if let Some(v) = get("JITTER") {
        f.jitter = Some(v.clone());
    }
    if let Some(v) = get("RETRYABLE_CODES") {
        f.retryable_codes = Some(v.split(',').map(str::trim).filter(|c| !c.is_empty()).map(str::to_owned).collect());
    }
    if let Some(v) = num("LEASE_SECONDS")? {
        f.lease_seconds = Some(u32::try_from(v)?);
    }
    if let Some(v) = num("CONFIRM_WINDOW_SECONDS")? {
        f.confirm_window_seconds = Some(v);
    }
    if let Some(v) = get("REFUND_ON") {
        f.refund_on = Some(v.clone());
    }
    if let Some(v) = num("MAX_RUNNING")? {
        f.max_running = Some(i64::try_from(v)?);
    }
    Ok(())
}

fn env_name(kind: &str) -> String {
    kind.chars().map(|c| if c.is_ascii_alphanumeric() { c.to_ascii_uppercase() } else { '_' }).collect()
}

/// A parse error without the line it quotes: that line may hold a secret (a webhook's, a database
/// password), and the error goes to stderr and the log.
fn parse_error(path: &std::path::Path, text: &str, e: &toml::de::Error) -> anyhow::Error {
    let line = e.span().map(|span| text[..span.start.min(text.len())].matches('\n').count() + 1);
    match line {
        Some(line) => anyhow::anyhow!("parse {}, line {line}: {}", path.display(), e.message()),
        None => anyhow::anyhow!("parse {}: {}", path.display(), e.message()),
    }
}

impl Config {
    /// Reads `path` (if any), then the environment.
    pub fn load(path: Option<&std::path::Path>, env: &BTreeMap<String, String>) -> anyhow::Result<Config> {
        let mut file: ConfigFile = match path {
            Some(p) => {
                let text = std::fs::read_to_string(p).with_context(|| format!("read {}", p.display()))?;
                toml::from_str(&text).map_err(|e| parse_error(p, &text, &e))?
            }
            None => ConfigFile::default(),
        };
        // The environment over the file, as the flags' own variables do for `serve`.
        for (var, slot) in [
            ("SETTLE_LISTEN", &mut file.listen),
            ("SETTLE_DATABASE_URL", &mut file.db),
            ("SETTLE_ARTIFACTS", &mut file.artifacts),
        ] {
            if let Some(v) = env.get(var) {
                *slot = Some(v.clone());
            }
        }
        if let Some(v) = env.get("SETTLE_TOKENS_FILE") {
            file.tokens_file = Some(v.into());
        }
        env_overrides("SETTLE_", &mut file.defaults, env)?;
        file.kinds.entry(WITHDRAWAL_KIND.to_owned()).or_default();
        file.kinds.entry(TOP_UP_KIND.to_owned()).or_default();
        check_kind_variables(&file.kinds, env)?;
        for (kind, f) in file.kinds.iter_mut() {
            JobKind::parse(kind).with_context(|| format!("[kinds.{kind}]"))?;
            env_overrides(&format!("SETTLE_KIND_{}_", env_name(kind)), f, env)?;
        }
        loops_from_env(&mut file.loops, env)?;
        http_from_env(&mut file.http, env)?;
        check_http(&file.http)?;
        if let Some(v) = env.get("SETTLE_POSTGRES_SYNCHRONOUS_STANDBY") {
            file.postgres.synchronous_standby = match v.as_str() {
                "auto" => SynchronousStandby::Auto,
                "required" => SynchronousStandby::Required,
                "off" => SynchronousStandby::Off,
                other => bail!("SETTLE_POSTGRES_SYNCHRONOUS_STANDBY={other}: auto, required or off"),
            };
        }
        provider_from_env(&mut file.provider, env, "SETTLE_PROVIDER_")?;
        provider_from_env(&mut file.funding, env, "SETTLE_FUNDING_")?;
        check_loops(&file.loops)?;
        if file.defaults.max_running.is_some() {
            bail!("max_running is a job kind's cap: set it in [kinds.NAME], not in [defaults] (or SETTLE_MAX_RUNNING)");
        }
        for kind in [WITHDRAWAL_KIND, TOP_UP_KIND] {
            if file.kinds.get(kind).is_some_and(|w| w.max_running.is_some()) {
                bail!("[kinds.{kind}].max_running: a processor's kind is never capped (its processor sends in order)");
            }
        }
        let default = apply(&RetryPolicy::default(), &file.defaults, "[defaults]")?;
        let mut kinds = BTreeMap::new();
        for (kind, f) in &file.kinds {
            let base = match kind.as_str() {
                WITHDRAWAL_KIND => withdrawal_base(&default),
                TOP_UP_KIND => top_up_base(&default),
                _ => default.clone(),
            };
            kinds.insert(kind.clone(), apply(&base, f, &format!("[kinds.{kind}]"))?);
        }
        let funding = provider(&file.funding, "funding")?;
        let provider = provider(&file.provider, "provider")?;
        check_rails(&kinds, &provider, &funding)?;
        let webhooks = file.webhooks.iter().map(|w| endpoint(w, env)).collect::<anyhow::Result<Vec<_>>>()?;
        let mut ids: Vec<&str> = webhooks.iter().map(|w| w.id.as_str()).collect();
        ids.sort_unstable();
        if ids.windows(2).any(|w| w[0] == w[1]) {
            bail!("[[webhooks]] ids must be unique");
        }
        // Their secrets' variables must be too: `ops-a` and `ops_a` are both SETTLE_WEBHOOK_OPS_A_….
        let mut vars: Vec<String> = ids.iter().map(|id| env_name(id)).collect();
        vars.sort_unstable();
        if let Some(w) = vars.windows(2).find(|w| w[0] == w[1]) {
            bail!(
                "[[webhooks]] two ids share the variable SETTLE_WEBHOOK_{}_SECRET: give them names that differ in letters or digits",
                w[0]
            );
        }
        Ok(Config {
            server: Server {
                listen: file.listen,
                db: file.db,
                artifacts: file.artifacts,
                tokens_file: file.tokens_file,
            },
            policies: Policies { default, kinds },
            loops: file.loops,
            http: file.http,
            postgres: file.postgres,
            provider,
            funding,
            webhooks,
        })
    }

    pub fn from_process_env(path: Option<&std::path::Path>) -> anyhow::Result<Config> {
        Config::load(path, &crate::secrets::settle_env())
    }

    /// The effective configuration, as TOML with every field written out.
    pub fn to_toml(&self) -> String {
        fn file(p: &RetryPolicy) -> PolicyFile {
            PolicyFile {
                attempts_max: Some(p.attempts_max),
                backoff_ms_base: Some(p.backoff.backoff_ms_base),
                backoff_ms_max: Some(p.backoff.backoff_ms_max),
                jitter: Some(match p.backoff.jitter {
                    Jitter::Full => "full".into(),
                    Jitter::None => "none".into(),
                }),
                retryable_codes: Some(p.retryable_codes.iter().map(|c| c.as_str().to_owned()).collect()),
                lease_seconds: Some(p.lease_seconds),
                confirm_window_seconds: Some(p.confirm_window_seconds),
                refund_on: Some(p.refund_on.as_str().to_owned()),
                max_running: p.max_running,
            }
        }
        let out = ConfigFile {
            listen: Some(self.server.listen(None)),
            db: Some(settle_store::redacted_url(&self.server.db(None))),
            artifacts: Some(self.server.artifacts(None)),
            tokens_file: self.server.tokens_file.clone(),
            defaults: file(&self.policies.default),
            kinds: self.policies.kinds.iter().map(|(k, p)| (k.clone(), file(p))).collect(),
            loops: self.loops.clone(),
            http: self.http.clone(),
            postgres: self.postgres.clone(),
            provider: provider_file(self.provider.as_ref()),
            funding: provider_file(self.funding.as_ref()),
            webhooks: self
                .webhooks
                .iter()
                .map(|w| WebhookFile {
                    id: w.id.clone(),
                    url: settle_store::redacted_url(&w.url),
                    secret: Some("<redacted>".into()),
                    secret_file: None,
                    allow_link_local: w.allow_link_local,
                    attempts_max: Some(w.attempts_max),
                    backoff_ms_base: Some(w.backoff.backoff_ms_base),
                    backoff_ms_max: Some(w.backoff.backoff_ms_max),
                    timeout_ms: Some(u64::try_from(w.timeout.as_millis()).unwrap_or(u64::MAX)),
                    retention_hours: Some(w.retention.as_secs() / 3_600),
                    breaker_failures: Some(w.breaker.failures),
                    breaker_open_ms: Some(w.breaker.open_ms),
                    breaker_open_ms_max: Some(w.breaker.open_ms_max),
                    start_from: Some(
                        match w.start_from {
                            settle_store::StartFrom::Now => "now",
                            settle_store::StartFrom::Beginning => "beginning",
                        }
                        .to_owned(),
                    ),
                })
                .collect(),
        };
        toml::to_string(&out).unwrap_or_default()
    }
}

/// `PREFIX_FIELD` from the environment, parsed, if it is set.
fn env_num<T: std::str::FromStr>(env: &BTreeMap<String, String>, prefix: &str, field: &str) -> anyhow::Result<Option<T>>
where
    T::Err: std::error::Error + Send + Sync + 'static,
{
    env.get(&format!("{prefix}{field}"))
        .map(|v| v.parse::<T>().with_context(|| format!("{prefix}{field}={v}")))
        .transpose()
}

/// `SETTLE_LOOPS_*` over the file's `[loops]`.
fn loops_from_env(loops: &mut Loops, env: &BTreeMap<String, String>) -> anyhow::Result<()> {
    let num = |field| env_num::<u64>(env, "SETTLE_LOOPS_", field);
    if let Some(v) = num("RESCUE_EVERY_MS")? {
        loops.rescue_every_ms = v;
    }
    if let Some(v) = num("SWEEP_EVERY_MS")? {
        loops.sweep_every_ms = v;
    }
    if let Some(v) = num("RECONCILE_EVERY_MS")? {
        loops.reconcile_every_ms = v;
    }
    if let Some(v) = num("PAYOUT_EVERY_MS")? {
        loops.payout_every_ms = v;
    }
    if let Some(v) = num("BATCH")? {
        loops.batch = u32::try_from(v)?;
    }
    Ok(())
}

fn check_loops(l: &Loops) -> anyhow::Result<()> {
    if l.rescue_every_ms == 0
        || l.sweep_every_ms == 0
        || l.reconcile_every_ms == 0
        || l.payout_every_ms == 0
        || !(1..=limits::PAGE_LIMIT_MAX).contains(&l.batch)
    {
        bail!("[loops]: every period must be at least 1 ms and batch between 1 and {}", limits::PAGE_LIMIT_MAX);
    }
    Ok(())
}

/// `SETTLE_HTTP_*` over the file's `[http]`.
fn http_from_env(http: &mut Http, env: &BTreeMap<String, String>) -> anyhow::Result<()> {
    let num = |field| env_num::<u64>(env, "SETTLE_HTTP_", field);
    if let Some(v) = num("HEADER_READ_TIMEOUT_MS")? {
        http.header_read_timeout_ms = v;
    }
    if let Some(v) = num("BODY_READ_TIMEOUT_MS")? {
        http.body_read_timeout_ms = v;
    }
    if let Some(v) = num("MAX_CONNECTIONS")? {
        http.max_connections = usize::try_from(v)?;
    }
    if let Some(v) = num("MAX_CONNECTIONS_PER_PEER")? {
        http.max_connections_per_peer = usize::try_from(v)?;
    }
    if let Some(v) = num("LONG_POLLS_PER_TOKEN")? {
        http.long_polls_per_token = usize::try_from(v)?;
    }
    let rate = |field| env_num::<f64>(env, "SETTLE_HTTP_", field);
    if let Some(v) = rate("REQUESTS_PER_SECOND_PER_TOKEN")? {
        http.requests_per_second_per_token = v;
    }
    if let Some(v) = rate("BURST_PER_TOKEN")? {
        http.burst_per_token = v;
    }
    Ok(())
}

fn check_http(h: &Http) -> anyhow::Result<()> {
    let http_ok = (100..=600_000).contains(&h.header_read_timeout_ms)
        && (100..=600_000).contains(&h.body_read_timeout_ms)
        && (1..=1_000_000).contains(&h.max_connections)
        && (1..=h.max_connections).contains(&h.max_connections_per_peer)
        && h.requests_per_second_per_token.is_finite()
        && h.requests_per_second_per_token >= 0.0
        && h.burst_per_token.is_finite()
        && h.burst_per_token >= 1.0
        && (1..=100_000).contains(&h.long_polls_per_token);
    if !http_ok {
        bail!(
            "[http]: timeouts are between 100 ms and 10 min, max_connections between 1 and 1000000, \
             max_connections_per_peer between 1 and max_connections, the rate \
             zero (off) or more, the burst at least 1, long_polls_per_token between 1 and 100000"
        );
    }
    Ok(())
}

/// A provider as the file writes it (its URL's password hidden).
fn provider_file(p: Option<&Provider>) -> ProviderFile {
    match p {
        Some(p) => ProviderFile {
            url: Some(settle_store::redacted_url(&p.url)),
            timeout_ms: Some(p.timeout_ms),
            connect_timeout_ms: Some(p.connect_timeout_ms),
            return_window_seconds: Some(p.return_window_seconds),
        },
        None => ProviderFile::default(),
    }
}

/// `{prefix}URL` and `{prefix}*` (`SETTLE_PROVIDER_`, `SETTLE_FUNDING_`) over the file's section.
fn provider_from_env(provider: &mut ProviderFile, env: &BTreeMap<String, String>, prefix: &str) -> anyhow::Result<()> {
    if let Some(v) = env.get(&format!("{prefix}URL")) {
        provider.url = Some(v.clone());
    }
    let num = |field| env_num::<u64>(env, prefix, field);
    if let Some(v) = num("TIMEOUT_MS")? {
        provider.timeout_ms = Some(v);
    }
    if let Some(v) = num("CONNECT_TIMEOUT_MS")? {
        provider.connect_timeout_ms = Some(v);
    }
    if let Some(v) = num("RETURN_WINDOW_SECONDS")? {
        provider.return_window_seconds = Some(v);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect()
    }

    #[test]
    fn kinds_inherit_defaults_and_env_overrides_both() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("settle.toml");
        std::fs::write(
            &path,
            "[defaults]\nattempts_max = 3\nbackoff_ms_base = 500\n\n[kinds.withdrawal]\nrefund_on = \"final_failure\"\n\n[kinds.\"render-4k\"]\nlease_seconds = 120\n",
        )
        .unwrap();
        let c = Config::load(
            Some(&path),
            &env(&[
                ("SETTLE_BACKOFF_MS_MAX", "9000"),
                ("SETTLE_KIND_RENDER_4K_ATTEMPTS_MAX", "7"),
                ("SETTLE_LOOPS_BATCH", "10"),
            ]),
        )
        .unwrap();
        let d = &c.policies.default;
        assert_eq!((d.attempts_max, d.backoff.backoff_ms_base, d.backoff.backoff_ms_max), (3, 500, 9000));
        let w = c.policies.for_kind("withdrawal");
        // withdrawals: held to final failure, and at least 8 attempts unless [kinds.withdrawal] says otherwise
        assert_eq!((w.refund_on, w.attempts_max, w.backoff.backoff_ms_max), (RefundPolicy::FinalFailure, 8, 9000));
        let r = c.policies.for_kind("render-4k");
        assert_eq!((r.lease_seconds, r.attempts_max), (120, 7));
        assert_eq!(c.policies.for_kind("other").attempts_max, 3);
        assert_eq!(c.loops.batch, 10);
        // the printed configuration reads back to the same policies
        assert!(c.to_toml().contains("[loops]"));
        std::fs::write(&path, c.to_toml()).unwrap();
        let again = Config::load(Some(&path), &BTreeMap::new()).unwrap();
        assert_eq!(again.policies, c.policies);
    }

    /// Issue 41: a kind's variable for a kind the configuration does not name, or for a field no
    /// kind has, stops the start instead of being dropped in silence.
    #[test]
    fn a_kind_variable_the_configuration_cannot_apply_is_refused() {
        let e = Config::load(None, &env(&[("SETTLE_KIND_RENDER_LEASE_SECONDS", "120")])).unwrap_err();
        assert!(format!("{e:#}").contains("SETTLE_KIND_RENDER_LEASE_SECONDS names no kind"), "{e:#}");
        let e = Config::load(None, &env(&[("SETTLE_KIND_WITHDRAWAL_LEASE_SECS", "120")])).unwrap_err();
        assert!(format!("{e:#}").contains("SETTLE_KIND_WITHDRAWAL_LEASE_SECS"), "{e:#}");
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("settle.toml");
        std::fs::write(&path, "[kinds.render]\n").unwrap();
        let c = Config::load(Some(&path), &env(&[("SETTLE_KIND_RENDER_LEASE_SECONDS", "120")])).unwrap();
        assert_eq!(c.policies.for_kind("render").lease_seconds, 120);
        let c = Config::load(None, &env(&[("SETTLE_KIND_WITHDRAWAL_ATTEMPTS_MAX", "9")])).unwrap();
        assert_eq!(c.policies.for_kind("withdrawal").attempts_max, 9);
    }

    #[test]
    fn bad_values_are_refused() {
        for bad in [
            "[defaults]\nattempts_max = 0\n",
            "[defaults]\njitter = \"some\"\n",
            "[defaults]\nrefund_on = \"never\"\n",
            "[defaults]\nretryable_codes = [\"lower\"]\n",
            "[defaults]\nbackoff_ms_base = 10\nbackoff_ms_max = 5\n",
            "[defaults]\ncolour = 1\n",
            "[kinds.\"bad kind\"]\n",
            "[loops]\nbatch = 0\n",
            "[kinds.withdrawal]\nrefund_on = \"failure\"\n",
            "[provider]\ntimeout_ms = 100\n",
            "[provider]\nurl = \"ftp://x\"\n",
            "[provider]\nurl = \"http://x\"\ntimeout_ms = 20000\n",
            "[provider]\nurl = \"http://x\"\ntimeout_ms = 1000\nconnect_timeout_ms = 2000\n",
            "[provider]\nurl = \"http://x\"\ncolour = 1\n",
            "[http]\nheader_read_timeout_ms = 0\n",
            "[http]\nmax_connections = 0\n",
            "[postgres]\nsynchronous_standby = \"sometimes\"\n",
            "[postgres]\ncolour = 1\n",
        ] {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("c.toml");
            std::fs::write(&path, bad).unwrap();
            assert!(Config::load(Some(&path), &BTreeMap::new()).is_err(), "{bad}");
        }
        assert!(Config::load(None, &env(&[("SETTLE_ATTEMPTS_MAX", "x")])).is_err());
        assert!(Config::load(None, &env(&[("SETTLE_POSTGRES_SYNCHRONOUS_STANDBY", "yes")])).is_err());
    }

    #[test]
    fn a_synchronous_standby_is_asked_for_by_the_url_unless_told() {
        let auto = Config::load(None, &BTreeMap::new()).unwrap();
        assert_eq!(auto.postgres.synchronous_standby.required(), None);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, "[postgres]\nsynchronous_standby = \"required\"\n").unwrap();
        let file = Config::load(Some(&path), &BTreeMap::new()).unwrap();
        assert_eq!(file.postgres.synchronous_standby.required(), Some(true));
        let env_over = Config::load(Some(&path), &env(&[("SETTLE_POSTGRES_SYNCHRONOUS_STANDBY", "off")])).unwrap();
        assert_eq!(env_over.postgres.synchronous_standby.required(), Some(false));
        // the printed configuration carries it
        std::fs::write(&path, file.to_toml()).unwrap();
        assert_eq!(Config::load(Some(&path), &BTreeMap::new()).unwrap().postgres, file.postgres);
    }

    #[test]
    fn withdrawals_are_built_in_and_the_provider_is_optional() {
        let c = Config::load(None, &BTreeMap::new()).unwrap();
        assert_eq!(c.provider, None);
        let w = c.policies.for_kind("withdrawal");
        assert_eq!((w.refund_on, w.attempts_max, w.backoff.backoff_ms_base), (RefundPolicy::FinalFailure, 8, 5_000));
        let c = Config::load(
            None,
            &env(&[
                ("SETTLE_PROVIDER_URL", "http://127.0.0.1:7071"),
                ("SETTLE_PROVIDER_TIMEOUT_MS", "3000"),
                ("SETTLE_KIND_WITHDRAWAL_ATTEMPTS_MAX", "4"),
                ("SETTLE_LOOPS_PAYOUT_EVERY_MS", "250"),
            ]),
        )
        .unwrap();
        let p = c.provider.clone().unwrap();
        assert_eq!(
            (p.url.as_str(), p.timeout_ms, p.connect_timeout_ms, p.return_window_seconds),
            ("http://127.0.0.1:7071", 3_000, 2_000, 0)
        );
        assert_eq!((c.policies.for_kind("withdrawal").attempts_max, c.loops.payout_every_ms), (4, 250));
        // the printed configuration reads back
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("c.toml");
        std::fs::write(&path, c.to_toml()).unwrap();
        let again = Config::load(Some(&path), &BTreeMap::new()).unwrap();
        assert_eq!((again.provider, again.policies), (c.provider, c.policies));
    }
}
