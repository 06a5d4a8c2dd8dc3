//! What the provider adapters (`provider-v1`, `funding-v1`) share: one reused client with explicit
//! timeouts and no redirects, bounded answers, and the reading of lookups and sends — an id in a
//! success, a protocol's definitive code in a refusal, and nothing learned from anything else.

use crate::processor::{Lookup, Sent};
use settle_core::ids::FailCode;
use settle_core::limits;
use std::time::Duration;

/// Where a provider is and how long its calls may take.
#[derive(Debug, Clone)]
pub struct HttpProviderConfig {
    pub url: String,
    /// The whole request, connect included.
    pub timeout: Duration,
    pub connect_timeout: Duration,
}

/// A provider over HTTP: its base URL and one reused client.
pub(crate) struct Client {
    base: String,
    http: reqwest::Client,
}

/// A read answer: status, whether it said JSON, and the body (bounded).
pub(crate) struct Answer {
    pub status: u16,
    pub json: bool,
    pub retry_after_ms: Option<u64>,
    pub body: Vec<u8>,
}

impl Client {
    pub fn new(config: &HttpProviderConfig) -> Result<Client, String> {
        let http = reqwest::Client::builder()
            .timeout(config.timeout)
            .connect_timeout(config.connect_timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .map_err(|e| format!("provider client: {e}"))?;
        Ok(Client { base: config.url.trim_end_matches('/').to_owned(), http })
    }

    /// `GET {base}{path}`: an answer, or why none came.
    pub async fn get(&self, path: &str) -> Result<Answer, String> {
        match self.http.get(format!("{}{path}", self.base)).send().await {
            Ok(r) => read(r).await,
            Err(e) => Err(format!("no answer: {e}")),
        }
    }

    /// `POST {base}{path}` with a JSON body, read as a send: a connection never made is a refusal
    /// (`UNAVAILABLE`: the request did not leave, nothing can have executed); anything else without
    /// an answer is `NoAnswer`.
    pub async fn send(&self, path: &str, body: &serde_json::Value, id_field: &str, definitive: &[&str]) -> Sent {
        let request = self
            .http
            .post(format!("{}{path}", self.base))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(serde_json::to_vec(body).unwrap_or_default());
        let a = match request.send().await {
            Ok(r) => match read(r).await {
                Ok(a) => a,
                Err(message) => return Sent::NoAnswer { message },
            },
            Err(e) if e.is_connect() => {
                return Sent::Refused {
                    code: FailCode::parse("UNAVAILABLE").expect("a valid code"),
                    message: format!("cannot connect to the provider: {e}"),
                    retry_after_ms: None,
                };
            }
            Err(e) => return Sent::NoAnswer { message: format!("no answer: {e}") },
        };
        if (200..=299).contains(&a.status) {
            return match id_of(&a, id_field) {
                Some(id) => Sent::Executed { id },
                None => Sent::NoAnswer { message: format!("a {} answer without a {id_field}", a.status) },
            };
        }
        match error_body(&a) {
            Some((code, message)) if definitive.contains(&code.as_str()) => {
                let code = FailCode::parse(&code).expect("the definitive codes are valid");
                let retry_after_ms = if code.as_str() == "RATE_LIMITED" { a.retry_after_ms } else { None };
                Sent::Refused { code, message, retry_after_ms }
            }
            Some((code, message)) => {
                tracing::warn!(%code, %message, "the provider answered a code outside the protocol; outcome unknown");
                Sent::NoAnswer { message: format!("{} {code}: {message}", a.status) }
            }
            None => Sent::NoAnswer { message: format!("an answer outside the protocol (status {})", a.status) },
        }
    }
}

/// A lookup's answer other than a success: absent only when the provider itself says so (a `404`
/// with an empty or JSON body — an HTML 404 from a proxy or a wrong base URL proves nothing).
pub(crate) fn not_found(a: &Answer) -> Lookup {
    match a.status {
        404 if a.body.is_empty() || a.json => Lookup::Absent,
        status => Lookup::Failed {
            message: match error_body(a) {
                Some((code, message)) => format!("{status} {code}: {message}"),
                None => format!("an answer outside the protocol (status {status})"),
            },
        },
    }
}

async fn read(response: reqwest::Response) -> Result<Answer, String> {
    let status = response.status().as_u16();
    let json = response
        .headers()
        .get(reqwest::header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    let retry_after_ms = response
        .headers()
        .get(reqwest::header::RETRY_AFTER)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map(|s| s.saturating_mul(1_000));
    let mut response = response;
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await.map_err(|e| format!("reading the answer failed: {e}"))? {
        body.extend_from_slice(&chunk);
        if body.len() > limits::PROVIDER_BODY_BYTES_MAX {
            return Err("the answer is larger than the protocol allows".into());
        }
    }
    Ok(Answer { status, json, retry_after_ms, body })
}

/// `{"code", "message"}` of an error answer, if that is what it is.
fn error_body(a: &Answer) -> Option<(String, String)> {
    let v: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
    let code = v.get("code")?.as_str()?.to_owned();
    let message = v.get("message").and_then(|m| m.as_str()).unwrap_or("").to_owned();
    Some((code, message))
}

/// The provider's id in a success's body (`txid`, `charge_id`), if it is one the protocol allows.
pub(crate) fn id_of(a: &Answer, field: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
    let id = v.get(field)?.as_str()?.to_owned();
    if id.is_empty() || id.len() > limits::PROVIDER_TXID_LEN_MAX || id.chars().any(char::is_control) {
        return None;
    }
    Some(id)
}

/// The body's `status`, when there is one: a string as it is, anything else as its JSON text (which
/// no protocol knows).
pub(crate) fn status_of(a: &Answer) -> Option<String> {
    let v: serde_json::Value = serde_json::from_slice(&a.body).ok()?;
    match v.get("status") {
        None => None,
        Some(serde_json::Value::String(s)) => Some(s.clone()),
        Some(other) => Some(other.to_string()),
    }
}
