//! One integration-test binary for the store: the conformance suite (written once against the
//! `Store` trait and instantiated per engine), race tests and crash convergence.

mod artifacts;
#[macro_use]
mod kit;
mod alerts;
mod checkpoint;
#[macro_use]
mod conformance;
mod caps;
mod claims;
mod crash;
mod fair;
mod feed;
mod grants;
mod held;
mod identity;
mod limits;
mod plan;
mod primary;
mod race;
mod release;
mod schema;
mod tamper;
mod top_ups;
mod upgrade;
mod withdrawals;
