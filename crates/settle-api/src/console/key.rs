//! The key that signs console sessions (see `session` for the cookie), below the state that holds
//! it and the sessions that use it.

use crate::auth::{Actor, Role};
use settle_core::signature::hmac_sha256;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use subtle::ConstantTimeEq;

/// The key that signs sessions, and the nonces signed out before they expired.
#[derive(Clone)]
pub struct SessionKey {
    key: [u8; 32],
    revoked: Arc<Mutex<HashMap<String, i64>>>,
}

impl SessionKey {
    /// A key of this process alone.
    pub fn random() -> SessionKey {
        let mut key = [0u8; 32];
        getrandom::fill(&mut key).expect("the operating system's random source works");
        SessionKey { key, revoked: Arc::default() }
    }

    /// A key every process configured with the same secret shares (at least 32 characters).
    pub fn from_secret(secret: &str) -> Result<SessionKey, String> {
        if secret.len() < 32 {
            return Err("SETTLE_CONSOLE_SECRET must be at least 32 characters".into());
        }
        Ok(SessionKey { key: hmac_sha256(secret.as_bytes(), b"settle.console.v1"), revoked: Arc::default() })
    }

    /// Ties a session to the token that opened it (its digest, never the token).
    pub fn binding(&self, token_digest: &[u8; 32]) -> String {
        self.sign("binding", &hex::encode(token_digest))[..32].to_owned()
    }

    /// Signs the session of `nonce` out in this process until it would have expired (`expires`).
    pub fn revoke(&self, nonce: &str, expires: i64, now: i64) {
        let mut revoked = self.revoked.lock().unwrap_or_else(|p| p.into_inner());
        revoked.retain(|_, until| *until > now);
        revoked.insert(nonce.to_owned(), expires);
    }

    fn is_revoked(&self, nonce: &str) -> bool {
        self.revoked.lock().unwrap_or_else(|p| p.into_inner()).contains_key(nonce)
    }

    pub(super) fn sign(&self, label: &str, payload: &str) -> String {
        hex::encode(hmac_sha256(&self.key, format!("{label}|{payload}").as_bytes()))
    }

    /// A new session's cookie value for `actor` (signed in with the token of `token_digest`),
    /// valid until `expires` (unix seconds).
    pub fn issue(&self, actor: &Actor, token_digest: &[u8; 32], expires: i64) -> String {
        let mut nonce = [0u8; 16];
        getrandom::fill(&mut nonce).expect("the operating system's random source works");
        let binding = self.binding(token_digest);
        let payload = format!("v1|{}|{}|{binding}|{expires}|{}", actor.name, actor.role.name(), hex::encode(nonce));
        let sig = self.sign("session", &payload);
        format!("{payload}.{sig}")
    }

    /// The session a cookie value names, if its signature holds, it has not expired and it was
    /// not signed out.
    pub(super) fn open(&self, value: &str, now: i64) -> Option<Opened> {
        let (payload, sig) = value.rsplit_once('.')?;
        let expected = self.sign("session", payload);
        if !bool::from(expected.as_bytes().ct_eq(sig.as_bytes())) {
            return None;
        }
        let parts: Vec<&str> = payload.split('|').collect();
        let [version, name, role, binding, expires, nonce] = parts.as_slice() else { return None };
        let expires = expires.parse::<i64>().ok()?;
        if *version != "v1" || expires <= now || self.is_revoked(nonce) {
            return None;
        }
        Some(Opened {
            name: (*name).to_owned(),
            role: Role::parse(role)?,
            binding: (*binding).to_owned(),
            expires,
            nonce: (*nonce).to_owned(),
            payload: payload.to_owned(),
        })
    }
}

pub(super) struct Opened {
    pub(super) name: String,
    pub(super) role: Role,
    pub(super) binding: String,
    pub(super) expires: i64,
    pub(super) nonce: String,
    pub(super) payload: String,
}
