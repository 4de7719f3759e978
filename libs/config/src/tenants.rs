//! `[tenants.default]` and `[tenants.<id>]` (docs/tenants.md): a tenant's own policy and
//! quotas. `[tenants.default]` is every tenant without an entry of its own; a named
//! entry takes each key it does not set from `[tenants.default]`. A tenant's policy keys
//! win over the route's, which win over `[idempotency]` and `[server]`.
//!
//! | key | default | meaning |
//! | --- | --- | --- |
//! | `tenants.<id>.ttl`, `lease`, `wait_timeout` | the route's | the tenant's own policy, on every route (but a webhook route's ttl: providers redeliver for as long as it) |
//! | `tenants.<id>.max_body_bytes` | `server.max_body_bytes` | larger request bodies get 413 |
//! | `tenants.<id>.rate` | unlimited | `"500/s"` (also `/m`, `/h`, or a duration: `"50/100ms"`): a token bucket per tenant, per replica; over it, 429 `tenant-rate-limited` |
//! | `tenants.<id>.burst` | one second of `rate` (at least 1) | requests the bucket holds |
//! | `tenants.<id>.max_concurrent_requests` | unlimited | per tenant, per replica; over it, 429 `tenant-concurrency-limited` |
//! | `tenants.<id>.callback_url` | none | `http(s)://…`: where the settlement of a key whose client was not given its final answer is POSTed (docs/http-api.md, "Told when it settles") |
//! | `tenants.<id>.callback_secret_file` | none | a file of `whsec_` secrets (one a line; the callback is signed with each): required with `callback_url` |
//!
//! Quotas are per replica: `rate = "500/s"` on three replicas admits up to 1500/s.

use std::collections::BTreeMap;
use std::num::NonZeroU32;
use std::time::Duration;

use idem_core::policy::Policy;
use serde::Deserialize;

use crate::{ConfigError, Route, idempotency};

/// The name of the entry for every tenant without one of its own.
pub const DEFAULT: &str = "default";

/// One `[tenants.<id>]` entry: every key optional.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    #[serde(default, with = "humantime_serde")]
    pub ttl: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub lease: Option<Duration>,
    #[serde(default, with = "humantime_serde")]
    pub wait_timeout: Option<Duration>,
    pub max_body_bytes: Option<usize>,
    pub rate: Option<Rate>,
    pub burst: Option<u32>,
    pub max_concurrent_requests: Option<usize>,
    /// Where settlements are told (with `callback_secret_file`; taken from the default
    /// entry as a pair).
    pub callback_url: Option<String>,
    pub callback_secret_file: Option<std::path::PathBuf>,
}

impl TenantConfig {
    /// A route's policy for this tenant: the tenant's keys over the route's — except a
    /// webhook route's ttl, which is as long as its provider redelivers: a tenant's
    /// shorter one would execute a late redelivery again.
    pub fn policy(&self, route: &Route) -> Policy {
        let ttl = match route.webhook {
            Some(_) => route.policy.ttl,
            None => self.ttl.unwrap_or(route.policy.ttl),
        };
        Policy {
            ttl,
            lease: self.lease.unwrap_or(route.policy.lease),
            wait_timeout: self.wait_timeout.unwrap_or(route.policy.wait_timeout),
            ..route.policy.clone()
        }
    }

    /// Whether the tenant changes any route's policy.
    pub fn overrides_policy(&self) -> bool {
        self.ttl.is_some() || self.lease.is_some() || self.wait_timeout.is_some()
    }

    /// The bucket's size: `burst`, or one second of `rate` (at least 1).
    pub fn burst(&self) -> Option<NonZeroU32> {
        let rate = self.rate?;
        let burst = self
            .burst
            .unwrap_or_else(|| rate.per_second().ceil() as u32);
        Some(NonZeroU32::new(burst).unwrap_or(NonZeroU32::MIN))
    }

    /// Whether the tenant is told its keys' settlements.
    pub fn tells_settlements(&self) -> bool {
        self.callback_url.is_some()
    }

    /// Each key this entry does not set, from `default` (the callback's URL and secret as
    /// one: an entry setting either has its own pair).
    fn or(self, default: &TenantConfig) -> Self {
        let (callback_url, callback_secret_file) =
            if self.callback_url.is_some() || self.callback_secret_file.is_some() {
                (self.callback_url, self.callback_secret_file)
            } else {
                (
                    default.callback_url.clone(),
                    default.callback_secret_file.clone(),
                )
            };
        Self {
            callback_url,
            callback_secret_file,
            ttl: self.ttl.or(default.ttl),
            lease: self.lease.or(default.lease),
            wait_timeout: self.wait_timeout.or(default.wait_timeout),
            max_body_bytes: self.max_body_bytes.or(default.max_body_bytes),
            rate: self.rate.or(default.rate),
            burst: self.burst.or(default.burst),
            max_concurrent_requests: self
                .max_concurrent_requests
                .or(default.max_concurrent_requests),
        }
    }

    fn validate(&self, at: &str) -> Result<(), ConfigError> {
        ConfigError::first_zero([
            (
                format!("{at}.ttl").as_str(),
                self.ttl == Some(Duration::ZERO),
            ),
            (
                format!("{at}.lease").as_str(),
                self.lease == Some(Duration::ZERO),
            ),
            (
                format!("{at}.max_body_bytes").as_str(),
                self.max_body_bytes == Some(0),
            ),
            (format!("{at}.burst").as_str(), self.burst == Some(0)),
            (
                format!("{at}.max_concurrent_requests").as_str(),
                self.max_concurrent_requests == Some(0),
            ),
        ])?;
        match (&self.callback_url, &self.callback_secret_file) {
            (Some(url), Some(_)) => check_callback_url(&format!("{at}.callback_url"), url)?,
            (Some(_), None) => {
                return Err(ConfigError::new(
                    format!("{at}.callback_secret_file"),
                    "is required with `callback_url`: callbacks are always signed",
                ));
            }
            (None, Some(_)) => {
                return Err(ConfigError::new(
                    format!("{at}.callback_url"),
                    "is required with `callback_secret_file`",
                ));
            }
            (None, None) => {}
        }
        if self.burst.is_some() && self.rate.is_none() {
            return Err(ConfigError::new(
                format!("{at}.burst"),
                "is the size of the rate's bucket: set `rate` too",
            ));
        }
        Ok(())
    }
}

/// `[tenants]`: the default entry and the named ones (each already completed from the
/// default).
#[derive(Debug, Clone, Default)]
pub struct Tenants {
    default: TenantConfig,
    named: BTreeMap<String, TenantConfig>,
}

impl Tenants {
    /// `tenant`'s entry, or the default's.
    pub fn get(&self, tenant: &str) -> &TenantConfig {
        self.named.get(tenant).unwrap_or(&self.default)
    }

    /// Whether `tenant` has an entry of its own (metrics name only those).
    pub fn is_named(&self, tenant: &str) -> bool {
        self.named.contains_key(tenant)
    }

    pub fn default_entry(&self) -> &TenantConfig {
        &self.default
    }

    /// The named entries, by tenant id.
    pub fn named(&self) -> impl Iterator<Item = (&str, &TenantConfig)> {
        self.named.iter().map(|(id, entry)| (id.as_str(), entry))
    }

    /// Every entry with the key it is configured under (`tenants.default` first).
    pub fn entries(&self) -> impl Iterator<Item = (String, &TenantConfig)> {
        std::iter::once((format!("tenants.{DEFAULT}"), &self.default)).chain(
            self.named
                .iter()
                .map(|(id, entry)| (format!("tenants.{}", key_name(id)), entry)),
        )
    }

    pub(crate) fn from_raw(mut raw: BTreeMap<String, TenantConfig>) -> Result<Self, ConfigError> {
        let default = raw.remove(DEFAULT).unwrap_or_default();
        default.validate(&format!("tenants.{DEFAULT}"))?;
        let mut named = BTreeMap::new();
        for (id, entry) in raw {
            let at = format!("tenants.{}", key_name(&id));
            if id.is_empty() || id.len() > 255 {
                return Err(ConfigError::new(
                    at,
                    "a tenant id is 1 to 255 characters, as in the token's tenant claim",
                ));
            }
            entry.validate(&at)?;
            named.insert(id, entry.or(&default));
        }
        Ok(Self { default, named })
    }
}

/// The rules of every route's policy as each tenant sees it (the lease rule of
/// docs/configuration.md among them), for the default entry and every named one.
pub(crate) fn check_routes(
    tenants: &Tenants,
    routes: &[Route],
    ledger_op: Duration,
) -> Result<(), ConfigError> {
    for (at, entry) in tenants.entries() {
        if !entry.overrides_policy() {
            continue;
        }
        for (i, route) in routes.iter().enumerate().filter(|(_, r)| r.idempotent) {
            let policy = entry.policy(route);
            idempotency::check(&at, &policy, route.mismatch_status).map_err(|e| {
                ConfigError::new(
                    e.key,
                    format!("{} on routes[{i}] ({})", e.message, route.endpoint),
                )
            })?;
            if route.timeout + ledger_op >= policy.lease {
                return Err(ConfigError::new(
                    format!("{at}.lease"),
                    format!(
                        "{} must be longer than routes[{i}] ({})'s timeout ({}) plus the ledger's op timeout (postgres.acquire_timeout + postgres.statement_timeout = {}), or the reconciler could act while the first attempt is still in flight or still recording its result",
                        humantime::format_duration(policy.lease),
                        route.endpoint,
                        humantime::format_duration(route.timeout),
                        humantime::format_duration(ledger_op),
                    ),
                ));
            }
        }
    }
    Ok(())
}

/// A callback URL: absolute `http://` or `https://`, with a host, no credentials in it.
fn check_callback_url(at: &str, url: &str) -> Result<(), ConfigError> {
    let invalid = |why: &str| ConfigError::new(at, format!("{url:?} {why}"));
    let uri: http::Uri = url.parse().map_err(|_| invalid("is not a URL"))?;
    match uri.scheme_str() {
        Some("http" | "https") => {}
        _ => return Err(invalid("is not an http:// or https:// URL")),
    }
    let Some(authority) = uri.authority() else {
        return Err(invalid("has no host"));
    };
    if authority.as_str().contains('@') {
        return Err(invalid(
            "holds credentials: sign with `callback_secret_file` instead",
        ));
    }
    Ok(())
}

/// A tenant id as a TOML key: bare if it can be, else quoted.
fn key_name(id: &str) -> String {
    let bare = !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    if bare {
        id.to_owned()
    } else {
        format!("{id:?}")
    }
}

/// A request rate: `count` requests per `per`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Rate {
    pub count: NonZeroU32,
    pub per: Duration,
}

impl Rate {
    pub fn per_second(&self) -> f64 {
        f64::from(self.count.get()) / self.per.as_secs_f64()
    }

    /// The time the bucket takes to gain one request.
    pub fn interval(&self) -> Duration {
        self.per / self.count.get()
    }
}

/// Why a `rate` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("expected \"N/s\", \"N/m\", \"N/h\" or \"N/<duration>\" with N > 0, found {0:?}")]
pub struct RateError(String);

impl TryFrom<String> for Rate {
    type Error = RateError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        let parsed = s.split_once('/').and_then(|(count, per)| {
            let count = count.trim().parse::<NonZeroU32>().ok()?;
            let per = match per.trim() {
                "s" => Duration::from_secs(1),
                "m" => Duration::from_secs(60),
                "h" => Duration::from_secs(3600),
                other => humantime::parse_duration(other).ok()?,
            };
            // At most one request per nanosecond: the bucket counts in nanoseconds.
            (per >= Duration::from_nanos(u64::from(count.get()))).then_some(Rate { count, per })
        });
        parsed.ok_or(RateError(s))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rate(s: &str) -> Result<Rate, RateError> {
        Rate::try_from(s.to_owned())
    }

    #[test]
    fn rates_are_counts_per_unit_or_per_duration() {
        assert_eq!(rate("500/s").unwrap().interval(), Duration::from_millis(2));
        assert_eq!(rate("60/m").unwrap().interval(), Duration::from_secs(1));
        assert_eq!(rate("10/h").unwrap().interval(), Duration::from_secs(360));
        assert_eq!(
            rate("50/100ms").unwrap().interval(),
            Duration::from_millis(2)
        );
        for bad in ["", "500", "0/s", "-1/s", "1/x", "/s", "1/0s", "ten/s"] {
            assert!(rate(bad).is_err(), "{bad:?} was accepted");
        }
    }

    #[test]
    fn the_burst_is_one_second_of_the_rate_unless_set() {
        let entry = |rate: &str, burst| TenantConfig {
            rate: Some(super::Rate::try_from(rate.to_owned()).unwrap()),
            burst,
            ..TenantConfig::default()
        };
        assert_eq!(entry("500/s", None).burst().unwrap().get(), 500);
        assert_eq!(entry("10/m", None).burst().unwrap().get(), 1);
        assert_eq!(entry("500/s", Some(20)).burst().unwrap().get(), 20);
        assert_eq!(TenantConfig::default().burst(), None);
    }

    #[test]
    fn a_callback_is_an_http_url_with_its_secret() {
        let entry = |url: Option<&str>, file: Option<&str>| TenantConfig {
            callback_url: url.map(str::to_owned),
            callback_secret_file: file.map(Into::into),
            ..TenantConfig::default()
        };
        let key = |e: TenantConfig| e.validate("tenants.acme").err().map(|e| e.key);
        assert_eq!(
            key(entry(Some("https://hooks.example/idem"), Some("/s"))),
            None
        );
        assert_eq!(key(entry(Some("http://127.0.0.1:9/cb"), Some("/s"))), None);
        for bad in ["ftp://x/", "/relative", "https://user:pw@x/", "not a url"] {
            assert_eq!(
                key(entry(Some(bad), Some("/s"))).as_deref(),
                Some("tenants.acme.callback_url"),
                "{bad:?}"
            );
        }
        assert_eq!(
            key(entry(Some("https://x/"), None)).as_deref(),
            Some("tenants.acme.callback_secret_file")
        );
        assert_eq!(
            key(entry(None, Some("/s"))).as_deref(),
            Some("tenants.acme.callback_url")
        );
    }

    #[test]
    fn a_named_entry_takes_what_it_does_not_set_from_the_default() {
        let mut raw = BTreeMap::new();
        raw.insert(
            DEFAULT.to_owned(),
            TenantConfig {
                rate: Some(rate("100/s").unwrap()),
                max_concurrent_requests: Some(8),
                ..TenantConfig::default()
            },
        );
        raw.insert(
            "acme".to_owned(),
            TenantConfig {
                ttl: Some(Duration::from_secs(7200)),
                max_concurrent_requests: Some(64),
                ..TenantConfig::default()
            },
        );
        let tenants = Tenants::from_raw(raw).unwrap();
        let acme = tenants.get("acme");
        assert_eq!(acme.ttl, Some(Duration::from_secs(7200)));
        assert_eq!(acme.rate, Some(rate("100/s").unwrap()));
        assert_eq!(acme.max_concurrent_requests, Some(64));
        assert_eq!(tenants.get("globex"), tenants.default_entry());
        assert!(tenants.is_named("acme") && !tenants.is_named("globex"));
    }
}
