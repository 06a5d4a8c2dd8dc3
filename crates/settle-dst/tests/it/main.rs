//! The simulator's promises and the broken-guard search: one test binary.

mod broken_guards;
mod determinism;
