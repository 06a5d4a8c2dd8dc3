//! The wire types of API v1 (`../shared/spec/api-v1.md`): the only place that knows JSON.
//! Requests deny unknown fields; money is `i64`; times are RFC 3339 UTC strings.

use serde::{Deserialize, Serialize};
use settle_core::Timestamp;
use settle_store as store;
use utoipa::ToSchema;

pub fn rfc3339(t: Timestamp) -> String {
    t.rfc3339()
}

pub fn parse_rfc3339(s: &str) -> Option<Timestamp> {
    Timestamp::parse_rfc3339(s)
}

// ----- accounts and ledger -----------------------------------------------------------------------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAccount {
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    #[serde(default)]
    #[schema(minimum = 0)]
    pub overdraft_limit: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Account {
    pub id: String,
    pub balance: i64,
    pub overdraft_limit: i64,
    pub created_at: String,
}

impl From<store::Account> for Account {
    fn from(a: store::Account) -> Account {
        Account {
            id: a.id.to_string(),
            balance: a.balance.get(),
            overdraft_limit: a.overdraft_limit.get(),
            created_at: rfc3339(a.created_at),
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateGrant {
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// Greater than zero.
    #[schema(minimum = 1)]
    pub amount: i64,
    #[serde(default)]
    pub reason: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAdjustment {
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// Not zero.
    pub amount: i64,
    #[schema(min_length = 1)]
    pub reason: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LedgerEntry {
    pub seq: i64,
    pub account_id: String,
    /// `grant`, `charge`, `refund`, `reclaim`, `adjustment`.
    pub kind: String,
    pub amount: i64,
    pub balance_after: i64,
    pub job_id: Option<String>,
    pub item_id: Option<String>,
    /// The grant's or adjustment's id.
    pub id: Option<String>,
    pub reason: Option<String>,
    pub created_at: String,
    /// Hex SHA-256 of this entry chained to the account's previous one.
    pub hash: String,
}

impl From<store::LedgerEntry> for LedgerEntry {
    fn from(e: store::LedgerEntry) -> LedgerEntry {
        LedgerEntry {
            seq: e.seq,
            account_id: e.account_id,
            kind: e.kind.as_str().to_owned(),
            amount: e.amount.get(),
            balance_after: e.balance_after.get(),
            job_id: e.job_id,
            item_id: e.item_id,
            id: e.ref_id,
            reason: e.reason,
            created_at: rfc3339(e.created_at),
            hash: hex::encode(e.hash),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LedgerPage {
    pub entries: Vec<LedgerEntry>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
}

// ----- jobs ------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewItem {
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    #[schema(minimum = 0)]
    pub cost: i64,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateJob {
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub account_id: String,
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub kind: String,
    /// A single-item job (item `main`). Exactly one of `cost` and `items`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub cost: Option<i64>,
    #[serde(default)]
    pub items: Option<Vec<NewItem>>,
    /// Any JSON, handed to the worker.
    #[serde(default)]
    pub payload: Option<serde_json::Value>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub max_attempts: Option<u32>,
    /// `failure` (default) or `final_failure`.
    #[serde(default)]
    #[schema(pattern = r"^(failure|final_failure)$")]
    pub refund_on: Option<String>,
    /// RFC 3339; not claimable before.
    #[serde(default)]
    pub not_before: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Item {
    pub id: String,
    pub cost: i64,
    /// `charged`, `succeeded`, `refunded`, `reclaimed`, `cancelled`, `returned` (a withdrawal paid out
    /// and sent back).
    pub state: String,
    pub is_refunded: bool,
    pub is_reclaimed: bool,
    /// `job_failed`, `item_failed`, `cancelled`.
    pub refund_reason: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LastError {
    pub code: String,
    pub message: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Job {
    pub id: String,
    pub account_id: String,
    pub kind: String,
    /// `queued`, `running`, `unknown`, `cancelling`, `succeeded`, `dead`, `cancelled`, and for
    /// withdrawals `returned`.
    pub state: String,
    pub cost: i64,
    /// Sum of the job's ledger entries (≤ 0).
    pub net: i64,
    pub attempt: u32,
    pub max_attempts: u32,
    pub refund_on: String,
    pub cancel_requested: bool,
    pub not_before: String,
    pub last_error: Option<LastError>,
    pub items: Vec<Item>,
    pub payload: serde_json::Value,
    /// What the worker's success carried.
    pub result: Option<serde_json::Value>,
    pub created_at: String,
    pub updated_at: String,
}

fn json_text(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or(serde_json::Value::Null)
}

impl From<store::Job> for Job {
    fn from(j: store::Job) -> Job {
        Job {
            id: j.id,
            account_id: j.account_id,
            kind: j.kind,
            state: j.state.as_str().to_owned(),
            cost: j.cost.get(),
            net: j.net.get(),
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            refund_on: j.refund_on.as_str().to_owned(),
            cancel_requested: j.cancel_requested,
            not_before: rfc3339(j.not_before),
            last_error: j.last_error.map(|e| LastError { code: e.code, message: e.message }),
            items: j
                .items
                .into_iter()
                .map(|i| Item {
                    id: i.id,
                    cost: i.cost.get(),
                    state: i.state.as_str().to_owned(),
                    is_refunded: i.state.is_refunded(),
                    is_reclaimed: i.state.is_reclaimed(),
                    refund_reason: i.refund_reason,
                })
                .collect(),
            payload: json_text(&j.payload),
            result: j.result.as_deref().map(json_text),
            created_at: rfc3339(j.created_at),
            updated_at: rfc3339(j.updated_at),
        }
    }
}

// ----- withdrawals -----------------------------------------------------------------------------------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWithdrawal {
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub account_id: String,
    /// Greater than zero; held (charged) at once, refunded only if the payout is definitively not made.
    #[schema(minimum = 1)]
    pub amount: i64,
    /// Where the payout goes: 1-256 printable ASCII characters, not starting or ending with a space.
    #[schema(pattern = r"^[!-~]([ -~]{0,254}[!-~])?$", min_length = 1, max_length = 256)]
    pub destination: String,
}

/// A withdrawal: its job (kind `withdrawal`, `refund_on = final_failure`) and the payout's own fields.
#[derive(Debug, Serialize, ToSchema)]
pub struct Withdrawal {
    #[serde(flatten)]
    pub job: Job,
    pub amount: i64,
    pub destination: String,
    /// Made once at creation; every attempt looks up and sends with it.
    pub idempotency_key: String,
    /// The provider's id of the transfer, once known.
    pub provider_txid: Option<String>,
    /// When the payout was recorded as returned.
    pub returned_at: Option<String>,
}

impl From<store::Withdrawal> for Withdrawal {
    fn from(w: store::Withdrawal) -> Withdrawal {
        Withdrawal {
            job: w.job.into(),
            amount: w.amount.get(),
            destination: w.destination,
            idempotency_key: w.idempotency_key,
            provider_txid: w.provider_txid,
            returned_at: w.returned_at.map(rfc3339),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WithdrawalPage {
    pub withdrawals: Vec<Withdrawal>,
    pub next_after: Option<i64>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct WithdrawalsQuery {
    pub after: Option<i64>,
    pub limit: Option<u32>,
    pub state: Option<String>,
    pub account_id: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobPage {
    pub jobs: Vec<Job>,
    pub next_after: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Attempt {
    pub attempt_no: u32,
    pub worker: String,
    pub started_at: String,
    pub finished_at: Option<String>,
    /// `succeeded`, `failed`, `lease_expired`, `unknown`, `cancelled`, `superseded`; null while open.
    pub result: Option<String>,
    pub fail_code: Option<String>,
    pub message: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Attempts {
    pub attempts: Vec<Attempt>,
}

// ----- worker protocol -------------------------------------------------------------------------------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    #[schema(pattern = r"^[A-Za-z0-9_.:@/-]{1,128}$")]
    pub worker: String,
    #[serde(default)]
    pub kinds: Option<Vec<String>>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 1, maximum = 3600)]
    pub lease_seconds: Option<u32>,
    #[serde(default)]
    #[schema(minimum = 0, maximum = 30)]
    pub wait_seconds: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimedJob {
    #[serde(flatten)]
    pub job: Job,
    pub lease_token: String,
    pub lease_expires_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Claimed {
    pub jobs: Vec<ClaimedJob>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseOnly {
    pub lease_token: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Heartbeat {
    pub lease_expires_at: String,
    pub cancel_requested: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Succeed {
    #[serde(default)]
    pub lease_token: Option<String>,
    #[serde(default)]
    pub result: Option<serde_json::Value>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Fail {
    pub lease_token: String,
    #[schema(pattern = r"^[A-Z0-9_]{1,64}$")]
    pub code: String,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub retryable: Option<bool>,
    /// Overrides the backoff for this retry (a 429 with Retry-After).
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Unknown {
    pub lease_token: String,
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ItemFail {
    pub lease_token: String,
    #[schema(pattern = r"^[A-Z0-9_]{1,64}$")]
    pub code: String,
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ItemReport {
    pub item: Item,
    pub cancel_requested: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterArtifact {
    pub lease_token: String,
    pub key: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Artifact {
    pub job_id: String,
    pub item_id: String,
    pub key: String,
}

// ----- failures, events, audit ------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
pub struct FailureCount {
    pub code: String,
    /// `dead`, `unknown` or `retrying`.
    pub state: String,
    pub count: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FailureSummary {
    pub by_code: Vec<FailureCount>,
}

/// The schema of an event envelope. Answers serialize `settle_store::EventEnvelope` itself — the
/// same value, byte for byte, that a webhook delivery sends.
#[derive(Debug, Serialize, ToSchema)]
pub struct Event {
    pub seq: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub job_id: Option<String>,
    pub account_id: String,
    pub data: serde_json::Value,
    pub created_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventPage {
    #[schema(value_type = Vec<Event>)]
    pub events: Vec<store::EventEnvelope>,
    pub next_after: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Violation {
    /// `L1` … `L4`, or `SEQ`.
    pub invariant: String,
    pub account_id: Option<String>,
    pub job_id: Option<String>,
    pub item_id: Option<String>,
    pub message: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Audit {
    pub ok: bool,
    pub accounts_checked: u64,
    pub items_checked: u64,
    pub entries_checked: u64,
    pub violations: Vec<Violation>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    pub status: String,
}

/// Paging and filters, from the query string.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    /// The `next_after` of the previous page.
    pub after: Option<i64>,
    /// 1 to 1000, default 100.
    pub limit: Option<u32>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct JobsQuery {
    pub after: Option<i64>,
    pub limit: Option<u32>,
    pub state: Option<String>,
    pub kind: Option<String>,
    pub account_id: Option<String>,
    pub fail_code: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    pub after: Option<i64>,
    pub limit: Option<u32>,
    /// Long-poll: wait up to this many seconds (at most 30) for an event after `after`.
    pub wait_seconds: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookDelivery {
    pub endpoint_id: String,
    #[schema(value_type = Event)]
    pub event: store::EventEnvelope,
    /// `pending`, `delivered`, `dead`.
    pub state: String,
    pub attempts: u32,
    pub next_attempt_at: String,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub delivered_at: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RequeuedDeliveries {
    /// How many dead deliveries were put back in line; call again while it is 1000.
    pub requeued: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookDeliveryPage {
    pub deliveries: Vec<WebhookDelivery>,
    pub next_after: Option<i64>,
    /// Every endpoint's circuit breaker (all endpoints, whatever the page's filter).
    pub endpoints: Vec<WebhookBreaker>,
}

/// A webhook endpoint's circuit breaker (docs/design/webhooks.md).
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookBreaker {
    pub endpoint_id: String,
    /// `closed` (sending), `open` (paused until `next_probe_at`) or `half_open` (one probe in flight).
    pub breaker: String,
    /// Consecutive failed sends while closed.
    pub failures: i64,
    /// Consecutive openings without a delivered send between them; each doubles the pause.
    pub opens: i64,
    /// When an open breaker lets its next probe through (RFC 3339).
    pub next_probe_at: Option<String>,
}

impl From<store::BreakerStatus> for WebhookBreaker {
    fn from(b: store::BreakerStatus) -> WebhookBreaker {
        let open = b.state != "closed";
        WebhookBreaker {
            endpoint_id: b.endpoint_id,
            breaker: b.state,
            failures: b.failures,
            opens: b.opens,
            next_probe_at: b.next_probe_at.filter(|_| open).map(rfc3339),
        }
    }
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesQuery {
    pub after: Option<i64>,
    pub limit: Option<u32>,
    pub endpoint: Option<String>,
    /// `pending`, `delivered` or `dead`.
    pub state: Option<String>,
}

impl From<store::Delivery> for WebhookDelivery {
    fn from(d: store::Delivery) -> WebhookDelivery {
        WebhookDelivery {
            endpoint_id: d.endpoint_id,
            event: d.event.envelope(),
            state: d.state,
            attempts: d.attempts,
            next_attempt_at: rfc3339(d.next_attempt_at),
            last_status: d.last_status,
            last_error: d.last_error,
            delivered_at: d.delivered_at.map(rfc3339),
        }
    }
}
