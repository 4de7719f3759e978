//! The admin API's bearer token: the contents of `admin.token_file`, read at start and
//! again whenever the file changes (a rotated Kubernetes Secret is a new file behind the
//! same path), so a new token is accepted and the old one refused without a restart.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::SystemTime;

use idem_config::admin::AdminConfig;
use secrecy::{ExposeSecret, SecretString};

/// What identifies one version of the file: its inode, modification time and size.
type Stamp = Option<(u64, SystemTime, u64)>;

fn stamp(path: &PathBuf) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.ino(), meta.modified().ok()?, meta.len()))
}

/// The token as the file holds it now.
pub struct AdminToken {
    config: AdminConfig,
    path: PathBuf,
    current: Mutex<(SecretString, Stamp)>,
}

impl std::fmt::Debug for AdminToken {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AdminToken")
            .field("path", &self.path)
            .finish_non_exhaustive()
    }
}

impl AdminToken {
    /// The token of `config`, read now; `None` when the admin API is off.
    pub fn load(config: &AdminConfig) -> Result<Option<Self>, idem_config::ConfigError> {
        let (Some(path), Some(token)) = (config.token_file.clone(), config.token()?) else {
            return Ok(None);
        };
        let stamp = stamp(&path);
        Ok(Some(Self {
            config: config.clone(),
            path,
            current: Mutex::new((token, stamp)),
        }))
    }

    /// Whether `sent` is the token the file holds now, compared in a time that does not
    /// depend on where the two first differ. A changed file is read again; one that no
    /// longer holds a valid token leaves the last good one in force (and says so).
    pub fn accepts(&self, sent: &str) -> bool {
        let mut current = self.current.lock().expect("admin token");
        let now = stamp(&self.path);
        if now != current.1 {
            current.1 = now;
            match self.config.token() {
                Ok(Some(token)) => {
                    current.0 = token;
                    tracing::info!(path = %self.path.display(), "admin token re-read");
                }
                Ok(None) => {}
                Err(error) => tracing::warn!(
                    %error,
                    "admin.token_file changed but holds no valid token; the last one stays in force"
                ),
            }
        }
        same(sent.as_bytes(), current.0.expose_secret().as_bytes())
    }
}

/// Equal, in a time that does not depend on where the two first differ.
fn same(a: &[u8], b: &[u8]) -> bool {
    a.len() == b.len() && a.iter().zip(b).fold(0u8, |d, (x, y)| d | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_compare_whole() {
        assert!(same(b"0123456789abcdef", b"0123456789abcdef"));
        assert!(!same(b"0123456789abcdef", b"0123456789abcdeF"));
        assert!(!same(b"0123456789abcdef", b"0123456789abcde"));
        assert!(!same(b"", b"x"));
    }
}
