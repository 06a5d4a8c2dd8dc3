//! What a PostgreSQL transaction writes last, just before COMMIT: its queued ledger lines, numbered
//! and chained, and its events, in one statement (docs/decisions/0024).

use super::Pending;
use crate::db::Db;
use crate::error::StoreError;
use std::time::Duration;

/// PostgreSQL, the statements before COMMIT: the queued lines numbered and chained
/// (`ledger::flush_lines`), then one statement that writes them and the events and sets what COMMIT
/// needs (`outbox::flush_with_lines`). Returns whether it wrote events, so the engine asks the
/// sequencer to number them once the COMMIT is done.
pub(crate) async fn flush(db: &mut Db<'_>, pending: &Pending, lock_timeout: Duration) -> Result<bool, StoreError> {
    let lines =
        if pending.lines.is_empty() { Vec::new() } else { super::ledger::flush_lines(db, &pending.lines).await? };
    super::outbox::flush_with_lines(db, pending, lines, lock_timeout).await
}
