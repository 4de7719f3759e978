//! Signatures made by the senders' own code, checked here.
//!
//! - Standard Webhooks: `standardwebhooks` 1.3.0 from PyPI, the specification's own library:
//!   `Webhook(SECRET).sign("msg_2Kq9", datetime.fromtimestamp(1796650000, utc), BODY)`.
//! - Stripe: HMAC-SHA256 of `"{t}.{body}"` keyed by the secret as written, hex — as
//!   Stripe's "verify signatures manually" documentation says (Python `hmac`).
//! - GitHub: the example of GitHub's "validating webhook deliveries" documentation.

use super::*;

const STANDARD_SECRET: &str = "whsec_aWRlbWdhdGUtdGVzdC1zZWNyZXQtMDEyMzQ1Njc4OWFi";
const STANDARD_BODY: &[u8] = br#"{"type":"invoice.paid","data":{"amount":100}}"#;
const STANDARD_SIGNATURE: &str = "v1,52BdjoLID415+rRie6OY5FCOoLSszullLEGLbfYGCGw=";
const SIGNED_AT: u64 = 1_796_650_000;

const STRIPE_SECRET: &str = "whsec_stripe_test_secret";
const STRIPE_BODY: &[u8] =
    br#"{"id":"evt_1QaZ","object":"event","type":"payment_intent.succeeded"}"#;
const STRIPE_V1: &str = "95960846654c360a908bbb64d56c68172086eb6786e22adbe5f116522bd6a930";

const GITHUB_SECRET: &str = "It's a Secret to Everybody";
const GITHUB_BODY: &[u8] = b"Hello, World!";
const GITHUB_SIGNATURE: &str =
    "sha256=757107ea0eb2509fc211221cce984b8a37570b6d7586c22c46f4379c8b043e17";

const TOLERANCE: Duration = Duration::from_secs(300);

fn at(seconds: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_secs(seconds)
}

fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
    let mut map = HeaderMap::new();
    for (name, value) in pairs {
        map.append(*name, value.parse().unwrap());
    }
    map
}

fn secrets(scheme: Scheme, text: &str) -> Secrets {
    Secrets::parse(scheme, text).unwrap()
}

fn standard_headers(signature: &str) -> HeaderMap {
    let signed_at = SIGNED_AT.to_string();
    headers(&[
        ("webhook-id", "msg_2Kq9"),
        ("webhook-timestamp", &signed_at),
        ("webhook-signature", signature),
    ])
}

fn verify_standard(h: &HeaderMap, body: &[u8], now: u64) -> Result<Verified, Rejection> {
    let s = secrets(Scheme::StandardWebhooks, STANDARD_SECRET);
    verify(Scheme::StandardWebhooks, &s, h, body, at(now), TOLERANCE)
}

#[test]
fn a_standard_webhooks_delivery_signed_by_its_library_verifies_and_names_its_key() {
    let verified = verify_standard(
        &standard_headers(STANDARD_SIGNATURE),
        STANDARD_BODY,
        SIGNED_AT + 10,
    );
    assert_eq!(
        verified,
        Ok(Verified {
            key: Some("msg_2Kq9".into())
        })
    );
    // Svix's names for the same headers.
    let signed_at = SIGNED_AT.to_string();
    let svix = headers(&[
        ("svix-id", "msg_2Kq9"),
        ("svix-timestamp", &signed_at),
        ("svix-signature", STANDARD_SIGNATURE),
    ]);
    assert!(verify_standard(&svix, STANDARD_BODY, SIGNED_AT).is_ok());
    // Several signatures, one of them right (a sender mid-rotation signs with both).
    let several = format!("v1,AAAA v2,whatever {STANDARD_SIGNATURE}");
    assert!(verify_standard(&standard_headers(&several), STANDARD_BODY, SIGNED_AT).is_ok());
}

#[test]
fn the_gateways_own_signature_is_the_standard_webhooks_librarys() {
    let one = secrets(Scheme::StandardWebhooks, STANDARD_SECRET);
    assert_eq!(
        sign_standard(&one, "msg_2Kq9", SIGNED_AT, STANDARD_BODY),
        STANDARD_SIGNATURE
    );
    // Mid-rotation: signed by both, and the library's signature is one of them.
    let two = secrets(
        Scheme::StandardWebhooks,
        &format!("whsec_b3RoZXItc2VjcmV0LW9mLWF0LWxlYXN0LTI0LWJ5dGVz\n{STANDARD_SECRET}"),
    );
    let signed = sign_standard(&two, "msg_2Kq9", SIGNED_AT, STANDARD_BODY);
    assert_eq!(signed.split(' ').count(), 2);
    assert!(
        signed.split(' ').any(|s| s == STANDARD_SIGNATURE),
        "{signed}"
    );
}

#[test]
fn a_standard_webhooks_delivery_changed_unsigned_or_old_is_refused_with_its_reason() {
    let h = standard_headers(STANDARD_SIGNATURE);
    let changed = br#"{"type":"invoice.paid","data":{"amount":900}}"#;
    assert_eq!(
        verify_standard(&h, changed, SIGNED_AT),
        Err(Rejection::Invalid)
    );
    let mut unsigned = h.clone();
    unsigned.remove("webhook-signature");
    assert_eq!(
        verify_standard(&unsigned, STANDARD_BODY, SIGNED_AT),
        Err(Rejection::Missing)
    );
    let mut no_id = h.clone();
    no_id.remove("webhook-id");
    assert_eq!(
        verify_standard(&no_id, STANDARD_BODY, SIGNED_AT),
        Err(Rejection::Missing)
    );
    assert_eq!(
        verify_standard(
            &standard_headers("v1,not base64!"),
            STANDARD_BODY,
            SIGNED_AT
        ),
        Err(Rejection::Invalid)
    );
    // Within the tolerance either way, not past it.
    assert!(verify_standard(&h, STANDARD_BODY, SIGNED_AT + 300).is_ok());
    assert!(verify_standard(&h, STANDARD_BODY, SIGNED_AT - 300).is_ok());
    assert_eq!(
        verify_standard(&h, STANDARD_BODY, SIGNED_AT + 301),
        Err(Rejection::Stale)
    );
    assert_eq!(
        verify_standard(&h, STANDARD_BODY, SIGNED_AT - 301),
        Err(Rejection::Stale)
    );
    // A forged signature on an old timestamp is invalid, not stale.
    let forged = standard_headers("v1,52BdkoLID415+rRie6OY5FCOoLSszullLEGLbfYGCGw=");
    assert_eq!(
        verify_standard(&forged, STANDARD_BODY, SIGNED_AT + 3600),
        Err(Rejection::Invalid)
    );
}

#[test]
fn any_secret_of_a_rotated_file_verifies() {
    let other = "whsec_b3RoZXItc2VjcmV0LW9mLXRoZS1zYW1lLWxlbmd0aCE=";
    let h = standard_headers(STANDARD_SIGNATURE);
    let both = secrets(
        Scheme::StandardWebhooks,
        &format!("\n  {other}\n{STANDARD_SECRET}  \n\n"),
    );
    assert_eq!(both.len(), 2);
    let now = at(SIGNED_AT);
    assert!(
        verify(
            Scheme::StandardWebhooks,
            &both,
            &h,
            STANDARD_BODY,
            now,
            TOLERANCE
        )
        .is_ok()
    );
    let old_only = secrets(Scheme::StandardWebhooks, other);
    assert_eq!(
        verify(
            Scheme::StandardWebhooks,
            &old_only,
            &h,
            STANDARD_BODY,
            now,
            TOLERANCE
        ),
        Err(Rejection::Invalid)
    );
}

fn stripe_headers(value: &str) -> HeaderMap {
    headers(&[("stripe-signature", value)])
}

fn verify_stripe(h: &HeaderMap, body: &[u8], now: u64) -> Result<Verified, Rejection> {
    let s = secrets(Scheme::Stripe, STRIPE_SECRET);
    verify(Scheme::Stripe, &s, h, body, at(now), TOLERANCE)
}

#[test]
fn a_stripe_delivery_verifies_and_its_key_is_the_events_id() {
    let h = stripe_headers(&format!("t={SIGNED_AT},v1={STRIPE_V1},v0=ignored"));
    assert_eq!(
        verify_stripe(&h, STRIPE_BODY, SIGNED_AT + 5),
        Ok(Verified {
            key: Some("evt_1QaZ".into())
        })
    );
    // A second v1 (Stripe signs with each secret while one is rolled), the right one last.
    let h = stripe_headers(&format!(
        "t={SIGNED_AT},v1={},v1={STRIPE_V1}",
        "00".repeat(32)
    ));
    assert!(verify_stripe(&h, STRIPE_BODY, SIGNED_AT).is_ok());
}

#[test]
fn a_stripe_delivery_changed_unsigned_or_old_is_refused() {
    let h = stripe_headers(&format!("t={SIGNED_AT},v1={STRIPE_V1}"));
    let changed = br#"{"id":"evt_1QaZ","object":"event","type":"payment_intent.failed"}"#;
    assert_eq!(
        verify_stripe(&h, changed, SIGNED_AT),
        Err(Rejection::Invalid)
    );
    assert_eq!(
        verify_stripe(&HeaderMap::new(), STRIPE_BODY, SIGNED_AT),
        Err(Rejection::Missing)
    );
    assert_eq!(
        verify_stripe(
            &stripe_headers(&format!("v1={STRIPE_V1}")),
            STRIPE_BODY,
            SIGNED_AT
        ),
        Err(Rejection::Invalid),
        "no timestamp"
    );
    // The signature covers t: another t with the same v1 is refused.
    let moved = stripe_headers(&format!("t={},v1={STRIPE_V1}", SIGNED_AT + 1));
    assert_eq!(
        verify_stripe(&moved, STRIPE_BODY, SIGNED_AT),
        Err(Rejection::Invalid)
    );
    assert_eq!(
        verify_stripe(&h, STRIPE_BODY, SIGNED_AT + 301),
        Err(Rejection::Stale)
    );
}

#[test]
fn a_signed_stripe_delivery_without_an_event_id_has_no_key() {
    let s = secrets(Scheme::Stripe, STRIPE_SECRET);
    for body in [&br#"{"object":"event"}"#[..], b"not json", br#"{"id":""}"#] {
        let mut mac = HmacSha256::new_from_slice(STRIPE_SECRET.as_bytes()).unwrap();
        mac.update(format!("{SIGNED_AT}.").as_bytes());
        mac.update(body);
        let v1 = hex::encode(mac.finalize().into_bytes());
        let h = stripe_headers(&format!("t={SIGNED_AT},v1={v1}"));
        assert_eq!(
            verify(Scheme::Stripe, &s, &h, body, at(SIGNED_AT), TOLERANCE),
            Ok(Verified { key: None })
        );
    }
}

#[test]
fn githubs_documented_example_verifies_and_its_key_is_the_delivery_header() {
    let s = secrets(Scheme::Github, GITHUB_SECRET);
    let h = headers(&[
        ("x-hub-signature-256", GITHUB_SIGNATURE),
        ("x-github-delivery", "72d3162e-cc78-11e3-81ab-4c9367dc0958"),
    ]);
    // No timestamp is signed: no tolerance applies.
    let verified = verify(Scheme::Github, &s, &h, GITHUB_BODY, at(0), TOLERANCE);
    assert_eq!(
        verified,
        Ok(Verified {
            key: Some("72d3162e-cc78-11e3-81ab-4c9367dc0958".into())
        })
    );
    let now = at(SIGNED_AT);
    assert_eq!(
        verify(Scheme::Github, &s, &h, b"Hello, World?", now, TOLERANCE),
        Err(Rejection::Invalid)
    );
    let sha1 = headers(&[("x-hub-signature-256", "sha1=757107ea")]);
    assert_eq!(
        verify(Scheme::Github, &s, &sha1, GITHUB_BODY, now, TOLERANCE),
        Err(Rejection::Invalid)
    );
    assert_eq!(
        verify(
            Scheme::Github,
            &s,
            &HeaderMap::new(),
            GITHUB_BODY,
            now,
            TOLERANCE
        ),
        Err(Rejection::Missing)
    );
    let keyless = headers(&[("x-hub-signature-256", GITHUB_SIGNATURE)]);
    assert_eq!(
        verify(Scheme::Github, &s, &keyless, GITHUB_BODY, now, TOLERANCE),
        Ok(Verified { key: None })
    );
}

#[test]
fn a_secrets_file_must_hold_a_secret_in_the_schemes_form() {
    assert_eq!(
        Secrets::parse(Scheme::Github, " \n\n").unwrap_err(),
        SecretError::Empty
    );
    assert!(matches!(
        Secrets::parse(
            Scheme::StandardWebhooks,
            &format!("{STANDARD_SECRET}\nwhsec_@@@")
        ),
        Err(SecretError::NotBase64 { line: 2, .. })
    ));
    // The prefix may be left out.
    let bare = STANDARD_SECRET.trim_start_matches("whsec_");
    let s = secrets(Scheme::StandardWebhooks, bare);
    let h = standard_headers(STANDARD_SIGNATURE);
    assert!(
        verify(
            Scheme::StandardWebhooks,
            &s,
            &h,
            STANDARD_BODY,
            at(SIGNED_AT),
            TOLERANCE
        )
        .is_ok()
    );
    assert_eq!(format!("{s:?}"), "Secrets(1 redacted)");
}

#[test]
fn schemes_are_named_as_the_config_names_them() {
    for scheme in [Scheme::StandardWebhooks, Scheme::Stripe, Scheme::Github] {
        assert_eq!(scheme.as_str().parse::<Scheme>().unwrap(), scheme);
    }
    assert!("svix".parse::<Scheme>().is_err());
}

#[test]
fn a_short_secret_is_refused_and_a_header_stuffed_with_signatures_is_bounded() {
    for text in ["whsec_", "whsec_AA==", "short"] {
        let scheme = if text.starts_with("whsec_") {
            Scheme::StandardWebhooks
        } else {
            Scheme::Github
        };
        assert!(
            matches!(
                Secrets::parse(scheme, text),
                Err(SecretError::TooShort { line: 1, .. })
            ),
            "{text}"
        );
    }
    // The right signature among the first MAX_SIGNATURES of the right length counts;
    // past them it is not looked at.
    let wrong = format!("v1,{}", BASE64.encode([7u8; 32]));
    let within = format!(
        "{} {STANDARD_SIGNATURE}",
        [wrong.as_str(); MAX_SIGNATURES - 1].join(" ")
    );
    assert!(verify_standard(&standard_headers(&within), STANDARD_BODY, SIGNED_AT).is_ok());
    let beyond = format!(
        "{} {STANDARD_SIGNATURE}",
        [wrong.as_str(); MAX_SIGNATURES].join(" ")
    );
    assert_eq!(
        verify_standard(&standard_headers(&beyond), STANDARD_BODY, SIGNED_AT),
        Err(Rejection::Invalid)
    );
    // Tags of another length are not counted among them.
    let short = vec!["v1,AA=="; 1000].join(" ");
    let padded = format!("{short} {STANDARD_SIGNATURE}");
    assert!(verify_standard(&standard_headers(&padded), STANDARD_BODY, SIGNED_AT).is_ok());
}
