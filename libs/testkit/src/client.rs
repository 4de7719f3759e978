//! A small HTTP client for the tests, tokens, and reading answers and metrics.

use std::time::Duration;

use crate::*;
use ::http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use secrecy::SecretString;
use tokio::io::AsyncReadExt;

pub fn token(tenant: &str) -> String {
    idem_auth::mint_hs256(
        &SecretString::from(SECRET),
        "tenant_id",
        tenant,
        Duration::from_secs(600),
        None,
        None,
    )
    .expect("mint a token")
}

/// The value of a Prometheus sample named `name` (with its label set, if it has one,
/// e.g. `idemgate_cache_up` or `idemgate_requests_total{outcome="executed",…}`).
pub fn metric(text: &str, name: &str) -> Option<f64> {
    text.lines()
        .filter(|line| !line.starts_with('#'))
        .find_map(|line| {
            let (sample, value) = line.rsplit_once(' ')?;
            (sample == name).then(|| value.parse().ok()).flatten()
        })
}

/// A response, read in full.
#[derive(Debug, Clone)]
pub struct Answer {
    pub status: StatusCode,
    pub headers: HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn replayed(&self) -> bool {
        self.header("idempotent-replayed") == Some("true")
    }

    /// The slug at the end of a problem's `type` URI.
    pub fn problem(&self) -> String {
        assert_eq!(
            self.header("content-type"),
            Some("application/problem+json"),
            "status {} body {}",
            self.status,
            String::from_utf8_lossy(&self.body)
        );
        let json = self.json();
        assert_eq!(json["status"], self.status.as_u16(), "{json}");
        json["type"]
            .as_str()
            .and_then(|t| t.strip_prefix(PROBLEM_BASE))
            .unwrap_or_else(|| panic!("problem type: {json}"))
            .to_owned()
    }
}

/// A request builder over one shared pooled client.
#[derive(Clone)]
pub struct Http {
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Default for Http {
    fn default() -> Self {
        Self {
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }
}

pub struct Call {
    client: Client<HttpConnector, Full<Bytes>>,
    request: Request<Full<Bytes>>,
}

impl Http {
    pub fn post(&self, url: &str) -> Call {
        self.call(Method::POST, url)
    }

    /// The common idempotent call: POST `body` as JSON to `url` as `tenant` with `key`.
    pub fn pay(&self, url: &str, tenant: &str, key: &str, body: &str) -> Call {
        self.post(url).tenant(tenant).key(key).json(body)
    }

    pub fn get(&self, url: &str) -> Call {
        self.call(Method::GET, url)
    }

    pub fn call(&self, method: Method, url: &str) -> Call {
        let mut request = Request::new(Full::new(Bytes::new()));
        *request.method_mut() = method;
        *request.uri_mut() = url.parse().expect("a URL");
        Call {
            client: self.client.clone(),
            request,
        }
    }
}

impl Call {
    pub fn header(mut self, name: &str, value: &str) -> Self {
        self.request.headers_mut().append(
            HeaderName::from_bytes(name.as_bytes()).expect("header name"),
            HeaderValue::from_bytes(value.as_bytes()).expect("header value"),
        );
        self
    }

    pub fn bearer(self, token: &str) -> Self {
        self.header("authorization", &format!("Bearer {token}"))
    }

    pub fn tenant(self, tenant: &str) -> Self {
        self.bearer(&token(tenant))
    }

    pub fn key(self, key: &str) -> Self {
        self.header("idempotency-key", key)
    }

    /// Asks payments-demo to answer only `millis` after its insert committed, so the
    /// first execution stays in flight while a test does something else.
    pub fn demo_delay(self, millis: u64) -> Self {
        self.header("x-demo-delay-ms", &millis.to_string())
    }

    pub fn json(mut self, body: &str) -> Self {
        *self.request.body_mut() = Full::new(Bytes::copy_from_slice(body.as_bytes()));
        self.header("content-type", "application/json")
    }

    pub fn body(mut self, body: impl Into<Bytes>) -> Self {
        *self.request.body_mut() = Full::new(body.into());
        self
    }

    pub async fn send(self) -> Answer {
        self.try_send().await.expect("request failed")
    }

    /// Like `send`, for requests whose connection may die (a gateway killed mid-request).
    pub async fn try_send(self) -> Result<Answer, String> {
        let response = self
            .client
            .request(self.request)
            .await
            .map_err(|e| e.to_string())?;
        let (parts, body) = response.into_parts();
        let body = body.collect().await.map_err(|e| e.to_string())?.to_bytes();
        Ok(Answer {
            status: parts.status,
            headers: parts.headers,
            body,
        })
    }
}

/// Starts `request` in a task of its own and gives it `head_start` to get under way
/// (claimed, and the upstream called) before the test goes on.
pub async fn in_flight<T: Send + 'static>(
    request: impl Future<Output = T> + Send + 'static,
    head_start: Duration,
) -> tokio::task::JoinHandle<T> {
    let task = tokio::spawn(request);
    // Real time: the request is on its way to another task or process.
    tokio::time::sleep(head_start).await;
    task
}

/// A payment body.
pub fn payment(order: &str, amount: u64) -> String {
    format!(r#"{{"orderId": "{order}", "amountUah": {amount}}}"#)
}

/// A fresh key.
pub fn new_key() -> String {
    format!("key-{}", uuid::Uuid::new_v4())
}

/// One answer read off a raw connection: its head (lower case) and body.
pub struct RawAnswer {
    pub head: String,
    pub body: Vec<u8>,
}

impl RawAnswer {
    pub fn says_close(&self) -> bool {
        self.head.lines().any(|l| l == "connection: close")
    }

    /// The status code of the answer's first line (0 if it has none).
    pub fn status(&self) -> u16 {
        self.head
            .split(' ')
            .nth(1)
            .and_then(|s| s.parse().ok())
            .unwrap_or(0)
    }
}

impl std::fmt::Debug for RawAnswer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}{}", self.head, String::from_utf8_lossy(&self.body))
    }
}

/// Reads one answer whose body has a `content-length` off a raw connection.
pub async fn read_answer(conn: &mut tokio::net::TcpStream) -> Result<RawAnswer, String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 8192];
    let end = loop {
        if let Some(end) = got.windows(4).position(|w| w == b"\r\n\r\n") {
            break end + 4;
        }
        match conn.read(&mut buf).await {
            Ok(0) => return Err(format!("closed after {} bytes", got.len())),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("{e} after {} bytes", got.len())),
        }
    };
    let head = String::from_utf8_lossy(&got[..end]).to_ascii_lowercase();
    let length: usize = head
        .lines()
        .find_map(|l| l.strip_prefix("content-length: "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    while got.len() < end + length {
        match conn.read(&mut buf).await {
            Ok(0) => return Err("closed inside the body".into()),
            Ok(n) => got.extend_from_slice(&buf[..n]),
            Err(e) => return Err(format!("{e} inside the body")),
        }
    }
    Ok(RawAnswer {
        head,
        body: got[end..end + length].to_vec(),
    })
}

/// The head of a raw `POST path` with `tenant`'s token, the key `k-early` and a body of
/// `length` bytes (not included): for the early-answer tests of both modes.
pub fn raw_post_head(path: &str, tenant: &str, length: usize) -> Vec<u8> {
    format!(
        "POST {path} HTTP/1.1\r\nhost: test\r\nauthorization: Bearer {}\r\n\
         idempotency-key: k-early\r\ncontent-type: application/octet-stream\r\n\
         content-length: {length}\r\n\r\n",
        token(tenant)
    )
    .into_bytes()
}

/// Sends `request` whole on `conn` and reads one answer within 10 s; panics, naming the
/// `attempt`, when the request cannot be sent or the answer is lost.
pub async fn exchange(
    conn: &mut tokio::net::TcpStream,
    request: &[u8],
    attempt: usize,
) -> RawAnswer {
    use tokio::io::AsyncWriteExt;
    if let Err(e) = conn.write_all(request).await {
        panic!("try {attempt}: the request could not be sent: {e}");
    }
    tokio::time::timeout(Duration::from_secs(10), read_answer(conn))
        .await
        .unwrap_or_else(|_| panic!("try {attempt}: no answer in 10 s"))
        .unwrap_or_else(|e| panic!("try {attempt}: the answer was lost: {e}"))
}

/// After an answer that said `Connection: close`: the server ends `conn` within 10 s,
/// cleanly and with nothing more sent — never with a reset.
pub async fn ends_cleanly(conn: &mut tokio::net::TcpStream, attempt: usize) {
    let mut rest = Vec::new();
    let ended = tokio::time::timeout(Duration::from_secs(10), conn.read_to_end(&mut rest))
        .await
        .unwrap_or_else(|_| panic!("try {attempt}: the connection stayed open after close"));
    if let Err(e) = ended {
        panic!("try {attempt}: the connection was reset, not closed: {e}");
    }
    assert!(rest.is_empty(), "try {attempt}: bytes after the answer");
}
