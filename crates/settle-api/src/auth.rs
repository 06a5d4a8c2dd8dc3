//! Bearer tokens with roles `admin` ⊇ {`client`, `worker`}.
//!
//! Tokens come from a file (`--tokens FILE`, `#` comments) or the environment
//! (`SETTLE_TOKENS="admin=…,worker:ci=…"`). A file line is `ROLE TOKEN [NAME]`, or — so the file holds
//! no secret — `ROLE sha256:HEX NAME` with the hex SHA-256 of the token. Any number of tokens per
//! role, each with a unique name (default `ROLE-LINE`): the name is the actor in logs and in the
//! action log, so a token can be rotated (add the new one, then remove the old) and revoked alone.
//! A client or worker token may be scoped (decision 0018): `ROLE TOKEN NAME accounts=acme-*,bob
//! kinds=render` sees and moves only those accounts (by exact id or prefix) and job kinds; worker
//! tokens take only `kinds=`, admin tokens no scope at all.
//! Tokens are compared as SHA-256 digests in constant time. With no token configured, every request
//! is allowed (actor `loopback`) and the server only binds a loopback address. A server holds its
//! set as `LiveTokens`, which SIGHUP replaces whole (rotation without a restart). `/metrics` is open
//! unless a metrics token is set (`SETTLE_METRICS_TOKEN`), which no role's token replaces.

use crate::error::ApiError;
use axum::http::HeaderMap;
use settle_core::scope::Scope;
use sha2::{Digest, Sha256};
use std::sync::{Arc, RwLock};
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

/// Who made a request: the token's name, role and scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Actor {
    pub name: String,
    pub role: Role,
    /// What the token may see and move (`Scope::ALL` unless configured).
    pub scope: Scope,
}

impl Actor {
    /// `403 forbidden` unless the scope names this account (for what a request would create).
    pub fn may_use_account(&self, account: &str) -> Result<(), ApiError> {
        if self.scope.account(account) {
            return Ok(());
        }
        Err(ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "forbidden",
            format!("This token's scope does not include account {account}."),
        ))
    }

    /// `403 forbidden` unless the scope names this job kind.
    pub fn may_use_kind(&self, kind: &str) -> Result<(), ApiError> {
        if self.scope.kind(kind) {
            return Ok(());
        }
        Err(ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "forbidden",
            format!("This token's scope does not include the job kind {kind}."),
        ))
    }

    /// Buying credits charges a customer: an unscoped token may; a scoped one only when its scope
    /// names the kind `top_up` itself (a scope of accounts alone does not), so a tenant's token
    /// never charges anyone by default (decision 0035).
    pub fn may_buy(&self) -> Result<(), ApiError> {
        let kind = settle_core::job::TOP_UP_KIND;
        let named = self.scope.kinds.as_ref().is_some_and(|ks| ks.iter().any(|k| k.as_str() == kind));
        if self.scope.is_all() || named {
            return Ok(());
        }
        Err(ApiError::new(
            axum::http::StatusCode::FORBIDDEN,
            "forbidden",
            format!("A scoped token buys credits only when its scope names the kind {kind}."),
        ))
    }
}

impl std::fmt::Display for Actor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name)
    }
}

#[derive(Clone, Default)]
pub struct Tokens {
    entries: Vec<Entry>,
    /// The SHA-256 of the token `/metrics` asks for, when it asks for one.
    metrics: Option<[u8; 32]>,
}

/// The tokens a server checks, replaced whole while it serves (SIGHUP re-reads the tokens file): a
/// request is checked against the set that was current when it asked, never half of each.
#[derive(Clone, Default)]
pub struct LiveTokens(Arc<RwLock<Arc<Tokens>>>);

impl LiveTokens {
    pub fn new(tokens: Tokens) -> LiveTokens {
        LiveTokens(Arc::new(RwLock::new(Arc::new(tokens))))
    }

    pub fn current(&self) -> Arc<Tokens> {
        self.0.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Puts `tokens` in place of the current set. Refused when it would turn authentication on or
    /// off: whether the server may listen beyond loopback was decided by the set it started with.
    pub fn replace(&self, tokens: Tokens) -> Result<(), String> {
        let mut current = self.0.write().unwrap_or_else(|e| e.into_inner());
        if current.is_empty() != tokens.is_empty() {
            return Err(if tokens.is_empty() {
                "the new set names no token: a server started with tokens keeps authentication on (restart without them to serve on loopback only)".to_owned()
            } else {
                "the server started without tokens (loopback mode): restart it to turn authentication on".to_owned()
            });
        }
        *current = Arc::new(tokens);
        Ok(())
    }

    pub fn is_empty(&self) -> bool {
        self.current().is_empty()
    }

    pub fn identify(&self, headers: &HeaderMap) -> Option<[u8; 32]> {
        self.current().identify(headers)
    }

    pub fn actor_of(&self, presented: &str) -> Option<Actor> {
        self.current().actor_of(presented)
    }

    pub fn entry_of(&self, name: &str) -> Option<(Actor, [u8; 32])> {
        self.current().entry_of(name)
    }

    pub fn authorize(&self, headers: &HeaderMap, needed: Role) -> Result<Actor, ApiError> {
        self.current().authorize(headers, needed)
    }

    pub fn authorize_metrics(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        self.current().authorize_metrics(headers)
    }
}

#[derive(Clone)]
struct Entry {
    digest: [u8; 32],
    role: Role,
    name: String,
    scope: Scope,
}

impl Entry {
    fn actor(&self) -> Actor {
        Actor { name: self.name.clone(), role: self.role, scope: self.scope.clone() }
    }
}

fn check_name(name: &str) -> Result<(), String> {
    let ok = !name.is_empty()
        && name.len() <= 64
        && name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '.' | ':' | '@' | '-'));
    if !ok {
        // Not echoed: a line with its token and name swapped would print the token.
        return Err("a token's name is 1-64 characters of [A-Za-z0-9_.:@-] (is the line ROLE TOKEN NAME?)".to_owned());
    }
    Ok(())
}

impl std::fmt::Debug for Tokens {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Tokens({} configured)", self.entries.len())
    }
}

/// The token of an `Authorization: Bearer …` header.
fn bearer(headers: &HeaderMap) -> Option<&str> {
    headers
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
}

fn digest(token: &str) -> [u8; 32] {
    Sha256::digest(token.as_bytes()).into()
}

impl Tokens {
    /// How many tokens are configured (the metrics token aside).
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// `/metrics` answers only to `Authorization: Bearer <token>` (no role grants it: a scraper
    /// holds this token and nothing else).
    pub fn set_metrics_token(&mut self, token: &str) -> Result<(), String> {
        if token.trim().len() < 16 {
            return Err("the metrics token must be at least 16 characters".to_owned());
        }
        self.metrics = Some(digest(token.trim()));
        Ok(())
    }

    /// `/metrics`: open without a metrics token; with one, 401 unless it is presented.
    pub fn authorize_metrics(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(expected) = self.metrics else { return Ok(()) };
        let presented = bearer(headers).ok_or_else(ApiError::unauthorized)?;
        if bool::from(expected.ct_eq(&digest(presented))) { Ok(()) } else { Err(ApiError::unauthorized()) }
    }

    pub fn add(&mut self, role: Role, token: &str) -> Result<(), String> {
        let name = format!("{}-{}", role.name(), self.entries.len() + 1);
        self.add_named(role, token, &name)
    }

    pub fn add_named(&mut self, role: Role, token: &str, name: &str) -> Result<(), String> {
        if token.len() < 16 {
            return Err(format!("a {} token must be at least 16 characters", role.name()));
        }
        self.add_digest(role, digest(token), name)
    }

    /// A token known only by its SHA-256 (the file keeps no secret).
    pub fn add_digest(&mut self, role: Role, digest: [u8; 32], name: &str) -> Result<(), String> {
        self.add_digest_scoped(role, digest, name, Scope::ALL)
    }

    /// A token that sees and moves only what `scope` names (decision 0018).
    pub fn add_scoped(&mut self, role: Role, token: &str, name: &str, scope: Scope) -> Result<(), String> {
        if token.len() < 16 {
            return Err(format!("a {} token must be at least 16 characters", role.name()));
        }
        self.add_digest_scoped(role, digest(token), name, scope)
    }

    fn add_digest_scoped(&mut self, role: Role, digest: [u8; 32], name: &str, scope: Scope) -> Result<(), String> {
        check_name(name)?;
        match role {
            Role::Admin if !scope.is_all() => {
                return Err(format!("token {name}: admin tokens are not scoped (use a client or worker token)"));
            }
            Role::Worker if scope.accounts.is_some() => {
                return Err(format!("token {name}: worker tokens are scoped by kinds= only"));
            }
            _ => {}
        }
        if self.entries.iter().any(|e| e.name == name) {
            return Err(format!("two tokens are named {name}"));
        }
        if self.entries.iter().any(|e| e.digest == digest) {
            return Err(format!("token {name} is configured twice"));
        }
        self.entries.push(Entry { digest, role, name: name.to_owned(), scope });
        Ok(())
    }

    /// `ROLE TOKEN [NAME [SCOPE…]]` lines; blank lines and `#` comments are skipped.
    pub fn parse_file(text: &str) -> Result<Tokens, String> {
        let mut tokens = Tokens::default();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() || line.starts_with('#') {
                continue;
            }
            let mut parts = line.split_whitespace();
            let (Some(role), Some(token), name) = (parts.next(), parts.next(), parts.next()) else {
                return Err(format!("line {}: expected `ROLE TOKEN [NAME]` or `ROLE sha256:HEX NAME`", n + 1));
            };
            if name.is_some_and(|n| n.contains('=')) {
                return Err(format!("line {}: a scoped token needs a name before its scope", n + 1));
            }
            let scope = Scope::parse_words(parts).map_err(|e| format!("line {}: {e}", n + 1))?;
            let role = Role::parse(role).ok_or_else(|| format!("line {}: unknown role {role}", n + 1))?;
            let default_name = format!("{}-{}", role.name(), n + 1);
            let added = match token.strip_prefix("sha256:") {
                Some(hex_digest) => {
                    let name = name.ok_or("a hashed token needs a name")?;
                    let bytes = hex::decode(hex_digest).ok().filter(|b| b.len() == 32);
                    let digest: [u8; 32] = bytes
                        .and_then(|b| b.try_into().ok())
                        .ok_or("sha256: takes 64 hex digits (the SHA-256 of the token)")?;
                    tokens.add_digest_scoped(role, digest, name, scope)
                }
                None => tokens.add_scoped(role, token, name.unwrap_or(&default_name), scope),
            };
            added.map_err(|e| format!("line {}: {e}", n + 1))?;
        }
        Ok(tokens)
    }

    /// `role=token,role=token`.
    pub fn parse_env(text: &str) -> Result<Tokens, String> {
        let mut tokens = Tokens::default();
        for pair in text.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (who, token) =
                pair.split_once('=').ok_or_else(|| "expected role=token or role:name=token".to_owned())?;
            let (role, name) = match who.split_once(':') {
                Some((role, name)) => (role.trim(), Some(name.trim())),
                None => (who.trim(), None),
            };
            let role = Role::parse(role).ok_or_else(|| format!("unknown role {role}"))?;
            match name {
                Some(name) => tokens.add_named(role, token.trim(), name)?,
                None => tokens.add(role, token.trim())?,
            }
        }
        Ok(tokens)
    }

    /// The digest of the presented token when it is a configured one (the key of its limits).
    pub fn identify(&self, headers: &HeaderMap) -> Option<[u8; 32]> {
        let d = digest(bearer(headers)?);
        let mut found = None;
        for e in &self.entries {
            if bool::from(e.digest.ct_eq(&d)) {
                found = Some(d);
            }
        }
        found
    }

    /// The actor of a presented token, if it is a configured one (compared in constant time
    /// against every entry, without an early exit).
    pub fn actor_of(&self, presented: &str) -> Option<Actor> {
        let d = digest(presented.trim());
        let mut found = None;
        for e in &self.entries {
            if bool::from(e.digest.ct_eq(&d)) {
                found = Some(e.actor());
            }
        }
        found
    }

    /// The actor and digest of the token named `name`, while it is configured (a console session
    /// ends when its token is removed, rotated or given another role, and follows its scope).
    pub fn entry_of(&self, name: &str) -> Option<(Actor, [u8; 32])> {
        self.entries.iter().find(|e| e.name == name).map(|e| (e.actor(), e.digest))
    }

    /// The digest of a presented token (what a console session is bound to).
    pub fn digest_of(presented: &str) -> [u8; 32] {
        digest(presented.trim())
    }

    /// Checks the `Authorization: Bearer …` header for `needed`: 401 without a known token,
    /// 403 with a known token of another role.
    pub fn authorize(&self, headers: &HeaderMap, needed: Role) -> Result<Actor, ApiError> {
        if self.entries.is_empty() {
            return Ok(Actor { name: "loopback".to_owned(), role: Role::Admin, scope: Scope::ALL });
        }
        let presented = bearer(headers).ok_or_else(ApiError::unauthorized)?;
        let d = digest(presented);
        // Compare against every entry, without an early exit, in constant time per entry.
        let mut found = None;
        for e in &self.entries {
            if bool::from(e.digest.ct_eq(&d)) {
                found = Some(e);
            }
        }
        match found {
            None => Err(ApiError::unauthorized()),
            Some(e) if e.role.grants(needed) => Ok(e.actor()),
            Some(e) => {
                tracing::info!(actor = %e.name, needed = needed.name(), "token of another role refused");
                Err(ApiError::forbidden(needed.name()))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bearer(token: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(axum::http::header::AUTHORIZATION, format!("Bearer {token}").parse().unwrap());
        h
    }

    #[test]
    fn files_hold_hashes_and_names() {
        let hashed = hex::encode(Sha256::digest(b"alice-admin-token-0123"));
        let file = format!(
            "# rotated on 2026-11-30\nadmin sha256:{hashed} ops-alice\nadmin bob-admin-token-0123456 ops-bob\nworker worker-token-0123456789\n"
        );
        let t = Tokens::parse_file(&file).unwrap();
        let actor = t.authorize(&bearer("alice-admin-token-0123"), Role::Client).unwrap();
        assert_eq!((actor.name.as_str(), actor.role), ("ops-alice", Role::Admin));
        assert_eq!(t.authorize(&bearer("bob-admin-token-0123456"), Role::Admin).unwrap().name, "ops-bob");
        assert_eq!(t.authorize(&bearer("worker-token-0123456789"), Role::Worker).unwrap().name, "worker-4");
        assert!(t.authorize(&bearer(&format!("sha256:{hashed}")), Role::Admin).is_err(), "the hash is not the token");
        for bad in [
            format!("admin sha256:{hashed}\n"),
            "admin sha256:abcd ops\n".to_owned(),
            format!("admin sha256:{hashed} ops\nclient sha256:{hashed} other\n"),
            "admin a-token-0123456789 ops\nclient b-token-0123456789 ops\n".to_owned(),
            "admin a-token-0123456789 bad name\n".to_owned(),
            "admin short ops\n".to_owned(),
        ] {
            assert!(Tokens::parse_file(&bad).is_err(), "{bad}");
        }
        let env = Tokens::parse_env("admin:ops-carol=carol-token-0123456789,worker=w-token-0123456789").unwrap();
        assert_eq!(env.authorize(&bearer("carol-token-0123456789"), Role::Admin).unwrap().name, "ops-carol");
    }

    #[test]
    fn scoped_tokens_are_read_from_a_file_and_admin_tokens_are_never_scoped() {
        let file = "client acme-client-token-0123 acme accounts=acme-*,acme kinds=render\n\
                    worker render-worker-token-01 gpu kinds=render,thumb\n\
                    client plain-client-token-012 plain\n";
        let t = Tokens::parse_file(file).unwrap();
        let acme = t.authorize(&bearer("acme-client-token-0123"), Role::Client).unwrap();
        assert_eq!(acme.scope.to_string(), "accounts=acme-*,acme kinds=render");
        assert!(acme.may_use_account("acme-7").is_ok() && acme.may_use_account("globex").is_err());
        assert!(acme.may_use_kind("render").is_ok() && acme.may_use_kind("withdrawal").is_err());
        let gpu = t.authorize(&bearer("render-worker-token-01"), Role::Worker).unwrap();
        assert!(gpu.scope.accounts.is_none() && gpu.scope.kind("thumb") && !gpu.scope.kind("payout"));
        assert!(t.authorize(&bearer("plain-client-token-012"), Role::Client).unwrap().scope.is_all());
        let (actor, _) = t.entry_of("acme").unwrap();
        assert_eq!(actor.scope, acme.scope, "a console session follows its token's scope");
        for bad in [
            "admin admin-token-0123456789 ops accounts=a\n",
            "worker worker-token-012345678 w accounts=a\n",
            "client client-token-012345678 accounts=a\n",
            "client client-token-012345678 c accounts=\n",
            "client client-token-012345678 c colour=blue\n",
        ] {
            assert!(Tokens::parse_file(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_token_is_at_least_16_characters_in_a_file_and_in_the_environment() {
        let at_edge = "a".repeat(16);
        let short = "a".repeat(15);
        assert!(Tokens::parse_file(&format!("admin {at_edge}\n")).is_ok());
        let e = Tokens::parse_file(&format!("admin {short}\n")).err().unwrap();
        assert!(e.contains("line 1") && e.contains("at least 16"), "{e}");
        assert!(Tokens::parse_env(&format!("worker={at_edge}")).is_ok());
        assert!(Tokens::parse_env(&format!("worker={short}")).unwrap_err().contains("at least 16"));
        let mut t = Tokens::default();
        assert!(t.add(Role::Client, &short).is_err());
        assert!(t.is_empty(), "a refused token is not kept");
    }

    #[test]
    fn environment_and_file_parsing_refuse_what_they_do_not_understand() {
        for bad in
            ["admin", "root=aaaaaaaaaaaaaaaaaaaa", "admin:two words=aaaaaaaaaaaaaaaaaaaa", "=aaaaaaaaaaaaaaaaaaaa"]
        {
            assert!(Tokens::parse_env(bad).is_err(), "{bad}");
        }
        // Blank entries and surrounding space are fine; several tokens per role, each its own name.
        let t = Tokens::parse_env(" admin=aaaaaaaaaaaaaaaaaaaa , ,admin=bbbbbbbbbbbbbbbbbbbb ").unwrap();
        assert_eq!(t.authorize(&bearer("aaaaaaaaaaaaaaaaaaaa"), Role::Admin).unwrap().name, "admin-1");
        assert_eq!(t.authorize(&bearer("bbbbbbbbbbbbbbbbbbbb"), Role::Admin).unwrap().name, "admin-2");
        for bad in ["admin", "superuser aaaaaaaaaaaaaaaaaaaa", "admin aaaaaaaaaaaaaaaaaaaa name extra"] {
            let e = Tokens::parse_file(bad).err().unwrap_or_default();
            assert!(e.starts_with("line 1"), "{bad}: {e:?}");
        }
        let t = Tokens::parse_file("# only comments\n\n   \n").unwrap();
        assert!(t.is_empty());
        // A wrong token, a token of another role and no token at all are told apart.
        let t = Tokens::parse_env("worker=wwwwwwwwwwwwwwwwwwww").unwrap();
        assert!(t.authorize(&HeaderMap::new(), Role::Worker).is_err());
        assert!(t.authorize(&bearer("wwwwwwwwwwwwwwwwwwww"), Role::Worker).is_ok());
        assert!(t.authorize(&bearer("wwwwwwwwwwwwwwwwwwww"), Role::Client).is_err());
        assert!(t.authorize(&bearer("wwwwwwwwwwwwwwwwwwwx"), Role::Worker).is_err());
    }
}
