//! The `settle` binaries run as a user would, as processes: one test binary, a module per subject.

// What the modules share; not every module uses all of it.
mod artifacts;
mod caps;
mod cli;
#[allow(dead_code)]
mod common;
mod configuration;
mod contention;
mod examples;
mod failover;
mod faults;
mod operations;
mod operator_api;
mod payouts;
mod worker_restart;
