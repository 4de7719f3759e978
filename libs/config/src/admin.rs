//! `[admin]`: the operator's HTTP API (docs/operations.md), off unless `admin.listen` is set.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `admin.listen` | unset (off) | address the admin API serves on; keep it off the public network |
//! | `admin.token_file` | required with `listen` | a file whose contents (trimmed) are the bearer token every admin call must send |

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
