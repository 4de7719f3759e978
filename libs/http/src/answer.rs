//! An engine [`Outcome`] as the client's response, the same in the gateway and in
//! embedded mode: a replay with `Idempotent-Replayed: true`, each idempotency problem
//! with its `Retry-After` and `Preference-Applied`, and `Idempotency-Expires`.

use std::time::{Duration, SystemTime};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderName, HeaderValue, StatusCode};
use idem_core::headers::{self as h, IDEMPOTENT_REPLAYED, PREFERENCE_APPLIED};
use idem_core::{Outcome, StoredResponse, UnknownCause};

use crate::problem::Problem;

/// Until when a key is remembered (docs/http-api.md), as an IMF-fixdate.
pub const IDEMPOTENCY_EXPIRES: HeaderName = HeaderName::from_static("idempotency-expires");

/// Answers an outcome. `first` turns the answer of the request that executed (or whose
/// key was released) into the response; `wait` is how long this request was willing to
/// wait for another attempt. An answer that stored or replayed a record says until when
/// it is kept (`Idempotency-Expires`); a key still in progress has no expiry yet.
pub fn answer<R>(
    outcome: Outcome<R>,
    mismatch_status: u16,
    wait: Option<Duration>,
    first: impl FnOnce(R) -> Response,
) -> Response {
    let applied = |response: &mut Response, waited: bool| {
        if let (true, Some(wait)) = (waited, wait) {
            let value = format!("wait={}", wait.as_secs());
            if let Ok(value) = HeaderValue::from_str(&value) {
                response.headers_mut().insert(PREFERENCE_APPLIED, value);
            }
        }
    };
    match outcome {
        Outcome::Executed {
            response,
            expires_at,
        } => {
            let mut response = first(response);
            if let Some(at) = expires_at {
                set_expires(&mut response, at);
            }
            response
        }
        Outcome::Released(response) | Outcome::Uncertain(response) => first(response),
        Outcome::Replayed {
            response,
            waited,
            expires_at,
            ..
        } => {
            let mut response = replay(response);
            applied(&mut response, waited);
            if let Some(at) = expires_at {
                set_expires(&mut response, at);
            }
            response
        }
        Outcome::Mismatch { completed, .. } => Problem::KeyReused {
            status: mismatch_status,
            completed,
        }
        .into_response(),
        Outcome::InProgress {
            retry_after,
            waited,
            outcome_unknown,
            ..
        } => {
            let mut response = Problem::InProgress {
                retry_after,
                outcome_unknown,
            }
            .into_response();
            applied(&mut response, waited);
            response
        }
        Outcome::UpstreamUnavailable => Problem::UpstreamUnavailable.into_response(),
        Outcome::Unknown(UnknownCause::Upstream) => Problem::UpstreamTimeout.into_response(),
        Outcome::Unknown(UnknownCause::Ledger) => Problem::OutcomeUnrecorded.into_response(),
    }
}

/// A stored response, replayed: same status, body and kept headers; a fresh `Date`
/// (added by the server) and a `Content-Length` computed from the body. A response
/// recorded without its body (too large to keep) is a 410: it happened, once.
pub fn replay(stored: StoredResponse) -> Response {
    if stored.body_omitted {
        let mut response = Problem::ResultUnavailable.into_response();
        response
            .headers_mut()
            .insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
        return response;
    }
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut headers = h::from_stored(&stored.headers);
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    *response.headers_mut() = headers;
    response
}

/// Sets `Idempotency-Expires` to `at`, to the second.
pub fn set_expires(response: &mut Response, at: SystemTime) {
    if let Ok(value) = HeaderValue::from_str(&httpdate::fmt_http_date(at)) {
        response.headers_mut().insert(IDEMPOTENCY_EXPIRES, value);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn expiry_is_an_imf_fixdate() {
        let mut response = Response::new(Body::empty());
        set_expires(
            &mut response,
            SystemTime::UNIX_EPOCH + Duration::from_secs(784_111_777),
        );
        assert_eq!(
            response.headers()[IDEMPOTENCY_EXPIRES],
            "Sun, 06 Nov 1994 08:49:37 GMT"
        );
    }

    #[test]
    fn a_body_too_large_to_keep_replays_as_410() {
        let response = replay(StoredResponse::without_body(201, vec![]));
        assert_eq!(response.status(), StatusCode::GONE);
        assert_eq!(response.headers()[IDEMPOTENT_REPLAYED], "true");
    }
}
