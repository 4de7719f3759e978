//! Webhook routes (docs/webhooks.md) through real HTTP against a gateway process and real
//! Postgres, each delivery signed the way its sender signs it (`webhooks/sign.py`: the
//! Standard Webhooks library from PyPI; Stripe's and GitHub's formats as their docs
//! compute them).

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use common::*;
use http::StatusCode;

const STANDARD_SECRET: &str = "whsec_aWRlbWdhdGUtdGVzdC1zZWNyZXQtMDEyMzQ1Njc4OWFi";
const OTHER_SECRET: &str = "whsec_b3RoZXItc2VjcmV0LW9mLXRoZS1zYW1lLWxlbmd0aCE=";

/// A fresh Standard Webhooks message id.
fn msg_id() -> String {
    format!("msg_{}", uuid::Uuid::new_v4().simple())
}

fn now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

/// The headers `scheme`'s sender puts on a delivery of `body`, signed with `secret` at
/// `timestamp`.
fn signed(
    scheme: &str,
    secret: &str,
    id: &str,
    timestamp: u64,
    body: &str,
) -> Vec<(String, String)> {
    use std::io::Write;
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/webhooks/sign.py");
    let mut child = std::process::Command::new("python3")
        .arg(script)
        .args([scheme, secret, id, &timestamp.to_string()])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("python3 runs the senders' signing code");
    child
        .stdin
        .take()
        .unwrap()
        .write_all(body.as_bytes())
        .unwrap();
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "signing failed (pip install standardwebhooks): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let headers: serde_json::Map<String, serde_json::Value> =
        serde_json::from_slice(&out.stdout).unwrap();
    headers
        .into_iter()
        .map(|(k, v)| (k, v.as_str().unwrap().to_owned()))
        .collect()
}

/// A directory of the test's own holding `files` (name, text).
fn secrets_dir(files: &[(&str, &str)]) -> PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "idemgate-webhooks-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    for (name, text) in files {
        std::fs::write(dir.join(name), text).unwrap();
    }
    dir
}

/// A Standard Webhooks route at `path` to `upstream`, every delivery for the tenant acme,
/// its secrets in `file`.
fn acme_route(path: &str, upstream: &TestUpstream, file: &Path) -> Route {
    Route::idempotent("POST", path, &upstream.url()).webhook(&[
        ("scheme", "standard-webhooks"),
        ("secret_file", &file.display().to_string()),
        ("tenant", "acme"),
    ])
}

/// A gateway with one webhook route, `path` to `upstream`, `[routes.webhook]` as given.
async fn gateway(
    db: &TestDb,
    upstream: &TestUpstream,
    path: &str,
    webhook: &[(&str, &str)],
) -> GatewayProcess {
    let config = TestConfig::new(db)
        .route(Route::idempotent("POST", path, &upstream.url()).webhook(webhook));
    GatewayProcess::start(&config.toml()).await
}

/// A gateway with a Standard Webhooks route `/webhooks/billing` for the tenant acme, its
/// secrets file holding [`STANDARD_SECRET`] (returned, for rotation), and `extra` keys.
async fn billing(
    db: &TestDb,
    upstream: &TestUpstream,
    extra: &[(&str, &str)],
) -> (GatewayProcess, PathBuf) {
    let file = secrets_dir(&[("billing", STANDARD_SECRET)]).join("billing");
    let path = file.display().to_string();
    let mut webhook = vec![
        ("scheme", "standard-webhooks"),
        ("secret_file", path.as_str()),
        ("tenant", "acme"),
    ];
    webhook.extend_from_slice(extra);
    (
        gateway(db, upstream, "/webhooks/billing", &webhook).await,
        file,
    )
}

async fn deliver(http: &Http, url: &str, headers: &[(String, String)], body: &str) -> Answer {
    let mut call = http.post(url).body(body.to_owned());
    for (name, value) in headers {
        call = call.header(name, value);
    }
    call.send().await
}

async fn rows(db: &TestDb, key: &str) -> i64 {
    let mut conn = db.connect().await;
    sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE key = $1")
        .bind(key)
        .fetch_one(&mut conn)
        .await
        .unwrap()
}

async fn scrape(http: &Http, gw: &GatewayProcess, name: &str) -> f64 {
    let answer = http.get(&gw.url("/metrics")).send().await;
    metric(std::str::from_utf8(&answer.body).unwrap(), name).unwrap_or(0.0)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_delivery_executes_once_and_every_resigned_redelivery_replays_it() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let (gw, _) = billing(&db, &upstream, &[]).await;
    let http = Http::default();
    let id = msg_id();
    let body = r#"{"type":"invoice.paid","amount":100}"#;
    let url = gw.url("/webhooks/billing");

    let first = deliver(
        &http,
        &url,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), body),
        body,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    assert!(!first.replayed());
    // The provider redelivers: the same id and body, signed again a moment later.
    for later in 1..=3 {
        let again = signed(
            "standard-webhooks",
            STANDARD_SECRET,
            &id,
            now() + later,
            body,
        );
        let replay = deliver(&http, &url, &again, body).await;
        assert_eq!(replay.status, StatusCode::CREATED);
        assert!(replay.replayed(), "redelivery {later} replays");
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(upstream.calls(), 1, "executed once");
    let tenant: String =
        sqlx::query_scalar("SELECT tenant_id FROM idempotency_keys WHERE key = $1")
            .bind(&id)
            .fetch_one(&mut db.connect().await)
            .await
            .unwrap();
    assert_eq!(tenant, "acme");
    // An Idempotency-Key sent beside the signature is ignored: the event id is the key.
    let other_key = signed("standard-webhooks", STANDARD_SECRET, &id, now(), body);
    let mut with_key = other_key.clone();
    with_key.push(("idempotency-key".into(), new_key()));
    assert!(deliver(&http, &url, &with_key, body).await.replayed());
    // The same id with another body is a mismatch, and executes nothing.
    let other = r#"{"type":"invoice.paid","amount":900}"#;
    let mismatch = deliver(
        &http,
        &url,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), other),
        other,
    )
    .await;
    assert_eq!(
        mismatch.problem(),
        "idempotency-key-reused",
        "{:?}",
        mismatch.body
    );
    assert_eq!(upstream.calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_wrong_missing_or_stale_signature_is_401_and_claims_nothing() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let (gw, _) = billing(&db, &upstream, &[("tolerance", "5m")]).await;
    let http = Http::default();
    let url = gw.url("/webhooks/billing");
    let body = r#"{"type":"invoice.paid"}"#;
    let id = msg_id();
    let good = signed("standard-webhooks", STANDARD_SECRET, &id, now(), body);
    let unsigned: Vec<_> = good
        .iter()
        .filter(|(k, _)| k != "webhook-signature")
        .cloned()
        .collect();
    let cases = [
        (
            "wrong secret",
            signed("standard-webhooks", OTHER_SECRET, &id, now(), body),
            body,
            "invalid",
        ),
        ("no signature", unsigned, body, "missing"),
        (
            "stale",
            signed("standard-webhooks", STANDARD_SECRET, &id, now() - 600, body),
            body,
            "stale",
        ),
        (
            "from the future",
            signed("standard-webhooks", STANDARD_SECRET, &id, now() + 600, body),
            body,
            "stale",
        ),
        (
            "another body",
            good.clone(),
            r#"{"type":"invoice.void"}"#,
            "invalid",
        ),
    ];
    for (what, headers, sent, reason) in &cases {
        let refused = deliver(&http, &url, headers, sent).await;
        assert_eq!(
            refused.status,
            StatusCode::UNAUTHORIZED,
            "{what}: {:?}",
            refused.body
        );
        assert_eq!(refused.problem(), "webhook-signature-invalid", "{what}");
        assert!(
            refused.json()["detail"].as_str().unwrap().contains(reason),
            "{what}: {:?}",
            refused.body
        );
    }
    assert_eq!(upstream.calls(), 0, "nothing reached the upstream");
    assert_eq!(rows(&db, &id).await, 0, "nothing was claimed");
    for (reason, n) in [("invalid", 2.0), ("missing", 1.0), ("stale", 2.0)] {
        let counted = scrape(
            &http,
            &gw,
            &format!("idemgate_webhooks_rejected_total{{reason=\"{reason}\"}}"),
        )
        .await;
        assert_eq!(counted, n, "rejections counted as {reason}");
    }
    // No bearer token is asked for, and the genuine delivery then goes through.
    let ok = deliver(&http, &url, &good, body).await;
    assert_eq!(ok.status, StatusCode::CREATED, "{:?}", ok.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_deliveries_with_one_event_id_are_two_operations() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let dir = secrets_dir(&[("acme", STANDARD_SECRET), ("globex", OTHER_SECRET)]);
    let gw = gateway(
        &db,
        &upstream,
        "/webhooks/{tenant}/billing",
        &[
            ("scheme", "standard-webhooks"),
            ("secret_dir", &dir.display().to_string()),
        ],
    )
    .await;
    let http = Http::default();
    let id = msg_id();
    let body = r#"{"type":"invoice.paid"}"#;
    for (tenant, secret) in [("acme", STANDARD_SECRET), ("globex", OTHER_SECRET)] {
        let url = gw.url(&format!("/webhooks/{tenant}/billing"));
        let answer = deliver(
            &http,
            &url,
            &signed("standard-webhooks", secret, &id, now(), body),
            body,
        )
        .await;
        assert_eq!(
            answer.status,
            StatusCode::CREATED,
            "{tenant}: {:?}",
            answer.body
        );
        assert!(
            !answer.replayed(),
            "{tenant}'s delivery is its own operation"
        );
        // Each tenant's secret is its own: acme's secret does not sign for globex.
    }
    assert_eq!(upstream.calls(), 2);
    assert_eq!(rows(&db, &id).await, 2);
    let crossed = gw.url("/webhooks/globex/billing");
    let refused = deliver(
        &http,
        &crossed,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), body),
        body,
    )
    .await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    // A tenant with no secrets file verifies nothing.
    let unknown = gw.url("/webhooks/initech/billing");
    let refused = deliver(
        &http,
        &unknown,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), body),
        body,
    )
    .await;
    assert_eq!(refused.status, StatusCode::UNAUTHORIZED);
    assert_eq!(upstream.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rotated_secret_verifies_old_and_new_senders_without_a_restart() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let (gw, file) = billing(&db, &upstream, &[]).await;
    let http = Http::default();
    let url = gw.url("/webhooks/billing");
    let body = r#"{"type":"invoice.paid"}"#;
    let send = |secret: &'static str| {
        let id = msg_id();
        let headers = signed("standard-webhooks", secret, &id, now(), body);
        let (http, url) = (http.clone(), url.clone());
        async move { deliver(&http, &url, &headers, body).await.status }
    };
    assert_eq!(send(STANDARD_SECRET).await, StatusCode::CREATED);
    assert_eq!(
        send(OTHER_SECRET).await,
        StatusCode::UNAUTHORIZED,
        "not yet a secret of the route"
    );
    // The new secret added beside the old one: both senders verify.
    std::fs::write(&file, format!("{STANDARD_SECRET}\n{OTHER_SECRET}\n")).unwrap();
    assert_eq!(send(OTHER_SECRET).await, StatusCode::CREATED);
    assert_eq!(send(STANDARD_SECRET).await, StatusCode::CREATED);
    // The old one removed: only the new sender verifies.
    std::fs::write(&file, format!("{OTHER_SECRET}\n")).unwrap();
    assert_eq!(send(STANDARD_SECRET).await, StatusCode::UNAUTHORIZED);
    assert_eq!(send(OTHER_SECRET).await, StatusCode::CREATED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stripe_and_github_deliveries_are_keyed_by_their_event_ids() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let stripe_secret = "whsec_stripe_test_secret";
    let github_secret = "github-test-secret";
    let dir = secrets_dir(&[("stripe", stripe_secret), ("github", github_secret)]);
    let config = TestConfig::new(&db)
        .route(
            Route::idempotent("POST", "/webhooks/stripe", &upstream.url()).webhook(&[
                ("scheme", "stripe"),
                ("secret_file", &dir.join("stripe").display().to_string()),
                ("tenant", "acme"),
            ]),
        )
        .route(
            Route::idempotent("POST", "/webhooks/github", &upstream.url()).webhook(&[
                ("scheme", "github"),
                ("secret_file", &dir.join("github").display().to_string()),
                ("tenant", "acme"),
            ]),
        );
    let gw = GatewayProcess::start(&config.toml()).await;
    let http = Http::default();

    let event = format!("evt_{}", uuid::Uuid::new_v4().simple());
    let body = format!(r#"{{"id":"{event}","object":"event","type":"payment_intent.succeeded"}}"#);
    let url = gw.url("/webhooks/stripe");
    let first = deliver(
        &http,
        &url,
        &signed("stripe", stripe_secret, "-", now(), &body),
        &body,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    let replay = deliver(
        &http,
        &url,
        &signed("stripe", stripe_secret, "-", now() + 2, &body),
        &body,
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(rows(&db, &event).await, 1, "keyed by the event's id");
    // Signed, but no event id in the body: 400, nothing claimed.
    let keyless = r#"{"object":"event"}"#;
    let answer = deliver(
        &http,
        &url,
        &signed("stripe", stripe_secret, "-", now(), keyless),
        keyless,
    )
    .await;
    assert_eq!(answer.status, StatusCode::BAD_REQUEST);
    assert_eq!(answer.problem(), "idempotency-key-missing");

    let delivery = uuid::Uuid::new_v4().to_string();
    let body = r#"{"action":"opened","number":7}"#;
    let url = gw.url("/webhooks/github");
    let first = deliver(
        &http,
        &url,
        &signed("github", github_secret, &delivery, 0, body),
        body,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    let replay = deliver(
        &http,
        &url,
        &signed("github", github_secret, &delivery, 0, body),
        body,
    )
    .await;
    assert!(replay.replayed());
    assert_eq!(rows(&db, &delivery).await, 1);
    let forged = deliver(
        &http,
        &url,
        &signed("github", "not-the-secret", &delivery, 0, body),
        body,
    )
    .await;
    assert_eq!(forged.status, StatusCode::UNAUTHORIZED);
    assert_eq!(upstream.calls(), 2, "one execution per event");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivery_while_the_first_runs_is_409_with_retry_after() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let (gw, _) = billing(&db, &upstream, &[]).await;
    let http = Http::default();
    let url = gw.url("/webhooks/billing");
    let id = msg_id();
    let body = r#"{"type":"invoice.paid"}"#;
    let mut slow = signed("standard-webhooks", STANDARD_SECRET, &id, now(), body);
    slow.push(("x-test-delay-ms".into(), "1500".into()));
    let first = in_flight(
        {
            let (http, url) = (http.clone(), url.clone());
            async move { deliver(&http, &url, &slow, body).await }
        },
        Duration::from_millis(300),
    )
    .await;
    let again = signed("standard-webhooks", STANDARD_SECRET, &id, now() + 1, body);
    let busy = deliver(&http, &url, &again, body).await;
    assert_eq!(busy.status, StatusCode::CONFLICT, "{:?}", busy.body);
    assert_eq!(busy.problem(), "idempotency-key-in-progress");
    assert!(busy.header("retry-after").is_some());
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(upstream.calls(), 1);
}

/// A `{tenant}` template can match one of idemgate's own paths (`/{tenant}/v1/keys` matches
/// `/_idemgate/v1/keys`): the lookup API there still takes its tenant from a token only.
/// (Found in review: the webhook route's tenant, taken from the path with no signature
/// checked yet, answered the lookup.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemgates_own_paths_never_take_a_webhook_routes_tenant() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let dir = secrets_dir(&[("_idemgate", "a-github-secret-of-some-length")]);
    let config = TestConfig::new(&db).route(
        Route::idempotent("GET", "/{tenant}/v1/keys", &upstream.url()).webhook(&[
            ("scheme", "github"),
            ("secret_dir", &dir.display().to_string()),
        ]),
    );
    let gw = GatewayProcess::start(&config.toml()).await;
    let lookup = Http::default()
        .get(&gw.url("/_idemgate/v1/keys"))
        .send()
        .await;
    assert_eq!(lookup.status, StatusCode::UNAUTHORIZED, "{:?}", lookup.body);
    assert_eq!(lookup.problem(), "unauthorized");
}

/// Any other path under idemgate's own is no route's either, whoever asks: a token does
/// not reach a webhook route's receiver unsigned there. (Found in review of 1c4f8d1: a
/// `{tenant}` webhook template matched `/_idemgate/events`, and a request with a token
/// was proxied to the receiver without a signature — "left: 201, right: 404".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idemgates_own_paths_are_no_routes() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let dir = secrets_dir(&[("_idemgate", STANDARD_SECRET)]);
    let gw = gateway(
        &db,
        &upstream,
        "/{tenant}/events",
        &[
            ("scheme", "standard-webhooks"),
            ("secret_dir", &dir.display().to_string()),
        ],
    )
    .await;
    let http = Http::default();
    let tokened = http
        .post(&gw.url("/_idemgate/events"))
        .tenant("acme")
        .json("{}")
        .send()
        .await;
    assert_eq!(tokened.status, StatusCode::NOT_FOUND, "{:?}", tokened.body);
    let body = r#"{"type":"invoice.paid"}"#;
    let signed = deliver(
        &http,
        &gw.url("/_idemgate/events"),
        &signed("standard-webhooks", STANDARD_SECRET, &msg_id(), now(), body),
        body,
    )
    .await;
    assert_ne!(signed.status.as_u16() / 100, 2, "{:?}", signed.body);
    assert_eq!(upstream.calls(), 0);
}

/// A delivery spends its tenant's quota once its signature has proved its sender, as a
/// client's request does once its token has: a flood of unsigned requests is refused 401
/// and leaves the tenant's real deliveries their quota. (On 8efe06f the quota was spent
/// first: the second unsigned request was "429 tenant-rate-limited", and so was the
/// genuine delivery after them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsigned_requests_never_spend_the_tenants_quota() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let file = secrets_dir(&[("billing", STANDARD_SECRET)]).join("billing");
    let config = TestConfig::new(&db)
        .set("tenants.acme.rate", "1/s")
        .route(acme_route("/webhooks/billing", &upstream, &file));
    let gw = GatewayProcess::start(&config.toml()).await;
    let http = Http::default();
    let url = gw.url("/webhooks/billing");
    let body = r#"{"type":"invoice.paid"}"#;
    for _ in 0..5 {
        let id = msg_id();
        let forged = deliver(
            &http,
            &url,
            &signed("standard-webhooks", OTHER_SECRET, &id, now(), body),
            body,
        )
        .await;
        assert_eq!(forged.status, StatusCode::UNAUTHORIZED, "{:?}", forged.body);
    }
    let id = msg_id();
    let genuine = deliver(
        &http,
        &url,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), body),
        body,
    )
    .await;
    assert_eq!(genuine.status, StatusCode::CREATED, "{:?}", genuine.body);
    // The quota holds for signed deliveries.
    let id = msg_id();
    let next = deliver(
        &http,
        &url,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), body),
        body,
    )
    .await;
    assert_eq!(next.problem(), "tenant-rate-limited", "{:?}", next.body);
}

// ---- A webhook route never loses an event (docs/webhooks.md) ----

/// Opens a connection that sends a delivery's head to `path` and the first byte of a
/// `length`-byte body, then nothing more: an unsigned sender trickling its body.
async fn trickler(gw: &GatewayProcess, path: &str, length: usize) -> tokio::net::TcpStream {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n\
         webhook-id: {}\r\nwebhook-timestamp: {}\r\nwebhook-signature: v1,AAAA\r\n\
         Content-Length: {length}\r\n\r\n{{",
        msg_id(),
        now()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream
}

/// Unsigned senders trickling their bodies to one webhook route, more of them than
/// `server.max_concurrent_requests`, hold none of its slots: another tenant's payment and
/// a genuine delivery to another webhook route are served meanwhile, and past the route's
/// own `max_unverified` only that route says 503. (On 5336c16 the payment was
/// "503 overloaded": the tricklers held every global slot while their bodies were read.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unsigned_tricklers_never_take_other_routes_or_tenants_places() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let dir = secrets_dir(&[("billing", STANDARD_SECRET), ("orders", OTHER_SECRET)]);
    let config = TestConfig::new(&db)
        .set("server.max_concurrent_requests", 8)
        .route(Route::idempotent("POST", "/payments", &upstream.url()))
        .route(
            acme_route("/webhooks/billing", &upstream, &dir.join("billing"))
                .webhook_set("max_unverified", 12),
        )
        .route(acme_route(
            "/webhooks/orders",
            &upstream,
            &dir.join("orders"),
        ));
    let gw = GatewayProcess::start(&config.toml()).await;
    let mut tricklers = Vec::new();
    for _ in 0..12 {
        tricklers.push(trickler(&gw, "/webhooks/billing", 1000).await);
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let http = Http::default();

    let payment = http
        .pay(&gw.url("/payments"), "globex", &new_key(), "{}")
        .send()
        .await;
    assert_eq!(payment.status, StatusCode::CREATED, "{:?}", payment.body);
    let body = r#"{"type":"order.paid"}"#;
    let genuine = deliver(
        &http,
        &gw.url("/webhooks/orders"),
        &signed("standard-webhooks", OTHER_SECRET, &msg_id(), now(), body),
        body,
    )
    .await;
    assert_eq!(genuine.status, StatusCode::CREATED, "{:?}", genuine.body);
    // The route's own bound: a thirteenth unverified body on it is refused at once.
    let beyond = deliver(
        &http,
        &gw.url("/webhooks/billing"),
        &signed("standard-webhooks", STANDARD_SECRET, &msg_id(), now(), body),
        body,
    )
    .await;
    assert_eq!(beyond.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(beyond.problem(), "overloaded");
    assert!(beyond.header("retry-after").is_some());
    drop(tricklers);
    // Once they are gone, the route takes deliveries again.
    let mut answered = StatusCode::SERVICE_UNAVAILABLE;
    for _ in 0..50 {
        let again = deliver(
            &http,
            &gw.url("/webhooks/billing"),
            &signed("standard-webhooks", STANDARD_SECRET, &msg_id(), now(), body),
            body,
        )
        .await;
        answered = again.status;
        if answered != StatusCode::SERVICE_UNAVAILABLE {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(answered, StatusCode::CREATED);
}

/// An unverified body is bounded by the route's `max_body_bytes` and
/// `body_read_timeout`, not by the tenant's or the server's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unverified_body_is_bounded_by_the_routes_own_limits() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let file = secrets_dir(&[("billing", STANDARD_SECRET)]).join("billing");
    let config = TestConfig::new(&db).route(
        acme_route("/webhooks/billing", &upstream, &file)
            .webhook_set("body_read_timeout", "300ms")
            .webhook_set("max_body_bytes", 64),
    );
    let gw = GatewayProcess::start(&config.toml()).await;
    let http = Http::default();
    let big = format!(r#"{{"pad":"{}"}}"#, "x".repeat(100));
    let refused = deliver(
        &http,
        &gw.url("/webhooks/billing"),
        &signed("standard-webhooks", STANDARD_SECRET, &msg_id(), now(), &big),
        &big,
    )
    .await;
    assert_eq!(
        refused.status,
        StatusCode::PAYLOAD_TOO_LARGE,
        "{:?}",
        refused.body
    );
    let mut slow = trickler(&gw, "/webhooks/billing", 60).await;
    let started = std::time::Instant::now();
    let answer = read_answer(&mut slow).await.expect("answered");
    assert_eq!(answer.status(), 408, "{answer:?}");
    assert!(started.elapsed() < Duration::from_secs(3));
    assert_eq!(upstream.calls(), 0);
}

/// A tenant's ttl below 72 h does not shorten a webhook route's: a redelivery past the
/// tenant's ttl still replays. (On 5336c16 it executed again: "left: 2, right: 1".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_short_ttl_never_shortens_a_webhook_routes() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let file = secrets_dir(&[("billing", STANDARD_SECRET)]).join("billing");
    let config = TestConfig::new(&db)
        .set("tenants.acme.ttl", "3s")
        .set("tenants.acme.lease", "3s")
        .route(acme_route("/webhooks/billing", &upstream, &file).set("timeout", "500ms"));
    let gw = GatewayProcess::start(&config.toml()).await;
    let http = Http::default();
    let url = gw.url("/webhooks/billing");
    let id = msg_id();
    let body = r#"{"type":"invoice.paid"}"#;
    let first = deliver(
        &http,
        &url,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), body),
        body,
    )
    .await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    tokio::time::sleep(Duration::from_secs(4)).await;
    let later = deliver(
        &http,
        &url,
        &signed("standard-webhooks", STANDARD_SECRET, &id, now(), body),
        body,
    )
    .await;
    assert_eq!(upstream.calls(), 1, "the redelivery past the tenant's ttl");
    assert!(later.replayed());
    let kept: bool = sqlx::query_scalar(
        "SELECT expires_at > now() + interval '71 hours' FROM idempotency_keys WHERE key = $1",
    )
    .bind(&id)
    .fetch_one(&mut db.connect().await)
    .await
    .unwrap();
    assert!(kept, "kept for the route's 72 h");
}

/// A receiver's answered 5xx is not stored: the provider's redelivery runs the event
/// again and is answered 2xx; a timeout stays an unknown outcome, held. (On 5336c16
/// the 500 was replayed to every redelivery: "left: 500, right: 201".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receivers_5xx_is_released_and_the_redelivery_runs_once() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let (gw, _) = billing(&db, &upstream, &[]).await;
    let http = Http::default();
    let url = gw.url("/webhooks/billing");
    let id = msg_id();
    let body = r#"{"type":"invoice.paid"}"#;
    let mut failing = signed("standard-webhooks", STANDARD_SECRET, &id, now(), body);
    failing.push(("x-test-status".into(), "500".into()));
    let first = deliver(&http, &url, &failing, body).await;
    assert_eq!(first.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(!first.replayed());
    let mut answers = Vec::new();
    for later in 1..=3 {
        let again = signed(
            "standard-webhooks",
            STANDARD_SECRET,
            &id,
            now() + later,
            body,
        );
        let answer = deliver(&http, &url, &again, body).await;
        answers.push((answer.status.as_u16(), answer.replayed()));
    }
    assert_eq!(answers, [(201, false), (201, true), (201, true)]);
    assert_eq!(upstream.calls(), 2, "the 500, then one execution");
    assert_eq!(rows(&db, &id).await, 1);

    // A receiver that does not answer in time: unknown, held, never run again on a guess.
    let id = msg_id();
    let mut slow = signed("standard-webhooks", STANDARD_SECRET, &id, now(), body);
    slow.push(("x-test-delay-ms".into(), "6000".into()));
    let timed_out = deliver(&http, &url, &slow, body).await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    let again = signed("standard-webhooks", STANDARD_SECRET, &id, now(), body);
    let held = deliver(&http, &url, &again, body).await;
    assert_eq!(held.status, StatusCode::CONFLICT, "{:?}", held.body);
    assert_eq!(upstream.calls(), 3);
}

/// A redelivery of an event whose first answer was too large to keep is answered with
/// the first answer's 2xx and no body: never 410, which makes senders disable the
/// endpoint. (On 5336c16: "left: 410, right: 201".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_to_keep_is_never_410_to_a_provider() {
    let db = TestDb::create().await;
    db.migrate().await;
    let upstream = TestUpstream::start().await;
    let file = secrets_dir(&[("billing", STANDARD_SECRET)]).join("billing");
    let config = TestConfig::new(&db)
        .route(acme_route("/webhooks/billing", &upstream, &file).set("max_response_bytes", 1024));
    let gw = GatewayProcess::start(&config.toml()).await;
    let http = Http::default();
    let url = gw.url("/webhooks/billing");
    let id = msg_id();
    let body = r#"{"type":"invoice.paid"}"#;
    let mut large = signed("standard-webhooks", STANDARD_SECRET, &id, now(), body);
    large.push(("x-test-bytes".into(), "5000".into()));
    let first = deliver(&http, &url, &large, body).await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(first.body.len(), 5000);
    for later in 1..=2 {
        let again = signed(
            "standard-webhooks",
            STANDARD_SECRET,
            &id,
            now() + later,
            body,
        );
        let replay = deliver(&http, &url, &again, body).await;
        assert_eq!(replay.status, StatusCode::CREATED, "{:?}", replay.body);
        assert!(replay.replayed());
        assert!(replay.body.is_empty());
    }
    assert_eq!(upstream.calls(), 1);
}

/// A Stripe route whose secret file lies in a `{tenant}` Standard Webhooks route's
/// `secret_dir` would have that file read by two schemes: refused at start, naming
/// both. (On 5336c16 the gateway started, and one unsigned request to
/// `/webhooks/stripe/billing` made every genuine Stripe delivery 401.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_secrets_file_read_by_two_schemes_is_refused() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let dir = secrets_dir(&[
        ("acme", STANDARD_SECRET),
        ("stripe", "whsec_stripe_test_secret"),
    ]);
    let cfg = TestConfig::new(&db)
        .route(
            Route::idempotent("POST", "/webhooks/{tenant}/billing", &upstream.url()).webhook(&[
                ("scheme", "standard-webhooks"),
                ("secret_dir", &dir.display().to_string()),
            ]),
        )
        .route(
            Route::idempotent("POST", "/webhooks/stripe", &upstream.url()).webhook(&[
                ("scheme", "stripe"),
                ("secret_file", &dir.join("stripe").display().to_string()),
                ("tenant", "acme"),
            ]),
        );
    let app = idemgate::Application::build(config(cfg), idemgate::BuildOptions::default())
        .await
        .err()
        .expect("refused at start");
    let why = format!("{app:#}");
    assert!(why.contains("routes[1].webhook.secret_file"), "{why}");
    assert!(
        why.contains("standard-webhooks") && why.contains("stripe"),
        "{why}"
    );
}

/// What a `{tenant}` route answers a delivery for a tenant without a secrets file: the
/// same as for a known tenant's bad signature, and only after the body (before, the
/// timing told the tenants apart: on 5336c16 the unknown tenant was answered before its
/// body was sent — "answered before the body: 401").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_known_and_an_unknown_tenant_are_answered_alike() {
    use tokio::io::AsyncWriteExt;
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let dir = secrets_dir(&[("acme", STANDARD_SECRET)]);
    let gw = gateway(
        &db,
        &upstream,
        "/webhooks/{tenant}/billing",
        &[
            ("scheme", "standard-webhooks"),
            ("secret_dir", &dir.display().to_string()),
        ],
    )
    .await;
    let body = r#"{"type":"invoice.paid","amount":100}"#;
    let mut answers = Vec::new();
    for tenant in ["acme", "initech", "bad%20id"] {
        let headers = signed("standard-webhooks", OTHER_SECRET, &msg_id(), now(), body);
        let mut head = format!(
            "POST /webhooks/{tenant}/billing HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n",
            body.len()
        );
        for (name, value) in &headers {
            head.push_str(&format!("{name}: {value}\r\n"));
        }
        head.push_str("\r\n");
        let mut conn = tokio::net::TcpStream::connect(gw.addr).await.unwrap();
        conn.write_all(head.as_bytes()).await.unwrap();
        conn.write_all(&body.as_bytes()[..10]).await.unwrap();
        let early = tokio::time::timeout(Duration::from_millis(500), read_answer(&mut conn)).await;
        if let Ok(answer) = early {
            panic!("{tenant}: answered before the body: {answer:?}");
        }
        conn.write_all(&body.as_bytes()[10..]).await.unwrap();
        let answer = read_answer(&mut conn).await.expect("answered");
        let problem: serde_json::Value = serde_json::from_slice(&answer.body).unwrap();
        answers.push((
            tenant,
            answer.status(),
            problem["type"].clone(),
            problem["detail"].clone(),
        ));
    }
    let (_, status, kind, detail) = answers[0].clone();
    assert_eq!(status, 401);
    for (tenant, s, k, d) in &answers {
        assert_eq!(
            (s, k, d),
            (&status, &kind, &detail),
            "{tenant} answered as acme"
        );
    }
    assert_eq!(upstream.calls(), 0);
}
