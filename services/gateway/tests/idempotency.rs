//! Exactly-once, replays, mismatches and scoping, against real Postgres, the real
//! payments-demo process and two gateways sharing one database.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use http::StatusCode;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_storm_of_identical_requests_across_two_gateways_executes_once() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let routes = TestConfig::new(&db).payments(&demo, |r| r);
    let a = Gateway::start(config(routes.clone())).await;
    let b = Gateway::start(config(routes)).await;
    let http = Http::default();
    let key = new_key();
    let token = token("acme");

    let mut calls = Vec::new();
    for i in 0..100 {
        let gateway = if i % 2 == 0 { &a } else { &b };
        let call = http
            .post(&gateway.url("/payments"))
            .bearer(&token)
            .key(&key)
            // Keeps the first execution in flight while the rest arrive.
            .demo_delay(300)
            .json(&payment("order-storm", 100));
        calls.push(tokio::spawn(call.send()));
    }
    let mut bodies = HashSet::new();
    let (mut created, mut in_progress) = (0, 0);
    for call in calls {
        let answer = call.await.unwrap();
        match answer.status {
            StatusCode::CREATED => {
                created += 1;
                bodies.insert(answer.body.clone());
            }
            StatusCode::CONFLICT => {
                assert_eq!(answer.problem(), "idempotency-key-in-progress");
                assert!(answer.header("retry-after").is_some());
                in_progress += 1;
            }
            other => panic!("unexpected {other}: {:?}", answer.body),
        }
    }
    assert_eq!(created + in_progress, 100);
    assert!(created >= 1, "the first attempt answers 201");
    assert_eq!(bodies.len(), 1, "every 201 carries the same body");
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);

    // Once completed, every retry on either gateway replays the one result.
    for gateway in [&a, &b] {
        let replay = http
            .post(&gateway.url("/payments"))
            .bearer(&token)
            .key(&key)
            .json(&payment("order-storm", 100))
            .send()
            .await;
        assert_eq!(replay.status, StatusCode::CREATED);
        assert!(replay.replayed());
        assert!(bodies.contains(&replay.body));
    }
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_byte_identical_with_a_fresh_date() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let send = || {
        http.pay(&gw.url("/payments"), "acme", &key, &payment("order-1", 250))
            .send()
    };

    let first = send().await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    assert_eq!(first.json()["orderId"], "order-1");
    // Real time: a Date header counts whole seconds; the replay a second later carries a new one.
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    let second = send().await;

    assert_eq!(second.status, first.status);
    assert_eq!(second.body, first.body, "body byte for byte");
    assert!(second.replayed());
    for kept in ["content-type", "location"] {
        assert_eq!(second.header(kept), first.header(kept), "{kept}");
    }
    assert_eq!(
        second.header("content-length"),
        Some(second.body.len().to_string().as_str())
    );
    let (d1, d2) = (
        first.header("date").unwrap(),
        second.header("date").unwrap(),
    );
    assert_ne!(d1, d2, "a replay gets a fresh Date");
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn equivalent_json_is_the_same_request() {
    let (_db, gw, http) = setup().await;
    let key = new_key();
    let first = http
        .post(&gw.url("/payments"))
        .tenant("acme")
        .key(&key)
        .json(r#"{"orderId":"o-9","amountUah":100}"#)
        .send()
        .await;
    let reordered = http
        .post(&gw.url("/payments"))
        .tenant("acme")
        .key(&key)
        .json("{ \"amountUah\" : 100,\n \"orderId\" : \"o-\\u0039\" }")
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(reordered.replayed(), "{:?}", reordered.body);
    assert_eq!(reordered.body, first.body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_reused_with_another_payload_is_refused_on_both_paths() {
    let (db, gw, http) = setup().await;

    // After completion: the claim finds a completed row with another fingerprint.
    let key = new_key();
    let first = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-1", 100))
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let reused = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-1", 999))
        .send()
        .await;
    assert_eq!(reused.status, StatusCode::CONFLICT);
    assert_eq!(reused.problem(), "idempotency-key-reused");
    let body = String::from_utf8_lossy(&reused.body);
    assert!(!body.contains("o-1") && !body.contains(first.json()["paymentId"].as_str().unwrap()));

    // While in progress: the conflict is a mismatch, not "in progress".
    let key = new_key();
    let slow = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-2", 100))
            .demo_delay(500)
            .send(),
        std::time::Duration::from_millis(150),
    )
    .await;
    let conflicting = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-2", 5))
        .send()
        .await;
    assert_eq!(conflicting.status, StatusCode::CONFLICT);
    assert_eq!(conflicting.problem(), "idempotency-key-reused");
    assert_eq!(slow.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mismatch_status_can_be_422() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let gw = Gateway::start(config(
        TestConfig::new(&db)
            .set("idempotency.mismatch_status", 422)
            .payments(&demo, |r| r),
    ))
    .await;
    let http = Http::default();
    let key = new_key();
    http.pay(&gw.url("/payments"), "acme", &key, &payment("o", 1))
        .send()
        .await;
    let reused = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o", 2))
        .send()
        .await;
    assert_eq!(reused.status, StatusCode::UNPROCESSABLE_ENTITY);
    assert_eq!(reused.problem(), "idempotency-key-reused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_are_isolated_even_with_the_same_key() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let send = |tenant: &'static str, amount| {
        http.post(&gw.url("/payments"))
            .tenant(tenant)
            .key(&key)
            .json(&payment("shared-order", amount))
            .send()
    };
    let acme = send("acme", 100).await;
    // Another tenant, same key, different payload: its own operation, not a mismatch.
    let globex = send("globex", 200).await;
    assert_eq!(
        (acme.status, globex.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!globex.replayed());
    assert_ne!(acme.body, globex.body);
    let (acme_again, globex_again) = (send("acme", 100).await, send("globex", 200).await);
    assert_eq!(acme_again.body, acme.body);
    assert_eq!(globex_again.body, globex.body);
    assert!(acme_again.replayed() && globex_again.replayed());
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
    assert_eq!(db.executions("demo_payments", "globex", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_on_two_endpoints_is_two_operations() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let paid = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o", 100))
        .send()
        .await;
    let refund = format!(
        r#"{{"paymentId": "{}", "amountUah": 50}}"#,
        paid.json()["paymentId"].as_str().unwrap()
    );
    let refunded = http
        .post(&gw.url("/refunds"))
        .tenant("acme")
        .key(&key)
        .json(&refund)
        .send()
        .await;
    assert_eq!(
        (paid.status, refunded.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!refunded.replayed());
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
    assert_eq!(db.executions("demo_refunds", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_path_template_is_one_endpoint() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let routes = Route::idempotent("POST", "/orders/{id}/refunds", &demo.url());
    let gw = Gateway::start(config(TestConfig::new(&db).route(routes))).await;
    let http = Http::default();
    let key = new_key();
    // The demo has no such path and answers 404, which is kept and replayed like any 4xx.
    let first = http
        .post(&gw.url("/orders/1/refunds"))
        .tenant("acme")
        .key(&key)
        .json("{}")
        .send()
        .await;
    assert_eq!(first.status, StatusCode::NOT_FOUND);
    let again = http
        .post(&gw.url("/orders/1/refunds"))
        .tenant("acme")
        .key(&key)
        .json("{}")
        .send()
        .await;
    assert!(again.replayed());
    // Same template, other concrete path, same key: the same endpoint, so a mismatch.
    let other = http
        .post(&gw.url("/orders/2/refunds"))
        .tenant("acme")
        .key(&key)
        .json("{}")
        .send()
        .await;
    assert_eq!(other.problem(), "idempotency-key-reused");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_retry_can_wait_for_the_result() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let first = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-wait", 100))
            .demo_delay(600)
            .send(),
        std::time::Duration::from_millis(150),
    )
    .await;
    let waiting = http
        .post(&gw.url("/payments"))
        .tenant("acme")
        .key(&key)
        .header("prefer", "wait=5")
        .json(&payment("o-wait", 100))
        .send()
        .await;
    let first = first.await.unwrap();
    assert_eq!(waiting.status, StatusCode::CREATED, "{:?}", waiting.body);
    assert!(waiting.replayed());
    assert_eq!(waiting.header("preference-applied"), Some("wait=5"));
    assert_eq!(waiting.body, first.body);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_policy_can_be_the_routes_default() {
    let (_db, gw, http) = setup_with(|c| c, |r| r.set("on_in_progress", "wait")).await;
    let key = new_key();
    let first = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-w", 100))
            .demo_delay(600)
            .send(),
        std::time::Duration::from_millis(150),
    )
    .await;
    let waiting = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-w", 100))
        .send()
        .await;
    assert_eq!(waiting.status, StatusCode::CREATED);
    assert_eq!(waiting.body, first.await.unwrap().body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn keys_are_validated_and_sent_upstream_unquoted() {
    let (db, gw, http) = setup().await;
    let post = || {
        http.post(&gw.url("/payments"))
            .tenant("acme")
            .json(&payment("o", 1))
    };

    let missing = post().send().await;
    assert_eq!(
        (missing.status, missing.problem().as_str()),
        (StatusCode::BAD_REQUEST, "idempotency-key-missing")
    );
    for bad in [
        "a b",
        "a,b",
        &"k".repeat(256),
        "\"unterminated",
        "caf\u{e9}",
    ] {
        let answer = post().header("idempotency-key", bad).send().await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(answer.problem(), "idempotency-key-invalid", "{bad:?}");
    }
    let two = post().key("one").key("two").send().await;
    assert_eq!(
        (two.status, two.problem().as_str()),
        (StatusCode::BAD_REQUEST, "idempotency-key-invalid")
    );
    assert_eq!(db.ledger_rows("acme").await, 0, "bad keys claim nothing");

    let quoted = post().key("\"quoted-key-1\"").send().await;
    assert_eq!(quoted.status, StatusCode::CREATED);
    assert_eq!(
        db.executions("demo_payments", "acme", "quoted-key-1").await,
        1
    );
    let bare = post().key("quoted-key-1").send().await;
    assert!(bare.replayed(), "the quoted and bare forms are one key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_bodies_get_4xx_and_claim_nothing() {
    let (db, gw, http) = setup().await;
    for bad in [
        r#"{"orderId": "o", "amountUah": 1"#,
        r#"{"a":1,"a":2}"#,
        r#"{"a":"\ud800"}"#,
        "",
    ] {
        let answer = http
            .post(&gw.url("/payments"))
            .tenant("acme")
            .key(&new_key())
            .json(bad)
            .send()
            .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad:?}");
        assert_eq!(answer.problem(), "request-invalid", "{bad:?}");
    }
    // max_body_bytes is 4096 in tests: declared and streamed bodies over it get 413.
    let big = format!(r#"{{"orderId": "{}", "amountUah": 1}}"#, "x".repeat(5000));
    let answer = http
        .post(&gw.url("/payments"))
        .tenant("acme")
        .key(&new_key())
        .json(&big)
        .send()
        .await;
    assert_eq!(answer.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(answer.problem(), "payload-too-large");
    assert_eq!(db.ledger_rows("acme").await, 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unconfigured_routes_are_404() {
    let (_db, gw, http) = setup().await;
    let wrong_path = http
        .post(&gw.url("/nope"))
        .tenant("acme")
        .key(&new_key())
        .send()
        .await;
    assert_eq!(
        (wrong_path.status, wrong_path.problem().as_str()),
        (StatusCode::NOT_FOUND, "route-not-found")
    );
    let wrong_method = http
        .call(http::Method::PUT, &gw.url("/payments"))
        .tenant("acme")
        .send()
        .await;
    assert_eq!(wrong_method.status, StatusCode::NOT_FOUND);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn plain_routes_are_proxied_with_the_tokens_tenant() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let paid = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o", 7))
        .send()
        .await;
    // The client claims to be another tenant; the gateway overwrites X-Tenant-Id from
    // the token, so globex cannot read acme's payment and acme can.
    let spoofed = http
        .get(&gw.url(&format!("/payments/by-key/{key}")))
        .tenant("globex")
        .header("x-tenant-id", "acme")
        .send()
        .await;
    assert_eq!(spoofed.status, StatusCode::NOT_FOUND);
    let own = http
        .get(&gw.url(&format!("/payments/by-key/{key}")))
        .tenant("acme")
        .send()
        .await;
    assert_eq!(own.status, StatusCode::OK);
    assert_eq!(own.json(), paid.json());
    assert_eq!(
        db.ledger_rows("acme").await,
        1,
        "plain routes write no ledger rows"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_route_without_key_required_passes_keyless_requests_unprotected() {
    let (db, gw, http) = setup_with(|c| c, |r| r.set("key_required", false)).await;
    for _ in 0..2 {
        let answer = http
            .post(&gw.url("/payments"))
            .tenant("acme")
            .json(&payment("o-roll", 1))
            .send()
            .await;
        assert_eq!(answer.status, StatusCode::CREATED);
    }
    let mut conn = db.connect().await;
    let rows: i64 =
        sqlx::query_scalar("SELECT count(*) FROM demo_payments WHERE order_id = 'o-roll'")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(rows, 2, "without a key, each request executes");
    // With a key, the route is protected as usual.
    let key = new_key();
    for _ in 0..2 {
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-k", 1))
            .send()
            .await;
    }
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn health_endpoints_need_no_token() {
    let (_db, gw, http) = setup().await;
    assert_eq!(
        http.get(&gw.url("/healthz")).send().await.status,
        StatusCode::OK
    );
    let ready = http.get(&gw.url("/readyz")).send().await;
    assert_eq!(ready.status, StatusCode::OK);
    assert_eq!(ready.json()["postgres"], "up");
}

/// `Prefer: respond-async` (operation handles): a payment slower than the client will
/// wait is answered 202 with its result's `Location` once claimed; the execution goes on,
/// once; a retry with the header is 202 too (not 409); the result is 202 while it runs,
/// then the stored answer byte for byte; another tenant's handle is the lookup's 404, byte
/// for byte. (On 365c95c the first request waited for the payment: "left: 201, right: 202".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_payment_that_outlives_its_client_is_answered_202_and_its_result_fetched_later() {
    let (db, gw, http) = setup().await;
    let key = new_key();
    let body = payment("o-async", 100);
    let pay = || {
        http.pay(&gw.url("/payments"), "acme", &key, &body)
            .header("prefer", "respond-async")
            .demo_delay(1500)
    };
    let accepted = pay().send().await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{:?}", accepted.body);
    assert_eq!(accepted.header("preference-applied"), Some("respond-async"));
    let location = accepted.header("location").expect("Location").to_owned();
    assert_eq!(
        location,
        format!("/_idemgate/v1/keys/{key}/result?endpoint=POST%20%2Fpayments")
    );
    assert_eq!(accepted.json()["state"], "in_progress");
    let again = pay().send().await;
    assert_eq!(again.status, StatusCode::ACCEPTED, "a retry while it runs");

    let result = |tenant: &'static str| http.get(&gw.url(&location)).tenant(tenant).send();
    let running = result("acme").await;
    assert_eq!(running.status, StatusCode::ACCEPTED);
    assert!(running.header("retry-after").is_some());
    let settled = loop {
        let answer = result("acme").await;
        if answer.status != StatusCode::ACCEPTED {
            break answer;
        }
        // Real time: the payment takes the demo's 1.5 s.
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(settled.status, StatusCode::CREATED, "{:?}", settled.body);
    assert!(settled.replayed());
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &body)
        .send()
        .await;
    assert_eq!(settled.body, retry.body, "the stored answer, byte for byte");
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);

    let theirs = result("globex").await;
    let unknown = http
        .get(&gw.url(&location.replace(key.as_str(), "never-used")))
        .tenant("globex")
        .send()
        .await;
    assert_eq!(theirs.status, StatusCode::NOT_FOUND);
    assert_eq!(
        theirs.body, unknown.body,
        "another tenant's handle is the lookup's 404"
    );
}
