//! Extractors whose rejections are the spec's error body: malformed JSON, wrong types and unknown
//! fields are `400 invalid_request`, an oversized body `413 payload_too_large`; [`Auth`] authorizes
//! a request for a role before anything else of it is read.

use crate::auth::{Actor, Role};
use crate::error::ApiError;
use crate::state::AppState;
use axum::extract::rejection::{JsonRejection, PathRejection, QueryRejection};
use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use serde::de::DeserializeOwned;

pub struct Json<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, Self::Rejection> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(v)) => Ok(Json(v)),
            Err(rejection) => Err(json_rejection(rejection)),
        }
    }
}

fn json_rejection(r: JsonRejection) -> ApiError {
    if r.status() == StatusCode::PAYLOAD_TOO_LARGE {
        return ApiError::too_large();
    }
    match r {
        JsonRejection::MissingJsonContentType(_) => {
            ApiError::invalid("The request body must be JSON, sent with Content-Type: application/json.")
        }
        JsonRejection::JsonSyntaxError(e) => {
            ApiError::invalid(format!("The body is not valid JSON: {}.", e.body_text()))
        }
        JsonRejection::JsonDataError(e) => {
            ApiError::invalid(format!("The body does not fit this endpoint: {}.", e.body_text()))
        }
        other => ApiError::invalid(format!("The body could not be read: {}.", other.body_text())),
    }
}

pub struct Query<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(v)) => Ok(Query(v)),
            Err(QueryRejection::FailedToDeserializeQueryString(e)) => {
                Err(ApiError::invalid(format!("The query string does not fit this endpoint: {}.", e.body_text())))
            }
            Err(other) => Err(ApiError::invalid(format!("The query string could not be read: {}.", other.body_text()))),
        }
    }
}

/// Path parameters; one that does not parse (a sequence number that is not an integer) is
/// `400 invalid_request` with the spec's body.
pub struct Path<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, Self::Rejection> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(v)) => Ok(Path(v)),
            Err(PathRejection::FailedToDeserializePathParams(e)) => {
                Err(ApiError::invalid(format!("The path does not fit this endpoint: {}.", e.body_text())))
            }
            Err(other) => Err(ApiError::invalid(format!("The path could not be read: {}.", other.body_text()))),
        }
    }
}

/// An extractor that authorizes the request for role `R` before anything else of it is read:
/// a missing or wrong token is `401`, a token of another role `403` — even when the body is bad.
pub struct Auth<R> {
    /// Who is asking: the token's name and role (`loopback` without tokens).
    pub actor: Actor,
    role: std::marker::PhantomData<R>,
}

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

impl<R: RoleMarker + Send + Sync> axum::extract::FromRequestParts<AppState> for Auth<R> {
    type Rejection = ApiError;

    async fn from_request_parts(
        parts: &mut axum::http::request::Parts,
        state: &AppState,
    ) -> Result<Self, Self::Rejection> {
        let actor = state.tokens.authorize(&parts.headers, R::ROLE)?;
        Ok(Auth { actor, role: std::marker::PhantomData })
    }
}
