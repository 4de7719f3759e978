//! What happens when the upstream fails, times out or is down, when keys expire, when
//! clients hang up and when the gateway shuts down.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;

/// A 5xx proves nothing (docs/operations.md, "Unknown outcomes"): on a route without a probe it is stored and
/// replayed like any answer, so a retry never runs the payment again on a guess.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_500_is_kept_and_replayed_on_a_route_without_a_probe() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let failed = http
        .post(&gw.url("/payments"))
        .tenant("acme")
        .key(&key)
        .header("x-demo-fail", "500")
        .json(&payment("o-500", 100))
        .send()
        .await;
    assert_eq!(
        failed.status,
        StatusCode::INTERNAL_SERVER_ERROR,
        "the upstream's answer passes through"
    );
    assert!(!failed.replayed());
    assert_eq!(db.ledger_rows("acme").await, 1, "kept");

    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-500", 100))
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert!(retry.replayed(), "the retry got the stored answer");
    assert_eq!(retry.body, failed.body);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_upstream_gives_502_and_releases_the_key() {
    let db = TestDb::create().await;
    // A port that nothing listens on: bind, note it, close.
    let closed = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let route = Route::idempotent("POST", "/payments", &format!("http://{closed}"));
    let gw = Gateway::start(config(TestConfig::new(&db).route(route))).await;
    let http = Http::default();
    let key = new_key();
    for _ in 0..2 {
        let answer = http
            .pay(&gw.url("/payments"), "acme", &key, &payment("o", 1))
            .send()
            .await;
        // Not 409 the second time: the first attempt released the key.
        assert_eq!(answer.status, StatusCode::BAD_GATEWAY);
        assert_eq!(answer.problem(), "upstream-unavailable");
        assert_eq!(db.ledger_rows("acme").await, 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_timeout_gives_504_and_holds_the_key() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let payments = |r: Route| r.set("timeout", "300ms");
    let gw = Gateway::start(config(TestConfig::new(&db).payments(&demo, payments))).await;
    let http = Http::default();
    let key = new_key();
    let timed_out = http
        .post(&gw.url("/payments"))
        .tenant("acme")
        .key(&key)
        .demo_delay(1500)
        .json(&payment("o-slow", 100))
        .send()
        .await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(timed_out.problem(), "upstream-timeout");

    // The demo did insert (it sleeps after committing): the outcome is unknown, so the
    // key stays held and a retry must not execute again.
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-slow", 100))
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CONFLICT);
    assert_eq!(retry.problem(), "idempotency-key-in-progress");
    // Real time: the demo answers the first attempt at 1.5 s; Postgres's clock judges its lease.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let later = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-slow", 100))
        .send()
        .await;
    assert_eq!(later.status, StatusCode::CONFLICT);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

/// [`setup`] with keys that live 3 s (and a lease to match).
async fn short_lived() -> (TestDb, Gateway, Http) {
    let route = |r: Route| {
        r.set("ttl", "3s")
            .set("lease", "3s")
            .set("timeout", "900ms")
    };
    setup_with(|c| c, route).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_key_executes_again_even_before_any_purge() {
    let (db, gw, http) = short_lived().await;
    let key = new_key();
    let send = || {
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-ttl", 100))
            .send()
    };
    let first = send().await;
    assert!(send().await.replayed(), "replayed while the key lives");
    // Real time: past the 3 s TTL, which Postgres's clock judges.
    tokio::time::sleep(Duration::from_millis(3300)).await;
    assert_eq!(
        db.ledger_rows("acme").await,
        1,
        "the expired row is still there (no purge ran)"
    );

    let after = send().await;
    assert_eq!(after.status, StatusCode::CREATED);
    assert!(!after.replayed(), "an expired key behaves as absent");
    assert_ne!(after.body, first.body);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 2);
    assert!(
        send().await.replayed(),
        "and the new execution is replayed in turn"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_retries_of_an_expired_key_execute_once() {
    let (db, gw, http) = short_lived().await;
    let key = new_key();
    http.pay(&gw.url("/payments"), "acme", &key, &payment("o", 1))
        .send()
        .await;
    // Real time: past the 3 s lease and TTL, which Postgres's clock judges.
    tokio::time::sleep(Duration::from_millis(3200)).await;
    let calls: Vec<_> = (0..20)
        .map(|_| {
            tokio::spawn(
                http.post(&gw.url("/payments"))
                    .tenant("acme")
                    .key(&key)
                    .demo_delay(200)
                    .json(&payment("o", 1))
                    .send(),
            )
        })
        .collect();
    for call in calls {
        let status = call.await.unwrap().status;
        assert!(
            status == StatusCode::CREATED || status == StatusCode::CONFLICT,
            "{status}"
        );
    }
    assert_eq!(
        db.executions("demo_payments", "acme", &key).await,
        2,
        "one before expiry, one after"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_hangs_up_does_not_leave_the_claim_half_done() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let impatient = paying(&http, &gw, &key, "o-hangup", 500).await;
    hang_up(impatient).await;

    // Real time: the abandoned attempt finishes in the gateway (the demo answers at 500 ms).
    tokio::time::sleep(Duration::from_millis(700)).await;
    let retry = http
        .pay(
            &gw.url("/payments"),
            "acme",
            &key,
            &payment("o-hangup", 100),
        )
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed(),
        "the abandoned execution was completed and stored"
    );
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

/// A completion the fence turns away (the row changed hands while the upstream worked, as
/// when the reconciler resolves a row whose lease ran out) is counted even though its
/// client hung up long before: the count is the gateway's, not the request's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fenced_completion_is_counted_after_its_client_hung_up() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let impatient = paying(&http, &gw, &key, "o-fenced", 600).await;
    let mut conn = db.connect().await;
    let taken = sqlx::query(
        "UPDATE idempotency_keys SET attempt = gen_random_uuid() \
         WHERE tenant_id = 'acme' AND key = $1 AND status = 'in_progress'",
    )
    .bind(&key)
    .execute(&mut conn)
    .await
    .unwrap();
    assert_eq!(taken.rows_affected(), 1, "the claim is in the ledger");
    hang_up(impatient).await; // the client is gone before the upstream answers

    // Real time: the demo answers at 600 ms, then the completion is fenced out.
    let fenced = || async {
        let text = http.get(&gw.url("/metrics")).send().await.body.to_vec();
        metric(
            &String::from_utf8(text).unwrap(),
            "idemgate_fenced_completions_total",
        )
    };
    let deadline = tokio::time::Instant::now() + Duration::from_secs(3);
    while fenced().await != Some(1.0) && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(fenced().await, Some(1.0));
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

/// An answer that cannot be recorded within the lease (its row locked by someone else
/// all along) is 503 outcome-unrecorded, the key held for the reconciler, and counted:
/// `IdemgateOutcomeUnrecorded` alerts on that count.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_answer_that_cannot_be_recorded_is_503_and_counted() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let test_config = TestConfig::new(&db)
        .set("postgres.acquire_timeout", "300ms")
        .set("postgres.statement_timeout", "300ms")
        .set("idempotency.lease", "3s")
        .route(Route::idempotent("POST", "/payments", &demo.url()).set("timeout", "1s"));
    let gw = Gateway::start(config(test_config)).await;
    let http = Http::default();
    let key = new_key();
    let paying = paying(&http, &gw, &key, "o-unrecorded", 300).await;
    // The claim has committed: hold its row until the request has given up.
    let lock = db.lock_row(&key).await;
    let answer = paying.await.unwrap();
    lock.release().await;

    assert_eq!(answer.status, StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(answer.problem(), "outcome-unrecorded");
    assert_eq!(answer.json()["operation_state"], "unknown");
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
    let text = http.get(&gw.url("/metrics")).send().await.body.to_vec();
    let counted = metric(
        &String::from_utf8(text).unwrap(),
        "idemgate_outcome_unrecorded_total",
    );
    assert_eq!(counted, Some(1.0));
}

/// A payment of `order` under `key` through `gw`, its upstream answering after
/// `demo_delay` ms; returned once the request had 150 ms to reach the gateway.
async fn paying(
    http: &Http,
    gw: &Gateway,
    key: &str,
    order: &str,
    demo_delay: u64,
) -> tokio::task::JoinHandle<Answer> {
    let send = http
        .pay(&gw.url("/payments"), "acme", key, &payment(order, 100))
        .demo_delay(demo_delay)
        .send();
    in_flight(send, Duration::from_millis(150)).await
}

/// Drops a request's connection mid-request.
async fn hang_up(request: tokio::task::JoinHandle<Answer>) {
    request.abort();
    assert!(request.await.unwrap_err().is_cancelled());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_finishes_in_flight_requests_and_stops_accepting() {
    let (db, mut gw, http) = setup().await;
    let key = new_key();
    let draining = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-drain", 100))
            .demo_delay(600)
            .send(),
        Duration::from_millis(150),
    )
    .await;
    let serving = gw.stop();
    let answer = draining.await.unwrap();
    assert_eq!(
        answer.status,
        StatusCode::CREATED,
        "the in-flight request finished"
    );
    tokio::time::timeout(Duration::from_secs(5), serving)
        .await
        .expect("the gateway stopped within its grace period")
        .unwrap()
        .unwrap();
    assert!(
        tokio::net::TcpStream::connect(gw.addr).await.is_err(),
        "no longer accepting connections"
    );
    // Completed, not stuck: the ledger row is the stored response.
    let mut conn = db.connect().await;
    let status: String = sqlx::query_scalar("SELECT status FROM idempotency_keys WHERE key = $1")
        .bind(&key)
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_eq!(status, "completed");
}
