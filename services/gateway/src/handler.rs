//! One request, top to bottom, in named phases (as pingora names a request's):
//!
//! 1. **admit** — what the request may hold before anyone knows what it is: a client's
//!    token has proved its tenant (axum's extractors, before the handler), so its
//!    tenant's quota is spent and the global slot the limits gave it is kept; a webhook
//!    delivery is nobody's yet, and holds one of its route's unverified places only.
//! 2. **read** — the body, within the tenant's limits, or the webhook route's own.
//! 3. **identify** — who the request is for and which operation: the client's key
//!    header; a delivery's signature (off the request threads), then, proved, the slot
//!    and the quota a client took at admission.
//! 4. **run** — the engine (or a plain proxy on a route without a key), in a task of its
//!    own so that a client hanging up never cuts a forward-and-store in half.
//! 5. **respond** — the engine's outcome as the client's (or provider's) answer.
//!
//! It runs inside the `idemgate.request` span of [`crate::observe`], which also counts it
//! and logs it.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use axum::body::Body;
use axum::extract::{Request, State};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::request::Parts;
use http_body_util::Full;
use idem_config::{Route, RouteKind};
use idem_core::headers as h;
use idem_core::{Attempt, AttemptId, Execution, IdempotencyKey, Outcome, Scope, UnknownCause};
use idem_telemetry::metrics::{gauge, histogram};
use idem_telemetry::propagation;
use idem_upstream::{self as upstream, Forwarded};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tracing::{Instrument, Span};

use crate::extract::{Caller, Key, Matched, read_body};
use crate::limits::Slot;
use crate::observe::{self, Endpoint, TenantLabel};
use crate::problem::Problem;
use crate::respond::{passthrough, respond};
use crate::state::AppState;
use crate::tenants::TenantPermit;
use crate::webhook::Place;

/// The caller, route and key header are extracted before this runs; a rejection is the
/// [`Problem`]'s response. Every answer from here on names the route's endpoint.
pub async fn handle(
    State(app): State<Arc<AppState>>,
    caller: Caller,
    Matched(route): Matched,
    key: Result<Key, Problem>,
    request: Request,
) -> Response {
    let endpoint = Endpoint(route.endpoint.clone());
    let mut response = serve(app, caller, route, key, request)
        .await
        .into_response();
    response.extensions_mut().insert(endpoint);
    response
}

/// A request turned away: its problem's response — naming its tenant when the refusal is
/// the tenant's quota, for the refusal log ([`crate::refusals`]).
struct Refused {
    problem: Problem,
    tenant: Option<String>,
}

impl From<Problem> for Refused {
    fn from(problem: Problem) -> Self {
        Self {
            problem,
            tenant: None,
        }
    }
}

impl IntoResponse for Refused {
    fn into_response(self) -> Response {
        match self.tenant {
            Some(tenant) => (axum::Extension(TenantLabel(tenant)), self.problem).into_response(),
            None => self.problem.into_response(),
        }
    }
}

/// `tenant`'s quota for one request; refused, the refusal names the tenant.
fn tenant_quota(app: &AppState, tenant: &str) -> Result<Option<Arc<TenantPermit>>, Refused> {
    match app.tenants.admit(tenant) {
        Ok(permit) => Ok(permit.map(Arc::new)),
        Err(problem) => Err(Refused {
            problem,
            tenant: Some(tenant.to_owned()),
        }),
    }
}

/// The phases, in order.
async fn serve(
    app: Arc<AppState>,
    caller: Caller,
    route: Arc<Route>,
    key: Result<Key, Problem>,
    request: Request,
) -> Result<Response, Refused> {
    let admitted = admit(&app, caller, &route, key, &request)?;
    let (parts, body) = request.into_parts();
    let body = read(&app, &admitted, &route, &parts, body).await?;
    let identified = identify(&app, admitted, &route, &parts, &body).await?;
    Ok(run(app, route, identified, parts, body).await?)
}

/// What a request holds while it runs, given back when the last of its work ends: its
/// slot of `server.max_concurrent_requests`, its place among its tenant's requests.
#[derive(Clone)]
struct Holds {
    slot: Option<Slot>,
    /// Held, never read: dropping it gives the place back.
    #[allow(dead_code)]
    tenant: Option<Arc<TenantPermit>>,
}

/// A request let in: a client proved by its token, or a delivery not yet verified.
enum Admitted {
    Client {
        tenant: String,
        key: Option<IdempotencyKey>,
        holds: Holds,
    },
    /// Holds its route's place for an unverified body, and nothing else.
    Unverified { place: Place },
}

/// Who the request is for and which operation it is, proved.
struct Identified {
    tenant: String,
    key: Option<IdempotencyKey>,
    holds: Holds,
}

/// Phase 1: a client's key header and tenant quota; a delivery's place on its route.
fn admit(
    app: &AppState,
    caller: Caller,
    route: &Route,
    key: Result<Key, Problem>,
    request: &Request,
) -> Result<Admitted, Refused> {
    match caller {
        Caller::Token(tenant) => {
            let Key(key) = key?;
            // Before anything is read or claimed; its place among its tenant's requests
            // goes with the work, as the slot does.
            let permit = tenant_quota(app, &tenant)?;
            let holds = Holds {
                slot: request.extensions().get::<Slot>().cloned(),
                tenant: permit,
            };
            Ok(Admitted::Client { tenant, key, holds })
        }
        Caller::Unverified => Ok(Admitted::Unverified {
            place: app.webhooks.admit(route)?,
        }),
    }
}

/// Phase 2: the body, within the tenant's limit — or, unverified, the webhook route's.
async fn read(
    app: &AppState,
    admitted: &Admitted,
    route: &Route,
    parts: &Parts,
    body: Body,
) -> Result<Bytes, Problem> {
    let (limit, timeout) = match (admitted, route.kind()) {
        (Admitted::Unverified { .. }, RouteKind::Webhook(webhook)) => {
            (webhook.max_body_bytes, webhook.body_read_timeout)
        }
        (Admitted::Client { tenant, .. }, _) => (
            app.tenants.rules(tenant).max_body_bytes,
            app.body_read_timeout,
        ),
        (Admitted::Unverified { .. }, _) => return Err(Problem::Internal),
    };
    read_body(body, &parts.headers, limit, timeout).await
}

/// Phase 3: a delivery's signature, and then what a client took at admission: the slot
/// and the tenant's quota. A delivery that does not verify is 401, holding nothing.
async fn identify(
    app: &AppState,
    admitted: Admitted,
    route: &Arc<Route>,
    parts: &Parts,
    body: &Bytes,
) -> Result<Identified, Refused> {
    match admitted {
        Admitted::Client { tenant, key, holds } => Ok(Identified { tenant, key, holds }),
        Admitted::Unverified { place } => {
            let delivery = app
                .webhooks
                .verify(place, route, parts.uri.path(), &parts.headers, body)
                .await?;
            let span = Span::current();
            span.record("tenant.id", delivery.tenant.as_str());
            span.record("idempotency.key", delivery.key.as_str());
            let slot = Slot::take(&app.limits)?;
            let permit = tenant_quota(app, &delivery.tenant)?;
            Ok(Identified {
                tenant: delivery.tenant,
                key: Some(delivery.key),
                holds: Holds {
                    slot: Some(slot),
                    tenant: permit,
                },
            })
        }
    }
}

/// Phases 4 and 5: the engine (or a plain proxy), then the answer.
async fn run(
    app: Arc<AppState>,
    route: Arc<Route>,
    identified: Identified,
    parts: Parts,
    body: Bytes,
) -> Result<Response, Problem> {
    let Identified { tenant, key, holds } = identified;
    // Cancelled when this handler ends or is dropped (its client hung up): a wait for
    // another attempt stops then; an execution and its completion do not.
    let gone = CancellationToken::new();
    let _gone_on_drop = gone.clone().drop_guard();
    // Continued only if it is a valid W3C value; anything else starts a new trace.
    let client_trace = propagation::client_traceparent(&parts.headers);
    let Some(key) = key else {
        // Not idempotent (or key-less on a roll-out route): proxy as it is.
        let sent = Sent {
            parts: &parts,
            tenant: &tenant,
            key: None,
            traceparent: client_trace.as_deref(),
        };
        // Nothing is stored: the answer streams on as it comes (an event stream, a long
        // download), holding the request's places until it ends.
        let response = match forward(&app, &route, &sent, None, body, route.timeout, 0).await {
            Forwarded::Answered(response) => passthrough(response).map(|body| {
                Body::new(Holding {
                    body,
                    _holds: holds,
                })
            }),
            Forwarded::NotSent(_) => Problem::UpstreamUnavailable.into_response(),
            Forwarded::Unknown(_) => Problem::UpstreamTimeout.into_response(),
        };
        return Ok((axum::Extension(observe::OutcomeLabel("proxied")), response).into_response());
    };
    let policy = app
        .tenants
        .rules(&tenant)
        .policy(&route.endpoint)
        .cloned()
        .unwrap_or_else(|| Arc::new(route.policy.clone()));
    let fingerprint = match route.kind() {
        // The raw body, the one thing signed: a provider's redeliveries carry the same
        // bytes (the route's template stands for the unsigned path and query).
        RouteKind::Webhook(_) => app
            .fingerprints
            .compute(
                parts.method.as_str(),
                route.template.as_str(),
                idem_core::BodyKind::Raw,
                &body,
                holds.slot.clone(),
            )
            .await
            .map_err(|_| Problem::Internal)?,
        RouteKind::Keyed | RouteKind::Proxy => {
            app.fingerprints
                .of_request(&parts, &body, holds.slot.clone())
                .await?
        }
    };
    let wait = policy.wait_for(h::preferred_wait(&parts.headers));
    // `Prefer: respond-async`: a client that will not wait for the upstream is answered
    // 202 with its result's `Location` once its claim is made, the execution going on.
    let respond_async =
        matches!(route.kind(), RouteKind::Keyed) && h::prefers(&parts.headers, "respond-async");
    let scope = Scope::new(tenant.clone(), route.endpoint.clone(), key.clone());
    // Kept for a 202's lookup, or a callback's mark, once the task has the scope.
    let handle = (respond_async || app.callbacks.tells(&tenant)).then(|| scope.clone());
    let span = Span::current();
    // Stored with the claim, so retries can link to this execution's span.
    let trace_context = propagation::traceparent(&span).or_else(|| client_trace.clone());

    // A completed response held in this process answers without I/O and without a task.
    let peeked = app.engine.peek(idem_core::Request {
        scope: &scope,
        fingerprint: &fingerprint,
        policy: &policy,
        wait,
        trace_context: trace_context.as_deref(),
        gone: Some(&gone),
    });
    let outcome = match peeked {
        Some(outcome) => outcome,
        // Claim, forward and store in a task of its own: a client that hangs up drops
        // this handler's future, and must not cancel the forward-and-store half way.
        None => {
            let (claimed, on_claim) = tokio::sync::oneshot::channel::<()>();
            let async_wait = h::preferred_wait(&parts.headers)
                .unwrap_or_default()
                .min(policy.wait_timeout);
            let (task_app, route, gone) = (app.clone(), route.clone(), gone.clone());
            let mut ran = app.tasks.clone().spawn(
                async move {
                    let _holds = holds;
                    let request = idem_core::Request {
                        scope: &scope,
                        fingerprint: &fingerprint,
                        policy: &policy,
                        wait,
                        trace_context: trace_context.as_deref(),
                        gone: Some(&gone),
                    };
                    let sent = Sent {
                        parts: &parts,
                        tenant: &tenant,
                        key: Some(&key),
                        traceparent: client_trace.as_deref(),
                    };
                    let execute = |attempt| {
                        // This request won the claim: it executes.
                        let _ = claimed.send(());
                        execute(&task_app, &route, &sent, body, attempt)
                    };
                    let outcome = task_app.engine.run(request, execute).await;
                    // Counted here, not once the client hears: a fenced completion
                    // mostly follows a stall long enough for the client to give up.
                    match &outcome {
                        Ok(Outcome::Executed {
                            expires_at: None, ..
                        }) => {
                            task_app.fenced.fetch_add(1, Ordering::Relaxed);
                        }
                        Ok(Outcome::Unknown(UnknownCause::Ledger)) => {
                            task_app.unrecorded.fetch_add(1, Ordering::Relaxed);
                        }
                        _ => {}
                    }
                    outcome
                }
                .instrument(span.clone()),
            );
            let ran = if respond_async {
                tokio::select! {
                    ran = &mut ran => ran,
                    Ok(()) = on_claim => {
                        // Claimed: its answer if it comes within the client's wait, else
                        // 202 and the execution goes on in its task.
                        match tokio::time::timeout(async_wait, &mut ran).await {
                            Ok(ran) => ran,
                            Err(_) => match respond_accepted(&app, handle.as_ref()).await? {
                                Some(accepted) => return Ok(accepted),
                                // Not handed off (its row already gone, or its callback
                                // could not be promised): its own answer.
                                None => ran.await,
                            },
                        }
                    }
                }
            } else {
                ran.await
            };
            match ran {
                Ok(Ok(outcome)) => outcome,
                Ok(Err(error)) if error.is_busy() => {
                    tracing::warn!(%error, "refused: too much in flight");
                    span.record("idempotency.outcome", "overloaded");
                    return Err(Problem::Overloaded);
                }
                Ok(Err(error)) => {
                    tracing::error!(%error, "ledger unavailable");
                    span.record("idempotency.outcome", "error");
                    return Err(Problem::LedgerUnavailable);
                }
                Err(error) => {
                    tracing::error!(%error, "request task failed");
                    span.record("idempotency.outcome", "error");
                    return Err(Problem::Internal);
                }
            }
        }
    };

    // Respond. A client that prefers not to wait is told where the running operation's
    // result will be, instead of 409.
    if respond_async
        && matches!(outcome, Outcome::InProgress { .. })
        // Else the first's claim not visible yet (a Redis lock younger than its commit),
        // gone since, or its callback not promised: the 409 this retry would have had.
        && let Some(accepted) = respond_accepted(&app, handle.as_ref()).await?
    {
        return Ok(accepted);
    }
    // A client not given the final answer (503 outcome-unrecorded, 504, or 409 while the
    // key is held): its tenant is told the settlement, whoever makes it — the reconciler
    // tells its own; this mark tells a late completion of the attempt itself.
    if let Some(scope) = handle
        && app.callbacks.tells(&scope.tenant)
        && matches!(
            outcome,
            Outcome::Unknown(_)
                | Outcome::InProgress {
                    outcome_unknown: true,
                    ..
                }
        )
    {
        let marking = app.clone();
        app.tasks.spawn(async move {
            if let Err(error) = marking.engine.ledger().mark_callback(&scope).await {
                tracing::warn!(%error, "could not mark a key with an unknown outcome for its callback; the reconciler's settlement still tells it");
            }
        });
    }
    let name = outcome.name();
    if let Some(first) = outcome.first_execution() {
        // One click from this retry's trace to the first execution.
        propagation::link(&span, first);
    }
    span.record("idempotency.outcome", name);
    let response = respond(outcome, &route, wait);
    Ok((axum::Extension(observe::OutcomeLabel(name)), response).into_response())
}

/// 202 for `Prefer: respond-async`: the lookup's JSON, `Location` and `Retry-After`, and
/// `Preference-Applied: respond-async`; the key marked for its tenant's callback first.
/// `None`: the key is not handed off — its row is gone (released), or its tenant's
/// callback could not be promised (the mark failed) — and the request gets the answer it
/// would have had without the preference.
async fn respond_accepted(
    app: &AppState,
    scope: Option<&Scope>,
) -> Result<Option<Response>, Problem> {
    let scope = scope.ok_or(Problem::Internal)?;
    if app.callbacks.tells(&scope.tenant) {
        match app.engine.ledger().mark_callback(scope).await {
            Ok(true) => {}
            Ok(false) => return Ok(None),
            Err(error) => {
                tracing::warn!(%error, "could not mark the key for its settlement's callback: answered without respond-async");
                return Ok(None);
            }
        }
    }
    let mut response = match crate::lookup::accepted(app, scope).await {
        Ok(response) => response,
        Err(Problem::KeyNotFound) => return Ok(None),
        Err(problem) => return Err(problem),
    };
    response.headers_mut().insert(
        h::PREFERENCE_APPLIED,
        http::HeaderValue::from_static("respond-async"),
    );
    Span::current().record("idempotency.outcome", "in_progress");
    Ok(Some(
        (
            axum::Extension(observe::OutcomeLabel("in_progress")),
            response,
        )
            .into_response(),
    ))
}

/// A proxied answer's body, holding the request's places until it has been sent (or its
/// client has gone): a stream counts against `server.max_concurrent_requests` and its
/// tenant's requests in flight for as long as it flows.
struct Holding {
    body: Body,
    _holds: Holds,
}

impl http_body::Body for Holding {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.body.size_hint()
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
    let forwarded = forward(
        app,
        route,
        sent,
        Some(attempt.id),
        body,
        timeout,
        route.max_response_bytes,
    )
    .await;
    gauge!("idemgate_inflight_executions").decrement(1.0);
    match forwarded {
        Forwarded::Answered(response) => Execution::Responded {
            // Past max_response_bytes the body streams on to this client and is not kept.
            stored: h::to_stored(
                response.status.as_u16(),
                &response.headers,
                response.body.full().cloned(),
                route.store_set_cookie,
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
    attempt: Option<AttemptId>,
    body: Bytes,
    timeout: Duration,
    max_body: usize,
) -> Forwarded {
    let parts = sent.parts;
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let uri = match route.upstream.uri_for(target) {
        Ok(uri) => uri,
        Err(e) => return Forwarded::NotSent(upstream::NotSent::Uri(e)),
    };
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    *request.headers_mut() = h::upstream_request_headers(
        &parts.headers,
        sent.tenant,
        sent.key.zip(attempt),
        sent.traceparent,
    );
    let started = Instant::now();
    let forwarded = upstream::forward(&app.client, request, timeout, max_body).await;
    histogram!("idemgate_upstream_duration_seconds", "endpoint" => route.endpoint.clone())
        .record(started.elapsed().as_secs_f64());
    forwarded
}
