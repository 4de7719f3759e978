//! Operation handles (docs/http-api.md, "Operation handles") through real HTTP: two
//! gateway replicas on one ledger, without Redis (a wake-up never depends on it), the real
//! payments demo, and clients waiting for a key's result with `Prefer: wait=N`.

mod common;

use std::time::{Duration, Instant};

use common::*;
use http::StatusCode;

/// Two gateways (replicas) on one database and demo, without Redis.
async fn replicas(change: impl Fn(TestConfig) -> TestConfig) -> (TestDb, Gateway, Gateway) {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let test_config = || change(TestConfig::new(&db)).payments(&demo, |r| r);
    let mut a = Gateway::start(config(test_config())).await;
    let b = Gateway::start(config(test_config())).await;
    // The demo lives as long as the test: kept by the first replica.
    a.keep(demo);
    (db, a, b)
}

/// A payment of `ms`, answered 202 at once; its result's `Location`.
async fn slow_payment(http: &Http, gw: &Gateway, key: &str, ms: u64) -> String {
    let accepted = http
        .pay(&gw.url("/payments"), "acme", key, &payment("o-handle", 100))
        .header("prefer", "respond-async")
        .demo_delay(ms)
        .send()
        .await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{:?}", accepted.body);
    accepted.header("location").expect("Location").to_owned()
}

fn wait_for(http: &Http, gw: &Gateway, location: &str, seconds: u64) -> Call {
    http.get(&gw.url(location))
        .tenant("acme")
        .header("prefer", &format!("wait={seconds}"))
}

/// Three clients wait for one payment's result, two on the replica that runs it and one
/// on the other: all get the identical stored answer, within about a second of each other
/// and of the payment's end, with no Redis to tell them. (On 768657f a result never
/// waited: "left: 202, right: 201"; the other two tests failed the same way.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_on_both_replicas_get_the_one_answer_when_it_settles() {
    three_waiters_get_the_one_answer(None).await;
}

/// The same with Redis: its announcement of the completion wakes them, and the ledger's
/// poll stays the floor.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiters_with_redis_get_the_one_answer_when_it_settles() {
    let redis = RedisServer::start(&[]);
    three_waiters_get_the_one_answer(Some(&redis.url())).await;
}

async fn three_waiters_get_the_one_answer(redis: Option<&str>) {
    let (db, a, b) = replicas(|c| match redis {
        Some(url) => c.redis(url),
        None => c,
    })
    .await;
    let http = Http::default();
    let key = new_key();
    let location = slow_payment(&http, &a, &key, 2000).await;
    let started = Instant::now();
    let waiters: Vec<_> = [&a, &a, &b]
        .into_iter()
        .map(|gw| {
            let call = wait_for(&http, gw, &location, 20);
            tokio::spawn(async move {
                let answer = call.send().await;
                (answer, Instant::now())
            })
        })
        .collect();
    let mut answers = Vec::new();
    for waiter in waiters {
        answers.push(waiter.await.unwrap());
    }
    for (answer, _) in &answers {
        assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
        assert!(answer.replayed());
        assert_eq!(
            answer.body, answers[0].0.body,
            "one answer for every waiter"
        );
    }
    let first = answers.iter().map(|(_, at)| *at).min().unwrap();
    let last = answers.iter().map(|(_, at)| *at).max().unwrap();
    assert!(
        last - first < Duration::from_secs(1),
        "{:?} apart",
        last - first
    );
    // The payment took 2 s; every waiter was answered within about a second of its end.
    assert!(
        last - started < Duration::from_millis(3500),
        "{:?}",
        last - started
    );
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

/// A key released while its result is awaited (the upstream answered 429: nothing ran)
/// tells the waiter so: the lookup's 404 with `operation_state: not_executed` and
/// `safe_new_key: true`. Past the client's wait, a running key's result is 202.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_released_while_awaited_says_not_executed() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let routed = || {
        config(TestConfig::new(&db).route(Route::idempotent("POST", "/payments", &upstream.url())))
    };
    let (a, b) = (
        Gateway::start(routed()).await,
        Gateway::start(routed()).await,
    );
    let http = Http::default();
    let key = new_key();
    let accepted = http
        .pay(&a.url("/payments"), "acme", &key, "{}")
        .header("prefer", "respond-async")
        .header("x-test-status", "429")
        .header("x-test-delay-ms", "1500")
        .send()
        .await;
    assert_eq!(accepted.status, StatusCode::ACCEPTED, "{:?}", accepted.body);
    let location = accepted.header("location").unwrap().to_owned();
    let short = wait_for(&http, &b, &location, 1).send().await;
    assert_eq!(
        short.status,
        StatusCode::ACCEPTED,
        "past its wait: {:?}",
        short.body
    );
    let released = wait_for(&http, &b, &location, 20).send().await;
    assert_eq!(
        released.status,
        StatusCode::NOT_FOUND,
        "{:?}",
        released.body
    );
    assert_eq!(released.problem(), "idempotency-key-not-found");
    assert_eq!(released.json()["operation_state"], "not_executed");
    assert_eq!(released.json()["safe_new_key"], true);
}

/// A tenant's waiters are capped per replica: beyond `server.max_result_waiters`, 429 at
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_waiters_are_capped() {
    let (_db, a, _b) = replicas(|c| c.set("server.max_result_waiters", 1)).await;
    let http = Http::default();
    let key = new_key();
    let location = slow_payment(&http, &a, &key, 2000).await;
    let waiting = in_flight(
        wait_for(&http, &a, &location, 20).send(),
        Duration::from_millis(300),
    )
    .await;
    let refused = wait_for(&http, &a, &location, 20).send().await;
    assert_eq!(
        refused.status,
        StatusCode::TOO_MANY_REQUESTS,
        "{:?}",
        refused.body
    );
    assert_eq!(refused.problem(), "tenant-concurrency-limited");
    assert_eq!(waiting.await.unwrap().status, StatusCode::CREATED);
}

/// `Prefer: respond-async` never answers the lookup's 404 for the request's own key: an
/// upstream that releases the key at once (429) races the 202's lookup of the claim, and
/// the request then gets its own answer. (Found in review of d2ff041: the 202's lookup
/// found no row and answered 404 `idempotency-key-not-found` to the POST: "statuses seen:
/// {202, 404, 429}".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn respond_async_never_answers_404_for_its_own_key() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let gw = Gateway::start(config(TestConfig::new(&db).route(Route::idempotent(
        "POST",
        "/payments",
        &upstream.url(),
    ))))
    .await;
    let http = Http::default();
    let mut seen = std::collections::BTreeSet::new();
    for _ in 0..40 {
        let answer = http
            .pay(&gw.url("/payments"), "acme", &new_key(), "{}")
            .header("prefer", "respond-async")
            .header("x-test-status", "429")
            .send()
            .await;
        seen.insert(answer.status.as_u16());
    }
    assert!(
        seen.iter().all(|s| [202, 429].contains(s)),
        "statuses seen: {seen:?}"
    );
}
