//! Every way a token can be refused gets 401 with a Bearer challenge, and claims nothing.

mod common;

use std::time::{SystemTime, UNIX_EPOCH};

use common::*;
use http::StatusCode;
use jsonwebtoken::{Algorithm, EncodingKey, Header};
use serde_json::{Value, json};

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64
}

fn signed(claims: Value, secret: &str) -> String {
    jsonwebtoken::encode(
        &Header::new(Algorithm::HS256),
        &claims,
        &EncodingKey::from_secret(secret.as_bytes()).unwrap(),
    )
    .unwrap()
}

fn unsigned(claims: &Value) -> String {
    use std::fmt::Write;
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let b64 = |v: &Value| {
        let bytes = serde_json::to_vec(v).unwrap();
        let mut out = String::new();
        for chunk in bytes.chunks(3) {
            let n = chunk.iter().fold(0u32, |acc, &b| (acc << 8) | u32::from(b))
                << (8 * (3 - chunk.len()));
            for i in 0..=chunk.len() {
                out.write_char(A[((n >> (18 - 6 * i)) & 63) as usize] as char)
                    .unwrap();
            }
        }
        out
    };
    format!(
        "{}.{}.",
        b64(&json!({"alg": "none", "typ": "JWT"})),
        b64(claims)
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_refused_token_is_401_and_claims_nothing() {
    let (db, gw, http) = setup().await;
    let exp = now() + 300;
    let cases: Vec<(&str, Option<String>)> = vec![
        ("no Authorization header", None),
        (
            "not a bearer scheme",
            Some("Basic YWxhZGRpbjpvcGVuc2VzYW1l".into()),
        ),
        ("malformed token", Some("Bearer not.a.jwt".into())),
        (
            "expired",
            Some(format!(
                "Bearer {}",
                signed(json!({"tenant_id": "acme", "exp": now() - 5}), SECRET)
            )),
        ),
        (
            "not yet valid",
            Some(format!(
                "Bearer {}",
                signed(
                    json!({"tenant_id": "acme", "exp": exp, "nbf": now() + 120}),
                    SECRET
                )
            )),
        ),
        (
            "no exp",
            Some(format!(
                "Bearer {}",
                signed(json!({"tenant_id": "acme"}), SECRET)
            )),
        ),
        (
            "wrong secret",
            Some(format!(
                "Bearer {}",
                signed(
                    json!({"tenant_id": "acme", "exp": exp}),
                    "some-other-secret"
                )
            )),
        ),
        (
            "alg none",
            Some(format!(
                "Bearer {}",
                unsigned(&json!({"tenant_id": "acme", "exp": exp}))
            )),
        ),
        (
            "no tenant claim",
            Some(format!(
                "Bearer {}",
                signed(json!({"sub": "x", "exp": exp}), SECRET)
            )),
        ),
        (
            "tenant not a string",
            Some(format!(
                "Bearer {}",
                signed(json!({"tenant_id": 42, "exp": exp}), SECRET)
            )),
        ),
        (
            "empty tenant",
            Some(format!(
                "Bearer {}",
                signed(json!({"tenant_id": "", "exp": exp}), SECRET)
            )),
        ),
    ];
    for (case, authorization) in cases {
        let mut call = http
            .post(&gw.url("/payments"))
            .key(&new_key())
            .json(&payment("o", 1));
        if let Some(value) = &authorization {
            call = call.header("authorization", value);
        }
        let answer = call.send().await;
        assert_eq!(answer.status, StatusCode::UNAUTHORIZED, "{case}");
        assert_eq!(answer.problem(), "unauthorized", "{case}");
        let challenge = answer.header("www-authenticate").unwrap_or_default();
        assert!(challenge.starts_with("Bearer"), "{case}: {challenge:?}");
        assert!(
            !answer.json()["detail"].as_str().unwrap().contains("eyJ"),
            "{case}: no token echoed"
        );
    }
    let mut conn = db.connect().await;
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idempotency_keys")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(rows, 0, "nothing was claimed");
    let executed: i64 = sqlx::query_scalar("SELECT count(*) FROM demo_payments")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(executed, 0, "nothing reached the upstream");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_routes_are_authenticated_too() {
    let (_db, gw, _http) = setup().await;
    let answer = Http::default()
        .get(&gw.url("/payments/by-key/x"))
        .send()
        .await;
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
}
