//! The job's history, kept for support: the attempt log, the log of signals that changed nothing, and
//! the operator actions.

use super::{Cx, JobRow};
use crate::db::{Db, args};
use crate::error::StoreError;
use settle_core::history::{AttemptResult, Signal, SignalEffect};
use settle_core::limits;

/// A signal as received, for the signal log.
pub(crate) struct Heard<'a> {
    pub signal: Signal,
    pub code: Option<&'a str>,
    pub message: Option<&'a str>,
}

pub(crate) async fn log_signal(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    token: Option<&str>,
    heard: Heard<'_>,
    effect: SignalEffect,
) -> Result<(), StoreError> {
    let Heard { signal, code: fail_code, message } = heard;
    let attempt_no = match token {
        Some(t) => db
            .opt("SELECT attempt_no FROM attempts WHERE job_id = $1 AND lease_token = $2", args![&job.id, t])
            .await?
            .map(|r| r.i64(0))
            .transpose()?,
        None => None,
    };
    // The log is bounded per job: the first signals are kept whole, the rest only counted. The
    // job row is locked by the caller, so the count and the insert cannot race.
    let kept = db
        .one(
            "SELECT count(*) FROM (SELECT 1 FROM signals WHERE job_id = $1 LIMIT $2) AS kept",
            args![&job.id, limits::SIGNALS_LOGGED_MAX as i64],
        )
        .await?
        .i64(0)?;
    // A late success that recovered the job is always kept: it is what support asks about, and
    // stale signals sent first must not push it out.
    if kept >= limits::SIGNALS_LOGGED_MAX as i64 && effect != SignalEffect::Recovered {
        let counted =
            db.exec("UPDATE jobs SET signals_unlogged = signals_unlogged + 1 WHERE id = $1", args![&job.id]).await?;
        super::guard_hit(counted, "signal count")?;
        return Ok(());
    }
    db.exec(
        "INSERT INTO signals (job_id, attempt_no, signal, fail_code, message, effect, received_at) \
         VALUES ($1, $2, $3, $4, $5, $6, $7)",
        args![&job.id, attempt_no, signal.as_str(), fail_code, message, effect.as_str(), cx.now.micros()],
    )
    .await?;
    Ok(())
}

pub(super) async fn close_attempt(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    result: AttemptResult,
    code: Option<&str>,
    message: Option<&str>,
) -> Result<(), StoreError> {
    db.exec(
        "UPDATE attempts SET finished_at = $3, result = $4, fail_code = $5, message = $6 \
         WHERE job_id = $1 AND attempt_no = $2 AND finished_at IS NULL",
        args![&job.id, job.attempt, cx.now.micros(), result.as_str(), code, message],
    )
    .await?;
    Ok(())
}

/// Records an admin action in the caller's transaction.
pub(crate) async fn record_action(
    db: &mut Db<'_>,
    cx: &Cx,
    actor: &str,
    action: &'static str,
    job_id: Option<&str>,
    account_id: Option<&str>,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    if actor.is_empty() || actor.len() > limits::WORKER_LEN_MAX {
        return Err(StoreError::invalid("an actor's name is 1 to 128 characters"));
    }
    db.exec(
        "INSERT INTO actions (at, actor, action, job_id, account_id, detail) VALUES ($1, $2, $3, $4, $5, $6)",
        args![cx.now.micros(), actor, action, job_id, account_id, detail.to_string()],
    )
    .await?;
    Ok(())
}
