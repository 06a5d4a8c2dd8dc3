//! `Store` for `SqlStore`: every method validates what the store must, then runs its transition
//! from `ops` as one operation, and continues after the commit where the transition says so.

use super::{Backend, Route, SqlStore, check_text, lease_lost, next_cursor};
use crate::db::Db;
use crate::error::StoreError;
use crate::model::*;
use crate::ops::plan::{Intent, IntentKind};
use crate::ops::{self, After, Caller, Cx};
use crate::store::{Operators, Payouts, Store, Webhooks};
use crate::{audit, reads};
use async_trait::async_trait;
use futures_util::future::BoxFuture;
use settle_core::crash::CrashPoint;
use settle_core::fingerprint::canonical_json;
use settle_core::ids::{AccountId, FailCode, ItemId, JobId};
use settle_core::ledger::EntryKind;
use settle_core::{Credits, limits};
use std::sync::Arc;

#[async_trait]
impl Store for SqlStore {
    fn engine_name(&self) -> &'static str {
        self.engine().name()
    }

    fn payouts(&self) -> &dyn Payouts {
        self
    }

    fn funding(&self) -> &dyn crate::store::Funding {
        self
    }

    fn webhooks(&self) -> &dyn Webhooks {
        self
    }

    fn operators(&self) -> &dyn Operators {
        self
    }

    fn wake(&self) -> Arc<tokio::sync::Notify> {
        self.wake.clone()
    }

    fn events_wake(&self) -> Arc<tokio::sync::Notify> {
        self.events_wake.clone()
    }

    fn now(&self) -> settle_core::Timestamp {
        self.env.clock.now()
    }

    async fn worker_labels_since(
        &self,
        since: settle_core::Timestamp,
    ) -> Result<Vec<settle_core::ids::Labels>, StoreError> {
        self.read(op!([] | db, _cx | crate::ops::lines::labels_seen_since(db, since).await)).await
    }

    async fn next_due_at(
        &self,
        kinds: &[settle_core::ids::JobKind],
    ) -> Result<Option<settle_core::Timestamp>, StoreError> {
        let kinds = kinds.to_vec();
        self.read(op!([kinds] | db, _cx | reads::next_due_at(db, &kinds).await)).await
    }

    async fn create_account(&self, req: NewAccount, actor: &str) -> Result<Created<Account>, StoreError> {
        let actor = actor.to_owned();
        let route = req.id.as_str().to_owned();
        let out = self
            .write_to(
                Route::Account(&route),
                op!(
                    [req, actor] | db,
                    cx | {
                        let out = ops::create_account(db, cx, &req).await?;
                        if !out.replayed {
                            let detail = serde_json::json!({
                                "overdraft_limit": req.overdraft_limit.get(),
                                "max_running": req.max_running,
                            });
                            ops::record_action(
                                db,
                                cx,
                                &actor,
                                ActionKind::AccountCreate,
                                None,
                                Some(req.id.as_str()),
                                detail,
                            )
                            .await?;
                        }
                        Ok(out)
                    }
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn update_account(
        &self,
        id: &AccountId,
        changes: AccountChanges,
        actor: &str,
    ) -> Result<Account, StoreError> {
        let actor = actor.to_owned();
        let id = id.clone();
        let out = self
            .write_closing_gate(op!(
                [id, changes, actor] | db,
                cx | {
                    let (account, changed) = ops::update_account(db, cx, &id, &changes).await?;
                    if changed {
                        let detail = serde_json::json!({
                            "overdraft_limit": account.overdraft_limit.get(),
                            "max_running": account.max_running,
                        });
                        ops::record_action(db, cx, &actor, ActionKind::AccountUpdate, None, Some(id.as_str()), detail)
                            .await?;
                    }
                    Ok(account)
                }
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn set_alerts(
        &self,
        id: &AccountId,
        alerts: Vec<(String, i64)>,
        actor: &str,
    ) -> Result<Vec<Alert>, StoreError> {
        let actor = actor.to_owned();
        let id = id.clone();
        let out = self
            .write(op!(
                [id, alerts, actor] | db,
                cx | {
                    let (stored, changed) = ops::alerts::set_alerts(db, cx, id.as_str(), &alerts).await?;
                    let detail = || serde_json::json!({
                        "alerts": stored.iter().map(|a| serde_json::json!({"id": a.id, "below": a.below})).collect::<Vec<_>>(),
                    });
                    replaced(db, cx, (&actor, ActionKind::AccountAlerts, id.as_str()), changed, detail).await?;
                    Ok(stored)
                }
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn alerts(&self, id: &AccountId) -> Result<Vec<Alert>, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, _cx | ops::alerts::alerts(db, id.as_str()).await)).await
    }

    async fn set_limits(
        &self,
        id: &AccountId,
        limits: Vec<NewLimit>,
        actor: &str,
    ) -> Result<Vec<SpendLimit>, StoreError> {
        let actor = actor.to_owned();
        let id = id.clone();
        let out = self
            .write_alone(op!(
                [id, limits, actor] | db,
                cx | {
                    let (stored, changed) = ops::spend_limits::set_limits(db, cx, id.as_str(), &limits).await?;
                    let detail = || {
                        serde_json::json!({
                            "limits": stored.iter().map(|l| serde_json::json!({
                                "period": l.period.as_str(), "amount": l.amount, "kinds": l.kinds,
                            })).collect::<Vec<_>>(),
                        })
                    };
                    replaced(db, cx, (&actor, ActionKind::AccountLimits, id.as_str()), changed, detail).await?;
                    Ok(stored)
                }
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn limits(&self, id: &AccountId) -> Result<Vec<SpendLimit>, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, cx | ops::spend_limits::spend_limits(db, cx, id.as_str()).await)).await
    }

    async fn account(&self, id: &AccountId) -> Result<Account, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, _cx | reads::account(db, &id).await)).await
    }

    async fn accounts(
        &self,
        scope: &settle_core::scope::Scope,
        after: Option<&AccountId>,
        limit: u32,
    ) -> Result<AccountPage, StoreError> {
        let (scope, after) = (scope.clone(), after.map(|a| a.as_str().to_owned()).unwrap_or_default());
        self.read(op!([scope, after] | db, _cx | reads::accounts(db, &scope, &after, limit).await)).await
    }

    async fn grant(&self, account: &AccountId, req: NewGrant, actor: &str) -> Result<Created<LedgerEntry>, StoreError> {
        if !req.amount.is_positive() {
            return Err(StoreError::invalid("a grant's amount must be greater than zero"));
        }
        check_text("reason", req.reason.as_deref(), false)?;
        let terms = ops::grant_terms(req.expires_at, req.priority)?;
        let (account, actor) = (account.clone(), actor.to_owned());
        let out = self
            .write_alone(op!([account, req, actor] | db, cx | {
                let credit = ops::Credit {
                    kind: EntryKind::Grant,
                    account: &account,
                    id: req.id.as_str(),
                    amount: req.amount,
                    reason: req.reason.as_deref(),
                    terms,
                };
                let out = ops::credit(db, cx, &credit).await?;
                if !out.replayed {
                    let detail = serde_json::json!({ "id": req.id.as_str(), "amount": req.amount.get(), "seq": out.value.seq });
                    ops::record_action(db, cx, &actor, ActionKind::AccountGrant, None, Some(account.as_str()), detail).await?;
                }
                Ok(out)
            }))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn adjust(
        &self,
        account: &AccountId,
        req: NewAdjustment,
        actor: &str,
    ) -> Result<Created<LedgerEntry>, StoreError> {
        if req.amount == Credits::ZERO {
            return Err(StoreError::invalid("an adjustment's amount must not be zero"));
        }
        check_text("reason", Some(&req.reason), true)?;
        let (account, actor) = (account.clone(), actor.to_owned());
        let out = self
            .write_alone(op!([account, req, actor] | db, cx | {
                let credit = ops::Credit {
                    kind: EntryKind::Adjustment,
                    account: &account,
                    id: req.id.as_str(),
                    amount: req.amount,
                    reason: Some(&req.reason),
                    terms: ops::allocations::Terms::default(),
                };
                let out = ops::credit(db, cx, &credit).await?;
                if !out.replayed {
                    let detail = serde_json::json!({
                        "id": req.id.as_str(), "amount": req.amount.get(), "reason": req.reason, "seq": out.value.seq
                    });
                    ops::record_action(db, cx, &actor, ActionKind::AccountAdjust, None, Some(account.as_str()), detail).await?;
                }
                Ok(out)
            }))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn ledger(&self, account: &AccountId, page: Page) -> Result<Paged<LedgerEntry>, StoreError> {
        let account = account.clone();
        self.read(op!([account] | db, _cx | reads::ledger(db, &account, page).await)).await
    }

    async fn grants(&self, account: &AccountId, page: Page) -> Result<Paged<Grant>, StoreError> {
        let account = account.clone();
        self.read(op!([account] | db, cx | reads::grants(db, &account, cx.now, page).await)).await
    }

    async fn allocations(&self, job: &JobId) -> Result<Vec<Allocation>, StoreError> {
        let job = job.clone();
        self.read(op!(
            [job] | db,
            _cx | {
                ops::must_read_job(db, _cx, job.as_str()).await?;
                reads::job_allocations(db, job.as_str()).await
            }
        ))
        .await
    }

    async fn create_job(&self, req: NewJob) -> Result<Created<Job>, StoreError> {
        let job = ops::validate_job(req)?;
        let account = job.req.account_id.as_str().to_owned();
        let out =
            self.write_to(Route::Account(&account), op!([job] | db, cx | ops::create_job(db, cx, &job).await)).await?;
        // The job as stored (a replay answers the original), never the request that may have been refused.
        self.remember_job(out.value.id.as_str(), out.value.account_id.as_str());
        if !out.replayed {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn job(&self, id: &JobId) -> Result<Job, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, cx | ops::must_read_job(db, cx, id.as_str()).await)).await
    }

    async fn jobs(&self, filter: &JobFilter, page: Page) -> Result<Paged<Job>, StoreError> {
        reads::filter::check_filter(filter)?;
        let filter = filter.clone();
        self.read(op!([filter] | db, cx | reads::jobs(db, cx, &filter, page).await)).await
    }

    async fn claim(&self, req: ClaimRequest) -> Result<Vec<ClaimedJob>, StoreError> {
        if req.lease_seconds.is_some_and(|s| !(limits::LEASE_SECONDS_MIN..=limits::LEASE_SECONDS_MAX).contains(&s)) {
            return Err(StoreError::invalid(format!(
                "lease_seconds must be between {} and {}",
                limits::LEASE_SECONDS_MIN,
                limits::LEASE_SECONDS_MAX
            )));
        }
        if req.limit == 0 || req.limit > limits::CLAIM_LIMIT_MAX {
            return Err(StoreError::invalid(format!("limit must be between 1 and {}", limits::CLAIM_LIMIT_MAX)));
        }
        if req.kinds.len() > limits::CLAIM_KINDS_MAX {
            return Err(StoreError::invalid(format!("at most {} kinds per claim", limits::CLAIM_KINDS_MAX)));
        }
        let out = self.write_quiet(op!([req] | db, cx | ops::claim(db, cx, &req, Caller::Worker).await)).await?;
        if !out.is_empty() {
            self.events_appended();
        }
        for c in &out {
            self.remember_job(c.job.id.as_str(), c.job.account_id.as_str());
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError> {
        self.heartbeat_as(job, token, Caller::Worker).await
    }

    async fn item_succeed_priced(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        cost: Option<settle_core::Credits>,
    ) -> Result<ItemReport, StoreError> {
        let route = Route::Job(job.as_str());
        let (job, item, token) = (job.clone(), item.clone(), token.clone());
        let out = self
            .write_to(
                route,
                op!([job, item, token] | db, cx | ops::item_report(db, cx, &job, &item, &token, None, cost).await),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }

    async fn item_fail(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        code: &FailCode,
        message: Option<&str>,
    ) -> Result<ItemReport, StoreError> {
        check_text("message", message, false)?;
        let route = Route::Job(job.as_str());
        let (job, item, token, code) = (job.clone(), item.clone(), token.clone(), code.clone());
        let message = message.map(str::to_owned);
        let out = self
            .write_to(
                route,
                op!(
                    [job, item, token, code, message] | db,
                    cx | ops::item_report(db, cx, &job, &item, &token, Some((&code, message.as_deref())), None).await
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }

    async fn register_artifact(
        &self,
        job: &JobId,
        item: &ItemId,
        token: &LeaseToken,
        artifact: NewArtifact,
    ) -> Result<bool, StoreError> {
        let route = Route::Job(job.as_str());
        let (job, item, token) = (job.clone(), item.clone(), token.clone());
        let store = self.artifacts.as_ref().map(|a| a.location());
        let out = self
            .write_quiet_to(
                route,
                op!(
                    [job, item, token, artifact, store] | db,
                    cx | ops::register_artifact(db, cx, &job, &item, &token, &artifact, store.as_deref()).await
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        out.map_err(lease_lost)
    }

    async fn succeed_priced(
        &self,
        job: &JobId,
        by: Reporter<'_>,
        result: Option<serde_json::Value>,
        costs: &Costs,
    ) -> Result<Outcome<Job>, StoreError> {
        let (id, result, costs) = (job.clone(), result.as_ref().map(canonical_json), costs.clone());
        let (token, actor) = match by {
            Reporter::Lease(t) => (Some(t.clone()), None),
            Reporter::Operator(a) => (None, Some(a.to_owned())),
            // The reconciler succeeds a job through `reconcile`, on what the outside system said.
            Reporter::Reconciler => {
                return Err(StoreError::invalid("a success needs a lease token or an operator"));
            }
        };
        // A success with a lease token and no prices is the plan's (docs/design/batch-plan.md §12).
        let intent = match (&token, costs.0.is_empty()) {
            (Some(t), true) => {
                Some(Intent { job: job.as_str().to_owned(), kind: IntentKind::Succeed { token: t.0.clone() } })
            }
            _ => None,
        };
        let (outcome, after, refused) = self
            .write_intent(
                Route::Job(job.as_str()),
                intent,
                op!(
                    [id, token, actor, result, costs] | db,
                    cx | {
                        let by = match (&token, &actor) {
                            (Some(t), _) => Reporter::Lease(t),
                            (None, a) => Reporter::Operator(a.as_deref().unwrap_or(SYSTEM_ACTOR)),
                        };
                        ops::succeed(db, cx, &id, by, result.as_deref(), &costs).await
                    }
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        super::answer(self.continue_after(outcome.value, after).await, outcome.applied, refused)
    }

    async fn fail(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError> {
        self.fail_as(job, signal, Caller::Worker).await
    }

    async fn release(&self, job: &JobId, token: &LeaseToken) -> Result<Outcome<Job>, StoreError> {
        self.release_as(job, token, Caller::Worker).await
    }

    async fn mark_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError> {
        self.unknown_as(job, token, message, Caller::Worker).await
    }

    async fn reconcile(&self, job: &JobId, finding: Finding) -> Result<Outcome<Job>, StoreError> {
        let id = job.clone();
        let (outcome, after) = self
            .write_to(Route::Job(job.as_str()), op!([id] | db, cx | ops::reconcile(db, cx, &id, finding).await))
            .await?;
        if outcome.applied {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        let value = self.continue_after(outcome.value, after).await?;
        Ok(Outcome { value, applied: outcome.applied })
    }

    async fn cancel(&self, job: &JobId, actor: Option<&str>) -> Result<CancelOutcome, StoreError> {
        self.cancel_as(job, actor).await
    }

    async fn abandon_cleanup(&self, job: &JobId, actor: &str, reason: &str) -> Result<Job, StoreError> {
        self.abandon_cleanup_as(job, actor, reason).await
    }

    async fn cleanup_retry(&self, job: &JobId) -> Result<Option<CleanupRetry>, StoreError> {
        let id = job.clone();
        self.read(op!([id] | db, _cx | ops::cleanup_retry(db, id.as_str()).await)).await
    }

    async fn requeue(&self, job: &JobId, actor: &str) -> Result<Job, StoreError> {
        let (id, actor) = (job.clone(), actor.to_owned());
        let out = self
            .write_to(
                Route::Job(job.as_str()),
                op!(
                    [id, actor] | db,
                    cx | {
                        let before = ops::must_lock_job(db, id.as_str()).await?.state;
                        let job = ops::requeue(db, cx, &id).await?;
                        // A re-sent requeue answers the job again; only the one that moved it is an action.
                        if before == settle_core::job::JobState::Dead {
                            let detail = serde_json::json!({ "attempt": job.attempt });
                            ops::record_action(
                                db,
                                cx,
                                &actor,
                                ActionKind::JobRequeue,
                                Some(id.as_str()),
                                Some(job.account_id.as_str()),
                                detail,
                            )
                            .await?;
                        }
                        Ok(job)
                    }
                ),
            )
            .await?;
        self.work_due();
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn expire_grants(&self, limit: u32) -> Result<Vec<String>, StoreError> {
        let now = self.env.clock.now();
        let due = self.read(op!([] | db, _cx | reads::accounts_due(db, now, limit).await)).await?;
        let mut expired = Vec::new();
        for id in due {
            let account = id.clone();
            match self
                .write_to(
                    Route::Account(&id),
                    op!(
                        [account] | db,
                        cx | ops::expiry::expire_due(db, cx, &account, ops::expiry::Expiry::Pass).await
                    ),
                )
                .await
            {
                Ok(0) => {}
                Ok(_) => expired.push(id),
                Err(e @ (StoreError::InjectedCrash(_) | StoreError::Unavailable(_))) => return Err(e),
                // One account that fails every time must not stop the expiry of those behind it.
                Err(e) => {
                    tracing::error!(account = %id, error = %e, "grant expiry failed; continuing with the next account")
                }
            }
        }
        Ok(expired)
    }

    async fn rescue_expired_leases(&self, limit: u32) -> Result<Vec<String>, StoreError> {
        let now = self.env.clock.now();
        let after = *self.rescue_after.lock().expect("cursor lock");
        let seen = self.read(op!([] | db, _cx | reads::expired_leases(db, now, after, limit).await)).await?;
        let seqs: Vec<i64> = seen.iter().map(|(seq, _, _)| *seq).collect();
        *self.rescue_after.lock().expect("cursor lock") = next_cursor(&seqs, limit);
        let mut rescued = Vec::new();
        for (_, id, token) in seen {
            let job_id = id.clone();
            let rescued_one = async {
                let (applied, after) = self
                    .write_to(
                        Route::Job(&id),
                        op!([job_id, token] | db, cx | ops::expire_lease(db, cx, &job_id, &token).await),
                    )
                    .await?;
                if applied && after == After::Teardown {
                    let job = self.job(&JobId::stored(&id)).await?;
                    self.continue_after(job, after).await?;
                }
                Ok::<bool, StoreError>(applied)
            };
            // One job that fails every time must not stop the rescue of those behind it.
            match rescued_one.await {
                Ok(true) => {
                    self.work_due();
                    rescued.push(id);
                }
                Ok(false) => {}
                Err(e @ (StoreError::InjectedCrash(_) | StoreError::Unavailable(_))) => return Err(e),
                Err(e) => tracing::error!(job = %id, error = %e, "lease rescue failed; continuing with the next job"),
            }
        }
        // Parked jobs of accounts below their caps wait again (docs/design/fair-claims.md §10): here
        // too, not only in claims, so they return while every worker long-polls.
        match self.write(op!([] | db, cx | ops::unpark_and_wake(db, cx).await)).await {
            Ok(0) => {}
            Ok(_) => self.work_due(),
            Err(e @ (StoreError::InjectedCrash(_) | StoreError::Unavailable(_))) => return Err(e),
            Err(e) => tracing::error!(error = %e, "the unpark pass failed; the next one tries again"),
        }
        Ok(rescued)
    }

    async fn resume_teardowns(&self, limit: u32) -> Result<Vec<String>, StoreError> {
        let after = *self.sweep_after.lock().expect("cursor lock");
        let ids = self.read(op!([] | db, cx | reads::cancelling(db, cx.now, after, limit).await)).await?;
        let seqs: Vec<i64> = ids.iter().map(|(seq, _)| *seq).collect();
        *self.sweep_after.lock().expect("cursor lock") = next_cursor(&seqs, limit);
        let mut done = Vec::new();
        for (_, id) in ids {
            match self.finish_teardown(&id).await {
                Ok(job) if job.state == settle_core::job::JobState::Cancelled => done.push(id),
                Ok(_) => {}
                Err(StoreError::CleanupFailed { job, message }) => {
                    tracing::warn!(%job, %message, "artifact cleanup failed again; will retry");
                }
                Err(e @ (StoreError::InjectedCrash(_) | StoreError::Unavailable(_))) => return Err(e),
                Err(e) => tracing::error!(job = %id, error = %e, "teardown failed; continuing with the next job"),
            }
        }
        Ok(done)
    }

    async fn attempts(&self, job: &JobId) -> Result<Vec<Attempt>, StoreError> {
        let id = job.clone();
        self.read(op!([id] | db, cx | reads::attempts(db, cx, id.as_str()).await)).await
    }

    async fn signals(&self, job: &JobId) -> Result<Vec<SignalRecord>, StoreError> {
        let id = job.clone();
        self.read(op!([id] | db, _cx | reads::signals(db, id.as_str()).await)).await
    }

    async fn failure_summary(&self, scope: &settle_core::scope::Scope) -> Result<Vec<FailureCount>, StoreError> {
        let scope = scope.clone();
        self.read(op!([scope] | db, _cx | reads::failure_summary(db, &scope).await)).await
    }

    async fn events(
        &self,
        after: i64,
        limit: u32,
        scope: &settle_core::scope::Scope,
    ) -> Result<Paged<Event>, StoreError> {
        let scope = scope.clone();
        self.events_ready().await?;
        self.read(op!([scope] | db, _cx | reads::events(db, after, limit, &scope).await)).await
    }

    async fn ready(&self) -> Result<(), StoreError> {
        self.ready_for_writes().await
    }

    fn database_stats(&self) -> DatabaseStats {
        self.connection_stats()
    }

    async fn stats(&self) -> Result<Stats, StoreError> {
        let now = self.now();
        let mut stats = self.read(op!([] | db, _cx | reads::stats(db, now).await)).await?;
        stats.tx_retries = self.tx_retries();
        Ok(stats)
    }

    async fn audit_with(
        &self,
        run: AuditRun,
        progress: Option<Arc<dyn Fn(audit::AuditProgress) + Send + Sync>>,
    ) -> Result<AuditReport, StoreError> {
        let progress = progress.unwrap_or_else(|| Arc::new(|_| {}));
        let (mut report, record) = match &self.backend {
            // Streamed through rusqlite on blocking threads: sqlx-sqlite sends every row from its
            // worker thread to the caller, which costs far more than SQLite reading it. The ledger
            // pass and the items pass run at once on two connections of one snapshot.
            Backend::Sqlite { path, audits, .. } => {
                let (path, kept) = (path.clone(), audits.clone());
                let runtime = tokio::runtime::Handle::current();
                tokio::task::spawn_blocking(move || {
                    super::audits::sqlite_audit(&path, &kept, &runtime, run, &*progress)
                })
                .await
                .map_err(|e| StoreError::internal(format!("the audit thread failed: {e}")))??
            }
            Backend::Postgres { shared, .. } => super::audits::postgres_audit(shared, run, &*progress).await?,
        };
        if run.record {
            report.checkpoint.recorded = Some(match record {
                Some(record) => {
                    let record = Arc::new(record);
                    let write = self
                        .write_quiet(op!(
                            [record] | db,
                            cx | {
                                let written = crate::audit_checkpoint::write(db, cx.now, &record).await?;
                                cx.point(CrashPoint::BeforeCommit).map(|()| written)
                            }
                        ))
                        .await;
                    // The audit's verdict stands; only the checkpoint is lost.
                    write.unwrap_or_else(|e| Err(format!("the checkpoint could not be written: {e}")))
                }
                None => Err("the audit found something wrong: no checkpoint recorded".to_owned()),
            });
        }
        // Whatever it was asked: trust in what the checkpoint proved ends with the first audit that
        // finds something wrong (decision 0040).
        if !report.ok() {
            let retired = self.write_quiet(op!([] | db, cx | crate::audit_checkpoint::retire(db, cx.now).await)).await;
            if let Err(e) = &retired {
                tracing::error!(error = %e, "the audit found violations, and its checkpoint could not be retired");
            }
            report.checkpoint.retired = Some(retired.map_err(|e| e.to_string()));
        }
        Ok(report)
    }
}

#[async_trait]
impl Webhooks for SqlStore {
    async fn start(&self, endpoint: &str, from: StartFrom) -> Result<bool, StoreError> {
        let endpoint = endpoint.to_owned();
        self.events_ready().await?;
        self.write_quiet(op!([endpoint] | db, cx | ops::webhooks::start(db, cx, &endpoint, from).await)).await
    }
    async fn requeue_dead(&self, endpoint: &str, limit: u32, actor: &str) -> Result<u64, StoreError> {
        let (endpoint, actor) = (endpoint.to_owned(), actor.to_owned());
        self.write_quiet(op!(
            [endpoint, actor] | db,
            cx | {
                let n = ops::webhooks::requeue_dead(db, cx, &endpoint, limit).await?;
                if n > 0 {
                    let detail = serde_json::json!({ "endpoint": endpoint, "requeued": n });
                    ops::record_action(db, cx, &actor, ActionKind::WebhookRequeueDead, None, None, detail).await?;
                }
                Ok(n)
            }
        ))
        .await
    }
    async fn prune(&self, endpoint: &str, before: settle_core::Timestamp, limit: u32) -> Result<u64, StoreError> {
        let endpoint = endpoint.to_owned();
        self.write_quiet(op!([endpoint] | db, _cx | ops::webhooks::prune(db, &endpoint, before, limit).await)).await
    }
    async fn fan_out(&self, endpoint: &str, batch: u32) -> Result<u64, StoreError> {
        // Numbered first, never inside a lane's batch (a money-moving batch never takes the
        // counter the sequencer holds).
        self.events_ready().await?;
        let endpoint = endpoint.to_owned();
        let created =
            self.write_quiet(op!([endpoint] | db, cx | ops::webhooks::fan_out(db, cx, &endpoint, batch).await)).await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(created)
    }
    async fn lease(
        &self,
        endpoint: &str,
        limit: u32,
        lease_ms: u64,
        attempts_max: u32,
        breaker: BreakerPolicy,
    ) -> Result<Vec<Delivery>, StoreError> {
        let endpoint = endpoint.to_owned();
        let claimed = self
            .write_quiet(op!(
                [endpoint] | db,
                cx | ops::webhooks::claim(db, cx, &endpoint, limit, lease_ms, attempts_max, breaker).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(claimed)
    }
    async fn report(
        &self,
        endpoint: &str,
        seq: i64,
        token: &LeaseToken,
        report: DeliveryReport,
        breaker: BreakerPolicy,
    ) -> Result<bool, StoreError> {
        let (endpoint, token) = (endpoint.to_owned(), token.clone());
        let applied = self
            .write_quiet(op!(
                [endpoint, token, report] | db,
                cx | ops::webhooks::report(db, cx, &endpoint, seq, &token, &report, breaker).await
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(applied)
    }
    async fn breakers(&self) -> Result<Vec<BreakerStatus>, StoreError> {
        self.read(op!([] | db, _cx | reads::webhooks::breakers(db).await)).await
    }
    async fn close_breaker(&self, endpoint: &str, actor: &str) -> Result<BreakerStatus, StoreError> {
        let (endpoint, actor) = (endpoint.to_owned(), actor.to_owned());
        self.write_quiet(op!(
            [endpoint, actor] | db,
            cx | {
                let b = ops::webhooks::close_by_hand(db, cx, &endpoint).await?;
                let detail = serde_json::json!({ "endpoint": endpoint });
                ops::record_action(db, cx, &actor, ActionKind::WebhookCloseBreaker, None, None, detail).await?;
                Ok(b)
            }
        ))
        .await
    }
    async fn requeue_one(&self, endpoint: &str, seq: i64, actor: &str) -> Result<Delivery, StoreError> {
        let (endpoint, actor) = (endpoint.to_owned(), actor.to_owned());
        self.write_quiet(op!(
            [endpoint, actor] | db,
            cx | {
                let d = ops::webhooks::requeue(db, cx, &endpoint, seq).await?;
                let detail = serde_json::json!({ "endpoint": endpoint, "seq": seq });
                let (job, account) = (d.event.job_id.clone(), d.event.account_id.clone());
                ops::record_action(db, cx, &actor, ActionKind::WebhookRequeue, job.as_deref(), Some(&account), detail)
                    .await?;
                Ok(d)
            }
        ))
        .await
    }
    async fn deliveries(&self, filter: &DeliveryFilter, after: i64, limit: u32) -> Result<Paged<Delivery>, StoreError> {
        let filter = filter.clone();
        self.read(op!([filter] | db, _cx | reads::webhooks::list(db, &filter, after, limit).await)).await
    }
    async fn backlog(&self) -> Result<Vec<WebhookBacklog>, StoreError> {
        self.read(op!([] | db, _cx | reads::webhooks::webhook_backlog(db).await)).await
    }
}

#[async_trait]
impl Operators for SqlStore {
    async fn overview(&self, since: settle_core::Timestamp) -> Result<Overview, StoreError> {
        self.events_ready().await?;
        let now = self.now();
        self.read(op!([] | db, _cx | reads::overview(db, now, since).await)).await
    }
    async fn job_totals(&self, filter: &JobFilter, net: bool) -> Result<JobTotals, StoreError> {
        reads::filter::check_filter(filter)?;
        let filter = filter.clone();
        self.read(op!([filter] | db, _cx | reads::job_totals(db, &filter, net).await)).await
    }
    async fn job_history(&self, job: &JobId) -> Result<JobHistory, StoreError> {
        self.events_ready().await?;
        let id = job.clone();
        self.read(op!([id] | db, cx | reads::job_history(db, cx, id.as_str()).await)).await
    }
    async fn account_detail(&self, account: &AccountId) -> Result<AccountDetail, StoreError> {
        let id = account.clone();
        self.read(op!([id] | db, _cx | reads::account_detail(db, id.as_str()).await)).await
    }
    async fn verify_chain(&self, account: &AccountId) -> Result<Option<i64>, StoreError> {
        let id = account.clone();
        self.read(op!([id] | db, _cx | reads::verify_chain(db, id.as_str()).await)).await
    }
    async fn entries(
        &self,
        account: &AccountId,
        kind: Option<EntryKind>,
        since: Option<settle_core::Timestamp>,
        page: Page,
    ) -> Result<Paged<LedgerEntry>, StoreError> {
        let id = account.clone();
        self.read(op!([id] | db, _cx | reads::entries(db, id.as_str(), kind, since, page).await)).await
    }
    async fn record_action(
        &self,
        actor: &str,
        action: ActionKind,
        detail: serde_json::Value,
    ) -> Result<(), StoreError> {
        let actor = actor.to_owned();
        self.write(op!([actor, detail] | db, cx | ops::record_action(db, cx, &actor, action, None, None, detail).await))
            .await
    }
    async fn actions(&self, job: Option<&JobId>, account: Option<&AccountId>) -> Result<Vec<Action>, StoreError> {
        let (job, account) = (job.map(|j| j.as_str().to_owned()), account.map(|a| a.as_str().to_owned()));
        self.read(op!([job, account] | db, _cx | reads::actions(db, job.as_deref(), account.as_deref()).await)).await
    }
    async fn sign_out(&self, nonce: &str, expires_at: i64) -> Result<(), StoreError> {
        if nonce.is_empty() || nonce.len() > 128 {
            return Err(StoreError::invalid("a session nonce is 1 to 128 characters"));
        }
        let nonce = nonce.to_owned();
        self.write(op!([nonce] | db, cx | ops::sign_out(db, cx, &nonce, expires_at).await)).await
    }
    async fn signed_out(&self, nonce: &str) -> Result<bool, StoreError> {
        let nonce = nonce.to_owned();
        self.read(op!([nonce] | db, _cx | reads::signed_out(db, &nonce).await)).await
    }
}

/// An account's set (alerts, limits) replaced: the replacement recorded in the action log under
/// `actor` when it changed anything, then the crash point before COMMIT.
async fn replaced(
    db: &mut Db<'_>,
    cx: &ops::Cx,
    (actor, kind, account): (&str, ActionKind, &str),
    changed: bool,
    detail: impl FnOnce() -> serde_json::Value,
) -> Result<(), StoreError> {
    if changed {
        ops::record_action(db, cx, actor, kind, None, Some(account), detail()).await?;
    }
    cx.point(CrashPoint::BeforeCommit)
}
