//! The tower layer, and one request through it:
//!
//! 1. tenant, key, body and fingerprint, read as the gateway reads them: bad input is a
//!    4xx and nothing is claimed;
//! 2. a completed answer held in this process is replayed at once;
//! 3. the key's turn in this process (`gate.rs`): a duplicate of a key this process
//!    is serving waits in memory (at most `lock_wait`, then 409), holding no connection;
//! 4. `BEGIN`, then the gateway's claim on the transaction, waiting on another
//!    transaction's uncommitted claim of the key for `FIRST_LOCK_WAIT` (20 ms) — beyond it on
//!    one of `max_lock_waits` connections for the rest of `lock_wait`, or not at all (409).
//!    A live record answers as at the gateway (replay, 409/422, 409 in progress), decided
//!    by [`idem_core::verdict`]; a first that rolled back leaves the key to claim;
//! 5. the handler runs with the transaction ([`crate::Tx`]); the request's extensions
//!    hold its [`Scope`] (tenant, endpoint, key) and its [`AttemptId`];
//! 6. an answer whose status rolls back (every 5xx, 408, 425 and 429 by default) rolls
//!    everything back: the client gets it, marked `not_executed` if it is a problem
//!    document, and the key is free. Those are also the statuses of the layers that cut a
//!    handler off and answer for it (a timeout's 408, a rate limiter's 429, a load
//!    shedder's 503): the layer cannot tell their answer from the handler's (axum drops
//!    the handler's future before the answer reaches it), so a layer put between this
//!    one and the handler must answer with a status that rolls back. Any other answer
//!    is stored in the record on the same transaction, which commits; only then is it
//!    answered. A commit whose acknowledgement was lost is 503
//!    `outcome-unrecorded`: a retry finds the committed record, or none.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::response::{IntoResponse, Response};
use http::header;
use idem_core::verdict;
use idem_core::{AttemptId, Cache, CacheEntry, Claim, ClaimResult, Completed, Scope, Verdict};
use idem_http::Problem;
use idem_http::request::{idempotency_key, read_body};
use idem_postgres::ledger::in_tx;
use idem_telemetry::{failpoint, propagation};
use sqlx::{Connection, Postgres, Transaction};
use tokio::time::Instant;
use tower_layer::Layer;
use tower_service::Service;
use tracing::{Instrument, Span};

use crate::Shared;
use crate::answer::{self, HandlerBody, PassOn, existing, not_executed, record_outcome, respond};
use crate::gate::Entry;
use crate::tx::Slot;

/// Makes a route idempotent: [`crate::Idempotency::layer`].
#[derive(Debug, Clone)]
pub struct IdempotencyLayer {
    shared: Arc<Shared>,
    endpoint: Arc<str>,
}

impl IdempotencyLayer {
    pub(crate) fn new(shared: Arc<Shared>, endpoint: &str) -> Self {
        Self {
            shared,
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
            endpoint: self.endpoint.clone(),
        }
    }
}

/// The route's handler behind the layer.
#[derive(Debug, Clone)]
pub struct IdempotencyService<S> {
    inner: S,
    shared: Arc<Shared>,
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
        let endpoint = self.endpoint.clone();
        let span =
            propagation::request_span(request.method(), request.uri().path(), request.headers());
        // An answer given before the body was read says `Connection: close`.
        let (parts, body) = request.into_parts();
        let (body, consumed) = idem_http::early::track(body);
        let request = Request::from_parts(parts, body);
        Box::pin(
            async move {
                let mut response = serve(&shared, &endpoint, inner, request)
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
    endpoint: &str,
    inner: S,
    request: Request,
) -> Result<Response, Problem>
where
    S: Service<Request, Response = Response, Error = Infallible>,
{
    let options = &shared.settings;
    let (mut parts, body) = request.into_parts();
    let tenant = shared
        .tenant
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

    if let Some((entry, _)) = shared.replays.get(&scope) {
        return Ok(respond(shared, verdict::cached(entry, &fingerprint)));
    }

    // Duplicates of a key this process is serving wait for it here, holding no pooled
    // connection; the key's turn is held until this request's transaction ends.
    let deadline = Instant::now() + options.lock_wait;
    let _turn = loop {
        match shared.gates.enter(&scope) {
            Entry::Turn(turn) => break turn,
            Entry::Busy(done) => {
                if tokio::time::timeout_at(deadline, done).await.is_err() {
                    return Ok(respond(shared, verdict::locked_out(false)));
                }
                // The first committed an answer this process now holds, or went away.
                if let Some((entry, _)) = shared.replays.get(&scope) {
                    return Ok(respond(shared, verdict::cached(entry, &fingerprint)));
                }
            }
        }
    };

    let begun = Instant::now();
    let attempt = AttemptId::random();
    let claim = Claim {
        scope: &scope,
        fingerprint: &fingerprint,
        attempt,
        // Nobody sees the claim before it commits completed, so no reconciler ever
        // judges this lease; it is the lock wait's, for the record.
        lease: options.lock_wait,
        ttl: options.ttl,
        trace_context: trace_context.as_deref(),
    };
    let (mut tx, claimed) = match claim_on(shared, &claim, None).await? {
        (tx, ClaimResult::Locked) => {
            // Another process's request (or a gateway's statement) holds the key: wait for
            // it on one of the few connections set aside for such waits, or not at all.
            drop(tx);
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(_waiting) = shared.lock_waits.try_acquire() else {
                return Ok(respond(shared, verdict::locked_out(false)));
            };
            if left.is_zero() {
                return Ok(respond(shared, verdict::locked_out(false)));
            }
            claim_on(shared, &claim, Some(left)).await?
        }
        claimed => claimed,
    };
    let read = Instant::now();
    match claimed {
        ClaimResult::Claimed => {}
        ClaimResult::Existing(record) => {
            if record_bytes(&record) > LARGE {
                tx.shrink_buffers();
            }
            drop(tx);
            let verdict = Verdict::of(record, &fingerprint);
            return Ok(existing(shared, &scope, verdict, read).await);
        }
        // The first request's claim is still uncommitted after `lock_wait`.
        ClaimResult::Locked => return Ok(respond(shared, verdict::locked_out(false))),
    }

    let slot = Slot::new(tx);
    parts.extensions.insert(slot.clone());
    // For the handler: whose operation this is, and the attempt's token.
    parts.extensions.insert(scope.clone());
    parts.extensions.insert(attempt);
    let response = inner
        .oneshot_infallible(Request::from_parts(parts, Body::from(body)))
        .await;
    let Some(mut tx) = slot.take() else {
        // The handler moved its Tx somewhere that outlives it: the transaction ends (rolls
        // back) when that is dropped. Nothing can be stored.
        tracing::error!(
            ?scope,
            "the handler kept its Tx after answering; its transaction is rolled back"
        );
        return Err(Problem::Internal);
    };

    let status = response.status().as_u16();
    if options.roll_back_on.contains(status) {
        if let Err(error) = tx.rollback().await {
            // The connection is closed with it: Postgres rolls back on its own.
            tracing::warn!(?scope, %error, "could not roll back; the connection is dropped");
        }
        record_outcome("released");
        return Ok(not_executed(response, options.max_response_bytes).await);
    }

    let (mut head, handler_body) = response.into_parts();
    let (kept, body) = match answer::read_answer(handler_body, options.max_response_bytes).await {
        Ok(HandlerBody::Whole(bytes)) => (Some(bytes.clone()), Body::from(bytes)),
        // Past what is stored: committed without it (retries get 410), and passed on to
        // this client as it comes, never held whole.
        Ok(HandlerBody::Over { read, rest }) => (None, PassOn::body(read, rest)),
        Err(error) => {
            tracing::error!(?scope, %error, "the handler's answer could not be read; its transaction is rolled back");
            return Err(Problem::Internal);
        }
    };
    let stored =
        idem_core::headers::to_stored(status, &head.headers, kept, options.store_set_cookie);
    let completed = in_tx::complete(&mut tx, &scope, attempt, &fingerprint, &stored, options.ttl);
    let expires_at = match completed.await {
        Ok(Completed::Recorded { expires_at }) => expires_at,
        Ok(Completed::Lost) => {
            // No one else can see the uncommitted claim: this cannot happen.
            tracing::error!(?scope, "the claim vanished inside its own transaction");
            return Err(Problem::Internal);
        }
        Err(error) => return Err(unavailable(&scope, "complete", &error)),
    };
    if stored.body.len() > LARGE {
        // Its buffers grew to the body's size: back to their usual size before the
        // connection returns to the pool.
        tx.shrink_buffers();
    }
    failpoint::stop_here("embedded-before-commit");
    if let Err(error) = tx.commit().await {
        return Err(if in_tx::rolled_back(&error) {
            tracing::error!(?scope, %error, "the commit was refused; nothing was kept");
            record_outcome("error");
            Problem::LedgerUnavailable
        } else {
            tracing::error!(?scope, %error, "the commit's answer was lost; it may have committed");
            record_outcome("unknown");
            Problem::OutcomeUnrecorded
        });
    }
    record_outcome("executed");
    failpoint::stop_here("embedded-after-commit");
    let entry = CacheEntry {
        fingerprint,
        response: stored,
        trace_context,
        expires_at: Some(expires_at),
    };
    // The row expires `ttl` after its transaction began (Postgres's `now()`), which
    // was after `begun`.
    let left = options.ttl.saturating_sub(begun.elapsed());
    if !entry.response.body_omitted {
        shared.replays.fill(&scope, &entry, left).await;
    }
    head.headers.remove(header::CONTENT_LENGTH);
    let mut response = Response::from_parts(head, body);
    idem_http::set_expires(&mut response, expires_at);
    Ok(response)
}

/// Begins the request's transaction and claims the key on it, waiting on another
/// transaction's claim of the key at most [`FIRST_LOCK_WAIT`] (or `wait`); the
/// transaction keeps `lock_wait` as its lock timeout for the handler.
async fn claim_on(
    shared: &Shared,
    claim: &Claim<'_>,
    wait: Option<Duration>,
) -> Result<(Transaction<'static, Postgres>, ClaimResult), Problem> {
    let begin = match wait {
        None => shared.begin.clone(),
        Some(wait) => begin_waiting(wait),
    };
    let mut tx = shared
        .pool
        .begin_with(sqlx::AssertSqlSafe(begin))
        .await
        .map_err(|error| unavailable(claim.scope, "begin", &error))?;
    let claimed = in_tx::claim(&mut tx, claim, shared.settings.lock_wait, &shared.bodies)
        .await
        .map_err(|error| {
            if error.is_busy() {
                // A large stored answer would go past `max_replay_bytes_in_flight`.
                tracing::warn!(scope = ?claim.scope, %error, "refused: too many stored answers in flight");
                Problem::Overloaded
            } else {
                unavailable(claim.scope, "claim", &error)
            }
        })?;
    Ok((tx, claimed))
}

/// How long a claim first waits on another transaction's claim of its key: longer than a
/// gateway's statement holds one, far shorter than another request's handler does.
pub(crate) const FIRST_LOCK_WAIT: Duration = Duration::from_millis(20);

/// The statement that begins a request's transaction, its claim waiting at most `wait`.
pub(crate) fn begin_waiting(wait: Duration) -> String {
    format!(
        "BEGIN; SET LOCAL lock_timeout = '{}ms'",
        wait.as_millis().max(1)
    )
}

/// A body this large leaves the connection that carried it with its buffers shrunk back.
const LARGE: usize = 1 << 20;

fn record_bytes(record: &idem_core::Record) -> usize {
    match &record.state {
        idem_core::RecordState::Completed(response) => response.body.len(),
        idem_core::RecordState::InProgress { .. } => 0,
    }
}

/// The ledger could not be used before anything was committed: nothing happened.
fn unavailable(scope: &Scope, step: &str, error: &dyn std::fmt::Display) -> Problem {
    tracing::error!(?scope, step, %error, "the idempotency ledger is unavailable; nothing was executed");
    Problem::LedgerUnavailable
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
