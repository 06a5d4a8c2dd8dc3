//! The background passes, the payout processor and the webhook deliverer on real stores: one test binary, a module per subject.

mod funding;
mod loops;
mod payouts;
mod provider;
mod webhooks;
