//! Webhook delivery: every outbox event to every endpoint, in order per job, at least once, signed
//! (`Settle-Signature`, see `settle_core::signature`), retried with capped exponential backoff and
//! full jitter, dead-lettered after `attempts_max` and requeueable (docs/design/webhooks.md).

use settle_core::backoff::{BackoffPolicy, Jitter, SplitMix64};
use settle_core::signature;
use settle_store::{BreakerPolicy, Delivery, DeliveryReport, Event, StartFrom, Store, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

#[derive(Debug, Clone, PartialEq)]
pub struct Endpoint {
    pub id: String,
    pub url: String,
    pub secret: String,
    pub attempts_max: u32,
    pub backoff: BackoffPolicy,
    pub timeout: Duration,
    /// Where this endpoint's deliveries begin when it is new (an endpoint that has begun continues).
    pub start_from: StartFrom,
    /// How long delivered rows are kept (for the deliveries list) before they are pruned.
    pub retention: Duration,
    /// The endpoint's circuit breaker (shared by every process through the store).
    pub breaker: BreakerPolicy,
    /// Whether this endpoint may reach a link-local or cloud-metadata address (`169.254.0.0/16`,
    /// `fe80::/10`, `metadata.google.internal`, …). Off unless the operator opts this endpoint in:
    /// from there a signed POST could reach the machine's instance credentials.
    pub allow_link_local: bool,
}

impl Endpoint {
    pub fn new(id: &str, url: &str, secret: &str) -> Endpoint {
        Endpoint {
            id: id.to_owned(),
            url: url.to_owned(),
            secret: secret.to_owned(),
            attempts_max: 12,
            backoff: BackoffPolicy { backoff_ms_base: 1_000, backoff_ms_max: 300_000, jitter: Jitter::Full },
            timeout: Duration::from_secs(10),
            start_from: StartFrom::Now,
            retention: Duration::from_secs(7 * 24 * 3_600),
            breaker: BreakerPolicy::default(),
            allow_link_local: false,
        }
    }
}

/// Addresses a webhook must not reach unless its endpoint opts in: link-local (where cloud
/// instance metadata and its credentials answer) and the metadata services' other addresses.
pub fn is_metadata_or_link_local(ip: std::net::IpAddr) -> bool {
    use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
    let v4 = |ip: Ipv4Addr| ip.is_link_local() || ip == Ipv4Addr::new(100, 100, 100, 200);
    match ip {
        IpAddr::V4(ip) => v4(ip),
        IpAddr::V6(ip) => {
            let aws = Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254);
            (ip.segments()[0] & 0xffc0) == 0xfe80 || ip == aws || ip.to_ipv4_mapped().is_some_and(v4)
        }
    }
}

/// Host names that are a cloud's metadata service.
const METADATA_NAMES: &[&str] = &["metadata", "metadata.google.internal", "metadata.goog", "instance-data"];

/// Refuses a webhook URL that names a link-local or metadata host outright (an address in the
/// URL is never looked up, so it is checked here; names are checked again when they resolve).
pub fn check_target(url: &str, allow_link_local: bool) -> Result<(), String> {
    let parsed = reqwest::Url::parse(url).map_err(|e| format!("the url cannot be read: {e}"))?;
    if !matches!(parsed.scheme(), "http" | "https") {
        return Err("the url must be http:// or https://".into());
    }
    if allow_link_local {
        return Ok(());
    }
    let forbidden = match parsed.host() {
        Some(url::Host::Ipv4(ip)) => is_metadata_or_link_local(ip.into()),
        Some(url::Host::Ipv6(ip)) => is_metadata_or_link_local(ip.into()),
        Some(url::Host::Domain(name)) => {
            let name = name.trim_end_matches('.').to_ascii_lowercase();
            METADATA_NAMES.contains(&name.as_str())
        }
        None => return Err("the url names no host".into()),
    };
    if forbidden {
        return Err("the url names a link-local or cloud-metadata host; set allow_link_local = true on this \
                    endpoint if that is really where its receiver is"
            .into());
    }
    Ok(())
}

/// Name resolution for webhook sends that drops link-local and metadata addresses, so a receiver's
/// name pointed at `169.254.169.254` (by its owner, or by DNS rebinding) is not followed there.
struct PublicResolver;

impl reqwest::dns::Resolve for PublicResolver {
    fn resolve(&self, name: reqwest::dns::Name) -> reqwest::dns::Resolving {
        let host = name.as_str().to_owned();
        Box::pin(async move {
            let found: Vec<std::net::SocketAddr> = tokio::net::lookup_host((host.as_str(), 0)).await?.collect();
            let kept: Vec<std::net::SocketAddr> =
                found.iter().copied().filter(|a| !is_metadata_or_link_local(a.ip())).collect();
            if kept.is_empty() && !found.is_empty() {
                return Err(format!("{host} resolves only to link-local or metadata addresses").into());
            }
            let addrs: reqwest::dns::Addrs = Box::new(kept.into_iter());
            Ok(addrs)
        })
    }
}

/// What a failed send says, without the URL (reqwest's errors name it, credentials and all): the
/// error's own kind and its causes.
fn send_error(e: reqwest::Error) -> String {
    use std::error::Error as _;
    let e = e.without_url();
    let mut text = e.to_string();
    let mut cause = e.source();
    while let Some(c) = cause {
        text.push_str(": ");
        text.push_str(&c.to_string());
        cause = c.source();
    }
    text
}

/// The body sent for an event: the envelope `GET /v1/events` lists, the same bytes.
pub fn event_body(e: &Event) -> Vec<u8> {
    serde_json::to_vec(&e.envelope()).unwrap_or_default()
}

/// How many lines of one endpoint a deliverer sends at once (each line stays in order).
pub const LINES_AT_ONCE: u32 = 8;

pub struct Deliverer {
    store: Arc<dyn Store>,
    endpoint: Endpoint,
    http: reqwest::Client,
    rng: std::sync::Mutex<SplitMix64>,
    /// Whether the endpoint's start was made sure of (once per process).
    started: std::sync::atomic::AtomicBool,
    /// How often to look for work when nothing wakes the loop.
    pub every: Duration,
    pub batch: u32,
    /// How many lines the next lease takes (1 to `LINES_AT_ONCE`): slow start after a failure.
    width: std::sync::atomic::AtomicU32,
}

impl Deliverer {
    /// Refuses an endpoint whose client cannot be built with its timeout and without redirects:
    /// a process must not start with a sender that could hang forever or follow a redirect.
    pub fn new(store: Arc<dyn Store>, endpoint: Endpoint, seed: u64) -> Result<Deliverer, String> {
        let bounds = Duration::from_millis(100)..=Duration::from_secs(60);
        if !bounds.contains(&endpoint.timeout) {
            return Err(format!("webhook endpoint {}: the timeout must be between 100 ms and 60 s", endpoint.id));
        }
        check_target(&endpoint.url, endpoint.allow_link_local)
            .map_err(|e| format!("webhook endpoint {}: {e}", endpoint.id))?;
        // No redirects: a 3xx is a failure, never a re-sent request without its signature (nor
        // one to a host the target check would refuse).
        let builder = reqwest::Client::builder();
        // No proxy from the environment either: a proxy would resolve the name itself, past the
        // resolver that keeps link-local addresses out.
        let builder =
            if endpoint.allow_link_local { builder } else { builder.dns_resolver(Arc::new(PublicResolver)).no_proxy() };
        let http = builder
            .timeout(endpoint.timeout)
            .connect_timeout(endpoint.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("webhook endpoint {}: cannot build its HTTP client: {e}", endpoint.id))?;
        Ok(Deliverer {
            store,
            endpoint,
            http,
            rng: std::sync::Mutex::new(SplitMix64::new(seed)),
            started: std::sync::atomic::AtomicBool::new(false),
            every: Duration::from_millis(250),
            batch: 100,
            width: std::sync::atomic::AtomicU32::new(1),
        })
    }

    /// One pass: fan out new events, then send every delivery that is due and at the head of its
    /// job's line. Returns how many were delivered.
    pub async fn pass(&self) -> Result<usize, StoreError> {
        self.pass_until(&CancellationToken::new()).await
    }

    /// As `pass`, stopping between sends once `cancel` fires (shutdown does not wait for a backlog).
    pub async fn pass_until(&self, cancel: &CancellationToken) -> Result<usize, StoreError> {
        if !self.started.load(std::sync::atomic::Ordering::Relaxed) {
            if self.store.webhooks().start(&self.endpoint.id, self.endpoint.start_from).await? {
                tracing::info!(endpoint = %self.endpoint.id, from = ?self.endpoint.start_from, "webhook endpoint begins");
            }
            self.started.store(true, std::sync::atomic::Ordering::Relaxed);
        }
        self.store.webhooks().fan_out(&self.endpoint.id, self.batch).await?;
        let retention_seconds = self.endpoint.retention.as_secs();
        let cutoff = self.store.now().minus_seconds(retention_seconds);
        let pruned = self.store.webhooks().prune(&self.endpoint.id, cutoff, self.batch).await?;
        if pruned > 0 {
            tracing::debug!(endpoint = %self.endpoint.id, pruned, "pruned delivered webhook rows past retention");
        }
        let lease_ms = u64::try_from(self.endpoint.timeout.as_millis()).unwrap_or(u64::MAX).saturating_add(5_000);
        let mut delivered = 0;
        loop {
            if cancel.is_cancelled() {
                return Ok(delivered);
            }
            // Up to `LINES_AT_ONCE` lines at a time, each at its head (a lease is taken only for a
            // line's first undelivered event, so two of one line never go out together): a slow
            // receiver no longer caps the endpoint at one delivery in flight. A lease starts when
            // its send does.
            // Slow start: one at a time after a failure (the breaker counts failures one by one and
            // must not be overrun by sends already in flight), doubling after each batch that all
            // went through.
            let width = self.width.load(std::sync::atomic::Ordering::Relaxed).clamp(1, LINES_AT_ONCE);
            let claimed = self
                .store
                .webhooks()
                .lease(&self.endpoint.id, width, lease_ms, self.endpoint.attempts_max, self.endpoint.breaker)
                .await?;
            if claimed.is_empty() {
                return Ok(delivered);
            }
            let sent = futures_util::future::join_all(claimed.iter().map(|d| self.send(d))).await;
            let mut all_ok = true;
            for ok in sent {
                if ok? {
                    delivered += 1;
                } else {
                    all_ok = false;
                }
            }
            let next = if all_ok { (width * 2).min(LINES_AT_ONCE) } else { 1 };
            self.width.store(next, std::sync::atomic::Ordering::Relaxed);
        }
    }

    async fn send(&self, d: &Delivery) -> Result<bool, StoreError> {
        let token = d.lease_token.clone().ok_or_else(|| StoreError::internal("claimed delivery without a lease"))?;
        let body = event_body(&d.event);
        let now_s = self.store.now().micros().div_euclid(1_000_000);
        let sig = signature::sign(&self.endpoint.secret, now_s, &body);
        let sent = self
            .http
            .post(&self.endpoint.url)
            .header("content-type", "application/json")
            .header("settle-webhook-id", &self.endpoint.id)
            .header("settle-event-seq", d.event.seq.to_string())
            .header("settle-event-epoch", d.event.epoch.to_string())
            .header("settle-signature", sig)
            .body(body)
            .send()
            .await;
        let report = match sent {
            Ok(resp) if resp.status().is_success() => DeliveryReport::Delivered { status: resp.status().as_u16() },
            Ok(resp) => self.failed(d, Some(resp.status().as_u16()), format!("receiver answered {}", resp.status())),
            Err(e) if e.is_timeout() => {
                let ms = self.endpoint.timeout.as_millis();
                self.failed(d, None, format!("send failed: the receiver did not answer; timed out after {ms} ms"))
            }
            Err(e) => self.failed(d, None, format!("send failed: {}", send_error(e))),
        };
        let ok = matches!(report, DeliveryReport::Delivered { .. });
        if !self.store.webhooks().report(&self.endpoint.id, d.event.seq, &token, report, self.endpoint.breaker).await? {
            tracing::warn!(endpoint = %self.endpoint.id, seq = d.event.seq, "webhook lease lost before the report");
        }
        Ok(ok)
    }

    fn failed(&self, d: &Delivery, status: Option<u16>, error: String) -> DeliveryReport {
        let delay = {
            let mut rng = self.rng.lock().expect("rng lock");
            self.endpoint.backoff.delay_ms(d.attempts, &mut rng)
        };
        DeliveryReport::Failed {
            status,
            error,
            retry_at: self.store.now().plus_millis(delay),
            attempts_max: self.endpoint.attempts_max,
        }
    }

    /// Runs passes until `cancel`, woken early by commits.
    pub async fn run(self, cancel: CancellationToken) {
        let wake = self.store.events_wake();
        loop {
            let notified = wake.notified();
            tokio::pin!(notified);
            notified.as_mut().enable();
            if let Err(e) = self.pass_until(&cancel).await {
                tracing::warn!(endpoint = %self.endpoint.id, error = %e, "webhook pass failed; will try again");
            }
            tokio::select! {
                _ = cancel.cancelled() => return,
                _ = &mut notified => {}
                _ = tokio::time::sleep(self.every) => {}
            }
        }
    }
}
