//! Top-ups as they are read: one by id, and the list with filters (a top-up is its job plus its
//! `top_ups` row).

use super::filter::{Kinds, names_accounts, rail_list_sql, scope_sql};
use crate::db::{Db, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, Cx};
use settle_core::job;
use settle_core::{Credits, limits};
use std::sync::LazyLock;

columns! {
    /// A `top_ups` row, as `TopUp` shows it beside its job.
    TopUpCol { credits, price, currency, customer, idempotency_key, provider_charge_id, rule_generation }
}

static TOP_UP_ROW: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM top_ups WHERE job_id = $1", TopUpCol::LIST));

async fn with_job(db: &mut Db<'_>, job: Job) -> Result<TopUp, StoreError> {
    use TopUpCol as C;
    let r = db
        .opt(&TOP_UP_ROW, args![&job.id])
        .await?
        .ok_or_else(|| StoreError::internal(format!("top-up job {} has no top-up row", job.id)))?;
    let provider_charge_id = r.opt_text(C::provider_charge_id)?;
    Ok(TopUp {
        credits: Credits::new(r.i64(C::credits)?),
        price: r.i64(C::price)?,
        currency: r.text(C::currency)?,
        customer: r.text(C::customer)?,
        idempotency_key: r.text(C::idempotency_key)?,
        // A confirmed charge and its grant are written in one transaction.
        grant_id: provider_charge_id.as_ref().map(|_| job.id.to_string()),
        provider_charge_id,
        rule: r.opt_i64(C::rule_generation)?.is_some(),
        job,
    })
}

pub(crate) async fn read_top_up(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Option<TopUp>, StoreError> {
    match ops::read_job(db, cx, id).await? {
        Some(job) if job.kind.as_str() == job::TOP_UP_KIND => Ok(Some(with_job(db, job).await?)),
        _ => Ok(None),
    }
}

pub(crate) async fn must_read_top_up(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<TopUp, StoreError> {
    read_top_up(db, cx, id).await?.ok_or_else(|| StoreError::not_found("top-up", id))
}

/// Top-ups in creation order after `page.after` (a job sequence number).
pub(crate) async fn top_ups(
    db: &mut Db<'_>,
    cx: &Cx,
    filter: &TopUpFilter,
    page: Page,
) -> Result<Paged<TopUp>, StoreError> {
    let limit = page.limit.clamp(1, limits::PAGE_LIMIT_MAX);
    let by_account = names_accounts(filter.account_id.as_ref(), &filter.scope);
    let mut sql = rail_list_sql(db.engine(), job::TOP_UP_KIND, filter.state, by_account);
    let mut a: Vec<Value> = vec![page.after.into()];
    if let Some(acc) = &filter.account_id {
        a.push(acc.as_str().into());
        sql.push_str(&format!(" AND account_id = ${}", a.len()));
    }
    if let Some(since) = filter.updated_since {
        a.push(since.micros().into());
        sql.push_str(&format!(" AND updated_at >= ${}", a.len()));
    }
    sql.push_str(&scope_sql(&filter.scope, &mut a, "account_id", Kinds::Column("kind")));
    a.push(i64::from(limit).into());
    sql.push_str(&format!(" ORDER BY job_seq LIMIT ${}", a.len()));
    let rows = db.all_built(sql, &a).await?;
    let mut out = Vec::with_capacity(rows.len());
    let mut last = None;
    for r in &rows {
        let row = ops::job_row(r)?;
        last = Some(row.job_seq);
        let job = ops::attach(db, cx, row).await?;
        out.push(with_job(db, job).await?);
    }
    let next_after = if out.len() as u32 == limit { last } else { None };
    Ok(Paged { rows: out, next_after })
}
