//! What a job's history records, named once: the outbox's event types, how an attempt ended,
//! which signal arrived and what it did. The store writes these names and reads them back through
//! `parse`; the API, the CLI and the webhooks show them as they are spelled here (spec §4, §6).

crate::names! {
    /// The type of an outbox event (`GET /v1/events`, webhook bodies).
    pub EventKind {
        AccountCreated = "account.created",
        AccountGranted = "account.granted",
        AccountAdjusted = "account.adjusted",
        /// An admin changed the account's overdraft limit or cap (`PATCH /v1/accounts/{id}`).
        AccountUpdated = "account.updated",
        /// A posting took the balance under one of the account's alerts (spec §4a).
        AccountBalanceLow = "account.balance_low",
        /// A posting took the balance back to or above one of the account's alerts.
        AccountBalanceRecovered = "account.balance_recovered",
        JobQueued = "job.queued",
        JobClaimed = "job.claimed",
        JobItemSucceeded = "job.item_succeeded",
        JobItemRefunded = "job.item_refunded",
        JobItemReclaimed = "job.item_reclaimed",
        JobCancelRequested = "job.cancel_requested",
        JobCancelling = "job.cancelling",
        JobCancelled = "job.cancelled",
        JobRefunded = "job.refunded",
        JobReclaimed = "job.reclaimed",
        JobRetryScheduled = "job.retry_scheduled",
        JobDead = "job.dead",
        JobUnknown = "job.unknown",
        JobSucceeded = "job.succeeded",
        JobRequeued = "job.requeued",
        JobReleased = "job.released",
        WithdrawalLateExecution = "withdrawal.late_execution",
        WithdrawalReturned = "withdrawal.returned",
        /// A top-up was asked for (spec §4a); its job's `job.queued` beside it.
        TopUpQueued = "top_up.queued",
        /// The customer's charge is confirmed and the credits are granted, in one transaction.
        TopUpSucceeded = "top_up.succeeded",
        /// The top-up died (a decline, or retries spent) or was cancelled: nothing was charged.
        TopUpFailed = "top_up.failed",
        /// The provider charged a top-up Settle had closed: the credits are granted all the same
        /// (the customer paid), for a person to look at.
        TopUpLateCharge = "top_up.late_charge",
        /// A top-up of the account's auto rule died: the rule waits (`paused`) until its client
        /// puts it again — a declined card is never charged in a loop.
        TopUpRulePaused = "top_up.rule_paused",
        /// A posting crossed the rule's threshold but no top-up was made: one is in flight, the
        /// month's count would pass its maximum, or the balance could not hold the credits.
        TopUpRuleSkipped = "top_up.rule_skipped",
        GrantExpired = "grant.expired",
    }
}

impl EventKind {
    /// Events after which work may be due: a transaction that writes one wakes waiting claims.
    pub const fn wakes_claims(self) -> bool {
        matches!(
            self,
            EventKind::JobQueued | EventKind::JobRetryScheduled | EventKind::JobRequeued | EventKind::JobReleased
        )
    }
}

crate::names! {
    /// How an attempt ended (the attempt log's `result`; an open attempt has none).
    pub AttemptResult {
        Succeeded = "succeeded",
        Failed = "failed",
        LeaseExpired = "lease_expired",
        Unknown = "unknown",
        Cancelled = "cancelled",
        /// A success from an earlier attempt arrived and overtook this one (spec §3).
        Superseded = "superseded",
        /// The worker had to stop and handed the job back (spec §3 "Release"): not counted.
        Released = "released",
    }
}

crate::names! {
    /// A signal a worker (or the payout processor) sent about a job.
    pub Signal {
        Heartbeat = "heartbeat",
        ItemSucceed = "item_succeed",
        ItemFail = "item_fail",
        Artifact = "artifact",
        Fail = "fail",
        Succeed = "succeed",
        Unknown = "unknown",
        Release = "release",
    }
}

crate::names! {
    /// What a logged signal did. Signals that moved the job are visible in its events; the signal
    /// log keeps the ones that did not, and a late success that recovered a failed job.
    pub SignalEffect {
        /// Its lease token is not the current attempt's: nothing changed.
        Stale = "stale",
        /// A repeat of what already happened: nothing changed.
        Noop = "noop",
        /// A late success that took a failed job's refund back (the seed's 32-second result).
        Recovered = "recovered",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    // Each set round-trips in `names::tests::every_closed_set_round_trips`.

    #[test]
    fn only_events_that_make_work_due_wake_claims() {
        let waking: Vec<_> = EventKind::ALL.iter().filter(|k| k.wakes_claims()).map(|k| k.as_str()).collect();
        assert_eq!(waking, ["job.queued", "job.retry_scheduled", "job.requeued", "job.released"]);
    }
}
