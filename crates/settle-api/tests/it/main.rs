//! The HTTP API over real HTTP: a server on port 0 over a real store (SQLite file or a fresh
//! PostgreSQL database), driven by a real HTTP client. Every check runs on both engines.

#[macro_use]
mod api;
mod alerts;
mod answers;
mod console;
mod events;
mod grants;
mod hardening;
mod held;
mod http_limits;
mod kit;
mod latency;
mod licence;
mod limits;
mod metrics;
mod openapi;
mod reports;
mod roles;
mod scopes;
mod top_ups;
mod withdrawals;
