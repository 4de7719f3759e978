//! The answers the layer gives: those decided without the handler (a replay, a conflict,
//! in progress, as [`crate::once::run`] decides them), the handler's own (read within
//! `max_response_bytes`, or passed through past it), and a rolled-back one marked
//! `not_executed`.

use std::pin::Pin;
use std::task::{Context, Poll};

use axum::body::Body;
use axum::response::{IntoResponse, Response};
use bytes::{Bytes, BytesMut};
use http::{HeaderValue, header};
use http_body::Frame;
use http_body_util::BodyExt;
use idem_core::Outcome;
use idem_http::Problem;
use idem_http::problem::NOT_EXECUTED;
use idem_telemetry::propagation;
use tracing::Span;

use crate::Shared;

/// The answer to an outcome, as the gateway gives it: the handler's own answer (`first`
/// makes it), or one decided without running the handler — a replay's, a conflict's span
/// links to the first execution.
pub(crate) fn respond<R>(
    shared: &Shared,
    outcome: Outcome<R>,
    first: impl FnOnce(R) -> Response,
) -> Response {
    if let Some(first) = outcome.first_execution() {
        propagation::link(&Span::current(), first);
    }
    record_outcome(outcome.name());
    idem_http::answer(outcome, shared.settings.mismatch_status, None, first)
}

/// Names what the request came to on its `idemgate.request` span.
pub(crate) fn record_outcome(name: &'static str) {
    Span::current().record("idempotency.outcome", name);
}

/// The handler's answer to a request that was rolled back: as it came, with
/// `operation_state: not_executed` and `safe_new_key: true` added when it is a problem
/// document (RFC 9457), so the client knows the key is free.
pub(crate) async fn not_executed(response: Response, limit: usize) -> Response {
    let is_problem = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|ct| ct.starts_with("application/problem+json"));
    if !is_problem {
        return response;
    }
    let (mut head, body) = response.into_parts();
    let bytes = match http_body_util::Limited::new(body, limit).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return Problem::Internal.into_response(),
    };
    let body = match serde_json::from_slice::<serde_json::Value>(&bytes) {
        Ok(serde_json::Value::Object(mut problem)) => {
            problem.insert("operation_state".into(), NOT_EXECUTED.into());
            problem.insert("safe_new_key".into(), true.into());
            head.headers.remove(header::CONTENT_LENGTH);
            Bytes::from(serde_json::Value::Object(problem).to_string())
        }
        _ => bytes,
    };
    head.headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    Response::from_parts(head, Body::from(body))
}

/// The handler's answer body, read up to a limit.
pub(crate) enum HandlerBody {
    /// All of it.
    Whole(Bytes),
    /// More than the limit: what was read, and the rest still to come.
    Over { read: Bytes, rest: Body },
}

/// Reads `body` until its end, or until more than `limit` bytes have come: a service's
/// answer is held in memory only up to what would be stored of it.
pub(crate) async fn read_answer(mut body: Body, limit: usize) -> Result<HandlerBody, axum::Error> {
    let mut read = BytesMut::new();
    while let Some(frame) = body.frame().await {
        // Trailers are not stored or replayed.
        if let Ok(data) = frame?.into_data() {
            read.extend_from_slice(&data);
            if read.len() > limit {
                return Ok(HandlerBody::Over {
                    read: read.freeze(),
                    rest: body,
                });
            }
        }
    }
    Ok(HandlerBody::Whole(read.freeze()))
}

/// An answer over the limit, sent on as it comes: what was read first, then the rest.
pub(crate) struct PassOn {
    read: Option<Bytes>,
    rest: Body,
}

impl PassOn {
    pub(crate) fn body(read: Bytes, rest: Body) -> Body {
        Body::new(Self {
            read: Some(read),
            rest,
        })
    }
}

impl http_body::Body for PassOn {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        if let Some(read) = self.read.take() {
            return Poll::Ready(Some(Ok(Frame::data(read))));
        }
        Pin::new(&mut self.rest).poll_frame(cx)
    }
}
