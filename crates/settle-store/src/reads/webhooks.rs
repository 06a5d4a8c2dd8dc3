//! Webhook deliveries as operators read them: the list with filters, each endpoint's breaker and
//! backlog.

use crate::db::{Db, args, columns};
use crate::error::StoreError;
use crate::model::{BreakerState, BreakerStatus, Delivery, DeliveryFilter, Paged, WebhookBacklog};
use crate::ops::name;
use crate::ops::{DELIVERY_SELECT, delivery_from_row};
use settle_core::{Timestamp, limits};
use std::sync::LazyLock;

columns! {
    /// An endpoint's circuit breaker, as operators see it.
    BreakerCol { endpoint_id, state, failures, opens, probe_at }
}

columns! {
    /// An endpoint's undelivered deliveries, pending and dead.
    BacklogCol {
        endpoint_id,
        pending = "CAST(SUM(CASE WHEN state = 'pending' THEN 1 ELSE 0 END) AS bigint)",
        dead = "CAST(SUM(CASE WHEN state = 'dead' THEN 1 ELSE 0 END) AS bigint)",
        oldest = "MIN(CASE WHEN state = 'pending' THEN created_at END)",
    }
}

/// Every endpoint's breaker, by endpoint id.
pub(crate) async fn breakers(db: &mut Db<'_>) -> Result<Vec<BreakerStatus>, StoreError> {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM webhook_breakers ORDER BY endpoint_id", BreakerCol::LIST));
    let rows = db.all(&SQL, args![]).await?;
    rows.iter()
        .map(|r| {
            use BreakerCol as C;
            Ok(BreakerStatus {
                endpoint_id: r.text(C::endpoint_id)?,
                state: name(BreakerState::parse, "breaker state", r.text(C::state)?)?,
                failures: r.i64(C::failures)?,
                opens: r.i64(C::opens)?,
                next_probe_at: r.opt_i64(C::probe_at)?.map(Timestamp::from_micros),
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
    let mut sql = format!("{} WHERE d.event_seq > $1", *DELIVERY_SELECT);
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

/// Undelivered webhook deliveries by endpoint: how many wait, how many are dead, and since when the
/// oldest waits.
pub(crate) async fn webhook_backlog(db: &mut Db<'_>) -> Result<Vec<WebhookBacklog>, StoreError> {
    static SQL: LazyLock<String> = LazyLock::new(|| {
        format!(
            "SELECT {} FROM webhook_deliveries WHERE state <> 'delivered' GROUP BY endpoint_id ORDER BY endpoint_id",
            BacklogCol::LIST
        )
    });
    let rows = db.all(&SQL, args![]).await?;
    use BacklogCol as C;
    rows.iter()
        .map(|r| {
            Ok(WebhookBacklog {
                endpoint_id: r.text(C::endpoint_id)?,
                pending: r.i64(C::pending)?,
                dead: r.i64(C::dead)?,
                oldest_pending_at: r.opt_i64(C::oldest)?.map(Timestamp::from_micros),
            })
        })
        .collect()
}
