//! Turning an engine outcome into the client's response: `idem_http::answer`, with the
//! upstream's answer passed through for the request that executed.

use std::time::Duration;

use axum::body::Body;
use axum::response::Response;
use idem_config::Route;
use idem_core::Outcome;
use idem_core::headers as h;
use idem_upstream::{ResponseBody, UpstreamResponse};

pub fn respond(
    outcome: Outcome<UpstreamResponse>,
    route: &Route,
    wait: Option<Duration>,
) -> Response {
    idem_http::answer(outcome, route.mismatch_status, wait, passthrough)
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
