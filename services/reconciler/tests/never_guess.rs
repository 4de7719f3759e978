//! Never re-execute on a guess (docs/operations.md, "Unknown outcomes"), end to end: real gateway and
//! reconciler processes, upstreams of the tests' own, real Postgres. Each test is one of
//! the ways a key used to become executable again while the upstream may have acted.

mod common;

use std::collections::HashSet;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http::StatusCode;
use idem_testkit::*;

// On main: "left: 500, right: 409" — the 500 released the key and the retry executed
// the payment again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_is_uncertain_held_and_probed_at_once_on_a_route_with_a_probe() {
    let db = TestDb::create().await;
    // The probe (it sends no x-test-* headers) finds the operation: 200.
    let upstream = TestUpstream::answering(200, None).await;
    let cfg = leased(&db, &upstream.url(), "900ms", Route::probed).toml();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    for status in [500u16, 502] {
        let key = new_key();
        let send = || {
            http.pay(&gw.url("/payments"), "acme", &key, "{}")
                .header("x-test-status", &status.to_string())
                .send()
        };
        let first = send().await;
        assert_eq!(
            first.status.as_u16(),
            status,
            "the first client sees the answer"
        );
        let retry = send().await;
        assert_eq!(retry.status, StatusCode::CONFLICT);
        assert_eq!(retry.problem(), "idempotency-key-in-progress");
        assert_eq!(retry.json()["operation_state"], "unknown");
        // Probed at once, without waiting for the lease to run out.
        pass_reporting(&cfg, &["completed=1"]).await;
        let replay = send().await;
        assert_eq!(replay.status, StatusCode::OK, "the probe's answer");
        assert!(replay.replayed());
    }
    assert_eq!(upstream.calls(), 4, "one request and one probe per key");
}

// On main: "left: 201, right: 500" — the 500 released the key and the retry executed
// again (and this time succeeded: two payments).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_5xx_on_a_route_without_a_probe_is_stored_and_replayed() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let gw = GatewayProcess::start(&leased(&db, &upstream.url(), "900ms", |r| r).toml()).await;
    let http = Http::default();
    for status in [500u16, 502, 503] {
        let key = new_key();
        let first = http
            .pay(&gw.url("/payments"), "acme", &key, "{}")
            .header("x-test-status", &status.to_string())
            .send()
            .await;
        assert_eq!(first.status.as_u16(), status);
        // The retry would succeed if it reached the upstream: it must not.
        let retry = http
            .pay(&gw.url("/payments"), "acme", &key, "{}")
            .send()
            .await;
        assert_eq!(retry.status.as_u16(), status);
        assert!(retry.replayed());
        assert_eq!(retry.body, first.body);
    }
    assert_eq!(upstream.calls(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn release_on_5xx_is_an_explicit_opt_in() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let cfg = leased(&db, &upstream.url(), "900ms", |r| {
        r.set("release_on", vec!["5xx"])
    });
    let gw = GatewayProcess::start(&cfg.toml()).await;
    let http = Http::default();
    let key = new_key();
    let first = http
        .pay(&gw.url("/payments"), "acme", &key, "{}")
        .header("x-test-status", "503")
        .send()
        .await;
    assert_eq!(first.status, StatusCode::SERVICE_UNAVAILABLE);
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, "{}")
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CREATED, "released: the retry ran");
    assert!(!retry.replayed());
    assert_eq!(upstream.calls(), 2);
}

/// An upstream that commits late: a POST is committed `commit_after` after it arrived
/// (long after the gateway gave up on it), and the status probe answers 404 until then
/// and 200 after. Returns its URL and the number of POSTs it received.
async fn late_committer(commit_after: Duration) -> (String, Arc<AtomicUsize>) {
    use axum::extract::{Path, State};
    use axum::routing::{get, post};

    #[derive(Clone, Default)]
    struct Upstream {
        committed: Arc<Mutex<HashSet<String>>>,
        posts: Arc<AtomicUsize>,
    }
    let state = Upstream::default();
    let posts = state.posts.clone();
    let app = axum::Router::new()
        .route(
            "/payments",
            post(
                move |State(s): State<Upstream>, headers: http::HeaderMap| async move {
                    s.posts.fetch_add(1, Ordering::SeqCst);
                    let key = headers["idempotency-key"].to_str().unwrap().to_owned();
                    // Its own task: the work goes on after the gateway has hung up.
                    tokio::spawn(async move {
                        // Real time: a slow commit in this real upstream, after the gateway gave up.
                        tokio::time::sleep(commit_after).await;
                        s.committed.lock().unwrap().insert(key);
                    });
                    // Real time: the answer comes after the gateway gave up.
                    tokio::time::sleep(commit_after).await;
                    (StatusCode::CREATED, "{\"late\":true}")
                },
            ),
        )
        .route(
            "/payments/by-key/{key}",
            get(
                |State(s): State<Upstream>, Path(key): Path<String>| async move {
                    if s.committed.lock().unwrap().contains(&key) {
                        (StatusCode::OK, "{\"late\":true}")
                    } else {
                        (StatusCode::NOT_FOUND, "")
                    }
                },
            ),
        )
        .with_state(state);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    (url, posts)
}

// On main (run without `reconciler.release_confirm`, unknown there): the first pass
// reported "released=1 not_found=0" — the first 404 released the key, though the upstream
// was still about to commit, and a retry would have sent the payment a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_404_is_confirmed_release_confirm_later_before_a_key_is_released() {
    let db = TestDb::create().await;
    let (upstream, posts) = late_committer(Duration::from_millis(4000)).await;
    let cfg = leased(&db, &upstream, "500ms", Route::probed)
        .set("reconciler.release_confirm", "2s")
        .toml();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let send = || http.pay(&gw.url("/payments"), "acme", &key, "{}").send();
    assert_eq!(send().await.status, StatusCode::GATEWAY_TIMEOUT);
    past_lease().await;
    // The upstream has not committed yet: its probe says 404.
    pass_reporting(&cfg, &["released=0", "not_found=1"]).await;
    let retry = send().await;
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "still held after one 404"
    );
    // It commits at 4 s; the confirming probe is due 2 s after the first.
    // Real time: release_confirm is judged by Postgres's clock.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    pass_reporting(&cfg, &["completed=1"]).await;
    let replay = send().await;
    assert_eq!(replay.status, StatusCode::OK);
    assert!(replay.replayed());
    assert_eq!(replay.json()["late"], true);
    assert_eq!(posts.load(Ordering::SeqCst), 1, "executed once");
}

// On main: the first pass already reported "released=1" (one 404 released the key).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_404s_release_confirm_apart_release_the_key_for_a_retry() {
    let db = TestDb::create().await;
    db.migrate().await;
    let (upstream, posts) = late_committer(Duration::ZERO).await;
    let cfg = leased(&db, &upstream, "900ms", Route::probed)
        .set("reconciler.release_confirm", "1s")
        .toml();
    let keys = stuck_rows(&db, "acme", "POST /payments", 1).await;
    pass_reporting(&cfg, &["not_found=1"]).await;
    assert_eq!(row(&db, &keys[0]).await.unwrap().0, "in_progress");
    // Real time: release_confirm is judged by Postgres's clock.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    pass_reporting(&cfg, &["released=1"]).await;
    assert!(row(&db, &keys[0]).await.is_none());
    assert_eq!(posts.load(Ordering::SeqCst), 0);
}

// On main: "the held row is still there" failed (`left: None`) — the purge deleted the
// in-progress row once its TTL had passed, and the retry would have executed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_held_key_never_lapses_past_its_ttl_or_the_purge() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let cfg = leased(&db, &upstream.url(), "500ms", |r| r.set("ttl", "3s")).toml();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let send = || {
        http.pay(&gw.url("/payments"), "acme", &key, "{}")
            .header("x-test-delay-ms", "10000")
            .send()
    };
    assert_eq!(send().await.status, StatusCode::GATEWAY_TIMEOUT);
    past_lease().await; // and past the 3 s TTL
    pass_reporting(&cfg, &["held=1", "purged=0", "held_keys=1"]).await;
    assert_eq!(
        row(&db, &key).await.map(|r| r.0),
        Some("in_progress".to_owned()),
        "the held row is still there"
    );
    let retry = send().await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.json()["operation_state"], "unknown");
    assert_eq!(upstream.calls(), 1, "never executed again");
}

// On main: "left: 503, right: 201" — the completion failed once (its row was locked past
// the statement timeout), the client got 503 outcome-unrecorded and the answer was lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_fails_once_is_retried_within_the_lease() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let cfg = TestConfig::new(&db)
        .set("postgres.acquire_timeout", "300ms")
        .set("postgres.statement_timeout", "300ms")
        .set("idempotency.lease", "5s")
        .route(Route::idempotent("POST", "/payments", &upstream.url()).set("timeout", "2s"));
    let gw = GatewayProcess::start(&cfg.toml()).await;
    let http = Http::default();
    let key = new_key();
    let request = http
        .pay(&gw.url("/payments"), "acme", &key, "{}")
        .header("x-test-delay-ms", "800")
        .send();
    let first = tokio::spawn(request);
    // Once the claim has committed, lock the row past the statement timeout: the first
    // completion times out waiting for the lock.
    // Real time: the claim commits in the gateway process.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let lock = db.lock_row(&key).await;
    // Real time: the row stays locked past the gateway's statement timeout.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    lock.release().await;

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.json());
    assert_eq!(row(&db, &key).await.unwrap().0, "completed");
    let replay = http
        .pay(&gw.url("/payments"), "acme", &key, "{}")
        .send()
        .await;
    assert!(replay.replayed());
    assert_eq!(upstream.calls(), 1);
}
