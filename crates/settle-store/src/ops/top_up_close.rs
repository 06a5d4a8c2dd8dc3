//! The close of a top-up (docs/design/money-controls.md §11.7): what every writer of a top-up's
//! `dead` or `cancelled` does in its own transaction — the top-up closed, its reservation out of the
//! account's `held`, `top_up.failed`. Apart from `ops::top_ups`, which reaches the success path, so
//! the failure and teardown paths can call it without a circle.

use super::Cx;
use crate::db::{Db, args, columns};
use crate::error::StoreError;
use settle_core::history::EventKind;
use settle_core::job::Rail;
use std::sync::LazyLock;

columns! {
    /// What closing a top-up gives back to the account's `held`.
    ClosedCol { credits, rule_generation, created_at }
}

/// The terminal hook of every writer of a top-up's `dead` or `cancelled` (§11.7): the top-up is
/// closed, its reservation leaves `held`, and `top_up.failed` says why. A job of another rail, or a
/// top-up already closed (its charge was found), is left as it is. A rule's top-up gives its credits
/// back to the rule's month count, and one that `died` (a decline, retries spent — not a cancel)
/// pauses the rule that made it, in the same transaction: a declined card is never charged in a loop.
pub(crate) async fn closed(
    db: &mut Db<'_>,
    cx: &Cx,
    job: &super::JobRow,
    code: &str,
    died: bool,
) -> Result<(), StoreError> {
    if Rail::of(&job.kind) != Rail::Funding {
        return Ok(());
    }
    static CLOSE: LazyLock<String> = LazyLock::new(|| {
        format!("UPDATE top_ups SET open = 0 WHERE job_id = $1 AND open = 1 RETURNING {}", ClosedCol::LIST)
    });
    let Some(r) = db.opt(&CLOSE, args![&job.id]).await? else { return Ok(()) };
    let credits = r.i64(ClosedCol::credits)?;
    let rows = db
        .exec("UPDATE accounts SET held = held - $2 WHERE id = $1 AND held >= $2", args![&job.account_id, credits])
        .await?;
    super::guard_hit(rows, "top-up reservation")?;
    let data = serde_json::json!({ "code": code, "credits": credits });
    super::emit(db, cx, EventKind::TopUpFailed, Some(&job.id), &job.account_id, data).await?;
    let Some(generation) = r.opt_i64(ClosedCol::rule_generation)? else { return Ok(()) };
    // Counted in its rule's month only if made in it (the count is of the month's top-ups).
    db.exec(
        "UPDATE auto_top_ups SET credits_this_month = credits_this_month - $2 \
         WHERE account_id = $1 AND month_start <= $3 AND credits_this_month >= $2",
        args![&job.account_id, credits, r.i64(ClosedCol::created_at)?],
    )
    .await?;
    if !died || cx.broken(crate::broken::Guard::RulePause) {
        return Ok(());
    }
    let paused = db
        .exec(
            "UPDATE auto_top_ups SET state = 'paused' WHERE account_id = $1 AND generation = $2 AND state = 'active'",
            args![&job.account_id, generation],
        )
        .await?;
    if paused == 0 {
        return Ok(());
    }
    let data = serde_json::json!({ "top_up": job.id, "code": code });
    super::emit(db, cx, EventKind::TopUpRulePaused, Some(&job.id), &job.account_id, data).await
}
