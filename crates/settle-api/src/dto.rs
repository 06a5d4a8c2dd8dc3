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
    /// The account's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
    /// idempotent.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// How far below zero charges may take the balance, in credits (minor units); 0 (the default) to 2^61.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub overdraft_limit: Option<i64>,
    /// The most of the account's jobs that may run at once (0 to 10,000; absent or null: no cap). A
    /// claim never takes a job that would put the account over it.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 10000)]
    pub max_running: Option<i64>,
}

/// `PATCH /v1/accounts/{id}`: each field given is set, the others kept.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct UpdateAccount {
    /// How far below zero charges may take the balance, in credits; 0 to 2^61. Lowering it below
    /// what the balance already owes refuses further charges; it moves no credits.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub overdraft_limit: Option<i64>,
    /// The account's cap on running jobs, 0 to 10,000; `null` removes the cap. Lowered below what
    /// runs now, running jobs finish and nothing new starts until the account is below it.
    #[serde(default, deserialize_with = "present")]
    #[schema(value_type = Option<i64>, minimum = 0, maximum = 10000)]
    pub max_running: Option<Option<i64>>,
}

/// `PUT /v1/accounts/{id}/alerts`: the account's whole set of alerts.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutAlerts {
    /// At most 16; an empty list removes them all.
    pub alerts: Vec<NewAlert>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewAlert {
    /// The alert's name, unique on the account (the id charset, 1–128 characters).
    pub id: String,
    /// The threshold in credits, 1 to 2^61: `account.balance_low` when a posting takes the balance
    /// from at or above it to under it, `account.balance_recovered` back.
    #[schema(minimum = 1)]
    pub below: i64,
}

/// An account's alerts, in threshold order.
#[derive(Debug, Serialize, ToSchema)]
pub struct AlertList {
    /// The account's alerts, lowest threshold first (ties by id).
    pub alerts: Vec<Alert>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Alert {
    /// The alert's name, unique on the account.
    pub id: String,
    /// The threshold in credits.
    pub below: i64,
    /// `above` (the balance is at or above `below`) or `below`.
    pub side: String,
}

impl From<Vec<store::Alert>> for AlertList {
    fn from(alerts: Vec<store::Alert>) -> AlertList {
        AlertList {
            alerts: alerts
                .into_iter()
                .map(|a| Alert { id: a.id, below: a.below, side: a.side.as_str().to_owned() })
                .collect(),
        }
    }
}

/// `PUT /v1/accounts/{id}/limits`: the account's whole set of spend limits.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutLimits {
    /// At most 16; an empty list removes them all.
    pub limits: Vec<NewLimit>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewLimit {
    /// `day` (a UTC day) or `month` (a UTC calendar month).
    pub period: String,
    /// The most the period's spend may reach through creates, in credits, 1 to 2^61.
    #[schema(minimum = 1)]
    pub amount: i64,
    /// The job kinds it counts (at most 16, unique); absent or empty: every kind but
    /// `withdrawal`, which counts only when named.
    #[serde(default)]
    pub kinds: Vec<String>,
}

/// An account's spend limits, in the order they were put.
#[derive(Debug, Serialize, ToSchema)]
pub struct LimitList {
    /// The account's limits.
    pub limits: Vec<SpendLimit>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SpendLimit {
    /// `day` or `month` (UTC).
    pub period: String,
    /// The most the period's spend may reach through creates.
    pub amount: i64,
    /// The job kinds it counts; empty: every kind but `withdrawal`.
    pub kinds: Vec<String>,
    /// What the current period spent: charges, holds and reclaims posted in it, less the refunds,
    /// releases and payout returns posted in it (negative when refunds of an earlier period's
    /// charges came back in it).
    pub spent: i64,
    /// When the next period starts (RFC 3339, UTC).
    pub resets_at: String,
}

impl From<Vec<store::SpendLimit>> for LimitList {
    fn from(limits: Vec<store::SpendLimit>) -> LimitList {
        LimitList {
            limits: limits
                .into_iter()
                .map(|l| SpendLimit {
                    period: l.period.as_str().to_owned(),
                    amount: l.amount,
                    kinds: l.kinds,
                    spent: l.spent,
                    resets_at: l.resets_at.rfc3339(),
                })
                .collect(),
        }
    }
}

/// A field that may be given as `null`: absent is `None`, `null` is `Some(None)`.
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Option<i64>>, D::Error> {
    Option::<i64>::deserialize(d).map(Some)
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Account {
    /// The account's id.
    pub id: String,
    /// The balance in credits (minor units, signed 64-bit): the sum of the account's ledger entries.
    pub balance: i64,
    /// How far below zero charges may take the balance, in credits.
    pub overdraft_limit: i64,
    /// The most of the account's jobs that may run at once; null: no cap.
    pub max_running: Option<i64>,
    /// When the account was created (RFC 3339 UTC time).
    pub created_at: String,
}

impl From<store::Account> for Account {
    fn from(a: store::Account) -> Account {
        Account {
            id: a.id.to_string(),
            balance: a.balance.get(),
            overdraft_limit: a.overdraft_limit.get(),
            max_running: a.max_running,
            created_at: rfc3339(a.created_at),
        }
    }
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateGrant {
    /// The grant's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
    /// idempotent.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// Credits to add (minor units): greater than zero; the balance stays within ±2^61.
    #[schema(minimum = 1)]
    pub amount: i64,
    /// Why, for people reading the ledger: up to 2,000 bytes.
    #[serde(default)]
    pub reason: Option<String>,
    /// When what is left of the grant expires (RFC 3339, after now); absent: never. At that instant
    /// the rest is taken by one `expire` entry, and credits given back to it later expire at once.
    #[serde(default)]
    pub expires_at: Option<String>,
    /// 0–100, default 50: charges take from the lowest priority first, then the soonest expiry
    /// (never-expiring last), then the oldest grant.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 100)]
    pub priority: Option<i64>,
}

/// A source of an account's credit: a grant, a positive adjustment, or the balance the account had
/// before grants were tracked (`origin` `opening`, its id the account's).
#[derive(Debug, Serialize, ToSchema)]
pub struct Grant {
    /// The grant's (or adjustment's) id.
    pub id: String,
    /// `grant`, `adjustment` or `opening`.
    pub origin: String,
    /// Credits it gave.
    pub amount: i64,
    /// Credits it has left to spend (0 once expired).
    pub remaining: i64,
    /// RFC 3339; null: never expires.
    pub expires_at: Option<String>,
    /// 0–100, lower spent first.
    pub priority: i64,
    /// `active`, `used` (nothing left) or `expired` (from its expiry instant on).
    pub state: String,
    /// RFC 3339.
    pub created_at: String,
}

impl From<store::Grant> for Grant {
    fn from(g: store::Grant) -> Self {
        Grant {
            id: g.id,
            origin: g.origin,
            amount: g.amount.get(),
            remaining: g.remaining.get(),
            expires_at: g.expires_at.map(rfc3339),
            priority: g.priority,
            state: g.state.as_str().to_owned(),
            created_at: rfc3339(g.created_at),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct GrantList {
    /// In the order they were made.
    pub grants: Vec<Grant>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateAdjustment {
    /// The adjustment's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
    /// idempotent.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// Credits to add (positive) or take away (negative), in minor units; not zero.
    pub amount: i64,
    /// Why (required): 1 to 2,000 bytes.
    #[schema(min_length = 1)]
    pub reason: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LedgerEntry {
    /// The entry's number: unique, and increasing within its account in commit order (gaps
    /// allowed; no order across accounts). The ledger's `after` cursor.
    pub seq: i64,
    /// The entry's place in its account: 1, 2, 3, … without gaps, the order of its hash chain.
    pub account_seq: i64,
    /// The account the entry belongs to.
    pub account_id: String,
    /// `grant`, `adjustment`, `charge`, `refund`, `reclaim`, `payout_return`, `release` (what a held
    /// item's price did not use) or `expire` (what an expired grant had left, or a part given back to
    /// it after it expired).
    pub kind: String,
    /// Signed credits (minor units): charges, reclaims and expiries negative; grants, refunds,
    /// releases and returns positive.
    pub amount: i64,
    /// The account's balance right after this entry, in credits.
    pub balance_after: i64,
    /// The job the entry charges, refunds or reclaims; null for grants, adjustments and expiries.
    pub job_id: Option<String>,
    /// The job's item the entry moves; null for grants, adjustments and expiries.
    pub item_id: Option<String>,
    /// The grant's or adjustment's id; an expiry's grant (`{grant}#{account_seq}` for a part given
    /// back after the grant expired); null for job entries.
    pub id: Option<String>,
    /// Why: the grant's or adjustment's reason, or a refund's reason (`job_failed`, `item_failed`,
    /// `cancelled`).
    pub reason: Option<String>,
    /// When the entry was written (RFC 3339 UTC time).
    pub created_at: String,
    /// Hex SHA-256 of this entry chained to the account's previous entry (64 hex digits).
    pub hash: String,
}

impl From<store::LedgerEntry> for LedgerEntry {
    fn from(e: store::LedgerEntry) -> LedgerEntry {
        LedgerEntry {
            seq: e.seq,
            account_seq: e.account_seq,
            account_id: e.account_id.into(),
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
    /// Entries in `seq` order.
    pub entries: Vec<LedgerEntry>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
}

// ----- jobs ------------------------------------------------------------------------------------------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct NewItem {
    /// The item's id, unique within the job: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// The item's price in credits (minor units), 0 or more; charged when the job is created.
    /// Exactly one of `cost` and `hold`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub cost: Option<i64>,
    /// For an item priced by what the work used: credits held (charged) when the job is created,
    /// more than 0. The first success prices the item (`0 ≤ cost ≤ hold`) and releases the rest.
    /// Exactly one of `cost` and `hold`.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub hold: Option<i64>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateJob {
    /// The job's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
    /// idempotent.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// The account to charge.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub account_id: String,
    /// What kind of work (1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`); workers claim by kind.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub kind: String,
    /// A single-item job (item `main`) of this price in credits, 0 or more. Exactly one of `cost`,
    /// `hold` and `items`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub cost: Option<i64>,
    /// A single-item job (item `main`) priced by what the work used: credits held (charged) on
    /// creation, more than 0; the success says the price (at most the hold) and the rest is
    /// released. Exactly one of `cost`, `hold` and `items`.
    #[serde(default)]
    #[schema(minimum = 1)]
    pub hold: Option<i64>,
    /// The billable items, 1 to 1,000, each charged (or held) on creation. Exactly one of `cost`,
    /// `hold` and `items`.
    #[serde(default)]
    pub items: Option<Vec<NewItem>>,
    /// Any JSON, up to 256 KiB, handed to the worker as is.
    #[serde(default)]
    pub payload: Option<serde_json::Value>,
    /// How many attempts before the job is dead: 1 to 100 (default per kind, else 5).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub max_attempts: Option<u32>,
    /// `failure` (default: refund at every failure, reclaim on a late success) or `final_failure` (refund
    /// only when the job is dead).
    #[serde(default)]
    #[schema(pattern = r"^(failure|final_failure)$")]
    pub refund_on: Option<String>,
    /// Not claimable before this time (RFC 3339 UTC time); default now.
    #[serde(default)]
    pub not_before: Option<String>,
    /// 0 to 100, default 50: a lower number is claimed first. Within one priority, accounts take
    /// turns.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 100)]
    pub priority: Option<u8>,
    /// Labels a worker must have to claim it (`gpu:a100`, `region:eu`): at most 8, each 1-64
    /// characters of `[A-Za-z0-9_.:/=-]`.
    #[serde(default)]
    pub requires: Option<Vec<String>>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Item {
    /// The item's id within its job.
    pub id: String,
    /// The item's price in credits (minor units); null for a held item until a success prices it.
    pub cost: Option<i64>,
    /// What a held item holds (was charged at creation); null for a fixed-price item.
    pub hold: Option<i64>,
    /// `charged`, `succeeded`, `refunded`, `reclaimed`, `cancelled`, or `returned` (a withdrawal paid out
    /// and sent back).
    pub state: String,
    /// Whether the item's charge is refunded now (its net is 0).
    pub is_refunded: bool,
    /// Whether a refund of this item was taken back by a late success.
    pub is_reclaimed: bool,
    /// Why it was refunded: `job_failed`, `item_failed` or `cancelled`; null if never refunded.
    pub refund_reason: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct LastError {
    /// The fail code of the last failure (`A-Z0-9_`, 1-64 characters), e.g. `TIMEOUT`, `LEASE_EXPIRED`.
    pub code: String,
    /// The failure's message, up to 2,000 bytes.
    pub message: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Job {
    /// The job's id.
    pub id: String,
    /// The account charged.
    pub account_id: String,
    /// The kind of work.
    pub kind: String,
    /// `queued`, `running`, `unknown`, `cancelling`, `succeeded`, `dead`, `cancelled`, and for withdrawals
    /// `returned`.
    pub state: String,
    /// The sum of its items' prices, in credits (minor units); null while a held item is unpriced.
    pub cost: Option<i64>,
    /// The sum of its held items' holds; null when it has none.
    pub hold: Option<i64>,
    /// The sum of the job's ledger entries, in credits (≤ 0): what the job costs the account now.
    pub net: i64,
    /// How many attempts have started (0 before the first claim).
    pub attempt: u32,
    /// Attempts allowed before the job is dead (1 to 100); a requeue gives a fresh budget.
    pub max_attempts: u32,
    /// `failure` or `final_failure`.
    pub refund_on: String,
    /// A cancel was requested while the job was running; its worker stops at the next item boundary.
    pub cancel_requested: bool,
    /// Not claimable before this time (RFC 3339 UTC time); a retry's backoff moves it.
    pub not_before: String,
    /// 0 to 100: a lower number is claimed first.
    pub priority: u8,
    /// The labels a worker must have to claim it, sorted.
    pub requires: Vec<String>,
    /// The last failure, if any.
    pub last_error: Option<LastError>,
    /// The job's items, in the order they were given.
    pub items: Vec<Item>,
    /// The JSON given at creation.
    pub payload: serde_json::Value,
    /// What the worker's success carried (any JSON); null before success.
    pub result: Option<serde_json::Value>,
    /// When the job was created (RFC 3339 UTC time).
    pub created_at: String,
    /// When the job last changed (RFC 3339 UTC time).
    pub updated_at: String,
}

impl From<store::Item> for Item {
    fn from(i: store::Item) -> Item {
        Item {
            cost: i.priced_cost().map(|c| c.get()),
            hold: i.hold.map(|h| h.get()),
            is_refunded: i.state.is_refunded(),
            is_reclaimed: i.state.is_reclaimed(),
            id: i.id.into(),
            state: i.state.as_str().to_owned(),
            refund_reason: i.refund_reason.map(|r| r.as_str().to_owned()),
        }
    }
}

/// The sum of the items' prices; null while one is unpriced. Within i64: each is at most what
/// create took, and their total was checked there.
fn job_cost(items: &[store::Item]) -> Option<i64> {
    items.iter().map(|i| i.priced_cost().map(|c| c.get())).sum()
}

/// The sum of the held items' holds; null when none is held.
fn job_hold(items: &[store::Item]) -> Option<i64> {
    let holds: Vec<i64> = items.iter().filter_map(|i| i.hold.map(|h| h.get())).collect();
    (!holds.is_empty()).then(|| holds.iter().sum())
}

fn json_text(s: &str) -> serde_json::Value {
    serde_json::from_str(s).unwrap_or(serde_json::Value::Null)
}

impl From<store::Job> for Job {
    fn from(j: store::Job) -> Job {
        Job {
            id: j.id.into(),
            account_id: j.account_id.into(),
            kind: j.kind.into(),
            state: j.state.as_str().to_owned(),
            cost: job_cost(&j.items),
            hold: job_hold(&j.items),
            net: j.net.get(),
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            refund_on: j.refund_on.as_str().to_owned(),
            cancel_requested: j.cancel_requested,
            not_before: rfc3339(j.not_before),
            priority: j.priority,
            requires: j.requires.iter().map(|l| l.as_str().to_owned()).collect(),
            last_error: j.last_error.map(|e| LastError { code: e.code, message: e.message }),
            items: j.items.into_iter().map(Item::from).collect(),
            payload: json_text(&j.payload),
            result: j.result.as_deref().map(json_text),
            created_at: rfc3339(j.created_at),
            updated_at: rfc3339(j.updated_at),
        }
    }
}

// ----- withdrawals -----------------------------------------------------------------------------------

/// An operator's resolution of an `unknown` withdrawal, confirmed by means outside Settle.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ResolveWithdrawal {
    /// `sent`: the transfer left (the withdrawal succeeds with `provider_txid`); `not_sent`: it did
    /// not (the withdrawal ends `dead` with code `CONFIRMED_NOT_SENT` and its hold refunded).
    #[schema(example = "sent")]
    pub outcome: String,
    /// The provider's transaction id; required with `sent`, refused with `not_sent`.
    #[serde(default)]
    pub provider_txid: Option<String>,
    /// How the outcome was confirmed (a statement, a ticket): kept in the action log.
    pub reason: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateWithdrawal {
    /// The withdrawal's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`. Makes the request
    /// idempotent.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// The account paying out.
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
    /// The withdrawal's job.
    #[serde(flatten)]
    pub job: Job,
    /// Credits paid out (minor units), greater than zero.
    pub amount: i64,
    /// Where the payout goes.
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
    /// Withdrawals in creation order.
    pub withdrawals: Vec<Withdrawal>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct WithdrawalsQuery {
    /// The `next_after` of the previous page.
    pub after: Option<i64>,
    /// Page size: 1 to 1,000, default 100.
    pub limit: Option<u32>,
    /// Only withdrawals in this job state.
    pub state: Option<String>,
    /// Only this account's withdrawals.
    pub account_id: Option<String>,
}

// ----- top-ups -----------------------------------------------------------------------------------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateTopUp {
    /// The top-up's id, chosen by the client: 1-128 characters of `[A-Za-z0-9_.:-]`, not `.` or `..`.
    /// Makes the request idempotent; the credits, once paid, are granted under this id.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub id: String,
    /// The account the credits go to.
    #[schema(pattern = r"^[A-Za-z0-9_.:-]{1,128}$")]
    pub account_id: String,
    /// Credits bought: 1 to 2^53.
    #[schema(minimum = 1, maximum = 9_007_199_254_740_992_i64)]
    pub credits: i64,
    /// What the customer pays, in minor units of `currency`: 0 to 2^53 (0 only with the admin role:
    /// a free top-up gives credit away).
    #[schema(minimum = 0, maximum = 9_007_199_254_740_992_i64)]
    pub price: i64,
    /// An ISO 4217 code (either case; answered in capitals).
    #[schema(example = "USD", min_length = 3, max_length = 3)]
    pub currency: String,
    /// Who the funding provider charges: 1-256 printable ASCII characters, not starting or ending with a space.
    #[schema(pattern = r"^[!-~]([ -~]{0,254}[!-~])?$", min_length = 1, max_length = 256)]
    pub customer: String,
}

/// A top-up: its job (kind `top_up`, `refund_on = final_failure`, nothing charged to the account)
/// and the charge's own fields.
#[derive(Debug, Serialize, ToSchema)]
pub struct TopUp {
    /// The top-up's job.
    #[serde(flatten)]
    pub job: Job,
    /// Credits bought; granted once the charge is confirmed.
    pub credits: i64,
    /// In minor units of `currency`.
    pub price: i64,
    /// The ISO 4217 code of the price, in capitals.
    pub currency: String,
    /// Who the funding provider charges.
    pub customer: String,
    /// Made once at creation; every attempt looks up and charges with it.
    pub idempotency_key: String,
    /// The funding provider's id of the charge, once confirmed.
    pub provider_charge_id: Option<String>,
    /// The grant the confirmed charge wrote (the top-up's id), once written.
    pub grant_id: Option<String>,
    /// Made by the account's auto top-up rule.
    pub rule: bool,
}

impl From<store::TopUp> for TopUp {
    fn from(t: store::TopUp) -> TopUp {
        TopUp {
            job: t.job.into(),
            credits: t.credits.get(),
            price: t.price,
            currency: t.currency,
            customer: t.customer,
            idempotency_key: t.idempotency_key,
            provider_charge_id: t.provider_charge_id,
            grant_id: t.grant_id,
            rule: t.rule,
        }
    }
}

/// An account's auto top-up rule to put.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct PutAutoTopUp {
    /// A posting that takes the balance from at or above this to under it buys `credits`: 1 to 2^61.
    #[schema(minimum = 1)]
    pub below: i64,
    /// Credits each top-up buys: 1 to 2^53.
    #[schema(minimum = 1, maximum = 9_007_199_254_740_992_i64)]
    pub credits: i64,
    /// What each costs the customer, in minor units of `currency` (0 only with the admin role).
    #[schema(minimum = 0, maximum = 9_007_199_254_740_992_i64)]
    pub price: i64,
    /// An ISO 4217 code.
    #[schema(example = "USD", min_length = 3, max_length = 3)]
    pub currency: String,
    /// Who the funding provider charges.
    #[schema(pattern = r"^[!-~]([ -~]{0,254}[!-~])?$", min_length = 1, max_length = 256)]
    pub customer: String,
    /// The most credits the rule buys in a UTC month (at least `credits`): counted when a top-up is
    /// made, given back when one dies or is cancelled.
    #[schema(minimum = 1)]
    pub monthly_credits_max: i64,
}

/// An account's auto top-up rule.
#[derive(Debug, Serialize, ToSchema)]
pub struct AutoTopUp {
    /// The threshold a posting crosses downward to buy.
    pub below: i64,
    /// Credits each top-up buys.
    pub credits: i64,
    /// What each costs, in minor units of `currency`.
    pub price: i64,
    /// The ISO 4217 code of the price.
    pub currency: String,
    /// Who the funding provider charges.
    pub customer: String,
    /// The most credits bought in a UTC month.
    pub monthly_credits_max: i64,
    /// `active`, or `paused` after one of its top-ups died (put the rule again to turn it on).
    #[schema(example = "active")]
    pub state: String,
    /// What its top-ups made this month are buying or bought.
    pub credits_this_month: i64,
    /// When the month's count starts again (RFC 3339).
    pub month_resets_at: String,
}

impl From<store::AutoTopUp> for AutoTopUp {
    fn from(r: store::AutoTopUp) -> AutoTopUp {
        AutoTopUp {
            below: r.below,
            credits: r.credits.get(),
            price: r.price,
            currency: r.currency,
            customer: r.customer,
            monthly_credits_max: r.monthly_credits_max,
            state: r.state.as_str().to_owned(),
            credits_this_month: r.credits_this_month,
            month_resets_at: rfc3339(r.month_resets_at),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct TopUpPage {
    /// Top-ups in creation order.
    pub top_ups: Vec<TopUp>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct AccountPage {
    /// Accounts in id order (a scoped token's own only).
    pub accounts: Vec<Account>,
    /// Pass as `after` for the next page (the last account's id); null at the end.
    pub next_after: Option<String>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct AccountsQuery {
    /// The `next_after` of the previous page: the last account id seen.
    pub after: Option<String>,
    /// Page size: 1 to 1,000, default 100.
    pub limit: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct JobPage {
    /// Jobs in creation order.
    pub jobs: Vec<Job>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Attempt {
    /// 1 for the first attempt, counting up.
    pub attempt_no: u32,
    /// The worker that held the lease.
    pub worker: String,
    /// When the claim started the attempt (RFC 3339 UTC time).
    pub started_at: String,
    /// When the attempt ended (RFC 3339 UTC time); null while open.
    pub finished_at: Option<String>,
    /// `succeeded`, `failed`, `lease_expired`, `unknown`, `cancelled`, `superseded`, `released`; null
    /// while open.
    pub result: Option<String>,
    /// The failure's code, if it failed.
    pub fail_code: Option<String>,
    /// The failure's or unknown outcome's message, up to 2,000 bytes.
    pub message: Option<String>,
    /// When a success this attempt reported after it had ended otherwise (its lease expired, it
    /// failed) recovered the job (RFC 3339 UTC time); null if none did.
    pub recovered_at: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Attempts {
    /// Every attempt, oldest first.
    pub attempts: Vec<Attempt>,
}

/// What paid for a job, what operators did to it and the signals that changed nothing: the parts
/// of a job's story the attempt log does not hold (the console's job page, as JSON).
#[derive(Debug, Serialize, ToSchema)]
pub struct JobHistory {
    /// Which grant paid which part, and what of it went back (decision 0023).
    pub allocations: Vec<Allocation>,
    /// Operators' actions on the job, oldest first.
    pub actions: Vec<Action>,
    /// Worker signals that changed nothing (stale, repeats) and late successes that recovered it.
    pub signals: Vec<SignalRecord>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Allocation {
    /// The grant that paid (`null`: the part no grant covered, debt).
    pub grant_id: Option<String>,
    /// The grant's origin (`grant`, `opening`, …).
    pub origin: Option<String>,
    /// `charge`, `reclaim`, `adjustment`, `settle_debt` or `opening`.
    pub kind: String,
    /// The item the part was for (`null`: the job as a whole).
    pub item_id: Option<String>,
    /// Credits taken from the grant.
    pub taken: i64,
    /// Credits of it given back since (refunds, releases go home).
    pub given_back: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Action {
    /// When (RFC 3339 UTC).
    pub at: String,
    /// The token's name (or `cli`, `system`, `loopback`).
    pub actor: String,
    /// What was done: `job.requeue`, `job.abandon_cleanup`, …
    pub action: String,
    /// What the action named (ids, amounts, reasons).
    pub detail: serde_json::Value,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct SignalRecord {
    /// `succeed`, `fail`, `unknown`, `heartbeat`, …
    pub signal: String,
    /// What came of it: `stale` (not the current attempt's lease), `noop` (a repeat) or `recovered` (a late success took a refund back).
    pub effect: String,
    /// The attempt whose lease token it carried (`null`: none matched).
    pub attempt_no: Option<u32>,
    /// When it arrived (RFC 3339 UTC).
    pub received_at: String,
    /// A failure's code.
    pub fail_code: Option<String>,
    /// A failure's message.
    pub message: Option<String>,
}

// ----- worker protocol -------------------------------------------------------------------------------

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Claim {
    /// The worker's name, 1-128 characters of `[A-Za-z0-9_.:@/-]`: kept in the attempt log.
    #[schema(pattern = r"^[A-Za-z0-9_.:@/-]{1,128}$")]
    pub worker: String,
    /// Claim only these kinds (each a job kind); all kinds but withdrawals when absent.
    #[serde(default)]
    pub kinds: Option<Vec<String>>,
    /// The worker's labels (at most 64): it is given only jobs whose every required label is
    /// among them. None: only jobs that require none.
    #[serde(default)]
    pub labels: Option<Vec<String>>,
    /// At most this many jobs: 1 to 100, default 1.
    #[serde(default)]
    #[schema(minimum = 1, maximum = 100)]
    pub limit: Option<u32>,
    /// How long the lease lasts without a heartbeat, in seconds: 1 to 3,600 (default per kind, else 30).
    #[serde(default)]
    #[schema(minimum = 1, maximum = 3600)]
    pub lease_seconds: Option<u32>,
    /// Long-poll: wait up to this many seconds (0 to 30, default 0) for a job to become due.
    #[serde(default)]
    #[schema(minimum = 0, maximum = 30)]
    pub wait_seconds: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ClaimedJob {
    /// The claimed job, now `running`.
    #[serde(flatten)]
    pub job: Job,
    /// The attempt's lease token: send it with every signal of this attempt.
    pub lease_token: String,
    /// When the lease lapses without a heartbeat (RFC 3339 UTC time).
    pub lease_expires_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Claimed {
    /// The claimed jobs; empty when nothing was due.
    pub jobs: Vec<ClaimedJob>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct AbandonCleanup {
    /// Why the cleanup is given up (1 to 500 characters), recorded in the action log.
    pub reason: String,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct LeaseOnly {
    /// The lease token the claim answered.
    pub lease_token: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Heartbeat {
    /// The lease's new expiry (RFC 3339 UTC time).
    pub lease_expires_at: String,
    /// A cancel was requested: stop at the item boundary and report.
    pub cancel_requested: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Succeed {
    /// The attempt's lease token; optional, since a success is accepted from any attempt.
    #[serde(default)]
    pub lease_token: Option<String>,
    /// Any JSON the job produced, kept with the job.
    #[serde(default)]
    pub result: Option<serde_json::Value>,
    /// The price of a held job's `main` item: what the work used, `0 ≤ cost ≤ hold`. Required when
    /// this success delivers or reclaims a held item; not with `costs`.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub cost: Option<i64>,
    /// The prices of the held items this success decides, by item id (`0 ≤ cost ≤ hold` each).
    #[serde(default)]
    pub costs: Option<std::collections::BTreeMap<String, i64>>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ItemSucceed {
    /// The lease token the claim answered.
    pub lease_token: String,
    /// A held item's price: what the work used, `0 ≤ cost ≤ hold`. Required for a held item; for a
    /// fixed item, if given, its cost.
    #[serde(default)]
    #[schema(minimum = 0)]
    pub cost: Option<i64>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Fail {
    /// The lease token the claim answered.
    pub lease_token: String,
    /// Why it failed: 1-64 characters of `A-Z0-9_` (e.g. `TIMEOUT`, `OOM`); the failures summary groups by
    /// it.
    #[schema(pattern = r"^[A-Z0-9_]{1,64}$")]
    pub code: String,
    /// Details for people, up to 2,000 bytes.
    #[serde(default)]
    pub message: Option<String>,
    /// Whether another attempt may succeed (default true); false ends the job `dead` at once.
    #[serde(default)]
    pub retryable: Option<bool>,
    /// Overrides the backoff for this retry, in milliseconds (e.g. a 429's Retry-After), capped at
    /// the kind's longest backoff (default 600,000).
    #[serde(default)]
    pub retry_after_ms: Option<u64>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Unknown {
    /// The lease token the claim answered.
    pub lease_token: String,
    /// What is known, up to 2,000 bytes.
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ItemFail {
    /// The lease token the claim answered.
    pub lease_token: String,
    /// Why the item failed: 1-64 characters of `A-Z0-9_`.
    #[schema(pattern = r"^[A-Z0-9_]{1,64}$")]
    pub code: String,
    /// Details for people, up to 2,000 bytes.
    #[serde(default)]
    pub message: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ItemReport {
    /// The item as it is now.
    pub item: Item,
    /// A cancel was requested: stop at this item boundary.
    pub cancel_requested: bool,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct RegisterArtifact {
    /// The lease token the claim answered.
    pub lease_token: String,
    /// The artifact's key in the artifact store: a relative path of 1-512 characters of
    /// `[A-Za-z0-9_.:/-]` without `.`, `..` or empty segments.
    pub key: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Artifact {
    /// The job the artifact belongs to.
    pub job_id: String,
    /// The item the artifact belongs to.
    pub item_id: String,
    /// The artifact's key, as the worker named it.
    pub key: String,
    /// Where the worker stores the object in the artifact store: its job's and item's own prefix,
    /// `{job_id}/{item_id}/{key}` (an id `.` or `..` written `%2E`). Teardown deletes exactly this.
    pub path: String,
}

// ----- failures, events, audit ------------------------------------------------------------------------

#[derive(Debug, Serialize, ToSchema)]
pub struct FailureCount {
    /// The jobs' last fail code.
    pub code: String,
    /// `dead`, `unknown` or `retrying`.
    pub state: String,
    /// How many jobs.
    pub count: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct FailureSummary {
    /// One row per fail code and state, most jobs first.
    pub by_code: Vec<FailureCount>,
}

/// The schema of an event envelope. Answers serialize `settle_store::EventEnvelope` itself — the
/// same value, byte for byte, that a webhook delivery sends.
#[derive(Debug, Serialize, ToSchema)]
pub struct Event {
    /// The event's position in the feed: increasing, gap-free, in commit order.
    pub seq: i64,
    /// The store's epoch when the event was numbered: 1 for a new store, raised by one by each
    /// restore from a backup (which numbers events again from where the backup stood). Receivers
    /// deduplicate by (`epoch`, `seq`), never by `seq` alone.
    pub epoch: i64,
    /// The event type, e.g. `job.queued`, `job.refunded`, `job.reclaimed`, `job.dead`, `account.granted`.
    #[serde(rename = "type")]
    pub kind: String,
    /// The job it is about; null for account events.
    pub job_id: Option<String>,
    /// The account it is about.
    pub account_id: String,
    /// The event's details (amounts in credits, codes, states), a JSON object.
    pub data: serde_json::Value,
    /// When the transition committed (RFC 3339 UTC time).
    pub created_at: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EventPage {
    /// Events in `seq` order.
    #[schema(value_type = Vec<Event>)]
    pub events: Vec<store::EventEnvelope>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Violation {
    /// `L1` … `L4` (semantics.md), or `SEQ` (a gap in the ledger's numbering).
    pub invariant: String,
    /// The account where it was found, if any.
    pub account_id: Option<String>,
    /// The job where it was found, if any.
    pub job_id: Option<String>,
    /// The item where it was found, if any.
    pub item_id: Option<String>,
    /// What does not hold, with the numbers.
    pub message: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Audit {
    /// True when no invariant is violated.
    pub ok: bool,
    /// Accounts checked.
    pub accounts_checked: u64,
    /// Items checked.
    pub items_checked: u64,
    /// Ledger entries checked.
    pub entries_checked: u64,
    /// Every violation found; empty when `ok`.
    pub violations: Vec<Violation>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Health {
    /// `ok`.
    pub status: String,
}

/// Paging and filters, from the query string.
#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct PageQuery {
    /// The `next_after` of the previous page.
    pub after: Option<i64>,
    /// Page size: 1 to 1,000, default 100.
    pub limit: Option<u32>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct JobsQuery {
    /// The `next_after` of the previous page.
    pub after: Option<i64>,
    /// Page size: 1 to 1,000, default 100.
    pub limit: Option<u32>,
    /// Only jobs in this state.
    pub state: Option<String>,
    /// Only jobs of this kind.
    pub kind: Option<String>,
    /// Only this account's jobs.
    pub account_id: Option<String>,
    /// Only jobs whose last fail code is this.
    pub fail_code: Option<String>,
    /// Only jobs of this priority (0 to 100).
    pub priority: Option<u8>,
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct EventsQuery {
    /// The last `seq` seen (0 to start from the beginning).
    pub after: Option<i64>,
    /// Page size: 1 to 1,000, default 100.
    pub limit: Option<u32>,
    /// Long-poll: wait up to this many seconds (at most 30) for an event after `after`.
    pub wait_seconds: Option<u32>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookDelivery {
    /// The webhook endpoint's id (from the configuration).
    pub endpoint_id: String,
    /// The event delivered, the same envelope as the event feed.
    #[schema(value_type = Event)]
    pub event: store::EventEnvelope,
    /// `pending`, `delivered` or `dead`.
    pub state: String,
    /// Sends tried so far.
    pub attempts: u32,
    /// When the next send is due (RFC 3339 UTC time).
    pub next_attempt_at: String,
    /// The HTTP status of the last send, if one was answered.
    pub last_status: Option<u16>,
    /// Why the last send failed, if it did.
    pub last_error: Option<String>,
    /// When the receiver answered 2xx (RFC 3339 UTC time).
    pub delivered_at: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct RequeuedDeliveries {
    /// How many dead deliveries were put back in line; call again while it is 1000.
    pub requeued: u64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookDeliveryPage {
    /// Deliveries in event order.
    pub deliveries: Vec<WebhookDelivery>,
    /// Pass as `after` for the next page; null at the end.
    pub next_after: Option<i64>,
    /// Every endpoint's circuit breaker (all endpoints, whatever the page's filter).
    pub endpoints: Vec<WebhookBreaker>,
}

/// A webhook endpoint's circuit breaker (docs/design/webhooks.md).
#[derive(Debug, Serialize, ToSchema)]
pub struct WebhookBreaker {
    /// The webhook endpoint's id.
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
        let open = b.state != store::BreakerState::Closed;
        WebhookBreaker {
            endpoint_id: b.endpoint_id,
            breaker: b.state.as_str().to_owned(),
            failures: b.failures,
            opens: b.opens,
            next_probe_at: b.next_probe_at.filter(|_| open).map(rfc3339),
        }
    }
}

#[derive(Debug, Deserialize, utoipa::IntoParams)]
#[serde(deny_unknown_fields)]
pub struct DeliveriesQuery {
    /// The `next_after` of the previous page.
    pub after: Option<i64>,
    /// Page size: 1 to 1,000, default 100.
    pub limit: Option<u32>,
    /// Only this endpoint's deliveries.
    pub endpoint: Option<String>,
    /// `pending`, `delivered` or `dead`.
    pub state: Option<String>,
}

impl From<store::Delivery> for WebhookDelivery {
    fn from(d: store::Delivery) -> WebhookDelivery {
        WebhookDelivery {
            endpoint_id: d.endpoint_id,
            event: d.event.envelope(),
            state: d.state.as_str().to_owned(),
            attempts: d.attempts,
            next_attempt_at: rfc3339(d.next_attempt_at),
            last_status: d.last_status,
            last_error: d.last_error,
            delivered_at: d.delivered_at.map(rfc3339),
        }
    }
}

/// `POST /v1/reports`: many worker signals in one request, each its own guarded transition with
/// its own answer (docs/design/reports.md).
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct Reports {
    /// 1 to 100 reports, each on another job.
    #[schema(min_items = 1, max_items = 100)]
    pub reports: Vec<Report>,
}

/// One signal: the body of its single route (`/v1/jobs/{id}/succeed`, `fail`, `release`,
/// `unknown`, `heartbeat`), with the job's id and the `outcome` that names the route.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(tag = "outcome", rename_all = "snake_case", deny_unknown_fields)]
pub enum Report {
    /// As `POST /v1/jobs/{id}/succeed`, with a lease token (an operator's success stays a request
    /// of its own).
    Succeed {
        /// The job reported on.
        job_id: String,
        /// The token of any attempt of this job.
        lease_token: String,
        /// Any JSON the job produced, kept with the job.
        #[serde(default)]
        result: Option<serde_json::Value>,
        /// The price of a held job's `main` item (`0 ≤ cost ≤ hold`); not with `costs`.
        #[serde(default)]
        #[schema(minimum = 0)]
        cost: Option<i64>,
        /// The prices of the held items this success decides, by item id.
        #[serde(default)]
        costs: Option<std::collections::BTreeMap<String, i64>>,
    },
    /// As `POST /v1/jobs/{id}/fail`.
    Fail {
        /// The job reported on.
        job_id: String,
        /// The lease token the claim answered.
        lease_token: String,
        /// Why it failed: 1-64 characters of `A-Z0-9_`.
        #[schema(pattern = r"^[A-Z0-9_]{1,64}$")]
        code: String,
        /// Details for people, up to 2,000 bytes.
        #[serde(default)]
        message: Option<String>,
        /// Whether another attempt may succeed (default true).
        #[serde(default)]
        retryable: Option<bool>,
        /// Overrides the backoff for this retry, in milliseconds.
        #[serde(default)]
        retry_after_ms: Option<u64>,
    },
    /// As `POST /v1/jobs/{id}/release`.
    Release {
        /// The job reported on.
        job_id: String,
        /// The lease token the claim answered.
        lease_token: String,
    },
    /// As `POST /v1/jobs/{id}/unknown`.
    Unknown {
        /// The job reported on.
        job_id: String,
        /// The lease token the claim answered.
        lease_token: String,
        /// What is known, up to 2,000 bytes.
        #[serde(default)]
        message: Option<String>,
    },
    /// As `POST /v1/jobs/{id}/heartbeat`.
    Heartbeat {
        /// The job reported on.
        job_id: String,
        /// The lease token the claim answered.
        lease_token: String,
    },
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ReportResults {
    /// One result per report, in the request's order.
    pub results: Vec<ReportResult>,
}

/// What the report's single route would have answered: its status, and its body — the job (in
/// brief), the heartbeat, or the error.
#[derive(Debug, Serialize, ToSchema)]
pub struct ReportResult {
    /// The report's job.
    pub job_id: String,
    /// The status its single route would have answered: 200, or the error's (404, 409, 422, 503, …).
    pub status: u16,
    /// With 200: the report had already taken effect (the single route's `Idempotent-Replayed:
    /// true`); nothing changed.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replayed: Option<bool>,
    /// With 200 for `succeed`, `fail`, `release` and `unknown`: the job after the report.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub job: Option<JobBrief>,
    /// With 200 for `heartbeat`: the lease's new expiry and whether a cancel was requested.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub heartbeat: Option<Heartbeat>,
    /// With any other status: the error its single route would have answered.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<crate::error::ErrorDetail>,
}

/// A job in brief: what a worker acts on after a report (`GET /v1/jobs/{id}` has the rest).
#[derive(Debug, Serialize, ToSchema)]
pub struct JobBrief {
    /// The job's id.
    pub id: String,
    /// As the job's `state`.
    pub state: String,
    /// How many attempts have started.
    pub attempt: u32,
    /// Attempts allowed before the job is dead.
    pub max_attempts: u32,
    /// A cancel was requested: stop at the item boundary.
    pub cancel_requested: bool,
    /// Not claimable before this time (RFC 3339 UTC time): a retry's backoff.
    pub not_before: String,
    /// The sum of the job's ledger entries (≤ 0).
    pub net: i64,
    /// The last failure, if any.
    pub last_error: Option<LastError>,
    /// When the job last changed (RFC 3339 UTC time).
    pub updated_at: String,
}

impl From<Job> for JobBrief {
    fn from(j: Job) -> JobBrief {
        JobBrief {
            id: j.id,
            state: j.state,
            attempt: j.attempt,
            max_attempts: j.max_attempts,
            cancel_requested: j.cancel_requested,
            not_before: j.not_before,
            net: j.net,
            last_error: j.last_error,
            updated_at: j.updated_at,
        }
    }
}
