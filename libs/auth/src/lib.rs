//! `idem-auth`: a bearer JWT in, an authenticated tenant out.
//!
//! # Layout
//! - [`AuthConfig`]: the `[auth]` section of the gateway's config.
//! - [`Authenticator`]: built once from the config; verifies tokens.
//! - [`keys`]: loading HS256 secrets, PEM public keys and JWKS files.
//! - [`mint_hs256`]: a development token for the `idemgate token` command.
//!
//! # What is checked
//! The algorithm is pinned by the key, never taken from the token: an HS256 secret only
//! accepts HS256, an RSA key RS256 and a P-256 key ES256 (so no `alg: none` and no
//! HS/RS confusion). `exp` is required; `nbf` is honoured when present; `iss` and `aud`
//! are required and checked when configured. With a JWKS, a token must name a known
//! `kid` (a set of exactly one key also accepts tokens without `kid`). The tenant is
//! the configured claim and must be a non-empty printable-ASCII string.
#![forbid(unsafe_code)]

pub mod keys;

use std::path::PathBuf;
use std::time::Duration;

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation, errors::ErrorKind};
use secrecy::{ExposeSecret, SecretString};
use serde::Deserialize;
use serde_json::{Map, Value};

pub use keys::KeyError;

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
    /// A JWKS URL: not fetched by this version (see README); refused with a clear error.
    pub jwks_url: Option<String>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    /// Clock skew allowed on `exp` and `nbf`.
    #[serde(default, with = "humantime_serde")]
    pub leeway: Duration,
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

/// Verifies bearer tokens. Built once at start-up.
pub struct Authenticator {
    keys: KeySet,
    tenant_claim: String,
    leeway: u64,
    /// Tokens verified before, with their tenant and the second (Unix time) after which
    /// they expire: a client sends the same token with every request, and verifying it
    /// again gives the same answer until it expires.
    verified: std::sync::Mutex<std::collections::HashMap<String, (Tenant, u64)>>,
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
    pub fn from_config(config: &AuthConfig) -> Result<Self, KeyError> {
        let sources = [
            config.hs256_secret.is_some(),
            config.public_key_pem_file.is_some(),
            config.jwks_file.is_some(),
            config.jwks_url.is_some(),
        ];
        match sources.iter().filter(|s| **s).count() {
            1 => {}
            0 => return Err(KeyError::NoSource),
            _ => return Err(KeyError::SeveralSources),
        }
        if config.tenant_claim.is_empty() {
            return Err(KeyError::Invalid {
                key: "auth.tenant_claim",
                reason: "must not be empty".into(),
            });
        }
        let pin = |alg: Algorithm| validation(alg, config);
        let keys = if let Some(secret) = &config.hs256_secret {
            KeySet::One(Box::new(PinnedKey {
                key: keys::hs256(secret.expose_secret())?,
                validation: pin(Algorithm::HS256),
            }))
        } else if let Some(path) = &config.public_key_pem_file {
            let (key, alg) = keys::pem_file(path)?;
            KeySet::One(Box::new(PinnedKey {
                key,
                validation: pin(alg),
            }))
        } else if let Some(path) = &config.jwks_file {
            let set = keys::jwks_file(path)?
                .into_iter()
                .map(|(kid, key, alg)| {
                    (
                        kid,
                        PinnedKey {
                            key,
                            validation: pin(alg),
                        },
                    )
                })
                .collect();
            KeySet::ByKid(set)
        } else {
            return Err(KeyError::Invalid {
                key: "auth.jwks_url",
                reason: "fetching a JWKS over the network is not supported yet; \
                         save it and use auth.jwks_file"
                    .into(),
            });
        };
        Ok(Self {
            keys,
            tenant_claim: config.tenant_claim.clone(),
            leeway: config.leeway.as_secs(),
            verified: Default::default(),
        })
    }

    /// Verifies a token and returns its tenant.
    pub fn verify(&self, token: &str) -> Result<Tenant, AuthError> {
        let now = now_secs();
        if let Some((tenant, until)) = self.verified.lock().expect("verified lock").get(token)
            && now <= *until
        {
            return Ok(tenant.clone());
        }
        let (tenant, exp) = self.verify_signed(token)?;
        let mut verified = self.verified.lock().expect("verified lock");
        if verified.len() >= VERIFIED_CAPACITY {
            verified.clear();
        }
        verified.insert(
            token.to_owned(),
            (tenant.clone(), exp.saturating_add(self.leeway)),
        );
        Ok(tenant)
    }

    /// Full verification: the tenant and the token's `exp`.
    fn verify_signed(&self, token: &str) -> Result<(Tenant, u64), AuthError> {
        let pinned = match &self.keys {
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

fn valid_tenant(t: &str) -> bool {
    !t.is_empty() && t.len() <= MAX_TENANT_LEN && t.bytes().all(|b| (0x21..=0x7e).contains(&b))
}

fn validation(alg: Algorithm, config: &AuthConfig) -> Validation {
    let mut v = Validation::new(alg);
    v.leeway = config.leeway.as_secs();
    v.validate_exp = true;
    v.validate_nbf = true;
    let mut required = vec!["exp"];
    if let Some(issuer) = &config.issuer {
        v.set_issuer(&[issuer]);
        required.push("iss");
    }
    match &config.audience {
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
