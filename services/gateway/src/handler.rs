//! One request: authenticate, match the route, validate, then either proxy plainly or
//! run the request through the idempotency engine — all inside the `idemgate.request`
//! span, which continues the client's trace and links retries to the first execution.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::Request;
use http::request::Parts;
use http_body_util::Full;
use idem_config::Route;
use idem_core::{Attempt, BodyKind, Execution, Fingerprint, IdempotencyKey, Outcome, Scope};
use idem_telemetry::metrics::{counter, gauge, histogram};
use idem_telemetry::propagation;
use idem_upstream::headers::{self as h};
use idem_upstream::{self as upstream, Forwarded};
use tokio::time::Instant;
use tracing::field::Empty;
use tracing::{Instrument, Span};

use crate::app::AppState;
use crate::extract::{bearer, idempotency_key, is_json, preferred_wait, read_body};
use crate::problem::Problem;
use crate::respond::{passthrough, respond};

/// What a request came to, for the log line and the metrics.
struct Handled {
    response: Response,
    /// `executed`, `replayed`, … or, for requests turned away before the engine, the
    /// problem's slug; `proxied` for plain routes.
    outcome: &'static str,
    endpoint: Option<String>,
}

impl From<(Problem, Option<&Route>)> for Handled {
    fn from((problem, route): (Problem, Option<&Route>)) -> Self {
        Self {
            outcome: problem.slug(),
            response: problem.into_response(),
            endpoint: route.map(|r| r.endpoint.clone()),
        }
    }
}

pub async fn handle(State(app): State<Arc<AppState>>, request: Request<Body>) -> Response {
    let started = Instant::now();
    let span = tracing::info_span!(
        "idemgate.request",
        otel.kind = "server",
        http.request.method = %request.method(),
        url.path = %request.uri().path(),
        tenant.id = Empty,
        idempotency.endpoint = Empty,
        idempotency.key = Empty,
        idempotency.outcome = Empty,
        http.response.status_code = Empty,
    );
    propagation::continue_trace(&span, request.headers());
    let handled = serve(app, request, span.clone())
        .instrument(span.clone())
        .await;

    let status = handled.response.status().as_u16();
    span.record("http.response.status_code", status);
    let endpoint = handled.endpoint.unwrap_or_else(|| "unmatched".into());
    let elapsed = started.elapsed().as_secs_f64();
    counter!("idemgate_requests_total", "outcome" => handled.outcome, "endpoint" => endpoint.clone()).increment(1);
    histogram!("idemgate_request_duration_seconds", "outcome" => handled.outcome, "endpoint" => endpoint)
        .record(elapsed);
    span.in_scope(|| {
        tracing::info!(
            idempotency.outcome = handled.outcome,
            http.status = status,
            duration_ms = elapsed * 1000.0,
            "request"
        )
    });
    handled.response
}

async fn serve(app: Arc<AppState>, request: Request<Body>, span: Span) -> Handled {
    let (parts, body) = request.into_parts();
    let verified = match bearer(&parts.headers) {
        Ok(token) => app.auth.verify_fetching(token).await,
        Err(why) => Err(why),
    };
    let tenant = match verified {
        Ok(tenant) => tenant.0,
        Err(why) => return (Problem::Unauthorized(why), None).into(),
    };
    span.record("tenant.id", tenant.as_str());
    let Some(route) = app.routes.find(&parts.method, parts.uri.path()) else {
        return (Problem::RouteNotFound, None).into();
    };
    span.record("idempotency.endpoint", route.endpoint.as_str());
    let key = if route.idempotent {
        match idempotency_key(&parts.headers) {
            Ok(Some(key)) => Some(key),
            Ok(None) if !route.key_required => None,
            Ok(None) => return (Problem::KeyMissing, Some(route)).into(),
            Err(why) => return (Problem::KeyInvalid(why), Some(route)).into(),
        }
    } else {
        None
    };
    let body = match read_body(
        body,
        &parts.headers,
        app.max_body_bytes,
        app.body_read_timeout,
    )
    .await
    {
        Ok(body) => body,
        Err(problem) => return (problem, Some(route)).into(),
    };
    // Continued only if it is a valid W3C value; anything else starts a new trace.
    let client_trace = client_traceparent(&parts.headers);
    let Some(key) = key else {
        // Not idempotent (or key-less on a roll-out route): proxy as it is.
        let sent = Sent {
            parts: &parts,
            tenant: &tenant,
            key: None,
            traceparent: client_trace.as_deref(),
        };
        let response = match forward(&app, route, &sent, body, route.timeout).await {
            Forwarded::Answered(response) => passthrough(response),
            Forwarded::NotSent(_) => Problem::UpstreamUnavailable.into_response(),
            Forwarded::Unknown(_) => Problem::UpstreamTimeout.into_response(),
        };
        return Handled {
            response,
            outcome: "proxied",
            endpoint: Some(route.endpoint.clone()),
        };
    };
    span.record("idempotency.key", key.as_str());

    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let kind = if is_json(&parts.headers) {
        BodyKind::Json
    } else {
        BodyKind::Raw
    };
    let fingerprint = match fingerprint(&app, parts.method.as_str(), target, kind, &body).await {
        Ok(fp) => fp,
        Err(why) => {
            let problem =
                Problem::RequestInvalid(format!("the body is not acceptable JSON: {why}"));
            return (problem, Some(route)).into();
        }
    };
    let wait = route.policy.wait_for(preferred_wait(&parts.headers));
    let scope = Scope::new(tenant.clone(), route.endpoint.clone(), key.clone());
    // Stored with the claim, so retries can link to this execution's span.
    let trace_context = propagation::traceparent(&span).or_else(|| client_trace.clone());

    // A completed response held in this process answers without I/O and without a task.
    let peeked = app.engine.peek(idem_core::Request {
        scope: &scope,
        fingerprint: &fingerprint,
        policy: &route.policy,
        wait,
        trace_context: trace_context.as_deref(),
    });
    let result = match peeked {
        Some(outcome) => Ok(Ok(outcome)),
        // Claim, forward and store in a task of its own: a client that hangs up drops
        // this handler's future, and must not cancel the forward-and-store half way.
        None => {
            let (app, route) = (app.clone(), route.clone());
            app.tasks
                .clone()
                .spawn(
                    async move {
                        let request = idem_core::Request {
                            scope: &scope,
                            fingerprint: &fingerprint,
                            policy: &route.policy,
                            wait,
                            trace_context: trace_context.as_deref(),
                        };
                        let sent = Sent {
                            parts: &parts,
                            tenant: &tenant,
                            key: Some(&key),
                            traceparent: client_trace.as_deref(),
                        };
                        let execute = |attempt| execute(&app, &route, &sent, body, attempt);
                        app.engine.run(request, execute).await
                    }
                    .instrument(span.clone()),
                )
                .await
        }
    };
    let (response, outcome) = match result {
        Ok(Ok(outcome)) => {
            let name = outcome.name();
            match &outcome {
                Outcome::Executed {
                    recorded: false, ..
                } => {
                    app.fenced.fetch_add(1, Ordering::Relaxed);
                }
                Outcome::Replayed { trace_context, .. }
                | Outcome::Mismatch { trace_context, .. }
                | Outcome::InProgress { trace_context, .. } => {
                    // One click from this retry's trace to the first execution.
                    if let Some(first) = trace_context {
                        propagation::link(&span, first);
                    }
                }
                _ => {}
            }
            (respond(outcome, route, wait), name)
        }
        Ok(Err(error)) => {
            tracing::error!(%error, "ledger unavailable");
            (Problem::LedgerUnavailable.into_response(), "error")
        }
        Err(error) => {
            tracing::error!(%error, "request task failed");
            (Problem::Internal.into_response(), "error")
        }
    };
    span.record("idempotency.outcome", outcome);
    Handled {
        response,
        outcome,
        endpoint: Some(route.endpoint.clone()),
    }
}

/// What is sent upstream besides the body.
struct Sent<'a> {
    parts: &'a Parts,
    tenant: &'a str,
    key: Option<&'a IdempotencyKey>,
    /// The client's valid `traceparent`, continued when idemgate itself does not trace.
    traceparent: Option<&'a str>,
}

/// The client's `traceparent`, if it sent exactly one and it is a valid W3C value.
fn client_traceparent(headers: &http::HeaderMap) -> Option<String> {
    let mut values = headers.get_all(h::TRACEPARENT).iter();
    match (values.next(), values.next()) {
        (Some(value), None) => value
            .to_str()
            .ok()
            .filter(|v| propagation::parse_traceparent(v).is_some())
            .map(str::to_owned),
        _ => None,
    }
}

/// Bodies larger than this are fingerprinted on the blocking pool: canonical JSON costs
/// roughly 2-4 ms of CPU per MiB (loadtest/bench), long enough on an async worker to
/// delay every other request's I/O behind it. Smaller bodies cost tens of microseconds
/// and are done in place.
const FINGERPRINT_INLINE_UP_TO: usize = 32 * 1024;

/// The request's fingerprint; large bodies off the async workers, on at most all cores
/// but one at a time (so a flood of large bodies queues here, not on the workers).
async fn fingerprint(
    app: &AppState,
    method: &str,
    target: &str,
    kind: BodyKind,
    body: &Bytes,
) -> Result<Fingerprint, idem_core::canonical::JsonError> {
    if body.len() <= FINGERPRINT_INLINE_UP_TO {
        return Fingerprint::compute(method, target, kind, body);
    }
    let permit = app
        .cpu
        .clone()
        .acquire_owned()
        .await
        .expect("the CPU pool is never closed");
    let (method, target, body) = (method.to_owned(), target.to_owned(), body.clone());
    tokio::task::spawn_blocking(move || {
        // Held by the work itself, so a client that hangs up frees no slot early.
        let _permit = permit;
        Fingerprint::compute(&method, &target, kind, &body)
    })
    .await
    .expect("fingerprinting never panics")
}

/// The engine's upstream call for the attempt that won the claim.
async fn execute(
    app: &AppState,
    route: &Route,
    sent: &Sent<'_>,
    body: Bytes,
    attempt: Attempt,
) -> Execution<idem_upstream::UpstreamResponse> {
    // Never run past the lease: after it the reconciler may act on the row.
    let left = attempt.deadline.saturating_duration_since(Instant::now());
    let timeout = route.timeout.min(left);
    if timeout.is_zero() {
        tracing::warn!("lease ran out before the request could be sent; key released");
        return Execution::NotSent;
    }
    gauge!("idemgate_inflight_executions").increment(1.0);
    let forwarded = forward(app, route, sent, body, timeout).await;
    gauge!("idemgate_inflight_executions").decrement(1.0);
    match forwarded {
        Forwarded::Answered(response) => Execution::Responded {
            // Past max_response_bytes the body streams on to this client and is not kept.
            stored: h::to_stored(
                response.status.as_u16(),
                &response.headers,
                response.body.full().cloned(),
                route.policy.store_set_cookie,
            ),
            passthrough: response,
        },
        Forwarded::NotSent(why) => {
            tracing::warn!(%why, "upstream unreachable; key released");
            Execution::NotSent
        }
        Forwarded::Unknown(why) => {
            tracing::warn!(%why, "upstream outcome unknown; key held");
            Execution::Unknown
        }
    }
}

async fn forward(
    app: &AppState,
    route: &Route,
    sent: &Sent<'_>,
    body: Bytes,
    timeout: Duration,
) -> Forwarded {
    let parts = sent.parts;
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let uri = match route.upstream.uri_for(target) {
        Ok(uri) => uri,
        Err(e) => return Forwarded::NotSent(format!("cannot build the upstream URI: {e}")),
    };
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    *request.headers_mut() =
        h::upstream_request_headers(&parts.headers, sent.tenant, sent.key, sent.traceparent);
    let started = Instant::now();
    let forwarded =
        upstream::forward(&app.client, request, timeout, route.max_response_bytes).await;
    histogram!("idemgate_upstream_duration_seconds", "endpoint" => route.endpoint.clone())
        .record(started.elapsed().as_secs_f64());
    forwarded
}
