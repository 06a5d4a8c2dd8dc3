//! The outbox as a feed: events in commit order after a cursor, within a token's scope.

use super::filter::{Kinds, scope_sql};
use super::{next_after, page_limit};
use crate::db::{Db, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{EventCol, event_from_row};
use std::sync::LazyLock;

columns! {
    /// The newest numbered event.
    TopCol { top = "MAX(seq)" }
}

/// Events after `after` in `seq` order; for a scoped token only those of its accounts and kinds
/// (an account's own events, such as grants, are of no kind).
///
/// `next_after` says how far the page looked, whatever it found (issue 41): a full page ends at its
/// last event; a page that is not full looked through every event numbered when it began — other
/// tenants' too — so its cursor moves past them, and a scoped consumer never rescans them. `None`
/// when nothing beyond what the page returns (or beyond `after`) was numbered: "caught up".
/// The newest seq is read first and the page kept to it: numbers become visible in order (the
/// sequencer's promise), so every event up to it is there to be read.
pub(crate) async fn events(
    db: &mut Db<'_>,
    after: i64,
    limit: u32,
    scope: &settle_core::scope::Scope,
) -> Result<Paged<Event>, StoreError> {
    static TOP: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM outbox", TopCol::LIST));
    let limit = page_limit(limit);
    let top = db.one(&TOP, args![]).await?.opt_i64(TopCol::top)?.unwrap_or(0);
    if after > top {
        return Err(cursor_ahead(db, after, top).await?);
    }
    let mut a: Vec<Value> = vec![after.into(), top.into()];
    let scoped = scope_sql(scope, &mut a, "account_id", Kinds::OfJob("job_id"));
    a.push(limit.into());
    let sql = format!(
        "SELECT {} FROM outbox WHERE seq > $1 AND seq <= $2{scoped} ORDER BY seq LIMIT ${}",
        EventCol::LIST,
        a.len()
    );
    let rows = db.all_built(sql, &a).await?;
    let events = rows.iter().map(event_from_row::<EventCol>).collect::<Result<Vec<_>, StoreError>>()?;
    let next = match next_after(&events, limit, |e| e.seq) {
        Some(full) => Some(full),
        None => {
            let seen = events.last().map_or(after, |e| e.seq);
            (top > seen).then_some(top)
        }
    };
    Ok(Paged { rows: events, next_after: next })
}

columns! {
    /// The epoch events are numbered in now, and the number before its first.
    EpochCol { epoch, restart_after = "first_seq - 1" }
}

/// A cursor past every numbered event: numbers only grow, except when a restore rewinds them, so
/// the consumer read a timeline the restore threw away. It is told where the new epoch begins.
async fn cursor_ahead(db: &mut Db<'_>, after: i64, top: i64) -> Result<StoreError, StoreError> {
    static SQL: LazyLock<String> =
        LazyLock::new(|| format!("SELECT {} FROM store_epochs ORDER BY epoch DESC LIMIT 1", EpochCol::LIST));
    let r = db.one(&SQL, args![]).await?;
    let (epoch, restart_after) = (r.i64(EpochCol::epoch)?, r.i64(EpochCol::restart_after)?);
    // Events numbered before the current epoch began are ones the consumer may have seen: it
    // restarts where the new epoch starts, or at the end if it has not numbered anything yet.
    Ok(StoreError::CursorAhead { after, last: top, epoch, restart_after: restart_after.min(top) })
}
