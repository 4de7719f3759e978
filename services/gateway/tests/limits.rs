//! Hostile input against the real `idemgate` binary, real Postgres and Redis: bodies
//! that are expensive to fingerprint, slow or oversized heads and bodies, too many
//! requests at once, answers too large to keep, waiters that never let go, headers
//! that spell idemgate's own, and paths that try to leave their segment.
//!
//! Every test says what it failed with on the main branch before these limits existed.
//! The few time bounds below are liveness bounds (seconds where the gateway needs
//! milliseconds, and where it used to hang for good), not performance targets: those
//! live in loadtest/bench.

mod common;

use std::time::{Duration, Instant};

use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// The tests' config with the server's own body limit (1 MiB), not the 4 KiB one.
fn base(db: &TestDb) -> TestConfig {
    TestConfig::new(db).unset("server.max_body_bytes")
}

async fn gateway(config: TestConfig) -> GatewayProcess {
    GatewayProcess::start(&config.toml()).await
}

/// One idempotent route to `upstream`, one with a path template, and a plain one,
/// each changed by `change`.
fn routes_to(config: TestConfig, upstream: &str, change: impl Fn(Route) -> Route) -> TestConfig {
    config
        .route(change(Route::idempotent("POST", "/payments", upstream)))
        .route(change(Route::idempotent(
            "POST",
            "/orders/{id}/refunds",
            upstream,
        )))
        .route(change(Route::plain("GET", "/files/{name}", upstream)))
}

async fn scrape(http: &Http, gw: &GatewayProcess) -> String {
    let answer = http.get(&gw.url("/metrics")).send().await;
    assert_eq!(answer.status, StatusCode::OK);
    String::from_utf8(answer.body.to_vec()).unwrap()
}

/// Reads from a raw connection until the peer closes it or `within` passes; returns
/// what arrived, or `None` if the connection was still open at the end.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut buf = [0u8; 4096];
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// `{"0085999":0,…,"0000000":0}`: 86,000 members in 1 MB, names in reverse order.
fn many_members() -> String {
    let members: Vec<String> = (0..86_000).rev().map(|i| format!("\"{i:07}\":0")).collect();
    format!("{{{}}}", members.join(","))
}

// On main: "the replay waited 28.8s" (debug build) — each member name was compared with
// every earlier one, on the async workers, so two of these bodies stalled everyone.
// (The issue measured 12.9 s against a release build.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worst_case_json_body_does_not_stall_a_concurrent_replay() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let gw = gateway(
        base(&db)
            .set("server.max_body_bytes", 2_097_152)
            .payments(&demo, |r| r),
    )
    .await;
    let http = Http::default();
    let key = new_key();
    let pay = || http.pay(&gw.url("/payments"), "acme", &key, &payment("o-1", 100));
    assert_eq!(pay().send().await.status, StatusCode::CREATED);

    let body = many_members();
    assert!(body.len() > 1_000_000);
    let hostile: Vec<_> = (0..2)
        .map(|_| {
            tokio::spawn(
                http.pay(&gw.url("/payments"), "mallory", &new_key(), &body)
                    .send(),
            )
        })
        .collect();
    // Real time: the hostile bodies are on their way to the real server.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let replay = pay().send().await;
    let waited = started.elapsed();
    assert!(replay.replayed());
    assert!(
        waited < Duration::from_secs(3),
        "the replay waited {waited:?}"
    );
    for call in hostile {
        // The demo refuses a body without orderId (422); idemgate fingerprinted it.
        assert_eq!(call.await.unwrap().status, StatusCode::UNPROCESSABLE_ENTITY);
    }
}

// On main (which refused `server.header_read_timeout` as an unknown key; run without
// it): "the connection is still open" — there was no header read timeout at all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_head_that_never_ends_is_cut_off() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = base(&db).set("server.header_read_timeout", "500ms");
    let gw = gateway(cfg.payments(&demo, |r| r)).await;
    let mut slow = TcpStream::connect(gw.addr).await.unwrap();
    slow.write_all(b"POST /payments HTTP/1.1\r\nHost: x\r\n")
        .await
        .unwrap();
    let closed = read_until_closed(&mut slow, Duration::from_secs(5)).await;
    assert!(closed.is_some(), "the connection is still open");
    // An idle keep-alive connection is closed the same way; the gateway serves on.
    let mut idle = TcpStream::connect(gw.addr).await.unwrap();
    assert!(
        read_until_closed(&mut idle, Duration::from_secs(5))
            .await
            .is_some()
    );
    let http = Http::default();
    assert_eq!(
        http.get(&gw.url("/healthz")).send().await.status,
        StatusCode::OK
    );
    assert_eq!(db.ledger_rows("acme").await, 0);
}

// On main (run without `server.body_read_timeout`, unknown there): "answered and
// closed" failed — no answer in 5 s, the body read had no deadline.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trickled_body_gets_408_and_claims_nothing() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = base(&db).set("server.body_read_timeout", "500ms");
    let gw = gateway(cfg.payments(&demo, |r| r)).await;
    let mut stream = TcpStream::connect(gw.addr).await.unwrap();
    let head = format!(
        "POST /payments HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         Idempotency-Key: {}\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n",
        token("acme"),
        new_key()
    );
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(b"{\"orderId\":").await.unwrap();
    let answer = read_until_closed(&mut stream, Duration::from_secs(5))
        .await
        .expect("answered and closed");
    let answer = String::from_utf8_lossy(&answer);
    assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
    assert!(answer.contains("application/problem+json"), "{answer}");
    assert!(answer.contains("problems/request-timeout"), "{answer}");
    assert_eq!(db.ledger_rows("acme").await, 0);
}

// On main: the 431 for 101 headers was hyper's own, with no problem body (content type
// `None`, expected `application/problem+json`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_request_heads_get_431_and_claim_nothing() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let gw = gateway(base(&db).payments(&demo, |r| r)).await;
    let http = Http::default();
    let post = || http.pay(&gw.url("/payments"), "acme", &new_key(), &payment("o", 1));

    let mut many = post();
    for i in 0..100 {
        many = many.header(&format!("x-filler-{i}"), "1");
    }
    let many = many.send().await;
    assert_eq!(many.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert_eq!(many.problem(), "request-header-fields-too-large");

    let large = post().header("x-large", &"a".repeat(17_000)).send().await;
    assert_eq!(large.status, StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE);
    assert_eq!(large.problem(), "request-header-fields-too-large");

    // Far past the limit hyper refuses the head itself, before any handler: still 431.
    let mut huge = post();
    for i in 0..250 {
        huge = huge.header(&format!("x-filler-{i}"), "1");
    }
    let huge = huge.try_send().await;
    assert!(
        huge.as_ref()
            .is_ok_and(|a| a.status == StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE)
            || huge.is_err(),
        "{huge:?}"
    );
    assert_eq!(db.ledger_rows("acme").await, 0);
    // Within the limits, the same request goes through.
    assert_eq!(post().send().await.status, StatusCode::CREATED);
}

// On main (run without `server.max_concurrent_requests`, unknown there): the third
// request got 201, not 503 — nothing limited requests in flight.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn requests_past_the_limit_are_shed_at_once_while_health_answers() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = base(&db).set("server.max_concurrent_requests", 2);
    let gw = gateway(cfg.payments(&demo, |r| r)).await;
    let http = Http::default();
    let slow = |order: &str| {
        tokio::spawn(
            http.pay(&gw.url("/payments"), "acme", &new_key(), &payment(order, 1))
                .demo_delay(1500)
                .send(),
        )
    };
    let (first, second) = (slow("o-1"), slow("o-2"));
    // Real time: both slow requests have reached the upstream.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let key = new_key();
    let shed = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-3", 1))
        .send()
        .await;
    assert!(
        !first.is_finished() && !second.is_finished(),
        "answered while the two slow requests were still in flight"
    );
    assert_eq!(shed.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(shed.problem(), "overloaded");
    assert_eq!(shed.header("retry-after"), Some("1"));
    for path in ["/healthz", "/readyz", "/metrics"] {
        assert_eq!(
            http.get(&gw.url(path)).send().await.status,
            StatusCode::OK,
            "{path}"
        );
    }
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(second.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 0);
    // The shed request claimed nothing: sent again, it executes.
    let again = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-3", 1))
        .send()
        .await;
    assert_eq!(again.status, StatusCode::CREATED);
    assert!(!again.replayed());
}

// On main (run without `max_response_bytes`, unknown there): the retry got 201, the
// 300 kB answer replayed from a whole stored copy — nothing capped what was stored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_too_large_to_keep_reaches_its_client_whole_and_never_runs_again() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let redis = RedisServer::start(&[]);
    let cfg = base(&db)
        .redis(&redis.url())
        .unset("redis.local_cache_entries");
    let gw = gateway(routes_to(cfg, &upstream.url(), |r| {
        r.set("max_response_bytes", 65_536)
    }))
    .await;
    let http = Http::default();
    let key = new_key();
    let send = || {
        http.pay(&gw.url("/payments"), "acme", &key, "{}")
            .header("x-test-bytes", "300000")
            .send()
    };
    let first = send().await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.body, TestUpstream::body_of(300_000), "the whole body");

    for _ in 0..3 {
        let retry = send().await;
        assert_eq!(retry.status, StatusCode::GONE);
        assert_eq!(retry.problem(), "idempotency-result-unavailable");
        assert!(retry.replayed());
        assert_eq!(retry.json()["operation_state"], "completed");
        assert_eq!(retry.json()["safe_new_key"], false);
    }
    assert_eq!(upstream.calls(), 1, "executed once");

    let mut conn = db.connect().await;
    let (status, omitted, stored): (String, bool, i32) = sqlx::query_as(
        "SELECT status, response_omitted, octet_length(response_body) FROM idempotency_keys WHERE key = $1",
    )
    .bind(&key)
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!((status.as_str(), omitted, stored), ("completed", true, 0));

    // A plain route streams a large answer through as well.
    let file = http
        .get(&gw.url("/files/report"))
        .tenant("acme")
        .header("x-test-bytes", "500000")
        .send()
        .await;
    assert_eq!(file.status, StatusCode::CREATED);
    assert_eq!(file.body, TestUpstream::body_of(500_000));
}

// On main (run without `redis.local_cache_bytes`, unknown there): no
// `idemgate_local_cache_bytes` gauge — the cache counted entries, whatever their size.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_cache_holds_at_most_its_bytes() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let redis = RedisServer::start(&[]);
    let cfg = base(&db)
        .redis(&redis.url())
        .set("redis.local_cache_entries", 1000)
        .set("redis.local_cache_bytes", 200_000);
    let gw = gateway(routes_to(cfg, &upstream.url(), |r| r)).await;
    let http = Http::default();
    let keys: Vec<String> = (0..10).map(|_| new_key()).collect();
    for _ in 0..2 {
        for key in &keys {
            let answer = http
                .pay(&gw.url("/payments"), "acme", key, "{}")
                .header("x-test-bytes", "50000")
                .send()
                .await;
            assert_eq!(answer.status, StatusCode::CREATED);
            assert_eq!(answer.body.len(), 50_000);
        }
    }
    let metrics = scrape(&http, &gw).await;
    let bytes = metric(&metrics, "idemgate_local_cache_bytes").expect("the gauge");
    let entries = metric(&metrics, "idemgate_local_cache_entries").expect("the gauge");
    assert!(bytes > 0.0 && bytes <= 200_000.0, "{bytes}");
    assert!((1.0..=3.0).contains(&entries), "{entries}");
    assert_eq!(upstream.calls(), 10);
}

/// The pub/sub channels a Redis server has subscribers on.
fn subscribed_channels(redis: &RedisServer) -> usize {
    redis
        .cli(&["PUBSUB", "CHANNELS", "*"])
        .lines()
        .filter(|l| !l.trim().is_empty())
        .count()
}

async fn eventually_unsubscribed(redis: &RedisServer) {
    let deadline = Instant::now() + Duration::from_secs(3);
    while subscribed_channels(redis) > 0 {
        assert!(
            Instant::now() < deadline,
            "still subscribed: {}",
            redis.cli(&["PUBSUB", "CHANNELS", "*"])
        );
        // Real time: polling a real Redis's subscription list.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

// On main: "still subscribed: idem:{acme|POST /payments|key-…}:done" — the guard's
// last-waiter test never held, so every scope ever waited on stayed subscribed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_retries_unsubscribe_however_their_wait_ends() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&[]);
    let cfg = base(&db).redis(&redis.url());
    let gw = gateway(cfg.payments(&demo, |r| r.set("on_in_progress", "wait"))).await;
    let http = Http::default();

    // Waits that end with the result.
    let key = new_key();
    let pay = || http.pay(&gw.url("/payments"), "acme", &key, &payment("o-w", 1));
    let first = tokio::spawn(pay().demo_delay(1000).send());
    // Real time: the first attempt has claimed the key and reached the upstream.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let waiters: Vec<_> = (0..10).map(|_| tokio::spawn(pay().send())).collect();
    let first = first.await.unwrap();
    for waiter in waiters {
        let answer = waiter.await.unwrap();
        assert_eq!(answer.body, first.body);
    }
    eventually_unsubscribed(&redis).await;

    // A wait that ends with its timeout, while the first attempt still runs.
    let key = new_key();
    let slow = tokio::spawn(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-t", 1))
            .demo_delay(3000)
            .send(),
    );
    // Real time: the first attempt has claimed the key and reached the upstream.
    tokio::time::sleep(Duration::from_millis(200)).await;
    let impatient = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-t", 1))
        .header("prefer", "wait=1")
        .send()
        .await;
    assert_eq!(impatient.status, StatusCode::CONFLICT);
    eventually_unsubscribed(&redis).await;
    assert!(!slow.is_finished(), "the first attempt was still running");
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

// On main: "x_tenant_id reached the upstream" — `X_Tenant_Id: globex` was forwarded
// beside the real `X-Tenant-Id`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headers_idemgate_sets_are_never_taken_from_the_client() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let redis = RedisServer::start(&[]);
    let cfg = base(&db)
        .set("server.max_header_bytes", 200_000)
        .redis(&redis.url());
    let gw = gateway(routes_to(cfg, &upstream.url(), |r| r)).await;
    let http = Http::default();
    let key = new_key();
    let answer = http
        .pay(&gw.url("/payments"), "acme", &key, "{}")
        .header("X_Tenant_Id", "globex")
        .header("Idempotency_Key", "other")
        .header("x-tenant_id", "globex")
        .header("traceparent", "not-a-traceparent")
        .send()
        .await;
    assert_eq!(answer.status, StatusCode::CREATED);
    let seen = &upstream.seen()[0];
    let all = |name: &str| -> Vec<&str> {
        seen.get_all(name)
            .iter()
            .map(|v| v.to_str().unwrap())
            .collect()
    };
    assert_eq!(all("x-tenant-id"), ["acme"]);
    assert_eq!(all("idempotency-key"), [key.as_str()]);
    for spelled in [
        "x_tenant_id",
        "idempotency_key",
        "x-tenant_id",
        "traceparent",
    ] {
        assert!(
            seen.get(spelled).is_none(),
            "{spelled} reached the upstream"
        );
    }

    // A valid one is continued (this gateway does not trace, so it is passed on).
    let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
    http.pay(&gw.url("/payments"), "acme", &new_key(), "{}")
        .header("traceparent", tp)
        .send()
        .await;
    assert_eq!(upstream.seen()[1]["traceparent"], tp);

    // A 70 kB "traceparent" is neither stored nor allowed to corrupt the cache entry.
    let key = new_key();
    let long = "0".repeat(70_000);
    let send = || {
        http.pay(&gw.url("/payments"), "acme", &key, "{}")
            .header("traceparent", &long)
            .send()
    };
    let first = send().await;
    assert_eq!(first.status, StatusCode::CREATED);
    let mut conn = db.connect().await;
    let stored: Option<String> =
        sqlx::query_scalar("SELECT trace_context FROM idempotency_keys WHERE key = $1")
            .bind(&key)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(stored, None);
    let replay = send().await;
    assert!(replay.replayed());
    assert_eq!(replay.body, first.body);
    let metrics = scrape(&http, &gw).await;
    assert_eq!(metric(&metrics, "idemgate_cache_errors_total"), Some(0.0));
}

// On main: `/orders/./refunds` got 201 — it matched `/orders/{id}/refunds` and was
// forwarded.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn path_parameters_that_could_leave_their_segment_are_404() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let gw = gateway(routes_to(base(&db), &upstream.url(), |r| r)).await;
    let http = Http::default();
    for path in [
        "/orders/./refunds",
        "/orders/../refunds",
        "/orders/%2e%2e/refunds",
        "/orders/a%2Fb/refunds",
        "/orders/a%2fb/refunds",
        "/orders/a%5Cb/refunds",
    ] {
        let answer = http
            .pay(&gw.url(path), "acme", &new_key(), "{}")
            .send()
            .await;
        assert_eq!(answer.status, StatusCode::NOT_FOUND, "{path}");
        assert_eq!(answer.problem(), "route-not-found", "{path}");
    }
    assert_eq!(upstream.calls(), 0);
    assert_eq!(db.ledger_rows("acme").await, 0);
    let ok = http
        .pay(&gw.url("/orders/a.b/refunds"), "acme", &new_key(), "{}")
        .send()
        .await;
    assert_eq!(ok.status, StatusCode::CREATED);
}

// On main: /readyz said redis "down (serving from Postgres alone)" — the replays' cache
// fills hit OOM, and the breaker counted that as Redis failing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn filling_a_full_redis_keeps_the_breaker_closed() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&[
        "--maxmemory",
        "4mb",
        "--maxmemory-policy",
        "noeviction",
        "--enable-debug-command",
        "yes",
    ]);
    let gw = gateway(base(&db).redis(&redis.url()).payments(&demo, |r| r)).await;
    let http = Http::default();
    let key = new_key();
    let pay = || http.pay(&gw.url("/payments"), "acme", &key, &payment("o", 1));
    assert_eq!(pay().send().await.status, StatusCode::CREATED);
    // Forget the cached answer, then fill Redis past maxmemory: every write is refused.
    redis.cli(&["FLUSHALL"]);
    redis.cli(&["DEBUG", "POPULATE", "100000", "junk", "100"]);
    assert!(
        redis.cli(&["SET", "probe", "x"]).contains("OOM"),
        "Redis is full"
    );

    for _ in 0..3 {
        let replay = pay().send().await;
        assert!(replay.replayed(), "served from Postgres");
    }
    let ready = http.get(&gw.url("/readyz")).send().await;
    assert_eq!(ready.json()["redis"], "up");
    let metrics = scrape(&http, &gw).await;
    assert_eq!(metric(&metrics, "idemgate_cache_up"), Some(1.0));
    assert!(metric(&metrics, "idemgate_cache_refused_total").unwrap_or(0.0) >= 3.0);
}

// On main: the in-progress problem had no `operation_state` (unwrap on `None`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_problems_say_where_the_operation_stands() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    // 1 s + 0.5 s + 1 s < the 3 s lease.
    let cfg = base(&db)
        .set("postgres.acquire_timeout", "500ms")
        .payments(&demo, |r| r.set("timeout", "1s").set("lease", "3s"))
        .route(Route::idempotent(
            "POST",
            "/down",
            &format!("http://{closed}"),
        ));
    let gw = gateway(cfg).await;
    let http = Http::default();
    let state = |answer: &Answer| {
        let json = answer.json();
        (
            answer.problem(),
            json["operation_state"].as_str().unwrap().to_owned(),
            json["safe_new_key"].as_bool().unwrap(),
        )
    };
    let owned = |slug: &str, state: &str, safe| (slug.to_owned(), state.to_owned(), safe);

    let key = new_key();
    let pay = |order: &str| http.pay(&gw.url("/payments"), "acme", &key, &payment(order, 1));
    let running = tokio::spawn(pay("o").demo_delay(600).send());
    // Real time: the first attempt has claimed the key and reached the upstream.
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        state(&pay("o").send().await),
        owned("idempotency-key-in-progress", "in_progress", false)
    );
    assert_eq!(
        state(&pay("other").send().await),
        owned("idempotency-key-reused", "in_progress", false)
    );
    running.await.unwrap();
    assert_eq!(
        state(&pay("other").send().await),
        owned("idempotency-key-reused", "completed", false)
    );
    let lost = new_key();
    let timed_out = http
        .pay(&gw.url("/payments"), "acme", &lost, &payment("o", 1))
        .demo_delay(1500)
        .send()
        .await;
    assert_eq!(
        state(&timed_out),
        owned("upstream-timeout", "unknown", false)
    );
    // Past the lease, with no reconciler running, the outcome is still unknown.
    // Real time: Postgres's clock judges the lease.
    tokio::time::sleep(Duration::from_millis(2200)).await;
    let retry = http
        .pay(&gw.url("/payments"), "acme", &lost, &payment("o", 1))
        .send()
        .await;
    assert_eq!(
        state(&retry),
        owned("idempotency-key-in-progress", "unknown", false)
    );
    let refused = http
        .pay(&gw.url("/down"), "acme", &new_key(), "{}")
        .send()
        .await;
    assert_eq!(
        state(&refused),
        owned("upstream-unavailable", "not_executed", true)
    );
}

/// A route that stores nothing forwards its answer as it comes: an event stream's events
/// arrive one by one, and a stream that flows longer than the route's `timeout` is not
/// cut. (On 9a8c6d3 the answer was held whole first, and the test read "HTTP/1.1 504
/// Gateway Timeout" after the route's 1 s timeout, no event.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stream_through_a_route_that_stores_nothing_flows_as_it_comes() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let gw = gateway(
        base(&db).route(Route::plain("GET", "/events", &upstream.url()).set("timeout", "1s")),
    )
    .await;
    let mut stream = TcpStream::connect(gw.addr).await.unwrap();
    let request = format!(
        "GET /events HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {}\r\n\
         x-test-status: 200\r\nx-test-events: 6\r\nx-test-event-ms: 400\r\nConnection: close\r\n\r\n",
        token("acme")
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut got = Vec::new();
    // What had arrived when the first event did.
    let mut at_first_event = None;
    let mut buf = [0u8; 4096];
    loop {
        let n = tokio::time::timeout(Duration::from_secs(5), stream.read(&mut buf))
            .await
            .expect("the stream keeps flowing")
            .unwrap();
        if n == 0 {
            break;
        }
        got.extend_from_slice(&buf[..n]);
        if at_first_event.is_none() && got.windows(8).any(|w| w == b"data: 0\n") {
            at_first_event = Some(String::from_utf8_lossy(&got).into_owned());
        }
    }
    let answer = String::from_utf8_lossy(&got);
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    assert!(answer.contains("text/event-stream"), "{answer}");
    for i in 0..6 {
        assert!(
            answer.contains(&format!("data: {i}\n\n")),
            "event {i}: {answer}"
        );
    }
    // Events arrive as sent: the first before the last was even sent (2.4 s in, past the
    // route's 1 s timeout).
    let first = at_first_event.expect("the first event");
    assert!(!first.contains("data: 5"), "held whole: {first}");
}
