//! Loading verification keys, each pinned to the one algorithm it may verify.

use std::path::Path;

use jsonwebtoken::jwk::{AlgorithmParameters, EllipticCurve, JwkSet, PublicKeyUse};
use jsonwebtoken::{Algorithm, DecodingKey};

/// A key source that cannot be used. Names the setting at fault.
#[derive(Debug, thiserror::Error)]
pub enum KeySourceError {
    #[error(
        "[auth] needs exactly one of hs256_secret, public_key_pem_file, jwks_file, jwks_url, oidc_issuer"
    )]
    NoSource,
    #[error(
        "[auth] sets more than one of hs256_secret, public_key_pem_file, jwks_file, jwks_url, oidc_issuer; keep one"
    )]
    SeveralSources,
    #[error("{key}: {reason}")]
    Invalid { key: &'static str, reason: String },
}

fn invalid(key: &'static str, reason: impl Into<String>) -> KeySourceError {
    KeySourceError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// The DER encoding of the P-384 curve's OID (1.3.132.0.34), as found in its SPKI.
const P384_OID: &[u8] = &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];

pub fn hs256(secret: &str) -> Result<DecodingKey, KeySourceError> {
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
pub fn pem_file(path: &Path) -> Result<(DecodingKey, Algorithm), KeySourceError> {
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

/// A usable key of a JWKS, pinned to its algorithm.
pub(crate) struct JwkKey {
    pub kid: String,
    pub key: DecodingKey,
    pub alg: Algorithm,
    /// The key as the document gave it (to tell whether a set changed).
    pub json: String,
}

/// Every signing key of a JWKS document, with its `kid` and pinned algorithm. A key
/// that cannot be used (symmetric, an unsupported type, an `alg` its type contradicts)
/// makes the file invalid: it is the operator's own file.
pub fn jwks_file(path: &Path) -> Result<Vec<(String, DecodingKey, Algorithm)>, KeySourceError> {
    const KEY: &str = "auth.jwks_file";
    let bytes = std::fs::read(path)
        .map_err(|e| invalid(KEY, format!("cannot read {}: {e}", path.display())))?;
    let keys = jwks(&bytes, &path.display().to_string(), |_, why| {
        Err(invalid(KEY, why))
    })?;
    Ok(keys.into_iter().map(|k| (k.kid, k.key, k.alg)).collect())
}

/// The usable keys of a JWKS fetched from an identity provider. A key that cannot be
/// used is left out (and logged), as a provider's set may hold keys for other
/// purposes; a symmetric key is never trusted from the network.
pub(crate) fn fetched_jwks(bytes: &[u8], url: &str) -> Result<Vec<JwkKey>, KeySourceError> {
    jwks(bytes, url, |named, why| {
        tracing::warn!(
            url,
            key = named,
            "ignoring a key of the fetched JWKS: {why}"
        );
        Ok(())
    })
}

/// Parses a JWKS; `unusable(key, why)` decides whether a key that cannot be used is
/// an error or is left out.
fn jwks(
    bytes: &[u8],
    origin: &str,
    unusable: impl Fn(&str, String) -> Result<(), KeySourceError>,
) -> Result<Vec<JwkKey>, KeySourceError> {
    let key_name = if origin.starts_with("http") {
        "auth.jwks_url"
    } else {
        "auth.jwks_file"
    };
    let set: JwkSet = serde_json::from_slice(bytes)
        .map_err(|e| invalid(key_name, format!("{origin} is not a JWKS document: {e}")))?;
    let mut keys = Vec::new();
    for (i, jwk) in set.keys.iter().enumerate() {
        if matches!(
            jwk.common.public_key_use,
            Some(PublicKeyUse::Encryption | PublicKeyUse::Other(_))
        ) {
            continue; // not a signing key
        }
        let kid = jwk.common.key_id.clone().unwrap_or_default();
        let named = format!("key {i} (kid {kid:?})");
        let pinned = pin(jwk).and_then(|alg| {
            DecodingKey::from_jwk(jwk)
                .map(|key| (key, alg))
                .map_err(|e| e.to_string())
        });
        match pinned {
            Ok((key, alg)) => keys.push(JwkKey {
                kid,
                key,
                alg,
                json: serde_json::to_string(jwk).unwrap_or_default(),
            }),
            Err(why) => unusable(&named, format!("{named}: {why}"))?,
        }
    }
    if keys.len() > 1 && keys.iter().any(|k| k.kid.is_empty()) {
        // Without a kid no token can name the key: an operator's file is wrong, a
        // provider's set is used without it.
        unusable(
            "a key without a kid",
            "with more than one key, every key needs a kid".into(),
        )?;
        keys.retain(|k| !k.kid.is_empty());
    }
    if keys.is_empty() {
        return Err(invalid(
            key_name,
            format!("{origin} holds no usable signing keys"),
        ));
    }
    Ok(keys)
}

/// The one algorithm a JWK may verify: its `alg` if it names one its type allows,
/// otherwise its type's default.
fn pin(jwk: &jsonwebtoken::jwk::Jwk) -> Result<Algorithm, String> {
    use Algorithm::*;
    let alg = match &jwk.common.key_algorithm {
        Some(alg) => Some(
            format!("{alg:?}")
                .parse::<Algorithm>()
                .map_err(|_| format!("unsupported alg {alg:?}"))?,
        ),
        None => None,
    };
    match (&jwk.algorithm, alg) {
        (AlgorithmParameters::OctetKey(_), _) | (_, Some(HS256 | HS384 | HS512)) => {
            Err("symmetric keys are not accepted in a JWKS".into())
        }
        (AlgorithmParameters::RSA(_), None) => Ok(RS256),
        (
            AlgorithmParameters::RSA(_),
            Some(alg @ (RS256 | RS384 | RS512 | PS256 | PS384 | PS512)),
        ) => Ok(alg),
        (AlgorithmParameters::EllipticCurve(ec), alg) => match (&ec.curve, alg) {
            (EllipticCurve::P256, None | Some(ES256)) => Ok(ES256),
            (EllipticCurve::P384, None | Some(ES384)) => Ok(ES384),
            (curve, Some(alg)) => Err(format!("alg {alg:?} contradicts its curve {curve:?}")),
            (curve, None) => Err(format!("unsupported curve {curve:?}")),
        },
        (_, Some(alg)) => Err(format!("alg {alg:?} contradicts its key type")),
        (_, None) => Err("unsupported key type".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The fixture's RSA and EC keys, with `changes` applied to copies of them.
    fn set_with(extra: &[serde_json::Value]) -> Vec<u8> {
        let fixture = include_str!("../tests/fixtures/jwks.json");
        let mut set: serde_json::Value = serde_json::from_str(fixture).unwrap();
        let keys = set["keys"].as_array_mut().unwrap();
        keys.extend(extra.iter().cloned());
        serde_json::to_vec(&set).unwrap()
    }

    #[test]
    fn a_fetched_set_leaves_out_what_it_cannot_trust() {
        let fixture: serde_json::Value =
            serde_json::from_str(include_str!("../tests/fixtures/jwks.json")).unwrap();
        let rsa = fixture["keys"][0].clone();
        let mut contradicting = rsa.clone();
        contradicting["kid"] = "rsa-as-ec".into();
        contradicting["alg"] = "ES256".into();
        let mut encryption = rsa.clone();
        encryption["kid"] = "rsa-enc".into();
        encryption["use"] = "enc".into();
        let symmetric =
            serde_json::json!({"kty": "oct", "kid": "shared", "k": "c2VjcmV0LXNlY3JldA"});
        let body = set_with(&[contradicting, encryption, symmetric]);
        let keys = fetched_jwks(&body, "https://idp.example/jwks").unwrap();
        let kids: Vec<&str> = keys.iter().map(|k| k.kid.as_str()).collect();
        assert_eq!(kids, ["rsa-1", "ec-1"]);
        assert_eq!(keys[1].alg, Algorithm::ES256);

        // The operator's own file is held to more: a symmetric key there is an error.
        let dir = std::env::temp_dir().join(format!("jwks-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("jwks.json");
        std::fs::write(
            &file,
            set_with(&[serde_json::json!({"kty": "oct", "kid": "s", "k": "c2VjcmV0"})]),
        )
        .unwrap();
        let error = jwks_file(&file).err().unwrap().to_string();
        assert!(error.contains("symmetric keys are not accepted"), "{error}");
    }

    #[test]
    fn a_fetched_set_without_a_usable_key_is_an_error() {
        let body = br#"{"keys":[{"kty":"oct","kid":"s","k":"c2VjcmV0"}]}"#;
        let error = fetched_jwks(body, "https://idp.example/jwks")
            .err()
            .unwrap()
            .to_string();
        assert!(error.contains("no usable signing keys"), "{error}");
    }
}
