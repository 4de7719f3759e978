//! `idem-auth`: a bearer JWT in, an authenticated tenant out.
//!
//! # Layout
//! - [`AuthConfig`]: the `[auth]` section of the gateway's config.
//! - [`Authenticator`]: built once from the config; verifies tokens.
//! - [`keys`]: loading HS256 secrets, PEM public keys and JWKS documents.
//! - `remote`: keys fetched from an identity provider (OIDC discovery or a JWKS URL),
//!   refreshed in the background, refetched once for a token with an unknown `kid`.
//! - [`mint_hs256`]: a development token for the `idemgate token` command.
//!
//! # What is checked
//! The algorithm is pinned by the key, never taken from the token: an HS256 secret only
//! accepts HS256, an RSA key RS256 and a P-256 key ES256 (so no `alg: none` and no
//! HS/RS confusion). `exp` is required; `nbf` is honoured when present; `iss` and `aud`
//! are required and checked when configured (discovery pins `iss` to the issuer). With a
//! JWKS, a token must name a known `kid` (a set of exactly one key also accepts tokens
//! without `kid`). The tenant is the configured claim and must be a non-empty
//! printable-ASCII string.
//!
//! # Why one file of ~500 lines
//! It is the verifier and its key set: the checks a token goes through are written in
//! the order they run, beside the key set they read, and every unit test of them is in
//! `tests/verify.rs`. Key files and fetching live in [`keys`] and `remote.rs`.
#![forbid(unsafe_code)]

pub mod keys;
mod remote;

use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation, errors::ErrorKind};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use serde_json::{Map, Value};

pub use keys::KeySourceError;
pub use remote::{RemoteStats, https_connector};

/// The longest tenant id accepted.
pub const MAX_TENANT_LEN: usize = 255;

/// `[auth]`: how tokens are verified. Exactly one key source must be set.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AuthConfig {
    /// The claim that carries the tenant id.
    #[serde(default = "default_tenant_claim")]
    pub tenant_claim: String,
    /// A shared HS256 secret.
    pub hs256_secret: Option<SecretString>,
    /// A PEM public key (RSA → RS256, EC P-256 → ES256).
    pub public_key_pem_file: Option<PathBuf>,
    /// A JWKS document on disk.
    pub jwks_file: Option<PathBuf>,
    /// A JWKS fetched over HTTPS (or loopback HTTP) and refreshed.
    pub jwks_url: Option<String>,
    /// An OpenID Connect issuer: its discovery document names the JWKS; sets `issuer`.
    pub oidc_issuer: Option<String>,
    /// How often fetched keys are refreshed (a shorter `Cache-Control: max-age` wins).
    #[serde(default = "default_jwks_refresh", with = "humantime_serde")]
    pub jwks_refresh: Duration,
    /// The least time between two fetches, however many unknown `kid`s arrive.
    #[serde(default = "default_jwks_min_refetch", with = "humantime_serde")]
    pub jwks_min_refetch: Duration,
    /// Extra root certificates (PEM) for a provider behind a private CA.
    pub ca_file: Option<PathBuf>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    /// Says that tokens for any audience are accepted from a provider (otherwise
    /// `check-config` warns when `audience` is not set).
    #[serde(default)]
    pub allow_any_audience: bool,
    /// Clock skew allowed on `exp` and `nbf`.
    #[serde(default, with = "humantime_serde")]
    pub leeway: Duration,
}

fn default_jwks_refresh() -> Duration {
    Duration::from_secs(300)
}

fn default_jwks_min_refetch() -> Duration {
    Duration::from_secs(30)
}

fn default_tenant_claim() -> String {
    "tenant_id".to_owned()
}

/// Why a token was refused. Every variant becomes a 401; the message is safe to show.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AuthError {
    #[error("a bearer token is required")]
    Missing,
    #[error("the token is malformed")]
    Malformed,
    #[error("the token has expired")]
    Expired,
    #[error("the token is not valid yet")]
    NotYetValid,
    #[error("the token's signature or algorithm is not accepted")]
    BadSignature,
    #[error("the token's key id is not known")]
    UnknownKey,
    #[error("the identity provider's signing keys have not been loaded yet; try again shortly")]
    KeysUnavailable,
    #[error("the token's issuer is not accepted")]
    Issuer,
    #[error("the token's audience is not accepted")]
    Audience,
    #[error("the token lacks the required claim {0:?}")]
    MissingClaim(String),
    #[error("the token's {0:?} claim is malformed")]
    BadClaim(String),
    #[error("the token carries no tenant in claim {0:?}")]
    TenantMissing(String),
    #[error(
        "the token's tenant claim {0:?} must be a non-empty string of printable ASCII, at most 255 characters"
    )]
    TenantInvalid(String),
    /// Embedded mode's trusted tenant header (set by the service's own authentication).
    #[error("the request carries no tenant in header {0:?}")]
    TenantHeaderMissing(String),
    #[error(
        "the tenant header {0:?} must appear once, a non-empty string of printable ASCII, at most 255 characters"
    )]
    TenantHeaderInvalid(String),
}

/// The authenticated tenant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tenant(pub String);

/// A verifying key and the one algorithm it accepts.
struct PinnedKey {
    key: DecodingKey,
    validation: Validation,
}

enum KeySet {
    One(Box<PinnedKey>),
    ByKid(Vec<(String, PinnedKey)>),
}

impl KeySet {
    fn len(&self) -> usize {
        match self {
            KeySet::One(_) => 1,
            KeySet::ByKid(set) => set.len(),
        }
    }
}

/// The keys: loaded once, or fetched and refreshed.
enum Keys {
    Static(KeySet),
    Remote(Arc<remote::RemoteKeys>),
}

/// The claims every key checks besides its signature.
#[derive(Debug, Clone)]
struct Checks {
    issuer: Option<String>,
    audience: Option<String>,
    leeway: u64,
}

/// Verifies bearer tokens. Built once at start-up.
pub struct Authenticator {
    keys: Keys,
    tenant_claim: String,
    leeway: u64,
    /// Tokens verified before, with their tenant, the second (Unix time) after which
    /// they expire and the key set's generation: a client sends the same token with
    /// every request, and verifying it again gives the same answer until it expires
    /// or the keys change.
    verified: std::sync::Mutex<std::collections::HashMap<String, (Tenant, u64, u64)>>,
    warnings: Vec<String>,
}

/// How many verified tokens are remembered; past it the memory starts over.
const VERIFIED_CAPACITY: usize = 10_000;

impl std::fmt::Debug for Authenticator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Authenticator")
            .field("tenant_claim", &self.tenant_claim)
            .finish_non_exhaustive()
    }
}

impl Authenticator {
    /// Loads the configured keys. Errors name the offending setting.
    pub fn from_config(config: &AuthConfig) -> Result<Self, KeySourceError> {
        let sources = [
            config.hs256_secret.is_some(),
            config.public_key_pem_file.is_some(),
            config.jwks_file.is_some(),
            config.jwks_url.is_some(),
            config.oidc_issuer.is_some(),
        ];
        match sources.iter().filter(|s| **s).count() {
            1 => {}
            0 => return Err(KeySourceError::NoSource),
            _ => return Err(KeySourceError::SeveralSources),
        }
        if config.tenant_claim.is_empty() {
            return Err(KeySourceError::Invalid {
                key: "auth.tenant_claim",
                reason: "must not be empty".into(),
            });
        }
        let mut issuer = config.issuer.clone();
        if let Some(oidc) = &config.oidc_issuer {
            match &issuer {
                Some(other) if other != oidc => {
                    return Err(KeySourceError::Invalid {
                        key: "auth.issuer",
                        reason: format!(
                            "{other:?} differs from auth.oidc_issuer {oidc:?}; leave it out (discovery sets it)"
                        ),
                    });
                }
                _ => issuer = Some(oidc.clone()),
            }
        }
        let checks = Checks {
            issuer,
            audience: config.audience.clone(),
            leeway: config.leeway.as_secs(),
        };
        let pin = |alg: Algorithm| checks.validation(alg);
        let mut warnings = Vec::new();
        let fetched = config.jwks_url.is_some() || config.oidc_issuer.is_some();
        if !fetched && (config.ca_file.is_some() || config.allow_any_audience) {
            warnings.push(
                "auth.ca_file and auth.allow_any_audience apply only to keys fetched from a \
                 provider (auth.oidc_issuer or auth.jwks_url); they are ignored here"
                    .into(),
            );
        }
        let keys = if let Some(secret) = &config.hs256_secret {
            Keys::Static(KeySet::One(Box::new(PinnedKey {
                key: keys::hs256(secret.expose_secret())?,
                validation: pin(Algorithm::HS256),
            })))
        } else if let Some(path) = &config.public_key_pem_file {
            let (key, alg) = keys::pem_file(path)?;
            Keys::Static(KeySet::One(Box::new(PinnedKey {
                key,
                validation: pin(alg),
            })))
        } else if let Some(path) = &config.jwks_file {
            Keys::Static(checks.key_set(keys::jwks_file(path)?))
        } else {
            let source = match (&config.oidc_issuer, &config.jwks_url) {
                (Some(issuer), _) => {
                    remote::check_url("auth.oidc_issuer", issuer)?;
                    remote::Source::Discovery {
                        issuer: issuer.clone(),
                    }
                }
                (None, Some(url)) => {
                    remote::check_url("auth.jwks_url", url)?;
                    remote::Source::Jwks { url: url.clone() }
                }
                (None, None) => return Err(KeySourceError::NoSource),
            };
            if config.jwks_min_refetch.is_zero() || config.jwks_min_refetch > config.jwks_refresh {
                return Err(KeySourceError::Invalid {
                    key: "auth.jwks_min_refetch",
                    reason: "must be more than 0 and at most auth.jwks_refresh".into(),
                });
            }
            if config.oidc_issuer.is_none() && config.issuer.is_none() {
                warnings.push(
                    "auth.issuer is not set: with auth.jwks_url, tokens of any issuer that \
                     shares those keys are accepted (some providers serve one JWKS for many \
                     tenants); set it, or use auth.oidc_issuer"
                        .into(),
                );
            }
            if config.audience.is_none() && !config.allow_any_audience {
                warnings.push(
                    "auth.audience is not set: tokens the provider issued for any other \
                     application are accepted too; set it, or say auth.allow_any_audience = true"
                        .into(),
                );
            }
            let connector = remote::https_connector(config.ca_file.as_deref())?;
            Keys::Remote(Arc::new(remote::RemoteKeys::new(
                source,
                connector,
                checks.clone(),
                config.jwks_refresh,
                config.jwks_min_refetch,
            )))
        };
        Ok(Self {
            keys,
            tenant_claim: config.tenant_claim.clone(),
            leeway: config.leeway.as_secs(),
            verified: Default::default(),
            warnings,
        })
    }

    /// What `check-config` should say about this config besides errors.
    pub fn warnings(&self) -> &[String] {
        &self.warnings
    }

    /// Starts fetching and refreshing a provider's keys (nothing to do for static
    /// keys). Must be called within a Tokio runtime; the task runs until aborted.
    pub fn start(&self) -> Option<tokio::task::JoinHandle<()>> {
        match &self.keys {
            Keys::Static(_) => None,
            Keys::Remote(remote) => Some(tokio::spawn(remote.clone().run())),
        }
    }

    /// Whether tokens can be verified: always, except while a provider's keys have
    /// not been fetched yet.
    pub fn ready(&self) -> bool {
        match &self.keys {
            Keys::Static(_) => true,
            Keys::Remote(remote) => remote.now().is_some(),
        }
    }

    /// The fetched keys' counters, for a provider's keys.
    pub fn remote_stats(&self) -> Option<RemoteStats> {
        match &self.keys {
            Keys::Static(_) => None,
            Keys::Remote(remote) => Some(remote.stats()),
        }
    }

    /// [`Authenticator::verify`], and for a token whose key the provider's set lacks
    /// (a key rotated in since the last refresh), one refetch shared with every request
    /// that asks at the same time, at most once per `auth.jwks_min_refetch`.
    pub async fn verify_fetching(&self, token: &str) -> Result<Tenant, AuthError> {
        match (self.verify(token), &self.keys) {
            (Err(AuthError::UnknownKey | AuthError::KeysUnavailable), Keys::Remote(remote)) => {
                remote.refetch().await;
                self.verify(token)
            }
            (answer, _) => answer,
        }
    }

    /// Verifies a token and returns its tenant.
    pub fn verify(&self, token: &str) -> Result<Tenant, AuthError> {
        let now = now_secs();
        // A token verified before is checked against the keys' generation only: no
        // lock on the key set.
        let generation = match &self.keys {
            Keys::Static(_) => 0,
            Keys::Remote(remote) => remote.generation(),
        };
        if let Some((tenant, until, seen)) = self.verified.lock().expect("verified lock").get(token)
            && now <= *until
            && *seen == generation
        {
            return Ok(tenant.clone());
        }
        let fetched;
        let (keys, generation) = match &self.keys {
            Keys::Static(set) => (set, 0),
            Keys::Remote(remote) => {
                fetched = remote.now().ok_or(AuthError::KeysUnavailable)?;
                (&fetched.set, fetched.generation)
            }
        };
        let (tenant, exp) = self.verify_signed(token, keys)?;
        let mut verified = self.verified.lock().expect("verified lock");
        if verified.len() >= VERIFIED_CAPACITY {
            verified.clear();
        }
        verified.insert(
            token.to_owned(),
            (tenant.clone(), exp.saturating_add(self.leeway), generation),
        );
        Ok(tenant)
    }

    /// Full verification: the tenant and the token's `exp`.
    fn verify_signed(&self, token: &str, keys: &KeySet) -> Result<(Tenant, u64), AuthError> {
        let pinned = match keys {
            KeySet::One(key) => key,
            KeySet::ByKid(set) => {
                let header =
                    jsonwebtoken::decode_header(token).map_err(|_| AuthError::Malformed)?;
                match (header.kid, set.as_slice()) {
                    (Some(kid), set) => set
                        .iter()
                        .find(|(k, _)| *k == kid)
                        .map(|(_, key)| key)
                        .ok_or(AuthError::UnknownKey)?,
                    (None, [(_, only)]) => only,
                    (None, _) => return Err(AuthError::UnknownKey),
                }
            }
        };
        let data =
            jsonwebtoken::decode::<Map<String, Value>>(token, &pinned.key, &pinned.validation)
                .map_err(|e| classify(e.into_kind()))?;
        // `exp` is required and was checked, so it is a number here.
        let exp = data.claims.get("exp").and_then(Value::as_u64).unwrap_or(0);
        match data.claims.get(&self.tenant_claim) {
            None | Some(Value::Null) => Err(AuthError::TenantMissing(self.tenant_claim.clone())),
            Some(Value::String(t)) if valid_tenant(t) => Ok((Tenant(t.clone()), exp)),
            Some(_) => Err(AuthError::TenantInvalid(self.tenant_claim.clone())),
        }
    }
}

fn now_secs() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_secs()
}

/// Whether `t` may name a tenant: 1 to [`MAX_TENANT_LEN`] printable ASCII characters
/// (0x21–0x7E), as the tenant claim of a token must be.
pub fn valid_tenant(t: &str) -> bool {
    !t.is_empty() && t.len() <= MAX_TENANT_LEN && t.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

impl Checks {
    /// A JWKS's keys, each pinned to its algorithm.
    fn key_set(&self, keys: impl IntoIterator<Item = (String, DecodingKey, Algorithm)>) -> KeySet {
        let pinned = keys.into_iter().map(|(kid, key, alg)| {
            let validation = self.validation(alg);
            (kid, PinnedKey { key, validation })
        });
        KeySet::ByKid(pinned.collect())
    }

    /// The validation for a key that verifies `alg` only.
    fn validation(&self, alg: Algorithm) -> Validation {
        let mut v = Validation::new(alg);
        v.leeway = self.leeway;
        v.validate_exp = true;
        v.validate_nbf = true;
        let mut required = vec!["exp"];
        if let Some(issuer) = &self.issuer {
            v.set_issuer(&[issuer]);
            required.push("iss");
        }
        match &self.audience {
            Some(audience) => {
                v.set_audience(&[audience]);
                required.push("aud");
            }
            // Without a configured audience, a token's `aud` is not ours to judge.
            None => v.validate_aud = false,
        }
        v.set_required_spec_claims(&required);
        v
    }
}

fn classify(kind: ErrorKind) -> AuthError {
    match kind {
        ErrorKind::ExpiredSignature => AuthError::Expired,
        ErrorKind::ImmatureSignature => AuthError::NotYetValid,
        ErrorKind::InvalidIssuer => AuthError::Issuer,
        ErrorKind::InvalidAudience => AuthError::Audience,
        ErrorKind::MissingRequiredClaim(c) => AuthError::MissingClaim(c),
        ErrorKind::InvalidClaimFormat(c) => AuthError::BadClaim(c),
        ErrorKind::InvalidSignature
        | ErrorKind::InvalidAlgorithm
        | ErrorKind::InvalidAlgorithmName
        | ErrorKind::InvalidEcdsaKey
        | ErrorKind::InvalidRsaKey(_)
        | ErrorKind::InvalidKeyFormat => AuthError::BadSignature,
        _ => AuthError::Malformed,
    }
}

/// Mints an HS256 token for development (`idemgate token`). Includes `iss` and `aud`
/// when given, so the token passes a config that checks them.
pub fn mint_hs256(
    secret: &SecretString,
    tenant_claim: &str,
    tenant: &str,
    ttl: Duration,
    issuer: Option<&str>,
    audience: Option<&str>,
) -> Result<String, jsonwebtoken::errors::Error> {
    let now = now_secs();
    let mut claims = Map::new();
    claims.insert(tenant_claim.to_owned(), Value::from(tenant));
    claims.insert("sub".into(), Value::from(format!("dev:{tenant}")));
    claims.insert("iat".into(), Value::from(now));
    claims.insert("exp".into(), Value::from(now + ttl.as_secs()));
    if let Some(iss) = issuer {
        claims.insert("iss".into(), Value::from(iss));
    }
    if let Some(aud) = audience {
        claims.insert("aud".into(), Value::from(aud));
    }
    let key = EncodingKey::from_secret(secret.expose_secret().as_bytes())?;
    jsonwebtoken::encode(&Header::new(Algorithm::HS256), &claims, &key)
}
