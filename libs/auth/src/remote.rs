//! Signing keys fetched from an identity provider: OpenID Connect discovery or a JWKS
//! URL, over HTTPS, refreshed in the background and refetched (once, for everyone) when
//! a token names a key the set does not have.
//!
//! The set in use only ever changes to another good set: a failed fetch keeps the last
//! good keys (and is counted). Every change bumps [`KeysNow::generation`], which the
//! verified-token memory is tagged with, so no token outlives the key that signed it.
//!
//! # Why one file of ~420 lines
//! Discovery, the fetch, the background refresh and the refetch on an unknown key id
//! share one rule (the set changes only to another good set, and one fetch at a time
//! serves everyone waiting); split apart, each part would have to restate it.

use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, RwLock};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http::{HeaderMap, Request, StatusCode, Uri, header};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_rustls::HttpsConnector;
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::Deserialize;
use tokio::time::Instant;

use idem_core::error_chain;
use idem_core::headers::max_age;

use crate::keys::{self, KeySourceError};
use crate::{Checks, KeySet};

/// The longest JWKS or discovery document read.
const MAX_DOCUMENT_BYTES: usize = 512 * 1024;
/// How long one fetch may take, connection included.
const FETCH_TIMEOUT: Duration = Duration::from_secs(5);
/// The first retry after a failed fetch at start-up; it doubles up to the refresh interval.
const FIRST_RETRY: Duration = Duration::from_millis(500);

/// Where the keys come from.
#[derive(Debug, Clone)]
pub(crate) enum Source {
    /// `{issuer}/.well-known/openid-configuration` names the JWKS.
    Discovery { issuer: String },
    /// The JWKS itself.
    Jwks { url: String },
}

/// The keys in use, and which generation of them.
pub(crate) struct KeysNow {
    pub set: KeySet,
    pub generation: u64,
    /// Each key's `kid` and JSON, sorted: two fetches of the same set compare equal.
    identity: Vec<(String, String)>,
}

/// What the gateway shows of the fetched keys (`/metrics`, `/readyz`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RemoteStats {
    /// Keys in the set in use (0 until the first fetch succeeds).
    pub keys: u64,
    /// Fetches attempted (discovery and JWKS count as one).
    pub fetches: u64,
    /// Fetches that failed; the last good keys stayed in use.
    pub refresh_errors: u64,
    /// When a fetch last succeeded (Unix seconds; 0: never).
    pub last_success_unix: u64,
}

pub(crate) struct RemoteKeys {
    source: Source,
    http: Client<HttpsConnector<HttpConnector>, Empty<Bytes>>,
    checks: Checks,
    refresh: Duration,
    min_refetch: Duration,
    now: RwLock<Option<Arc<KeysNow>>>,
    /// The generation of `now` (0: none yet), readable without a lock.
    generation: AtomicU64,
    /// The JWKS URL discovery found (refound after a failure).
    jwks_uri: Mutex<Option<String>>,
    /// When the last fetch started: refetches for unknown kids wait this long apart.
    last_fetch: Mutex<Option<Instant>>,
    /// Held for the length of a fetch: concurrent refetches share one.
    flight: tokio::sync::Mutex<()>,
    /// Fetches finished (well or not): a refetch that waited sees whether one ran.
    completed: AtomicU64,
    fetches: AtomicU64,
    errors: AtomicU64,
    last_success: AtomicU64,
}

/// Why a fetch failed. Logged and counted; the last good keys stay in use.
#[derive(Debug, thiserror::Error)]
pub(crate) enum FetchError {
    #[error("GET {url}: {why}")]
    Http { url: String, why: String },
    #[error("{url}: {why}")]
    Document { url: String, why: String },
}

impl RemoteKeys {
    pub fn new(
        source: Source,
        connector: HttpsConnector<HttpConnector>,
        checks: Checks,
        refresh: Duration,
        min_refetch: Duration,
    ) -> Self {
        Self {
            source,
            // Fetches are minutes apart: a kept-alive connection would mostly meet the
            // server's idle close when reused.
            http: Client::builder(TokioExecutor::new())
                .pool_max_idle_per_host(0)
                .build(connector),
            checks,
            refresh,
            min_refetch,
            now: RwLock::new(None),
            generation: AtomicU64::new(0),
            jwks_uri: Mutex::new(None),
            last_fetch: Mutex::new(None),
            flight: tokio::sync::Mutex::new(()),
            completed: AtomicU64::new(0),
            fetches: AtomicU64::new(0),
            errors: AtomicU64::new(0),
            last_success: AtomicU64::new(0),
        }
    }

    pub fn now(&self) -> Option<Arc<KeysNow>> {
        self.now.read().expect("keys lock").clone()
    }

    /// The generation of the keys in use (0: none yet), without taking a lock: a
    /// remembered token is checked against it alone.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    pub fn stats(&self) -> RemoteStats {
        RemoteStats {
            keys: self.now().map_or(0, |now| now.set.len() as u64),
            fetches: self.fetches.load(Ordering::Relaxed),
            refresh_errors: self.errors.load(Ordering::Relaxed),
            last_success_unix: self.last_success.load(Ordering::Relaxed),
        }
    }

    /// For a token whose key is not in the set: fetches again, unless a fetch started
    /// less than `min_refetch` ago. Callers that arrive during a fetch wait for it and
    /// share its result, so a flood of unknown kids costs one fetch per interval. The
    /// fetch runs in a task of its own: a caller that goes away (a client that hung up)
    /// cannot cancel it halfway and leave the interval spent for nothing.
    pub async fn refetch(self: &Arc<Self>) {
        let seen = self.completed.load(Ordering::Acquire);
        let keys = self.clone();
        let shared = tokio::spawn(async move {
            let _flight = keys.flight.lock().await;
            if keys.completed.load(Ordering::Acquire) != seen {
                return; // a fetch finished while we waited: its answer is ours
            }
            let last = *keys.last_fetch.lock().expect("fetch lock");
            if last.is_some_and(|last| last.elapsed() < keys.min_refetch) {
                return; // one ran a moment ago
            }
            if let Err(e) = keys.fetch().await {
                tracing::warn!(error = %e, "refetching the identity provider's keys failed");
            }
        });
        let _ = shared.await;
    }

    /// The background task: the first fetch (retried until it succeeds), then a refresh
    /// every `refresh`, or sooner when the provider's `Cache-Control: max-age` says so,
    /// never more often than `min_refetch`.
    ///
    /// A failed fetch is retried: before the first success after 0.5 s, doubling up to
    /// `min_refetch` (the gateway is not ready meanwhile); afterwards every
    /// `min_refetch`, the last good keys serving meanwhile.
    pub async fn run(self: Arc<Self>) {
        let mut retry = FIRST_RETRY;
        loop {
            let wait = {
                let _flight = self.flight.lock().await;
                match self.fetch().await {
                    Ok(max_age) => {
                        retry = FIRST_RETRY;
                        max_age
                            .map_or(self.refresh, |age| age.min(self.refresh))
                            .max(self.min_refetch)
                    }
                    Err(e) if self.now().is_some() => {
                        tracing::warn!(error = %e, "refreshing the identity provider's keys failed; the last good keys stay in use");
                        self.min_refetch
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "fetching the identity provider's keys failed; not ready until it succeeds");
                        let wait = retry.min(self.min_refetch);
                        retry = (retry * 2).min(self.min_refetch);
                        wait
                    }
                }
            };
            tokio::time::sleep(wait).await;
        }
    }

    /// One fetch (discovery if needed, then the JWKS): the new set goes into use if
    /// it holds a usable key. Returns the JWKS's `max-age`, if it gave one.
    async fn fetch(&self) -> Result<Option<Duration>, FetchError> {
        *self.last_fetch.lock().expect("fetch lock") = Some(Instant::now());
        self.fetches.fetch_add(1, Ordering::Relaxed);
        // One deadline for discovery and the JWKS together.
        let result = tokio::time::timeout(FETCH_TIMEOUT, self.fetch_set())
            .await
            .unwrap_or_else(|_| {
                Err(FetchError::Http {
                    url: self.describe(),
                    why: format!("no answer within {FETCH_TIMEOUT:?}"),
                })
            });
        self.completed.fetch_add(1, Ordering::AcqRel);
        match &result {
            Ok(_) => {
                let unix = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .unwrap_or_default();
                self.last_success.store(unix.as_secs(), Ordering::Relaxed);
            }
            Err(_) => {
                self.errors.fetch_add(1, Ordering::Relaxed);
                // A provider that moved its JWKS is found again by the next discovery.
                *self.jwks_uri.lock().expect("uri lock") = None;
            }
        }
        result
    }

    async fn fetch_set(&self) -> Result<Option<Duration>, FetchError> {
        let url = self.jwks_url().await?;
        let (headers, body) = self.get(&url).await?;
        let found = keys::fetched_jwks(&body, &url).map_err(|e| FetchError::Document {
            url: url.clone(),
            why: e.to_string(),
        })?;
        let mut identity: Vec<(String, String)> = found
            .iter()
            .map(|k| (k.kid.clone(), k.json.clone()))
            .collect();
        identity.sort();
        let current = self.now();
        if current.as_ref().is_none_or(|now| now.identity != identity) {
            let generation = current.as_ref().map_or(1, |now| now.generation + 1);
            let set = self
                .checks
                .key_set(found.into_iter().map(|k| (k.kid, k.key, k.alg)));
            tracing::info!(
                url,
                keys = identity.len(),
                kids = ?identity.iter().map(|(kid, _)| kid.as_str()).collect::<Vec<_>>(),
                "the identity provider's keys changed"
            );
            *self.now.write().expect("keys lock") = Some(Arc::new(KeysNow {
                set,
                generation,
                identity,
            }));
            self.generation.store(generation, Ordering::Release);
        }
        Ok(max_age(&headers))
    }

    /// The JWKS URL: configured, or found by discovery (whose `issuer` must be ours).
    async fn jwks_url(&self) -> Result<String, FetchError> {
        let issuer = match &self.source {
            Source::Jwks { url } => return Ok(url.clone()),
            Source::Discovery { issuer } => issuer,
        };
        if let Some(url) = self.jwks_uri.lock().expect("uri lock").clone() {
            return Ok(url);
        }
        let url = format!(
            "{}/.well-known/openid-configuration",
            issuer.trim_end_matches('/')
        );
        let (_, body) = self.get(&url).await?;
        #[derive(Deserialize)]
        struct Discovery {
            issuer: String,
            jwks_uri: String,
        }
        let document = |why: String| FetchError::Document {
            url: url.clone(),
            why,
        };
        let found: Discovery = serde_json::from_slice(&body)
            .map_err(|e| document(format!("not an OpenID provider configuration: {e}")))?;
        if found.issuer != *issuer {
            return Err(document(format!(
                "names issuer {:?}, not the configured {issuer:?}",
                found.issuer
            )));
        }
        check_url("jwks_uri", &found.jwks_uri).map_err(|e| document(e.to_string()))?;
        *self.jwks_uri.lock().expect("uri lock") = Some(found.jwks_uri.clone());
        Ok(found.jwks_uri)
    }

    /// Where the keys come from, for messages.
    fn describe(&self) -> String {
        match &self.source {
            Source::Discovery { issuer } => issuer.clone(),
            Source::Jwks { url } => url.clone(),
        }
    }

    /// GET with a size cap (the caller bounds the time).
    async fn get(&self, url: &str) -> Result<(HeaderMap, Bytes), FetchError> {
        let failed = |why: String| FetchError::Http {
            url: url.to_owned(),
            why,
        };
        let uri: Uri = url.parse().map_err(|e| failed(format!("{e}")))?;
        let request = Request::get(uri)
            .header(header::ACCEPT, "application/json")
            .header(header::USER_AGENT, "idemgate")
            .body(Empty::new())
            .map_err(|e| failed(e.to_string()))?;
        let exchange = async {
            let response = self
                .http
                .request(request)
                .await
                .map_err(|e| failed(error_chain(&e)))?;
            let (parts, body) = response.into_parts();
            if parts.status != StatusCode::OK {
                return Err(failed(format!("answered {}", parts.status)));
            }
            let body = Limited::new(body, MAX_DOCUMENT_BYTES)
                .collect()
                .await
                .map_err(|e| failed(format!("reading the body: {e}")))?;
            Ok((parts.headers, body.to_bytes()))
        };
        exchange.await
    }
}

/// The HTTPS client's connector for fetching a provider's keys (and for the gateway's
/// settlement callbacks): rustls (ring) with the Mozilla roots, plus `ca_file`'s
/// certificates for a private CA. Plain `http://` is connectable too; the URL rules are
/// the caller's to check before.
pub fn https_connector(
    ca_file: Option<&Path>,
) -> Result<HttpsConnector<HttpConnector>, KeySourceError> {
    use rustls::pki_types::CertificateDer;
    use rustls::pki_types::pem::PemObject;
    let invalid = |reason: String| KeySourceError::Invalid {
        key: "auth.ca_file",
        reason,
    };
    let mut roots = rustls::RootCertStore::empty();
    roots.extend(webpki_roots::TLS_SERVER_ROOTS.iter().cloned());
    if let Some(path) = ca_file {
        let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(path)
            .map_err(|e| invalid(format!("cannot read {}: {e}", path.display())))?
            .collect::<Result<_, _>>()
            .map_err(|e| invalid(format!("{} is not PEM: {e}", path.display())))?;
        if certs.is_empty() {
            return Err(invalid(format!("{} holds no certificates", path.display())));
        }
        for cert in certs {
            roots
                .add(cert)
                .map_err(|e| invalid(format!("{}: {e}", path.display())))?;
        }
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let tls = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| invalid(e.to_string()))?
        .with_root_certificates(roots)
        .with_no_client_auth();
    let mut http = HttpConnector::new();
    http.enforce_http(false);
    http.set_connect_timeout(Some(FETCH_TIMEOUT));
    Ok(hyper_rustls::HttpsConnectorBuilder::new()
        .with_tls_config(tls)
        .https_or_http()
        .enable_http1()
        .wrap_connector(http))
}

/// An identity provider's URL must be `https://`, or `http://` on loopback (development).
pub(crate) fn check_url(key: &'static str, url: &str) -> Result<(), KeySourceError> {
    let invalid = |reason: String| KeySourceError::Invalid { key, reason };
    let uri: Uri = url
        .parse()
        .map_err(|e| invalid(format!("{url:?} is not a URL: {e}")))?;
    let host = uri
        .host()
        .ok_or_else(|| invalid(format!("{url:?} has no host")))?;
    match uri.scheme_str() {
        Some("https") => Ok(()),
        Some("http") if is_loopback(host) => Ok(()),
        Some("http") => Err(invalid(format!(
            "{url:?}: keys are fetched only over https:// (http:// only on loopback, for development)"
        ))),
        _ => Err(invalid(format!("{url:?} must be an https:// URL"))),
    }
}

fn is_loopback(host: &str) -> bool {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    host.eq_ignore_ascii_case("localhost")
        || host
            .parse::<std::net::IpAddr>()
            .is_ok_and(|ip| ip.is_loopback())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_https_or_loopback_http_is_accepted() {
        for ok in [
            "https://idp.example.com/realms/acme",
            "http://127.0.0.1:8080",
            "http://localhost:9000/jwks",
            "http://[::1]:80/x",
        ] {
            assert!(check_url("auth.jwks_url", ok).is_ok(), "{ok}");
        }
        for bad in [
            "http://idp.example.com/jwks",
            "http://10.0.0.1/jwks",
            "http://127.0.0.1.evil.example/jwks",
            "http://127.0.0.1@evil.example/jwks",
            "http://localhost:80@evil.example/jwks",
            "ftp://idp.example.com",
            "idp.example.com",
        ] {
            let error = check_url("auth.jwks_url", bad).unwrap_err().to_string();
            assert!(error.starts_with("auth.jwks_url: "), "{bad}: {error}");
        }
    }
}
