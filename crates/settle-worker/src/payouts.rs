//! Payouts (spec §4, docs/design/payouts.md): the provider adapter (`provider-v1`) and the payout
//! rail of the processor (`crate::processor`, written once for every rail).
//!
//! The processor asks the provider whether the withdrawal's idempotency key exists before it sends,
//! and sends only after it has renewed its lease and marked the attempt as sending. A send without
//! an answer is `unknown`; the reconcile pass asks about it (found → succeeded; absent after the
//! confirm window → `TIMEOUT_CONFIRMED_NOT_SENT`, retried with the same key; no answer → stays).

pub use crate::http::HttpProviderConfig;
pub use crate::processor::{AttemptEnd, Lookup, Sent};
use crate::processor::{Processor, ProcessorSettings, Rail};
use async_trait::async_trait;
use settle_core::Timestamp;
use settle_core::ids::{FailCode, JobId, WorkerName};
use settle_core::job::JobState;
use settle_store::{
    ClaimedJob, FailSignal, Heartbeat, Job, LeaseToken, Outcome, Page, Paged, ReturnSource, Store, StoreError,
    Withdrawal, WithdrawalFilter,
};
use std::sync::Arc;

/// The payout provider. `HttpProvider` speaks `provider-v1`; tests may put anything behind it.
#[async_trait]
pub trait Provider: Send + Sync {
    async fn lookup(&self, key: &str) -> Lookup;
    async fn send(&self, key: &str, destination: &str, amount: i64) -> Sent;
}

/// Codes a provider's error answer may carry that mean "not executed" (provider-v1). `TIMEOUT` is
/// not one of them: a provider that timed out itself does not know either (docs/decisions/0010).
pub const DEFINITIVE_CODES: [&str; 4] = ["INSUFFICIENT", "INVALID_ADDRESS", "NODE_DOWN", "RATE_LIMITED"];

/// `provider-v1` over HTTP: one reused client, explicit timeouts, no redirects.
pub struct HttpProvider {
    client: crate::http::Client,
}

impl HttpProvider {
    pub fn new(config: &HttpProviderConfig) -> Result<HttpProvider, String> {
        Ok(HttpProvider { client: crate::http::Client::new(config)? })
    }
}

#[async_trait]
impl Provider for HttpProvider {
    async fn lookup(&self, key: &str) -> Lookup {
        let a = match self.client.get(&format!("/v1/transactions/{key}")).await {
            Ok(a) => a,
            Err(message) => return Lookup::Failed { message },
        };
        if !(200..=299).contains(&a.status) {
            return crate::http::not_found(&a);
        }
        let Some(id) = crate::http::id_of(&a, "txid") else {
            return Lookup::Failed { message: format!("a {} answer without a txid", a.status) };
        };
        // A status that is there must be one the protocol knows; anything else is not an answer.
        match crate::http::status_of(&a).as_deref() {
            None | Some("executed") => Lookup::Found { id, returned: false },
            Some("returned") => Lookup::Found { id, returned: true },
            Some(s) => Lookup::Failed { message: format!("unknown transfer status {s:?}") },
        }
    }

    async fn send(&self, key: &str, destination: &str, amount: i64) -> Sent {
        let body = serde_json::json!({ "key": key, "destination": destination, "amount": amount });
        self.client.send("/v1/transactions", &body, "txid", &DEFINITIVE_CODES).await
    }
}

/// The processing settings of a rail (`PayoutSettings` by its first name).
pub type PayoutSettings = ProcessorSettings;

/// The payout processor: the processor on the payout rail.
pub type PayoutProcessor = Processor<PayoutRail>;

impl PayoutProcessor {
    pub fn new(
        store: Arc<dyn Store>,
        provider: Arc<dyn Provider>,
        worker: WorkerName,
        settings: PayoutSettings,
    ) -> PayoutProcessor {
        Processor::on(store, PayoutRail { provider }, worker, settings)
    }
}

/// Withdrawals through a payout provider.
pub struct PayoutRail {
    provider: Arc<dyn Provider>,
}

#[async_trait]
impl Rail for PayoutRail {
    type Row = Withdrawal;
    const WHAT: &'static str = "payout";
    const RETURNS: bool = true;

    fn job(row: &Withdrawal) -> &Job {
        &row.job
    }
    fn key(row: &Withdrawal) -> &str {
        &row.idempotency_key
    }
    fn provider_id(row: &Withdrawal) -> Option<&str> {
        row.provider_txid.as_deref()
    }
    /// The kind's configured codes decide (`[kinds.withdrawal]`).
    fn retryable(_: &FailCode) -> Option<bool> {
        None
    }
    async fn claim(&self, store: &dyn Store, worker: &WorkerName, limit: u32) -> Result<Vec<ClaimedJob>, StoreError> {
        store.payouts().claim_payouts(worker, limit).await
    }
    async fn read(&self, store: &dyn Store, id: &JobId) -> Result<Withdrawal, StoreError> {
        store.payouts().withdrawal(id).await
    }
    async fn list(
        &self,
        store: &dyn Store,
        state: JobState,
        updated_since: Option<Timestamp>,
        page: Page,
    ) -> Result<Paged<Withdrawal>, StoreError> {
        let filter = WithdrawalFilter { state: Some(state), updated_since, ..WithdrawalFilter::default() };
        store.payouts().withdrawals(&filter, page).await
    }
    async fn heartbeat(&self, store: &dyn Store, id: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError> {
        store.payouts().payout_heartbeat(id, token).await
    }
    async fn lookup(&self, key: &str) -> Lookup {
        self.provider.lookup(key).await
    }
    async fn send(&self, w: &Withdrawal) -> Sent {
        self.provider.send(&w.idempotency_key, &w.destination, w.amount.get()).await
    }
    async fn succeeded(
        &self,
        store: &dyn Store,
        id: &JobId,
        token: Option<&LeaseToken>,
        found: &str,
        returned: bool,
    ) -> Result<Outcome<Withdrawal>, StoreError> {
        store.payouts().payout_succeeded(id, token, found, returned).await
    }
    async fn failed(&self, store: &dyn Store, id: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError> {
        store.payouts().payout_failed(id, signal).await
    }
    async fn unknown(
        &self,
        store: &dyn Store,
        id: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError> {
        store.payouts().payout_unknown(id, token, message).await
    }
    async fn returned(&self, store: &dyn Store, id: &JobId) -> Result<bool, StoreError> {
        let out = store.payouts().payout_returned(id, ReturnSource::Provider, settle_store::SYSTEM_ACTOR).await?;
        Ok(out.applied)
    }
}
