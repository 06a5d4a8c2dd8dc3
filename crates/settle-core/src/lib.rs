//! Settle's domain, with no IO.
//!
//! - [`money`]: `Credits`, an `i64` of minor units whose every operation is checked.
//! - [`ids`]: validated identifiers (client ids, item ids, worker names, fail codes, artifact keys).
//! - [`item`]: the billable item's money state machine (spec §2) as a pure transition table.
//! - [`job`]: the job lifecycle (spec §3): states, refund policy, and the pure decisions a store applies.
//! - [`backoff`]: `min(base · 2^n, max)` with optional full jitter from a seedable generator.
//! - [`ledger`]: entry kinds and the per-account hash chain.
//! - [`history`]: the names a job's history records (event types, attempt results, signals and their effects).
//! - [`scope`]: what a scoped token may see and move (accounts by id or prefix, job kinds).
//! - [`fingerprint`]: canonical request fingerprints for create-by-id idempotency, and canonical JSON.
//! - [`clock`]: the injected `Clock`; nothing else reads the system time.
//! - [`crash`]: the `CrashPoint` enum the crash-convergence harness iterates.
//! - [`limits`]: every bound, named.
//! - [`names`]: `names!`, the one way a closed set of names (states, kinds, codes) is written.
//! - [`spend`]: spend limits' periods (UTC days and months), what a posting spends, whether a charge fits.
//! - [`signature`]: HMAC-SHA256 and the webhook `Settle-Signature` header (sign, verify).

pub mod backoff;
pub mod clock;
pub mod crash;
pub mod currency;
pub mod fingerprint;
pub mod history;
pub mod ids;
pub mod item;
pub mod job;
pub mod ledger;
pub mod limits;
pub mod money;
pub mod names;
pub mod scope;
pub mod signature;
pub mod spend;

pub use clock::{Clock, FakeClock, SystemClock, Timestamp};
pub use money::{Credits, MoneyError};
