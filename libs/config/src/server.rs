//! `[server]`: the listener and the limits every client is held to.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `server.listen` | `127.0.0.1:8080` | address to serve on |
//! | `server.max_body_bytes` | `1048576` | larger request bodies get 413 |
//! | `server.shutdown_grace` | `10s` | how long in-flight requests may finish after SIGTERM |
//! | `server.worker_threads` | one per CPU | threads serving requests |
//! | `server.max_header_bytes` / `server.max_headers` | `16384` / `100` | request head size and field count (431) |
//! | `server.header_read_timeout` | `10s` | a request head must arrive within this (slowloris) |
//! | `server.body_read_timeout` | `30s` | a request body must arrive within this (408) |
//! | `server.max_concurrent_requests` | `1024` | requests in flight; beyond, 503 `overloaded` |
//! | `server.response_write_timeout` | `30s` | a client that takes longer to accept a write of its answer is cut off |
//! | `server.max_result_wait` | `60s` | the longest a key's result waits for its operation to settle (`Prefer: wait=N` on `/_idemgate/v1/keys/{key}/result`) |
//! | `server.max_result_waiters` | `64` | a tenant's result waiters at once, per replica; beyond, 429 `tenant-concurrency-limited` |
//! | `server.refusal_log_interval` | `10s` | idemgate's own refusals (401, 429 over a quota, 503 `overloaded`) are logged at most once per tenant and reason per interval, with their count |
//! | `server.max_replay_bytes_in_flight` | `268435456` | stored bodies held for answers in flight, all requests together (one tenant at most a quarter, or one body); beyond, 503 `overloaded` |

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::ConfigError;

/// `[server]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ServerConfig {
    pub listen: SocketAddr,
    /// Larger request bodies get 413.
    pub max_body_bytes: usize,
    #[serde(with = "humantime_serde")]
    pub shutdown_grace: Duration,
    /// Runtime worker threads; `None`: one per CPU the process may use.
    pub worker_threads: Option<usize>,
    /// A request head (request line and headers) larger than this gets 431.
    pub max_header_bytes: usize,
    /// A request with more header fields than this gets 431.
    pub max_headers: usize,
    /// A connection whose request head is not complete this long after the server
    /// started reading it (or, between requests, after it went idle) is closed.
    #[serde(with = "humantime_serde")]
    pub header_read_timeout: Duration,
    /// A request body not complete this long after its head gets 408.
    #[serde(with = "humantime_serde")]
    pub body_read_timeout: Duration,
    /// Requests in flight beyond this get 503 `overloaded` at once (health and metrics
    /// endpoints are not counted and always answer).
    pub max_concurrent_requests: usize,
    /// A connection whose client accepts none of a pending write of its answer for
    /// this long is closed (a client that asks and never reads holds no memory for long).
    #[serde(with = "humantime_serde")]
    pub response_write_timeout: Duration,
    /// Stored bodies held in memory for replays being read back from Postgres or sent,
    /// all requests together (concurrent retries of one key share one copy); a replay
    /// that would go past it gets 503 `overloaded`.
    pub max_replay_bytes_in_flight: usize,
    /// The longest a key's result waits for its operation to settle.
    #[serde(with = "humantime_serde")]
    pub max_result_wait: Duration,
    /// A tenant's result waiters at once, per replica.
    pub max_result_waiters: usize,
    /// Refusals are logged at most once per tenant and reason per interval, with their
    /// count: a flood of them is a flood of counts, not of log lines.
    #[serde(with = "humantime_serde")]
    pub refusal_log_interval: Duration,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            max_body_bytes: 1024 * 1024,
            shutdown_grace: Duration::from_secs(10),
            worker_threads: None,
            max_header_bytes: 16 * 1024,
            max_headers: 100,
            header_read_timeout: Duration::from_secs(10),
            body_read_timeout: Duration::from_secs(30),
            max_concurrent_requests: 1024,
            response_write_timeout: Duration::from_secs(30),
            max_replay_bytes_in_flight: 256 * 1024 * 1024,
            refusal_log_interval: Duration::from_secs(10),
            max_result_wait: Duration::from_secs(60),
            max_result_waiters: 64,
        }
    }
}

impl ServerConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::first_zero([
            ("server.max_body_bytes", self.max_body_bytes == 0),
            ("server.max_header_bytes", self.max_header_bytes == 0),
            ("server.max_headers", self.max_headers == 0),
            (
                "server.header_read_timeout",
                self.header_read_timeout.is_zero(),
            ),
            ("server.body_read_timeout", self.body_read_timeout.is_zero()),
            (
                "server.max_concurrent_requests",
                self.max_concurrent_requests == 0,
            ),
            (
                "server.response_write_timeout",
                self.response_write_timeout.is_zero(),
            ),
            (
                "server.max_replay_bytes_in_flight",
                self.max_replay_bytes_in_flight == 0,
            ),
            (
                "server.refusal_log_interval",
                self.refusal_log_interval.is_zero(),
            ),
            ("server.max_result_waiters", self.max_result_waiters == 0),
        ])?;
        if self.max_header_bytes < 1024 {
            return Err(ConfigError::new(
                "server.max_header_bytes",
                "must be at least 1024 (a request line and a bearer token need room)",
            ));
        }
        if self.worker_threads == Some(0) {
            return Err(ConfigError::new(
                "server.worker_threads",
                "must be greater than 0",
            ));
        }
        Ok(())
    }
}
