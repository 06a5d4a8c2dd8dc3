//! Teardown steps 2 and 3 of a cancelling job (seed 003), after step 1's refunds committed:
//! artifacts deleted outside any transaction, then the terminal state written last.

use super::{Route, SqlStore};
use crate::artifacts::ArtifactStore;
use crate::db::Db;
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, After, Cx};
use crate::store::Store;
use futures_util::future::BoxFuture;
use settle_core::crash::CrashPoint;
use settle_core::ids::JobId;
use std::sync::Arc;

impl SqlStore {
    /// Teardown steps 2 and 3, after step 1 committed: delete the artifacts of every undelivered
    /// item (a full rescan, each delete idempotent), then `cancelling → cancelled`, last.
    /// A cleanup failure leaves the job `cancelling` and is returned as `CleanupFailed`.
    pub(super) async fn finish_teardown(&self, id: &str) -> Result<Job, StoreError> {
        self.crash_point(CrashPoint::TeardownAfterRefund)?;
        if crate::broken::is_broken(self.env.broken, crate::broken::Guard::TeardownOrder) {
            // The simulator's broken-guard test only: the terminal state first, cleanup after.
            let job = self.terminal_after_cleanup(id).await?;
            let _ = self.cleanup(id).await;
            return Ok(job);
        }
        if let Err(e) = self.cleanup(id).await {
            if let StoreError::CleanupFailed { message, .. } = &e {
                let (owned, message) = (id.to_owned(), message.clone());
                self.write_quiet_to(
                    Route::Job(id),
                    op!([owned, message] | db, cx | ops::cleanup_failed(db, cx, &owned, &message).await),
                )
                .await?;
            }
            return Err(e);
        }
        self.crash_point(CrashPoint::TeardownAfterCleanup)?;
        self.terminal_after_cleanup(id).await
    }

    /// Step 3: `cancelling → cancelled`.
    async fn terminal_after_cleanup(&self, id: &str) -> Result<Job, StoreError> {
        let owned = id.to_owned();
        let job =
            self.write_to(Route::Job(id), op!([owned] | db, cx | ops::finish_teardown(db, cx, &owned).await)).await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(job)
    }

    /// Step 2: deletes the artifacts of every undelivered item, each in the store it was
    /// registered in; a failure is `CleanupFailed` (the job stays `cancelling`).
    async fn cleanup(&self, id: &str) -> Result<(), StoreError> {
        let owned = id.to_owned();
        let keys = self.read(op!([owned] | db, _cx | ops::cleanup_keys(db, &owned).await)).await?;
        if keys.is_empty() {
            return Ok(());
        }
        let Some(artifacts) = &self.artifacts else {
            return Err(StoreError::CleanupFailed {
                job: id.to_owned(),
                message: "no artifact store is configured".into(),
            });
        };
        // Each artifact is deleted in the store it was registered in: this process's, or one it
        // opens as recorded (another working directory, an --artifacts changed while the job ran).
        // Rows from before stores were recorded have none: this process's store.
        let here = artifacts.location();
        let mut by_store: std::collections::BTreeMap<Option<String>, Vec<String>> = Default::default();
        for (path, store) in keys {
            by_store.entry(store.filter(|s| *s != here)).or_default().push(path);
        }
        for (store, paths) in by_store {
            let result = match &store {
                None => artifacts.delete_all(&paths).await,
                Some(there) => match self.recorded_store(there) {
                    Ok(other) => other.delete_all(&paths).await,
                    Err(e) => Err(e),
                },
            };
            result.map_err(|message| StoreError::CleanupFailed { job: id.to_owned(), message })?;
        }
        Ok(())
    }

    /// The artifact store an artifact was registered in, when it is not this process's: opened as
    /// recorded (a directory must exist with its marker; never created) and kept for later passes.
    fn recorded_store(&self, location: &str) -> Result<Arc<crate::artifacts::ObjectArtifactStore>, String> {
        let mut open = self.recorded.lock().expect("not poisoned");
        if let Some(store) = open.get(location) {
            return Ok(store.clone());
        }
        let store =
            Arc::new(crate::artifacts::ObjectArtifactStore::open_recorded(location).map_err(|e| e.to_string())?);
        open.insert(location.to_owned(), store.clone());
        Ok(store)
    }

    /// An operator's way out of a teardown that cannot clean up (decision 0028 §6).
    pub(super) async fn abandon_cleanup_as(&self, job: &JobId, actor: &str, reason: &str) -> Result<Job, StoreError> {
        let reason = reason.trim();
        if reason.is_empty() || reason.chars().count() > 500 {
            return Err(StoreError::invalid("a reason is 1 to 500 characters: why the cleanup is given up"));
        }
        let (id, actor, reason) = (job.clone(), actor.to_owned(), reason.to_owned());
        let job = self
            .write_to(
                Route::Job(job.as_str()),
                op!(
                    [id, actor, reason] | db,
                    cx | {
                        let retry = ops::cleanup_retry(db, id.as_str()).await?;
                        let (job, moved) = ops::abandon_cleanup(db, cx, id.as_str()).await?;
                        if let Some(left) = moved {
                            let detail = serde_json::json!({
                                "reason": reason,
                                "artifacts_left": left,
                                "failures": retry.as_ref().map(|r| r.failures),
                                "last_error": retry.map(|r| r.last_error),
                            });
                            let account = job.account_id.as_str().to_owned();
                            let action = ActionKind::JobAbandonCleanup;
                            ops::record_action(db, cx, &actor, action, Some(id.as_str()), Some(&account), detail)
                                .await?;
                        }
                        Ok(job)
                    }
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        Ok(job)
    }

    /// Continues a transition that left teardown to do; a cleanup failure is not an error for the
    /// signal that caused it: the job stays `cancelling` for the sweeper.
    pub(super) async fn continue_after(&self, job: Job, after: After) -> Result<Job, StoreError> {
        match after {
            After::Nothing => Ok(job),
            After::Teardown => match self.finish_teardown(job.id.as_str()).await {
                Ok(done) => Ok(done),
                Err(StoreError::CleanupFailed { job: id, message }) => {
                    tracing::warn!(job = %id, %message, "artifact cleanup failed; the job stays cancelling for the sweeper");
                    self.job(&JobId::stored(&id)).await
                }
                Err(e) => Err(e),
            },
        }
    }

    /// Cancel, per the spec's table, then teardown steps 2–3 if step 1 left the job `cancelling`.
    /// With an `actor`, a cancel that moved the job is recorded in the action log, in its transaction.
    pub(super) async fn cancel_as(&self, job: &JobId, actor: Option<&str>) -> Result<CancelOutcome, StoreError> {
        let route = Route::Job(job.as_str());
        let (id, actor) = (job.clone(), actor.map(str::to_owned));
        let (job, after) = self
            .write_to(
                route,
                op!(
                    [id, actor] | db,
                    cx | {
                        let before = ops::must_lock_job(db, id.as_str()).await?;
                        let (job, after) = ops::cancel(db, cx, &id).await?;
                        if let Some(actor) = &actor
                            && (job.state != before.state || job.cancel_requested != before.cancel_requested)
                        {
                            let detail = serde_json::json!({ "from": before.state.as_str(), "to": job.state.as_str() });
                            ops::record_action(
                                db,
                                cx,
                                actor,
                                ActionKind::JobCancel,
                                Some(id.as_str()),
                                Some(job.account_id.as_str()),
                                detail,
                            )
                            .await?;
                        }
                        Ok((job, after))
                    }
                ),
            )
            .await?;
        self.crash_point(CrashPoint::AfterCommit)?;
        let job = match after {
            After::Nothing => job,
            After::Teardown => match self.finish_teardown(job.id.as_str()).await {
                Ok(done) => done,
                Err(StoreError::CleanupFailed { job: id, message }) => {
                    tracing::warn!(job = %id, %message, "artifact cleanup failed; the job stays cancelling for the sweeper");
                    return Ok(CancelOutcome::Accepted(self.job(&JobId::stored(&id)).await?));
                }
                Err(e) => return Err(e),
            },
        };
        Ok(match job.state {
            settle_core::job::JobState::Cancelled => CancelOutcome::Cancelled(job),
            _ => CancelOutcome::Accepted(job),
        })
    }
}
