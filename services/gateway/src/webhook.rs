//! Webhook routes (docs/webhooks.md): a provider's delivery authenticated by its signature
//! (`idem_webhooks`) instead of a token, its tenant named by the route, its key the
//! provider's event id. A delivery that does not verify is 401
//! `webhook-signature-invalid`, counted by reason, and nothing is claimed.
//!
//! Anyone may send to a webhook URL, so until its signature has verified a delivery is
//! nobody's: it holds one of its route's `max_unverified` places ([`Receivers::admit`])
//! and nothing else — no slot of `server.max_concurrent_requests`, no tenant quota — and
//! its body is bounded by the route's own `max_body_bytes` and `body_read_timeout`. The
//! secrets file is read and the MAC computed on the blocking pool, never on the threads
//! that serve requests.
//!
//! Secrets are read from their file when first needed and again whenever the file
//! changes (its inode, length, modification or change time), so a secret is rotated by
//! editing the file: no restart. A parse is kept per file *and scheme*. A file that
//! cannot be read or holds no secret verifies nothing.
//!
//! A `{tenant}` route answers a tenant without a secrets file exactly as it answers a bad
//! signature: after the body, with as many MACs computed (under secrets nobody has) as a
//! tenant's check computes — every file is padded to [`MACS`] — so neither the status nor
//! the time tells which tenants exist.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use bytes::Bytes;
use http::HeaderMap;
use idem_config::{Route, RouteTable, SecretSource, Webhook};
use idem_core::IdempotencyKey;
use idem_telemetry::metrics::counter;
use idem_webhooks::{Rejection, Scheme, Secrets};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::problem::Problem;

/// What the webhook routes share: each one's places for unverified bodies, and the
/// secrets files as last read.
#[derive(Debug)]
pub struct Receivers {
    /// Each webhook route's `max_unverified` places, by endpoint.
    places: HashMap<String, Arc<Semaphore>>,
    files: SecretFiles,
    /// A secret no sender has: what a delivery for a tenant without secrets is checked
    /// against, so it costs what a bad signature costs.
    decoy: Arc<Secrets>,
}

/// How many MACs a delivery's check computes at the least: a file of one secret is padded
/// with secrets nobody has up to this, so a tenant with one secret, one mid-rotation with
/// two, and a tenant without a file (checked against [`MACS`] of them) cost the same.
const MACS: usize = 2;

/// One unverified body's place on its route, given back when dropped.
#[derive(Debug)]
pub struct Place(#[allow(dead_code)] OwnedSemaphorePermit);

/// A delivery whose signature verified: who it is for and which operation it is.
#[derive(Debug)]
pub struct Delivery {
    pub tenant: String,
    pub key: IdempotencyKey,
}

impl Receivers {
    pub fn new(routes: &RouteTable) -> Self {
        let places = routes
            .routes()
            .iter()
            .filter_map(|route| {
                let webhook = route.webhook.as_ref()?;
                let places = Arc::new(Semaphore::new(webhook.max_unverified));
                Some((route.endpoint.clone(), places))
            })
            .collect();
        let decoy = (0..MACS)
            .map(|_| uuid::Uuid::new_v4().simple().to_string())
            .collect::<Vec<_>>()
            .join("\n");
        let decoy = Secrets::parse(Scheme::Github, &decoy).expect("32 characters are a secret");
        let decoy = Arc::new(decoy);
        Self {
            places,
            files: SecretFiles {
                files: Mutex::default(),
                pad: decoy.clone(),
            },
            decoy,
        }
    }

    /// One of `route`'s places for an unverified body; beyond its `max_unverified`, 503
    /// `overloaded` on this route only.
    pub fn admit(&self, route: &Route) -> Result<Place, Problem> {
        let places = self.places.get(&route.endpoint).ok_or(Problem::Internal)?;
        // Counted as every refusal is, in idemgate_requests_total{outcome="overloaded"}.
        match places.clone().try_acquire_owned() {
            Ok(permit) => Ok(Place(permit)),
            Err(_) => Err(Problem::Overloaded),
        }
    }

    /// Verifies a delivery to `route` at `path` (its signature over `body` by one of its
    /// tenant's secrets) on the blocking pool, and returns its tenant and key: 401 when
    /// it does not verify (a tenant without secrets included), 400 when a verified
    /// delivery names no key. The delivery's `place` goes with the work, so a sender that
    /// hangs up mid-check frees it only once the check has ended.
    pub async fn verify(
        self: &Arc<Self>,
        place: Place,
        route: &Arc<Route>,
        path: &str,
        headers: &HeaderMap,
        body: &Bytes,
    ) -> Result<Delivery, Problem> {
        let webhook = route.webhook.as_ref().ok_or(Problem::Internal)?;
        let tenant = claimed_tenant(route, webhook, path);
        let (receivers, route, headers, body) =
            (self.clone(), route.clone(), headers.clone(), body.clone());
        let verified = tokio::task::spawn_blocking(move || {
            let _place = place;
            let webhook = route.webhook.as_ref().expect("a webhook route");
            let secrets = tenant
                .as_deref()
                .and_then(|tenant| receivers.files.secrets(webhook, tenant));
            let known = secrets.is_some();
            let secrets = secrets.unwrap_or_else(|| receivers.decoy.clone());
            let verified = idem_webhooks::verify(
                webhook.scheme,
                &secrets,
                &headers,
                &body,
                SystemTime::now(),
                webhook.tolerance,
            );
            match (verified, tenant) {
                (Ok(verified), Some(tenant)) if known => Ok((tenant, verified.key)),
                (Err(rejection), _) => Err(rejection),
                // Only a secret nobody has could have made it.
                _ => Err(Rejection::Invalid),
            }
        })
        .await
        .map_err(|_| Problem::Internal)?;
        let (tenant, key) = verified.map_err(rejected)?;
        let key = key.ok_or(Problem::KeyMissing)?;
        let key = IdempotencyKey::parse(key.as_bytes())
            .map_err(|e| Problem::KeyInvalid(idem_http::problem::KeyHeaderError::Invalid(e)))?;
        Ok(Delivery { tenant, key })
    }
}

/// The tenant a delivery to a webhook route is for, if the route's own or its path's
/// `{tenant}` can be one. Only its secrets prove it.
fn claimed_tenant(route: &Route, webhook: &Webhook, path: &str) -> Option<String> {
    let tenant = match &webhook.tenant {
        Some(tenant) => Some(tenant.as_str()),
        None => route.template.param(path, "tenant"),
    };
    tenant
        .filter(|t| idem_auth::valid_tenant(t))
        .map(str::to_owned)
}

/// A refused delivery, counted by its reason.
fn rejected(rejection: Rejection) -> Problem {
    counter!("idemgate_webhooks_rejected_total", "reason" => rejection.reason()).increment(1);
    Problem::WebhookSignatureInvalid {
        reason: rejection.reason(),
        explanation: rejection.explanation(),
    }
}

/// The secrets files of the webhook routes, each as last read for each scheme that
/// reads it.
#[derive(Debug)]
pub struct SecretFiles {
    files: Mutex<HashMap<(PathBuf, Scheme), Loaded>>,
    /// Secrets nobody has, that pad a file's up to [`MACS`].
    pad: Arc<Secrets>,
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
    /// Blocking: a `stat`, and a read when the file changed.
    fn secrets(&self, webhook: &Webhook, tenant: &str) -> Option<Arc<Secrets>> {
        let path = match &webhook.secrets {
            SecretSource::File(file) => file.clone(),
            // The tenant is one path segment already (no `/`, no dot segment).
            SecretSource::Dir(dir) => dir.join(tenant),
        };
        // No file, no secrets — and nothing remembered of it.
        let seen = seen(&path)?;
        let at = (path, webhook.scheme);
        let mut files = self.files.lock().expect("secret files");
        if let Some(loaded) = files.get(&at)
            && loaded.seen == seen
        {
            return loaded.secrets.clone();
        }
        let secrets = read(&at.0, webhook.scheme).map(|s| Arc::new(s.padded(&self.pad, MACS)));
        files.insert(
            at,
            Loaded {
                seen,
                secrets: secrets.clone(),
            },
        );
        secrets
    }
}

fn read(path: &Path, scheme: Scheme) -> Option<Secrets> {
    let parsed = std::fs::read_to_string(path)
        .map_err(|e| e.to_string())
        .and_then(|text| Secrets::parse(scheme, &text).map_err(|e| e.to_string()));
    match parsed {
        Ok(secrets) => {
            tracing::info!(file = %path.display(), %scheme, secrets = secrets.len(), "webhook secrets read");
            Some(secrets)
        }
        Err(error) => {
            tracing::warn!(file = %path.display(), %scheme, %error, "webhook secrets unusable: deliveries are refused");
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn webhook(scheme: Scheme, file: &Path) -> Webhook {
        Webhook {
            scheme,
            secrets: SecretSource::File(file.to_owned()),
            tenant: Some("acme".into()),
            tolerance: Duration::from_secs(300),
            max_body_bytes: 1024,
            body_read_timeout: Duration::from_secs(1),
            max_unverified: 1,
            settles_unknown: false,
        }
    }

    /// One file read by two schemes is parsed once for each: the parse that fails for
    /// one scheme never stands for the other's. (Kept by file alone, a Standard Webhooks
    /// read of a Stripe secret made the Stripe route refuse every genuine delivery.)
    #[test]
    fn a_file_is_parsed_once_per_scheme() {
        let dir = std::env::temp_dir().join(format!("idem-secrets-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("stripe");
        std::fs::write(&file, "whsec_not*base64*but-a-stripe-secret\n").unwrap();
        let files = Receivers::new(&RouteTable::default()).files;
        assert!(
            files
                .secrets(&webhook(Scheme::StandardWebhooks, &file), "acme")
                .is_none(),
            "not base64: no Standard Webhooks secret"
        );
        assert!(
            files
                .secrets(&webhook(Scheme::Stripe, &file), "acme")
                .is_some(),
            "still a Stripe secret"
        );
        std::fs::remove_dir_all(&dir).ok();
    }
}
