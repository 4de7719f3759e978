//! The upstream client: one pooled HTTP/1.1 client, and the classification of what
//! happened to a forwarded request (answered, provably not sent, or unknown).
//!
//! An answer's body is read into memory up to a cap (a route's `max_response_bytes`);
//! past it, what was read and the rest of the body are handed on as a stream, so one
//! large answer costs at most the cap in memory, and it still reaches its client whole.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::{HeaderMap, Request, StatusCode, header};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tokio::time::{Instant, Sleep};
use tracing::Instrument;

use crate::error_chain;

pub type HttpClient = Client<HttpConnector, Deadlined>;

/// How long connecting may take. A connect that fails sent nothing, so the key is
/// released; this bounds how long that takes.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);

pub fn pooled_client() -> HttpClient {
    let mut connector = HttpConnector::new();
    connector.set_nodelay(true);
    connector.set_connect_timeout(Some(CONNECT_TIMEOUT));
    Client::builder(TokioExecutor::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .pool_max_idle_per_host(512)
        .build(connector)
}

/// An upstream answer.
#[derive(Debug)]
pub struct UpstreamResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: ResponseBody,
}

/// An answer's body: in memory, or (past the cap) streaming.
#[derive(Debug)]
pub enum ResponseBody {
    /// Read in full, within the cap.
    Full(Bytes),
    /// Longer than the cap: what was read so far, then the rest as it arrives.
    Streaming(Streaming),
}

impl ResponseBody {
    /// The body if it was read in full.
    pub fn full(&self) -> Option<&Bytes> {
        match self {
            Self::Full(bytes) => Some(bytes),
            Self::Streaming(_) => None,
        }
    }
}

/// What a forwarded request did.
#[derive(Debug)]
pub enum Forwarded {
    Answered(UpstreamResponse),
    /// The upstream never saw the request.
    NotSent(NotSent),
    /// Sent, but no complete answer within the deadline (or the connection broke).
    Unknown(Unknown),
}

/// Why a request never reached the upstream (so its key may be released). Each message
/// carries its whole cause chain, as it goes to the log.
#[derive(Debug, thiserror::Error)]
pub enum NotSent {
    #[error("cannot build the upstream URI: {}", error_chain(.0))]
    Uri(#[source] http::Error),
    #[error("{}", error_chain(.0))]
    Connect(#[source] hyper_util::client::legacy::Error),
    /// The process stalled before the request left, until past its deadline (and so,
    /// for the gateway, past its lease): [`Deadlined`] refused to send it.
    #[error("the request could not leave within {0:?}, so it was not sent")]
    Late(Duration),
}

/// Why a request that may have reached the upstream has no complete answer.
#[derive(Debug, thiserror::Error)]
pub enum Unknown {
    #[error("{}", error_chain(.0))]
    Request(#[source] hyper_util::client::legacy::Error),
    #[error("response body broke off: {}", error_chain(.0))]
    Body(#[source] hyper::Error),
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
}

/// Sends `request` and reads the answer, all within `timeout`, in a client span whose
/// context goes upstream as `traceparent`. A body longer than `max_body` bytes is
/// handed on as a stream (each of its later frames due within `timeout` of the last).
pub async fn forward(
    client: &HttpClient,
    mut request: Request<Full<Bytes>>,
    timeout: Duration,
    max_body: usize,
) -> Forwarded {
    let span = tracing::info_span!(
        "upstream",
        otel.kind = "client",
        http.request.method = %request.method(),
        url.full = %request.uri(),
        http.response.status_code = tracing::field::Empty,
    );
    idem_telemetry::propagation::inject(&span, request.headers_mut());
    let forwarded = exchange(client, request, timeout, max_body)
        .instrument(span.clone())
        .await;
    if let Forwarded::Answered(answer) = &forwarded {
        span.record("http.response.status_code", answer.status.as_u16());
    }
    forwarded
}

async fn exchange(
    client: &HttpClient,
    request: Request<Full<Bytes>>,
    timeout: Duration,
    max_body: usize,
) -> Forwarded {
    let deadline = Instant::now() + timeout;
    let request = request.map(|body| Deadlined::new(body, deadline));
    let exchange = async {
        idem_telemetry::failpoint::stop_here("stop-before-send");
        if Instant::now() >= deadline {
            return Forwarded::NotSent(NotSent::Late(timeout));
        }
        let response = match client.request(request).await {
            Ok(response) => response,
            Err(e) if e.is_connect() => return Forwarded::NotSent(NotSent::Connect(e)),
            Err(e) if refused_late(&e) => return Forwarded::NotSent(NotSent::Late(timeout)),
            Err(e) => return Forwarded::Unknown(Unknown::Request(e)),
        };
        let (parts, body) = response.into_parts();
        match read_capped(body, &parts.headers, max_body, timeout).await {
            Ok(body) => Forwarded::Answered(UpstreamResponse {
                status: parts.status,
                headers: parts.headers,
                body,
            }),
            Err(e) => Forwarded::Unknown(Unknown::Body(e)),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(forwarded) => forwarded,
        Err(_) => Forwarded::Unknown(Unknown::Timeout(timeout)),
    }
}

/// A request body that will not leave after its deadline.
///
/// A process can stall anywhere (a paused VM, a starved node): after the lease check and
/// before the request's bytes leave, the request may wait in the pool's hands until the
/// lease is over, and by then the reconciler may have released the key and a retry
/// executed it. The connection asks for the body only when it writes the request, so
/// refusing it there, unsent, keeps a late request from ever reaching the upstream.
/// Only the first frame is checked: once the body has started to leave, it leaves whole.
/// (An empty body is never asked for, so only a request with a body is covered.)
#[derive(Debug)]
pub struct Deadlined {
    body: Full<Bytes>,
    deadline: Instant,
    started: bool,
}

impl Deadlined {
    pub fn new(body: Full<Bytes>, deadline: Instant) -> Self {
        Self {
            body,
            deadline,
            started: false,
        }
    }
}

/// [`Deadlined`]'s refusal.
#[derive(Debug, thiserror::Error)]
#[error("the request body's deadline passed before it was sent")]
pub struct Late;

impl Body for Deadlined {
    type Data = Bytes;
    type Error = Late;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Late>>> {
        if !self.started {
            if Instant::now() >= self.deadline {
                return Poll::Ready(Some(Err(Late)));
            }
            self.started = true;
        }
        Pin::new(&mut self.body)
            .poll_frame(cx)
            .map_err(|never| match never {})
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// Whether the client's error is [`Deadlined`] refusing a late body.
fn refused_late(error: &hyper_util::client::legacy::Error) -> bool {
    let mut cause: Option<&(dyn std::error::Error + 'static)> = Some(error);
    while let Some(e) = cause {
        if e.is::<Late>() {
            return true;
        }
        cause = e.source();
    }
    false
}

/// Reads `body` in full if it fits in `max` bytes, else starts streaming it.
async fn read_capped(
    mut body: Incoming,
    headers: &HeaderMap,
    max: usize,
    idle: Duration,
) -> Result<ResponseBody, hyper::Error> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > max as u64) {
        return Ok(ResponseBody::Streaming(Streaming::new(None, body, idle)));
    }
    let mut read = BytesMut::with_capacity(declared.map_or(0, |len| len as usize));
    while let Some(frame) = body.frame().await {
        // Trailers are not kept (nor replayed).
        let Ok(data) = frame?.into_data() else {
            continue;
        };
        if read.len() + data.len() > max {
            read.extend_from_slice(&data);
            let head = read.freeze();
            return Ok(ResponseBody::Streaming(Streaming::new(
                Some(head),
                body,
                idle,
            )));
        }
        read.extend_from_slice(&data);
    }
    Ok(ResponseBody::Full(read.freeze()))
}

/// The rest of an answer longer than the cap: the part already read, then the
/// upstream's frames as they come. A stall longer than `idle` ends it with an error
/// (the client sees the connection close before the body's end).
pub struct Streaming {
    head: Option<Bytes>,
    rest: Incoming,
    idle: Duration,
    stall: Pin<Box<Sleep>>,
}

impl std::fmt::Debug for Streaming {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Streaming")
            .field("head", &self.head.as_ref().map(Bytes::len))
            .finish_non_exhaustive()
    }
}

impl Streaming {
    fn new(head: Option<Bytes>, rest: Incoming, idle: Duration) -> Self {
        Self {
            head,
            rest,
            idle,
            stall: Box::pin(tokio::time::sleep(idle)),
        }
    }
}

impl Body for Streaming {
    type Data = Bytes;
    type Error = Box<dyn std::error::Error + Send + Sync>;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        let this = &mut *self;
        if let Some(head) = this.head.take() {
            return Poll::Ready(Some(Ok(Frame::data(head))));
        }
        match Pin::new(&mut this.rest).poll_frame(cx) {
            Poll::Ready(frame) => {
                let deadline = Instant::now() + this.idle;
                this.stall.as_mut().reset(deadline);
                Poll::Ready(frame.map(|f| f.map_err(Into::into)))
            }
            Poll::Pending => match this.stall.as_mut().poll(cx) {
                Poll::Ready(()) => Poll::Ready(Some(Err(format!(
                    "the upstream sent nothing for {:?} mid-body",
                    this.idle
                )
                .into()))),
                Poll::Pending => Poll::Pending,
            },
        }
    }

    fn is_end_stream(&self) -> bool {
        self.head.is_none() && self.rest.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        let head = self.head.as_ref().map_or(0, |h| h.len() as u64);
        let rest = self.rest.size_hint();
        let mut hint = SizeHint::new();
        hint.set_lower(rest.lower() + head);
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper + head);
        }
        hint
    }
}

#[cfg(test)]
mod tests {
    use std::io::Read;

    use super::*;

    fn payment() -> Full<Bytes> {
        Full::new(Bytes::from_static(br#"{"amountUah": 100}"#))
    }

    /// A body asked for past its deadline is refused, and none of it reaches the server.
    #[tokio::test]
    async fn a_late_body_is_refused_unsent() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            socket
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut got = Vec::new();
            let _ = socket.read_to_end(&mut got); // closed, or quiet for 500 ms
            got
        });
        let request = Request::post(format!("http://{addr}/payments"))
            .body(Deadlined::new(payment(), Instant::now()))
            .unwrap();
        let error = pooled_client().request(request).await.unwrap_err();
        assert!(refused_late(&error), "{error:?}");
        let got = String::from_utf8_lossy(&server.join().unwrap()).into_owned();
        assert!(!got.contains("amountUah"), "the body left: {got:?}");
    }

    /// Once a body has started to leave, its deadline no longer matters.
    #[tokio::test]
    async fn a_body_asked_for_in_time_leaves_whole() {
        let mut body = Deadlined::new(payment(), Instant::now() + Duration::from_millis(50));
        let first = body.frame().await.unwrap().unwrap();
        assert_eq!(
            first.into_data().unwrap(),
            payment().collect().await.unwrap().to_bytes()
        );
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(body.frame().await.is_none(), "the end, not a refusal");
    }
}
