//! The `Host` rule of loopback mode. With no token configured the server asks for no credentials
//! and binds a loopback address only, but a page on any site can still reach it from the
//! operator's browser by DNS rebinding (`attacker.example` resolving to 127.0.0.1): the request
//! arrives on loopback carrying the attacker's name in `Host`. So in loopback mode every route —
//! the API, the console, the reference — answers only requests whose `Host` is a loopback name.

use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::{Request, State};
use axum::http::StatusCode;
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::{IpAddr, Ipv6Addr};

/// Whether `host` (a `Host` header or an `:authority`, with or without a port) names this machine's
/// loopback interface: `localhost`, or an IP address in 127.0.0.0/8 or `::1`. Only an address that
/// parses whole counts — `127.attacker.example` and `127.0.0.1.nip.io` are names anyone can point
/// anywhere.
pub fn is_loopback_host(host: &str) -> bool {
    let name = match host.strip_prefix('[') {
        // `[::1]:7070`: the address is what the brackets hold, and only a port may follow them.
        Some(rest) => match rest.split_once(']') {
            Some((v6, tail)) if tail.is_empty() || port(tail.strip_prefix(':')) => {
                return v6.parse::<Ipv6Addr>().is_ok_and(|ip| ip.is_loopback());
            }
            _ => return false,
        },
        None => match host.rsplit_once(':') {
            Some((name, p)) if port(Some(p)) => name,
            Some(_) => return false,
            None => host,
        },
    };
    name.eq_ignore_ascii_case("localhost") || name.parse::<IpAddr>().is_ok_and(|ip| ip.is_loopback())
}

fn port(p: Option<&str>) -> bool {
    p.is_some_and(|p| !p.is_empty() && p.len() <= 5 && p.bytes().all(|b| b.is_ascii_digit()))
}

/// The name a request was sent to: its `Host` header, or the URI's authority (HTTP/2).
pub fn request_host(req: &Request) -> Option<&str> {
    req.headers()
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .or_else(|| req.uri().authority().map(|a| a.as_str()))
}

/// Whether a request that can change something comes from a page of another site. A browser says
/// so with `Sec-Fetch-Site` and `Origin`; a page anywhere can make the operator's browser send a
/// form POST to `http://127.0.0.1:7070` (its `Host` is loopback, and a form needs no CORS
/// preflight), and in loopback mode that request is an admin's. Clients that send neither header
/// (curl, the SDKs) are not browsers a page could drive.
fn cross_site(req: &Request) -> bool {
    if matches!(*req.method(), axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS) {
        return false;
    }
    let headers = req.headers();
    let site = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok());
    if site.is_some_and(|s| s != "same-origin" && s != "none") {
        return true;
    }
    match headers.get(axum::http::header::ORIGIN).and_then(|v| v.to_str().ok()) {
        None => false,
        Some(origin) => !origin.split_once("://").is_some_and(|(_, authority)| is_loopback_host(authority)),
    }
}

/// In loopback mode, `403 forbidden` before anything else for a request whose `Host` is not a
/// loopback name (or that names none), and for a write sent by another site's page.
pub async fn loopback_only(State(s): State<AppState>, req: Request, next: Next) -> Response {
    if !s.tokens.is_empty() {
        return next.run(req).await;
    }
    let host = request_host(&req).unwrap_or("");
    if !is_loopback_host(host) {
        tracing::warn!(%host, "request for a non-loopback host refused in loopback mode");
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "Without tokens Settle answers requests addressed to a loopback name only (localhost, 127.0.0.1, [::1]).",
        )
        .into_response();
    }
    if cross_site(&req) {
        tracing::warn!(%host, "a write from another site's page refused in loopback mode");
        return ApiError::new(
            StatusCode::FORBIDDEN,
            "forbidden",
            "Without tokens Settle accepts no write sent by another site's page.",
        )
        .into_response();
    }
    next.run(req).await
}

#[cfg(test)]
mod tests {
    use super::is_loopback_host;

    #[test]
    fn only_loopback_names_and_addresses_count() {
        for ok in ["localhost", "LOCALHOST:7070", "127.0.0.1", "127.0.0.1:7070", "127.1.2.3:80", "[::1]", "[::1]:7070"]
        {
            assert!(is_loopback_host(ok), "{ok}");
        }
        for bad in [
            "",
            "attacker.example",
            "attacker.example:7070",
            "127.attacker.example",
            "127.0.0.1.nip.io:7070",
            "localhost.attacker.example",
            "10.0.0.1:7070",
            "[::2]:7070",
            "[::1]x",
            "[::1]:",
            "127.0.0.1:",
            "127.0.0.1:70x",
            "127.0.0.1:7070:1",
            "::1",
            "0.0.0.0:7070",
        ] {
            assert!(!is_loopback_host(bad), "{bad}");
        }
    }
}
