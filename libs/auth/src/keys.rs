//! Loading verification keys, each pinned to the one algorithm it may verify.

use std::path::Path;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// A key source that cannot be used. Names the setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    #[error("[auth] needs exactly one of hs256_secret, public_key_pem_file, jwks_file")]
    NoSource,
    #[error(
        "[auth] sets more than one of hs256_secret, public_key_pem_file, jwks_file, jwks_url; keep one"
    )]
    SeveralSources,
    #[error("{key}: {reason}")]
    Invalid { key: &'static str, reason: String },
}

fn invalid(key: &'static str, reason: impl Into<String>) -> KeyError {
    KeyError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// The DER encoding of the P-384 curve's OID (1.3.132.0.34), as found in its SPKI.
const P384_OID: &[u8] = &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];

pub fn hs256(secret: &str) -> Result<DecodingKey, KeyError> {
    if secret.len() < 8 {
        return Err(invalid(
            "auth.hs256_secret",
            "must be at least 8 characters",
        ));
    }
    DecodingKey::from_secret(secret.as_bytes())
        .map_err(|e| invalid("auth.hs256_secret", e.to_string()))
}

/// A PEM public key: RSA → RS256, EC P-256 → ES256, EC P-384 → ES384.
pub fn pem_file(path: &Path) -> Result<(DecodingKey, Algorithm), KeyError> {
    const KEY: &str = "auth.public_key_pem_file";
    let bytes = std::fs::read(path)
        .map_err(|e| invalid(KEY, format!("cannot read {}: {e}", path.display())))?;
    let pem = pem::parse(&bytes)
        .map_err(|e| invalid(KEY, format!("{} is not PEM: {e}", path.display())))?;
    if let Ok(key) = DecodingKey::from_rsa_pem(&bytes) {
        return Ok((key, Algorithm::RS256));
    }
    if let Ok(key) = DecodingKey::from_ec_pem(&bytes) {
        let p384 = pem
            .contents()
            .windows(P384_OID.len())
            .any(|w| w == P384_OID);
        return Ok((
            key,
            if p384 {
                Algorithm::ES384
            } else {
                Algorithm::ES256
            },
        ));
    }
    Err(invalid(
        KEY,
        format!(
            "{} holds a {:?} block; expected an RSA or EC (P-256/P-384) public key",
            path.display(),
            pem.tag()
        ),
    ))
}

/// Every signing key of a JWKS document, with its `kid` and pinned algorithm.
pub fn jwks_file(path: &Path) -> Result<Vec<(String, DecodingKey, Algorithm)>, KeyError> {
    const KEY: &str = "auth.jwks_file";
    let bytes = std::fs::read(path)
        .map_err(|e| invalid(KEY, format!("cannot read {}: {e}", path.display())))?;
    let set: JwkSet = serde_json::from_slice(&bytes).map_err(|e| {
        invalid(
            KEY,
            format!("{} is not a JWKS document: {e}", path.display()),
        )
    })?;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        if matches!(jwk.common.public_key_use, Some(PublicKeyUse::Encryption)) {
            continue;
        }
        let kid = jwk.common.key_id.clone().unwrap_or_default();
        let named = || format!("key {i} (kid {kid:?})");
        let alg = match (&jwk.common.key_algorithm, &jwk.algorithm) {
            (Some(alg), _) => format!("{alg:?}")
                .parse::<Algorithm>()
                .map_err(|_| invalid(KEY, format!("{}: unsupported alg {alg:?}", named())))?,
            (None, AlgorithmParameters::RSA(_)) => Algorithm::RS256,
            (None, AlgorithmParameters::EllipticCurve(ec)) => match ec.curve {
                EllipticCurve::P256 => Algorithm::ES256,
                EllipticCurve::P384 => Algorithm::ES384,
                _ => return Err(invalid(KEY, format!("{}: unsupported curve", named()))),
            },
            (None, _) => return Err(invalid(KEY, format!("{}: unsupported key type", named()))),
        };
        if matches!(jwk.algorithm, AlgorithmParameters::OctetKey(_))
            || matches!(alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512)
        {
            return Err(invalid(
                KEY,
                format!("{}: symmetric keys are not accepted in a JWKS", named()),
            ));
        }
        let key =
            DecodingKey::from_jwk(jwk).map_err(|e| invalid(KEY, format!("{}: {e}", named())))?;
        keys.push((kid, key, alg));
    }
    if keys.is_empty() {
        return Err(invalid(
            KEY,
            format!("{} holds no signing keys", path.display()),
        ));
    }
    if keys.len() > 1 && keys.iter().any(|(kid, _, _)| kid.is_empty()) {
        return Err(invalid(
            KEY,
            "with more than one key, every key needs a kid",
        ));
    }
    Ok(keys)
}
