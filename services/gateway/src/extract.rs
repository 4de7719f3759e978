//! Reading a request: the extractors [`Tenant`], [`Matched`] and [`Key`] (run by axum
//! in that order, before the handler), the body within its limit, and the client's
//! preferences. Every failure is a [`Problem`] and nothing is claimed.

use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::extract::FromRequestParts;
use bytes::Bytes;
use http::header::{self, HeaderMap};
use http::request::Parts;
use http_body_util::{BodyExt, Limited};
use idem_config::Route;
use idem_core::{IdempotencyKey, KeyError};
use idem_upstream::headers::IDEMPOTENCY_KEY;
use tracing::Span;

use crate::app::AppState;
use crate::problem::Problem;

/// The tenant the bearer token proves (401 without one).
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

impl FromRequestParts<Arc<AppState>> for Tenant {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
        let token = bearer(&parts.headers).map_err(Problem::Unauthorized)?;
        let tenant = app
            .auth
            .verify_fetching(token)
            .await
            .map_err(Problem::Unauthorized)?;
        Span::current().record("tenant.id", tenant.0.as_str());
        Ok(Self(tenant.0))
    }
}

/// The route configured for the request's method and path (404 without one). Kept
/// in the request's extensions once matched, so [`Key`] reads the same one.
#[derive(Debug, Clone)]
pub struct Matched(pub Arc<Route>);

impl FromRequestParts<Arc<AppState>> for Matched {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
        if let Some(matched) = parts.extensions.get::<Self>() {
            return Ok(matched.clone());
        }
        let route = app
            .routes
            .find(&parts.method, parts.uri.path())
            .ok_or(Problem::RouteNotFound)?;
        Span::current().record("idempotency.endpoint", route.endpoint.as_str());
        let matched = Self(route.clone());
        parts.extensions.insert(matched.clone());
        Ok(matched)
    }
}

/// The request's idempotency key: `None` on a route that is not idempotent, or on one
/// whose keys are optional (`key_required = false`) when none was sent; 400 otherwise.
#[derive(Debug, Clone)]
pub struct Key(pub Option<IdempotencyKey>);

impl FromRequestParts<Arc<AppState>> for Key {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
        let Matched(route) = Matched::from_request_parts(parts, app).await?;
        if !route.idempotent {
            return Ok(Self(None));
        }
        match idempotency_key(&parts.headers).map_err(Problem::KeyInvalid)? {
            Some(key) => {
                Span::current().record("idempotency.key", key.as_str());
                Ok(Self(Some(key)))
            }
            None if !route.key_required => Ok(Self(None)),
            None => Err(Problem::KeyMissing),
        }
    }
}

pub fn bearer(headers: &HeaderMap) -> Result<&str, idem_auth::AuthError> {
    use idem_auth::AuthError;
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(AuthError::Missing);
    };
    let value = value.to_str().map_err(|_| AuthError::Malformed)?;
    match value.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(token.trim())
        }
        _ => Err(AuthError::Missing),
    }
}

/// Why an `Idempotency-Key` header was refused. The message is safe to show the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyHeaderError {
    #[error("send exactly one Idempotency-Key header")]
    Repeated,
    #[error(transparent)]
    Invalid(#[from] KeyError),
}

pub fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, KeyHeaderError> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(KeyHeaderError::Repeated);
    }
    Ok(Some(IdempotencyKey::parse(value.as_bytes())?))
}

/// `Content-Type: application/json` or any `+json` type.
pub fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let media = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    media == "application/json" || (media.starts_with("application/") && media.ends_with("+json"))
}

/// Reads the whole body, at most `limit` bytes (413 past it) within `timeout` (408).
pub async fn read_body(
    body: Body,
    headers: &HeaderMap,
    limit: usize,
    timeout: Duration,
) -> Result<Bytes, Problem> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Problem::PayloadTooLarge { limit });
    }
    let Ok(collected) = tokio::time::timeout(timeout, Limited::new(body, limit).collect()).await
    else {
        return Err(Problem::RequestTimeout { after: timeout });
    };
    match collected {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Problem::PayloadTooLarge { limit })
        }
        Err(e) => Err(Problem::RequestInvalid(format!(
            "the request body could not be read: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::HeaderValue;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn json_media_types() {
        assert!(is_json(&headers(&[("content-type", "application/json")])));
        assert!(is_json(&headers(&[(
            "content-type",
            "Application/JSON; charset=utf-8"
        )])));
        assert!(is_json(&headers(&[(
            "content-type",
            "application/merge-patch+json"
        )])));
        assert!(!is_json(&headers(&[("content-type", "text/plain")])));
        assert!(!is_json(&headers(&[])));
    }

    #[test]
    fn one_key_header_only() {
        assert!(
            idempotency_key(&headers(&[
                ("idempotency-key", "a"),
                ("idempotency-key", "b")
            ]))
            .is_err()
        );
        assert_eq!(idempotency_key(&headers(&[])), Ok(None));
        assert_eq!(
            idempotency_key(&headers(&[("idempotency-key", "\"k\"")]))
                .unwrap()
                .unwrap()
                .as_str(),
            "k"
        );
    }

    #[test]
    fn bearer_tokens() {
        assert_eq!(
            bearer(&headers(&[("authorization", "Bearer abc")])),
            Ok("abc")
        );
        assert_eq!(
            bearer(&headers(&[("authorization", "bearer abc")])),
            Ok("abc")
        );
        assert!(bearer(&headers(&[("authorization", "Basic abc")])).is_err());
        assert!(bearer(&headers(&[("authorization", "Bearer ")])).is_err());
        assert!(bearer(&headers(&[])).is_err());
    }
}
