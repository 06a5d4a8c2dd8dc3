//! Settle's storage: the [`Store`] trait and [`SqlStore`], its implementation for SQLite and
//! PostgreSQL. API boundary: the [`Store`] and [`Payouts`] traits and the types of [`model`] are
//! what the other crates use; everything else is this crate's own.
//!
//! From the top down:
//!
//! - [`store`]: the traits, one call per domain operation.
//! - [`sql_store`]: `SqlStore` — opening either engine, running operations (transactions, crash
//!   points), teardown steps 2–3.
//! - `engine`: how writes reach each engine — the batching SQLite writer thread, PostgreSQL's
//!   write lanes.
//! - `ops`: every write, written once for both engines (guard, items, ledger, outbox), payouts and
//!   webhook deliveries included; `ops::rows` decodes the rows both sides read.
//! - `reads`: every read, by what it reads (accounts, jobs, events, payouts, webhooks, overview).
//! - `audit`: the ledger invariants L1–L9 recomputed from the rows.
//! - `identity`: whose database this is, checked before anything is written.
//! - `db`: the thin layer that lets one piece of SQL run on either engine.
//! - [`options`]: how a store is opened (`StoreOptions`, `Durability`).
//! - [`model`], [`error`]: the data that goes in and out, and the errors.
//! - [`artifacts`]: where workers' artifacts live, for teardown's cleanup.

pub mod artifacts;
mod audit;
mod audit_apart;
mod audit_checkpoint;
pub mod backup;
pub mod copy;
pub use audit::AuditProgress;
pub mod db;
mod engine;
pub mod error;
mod identity;
pub mod model;
mod ops;
pub mod options;
mod reads;
pub mod sql_store;
pub mod store;

pub mod broken;
pub use artifacts::{ArtifactStore, ArtifactsError, DIRECTORY_MARKER, ObjectArtifactStore, StoreCheck};
pub use db::{Engine, redacted_url};
pub use error::StoreError;
pub use model::*;
pub use ops::CrashHook;
pub use sql_store::{Durability, SqlStore, StoreOptions};
pub use store::{Funding, Operators, Payouts, Store, Webhooks};
