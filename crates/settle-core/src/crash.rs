//! Crash points: the places inside a multi-step operation where a process can die.
//!
//! A store asks an injected hook at each point; the crash-convergence harness iterates every
//! operation × every point (see `settle-store`'s tests) and checks that a re-run converges.

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum CrashPoint {
    /// The guarded state change is written, nothing else.
    AfterGuard,
    /// A ledger row (and its balance change) is written.
    AfterLedger,
    /// The outbox event is written.
    AfterOutbox,
    /// Everything is written; the transaction has not committed.
    BeforeCommit,
    /// The transaction committed; the caller never saw the answer.
    AfterCommit,
    /// Teardown: step 1 (refunds, state `cancelling`) committed; cleanup not started.
    TeardownAfterRefund,
    /// Teardown: artifacts cleaned up; the terminal transition not written.
    TeardownAfterCleanup,
    /// Payout: the provider said the key is absent; the send has not been made.
    PayoutAfterLookup,
    /// Payout: the provider executed the send and answered; the answer is not recorded.
    PayoutAfterSend,
}

impl CrashPoint {
    /// The points inside the store's operations (the store's crash harness visits every one).
    pub const STORE: &'static [CrashPoint] = &[
        CrashPoint::AfterGuard,
        CrashPoint::AfterLedger,
        CrashPoint::AfterOutbox,
        CrashPoint::BeforeCommit,
        CrashPoint::AfterCommit,
        CrashPoint::TeardownAfterRefund,
        CrashPoint::TeardownAfterCleanup,
    ];
    /// The points of a payout attempt, between provider calls (the payout crash test visits both).
    pub const PAYOUT: &'static [CrashPoint] = &[CrashPoint::PayoutAfterLookup, CrashPoint::PayoutAfterSend];

    pub const ALL: &'static [CrashPoint] = &[
        CrashPoint::AfterGuard,
        CrashPoint::AfterLedger,
        CrashPoint::AfterOutbox,
        CrashPoint::BeforeCommit,
        CrashPoint::AfterCommit,
        CrashPoint::TeardownAfterRefund,
        CrashPoint::TeardownAfterCleanup,
        CrashPoint::PayoutAfterLookup,
        CrashPoint::PayoutAfterSend,
    ];

    pub const fn name(self) -> &'static str {
        match self {
            CrashPoint::AfterGuard => "after_guard",
            CrashPoint::AfterLedger => "after_ledger",
            CrashPoint::AfterOutbox => "after_outbox",
            CrashPoint::BeforeCommit => "before_commit",
            CrashPoint::AfterCommit => "after_commit",
            CrashPoint::TeardownAfterRefund => "teardown_after_refund",
            CrashPoint::TeardownAfterCleanup => "teardown_after_cleanup",
            CrashPoint::PayoutAfterLookup => "payout_after_lookup",
            CrashPoint::PayoutAfterSend => "payout_after_send",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CrashPoint;

    #[test]
    fn store_and_payout_points_are_all_the_points() {
        let mut both: Vec<CrashPoint> = CrashPoint::STORE.iter().chain(CrashPoint::PAYOUT).copied().collect();
        both.sort();
        let mut all = CrashPoint::ALL.to_vec();
        all.sort();
        assert_eq!(both, all);
    }

    #[test]
    fn names_are_distinct_snake_case() {
        let names: Vec<&str> = CrashPoint::ALL.iter().map(|p| p.name()).collect();
        assert_eq!(names[0], "after_guard");
        let mut distinct = names.clone();
        distinct.sort();
        distinct.dedup();
        assert_eq!(distinct.len(), names.len());
        assert!(
            names.iter().all(|n| !n.is_empty() && n.chars().all(|c| c.is_ascii_lowercase() || c == '_')),
            "{names:?}"
        );
    }
}
