//! The workspace's binaries as child processes of the test, and an upstream of its own.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, SystemTime};

use crate::*;
use ::http::{HeaderMap, StatusCode};
use bytes::Bytes;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

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
    /// The demo as idemgate's upstream.
    pub async fn start(db: &TestDb) -> Self {
        Self::spawn(db, &[]).await
    }

    /// The demo in embedded mode (docs/embedded-mode.md), with `config_text` as its
    /// `PAYMENTS_DEMO_CONFIG` and `env` besides.
    pub async fn embedded(db: &TestDb, config_text: &str, env: &[(&str, &str)]) -> Self {
        let config = config_file(config_text);
        let config = config.to_str().expect("a UTF-8 temp path");
        let mut all = vec![
            ("PAYMENTS_DEMO_MODE", "embedded"),
            ("PAYMENTS_DEMO_CONFIG", config),
        ];
        all.extend_from_slice(env);
        Self::spawn(db, &all).await
    }

    /// The demo consuming a Redis Stream (docs/embedded-mode.md, "Queue consumers"), with
    /// `config_text` as its `PAYMENTS_DEMO_CONFIG` (its `[redis] url`) and `env` besides.
    pub async fn consumer(db: &TestDb, config_text: &str, env: &[(&str, &str)]) -> Self {
        let mut all = vec![("PAYMENTS_DEMO_MODE", "consumer")];
        all.extend_from_slice(env);
        Self::embedded(db, config_text, &all).await
    }

    /// The demo as a card processor (`PAYMENTS_DEMO_MODE=processor`): `POST /charges`,
    /// once per `Idempotency-Key`.
    pub async fn processor(db: &TestDb) -> Self {
        Self::spawn(db, &[("PAYMENTS_DEMO_MODE", "processor")]).await
    }

    async fn spawn(db: &TestDb, env: &[(&str, &str)]) -> Self {
        let mut child = Command::new(binary("payments-demo", "services/payments-demo/src"))
            .env("PAYMENTS_DEMO_LISTEN", "127.0.0.1:0")
            .env("PAYMENTS_DEMO_DATABASE_URL", &db.url)
            .env("RUST_LOG", "warn")
            .envs(env.iter().copied())
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

    pub fn pid(&self) -> u32 {
        self.child.id().expect("running")
    }

    /// SIGKILL, and wait until it is gone.
    pub async fn kill(&mut self) {
        let _ = self.child.start_kill();
        let _ = self.child.wait().await;
    }

    /// SIGTERM (a clean exit), and wait up to 10 s until it is gone; whether it exited 0.
    pub async fn terminate(&mut self) -> bool {
        signal(self.pid(), "TERM");
        let exited = tokio::time::timeout(Duration::from_secs(10), self.child.wait()).await;
        matches!(exited, Ok(Ok(status)) if status.success())
    }
}

/// An upstream of the test's own, on a real socket: it answers every request with the
/// status in `x-test-status` (default 201) and a body of `x-test-bytes` bytes (default
/// a small JSON object) — or, with `x-test-events: n`, a `text/event-stream` of n events
/// (`data: <i>`), one every `x-test-event-ms` (default 200) — and records what it was
/// sent, so tests can count executions and read the headers idemgate forwarded.
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
                let events = number("x-test-events");
                let every = Duration::from_millis(number("x-test-event-ms").unwrap_or(200) as u64);
                record.lock().unwrap().push(headers);
                if let Some(n) = events {
                    return (
                        status,
                        [("content-type", "text/event-stream")],
                        axum::body::Body::new(EventStream::start(n, every)),
                    )
                        .into_response();
                }
                if let Some(ms) = delay {
                    // Real time: the delay a test asked this upstream for.
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

/// `n` server-sent events, one every `every`, from a task of their own.
struct EventStream(tokio::sync::mpsc::Receiver<Bytes>);

impl EventStream {
    fn start(n: usize, every: Duration) -> Self {
        let (events, receiver) = tokio::sync::mpsc::channel(1);
        tokio::spawn(async move {
            for i in 0..n {
                // Real time: the pace a test asked this upstream for.
                tokio::time::sleep(every).await;
                if events
                    .send(Bytes::from(format!("data: {i}\n\n")))
                    .await
                    .is_err()
                {
                    return;
                }
            }
        });
        Self(receiver)
    }
}

impl http_body::Body for EventStream {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, Self::Error>>> {
        self.0
            .poll_recv(cx)
            .map(|event| event.map(|e| Ok(http_body::Frame::data(e))))
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

/// A free TCP port on 127.0.0.1 (and, for cluster nodes, its bus port + 10000 too) for
/// a process to listen on later.
///
/// It comes from below the kernel's ephemeral range, so no `bind(0)` and no outgoing
/// connection of another test can take it before that process listens: a port from
/// `bind(0)` raced with other tests' sockets (EADDRINUSE in CI).
pub fn free_port(with_bus: bool) -> u16 {
    let (low, high) = if with_bus {
        (10_000, 22_000)
    } else {
        (10_000, 32_000)
    };
    let ephemeral_low = std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|range| range.split_whitespace().next()?.parse::<u32>().ok())
        .unwrap_or(32_768);
    let high = high.min(ephemeral_low.saturating_sub(if with_bus { 10_000 } else { 0 }));
    assert!(
        high > low + 1_000,
        "the ephemeral port range starts at {ephemeral_low}: the tests need ports below it"
    );
    // Never the same port twice in one test process, where tests run at once.
    static GIVEN: std::sync::Mutex<Vec<u32>> = std::sync::Mutex::new(Vec::new());
    let free = |port: u32| std::net::TcpListener::bind(("127.0.0.1", port as u16)).is_ok();
    loop {
        let port = low + (uuid::Uuid::new_v4().as_u128() % u128::from(high - low)) as u32;
        let ports = [port, port + 10_000];
        let ports = if with_bus { &ports[..] } else { &ports[..1] };
        let mut given = GIVEN.lock().expect("ports given");
        if ports.iter().all(|p| !given.contains(p) && free(*p)) {
            given.extend_from_slice(ports);
            return port as u16;
        }
    }
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
    /// Its log lines (JSON), when started with [`GatewayProcess::start_logged`].
    logs: Option<std::sync::Arc<std::sync::Mutex<Vec<serde_json::Value>>>>,
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
        Self {
            addr,
            child,
            logs: None,
        }
    }

    /// A gateway whose info-level log lines (as JSON) the test reads with
    /// [`GatewayProcess::logs`].
    pub async fn start_logged(config_text: &str) -> Self {
        let path = config_file(config_text);
        let mut child = Command::new(binary("idemgate", "services/gateway/src"))
            .arg("serve")
            .arg("--config")
            .arg(&path)
            .env("RUST_LOG", "info")
            .env("IDEMGATE_LOG_FORMAT", "json")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("spawn idemgate");
        let logs = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let mut lines = BufReader::new(child.stderr.take().expect("piped stderr")).lines();
        let kept = logs.clone();
        tokio::spawn(async move {
            while let Ok(Some(line)) = lines.next_line().await {
                if let Ok(value) = serde_json::from_str(&line) {
                    kept.lock().unwrap().push(value);
                }
            }
        });
        let addr = read_listen_line(&mut child, "idemgate listening on ").await;
        Self {
            addr,
            child,
            logs: Some(logs),
        }
    }

    /// The log lines so far whose message is `message`, as their fields.
    pub fn logs(&self, message: &str) -> Vec<serde_json::Value> {
        let logs = self.logs.as_ref().expect("started with start_logged");
        logs.lock()
            .unwrap()
            .iter()
            .filter(|line| line["fields"]["message"] == message)
            .map(|line| line["fields"].clone())
            .collect()
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
