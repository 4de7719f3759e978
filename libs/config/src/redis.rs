//! `[redis]`: the fast path. Without this section, Postgres alone serves.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `redis.url` / `redis.cluster_urls` | (none) | one node, or a cluster's seed nodes |
//! | `redis.prefix` | `idem:` | prepended to every Redis key |
//! | `redis.timeout` | `100ms` | per Redis call; past it the breaker opens |
//! | `redis.probe_interval` | `1s` | how often an open breaker tries Redis again |
//! | `redis.local_cache_entries` | `10000` | completed responses also kept in-process (0: none) |
//! | `redis.local_cache_bytes` | `67108864` | the bytes those copies may hold (LRU) |
//! | `redis.lock` | `true` | take the in-progress lock in Redis before a new key's Postgres claim |

use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use crate::ConfigError;

/// `[redis]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RedisConfig {
    /// One Redis node.
    pub url: Option<SecretString>,
    /// Or the seed nodes of a Redis Cluster.
    pub cluster_urls: Option<Vec<SecretString>>,
    #[serde(default = "default_prefix")]
    pub prefix: String,
    /// Upper bound on one Redis call; past it the breaker opens and Postgres serves.
    #[serde(default = "default_timeout", with = "humantime_serde")]
    pub timeout: Duration,
    /// How often an open breaker tries Redis again (the key keeps its contract name).
    #[serde(default = "default_probe_interval", with = "humantime_serde")]
    pub probe_interval: Duration,
    /// Completed responses also kept in this process (0: none), so a hot replay costs
    /// no round trip at all. Each copy expires with its ledger row.
    #[serde(default = "default_local_cache_entries")]
    pub local_cache_entries: usize,
    /// The bytes those in-process copies may hold in all (least recently used go first).
    #[serde(default = "default_local_cache_bytes")]
    pub local_cache_bytes: usize,
    /// Take the in-progress lock in Redis before a new key's Postgres claim, so that
    /// concurrent duplicates are turned away before Postgres. `false`: the lookup only
    /// reads a completed answer, and Postgres decides alone (it does anyway).
    #[serde(default = "default_lock")]
    pub lock: bool,
}

fn default_local_cache_entries() -> usize {
    10_000
}
fn default_local_cache_bytes() -> usize {
    64 * 1024 * 1024
}
fn default_lock() -> bool {
    true
}
fn default_prefix() -> String {
    "idem:".into()
}
fn default_timeout() -> Duration {
    Duration::from_millis(100)
}
fn default_probe_interval() -> Duration {
    Duration::from_secs(1)
}

impl RedisConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
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
        ConfigError::first_zero([
            ("redis.timeout", self.timeout.is_zero()),
            ("redis.probe_interval", self.probe_interval.is_zero()),
        ])?;
        if self.local_cache_entries > 0 && self.local_cache_bytes == 0 {
            return Err(ConfigError::new(
                "redis.local_cache_bytes",
                "must be greater than 0 (set local_cache_entries = 0 to keep no copies)",
            ));
        }
        Ok(())
    }
}
