//! Settle's HTTP API v1 (`../shared/spec/api-v1.md`): the only crate that knows HTTP and JSON.
//!
//! - [`app`]: the router, layers (body limit, timeout, metrics, tracing, panics), `Application`.
//! - [`state`]: `AppState`, what every handler shares.
//! - `handlers`: one thin handler per endpoint: parse, authorize, one store call, map the answer.
//! - [`dto`]: the wire types; requests deny unknown fields.
//! - [`error`]: `ApiError`, the spec's error body and status codes.
//! - [`auth`]: bearer tokens and roles.
//! - `extract`: JSON, query and role (`Auth<R>`) extractors whose rejections are the spec's errors.
//! - [`console`]: the operator console at `/console` (server-rendered pages, sessions, CSRF).
//! - [`host`]: the loopback-mode `Host` rule (no DNS rebinding), for every route.
//! - `reports`: `POST /v1/reports`, many worker signals in one request, each its own transition.
//! - `reference`: the API reference at `/docs` (Redoc, embedded) over `/openapi.json`.

mod answer;
pub mod app;
pub mod auth;
pub mod console;
pub mod dto;
pub mod error;
mod extract;
mod handlers;
pub mod host;
pub mod limits;
mod reference;
mod reports;
pub mod state;
pub mod telemetry;

pub use app::{AppState, Application, HttpLimits, StartError, openapi, router};
pub use auth::{LiveTokens, Role, Tokens};
pub use limits::AbuseLimits;
