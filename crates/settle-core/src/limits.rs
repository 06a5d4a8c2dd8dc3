//! Every bound in Settle, named, with what happens at the bound.

/// Longest client-chosen id (account, job, grant, adjustment, item). Longer → `invalid_request`.
pub const ID_LEN_MAX: usize = 128;
/// Most items in one job. More → `invalid_request` (a job is charged in one transaction).
pub const JOB_ITEMS_MAX: usize = 1_000;
/// Longest worker name, fail code, artifact key.
pub const WORKER_LEN_MAX: usize = 128;
pub const FAIL_CODE_LEN_MAX: usize = 64;
pub const ARTIFACT_KEY_LEN_MAX: usize = 512;
/// Longest free-text message or reason stored; longer → `invalid_request`.
pub const MESSAGE_LEN_MAX: usize = 2_000;
/// Signals that changed nothing (stale tokens, duplicates) kept in a job's signal log; past this
/// they are only counted (`signals_unlogged`), so a worker looping on a stale token cannot grow
/// the log, or the console's job page, without bound.
pub const SIGNALS_LOGGED_MAX: usize = 100;
/// Largest job payload (canonical JSON bytes).
pub const PAYLOAD_BYTES_MAX: usize = 256 * 1024;
/// Most attempts a job kind may ask for.
pub const ATTEMPTS_MAX_LIMIT: u32 = 100;
/// Lease bounds for a claim.
pub const LEASE_SECONDS_MIN: u32 = 1;
pub const LEASE_SECONDS_MAX: u32 = 3_600;
pub const LEASE_SECONDS_DEFAULT: u32 = 30;
/// Most jobs one claim may take.
pub const CLAIM_LIMIT_MAX: u32 = 100;
/// List pages (ledger, jobs, events): default and maximum page size.
pub const PAGE_LIMIT_DEFAULT: u32 = 100;
pub const PAGE_LIMIT_MAX: u32 = 1_000;
/// The stored bytes of jobs one list page may carry (payloads, results, items): past it the page
/// ends early with `next_after` where it stopped, so a page of 1,000 fat jobs is never read,
/// held or sent whole. A page always holds one job, so an answer is at most this plus one job.
pub const PAGE_BYTES_MAX: i64 = 2 << 20;
/// What one item adds to a job's answer, for the page budget (an id of up to 128 characters and
/// its fields).
pub const ITEM_BYTES_ESTIMATE: i64 = 200;
/// What a job adds to its answer besides payload, result and items, for the page budget.
pub const JOB_BYTES_OVERHEAD: i64 = 1_024;
/// Most guarded operations the SQLite writer commits in one transaction.
pub const WRITE_BATCH_MAX: usize = 256;
/// Operations waiting for the writer before callers wait for room.
pub const WRITE_QUEUE_MAX: usize = 4_096;
/// Jobs whose account a PostgreSQL store remembers, to queue their operations on the account's
/// write lane; past it a job's slot is taken by a newer one, and the next operation on the older
/// job reads its account once more.
pub const JOB_ACCOUNTS_CACHED: usize = 1 << 14;
/// Most times one PostgreSQL transaction is retried on a serialization failure or deadlock.
pub const TX_ATTEMPTS_MAX: u32 = 5;
/// PostgreSQL's event sequencer (docs/decisions/0021). One pass numbers the events of at most this
/// many committed transactions; a round runs passes until it has moved the newest stamp visible
/// when it began (so it ends however fast commits keep coming: later ones are the next round's).
pub const SEQUENCER_STAMPS_MAX: i64 = 1_000;
/// A process's sequencer looks for events nobody asked it to number (their process died between
/// COMMIT and its pass) this often when idle; a look finding none writes nothing.
pub const SEQUENCER_IDLE_MS: u64 = 200;
/// The longest a read waits for the round that makes every event committed before it readable
/// (past it the read answers `unavailable`), and the longest a round may take before it is given
/// up and started afresh.
pub const SEQUENCER_SYNC_WAIT_MS: u64 = 10_000;
/// Backoff defaults (spec §3).
pub const BACKOFF_MS_BASE_DEFAULT: u64 = 1_000;
pub const BACKOFF_MS_MAX_DEFAULT: u64 = 600_000;
pub const ATTEMPTS_MAX_DEFAULT: u32 = 5;
/// How long an `unknown` job waits before "absent" may be concluded (spec §3, 1 h).
pub const CONFIRM_WINDOW_SECONDS_DEFAULT: u64 = 3_600;
/// The largest balance a grant or adjustment may produce, and the largest overdraft limit and job
/// cost: 2^61. Refunds only return what was charged, so with these bounds no balance change can
/// leave `i64` (docs/decisions/0003).
pub const BALANCE_MAX: i64 = 1 << 61;
/// Most job kinds one claim may filter on.
pub const CLAIM_KINDS_MAX: usize = 32;
/// A job's priority: 0 (first) to 100 (last), 50 unless given (spec §3a).
pub const JOB_PRIORITY_MAX: u8 = 100;
pub const JOB_PRIORITY_DEFAULT: u8 = 50;
/// The most `max_running` an account or a job kind may carry (docs/design/fair-claims.md §9): a
/// capped claim reads at most this many running jobs to count them. 0 starts nothing (a pause).
pub const MAX_RUNNING_MAX: i64 = 10_000;
/// Most labels a job may require (spec §3a), and most a worker's claim may carry.
pub const JOB_REQUIRES_MAX: usize = 8;
pub const CLAIM_LABELS_MAX: usize = 64;
/// Longest label (`gpu:a100`, `region:eu`).
pub const LABEL_LEN_MAX: usize = 64;
/// Longest long-poll (`wait_seconds`) of a claim or an events read.
pub const WAIT_SECONDS_MAX: u32 = 30;
/// How often a long-poll looks again when no wake-up arrives.
pub const POLL_INTERVAL_MS: u64 = 250;
/// The shortest nap of a long-poll that found a due job it could not claim (another process holds it).
pub const POLL_FLOOR_MS: u64 = 10;
/// Longest withdrawal destination (printable ASCII); longer → `invalid_request`.
pub const DESTINATION_LEN_MAX: usize = 256;
/// Provider calls: the whole request, and the connect phase within it (defaults of `[provider]`).
pub const PROVIDER_TIMEOUT_MS_DEFAULT: u64 = 10_000;
pub const PROVIDER_CONNECT_TIMEOUT_MS_DEFAULT: u64 = 2_000;
/// Bounds a configuration may set for a provider call.
pub const PROVIDER_TIMEOUT_MS_MIN: u64 = 50;
pub const PROVIDER_TIMEOUT_MS_MAX: u64 = 600_000;
/// Largest provider answer body read; a longer one is outside the protocol (treated as no answer).
pub const PROVIDER_BODY_BYTES_MAX: usize = 64 * 1024;
/// Longest `provider_txid` kept; a longer one is outside the protocol.
pub const PROVIDER_TXID_LEN_MAX: usize = 256;
/// Most payouts one processor has in flight at once (one pass claims at most this many).
pub const PAYOUTS_IN_FLIGHT_MAX: u32 = 64;
/// A top-up's `credits` and `price` (minor units): at most 2^53, what every JSON client reads exactly.
pub const TOP_UP_CREDITS_MAX: i64 = 1 << 53;
pub const TOP_UP_PRICE_MAX: i64 = 1 << 53;
/// Longest funding customer reference (printable ASCII, as a destination).
pub const CUSTOMER_LEN_MAX: usize = 256;

#[cfg(test)]
mod tests {
    use super::*;

    /// The bounds decision 0003's arithmetic rests on, and the sizes the API and the provider
    /// protocol document.
    #[test]
    fn the_bounds_are_what_the_decisions_say() {
        assert_eq!(BALANCE_MAX, 2_305_843_009_213_693_952);
        assert_eq!(BALANCE_MAX.checked_mul(4), None, "four balances overflow: why held is tracked");
        assert_eq!(PAYLOAD_BYTES_MAX, 262_144);
        assert_eq!(PROVIDER_BODY_BYTES_MAX, 65_536);
    }
}
