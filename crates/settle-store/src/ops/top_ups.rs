//! Top-ups (spec §4a, docs/design/money-controls.md §4 and §11): the writes only top-ups have. A
//! top-up is a job of the reserved kind `top_up` — one item `main` of cost 0, so it takes nothing
//! from the account — plus one row of `top_ups` with the idempotency key made once at creation.
//! While it is open its `credits` are reserved in the account's `held`, so the grant a confirmed
//! charge writes can never be refused by the balance's bound. Only a confirmed charge grants, once
//! (the grant's id is the top-up's; `grants_source` and the ledger's grant ids refuse a second).
//! The reads are in `reads::top_ups`.

use super::{After, Caller, Cx, Pay};
use crate::db::{Db, Engine, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::reads::top_ups::must_read_top_up;
use settle_core::crash::CrashPoint;
use settle_core::fingerprint::Fingerprint;
use settle_core::history::EventKind;
use settle_core::ids::{ItemId, JobId, JobKind};
use settle_core::job::{self, JobState, Rail, RefundPolicy};
use settle_core::ledger::EntryKind;
use settle_core::{Credits, limits};
use std::sync::LazyLock;

/// The advisory lock class (PostgreSQL's two-key form, `hashtext` of the id) that an admin grant
/// and a top-up's create of one id take first, so the two can never both take it: a grant id is
/// one namespace across admin grants and top-ups (§11.9).
pub(crate) const GRANT_ID_LOCK_CLASS: i32 = 0x5e7b;

pub(crate) fn top_up_fingerprint(req: &NewTopUp) -> [u8; 32] {
    Fingerprint::new("top_up")
        .str("id", req.id.as_str())
        .str("account_id", req.account_id.as_str())
        .i64("credits", req.credits.get())
        .i64("price", req.price)
        .str("currency", req.currency.as_str())
        .str("customer", req.customer.as_str())
        .finish()
}

/// Bad input writes nothing: credits from 1, a price from 0, each at most 2^53.
pub(crate) fn validate_top_up(req: &NewTopUp) -> Result<(), StoreError> {
    if !req.credits.is_positive() || req.credits.get() > limits::TOP_UP_CREDITS_MAX {
        return Err(StoreError::invalid(format!(
            "a top-up's credits must be 1 to {} (2^53)",
            limits::TOP_UP_CREDITS_MAX
        )));
    }
    if req.price < 0 || req.price > limits::TOP_UP_PRICE_MAX {
        return Err(StoreError::invalid(format!(
            "a top-up's price must be 0 to {} (2^53) minor units",
            limits::TOP_UP_PRICE_MAX
        )));
    }
    Ok(())
}

/// Takes the grant id's lock (PostgreSQL; SQLite's one writer needs none). First in its
/// transaction, before any row lock, so it cannot be part of a deadlock.
pub(crate) async fn lock_grant_id(db: &mut Db<'_>, id: &str) -> Result<(), StoreError> {
    if db.engine() == Engine::Postgres {
        static SQL: LazyLock<String> = LazyLock::new(|| {
            format!("SELECT 1 AS locked FROM (SELECT pg_advisory_xact_lock({GRANT_ID_LOCK_CLASS}, hashtext($1))) g")
        });
        db.one(&SQL, args![id]).await?;
    }
    Ok(())
}

/// Whether a top-up (open or not) has this id: an admin grant may not take it.
pub(crate) async fn is_top_up(db: &mut Db<'_>, id: &str) -> Result<bool, StoreError> {
    Ok(db.opt("SELECT 1 AS found FROM top_ups WHERE job_id = $1", args![id]).await?.is_some())
}

/// Creates the top-up: the job (its 0-credit charge reserving the credits under the bound), the
/// row with a fresh idempotency key, `job.queued` and `top_up.queued` — or answers the replay.
/// `rule`: the generation of the auto rule that made it.
pub(crate) async fn create_top_up(
    db: &mut Db<'_>,
    cx: &Cx,
    req: &NewTopUp,
    rule: Option<i64>,
) -> Result<Created<TopUp>, StoreError> {
    validate_top_up(req)?;
    let fp = top_up_fingerprint(req);
    // A rule's top-up takes a fresh id in a batch that holds rows already: no waiting lock there.
    if rule.is_none() {
        lock_grant_id(db, req.id.as_str()).await?;
    }
    if db.opt("SELECT 1 FROM accounts WHERE id = $1", args![req.account_id.as_str()]).await?.is_none() {
        return Err(StoreError::not_found("account", req.account_id.as_str()));
    }
    if let Some(existing) = super::lock_job(db, req.id.as_str()).await? {
        if existing.request_hash != fp || Rail::of(&existing.kind) != Rail::Funding {
            return Err(StoreError::IdempotencyConflict { what: "top_up", id: req.id.to_string() });
        }
        return Ok(Created { value: must_read_top_up(db, cx, req.id.as_str()).await?, replayed: true });
    }
    // The grant a confirmed charge writes takes the top-up's id: an admin grant's must not be it.
    if db
        .opt("SELECT 1 FROM ledger_entries WHERE kind = 'grant' AND ref_id = $1", args![req.id.as_str()])
        .await?
        .is_some()
    {
        return Err(StoreError::IdTaken { what: "grant", id: req.id.to_string() });
    }
    let new_job = NewJob {
        id: req.id.clone(),
        account_id: req.account_id.clone(),
        kind: JobKind::parse(job::TOP_UP_KIND).expect("the top-up kind is a valid kind"),
        items: vec![NewItem { id: ItemId::main(), price: Price::Cost(Credits::ZERO) }],
        payload: serde_json::Value::Null,
        max_attempts: None,
        // Nothing to refund; never handed back while a charge may still be confirmed.
        refund_on: Some(RefundPolicy::FinalFailure),
        not_before: None,
        priority: None,
        requires: Default::default(),
    };
    super::insert_job(db, cx, &super::validate_job(new_job)?, &fp, Pay::Reserve(req.credits.get())).await?;
    // Made once, here; every attempt charges and looks up with it.
    let key = format!("tu_{}", cx.token().simple());
    db.exec(
        "INSERT INTO top_ups (job_id, account_id, credits, price, currency, customer, idempotency_key, \
         rule_generation, open, created_at) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, 1, $9)",
        args![
            req.id.as_str(),
            req.account_id.as_str(),
            req.credits.get(),
            req.price,
            req.currency.as_str(),
            req.customer.as_str(),
            &key,
            rule,
            cx.now.micros()
        ],
    )
    .await?;
    let data = serde_json::json!({
        "credits": req.credits.get(),
        "price": req.price,
        "currency": req.currency.as_str(),
        "customer": req.customer.as_str(),
        "rule": rule.is_some(),
    });
    super::emit(db, cx, EventKind::TopUpQueued, Some(req.id.as_str()), req.account_id.as_str(), data).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let t = must_read_top_up(db, cx, req.id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(Created { value: t, replayed: false })
}

columns! {
    /// What a top-up's transitions read of its row.
    RowCol { credits, price, currency, provider_charge_id, open }
}

static SELECT_ROW: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM top_ups WHERE job_id = $1", RowCol::LIST));

pub(crate) fn check_charge_id(id: &str) -> Result<(), StoreError> {
    if id.is_empty() || id.len() > limits::PROVIDER_TXID_LEN_MAX || id.chars().any(char::is_control) {
        return Err(StoreError::invalid(format!(
            "a provider charge id is 1 to {} characters without control characters",
            limits::PROVIDER_TXID_LEN_MAX
        )));
    }
    Ok(())
}

/// The funding provider has the charge: the success path (accepted from any attempt, with or
/// without the current lease: the customer paid) with the grant, the charge id and
/// `top_up.succeeded`, in one transaction. A charge found for a top-up Settle had closed (dead,
/// cancelled) is granted all the same, with `top_up.late_charge`: the customer paid, and the
/// credits are what they paid for. A charge already recorded changes nothing.
pub(crate) async fn top_up_succeeded(
    db: &mut Db<'_>,
    cx: &Cx,
    id: &JobId,
    token: Option<&LeaseToken>,
    charge_id: &str,
) -> Result<(Outcome<TopUp>, After), StoreError> {
    check_charge_id(charge_id)?;
    let job = super::must_lock_job(db, id.as_str()).await?;
    super::check_caller(&job, Caller::FUNDING)?;
    let row = db.one(&SELECT_ROW, args![&job.id]).await?;
    if let Some(kept) = row.opt_text(RowCol::provider_charge_id)? {
        if kept != charge_id {
            tracing::warn!(job = %job.id, %kept, reported = charge_id, "the funding provider reported another charge for one key");
        }
        let t = must_read_top_up(db, cx, id.as_str()).await?;
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok((Outcome { value: t, applied: false }, After::Nothing));
    }
    let reporter = token.map_or(Reporter::Reconciler, Reporter::Lease);
    let (applied, after) = if JobState::SUCCEED_FROM.contains(&job.state) {
        super::apply_success(db, cx, &job, reporter, None, &Costs::default()).await?
    } else {
        (false, After::Nothing)
    };
    let (credits, open) = (row.i64(RowCol::credits)?, row.i64(RowCol::open)? == 1);
    let rows = db
        .exec(
            "UPDATE top_ups SET provider_charge_id = $2, open = 0 WHERE job_id = $1 AND provider_charge_id IS NULL",
            args![&job.id, charge_id],
        )
        .await?;
    super::guard_hit(rows, "charge id")?;
    grant(db, cx, &job, credits, open).await?;
    if !open {
        // A rule's top-up closed before its charge was known gave its credits back to the rule's
        // month count; they are bought after all.
        db.exec(
            "UPDATE auto_top_ups SET credits_this_month = credits_this_month + $2 WHERE account_id = $1 \
             AND month_start <= (SELECT created_at FROM top_ups WHERE job_id = $3 AND rule_generation IS NOT NULL)",
            args![&job.account_id, credits, &job.id],
        )
        .await?;
    }
    cx.point(CrashPoint::AfterLedger)?;
    let mut data = serde_json::json!({
        "credits": credits,
        "price": row.i64(RowCol::price)?,
        "currency": row.text(RowCol::currency)?,
        "provider_charge_id": charge_id,
        "grant_id": job.id,
    });
    let event = if applied || job.state == JobState::Succeeded {
        EventKind::TopUpSucceeded
    } else {
        // Closed before its charge was known: kept, granted, and reported for a person.
        tracing::error!(job = %job.id, state = job.state.as_str(), charge_id, "the funding provider charged a top-up Settle had closed");
        data["state"] = serde_json::json!(job.state.as_str());
        EventKind::TopUpLateCharge
    };
    super::emit(db, cx, event, Some(&job.id), &job.account_id, data).await?;
    cx.point(CrashPoint::AfterOutbox)?;
    let t = must_read_top_up(db, cx, id.as_str()).await?;
    cx.point(CrashPoint::BeforeCommit)?;
    Ok((Outcome { value: t, applied: true }, after))
}

/// The confirmed charge's grant: `credits`, origin `top_up`, id the top-up's, never expiring. An
/// open top-up's reservation in `held` becomes the balance in the same statement, so the bound
/// cannot refuse it; a closed one's was given back, and the bound judges the grant as any other.
async fn grant(db: &mut Db<'_>, cx: &Cx, job: &super::JobRow, credits: i64, open: bool) -> Result<(), StoreError> {
    let fp = <&[u8; 32]>::try_from(job.request_hash.as_slice())
        .map_err(|_| StoreError::internal(format!("top-up {} has no fingerprint", job.id)))?;
    let line = super::Line {
        kind: EntryKind::Grant,
        amount: Credits::new(credits),
        job_id: None,
        job_seq: None,
        item_id: None,
        ref_id: Some(&job.id),
        reason: None,
        request_hash: Some(fp),
    };
    let holds = super::Holds { held: if open { -credits } else { 0 }, exposure: 0 };
    let posting = super::Posting {
        account_id: &job.account_id,
        job_kind: None,
        check: super::BalanceCheck::Bounded,
        lines: std::slice::from_ref(&line),
        holds,
    };
    super::post_bought(db, cx, posting).await
}
