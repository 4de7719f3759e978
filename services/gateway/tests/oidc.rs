//! Tokens from a real identity provider: OpenID Connect discovery and a JWKS URL,
//! key rotation without a restart, a provider that is down, floods of unknown key ids,
//! and a provider behind a private CA. The provider is `oidc-provider` from npm
//! (`libs/auth/tests/idp`), and every token comes from a real client-credentials request.

mod common;

use std::time::{Duration, Instant};

use common::*;
use http::StatusCode;

/// A gateway in front of the demo that trusts `auth` (`auth.*` keys, which may also
/// override the defaults here: a refresh every 2 s, a refetch at most once a second).
async fn gateway_trusting(db: &TestDb, demo: &Demo, auth: &[(&str, &str)]) -> Gateway {
    let mut cfg = TestConfig::new(db)
        .unset("auth.hs256_secret")
        .set("auth.audience", IDP_AUDIENCE)
        .set("auth.jwks_refresh", "2s")
        .set("auth.jwks_min_refetch", "1s");
    for (key, value) in auth {
        cfg = cfg.set(&format!("auth.{key}"), *value);
    }
    Gateway::start(config(cfg.payments(demo, |r| r))).await
}

async fn pay(http: &Http, gw: &Gateway, token: &str) -> Answer {
    http.post(&gw.url("/payments"))
        .bearer(token)
        .key(&new_key())
        .json(&payment("o-idp", 100))
        .send()
        .await
}

/// Waits (real time: the gateway fetches on its own schedule) until `/readyz` is 200.
async fn until_ready(http: &Http, gw: &Gateway, within: Duration) {
    let deadline = Instant::now() + within;
    loop {
        let ready = http.get(&gw.url("/readyz")).send().await;
        if ready.status == StatusCode::OK {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "not ready after {within:?}: {}",
            String::from_utf8_lossy(&ready.body)
        );
        // Real time: polling the gateway's own fetch schedule.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A 401 whose problem `detail` says `why`.
fn assert_refused(answer: &Answer, why: &str) {
    assert_eq!(answer.status, StatusCode::UNAUTHORIZED);
    let detail = answer.json()["detail"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    assert!(detail.contains(why), "{why:?} not in {detail:?}");
}

/// The fetched keys' counters (metrics are process-wide: in-process gateways share them).
fn keys_of(gw: &Gateway) -> idem_auth::RemoteStats {
    gw.state.auth.remote_stats().expect("a provider's keys")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn discovery_finds_the_keys_and_a_providers_token_pays() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let idp = Idp::start(&[]).await;
    let gw = gateway_trusting(&db, &demo, &[("oidc_issuer", &idp.url)]).await;
    let http = Http::default();
    until_ready(&http, &gw, Duration::from_secs(10)).await;

    let key = new_key();
    let paid = http
        .post(&gw.url("/payments"))
        .bearer(&idp.token("acme"))
        .key(&key)
        .json(&payment("o-idp", 100))
        .send()
        .await;
    assert_eq!(paid.status, StatusCode::CREATED, "{}", paid.problem());
    assert_eq!(
        db.executions("demo_payments", "acme", &key).await,
        1,
        "the tenant is the token's"
    );
    let other = pay(&http, &gw, &idp.token("globex")).await;
    assert_eq!(other.status, StatusCode::CREATED);

    // A token of another system (the shared test secret, HS256) is refused: the keys
    // pin their algorithm.
    let foreign = pay(&http, &gw, &token("acme")).await;
    assert_eq!(foreign.status, StatusCode::UNAUTHORIZED);
    assert!(keys_of(&gw).keys >= 1);
    let metrics = http.get(&gw.url("/metrics")).send().await;
    let metrics = String::from_utf8_lossy(&metrics.body);
    for name in [
        "idemgate_jwks_keys",
        "idemgate_jwks_fetches_total",
        "idemgate_jwks_refresh_errors_total",
        "idemgate_jwks_last_success_timestamp_seconds",
    ] {
        assert!(metric(&metrics, name).is_some(), "{name} in {metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_jwks_url_works_without_discovery() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let idp = Idp::start(&[]).await;
    let jwks = format!("{}/jwks", idp.url);
    let gw = gateway_trusting(&db, &demo, &[("jwks_url", &jwks), ("issuer", &idp.url)]).await;
    let http = Http::default();
    until_ready(&http, &gw, Duration::from_secs(10)).await;
    let paid = pay(&http, &gw, &idp.token("acme")).await;
    assert_eq!(paid.status, StatusCode::CREATED, "{}", paid.problem());

    // The same keys with another issuer configured: the provider's tokens are not for it.
    let other = gateway_trusting(
        &db,
        &demo,
        &[("jwks_url", &jwks), ("issuer", "https://other.example")],
    )
    .await;
    until_ready(&http, &other, Duration::from_secs(10)).await;
    let refused = pay(&http, &other, &idp.token("acme")).await;
    assert_refused(&refused, "issuer");
}

/// Private JWKS files for the provider, one per list of kids.
fn key_files(sets: &[&[&str]]) -> Vec<std::path::PathBuf> {
    let dir = std::env::temp_dir().join(format!("idemgate-keys-{}", uuid::Uuid::new_v4()));
    std::fs::create_dir_all(&dir).unwrap();
    sets.iter()
        .enumerate()
        .map(|(i, kids)| {
            let path = dir.join(format!("keys-{i}.json"));
            idp_keys(&path, kids);
            path
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_key_is_fetched_on_the_first_request_that_names_it() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let files = key_files(&[&["rsa-old"], &["rsa-new"]]);
    let mut idp = Idp::start(&[("IDP_JWKS_FILE", files[0].to_str().unwrap())]).await;
    // No refresh during the test: only the unknown kid can bring the new key in.
    let gw = gateway_trusting(
        &db,
        &demo,
        &[("oidc_issuer", &idp.url), ("jwks_refresh", "10m")],
    )
    .await;
    let http = Http::default();
    until_ready(&http, &gw, Duration::from_secs(10)).await;
    assert_eq!(
        pay(&http, &gw, &idp.token("acme")).await.status,
        StatusCode::CREATED
    );

    // The provider rotates: restarted with only the new key (its counters start over).
    idp.restart(&[("IDP_JWKS_FILE", files[1].to_str().unwrap())])
        .await;
    let signed_by_new = idp.token("acme");
    // Real time: a rotation comes long after the last fetch; here, past the 1 s
    // jwks_min_refetch at least (within it, an unknown kid is refused without a fetch).
    tokio::time::sleep(Duration::from_millis(1100)).await;
    assert_eq!(idp.jwks_fetches(), 0);
    let first = pay(&http, &gw, &signed_by_new).await;
    assert_eq!(
        first.status,
        StatusCode::CREATED,
        "the new kid is fetched on its first request: {}",
        first.problem()
    );
    assert_eq!(idp.jwks_fetches(), 1, "one fetch, by that request");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_the_provider_dropped_is_refused_after_the_next_refresh() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    // Tokens are signed by the first key of the file: rsa-old, then rsa-new alone.
    let files = key_files(&[&["rsa-old", "rsa-new"], &["rsa-new"]]);
    let mut idp = Idp::start(&[("IDP_JWKS_FILE", files[0].to_str().unwrap())]).await;
    let gw = gateway_trusting(&db, &demo, &[("oidc_issuer", &idp.url)]).await;
    let http = Http::default();
    until_ready(&http, &gw, Duration::from_secs(10)).await;
    let signed_by_old = idp.token("acme");
    assert_eq!(
        pay(&http, &gw, &signed_by_old).await.status,
        StatusCode::CREATED
    );

    idp.restart(&[("IDP_JWKS_FILE", files[1].to_str().unwrap())])
        .await;
    // Real time: wait for the gateway's own refresh (every 2 s), without a request.
    let deadline = Instant::now() + Duration::from_secs(8);
    while idp.jwks_fetches() == 0 {
        assert!(Instant::now() < deadline, "no refresh came");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // The token was verified and remembered before; its key is gone now.
    let refused = pay(&http, &gw, &signed_by_old).await;
    assert_refused(&refused, "key id");
    assert_eq!(
        pay(&http, &gw, &idp.token("acme")).await.status,
        StatusCode::CREATED
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_down_at_start_is_waited_for() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let port = free_port(false);
    let issuer = format!("http://127.0.0.1:{port}");
    let gw = gateway_trusting(&db, &demo, &[("oidc_issuer", &issuer)]).await;
    let http = Http::default();

    let ready = http.get(&gw.url("/readyz")).send().await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(ready.json()["auth_keys"], "not loaded yet");
    let refused = pay(&http, &gw, "a.b.c").await;
    assert_refused(&refused, "have not been loaded yet");

    let idp = Idp::start_on(port, &[]).await;
    until_ready(&http, &gw, Duration::from_secs(10)).await;
    let paid = pay(&http, &gw, &idp.token("acme")).await;
    assert_eq!(paid.status, StatusCode::CREATED, "{}", paid.problem());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_down_during_a_refresh_leaves_the_last_keys_in_use() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let mut idp = Idp::start(&[]).await;
    let gw = gateway_trusting(&db, &demo, &[("oidc_issuer", &idp.url)]).await;
    let http = Http::default();
    until_ready(&http, &gw, Duration::from_secs(10)).await;
    let unused = idp.token("acme"); // verified only after the provider is gone

    idp.kill().await;
    // Real time: past a refresh (every 2 s), which fails.
    tokio::time::sleep(Duration::from_millis(2600)).await;
    let paid = pay(&http, &gw, &unused).await;
    assert_eq!(paid.status, StatusCode::CREATED, "{}", paid.problem());
    let ready = http.get(&gw.url("/readyz")).send().await;
    assert_eq!(ready.status, StatusCode::OK);
    assert!(keys_of(&gw).refresh_errors >= 1, "{:?}", keys_of(&gw));
}

/// A token whose header names `kid`; its signature is never reached.
fn forged(kid: &str) -> String {
    let b64 = base64_url;
    let head = b64(&format!(r#"{{"alg":"RS256","typ":"JWT","kid":"{kid}"}}"#));
    let body = b64(r#"{"tenant_id":"mallory","exp":9999999999}"#);
    format!("{head}.{body}.c2lnbmF0dXJl")
}

fn base64_url(text: &str) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
    let bytes = text.as_bytes();
    let mut out = String::new();
    for chunk in bytes.chunks(3) {
        let n = chunk.iter().fold(0u32, |n, b| (n << 8) | u32::from(*b)) << (8 * (3 - chunk.len()));
        for i in 0..=chunk.len() {
            out.push(ALPHABET[((n >> (18 - 6 * i)) & 63) as usize] as char);
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_unknown_key_ids_costs_one_fetch() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let idp = Idp::start(&[]).await;
    // A long refresh: every fetch below is a refetch.
    let gw = gateway_trusting(
        &db,
        &demo,
        &[
            ("oidc_issuer", &idp.url),
            ("jwks_refresh", "10m"),
            ("jwks_min_refetch", "2s"),
        ],
    )
    .await;
    let http = Http::default();
    until_ready(&http, &gw, Duration::from_secs(10)).await;
    // Real time: past min_refetch, so the flood may fetch (once).
    tokio::time::sleep(Duration::from_millis(2100)).await;
    let before = idp.jwks_fetches();

    for _ in 0..2 {
        let flood: Vec<_> = (0..200)
            .map(|_| {
                let call = http
                    .post(&gw.url("/payments"))
                    .bearer(&forged(&uuid::Uuid::new_v4().to_string()))
                    .key(&new_key())
                    .json(&payment("o", 1))
                    .send();
                tokio::spawn(call)
            })
            .collect();
        for answer in flood {
            assert_eq!(answer.await.unwrap().status, StatusCode::UNAUTHORIZED);
        }
    }
    let fetched = idp.jwks_fetches() - before;
    assert_eq!(
        fetched, 1,
        "400 unknown kids, at most 2 s apart, cost {fetched} fetches"
    );
    let paid = pay(&http, &gw, &idp.token("acme")).await;
    assert_eq!(paid.status, StatusCode::CREATED, "the real keys still work");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_provider_behind_a_private_ca_is_trusted_with_ca_file_only() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let ca = ca();
    let idp = Idp::start_tls(&ca).await;
    assert!(idp.url.starts_with("https://"), "{}", idp.url);
    let root = ca.root.to_str().unwrap();
    let trusting =
        gateway_trusting(&db, &demo, &[("oidc_issuer", &idp.url), ("ca_file", root)]).await;
    let http = Http::default();
    until_ready(&http, &trusting, Duration::from_secs(10)).await;
    let paid = pay(&http, &trusting, &idp.token("acme")).await;
    assert_eq!(paid.status, StatusCode::CREATED, "{}", paid.problem());

    // Without the CA the provider's certificate is not trusted: never ready.
    let doubting = gateway_trusting(&db, &demo, &[("oidc_issuer", &idp.url)]).await;
    // Real time: the first fetch and a retry fail meanwhile.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let ready = http.get(&doubting.url("/readyz")).send().await;
    assert_eq!(ready.status, StatusCode::SERVICE_UNAVAILABLE);
    let keys = keys_of(&doubting);
    assert!(keys.refresh_errors >= 1 && keys.keys == 0, "{keys:?}");
}
