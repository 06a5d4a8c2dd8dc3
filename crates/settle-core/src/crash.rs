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
}

impl CrashPoint {
    pub const ALL: &'static [CrashPoint] = &[
        CrashPoint::AfterGuard,
        CrashPoint::AfterLedger,
        CrashPoint::AfterOutbox,
        CrashPoint::BeforeCommit,
        CrashPoint::AfterCommit,
        CrashPoint::TeardownAfterRefund,
        CrashPoint::TeardownAfterCleanup,
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
        }
    }
}
