//! Answers given before the request's body was read: a 413 to a body over the limit, a
//! 401, 400 or 429 while the body is still arriving. HTTP/1.1 cannot take another request
//! on that connection (the rest of the body is still in the way), so the server closes it
//! after the answer — and an answer that does not say so leaves a keep-alive client (a
//! pooled SDK) sending its next request into a connection about to close: a connection
//! error, the very uncertainty idemgate exists to remove. So such an answer carries
//! `Connection: close`, in both modes; the gateway's listener also reads and discards
//! what the client still sends before it closes (see `services/gateway/src/server.rs`),
//! so the kernel never resets the connection under the answer.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Context, Poll};

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderValue, header};
use http_body::{Frame, SizeHint};

/// Whether a request's body has been read to its end.
#[derive(Debug, Clone, Default)]
pub struct Consumed(Arc<AtomicBool>);

impl Consumed {
    pub fn done(&self) -> bool {
        self.0.load(Ordering::Relaxed)
    }

    /// `Connection: close` on `response` unless the body was read to its end.
    pub fn close_unless_done(&self, response: &mut Response) {
        if !self.done() {
            response
                .headers_mut()
                .insert(header::CONNECTION, HeaderValue::from_static("close"));
        }
    }
}

/// `body`, telling `Consumed` once it has been read to its end.
pub fn track(body: Body) -> (Body, Consumed) {
    let consumed = Consumed::default();
    if http_body::Body::is_end_stream(&body) {
        consumed.0.store(true, Ordering::Relaxed);
        return (body, consumed);
    }
    let tracked = Tracked {
        inner: body,
        consumed: consumed.clone(),
    };
    (Body::new(tracked), consumed)
}

/// As middleware: every answer given before its request's body was read says
/// `Connection: close`.
pub async fn close_if_unread(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let (body, consumed) = track(body);
    let mut response = next.run(Request::from_parts(parts, body)).await;
    consumed.close_unless_done(&mut response);
    response
}

struct Tracked {
    inner: Body,
    consumed: Consumed,
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let polled = Pin::new(&mut self.inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.consumed.0.store(true, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.inner.size_hint()
    }
}
