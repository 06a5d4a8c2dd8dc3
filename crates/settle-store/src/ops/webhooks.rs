//! Webhook delivery bookkeeping (docs/design/webhooks.md): fan-out of outbox events to an
//! endpoint's deliveries, claims with leases (head of line per job), guarded reports, requeue and
//! the circuit breaker. Sending happens outside any transaction, in settle-worker; the reads
//! (deliveries, breakers, backlogs) are in `reads::webhooks`.

use super::Cx;
use super::rows::{DELIVERY_SELECT, delivery_from_row};
use crate::db::{Db, Engine, args, columns};
use crate::error::StoreError;
use crate::model::{BreakerPolicy, BreakerState, BreakerStatus, Delivery, DeliveryReport, DeliveryState, LeaseToken};
use settle_core::Timestamp;
use settle_core::crash::CrashPoint;
use settle_core::limits;
use std::sync::LazyLock;

columns! {
    /// How far an endpoint's deliveries have been fanned out (an outbox seq).
    CursorCol { last_seq }
}

columns! {
    /// An outbox event to fan out, and the line its deliveries keep their order in (its job, or
    /// its account for an account's own events). The two kinds of line never meet: each key starts
    /// with its kind and a space, which no id holds (a job named `account:acme` once joined the
    /// account `acme`'s line: issue 41).
    FanOutCol {
        seq = "n.first_seq + e.pos - 1",
        order_key = "CASE WHEN e.job_id IS NULL THEN 'account ' || e.account_id ELSE 'job ' || e.job_id END",
    }
}

columns! {
    /// A breaker that is not closed, and the seq of its last probe.
    OpenBreakerCol { state, probe_seq }
}

columns! {
    /// A delivery just leased.
    ClaimedCol { event_seq, attempts }
}

columns! {
    /// A breaker as a failed send moves it.
    BreakerLockCol { state, failures, opens, probe_token }
}

static CURSOR_SQLITE: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM webhook_cursors WHERE endpoint_id = $1", CursorCol::LIST));
static CURSOR_PG: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM webhook_cursors WHERE endpoint_id = $1 FOR UPDATE SKIP LOCKED", CursorCol::LIST)
});
static FAN_OUT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM {} WHERE n.last_seq > $1 AND n.last_seq <= $2 AND e.pos > $1 - n.first_seq + 1 \
         ORDER BY n.last_seq, e.pos LIMIT $3",
        FanOutCol::LIST,
        super::EVENTS
    )
});
static OPEN_BREAKER: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM webhook_breakers WHERE endpoint_id = $1 AND state <> 'closed'", OpenBreakerCol::LIST)
});
static BREAKER_SQLITE: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM webhook_breakers WHERE endpoint_id = $1", BreakerLockCol::LIST));
static BREAKER_PG: LazyLock<String> = LazyLock::new(|| {
    format!("SELECT {} FROM webhook_breakers WHERE endpoint_id = $1 FOR UPDATE", BreakerLockCol::LIST)
});

/// Begins an endpoint: its cursor at 0 (`Beginning`) or after the newest event (`Now`), unless it
/// has one already. Returns whether it began now.
pub(crate) async fn start(
    db: &mut Db<'_>,
    cx: &Cx,
    endpoint: &str,
    from: crate::model::StartFrom,
) -> Result<bool, StoreError> {
    let sql = match from {
        crate::model::StartFrom::Beginning => {
            "INSERT INTO webhook_cursors (endpoint_id, last_seq) VALUES ($1, 0) ON CONFLICT DO NOTHING"
        }
        crate::model::StartFrom::Now => {
            "INSERT INTO webhook_cursors (endpoint_id, last_seq) \
             SELECT $1, COALESCE(MAX(last_seq), 0) FROM stamp_numbers WHERE true ON CONFLICT DO NOTHING"
        }
    };
    let began = db.exec(sql, args![endpoint]).await? == 1;
    ensure_breaker(db, endpoint, cx.now).await?;
    Ok(began)
}

/// Makes the endpoint's breaker row (closed) unless it exists, so every locking read finds a row.
async fn ensure_breaker(db: &mut Db<'_>, endpoint: &str, now: Timestamp) -> Result<(), StoreError> {
    db.exec(
        "INSERT INTO webhook_breakers (endpoint_id, state, failures, opens, changed_at) \
         VALUES ($1, 'closed', 0, 0, $2) ON CONFLICT DO NOTHING",
        args![endpoint, now.micros()],
    )
    .await?;
    Ok(())
}

/// Puts up to `limit` dead deliveries of `endpoint` back in line with a fresh attempt budget;
/// returns how many.
pub(crate) async fn requeue_dead(db: &mut Db<'_>, cx: &Cx, endpoint: &str, limit: u32) -> Result<u64, StoreError> {
    db.exec(
        "UPDATE webhook_deliveries SET state = 'pending', attempts = 0, next_attempt_at = $2, lease_token = NULL, \
         lease_expires_at = NULL, updated_at = $2 WHERE endpoint_id = $1 AND state = 'dead' AND event_seq IN \
         (SELECT event_seq FROM webhook_deliveries WHERE endpoint_id = $1 AND state = 'dead' ORDER BY event_seq LIMIT $3)",
        args![endpoint, cx.now.micros(), i64::from(limit.clamp(1, limits::PAGE_LIMIT_MAX))],
    )
    .await
}

/// Deletes up to `limit` of `endpoint`'s delivered rows delivered before `before` (the fan-out
/// cursor is kept apart, so nothing is delivered again); returns how many.
pub(crate) async fn prune(db: &mut Db<'_>, endpoint: &str, before: Timestamp, limit: u32) -> Result<u64, StoreError> {
    db.exec(
        "DELETE FROM webhook_deliveries WHERE endpoint_id = $1 AND state = 'delivered' AND event_seq IN \
         (SELECT event_seq FROM webhook_deliveries WHERE endpoint_id = $1 AND state = 'delivered' \
          AND delivered_at < $2 ORDER BY event_seq LIMIT $3)",
        args![endpoint, before.micros(), i64::from(limit.clamp(1, limits::PAGE_LIMIT_MAX))],
    )
    .await
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
        Engine::Sqlite => &*CURSOR_SQLITE,
        Engine::Postgres => &*CURSOR_PG,
    };
    let Some(row) = db.opt(lock, args![endpoint]).await? else { return Ok(0) };
    let old = row.i64(CursorCol::last_seq)?;
    let want = i64::from(batch.clamp(1, limits::PAGE_LIMIT_MAX));
    let Some(through) = super::read_through(db, old, i64::MAX, want).await? else {
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok(0);
    };
    let rows = db.all(&FAN_OUT, args![old, through, want]).await?;
    let mut last = old;
    let mut created = 0;
    for r in &rows {
        let (seq, key) = (r.i64(FanOutCol::seq)?, r.text(FanOutCol::order_key)?);
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
    cx.point(CrashPoint::BeforeCommit)?;
    Ok(created)
}

/// The claim statement; `lock` is empty on SQLite (the single writer serialises) and
/// `FOR UPDATE SKIP LOCKED` on PostgreSQL. The guard is repeated in the outer WHERE either way.
/// The claim statement. With `head_of_line`, a delivery is claimed only when every earlier delivery
/// of its line (the same endpoint and `order_key`) was delivered; without it (the simulator's
/// broken-guard test only) any due delivery is.
fn claim_sql(lock: &str, head_of_line: bool) -> String {
    let guard = if head_of_line {
        "AND NOT EXISTS (SELECT 1 FROM webhook_deliveries e WHERE e.endpoint_id = d.endpoint_id \
         AND e.order_key = d.order_key AND e.event_seq < d.event_seq AND e.state <> 'delivered') "
    } else {
        ""
    };
    format!(
        "UPDATE webhook_deliveries SET lease_token = $3, lease_expires_at = $4, attempts = attempts + 1, updated_at = $2 \
         WHERE endpoint_id = $1 AND event_seq = ( \
            SELECT d.event_seq FROM webhook_deliveries d \
            WHERE d.endpoint_id = $1 AND d.state = 'pending' AND d.next_attempt_at <= $2 AND d.event_seq > $5 \
              AND (d.lease_expires_at IS NULL OR d.lease_expires_at <= $2) {guard}\
            ORDER BY d.event_seq LIMIT 1 {lock}) \
         AND state = 'pending' AND next_attempt_at <= $2 AND (lease_expires_at IS NULL OR lease_expires_at <= $2) \
         RETURNING {}",
        ClaimedCol::LIST
    )
}

static CLAIM_SQLITE: LazyLock<String> = LazyLock::new(|| claim_sql("", true));

static CLAIM_PG: LazyLock<String> = LazyLock::new(|| claim_sql("FOR UPDATE SKIP LOCKED", true));

static CLAIM_ANY_ORDER: LazyLock<String> = LazyLock::new(|| claim_sql("", false));

/// Leases up to `limit` deliveries that are due and at the head of their job's line. An attempt is
/// counted when it is claimed, so a delivery whose sender keeps dying still reaches `attempts_max`.
/// While the endpoint's breaker is open nothing is claimed but, when due, one probe.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn claim(
    db: &mut Db<'_>,
    cx: &Cx,
    endpoint: &str,
    limit: u32,
    lease_ms: u64,
    attempts_max: u32,
    breaker: BreakerPolicy,
) -> Result<Vec<Delivery>, StoreError> {
    // Delivery rows before the breaker row, on every path (docs/design/webhooks.md).
    db.exec(
        "UPDATE webhook_deliveries SET state = 'dead', last_error = COALESCE(last_error, 'the sender stopped mid-send'), \
         lease_token = NULL, lease_expires_at = NULL, updated_at = $2 \
         WHERE endpoint_id = $1 AND state = 'pending' AND attempts >= $3 AND (lease_expires_at IS NULL OR lease_expires_at <= $2)",
        args![endpoint, cx.now.micros(), i64::from(attempts_max)],
    )
    .await?;
    let expires = cx.now.plus_millis(lease_ms);
    let open = if breaker.enabled() { db.opt(&OPEN_BREAKER, args![endpoint]).await? } else { None };
    let Some(row) = open else {
        let mut out = Vec::new();
        for _ in 0..limit.min(limits::CLAIM_LIMIT_MAX) {
            let Some(d) = claim_one(db, cx, endpoint, &new_token(cx), expires, 0).await? else { break };
            out.push(d);
        }
        cx.point(CrashPoint::BeforeCommit)?;
        return Ok(out);
    };
    // Open or half-open: at most one probe, taken with a guarded write so only one process gets it.
    // A `probe_at` further away than the longest pause is due anyway (a clock that ran ahead).
    let token = new_token(cx);
    let took = db
        .exec(
            "UPDATE webhook_breakers SET state = 'half_open', probe_token = $3, probe_expires_at = $4 \
             WHERE endpoint_id = $1 AND ( \
               (state = 'open' AND (probe_at IS NULL OR probe_at <= $2 OR probe_at > $5)) \
               OR (state = 'half_open' AND (probe_expires_at IS NULL OR probe_expires_at <= $2)))",
            args![
                endpoint,
                cx.now.micros(),
                &token.0,
                expires.micros(),
                cx.now.plus_millis(breaker.open_ms_max.max(breaker.open_ms)).micros()
            ],
        )
        .await?;
    if took == 0 {
        return Ok(Vec::new());
    }
    // Probes rotate through the due deliveries: the next one after the last probe, wrapping round.
    let after = row.opt_i64(OpenBreakerCol::probe_seq)?.unwrap_or(0);
    let mut probe = claim_one(db, cx, endpoint, &token, expires, after).await?;
    if probe.is_none() && after > 0 {
        probe = claim_one(db, cx, endpoint, &token, expires, 0).await?;
    }
    match &probe {
        Some(d) => {
            db.exec("UPDATE webhook_breakers SET probe_seq = $2 WHERE endpoint_id = $1", args![endpoint, d.event.seq])
                .await?;
            tracing::info!(endpoint, seq = d.event.seq, "webhook breaker half-open: sending one probe");
        }
        None => {
            db.exec(
                "UPDATE webhook_breakers SET state = 'open', probe_token = NULL, probe_expires_at = NULL \
                 WHERE endpoint_id = $1 AND probe_token = $2",
                args![endpoint, &token.0],
            )
            .await?;
        }
    }
    Ok(probe.into_iter().collect())
}

fn new_token(cx: &Cx) -> LeaseToken {
    LeaseToken(cx.token().to_string())
}

/// Leases the first due delivery at the head of its line with `event_seq > after`.
async fn claim_one(
    db: &mut Db<'_>,
    cx: &Cx,
    endpoint: &str,
    token: &LeaseToken,
    expires: Timestamp,
    after: i64,
) -> Result<Option<Delivery>, StoreError> {
    let sql = match db.engine() {
        Engine::Sqlite if cx.broken(crate::broken::Guard::WebhookOrder) => &*CLAIM_ANY_ORDER,
        Engine::Sqlite => &*CLAIM_SQLITE,
        Engine::Postgres => &*CLAIM_PG,
    };
    let Some(row) = db.opt(sql, args![endpoint, cx.now.micros(), &token.0, expires.micros(), after]).await? else {
        return Ok(None);
    };
    cx.point(CrashPoint::AfterGuard)?;
    let seq = row.i64(ClaimedCol::event_seq)?;
    let r = db.one(&SELECT_ONE, args![endpoint, seq]).await?;
    let mut d = delivery_from_row(&r)?;
    d.lease_token = Some(token.clone());
    Ok(Some(d))
}

static SELECT_ONE: LazyLock<String> =
    LazyLock::new(|| format!("{} WHERE d.endpoint_id = $1 AND d.event_seq = $2", *DELIVERY_SELECT));

/// Records a send's outcome, guarded by the lease: a report from a lost lease changes nothing,
/// the breaker included.
#[allow(clippy::too_many_arguments)]
pub(crate) async fn report(
    db: &mut Db<'_>,
    cx: &Cx,
    endpoint: &str,
    seq: i64,
    token: &LeaseToken,
    report: &DeliveryReport,
    breaker: BreakerPolicy,
) -> Result<bool, StoreError> {
    match report {
        DeliveryReport::Delivered { status } => {
            let rows = db
                .exec(
                    "UPDATE webhook_deliveries SET state = 'delivered', delivered_at = $4, \
                     last_status = $5, last_error = NULL, lease_token = NULL, lease_expires_at = NULL, updated_at = $4 \
                     WHERE endpoint_id = $1 AND event_seq = $2 AND lease_token = $3 AND state = 'pending'",
                    args![endpoint, seq, &token.0, cx.now.micros(), i64::from(*status)],
                )
                .await?;
            cx.point(CrashPoint::AfterGuard)?;
            if rows == 1 && close_breaker(db, cx, endpoint).await? {
                tracing::debug!(
                    endpoint,
                    seq,
                    "webhook breaker closed (or its failure count cleared) by a delivered send"
                );
            }
            cx.point(CrashPoint::BeforeCommit)?;
            Ok(rows == 1)
        }
        DeliveryReport::Failed { status, error, retry_at, attempts_max } => {
            // A probe tests the endpoint, not the delivery: a failed probe gives its attempt back.
            let probe = breaker.enabled()
                && db
                    .opt(
                        "SELECT 1 FROM webhook_breakers WHERE endpoint_id = $1 AND state = 'half_open' AND probe_token = $2",
                        args![endpoint, &token.0],
                    )
                    .await?
                    .is_some();
            let rows = db
                .exec(
                    "UPDATE webhook_deliveries SET \
                     state = CASE WHEN attempts - $9 >= $7 THEN 'dead' ELSE 'pending' END, attempts = attempts - $9, \
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
                        error.chars().take(limits::MESSAGE_LEN_MAX).collect::<String>(),
                        i64::from(probe)
                    ],
                )
                .await?;
            cx.point(CrashPoint::AfterGuard)?;
            if rows == 1 {
                if breaker.enabled() {
                    breaker_failed(db, cx, endpoint, token, breaker).await?;
                } else {
                    close_breaker(db, cx, endpoint).await?;
                }
            }
            cx.point(CrashPoint::BeforeCommit)?;
            Ok(rows == 1)
        }
    }
}

/// A success (or no breaker configured): closed, counters and probe cleared. Writes nothing, and
/// so locks nothing, while the endpoint is healthy.
async fn close_breaker(db: &mut Db<'_>, cx: &Cx, endpoint: &str) -> Result<bool, StoreError> {
    let rows = db
        .exec(
            "UPDATE webhook_breakers SET state = 'closed', failures = 0, opens = 0, probe_at = NULL, probe_seq = NULL, \
             probe_token = NULL, probe_expires_at = NULL, changed_at = $2 \
             WHERE endpoint_id = $1 AND (state <> 'closed' OR failures <> 0)",
            args![endpoint, cx.now.micros()],
        )
        .await?;
    Ok(rows == 1)
}

/// A failed send moves the breaker: counted while closed (opening it at the threshold), re-opened
/// with a longer pause when it was the probe, ignored otherwise (a send claimed before it opened).
async fn breaker_failed(
    db: &mut Db<'_>,
    cx: &Cx,
    endpoint: &str,
    token: &LeaseToken,
    breaker: BreakerPolicy,
) -> Result<(), StoreError> {
    ensure_breaker(db, endpoint, cx.now).await?;
    let lock = match db.engine() {
        Engine::Sqlite => &*BREAKER_SQLITE,
        Engine::Postgres => &*BREAKER_PG,
    };
    let row = db.one(lock, args![endpoint]).await?;
    use BreakerLockCol as C;
    let (state, failures, opens) = (row.text(C::state)?, row.i64(C::failures)?, row.i64(C::opens)?);
    let probe_token = row.opt_text(C::probe_token)?;
    let threshold = i64::from(breaker.failures);
    let (failures, opens) = match state.as_str() {
        "closed" if failures + 1 < threshold => {
            db.exec("UPDATE webhook_breakers SET failures = $2 WHERE endpoint_id = $1", args![endpoint, failures + 1])
                .await?;
            return Ok(());
        }
        "closed" => (failures + 1, 1),
        "half_open" if probe_token.as_deref() == Some(token.0.as_str()) => (failures, opens + 1),
        _ => return Ok(()),
    };
    let pause = breaker.pause_ms(opens);
    db.exec(
        "UPDATE webhook_breakers SET state = 'open', failures = $2, opens = $3, probe_at = $4, probe_token = NULL, \
         probe_expires_at = NULL, changed_at = $5 WHERE endpoint_id = $1",
        args![endpoint, failures, opens, cx.now.plus_millis(pause).micros(), cx.now.micros()],
    )
    .await?;
    tracing::warn!(endpoint, failures, opens, pause_ms = pause, "webhook breaker open: the endpoint is paused");
    Ok(())
}

/// An admin closes an endpoint's breaker by hand; returns where it stands now.
pub(crate) async fn close_by_hand(db: &mut Db<'_>, cx: &Cx, endpoint: &str) -> Result<BreakerStatus, StoreError> {
    let known = db.opt("SELECT 1 FROM webhook_cursors WHERE endpoint_id = $1", args![endpoint]).await?.is_some();
    if !known {
        return Err(StoreError::not_found("webhook endpoint", endpoint));
    }
    ensure_breaker(db, endpoint, cx.now).await?;
    close_breaker(db, cx, endpoint).await?;
    tracing::info!(endpoint, "webhook breaker closed by hand");
    Ok(BreakerStatus {
        endpoint_id: endpoint.to_owned(),
        state: BreakerState::Closed,
        failures: 0,
        opens: 0,
        next_probe_at: None,
    })
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
        .opt(&SELECT_ONE, args![endpoint, seq])
        .await?
        .ok_or_else(|| StoreError::not_found("delivery", format!("{endpoint}/{seq}")))?;
    let d = delivery_from_row(&row)?;
    if rows == 0 && d.state != DeliveryState::Pending {
        return Err(StoreError::InvalidTransition {
            job: format!("{endpoint}/{seq}"),
            action: "be requeued",
            state: d.state.as_str().to_owned(),
        });
    }
    Ok(d)
}
