//! Token verification against real keys (fixtures made with `openssl`).

use std::path::PathBuf;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use idem_auth::{AuthConfig, AuthError, Authenticator, KeySourceError, Tenant};
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

const SECRET: &str = "test-secret-0123456789";

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn config() -> AuthConfig {
    AuthConfig {
        tenant_claim: "tenant_id".into(),
        hs256_secret: None,
        public_key_pem_file: None,
        jwks_file: None,
        jwks_url: None,
        oidc_issuer: None,
        jwks_refresh: Duration::from_secs(300),
        jwks_min_refetch: Duration::from_secs(30),
        ca_file: None,
        issuer: None,
        audience: None,
        allow_any_audience: false,
        leeway: Duration::ZERO,
    }
}

fn hs_config() -> AuthConfig {
    AuthConfig {
        hs256_secret: Some(SECRET.into()),
        ..config()
    }
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn claims(extra: Value) -> Value {
    let mut c = json!({"tenant_id": "acme", "exp": now() + 300});
    for (k, v) in extra.as_object().unwrap() {
        if v.is_null() {
            c.as_object_mut().unwrap().remove(k);
        } else {
            c[k] = v.clone();
        }
    }
    c
}

fn hs256(claims: &Value) -> String {
    sign(
        Header::new(Algorithm::HS256),
        claims,
        &EncodingKey::from_secret(SECRET.as_bytes()).unwrap(),
    )
}

fn sign(header: Header, claims: &Value, key: &EncodingKey) -> String {
    jsonwebtoken::encode(&header, claims, key).unwrap()
}

fn rsa_key() -> EncodingKey {
    EncodingKey::from_rsa_pem(&std::fs::read(fixture("rsa-private.pem")).unwrap()).unwrap()
}

fn ec_key() -> EncodingKey {
    EncodingKey::from_ec_pem(&std::fs::read(fixture("ec-private.pem")).unwrap()).unwrap()
}

fn b64(v: &Value) -> String {
    use std::fmt::Write;
    // base64url without padding, written out to avoid another dependency.
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let bytes = serde_json::to_vec(v).unwrap();
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n =
            chunk.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.write_char(A[((n >> (18 - 6 * i)) & 63) as usize] as char)
                .unwrap();
        }
    }
    out
}

#[test]
fn hs256_token_yields_its_tenant() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    assert_eq!(
        auth.verify(&hs256(&claims(json!({})))),
        Ok(Tenant("acme".into()))
    );
}

#[test]
fn the_tenant_claim_is_configurable_and_must_be_a_nonempty_string() {
    let auth = Authenticator::from_config(&AuthConfig {
        tenant_claim: "org".into(),
        ..hs_config()
    })
    .unwrap();
    assert_eq!(
        auth.verify(&hs256(&claims(json!({"org": "globex"})))),
        Ok(Tenant("globex".into()))
    );
    assert_eq!(
        auth.verify(&hs256(&claims(json!({})))),
        Err(AuthError::TenantMissing("org".into()))
    );
    for bad in [
        json!(""),
        json!(42),
        json!(["a"]),
        json!({"a": 1}),
        json!("has space"),
        json!("x".repeat(256)),
    ] {
        assert_eq!(
            auth.verify(&hs256(&claims(json!({"org": bad})))),
            Err(AuthError::TenantInvalid("org".into())),
            "{bad}"
        );
    }
}

#[test]
fn exp_is_required_and_enforced_without_the_default_leeway() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    assert_eq!(
        auth.verify(&hs256(&claims(json!({"exp": null})))),
        Err(AuthError::MissingClaim("exp".into()))
    );
    // jsonwebtoken's default leeway is 60 s: a token 5 s past exp must still fail here.
    assert_eq!(
        auth.verify(&hs256(&claims(json!({"exp": now() - 5})))),
        Err(AuthError::Expired)
    );
    // A non-numeric exp is no exp at all.
    assert!(matches!(
        auth.verify(&hs256(&claims(json!({"exp": "soon"})))),
        Err(AuthError::MissingClaim(_) | AuthError::BadClaim(_))
    ));
}

#[test]
fn leeway_is_configurable() {
    let auth = Authenticator::from_config(&AuthConfig {
        leeway: Duration::from_secs(30),
        ..hs_config()
    })
    .unwrap();
    assert!(
        auth.verify(&hs256(&claims(json!({"exp": now() - 5}))))
            .is_ok()
    );
    assert_eq!(
        auth.verify(&hs256(&claims(json!({"exp": now() - 60})))),
        Err(AuthError::Expired)
    );
}

#[test]
fn nbf_is_honoured() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    assert_eq!(
        auth.verify(&hs256(&claims(json!({"nbf": now() + 60})))),
        Err(AuthError::NotYetValid)
    );
    assert!(
        auth.verify(&hs256(&claims(json!({"nbf": now() - 1}))))
            .is_ok()
    );
}

#[test]
fn issuer_and_audience_are_required_when_configured() {
    let auth = Authenticator::from_config(&AuthConfig {
        issuer: Some("https://issuer.example".into()),
        audience: Some("idemgate".into()),
        ..hs_config()
    })
    .unwrap();
    let good = json!({"iss": "https://issuer.example", "aud": "idemgate"});
    assert!(auth.verify(&hs256(&claims(good))).is_ok());
    assert_eq!(
        auth.verify(&hs256(&claims(
            json!({"iss": "https://evil.example", "aud": "idemgate"})
        ))),
        Err(AuthError::Issuer)
    );
    assert_eq!(
        auth.verify(&hs256(&claims(
            json!({"iss": "https://issuer.example", "aud": "other"})
        ))),
        Err(AuthError::Audience)
    );
    assert_eq!(
        auth.verify(&hs256(&claims(json!({"aud": "idemgate"})))),
        Err(AuthError::MissingClaim("iss".into()))
    );
    assert_eq!(
        auth.verify(&hs256(&claims(json!({"iss": "https://issuer.example"})))),
        Err(AuthError::MissingClaim("aud".into()))
    );
}

#[test]
fn unconfigured_audience_is_not_judged() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    assert!(
        auth.verify(&hs256(&claims(json!({"aud": "someone-else"}))))
            .is_ok()
    );
}

#[test]
fn bad_signatures_and_garbage_are_refused() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    let other = sign(
        Header::new(Algorithm::HS256),
        &claims(json!({})),
        &EncodingKey::from_secret(b"another-secret-entirely").unwrap(),
    );
    assert_eq!(auth.verify(&other), Err(AuthError::BadSignature));
    for garbage in ["", "abc", "a.b.c", "a.b", "..."] {
        assert!(auth.verify(garbage).is_err(), "{garbage:?}");
    }
}

#[test]
fn alg_none_is_refused() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    let unsigned = format!(
        "{}.{}.",
        b64(&json!({"alg": "none", "typ": "JWT"})),
        b64(&claims(json!({})))
    );
    assert!(auth.verify(&unsigned).is_err());
}

#[test]
fn an_hs256_token_signed_with_the_public_key_is_refused_by_an_rsa_config() {
    let auth = Authenticator::from_config(&AuthConfig {
        public_key_pem_file: Some(fixture("rsa-public.pem")),
        ..config()
    })
    .unwrap();
    let public_pem = std::fs::read(fixture("rsa-public.pem")).unwrap();
    let confused = sign(
        Header::new(Algorithm::HS256),
        &claims(json!({})),
        &EncodingKey::from_secret(&public_pem).unwrap(),
    );
    assert_eq!(auth.verify(&confused), Err(AuthError::BadSignature));
    let genuine = sign(
        Header::new(Algorithm::RS256),
        &claims(json!({})),
        &rsa_key(),
    );
    assert_eq!(auth.verify(&genuine), Ok(Tenant("acme".into())));
}

#[test]
fn an_ec_public_key_pins_es256() {
    let auth = Authenticator::from_config(&AuthConfig {
        public_key_pem_file: Some(fixture("ec-public.pem")),
        ..config()
    })
    .unwrap();
    let genuine = sign(Header::new(Algorithm::ES256), &claims(json!({})), &ec_key());
    assert!(auth.verify(&genuine).is_ok());
    let rsa = sign(
        Header::new(Algorithm::RS256),
        &claims(json!({})),
        &rsa_key(),
    );
    assert_eq!(auth.verify(&rsa), Err(AuthError::BadSignature));
}

#[test]
fn jwks_selects_by_kid_and_refuses_unknown_kids() {
    let auth = Authenticator::from_config(&AuthConfig {
        jwks_file: Some(fixture("jwks.json")),
        ..config()
    })
    .unwrap();
    let kid = |k: &str, alg| {
        let mut h = Header::new(alg);
        h.kid = Some(k.into());
        h
    };
    assert!(
        auth.verify(&sign(
            kid("rsa-1", Algorithm::RS256),
            &claims(json!({})),
            &rsa_key()
        ))
        .is_ok()
    );
    assert!(
        auth.verify(&sign(
            kid("ec-1", Algorithm::ES256),
            &claims(json!({})),
            &ec_key()
        ))
        .is_ok()
    );
    assert_eq!(
        auth.verify(&sign(
            kid("rsa-2", Algorithm::RS256),
            &claims(json!({})),
            &rsa_key()
        )),
        Err(AuthError::UnknownKey)
    );
    // The right key id with the other key's signature.
    assert_eq!(
        auth.verify(&sign(
            kid("ec-1", Algorithm::RS256),
            &claims(json!({})),
            &rsa_key()
        )),
        Err(AuthError::BadSignature)
    );
    // Two keys: a token without kid cannot pick one.
    assert_eq!(
        auth.verify(&sign(
            Header::new(Algorithm::RS256),
            &claims(json!({})),
            &rsa_key()
        )),
        Err(AuthError::UnknownKey)
    );
}

#[test]
fn key_sources_are_checked_at_start_up() {
    assert!(matches!(
        Authenticator::from_config(&config()),
        Err(KeySourceError::NoSource)
    ));
    let both = AuthConfig {
        jwks_file: Some(fixture("jwks.json")),
        ..hs_config()
    };
    assert!(matches!(
        Authenticator::from_config(&both),
        Err(KeySourceError::SeveralSources)
    ));
    let missing = AuthConfig {
        public_key_pem_file: Some(fixture("nope.pem")),
        ..config()
    };
    let err = Authenticator::from_config(&missing)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("auth.public_key_pem_file:"), "{err}");
    let not_a_key = AuthConfig {
        jwks_file: Some(fixture("rsa-public.pem")),
        ..config()
    };
    let err = Authenticator::from_config(&not_a_key)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("auth.jwks_file:"), "{err}");
    let short = AuthConfig {
        hs256_secret: Some("short".into()),
        ..config()
    };
    let err = Authenticator::from_config(&short).unwrap_err().to_string();
    assert!(err.starts_with("auth.hs256_secret:"), "{err}");
}

#[test]
fn minted_dev_tokens_verify() {
    let cfg = AuthConfig {
        issuer: Some("https://issuer.example".into()),
        audience: Some("idemgate".into()),
        ..hs_config()
    };
    let auth = Authenticator::from_config(&cfg).unwrap();
    let token = idem_auth::mint_hs256(
        cfg.hs256_secret.as_ref().unwrap(),
        "tenant_id",
        "acme",
        Duration::from_secs(60),
        cfg.issuer.as_deref(),
        cfg.audience.as_deref(),
    )
    .unwrap();
    assert_eq!(auth.verify(&token), Ok(Tenant("acme".into())));
}

#[test]
fn a_remembered_token_still_expires() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    let token = hs256(&claims(json!({"exp": now() + 2})));
    assert!(auth.verify(&token).is_ok());
    assert!(auth.verify(&token).is_ok(), "served from memory");
    // Real time: a token's exp is judged by the system clock, in whole seconds.
    std::thread::sleep(Duration::from_millis(3100));
    assert_eq!(auth.verify(&token), Err(AuthError::Expired));
}

#[test]
fn a_refused_token_is_not_remembered_as_good() {
    let auth = Authenticator::from_config(&hs_config()).unwrap();
    let forged = sign(
        Header::new(Algorithm::HS256),
        &claims(json!({})),
        &EncodingKey::from_secret(b"another-secret-entirely").unwrap(),
    );
    for _ in 0..2 {
        assert_eq!(auth.verify(&forged), Err(AuthError::BadSignature));
    }
}
