//! Webhook deliveries as operators read them: the list with filters, each endpoint's breaker and
//! backlog.

use crate::db::{Db, args};
use crate::error::StoreError;
use crate::model::{BreakerState, BreakerStatus, Delivery, DeliveryFilter, Paged};
use crate::ops::name;
use crate::ops::{DELIVERY_SELECT, delivery_from_row};
use settle_core::{Timestamp, limits};

/// Every endpoint's breaker, by endpoint id.
pub(crate) async fn breakers(db: &mut Db<'_>) -> Result<Vec<BreakerStatus>, StoreError> {
    let rows = db
        .all("SELECT endpoint_id, state, failures, opens, probe_at FROM webhook_breakers ORDER BY endpoint_id", args![])
        .await?;
    rows.iter()
        .map(|r| {
            Ok(BreakerStatus {
                endpoint_id: r.text(0)?,
                state: name(BreakerState::parse, "breaker state", r.text(1)?)?,
                failures: r.i64(2)?,
                opens: r.i64(3)?,
                next_probe_at: r.opt_i64(4)?.map(Timestamp::from_micros),
            })
        })
        .collect()
}

pub(crate) async fn list(
    db: &mut Db<'_>,
    filter: &DeliveryFilter,
    after: i64,
    limit: u32,
) -> Result<Paged<Delivery>, StoreError> {
    let limit = i64::from(limit.clamp(1, limits::PAGE_LIMIT_MAX));
    let mut sql = format!("{DELIVERY_SELECT} WHERE d.event_seq > $1");
    let mut a: Vec<crate::db::Value> = vec![after.into()];
    if let Some(e) = &filter.endpoint_id {
        a.push(e.as_str().into());
        sql.push_str(&format!(" AND d.endpoint_id = ${}", a.len()));
    }
    if let Some(s) = &filter.state {
        a.push(s.as_str().into());
        sql.push_str(&format!(" AND d.state = ${}", a.len()));
    }
    a.push(limit.into());
    sql.push_str(&format!(" ORDER BY d.event_seq, d.endpoint_id LIMIT ${}", a.len()));
    let rows = db.all_built(sql, &a).await?;
    let mut out = rows.iter().map(delivery_from_row).collect::<Result<Vec<_>, _>>()?;
    // The cursor is an event seq: a full page ends on a whole seq, so no endpoint's delivery of
    // the last seq is skipped (unless one seq alone fills the page).
    let next = if out.len() as i64 == limit {
        let last = out.last().map(|d| d.event.seq).unwrap_or(after);
        if out.first().is_some_and(|d| d.event.seq != last) {
            out.retain(|d| d.event.seq != last);
            Some(last - 1)
        } else {
            Some(last)
        }
    } else {
        None
    };
    Ok(Paged { rows: out, next_after: next })
}

/// Undelivered webhook deliveries by endpoint: (endpoint, pending, dead).
pub(crate) async fn webhook_backlog(db: &mut Db<'_>) -> Result<Vec<(String, i64, i64)>, StoreError> {
    let rows = db
        .all(
            "SELECT endpoint_id, \
             CAST(SUM(CASE WHEN state = 'pending' THEN 1 ELSE 0 END) AS bigint), \
             CAST(SUM(CASE WHEN state = 'dead' THEN 1 ELSE 0 END) AS bigint) \
             FROM webhook_deliveries WHERE state <> 'delivered' GROUP BY endpoint_id ORDER BY endpoint_id",
            args![],
        )
        .await?;
    rows.iter().map(|r| Ok((r.text(0)?, r.i64(1)?, r.i64(2)?))).collect()
}
