//! The tower layer, and one request through it:
//!
//! 1. tenant, key, body and fingerprint, read as the gateway reads them: bad input is a
//!    4xx and nothing is claimed;
//! 2. then the request runs through [`crate::once::run`], the engine of
//!    [`Idempotency::once`](crate::Idempotency::once) (a held answer replayed, the key's
//!    turn, the claim, the operation, the commit): the operation is the handler, with the
//!    transaction in the request's extensions ([`crate::Tx`]) beside its [`Scope`]
//!    (tenant, endpoint, key) and its [`AttemptId`];
//! 3. an answer whose status rolls back (every 5xx, 408, 425 and 429 by default) rolls
//!    everything back: the client gets it, marked `not_executed` if it is a problem
//!    document, and the key is free. Those are also the statuses of the layers that cut a
//!    handler off and answer for it (a timeout's 408, a rate limiter's 429, a load
//!    shedder's 503): the layer cannot tell their answer from the handler's (axum drops
//!    the handler's future before the answer reaches it), so a layer put between this
//!    one and the handler must answer with a status that rolls back. Any other answer
//!    is stored in the record on the same transaction, which commits; only then is it
//!    answered. A commit whose acknowledgement was lost is 503
//!    `outcome-unrecorded`: a retry finds the committed record, or none. A live record
//!    answers as at the gateway: a replay, 409/422, 409 in progress.

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::header;
use idem_core::{AttemptId, Execution, Outcome, Scope};
use idem_http::Problem;
use idem_http::request::{idempotency_key, read_body};
use idem_telemetry::propagation;
use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use tower_layer::Layer;
use tower_service::Service;
use tracing::{Instrument, Span};

use crate::answer::{self, HandlerBody, PassOn, not_executed, respond};
use crate::once;
use crate::tx::Slot;
use crate::{Shared, TenantFrom};

/// Makes a route idempotent: [`crate::Idempotency::layer`].
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
    tenant: TenantFrom,
    endpoint: Arc<str>,
}

impl IdempotencyLayer {
    pub(crate) fn new(shared: Arc<Shared>, tenant: TenantFrom, endpoint: &str) -> Self {
        Self {
            shared,
            tenant,
            endpoint: endpoint.into(),
        }
    }
}

impl<S> Layer<S> for IdempotencyLayer {
    type Service = IdempotencyService<S>;

    fn layer(&self, inner: S) -> Self::Service {
        IdempotencyService {
            inner,
            shared: self.shared.clone(),
            tenant: self.tenant.clone(),
            endpoint: self.endpoint.clone(),
        }
    }
}

/// The route's handler behind the layer.
#[derive(Debug, Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
    tenant: TenantFrom,
    endpoint: Arc<str>,
}

impl<S> Service<Request> for IdempotencyService<S>
where
    S: Service<Request, Response = Response, Error = Infallible> + Clone + Send + 'static,
    S::Future: Send + 'static,
{
    type Response = Response;
    type Error = Infallible;
    type Future = Pin<Box<dyn Future<Output = Result<Response, Infallible>> + Send>>;

    fn poll_ready(&mut self, _: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        // Readiness is the inner service's, asked for when it is called.
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, request: Request) -> Self::Future {
        // The clone that was made ready is the one that is called (tower's rule).
        let clone = self.inner.clone();
        let inner = std::mem::replace(&mut self.inner, clone);
        let shared = self.shared.clone();
        let tenant = self.tenant.clone();
        let endpoint = self.endpoint.clone();
        let span =
            propagation::request_span(request.method(), request.uri().path(), request.headers());
        // An answer given before the body was read says `Connection: close`.
        let (parts, body) = request.into_parts();
        let (body, consumed) = idem_http::early::track(body);
        let request = Request::from_parts(parts, body);
        Box::pin(
            async move {
                let mut response = serve(&shared, &tenant, &endpoint, inner, request)
                    .await
                    .unwrap_or_else(|problem| problem.into_response());
                consumed.close_unless_done(&mut response).await;
                consumed.linger();
                Span::current().record("http.response.status_code", response.status().as_u16());
                Ok(response)
            }
            .instrument(span),
        )
    }
}

/// One request: read, claim, run, store, commit, answer.
async fn serve<S>(
    shared: &Shared,
    tenant: &TenantFrom,
    endpoint: &str,
    inner: S,
    request: Request,
) -> Result<Response, Problem>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    let options = &shared.settings;
    let (mut parts, body) = request.into_parts();
    let tenant = tenant
        .of(&parts.headers)
        .await
        .map_err(Problem::Unauthorized)?;
    let span = Span::current();
    span.record("tenant.id", tenant.as_str());
    span.record("idempotency.endpoint", endpoint);
    let key = idempotency_key(&parts.headers)
        .map_err(Problem::KeyInvalid)?
        .ok_or(Problem::KeyMissing)?;
    span.record("idempotency.key", key.as_str());
    let body = read_body(
        body,
        &parts.headers,
        options.max_body_bytes,
        options.body_read_timeout,
    )
    .await?;
    let fingerprint = shared.fingerprints.of_request(&parts, &body, ()).await?;
    let scope = Scope::new(tenant, endpoint, key);
    // Stored with the record, so retries link to this execution's span.
    let trace_context = propagation::trace_context(&span, &parts.headers);

    let handler = async |slot: Slot, attempt: AttemptId| {
        parts.extensions.insert(slot.clone());
        // For the handler: whose operation this is, and the attempt's token.
        parts.extensions.insert(scope.clone());
        parts.extensions.insert(attempt);
        let response = inner
            .oneshot_infallible(Request::from_parts(parts, Body::from(body)))
            .await;
        // Before the answer's body is read: a body holding the Tx must not write into
        // the commit.
        slot.given_back(&scope)?;
        let status = response.status().as_u16();
        if options.roll_back_on.contains(status) {
            return Ok(Execution::Declined(response));
        }
        let (head, handler_body) = response.into_parts();
        let (kept, body) = match answer::read_answer(handler_body, options.max_response_bytes).await
        {
            Ok(HandlerBody::Whole(bytes)) => (Some(bytes.clone()), Body::from(bytes)),
            // Past what is stored: committed without it (retries get 410), and passed on
            // to this client as it comes, never held whole.
            Ok(HandlerBody::Over { read, rest }) => (None, PassOn::body(read, rest)),
            Err(error) => {
                tracing::error!(?scope, %error, "the handler's answer could not be read; its transaction is rolled back");
                return Err(Problem::Internal);
            }
        };
        let stored =
            idem_core::headers::to_stored(status, &head.headers, kept, options.store_set_cookie);
        Ok(Execution::Responded {
            stored,
            passthrough: Response::from_parts(head, body),
        })
    };
    match once::run(shared, &scope, fingerprint, trace_context, handler).await? {
        Outcome::Released(response) => Ok(not_executed(response, options.max_response_bytes).await),
        // The handler's committed answer (its length is the body's, whole or passed on), or
        // a found record's: a replay, a mismatch, in progress.
        outcome => Ok(respond(shared, outcome, |response: Response| {
            let (mut head, body) = response.into_parts();
            head.headers.remove(header::CONTENT_LENGTH);
            Response::from_parts(head, body)
        })),
    }
}

/// Calling a service whose readiness is always given (an axum route).
trait OneshotInfallible {
    fn oneshot_infallible(self, request: Request) -> impl Future<Output = Response>;
}

impl<S> OneshotInfallible for S
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    async fn oneshot_infallible(mut self, request: Request) -> Response {
        match std::future::poll_fn(|cx| self.poll_ready(cx)).await {
            Ok(()) => {}
            Err(never) => match never {},
        }
        match self.call(request).await {
            Ok(response) => response,
            Err(never) => match never {},
        }
    }
}
