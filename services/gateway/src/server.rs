//! The HTTP/1.1 listener: accepting connections and serving each with hyper, under the
//! connection-level limits of the `server.*` keys (docs/configuration.md) that a handler cannot enforce itself.
//!
//! - A request head must arrive within `server.header_read_timeout`, or the connection
//!   is closed (slowloris). hyper starts that clock whenever it waits for a head, so an
//!   idle keep-alive connection is closed after the same time.
//! - hyper refuses heads past twice `server.max_header_bytes` / `server.max_headers`
//!   with a bare 431 and closes the connection; below that, [`crate::limits`] answers
//!   431 with a problem body at the exact limits. (hyper cannot be asked for a body on
//!   its own refusals, and it must not buffer unbounded heads to let us decide.)
//!
//! - An answer given before its request's body was read says `Connection: close`
//!   (`idem_http::early`), and every connection is closed gracefully ([`linger`]): the
//!   rest of what the client sends is read and discarded for a bounded time and size, so
//!   the kernel never resets the connection under an answer.
//!
//! - A write of an answer that the client accepts none of for
//!   `server.response_write_timeout` closes the connection ([`WriteTimeout`]): a client
//!   that asks and never reads holds its answer's memory that long at most.
//!
//! `axum::serve` sets none of these (it builds hyper without a timer), which is why this
//! module exists.

use std::future::{Future, poll_fn};
use std::io;
use std::net::SocketAddr;
use std::pin::{Pin, pin};
use std::task::{Context, Poll};
use std::time::Duration;

use axum::Router;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Sleep;

/// The connection-level limits.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    pub header_read_timeout: Duration,
    pub max_header_bytes: usize,
    pub max_headers: usize,
    pub response_write_timeout: Duration,
}

/// Serves `router` on `listener` until `shutdown` resolves; then stops accepting, asks
/// every open connection to finish its request in flight and close, and returns once
/// all have.
pub async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    shutdown: impl Future<Output = ()> + Send + 'static,
) {
    // Every answer given before its request's body was read says `Connection: close`.
    let router = router.layer(axum::middleware::from_fn(idem_http::early::close_if_unread));
    let mut http = hyper::server::conn::http1::Builder::new();
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.header_read_timeout)
        .max_header_size(limits.max_header_bytes.saturating_mul(2))
        .max_headers(limits.max_headers.saturating_mul(2));
    // Dropped when shutdown starts: every connection task watches for that.
    let (stop_tx, stop_rx) = watch::channel(());
    // Each connection task holds a clone; `closed()` resolves when all are gone.
    let (done_tx, _) = watch::channel(());
    let mut shutdown = pin!(shutdown);
    loop {
        let (stream, peer) = tokio::select! {
            accepted = listener.accept() => match accepted {
                Ok(accepted) => accepted,
                Err(error) => {
                    // Out of file descriptors, or a connection reset before accept:
                    // back off a little rather than spin.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
            () = &mut shutdown => break,
        };
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(WithPeer {
            inner: router.clone(),
            peer,
        });
        let stream = WriteTimeout::new(stream, limits.response_write_timeout);
        let mut connection = http.serve_connection(TokioIo::new(stream), service);
        let mut stop = stop_rx.clone();
        let done = done_tx.subscribe();
        tokio::spawn(async move {
            // Served without hyper shutting the socket down at the end, so that it can
            // be closed gracefully (`linger`) once the last answer has gone out.
            let mut served = poll_fn(|cx| connection.poll_without_shutdown(cx));
            let ended = tokio::select! {
                ended = &mut served => ended,
                _ = stop.changed() => {
                    drop(served);
                    Pin::new(&mut connection).graceful_shutdown();
                    poll_fn(|cx| connection.poll_without_shutdown(cx)).await
                }
            };
            match ended {
                Ok(()) => linger(connection.into_parts().io.into_inner().into_inner()).await,
                Err(error) => tracing::debug!(%error, "connection ended with an error"),
            }
            drop(done);
        });
    }
    drop(listener);
    drop(stop_tx);
    done_tx.closed().await;
}

/// The router, with each request's peer address in its extensions (axum's
/// `ConnectInfo`, as `into_make_service_with_connect_info` would put it): the admin API
/// logs who was refused.
#[derive(Clone)]
struct WithPeer {
    inner: Router,
    peer: SocketAddr,
}

impl<B> tower_service::Service<http::Request<B>> for WithPeer
where
    B: http_body::Body<Data = bytes::Bytes> + Send + 'static,
    B::Error: Into<axum::BoxError>,
{
    type Response = axum::response::Response;
    type Error = std::convert::Infallible;
    type Future = <Router as tower_service::Service<http::Request<B>>>::Future;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        <Router as tower_service::Service<http::Request<B>>>::poll_ready(&mut self.inner, cx)
    }

    fn call(&mut self, mut request: http::Request<B>) -> Self::Future {
        request
            .extensions_mut()
            .insert(axum::extract::ConnectInfo(self.peer));
        self.inner.call(request)
    }
}

/// The longest and the most a closing connection still reads of what its client sends.
const LINGER_FOR: Duration = Duration::from_secs(2);
const LINGER_BYTES: usize = 1 << 20;

/// Closes a connection gracefully, as nginx's lingering close does: says it is done
/// (FIN), then reads and discards what the client still sends — the rest of a body that
/// was answered early — until the client closes too, for at most [`LINGER_FOR`] and
/// [`LINGER_BYTES`]. Closing with unread bytes would make the kernel reset the
/// connection, and a reset can destroy the answer before the client has read it.
async fn linger(mut stream: TcpStream) {
    if stream.shutdown().await.is_err() {
        return;
    }
    let deadline = tokio::time::Instant::now() + LINGER_FOR;
    let mut buf = vec![0u8; 16 * 1024];
    let mut left = LINGER_BYTES;
    while left > 0 {
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Ok(Ok(n)) if n > 0 => left = left.saturating_sub(n),
            _ => return,
        }
    }
}

/// A connection whose writes fail once one has waited `timeout` for the client to take
/// any of it (its receive window stayed full): hyper then closes the connection. A
/// client reading slowly but steadily is never cut off; one that stopped reading is.
struct WriteTimeout {
    io: TcpStream,
    timeout: Duration,
    /// Running while a write waits for the client.
    stalled: Option<Pin<Box<Sleep>>>,
}

impl WriteTimeout {
    fn new(io: TcpStream, timeout: Duration) -> Self {
        Self {
            io,
            timeout,
            stalled: None,
        }
    }

    fn into_inner(self) -> TcpStream {
        self.io
    }

    /// After the socket's answer to a write: on `Pending`, start (or check) the clock.
    fn watch<T>(
        &mut self,
        cx: &mut Context<'_>,
        polled: Poll<io::Result<T>>,
    ) -> Poll<io::Result<T>> {
        if polled.is_ready() {
            self.stalled = None;
            return polled;
        }
        let timeout = self.timeout;
        let stalled = self
            .stalled
            .get_or_insert_with(|| Box::pin(tokio::time::sleep(timeout)));
        match stalled.as_mut().poll(cx) {
            Poll::Ready(()) => Poll::Ready(Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("the client took none of the answer for {timeout:?}"),
            ))),
            Poll::Pending => Poll::Pending,
        }
    }
}

impl AsyncRead for WriteTimeout {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_read(cx, buf)
    }
}

impl AsyncWrite for WriteTimeout {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        self.watch(cx, polled)
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        self.watch(cx, polled)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let polled = Pin::new(&mut self.io).poll_flush(cx);
        self.watch(cx, polled)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}
