//! The `Store` trait: one call per domain operation. The conformance suite is written against it.

use crate::audit::AuditProgress;
use crate::error::StoreError;
use crate::model::*;
use async_trait::async_trait;
use settle_core::ids::{AccountId, FailCode, ItemId, JobId};
use std::sync::Arc;

#[async_trait]
pub trait Store: Send + Sync {
    fn engine_name(&self) -> &'static str;

    /// Withdrawals: their creation, reads, and the payout processor's transitions.
    fn payouts(&self) -> &dyn Payouts;
    /// The door to top-ups (the funding rail).
    fn funding(&self) -> &dyn Funding;
    /// The door to webhook deliveries.
    fn webhooks(&self) -> &dyn Webhooks;
    /// The door to the console's reads.
    fn operators(&self) -> &dyn Operators;

    /// Notified when a job may have become due: created, requeued, retried, rescued — in this process,
    /// or, on PostgreSQL, in any process. Claim long-polls wait on it.
    fn wake(&self) -> std::sync::Arc<tokio::sync::Notify>;

    /// Notified when this process appended outbox events. Event long-polls and webhook delivery wait on it.
    fn events_wake(&self) -> std::sync::Arc<tokio::sync::Notify>;

    /// The store's clock (injected; tests use a fake one).
    fn now(&self) -> settle_core::Timestamp;

    /// The label sets workers claimed with since `since` (each written at most once a minute per
    /// process: a minute's precision).
    async fn worker_labels_since(
        &self,
        since: settle_core::Timestamp,
    ) -> Result<Vec<settle_core::ids::Labels>, StoreError>;

    /// When the next queued job of these kinds (all kinds when empty) becomes due, if any is queued.
    async fn next_due_at(
        &self,
        kinds: &[settle_core::ids::JobKind],
    ) -> Result<Option<settle_core::Timestamp>, StoreError>;

    /// Creates an account, recording `actor` (a token's name, or `SYSTEM_ACTOR`) in the action log.
    async fn create_account(&self, req: NewAccount, actor: &str) -> Result<Created<Account>, StoreError>;
    async fn account(&self, id: &AccountId) -> Result<Account, StoreError>;
    /// `PATCH /v1/accounts/{id}`: the overdraft limit and the cap (`max_running`) set as `changes`
    /// gives them, recorded in the action log under `actor` when anything changed.
    async fn update_account(&self, id: &AccountId, changes: AccountChanges, actor: &str)
    -> Result<Account, StoreError>;
    /// `PUT /v1/accounts/{id}/alerts`: replaces the account's alerts (`(id, below)` each), each on
    /// the side the balance is on now; fires nothing; recorded in the action log under `actor` when
    /// anything changed. Answers the alerts as stored, in threshold order.
    async fn set_alerts(
        &self,
        id: &AccountId,
        alerts: Vec<(String, i64)>,
        actor: &str,
    ) -> Result<Vec<Alert>, StoreError>;
    /// An account's alerts, in threshold order.
    async fn alerts(&self, id: &AccountId) -> Result<Vec<Alert>, StoreError>;
    /// `PUT /v1/accounts/{id}/limits`: replaces the account's spend limits, each starting from what
    /// the ledger says its current period spent; recorded in the action log under `actor` when
    /// anything changed. Answers the limits as stored, in the order given.
    async fn set_limits(
        &self,
        id: &AccountId,
        limits: Vec<NewLimit>,
        actor: &str,
    ) -> Result<Vec<SpendLimit>, StoreError>;
    /// An account's spend limits with their current period's spend, in order.
    async fn limits(&self, id: &AccountId) -> Result<Vec<SpendLimit>, StoreError>;
    /// The accounts `scope` sees, a page at a time in id order after the id `after` (`None`: from
    /// the first).
    async fn accounts(
        &self,
        scope: &settle_core::scope::Scope,
        after: Option<&AccountId>,
        limit: u32,
    ) -> Result<AccountPage, StoreError>;
    async fn grant(&self, account: &AccountId, req: NewGrant, actor: &str) -> Result<Created<LedgerEntry>, StoreError>;
    async fn adjust(
        &self,
        account: &AccountId,
        req: NewAdjustment,
        actor: &str,
    ) -> Result<Created<LedgerEntry>, StoreError>;
    /// Entries in `seq` order after `page.after`.
    async fn ledger(&self, account: &AccountId, page: Page) -> Result<Paged<LedgerEntry>, StoreError>;
    /// An account's sources of credit — grants, positive adjustments, its opening balance — in the
    /// order they were made (docs/decisions/0023).
    async fn grants(&self, account: &AccountId, page: Page) -> Result<Paged<Grant>, StoreError>;
    /// Which sources of credit paid for a job's items, in the order they were taken.
    async fn allocations(&self, job: &JobId) -> Result<Vec<Allocation>, StoreError>;

    /// Creates a job and charges every item in the same transaction; `insufficient_credits` writes nothing.
    async fn create_job(&self, req: NewJob) -> Result<Created<Job>, StoreError>;
    async fn job(&self, id: &JobId) -> Result<Job, StoreError>;
    async fn jobs(&self, filter: &JobFilter, page: Page) -> Result<Paged<Job>, StoreError>;

    async fn claim(&self, req: ClaimRequest) -> Result<Vec<ClaimedJob>, StoreError>;
    async fn heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError>;
    async fn item_succeed(&self, job: &JobId, item: &ItemId, token: &LeaseToken) -> Result<ItemReport, StoreError> {
        self.item_succeed_priced(job, item, token, None).await
    }
    /// An item's success with its price: required for a held item (docs/decisions/0022).
    async fn item_succeed_priced(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        cost: Option<settle_core::Credits>,
    ) -> Result<ItemReport, StoreError>;
    async fn item_fail(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        code: &FailCode,
        message: Option<&str>,
    ) -> Result<ItemReport, StoreError>;
    /// Returns whether the key was new.
    async fn register_artifact(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        artifact: NewArtifact,
    ) -> Result<bool, StoreError>;

    /// A success report (decision 0019): `applied` when it moved the job; not applied, a replay (the
    /// job had succeeded, or this attempt's success had lost to a cancel); `LeaseLost` for a token no
    /// attempt of this job held (nothing written) or a job no success can move (logged). An
    /// operator's success is recorded in the action log; `job_finished` on a cancelled job. The
    /// `result` is kept as canonical JSON text (`Job.result`).
    async fn succeed(
        &self,
        job: &JobId,
        by: Reporter<'_>,
        result: Option<serde_json::Value>,
    ) -> Result<Outcome<Job>, StoreError> {
        self.succeed_priced(job, by, result, &Costs::default()).await
    }
    /// A job's success with the prices of the held items it decides (docs/decisions/0022).
    async fn succeed_priced(
        &self,
        job: &JobId,
        by: Reporter<'_>,
        result: Option<serde_json::Value>,
        costs: &Costs,
    ) -> Result<Outcome<Job>, StoreError>;
    async fn fail(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError>;
    /// A release by the lease holder, which must stop (spec §3 "Release"): the job goes back to
    /// `queued`, due now, and the attempt closes `released` without counting; with a cancel
    /// requested it is torn down instead. A stale token is `LeaseLost`.
    async fn release(&self, job: &JobId, token: &LeaseToken) -> Result<Outcome<Job>, StoreError>;
    async fn mark_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError>;
    async fn reconcile(&self, job: &JobId, finding: Finding) -> Result<Outcome<Job>, StoreError>;
    /// A cancel: by the client (`actor` `None`), or by an operator, recorded with `actor` in the
    /// action log when it moved the job.
    async fn cancel(&self, job: &JobId, actor: Option<&str>) -> Result<CancelOutcome, StoreError>;
    async fn requeue(&self, job: &JobId, actor: &str) -> Result<Job, StoreError>;
    /// An operator finishes a `cancelling` job's teardown without its artifact cleanup
    /// (`cancelling → cancelled`); the paths left and the `reason` are recorded in the action log
    /// under `actor`, and the `job.cancelled` event names the paths (decision 0028 §6).
    async fn abandon_cleanup(&self, job: &JobId, actor: &str, reason: &str) -> Result<Job, StoreError>;
    /// A cancelling job's failed cleanups: how many, the next try, the last error.
    async fn cleanup_retry(&self, job: &JobId) -> Result<Option<CleanupRetry>, StoreError>;

    /// The lease rescuer's pass: jobs running past their lease take the failure path
    /// (`LEASE_EXPIRED`, retryable), or teardown when a cancel was requested. Returns their ids.
    async fn rescue_expired_leases(&self, limit: u32) -> Result<Vec<String>, StoreError>;
    /// The teardown sweeper's pass: finishes jobs left `cancelling`. Returns those now `cancelled`.
    async fn resume_teardowns(&self, limit: u32) -> Result<Vec<String>, StoreError>;
    /// The expiry pass: expires what is due on up to `limit` accounts with a grant due, each in one
    /// guarded transition on its account. Returns the accounts it expired grants on.
    async fn expire_grants(&self, limit: u32) -> Result<Vec<String>, StoreError>;

    async fn attempts(&self, job: &JobId) -> Result<Vec<Attempt>, StoreError>;
    async fn signals(&self, job: &JobId) -> Result<Vec<SignalRecord>, StoreError>;
    /// The failure summary over the jobs `scope` names.
    async fn failure_summary(&self, scope: &settle_core::scope::Scope) -> Result<Vec<FailureCount>, StoreError>;
    /// Events after `after` of the accounts and kinds `scope` names.
    async fn events(
        &self,
        after: i64,
        limit: u32,
        scope: &settle_core::scope::Scope,
    ) -> Result<Paged<Event>, StoreError>;
    /// Jobs by state and ledger entries by kind (for metrics).
    async fn stats(&self) -> Result<Stats, StoreError>;
    /// Whether the store can take writes now: on PostgreSQL, a connection of the writers' pool
    /// answers and its server is the primary (not in recovery).
    async fn ready(&self) -> Result<(), StoreError>;
    /// The connection counters (`/metrics`), kept in memory so they answer while the database is away.
    fn database_stats(&self) -> DatabaseStats;
    /// L1–L9 and gap-free sequences, over one consistent snapshot, from the first entry. It writes
    /// nothing, except that one which finds something wrong retires the store's audit checkpoint
    /// (decision 0040). `progress` is called as it streams through the ledger and the items.
    async fn audit(
        &self,
        progress: Option<Arc<dyn Fn(AuditProgress) + Send + Sync>>,
    ) -> Result<AuditReport, StoreError> {
        self.audit_with(AuditRun::default(), progress).await
    }
    /// `audit`, from the store's checkpoint and recording one as `run` says (decision 0040): a
    /// checkpoint is recorded only by an audit that found nothing wrong.
    async fn audit_with(
        &self,
        run: AuditRun,
        progress: Option<Arc<dyn Fn(AuditProgress) + Send + Sync>>,
    ) -> Result<AuditReport, StoreError>;
}

/// Webhook deliveries (docs/design/webhooks.md): the deliverer's fan-out, leases and reports, and
/// what an operator does to them. Every write of a delivery goes through this door.
#[async_trait]
pub trait Webhooks: Send + Sync {
    /// Webhooks: begins `endpoint` (its first delivery) where `from` says, if it has not begun.
    async fn start(&self, endpoint: &str, from: StartFrom) -> Result<bool, StoreError>;
    /// Requeues up to `limit` dead deliveries of `endpoint` (an admin's bulk requeue, recorded).
    async fn requeue_dead(&self, endpoint: &str, limit: u32, actor: &str) -> Result<u64, StoreError>;
    /// Deletes up to `limit` delivered rows of `endpoint` delivered before `before` (retention).
    async fn prune(&self, endpoint: &str, before: settle_core::Timestamp, limit: u32) -> Result<u64, StoreError>;
    /// Webhooks: creates the deliveries of the next outbox events for `endpoint` (at most `batch`).
    async fn fan_out(&self, endpoint: &str, batch: u32) -> Result<u64, StoreError>;
    /// Leases up to `limit` due deliveries, each at the head of its job's line for `endpoint`; while
    /// the endpoint's breaker is open, nothing but (when due) one probe.
    async fn lease(
        &self,
        endpoint: &str,
        limit: u32,
        lease_ms: u64,
        attempts_max: u32,
        breaker: BreakerPolicy,
    ) -> Result<Vec<Delivery>, StoreError>;
    /// Records a send's outcome and moves the endpoint's breaker; `false` when the lease was lost
    /// (nothing changed).
    async fn report(
        &self,
        endpoint: &str,
        seq: i64,
        token: &LeaseToken,
        report: DeliveryReport,
        breaker: BreakerPolicy,
    ) -> Result<bool, StoreError>;
    /// Every webhook endpoint's circuit breaker.
    async fn breakers(&self) -> Result<Vec<BreakerStatus>, StoreError>;
    /// Closes an endpoint's breaker by hand (an admin, recorded in the action log).
    async fn close_breaker(&self, endpoint: &str, actor: &str) -> Result<BreakerStatus, StoreError>;
    /// Puts a dead delivery back in line with a fresh attempt budget (recorded with `actor`).
    async fn requeue_one(&self, endpoint: &str, seq: i64, actor: &str) -> Result<Delivery, StoreError>;
    /// Deliveries with their attempts, by filter, page by page.
    async fn deliveries(&self, filter: &DeliveryFilter, after: i64, limit: u32) -> Result<Paged<Delivery>, StoreError>;
    /// Undelivered webhook deliveries by endpoint: (endpoint, pending, dead).
    async fn backlog(&self) -> Result<Vec<WebhookBacklog>, StoreError>;
}

/// The operator console's reads, and the actions it records that move nothing.
#[async_trait]
pub trait Operators: Send + Sync {
    /// Jobs by kind and state, the due count, and events per minute from `since` to now.
    async fn overview(&self, since: settle_core::Timestamp) -> Result<Overview, StoreError>;
    /// How many jobs `filter` matches and the credits they carry (what a bulk action touches);
    /// with `net`, also what they cost their accounts now (reads all their entries).
    async fn job_totals(&self, filter: &JobFilter, net: bool) -> Result<JobTotals, StoreError>;
    /// A job's ledger entries, events and artifacts.
    async fn job_history(&self, job: &JobId) -> Result<JobHistory, StoreError>;
    /// An account with its holds and its number of entries.
    async fn account_detail(&self, account: &AccountId) -> Result<AccountDetail, StoreError>;
    /// Recomputes an account's hash chain from its entries (reads them all): `None` when intact,
    /// else the first entry whose hash does not follow.
    async fn verify_chain(&self, account: &AccountId) -> Result<Option<i64>, StoreError>;
    /// A page of an account's entries, optionally of one kind and from a time on.
    async fn entries(
        &self,
        account: &AccountId,
        kind: Option<settle_core::ledger::EntryKind>,
        since: Option<settle_core::Timestamp>,
        page: Page,
    ) -> Result<Paged<LedgerEntry>, StoreError>;
    /// Records an operator action that moves nothing (an audit run from the console) in the
    /// action log: who, what, when, and what it found.
    async fn record_action(&self, actor: &str, action: ActionKind, detail: serde_json::Value)
    -> Result<(), StoreError>;
    /// The admin actions on a job or an account (both `None`: all), oldest first, at most 1000.
    async fn actions(&self, job: Option<&JobId>, account: Option<&AccountId>) -> Result<Vec<Action>, StoreError>;
    /// Signs a console session out (its `nonce`) in every process, until it would have expired
    /// (`expires_at`, unix seconds); forgets sign-outs already past theirs.
    async fn sign_out(&self, nonce: &str, expires_at: i64) -> Result<(), StoreError>;
    /// Whether the console session of `nonce` was signed out.
    async fn signed_out(&self, nonce: &str) -> Result<bool, StoreError>;
}

/// Withdrawals (spec §4, docs/design/payouts.md). Only the payout processor and reconciler call the
/// transitions; the worker protocol refuses withdrawals.
#[async_trait]
pub trait Payouts: Send + Sync {
    /// Holds the amount (a charge; `insufficient_credits` writes nothing) and makes the
    /// idempotency key, once. Create-by-id: a replay answers the stored withdrawal.
    async fn create_withdrawal(&self, req: NewWithdrawal) -> Result<Created<Withdrawal>, StoreError>;
    async fn withdrawal(&self, id: &JobId) -> Result<Withdrawal, StoreError>;
    async fn withdrawals(&self, filter: &WithdrawalFilter, page: Page) -> Result<Paged<Withdrawal>, StoreError>;
    /// Claims up to `limit` due withdrawals (also those with a cancel request: the processor asks
    /// the provider before a refund), each with its kind's lease.
    async fn claim_payouts(
        &self,
        worker: &settle_core::ids::WorkerName,
        limit: u32,
    ) -> Result<Vec<ClaimedJob>, StoreError>;
    /// Renews the lease just before a send and, unless a cancel was requested, marks the attempt
    /// as sending (committed before the request leaves). `lease_lost` for a stale token.
    async fn payout_heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError>;
    /// The provider has the transfer: success from any attempt, the txid kept; `returned`: the
    /// provider says it came back, recorded in the same transaction.
    async fn payout_succeeded(
        &self,
        job: &JobId,
        token: Option<&LeaseToken>,
        txid: &str,
        returned: bool,
    ) -> Result<Outcome<Withdrawal>, StoreError>;
    /// A definitive failure answer (or `LOOKUP_FAILED`: retried, never dead, a cancel kept).
    async fn payout_failed(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError>;
    /// No answer to a send: `unknown`, never retried automatically.
    async fn payout_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError>;
    /// An operator's resolution of an `unknown` withdrawal (decision 0017): one guarded transition
    /// from `unknown`, recorded with `actor` in the action log; any other state is
    /// `invalid_transition`. Whether a provider could still be asked is the caller's to check.
    async fn payout_resolve(
        &self,
        job: &JobId,
        resolution: Resolution,
        actor: &str,
    ) -> Result<Outcome<Withdrawal>, StoreError>;
    /// `succeeded → returned` with one `payout_return` credit, once; an admin's return is recorded
    /// with `actor` in the action log (`SYSTEM_ACTOR` for the re-check's).
    async fn payout_returned(
        &self,
        job: &JobId,
        source: ReturnSource,
        actor: &str,
    ) -> Result<Outcome<Withdrawal>, StoreError>;
}

/// Top-ups (spec §4a, docs/design/money-controls.md §4). Only the funding processor and its
/// reconciler call the transitions; the worker protocol refuses top-ups.
#[async_trait]
pub trait Funding: Send + Sync {
    /// Reserves the credits under the balance's bound (nothing is charged to the account) and makes
    /// the idempotency key, once. Create-by-id: a replay answers the stored top-up.
    async fn create_top_up(&self, req: NewTopUp) -> Result<Created<TopUp>, StoreError>;
    async fn top_up(&self, id: &JobId) -> Result<TopUp, StoreError>;
    async fn top_ups(&self, filter: &TopUpFilter, page: Page) -> Result<Paged<TopUp>, StoreError>;
    /// Claims up to `limit` due top-ups (also those with a cancel request: the processor asks the
    /// provider first), each with its kind's lease.
    async fn claim_top_ups(
        &self,
        worker: &settle_core::ids::WorkerName,
        limit: u32,
    ) -> Result<Vec<ClaimedJob>, StoreError>;
    /// Renews the lease just before a charge and, unless a cancel was requested, marks the attempt
    /// as charging (committed before the request leaves). `lease_lost` for a stale token.
    async fn top_up_heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError>;
    /// The provider has the charge: success from any attempt, the grant and the charge id in one
    /// transaction; a closed top-up's charge is granted as a late charge.
    async fn top_up_succeeded(
        &self,
        job: &JobId,
        token: Option<&LeaseToken>,
        charge_id: &str,
    ) -> Result<Outcome<TopUp>, StoreError>;
    /// A definitive failure answer (or `LOOKUP_FAILED`: retried, never dead, a cancel kept).
    async fn top_up_failed(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError>;
    /// Puts the account's auto top-up rule (`active`, on the side the balance is on now; nothing
    /// fires), recorded with `actor` in the action log when it changed.
    async fn put_auto_top_up(
        &self,
        account: &AccountId,
        rule: NewAutoTopUp,
        actor: &str,
    ) -> Result<AutoTopUp, StoreError>;
    /// The account's rule; `NotFound` without one.
    async fn auto_top_up(&self, account: &AccountId) -> Result<AutoTopUp, StoreError>;
    /// Removes the rule (a top-up it made goes on); whether there was one.
    async fn delete_auto_top_up(&self, account: &AccountId, actor: &str) -> Result<bool, StoreError>;
    /// No answer to a charge: `unknown`, never charged again blind.
    async fn top_up_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError>;
}
