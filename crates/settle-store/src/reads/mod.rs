//! Every read of Settle, for both engines, by what it reads (the writes are in `ops`). Each runs on
//! one read snapshot and changes nothing.
//!
//! - [`accounts`]: balances, ledgers, holds and the hash chain.
//! - [`jobs`]: job lists and totals, attempts, signals, histories, failures, the loops' lookups.
//! - [`events`]: the outbox as a feed.
//! - [`payouts`]: withdrawals, one or a page of them.
//! - [`webhooks`]: deliveries, breakers, backlogs.
//! - [`overview`]: the console's overview, the metrics' counters, the operator action log.
//! - [`filter`]: the SQL of a job filter and of a token's scope.

mod accounts;
mod events;
pub(crate) mod filter;
mod jobs;
mod overview;
pub(crate) mod payouts;
pub(crate) mod top_ups;
pub(crate) mod webhooks;

pub(crate) use accounts::*;
pub(crate) use events::*;
pub(crate) use jobs::*;
pub(crate) use overview::*;

use settle_core::limits::PAGE_LIMIT_MAX;

pub(crate) fn page_limit(limit: u32) -> i64 {
    i64::from(limit.clamp(1, PAGE_LIMIT_MAX))
}

pub(crate) fn next_after<T>(rows: &[T], limit: i64, key: impl Fn(&T) -> i64) -> Option<i64> {
    if rows.len() as i64 == limit { rows.last().map(key) } else { None }
}
