//! Withdrawals as they are read: one by id, and the list with filters (a withdrawal is its job
//! plus its `withdrawals` row).

use super::filter::{Kinds, names_accounts, rail_list_sql, scope_sql};
use crate::db::{Db, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, Cx};
use settle_core::job;
use settle_core::{Credits, Timestamp, limits};
use std::sync::LazyLock;

columns! {
    /// A `withdrawals` row, as `Withdrawal` shows it beside its job.
    WithdrawalCol { destination, amount, idempotency_key, provider_txid, returned_at }
}

static WITHDRAWAL_ROW: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM withdrawals WHERE job_id = $1", WithdrawalCol::LIST));

async fn with_job(db: &mut Db<'_>, job: Job) -> Result<Withdrawal, StoreError> {
    use WithdrawalCol as C;
    let r = db
        .opt(&WITHDRAWAL_ROW, args![&job.id])
        .await?
        .ok_or_else(|| StoreError::internal(format!("withdrawal job {} has no withdrawal row", job.id)))?;
    Ok(Withdrawal {
        destination: r.text(C::destination)?,
        amount: Credits::new(r.i64(C::amount)?),
        idempotency_key: r.text(C::idempotency_key)?,
        provider_txid: r.opt_text(C::provider_txid)?,
        returned_at: r.opt_i64(C::returned_at)?.map(Timestamp::from_micros),
        job,
    })
}

pub(crate) async fn read_withdrawal(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Option<Withdrawal>, StoreError> {
    match ops::read_job(db, cx, id).await? {
        Some(job) if job.kind.as_str() == job::WITHDRAWAL_KIND => Ok(Some(with_job(db, job).await?)),
        _ => Ok(None),
    }
}

pub(crate) async fn must_read_withdrawal(db: &mut Db<'_>, cx: &Cx, id: &str) -> Result<Withdrawal, StoreError> {
    read_withdrawal(db, cx, id).await?.ok_or_else(|| StoreError::not_found("withdrawal", id))
}

/// Withdrawals in creation order after `page.after` (a job sequence number).
pub(crate) async fn withdrawals(
    db: &mut Db<'_>,
    cx: &Cx,
    filter: &WithdrawalFilter,
    page: Page,
) -> Result<Paged<Withdrawal>, StoreError> {
    let limit = page.limit.clamp(1, limits::PAGE_LIMIT_MAX);
    let by_account = names_accounts(filter.account_id.as_ref(), &filter.scope);
    let mut sql = rail_list_sql(db.engine(), job::WITHDRAWAL_KIND, filter.state, by_account);
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
