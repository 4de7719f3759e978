//! `[idempotency]`: the defaults every idempotent route starts from (each key can be
//! set per route as well).
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `idempotency.ttl` | `24h` | how long a completed key is replayed |
//! | `idempotency.lease` | `30s` | protection of an in-progress claim |
//! | `idempotency.on_in_progress` | `reject` | or `wait` |
//! | `idempotency.wait_timeout` | `5s` | longest wait for a concurrent attempt |
//! | `idempotency.mismatch_status` | `409` | or `422` |
//! | `idempotency.lock_wait` | `5s` | embedded mode: how long a duplicate waits on an uncommitted claim |

use std::time::Duration;

use idem_core::policy::{self, OnInProgress, Policy};
use serde::Deserialize;

use crate::ConfigError;

/// `[idempotency]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct IdempotencyConfig {
    #[serde(with = "humantime_serde")]
    pub ttl: Duration,
    #[serde(with = "humantime_serde")]
    pub lease: Duration,
    pub on_in_progress: OnInProgress,
    #[serde(with = "humantime_serde")]
    pub wait_timeout: Duration,
    /// The status of a key reused with a different request: 409 or 422.
    pub mismatch_status: u16,
    /// Embedded mode (docs/embedded-mode.md): how long a duplicate waits on another request's
    /// uncommitted claim before it is answered 409.
    #[serde(with = "humantime_serde")]
    pub lock_wait: Duration,
}

impl Default for IdempotencyConfig {
    fn default() -> Self {
        Self {
            ttl: Duration::from_secs(24 * 3600),
            lease: Duration::from_secs(30),
            on_in_progress: OnInProgress::Reject,
            wait_timeout: Duration::from_secs(5),
            mismatch_status: 409,
            lock_wait: Duration::from_secs(5),
        }
    }
}

impl IdempotencyConfig {
    /// The engine's policy for a route that sets nothing of its own.
    pub fn policy(&self) -> Policy {
        Policy {
            ttl: self.ttl,
            lease: self.lease,
            on_in_progress: self.on_in_progress,
            wait_timeout: self.wait_timeout,
            release_on: policy::default_release_statuses(),
            probe: false,
        }
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        if self.lock_wait.is_zero() {
            return Err(ConfigError::new(
                "idempotency.lock_wait",
                "must be greater than 0",
            ));
        }
        check("idempotency", &self.policy(), self.mismatch_status)
    }
}

/// The rules a policy (the defaults', or a route's at `at`) must keep.
pub(crate) fn check(at: &str, p: &Policy, mismatch_status: u16) -> Result<(), ConfigError> {
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
    if !matches!(mismatch_status, 409 | 422) {
        return Err(ConfigError::new(
            format!("{at}.mismatch_status"),
            "must be 409 or 422",
        ));
    }
    Ok(())
}
