//! `[reconciler]`: how `idemgate-reconciler` works through stuck claims and expired keys.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `reconciler.listen` | `127.0.0.1:9091` | its `/healthz` and `/metrics` |
//! | `reconciler.interval` | `5s` | pause between passes |
//! | `reconciler.batch_size` | `100` | stuck rows taken per batch |
//! | `reconciler.processing_lease` | `2m` | how long taken rows are its own |
//! | `reconciler.concurrency` | `16` | status probes at once |
//! | `reconciler.max_backoff` | `10m` | longest wait before a row is looked at again |
//! | `reconciler.release_confirm` | `30s` | two probe 404s this far apart release a key |
//! | `reconciler.purge_batch` | `1000` | expired rows deleted per statement |
//! | `reconciler.purge_budget` | `2s` | the most time one pass spends purging |

use std::net::SocketAddr;
use std::time::Duration;

use serde::Deserialize;

use crate::ConfigError;

/// `[reconciler]`.
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
    /// How long a reconciler keeps the rows it took while it asks their upstreams;
    /// other reconcilers skip them meanwhile.
    #[serde(with = "humantime_serde")]
    pub processing_lease: Duration,
    /// Status probes running at once.
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

impl ReconcilerConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::first_zero([
            ("reconciler.interval", self.interval.is_zero()),
            ("reconciler.batch_size", self.batch_size == 0),
            (
                "reconciler.processing_lease",
                self.processing_lease.is_zero(),
            ),
            ("reconciler.concurrency", self.concurrency == 0),
            ("reconciler.max_backoff", self.max_backoff.is_zero()),
            ("reconciler.release_confirm", self.release_confirm.is_zero()),
            ("reconciler.purge_batch", self.purge_batch == 0),
            ("reconciler.purge_budget", self.purge_budget.is_zero()),
        ])
    }
}
