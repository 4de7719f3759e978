//! payments-demo as a Redis Stream consumer (docs/embedded-mode.md, "Queue consumers"),
//! against a Redis and a Postgres of the test's own: a message that can never be paid is
//! dead-lettered after its deliveries, counted, and blocks nothing; a clean exit leaves
//! the group.

use std::time::Duration;

use idem_testkit::{Demo, Http, RedisServer, TestConfig, TestDb, metric};

/// Waits up to 15 s for `check` to hold, polling every 100 ms.
async fn eventually(what: &str, mut check: impl AsyncFnMut() -> bool) {
    let deadline = std::time::Instant::now() + Duration::from_secs(15);
    while !check().await {
        assert!(std::time::Instant::now() < deadline, "never: {what}");
        // Real time: the consumer works on its own clock.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A command Postgres refuses every time (an `orderId` holding `\u0000`) is delivered
/// `PAYMENTS_DEMO_MAX_DELIVERIES` times, then moved to the dead-letter stream, counted and
/// acknowledged; the commands after it are paid meanwhile. (On f929534 it was redelivered
/// for good: "never: the poison message is dead-lettered".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_poison_message_is_dead_lettered_and_blocks_nothing() {
    let db = TestDb::create().await;
    let redis = RedisServer::start(&[]);
    let config = TestConfig::new(&db).redis(&redis.url()).toml();
    let mut consumer = Demo::consumer(
        &db,
        &config,
        &[
            ("PAYMENTS_DEMO_STREAM", "payments"),
            ("PAYMENTS_DEMO_CONSUMER", "consumer-1"),
            ("PAYMENTS_DEMO_CLAIM_IDLE", "200ms"),
            ("PAYMENTS_DEMO_MAX_DELIVERIES", "3"),
        ],
    )
    .await;
    let publish = |key: &str, order: &str| {
        let body = format!(r#"{{"orderId": "{order}", "amountUah": 100}}"#);
        redis.cli(&[
            "XADD", "payments", "*", "tenant", "acme", "key", key, "body", &body,
        ])
    };
    let poison = publish("poison-1", r"bad\u0000order");
    let poison = poison.trim().to_owned();
    publish("good-1", "order-1");
    publish("good-2", "order-2");

    for key in ["good-1", "good-2"] {
        eventually(&format!("{key} is paid"), async || {
            db.executions("demo_payments", "acme", key).await == 1
        })
        .await;
    }
    eventually("the poison message is dead-lettered", async || {
        redis.cli(&["XLEN", "payments:dead"]).trim() == "1"
    })
    .await;
    let dead = redis.cli(&["XRANGE", "payments:dead", "-", "+"]);
    assert!(dead.contains("poison-1"), "{dead}");
    assert!(dead.contains(&poison), "its source id: {dead}");
    let deliveries: u64 = dead
        .lines()
        .skip_while(|l| l.trim() != "deliveries")
        .nth(1)
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or_else(|| panic!("a delivery count: {dead}"));
    assert_eq!(deliveries, 4, "dead-lettered once delivered past 3 times");
    assert_eq!(
        redis
            .cli(&["XPENDING", "payments", "payments-demo"])
            .lines()
            .next(),
        Some("0"),
        "nothing left pending"
    );
    assert_eq!(db.executions("demo_payments", "acme", "poison-1").await, 0);
    let scraped = Http::default()
        .get(&format!("{}/metrics", consumer.url()))
        .send()
        .await;
    let scraped = String::from_utf8_lossy(&scraped.body).into_owned();
    assert_eq!(
        metric(&scraped, "payments_demo_dead_lettered_total"),
        Some(1.0)
    );

    // A clean exit with nothing pending leaves the group.
    assert!(
        redis
            .cli(&["XINFO", "CONSUMERS", "payments", "payments-demo"])
            .contains("consumer-1")
    );
    assert!(consumer.terminate().await, "a clean exit");
    let consumers = redis.cli(&["XINFO", "CONSUMERS", "payments", "payments-demo"]);
    assert!(
        !consumers.contains("consumer-1"),
        "left the group: {consumers}"
    );
}
