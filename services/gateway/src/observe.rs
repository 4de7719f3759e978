//! Observability as a layer around the request handler: the `idemgate.request` span
//! (continuing the client's trace), the request metrics and the one log line per
//! request served — a refusal (401, 429, 503 `overloaded`) is counted as every request is,
//! but logged per tenant and reason at most once per interval ([`crate::refusals`]).
//! Whoever answers says what the request came to by putting an [`OutcomeLabel`] (and,
//! once a route matched, an [`Endpoint`]; a refusal by its tenant's quota, a [`TenantLabel`]) in
//! the response's extensions; a [`crate::problem::Problem`] does so itself.

use std::sync::Arc;

use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use idem_telemetry::metrics::{counter, histogram};
use idem_telemetry::propagation;
use tokio::time::Instant;
use tracing::Instrument;

pub use idem_http::OutcomeLabel;

use crate::refusals::{self, Refusals};
use crate::state::AppState;

/// The matched route's endpoint (`"POST /payments"`), a metrics label.
#[derive(Debug, Clone)]
pub struct Endpoint(pub String);

/// The tenant whose quota refused a request, for the refusal log.
#[derive(Debug, Clone)]
pub struct TenantLabel(pub String);

pub async fn observe(State(app): State<Arc<AppState>>, request: Request, next: Next) -> Response {
    let started = Instant::now();
    let span = propagation::request_span(request.method(), request.uri().path(), request.headers());
    let mut response = next.run(request).instrument(span.clone()).await;

    let status = response.status().as_u16();
    span.record("http.response.status_code", status);
    let outcome = response
        .extensions()
        .get::<OutcomeLabel>()
        .map_or("error", |o| o.0);
    // Taken, not cloned: the label is all it is for.
    let endpoint = response
        .extensions_mut()
        .remove::<Endpoint>()
        .map_or_else(|| "unmatched".to_owned(), |e| e.0);
    let elapsed = started.elapsed().as_secs_f64();
    counter!("idemgate_requests_total", "outcome" => outcome, "endpoint" => endpoint.clone())
        .increment(1);
    histogram!("idemgate_request_duration_seconds", "outcome" => outcome, "endpoint" => endpoint)
        .record(elapsed);
    if Refusals::is_refusal(outcome) {
        let tenant = response.extensions_mut().remove::<TenantLabel>();
        let tenant = tenant.as_ref().map_or(refusals::UNKNOWN, |t| t.0.as_str());
        app.refusals.refused(tenant, outcome, status);
        return response;
    }
    span.in_scope(|| {
        tracing::info!(
            idempotency.outcome = outcome,
            http.status = status,
            duration_ms = elapsed * 1000.0,
            "request"
        )
    });
    response
}
