//! Webhook routes (DESIGN §17.1): a provider's delivery authenticated by its signature
//! (`idem_webhooks`) instead of a token, its tenant named by the route, its key the
//! provider's event id. A delivery that does not verify is 401
//! `webhook-signature-invalid`, counted by reason, and nothing is claimed.
//!
//! Secrets are read from their file when first needed and again whenever the file
//! changes (its length or modification time), so a secret is rotated by editing the file:
//! no restart. A file that cannot be read or holds no secret verifies nothing.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use http::request::Parts;
use idem_config::{Route, SecretSource, Webhook};
use idem_core::IdempotencyKey;
use idem_telemetry::metrics::counter;
use idem_webhooks::{Rejection, Secrets};

use crate::problem::Problem;

/// The tenant of a delivery to a webhook route: the route's own, or its path's `{tenant}`
/// — one that has a secrets file: a `{tenant}` without one is refused here, before its
/// quota or anything else of a tenant is touched, so unsigned requests to made-up
/// tenants leave nothing behind.
pub fn tenant(route: &Route, webhook: &Webhook, path: &str) -> Result<String, Problem> {
    let tenant = match &webhook.tenant {
        Some(tenant) => Some(tenant.as_str()),
        None => route.template.param(path, "tenant"),
    };
    let tenant = tenant
        .filter(|t| idem_auth::valid_tenant(t))
        .ok_or(Problem::RouteNotFound)?;
    if let SecretSource::Dir(dir) = &webhook.secrets
        && !dir.join(tenant).is_file()
    {
        return Err(rejected(Rejection::Invalid));
    }
    Ok(tenant.to_owned())
}

/// A refused delivery, counted by its reason.
fn rejected(rejection: Rejection) -> Problem {
    counter!("idemgate_webhooks_rejected_total", "reason" => rejection.reason()).increment(1);
    Problem::WebhookSignatureInvalid {
        reason: rejection.reason(),
        explanation: rejection.explanation(),
    }
}

/// The secrets files of the webhook routes, each as last read.
#[derive(Debug, Default)]
pub struct SecretFiles {
    files: Mutex<HashMap<PathBuf, Loaded>>,
}

#[derive(Debug, Clone)]
struct Loaded {
    /// What the file looked like when read: read again when this changes.
    seen: Seen,
    secrets: Option<Arc<Secrets>>,
}

/// A file's identity and last change: its inode and change time catch a same-length
/// secret written with its modification time kept (`cp -p`, `rsync -t`), and a
/// Kubernetes Secret's files swapped in by a new symlink.
type Seen = (u64, u64, SystemTime, i64, i64);

fn seen(path: &Path) -> Option<Seen> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some((
        m.ino(),
        m.len(),
        m.modified().ok()?,
        m.ctime(),
        m.ctime_nsec(),
    ))
}

impl SecretFiles {
    /// The secrets `webhook` verifies `tenant`'s deliveries with, if its file has any.
    fn secrets(&self, webhook: &Webhook, tenant: &str) -> Option<Arc<Secrets>> {
        let path = match &webhook.secrets {
            SecretSource::File(file) => file.clone(),
            // The tenant is one path segment already (no `/`, no dot segment).
            SecretSource::Dir(dir) => dir.join(tenant),
        };
        // No file, no secrets — and nothing remembered of it.
        let seen = seen(&path)?;
        let mut files = self.files.lock().expect("secret files");
        if let Some(loaded) = files.get(&path)
            && loaded.seen == seen
        {
            return loaded.secrets.clone();
        }
        let secrets = read(&path, webhook);
        files.insert(
            path,
            Loaded {
                seen,
                secrets: secrets.clone(),
            },
        );
        secrets
    }
}

fn read(path: &Path, webhook: &Webhook) -> Option<Arc<Secrets>> {
    let parsed = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|text| Secrets::parse(webhook.scheme, &text).map_err(|e| e.to_string()));
    match parsed {
        Ok(secrets) => {
            tracing::info!(file = %path.display(), secrets = secrets.len(), "webhook secrets read");
            Some(Arc::new(secrets))
        }
        Err(error) => {
            tracing::warn!(file = %path.display(), %error, "webhook secrets unusable: deliveries are refused");
            None
        }
    }
}

/// Verifies a delivery's signature and returns its key (400 when a verified delivery
/// names none); 401 and nothing claimed when it does not verify.
pub fn verify(
    files: &SecretFiles,
    webhook: &Webhook,
    tenant: &str,
    parts: &Parts,
    body: &[u8],
) -> Result<IdempotencyKey, Problem> {
    let verified = files
        .secrets(webhook, tenant)
        .ok_or(Rejection::Invalid)
        .and_then(|secrets| {
            idem_webhooks::verify(
                webhook.scheme,
                &secrets,
                &parts.headers,
                body,
                SystemTime::now(),
                webhook.tolerance,
            )
        });
    let verified = verified.map_err(rejected)?;
    let key = verified.key.ok_or(Problem::KeyMissing)?;
    IdempotencyKey::parse(key.as_bytes())
        .map_err(|e| Problem::KeyInvalid(idem_http::problem::KeyHeaderError::Invalid(e)))
}
