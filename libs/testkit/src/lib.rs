//! `idem-testkit`: what the integration tests of every service share — a fresh Postgres
//! database per test, the real payments-demo, gateway and reconciler processes, Redis
//! servers of the tests' own, and a small HTTP client.
//!
//! Nothing here skips: a missing service or binary fails the test and says how to fix it.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, StatusCode};
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use secrecy::SecretString;
use sqlx::{Connection, PgConnection};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

pub const SECRET: &str = "integration-test-secret";
/// The base of idemgate's problem `type` URIs.
pub const PROBLEM_BASE: &str = "https://idemgate.dev/problems/";

/// The server that tests create their databases on.
pub fn admin_url() -> String {
    std::env::var("IDEMGATE_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database of this test's own, dropped when the test ends (pass or fail).
pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    pub async fn create() -> Self {
        let admin = admin_url();
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
            panic!("Postgres is not reachable at {admin} ({e}). Start it with scripts/dev-services, or set IDEMGATE_TEST_POSTGRES.")
        });
        let name = format!("idemgate_test_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        let base = admin
            .rsplit_once('/')
            .map_or(admin.as_str(), |(base, _)| base);
        let url = format!("{base}/{name}");
        Self { name, url }
    }

    /// Applies idemgate's migrations (for tests that write ledger rows themselves).
    pub async fn migrate(&self) {
        let pool = sqlx::PgPool::connect(&self.url)
            .await
            .expect("connect to the test database");
        idem_postgres::migrate(&pool)
            .await
            .expect("migrations apply");
        pool.close().await;
    }

    pub async fn connect(&self) -> PgConnection {
        PgConnection::connect(&self.url)
            .await
            .expect("connect to the test database")
    }

    /// Rows in `table` for a tenant and key: the number of executions.
    pub async fn executions(&self, table: &str, tenant: &str, key: &str) -> i64 {
        let mut conn = self.connect().await;
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE tenant_id = $1 AND idempotency_key = $2"
        )))
        .bind(tenant)
        .bind(key)
        .fetch_one(&mut conn)
        .await
        .expect("count executions")
    }

    /// Ledger rows for a tenant (all endpoints and keys).
    pub async fn ledger_rows(&self, tenant: &str) -> i64 {
        let mut conn = self.connect().await;
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1")
            .bind(tenant)
            .fetch_one(&mut conn)
            .await
            .expect("count ledger rows")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside any runtime we may block: use a thread with its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut conn) = PgConnection::connect(&admin_url()).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}

/// The workspace root.
pub fn workspace() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// The directory holding the workspace's built binaries (next to this test binary).
fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binary path");
    exe.parent()
        .and_then(|deps| deps.parent())
        .expect("target dir")
        .to_path_buf()
}

/// The path of a workspace binary, checked to exist and to be newer than its sources.
pub fn binary(name: &str, sources: &str) -> PathBuf {
    let path = bin_dir().join(name);
    let built = std::fs::metadata(&path)
        .and_then(|m| m.modified())
        .unwrap_or_else(|_| {
            panic!(
                "{} not found: build it with `cargo build --workspace --bins` (scripts/test does)",
                path.display()
            )
        });
    let src = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(sources);
    if let Some(newest) = newest_mtime(&src) {
        assert!(
            built >= newest,
            "{} is older than its sources in {}: rebuild with `cargo build --workspace --bins`",
            path.display(),
            src.display()
        );
    }
    path
}

fn newest_mtime(dir: &PathBuf) -> Option<SystemTime> {
    let mut newest = None;
    for entry in std::fs::read_dir(dir).ok()?.flatten() {
        let path = entry.path();
        let t = if path.is_dir() {
            newest_mtime(&path)
        } else {
            entry.metadata().ok().and_then(|m| m.modified().ok())
        };
        newest = newest.max(t);
    }
    newest
}

/// A running payments-demo process, killed when dropped.
pub struct Demo {
    pub addr: SocketAddr,
    child: Child,
}

impl Demo {
    pub async fn start(db: &TestDb) -> Self {
        let mut child = Command::new(binary("payments-demo", "services/payments-demo/src"))
            .env("PAYMENTS_DEMO_LISTEN", "127.0.0.1:0")
            .env("PAYMENTS_DEMO_DATABASE_URL", &db.url)
            .env("RUST_LOG", "warn")
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn payments-demo");
        let addr = read_listen_line(&mut child, "payments-demo listening on ").await;
        Self { addr, child }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// SIGKILL: the upstream is gone (connections now refused).
    pub fn kill(&mut self) {
        let _ = self.child.start_kill();
    }
}

/// An upstream of the test's own, on a real socket: it answers every request with the
/// status in `x-test-status` (default 201) and a body of `x-test-bytes` bytes (default
/// a small JSON object), and records what it was sent, so tests can count executions
/// and read the headers idemgate forwarded.
pub struct TestUpstream {
    pub addr: SocketAddr,
    seen: std::sync::Arc<std::sync::Mutex<Vec<HeaderMap>>>,
    task: tokio::task::JoinHandle<()>,
}

impl TestUpstream {
    pub async fn start() -> Self {
        Self::answering(201, None).await
    }

    /// One whose answers default to `status` and a body of `bytes` bytes (when given),
    /// for requests that carry no `x-test-*` headers (such as the reconciler's probes).
    pub async fn answering(status: u16, bytes: Option<usize>) -> Self {
        use axum::response::IntoResponse;
        let seen: std::sync::Arc<std::sync::Mutex<Vec<HeaderMap>>> = Default::default();
        let record = seen.clone();
        let app = axum::Router::new().fallback(move |headers: HeaderMap| {
            let record = record.clone();
            async move {
                let number = |name: &str| {
                    headers
                        .get(name)
                        .and_then(|v| v.to_str().ok())
                        .and_then(|v| v.parse::<usize>().ok())
                };
                let status =
                    StatusCode::from_u16(number("x-test-status").unwrap_or(status as usize) as u16)
                        .expect("a status code");
                let body = match number("x-test-bytes").or(bytes) {
                    // A pattern, so a truncated or reordered body is noticed.
                    Some(n) => Bytes::from((0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>()),
                    None => Bytes::from_static(br#"{"ok":true}"#),
                };
                let delay = number("x-test-delay-ms");
                record.lock().unwrap().push(headers);
                if let Some(ms) = delay {
                    tokio::time::sleep(Duration::from_millis(ms as u64)).await;
                }
                (status, body).into_response()
            }
        });
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(async move {
            axum::serve(listener, app).await.unwrap();
        });
        Self { addr, seen, task }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// How many requests reached it.
    pub fn calls(&self) -> usize {
        self.seen.lock().unwrap().len()
    }

    /// The headers of every request it received, in order.
    pub fn seen(&self) -> Vec<HeaderMap> {
        self.seen.lock().unwrap().clone()
    }

    /// The body `x-test-bytes: n` makes it send.
    pub fn body_of(n: usize) -> Bytes {
        Bytes::from((0..n).map(|i| (i % 251) as u8).collect::<Vec<_>>())
    }
}

impl Drop for TestUpstream {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads the child's stdout until the line announcing its address.
pub async fn read_listen_line(child: &mut Child, prefix: &str) -> SocketAddr {
    let stdout = child.stdout.take().expect("piped stdout");
    let mut lines = BufReader::new(stdout).lines();
    let line = tokio::time::timeout(Duration::from_secs(20), async {
        while let Some(line) = lines.next_line().await.expect("read stdout") {
            if let Some(addr) = line.strip_prefix(prefix) {
                return addr.to_owned();
            }
        }
        panic!("process exited before announcing its address");
    })
    .await
    .expect("process announced its address in time");
    // Keep draining stdout so the child never blocks on a full pipe.
    tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
    line.parse().expect("a socket address")
}

/// A config file's text for tests: server, Postgres at `db`, HS256 auth, then `extra`.
pub fn config_toml(db: &TestDb, extra: &str) -> String {
    config_toml_with(db, "max_body_bytes = 4096", extra)
}

/// [`config_toml`] with `server` as the `[server]` keys beyond the listener (instead
/// of the 4 KiB body limit).
pub fn config_toml_with(db: &TestDb, server: &str, extra: &str) -> String {
    config_toml_parts(db, server, "", extra)
}

/// The ledger's limits in tests: a route's timeout plus these two must be shorter than
/// its lease (DESIGN §6), and tests use leases of a few seconds.
const TEST_POSTGRES: &str = "acquire_timeout = \"1s\"\nstatement_timeout = \"1s\"";

/// [`config_toml_with`] with `postgres` as `[postgres]` keys beyond the URL and pool
/// size (in place of the tests' default one-second timeouts).
pub fn config_toml_parts(db: &TestDb, server: &str, postgres: &str, extra: &str) -> String {
    let postgres = if postgres.is_empty() {
        TEST_POSTGRES
    } else {
        postgres
    };
    format!(
        r#"
        [server]
        listen = "127.0.0.1:0"
        shutdown_grace = "5s"
        {server}
        [postgres]
        url = "{url}"
        max_connections = 8
        {postgres}
        [auth]
        hs256_secret = "{SECRET}"
        {extra}
        "#,
        url = db.url
    )
}

/// The usual payments route against the demo (and refunds), with extra route keys.
pub fn payments_routes(demo: &Demo, route_extra: &str) -> String {
    let timeout = if route_extra.contains("timeout") {
        ""
    } else {
        "timeout = \"5s\""
    };
    format!(
        r#"
        [[routes]]
        method = "POST"
        path = "/payments"
        upstream = "{url}"
        idempotent = true
        {timeout}
        {route_extra}

        [[routes]]
        method = "POST"
        path = "/refunds"
        upstream = "{url}"
        idempotent = true
        timeout = "5s"

        [[routes]]
        method = "GET"
        path = "/payments/by-key/{{key}}"
        upstream = "{url}"
        "#,
        url = demo.url()
    )
}

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

/// A payment body.
/// Starts `request` in a task of its own and gives it `head_start` to get under way
/// (claimed, and the upstream called) before the test goes on.
pub async fn in_flight<T: Send + 'static>(
    request: impl Future<Output = T> + Send + 'static,
    head_start: Duration,
) -> tokio::task::JoinHandle<T> {
    let task = tokio::spawn(request);
    tokio::time::sleep(head_start).await;
    task
}

pub fn payment(order: &str, amount: u64) -> String {
    format!(r#"{{"orderId": "{order}", "amountUah": {amount}}}"#)
}

/// A fresh key.
pub fn new_key() -> String {
    format!("key-{}", uuid::Uuid::new_v4())
}

/// A free TCP port on 127.0.0.1 (and, for cluster nodes, its bus port + 10000 too).
pub fn free_port(with_bus: bool) -> u16 {
    loop {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        if !with_bus {
            return port;
        }
        if port < 55_000 && std::net::TcpListener::bind(("127.0.0.1", port + 10_000)).is_ok() {
            return port;
        }
    }
}

/// A redis-server process of this test's own, on its own port, killed when dropped.
pub struct RedisServer {
    pub port: u16,
    args: Vec<String>,
    child: Option<std::process::Child>,
    dir: Option<PathBuf>,
}

impl RedisServer {
    pub fn start(args: &[&str]) -> Self {
        let mut server = Self {
            port: free_port(args.contains(&"--cluster-enabled")),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
            dir: None,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let dir = std::env::temp_dir().join(format!(
            "idemgate-redis-{}-{}",
            self.port,
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&dir)
            .args(&self.args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("redis-server could not start ({e}): install it with scripts/dev-services")
            });
        self.child = Some(child);
        self.dir = Some(dir);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]).trim() != "PONG" {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server on port {} did not answer",
                self.port
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs redis-cli against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// SIGKILL: the server vanishes with its data, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}

/// The `[redis]` section for one server, with short timeouts for tests, and without
/// the in-process layer, so tests see Redis itself.
pub fn redis_section(url: &str) -> String {
    format!(
        "[redis]\nurl = \"{url}\"\ntimeout = \"200ms\"\nprobe_interval = \"200ms\"\nlocal_cache_entries = 0\n"
    )
}

/// Writes `text` to a config file of its own and returns the path.
pub fn config_file(text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idemgate-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idemgate.toml");
    std::fs::write(&path, text).unwrap();
    path
}

/// Sends a signal to a process of ours (`STOP`, `CONT`, `KILL`, `TERM`).
pub fn signal(pid: u32, name: &str) {
    let status = std::process::Command::new("kill")
        .arg(format!("-{name}"))
        .arg(pid.to_string())
        .status()
        .expect("run kill");
    assert!(status.success(), "kill -{name} {pid}");
}

/// An `idemgate serve` process (for tests that kill or pause it), killed when dropped.
pub struct GatewayProcess {
    pub addr: SocketAddr,
    child: Child,
}

impl GatewayProcess {
    pub async fn start(config_text: &str) -> Self {
        Self::start_with_env(config_text, &[]).await
    }

    pub async fn start_with_env(config_text: &str, env: &[(&str, &str)]) -> Self {
        let path = config_file(config_text);
        let mut child = Command::new(binary("idemgate", "services/gateway/src"))
            .arg("serve")
            .arg("--config")
            .arg(&path)
            .envs(env.iter().copied())
            .env(
                "RUST_LOG",
                std::env::var("IDEMGATE_TEST_LOG").unwrap_or_else(|_| "error".into()),
            )
            .stdout(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn idemgate");
        let addr = read_listen_line(&mut child, "idemgate listening on ").await;
        Self { addr, child }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    /// SIGKILL, and wait until it is gone.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }
}

/// The output of one `idemgate-reconciler --once` pass.
#[derive(Debug)]
pub struct Pass {
    pub success: bool,
    pub stdout: String,
    pub stderr: String,
}

/// Runs one reconciler pass (`--once`) with this config and waits for it.
pub async fn reconcile_once(config_text: &str) -> Pass {
    let path = config_file(config_text);
    let output = Command::new(binary("idemgate-reconciler", "services/reconciler/src"))
        .arg("--config")
        .arg(&path)
        .arg("--once")
        .env("RUST_LOG", "info")
        .output()
        .await
        .expect("run idemgate-reconciler");
    Pass {
        success: output.status.success(),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        stderr: String::from_utf8_lossy(&output.stderr).into_owned(),
    }
}
