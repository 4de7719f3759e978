//! Configuration: one TOML file plus `IDEMGATE_<SECTION>__<KEY>` environment overrides
//! (the README's "Configuration"), parsed once at start-up into typed values.
//!
//! Every problem is reported as a [`ConfigError`] that names the key at fault, e.g.
//! `routes[0].timeout: must be shorter than the lease (30s)`.
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
//! | `postgres.url` | (required) | the ledger's database |
//! | `postgres.max_connections` | `16` | pool size |
//! | `postgres.acquire_timeout` | `2s` | wait for a pooled connection |
//! | `postgres.statement_timeout` | `5s` | server-side limit per statement |
//! | `redis.url` / `redis.cluster_urls` | (none) | the fast path; without `[redis]`, Postgres alone |
//! | `redis.prefix` | `idem:` | prepended to every Redis key |
//! | `redis.timeout` | `100ms` | per Redis call; past it the breaker opens |
//! | `redis.probe_interval` | `1s` | how often an open breaker probes Redis |
//! | `redis.local_cache_entries` | `10000` | completed responses also kept in-process (0: none) |
//! | `redis.local_cache_bytes` | `67108864` | the bytes those copies may hold (LRU) |
//! | `auth.*` | | see `idem_auth::AuthConfig` |
//! | `idempotency.ttl` | `24h` | how long a completed key is replayed |
//! | `idempotency.lease` | `30s` | protection of an in-progress claim |
//! | `idempotency.on_in_progress` | `reject` | or `wait` |
//! | `idempotency.wait_timeout` | `5s` | longest wait for a concurrent attempt |
//! | `idempotency.mismatch_status` | `409` | or `422` |
//! | `reconciler.*` | | see [`ReconcilerConfig`] (`reconciler.release_confirm`: `30s`) |
//! | `routes[]` | | see [`RawRoute`] |

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use idem_auth::AuthConfig;
use idem_core::policy::{self, OnInProgress, Policy, StatusSet};
use secrecy::SecretString;
use serde::Deserialize;

use crate::routes::{PathTemplate, Route, RouteTable, Upstream};

/// A configuration problem, naming the key at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }
}

/// A list of configuration problems (figment reports all it finds at once).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n  {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl From<ConfigError> for ConfigErrors {
    fn from(e: ConfigError) -> Self {
        Self(vec![e])
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: ServerConfig,
    postgres: PostgresConfig,
    redis: Option<RedisConfig>,
    auth: AuthConfig,
    #[serde(default)]
    idempotency: RawIdempotency,
    #[serde(default)]
    reconciler: ReconcilerConfig,
    #[serde(default)]
    routes: Vec<RawRoute>,
}

/// `[server]`: the listener and the limits every client is held to (the README's `server.*` keys).
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
        }
    }
}

/// `[postgres]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresConfig {
    pub url: SecretString,
    #[serde(default = "default_max_connections")]
    pub max_connections: u32,
    #[serde(default = "default_acquire_timeout", with = "humantime_serde")]
    pub acquire_timeout: Duration,
    #[serde(default = "default_statement_timeout", with = "humantime_serde")]
    pub statement_timeout: Duration,
}

fn default_max_connections() -> u32 {
    16
}
fn default_acquire_timeout() -> Duration {
    Duration::from_secs(2)
}
fn default_statement_timeout() -> Duration {
    Duration::from_secs(5)
}

/// `[reconciler]`: how `idemgate-reconciler` works through stuck claims and expired keys.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ReconcilerConfig {
    /// `/healthz` and `/metrics` of the reconciler.
    pub listen: SocketAddr,
    /// Pause between passes.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// Stuck rows taken per batch.
    pub batch_size: u32,
    /// How long a reconciler keeps the rows it took while it probes them; other
    /// reconcilers skip them meanwhile.
    #[serde(with = "humantime_serde")]
    pub processing_lease: Duration,
    /// Probes running at once.
    pub concurrency: u32,
    /// The longest wait before a row whose probe failed (or that is held) is looked at again.
    #[serde(with = "humantime_serde")]
    pub max_backoff: Duration,
    /// A probe's 404 releases a key only when a second 404 comes at least this long
    /// after the first: an upstream may commit long after the gateway gave up.
    #[serde(with = "humantime_serde")]
    pub release_confirm: Duration,
    /// Expired rows deleted per purge statement.
    pub purge_batch: u32,
    /// The most time one pass spends purging.
    #[serde(with = "humantime_serde")]
    pub purge_budget: Duration,
}

impl Default for ReconcilerConfig {
    fn default() -> Self {
        Self {
            listen: SocketAddr::from(([127, 0, 0, 1], 9091)),
            interval: Duration::from_secs(5),
            batch_size: 100,
            processing_lease: Duration::from_secs(120),
            concurrency: 16,
            max_backoff: Duration::from_secs(600),
            release_confirm: Duration::from_secs(30),
            purge_batch: 1000,
            purge_budget: Duration::from_secs(2),
        }
    }
}

/// `[redis]`: the fast path. Without this section, Postgres alone serves.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// One Redis node.
    pub url: Option<SecretString>,
    /// Or the seed nodes of a Redis Cluster.
    pub cluster_urls: Option<Vec<SecretString>>,
    #[serde(default = "default_redis_prefix")]
    pub prefix: String,
    /// Upper bound on one Redis call; past it the breaker opens and Postgres serves.
    #[serde(default = "default_redis_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// How often an open breaker probes Redis again.
    #[serde(default = "default_redis_probe", with = "humantime_serde")]
    pub probe_interval: Duration,
    /// Completed responses also kept in this process (0: none), so a hot replay costs
    /// no round trip at all. Each copy expires with its ledger row.
    #[serde(default = "default_local_cache_entries")]
    pub local_cache_entries: usize,
    /// The bytes those in-process copies may hold in all (least recently used go first).
    #[serde(default = "default_local_cache_bytes")]
    pub local_cache_bytes: usize,
}

fn default_local_cache_entries() -> usize {
    10_000
}
fn default_local_cache_bytes() -> usize {
    64 * 1024 * 1024
}

fn default_redis_prefix() -> String {
    "idem:".into()
}
fn default_redis_timeout() -> Duration {
    Duration::from_millis(100)
}
fn default_redis_probe() -> Duration {
    Duration::from_secs(1)
}

impl RedisConfig {
    fn validate(&self) -> Result<(), ConfigError> {
        match (&self.url, &self.cluster_urls) {
            (Some(_), None) => {}
            (None, Some(urls)) if !urls.is_empty() => {}
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    "redis.cluster_urls",
                    "must list at least one node",
                ));
            }
            (None, None) => {
                return Err(ConfigError::new(
                    "redis",
                    "set url (one node) or cluster_urls (a cluster)",
                ));
            }
            (Some(_), Some(_)) => {
                return Err(ConfigError::new(
                    "redis",
                    "set url or cluster_urls, not both",
                ));
            }
        }
        if self.prefix.contains(['{', '}']) {
            return Err(ConfigError::new(
                "redis.prefix",
                "must not contain '{' or '}' (they delimit the hash tag)",
            ));
        }
        if self.timeout.is_zero() {
            return Err(ConfigError::new("redis.timeout", "must be greater than 0"));
        }
        if self.probe_interval.is_zero() {
            return Err(ConfigError::new(
                "redis.probe_interval",
                "must be greater than 0",
            ));
        }
        if self.local_cache_entries > 0 && self.local_cache_bytes == 0 {
            return Err(ConfigError::new(
                "redis.local_cache_bytes",
                "must be greater than 0 (set local_cache_entries = 0 to keep no copies)",
            ));
        }
        Ok(())
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields, default)]
struct RawIdempotency {
    #[serde(with = "humantime_serde")]
    ttl: Duration,
    #[serde(with = "humantime_serde")]
    lease: Duration,
    on_in_progress: String,
    #[serde(with = "humantime_serde")]
    wait_timeout: Duration,
    mismatch_status: u16,
}

impl Default for RawIdempotency {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            on_in_progress: "reject".into(),
            wait_timeout: Duration::from_secs(5),
            mismatch_status: 409,
        }
    }
}

/// One `[[routes]]` entry as written. Per-route idempotency keys override
/// `[idempotency]`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RawRoute {
    method: String,
    path: String,
    upstream: String,
    #[serde(default)]
    idempotent: bool,
    /// Upstream deadline; past it the outcome is unknown (504).
    #[serde(default = "default_timeout", with = "humantime_serde")]
    timeout: Duration,
    #[serde(default, with = "humantime_serde")]
    ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    lease: Option<Duration>,
    on_in_progress: Option<String>,
    #[serde(default, with = "humantime_serde")]
    wait_timeout: Option<Duration>,
    mismatch_status: Option<u16>,
    /// false: key-less requests pass unprotected (gradual roll-out).
    #[serde(default = "yes")]
    key_required: bool,
    /// Upstream statuses after which the key is released; default 5xx, 408, 425, 429.
    release_on: Option<Vec<String>>,
    /// Store and replay `Set-Cookie`.
    #[serde(default)]
    store_set_cookie: bool,
    /// `"GET /payments/by-key/{key}"`: the reconciler's status probe.
    probe: Option<String>,
    /// `"hold"` or `"release-after:10m"`: what the reconciler does without a probe.
    on_unknown: Option<String>,
    /// Upstream response bodies up to this size are stored (and replayed); larger ones
    /// reach their first client whole, are recorded without their body, and retries
    /// get 410.
    #[serde(default = "default_max_response_bytes")]
    max_response_bytes: usize,
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_max_response_bytes() -> usize {
    10 * 1024 * 1024
}
fn yes() -> bool {
    true
}

/// What the reconciler does with an unknown outcome on a route without a probe.
pub use idem_core::reconcile::OnUnknown;

/// A status probe: `GET /payments/by-key/{key}`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Probe {
    pub method: http::Method,
    pub path: String,
}

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    pub postgres: PostgresConfig,
    pub redis: Option<RedisConfig>,
    pub auth: AuthConfig,
    pub reconciler: ReconcilerConfig,
    pub routes: RouteTable,
}

impl Config {
    /// Reads `path` and applies `IDEMGATE_…` environment overrides.
    pub fn load(path: &Path) -> Result<Self, ConfigErrors> {
        if !path.exists() {
            return Err(
                ConfigError::new("--config", format!("{} does not exist", path.display())).into(),
            );
        }
        let env = Env::prefixed("IDEMGATE_")
            .filter(|k| k.as_str().contains("__"))
            .split("__");
        Self::from_figment(Figment::from(Toml::file_exact(path)).merge(env))
    }

    /// Parses a TOML document, without environment overrides (for tests and tools).
    pub fn from_toml(toml: &str) -> Result<Self, ConfigErrors> {
        Self::from_figment(Figment::from(Toml::string(toml)))
    }

    fn from_figment(figment: Figment) -> Result<Self, ConfigErrors> {
        let raw: RawConfig = figment.extract().map_err(|e| {
            ConfigErrors(
                e.into_iter()
                    .map(|e| {
                        let mut path = key_path(&e.path);
                        // An unknown field is already in the path; a missing one is not.
                        if let figment::error::Kind::MissingField(field) = &e.kind {
                            path = key_path(&[path, field.to_string()]);
                        }
                        ConfigError::new(
                            if path.is_empty() {
                                "(file)".into()
                            } else {
                                path
                            },
                            e.kind.to_string(),
                        )
                    })
                    .collect(),
            )
        })?;
        raw.validate()
    }
}

/// `["routes", "0", "timeout"]` → `routes[0].timeout`, the form validation errors use.
fn key_path(segments: &[String]) -> String {
    let mut path = String::new();
    for segment in segments.iter().filter(|s| !s.is_empty()) {
        if segment.parse::<usize>().is_ok() {
            path.push_str(&format!("[{segment}]"));
        } else {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(segment);
        }
    }
    path
}

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigErrors> {
        let server = &self.server;
        for (key, zero) in [
            ("server.max_body_bytes", server.max_body_bytes == 0),
            ("server.max_header_bytes", server.max_header_bytes == 0),
            ("server.max_headers", server.max_headers == 0),
            (
                "server.header_read_timeout",
                server.header_read_timeout.is_zero(),
            ),
            (
                "server.body_read_timeout",
                server.body_read_timeout.is_zero(),
            ),
            (
                "server.max_concurrent_requests",
                server.max_concurrent_requests == 0,
            ),
        ] {
            if zero {
                return Err(ConfigError::new(key, "must be greater than 0").into());
            }
        }
        if server.max_header_bytes < 1024 {
            return Err(ConfigError::new(
                "server.max_header_bytes",
                "must be at least 1024 (a request line and a bearer token need room)",
            )
            .into());
        }
        if self.server.worker_threads == Some(0) {
            return Err(ConfigError::new("server.worker_threads", "must be greater than 0").into());
        }
        if self.postgres.max_connections == 0 {
            return Err(
                ConfigError::new("postgres.max_connections", "must be greater than 0").into(),
            );
        }
        if let Some(redis) = &self.redis {
            redis.validate()?;
        }
        let r = &self.reconciler;
        for (key, zero) in [
            ("reconciler.interval", r.interval.is_zero()),
            ("reconciler.batch_size", r.batch_size == 0),
            ("reconciler.processing_lease", r.processing_lease.is_zero()),
            ("reconciler.concurrency", r.concurrency == 0),
            ("reconciler.max_backoff", r.max_backoff.is_zero()),
            ("reconciler.release_confirm", r.release_confirm.is_zero()),
            ("reconciler.purge_batch", r.purge_batch == 0),
            ("reconciler.purge_budget", r.purge_budget.is_zero()),
        ] {
            if zero {
                return Err(ConfigError::new(key, "must be greater than 0").into());
            }
        }
        let defaults = self.idempotency.policy()?;
        let ledger_op = self.postgres.acquire_timeout + self.postgres.statement_timeout;
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, raw) in self.routes.into_iter().enumerate() {
            let route = raw.validate(&format!("routes[{i}]"), &defaults, ledger_op)?;
            if let Some(other) = routes.iter().position(|r: &Route| {
                r.method == route.method && r.template.same_shape(&route.template)
            }) {
                return Err(ConfigError::new(
                    format!("routes[{i}]"),
                    format!("{} overlaps routes[{other}]", route.endpoint),
                )
                .into());
            }
            routes.push(route);
        }
        Ok(Config {
            server: self.server,
            postgres: self.postgres,
            redis: self.redis,
            auth: self.auth,
            reconciler: self.reconciler,
            routes: RouteTable::new(routes),
        })
    }
}

impl RawIdempotency {
    fn policy(&self) -> Result<Policy, ConfigError> {
        let on_in_progress = self
            .on_in_progress
            .parse::<OnInProgress>()
            .map_err(|e| ConfigError::new("idempotency.on_in_progress", e))?;
        let policy = Policy {
            ttl: self.ttl,
            lease: self.lease,
            on_in_progress,
            wait_timeout: self.wait_timeout,
            mismatch_status: self.mismatch_status,
            release_on: policy::default_release_statuses(),
            probe: false,
            store_set_cookie: false,
        };
        check_policy("idempotency", &policy)?;
        Ok(policy)
    }
}

fn check_policy(at: &str, p: &Policy) -> Result<(), ConfigError> {
    if p.ttl.is_zero() {
        return Err(ConfigError::new(
            format!("{at}.ttl"),
            "must be greater than 0",
        ));
    }
    if p.lease.is_zero() {
        return Err(ConfigError::new(
            format!("{at}.lease"),
            "must be greater than 0",
        ));
    }
    if p.lease > p.ttl {
        return Err(ConfigError::new(
            format!("{at}.lease"),
            format!(
                "must not be longer than the ttl ({})",
                humantime::format_duration(p.ttl)
            ),
        ));
    }
    if !matches!(p.mismatch_status, 409 | 422) {
        return Err(ConfigError::new(
            format!("{at}.mismatch_status"),
            "must be 409 or 422",
        ));
    }
    Ok(())
}

impl RawRoute {
    /// `ledger_op` is the longest one ledger call may take (a pooled connection, then
    /// the statement): a completion sent at the upstream deadline must land within it.
    fn validate(
        self,
        at: &str,
        defaults: &Policy,
        ledger_op: Duration,
    ) -> Result<Route, ConfigError> {
        let method = http::Method::from_bytes(self.method.as_bytes())
            .ok()
            .filter(|m| m.as_str().bytes().all(|b| b.is_ascii_uppercase()))
            .ok_or_else(|| {
                ConfigError::new(
                    format!("{at}.method"),
                    "must be an upper-case HTTP method like \"POST\"",
                )
            })?;
        let template = PathTemplate::parse(&self.path)
            .map_err(|e| ConfigError::new(format!("{at}.path"), e))?;
        let upstream = Upstream::parse(&self.upstream)
            .map_err(|e| ConfigError::new(format!("{at}.upstream"), e))?;
        if self.timeout.is_zero() {
            return Err(ConfigError::new(
                format!("{at}.timeout"),
                "must be greater than 0",
            ));
        }
        if self.max_response_bytes == 0 {
            return Err(ConfigError::new(
                format!("{at}.max_response_bytes"),
                "must be greater than 0",
            ));
        }
        let on_in_progress = match &self.on_in_progress {
            Some(s) => s
                .parse::<OnInProgress>()
                .map_err(|e| ConfigError::new(format!("{at}.on_in_progress"), e))?,
            None => defaults.on_in_progress,
        };
        let probe = self
            .probe
            .as_deref()
            .map(parse_probe)
            .transpose()
            .map_err(|e| ConfigError::new(format!("{at}.probe"), e))?;
        let release_on = match &self.release_on {
            Some(entries) => StatusSet::from_entries(
                entries
                    .iter()
                    .map(|e| StatusSet::parse_entry(e))
                    .collect::<Result<Vec<_>, _>>()
                    .map_err(|e| ConfigError::new(format!("{at}.release_on"), e))?,
            ),
            None => defaults.release_on.clone(),
        };
        let policy = Policy {
            ttl: self.ttl.unwrap_or(defaults.ttl),
            lease: self.lease.unwrap_or(defaults.lease),
            on_in_progress,
            wait_timeout: self.wait_timeout.unwrap_or(defaults.wait_timeout),
            mismatch_status: self.mismatch_status.unwrap_or(defaults.mismatch_status),
            release_on,
            probe: probe.is_some(),
            store_set_cookie: self.store_set_cookie,
        };
        check_policy(at, &policy)?;
        if self.idempotent && self.timeout + ledger_op >= policy.lease {
            return Err(ConfigError::new(
                format!("{at}.timeout"),
                format!(
                    "{} plus the ledger's op timeout (postgres.acquire_timeout + postgres.statement_timeout = {}) must be shorter than the lease ({}), or the reconciler could act while the first attempt is still in flight or still recording its result",
                    humantime::format_duration(self.timeout),
                    humantime::format_duration(ledger_op),
                    humantime::format_duration(policy.lease)
                ),
            ));
        }
        let on_unknown = match self.on_unknown.as_deref() {
            None | Some("hold") => OnUnknown::Hold,
            Some(other) => match other.strip_prefix("release-after:") {
                Some(d) => {
                    OnUnknown::ReleaseAfter(humantime::parse_duration(d.trim()).map_err(|e| {
                        ConfigError::new(
                            format!("{at}.on_unknown"),
                            format!("bad duration {d:?}: {e}"),
                        )
                    })?)
                }
                None => {
                    return Err(ConfigError::new(
                        format!("{at}.on_unknown"),
                        format!("expected \"hold\" or \"release-after:DURATION\", found {other:?}"),
                    ));
                }
            },
        };
        let endpoint = format!("{} {}", method, template.as_str());
        Ok(Route {
            endpoint,
            method,
            template,
            upstream,
            idempotent: self.idempotent,
            key_required: self.key_required,
            timeout: self.timeout,
            max_response_bytes: self.max_response_bytes,
            policy,
            probe,
            on_unknown,
        })
    }
}

fn parse_probe(s: &str) -> Result<Probe, String> {
    let bad = || format!("expected \"METHOD /path/{{key}}\", found {s:?}");
    let (method, path) = s.split_once(' ').ok_or_else(bad)?;
    let method = http::Method::from_bytes(method.as_bytes()).map_err(|_| bad())?;
    if !path.starts_with('/') || !path.contains("{key}") {
        return Err(bad());
    }
    Ok(Probe {
        method,
        path: path.to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::Disposition;

    const BASE: &str = r#"
        [postgres]
        url = "postgres://postgres@127.0.0.1:5432/idemgate"
        [auth]
        hs256_secret = "dev-secret-123"
    "#;

    fn with(extra: &str) -> Result<Config, ConfigErrors> {
        Config::from_toml(&format!("{BASE}\n{extra}"))
    }

    fn error_key(extra: &str) -> String {
        let errors = with(extra).expect_err("should be rejected");
        errors.0[0].key.clone()
    }

    const ROUTE: &str = r#"
        [[routes]]
        method = "POST"
        path = "/payments"
        upstream = "http://127.0.0.1:9090"
        idempotent = true
    "#;

    #[test]
    fn the_design_example_parses_with_defaults() {
        let config = with(ROUTE).unwrap();
        assert_eq!(config.server.listen.to_string(), "127.0.0.1:8080");
        assert_eq!(config.server.max_body_bytes, 1024 * 1024);
        assert_eq!(config.server.worker_threads, None);
        let route = &config.routes.routes()[0];
        assert_eq!(route.endpoint, "POST /payments");
        assert_eq!(route.policy.ttl, Duration::from_secs(86_400));
        assert_eq!(route.policy.lease, Duration::from_secs(30));
        assert_eq!(route.timeout, Duration::from_secs(10));
        assert!(route.key_required);
        assert_eq!(route.on_unknown, OnUnknown::Hold);
        assert_eq!(config.reconciler.release_confirm, Duration::from_secs(30));
        // A 5xx proves nothing: kept where no probe can settle it, never released.
        assert_eq!(route.policy.disposition(500), Disposition::Keep);
        assert_eq!(route.policy.disposition(429), Disposition::Release);
    }

    #[test]
    fn a_route_whose_timeout_and_ledger_call_outlast_its_lease_is_refused() {
        // 10 s + 2 s + 5 s < 30 s: the defaults fit.
        assert!(with(ROUTE).is_ok());
        let tight = format!("[idempotency]\nlease = \"16s\"\n{ROUTE}");
        let errors = with(&tight).expect_err("10 s + 7 s is not shorter than 16 s");
        assert_eq!(errors.0[0].key, "routes[0].timeout");
        assert!(
            errors.0[0].message.contains("postgres.acquire_timeout"),
            "{}",
            errors.0[0].message
        );
        let faster = format!(
            "[postgres]\nurl = \"postgres://x\"\nstatement_timeout = \"1s\"\n[auth]\nhs256_secret = \"dev-secret-123\"\n[idempotency]\nlease = \"16s\"\n{ROUTE}"
        );
        assert!(Config::from_toml(&faster).is_ok(), "10 s + 3 s < 16 s");
        // A route that is not idempotent has no lease to outlast.
        let plain = ROUTE.replace("idempotent = true", "idempotent = false");
        assert!(with(&format!("[idempotency]\nlease = \"11s\"\n{plain}")).is_ok());
    }

    #[test]
    fn the_limits_have_their_documented_defaults_and_bad_values_are_named() {
        let config = with(&format!("[redis]\nurl = \"redis://a\"\n{ROUTE}")).unwrap();
        let server = &config.server;
        assert_eq!(
            (
                server.max_header_bytes,
                server.max_headers,
                server.max_concurrent_requests
            ),
            (16384, 100, 1024)
        );
        assert_eq!(server.header_read_timeout, Duration::from_secs(10));
        assert_eq!(server.body_read_timeout, Duration::from_secs(30));
        assert_eq!(config.redis.unwrap().local_cache_bytes, 64 << 20);
        assert_eq!(config.routes.routes()[0].max_response_bytes, 10 << 20);
        for (bad, key) in [
            (
                "[server]\nmax_header_bytes = 512",
                "server.max_header_bytes",
            ),
            ("[server]\nmax_headers = 0", "server.max_headers"),
            (
                "[server]\nheader_read_timeout = \"0s\"",
                "server.header_read_timeout",
            ),
            (
                "[server]\nbody_read_timeout = \"soon\"",
                "server.body_read_timeout",
            ),
            (
                "[server]\nmax_concurrent_requests = 0",
                "server.max_concurrent_requests",
            ),
            (
                "[server]\nmax_concurrent_requests = -1",
                "server.max_concurrent_requests",
            ),
        ] {
            assert_eq!(error_key(bad), key, "{bad}");
        }
        assert_eq!(
            error_key(&format!("{ROUTE}\nmax_response_bytes = 0")),
            "routes[0].max_response_bytes"
        );
        assert_eq!(
            error_key("[redis]\nurl = \"redis://a\"\nlocal_cache_bytes = 0"),
            "redis.local_cache_bytes"
        );
    }

    #[test]
    fn unknown_keys_are_named() {
        assert_eq!(error_key("[server]\nlisten_on = \"x\""), "server.listen_on");
        assert_eq!(error_key("[extra]\na = 1"), "extra");
        assert_eq!(
            error_key(&format!("{ROUTE}\nretries = 3")),
            "routes[0].retries"
        );
    }

    #[test]
    fn bad_durations_and_values_are_named() {
        assert_eq!(
            error_key("[idempotency]\nttl = \"forever\""),
            "idempotency.ttl"
        );
        assert_eq!(
            error_key("[idempotency]\non_in_progress = \"later\""),
            "idempotency.on_in_progress"
        );
        assert_eq!(
            error_key("[idempotency]\nmismatch_status = 400"),
            "idempotency.mismatch_status"
        );
        assert_eq!(error_key("[server]\nlisten = \"nowhere\""), "server.listen");
        assert_eq!(
            error_key("[server]\nworker_threads = 0"),
            "server.worker_threads"
        );
        assert_eq!(
            error_key(&format!("{ROUTE}\ntimeout = \"10 parsecs\"")),
            "routes[0].timeout"
        );
    }

    #[test]
    fn route_timeout_must_be_shorter_than_the_lease() {
        let errors = with(&format!("{ROUTE}\ntimeout = \"30s\"")).unwrap_err();
        assert_eq!(errors.0[0].key, "routes[0].timeout");
        assert!(errors.0[0].message.contains("lease"), "{errors}");
        // A per-route lease can make room for a longer timeout.
        assert!(with(&format!("{ROUTE}\ntimeout = \"30s\"\nlease = \"1m\"")).is_ok());
    }

    #[test]
    fn route_fields_are_validated() {
        assert_eq!(
            error_key(&ROUTE.replace("POST", "post")),
            "routes[0].method"
        );
        assert_eq!(
            error_key(&ROUTE.replace("/payments", "payments")),
            "routes[0].path"
        );
        assert_eq!(
            error_key(&ROUTE.replace("http://127.0.0.1:9090", "https://x")),
            "routes[0].upstream"
        );
        assert_eq!(
            error_key(&format!("{ROUTE}\nprobe = \"GET /payments\"")),
            "routes[0].probe"
        );
        assert_eq!(
            error_key(&format!("{ROUTE}\non_unknown = \"release\"")),
            "routes[0].on_unknown"
        );
        assert_eq!(
            error_key(&format!("{ROUTE}\non_unknown = \"release-after:soon\"")),
            "routes[0].on_unknown"
        );
        assert_eq!(
            error_key(&format!("{ROUTE}\nrelease_on = [\"6xx\"]")),
            "routes[0].release_on"
        );
        assert_eq!(error_key(&format!("{ROUTE}{ROUTE}")), "routes[1]");
    }

    #[test]
    fn per_route_settings_override_defaults() {
        let config = with(&format!(
            "[idempotency]\nttl = \"1h\"\n{ROUTE}\nttl = \"10m\"\nmismatch_status = 422\non_unknown = \"release-after:10m\"\nprobe = \"GET /payments/by-key/{{key}}\"\nrelease_on = [\"5xx\"]"
        ))
        .unwrap();
        let route = &config.routes.routes()[0];
        assert_eq!(route.policy.ttl, Duration::from_secs(600));
        assert_eq!(route.policy.mismatch_status, 422);
        assert_eq!(
            route.on_unknown,
            OnUnknown::ReleaseAfter(Duration::from_secs(600))
        );
        assert_eq!(route.probe.as_ref().unwrap().path, "/payments/by-key/{key}");
        assert_eq!(route.policy.disposition(503), Disposition::Release);
        assert_eq!(
            route.policy.disposition(429),
            Disposition::Keep,
            "the list replaces the default"
        );
    }

    #[test]
    fn redis_needs_one_of_url_or_cluster_urls() {
        assert!(
            with("[redis]\nurl = \"redis://127.0.0.1:6379\"")
                .unwrap()
                .redis
                .is_some()
        );
        assert!(with("[redis]\ncluster_urls = [\"redis://127.0.0.1:7000\"]").is_ok());
        assert_eq!(error_key("[redis]\nprefix = \"x\""), "redis");
        assert_eq!(
            error_key("[redis]\nurl = \"redis://a\"\ncluster_urls = [\"redis://b\"]"),
            "redis"
        );
        assert_eq!(
            error_key("[redis]\nurl = \"redis://a\"\nprefix = \"{x}\""),
            "redis.prefix"
        );
        assert_eq!(
            error_key("[redis]\nurl = \"redis://a\"\ntimeout = \"fast\""),
            "redis.timeout"
        );
    }

    #[test]
    fn missing_sections_are_named() {
        let errors = Config::from_toml("[auth]\nhs256_secret = \"x\"").unwrap_err();
        assert!(errors.0.iter().any(|e| e.key == "postgres"), "{errors}");
    }
}
