//! The admin API's bearer token: the contents of `admin.token_file`, read at start and
//! again whenever the file changes (a rotated Kubernetes Secret is a new file behind the
//! same path; an in-place rewrite that keeps the modification time still changes the
//! change time), so a new token is accepted and the old one refused without a restart.
//!
//! The file is the token: once it is gone, or holds no valid token, every call is refused
//! until it holds one again — deleting the file closes the API.

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::SystemTime;

use idem_config::admin::AdminConfig;
use secrecy::{ExposeSecret, SecretString};

/// What identifies one version of the file: its inode, size, modification time and
/// change time (which no `cp -p` or `rsync -t` keeps). `None`: there is no file.
type Stamp = Option<(u64, u64, SystemTime, i64, i64)>;

fn stamp(path: &PathBuf) -> Stamp {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::metadata(path).ok()?;
    Some((
        meta.ino(),
        meta.len(),
        meta.modified().ok()?,
        meta.ctime(),
        meta.ctime_nsec(),
    ))
}

/// The token as the file holds it now.
pub struct AdminToken {
    config: AdminConfig,
    path: PathBuf,
    /// The token in force (`None`: the file is gone or holds none, and every call is
    /// refused), and the version of the file it was read from.
    current: Mutex<(Option<SecretString>, Stamp)>,
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
            current: Mutex::new((Some(token), stamp)),
        }))
    }

    /// Whether `sent` is the token the file holds now, compared in a time that does not
    /// depend on where the two first differ. A changed file is read again; one that is
    /// gone or holds no valid token accepts nothing (and says so, once per change).
    pub fn accepts(&self, sent: &str) -> bool {
        let mut current = self.current.lock().expect("admin token");
        let now = stamp(&self.path);
        if now != current.1 {
            current.1 = now;
            current.0 = match self.config.token() {
                Ok(token) => {
                    tracing::info!(path = %self.path.display(), "admin token re-read");
                    token
                }
                Err(error) => {
                    tracing::warn!(
                        %error,
                        "admin.token_file is gone or holds no valid token: every admin call is refused until it holds one"
                    );
                    None
                }
            };
        }
        current
            .0
            .as_ref()
            .is_some_and(|token| same(sent.as_bytes(), token.expose_secret().as_bytes()))
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
