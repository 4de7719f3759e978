//! Reading a request, the same way in the gateway and in embedded mode: the bearer
//! token, the `Idempotency-Key` header, whether the body is JSON, and the body within its
//! limit and time. Every failure is a [`Problem`]; nothing has been claimed yet.

use std::time::Duration;

use axum::body::Body;
use bytes::Bytes;
use http::header::{self, HeaderMap};
use http_body_util::{BodyExt, Limited};
use idem_core::IdempotencyKey;
use idem_core::headers::IDEMPOTENCY_KEY;

use crate::problem::{KeyHeaderError, Problem};

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
