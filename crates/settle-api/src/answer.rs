//! JSON answers, written once for every route: serialized by serde_json and ended with a newline,
//! so that consecutive `curl` outputs in a terminal stay on lines of their own (issue 41).

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

/// `status` with `value` as its JSON body (`Content-Type: application/json`), ended by `\n`.
pub fn json<T: serde::Serialize>(status: StatusCode, value: &T) -> Response {
    match serde_json::to_vec(value) {
        Ok(mut body) => {
            body.push(b'\n');
            (status, [(header::CONTENT_TYPE, HeaderValue::from_static("application/json"))], body).into_response()
        }
        Err(e) => {
            tracing::error!(error = %e, "an answer could not be serialized");
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
    }
}
