//! Handlers: parse, authorize, call one store operation, map the answer. Thin on purpose.

use crate::answer::json;
use crate::auth::{Actor, Role};
use crate::dto::{self, parse_rfc3339};
use crate::error::{ApiError, ErrorBody};
use crate::extract::{AdminRole, Auth, ClientRole, Json, Path, Query, WorkerRole};
use crate::state::AppState;
use crate::telemetry;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use settle_core::ids::*;
use settle_core::job::{JobState, RefundPolicy};
use settle_core::{Credits, limits};
use settle_store::{self as store, Created};
use std::time::Duration;

type ApiResult = Result<Response, ApiError>;

pub(crate) fn id<T>(parse: fn(&str) -> Result<T, IdError>, s: &str) -> Result<T, ApiError> {
    parse(s).map_err(|e| ApiError::invalid(format!("The {} is malformed: it must be {}.", e.what, e.rule)))
}

/// A job's requirements or a worker's labels, each checked, as one canonical set of at most `max`.
fn labels(given: &[String], max: usize) -> Result<Labels, ApiError> {
    let set = Labels::parse(given, usize::MAX)
        .map_err(|e| ApiError::invalid(format!("The {} is malformed: it must be {}.", e.what, e.rule)))?;
    if set.len() > max {
        return Err(ApiError::invalid(format!("At most {max} distinct labels.")));
    }
    Ok(set)
}

fn created<T, D: serde::Serialize>(c: Created<T>, to_dto: impl FnOnce(T) -> D) -> Response {
    let body = to_dto(c.value);
    if c.replayed {
        let mut r = json(StatusCode::OK, &body);
        r.headers_mut().insert("Idempotent-Replayed", HeaderValue::from_static("true"));
        r
    } else {
        json(StatusCode::CREATED, &body)
    }
}

pub(crate) fn ok<D: serde::Serialize>(d: D) -> Response {
    json(StatusCode::OK, &d)
}

/// A worker's report: `200`, with `Idempotent-Replayed: true` when it had already taken effect
/// (the same report re-sent after its answer was lost: decision 0019).
fn reported<D: serde::Serialize>(d: D, applied: bool) -> Response {
    let mut r = ok(d);
    if !applied {
        r.headers_mut().insert("Idempotent-Replayed", HeaderValue::from_static("true"));
    }
    r
}

fn page(after: Option<i64>, limit: Option<u32>) -> Result<store::Page, ApiError> {
    let after = after.unwrap_or(0);
    if after < 0 {
        return Err(ApiError::invalid("after must be zero or more."));
    }
    let limit = limit.unwrap_or(limits::PAGE_LIMIT_DEFAULT);
    if limit == 0 || limit > limits::PAGE_LIMIT_MAX {
        return Err(ApiError::invalid(format!("limit must be between 1 and {}.", limits::PAGE_LIMIT_MAX)));
    }
    Ok(store::Page { after, limit })
}

/// Counts a long-poll in `settle_http_long_polls_waiting` while it sleeps between looks.
struct Waiting;

impl Waiting {
    fn start() -> Waiting {
        metrics::gauge!("settle_http_long_polls_waiting").increment(1.0);
        Waiting
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        metrics::gauge!("settle_http_long_polls_waiting").decrement(1.0);
    }
}

/// A long-poll: `look`s (`(answer, found)`), and while a look finds nothing and `wait_seconds`
/// have not passed, sleeps until `wake` fires (a commit here, or a NOTIFY from another process),
/// until `sooner` says to look again (asked only before a sleep: when the next queued job becomes
/// due), or for the recheck interval — whichever comes first — and looks again. The wake-up is
/// armed before each look, so a commit between the look and the sleep is never missed. Answers
/// the last look.
async fn long_poll<T, F, Fut, G, GFut>(
    s: &AppState,
    wake: std::sync::Arc<tokio::sync::Notify>,
    wait_seconds: u32,
    mut look: F,
    mut sooner: G,
) -> Result<T, ApiError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(T, bool), ApiError>>,
    G: FnMut() -> GFut,
    GFut: std::future::Future<Output = Result<Option<Duration>, ApiError>>,
{
    let deadline = tokio::time::Instant::now() + Duration::from_secs(u64::from(wait_seconds));
    loop {
        let notified = wake.notified();
        tokio::pin!(notified);
        notified.as_mut().enable();
        let (got, found) = look().await?;
        let now = tokio::time::Instant::now();
        if found || now >= deadline {
            return Ok(got);
        }
        let mut nap = (deadline - now).min(s.long_poll_recheck);
        if let Some(soon) = sooner().await? {
            nap = nap.min(soon);
        }
        // Counted only while it sleeps after finding nothing: what a test (or an operator) sees
        // waiting has looked and will be answered by a wake-up or its next look.
        let _waiting = Waiting::start();
        tokio::select! {
            _ = &mut notified => {}
            _ = tokio::time::sleep(nap) => {}
        }
    }
}

/// A waiting long-poll takes one of its token's places; with none left it answers at once (a plain
/// poll) instead of waiting. Loopback mode (no tokens) has no one to tell apart.
fn long_poll_slot(s: &AppState, headers: &HeaderMap, wait: u32) -> (u32, Option<tokio::sync::OwnedSemaphorePermit>) {
    if wait == 0 || s.tokens.is_empty() {
        return (wait, None);
    }
    match s.limiter.long_poll(s.tokens.identify(headers)) {
        Some(slot) => (wait, Some(slot)),
        None => {
            metrics::counter!("settle_http_long_polls_refused_total").increment(1);
            (0, None)
        }
    }
}

/// `404 not_found` for an account a scoped token may not see, as if it did not exist.
fn seen_account(actor: &Actor, account: &AccountId) -> Result<(), ApiError> {
    if actor.scope.account(account.as_str()) {
        return Ok(());
    }
    Err(store::StoreError::not_found("account", account.as_str()).into())
}

/// `404 not_found` for a job a scoped token may not see (its account or kind is outside the
/// scope), as if it did not exist. Unscoped tokens read nothing here.
pub(crate) async fn seen_job(s: &AppState, actor: &Actor, job: &JobId) -> Result<(), ApiError> {
    if actor.scope.is_all() {
        return Ok(());
    }
    let j = s.store.job(job).await?;
    if actor.scope.job(j.account_id.as_str(), j.kind.as_str()) {
        return Ok(());
    }
    Err(store::StoreError::not_found("job", job.as_str()).into())
}

pub(crate) fn mark(kind: &'static str, applied: bool) {
    metrics::counter!("settle_transitions_total", "kind" => kind, "applied" => if applied { "true" } else { "false" })
        .increment(1);
}

// ----- accounts -------------------------------------------------------------------------------------

/// Create an account
///
/// Creates an account with a zero balance and an optional overdraft limit (credits the balance may go
/// below zero by charges). The id is the client's: repeating the request with the same body answers
/// `200` with `Idempotent-Replayed: true` and the account as it is now; the same id with a different
/// body is `409 idempotency_conflict`. Admin only; recorded in the action log.
#[utoipa::path(post, path = "/v1/accounts", tag = "accounts", request_body = dto::CreateAccount,
    responses((status = 201, body = dto::Account), (status = 200, description = "a replay (header Idempotent-Replayed: true): the resource as it is now, not as first answered", body = dto::Account),
              (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create_account(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Json(b): Json<dto::CreateAccount>,
) -> ApiResult {
    let req = store::NewAccount {
        id: id(AccountId::parse, &b.id)?,
        overdraft_limit: Credits::new(b.overdraft_limit.unwrap_or(0)),
        max_running: b.max_running,
    };
    tracing::info!(actor = %auth.actor, account = %req.id, "create account");
    let c = s.store.create_account(req, &auth.actor.name).await?;
    Ok(created(c, dto::Account::from))
}

/// List accounts
///
/// Accounts in id order, one page at a time: pass the answer's `next_after` (the last id of the
/// page) as `after` for the next page. A token scoped to accounts sees its own only.
#[utoipa::path(get, path = "/v1/accounts", tag = "accounts", params(dto::AccountsQuery),
    responses((status = 200, body = dto::AccountPage), (status = 400, body = ErrorBody)))]
pub async fn list_accounts(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Query(q): Query<dto::AccountsQuery>,
) -> ApiResult {
    let limit = page(None, q.limit)?.limit;
    let after = q.after.as_deref().map(|a| id(AccountId::parse, a)).transpose()?;
    let p = s.store.accounts(&auth.actor.scope, after.as_ref(), limit).await?;
    Ok(ok(dto::AccountPage { accounts: p.rows.into_iter().map(Into::into).collect(), next_after: p.next_after }))
}

/// Read an account's balance
///
/// The account's balance in credits (minor units, a signed 64-bit integer), its overdraft limit and its
/// creation time. The balance is always the sum of the account's ledger entries.
#[utoipa::path(get, path = "/v1/accounts/{id}", tag = "accounts", params(("id" = String, Path)),
    responses((status = 200, body = dto::Account), (status = 404, body = ErrorBody)))]
pub async fn get_account(State(s): State<AppState>, auth: Auth<ClientRole>, Path(account): Path<String>) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    Ok(ok(dto::Account::from(s.store.account(&account).await?)))
}

/// Change an account's overdraft limit or cap
///
/// Sets each field given and keeps the others: `overdraft_limit` (0 to 2^61) and `max_running` (0 to
/// 10,000; `null` removes the cap). A cap lowered below what runs now stops new claims until the
/// account is below it; running jobs finish. A change writes one `account.updated` event and is
/// recorded in the action log; a body that changes nothing writes nothing. Admin only.
#[utoipa::path(patch, path = "/v1/accounts/{id}", tag = "accounts", params(("id" = String, Path)),
    request_body = dto::UpdateAccount,
    responses((status = 200, body = dto::Account), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn update_account(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(account): Path<String>,
    Json(b): Json<dto::UpdateAccount>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    let changes =
        store::AccountChanges { overdraft_limit: b.overdraft_limit.map(Credits::new), max_running: b.max_running };
    tracing::info!(actor = %auth.actor, account = %account, "update account");
    Ok(ok(dto::Account::from(s.store.update_account(&account, changes, &auth.actor.name).await?)))
}

/// Set an account's balance alerts
///
/// Replaces the account's alerts (at most 16, each `{id, below}` with `below` from 1 to 2^61; an empty
/// list removes them). Each alert is edge-triggered: a posting that takes the balance from at or above
/// `below` to under it writes one `account.balance_low` event in its own transaction, one that takes
/// it back writes one `account.balance_recovered`, and nothing fires while the balance stays on one
/// side. Setting alerts records the side the balance is on now and fires nothing.
#[utoipa::path(put, path = "/v1/accounts/{id}/alerts", tag = "accounts", params(("id" = String, Path)),
    request_body = dto::PutAlerts,
    responses((status = 200, body = dto::AlertList), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn put_alerts(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(account): Path<String>,
    Json(b): Json<dto::PutAlerts>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    let alerts = b.alerts.into_iter().map(|a| (a.id, a.below)).collect();
    tracing::info!(actor = %auth.actor, %account, "set alerts");
    Ok(ok(dto::AlertList::from(s.store.set_alerts(&account, alerts, &auth.actor.name).await?)))
}

/// Read an account's balance alerts
///
/// The account's alerts in threshold order, each with the side of it the balance is on now.
#[utoipa::path(get, path = "/v1/accounts/{id}/alerts", tag = "accounts", params(("id" = String, Path)),
    responses((status = 200, body = dto::AlertList), (status = 404, body = ErrorBody)))]
pub async fn get_alerts(State(s): State<AppState>, auth: Auth<ClientRole>, Path(account): Path<String>) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    Ok(ok(dto::AlertList::from(s.store.alerts(&account).await?)))
}

/// Set an account's spend limits
///
/// Replaces the account's spend limits (at most 16; an empty list removes them). Each bounds what
/// one UTC `day` or `month` may spend through creates — charges, holds and reclaims posted in the
/// period, less the refunds, releases and payout returns posted in it — on the job kinds it names
/// (none: every kind but `withdrawal`, which counts only when named). A create (or a withdrawal a
/// limit names) that would take a period over its `amount` is `402 spend_limit_exceeded` with the
/// limit, its spend and what is left, and writes nothing; a reclaim is never refused, and counts.
/// A limit put mid-period starts from what the period's ledger says was spent.
#[utoipa::path(put, path = "/v1/accounts/{id}/limits", tag = "accounts", params(("id" = String, Path)),
    request_body = dto::PutLimits,
    responses((status = 200, body = dto::LimitList), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn put_limits(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(account): Path<String>,
    Json(b): Json<dto::PutLimits>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    let mut limits = Vec::with_capacity(b.limits.len());
    for (i, l) in b.limits.into_iter().enumerate() {
        let period = settle_core::spend::Period::parse(&l.period).ok_or_else(|| {
            ApiError::invalid(format!("Spend limit {i}: period must be day or month, not {:?}.", l.period))
        })?;
        limits.push(store::NewLimit { period, amount: l.amount, kinds: l.kinds });
    }
    tracing::info!(actor = %auth.actor, %account, "set spend limits");
    Ok(ok(dto::LimitList::from(s.store.set_limits(&account, limits, &auth.actor.name).await?)))
}

/// Put an account's auto top-up rule
///
/// One rule per account: a posting that takes the balance from at or above `below` to under it
/// buys `credits` for `price` through the funding provider, in the posting's own transaction —
/// unless a top-up of the account is in flight, or the month's count would pass
/// `monthly_credits_max` (`top_up.rule_skipped`). A rule top-up that dies pauses the rule
/// (`top_up.rule_paused`) until it is put again. Putting it fires nothing, even below the threshold.
#[utoipa::path(put, path = "/v1/accounts/{id}/auto-top-up", tag = "accounts", params(("id" = String, Path)),
    request_body = dto::PutAutoTopUp,
    responses((status = 200, body = dto::AutoTopUp), (status = 400, body = ErrorBody), (status = 403, body = ErrorBody),
              (status = 404, body = ErrorBody)))]
pub async fn put_auto_top_up(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(account): Path<String>,
    Json(b): Json<dto::PutAutoTopUp>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    auth.actor.may_buy()?;
    let rule = store::NewAutoTopUp {
        below: b.below,
        credits: Credits::new(b.credits),
        price: b.price,
        currency: settle_core::currency::Currency::parse(&b.currency)
            .ok_or_else(|| ApiError::invalid("currency is not an ISO 4217 code."))?,
        customer: id(settle_core::ids::Customer::parse, &b.customer)?,
        monthly_credits_max: b.monthly_credits_max,
    };
    if rule.price == 0 && auth.actor.role != crate::auth::Role::Admin {
        return Err(ApiError::forbidden("admin (a top-up with price 0 gives credit away)"));
    }
    tracing::info!(actor = %auth.actor, %account, "put auto top-up rule");
    Ok(ok(dto::AutoTopUp::from(s.store.funding().put_auto_top_up(&account, rule, &auth.actor.name).await?)))
}

/// Read an account's auto top-up rule
///
/// The rule with its state and what its top-ups made this month are buying or bought; `404` when
/// the account has none.
#[utoipa::path(get, path = "/v1/accounts/{id}/auto-top-up", tag = "accounts", params(("id" = String, Path)),
    responses((status = 200, body = dto::AutoTopUp), (status = 404, body = ErrorBody)))]
pub async fn get_auto_top_up(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(account): Path<String>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    Ok(ok(dto::AutoTopUp::from(s.store.funding().auto_top_up(&account).await?)))
}

/// Remove an account's auto top-up rule
///
/// The rule goes; a top-up it made goes on. `204` whether or not there was one.
#[utoipa::path(delete, path = "/v1/accounts/{id}/auto-top-up", tag = "accounts", params(("id" = String, Path)),
    responses((status = 204, description = "no rule now"), (status = 404, body = ErrorBody)))]
pub async fn delete_auto_top_up(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(account): Path<String>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    auth.actor.may_buy()?;
    s.store.funding().delete_auto_top_up(&account, &auth.actor.name).await?;
    Ok(axum::http::StatusCode::NO_CONTENT.into_response())
}

/// Read an account's spend limits
///
/// The account's spend limits in the order they were put, each with what its current period spent
/// and when the next period starts.
#[utoipa::path(get, path = "/v1/accounts/{id}/limits", tag = "accounts", params(("id" = String, Path)),
    responses((status = 200, body = dto::LimitList), (status = 404, body = ErrorBody)))]
pub async fn get_limits(State(s): State<AppState>, auth: Auth<ClientRole>, Path(account): Path<String>) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    Ok(ok(dto::LimitList::from(s.store.limits(&account).await?)))
}

/// Grant credits to an account
///
/// Adds `amount` credits (> 0) to the balance with one `grant` ledger entry, answered with that entry.
/// The grant id makes the request idempotent: a replay answers `200` with the entry, a different body
/// under the same id is `409 idempotency_conflict`. A grant that would take the balance past the bound
/// is `400`. Admin only; recorded in the action log.
#[utoipa::path(post, path = "/v1/accounts/{id}/grants", tag = "accounts", params(("id" = String, Path)),
    request_body = dto::CreateGrant,
    responses((status = 201, body = dto::LedgerEntry), (status = 200, description = "a replay (header Idempotent-Replayed: true): the resource as it is now, not as first answered", body = dto::LedgerEntry),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create_grant(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(account): Path<String>,
    Json(b): Json<dto::CreateGrant>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    let expires_at = match b.expires_at.as_deref() {
        None => None,
        Some(t) => Some(parse_rfc3339(t).ok_or_else(|| ApiError::invalid("expires_at must be an RFC 3339 time."))?),
    };
    let req = store::NewGrant {
        id: id(RefId::parse, &b.id)?,
        amount: Credits::new(b.amount),
        reason: b.reason,
        expires_at,
        priority: b.priority,
    };
    tracing::info!(actor = %auth.actor, %account, grant = %req.id, amount = req.amount.get(), "grant");
    Ok(created(s.store.grant(&account, req, &auth.actor.name).await?, dto::LedgerEntry::from))
}

/// List an account's grants
///
/// The sources of the account's credit in the order they were made — its grants, its positive
/// adjustments, and (`origin` `opening`) the balance it had before grants were tracked — each with
/// what it has left, its priority and its expiry. Charges take from `active` grants by priority, then
/// soonest expiry, then oldest; `remaining` summed over active grants, less any debt, is the balance.
#[utoipa::path(get, path = "/v1/accounts/{id}/grants", tag = "accounts", params(("id" = String, Path), dto::PageQuery),
    responses((status = 200, body = dto::GrantList), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn list_grants(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(account): Path<String>,
    Query(q): Query<dto::PageQuery>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    let p = s.store.grants(&account, page(q.after, q.limit)?).await?;
    Ok(ok(dto::GrantList { grants: p.rows.into_iter().map(Into::into).collect(), next_after: p.next_after }))
}

/// Adjust an account's balance by hand
///
/// Adds or takes away `amount` credits (≠ 0) with one `adjustment` ledger entry carrying the required
/// `reason`, answered with that entry. Idempotent by its id like grants. A negative adjustment may not
/// take the balance below what outstanding reclaims need. Admin only; recorded in the action log.
#[utoipa::path(post, path = "/v1/accounts/{id}/adjustments", tag = "accounts", params(("id" = String, Path)),
    request_body = dto::CreateAdjustment,
    responses((status = 201, body = dto::LedgerEntry), (status = 200, description = "a replay (header Idempotent-Replayed: true): the resource as it is now, not as first answered", body = dto::LedgerEntry),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn create_adjustment(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(account): Path<String>,
    Json(b): Json<dto::CreateAdjustment>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    let req = store::NewAdjustment { id: id(RefId::parse, &b.id)?, amount: Credits::new(b.amount), reason: b.reason };
    tracing::info!(actor = %auth.actor, %account, adjustment = %req.id, amount = req.amount.get(), "adjustment");
    Ok(created(s.store.adjust(&account, req, &auth.actor.name).await?, dto::LedgerEntry::from))
}

/// List an account's ledger entries
///
/// The account's append-only ledger in `seq` order, one page at a time: pass the answer's `next_after`
/// as `after` for the next page (`null` when there is none). Each entry carries its kind (`grant`,
/// `adjustment`, `charge`, `refund`, `reclaim`, `payout_return`, `release`, `expire`), signed amount,
/// the balance after it, the job and item it belongs to, and its hash in the account's chain.
#[utoipa::path(get, path = "/v1/accounts/{id}/ledger", tag = "accounts", params(("id" = String, Path), dto::PageQuery),
    responses((status = 200, body = dto::LedgerPage), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody)))]
pub async fn get_ledger(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(account): Path<String>,
    Query(q): Query<dto::PageQuery>,
) -> ApiResult {
    let account = id(AccountId::parse, &account)?;
    seen_account(&auth.actor, &account)?;
    let p = s.store.ledger(&account, page(q.after, q.limit)?).await?;
    Ok(ok(dto::LedgerPage { entries: p.rows.into_iter().map(Into::into).collect(), next_after: p.next_after }))
}

// ----- jobs -----------------------------------------------------------------------------------------

/// Create a job and charge it
///
/// Creates a job of `kind` with one `cost`, one `hold`, or a list of billable `items` (each a `cost`
/// or a `hold`), and charges every item in the same transaction (one `charge` ledger entry each). A
/// held item is charged its hold; the worker's success prices it (at most the hold) and releases
/// the rest. When the balance cannot cover it the
/// answer is `402 insufficient_credits` and nothing is written. The job id is the client's: a replay
/// with the same body answers `200` with `Idempotent-Replayed: true` and the job as it is now; a
/// different body is `409 idempotency_conflict`. Optional: `payload` (JSON kept for the worker),
/// `max_attempts`, `refund_on` (`failure` or `final_failure`), `not_before` (RFC 3339).
#[utoipa::path(post, path = "/v1/jobs", tag = "jobs", request_body = dto::CreateJob,
    responses((status = 201, body = dto::Job), (status = 200, description = "a replay (header Idempotent-Replayed: true): the resource as it is now, not as first answered", body = dto::Job),
              (status = 400, body = ErrorBody), (status = 402, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
pub async fn create_job(State(s): State<AppState>, auth: Auth<ClientRole>, Json(b): Json<dto::CreateJob>) -> ApiResult {
    let items = match (b.cost, b.hold, b.items) {
        (Some(cost), None, None) => {
            vec![store::NewItem { id: ItemId::main(), price: store::Price::Cost(Credits::new(cost)) }]
        }
        (None, Some(hold), None) => {
            vec![store::NewItem { id: ItemId::main(), price: store::Price::Hold(Credits::new(hold)) }]
        }
        (None, None, Some(items)) => items
            .into_iter()
            .map(|i| {
                let price = match (i.cost, i.hold) {
                    (Some(c), None) => store::Price::Cost(Credits::new(c)),
                    (None, Some(h)) => store::Price::Hold(Credits::new(h)),
                    _ => return Err(ApiError::invalid(format!("Item {} has exactly one of cost and hold.", i.id))),
                };
                Ok(store::NewItem { id: id(ItemId::parse, &i.id)?, price })
            })
            .collect::<Result<Vec<_>, ApiError>>()?,
        _ => return Err(ApiError::invalid("A job has exactly one of cost, hold and items.")),
    };
    let refund_on = match b.refund_on.as_deref() {
        None => None,
        Some(p) => {
            Some(RefundPolicy::parse(p).ok_or_else(|| ApiError::invalid("refund_on is failure or final_failure."))?)
        }
    };
    let not_before = match b.not_before.as_deref() {
        None => None,
        Some(t) => Some(parse_rfc3339(t).ok_or_else(|| ApiError::invalid("not_before must be an RFC 3339 time."))?),
    };
    let req = store::NewJob {
        id: id(JobId::parse, &b.id)?,
        account_id: id(AccountId::parse, &b.account_id)?,
        kind: id(JobKind::parse, &b.kind)?,
        items,
        payload: b.payload.unwrap_or(serde_json::Value::Null),
        max_attempts: b.max_attempts,
        refund_on,
        not_before,
        priority: b.priority,
        requires: labels(&b.requires.unwrap_or_default(), limits::JOB_REQUIRES_MAX)?,
    };
    auth.actor.may_use_account(req.account_id.as_str())?;
    auth.actor.may_use_kind(req.kind.as_str())?;
    Ok(created(s.store.create_job(req).await?, dto::Job::from))
}

/// Read a job
///
/// The job's state, its items with their money states, its net (the sum of its ledger entries), its
/// attempt count, lease expiry, cancel request and last error.
#[utoipa::path(get, path = "/v1/jobs/{id}", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, body = dto::Job), (status = 404, body = ErrorBody)))]
pub async fn get_job(State(s): State<AppState>, auth: Auth<ClientRole>, Path(job): Path<String>) -> ApiResult {
    let j = s.store.job(&id(JobId::parse, &job)?).await?;
    if !auth.actor.scope.job(j.account_id.as_str(), j.kind.as_str()) {
        return Err(store::StoreError::not_found("job", j.id).into());
    }
    Ok(ok(dto::Job::from(j)))
}

/// List jobs
///
/// Jobs in creation order, filtered by `state`, `kind`, `account_id`, `fail_code` and `priority`, one page at a
/// time: pass the answer's `next_after` as `after` for the next page.
#[utoipa::path(get, path = "/v1/jobs", tag = "jobs", params(dto::JobsQuery),
    responses((status = 200, body = dto::JobPage), (status = 400, body = ErrorBody)))]
pub async fn list_jobs(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Query(q): Query<dto::JobsQuery>,
) -> ApiResult {
    let filter = store::JobFilter {
        state: match q.state.as_deref() {
            None => None,
            Some(st) => Some(JobState::parse(st).ok_or_else(|| ApiError::invalid("state is not a job state."))?),
        },
        kind: q.kind.as_deref().map(|k| id(JobKind::parse, k)).transpose()?,
        account_id: q.account_id.as_deref().map(|a| id(AccountId::parse, a)).transpose()?,
        fail_code: q.fail_code.as_deref().map(|c| id(FailCode::parse, c)).transpose()?,
        priority: match q.priority {
            Some(p) if p > limits::JOB_PRIORITY_MAX => return Err(ApiError::invalid("priority is 0 to 100.")),
            p => p,
        },
        id_prefix: None,
        until_seq: None,
        // A scoped token lists only what its scope names, whatever the filter asks.
        scope: auth.actor.scope.clone(),
    };
    let p = s.store.jobs(&filter, page(q.after, q.limit)?).await?;
    Ok(ok(dto::JobPage { jobs: p.rows.into_iter().map(Into::into).collect(), next_after: p.next_after }))
}

/// Read a job's attempt log
///
/// One row per attempt, never deleted: the worker that held the lease, when it started and ended, and
/// how it ended (`succeeded`, `failed`, `lease_expired`, `unknown`, `cancelled`, `superseded`) with the
/// fail code and message. Support answers "when and why did it fail" from it.
#[utoipa::path(get, path = "/v1/jobs/{id}/attempts", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, body = dto::Attempts), (status = 404, body = ErrorBody)))]
pub async fn attempts(State(s): State<AppState>, auth: Auth<ClientRole>, Path(job): Path<String>) -> ApiResult {
    let job = id(JobId::parse, &job)?;
    seen_job(&s, &auth.actor, &job).await?;
    let rows = s.store.attempts(&job).await?;
    Ok(ok(dto::Attempts {
        attempts: rows
            .into_iter()
            .map(|a| dto::Attempt {
                attempt_no: a.attempt_no,
                worker: a.worker,
                started_at: dto::rfc3339(a.started_at),
                finished_at: a.finished_at.map(dto::rfc3339),
                result: a.result.map(|r| r.as_str().to_owned()),
                fail_code: a.fail_code,
                message: a.message,
                recovered_at: a.recovered_at.map(dto::rfc3339),
            })
            .collect(),
    }))
}

/// Read what paid for a job and what was done to it
///
/// The parts of a job's story the attempt log does not hold: which grant paid which part and what of
/// it went back, operators' actions (requeue, abandon-cleanup) with the token that did them, and the
/// worker signals that changed nothing — a stale lease's or a repeat — or recovered the job (a late
/// success). Admin only: actions name tokens.
#[utoipa::path(get, path = "/v1/jobs/{id}/history", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, body = dto::JobHistory), (status = 404, body = ErrorBody)))]
pub async fn job_history(State(s): State<AppState>, _auth: Auth<AdminRole>, Path(job): Path<String>) -> ApiResult {
    let job = id(JobId::parse, &job)?;
    s.store.job(&job).await?; // 404 for a job that does not exist
    let allocations = s.store.allocations(&job).await?;
    let actions = s.store.operators().actions(Some(&job), None).await?;
    let signals = s.store.signals(&job).await?;
    Ok(ok(dto::JobHistory {
        allocations: allocations
            .into_iter()
            .map(|a| dto::Allocation {
                grant_id: a.grant_id,
                origin: a.origin,
                kind: a.kind,
                item_id: a.item_id,
                taken: a.taken.get(),
                given_back: a.given_back.get(),
            })
            .collect(),
        actions: actions
            .into_iter()
            .map(|a| dto::Action {
                at: dto::rfc3339(a.at),
                actor: a.actor,
                action: a.action.to_string(),
                detail: serde_json::from_str(&a.detail).unwrap_or(serde_json::Value::String(a.detail)),
            })
            .collect(),
        signals: signals
            .into_iter()
            .map(|r| dto::SignalRecord {
                signal: r.signal.to_string(),
                effect: r.effect.to_string(),
                attempt_no: r.attempt_no,
                received_at: dto::rfc3339(r.received_at),
                fail_code: r.fail_code,
                message: r.message,
            })
            .collect(),
    }))
}

/// Cancel a job
///
/// A queued job is cancelled at once: every charged item is refunded and the answer is `200` with the
/// job `cancelled`. A running job gets a cancel request (`202`, `cancel_requested: true`): its worker
/// sees it at the next heartbeat or item report and stops at the item boundary; delivered items stay
/// charged, the rest are refunded and their artifacts deleted, and the terminal state is written last.
/// A finished job is `409 job_finished`; a job whose outcome is unknown is `409 outcome_unknown`.
#[utoipa::path(post, path = "/v1/jobs/{id}/cancel", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, description = "cancelled", body = dto::Job),
              (status = 202, description = "cancel requested (running) or cleanup pending (cancelling)", body = dto::Job),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn cancel(State(s): State<AppState>, auth: Auth<ClientRole>, Path(job): Path<String>) -> ApiResult {
    let job = id(JobId::parse, &job)?;
    seen_job(&s, &auth.actor, &job).await?;
    let out = s.store.cancel(&job, None).await?;
    mark("cancel", true);
    Ok(match out {
        store::CancelOutcome::Cancelled(j) => json(StatusCode::OK, &dto::Job::from(j)),
        store::CancelOutcome::Accepted(j) => json(StatusCode::ACCEPTED, &dto::Job::from(j)),
    })
}

/// Requeue a dead job
///
/// Moves a `dead` job back to `queued`, due now, with a fresh attempt budget. What its failure
/// refunded stays refunded until a later success reclaims it. Only from `dead` (`409` otherwise); a
/// dead withdrawal is not requeued (its hold was refunded: create a new one). Admin only; recorded in
/// the action log.
#[utoipa::path(post, path = "/v1/jobs/{id}/requeue", tag = "jobs", params(("id" = String, Path)),
    responses((status = 200, body = dto::Job), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn requeue(State(s): State<AppState>, auth: Auth<AdminRole>, Path(job): Path<String>) -> ApiResult {
    let job = id(JobId::parse, &job)?;
    tracing::info!(actor = %auth.actor, %job, "requeue");
    let j = s.store.requeue(&job, &auth.actor.name).await?;
    mark("requeue", true);
    Ok(ok(dto::Job::from(j)))
}

/// Finish a teardown without its artifact cleanup
///
/// The way out of a job stuck `cancelling` because its artifacts cannot be deleted (a store that
/// refuses, a file that will not go; see the job's cleanup failures): `cancelling → cancelled`
/// without the cleanup. The refunds were made when the teardown began; the artifacts left are named
/// in the `job.cancelled` event (`artifacts_left`) and, with the reason, in the action log, for
/// someone to delete by hand. A job already `cancelled` is answered as it is; any other state is
/// `409`. Admin only.
#[utoipa::path(post, path = "/v1/jobs/{id}/abandon-cleanup", tag = "jobs", params(("id" = String, Path)),
    request_body = dto::AbandonCleanup,
    responses((status = 200, body = dto::Job), (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
        (status = 409, body = ErrorBody)))]
pub async fn abandon_cleanup(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(job): Path<String>,
    Json(b): Json<dto::AbandonCleanup>,
) -> ApiResult {
    let job = id(JobId::parse, &job)?;
    tracing::warn!(actor = %auth.actor, %job, reason = %b.reason, "teardown finished without its cleanup");
    let j = s.store.abandon_cleanup(&job, &auth.actor.name, &b.reason).await?;
    mark("abandon_cleanup", true);
    Ok(ok(dto::Job::from(j)))
}

// ----- worker protocol ------------------------------------------------------------------------------

/// Claim due jobs
///
/// Leases up to `limit` due jobs of the given `kinds` to `worker` for `lease_seconds`, each with a new
/// lease token and an attempt row. When nothing is due the request waits up to `wait_seconds` for work
/// (a long-poll) and then answers an empty list. Withdrawals are never handed to workers.
#[utoipa::path(post, path = "/v1/claims", tag = "workers", request_body = dto::Claim,
    responses((status = 200, body = dto::Claimed), (status = 400, body = ErrorBody)))]
pub async fn claim(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    headers: HeaderMap,
    Json(b): Json<dto::Claim>,
) -> ApiResult {
    let wait = b.wait_seconds.unwrap_or(0);
    if wait > limits::WAIT_SECONDS_MAX {
        return Err(ApiError::invalid(format!("wait_seconds is at most {}.", limits::WAIT_SECONDS_MAX)));
    }
    let kinds: Vec<JobKind> =
        b.kinds.unwrap_or_default().iter().map(|k| id(JobKind::parse, k)).collect::<Result<_, _>>()?;
    // A worker token scoped to kinds claims only those: none asked means all of its own.
    let kinds = match &auth.actor.scope.kinds {
        None => kinds,
        Some(own) if kinds.is_empty() => own.clone(),
        Some(_) => {
            for k in &kinds {
                auth.actor.may_use_kind(k.as_str())?;
            }
            kinds
        }
    };
    let (wait, _slot) = long_poll_slot(&s, &headers, wait);
    let req = store::ClaimRequest {
        worker: id(WorkerName::parse, &b.worker)?,
        kinds,
        labels: labels(&b.labels.unwrap_or_default(), limits::CLAIM_LABELS_MAX)?,
        limit: b.limit.unwrap_or(1),
        lease_seconds: b.lease_seconds,
    };
    // Woken when a job is queued anywhere; between wake-ups, looks again when the next queued
    // job becomes due.
    let claimed = long_poll(
        &s,
        s.store.wake(),
        wait,
        || async {
            let got = s.store.claim(req.clone()).await?;
            let found = !got.is_empty();
            Ok((got, found))
        },
        || async {
            Ok(s.store.next_due_at(&req.kinds).await?.map(|due| {
                let until_due = due.micros().saturating_sub(s.store.now().micros()).max(0);
                // A due job another process holds under SKIP LOCKED must not make this loop spin.
                Duration::from_micros(until_due as u64).max(Duration::from_millis(limits::POLL_FLOOR_MS))
            }))
        },
    )
    .await?;
    for _ in &claimed {
        mark("claim", true);
    }
    Ok(ok(dto::Claimed {
        jobs: claimed
            .into_iter()
            .map(|c| dto::ClaimedJob {
                job: c.job.into(),
                lease_token: c.lease_token.0,
                lease_expires_at: dto::rfc3339(c.lease_expires_at),
            })
            .collect(),
    }))
}

pub(crate) fn token(t: String) -> Result<store::LeaseToken, ApiError> {
    if t.is_empty() || t.len() > 128 {
        return Err(ApiError::invalid("lease_token is 1 to 128 characters."));
    }
    Ok(store::LeaseToken(t))
}

/// Renew a lease
///
/// Extends the lease of the current attempt and tells the worker whether a cancel was requested. A
/// token that is not the current attempt's is `409 lease_lost` and changes nothing (it is logged);
/// the error's `details` say what became of the job and of the token's attempt (`lease`: `expired`
/// with `expired_at`, `ended`, or `never_issued`).
#[utoipa::path(post, path = "/v1/jobs/{id}/heartbeat", tag = "workers", params(("id" = String, Path)),
    request_body = dto::LeaseOnly,
    responses((status = 200, body = dto::Heartbeat), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn heartbeat(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path(job): Path<String>,
    Json(b): Json<dto::LeaseOnly>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let hb = s.store.heartbeat(&id(JobId::parse, &job)?, &token(b.lease_token)?).await?;
    Ok(ok(dto::Heartbeat {
        lease_expires_at: dto::rfc3339(hb.lease_expires_at),
        cancel_requested: hb.cancel_requested,
    }))
}

/// Report a job's success
///
/// Accepted with the token of any attempt of this job, current or not: the work exists. A success
/// after a failure refunded the job reclaims that refund (the seed's timeout-at-30 s, result-at-32 s
/// case). If a cancel won the race, the job goes to teardown instead (the answer's `state` is
/// `cancelling`). A repeat, or a success after the job succeeded, is a replay: `200` with
/// `Idempotent-Replayed: true`, nothing changed (a held item keeps the price its first success
/// gave it, whatever a later one says). A held item this success delivers or reclaims needs its
/// price: `cost` for a job made with `hold`, `costs` by item id otherwise (what the work used, at
/// most the hold); the rest of the hold is released. A token no attempt of this job ever held is
/// `409 lease_lost` and writes nothing. Without a token a success is an operator's act: admin role
/// only, recorded in the action log.
#[utoipa::path(post, path = "/v1/jobs/{id}/succeed", tag = "workers", params(("id" = String, Path)),
    request_body = dto::Succeed,
    responses((status = 200, description = "applied, or a replay (header Idempotent-Replayed: true)", body = dto::Job),
              (status = 403, description = "no lease token, and not the admin role", body = ErrorBody),
              (status = 404, body = ErrorBody),
              (status = 409, description = "lease_lost (a token no attempt held, or a job no success moves), job_finished, or a withdrawal (moved only by the payout processor)", body = ErrorBody),
              (status = 400, description = "a malformed price: below zero, for an item the job lacks, or other than a fixed item's cost", body = ErrorBody),
              (status = 422, description = "cost_required (a held item this success decides, without its price) or cost_exceeds_hold", body = ErrorBody)))]
pub async fn succeed(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path(job): Path<String>,
    Json(b): Json<dto::Succeed>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let t = b.lease_token.map(token).transpose()?;
    let by = match &t {
        Some(t) => store::Reporter::Lease(t),
        None if auth.actor.role == Role::Admin => store::Reporter::Operator(&auth.actor.name),
        None => {
            return Err(ApiError::new(
                StatusCode::FORBIDDEN,
                "forbidden",
                "A success without a lease token is an operator's act: it needs the admin role.",
            ));
        }
    };
    let costs = costs(b.cost, b.costs)?;
    let out = s.store.succeed_priced(&id(JobId::parse, &job)?, by, b.result, &costs).await?;
    mark("succeed", out.applied);
    Ok(reported(dto::Job::from(out.value), out.applied))
}

/// A success's prices: `cost` for the `main` item, or `costs` by item id, not both.
pub(crate) fn costs(
    cost: Option<i64>,
    costs: Option<std::collections::BTreeMap<String, i64>>,
) -> Result<store::Costs, ApiError> {
    Ok(match (cost, costs) {
        (None, None) => store::Costs::default(),
        (Some(c), None) => store::Costs::main(Credits::new(c)),
        (None, Some(map)) => store::Costs(
            map.into_iter()
                .map(|(item, c)| Ok((id(ItemId::parse, &item)?, Credits::new(c))))
                .collect::<Result<_, ApiError>>()?,
        ),
        (Some(_), Some(_)) => return Err(ApiError::invalid("A success has at most one of cost and costs.")),
    })
}

/// Report a job's failure
///
/// Refunds per the job's refund policy, then schedules a retry with capped exponential backoff
/// (`queued` with a later `not_before`) or, when the code is not retryable or the attempts are used up,
/// ends the job `dead`. A requested cancel is honoured instead. The same report re-sent after it
/// took effect is a replay (`200` with `Idempotent-Replayed: true`); with another code, `409
/// idempotency_conflict`. Any other token that is not the current attempt's is `409 lease_lost`
/// with `details` (what became of the job and of that attempt) and changes nothing.
#[utoipa::path(post, path = "/v1/jobs/{id}/fail", tag = "workers", params(("id" = String, Path)),
    request_body = dto::Fail,
    responses((status = 200, description = "applied, or a replay (header Idempotent-Replayed: true)", body = dto::Job),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, description = "lease_lost, idempotency_conflict, or a withdrawal (moved only by the payout processor)", body = ErrorBody)))]
pub async fn fail(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path(job): Path<String>,
    Json(b): Json<dto::Fail>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let signal = store::FailSignal {
        lease_token: token(b.lease_token)?,
        code: id(FailCode::parse, &b.code)?,
        message: b.message,
        retryable: b.retryable,
        retry_after_ms: b.retry_after_ms,
    };
    let out = s.store.fail(&id(JobId::parse, &job)?, signal).await?;
    mark("fail", out.applied);
    Ok(reported(dto::Job::from(out.value), out.applied))
}

/// Release a job at an item boundary
///
/// For a worker that must stop (its machine is being taken away): after reporting the item in hand,
/// it hands the job back. The job goes back to `queued`, due at once; no money moves; the attempt
/// closes as `released` and does not count toward `max_attempts`. When a cancel was requested the
/// release is the worker's stop and the job is torn down (`cancelled`) instead. A re-send after it
/// took effect is a replay (`200` with `Idempotent-Replayed: true`); another stale token is `409
/// lease_lost` and changes nothing.
#[utoipa::path(post, path = "/v1/jobs/{id}/release", tag = "workers", params(("id" = String, Path)),
    request_body = dto::LeaseOnly,
    responses((status = 200, description = "released (queued), torn down after a cancel, or a replay (header Idempotent-Replayed: true)", body = dto::Job),
              (status = 404, body = ErrorBody),
              (status = 409, description = "lease_lost, or a withdrawal (moved only by the payout processor)", body = ErrorBody)))]
pub async fn release(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path(job): Path<String>,
    Json(b): Json<dto::LeaseOnly>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let out = s.store.release(&id(JobId::parse, &job)?, &token(b.lease_token)?).await?;
    mark("release", out.applied);
    Ok(reported(dto::Job::from(out.value), out.applied))
}

/// Report that a job's outcome is unknown
///
/// For an external effect whose answer was lost: the job moves to `unknown`, keeps its charge, and
/// waits for the reconciler to ask the outside system what happened. A re-send after it took effect
/// is a replay (`200` with `Idempotent-Replayed: true`); another stale token is `409 lease_lost`.
#[utoipa::path(post, path = "/v1/jobs/{id}/unknown", tag = "workers", params(("id" = String, Path)),
    request_body = dto::Unknown,
    responses((status = 200, description = "applied, or a replay (header Idempotent-Replayed: true)", body = dto::Job),
              (status = 404, body = ErrorBody),
              (status = 409, description = "lease_lost, or a withdrawal (moved only by the payout processor)", body = ErrorBody)))]
pub async fn unknown(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path(job): Path<String>,
    Json(b): Json<dto::Unknown>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let out = s.store.mark_unknown(&id(JobId::parse, &job)?, &token(b.lease_token)?, b.message.as_deref()).await?;
    mark("unknown", out.applied);
    Ok(reported(dto::Job::from(out.value), out.applied))
}

fn item_report(r: store::ItemReport) -> dto::ItemReport {
    dto::ItemReport { item: dto::Item::from(r.item), cancel_requested: r.cancel_requested }
}

/// Report an item delivered
///
/// Marks one item delivered (it stays charged) and answers whether a cancel was requested, so the
/// worker can stop at the item boundary. A held item needs its `cost` (what its work used, at most
/// its hold): it is priced at that and the rest of its hold released (`422 cost_required` /
/// `cost_exceeds_hold` otherwise, nothing written). A repeat is a replay (`200` with
/// `Idempotent-Replayed: true`; a price the item already has stays); a token that is not the
/// current lease is `409 lease_lost` unless its attempt decided the item (then a replay); an item
/// cancelled is `409 invalid_transition`.
#[utoipa::path(post, path = "/v1/jobs/{id}/items/{item}/succeed", tag = "workers",
    params(("id" = String, Path), ("item" = String, Path)), request_body = dto::ItemSucceed,
    responses((status = 200, description = "applied, or a replay (header Idempotent-Replayed: true)", body = dto::ItemReport),
              (status = 400, body = ErrorBody), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody),
              (status = 422, description = "cost_required (a held item without its price) or cost_exceeds_hold", body = ErrorBody)))]
pub async fn item_succeed(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path((job, item)): Path<(String, String)>,
    Json(b): Json<dto::ItemSucceed>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let (job, item) = (id(JobId::parse, &job)?, id(ItemId::parse, &item)?);
    let r = s.store.item_succeed_priced(&job, &item, &token(b.lease_token)?, b.cost.map(Credits::new)).await?;
    mark("item_succeed", r.applied);
    let applied = r.applied;
    Ok(reported(item_report(r), applied))
}

/// Report an item failed
///
/// Refunds one item with its own `refund` ledger entry; a later job-level success will not reclaim it.
/// Answers whether a cancel was requested. A repeat is a replay (`200` with `Idempotent-Replayed:
/// true`); a failure of a delivered item is `409 invalid_transition`; a token that is not the
/// current lease is `409 lease_lost` unless its attempt decided the item.
#[utoipa::path(post, path = "/v1/jobs/{id}/items/{item}/fail", tag = "workers",
    params(("id" = String, Path), ("item" = String, Path)), request_body = dto::ItemFail,
    responses((status = 200, description = "applied, or a replay (header Idempotent-Replayed: true)", body = dto::ItemReport),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn item_fail(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path((job, item)): Path<(String, String)>,
    Json(b): Json<dto::ItemFail>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let r = s
        .store
        .item_fail(
            &id(JobId::parse, &job)?,
            &id(ItemId::parse, &item)?,
            &token(b.lease_token)?,
            &id(FailCode::parse, &b.code)?,
            b.message.as_deref(),
        )
        .await?;
    mark("item_fail", r.applied);
    let applied = r.applied;
    Ok(reported(item_report(r), applied))
}

/// Register an item's artifact
///
/// Records an artifact key for an item and answers its `path`: where the worker stores the object,
/// under the job's and item's own prefix (`{job_id}/{item_id}/{key}`), so no worker can reach another
/// job's artifacts. Cancelling the job deletes that path if the item ends undelivered. Keys are
/// relative paths: `..`, `.`, absolute paths and empty segments are `400`. Only the current lease
/// holder may register.
#[utoipa::path(post, path = "/v1/jobs/{id}/items/{item}/artifacts", tag = "workers",
    params(("id" = String, Path), ("item" = String, Path)), request_body = dto::RegisterArtifact,
    responses((status = 201, body = dto::Artifact), (status = 200, description = "already registered (header Idempotent-Replayed: true)", body = dto::Artifact),
              (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn register_artifact(
    State(s): State<AppState>,
    auth: Auth<WorkerRole>,
    Path((job, item)): Path<(String, String)>,
    Json(b): Json<dto::RegisterArtifact>,
) -> ApiResult {
    // A worker token scoped to kinds reports only on jobs of those kinds.
    seen_job(&s, &auth.actor, &id(JobId::parse, &job)?).await?;
    let (job, item) = (id(JobId::parse, &job)?, id(ItemId::parse, &item)?);
    let key = id(ArtifactKey::parse, &b.key)?;
    let new =
        s.store.register_artifact(&job, &item, &token(b.lease_token)?, store::NewArtifact { key: key.clone() }).await?;
    let body = &(dto::Artifact {
        job_id: job.to_string(),
        item_id: item.to_string(),
        key: key.as_str().to_owned(),
        path: key.path_in(job.as_str(), item.as_str()),
    });
    if new {
        return Ok(json(StatusCode::CREATED, body));
    }
    let mut r = json(StatusCode::OK, body);
    r.headers_mut().insert("Idempotent-Replayed", HeaderValue::from_static("true"));
    Ok(r)
}

// ----- withdrawals ----------------------------------------------------------------------------------

/// Request a withdrawal
///
/// Creates a job of kind `withdrawal` that holds `amount` credits from the account and pays them out to
/// `destination` through the payout provider, under an idempotency key sent with every request. A lost
/// provider answer leaves it `unknown` until the reconciler asks the provider by that key. Idempotent
/// by its id like jobs.
#[utoipa::path(post, path = "/v1/withdrawals", tag = "withdrawals", request_body = dto::CreateWithdrawal,
    responses((status = 201, body = dto::Withdrawal), (status = 200, description = "a replay (header Idempotent-Replayed: true): the resource as it is now, not as first answered", body = dto::Withdrawal),
              (status = 400, body = ErrorBody), (status = 402, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
pub async fn create_withdrawal(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Json(b): Json<dto::CreateWithdrawal>,
) -> ApiResult {
    let req = store::NewWithdrawal {
        id: id(JobId::parse, &b.id)?,
        account_id: id(AccountId::parse, &b.account_id)?,
        amount: Credits::new(b.amount),
        destination: id(Destination::parse, &b.destination)?,
    };
    auth.actor.may_use_account(req.account_id.as_str())?;
    auth.actor.may_use_kind(settle_core::job::WITHDRAWAL_KIND)?;
    Ok(created(s.store.payouts().create_withdrawal(req).await?, dto::Withdrawal::from))
}

/// Read a withdrawal
///
/// The withdrawal's job with its idempotency key and, once the provider confirmed it, the provider's
/// transaction id.
#[utoipa::path(get, path = "/v1/withdrawals/{id}", tag = "withdrawals", params(("id" = String, Path)),
    responses((status = 200, body = dto::Withdrawal), (status = 404, body = ErrorBody)))]
pub async fn get_withdrawal(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Path(withdrawal): Path<String>,
) -> ApiResult {
    let w = s.store.payouts().withdrawal(&id(JobId::parse, &withdrawal)?).await?;
    if !auth.actor.scope.job(w.job.account_id.as_str(), w.job.kind.as_str()) {
        return Err(store::StoreError::not_found("withdrawal", w.job.id).into());
    }
    Ok(ok(dto::Withdrawal::from(w)))
}

/// List withdrawals
///
/// Withdrawals in creation order, filtered by `state` and `account_id`, one page at a time.
#[utoipa::path(get, path = "/v1/withdrawals", tag = "withdrawals", params(dto::WithdrawalsQuery),
    responses((status = 200, body = dto::WithdrawalPage), (status = 400, body = ErrorBody)))]
pub async fn list_withdrawals(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Query(q): Query<dto::WithdrawalsQuery>,
) -> ApiResult {
    let filter = store::WithdrawalFilter {
        state: job_state(q.state.as_deref())?,
        account_id: q.account_id.as_deref().map(|a| id(AccountId::parse, a)).transpose()?,
        updated_since: None,
        scope: auth.actor.scope.clone(),
    };
    let p = s.store.payouts().withdrawals(&filter, page(q.after, q.limit)?).await?;
    Ok(ok(dto::WithdrawalPage { withdrawals: p.rows.into_iter().map(Into::into).collect(), next_after: p.next_after }))
}

/// Buy credits
///
/// A top-up: `credits` bought for `price` minor units of `currency`, charged to the funding
/// provider's `customer` by the built-in funding processor. Nothing is charged to the account; the
/// credits are granted (origin `top_up`, never expiring, id the top-up's) only when the provider
/// confirms the charge, in the same transaction as `top_up.succeeded`. Create-by-id: a replay
/// answers the stored top-up, another body is `409`. A free top-up (`price: 0`) needs the admin role.
#[utoipa::path(post, path = "/v1/top-ups", tag = "top-ups", request_body = dto::CreateTopUp,
    responses((status = 201, body = dto::TopUp), (status = 200, description = "replay", body = dto::TopUp),
              (status = 400, body = ErrorBody), (status = 403, body = ErrorBody), (status = 404, body = ErrorBody),
              (status = 409, body = ErrorBody)))]
pub async fn create_top_up(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Json(b): Json<dto::CreateTopUp>,
) -> ApiResult {
    let req = store::NewTopUp {
        id: id(JobId::parse, &b.id)?,
        account_id: id(AccountId::parse, &b.account_id)?,
        credits: Credits::new(b.credits),
        price: b.price,
        currency: settle_core::currency::Currency::parse(&b.currency)
            .ok_or_else(|| ApiError::invalid("currency is not an ISO 4217 code."))?,
        customer: id(settle_core::ids::Customer::parse, &b.customer)?,
    };
    auth.actor.may_use_account(req.account_id.as_str())?;
    auth.actor.may_buy()?;
    if req.price == 0 && auth.actor.role != crate::auth::Role::Admin {
        return Err(ApiError::forbidden("admin (a top-up with price 0 gives credit away)"));
    }
    Ok(created(s.store.funding().create_top_up(req).await?, dto::TopUp::from))
}

/// Read a top-up
///
/// The top-up's job with its idempotency key and, once the provider confirmed the charge, its id and
/// the grant it wrote.
#[utoipa::path(get, path = "/v1/top-ups/{id}", tag = "top-ups", params(("id" = String, Path)),
    responses((status = 200, body = dto::TopUp), (status = 404, body = ErrorBody)))]
pub async fn get_top_up(State(s): State<AppState>, auth: Auth<ClientRole>, Path(top_up): Path<String>) -> ApiResult {
    let t = s.store.funding().top_up(&id(JobId::parse, &top_up)?).await?;
    if !auth.actor.scope.job(t.job.account_id.as_str(), t.job.kind.as_str()) {
        return Err(store::StoreError::not_found("top-up", t.job.id).into());
    }
    Ok(ok(dto::TopUp::from(t)))
}

/// List top-ups
///
/// Top-ups in creation order, filtered by `state` and `account_id`, one page at a time.
#[utoipa::path(get, path = "/v1/top-ups", tag = "top-ups", params(dto::WithdrawalsQuery),
    responses((status = 200, body = dto::TopUpPage), (status = 400, body = ErrorBody)))]
pub async fn list_top_ups(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    Query(q): Query<dto::WithdrawalsQuery>,
) -> ApiResult {
    let filter = store::TopUpFilter {
        state: job_state(q.state.as_deref())?,
        account_id: q.account_id.as_deref().map(|a| id(AccountId::parse, a)).transpose()?,
        updated_since: None,
        scope: auth.actor.scope.clone(),
    };
    let p = s.store.funding().top_ups(&filter, page(q.after, q.limit)?).await?;
    Ok(ok(dto::TopUpPage { top_ups: p.rows.into_iter().map(Into::into).collect(), next_after: p.next_after }))
}

/// A `state` filter: a job state, or none.
fn job_state(state: Option<&str>) -> Result<Option<JobState>, ApiError> {
    match state {
        None => Ok(None),
        Some(st) => Ok(Some(JobState::parse(st).ok_or_else(|| ApiError::invalid("state is not a job state."))?)),
    }
}

/// Record a returned payout
///
/// Records that a paid-out withdrawal was sent back by the receiving side: its amount is credited again
/// with one `payout_return` entry and the job ends `returned`. Admin only; recorded in the action log.
#[utoipa::path(post, path = "/v1/withdrawals/{id}/returned", tag = "withdrawals", params(("id" = String, Path)),
    responses((status = 200, description = "returned (now, or already)", body = dto::Withdrawal),
              (status = 404, body = ErrorBody), (status = 409, description = "not a succeeded withdrawal", body = ErrorBody)))]
pub async fn withdrawal_returned(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(withdrawal): Path<String>,
) -> ApiResult {
    let withdrawal = id(JobId::parse, &withdrawal)?;
    tracing::info!(actor = %auth.actor, %withdrawal, "withdrawal returned");
    let out = s.store.payouts().payout_returned(&withdrawal, store::ReturnSource::Admin, &auth.actor.name).await?;
    mark("withdrawal_returned", out.applied);
    Ok(ok(dto::Withdrawal::from(out.value)))
}

/// Resolve an unknown withdrawal by hand
///
/// For a withdrawal `unknown` (its send got no answer) whose provider can no longer be asked: an
/// operator records what was confirmed by other means — `sent` with the provider's txid (the
/// withdrawal succeeds), or `not_sent` (it ends `dead`, `CONFIRMED_NOT_SENT`, its hold refunded; it
/// cannot be requeued — to send the money after all, create a new withdrawal, which gets a new
/// idempotency key). One guarded transition from `unknown`, recorded in the action log.
/// Refused (`409 invalid_transition`) while this server has a payout provider configured — the
/// reconciler asks it — and for a withdrawal in any other state. Admin only.
#[utoipa::path(post, path = "/v1/withdrawals/{id}/resolve", tag = "withdrawals", params(("id" = String, Path)),
    request_body = dto::ResolveWithdrawal,
    responses((status = 200, description = "resolved", body = dto::Withdrawal),
              (status = 404, body = ErrorBody),
              (status = 409, description = "not unknown, or a provider can still be asked", body = ErrorBody)))]
pub async fn resolve_withdrawal(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(withdrawal): Path<String>,
    Json(b): Json<dto::ResolveWithdrawal>,
) -> ApiResult {
    let withdrawal = id(JobId::parse, &withdrawal)?;
    let outcome = match (b.outcome.as_str(), b.provider_txid) {
        ("sent", Some(provider_txid)) => store::ResolvedOutcome::Sent { provider_txid },
        ("sent", None) => return Err(ApiError::invalid("A withdrawal confirmed sent needs its provider_txid.")),
        ("not_sent", None) => store::ResolvedOutcome::NotSent,
        ("not_sent", Some(_)) => {
            return Err(ApiError::invalid("A withdrawal confirmed not sent has no provider_txid."));
        }
        _ => return Err(ApiError::invalid("outcome is sent or not_sent.")),
    };
    if s.payout_provider {
        return Err(ApiError::new(
            StatusCode::CONFLICT,
            "invalid_transition",
            "A payout provider is configured: the reconciler resolves unknown withdrawals by asking it. \
             Resolve by hand only once no provider can answer (remove it from the configuration).",
        ));
    }
    tracing::info!(actor = %auth.actor, %withdrawal, outcome = b.outcome, "withdrawal resolved by an operator");
    let resolution = store::Resolution { outcome, reason: b.reason };
    let out = s.store.payouts().payout_resolve(&withdrawal, resolution, &auth.actor.name).await?;
    mark("withdrawal_resolved", out.applied);
    Ok(ok(dto::Withdrawal::from(out.value)))
}

// ----- failures, events, audit, operations ----------------------------------------------------------

/// Count failures by code
///
/// How many jobs are now `dead`, `unknown` or waiting to retry, grouped by their last fail code and
/// state: the view an operator opens first when failures climb.
#[utoipa::path(get, path = "/v1/failures/summary", tag = "operations", responses((status = 200, body = dto::FailureSummary)))]
pub async fn failure_summary(State(s): State<AppState>, auth: Auth<ClientRole>) -> ApiResult {
    let rows = s.store.failure_summary(&auth.actor.scope).await?;
    Ok(ok(dto::FailureSummary {
        by_code: rows
            .into_iter()
            .map(|f| dto::FailureCount { code: f.code, state: f.state.as_str().to_owned(), count: f.count })
            .collect(),
    }))
}

/// Read the event feed
///
/// Every transition's event (`job.queued`, `job.refunded`, `account.granted`, …) in commit order by
/// `seq`, written in the same transaction as the transition. Pass the last `seq` seen as `after`; with
/// `wait_seconds` the request waits for new events (a long-poll). Webhook bodies carry the same
/// envelope. Deduplicate by (`epoch`, `seq`): a store restored from a backup numbers events again
/// from where the backup stood, under a higher epoch; a cursor past its last event is answered `409
/// cursor_ahead` with `details` `{"epoch", "restart_after"}` — go on from `after=restart_after`.
#[utoipa::path(get, path = "/v1/events", tag = "operations", params(dto::EventsQuery),
    responses((status = 200, body = dto::EventPage), (status = 400, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn events(
    State(s): State<AppState>,
    auth: Auth<ClientRole>,
    headers: HeaderMap,
    Query(q): Query<dto::EventsQuery>,
) -> ApiResult {
    let p = page(q.after, q.limit)?;
    let wait = q.wait_seconds.unwrap_or(0);
    if wait > limits::WAIT_SECONDS_MAX {
        return Err(ApiError::invalid(format!("wait_seconds is at most {}.", limits::WAIT_SECONDS_MAX)));
    }
    let (wait, _slot) = long_poll_slot(&s, &headers, wait);
    // Each look starts where the last one stopped: a scoped consumer's wake-ups do not rescan the
    // other tenants' events an empty look already passed.
    let cursor = std::sync::atomic::AtomicI64::new(p.after);
    let got = long_poll(
        &s,
        s.store.events_wake(),
        wait,
        || async {
            let after = cursor.load(std::sync::atomic::Ordering::Relaxed);
            let got = s.store.events(after, p.limit, &auth.actor.scope).await?;
            let found = !got.rows.is_empty();
            if let (false, Some(next)) = (found, got.next_after) {
                cursor.store(next, std::sync::atomic::Ordering::Relaxed);
            }
            Ok((got, found))
        },
        || async { Ok(None) },
    )
    .await?;
    Ok(ok(dto::EventPage { events: got.rows.iter().map(store::Event::envelope).collect(), next_after: got.next_after }))
}

/// List webhook deliveries
///
/// Deliveries of events to the configured webhook endpoints, filtered by endpoint and state (`pending`,
/// `delivered`, `dead`), with their attempts, last status and error.
#[utoipa::path(get, path = "/v1/webhooks/deliveries", tag = "operations", params(dto::DeliveriesQuery),
    responses((status = 200, body = dto::WebhookDeliveryPage)))]
pub async fn webhook_deliveries(
    State(s): State<AppState>,
    _auth: Auth<AdminRole>,
    Query(q): Query<dto::DeliveriesQuery>,
) -> ApiResult {
    let p = page(q.after, q.limit)?;
    let state = q
        .state
        .as_deref()
        .map(|st| {
            store::DeliveryState::parse(st).ok_or_else(|| ApiError::invalid("state is pending, delivered or dead."))
        })
        .transpose()?;
    if let Some(e) = q.endpoint.as_deref() {
        id(JobKind::parse, e)?;
    }
    let filter = store::DeliveryFilter { endpoint_id: q.endpoint, state };
    let got = s.store.webhooks().deliveries(&filter, p.after, p.limit).await?;
    let breakers = s.store.webhooks().breakers().await?;
    Ok(ok(dto::WebhookDeliveryPage {
        deliveries: got.rows.into_iter().map(Into::into).collect(),
        next_after: got.next_after,
        endpoints: breakers.into_iter().map(Into::into).collect(),
    }))
}

/// Close a webhook endpoint's circuit breaker
///
/// Closes the breaker by hand when the receiver is known to be back: deliveries resume at once instead
/// of at the next probe. Admin only; recorded in the action log.
#[utoipa::path(post, path = "/v1/webhooks/endpoints/{endpoint}/breaker/close", tag = "operations",
    params(("endpoint" = String, Path)),
    responses((status = 200, body = dto::WebhookBreaker), (status = 404, body = ErrorBody)))]
pub async fn close_breaker(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(endpoint): Path<String>,
) -> ApiResult {
    id(JobKind::parse, &endpoint)?;
    tracing::info!(actor = %auth.actor, %endpoint, "close webhook breaker");
    Ok(ok(dto::WebhookBreaker::from(s.store.webhooks().close_breaker(&endpoint, &auth.actor.name).await?)))
}

/// Requeue a dead webhook delivery
///
/// Moves one dead delivery back to pending with a fresh attempt budget. Admin only; recorded in the
/// action log.
#[utoipa::path(post, path = "/v1/webhooks/deliveries/{endpoint}/{seq}/requeue", tag = "operations",
    params(("endpoint" = String, Path), ("seq" = i64, Path)),
    responses((status = 200, body = dto::WebhookDelivery), (status = 404, body = ErrorBody), (status = 409, body = ErrorBody)))]
pub async fn requeue_delivery(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path((endpoint, seq)): Path<(String, i64)>,
) -> ApiResult {
    id(JobKind::parse, &endpoint)?;
    tracing::info!(actor = %auth.actor, %endpoint, seq, "requeue delivery");
    Ok(ok(dto::WebhookDelivery::from(s.store.webhooks().requeue_one(&endpoint, seq, &auth.actor.name).await?)))
}

/// Requeue an endpoint's dead deliveries
///
/// Moves the oldest dead deliveries of one endpoint (up to one page, 1,000) back to pending with a
/// fresh attempt budget, and answers how many moved; repeat while it answers a full page. Admin only;
/// recorded in the action log.
#[utoipa::path(post, path = "/v1/webhooks/deliveries/{endpoint}/requeue", tag = "operations",
    params(("endpoint" = String, Path)),
    responses((status = 200, description = "the dead deliveries put back in line (at most 1000 a call)", body = dto::RequeuedDeliveries)))]
pub async fn requeue_dead_deliveries(
    State(s): State<AppState>,
    auth: Auth<AdminRole>,
    Path(endpoint): Path<String>,
) -> ApiResult {
    id(JobKind::parse, &endpoint)?;
    tracing::info!(actor = %auth.actor, %endpoint, "requeue dead deliveries");
    let n = s.store.webhooks().requeue_dead(&endpoint, limits::PAGE_LIMIT_MAX, &auth.actor.name).await?;
    Ok(ok(dto::RequeuedDeliveries { requeued: n }))
}

/// Audit the ledger
///
/// Recomputes invariants L1–L9 from the stored rows: every balance is the sum of its entries, every
/// item's money state matches its entries, each account's hash chain is intact, every account's live
/// grants less its debt are its balance, no withdrawal left never-expiring credit below the debt
/// (the cash rule), and every event matches its transition. Answers `ok` and the violations found.
/// Admin only.
#[utoipa::path(get, path = "/v1/audit", tag = "operations", responses((status = 200, body = dto::Audit)))]
pub async fn audit(State(s): State<AppState>, _auth: Auth<AdminRole>) -> ApiResult {
    let r = s.store.audit(None).await?;
    Ok(ok(dto::Audit {
        ok: r.ok(),
        accounts_checked: r.accounts_checked,
        items_checked: r.items_checked,
        entries_checked: r.entries_checked,
        violations: r
            .violations
            .into_iter()
            .map(|v| dto::Violation {
                invariant: v.invariant.as_str().to_owned(),
                account_id: v.account_id,
                job_id: v.job_id,
                item_id: v.item_id,
                message: v.message,
            })
            .collect(),
    }))
}

/// Liveness
///
/// Answers `200` while the process serves requests; it does not touch the database.
#[utoipa::path(get, path = "/healthz", tag = "operations", responses((status = 200, body = dto::Health)))]
pub async fn healthz() -> Response {
    ok(dto::Health { status: "ok".into() })
}

/// Readiness
///
/// Answers `200` when the database takes writes — on PostgreSQL, the server Settle's connections
/// lead to is the primary — and events can be read; `503` otherwise (no primary answers, or one
/// answers as a standby).
#[utoipa::path(get, path = "/readyz", tag = "operations",
    responses((status = 200, body = dto::Health), (status = 503, body = ErrorBody)))]
pub async fn readyz(State(s): State<AppState>) -> ApiResult {
    s.store.ready().await?;
    s.store.events(0, 1, &settle_core::scope::Scope::ALL).await?;
    Ok(ok(dto::Health { status: "ready".into() }))
}

/// Prometheus metrics
///
/// Every family with its `# HELP`: requests by route and status and their latency, long-polls,
/// rate limiting, transitions, jobs by state, each kind's queue (depth, due now, how long the
/// oldest due job has waited), dead letters, each webhook endpoint's backlog and breaker, database
/// retries and PostgreSQL failovers, in the Prometheus text format. Answers while the database is
/// away (`settle_up 0`, the last gauges read). Open unless the server has a metrics token
/// (`SETTLE_METRICS_TOKEN`): then `401` without `Authorization: Bearer <it>`.
#[utoipa::path(get, path = "/metrics", tag = "operations",
    responses((status = 200, description = "Prometheus text format", content_type = "text/plain", body = String),
        (status = 401, body = ErrorBody)))]
pub async fn metrics(State(s): State<AppState>, headers: HeaderMap) -> ApiResult {
    s.tokens.authorize_metrics(&headers)?;
    // In memory, so they are there while the database is away.
    telemetry::read_connection_counters(&s);
    // One reader at a time, at most once per METRICS_REFRESH; the others render what is there.
    if let Ok(mut read_at) = s.gauges_read_at.try_lock()
        && read_at.is_none_or(|t| t.elapsed() >= crate::state::METRICS_REFRESH)
    {
        // A scrape while the database is away still answers, with the gauges it read last time
        // and `settle_up 0`: a failover is when an operator most needs the counters above.
        let up = telemetry::read_store_gauges(&s).await.is_ok();
        metrics::gauge!("settle_up").set(if up { 1.0 } else { 0.0 });
        *read_at = Some(std::time::Instant::now());
    }
    // One row per configured endpoint: cheap enough to be current on every scrape.
    telemetry::read_webhook_gauges(&s).await;
    let text = s.metrics.render();
    Ok(([(axum::http::header::CONTENT_TYPE, "text/plain; version=0.0.4")], text).into_response())
}
