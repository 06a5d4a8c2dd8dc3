//! What goes into and comes out of the store. Plain data; the api crate maps it to JSON.

use settle_core::history::{AttemptResult, EventKind, Signal, SignalEffect};
use settle_core::ids::{AccountId, ArtifactKey, FailCode, ItemId, JobId, JobKind, Labels, RefId, WorkerName};
use settle_core::item::{ItemState, RefundReason};
use settle_core::job::{JobState, RefundPolicy};
use settle_core::ledger::EntryKind;
use settle_core::{Credits, Timestamp};

/// A create's answer: the resource, and whether it was a replay of an earlier identical create.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Created<T> {
    pub value: T,
    pub replayed: bool,
}

/// A signal's answer: the job after it, and whether the signal changed anything. For a worker's
/// report (`succeed`, `fail`, `unknown`, the item reports) an answer that applied nothing is a
/// replay: the same report had already taken effect (decision 0019); a refused one is
/// `StoreError::LeaseLost` instead.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outcome<T> {
    pub value: T,
    pub applied: bool,
}

/// Who reports a job's success: the holder of some attempt's lease token (current or not: the
/// seed's recovery), an operator (recorded in the action log), or the reconciler.
#[derive(Debug, Clone, Copy)]
pub enum Reporter<'a> {
    Lease(&'a LeaseToken),
    Operator(&'a str),
    Reconciler,
}

impl<'a> Reporter<'a> {
    /// The holder of `token`; without one, the system's operator act.
    pub fn of(token: Option<&'a LeaseToken>) -> Reporter<'a> {
        token.map_or(Reporter::Operator(SYSTEM_ACTOR), Reporter::Lease)
    }
}

/// Why a worker's report was refused (decision 0019): the job as it is, and the attempt whose
/// token the report carried — `None` when no attempt of this job ever held it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseLost {
    pub job: String,
    pub state: JobState,
    pub attempt: Option<AttemptEnd>,
}

/// How the attempt of a refused token ended, from its row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttemptEnd {
    pub attempt_no: u32,
    /// `None` while the attempt is open (which a refused token's attempt never is).
    pub result: Option<AttemptResult>,
    /// Its own report that took effect (`succeed`, `fail`, `unknown`); `None` when it reported
    /// nothing that did (the rescuer, a cancel, another attempt or an operator closed it).
    pub reported: Option<String>,
    pub finished_at: Option<Timestamp>,
    /// When its lease ran out, for an attempt the rescuer closed.
    pub expired_at: Option<Timestamp>,
}

impl LeaseLost {
    /// `expired`, `ended` (the attempt ended another way) or `never_issued`.
    pub fn lease(&self) -> &'static str {
        match &self.attempt {
            None => "never_issued",
            Some(a) if a.result == Some(AttemptResult::LeaseExpired) => "expired",
            Some(_) => "ended",
        }
    }
}

impl std::fmt::Display for LeaseLost {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (job, state) = (&self.job, self.state.as_str());
        match &self.attempt {
            None => write!(f, "no attempt of job {job} ever held this lease token; the job is {state}"),
            Some(a) => {
                write!(f, "the lease of attempt {} of job {job} ", a.attempt_no)?;
                match (a.result, a.expired_at) {
                    (Some(AttemptResult::LeaseExpired), Some(at)) => write!(f, "expired at {}", at.rfc3339())?,
                    (Some(AttemptResult::LeaseExpired), None) => write!(f, "expired")?,
                    (Some(r), _) => write!(f, "is gone (the attempt ended {})", r.as_str())?,
                    (None, _) => write!(f, "is not the current one")?,
                }
                write!(f, "; the job is {state}")
            }
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAccount {
    pub id: AccountId,
    pub overdraft_limit: Credits,
    /// The most of its jobs that may run at once (`None`: no cap; docs/design/fair-claims.md §9).
    pub max_running: Option<i64>,
}

/// What `PATCH /v1/accounts/{id}` changes: each field given is set, the others kept.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AccountChanges {
    pub overdraft_limit: Option<Credits>,
    /// `Some(None)` removes the cap.
    pub max_running: Option<Option<i64>>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Account {
    pub id: AccountId,
    pub balance: Credits,
    pub overdraft_limit: Credits,
    pub max_running: Option<i64>,
    pub created_at: Timestamp,
}

settle_core::names! {
    /// Which side of an alert's threshold the balance is on: `above` (at or above it), `below`.
    pub AlertSide {
        Above = "above",
        Below = "below",
    }
}

/// A balance alert of an account (spec §4a): `account.balance_low` when a posting takes the balance
/// from at or above `below` to under it, `account.balance_recovered` back; `side` is where it is now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Alert {
    pub id: String,
    pub below: i64,
    pub side: AlertSide,
}

/// A spend limit as put (spec §4a): at most `amount` spent per UTC `period` on the job kinds
/// `kinds` (empty: every kind but withdrawals).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewLimit {
    pub period: settle_core::spend::Period,
    pub amount: i64,
    pub kinds: Vec<String>,
}

/// A spend limit and its current period: what was spent in it (net; negative when refunds of an
/// earlier period's charges came back in it) and when the next period starts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpendLimit {
    pub period: settle_core::spend::Period,
    pub amount: i64,
    pub kinds: Vec<String>,
    pub spent: i64,
    pub resets_at: Timestamp,
}

/// Why a charge was refused by a spend limit: the limit, its period's spend, what is left, and what
/// the charge needed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LimitExceeded {
    pub period: settle_core::spend::Period,
    pub amount: i64,
    pub kinds: Vec<String>,
    pub spent: i64,
    pub remaining: i64,
    pub needed: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewGrant {
    pub id: RefId,
    pub amount: Credits,
    pub reason: Option<String>,
    /// When what is left of it expires (after the store's now); `None`: never (docs/decisions/0023).
    pub expires_at: Option<Timestamp>,
    /// 0–100, lower taken first; `None`: 50.
    pub priority: Option<i64>,
}

/// A source of an account's credit (docs/decisions/0023): a grant, a positive adjustment, or the
/// balance the account had before grants were tracked (`opening`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Grant {
    /// The grant's or adjustment's id; the account's id for its opening balance.
    pub id: String,
    /// `grant`, `adjustment` or `opening`.
    pub origin: String,
    pub amount: Credits,
    pub remaining: Credits,
    pub priority: i64,
    pub expires_at: Option<Timestamp>,
    /// When the expiry closed it (what it had left then was taken by an `expire` entry).
    pub expired_at: Option<Timestamp>,
    pub state: GrantState,
    pub created_at: Timestamp,
}

settle_core::names! {
    /// A grant as the API shows it: `expired` from its expiry instant on (whether or not the
    /// expiry pass has closed it yet), `used` when nothing is left, else `active`.
    pub GrantState {
        Active = "active",
        Used = "used",
        Expired = "expired",
    }
}

/// What paid for part of a movement (a charge, a reclaim, a negative adjustment, a grant's payment
/// of debt) and how much of it was given back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Allocation {
    /// The grant's id (`None`: the part no grant covered, debt).
    pub grant_id: Option<String>,
    pub origin: Option<String>,
    /// `charge`, `reclaim`, `adjustment`, `settle_debt` or `opening`.
    pub kind: String,
    pub job_id: Option<String>,
    pub item_id: Option<String>,
    pub taken: Credits,
    pub given_back: Credits,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAdjustment {
    pub id: RefId,
    pub amount: Credits,
    pub reason: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LedgerEntry {
    /// Unique in the store; increases within an account in commit order (gaps allowed, no order
    /// across accounts).
    pub seq: i64,
    /// 1, 2, 3, … within the account, gap-free: the entry's place in the account's hash chain.
    pub account_seq: i64,
    pub account_id: AccountId,
    pub kind: EntryKind,
    pub amount: Credits,
    pub balance_after: Credits,
    pub job_id: Option<String>,
    pub item_id: Option<String>,
    pub ref_id: Option<String>,
    pub reason: Option<String>,
    pub created_at: Timestamp,
    pub hash: [u8; 32],
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewItem {
    pub id: ItemId,
    pub price: Price,
}

/// What a success says its held items cost (docs/decisions/0022): item → price. Empty for a job
/// of fixed-price items.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Costs(pub std::collections::BTreeMap<ItemId, Credits>);

impl Costs {
    /// One price, for the job's `main` item.
    pub fn main(cost: Credits) -> Costs {
        Costs([(ItemId::main(), cost)].into_iter().collect())
    }
}

/// How an item is priced at create.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Price {
    /// A fixed cost, charged at create.
    Cost(Credits),
    /// A held item (docs/decisions/0022): the hold is charged at create; the first success prices
    /// the item at most the hold and releases the rest.
    Hold(Credits),
}

impl Price {
    /// What create charges: the cost, or the hold.
    pub fn charged(self) -> Credits {
        match self {
            Price::Cost(c) | Price::Hold(c) => c,
        }
    }

    /// The hold of a held item.
    pub fn hold(self) -> Option<Credits> {
        match self {
            Price::Hold(n) => Some(n),
            Price::Cost(_) => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewJob {
    pub id: JobId,
    pub account_id: AccountId,
    pub kind: JobKind,
    /// Non-empty; a job created with a plain `cost` has the single item `main`.
    pub items: Vec<NewItem>,
    /// What the worker is given (`Null` for none); stored as canonical JSON text (object keys
    /// sorted, `settle_core::fingerprint::canonical_json`), as the request's fingerprint takes it.
    pub payload: serde_json::Value,
    pub max_attempts: Option<u32>,
    pub refund_on: Option<RefundPolicy>,
    pub not_before: Option<Timestamp>,
    /// 0 (claimed first) to 100; `None`: 50 (spec §3a).
    pub priority: Option<u8>,
    /// The labels a worker must have to claim it (at most 8).
    pub requires: Labels,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub id: ItemId,
    /// The amount at stake: a fixed item's cost; a held item's hold until a success prices it,
    /// then its price (docs/decisions/0022).
    pub cost: Credits,
    /// A held item's hold (`None`: a fixed price).
    pub hold: Option<Credits>,
    pub state: ItemState,
    /// Why the refund happened, when one did: `job_failed`, `item_failed`, `cancelled`.
    pub refund_reason: Option<RefundReason>,
}

impl Item {
    /// The price a held item was given by its first success; a fixed item's cost. `None` while a
    /// held item is unpriced: it is priced exactly when it was delivered (`succeeded`, `reclaimed`).
    pub fn priced_cost(&self) -> Option<Credits> {
        match self.hold {
            None => Some(self.cost),
            Some(_) if matches!(self.state, ItemState::Succeeded | ItemState::Reclaimed) => Some(self.cost),
            Some(_) => None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LastError {
    pub code: String,
    pub message: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Job {
    pub id: JobId,
    pub account_id: AccountId,
    pub kind: JobKind,
    pub state: JobState,
    pub cost: Credits,
    /// Sum of the job's ledger entries (≤ 0).
    pub net: Credits,
    pub attempt: u32,
    pub max_attempts: u32,
    /// Attempts made before the last requeue by a person; the budget counts from here.
    pub budget_base: u32,
    pub refund_on: RefundPolicy,
    pub cancel_requested: bool,
    pub not_before: Timestamp,
    /// 0 (claimed first) to 100.
    pub priority: u8,
    /// The labels a worker must have to claim it.
    pub requires: Labels,
    pub lease_expires_at: Option<Timestamp>,
    pub last_error: Option<LastError>,
    pub items: Vec<Item>,
    pub payload: String,
    /// What the success carried (JSON text), once succeeded.
    pub result: Option<String>,
    pub created_at: Timestamp,
    pub updated_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct JobFilter {
    pub state: Option<JobState>,
    pub kind: Option<JobKind>,
    pub account_id: Option<AccountId>,
    pub fail_code: Option<FailCode>,
    /// Jobs of this priority (0–100).
    pub priority: Option<u8>,
    /// Jobs whose id starts with this (an id's characters, 1 to 128 of them).
    pub id_prefix: Option<String>,
    /// Jobs created no later than the one numbered this (`JobTotals::last_seq`): what a bulk
    /// action was confirmed on, not what arrived since.
    pub until_seq: Option<i64>,
    /// Only the accounts and kinds a scoped token may see (decision 0018).
    pub scope: settle_core::scope::Scope,
}

impl JobFilter {
    pub const ALL: JobFilter = JobFilter {
        state: None,
        kind: None,
        account_id: None,
        fail_code: None,
        priority: None,
        id_prefix: None,
        until_seq: None,
        scope: settle_core::scope::Scope::ALL,
    };
}

/// How many jobs a filter matches and the credits they carry: what a bulk action will touch.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct JobTotals {
    pub jobs: i64,
    /// The sum of their costs, in credits.
    pub cost: i64,
    /// What they cost their accounts now (the sum of their ledger entries, ≤ 0), when asked for:
    /// it reads every entry of every matching job.
    pub net: Option<i64>,
    /// The newest matching job's sequence number (0 when none): bounds a confirmed bulk action.
    pub last_seq: i64,
}

/// The operator's overview, read in one snapshot.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Overview {
    /// Jobs by kind and state (kind, state, count), every pair that has jobs.
    pub jobs: Vec<(String, JobState, i64)>,
    /// Queued jobs whose `not_before` has passed: work waiting for a worker.
    pub due: i64,
    /// Events per minute, oldest first, over the window asked for (at most the latest
    /// `OVERVIEW_EVENTS_MAX` events are counted).
    pub per_minute: Vec<(Timestamp, i64)>,
    /// Whether the window held more events than were counted.
    pub per_minute_truncated: bool,
}

/// How many recent events the overview's throughput chart counts at most.
pub const OVERVIEW_EVENTS_MAX: i64 = 200_000;

/// An artifact as registered by a job's worker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArtifactRecord {
    pub item_id: String,
    pub key: String,
    /// Where the object is in the artifact store (`{job_id}/{item_id}/{key}`).
    pub path: String,
    pub created_at: Timestamp,
}

/// What happened to a job and to its credits, for the console's job page.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct JobHistory {
    /// Its ledger entries (charges, refunds, reclaims), in `seq` order.
    pub entries: Vec<LedgerEntry>,
    /// Its events, in `seq` order (at most 1,000).
    pub events: Vec<Event>,
    pub artifacts: Vec<ArtifactRecord>,
    /// Signals past the signal log's bound (`SIGNALS_LOGGED_MAX`), counted and not kept.
    pub signals_unlogged: i64,
}

/// An account with what the ledger holds against it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AccountDetail {
    pub account: Account,
    /// Credits that later refunds and returns could still add back (running jobs, withdrawals).
    pub held: i64,
    /// Credits that a later success could still reclaim (refunds of failed attempts).
    pub exposure: i64,
    /// Credits charged to work not decided yet: items still `charged` (running or waiting jobs,
    /// withdrawals not yet paid). Unlike `held`, not a paid withdrawal that may still come back.
    pub pending: i64,
    /// How many ledger entries the account has.
    pub entries: i64,
    /// What the balance owes that no grant holds (docs/decisions/0023): the live grants' remaining
    /// less this is the balance.
    pub debt: i64,
}

/// `after` is the opaque cursor of the previous page (a sequence number), `limit` ≤ `PAGE_LIMIT_MAX`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Page {
    pub after: i64,
    pub limit: u32,
}

impl Page {
    pub const FIRST: Page = Page { after: 0, limit: settle_core::limits::PAGE_LIMIT_DEFAULT };
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Paged<T> {
    pub rows: Vec<T>,
    pub next_after: Option<i64>,
}

/// A page of accounts: their cursor is the last account's id (accounts carry no number).
#[derive(Debug, Clone)]
pub struct AccountPage {
    pub rows: Vec<Account>,
    pub next_after: Option<String>,
}

#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LeaseToken(pub String);

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimRequest {
    pub worker: WorkerName,
    pub kinds: Vec<JobKind>,
    /// The worker's labels: it is given only jobs whose every required label is among them.
    pub labels: Labels,
    pub limit: u32,
    /// `None`: the lease length of each claimed job's kind.
    pub lease_seconds: Option<u32>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ClaimedJob {
    pub job: Job,
    pub lease_token: LeaseToken,
    pub lease_expires_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Heartbeat {
    pub lease_expires_at: Timestamp,
    pub cancel_requested: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ItemReport {
    pub item: Item,
    pub cancel_requested: bool,
    pub applied: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailSignal {
    pub lease_token: LeaseToken,
    pub code: FailCode,
    pub message: Option<String>,
    /// The worker's own verdict; `None` defers to the configured retryable codes.
    pub retryable: Option<bool>,
    /// Overrides the backoff formula for this retry (a 429 with Retry-After).
    pub retry_after_ms: Option<u64>,
}

/// What reconciling an `unknown` job found at the external system. (A withdrawal found at the
/// provider is recorded with its txid by `Payouts::payout_succeeded` instead.)
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finding {
    /// The external system has it: the job succeeded.
    Present,
    /// Absent; after the confirm window this becomes `TIMEOUT_CONFIRMED_NOT_SENT` (retryable).
    Absent,
}

/// What an operator confirmed about an `unknown` withdrawal, by means outside Settle (the
/// provider's dashboard, a bank statement), when no provider lookup can answer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ResolvedOutcome {
    /// It left: the success path, with the provider's txid.
    Sent { provider_txid: String },
    /// It did not leave: `dead`, the hold refunded.
    NotSent,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Resolution {
    pub outcome: ResolvedOutcome,
    /// How it was confirmed (kept in the action log and, for "not sent", as the failure message).
    pub reason: String,
}

/// A withdrawal to create (`POST /v1/withdrawals`): a job of kind `withdrawal` holding `amount`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewWithdrawal {
    pub id: JobId,
    pub account_id: AccountId,
    pub amount: Credits,
    pub destination: settle_core::ids::Destination,
}

/// A withdrawal: its job (state, attempts, hold) and what the payout needs and learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Withdrawal {
    pub job: Job,
    pub destination: String,
    pub amount: Credits,
    /// Made once at creation; every attempt sends and looks up with it.
    pub idempotency_key: String,
    /// The provider's id of the transfer, once known.
    pub provider_txid: Option<String>,
    pub returned_at: Option<Timestamp>,
}

/// A top-up to create (`POST /v1/top-ups`, spec §4a): `credits` bought for `price` minor units of
/// `currency`, charged to the funding provider's `customer`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewTopUp {
    pub id: JobId,
    pub account_id: AccountId,
    pub credits: Credits,
    pub price: i64,
    pub currency: settle_core::currency::Currency,
    pub customer: settle_core::ids::Customer,
}

/// A top-up: its job (state, attempts, last error) and what the charge needs and learned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopUp {
    pub job: Job,
    pub credits: Credits,
    pub price: i64,
    pub currency: String,
    pub customer: String,
    /// Made once at creation; every attempt charges and looks up with it.
    pub idempotency_key: String,
    /// The provider's id of the charge, once confirmed.
    pub provider_charge_id: Option<String>,
    /// The grant the confirmed charge wrote (the top-up's own id), once written.
    pub grant_id: Option<String>,
    /// Made by the account's auto top-up rule rather than asked for.
    pub rule: bool,
}

settle_core::names! {
    /// Whether an auto top-up rule makes top-ups (`active`), or waits for its client after one of
    /// its top-ups died (`paused`: a declined card is never charged in a loop).
    pub RuleState {
        Active = "active",
        Paused = "paused",
    }
}

/// An account's auto top-up rule to put (`PUT /v1/accounts/{id}/auto-top-up`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewAutoTopUp {
    pub below: i64,
    pub credits: Credits,
    pub price: i64,
    pub currency: settle_core::currency::Currency,
    pub customer: settle_core::ids::Customer,
    pub monthly_credits_max: i64,
}

/// An account's auto top-up rule as stored: what it buys when a posting takes the balance under
/// `below`, whether it is active, and what its top-ups of this UTC month are buying or bought.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AutoTopUp {
    pub account_id: AccountId,
    pub below: i64,
    pub credits: Credits,
    pub price: i64,
    pub currency: String,
    pub customer: String,
    pub monthly_credits_max: i64,
    pub state: RuleState,
    pub credits_this_month: i64,
    /// When this month's count starts again.
    pub month_resets_at: Timestamp,
}

/// Which top-ups to list.
#[derive(Debug, Clone, Default)]
pub struct TopUpFilter {
    pub state: Option<JobState>,
    pub account_id: Option<AccountId>,
    /// Only those whose job changed at or after this time (the late-charge re-check's window).
    pub updated_since: Option<Timestamp>,
    /// Only the accounts a scoped token may see (decision 0018).
    pub scope: settle_core::scope::Scope,
}

/// A cancelling job's artifact cleanup that failed: the sweeper tries again at `retry_at`
/// (a capped backoff), and an operator may finish the teardown without it (decision 0028 §6).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CleanupRetry {
    pub failures: i64,
    pub retry_at: Timestamp,
    pub last_error: String,
    pub failed_at: Timestamp,
}

/// Who acts when no person does (tests, the CLI's own store calls, the background loops).
pub const SYSTEM_ACTOR: &str = "system";

settle_core::names! {
    /// What an operator did, as the action log records it: `domain.verb`, one spelling each.
    pub ActionKind {
        AccountCreate = "account.create",
        AccountUpdate = "account.update",
        AccountAlerts = "account.alerts",
        AccountLimits = "account.limits",
        AccountAutoTopUp = "account.auto_top_up",
        AccountAutoTopUpDelete = "account.auto_top_up_delete",
        AccountGrant = "account.grant",
        AccountAdjust = "account.adjust",
        JobCancel = "job.cancel",
        JobRequeue = "job.requeue",
        JobAbandonCleanup = "job.abandon_cleanup",
        JobSucceed = "job.succeed",
        WithdrawalResolve = "withdrawal.resolve",
        WithdrawalReturn = "withdrawal.return",
        WebhookRequeue = "webhook.requeue",
        WebhookRequeueDead = "webhook.requeue_dead",
        WebhookCloseBreaker = "webhook.close_breaker",
        LedgerAudit = "ledger.audit",
    }
}

impl ActionKind {
    /// A stored action's name: as written now, or as it was written before the names took one
    /// spelling (issue 21) — the log is append-only, so old rows keep their old text.
    pub fn parse_stored(text: &str) -> Option<ActionKind> {
        ActionKind::parse(text).or(match text {
            "grant" => Some(ActionKind::AccountGrant),
            "adjustment" => Some(ActionKind::AccountAdjust),
            "cancel" => Some(ActionKind::JobCancel),
            "requeue" => Some(ActionKind::JobRequeue),
            "succeed" => Some(ActionKind::JobSucceed),
            "withdrawal.resolved" => Some(ActionKind::WithdrawalResolve),
            "withdrawal.returned" => Some(ActionKind::WithdrawalReturn),
            "webhook.breaker_close" => Some(ActionKind::WebhookCloseBreaker),
            "audit" => Some(ActionKind::LedgerAudit),
            _ => None,
        })
    }
}

/// An admin action as recorded: who, what, when, on which job or account.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Action {
    pub id: i64,
    pub at: Timestamp,
    /// The token's name (or `system`, `loopback`).
    pub actor: String,
    pub action: ActionKind,
    pub job_id: Option<String>,
    pub account_id: Option<String>,
    /// JSON text: what the action named (ids, amounts, reasons).
    pub detail: String,
}

/// Who saw a payout come back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReturnSource {
    /// The provider's lookup answered `"status": "returned"`.
    Provider,
    /// An admin said so (`POST /v1/withdrawals/{id}/returned`).
    Admin,
}

impl ReturnSource {
    pub const fn as_str(self) -> &'static str {
        match self {
            ReturnSource::Provider => "provider",
            ReturnSource::Admin => "admin",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct WithdrawalFilter {
    pub state: Option<JobState>,
    pub account_id: Option<AccountId>,
    /// Only those whose job changed at or after this time (the return re-check's window).
    pub updated_since: Option<Timestamp>,
    /// Only the accounts a scoped token may see (decision 0018).
    pub scope: settle_core::scope::Scope,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CancelOutcome {
    /// `200`: the job is `cancelled` (now, or already).
    Cancelled(Job),
    /// `202`: running with `cancel_requested`, or `cancelling` while cleanup is retried.
    Accepted(Job),
}

impl CancelOutcome {
    pub fn job(&self) -> &Job {
        match self {
            CancelOutcome::Cancelled(j) | CancelOutcome::Accepted(j) => j,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Attempt {
    pub attempt_no: u32,
    pub worker: String,
    pub started_at: Timestamp,
    pub finished_at: Option<Timestamp>,
    /// How it ended; `None` while open.
    pub result: Option<AttemptResult>,
    /// When a success it reported after it had ended otherwise (a lease expired, a failure)
    /// recovered the job: the seed's result at 32 s after the timeout at 30 s.
    pub recovered_at: Option<Timestamp>,
    pub fail_code: Option<String>,
    pub message: Option<String>,
}

/// A signal that changed nothing (stale token, duplicate): kept for support.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SignalRecord {
    pub attempt_no: Option<u32>,
    pub signal: Signal,
    pub fail_code: Option<String>,
    pub message: Option<String>,
    pub effect: SignalEffect,
    pub received_at: Timestamp,
}

settle_core::names! {
    /// Where the jobs of a failure summary's row are: given up, waiting for the reconciler, or
    /// queued for a retry after a failure.
    pub FailureState {
        Dead = "dead",
        Unknown = "unknown",
        Retrying = "retrying",
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FailureCount {
    pub code: String,
    pub state: FailureState,
    pub count: i64,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Event {
    pub seq: i64,
    pub kind: EventKind,
    pub job_id: Option<String>,
    pub account_id: String,
    /// JSON text.
    pub data: String,
    pub created_at: Timestamp,
    /// The store's epoch when the event was numbered: 1, raised by each restore (decision 0029).
    pub epoch: i64,
}

/// An event as it is shown and sent: `GET /v1/events`, the deliveries list and every webhook body
/// serialize this one value, so one event is the same bytes everywhere.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct EventEnvelope {
    pub seq: i64,
    pub epoch: i64,
    #[serde(rename = "type")]
    pub kind: String,
    pub job_id: Option<String>,
    pub account_id: String,
    pub data: serde_json::Value,
    pub created_at: String,
}

impl Event {
    pub fn envelope(&self) -> EventEnvelope {
        EventEnvelope {
            seq: self.seq,
            epoch: self.epoch,
            kind: self.kind.as_str().to_owned(),
            job_id: self.job_id.clone(),
            account_id: self.account_id.clone(),
            data: serde_json::from_str(&self.data).unwrap_or(serde_json::Value::Null),
            created_at: self.created_at.rfc3339(),
        }
    }
}

settle_core::names! {
    /// What an audit violation breaks: one of the ledger invariants of `docs/semantics.md`, or the
    /// gap-free numbering. The texts are what `GET /v1/audit`, the console and `settle audit` show.
    pub Invariant {
        /// A balance is the sum of its account's entries (and `held`, `exposure` what its items say).
        L1 = "L1",
        /// Each entry's `balance_after` is the running sum, and the account's hash chain verifies.
        L2 = "L2",
        /// Each item's entries sum to what its state nets; a withdrawal matches its row.
        L3 = "L3",
        /// At most one entry of each kind per item, and a reclaim only after a refund.
        L4 = "L4",
        /// The account's live grants less its debt are its balance; every grant's amount is what it
        /// gave, got back, lost to expiry and has left; nothing is taken from a grant after it expired.
        L5 = "L5",
        /// No withdrawal left its account with never-expiring credit less than its debt (the cash
        /// rule: the overdraft never leaves as cash).
        L6 = "L6",
        /// Every balance alert is on the side of its threshold the balance is on, and the account's
        /// band is what its alerts' sides give (alerts fire once per crossing).
        L7 = "L7",
        /// An account is marked as having spend limits exactly when it has some, and each limit's
        /// recorded spend is what its period's ledger lines say.
        L8 = "L8",
        /// Every top-up has its row and is open exactly while its charge is not known and it is
        /// not finished (its credits reserved in `held`); every confirmed charge has exactly one
        /// grant of its credits, and every bought grant a confirmed charge behind it.
        L9 = "L9",
        /// A gap in the ledger's or the outbox's numbering, or an event or a logged signal filed
        /// under a job it is not.
        Seq = "SEQ",
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    pub invariant: Invariant,
    pub account_id: Option<String>,
    pub job_id: Option<String>,
    pub item_id: Option<String>,
    pub message: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AuditReport {
    pub accounts_checked: u64,
    pub items_checked: u64,
    pub entries_checked: u64,
    pub violations: Vec<Violation>,
    /// How the audit stood to the store's checkpoint (decision 0040); all empty for a plain audit.
    pub checkpoint: CheckpointUse,
}

/// How an audit runs against the store's checkpoint (decision 0040). The default is the plain audit
/// of the spec: every row, nothing written.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct AuditRun {
    /// Start from the store's checkpoint when it has a usable one (else from the first entry).
    pub from_checkpoint: bool,
    /// Record a checkpoint of this audit's snapshot when it finds nothing wrong.
    pub record: bool,
}

/// What an audit did with the store's checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct CheckpointUse {
    /// The checkpoint it started from.
    pub from: Option<CheckpointMark>,
    /// Why it started from the first entry though asked to start from the checkpoint.
    pub not_used: Option<String>,
    /// Jobs whose items it checked again (from a checkpoint: those touched since; else all).
    pub jobs_checked: u64,
    /// Ledger entries the store holds: those checked, and those the checkpoint had proved.
    pub entries_covered: u64,
    /// Asked to record: the checkpoint recorded, or why none was.
    pub recorded: Option<Result<CheckpointMark, String>>,
    /// An audit that found something wrong retires the store's checkpoint (none is started from
    /// until a clean audit records one): whether there was one, or why it could not be retired.
    pub retired: Option<Result<bool, String>>,
}

/// A checkpoint: its generation (raised by each one recorded), when it was taken, and the ledger
/// entries it had proved.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CheckpointMark {
    pub generation: i64,
    pub taken_at: Timestamp,
    pub entries: u64,
}

impl AuditReport {
    pub fn ok(&self) -> bool {
        self.violations.is_empty()
    }
}

/// Registered with a lease token; deleted from the artifact store when its item is cancelled.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NewArtifact {
    pub key: ArtifactKey,
}

/// What the PostgreSQL write lanes' batch plan did so far (docs/design/batch-plan.md §12).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PlanTally {
    /// Intents whose job a batch locked and read ahead.
    pub ahead: u64,
    /// Intents whose job another transaction held (or that has none): run alone after their batch.
    pub skipped: u64,
    /// Phase 1s that failed (their batches' operations ran alone).
    pub failed: u64,
    /// Batches the lanes ran optimistic, and the operations in them.
    pub batches: u64,
    pub operations: u64,
    /// Of the intents read ahead: failures, successes, and those whose account another intent of
    /// the same batch also has (issue 43: what a batch-wide write of the accounts could merge).
    pub fails: u64,
    pub succeeds: u64,
    pub shared_account: u64,
}

/// What this process saw of its PostgreSQL connections (docs/decisions/0024); zeros on SQLite.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DatabaseStats {
    /// Connections the pools opened (each checked to lead to the primary).
    pub connections_opened: u64,
    /// Answers that said the server may no longer be the primary (a read-only transaction, a
    /// shutdown, a cut connection): each closed the pooled connections and looked for the primary.
    pub failover_signals: u64,
    /// Times the primary was found on another host than before.
    pub primary_changes: u64,
    /// The write lanes' batch plan (docs/design/batch-plan.md §12): intents whose job a batch
    /// locked and read ahead, intents whose job another transaction held (run alone after their
    /// batch), and phase 1s that failed.
    pub plan: PlanTally,
    /// The host connections go to now (`host:port` as the URL wrote it).
    pub primary: Option<String>,
}

/// Counts for metrics: jobs by state, ledger entries by kind.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Stats {
    pub jobs_by_state: Vec<(String, i64)>,
    pub entries_by_kind: Vec<(String, i64)>,
    /// Every job kind the store has seen, with its queue now.
    pub queues: Vec<KindQueue>,
    /// The queue by priority: every priority some queued job has (`KindQueue::kind` the priority).
    pub priorities: Vec<KindQueue>,
    /// PostgreSQL transactions retried after a serialization failure, deadlock or concurrent
    /// create, since this process opened the store.
    pub tx_retries: u64,
}

/// One job kind's queue, as `/metrics` shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindQueue {
    pub kind: String,
    /// Jobs `queued`, due or not.
    pub queued: i64,
    /// Of those, the ones a claim could take now.
    pub due: i64,
    /// When the longest-waiting due job became due (`None`: nothing is due).
    pub oldest_due_since: Option<Timestamp>,
}

/// One event's delivery to one webhook endpoint.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Delivery {
    pub endpoint_id: String,
    pub event: Event,
    pub state: DeliveryState,
    pub attempts: u32,
    pub next_attempt_at: Timestamp,
    pub last_status: Option<u16>,
    pub last_error: Option<String>,
    pub delivered_at: Option<Timestamp>,
    /// Set on a claimed delivery: the report must carry it.
    pub lease_token: Option<LeaseToken>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeliveryReport {
    Delivered { status: u16 },
    Failed { status: Option<u16>, error: String, retry_at: Timestamp, attempts_max: u32 },
}

/// A webhook endpoint's circuit breaker policy (docs/design/webhooks.md, "Circuit breaker").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Consecutive failed sends that open the breaker; 0 = no breaker.
    pub failures: u32,
    /// The first pause once open, in milliseconds; doubled per consecutive re-open.
    pub open_ms: u64,
    /// The longest pause, in milliseconds.
    pub open_ms_max: u64,
}

impl Default for BreakerPolicy {
    fn default() -> BreakerPolicy {
        BreakerPolicy { failures: 5, open_ms: 30_000, open_ms_max: 600_000 }
    }
}

impl BreakerPolicy {
    pub fn enabled(&self) -> bool {
        self.failures > 0
    }

    /// The pause after the `opens`-th consecutive opening (1-based).
    pub fn pause_ms(&self, opens: i64) -> u64 {
        let shift = u32::try_from(opens.saturating_sub(1).clamp(0, 20)).unwrap_or(20);
        self.open_ms.saturating_mul(1 << shift).min(self.open_ms_max.max(self.open_ms))
    }
}

settle_core::names! {
    /// Where one event's delivery to one endpoint is.
    pub DeliveryState {
        Pending = "pending",
        Delivered = "delivered",
        Dead = "dead",
    }
}

settle_core::names! {
    /// A webhook endpoint's circuit breaker: sending, paused, or letting one probe through.
    pub BreakerState {
        Closed = "closed",
        Open = "open",
        HalfOpen = "half_open",
    }
}

/// An endpoint's undelivered deliveries (`/metrics`, the console).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WebhookBacklog {
    pub endpoint_id: String,
    /// Waiting to be delivered (due or backing off).
    pub pending: i64,
    /// Given up on; a person requeues them.
    pub dead: i64,
    /// When the oldest waiting delivery was fanned out (its event was numbered).
    pub oldest_pending_at: Option<Timestamp>,
}

/// Where a webhook endpoint's breaker stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BreakerStatus {
    pub endpoint_id: String,
    pub state: BreakerState,
    /// Consecutive failed sends while closed.
    pub failures: i64,
    /// Consecutive openings without a success between them.
    pub opens: i64,
    /// When an open breaker lets its next probe through.
    pub next_probe_at: Option<Timestamp>,
}

/// Where a new webhook endpoint's deliveries begin. An endpoint that has begun continues from where
/// it is, whatever this says.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StartFrom {
    /// Events appended from now on (the default: adding an endpoint does not replay history).
    #[default]
    Now,
    /// The whole outbox, from its first event.
    Beginning,
}

#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct DeliveryFilter {
    pub endpoint_id: Option<String>,
    pub state: Option<DeliveryState>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The store's own closed sets: each name parses back to itself, and no two share a text (the
    /// database's CHECK constraints spell the same texts).
    #[test]
    fn the_store_closed_sets_round_trip() {
        macro_rules! round_trip {
            ($($set:ident),+) => {$(
                let texts: std::collections::BTreeSet<&str> = $set::ALL.iter().map(|v| v.as_str()).collect();
                assert_eq!(texts.len(), $set::ALL.len(), "{}", stringify!($set));
                for v in $set::ALL {
                    assert_eq!($set::parse(v.as_str()), Some(v), "{}", stringify!($set));
                }
                assert_eq!($set::parse("not-a-name"), None);
            )+};
        }
        round_trip!(FailureState, DeliveryState, BreakerState, ActionKind, Invariant);
        // The audit's texts are on the wire (`GET /v1/audit`): exactly these.
        assert_eq!(
            Invariant::ALL.map(Invariant::as_str),
            ["L1", "L2", "L3", "L4", "L5", "L6", "L7", "L8", "L9", "SEQ"]
        );
        for (old, new) in [("grant", ActionKind::AccountGrant), ("audit", ActionKind::LedgerAudit)] {
            assert_eq!(ActionKind::parse_stored(old), Some(new));
        }
        for k in ActionKind::ALL {
            assert_eq!(ActionKind::parse_stored(k.as_str()), Some(k));
        }
    }
}
