//! The per-request limits of the `server.*` keys (docs/configuration.md), as one middleware in front of every route:
//! a request head over `server.max_header_bytes` or `server.max_headers` gets 431, and
//! beyond `server.max_concurrent_requests` in flight a request gets 503 `overloaded`
//! at once (never queued). `/healthz`, `/readyz` and `/metrics` are not counted, so an
//! overloaded gateway still says how it is. Either refusal claims nothing.
//!
//! A request's slot goes with it as a [`Slot`] in its extensions; the work it starts
//! (the engine's task, a fingerprint on the blocking pool) holds a clone, so the slot is
//! free again only when all of it has ended, whether or not the client stayed.
//!
//! A delivery to a webhook route takes its slot only once its signature has verified
//! ([`Slot::take`]): until then anyone may be sending it, and it holds one of its route's
//! own places instead ([`crate::webhook::Receivers::admit`]), so unsigned senders can
//! never take the slots other routes and tenants are served in.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use idem_telemetry::metrics::counter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::extract::Matched;
use crate::problem::Problem;
use crate::state::AppState;

/// What the middleware holds to.
#[derive(Debug)]
pub struct RequestLimits {
    pub max_header_bytes: usize,
    pub max_headers: usize,
    /// One permit per request in flight.
    pub in_flight: Arc<Semaphore>,
    pub max_concurrent: usize,
}

/// One request's slot of `server.max_concurrent_requests`, given back when the last
/// clone is dropped.
#[derive(Debug, Clone)]
pub struct Slot {
    _permit: Arc<OwnedSemaphorePermit>,
}

impl Slot {
    /// A slot taken after the middleware (a webhook delivery, once verified): 503
    /// `overloaded` when none is free, as the middleware answers.
    pub fn take(limits: &RequestLimits) -> Result<Self, Problem> {
        let permit = limits
            .in_flight
            .clone()
            .try_acquire_owned()
            .map_err(|_| Problem::Overloaded)?;
        Ok(Self {
            _permit: Arc::new(permit),
        })
    }
}

impl RequestLimits {
    pub fn new(max_header_bytes: usize, max_headers: usize, max_concurrent: usize) -> Self {
        Self {
            max_header_bytes,
            max_headers,
            in_flight: Arc::new(Semaphore::new(max_concurrent)),
            max_concurrent,
        }
    }

    /// Requests (and the work they started) holding a slot now.
    pub fn in_use(&self) -> usize {
        self.max_concurrent - self.in_flight.available_permits()
    }

    /// Why the head is refused, if it is.
    fn head_refusal(&self, request: &Request) -> Option<String> {
        let headers = request.headers();
        if headers.len() > self.max_headers {
            return Some(format!(
                "The request has {} header fields; at most {} are accepted.",
                headers.len(),
                self.max_headers
            ));
        }
        // As it came over the wire: `METHOD target HTTP/1.1\r\n`, `name: value\r\n`
        // per field, and the blank line.
        let line = request.method().as_str().len()
            + request
                .uri()
                .path_and_query()
                .map_or(1, |pq| pq.as_str().len())
            + 12;
        let fields: usize = headers
            .iter()
            .map(|(name, value)| name.as_str().len() + value.len() + 4)
            .sum();
        let size = line + fields + 2;
        (size > self.max_header_bytes).then(|| {
            format!(
                "The request head is {size} bytes; at most {} are accepted.",
                self.max_header_bytes
            )
        })
    }
}

/// Paths that always answer: they are how an operator sees an overloaded gateway.
fn exempt(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz" | "/metrics")
}

pub async fn enforce(State(app): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let limits = &app.limits;
    if let Some(why) = limits.head_refusal(&request) {
        return refuse(Problem::HeadersTooLarge(why));
    }
    if exempt(request.uri().path()) {
        return next.run(request).await;
    }
    let (mut parts, body) = request.into_parts();
    if Matched::webhook(&mut parts, &app) {
        return next.run(Request::from_parts(parts, body)).await;
    }
    let slot = match Slot::take(limits) {
        Ok(slot) => slot,
        Err(problem) => return refuse(problem),
    };
    parts.extensions.insert(slot);
    next.run(Request::from_parts(parts, body)).await
}

fn refuse(problem: Problem) -> Response {
    counter!("idemgate_requests_total", "outcome" => problem.outcome(), "endpoint" => "unmatched")
        .increment(1);
    problem.into_response()
}
