//! `ApiError`: every failure as the spec's body, `{"error": {"code", "message"}}`, with its status.
//! Internal errors are logged here, where they are handled, and answered without details.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use settle_store::StoreError;
use utoipa::ToSchema;

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorBody {
    /// What went wrong: a stable code to branch on and a sentence for people.
    pub error: ErrorDetail,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ErrorDetail {
    /// `invalid_request`, `unauthorized`, `forbidden`, `not_found`, `insufficient_credits`,
    /// `idempotency_conflict`, `job_finished`, `outcome_unknown`, `lease_lost`, `invalid_transition`,
    /// `payload_too_large`, `rate_limited`, `unavailable`, `internal`.
    pub code: String,
    /// A human sentence.
    pub message: String,
    /// With `lease_lost` on the worker routes: what became of the job and of the attempt whose
    /// token the report carried — `{"state", "lease": "expired" | "ended" | "never_issued",
    /// "attempt": {"attempt", "result", "reported", "finished_at", "expired_at"} | null}`.
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schema(value_type = Option<Object>)]
    pub details: Option<serde_json::Value>,
}

#[derive(Debug)]
pub struct ApiError {
    pub status: StatusCode,
    pub code: &'static str,
    pub message: String,
    /// Sent as `Retry-After` (seconds) with a `503`.
    pub retry_after_seconds: Option<u32>,
    pub details: Option<serde_json::Value>,
}

impl ApiError {
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError { status, code, message: message.into(), retry_after_seconds: None, details: None }
    }
    pub fn invalid(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request", message)
    }
    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found", message)
    }
    pub fn unauthorized() -> ApiError {
        ApiError::new(StatusCode::UNAUTHORIZED, "unauthorized", "A valid bearer token is required.")
    }
    pub fn forbidden(role: &str) -> ApiError {
        ApiError::new(StatusCode::FORBIDDEN, "forbidden", format!("This endpoint needs the {role} role."))
    }
    /// `503 unavailable`, with `Retry-After: 1`.
    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError {
            retry_after_seconds: Some(1),
            ..ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "unavailable", message)
        }
    }
    /// `429 rate_limited`: this token made more requests than its rate allows.
    pub fn rate_limited(retry_after: std::time::Duration) -> ApiError {
        let seconds = u32::try_from(retry_after.as_secs()).unwrap_or(u32::MAX).saturating_add(1);
        ApiError {
            retry_after_seconds: Some(seconds),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limited",
                "Too many requests with this token; retry later.",
            )
        }
    }
    pub fn too_large() -> ApiError {
        ApiError::new(StatusCode::PAYLOAD_TOO_LARGE, "payload_too_large", "The request body is larger than 1 MiB.")
    }
}

fn sentence(s: String) -> String {
    let mut chars = s.chars();
    let mut out = match chars.next() {
        Some(c) => c.to_uppercase().collect::<String>() + chars.as_str(),
        None => return s,
    };
    if !out.ends_with('.') {
        out.push('.');
    }
    out
}

/// A refused report's details (decision 0019).
fn lease_details(lost: &settle_store::LeaseLost) -> serde_json::Value {
    let time = |t: Option<settle_core::Timestamp>| t.map(|t| t.rfc3339());
    serde_json::json!({
        "state": lost.state.as_str(),
        "lease": lost.lease(),
        "attempt": lost.attempt.as_ref().map(|a| serde_json::json!({
            "attempt": a.attempt_no,
            "result": a.result.map(|r| r.as_str()),
            "reported": a.reported,
            "finished_at": time(a.finished_at),
            "expired_at": time(a.expired_at),
        })),
    })
}

impl From<StoreError> for ApiError {
    fn from(e: StoreError) -> ApiError {
        use StatusCode as S;
        match e {
            StoreError::Invalid(m) => ApiError::invalid(sentence(m)),
            StoreError::NotFound { .. } => ApiError::not_found(sentence(e.to_string())),
            StoreError::InsufficientCredits { .. }
            | StoreError::InsufficientBalance { .. }
            | StoreError::InsufficientCash { .. } => {
                ApiError::new(S::PAYMENT_REQUIRED, "insufficient_credits", sentence(e.to_string()))
            }
            StoreError::SpendLimitExceeded { ref exceeded } => ApiError {
                details: Some(serde_json::json!({
                    "period": exceeded.period.as_str(),
                    "amount": exceeded.amount,
                    "spent": exceeded.spent,
                    "remaining": exceeded.remaining,
                    "kinds": exceeded.kinds,
                    "needed": exceeded.needed,
                })),
                ..ApiError::new(S::PAYMENT_REQUIRED, "spend_limit_exceeded", sentence(e.to_string()))
            },
            StoreError::IdempotencyConflict { .. } | StoreError::IdTaken { .. } | StoreError::ReportConflict(_) => {
                ApiError::new(S::CONFLICT, "idempotency_conflict", sentence(e.to_string()))
            }
            StoreError::CostRequired { .. } => {
                ApiError::new(S::UNPROCESSABLE_ENTITY, "cost_required", sentence(e.to_string()))
            }
            StoreError::CostExceedsHold { .. } => {
                ApiError::new(S::UNPROCESSABLE_ENTITY, "cost_exceeds_hold", sentence(e.to_string()))
            }
            StoreError::JobFinished(_) => ApiError::new(S::CONFLICT, "job_finished", sentence(e.to_string())),
            StoreError::OutcomeUnknown(_) => ApiError::new(S::CONFLICT, "outcome_unknown", sentence(e.to_string())),
            StoreError::LeaseLost(lost) => ApiError {
                details: Some(lease_details(&lost)),
                ..ApiError::new(S::CONFLICT, "lease_lost", sentence(lost.to_string()))
            },
            StoreError::CursorAhead { epoch, restart_after, .. } => ApiError {
                details: Some(serde_json::json!({ "epoch": epoch, "restart_after": restart_after })),
                ..ApiError::new(S::CONFLICT, "cursor_ahead", sentence(e.to_string()))
            },
            StoreError::InvalidTransition { .. } => {
                ApiError::new(S::CONFLICT, "invalid_transition", sentence(e.to_string()))
            }
            StoreError::Overflow => {
                ApiError::invalid("The amounts would overflow the largest balance Settle keeps; nothing was written.")
            }
            StoreError::Unavailable(_) | StoreError::Retryable(_) => {
                tracing::warn!(error = %e, "store unavailable");
                ApiError::unavailable("The ledger is unavailable; retry shortly.")
            }
            StoreError::Busy(_) => {
                tracing::warn!(error = %e, "store busy: a lock or statement timeout");
                metrics::counter!("settle_store_busy_total").increment(1);
                ApiError::unavailable("The ledger is busy; nothing was written. Retry shortly.")
            }
            StoreError::CleanupFailed { .. }
            | StoreError::InjectedCrash(_)
            | StoreError::NotSettle(_)
            | StoreError::Internal(_) => {
                tracing::error!(error = %e, "internal error");
                ApiError::new(S::INTERNAL_SERVER_ERROR, "internal", "An internal error occurred.")
            }
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let body = ErrorBody {
            error: ErrorDetail { code: self.code.to_owned(), message: self.message, details: self.details },
        };
        let mut response = crate::answer::json(self.status, &body);
        if let Some(seconds) = self.retry_after_seconds {
            response.headers_mut().insert(axum::http::header::RETRY_AFTER, seconds.into());
        }
        response
    }
}
