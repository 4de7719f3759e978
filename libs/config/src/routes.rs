//! `[[routes]]`: what is proxied where, and under which idempotency policy; and matching
//! a request to its route. A route's `ttl`, `lease`, `on_in_progress`, `wait_timeout` and
//! `mismatch_status` override `[idempotency]`.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `method`, `path`, `upstream` | (required) | `"POST"`, `"/orders/{id}/refunds"`, `"http://host:port[/prefix]"` |
//! | `idempotent` | `false` | run requests through the ledger |
//! | `key_required` | `true` | `false`: key-less requests pass unprotected (gradual roll-out) |
//! | `timeout` | `10s` | upstream deadline; past it the outcome is unknown (504) |
//! | `release_on` | `[408, 425, 429]` | upstream statuses that release the key |
//! | `store_set_cookie` | `false` | store and replay `Set-Cookie` |
//! | `probe` | (none) | `"GET /payments/by-key/{key}"`: the reconciler's status probe |
//! | `probe_status` | (the probe's) | `201`: the status stored when the probe finds the operation (what the first client would have seen) |
//! | `on_unknown` | `"hold"` | or `"release-after:10m"`: what the reconciler does without a probe |
//! | `max_response_bytes` | `10485760` | larger responses are not stored; retries get 410 |
//! | `webhook` | – | `[routes.webhook]`: a provider's webhook endpoint ([`crate::webhook`]) |

use std::sync::Arc;
use std::time::Duration;

use http::Method;
use idem_core::policy::{OnInProgress, Policy, StatusSet};
use idem_core::reconcile::OnUnknown;
use serde::Deserialize;

use crate::template::PathTemplate;
use crate::upstream::Upstream;
use crate::webhook::{
    RawWebhook, SecretSource, WEBHOOK_TTL, Webhook, shared_file, webhook_release_statuses,
};
use crate::{ConfigError, IdempotencyConfig, idempotency};

/// Where idemgate's own API lives: no route may be configured under it.
pub const RESERVED: &str = "/_idemgate/";

/// One configured route.
#[derive(Debug, Clone)]
pub struct Route {
    /// `"POST /orders/{id}/refunds"`: the method and template, the scope's endpoint.
    pub endpoint: String,
    pub method: Method,
    pub template: PathTemplate,
    pub upstream: Upstream,
    pub idempotent: bool,
    pub key_required: bool,
    pub timeout: Duration,
    /// Response bodies up to this size are stored; larger ones are recorded without it.
    pub max_response_bytes: usize,
    /// What the engine decides by.
    pub policy: Policy,
    /// The status of a key reused with a different request (409 or 422): HTTP, so the
    /// edge's, not the engine's.
    pub mismatch_status: u16,
    /// Whether `Set-Cookie` is stored and replayed.
    pub store_set_cookie: bool,
    pub probe: Option<Probe>,
    /// The status stored for an operation the probe found; `None`: the probe's own.
    pub probe_status: Option<u16>,
    pub on_unknown: OnUnknown,
    /// A provider's webhook endpoint: see [`Webhook`].
    pub webhook: Option<Webhook>,
}

/// What a route is, as a request meets it.
#[derive(Debug, Clone, Copy)]
pub enum RouteKind<'a> {
    /// Proxied as it is: no key, nothing stored.
    Proxy,
    /// A client's request, its tenant proved by a token, its key in `Idempotency-Key`.
    Keyed,
    /// A provider's delivery, proved by its signature once its body is read.
    Webhook(&'a Webhook),
}

impl Route {
    pub fn kind(&self) -> RouteKind<'_> {
        match (&self.webhook, self.idempotent) {
            (Some(webhook), _) => RouteKind::Webhook(webhook),
            (None, true) => RouteKind::Keyed,
            (None, false) => RouteKind::Proxy,
        }
    }
}

/// A status probe: `GET /payments/by-key/{key}`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Probe {
    pub method: Method,
    pub path: String,
}

/// Why a `routes[].probe` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected \"METHOD /path/{{key}}\", found {0:?}")]
pub struct ProbeError(String);

impl TryFrom<String> for Probe {
    type Error = ProbeError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        let parsed = s.split_once(' ').and_then(|(method, path)| {
            let method = Method::from_bytes(method.as_bytes()).ok()?;
            (path.starts_with('/') && path.contains("{key}")).then(|| Probe {
                method,
                path: path.to_owned(),
            })
        });
        parsed.ok_or(ProbeError(s))
    }
}

/// All routes, matched in configuration order. Each is shared: a request holds its
/// route for as long as it runs.
#[derive(Debug, Clone, Default)]
pub struct RouteTable {
    routes: Vec<Arc<Route>>,
}

impl RouteTable {
    pub fn new(routes: Vec<Route>) -> Self {
        Self {
            routes: routes.into_iter().map(Arc::new).collect(),
        }
    }

    pub fn routes(&self) -> &[Arc<Route>] {
        &self.routes
    }

    /// The route for a method and concrete path, if any. Nothing under [`RESERVED`]
    /// is a route's, whatever its template could match (`/{tenant}/events` would match
    /// `/_idemgate/events`): those paths are idemgate's own.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Arc<Route>> {
        if path.starts_with(RESERVED) {
            return None;
        }
        self.routes
            .iter()
            .find(|r| r.method == *method && r.template.matches(path))
    }

    /// The route whose endpoint is `endpoint` (as stored in the ledger).
    pub fn by_endpoint(&self, endpoint: &str) -> Option<&Route> {
        self.routes
            .iter()
            .map(AsRef::as_ref)
            .find(|r| r.endpoint == endpoint)
    }

    /// The idempotent route that would take over requests stored under `stored` with a
    /// different spelling: the same method and path shape, another endpoint name (a path
    /// parameter renamed, `{id}` → `{order_id}`). Keys are scoped by the endpoint's
    /// spelling, so serving such a route would forget every key stored under the old
    /// one and execute its retries again.
    pub fn renaming(&self, stored: &str) -> Option<&Route> {
        let (method, path) = stored.split_once(' ')?;
        let template = PathTemplate::parse(path).ok()?;
        self.routes.iter().map(AsRef::as_ref).find(|r| {
            r.idempotent
                && r.endpoint != stored
                && r.method.as_str() == method
                && r.template.same_shape(&template)
        })
    }

    /// Every webhook route's secrets, readable and of its scheme ([`Webhook::check_secrets`]),
    /// and no file read by two schemes: a Stripe route's file in a `{tenant}` Standard
    /// Webhooks route's directory would be parsed as both, and whichever parse came first
    /// would refuse the other route's genuine deliveries.
    pub fn check_webhook_secrets(&self) -> Result<(), ConfigError> {
        let webhooks: Vec<(usize, &Route, &Webhook)> = self
            .routes
            .iter()
            .enumerate()
            .filter_map(|(n, r)| r.webhook.as_ref().map(|w| (n, r.as_ref(), w)))
            .collect();
        for (n, _, webhook) in &webhooks {
            webhook.check_secrets(&format!("routes[{n}]"))?;
        }
        for (i, (m, earlier, a)) in webhooks.iter().enumerate() {
            for (n, _, b) in &webhooks[i + 1..] {
                if a.scheme == b.scheme {
                    continue;
                }
                if let Some(shared) = shared_file(&a.secrets, &b.secrets) {
                    let key = match b.secrets {
                        SecretSource::File(_) => "secret_file",
                        SecretSource::Dir(_) => "secret_dir",
                    };
                    return Err(ConfigError::new(
                        format!("routes[{n}].webhook.{key}"),
                        format!(
                            "{} would be read as {} secrets here and as {} secrets by routes[{m}] ({}): \
                             one file, one scheme — give each route a file (or directory) of its own",
                            shared.display(),
                            b.scheme,
                            a.scheme,
                            earlier.endpoint
                        ),
                    ));
                }
            }
        }
        Ok(())
    }

    /// What `check-config` and the gateway warn of: webhook routes that keep events
    /// for less than providers redeliver, or hold a receiver's timeouts with nothing to
    /// settle them.
    pub fn warnings(&self) -> Vec<String> {
        let mut warnings = Vec::new();
        for route in &self.routes {
            let Some(webhook) = &route.webhook else {
                continue;
            };
            if route.policy.ttl < WEBHOOK_TTL {
                warnings.push(format!(
                    "{}: a webhook route's ttl of {} is shorter than the 72h providers go on redelivering: a redelivery after it executes again",
                    route.endpoint,
                    humantime::format_duration(route.policy.ttl)
                ));
            }
            if !webhook.settles_unknown {
                warnings.push(format!(
                    "{}: a webhook route with neither `probe` nor `on_unknown`: a receiver that times out holds its event until an operator resolves the key, and every redelivery meanwhile is 409",
                    route.endpoint
                ));
            }
        }
        warnings
    }

    /// Every stored endpoint a route renames, as a refusal naming both spellings.
    pub fn check_renames<'a>(
        &self,
        stored: impl IntoIterator<Item = &'a str>,
    ) -> Result<(), String> {
        let clashes: Vec<String> = stored
            .into_iter()
            .filter_map(|old| {
                self.renaming(old)
                    .map(|route| format!("{:?} (stored) is now {:?}", old, route.endpoint))
            })
            .collect();
        if clashes.is_empty() {
            return Ok(());
        }
        Err(format!(
            "the ledger holds keys under an endpoint a route now spells differently: {}. \
             Keys are scoped by the endpoint as written, so retries of those keys would \
             execute again. Keep the old spelling until its keys have expired and been purged.",
            clashes.join("; ")
        ))
    }
}

/// One `[[routes]]` entry as written.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct RawRoute {
    method: String,
    path: PathTemplate,
    upstream: Upstream,
    #[serde(default)]
    idempotent: bool,
    #[serde(default = "default_timeout", with = "humantime_serde")]
    timeout: Duration,
    #[serde(default, with = "humantime_serde")]
    ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    lease: Option<Duration>,
    on_in_progress: Option<OnInProgress>,
    #[serde(default, with = "humantime_serde")]
    wait_timeout: Option<Duration>,
    mismatch_status: Option<u16>,
    #[serde(default = "yes")]
    key_required: bool,
    release_on: Option<StatusSet>,
    #[serde(default)]
    store_set_cookie: bool,
    probe: Option<Probe>,
    probe_status: Option<u16>,
    on_unknown: Option<OnUnknown>,
    #[serde(default = "default_max_response_bytes")]
    max_response_bytes: usize,
    webhook: Option<RawWebhook>,
}

fn default_timeout() -> Duration {
    Duration::from_secs(10)
}
fn default_max_response_bytes() -> usize {
    10 * 1024 * 1024
}
fn yes() -> bool {
    true
}

impl RawRoute {
    /// `ledger_op` is the longest one ledger call may take (a pooled connection, then
    /// the statement): a completion sent at the upstream deadline must land within it.
    pub(crate) fn validate(
        self,
        at: &str,
        defaults: &IdempotencyConfig,
        ledger_op: Duration,
    ) -> Result<Route, ConfigError> {
        let method = Method::from_bytes(self.method.as_bytes())
            .ok()
            .filter(|m| m.as_str().bytes().all(|b| b.is_ascii_uppercase()))
            .ok_or_else(|| {
                ConfigError::new(
                    format!("{at}.method"),
                    "must be an upper-case HTTP method like \"POST\"",
                )
            })?;
        if self.path.as_str().starts_with(RESERVED) {
            return Err(ConfigError::new(
                format!("{at}.path"),
                format!("paths under {RESERVED} are idemgate's own (the key lookup API)"),
            ));
        }
        ConfigError::first_zero([
            (format!("{at}.timeout").as_str(), self.timeout.is_zero()),
            (
                format!("{at}.max_response_bytes").as_str(),
                self.max_response_bytes == 0,
            ),
        ])?;
        match (self.probe_status, &self.probe) {
            (Some(_), None) => {
                return Err(ConfigError::new(
                    format!("{at}.probe_status"),
                    "is the status stored when the probe finds the operation: set `probe` too",
                ));
            }
            (Some(status), Some(_)) if !(200..=299).contains(&status) => {
                return Err(ConfigError::new(
                    format!("{at}.probe_status"),
                    "must be a 2xx status (what the first client would have seen on success)",
                ));
            }
            _ => {}
        }
        let settles_unknown = self.probe.is_some() || self.on_unknown.is_some();
        let webhook = self
            .webhook
            .map(|w| w.validate(at, &self.path, self.idempotent, settles_unknown))
            .transpose()?;
        let base = defaults.policy();
        // A provider redelivers for days and takes a receiver's 5xx as "try again".
        let (default_ttl, default_release) = if webhook.is_some() {
            (WEBHOOK_TTL, webhook_release_statuses())
        } else {
            (base.ttl, base.release_on)
        };
        let policy = Policy {
            ttl: self.ttl.unwrap_or(default_ttl),
            lease: self.lease.unwrap_or(base.lease),
            on_in_progress: self.on_in_progress.unwrap_or(base.on_in_progress),
            wait_timeout: self.wait_timeout.unwrap_or(base.wait_timeout),
            release_on: self.release_on.unwrap_or(default_release),
            probe: self.probe.is_some(),
        };
        let mismatch_status = self.mismatch_status.unwrap_or(defaults.mismatch_status);
        idempotency::check(at, &policy, mismatch_status)?;
        if let Some(webhook) = &webhook
            && webhook.tolerance >= policy.ttl
        {
            // A delivery signed long enough ago to outlive its key could be replayed by
            // whoever captured it, and would execute again.
            return Err(ConfigError::new(
                format!("{at}.webhook.tolerance"),
                format!(
                    "{} must be shorter than the route's ttl ({}): a captured delivery replayed after its key expired would still verify, and execute again",
                    humantime::format_duration(webhook.tolerance),
                    humantime::format_duration(policy.ttl)
                ),
            ));
        }
        if self.idempotent && self.timeout + ledger_op >= policy.lease {
            return Err(ConfigError::new(
                format!("{at}.timeout"),
                format!(
                    "{} plus the ledger's op timeout (postgres.acquire_timeout + postgres.statement_timeout = {}) must be shorter than the lease ({}), or the reconciler could act while the first attempt is still in flight or still recording its result",
                    humantime::format_duration(self.timeout),
                    humantime::format_duration(ledger_op),
                    humantime::format_duration(policy.lease)
                ),
            ));
        }
        Ok(Route {
            endpoint: format!("{} {}", method, self.path.as_str()),
            method,
            template: self.path,
            upstream: self.upstream,
            idempotent: self.idempotent,
            key_required: self.key_required,
            timeout: self.timeout,
            max_response_bytes: self.max_response_bytes,
            policy,
            mismatch_status,
            store_set_cookie: self.store_set_cookie,
            probe: self.probe,
            probe_status: self.probe_status,
            on_unknown: self.on_unknown.unwrap_or_default(),
            webhook,
        })
    }
}
