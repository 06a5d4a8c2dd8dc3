//! `Funding` for `SqlStore`: top-ups' creates, and the funding processor's claims and settlements
//! (docs/design/money-controls.md §4).

use super::{Route, SqlStore};
use crate::db::Db;
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, After, Caller, Cx};
use crate::reads;
use crate::store::Funding;
use async_trait::async_trait;
use futures_util::future::BoxFuture;
use settle_core::crash::CrashPoint;
use settle_core::ids::{AccountId, JobId};
use settle_core::limits;
use std::sync::Arc;

#[async_trait]
impl Funding for SqlStore {
    async fn create_top_up(&self, req: NewTopUp) -> Result<Created<TopUp>, StoreError> {
        ops::top_ups::validate_top_up(&req)?;
        // Alone on PostgreSQL: its first statement takes the grant id's lock, which nothing else in
        // a lane's batch may wait behind.
        let out = self.write_alone(op!([req] | db, cx | ops::top_ups::create_top_up(db, cx, &req, None).await)).await?;
        self.remember_job(out.value.job.id.as_str(), out.value.job.account_id.as_str());
        if !out.replayed {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn top_up(&self, id: &JobId) -> Result<TopUp, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, cx | reads::top_ups::must_read_top_up(db, cx, id.as_str()).await)).await
    }

    async fn top_ups(&self, filter: &TopUpFilter, page: Page) -> Result<Paged<TopUp>, StoreError> {
        let filter = filter.clone();
        self.read(op!([filter] | db, cx | reads::top_ups::top_ups(db, cx, &filter, page).await)).await
    }

    async fn claim_top_ups(
        &self,
        worker: &settle_core::ids::WorkerName,
        limit: u32,
    ) -> Result<Vec<ClaimedJob>, StoreError> {
        if limit == 0 || limit > limits::CLAIM_LIMIT_MAX {
            return Err(StoreError::invalid(format!("limit must be between 1 and {}", limits::CLAIM_LIMIT_MAX)));
        }
        self.claim_as(worker, limit, Caller::FUNDING).await
    }

    async fn top_up_heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError> {
        self.heartbeat_as(job, token, Caller::FUNDING).await
    }

    async fn top_up_succeeded(
        &self,
        job: &JobId,
        token: Option<&LeaseToken>,
        charge_id: &str,
    ) -> Result<Outcome<TopUp>, StoreError> {
        ops::top_ups::check_charge_id(charge_id)?;
        let (id, token, charge_id) = (job.clone(), token.cloned(), charge_id.to_owned());
        let (out, after) = self
            .write_to(
                Route::Job(job.as_str()),
                op!(
                    [id, token, charge_id] | db,
                    cx | ops::top_ups::top_up_succeeded(db, cx, &id, token.as_ref(), &charge_id).await
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        if after == After::Nothing {
            return Ok(out);
        }
        self.continue_after(out.value.job, after).await?;
        Ok(Outcome { value: self.top_up(job).await?, applied: out.applied })
    }

    async fn top_up_failed(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError> {
        self.fail_as(job, signal, Caller::FUNDING).await
    }

    async fn put_auto_top_up(
        &self,
        account: &AccountId,
        rule: NewAutoTopUp,
        actor: &str,
    ) -> Result<AutoTopUp, StoreError> {
        let (id, actor) = (account.clone(), actor.to_owned());
        let out = self
            .write_alone(op!(
                [id, rule, actor] | db,
                cx | {
                    let (stored, changed) = ops::auto_top_ups::put_rule(db, cx, id.as_str(), &rule).await?;
                    if changed {
                        let detail = serde_json::json!({
                            "below": stored.below, "credits": stored.credits.get(), "price": stored.price,
                            "currency": stored.currency, "customer": stored.customer,
                            "monthly_credits_max": stored.monthly_credits_max,
                        });
                        ops::record_action(
                            db,
                            cx,
                            &actor,
                            ActionKind::AccountAutoTopUp,
                            None,
                            Some(id.as_str()),
                            detail,
                        )
                        .await?;
                    }
                    cx.point(CrashPoint::BeforeCommit)?;
                    Ok(stored)
                }
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn auto_top_up(&self, account: &AccountId) -> Result<AutoTopUp, StoreError> {
        let id = account.clone();
        self.read(op!([id] | db, cx | ops::auto_top_ups::rule(db, cx, id.as_str()).await)).await
    }

    async fn delete_auto_top_up(&self, account: &AccountId, actor: &str) -> Result<bool, StoreError> {
        let (id, actor) = (account.clone(), actor.to_owned());
        let out = self
            .write_alone(op!(
                [id, actor] | db,
                cx | {
                    let deleted = ops::auto_top_ups::delete_rule(db, cx, id.as_str()).await?;
                    if deleted {
                        let detail = serde_json::json!({});
                        ops::record_action(
                            db,
                            cx,
                            &actor,
                            ActionKind::AccountAutoTopUpDelete,
                            None,
                            Some(id.as_str()),
                            detail,
                        )
                        .await?;
                    }
                    cx.point(CrashPoint::BeforeCommit)?;
                    Ok(deleted)
                }
            ))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn top_up_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError> {
        self.unknown_as(job, token, message, Caller::FUNDING).await
    }
}
