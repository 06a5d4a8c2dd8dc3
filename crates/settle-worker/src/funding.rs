//! Top-ups (spec §4a, docs/design/money-controls.md §4): the funding provider adapter (`funding-v1`)
//! and the funding rail of the processor (`crate::processor`, the payout processor's loop).
//!
//! Before every charge the processor asks the provider for the top-up's idempotency key; it charges
//! only after it has renewed its lease and marked the attempt as charging. A declined charge
//! (`CARD_DECLINED`, `INSUFFICIENT_FUNDS`, `NO_PAYMENT_METHOD`) kills the top-up at once; a charge
//! without an answer is `unknown`, never charged again blind: the reconcile pass asks (found →
//! succeeded and granted; absent after the confirm window → `TIMEOUT_CONFIRMED_NOT_CHARGED`, retried
//! with the same key; no answer → stays unknown).

pub use crate::http::HttpProviderConfig;
use crate::processor::{Lookup, Processor, ProcessorSettings, Rail, Sent};
use async_trait::async_trait;
use settle_core::Timestamp;
use settle_core::ids::{FailCode, JobId, WorkerName};
use settle_core::job::JobState;
use settle_store::{
    ClaimedJob, FailSignal, Heartbeat, Job, LeaseToken, Outcome, Page, Paged, Store, StoreError, TopUp, TopUpFilter,
};
use std::sync::Arc;

/// The funding provider. `HttpFunding` speaks `funding-v1`; tests may put anything behind it.
#[async_trait]
pub trait FundingProvider: Send + Sync {
    async fn lookup(&self, key: &str) -> Lookup;
    async fn charge(&self, key: &str, customer: &str, amount: i64, currency: &str) -> Sent;
}

/// Codes of a refused charge (funding-v1): nothing was charged.
pub const DEFINITIVE_CODES: [&str; 5] =
    ["CARD_DECLINED", "INSUFFICIENT_FUNDS", "NO_PAYMENT_METHOD", "PROCESSOR_DOWN", "RATE_LIMITED"];
/// Of those, the ones worth another attempt (with the same key); the others are the customer's to
/// mend, and end the top-up.
pub const RETRYABLE_CODES: [&str; 3] = ["PROCESSOR_DOWN", "RATE_LIMITED", "UNAVAILABLE"];

/// `funding-v1` over HTTP: one reused client, explicit timeouts, no redirects.
pub struct HttpFunding {
    client: crate::http::Client,
}

impl HttpFunding {
    pub fn new(config: &HttpProviderConfig) -> Result<HttpFunding, String> {
        Ok(HttpFunding { client: crate::http::Client::new(config)? })
    }
}

#[async_trait]
impl FundingProvider for HttpFunding {
    async fn lookup(&self, key: &str) -> Lookup {
        let a = match self.client.get(&format!("/v1/charges/{key}")).await {
            Ok(a) => a,
            Err(message) => return Lookup::Failed { message },
        };
        if !(200..=299).contains(&a.status) {
            return crate::http::not_found(&a);
        }
        match crate::http::id_of(&a, "charge_id") {
            Some(id) => Lookup::Found { id, returned: false },
            None => Lookup::Failed { message: format!("a {} answer without a charge_id", a.status) },
        }
    }

    async fn charge(&self, key: &str, customer: &str, amount: i64, currency: &str) -> Sent {
        let body = serde_json::json!({ "key": key, "customer": customer, "amount": amount, "currency": currency });
        self.client.send("/v1/charges", &body, "charge_id", &DEFINITIVE_CODES).await
    }
}

/// The funding processor: the processor on the funding rail.
pub type FundingProcessor = Processor<FundingRail>;

impl FundingProcessor {
    pub fn new(
        store: Arc<dyn Store>,
        provider: Arc<dyn FundingProvider>,
        worker: WorkerName,
        settings: ProcessorSettings,
    ) -> FundingProcessor {
        Processor::on(store, FundingRail { provider }, worker, settings)
    }
}

/// Top-ups through a funding provider.
pub struct FundingRail {
    provider: Arc<dyn FundingProvider>,
}

#[async_trait]
impl Rail for FundingRail {
    type Row = TopUp;
    const WHAT: &'static str = "top-up";
    const RETURNS: bool = false;

    fn job(row: &TopUp) -> &Job {
        &row.job
    }
    fn key(row: &TopUp) -> &str {
        &row.idempotency_key
    }
    fn provider_id(row: &TopUp) -> Option<&str> {
        row.provider_charge_id.as_deref()
    }
    /// The protocol says: a decline is final, a provider that is down or busy is tried again.
    fn retryable(code: &FailCode) -> Option<bool> {
        Some(RETRYABLE_CODES.contains(&code.as_str()))
    }
    async fn claim(&self, store: &dyn Store, worker: &WorkerName, limit: u32) -> Result<Vec<ClaimedJob>, StoreError> {
        store.funding().claim_top_ups(worker, limit).await
    }
    async fn read(&self, store: &dyn Store, id: &JobId) -> Result<TopUp, StoreError> {
        store.funding().top_up(id).await
    }
    async fn list(
        &self,
        store: &dyn Store,
        state: JobState,
        updated_since: Option<Timestamp>,
        page: Page,
    ) -> Result<Paged<TopUp>, StoreError> {
        let filter = TopUpFilter { state: Some(state), updated_since, ..TopUpFilter::default() };
        store.funding().top_ups(&filter, page).await
    }
    async fn heartbeat(&self, store: &dyn Store, id: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError> {
        store.funding().top_up_heartbeat(id, token).await
    }
    async fn lookup(&self, key: &str) -> Lookup {
        self.provider.lookup(key).await
    }
    async fn send(&self, t: &TopUp) -> Sent {
        self.provider.charge(&t.idempotency_key, &t.customer, t.price, &t.currency).await
    }
    async fn succeeded(
        &self,
        store: &dyn Store,
        id: &JobId,
        token: Option<&LeaseToken>,
        found: &str,
        _returned: bool,
    ) -> Result<Outcome<TopUp>, StoreError> {
        store.funding().top_up_succeeded(id, token, found).await
    }
    async fn failed(&self, store: &dyn Store, id: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError> {
        store.funding().top_up_failed(id, signal).await
    }
    async fn unknown(
        &self,
        store: &dyn Store,
        id: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError> {
        store.funding().top_up_unknown(id, token, message).await
    }
    /// A charge does not come back (refunds of top-ups are outside the contract).
    async fn returned(&self, _store: &dyn Store, _id: &JobId) -> Result<bool, StoreError> {
        Ok(false)
    }
}
