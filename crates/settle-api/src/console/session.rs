//! Console sessions: sign in with a bearer token once, then a signed cookie.
//!
//! The cookie is `v1|NAME|ROLE|EXPIRES|NONCE.SIG`, `SIG` the hex HMAC-SHA256 of the rest under a
//! key made at startup (a restart signs everyone out). It carries no secret: the token itself is
//! never stored. Every request re-checks that the token named in it is still configured with the
//! same role, so removing a token ends its sessions. Each session has a CSRF token, the HMAC of the
//! session under another label, which every form carries and every POST must present.

use crate::app::AppState;
use crate::auth::{Actor, Role};
use axum::extract::FromRequestParts;
use axum::http::request::Parts;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Redirect, Response};
use settle_core::signature::hmac_sha256;
use subtle::ConstantTimeEq;

pub const COOKIE: &str = "settle_console";
/// How long a session lasts after sign-in.
pub const SESSION_SECONDS: i64 = 8 * 3600;

/// The key that signs sessions, made once per process.
#[derive(Clone)]
pub struct SessionKey([u8; 32]);

impl SessionKey {
    pub fn random() -> SessionKey {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the operating system's random source works");
        SessionKey(key)
    }

    fn sign(&self, label: &str, payload: &str) -> String {
        hex::encode(hmac_sha256(&self.0, format!("{label}|{payload}").as_bytes()))
    }

    /// A new session's cookie value for `actor`, valid until `expires` (unix seconds).
    pub fn issue(&self, actor: &Actor, expires: i64) -> String {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).expect("the operating system's random source works");
        let payload = format!("v1|{}|{}|{}|{}", actor.name, actor.role.name(), expires, hex::encode(nonce));
        let sig = self.sign("session", &payload);
        format!("{payload}.{sig}")
    }

    /// The session a cookie value names, if its signature holds and it has not expired.
    fn open(&self, value: &str, now: i64) -> Option<(String, Role, String)> {
        let (payload, sig) = value.rsplit_once('.')?;
        let expected = self.sign("session", payload);
        if !bool::from(expected.as_bytes().ct_eq(sig.as_bytes())) {
            return None;
        }
        let mut parts = payload.split('|');
        let (version, name, role, expires) = (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
        if version != "v1" || expires.parse::<i64>().ok()? <= now {
            return None;
        }
        Some((name.to_owned(), Role::parse(role)?, payload.to_owned()))
    }
}

/// A signed-in operator (or, with no tokens configured, the loopback operator).
#[derive(Debug, Clone)]
pub struct Session {
    pub actor: Actor,
    /// The CSRF token every form of this session carries.
    pub csrf: String,
    /// No tokens are configured: nobody signs in or out.
    pub loopback: bool,
}

impl Session {
    pub fn can_act(&self) -> bool {
        self.actor.role == Role::Admin
    }

    /// Whether a submitted CSRF token is this session's.
    pub fn csrf_ok(&self, presented: &str) -> bool {
        !presented.is_empty() && bool::from(self.csrf.as_bytes().ct_eq(presented.as_bytes()))
    }
}

fn cookie(headers: &HeaderMap, name: &str) -> Option<String> {
    headers.get_all(header::COOKIE).iter().filter_map(|v| v.to_str().ok()).flat_map(|v| v.split(';')).find_map(|c| {
        let (k, v) = c.trim().split_once('=')?;
        (k == name).then(|| v.to_owned())
    })
}

pub fn now_unix() -> i64 {
    time::OffsetDateTime::now_utc().unix_timestamp()
}

/// The session of a request, if any.
pub fn session_of(state: &AppState, headers: &HeaderMap) -> Option<Session> {
    let key = &state.console_key;
    if state.tokens.is_empty() {
        let csrf = key.sign("csrf", "loopback")[..32].to_owned();
        return Some(Session { actor: Actor { name: "loopback".into(), role: Role::Admin }, csrf, loopback: true });
    }
    let (name, role, payload) = key.open(&cookie(headers, COOKIE)?, now_unix())?;
    // Signed out everywhere when the token is removed or its role changes.
    if state.tokens.role_of(&name) != Some(role) {
        return None;
    }
    let csrf = key.sign("csrf", &payload)[..32].to_owned();
    Some(Session { actor: Actor { name, role }, csrf, loopback: false })
}

impl FromRequestParts<AppState> for Session {
    type Rejection = Response;

    async fn from_request_parts(parts: &mut Parts, state: &AppState) -> Result<Session, Response> {
        session_of(state, &parts.headers).ok_or_else(|| Redirect::to("/console/login").into_response())
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
        Actor { name: "ops-1".into(), role }
    }

    #[test]
    fn a_session_opens_only_with_its_signature_and_before_it_expires() {
        let key = SessionKey::random();
        let value = key.issue(&actor(Role::Client), 1_000);
        let (name, role, _) = key.open(&value, 999).expect("valid");
        assert_eq!((name.as_str(), role), ("ops-1", Role::Client));
        assert!(key.open(&value, 1_000).is_none(), "expired");
        assert!(SessionKey::random().open(&value, 999).is_none(), "another process's key");
        let forged = value.replacen("|client|", "|admin|", 1);
        assert!(key.open(&forged, 999).is_none(), "a role cannot be raised by editing the cookie");
        let (payload, sig) = value.rsplit_once('.').unwrap();
        let mut bad = sig.to_owned();
        bad.replace_range(0..1, if &sig[0..1] == "0" { "1" } else { "0" });
        assert!(key.open(&format!("{payload}.{bad}"), 999).is_none());
    }
}
