//! The upstream client: one pooled HTTP/1.1 client, and the classification of what
//! happened to a forwarded request (answered, provably not sent, or unknown).

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use tracing::Instrument;

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

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

/// An upstream answer, read in full.
#[derive(Debug)]
pub struct UpstreamResponse {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

/// What a forwarded request did.
#[derive(Debug)]
pub enum Forwarded {
    Answered(UpstreamResponse),
    /// The connection could not be made: the upstream never saw the request.
    NotSent(String),
    /// Sent, but no complete answer within the deadline (or the connection broke).
    Unknown(String),
}

/// Sends `request` and reads the whole response, all within `timeout`, in a client
/// span whose context goes upstream as `traceparent`.
pub async fn forward(
    client: &HttpClient,
    mut request: Request<Full<Bytes>>,
    timeout: Duration,
) -> Forwarded {
    let span = tracing::info_span!(
        "upstream",
        otel.kind = "client",
        http.request.method = %request.method(),
        url.full = %request.uri(),
        http.response.status_code = tracing::field::Empty,
    );
    idem_telemetry::propagation::inject(&span, request.headers_mut());
    let forwarded = exchange(client, request, timeout)
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
) -> Forwarded {
    let exchange = async {
        let response = match client.request(request).await {
            Ok(response) => response,
            Err(e) if e.is_connect() => return Forwarded::NotSent(error_chain(&e)),
            Err(e) => return Forwarded::Unknown(error_chain(&e)),
        };
        let (parts, body) = response.into_parts();
        match body.collect().await {
            Ok(body) => Forwarded::Answered(UpstreamResponse {
                status: parts.status,
                headers: parts.headers,
                body: body.to_bytes(),
            }),
            Err(e) => Forwarded::Unknown(format!("response body broke off: {}", error_chain(&e))),
        }
    };
    match tokio::time::timeout(timeout, exchange).await {
        Ok(forwarded) => forwarded,
        Err(_) => Forwarded::Unknown(format!("no complete answer within {timeout:?}")),
    }
}

fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        message.push_str(": ");
        message.push_str(&s.to_string());
        source = s.source();
    }
    message
}
