//! The outbox as a feed: events in commit order after a cursor, within a token's scope.

use super::filter::{Kinds, scope_sql};
use super::{next_after, page_limit};
use crate::db::{Db, Value, args, columns};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{self, EVENTS, EventCol, event_from_row};
use std::sync::LazyLock;

columns! {
    /// The newest numbered event.
    TopCol { top = "MAX(last_seq)" }
}

/// Events after `after` in `seq` order; for a scoped token only those of its accounts and kinds
/// (an account's own events, such as grants, are of no kind).
///
/// `next_after` says how far the page looked, whatever it found (issue 41): a full page ends at its
/// last event; a page that is not full looked through events numbered when it began — other
/// tenants' too — so its cursor moves past them, and a scoped consumer never rescans them. A page
/// looks through at most `LOOK_ROUNDS` pages' worth of events (a small tenant far behind a big one
/// costs a bounded read per request) and then ends where it looked. `None` when nothing beyond what
/// the page returns (or beyond `after`) was numbered: "caught up".
/// The newest seq is read first and the page kept to it: numbers become visible in order (the
/// sequencer's promise), so every event up to it is there to be read.
pub(crate) async fn events(
    db: &mut Db<'_>,
    after: i64,
    limit: u32,
    scope: &settle_core::scope::Scope,
) -> Result<Paged<Event>, StoreError> {
    static TOP: LazyLock<String> = LazyLock::new(|| format!("SELECT {} FROM stamp_numbers", TopCol::LIST));
    let limit = page_limit(limit);
    let top = db.one(&TOP, args![]).await?.opt_i64(TopCol::top)?.unwrap_or(0);
    if after > top {
        return Err(cursor_ahead(db, after, top).await?);
    }
    // Stamp by stamp (docs/design/batch-plan.md §4a): a scoped page that is not full goes on
    // through other tenants' events, up to the newest number or `LOOK_ROUNDS` rounds.
    const LOOK_ROUNDS: usize = 8;
    let mut events = Vec::new();
    let mut from = after;
    for _ in 0..LOOK_ROUNDS {
        let want = limit - events.len() as i64;
        let Some(through) = ops::read_through(db, from, top, limit).await? else { break };
        let mut a: Vec<Value> = vec![from.into(), through.into()];
        let scoped = scope_sql(scope, &mut a, "e.account_id", Kinds::OfJob("e.job_id"));
        a.push(want.into());
        let sql = format!(
            "SELECT {} FROM {EVENTS} WHERE n.last_seq > $1 AND n.last_seq <= $2 AND e.pos > $1 - n.first_seq + 1\
             {scoped} ORDER BY n.last_seq, e.pos LIMIT ${}",
            EventCol::LIST,
            a.len()
        );
        for r in db.all_built(sql, &a).await? {
            events.push(event_from_row::<EventCol>(&r)?);
        }
        from = through;
        if through >= top || events.len() as i64 >= limit {
            break;
        }
    }
    let next = match next_after(&events, limit, |e| e.seq) {
        Some(full) => Some(full),
        // Looked through part of the way: on from there.
        None if from < top => Some(from),
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
