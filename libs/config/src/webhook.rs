//! `[routes.webhook]` (docs/webhooks.md) makes an idempotent route a provider's webhook
//! endpoint: the key is the provider's event id, the sender is authenticated by its
//! signature instead of a token, and the tenant comes from the route. Its `ttl` defaults
//! to 72 hours, as long as providers go on redelivering.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `scheme` | (required) | `"standard-webhooks"`, `"stripe"` or `"github"` |
//! | `secret_file` | – | one secret a line, any of them verifies (rotation); with `tenant` |
//! | `secret_dir` | – | a file per tenant, named by the tenant; with `{tenant}` in the path |
//! | `tenant` | – | the tenant of every delivery (or `{tenant}` in the path) |
//! | `tolerance` | `5m` | how far a signed timestamp may be from now, either way; less than the route's ttl |
//! | `max_body_bytes` | `262144` | an unverified body's size (413 beyond) |
//! | `body_read_timeout` | `5s` | how long an unverified body may take to arrive (408 beyond) |
//! | `max_unverified` | `64` | unverified bodies read at once on the route (503 `overloaded` beyond, on this route only) |
//!
//! Until its signature verifies, a delivery holds only one of its route's
//! `max_unverified` places: no slot of `server.max_concurrent_requests`, no tenant quota.
//! A webhook route's ttl (its own, else 72 h) is never shortened by a tenant entry, and
//! its `release_on` defaults to 408, 425, 429 and every 5xx the receiver answered: a
//! receiver acknowledges with 2xx, and has done nothing when it answers 5xx.

use std::path::PathBuf;
use std::time::Duration;

use idem_core::policy::StatusSet;
use idem_webhooks::{Scheme, Secrets};
use serde::Deserialize;

use crate::ConfigError;
use crate::template::PathTemplate;

/// `[routes.webhook]`: deliveries authenticated by their signature, keyed by the
/// provider's event id.
#[derive(Debug, Clone)]
pub struct Webhook {
    pub scheme: Scheme,
    pub secrets: SecretSource,
    /// The tenant of every delivery; `None`: the path's `{tenant}` names it.
    pub tenant: Option<String>,
    /// How far a signed timestamp may be from now, either way.
    pub tolerance: Duration,
    /// The most bytes of a body read before its signature is checked.
    pub max_body_bytes: usize,
    /// How long a body may take to arrive before its signature is checked.
    pub body_read_timeout: Duration,
    /// How many bodies the route reads at once before their signatures are checked.
    pub max_unverified: usize,
    /// Whether the route settles an unknown outcome by itself (a `probe`, or an
    /// `on_unknown` set): otherwise a receiver's timeout holds the event for the operator.
    pub settles_unknown: bool,
}

impl Webhook {
    /// Whether the route's secrets can be read and hold a secret of its scheme (a
    /// directory: whether it can be listed; its files are read per tenant). `at` names the
    /// route in the error. The gateway checks this at start, and `check-config` with it;
    /// the other processes that read the config (the reconciler, migrations) need no secrets.
    pub fn check_secrets(&self, at: &str) -> Result<(), ConfigError> {
        match &self.secrets {
            SecretSource::File(file) => {
                let key = format!("{at}.webhook.secret_file");
                let refused =
                    |e: String| ConfigError::new(key.clone(), format!("{}: {e}", file.display()));
                let text = std::fs::read_to_string(file).map_err(|e| refused(e.to_string()))?;
                Secrets::parse(self.scheme, &text).map_err(|e| refused(e.to_string()))?;
            }
            SecretSource::Dir(dir) => {
                std::fs::read_dir(dir).map_err(|e| {
                    ConfigError::new(
                        format!("{at}.webhook.secret_dir"),
                        format!("{}: {e}", dir.display()),
                    )
                })?;
            }
        }
        Ok(())
    }
}

/// Where a webhook route's secrets are read from (again whenever the file changes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SecretSource {
    /// One file: the route's secrets.
    File(PathBuf),
    /// A directory of files, each named by its tenant.
    Dir(PathBuf),
}

/// The ttl of a webhook route unless it sets one: providers redeliver for up to three
/// days.
pub const WEBHOOK_TTL: Duration = Duration::from_secs(72 * 3600);

/// The statuses a webhook route releases unless it sets `release_on`: HTTP's own (408,
/// 425, 429) and every 5xx the receiver answered — a receiver acknowledges with 2xx only
/// after its commit, so its 5xx says it did nothing and the provider's redelivery should
/// run it again. (A timeout is not an answer: it stays an unknown outcome.)
pub fn webhook_release_statuses() -> StatusSet {
    let mut statuses = idem_core::policy::default_release_statuses();
    statuses.insert(idem_core::policy::StatusEntry::Class(5));
    statuses
}

/// `[routes.webhook]` as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawWebhook {
    scheme: String,
    secret_file: Option<PathBuf>,
    secret_dir: Option<PathBuf>,
    tenant: Option<String>,
    #[serde(default = "default_tolerance", with = "humantime_serde")]
    tolerance: Duration,
    #[serde(default = "default_webhook_body")]
    max_body_bytes: usize,
    #[serde(default = "default_webhook_read", with = "humantime_serde")]
    body_read_timeout: Duration,
    #[serde(default = "default_max_unverified")]
    max_unverified: usize,
}

fn default_tolerance() -> Duration {
    Duration::from_secs(300)
}
fn default_webhook_body() -> usize {
    256 * 1024
}
fn default_webhook_read() -> Duration {
    Duration::from_secs(5)
}
fn default_max_unverified() -> usize {
    64
}

/// The file two secret sources could both read, if any: the same file, a file in the
/// other's directory, or the same directory.
pub(crate) fn shared_file(a: &SecretSource, b: &SecretSource) -> Option<PathBuf> {
    use SecretSource::{Dir, File};
    let same = |x: &std::path::Path, y: &std::path::Path| {
        x == y
            || matches!(
                (x.canonicalize(), y.canonicalize()),
                (Ok(x), Ok(y)) if x == y
            )
    };
    let in_dir = |file: &std::path::Path, dir: &std::path::Path| {
        file.parent().is_some_and(|parent| {
            same(parent, dir)
                || (parent.as_os_str().is_empty() && same(std::path::Path::new("."), dir))
        })
    };
    match (a, b) {
        (File(x), File(y)) if same(x, y) => Some(x.clone()),
        (File(file), Dir(dir)) | (Dir(dir), File(file)) if in_dir(file, dir) => Some(file.clone()),
        (Dir(x), Dir(y)) if same(x, y) => Some(x.clone()),
        _ => None,
    }
}

impl RawWebhook {
    /// Checks the section against its route's `path` (whether it has `{tenant}`). Its
    /// secrets are read by [`Webhook::check_secrets`].
    pub(crate) fn validate(
        self,
        at: &str,
        path: &PathTemplate,
        idempotent: bool,
        settles_unknown: bool,
    ) -> Result<Webhook, ConfigError> {
        let at = format!("{at}.webhook");
        let scheme: Scheme = self
            .scheme
            .parse()
            .map_err(|e: idem_webhooks::UnknownScheme| {
                ConfigError::new(format!("{at}.scheme"), e.to_string())
            })?;
        if !idempotent {
            return Err(ConfigError::new(
                at,
                "a webhook route deduplicates deliveries: set `idempotent = true` on the route",
            ));
        }
        ConfigError::first_zero([
            (format!("{at}.tolerance").as_str(), self.tolerance.is_zero()),
            (
                format!("{at}.max_body_bytes").as_str(),
                self.max_body_bytes == 0,
            ),
            (
                format!("{at}.body_read_timeout").as_str(),
                self.body_read_timeout.is_zero(),
            ),
            (
                format!("{at}.max_unverified").as_str(),
                self.max_unverified == 0,
            ),
        ])?;
        let secrets = match (self.tenant.as_deref(), path.has_param("tenant")) {
            (Some(tenant), _) if !idem_auth::valid_tenant(tenant) => {
                return Err(ConfigError::new(
                    format!("{at}.tenant"),
                    format!(
                        "{tenant:?} is not a tenant id (1 to {} printable ASCII characters, no spaces): every delivery would be refused",
                        idem_auth::MAX_TENANT_LEN
                    ),
                ));
            }
            (Some(_), true) => {
                return Err(ConfigError::new(
                    format!("{at}.tenant"),
                    "the path's {tenant} names the tenant already: set one or the other",
                ));
            }
            (None, false) => {
                return Err(ConfigError::new(
                    at,
                    "names no tenant: set `tenant`, or put {tenant} in the route's path",
                ));
            }
            (Some(_), false) => match (self.secret_file, self.secret_dir) {
                (Some(file), None) => SecretSource::File(file),
                _ => {
                    return Err(ConfigError::new(
                        format!("{at}.secret_file"),
                        "a route with one tenant reads its secrets from `secret_file` (and not `secret_dir`)",
                    ));
                }
            },
            (None, true) => match (self.secret_dir, self.secret_file) {
                (Some(dir), None) => SecretSource::Dir(dir),
                _ => {
                    return Err(ConfigError::new(
                        format!("{at}.secret_dir"),
                        "a {tenant} route reads each tenant's secrets from `secret_dir` (a file named by the tenant), not `secret_file`",
                    ));
                }
            },
        };
        Ok(Webhook {
            scheme,
            secrets,
            tenant: self.tenant,
            tolerance: self.tolerance,
            max_body_bytes: self.max_body_bytes,
            body_read_timeout: self.body_read_timeout,
            max_unverified: self.max_unverified,
            settles_unknown,
        })
    }
}
