//! Bearer tokens with roles `admin` ⊇ {`client`, `worker`}.
//!
//! Tokens come from a file (`--tokens FILE`: one `ROLE TOKEN` per line, `#` comments) or the
//! environment (`SETTLE_TOKENS="admin=…,worker=…"`). Tokens are compared as SHA-256 digests in
//! constant time. With no token configured, every request is allowed and the server only binds a
//! loopback address.

use crate::error::ApiError;
use axum::http::HeaderMap;
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    Admin,
    Client,
    Worker,
}

impl Role {
    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "admin" => Some(Role::Admin),
            "client" => Some(Role::Client),
            "worker" => Some(Role::Worker),
            _ => None,
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            Role::Admin => "admin",
            Role::Client => "client",
            Role::Worker => "worker",
        }
    }
    fn grants(self, needed: Role) -> bool {
        self == Role::Admin || self == needed
    }
}

#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<([u8; 32], Role)>,
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} configured)", self.entries.len())
    }
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Tokens {
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    pub fn add(&mut self, role: Role, token: &str) -> Result<(), String> {
        if token.len() < 16 {
            return Err(format!("a {} token must be at least 16 characters", role.name()));
        }
        self.entries.push((digest(token), role));
        Ok(())
    }

    /// `ROLE TOKEN` lines; blank lines and `#` comments are skipped.
    pub fn parse_file(text: &str) -> Result<Tokens, String> {
        let mut tokens = Tokens::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(role), Some(token), None) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format!("line {}: expected `ROLE TOKEN`", n + 1));
            };
            let role = Role::parse(role).ok_or_else(|| format!("line {}: unknown role {role}", n + 1))?;
            tokens.add(role, token).map_err(|e| format!("line {}: {e}", n + 1))?;
        }
        Ok(tokens)
    }

    /// `role=token,role=token`.
    pub fn parse_env(text: &str) -> Result<Tokens, String> {
        let mut tokens = Tokens::default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (role, token) = pair.split_once('=').ok_or_else(|| format!("expected role=token, got {pair:?}"))?;
            let role = Role::parse(role.trim()).ok_or_else(|| format!("unknown role {role}"))?;
            tokens.add(role, token.trim())?;
        }
        Ok(tokens)
    }

    /// The digest of the presented token when it is a configured one (the key of its limits).
    pub fn identify(&self, headers: &HeaderMap) -> Option<[u8; 32]> {
        let presented = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)?;
        let d = digest(presented);
        let mut found = None;
        for (known, _) in &self.entries {
            if bool::from(known.ct_eq(&d)) {
                found = Some(d);
            }
        }
        found
    }

    /// Checks the `Authorization: Bearer …` header for `needed`: 401 without a known token,
    /// 403 with a known token of another role.
    pub fn authorize(&self, headers: &HeaderMap, needed: Role) -> Result<(), ApiError> {
        if self.entries.is_empty() {
            return Ok(());
        }
        let presented = headers
            .get(axum::http::header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim)
            .ok_or_else(ApiError::unauthorized)?;
        let d = digest(presented);
        // Compare against every entry, without an early exit, in constant time per entry.
        let mut role = None;
        for (known, r) in &self.entries {
            if bool::from(known.ct_eq(&d)) {
                role = Some(*r);
            }
        }
        match role {
            None => Err(ApiError::unauthorized()),
            Some(r) if r.grants(needed) => Ok(()),
            Some(_) => Err(ApiError::forbidden(needed.name())),
        }
    }
}

/// An extractor that authorizes the request for role `R` before anything else of it is read:
/// a missing or wrong token is `401`, a token of another role `403` — even when the body is bad.
pub struct Auth<R>(std::marker::PhantomData<R>);

pub trait RoleMarker {
    const ROLE: Role;
}

pub struct AdminRole;
pub struct ClientRole;
pub struct WorkerRole;

impl RoleMarker for AdminRole {
    const ROLE: Role = Role::Admin;
}
impl RoleMarker for ClientRole {
    const ROLE: Role = Role::Client;
}
impl RoleMarker for WorkerRole {
    const ROLE: Role = Role::Worker;
}

impl<R: RoleMarker + Send + Sync> axum::extract::FromRequestParts<crate::app::AppState> for Auth<R> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &crate::app::AppState,
    ) -> Result<Self, Self::Rejection> {
        state.tokens.authorize(&parts.headers, R::ROLE)?;
        Ok(Auth(std::marker::PhantomData))
    }
}
