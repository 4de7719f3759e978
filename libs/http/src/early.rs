//! Answers given before the request's body was read: a 413 to a body over the limit, a
//! 401, 400 or 429 while the body is still arriving. HTTP/1.1 cannot take another request
//! on that connection (the rest of the body is still in the way), so the server closes it
//! after the answer — and an answer that does not say so leaves a keep-alive client (a
//! pooled SDK) sending its next request into a connection about to close: a connection
//! error, the very uncertainty idemgate exists to remove. So such an answer carries
//! `Connection: close`, in both modes; the gateway's listener also reads and discards
//! what the client still sends before it closes (see `services/gateway/src/server.rs`),
//! and in embedded mode [`Consumed::linger`] reads the rest of the body in the background,
//! so the kernel never resets the connection under the answer. A small remainder (at
//! most [`DRAIN_UP_TO`], arriving within [`DRAIN_FOR`]) is read and discarded instead,
//! and the connection stays open for the client's next request.

use std::pin::Pin;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::body::Body;
use axum::extract::Request;
use axum::middleware::Next;
use axum::response::Response;
use bytes::Bytes;
use http::{HeaderValue, header};
use http_body::{Frame, SizeHint};

/// What is left of a body after an early answer, read and discarded in the background by
/// [`Consumed::linger`] (embedded mode): at most this much...
pub const LINGER_BYTES: usize = 1 << 20;
/// ...for at most this long.
pub const LINGER_FOR: Duration = Duration::from_secs(2);

/// A remainder this small is read and discarded after an early answer, so the
/// connection can serve the client's next request.
pub const DRAIN_UP_TO: u64 = 64 * 1024;
/// ...if it arrives within this long.
pub const DRAIN_FOR: Duration = Duration::from_millis(100);

/// Whether a request's body has been read to its end, and what is left of it once its
/// reader let go of it unread. A request without a body allocates nothing (`None`).
#[derive(Debug, Clone)]
pub struct Consumed(Option<Arc<State>>);

#[derive(Debug, Default)]
struct State {
    done: AtomicBool,
    left: Mutex<Option<Body>>,
}

impl Consumed {
    pub fn done(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(|state| state.done.load(Ordering::Relaxed))
    }

    /// `Connection: close` on `response` unless the body was read to its end — or what
    /// was left of it is small and arrives soon: then it is read and discarded here.
    pub async fn close_unless_done(&self, response: &mut Response) {
        if self.done() || self.drain().await {
            return;
        }
        response
            .headers_mut()
            .insert(header::CONNECTION, HeaderValue::from_static("close"));
    }

    /// Behind a server that closes a connection as soon as its answer is out (hyper under
    /// `axum::serve`, embedded mode's), the rest of an early-answered body is read and
    /// discarded in the background — at most [`LINGER_BYTES`], for at most [`LINGER_FOR`]
    /// — so the server goes on reading the socket and closes only once the client has sent
    /// it all: closing with unread bytes would make the kernel reset the connection under
    /// the answer. (The gateway's own listener lingers on the socket itself.)
    pub fn linger(&self) {
        let Some(state) = &self.0 else { return };
        let Some(left) = state.left.lock().expect("body remainder").take() else {
            return;
        };
        tokio::spawn(async move {
            let limited = http_body_util::Limited::new(left, LINGER_BYTES);
            let _ =
                tokio::time::timeout(LINGER_FOR, http_body_util::BodyExt::collect(limited)).await;
        });
    }

    /// Reads what is left of the body if it is small, within [`DRAIN_FOR`]; a larger
    /// remainder stays for [`Consumed::linger`].
    async fn drain(&self) -> bool {
        let Some(state) = &self.0 else { return false };
        let left = state.left.lock().expect("body remainder").take();
        let Some(left) = left else { return false };
        if http_body::Body::size_hint(&left)
            .upper()
            .is_none_or(|upper| upper > DRAIN_UP_TO)
        {
            *state.left.lock().expect("body remainder") = Some(left);
            return false;
        }
        let limited = http_body_util::Limited::new(left, DRAIN_UP_TO as usize);
        matches!(
            tokio::time::timeout(DRAIN_FOR, http_body_util::BodyExt::collect(limited)).await,
            Ok(Ok(_))
        )
    }
}

/// `body`, telling `Consumed` once it has been read to its end.
pub fn track(body: Body) -> (Body, Consumed) {
    if http_body::Body::is_end_stream(&body) {
        return (body, Consumed(None));
    }
    let state = Arc::new(State::default());
    let tracked = Tracked {
        inner: Some(body),
        state: state.clone(),
    };
    (Body::new(tracked), Consumed(Some(state)))
}

/// As middleware: every answer given before its request's body was read says
/// `Connection: close`.
pub async fn close_if_unread(request: Request, next: Next) -> Response {
    let (parts, body) = request.into_parts();
    let (body, consumed) = track(body);
    let mut response = next.run(Request::from_parts(parts, body)).await;
    consumed.close_unless_done(&mut response).await;
    response
}

struct Tracked {
    /// Always `Some` until dropped.
    inner: Option<Body>,
    state: Arc<State>,
}

impl Drop for Tracked {
    fn drop(&mut self) {
        // Left unread: kept for `Consumed::drain`.
        if !self.state.done.load(Ordering::Relaxed) {
            *self.state.left.lock().expect("body remainder") = self.inner.take();
        }
    }
}

impl http_body::Body for Tracked {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, axum::Error>>> {
        let inner = self.inner.as_mut().expect("a live body");
        let polled = Pin::new(inner).poll_frame(cx);
        if let Poll::Ready(None) = polled {
            self.state.done.store(true, Ordering::Relaxed);
        }
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.inner
            .as_ref()
            .is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> SizeHint {
        self.inner
            .as_ref()
            .map_or_else(SizeHint::default, http_body::Body::size_hint)
    }
}
