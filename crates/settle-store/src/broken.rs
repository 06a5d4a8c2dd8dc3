//! Guards the deterministic simulator's tests remove one at a time, to show the auditor catches
//! each (issue 26, docs/decisions/0025). Only under the cargo feature `broken-guards`, which no
//! build that ships turns on; without it [`is_broken`] is `false` and compiles away.

/// A guard that matters, by name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Guard {
    /// A refund moves an item only from the state its arrow starts at (`AND state = …`).
    RefundState,
    /// A job success reclaims an item only from `refunded` (once).
    ReclaimAfterRefund,
    /// A report takes effect only with the job's current lease token.
    Lease,
    /// Teardown writes `cancelled` only after the artifacts are deleted.
    TeardownOrder,
    /// A webhook delivery is leased only at the head of its job's line (every earlier event of the
    /// job delivered to that endpoint).
    WebhookOrder,
    /// A withdrawal is refused unless never-expiring credit less the debt covers it (the cash rule).
    CashRule,
    /// A posting's balance UPDATE matches only while no grant of the account is due
    /// (`next_expiry > now`): a posting meets a due grant and expires it first.
    ExpiryClock,
    /// A success of a job whose cancel was requested tears it down instead of completing it (seed
    /// 003's race ⑤).
    CancelWins,
    /// A claim takes a capped account's or kind's job only while it runs fewer than its cap.
    Cap,
    /// A balance alert fires only when the balance crosses its threshold (its stored side
    /// changes), not on every posting on the far side of it (Blnk #318's monitors).
    AlertEdge,
    /// A create or withdrawal is refused when its charge would take a spend limit's period over
    /// its amount (the caps that overshoot: anthropics/claude-code#59858).
    SpendLimit,
    /// A rule's top-up that dies pauses its rule (a declined card is never charged in a loop:
    /// getlago/lago#6103).
    RulePause,
}

/// Whether `guard` is removed in this store.
#[cfg(feature = "broken-guards")]
pub(crate) fn is_broken(removed: Option<Guard>, guard: Guard) -> bool {
    removed == Some(guard)
}

#[cfg(not(feature = "broken-guards"))]
pub(crate) fn is_broken(_removed: Option<Guard>, _guard: Guard) -> bool {
    false
}
