//! `idem-webhooks`: a webhook's sender authenticated by its signature, and the key of the
//! delivery (docs/webhooks.md). Providers retry deliveries for days and sign each one afresh;
//! the signature says who sent it, the provider's event id says which operation it is.
//!
//! | scheme | key | signed content | signature |
//! | --- | --- | --- | --- |
//! | [`Scheme::StandardWebhooks`] | `webhook-id` (or `svix-id`) | `{id}.{timestamp}.{body}` | `webhook-signature`: space-separated `v1,<base64>` |
//! | [`Scheme::Stripe`] | the body's top-level `"id"` | `{t}.{body}` | `Stripe-Signature: t=…,v1=<hex>[,v1=…]` |
//! | [`Scheme::Github`] | `X-GitHub-Delivery` | the body | `X-Hub-Signature-256: sha256=<hex>` |
//!
//! All three are HMAC-SHA256, checked here with RustCrypto's `hmac` and `sha2`: each
//! secret's MAC computed once per delivery, compared in constant time (`subtle`) with at
//! most [`MAX_SIGNATURES`] signatures of the right length — a header stuffed with
//! thousands of them costs no more hashing than one. (The `standardwebhooks` crate fixes its timestamp
//! tolerance at five minutes, where a route sets its own, and would bring a second
//! generation of `base64` and `hmac` into the build; its format is a dozen lines.) The
//! tests check signatures made by the senders' own code: the Standard Webhooks Python
//! library, and GitHub's documented example.
//!
//! A route may hold several secrets (one a line): any of them verifies, so a secret is
//! rotated by adding the new line, moving the sender over, then removing the old one.
#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use hmac::{Hmac, KeyInit, Mac};
use http::HeaderMap;
use sha2::Sha256;
use subtle::ConstantTimeEq;

type HmacSha256 = Hmac<Sha256>;

/// How a provider signs its deliveries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scheme {
    /// The Standard Webhooks specification (Svix and the providers that follow it).
    StandardWebhooks,
    /// Stripe's `Stripe-Signature`.
    Stripe,
    /// GitHub's `X-Hub-Signature-256`.
    Github,
}

impl Scheme {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::StandardWebhooks => "standard-webhooks",
            Self::Stripe => "stripe",
            Self::Github => "github",
        }
    }

    /// Whether the scheme signs a timestamp (checked against the route's tolerance).
    pub fn signs_time(self) -> bool {
        !matches!(self, Self::Github)
    }
}

impl fmt::Display for Scheme {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Scheme {
    type Err = UnknownScheme;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "standard-webhooks" => Ok(Self::StandardWebhooks),
            "stripe" => Ok(Self::Stripe),
            "github" => Ok(Self::Github),
            _ => Err(UnknownScheme(s.to_owned())),
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown webhook scheme {0:?} (known: standard-webhooks, stripe, github)")]
pub struct UnknownScheme(String);

/// A route's secrets, one a line; any of them verifies a delivery.
#[derive(Clone)]
pub struct Secrets(Vec<Vec<u8>>);

impl fmt::Debug for Secrets {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secrets({} redacted)", self.0.len())
    }
}

/// A secrets file that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum SecretError {
    #[error("no secret in it (one a line)")]
    Empty,
    #[error("line {line}: a Standard Webhooks secret is `whsec_` and base64 ({why})")]
    NotBase64 { line: usize, why: String },
    #[error("line {line}: a secret of {len} bytes is guessable; use at least {MIN_SECRET_BYTES}")]
    TooShort { line: usize, len: usize },
}

/// The shortest secret accepted: an empty or short key (a template's `whsec_` with
/// nothing after it) would let anyone sign.
pub const MIN_SECRET_BYTES: usize = 16;

/// The most signatures of one delivery that are checked: a sender signs with one secret,
/// or two while it rotates. More is an attempt to make the gateway hash for nothing.
pub const MAX_SIGNATURES: usize = 8;

/// The length of an HMAC-SHA256 tag.
const TAG_BYTES: usize = 32;

impl Secrets {
    /// The secrets of a file's `text` for `scheme`: blank lines and the whitespace around
    /// a line are ignored. A Standard Webhooks secret is the base64 after `whsec_` (the
    /// prefix may be left out); Stripe's and GitHub's are used as written.
    pub fn parse(scheme: Scheme, text: &str) -> Result<Self, SecretError> {
        let mut keys = Vec::new();
        for (n, line) in text.lines().enumerate() {
            let line = line.trim();
            if line.is_empty() {
                continue;
            }
            let key = match scheme {
                Scheme::StandardWebhooks => {
                    let encoded = line.strip_prefix("whsec_").unwrap_or(line);
                    BASE64.decode(encoded).map_err(|e| SecretError::NotBase64 {
                        line: n + 1,
                        why: e.to_string(),
                    })?
                }
                Scheme::Stripe | Scheme::Github => line.as_bytes().to_vec(),
            };
            if key.len() < MIN_SECRET_BYTES {
                return Err(SecretError::TooShort {
                    line: n + 1,
                    len: key.len(),
                });
            }
            keys.push(key);
        }
        if keys.is_empty() {
            return Err(SecretError::Empty);
        }
        Ok(Self(keys))
    }

    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// These secrets and, while there are fewer than `at_least`, `pad`'s after them:
    /// secrets nobody signs with verify nothing, but cost a check what a real one costs,
    /// so how long a check takes says nothing of how many secrets a file holds.
    pub fn padded(mut self, pad: &Secrets, at_least: usize) -> Self {
        let missing = at_least.saturating_sub(self.0.len());
        self.0.extend(pad.0.iter().take(missing).cloned());
        self
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    /// Whether any secret's HMAC-SHA256 of the parts, in order, is one of `tags`: each
    /// secret's MAC computed once, whatever the number of tags (at most
    /// [`MAX_SIGNATURES`] of them, each of a tag's length, are looked at), and compared in
    /// constant time.
    fn verify(&self, parts: &[&[u8]], tags: impl IntoIterator<Item = Vec<u8>>) -> bool {
        let tags: Vec<Vec<u8>> = tags
            .into_iter()
            .filter(|tag| tag.len() == TAG_BYTES)
            .take(MAX_SIGNATURES)
            .collect();
        if tags.is_empty() {
            return false;
        }
        let mut verified = subtle::Choice::from(0);
        for key in &self.0 {
            let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
            for part in parts {
                mac.update(part);
            }
            let expected = mac.finalize().into_bytes();
            for tag in &tags {
                verified |= expected.as_slice().ct_eq(tag);
            }
        }
        verified.into()
    }
}

/// The `webhook-signature` a Standard Webhooks sender puts on the message `id`, sent at
/// `timestamp` (Unix seconds) with `body`: `v1,<base64>` by each of `secrets`, space
/// separated (a receiver rotating its secret accepts either). What the gateway's own
/// settlement callbacks are signed with.
pub fn sign_standard(secrets: &Secrets, id: &str, timestamp: u64, body: &[u8]) -> String {
    let timestamp = timestamp.to_string();
    let content = [id.as_bytes(), b".", timestamp.as_bytes(), b".", body];
    let signatures: Vec<String> = secrets
        .0
        .iter()
        .map(|key| {
            let mut mac = HmacSha256::new_from_slice(key).expect("HMAC takes a key of any length");
            for part in content {
                mac.update(part);
            }
            format!("v1,{}", BASE64.encode(mac.finalize().into_bytes()))
        })
        .collect();
    signatures.join(" ")
}

/// Why a delivery was refused (the `reason` label of `idemgate_webhooks_rejected_total`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// A header the scheme needs is absent.
    Missing,
    /// The signature is malformed, or no secret made it.
    Invalid,
    /// Signed correctly, but its timestamp is further from now than the tolerance.
    Stale,
}

impl Rejection {
    pub fn reason(self) -> &'static str {
        match self {
            Self::Missing => "missing",
            Self::Invalid => "invalid",
            Self::Stale => "stale",
        }
    }

    /// What the reason means, for the sender's operator.
    pub fn explanation(self) -> &'static str {
        match self {
            Self::Missing => "a header its scheme signs with is absent",
            Self::Invalid => "it is malformed, or no secret of this route made it",
            Self::Stale => "its signed timestamp is outside the route's tolerance",
        }
    }
}

/// A delivery whose signature verified, and its key: `None` when the sender named none
/// (the gateway answers 400 `idempotency-key-missing`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Verified {
    pub key: Option<String>,
}

/// Verifies one delivery of `scheme`: its signature over `body` by one of `secrets`, and,
/// for the schemes that sign a timestamp, that the timestamp is within `tolerance` of
/// `now` either way. The signature is checked first, so `Stale` always names a delivery
/// that was genuinely signed.
pub fn verify(
    scheme: Scheme,
    secrets: &Secrets,
    headers: &HeaderMap,
    body: &[u8],
    now: SystemTime,
    tolerance: Duration,
) -> Result<Verified, Rejection> {
    let (signed_at, key) = match scheme {
        Scheme::StandardWebhooks => standard(secrets, headers, body)?,
        Scheme::Stripe => stripe(secrets, headers, body)?,
        Scheme::Github => github(secrets, headers, body)?,
    };
    if let Some(signed_at) = signed_at {
        let now = now.duration_since(UNIX_EPOCH).unwrap_or_default().as_secs();
        if now.abs_diff(signed_at) > tolerance.as_secs() {
            return Err(Rejection::Stale);
        }
    }
    Ok(Verified { key })
}

/// The value of the first of `names` present, as text.
fn header<'h>(headers: &'h HeaderMap, names: &[&str]) -> Result<&'h str, Rejection> {
    let value = names
        .iter()
        .find_map(|name| headers.get(*name))
        .ok_or(Rejection::Missing)?;
    value.to_str().map_err(|_| Rejection::Invalid)
}

fn standard(
    secrets: &Secrets,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(Option<u64>, Option<String>), Rejection> {
    let id = header(headers, &["webhook-id", "svix-id"])?;
    let timestamp = header(headers, &["webhook-timestamp", "svix-timestamp"])?;
    let signatures = header(headers, &["webhook-signature", "svix-signature"])?;
    let signed_at: u64 = timestamp.parse().map_err(|_| Rejection::Invalid)?;
    let content = [id.as_bytes(), b".", timestamp.as_bytes(), b".", body];
    let tags = signatures
        .split(' ')
        .filter_map(|s| s.strip_prefix("v1,"))
        .filter_map(|s| BASE64.decode(s).ok());
    let verified = secrets.verify(&content, tags);
    if !verified {
        return Err(Rejection::Invalid);
    }
    Ok((Some(signed_at), (!id.is_empty()).then(|| id.to_owned())))
}

fn stripe(
    secrets: &Secrets,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(Option<u64>, Option<String>), Rejection> {
    let signature = header(headers, &["stripe-signature"])?;
    let mut t = None;
    let mut v1 = Vec::new();
    for pair in signature.split(',') {
        match pair.trim().split_once('=') {
            Some(("t", value)) => t = Some(value),
            Some(("v1", value)) => v1.push(value),
            _ => {}
        }
    }
    let t = t.ok_or(Rejection::Invalid)?;
    let signed_at: u64 = t.parse().map_err(|_| Rejection::Invalid)?;
    let content = [t.as_bytes(), b".", body];
    let verified = secrets.verify(&content, v1.iter().filter_map(|s| hex::decode(s).ok()));
    if !verified {
        return Err(Rejection::Invalid);
    }
    Ok((Some(signed_at), event_id(body)))
}

/// A Stripe event's top-level `"id"`, if the body is a JSON object that has one.
fn event_id(body: &[u8]) -> Option<String> {
    #[derive(serde::Deserialize)]
    struct Event {
        id: Option<String>,
    }
    serde_json::from_slice::<Event>(body)
        .ok()?
        .id
        .filter(|id| !id.is_empty())
}

fn github(
    secrets: &Secrets,
    headers: &HeaderMap,
    body: &[u8],
) -> Result<(Option<u64>, Option<String>), Rejection> {
    let signature = header(headers, &["x-hub-signature-256"])?;
    let tag = signature
        .strip_prefix("sha256=")
        .and_then(|hex_tag| hex::decode(hex_tag).ok())
        .ok_or(Rejection::Invalid)?;
    if !secrets.verify(&[body], [tag]) {
        return Err(Rejection::Invalid);
    }
    let key = headers
        .get("x-github-delivery")
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty())
        .map(str::to_owned);
    Ok((None, key))
}

#[cfg(test)]
mod tests;
