//! The request fingerprint: what makes two requests with one key "the same request".

use std::fmt;

use sha2::{Digest, Sha256};

use crate::canonical::{self, JsonError};

/// SHA-256 over the method, the concrete path and query, and the body (canonical JSON
/// when the body is JSON, raw bytes otherwise).
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Fingerprint([u8; 32]);

/// How the body enters the fingerprint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyKind {
    /// Parsed and canonicalised; invalid or ambiguous JSON is refused.
    Json,
    /// Hashed byte for byte.
    Raw,
}

impl Fingerprint {
    /// Computes the fingerprint of a request. `target` is the path and query as sent
    /// (`/payments?x=1`).
    pub fn compute(
        method: &str,
        target: &str,
        kind: BodyKind,
        body: &[u8],
    ) -> Result<Self, JsonError> {
        let mut hasher = Sha256::new();
        // Every variable-length part is length-prefixed, so no two different
        // (method, target, body) triples can produce the same byte stream.
        for part in [method.as_bytes(), target.as_bytes()] {
            hasher.update((part.len() as u64).to_be_bytes());
            hasher.update(part);
        }
        match kind {
            BodyKind::Json => {
                let canonical = canonical::canonicalize(body)?;
                hasher.update(b"J");
                hasher.update(&canonical);
            }
            BodyKind::Raw => {
                hasher.update(b"R");
                hasher.update(body);
            }
        }
        Ok(Self(hasher.finalize().into()))
    }

    pub fn from_bytes(bytes: [u8; 32]) -> Self {
        Self(bytes)
    }

    pub fn as_bytes(&self) -> &[u8; 32] {
        &self.0
    }
}

impl fmt::Debug for Fingerprint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Fingerprint({})", hex::encode(self.0))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn json(target: &str, body: &str) -> Fingerprint {
        Fingerprint::compute("POST", target, BodyKind::Json, body.as_bytes()).unwrap()
    }

    #[test]
    fn equivalent_json_bodies_share_a_fingerprint() {
        assert_eq!(
            json("/payments", r#"{"a":1,"b":2}"#),
            json("/payments", "{ \"b\": 2, \"a\": 1 }")
        );
    }

    #[test]
    fn method_target_and_body_all_count() {
        let base = json("/payments", r#"{"a":1}"#);
        assert_ne!(base, json("/payments?x=1", r#"{"a":1}"#));
        assert_ne!(base, json("/refunds", r#"{"a":1}"#));
        assert_ne!(base, json("/payments", r#"{"a":2}"#));
        let put = Fingerprint::compute("PUT", "/payments", BodyKind::Json, br#"{"a":1}"#).unwrap();
        assert_ne!(base, put);
    }

    #[test]
    fn raw_bodies_are_hashed_as_bytes() {
        let a = Fingerprint::compute("POST", "/p", BodyKind::Raw, b"a=1&b=2").unwrap();
        let b = Fingerprint::compute("POST", "/p", BodyKind::Raw, b"b=2&a=1").unwrap();
        assert_ne!(a, b);
        // A raw body never collides with the same bytes read as JSON.
        let raw = Fingerprint::compute("POST", "/p", BodyKind::Raw, b"{}").unwrap();
        let json = Fingerprint::compute("POST", "/p", BodyKind::Json, b"{}").unwrap();
        assert_ne!(raw, json);
    }

    #[test]
    fn parts_cannot_bleed_into_each_other() {
        let a = Fingerprint::compute("POST", "/ab", BodyKind::Raw, b"c").unwrap();
        let b = Fingerprint::compute("POST", "/a", BodyKind::Raw, b"bc").unwrap();
        assert_ne!(a, b);
    }

    #[test]
    fn invalid_json_has_no_fingerprint() {
        assert!(Fingerprint::compute("POST", "/p", BodyKind::Json, br#"{"a":1,"a":1}"#).is_err());
    }
}
