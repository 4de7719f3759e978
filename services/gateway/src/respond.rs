//! Turning an engine outcome into the client's response.

use std::time::Duration;

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use http::{HeaderValue, StatusCode};
use idem_config::Route;
use idem_core::{Outcome, StoredResponse, UnknownCause};
use idem_upstream::headers::{self as h, IDEMPOTENT_REPLAYED, PREFERENCE_APPLIED};
use idem_upstream::{ResponseBody, UpstreamResponse};

use crate::problem::Problem;

pub fn respond(
    outcome: Outcome<UpstreamResponse>,
    route: &Route,
    wait: Option<Duration>,
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
        Outcome::Executed { response, .. }
        | Outcome::Released(response)
        | Outcome::Uncertain(response) => passthrough(response),
        Outcome::Replayed {
            response, waited, ..
        } => {
            let mut response = replay(response);
            applied(&mut response, waited);
            response
        }
        Outcome::Mismatch { completed, .. } => Problem::KeyReused {
            status: route.mismatch_status,
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

/// The first execution's answer, as the upstream sent it (hop-by-hop removed); a body
/// past the route's cap streams on from the upstream.
pub fn passthrough(upstream: UpstreamResponse) -> Response {
    let body = match upstream.body {
        ResponseBody::Full(bytes) => Body::from(bytes),
        ResponseBody::Streaming(rest) => Body::new(rest),
    };
    let mut response = Response::new(body);
    *response.status_mut() = upstream.status;
    *response.headers_mut() = h::passthrough_response_headers(upstream.headers);
    response
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
