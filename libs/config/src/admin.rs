//! `[admin]`: the operator's HTTP API (docs/operations.md), off unless `admin.listen` is set.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `admin.listen` | unset (off) | address the admin API serves on; keep it off the public network |
//! | `admin.token_file` | required with `listen` | a file whose contents (trimmed) are the bearer token every admin call must send; re-read when it changes |
//! | `admin.allow_remote` | `false` | whether `listen` may be other than a loopback address: only where the network in front keeps the API private (the chart: a ClusterIP Service and a NetworkPolicy) |

use std::net::SocketAddr;
use std::path::PathBuf;

use secrecy::SecretString;
use serde::Deserialize;

use crate::ConfigError;

/// The shortest token accepted: a guessable one would open every key to release.
pub const MIN_TOKEN_BYTES: usize = 16;

/// `[admin]`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AdminConfig {
    pub listen: Option<SocketAddr>,
    pub token_file: Option<PathBuf>,
    /// `listen` may be other than loopback: the operator says the network keeps it private.
    #[serde(default)]
    pub allow_remote: bool,
}

impl AdminConfig {
    pub(crate) fn validate(&self) -> Result<(), ConfigError> {
        match (&self.listen, &self.token_file) {
            (Some(_), None) => Err(ConfigError::new(
                "admin.token_file",
                "is required with admin.listen: every admin call must send its bearer token",
            )),
            (None, Some(_)) => Err(ConfigError::new(
                "admin.listen",
                "is required with admin.token_file (the admin API is off without it)",
            )),
            (Some(at), Some(_)) if !at.ip().is_loopback() && !self.allow_remote => {
                Err(ConfigError::new(
                    "admin.listen",
                    format!(
                        "{at} is not a loopback address, and anyone who reaches the admin API \
                         with its token can release keys (a second execution, by design): \
                         listen on 127.0.0.1, or set admin.allow_remote = true where the \
                         network in front keeps it private (the chart does)"
                    ),
                ))
            }
            _ => Ok(()),
        }
    }

    /// The bearer token, read from `token_file` (at start-up and by `check-config`).
    pub fn token(&self) -> Result<Option<SecretString>, ConfigError> {
        let Some(path) = &self.token_file else {
            return Ok(None);
        };
        let text = std::fs::read_to_string(path).map_err(|e| {
            ConfigError::new("admin.token_file", format!("{}: {e}", path.display()))
        })?;
        let token = text.trim();
        if token.len() < MIN_TOKEN_BYTES {
            return Err(ConfigError::new(
                "admin.token_file",
                format!(
                    "{} holds a token of {} bytes; use at least {MIN_TOKEN_BYTES} (e.g. `openssl rand -hex 32`)",
                    path.display(),
                    token.len()
                ),
            ));
        }
        Ok(Some(SecretString::from(token.to_owned())))
    }
}
