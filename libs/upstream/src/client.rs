//! The upstream client: one pooled HTTP/1.1 client, and the classification of what
//! happened to a forwarded request (answered, provably not sent, or unknown).
//!
//! An answer's body is read into memory up to a cap (a route's `max_response_bytes`);
//! past it, what was read and the rest of the body are handed on as a stream, so one
//! large answer costs at most the cap in memory, and it still reaches its client whole.
//!
//! # Why one file of ~550 lines (and its tests)
//! The pool, the gate on each socket and the classification of what happened are one
//! mechanism: whether a request provably never left depends on the gate's state at the
//! moment the pool hands out the socket, and reading one without the others is how the
//! "not sent" promise breaks.

use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use http::uri::{Authority, PathAndQuery};
use http::{HeaderMap, HeaderValue, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Full};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::http1::{self, SendRequest};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio::time::{Instant, Sleep};
use tracing::Instrument;

use crate::error_chain;

/// How long connecting may take. A connect that fails sent nothing, so the key is
/// released; this bounds how long that takes.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// An idle connection older than this is closed rather than reused.
const IDLE_TIMEOUT: Duration = Duration::from_secs(30);
/// Idle connections kept per upstream (host and port).
const MAX_IDLE_PER_HOST: usize = 512;

/// One pooled HTTP/1.1 client (plain `http://` upstreams). Cloning shares the pool.
///
/// Every connection's socket is behind a [`Gate`]: a request is armed with its deadline
/// when it is handed to a connection, and its first byte may leave only before that
/// deadline. The check is made by the write itself, at the moment the request leaves, so
/// no stall anywhere before it (a paused VM, a starved node, a failpoint) can send a
/// request after its lease — whether or not it has a body.
#[derive(Clone, Debug, Default)]
pub struct HttpClient {
    idle: Arc<Mutex<HashMap<Authority, Vec<Idle>>>>,
}

pub fn pooled_client() -> HttpClient {
    HttpClient::default()
}

/// A connection that answered and may carry the next request.
#[derive(Debug)]
struct Idle {
    conn: Conn,
    since: Instant,
}

#[derive(Debug)]
struct Conn {
    sender: SendRequest<Full<Bytes>>,
    gate: Arc<Gate>,
}

impl HttpClient {
    /// An idle connection to `authority`, or a new one.
    async fn connection(&self, authority: &Authority) -> Result<(Conn, bool), ConnectError> {
        if let Some(conn) = self.reuse(authority) {
            return Ok((conn, true));
        }
        Ok((connect(authority).await?, false))
    }

    fn reuse(&self, authority: &Authority) -> Option<Conn> {
        let mut idle = self.idle.lock().expect("the pool lock is never poisoned");
        let list = idle.get_mut(authority)?;
        while let Some(entry) = list.pop() {
            if entry.since.elapsed() < IDLE_TIMEOUT && entry.conn.sender.is_ready() {
                return Some(entry.conn);
            }
        }
        None
    }

    /// Puts `conn` back once it has finished its exchange (its answer read to the end).
    fn give_back(&self, authority: Authority, mut conn: Conn) {
        let pool = self.clone();
        tokio::spawn(async move {
            if conn.sender.ready().await.is_err() {
                return; // closed: the upstream or an error ended it
            }
            let mut idle = pool.idle.lock().expect("the pool lock is never poisoned");
            let list = idle.entry(authority).or_default();
            list.retain(|entry| {
                entry.since.elapsed() < IDLE_TIMEOUT && !entry.conn.sender.is_closed()
            });
            if list.len() < MAX_IDLE_PER_HOST {
                list.push(Idle {
                    conn,
                    since: Instant::now(),
                });
            }
        });
    }
}

async fn connect(authority: &Authority) -> Result<Conn, ConnectError> {
    let host = authority
        .host()
        .trim_start_matches('[')
        .trim_end_matches(']');
    let port = authority.port_u16().unwrap_or(80);
    let stream = tokio::time::timeout(CONNECT_TIMEOUT, TcpStream::connect((host, port)))
        .await
        .map_err(|_| ConnectError::Timeout(CONNECT_TIMEOUT))?
        .map_err(ConnectError::Io)?;
    stream.set_nodelay(true).map_err(ConnectError::Io)?;
    let gate = Arc::new(Gate::default());
    let io = TokioIo::new(Gated {
        io: stream,
        gate: gate.clone(),
    });
    let (sender, connection) = http1::handshake(io)
        .await
        .map_err(ConnectError::Handshake)?;
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(error = %error_chain(&error), "upstream connection ended");
        }
    });
    Ok(Conn { sender, gate })
}

/// Why no connection could be made (nothing was sent).
#[derive(Debug, thiserror::Error)]
pub enum ConnectError {
    #[error("no connection within {0:?}")]
    Timeout(Duration),
    #[error("cannot connect: {}", error_chain(.0))]
    Io(#[source] std::io::Error),
    #[error("cannot set up the connection: {}", error_chain(.0))]
    Handshake(#[source] hyper::Error),
}

/// Whether the request on a connection may still leave: see [`HttpClient`].
#[derive(Debug, Default)]
struct Gate {
    state: Mutex<GateState>,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
enum GateState {
    /// Nothing to send, or the last request has left.
    #[default]
    Open,
    /// A request is waiting to leave, until this deadline.
    Armed(Instant),
    /// The request's deadline passed before it left: it never will.
    Refused,
}

impl Gate {
    fn lock(&self) -> std::sync::MutexGuard<'_, GateState> {
        self.state.lock().expect("the gate lock is never poisoned")
    }

    fn arm(&self, deadline: Instant) {
        *self.lock() = GateState::Armed(deadline);
    }

    /// Called by the socket's writes: whether bytes may leave now.
    fn pass(&self) -> bool {
        let mut state = self.lock();
        match *state {
            GateState::Open => true,
            GateState::Armed(deadline) if Instant::now() < deadline => {
                *state = GateState::Open;
                true
            }
            GateState::Armed(_) | GateState::Refused => {
                *state = GateState::Refused;
                false
            }
        }
    }

    /// The exchange is over without an answer: a request that has not left yet never
    /// will. True if it had not (so it provably was not sent).
    fn abandon(&self) -> bool {
        let mut state = self.lock();
        match *state {
            GateState::Armed(_) | GateState::Refused => {
                *state = GateState::Refused;
                true
            }
            GateState::Open => false,
        }
    }

    fn refused(&self) -> bool {
        *self.lock() == GateState::Refused
    }
}

/// A socket whose writes pass its [`Gate`] first.
#[derive(Debug)]
struct Gated {
    io: TcpStream,
    gate: Arc<Gate>,
}

fn late() -> std::io::Error {
    std::io::Error::other(Late)
}

impl AsyncRead for Gated {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for Gated {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        if !self.gate.pass() {
            return Poll::Ready(Err(late()));
        }
        Pin::new(&mut self.io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        if !self.gate.pass() {
            return Poll::Ready(Err(late()));
        }
        Pin::new(&mut self.io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

/// The gate's refusal.
#[derive(Debug, thiserror::Error)]
#[error("the request's deadline passed before it was sent")]
pub struct Late;

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
    #[error("the upstream URI {0} names no host")]
    NoHost(Uri),
    #[error("{0}")]
    Connect(#[source] ConnectError),
    /// The connection closed before the request was written (it was handed back unsent).
    #[error("the connection closed before the request was sent: {}", error_chain(.0))]
    Closed(#[source] hyper::Error),
    /// The process stalled before the request left, until past its deadline (and so,
    /// for the gateway, past its lease): the connection's gate refused to send it.
    #[error("the request could not leave within {0:?}, so it was not sent")]
    Late(Duration),
}

/// Why a request that may have reached the upstream has no complete answer.
#[derive(Debug, thiserror::Error)]
pub enum Unknown {
    #[error("{}", error_chain(.0))]
    Request(#[source] hyper::Error),
    #[error("response body broke off: {}", error_chain(.0))]
    Body(#[source] hyper::Error),
    #[error("no complete answer within {0:?}")]
    Timeout(Duration),
}

/// Sends `request` and reads the answer, all within `timeout`, in a client span whose
/// context goes upstream as `traceparent`. A body longer than `max_body` bytes is
/// handed on as a stream (each of its later frames due within `timeout` of the last);
/// with `max_body` 0 (a route that stores nothing) the whole body streams on from the
/// answer's head, so an event stream or a long download flows as it comes and `timeout`
/// bounds only the wait for the head and each stall between frames.
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
    mut request: Request<Full<Bytes>>,
    timeout: Duration,
    max_body: usize,
) -> Forwarded {
    let deadline = Instant::now() + timeout;
    let Some(authority) = request.uri().authority().cloned() else {
        return Forwarded::NotSent(NotSent::NoHost(request.uri().clone()));
    };
    // On a connection of its own, a request names its path only; the host goes in `Host`.
    if !request.headers().contains_key(header::HOST)
        && let Ok(host) = HeaderValue::from_str(authority.as_str())
    {
        request.headers_mut().insert(header::HOST, host);
    }
    let origin = request
        .uri()
        .path_and_query()
        .cloned()
        .unwrap_or_else(|| PathAndQuery::from_static("/"));
    *request.uri_mut() = Uri::from(origin);

    let Ok(connected) = tokio::time::timeout_at(deadline, client.connection(&authority)).await
    else {
        return Forwarded::NotSent(NotSent::Late(timeout));
    };
    let (mut conn, mut reused) = match connected {
        Ok(connected) => connected,
        Err(e) => return Forwarded::NotSent(NotSent::Connect(e)),
    };
    idem_telemetry::failpoint::stop_here("stop-before-send");
    let response = loop {
        conn.gate.arm(deadline);
        let gate = conn.gate.clone();
        let answer = conn.sender.try_send_request(request);
        client.give_back(authority.clone(), conn);
        match tokio::time::timeout_at(deadline, answer).await {
            Ok(Ok(response)) => break response,
            Err(_) if gate.abandon() => return Forwarded::NotSent(NotSent::Late(timeout)),
            Err(_) => return Forwarded::Unknown(Unknown::Timeout(timeout)),
            Ok(Err(_)) if gate.refused() => return Forwarded::NotSent(NotSent::Late(timeout)),
            Ok(Err(mut e)) => match e.take_message() {
                // An idle connection the upstream had just closed: once more on a new one.
                Some(unsent) if reused => {
                    request = unsent;
                    conn = match tokio::time::timeout_at(deadline, connect(&authority)).await {
                        Ok(Ok(conn)) => conn,
                        Ok(Err(e)) => return Forwarded::NotSent(NotSent::Connect(e)),
                        Err(_) => return Forwarded::NotSent(NotSent::Late(timeout)),
                    };
                    reused = false;
                }
                Some(_) => return Forwarded::NotSent(NotSent::Closed(e.into_error())),
                None => return Forwarded::Unknown(Unknown::Request(e.into_error())),
            },
        }
    };
    let (parts, body) = response.into_parts();
    match tokio::time::timeout_at(
        deadline,
        read_capped(body, &parts.headers, max_body, timeout),
    )
    .await
    {
        Ok(Ok(body)) => Forwarded::Answered(UpstreamResponse {
            status: parts.status,
            headers: parts.headers,
            body,
        }),
        Ok(Err(e)) => Forwarded::Unknown(Unknown::Body(e)),
        Err(_) => Forwarded::Unknown(Unknown::Timeout(timeout)),
    }
}

/// Reads `body` in full if it fits in `max` bytes, else starts streaming it (at once when
/// `max` is 0).
async fn read_capped(
    mut body: Incoming,
    headers: &HeaderMap,
    max: usize,
    idle: Duration,
) -> Result<ResponseBody, hyper::Error> {
    if max == 0 {
        return Ok(ResponseBody::Streaming(Streaming::new(None, body, idle)));
    }
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
    use std::io::{Read, Write};

    use super::*;

    /// A server that takes one connection and returns what arrived on it (until it
    /// closed, or was quiet for 500 ms).
    fn listen() -> (Authority, std::thread::JoinHandle<String>) {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            socket
                .set_read_timeout(Some(Duration::from_millis(500)))
                .unwrap();
            let mut got = Vec::new();
            let _ = socket.read_to_end(&mut got);
            String::from_utf8_lossy(&got).into_owned()
        });
        (addr.to_string().parse().unwrap(), server)
    }

    /// Hands `request` to a new connection whose gate is armed with a deadline already
    /// past: what a process stalled between its lease check and the send does on resume.
    async fn send_late(authority: &Authority, request: Request<Full<Bytes>>) -> Arc<Gate> {
        let mut conn = connect(authority).await.unwrap();
        conn.gate.arm(Instant::now());
        let sent = conn.sender.try_send_request(request).await;
        assert!(sent.is_err(), "a late request was answered");
        conn.gate
    }

    #[tokio::test]
    async fn a_late_request_with_a_body_is_refused_unsent() {
        let (authority, server) = listen();
        let request = Request::post("/payments")
            .header(header::HOST, authority.as_str())
            .body(Full::new(Bytes::from_static(br#"{"amountUah": 100}"#)))
            .unwrap();
        let gate = send_late(&authority, request).await;
        assert!(gate.refused());
        let got = server.join().unwrap();
        assert!(got.is_empty(), "the request left: {got:?}");
    }

    // On 7fa843d (hyper-util's pool, the deadline checked by the body): `the request
    // left: "POST /capture HTTP/1.1\r\ncontent-length: 0..."` — hyper writes a request
    // without a body without ever asking the body for a frame.
    #[tokio::test]
    async fn a_late_request_without_a_body_is_refused_unsent() {
        let (authority, server) = listen();
        let request = Request::post("/capture")
            .header(header::HOST, authority.as_str())
            .header(header::CONTENT_LENGTH, "0")
            .body(Full::new(Bytes::new()))
            .unwrap();
        let gate = send_late(&authority, request).await;
        assert!(gate.refused());
        let got = server.join().unwrap();
        assert!(got.is_empty(), "the request left: {got:?}");
    }

    /// In time, requests leave, and one connection carries them one after another.
    #[tokio::test]
    async fn requests_in_time_leave_and_share_a_connection() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let server = std::thread::spawn(move || {
            let (mut socket, _) = listener.accept().unwrap();
            let mut heads = 0;
            let mut got = Vec::new();
            let mut buf = [0u8; 4096];
            while heads < 2 {
                let n = socket.read(&mut buf).unwrap();
                got.extend_from_slice(&buf[..n]);
                let seen = String::from_utf8_lossy(&got).matches("\r\n\r\n").count();
                while heads < seen {
                    socket
                        .write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")
                        .unwrap();
                    heads += 1;
                }
            }
            String::from_utf8_lossy(&got).into_owned()
        });
        let client = pooled_client();
        for _ in 0..2 {
            let request = Request::post(format!("http://{addr}/capture"))
                .body(Full::new(Bytes::new()))
                .unwrap();
            match forward(&client, request, Duration::from_secs(5), 1024).await {
                Forwarded::Answered(answer) => {
                    assert_eq!(answer.body.full().unwrap().as_ref(), b"ok");
                }
                other => panic!("{other:?}"),
            }
            // The answer is read; the connection goes back to the pool.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let got = server.join().unwrap();
        assert_eq!(got.matches("POST /capture HTTP/1.1").count(), 2, "{got}");
        assert!(got.contains(&format!("host: {addr}")), "{got}");
    }

    /// Nobody listening: provably not sent.
    #[tokio::test]
    async fn a_refused_connection_is_not_sent() {
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let request = Request::post(format!("http://{addr}/payments"))
            .body(Full::new(Bytes::new()))
            .unwrap();
        let forwarded = forward(&pooled_client(), request, Duration::from_secs(5), 1024).await;
        assert!(
            matches!(forwarded, Forwarded::NotSent(NotSent::Connect(_))),
            "{forwarded:?}"
        );
    }
}
