//! The outbox as a feed: events in commit order after a cursor, within a token's scope.

use super::filter::{Kinds, scope_sql};
use super::{next_after, page_limit};
use crate::db::{Db, Value};
use crate::error::StoreError;
use crate::model::*;
use crate::ops::{EventCol, event_from_row};

/// Events after `after` in `seq` order; for a scoped token only those of its accounts and kinds
/// (an account's own events, such as grants, are of no kind).
pub(crate) async fn events(
    db: &mut Db<'_>,
    after: i64,
    limit: u32,
    scope: &settle_core::scope::Scope,
) -> Result<Paged<Event>, StoreError> {
    let limit = page_limit(limit);
    let mut a: Vec<Value> = vec![after.into()];
    let scoped = scope_sql(scope, &mut a, "account_id", Kinds::OfJob("job_id"));
    a.push(limit.into());
    let sql = format!("SELECT {} FROM outbox WHERE seq > $1{scoped} ORDER BY seq LIMIT ${}", EventCol::LIST, a.len());
    let rows = db.all_built(sql, &a).await?;
    let events = rows.iter().map(event_from_row::<EventCol>).collect::<Result<Vec<_>, StoreError>>()?;
    let next = next_after(&events, limit, |e| e.seq);
    Ok(Paged { rows: events, next_after: next })
}
