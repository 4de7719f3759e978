//! Turning an engine outcome into the client's response: `idem_http::answer`, with the
//! upstream's answer passed through for the request that executed.

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use idem_config::Route;
use idem_core::headers as h;
use idem_core::{Outcome, StoredResponse};
use idem_upstream::{ResponseBody, UpstreamResponse};

pub fn respond(
    outcome: Outcome<UpstreamResponse>,
    route: &Route,
    wait: Option<Duration>,
) -> Response {
    let outcome = match (&route.webhook, outcome) {
        (
            Some(_),
            Outcome::Replayed {
                response,
                trace_context,
                waited,
                expires_at,
            },
        ) if response.body_omitted => Outcome::Replayed {
            response: acknowledged(response),
            trace_context,
            waited,
            expires_at,
        },
        (_, outcome) => outcome,
    };
    idem_http::answer(outcome, route.mismatch_status, wait, passthrough)
}

/// A provider's redelivery of an event whose first answer was too large to keep: the
/// first answer's status when it was 2xx (else 200) and no body. Never the 410 an API
/// client gets: senders disable endpoints that answer 410 (Standard Webhooks), and the
/// event was handled, once.
fn acknowledged(first: StoredResponse) -> StoredResponse {
    let status = if (200..300).contains(&first.status) {
        first.status
    } else {
        200
    };
    // Nothing that describes the body that is not there.
    let headers = first
        .headers
        .into_iter()
        .filter(|(name, _)| !name.starts_with("content-") && name != "etag" && name != "digest")
        .collect();
    StoredResponse::new(status, headers, bytes::Bytes::new())
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
