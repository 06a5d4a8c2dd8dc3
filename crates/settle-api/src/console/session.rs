//! Console sessions: sign in with a bearer token once, then a signed cookie.
//!
//! The cookie is `v1|NAME|ROLE|BINDING|EXPIRES|NONCE.SIG`, `SIG` the hex HMAC-SHA256 of the rest
//! under the console key: made at startup (a restart signs everyone out), or derived from
//! `SETTLE_CONSOLE_SECRET` so that every process behind one address accepts the others' sessions.
//! It carries no secret: `BINDING` is an HMAC of the token's digest, so every request re-checks
//! that the very token signed in with is still configured with the same role — a token rotated or
//! removed ends its sessions, even under the same name. Signing out revokes the session's nonce
//! until it would have expired, in the store (every process, and after a restart: decision 0028). Each session has a CSRF token, the HMAC of the
//! session under another label, which every form carries and every POST must present.

use super::key::SessionKey;
use crate::auth::{Actor, Role};
use crate::state::AppState;
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Redirect, Response};
use subtle::ConstantTimeEq;

pub const COOKIE: &str = "settle_console";
/// How long a session lasts after sign-in.
pub const SESSION_SECONDS: i64 = 8 * 3600;

/// A signed-in operator (or, with no tokens configured, the loopback operator).
#[derive(Debug, Clone)]
pub struct Session {
    pub actor: Actor,
    /// The CSRF token every form of this session carries.
    pub csrf: String,
    /// No tokens are configured: nobody signs in or out.
    pub loopback: bool,
    /// The digest of the token signed in with: the session's requests take from that token's
    /// request-rate bucket (`None` in loopback mode, which has no rate limit).
    pub token: Option<[u8; 32]>,
    nonce: String,
    expires: i64,
}

impl Session {
    pub fn can_act(&self) -> bool {
        self.actor.role == Role::Admin
    }

    /// Signs this session out until it would have expired: in this process at once, and in the
    /// store, for every process and after a restart.
    pub async fn sign_out(
        &self,
        key: &SessionKey,
        store: &dyn settle_store::Store,
        now: i64,
    ) -> Result<(), settle_store::StoreError> {
        key.revoke(&self.nonce, self.expires, now);
        store.operators().sign_out(&self.nonce, self.expires).await
    }

    /// Whether a submitted CSRF token is this session's.
    pub fn csrf_ok(&self, presented: &str) -> bool {
        !presented.is_empty() && bool::from(self.csrf.as_bytes().ct_eq(presented.as_bytes()))
    }
}

/// Every value of the cookie `name` (a browser may send several: another path's, another port's).
fn cookies<'h>(headers: &'h HeaderMap, name: &'h str) -> impl Iterator<Item = &'h str> + 'h {
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).filter_map(
        move |c| {
            let (k, v) = c.trim().split_once('=')?;
            (k == name).then_some(v)
        },
    )
}

pub fn now_unix() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// The session of a request, if any.
pub fn session_of(state: &AppState, headers: &HeaderMap) -> Option<Session> {
    let key = &state.console_key;
    if state.tokens.is_empty() {
        let csrf = key.sign("csrf", "loopback")[..32].to_owned();
        let actor = Actor { name: "loopback".into(), role: Role::Admin, scope: settle_core::scope::Scope::ALL };
        return Some(Session { actor, csrf, loopback: true, token: None, nonce: String::new(), expires: i64::MAX });
    }
    let now = now_unix();
    // Exactly one session may open. A browser sends a cookie set on a more specific path (or by a
    // sibling host) before the console's own, so "the first that opens" could be one planted by
    // someone holding another token; with two different live sessions in one request, neither is
    // trusted and the operator signs in again.
    let mut open = cookies(headers, COOKIE).filter_map(|v| key.open(v, now).map(|o| (v, o)));
    let (value, opened) = open.next()?;
    if open.any(|(other, _)| other != value) {
        tracing::warn!("two different console sessions in one request: neither is used");
        return None;
    }
    // Ended when its token is removed, rotated or given another role.
    let (actor, digest) = state.tokens.entry_of(&opened.name)?;
    let binding = key.binding(&digest);
    if actor.role != opened.role || !bool::from(binding.as_bytes().ct_eq(opened.binding.as_bytes())) {
        return None;
    }
    let csrf = key.sign("csrf", &opened.payload)[..32].to_owned();
    Some(Session { actor, csrf, loopback: false, token: Some(digest), nonce: opened.nonce, expires: opened.expires })
}

impl FromRequestParts<AppState> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Session, Response> {
        let to_login = || Redirect::to("/console/login").into_response();
        let session = session_of(state, &parts.headers).ok_or_else(to_login)?;
        // Signed out in another process, or before a restart: the store keeps every sign-out. A
        // store that cannot answer opens no session (fail closed).
        if !session.loopback {
            match state.store.operators().signed_out(&session.nonce).await {
                Ok(false) => {}
                Ok(true) => return Err(to_login()),
                Err(e) => {
                    tracing::warn!(error = %e, "console session check failed; not signed in");
                    return Err(to_login());
                }
            }
        }
        Ok(session)
    }
}

/// The `Set-Cookie` value of a new session (HttpOnly, SameSite=Strict, only under /console).
pub fn set_cookie(value: &str, secure: bool) -> String {
    let secure = if secure { "; Secure" } else { "" };
    format!("{COOKIE}={value}; Path=/console; Max-Age={SESSION_SECONDS}; HttpOnly; SameSite=Strict{secure}")
}

/// The `Set-Cookie` value that ends a session.
pub fn clear_cookie() -> String {
    format!("{COOKIE}=; Path=/console; Max-Age=0; HttpOnly; SameSite=Strict")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn actor(role: Role) -> Actor {
        Actor { name: "ops-1".into(), role, scope: settle_core::scope::Scope::ALL }
    }

    #[test]
    fn a_session_opens_only_with_its_signature_before_it_expires_and_until_signed_out() {
        let key = SessionKey::random();
        let digest = [7u8; 32];
        let value = key.issue(&actor(Role::Client), &digest, 1_000);
        let opened = key.open(&value, 999).expect("valid");
        assert_eq!((opened.name.as_str(), opened.role), ("ops-1", Role::Client));
        assert_eq!(opened.binding, key.binding(&digest));
        assert_ne!(opened.binding, key.binding(&[8u8; 32]), "another token, another binding");
        assert!(key.open(&value, 1_000).is_none(), "expired");
        assert!(SessionKey::random().open(&value, 999).is_none(), "another process's key");
        let forged = value.replacen("|client|", "|admin|", 1);
        assert!(key.open(&forged, 999).is_none(), "a role cannot be raised by editing the cookie");
        let (payload, sig) = value.rsplit_once('.').unwrap();
        let mut bad = sig.to_owned();
        bad.replace_range(0..1, if &sig[0..1] == "0" { "1" } else { "0" });
        assert!(key.open(&format!("{payload}.{bad}"), 999).is_none());
        // In this process at once (the store keeps it for the others: tests/it/console.rs).
        key.revoke(&opened.nonce, opened.expires, 999);
        assert!(key.open(&value, 999).is_none(), "signed out");
    }

    #[test]
    fn processes_sharing_a_secret_share_sessions() {
        let secret = "a-shared-console-secret-of-32-chars!";
        let (a, b) = (SessionKey::from_secret(secret).unwrap(), SessionKey::from_secret(secret).unwrap());
        let value = a.issue(&actor(Role::Admin), &[1u8; 32], 1_000);
        assert!(b.open(&value, 999).is_some());
        assert!(SessionKey::from_secret("short").is_err());
    }
}
