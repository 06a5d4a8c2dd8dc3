//! Withdrawals (spec §4, docs/design/payouts.md): the writes that only payouts have. A withdrawal
//! is a job of kind `withdrawal` (its hold is the item `main`), plus one row of `withdrawals` with
//! the idempotency key made once at creation. Every write here has the shape of every transition:
//! lock the job, decide, guarded statements, ledger rows and the event in one transaction. The
//! reads are in `reads::payouts`.

use super::{After, Caller, Cx};
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::reads::payouts::must_read_withdrawal;
use settle_core::crash::CrashPoint;
use settle_core::fingerprint::Fingerprint;
use settle_core::history::{AttemptResult, EventKind};
use settle_core::ids::{FailCode, ItemId, JobId, JobKind};
use settle_core::item::{ItemSignal, ItemState};
use settle_core::job::{self, JobState, RefundPolicy};
use settle_core::limits;
use std::sync::LazyLock;

pub(crate) fn withdrawal_fingerprint(req: &NewWithdrawal) -> [u8; 32] {
    Fingerprint::new("withdrawal")
        .str("id", req.id.as_str())
        .str("account_id", req.account_id.as_str())
        .i64("amount", req.amount.get())
        .str("destination", req.destination.as_str())
        .finish()
}

/// Bad input writes nothing: the amount is positive and inside the largest balance Settle keeps.
pub(crate) fn validate_withdrawal(req: &NewWithdrawal) -> Result<(), StoreError> {
    if !req.amount.is_positive() {
        return Err(StoreError::invalid("a withdrawal's amount must be greater than zero"));
    }
    if req.amount.get() > limits::BALANCE_MAX {
        return Err(StoreError::Overflow);
    }
    Ok(())
}

/// Creates the withdrawal: the job holding the amount (a charge the balance alone must cover), the
/// withdrawal row with a fresh idempotency key, `job.queued` — or answers the replay.
pub(crate) async fn create_withdrawal(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &NewWithdrawal,
) -> Result<Created<Withdrawal>, StoreError> {
    validate_withdrawal(req)?;
    let fp = withdrawal_fingerprint(req);
    if db.opt("SELECT 1 FROM accounts WHERE id = $1", args![req.account_id.as_str()]).await?.is_none() {
        return Err(StoreError::not_found("account", req.account_id.as_str()));
    }
    if let Some(existing) = super::lock_job(db, req.id.as_str()).await? {
        if existing.request_hash != fp {
            return Err(StoreError::IdempotencyConflict { what: "withdrawal", id: req.id.to_string() });
        }
        return Ok(Created { value: must_read_withdrawal(db, cx, req.id.as_str()).await?, replayed: true });
    }
    let new_job = NewJob {
        id: req.id.clone(),
        account_id: req.account_id.clone(),
        kind: JobKind::parse(job::WITHDRAWAL_KIND).expect("the withdrawal kind is a valid kind"),
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(req.amount) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        // Never handed back while it may still leave, whatever the kind's configuration says.
        refund_on: Some(RefundPolicy::FinalFailure),
        not_before: None,
        priority: None,
        requires: Default::default(),
    };
    // Cash leaves: drawn on the balance alone, never the overdraft (spec §1).
    super::insert_job(db, cx, &super::validate_job(new_job)?, &fp, super::Pay::Cash).await?;
    // Made once, here; every attempt of this withdrawal sends and looks up with it.
    let key = format!("wd_{}", cx.token().simple());
    // The cash rule's figures as the withdrawal leaves them, read apart from the guard that
    // checked them (L6 of the audit judges them).
    let cash_after = super::allocations::cash(db, req.account_id.as_str()).await?;
    let debt_after = db.one(&SELECT_DEBT, args![req.account_id.as_str()]).await?.i64(DebtCol::debt)?;
    db.exec(
        "INSERT INTO withdrawals (job_id, destination, amount, idempotency_key, created_at, cash_after, debt_after) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        args![
            req.id.as_str(),
            req.destination.as_str(),
            req.amount.get(),
            &key,
            cx.now.micros(),
            cash_after,
            debt_after
        ],
    )
    .await?;
    let w = must_read_withdrawal(db, cx, req.id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Created { value: w, replayed: false })
}

columns! {
    /// What an account owes (its debt parts not yet paid).
    DebtCol { debt }
}

static SELECT_DEBT: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM accounts WHERE id = $1", DebtCol::LIST));

columns! {
    /// The provider's txid of a withdrawal, once known.
    TxidCol { provider_txid }
}

static SELECT_TXID: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM withdrawals WHERE job_id = $1", TxidCol::LIST));

/// Keeps the provider's txid once known; a txid already kept is never replaced.
pub(crate) async fn record_txid(db: &mut Db<'_>, job_id: &str, txid: &str) -> Result<(), StoreError> {
    check_txid(txid)?;
    let kept = db
        .opt(&SELECT_TXID, args![job_id])
        .await?
        .ok_or_else(|| StoreError::internal(format!("withdrawal job {job_id} has no withdrawal row")))?
        .opt_text(TxidCol::provider_txid)?;
    match kept {
        None => {
            let rows = db
                .exec(
                    "UPDATE withdrawals SET provider_txid = $2 WHERE job_id = $1 AND provider_txid IS NULL",
                    args![job_id, txid],
                )
                .await?;
            super::guard_hit(rows, "provider txid")
        }
        Some(k) if k == txid => Ok(()),
        Some(k) => {
            tracing::warn!(job = job_id, kept = %k, reported = txid, "the provider reported another txid for one key");
            Ok(())
        }
    }
}

pub(crate) fn check_txid(txid: &str) -> Result<(), StoreError> {
    if txid.is_empty() || txid.len() > limits::PROVIDER_TXID_LEN_MAX || txid.chars().any(char::is_control) {
        return Err(StoreError::invalid(format!(
            "a provider txid is 1 to {} characters without control characters",
            limits::PROVIDER_TXID_LEN_MAX
        )));
    }
    Ok(())
}

/// The provider has the transfer: the success path (accepted from any attempt, with or without
/// the current lease: the money left) and the txid, in one transaction; and, when the provider
/// says it came back already, the return too (a crash between the two would lose the return).
/// `After::Teardown` when the withdrawal was being torn down (a cancel that won before the provider
/// was asked): the caller finishes the teardown.
pub(crate) async fn payout_succeeded(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: Option<&LeaseToken>,
    txid: &str,
    returned: bool,
) -> Result<(Outcome<Withdrawal>, After), StoreError> {
    check_txid(txid)?;
    let job = super::must_lock_job(db, id.as_str()).await?;
    super::check_caller(&job, Caller::PAYOUTS)?;
    // A withdrawal is `final_failure`: its success wins over a cancel request. Only a teardown that
    // had already begun (`cancelling`) is left to finish.
    let reporter = token.map_or(Reporter::Reconciler, Reporter::Lease);
    let (mut applied, after) = super::apply_success(db, cx, &job, reporter, None, &Costs::default()).await?;
    let kept = db.one(&SELECT_TXID, args![&job.id]).await?.opt_text(TxidCol::provider_txid)?;
    if applied || matches!(job.state, JobState::Succeeded | JobState::Returned) {
        record_txid(db, &job.id, txid).await?;
    } else if kept.is_none() {
        // Money left for a withdrawal no success can reach any more (`cancelling`, `cancelled`: its
        // hold was refunded). Never drop what the provider said: kept, reported once, for a person
        // (docs/decisions/0010).
        tracing::error!(job = %job.id, state = job.state.as_str(), txid, "the provider executed a withdrawal Settle had closed");
        record_txid(db, &job.id, txid).await?;
        super::emit(
            db,
            cx,
            EventKind::WithdrawalLateExecution,
            Some(&job.id),
            &job.account_id,
            serde_json::json!({ "state": job.state.as_str(), "provider_txid": txid }),
        )
        .await?;
    }
    cx.point(CrashPoint::AfterLedger)?;
    if returned {
        let now = super::must_lock_job(db, id.as_str()).await?;
        if now.state == JobState::Succeeded {
            apply_return(db, cx, &now, ReturnSource::Provider).await?;
            applied = true;
        }
    }
    let w = must_read_withdrawal(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: w, applied }, after))
}

/// An operator's resolution of an `unknown` withdrawal whose provider cannot be asked (decision
/// 0017): "confirmed sent, txid X" takes the success path with the txid; "confirmed not sent" ends
/// it `dead` with its hold refunded (`CONFIRMED_NOT_SENT`, never retried; it cannot be requeued —
/// its hold went back — so sending the money again is a new withdrawal with a new key; a late
/// execution still recovers it as any dead withdrawal's). One guarded
/// transition from `unknown`, recorded in the action log in the same transaction; anything but
/// `unknown` is refused, so a resolution racing the reconciler (or a second operator) changes
/// nothing twice.
pub(crate) async fn payout_resolve(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    resolution: &Resolution,
    actor: &str,
) -> Result<(Outcome<Withdrawal>, After), StoreError> {
    if resolution.reason.trim().is_empty() || resolution.reason.len() > limits::MESSAGE_LEN_MAX {
        return Err(StoreError::invalid(format!(
            "a resolution needs a reason of 1 to {} characters: how the outcome was confirmed",
            limits::MESSAGE_LEN_MAX
        )));
    }
    if let ResolvedOutcome::Sent { provider_txid } = &resolution.outcome {
        check_txid(provider_txid)?;
    }
    let job = super::must_lock_job(db, id.as_str()).await?;
    if job.kind != job::WITHDRAWAL_KIND {
        return Err(StoreError::not_found("withdrawal", id.as_str()));
    }
    if job.state != JobState::Unknown {
        return Err(StoreError::InvalidTransition {
            job: job.id,
            action: "be resolved by an operator (only an unknown withdrawal is)",
            state: job.state.as_str().to_owned(),
        });
    }
    let (after, detail) = match &resolution.outcome {
        ResolvedOutcome::Sent { provider_txid } => {
            let (applied, after) =
                super::apply_success(db, cx, &job, Reporter::Operator(actor), None, &Costs::default()).await?;
            // From `unknown` the success always applies: the state was checked under the lock.
            super::guard_hit(u64::from(applied), "operator's success")?;
            record_txid(db, &job.id, provider_txid).await?;
            (
                after,
                serde_json::json!({ "outcome": "sent", "provider_txid": provider_txid, "reason": resolution.reason }),
            )
        }
        ResolvedOutcome::NotSent => {
            let code = FailCode::confirmed_not_sent();
            let after = super::apply_failure(
                db,
                cx,
                &job,
                super::Failure {
                    code: &code,
                    message: Some(&resolution.reason),
                    retryable: false,
                    retry_after_ms: None,
                    attempt_result: AttemptResult::Failed,
                    budget_exempt: false,
                    defer_cancel: false,
                    reported: None,
                },
            )
            .await?;
            (after, serde_json::json!({ "outcome": "not_sent", "reason": resolution.reason }))
        }
    };
    cx.point(CrashPoint::AfterLedger)?;
    super::record_action(db, cx, actor, ActionKind::WithdrawalResolve, Some(&job.id), Some(&job.account_id), detail)
        .await?;
    let w = must_read_withdrawal(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: w, applied: true }, after))
}

/// A paid-out withdrawal came back: `succeeded → returned`, once.
pub(crate) async fn payout_returned(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    source: ReturnSource,
) -> Result<Outcome<Withdrawal>, StoreError> {
    let job = super::must_lock_job(db, id.as_str()).await?;
    if job.kind != job::WITHDRAWAL_KIND {
        return Err(StoreError::not_found("withdrawal", id.as_str()));
    }
    let applied = match job.state {
        JobState::Returned => false,
        JobState::Succeeded => {
            apply_return(db, cx, &job, source).await?;
            true
        }
        other => {
            return Err(StoreError::InvalidTransition {
                job: job.id,
                action: "be returned (only a succeeded withdrawal was paid out)",
                state: other.as_str().to_owned(),
            });
        }
    };
    let w = must_read_withdrawal(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Outcome { value: w, applied })
}

/// The job `succeeded → returned`, its item `succeeded → returned` with one `payout_return` of the
/// stored amount, `returned_at`, and `withdrawal.returned`.
async fn apply_return(db: &mut Db<'_>, cx: &Cx, job: &super::JobRow, source: ReturnSource) -> Result<(), StoreError> {
    let rows = db
        .exec(
            "UPDATE jobs SET state = 'returned', updated_at = $2 WHERE id = $1 AND state = 'succeeded'",
            args![&job.id, cx.now.micros()],
        )
        .await?;
    super::guard_hit(rows, "return")?;
    cx.point(CrashPoint::AfterGuard)?;
    // Paid items: succeeded, or reclaimed (a late execution found after the hold was refunded).
    let mut moved = super::move_items(db, cx, job, super::Move::all(ItemState::Succeeded, ItemSignal::Return)).await?;
    moved.extend(super::move_items(db, cx, job, super::Move::all(ItemState::Reclaimed, ItemSignal::Return)).await?);
    if super::sum(&moved)?.get() != job.cost {
        return Err(StoreError::internal(format!(
            "return of {} credited {:?}, not its cost {}",
            job.id, moved, job.cost
        )));
    }
    cx.point(CrashPoint::AfterLedger)?;
    let rows = db
        .exec(
            "UPDATE withdrawals SET returned_at = $2 WHERE job_id = $1 AND returned_at IS NULL",
            args![&job.id, cx.now.micros()],
        )
        .await?;
    super::guard_hit(rows, "returned_at")?;
    let txid = db.one(&SELECT_TXID, args![&job.id]).await?.opt_text(TxidCol::provider_txid)?;
    super::emit(
        db,
        cx,
        EventKind::WithdrawalReturned,
        Some(&job.id),
        &job.account_id,
        serde_json::json!({ "amount": super::sum(&moved)?.get(), "provider_txid": txid, "source": source.as_str() }),
    )
    .await?;
    cx.point(CrashPoint::AfterOutbox)?;
    Ok(())
}
