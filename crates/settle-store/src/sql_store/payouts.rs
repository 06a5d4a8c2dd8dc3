//! `Payouts` for `SqlStore`: the payout processor's claims and settlements, and returns recorded
//! by an operator (docs/decisions/0010).

use super::{Route, SqlStore};
use crate::db::Db;
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, After, Caller, Cx};
use crate::reads;
use crate::store::Payouts;
use async_trait::async_trait;
use futures_util::future::BoxFuture;
use settle_core::crash::CrashPoint;
use settle_core::ids::JobId;
use settle_core::limits;
use std::sync::Arc;

#[async_trait]
impl Payouts for SqlStore {
    async fn create_withdrawal(&self, req: NewWithdrawal) -> Result<Created<Withdrawal>, StoreError> {
        ops::payouts::validate_withdrawal(&req)?;
        let account = req.account_id.as_str().to_owned();
        let out = self
            .write_to(
                Route::Account(&account),
                op!([req] | db, cx | ops::payouts::create_withdrawal(db, cx, &req).await),
            )
            .await?;
        self.remember_job(out.value.job.id.as_str(), out.value.job.account_id.as_str());
        if !out.replayed {
            self.work_due();
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    async fn withdrawal(&self, id: &JobId) -> Result<Withdrawal, StoreError> {
        let id = id.clone();
        self.read(op!([id] | db, cx | reads::payouts::must_read_withdrawal(db, cx, id.as_str()).await)).await
    }

    async fn withdrawals(&self, filter: &WithdrawalFilter, page: Page) -> Result<Paged<Withdrawal>, StoreError> {
        let filter = filter.clone();
        self.read(op!([filter] | db, cx | reads::payouts::withdrawals(db, cx, &filter, page).await)).await
    }

    async fn claim_payouts(
        &self,
        worker: &settle_core::ids::WorkerName,
        limit: u32,
    ) -> Result<Vec<ClaimedJob>, StoreError> {
        if limit == 0 || limit > limits::CLAIM_LIMIT_MAX {
            return Err(StoreError::invalid(format!("limit must be between 1 and {}", limits::CLAIM_LIMIT_MAX)));
        }
        self.claim_as(worker, limit, Caller::PAYOUTS).await
    }

    async fn payout_heartbeat(&self, job: &JobId, token: &LeaseToken) -> Result<Heartbeat, StoreError> {
        self.heartbeat_as(job, token, Caller::PAYOUTS).await
    }

    async fn payout_succeeded(
        &self,
        job: &JobId,
        token: Option<&LeaseToken>,
        txid: &str,
        returned: bool,
    ) -> Result<Outcome<Withdrawal>, StoreError> {
        ops::payouts::check_txid(txid)?;
        let (id, token, txid) = (job.clone(), token.cloned(), txid.to_owned());
        let (out, after) = self
            .write_to(
                Route::Job(job.as_str()),
                op!(
                    [id, token, txid] | db,
                    cx | ops::payouts::payout_succeeded(db, cx, &id, token.as_ref(), &txid, returned).await
                ),
            )
            .await?;
        self.finish_withdrawal(job, out, after).await
    }

    async fn payout_failed(&self, job: &JobId, signal: FailSignal) -> Result<Outcome<Job>, StoreError> {
        self.fail_as(job, signal, Caller::PAYOUTS).await
    }

    async fn payout_unknown(
        &self,
        job: &JobId,
        token: &LeaseToken,
        message: Option<&str>,
    ) -> Result<Outcome<Job>, StoreError> {
        self.unknown_as(job, token, message, Caller::PAYOUTS).await
    }

    async fn payout_resolve(
        &self,
        job: &JobId,
        resolution: Resolution,
        actor: &str,
    ) -> Result<Outcome<Withdrawal>, StoreError> {
        let (id, actor) = (job.clone(), actor.to_owned());
        let (out, after) = self
            .write_to(
                Route::Job(job.as_str()),
                op!(
                    [id, resolution, actor] | db,
                    cx | ops::payouts::payout_resolve(db, cx, &id, &resolution, &actor).await
                ),
            )
            .await?;
        self.finish_withdrawal(job, out, after).await
    }

    async fn payout_returned(
        &self,
        job: &JobId,
        source: ReturnSource,
        actor: &str,
    ) -> Result<Outcome<Withdrawal>, StoreError> {
        let (id, actor) = (job.clone(), actor.to_owned());
        let out = self
            .write_to(Route::Job(job.as_str()), op!([id, actor] | db, cx | {
                let out = ops::payouts::payout_returned(db, cx, &id, source).await?;
                if out.applied && source == ReturnSource::Admin {
                    let detail = serde_json::json!({ "amount": out.value.amount.get(), "provider_txid": out.value.provider_txid });
                    let account = out.value.job.account_id.clone();
                    ops::record_action(db, cx, &actor, ActionKind::WithdrawalReturn, Some(id.as_str()), Some(account.as_str()), detail)
                        .await?;
                }
                Ok(out)
            }))
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }
}

impl SqlStore {
    /// A rail's processor's claim: its due jobs, first due first, each with its kind's lease.
    pub(super) async fn claim_as(
        &self,
        worker: &settle_core::ids::WorkerName,
        limit: u32,
        caller: Caller,
    ) -> Result<Vec<ClaimedJob>, StoreError> {
        let req = ClaimRequest {
            worker: worker.clone(),
            kinds: Vec::new(),
            labels: Default::default(),
            limit,
            lease_seconds: None,
        };
        let out = self.write_quiet(op!([req] | db, cx | ops::claim(db, cx, &req, caller).await)).await?;
        if !out.is_empty() {
            self.events_appended();
        }
        for c in &out {
            self.remember_job(c.job.id.as_str(), c.job.account_id.as_str());
        }
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(out)
    }

    /// After a withdrawal's committed transition: what it left to do (a teardown begun by a cancel
    /// that won), then the withdrawal as it is now.
    async fn finish_withdrawal(
        &self,
        job: &JobId,
        out: Outcome<Withdrawal>,
        after: After,
    ) -> Result<Outcome<Withdrawal>, StoreError> {
        self.crash_point(CrashPoint::AfterCommit)?;
        if after == After::Nothing {
            return Ok(out);
        }
        self.continue_after(out.value.job, after).await?;
        Ok(Outcome { value: self.withdrawal(job).await?, applied: out.applied })
    }
}
