//! `[postgres]`: the ledger's database.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `postgres.url` | (required) | the ledger's database |
//! | `postgres.max_connections` | `16` | pool size |
//! | `postgres.acquire_timeout` | `2s` | wait for a pooled connection |
//! | `postgres.statement_timeout` | `5s` | server-side limit per statement |

use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use crate::ConfigError;

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

impl PostgresConfig {
    /// The longest one ledger call may take: a pooled connection, then the statement.
    pub fn op_timeout(&self) -> Duration {
        self.acquire_timeout + self.statement_timeout
    }

    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        ConfigError::first_zero([("postgres.max_connections", self.max_connections == 0)])
    }
}
