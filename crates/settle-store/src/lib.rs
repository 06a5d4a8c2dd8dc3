//! Settle's storage: the [`Store`] trait and [`SqlStore`], its implementation for SQLite and
//! PostgreSQL.
//!
//! - [`store`]: the trait, one call per domain operation.
//! - [`model`]: the data that goes in and out.
//! - `ops`: every transition, written once for both engines (guard, items, ledger, outbox).
//! - `db`: the thin layer that lets one piece of SQL run on either engine.
//! - [`sql_store`]: transactions, the batching SQLite writer, teardown steps 2–3, crash points.
//! - `audit`: the ledger invariants L1–L4 recomputed from the rows.
//! - [`artifacts`]: where workers' artifacts live, for teardown's cleanup.

pub mod artifacts;
mod audit;
mod console;
pub use audit::AuditProgress;
pub mod db;
mod engine;
pub mod error;
mod identity;
pub mod model;
mod ops;
mod payouts;
mod reads;
pub mod sql_store;
pub mod store;
mod webhooks;

pub use artifacts::{ArtifactStore, ArtifactsError, DIRECTORY_MARKER, ObjectArtifactStore, StoreCheck};
pub use db::{Engine, redacted_url};
pub use error::StoreError;
pub use model::*;
pub use ops::CrashHook;
pub use sql_store::{Durability, SqlStore, StoreOptions};
pub use store::{Payouts, Store};
