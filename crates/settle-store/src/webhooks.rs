//! Webhook delivery bookkeeping (docs/design/webhooks.md): fan-out of outbox events to an
//! endpoint's deliveries, claims with leases (head of line per job), guarded reports, requeue.
//! Sending happens outside any transaction, in settle-worker.

use crate::db::{Db, Engine, Row, args};
use crate::error::StoreError;
use crate::model::{Delivery, DeliveryFilter, DeliveryReport, Event, LeaseToken, Paged};
use crate::ops::Cx;
use settle_core::Timestamp;
use settle_core::limits;

fn event_from_row(r: &Row, at: usize) -> Result<Event, StoreError> {
    Ok(Event {
        seq: r.i64(at)?,
        kind: r.text(at + 1)?,
        job_id: r.opt_text(at + 2)?,
        account_id: r.text(at + 3)?,
        data: r.text(at + 4)?,
        created_at: Timestamp::from_micros(r.i64(at + 5)?),
    })
}

const DELIVERY_SELECT: &str = "SELECT d.endpoint_id, d.state, d.attempts, d.next_attempt_at, d.last_status, d.last_error, \
     d.delivered_at, o.seq, o.type, o.job_id, o.account_id, o.data, o.created_at \
     FROM webhook_deliveries d JOIN outbox o ON o.seq = d.event_seq";

fn delivery_from_row(r: &Row) -> Result<Delivery, StoreError> {
    Ok(Delivery {
        endpoint_id: r.text(0)?,
        state: r.text(1)?,
        attempts: u32::try_from(r.i64(2)?).map_err(StoreError::internal)?,
        next_attempt_at: Timestamp::from_micros(r.i64(3)?),
        last_status: r.opt_i64(4)?.map(|s| s as u16),
        last_error: r.opt_text(5)?,
        delivered_at: r.opt_i64(6)?.map(Timestamp::from_micros),
        event: event_from_row(r, 7)?,
        lease_token: None,
    })
}

/// Begins an endpoint: its cursor at 0 (`Beginning`) or after the newest event (`Now`), unless it
/// has one already. Returns whether it began now.
pub(crate) async fn start(db: &mut Db<'_>, endpoint: &str, from: crate::model::StartFrom) -> Result<bool, StoreError> {
    let sql = match from {
        crate::model::StartFrom::Beginning => {
            "INSERT INTO webhook_cursors (endpoint_id, last_seq) VALUES ($1, 0) ON CONFLICT DO NOTHING"
        }
        crate::model::StartFrom::Now => {
            "INSERT INTO webhook_cursors (endpoint_id, last_seq) \
             SELECT $1, COALESCE(MAX(seq), 0) FROM outbox WHERE true ON CONFLICT DO NOTHING"
        }
    };
    Ok(db.exec(sql, args![endpoint]).await? == 1)
}

/// Puts up to `limit` dead deliveries of `endpoint` back in line with a fresh attempt budget;
/// returns how many.
pub(crate) async fn requeue_dead(db: &mut Db<'_>, cx: &Cx, endpoint: &str, limit: u32) -> Result<u64, StoreError> {
    Ok(db.exec(
        "UPDATE webhook_deliveries SET state = 'pending', attempts = 0, next_attempt_at = $2, lease_token = NULL, \
         lease_expires_at = NULL, updated_at = $2 WHERE endpoint_id = $1 AND state = 'dead' AND event_seq IN \
         (SELECT event_seq FROM webhook_deliveries WHERE endpoint_id = $1 AND state = 'dead' ORDER BY event_seq LIMIT $3)",
        args![endpoint, cx.now.micros(), i64::from(limit.clamp(1, limits::PAGE_LIMIT_MAX))],
    )
    .await?)
}

/// Deletes up to `limit` of `endpoint`'s delivered rows delivered before `before` (the fan-out
/// cursor is kept apart, so nothing is delivered again); returns how many.
pub(crate) async fn prune(db: &mut Db<'_>, endpoint: &str, before: Timestamp, limit: u32) -> Result<u64, StoreError> {
    Ok(db
        .exec(
            "DELETE FROM webhook_deliveries WHERE endpoint_id = $1 AND state = 'delivered' AND event_seq IN \
             (SELECT event_seq FROM webhook_deliveries WHERE endpoint_id = $1 AND state = 'delivered' \
              AND delivered_at < $2 ORDER BY event_seq LIMIT $3)",
            args![endpoint, before.micros(), i64::from(limit.clamp(1, limits::PAGE_LIMIT_MAX))],
        )
        .await?)
}

/// Creates the deliveries of the next outbox events for `endpoint`. Advances only through a
/// contiguous run of sequence numbers, so no event is ever skipped. Returns how many it created.
pub(crate) async fn fan_out(db: &mut Db<'_>, cx: &Cx, endpoint: &str, batch: u32) -> Result<u64, StoreError> {
    db.exec(
        "INSERT INTO webhook_cursors (endpoint_id, last_seq) VALUES ($1, 0) ON CONFLICT DO NOTHING",
        args![endpoint],
    )
    .await?;
    // Another process fanning out this endpoint right now: leave it to them.
    let lock = match db.engine() {
        Engine::Sqlite => "SELECT last_seq FROM webhook_cursors WHERE endpoint_id = $1",
        Engine::Postgres => "SELECT last_seq FROM webhook_cursors WHERE endpoint_id = $1 FOR UPDATE SKIP LOCKED",
    };
    let Some(row) = db.opt(lock, args![endpoint]).await? else { return Ok(0) };
    let old = row.i64(0)?;
    let rows = db
        .all(
            "SELECT seq, COALESCE(job_id, 'account:' || account_id) FROM outbox WHERE seq > $1 ORDER BY seq LIMIT $2",
            args![old, i64::from(batch.clamp(1, limits::PAGE_LIMIT_MAX))],
        )
        .await?;
    let mut last = old;
    let mut created = 0;
    for r in &rows {
        let (seq, key) = (r.i64(0)?, r.text(1)?);
        if seq != last + 1 {
            // Outbox seqs come from the locked counter row, so commit order is seq order and a gap
            // means rows are missing: stop rather than skip an event, and say so.
            tracing::error!(
                endpoint,
                after = last,
                next = seq,
                "gap in the outbox sequence; webhook fan-out stops here"
            );
            break;
        }
        created += db
            .exec(
                "INSERT INTO webhook_deliveries (endpoint_id, event_seq, order_key, state, attempts, next_attempt_at, \
                 created_at, updated_at) VALUES ($1, $2, $3, 'pending', 0, $4, $4, $4) ON CONFLICT DO NOTHING",
                args![endpoint, seq, key, cx.now.micros()],
            )
            .await?;
        last = seq;
    }
    if last != old {
        let moved = db
            .exec(
                "UPDATE webhook_cursors SET last_seq = $3 WHERE endpoint_id = $1 AND last_seq = $2",
                args![endpoint, old, last],
            )
            .await?;
        if moved != 1 {
            return Err(StoreError::Retryable("webhook cursor moved concurrently".into()));
        }
    }
    Ok(created)
}

/// The claim statement; `$lock` is empty on SQLite (the single writer serialises) and
/// `FOR UPDATE SKIP LOCKED` on PostgreSQL. The guard is repeated in the outer WHERE either way.
macro_rules! claim_sql {
    ($lock:literal) => {
        concat!(
            "UPDATE webhook_deliveries SET lease_token = $3, lease_expires_at = $4, attempts = attempts + 1, updated_at = $2 \
             WHERE endpoint_id = $1 AND event_seq = ( \
                SELECT d.event_seq FROM webhook_deliveries d \
                WHERE d.endpoint_id = $1 AND d.state = 'pending' AND d.next_attempt_at <= $2 \
                  AND (d.lease_expires_at IS NULL OR d.lease_expires_at <= $2) \
                  AND NOT EXISTS (SELECT 1 FROM webhook_deliveries e WHERE e.endpoint_id = d.endpoint_id \
                                  AND e.order_key = d.order_key AND e.event_seq < d.event_seq AND e.state <> 'delivered') \
                ORDER BY d.event_seq LIMIT 1 ",
            $lock,
            ") AND state = 'pending' AND next_attempt_at <= $2 AND (lease_expires_at IS NULL OR lease_expires_at <= $2) \
             RETURNING event_seq, attempts"
        )
    };
}
const CLAIM_SQLITE: &str = claim_sql!("");
const CLAIM_PG: &str = claim_sql!("FOR UPDATE SKIP LOCKED");

/// Leases up to `limit` deliveries that are due and at the head of their job's line. An attempt is
/// counted when it is claimed, so a delivery whose sender keeps dying still reaches `attempts_max`.
pub(crate) async fn claim(
    db: &mut Db<'_>,
    cx: &Cx,
    endpoint: &str,
    limit: u32,
    lease_ms: u64,
    attempts_max: u32,
) -> Result<Vec<Delivery>, StoreError> {
    db.exec(
        "UPDATE webhook_deliveries SET state = 'dead', last_error = COALESCE(last_error, 'the sender stopped mid-send'), \
         lease_token = NULL, lease_expires_at = NULL, updated_at = $2 \
         WHERE endpoint_id = $1 AND state = 'pending' AND attempts >= $3 AND (lease_expires_at IS NULL OR lease_expires_at <= $2)",
        args![endpoint, cx.now.micros(), i64::from(attempts_max)],
    )
    .await?;
    let sql = match db.engine() {
        Engine::Sqlite => CLAIM_SQLITE,
        Engine::Postgres => CLAIM_PG,
    };
    let expires = cx.now.plus_millis(lease_ms).micros();
    let mut out = Vec::new();
    for _ in 0..limit.min(limits::CLAIM_LIMIT_MAX) {
        let token = uuid::Uuid::new_v4().to_string();
        let Some(row) = db.opt(sql, args![endpoint, cx.now.micros(), &token, expires]).await? else { break };
        let seq = row.i64(0)?;
        let r = db.one(SELECT_ONE, args![endpoint, seq]).await?;
        let mut d = delivery_from_row(&r)?;
        d.lease_token = Some(LeaseToken(token));
        out.push(d);
    }
    Ok(out)
}

const SELECT_ONE: &str = "SELECT d.endpoint_id, d.state, d.attempts, d.next_attempt_at, d.last_status, d.last_error, \
     d.delivered_at, o.seq, o.type, o.job_id, o.account_id, o.data, o.created_at \
     FROM webhook_deliveries d JOIN outbox o ON o.seq = d.event_seq WHERE d.endpoint_id = $1 AND d.event_seq = $2";

/// Records a send's outcome, guarded by the lease: a report from a lost lease changes nothing.
pub(crate) async fn report(
    db: &mut Db<'_>,
    cx: &Cx,
    endpoint: &str,
    seq: i64,
    token: &LeaseToken,
    report: &DeliveryReport,
) -> Result<bool, StoreError> {
    let rows = match report {
        DeliveryReport::Delivered { status } => {
            db.exec(
                "UPDATE webhook_deliveries SET state = 'delivered', delivered_at = $4, \
                 last_status = $5, last_error = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = $4 \
                 WHERE endpoint_id = $1 AND event_seq = $2 AND lease_token = $3 AND state = 'pending'",
                args![endpoint, seq, &token.0, cx.now.micros(), i64::from(*status)],
            )
            .await?
        }
        DeliveryReport::Failed { status, error, retry_at, attempts_max } => {
            db.exec(
                "UPDATE webhook_deliveries SET \
                 state = CASE WHEN attempts >= $7 THEN 'dead' ELSE 'pending' END, \
                 next_attempt_at = $5, last_status = $6, last_error = $8, lease_token = NULL, lease_expires_at = NULL, \
                 updated_at = $4 WHERE endpoint_id = $1 AND event_seq = $2 AND lease_token = $3 AND state = 'pending'",
                args![
                    endpoint,
                    seq,
                    &token.0,
                    cx.now.micros(),
                    retry_at.micros(),
                    status.map(i64::from),
                    i64::from(*attempts_max),
                    error.chars().take(limits::MESSAGE_LEN_MAX).collect::<String>()
                ],
            )
            .await?
        }
    };
    Ok(rows == 1)
}

pub(crate) async fn requeue(db: &mut Db<'_>, cx: &Cx, endpoint: &str, seq: i64) -> Result<Delivery, StoreError> {
    let rows = db
        .exec(
            "UPDATE webhook_deliveries SET state = 'pending', attempts = 0, next_attempt_at = $3, lease_token = NULL, \
             lease_expires_at = NULL, updated_at = $3 WHERE endpoint_id = $1 AND event_seq = $2 AND state = 'dead'",
            args![endpoint, seq, cx.now.micros()],
        )
        .await?;
    let row = db
        .opt(SELECT_ONE, args![endpoint, seq])
        .await?
        .ok_or_else(|| StoreError::not_found("delivery", format!("{endpoint}/{seq}")))?;
    let d = delivery_from_row(&row)?;
    if rows == 0 && d.state != "pending" {
        return Err(StoreError::InvalidTransition {
            job: format!("{endpoint}/{seq}"),
            action: "be requeued",
            state: d.state,
        });
    }
    Ok(d)
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
