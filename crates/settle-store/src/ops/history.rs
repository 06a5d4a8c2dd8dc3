//! The job's history, kept for support: the attempt log, the log of signals that changed nothing, and
//! the operator actions.

use super::{Cx, JobRow};
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use settle_core::history::{AttemptResult, Signal, SignalEffect};
use settle_core::limits;
use std::sync::LazyLock;

/// A signal as received, for the signal log.
pub(crate) struct Heard<'a> {
    pub signal: Signal,
    pub code: Option<&'a str>,
    pub message: Option<&'a str>,
}

columns! {
    /// The attempt that held a lease token.
    AttemptNoCol { attempt_no }
}

columns! {
    /// How many signals of a job are logged, counted up to the bound.
    KeptCol { kept = "count(*)" }
}

columns! {
    /// How an attempt ended, as a stale report is judged against it.
    TokenAttemptCol { attempt_no, result, reported, sent_code, finished_at, expired_at, success_at }
}

static ATTEMPT_NO: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM attempts WHERE job_id = $1 AND lease_token = $2", AttemptNoCol::LIST));
/// The job's logged signals, counted up to `$2`: those under its number `$3` (migration 0036) and
/// those logged before the number was kept, each arm on its partial index.
pub(crate) static SIGNALS_KEPT: LazyLock<String> = LazyLock::new(|| {
    format!(
        "SELECT {} FROM (SELECT 1 FROM signals WHERE job_seq = $3 AND job_id = $1 \
         UNION ALL SELECT 1 FROM signals WHERE job_id = $1 AND job_seq IS NULL LIMIT $2) AS kept",
        KeptCol::LIST
    )
});
static TOKEN_ATTEMPT: LazyLock<String> =
    LazyLock::new(|| format!("SELECT {} FROM attempts WHERE job_id = $1 AND lease_token = $2", TokenAttemptCol::LIST));

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
        Some(t) => {
            db.opt(&ATTEMPT_NO, args![&job.id, t]).await?.map(|r| r.i64(AttemptNoCol::attempt_no)).transpose()?
        }
        None => None,
    };
    // The log is bounded per job: the first signals are kept whole, the rest only counted. The
    // job row is locked by the caller, so the count and the insert cannot race.
    let bound = limits::SIGNALS_LOGGED_MAX as i64;
    let kept = db.one(&SIGNALS_KEPT, args![&job.id, bound, job.job_seq]).await?.i64(KeptCol::kept)?;
    // A late success that recovered the job is always kept: it is what support asks about, and
    // stale signals sent first must not push it out.
    if kept >= limits::SIGNALS_LOGGED_MAX as i64 && effect != SignalEffect::Recovered {
        let counted =
            db.exec("UPDATE jobs SET signals_unlogged = signals_unlogged + 1 WHERE id = $1", args![&job.id]).await?;
        super::guard_hit(counted, "signal count")?;
        return Ok(());
    }
    // The job's number from its row, in the statement (migration 0036), as an event's is.
    db.exec(
        "INSERT INTO signals (job_id, job_seq, attempt_no, signal, fail_code, message, effect, received_at) \
         VALUES ($1, (SELECT job_seq FROM jobs WHERE id = $1), $2, $3, $4, $5, $6, $7)",
        args![&job.id, attempt_no, signal.as_str(), fail_code, message, effect.as_str(), cx.now.micros()],
    )
    .await?;
    Ok(())
}

/// An attempt's own report that took effect, kept on its row so that the same report re-sent is
/// told apart from a stale one (decision 0019).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Reported<'a> {
    /// `succeed`, `fail`, `unknown` or `release`.
    pub signal: &'static str,
    /// The code the worker sent with its `fail` (the attempt's `fail_code` may differ: a fail
    /// during a cancel closes it `CANCELLED`).
    pub sent_code: Option<&'a str>,
}

impl Reported<'_> {
    pub const SUCCEED: Reported<'static> = Reported { signal: "succeed", sent_code: None };
    pub const UNKNOWN: Reported<'static> = Reported { signal: "unknown", sent_code: None };
    pub const RELEASE: Reported<'static> = Reported { signal: "release", sent_code: None };
}

/// Records that an attempt already closed (an earlier one) reported a success that took effect. Its
/// earlier report (a `fail`, an `unknown`) stays recorded: its re-send is still a replay.
pub(crate) async fn mark_reported_success(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    attempt_no: u32,
) -> Result<(), StoreError> {
    db.exec(
        "UPDATE attempts SET reported = COALESCE(reported, 'succeed'), success_at = COALESCE(success_at, $3) \
         WHERE job_id = $1 AND attempt_no = $2",
        args![&job.id, i64::from(attempt_no), cx.now.micros()],
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
    reported: Option<Reported<'_>>,
) -> Result<(), StoreError> {
    // The rescuer's close names when the lease ran out (its own time is later).
    let expired_at = if result == AttemptResult::LeaseExpired { job.lease_expires_at } else { None };
    let success_at = reported.is_some_and(|r| r.signal == "succeed").then_some(cx.now.micros());
    db.exec(
        "UPDATE attempts SET finished_at = $3, result = $4, fail_code = $5, message = $6, reported = $7, \
         sent_code = $8, expired_at = $9, success_at = $10 WHERE job_id = $1 AND attempt_no = $2 AND finished_at IS NULL",
        args![
            &job.id,
            job.attempt,
            cx.now.micros(),
            result.as_str(),
            code,
            message,
            reported.map(|c| c.signal),
            reported.and_then(|c| c.sent_code),
            expired_at,
            success_at
        ],
    )
    .await?;
    Ok(())
}

/// The attempt of this job whose lease token a report carried, as its row says.
pub(crate) struct TokenAttempt {
    pub end: crate::model::AttemptEnd,
    pub sent_code: Option<String>,
    /// Whether this attempt's own success took effect (perhaps losing to a cancel).
    pub success: bool,
}

impl TokenAttempt {
    pub fn reported(&self, signal: &str) -> bool {
        self.end.reported.as_deref() == Some(signal)
    }
}

/// Which attempt of `job` held `token`, if any did. Tokens are fresh UUIDs and attempt rows are
/// never deleted, so `None` means no attempt of this job ever held it.
pub(crate) async fn token_attempt(
    db: &mut Db<'_>,
    job: &JobRow,
    token: &str,
) -> Result<Option<TokenAttempt>, StoreError> {
    use TokenAttemptCol as C;
    let Some(r) = db.opt(&TOKEN_ATTEMPT, args![&job.id, token]).await? else { return Ok(None) };
    let result = match r.opt_text(C::result)? {
        Some(s) => {
            Some(AttemptResult::parse(&s).ok_or_else(|| StoreError::internal(format!("bad attempt result {s}")))?)
        }
        None => None,
    };
    Ok(Some(TokenAttempt {
        end: crate::model::AttemptEnd {
            attempt_no: u32::try_from(r.i64(C::attempt_no)?).unwrap_or(u32::MAX),
            result,
            reported: r.opt_text(C::reported)?,
            finished_at: r.opt_i64(C::finished_at)?.map(settle_core::Timestamp::from_micros),
            expired_at: r.opt_i64(C::expired_at)?.map(settle_core::Timestamp::from_micros),
        },
        sent_code: r.opt_text(C::sent_code)?,
        success: r.opt_i64(C::success_at)?.is_some(),
    }))
}

/// The refusal of a report whose token is not the current lease (decision 0019).
pub(crate) fn refusal(job: &JobRow, attempt: Option<TokenAttempt>) -> Box<crate::model::LeaseLost> {
    Box::new(crate::model::LeaseLost { job: job.id.clone(), state: job.state, attempt: attempt.map(|a| a.end) })
}

/// What a signal whose token no longer holds the lease comes to, when replaying it changes nothing
/// but the log (`unknown`, `release`; decision 0019): the same report re-sent by the attempt that
/// made it is logged as a no-op and answered; anything else from an attempt is logged stale and
/// refused; a token no attempt held is refused and not logged. Returns whether an attempt held the
/// token, and the refusal if any.
pub(crate) async fn replay_or_refuse(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &JobRow,
    token: &str,
    heard: Heard<'_>,
    reported: &str,
) -> Result<(bool, Option<Box<crate::model::LeaseLost>>), StoreError> {
    Ok(match token_attempt(db, job, token).await? {
        None => (false, Some(refusal(job, None))),
        Some(att) if att.reported(reported) => {
            log_signal(db, cx, job, Some(token), heard, SignalEffect::Noop).await?;
            (true, None)
        }
        Some(att) => {
            log_signal(db, cx, job, Some(token), heard, SignalEffect::Stale).await?;
            (true, Some(refusal(job, Some(att))))
        }
    })
}

/// Records an admin action in the caller's transaction.
pub(crate) async fn record_action(
    db: &mut Db<'_>,
    cx: &Cx,
    actor: &str,
    action: crate::model::ActionKind,
    job_id: Option<&str>,
    account_id: Option<&str>,
    detail: serde_json::Value,
) -> Result<(), StoreError> {
    if actor.is_empty() || actor.len() > limits::WORKER_LEN_MAX {
        return Err(StoreError::invalid("an actor's name is 1 to 128 characters"));
    }
    db.exec(
        "INSERT INTO actions (at, actor, action, job_id, account_id, detail) VALUES ($1, $2, $3, $4, $5, $6)",
        args![cx.now.micros(), actor, action.as_str(), job_id, account_id, detail.to_string()],
    )
    .await?;
    Ok(())
}

/// A console session signed out until `expires_at` (unix seconds); sign-outs past theirs are
/// forgotten (their cookies no longer open anyway).
pub(crate) async fn sign_out(db: &mut Db<'_>, cx: &Cx, nonce: &str, expires_at: i64) -> Result<(), StoreError> {
    let now_seconds = cx.now.micros().div_euclid(1_000_000);
    db.exec("DELETE FROM console_signouts WHERE expires_at <= $1", args![now_seconds]).await?;
    db.exec(
        "INSERT INTO console_signouts (nonce, expires_at) VALUES ($1, $2) ON CONFLICT DO NOTHING",
        args![nonce, expires_at],
    )
    .await?;
    Ok(())
}

columns! {
    /// How the job's last attempt ended.
    LastResultCol { result }
}

/// Whether the job's last attempt closed `released` (a requeue's replay check tells it apart).
pub(crate) async fn last_attempt_released(db: &mut Db<'_>, job: &JobRow) -> Result<bool, StoreError> {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM attempts WHERE job_id = $1 AND attempt_no = $2", LastResultCol::LIST));
    let row = db.opt(&SQL, args![&job.id, job.attempt]).await?;
    let result = match row {
        Some(r) => r.opt_text(LastResultCol::result)?,
        None => None,
    };
    Ok(result.as_deref() == Some(AttemptResult::Released.as_str()))
}
