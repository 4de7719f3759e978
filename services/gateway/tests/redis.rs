//! The Redis fast path, against redis-server processes of the tests' own (so they can be
//! killed, flushed, squeezed and restarted): cheap replays, and exactly-once whatever
//! state Redis is in.

mod common;

use std::collections::HashSet;
use std::time::Duration;

use common::*;
use http::StatusCode;

/// 100 concurrent identical requests, split over `gateways`; `during` runs while they
/// are in flight. Asserts the invariants and returns the one body every 201 carried.
async fn storm(
    gateways: &[&Gateway],
    db: &TestDb,
    key: &str,
    during: impl AsyncFnOnce(),
) -> bytes::Bytes {
    let http = Http::default();
    let token = token("acme");
    let calls: Vec<_> = (0..100)
        .map(|i| {
            let gw = gateways[i % gateways.len()];
            tokio::spawn(
                http.post(&gw.url("/payments"))
                    .bearer(&token)
                    .key(key)
                    .demo_delay(300)
                    .json(&payment("order-storm", 100))
                    .send(),
            )
        })
        .collect();
    during().await;
    let mut bodies = HashSet::new();
    for call in calls {
        let answer = call.await.unwrap();
        match answer.status {
            StatusCode::CREATED => {
                bodies.insert(answer.body.clone());
            }
            StatusCode::CONFLICT => assert_eq!(answer.problem(), "idempotency-key-in-progress"),
            other => panic!("unexpected {other}: {:?}", answer.body),
        }
    }
    assert_eq!(bodies.len(), 1, "every 201 carries the same body");
    assert_eq!(
        db.executions("demo_payments", "acme", key).await,
        1,
        "exactly one execution"
    );
    bodies.into_iter().next().unwrap()
}

/// Retries after the storm: all replays of `body`, byte for byte.
async fn replays_are_identical(gateways: &[&Gateway], key: &str, body: &bytes::Bytes) {
    let http = Http::default();
    for gw in gateways {
        let replay = http
            .post(&gw.url("/payments"))
            .tenant("acme")
            .key(key)
            .json(&payment("order-storm", 100))
            .send()
            .await;
        assert_eq!(replay.status, StatusCode::CREATED);
        assert!(replay.replayed());
        assert_eq!(&replay.body, body);
    }
}

async fn two_gateways(db: &TestDb, demo: &Demo, redis_url: &str) -> (Gateway, Gateway) {
    let cfg = TestConfig::new(db).redis(redis_url).payments(demo, |r| r);
    (
        Gateway::start(config(cfg.clone())).await,
        Gateway::start(config(cfg)).await,
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_warm_replay_makes_no_postgres_query() {
    let redis = RedisServer::start(&[]);
    let (_db, gw, http) = setup_with(|c| c.redis(&redis.url()), |r| r).await;
    let key = new_key();
    let send = || {
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-warm", 100))
            .send()
    };
    let first = send().await;
    assert_eq!(first.status, StatusCode::CREATED);

    let calls = gw.ledger_calls();
    let hits = gw.cache_stats().hits;
    for _ in 0..5 {
        let replay = send().await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
        assert_eq!(replay.header("location"), first.header("location"));
    }
    assert_eq!(
        gw.ledger_calls(),
        calls,
        "replays were served without touching Postgres"
    );
    assert_eq!(gw.cache_stats().hits, hits + 5);

    // A mismatch is caught from the cache too, still without Postgres.
    let reused = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-warm", 5))
        .send()
        .await;
    assert_eq!(reused.problem(), "idempotency-key-reused");
    assert_eq!(gw.ledger_calls(), calls);
    // Another tenant's same key is not in acme's cache entry.
    let other = http
        .pay(
            &gw.url("/payments"),
            "globex",
            &key,
            &payment("o-warm", 100),
        )
        .send()
        .await;
    assert!(!other.replayed());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_is_turned_away_by_the_lock_alone() {
    let redis = RedisServer::start(&[]);
    let (_db, gw, http) = setup_with(|c| c.redis(&redis.url()), |r| r).await;
    let key = new_key();
    let first = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-lock", 1))
            .demo_delay(500)
            .send(),
        Duration::from_millis(150),
    )
    .await;
    let calls = gw.ledger_calls();
    let duplicate = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-lock", 1))
        .send()
        .await;
    assert_eq!(duplicate.problem(), "idempotency-key-in-progress");
    assert_eq!(
        gw.ledger_calls(),
        calls,
        "the Redis lock answered without a Postgres round trip"
    );
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
}

/// `redis.lock = false`: a new key writes no lock, a storm of duplicates is decided by
/// Postgres alone (one execution, the rest in progress or replayed), and Redis still
/// serves the completed answer, to the other gateway too, without Postgres.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_lock_postgres_decides_and_redis_still_replays() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&[]);
    let cfg = TestConfig::new(&db)
        .redis(&redis.url())
        .set("redis.lock", false)
        .payments(&demo, |r| r);
    let (a, b) = (
        Gateway::start(config(cfg.clone())).await,
        Gateway::start(config(cfg)).await,
    );
    let key = new_key();
    let body = storm(&[&a, &b], &db, &key, async || {
        // Real time: while the first attempt runs upstream.
        tokio::time::sleep(Duration::from_millis(150)).await;
        let locks = redis.cli(&["--scan", "--pattern", "*:l"]);
        assert_eq!(locks.trim(), "", "no lock was written");
    })
    .await;
    let calls = (a.ledger_calls(), b.ledger_calls());
    replays_are_identical(&[&a, &b], &key, &body).await;
    assert_eq!(
        (a.ledger_calls(), b.ledger_calls()),
        calls,
        "the replays came from Redis"
    );
    assert!(a.cache_stats().hits > 0 && b.cache_stats().hits > 0);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_killed_mid_storm_changes_nothing_a_client_sees() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let mut redis = RedisServer::start(&[]);
    let (a, b) = two_gateways(&db, &demo, &redis.url()).await;
    let key = new_key();
    let body = storm(&[&a, &b], &db, &key, async || {
        // Real time: the fault lands while the storm is under way in the gateways.
        tokio::time::sleep(Duration::from_millis(100)).await;
        redis.kill();
    })
    .await;
    replays_are_identical(&[&a, &b], &key, &body).await;
    assert!(
        !a.cache_stats().up || !b.cache_stats().up,
        "the breaker noticed"
    );
    // New keys keep working through Postgres alone.
    let fresh = new_key();
    let body = storm(&[&a, &b], &db, &fresh, async || {}).await;
    replays_are_identical(&[&a, &b], &fresh, &body).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redis_that_stops_answering_changes_nothing_a_client_sees() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&["--enable-debug-command", "yes"]);
    let (a, b) = two_gateways(&db, &demo, &redis.url()).await;
    let key = new_key();
    let body = storm(&[&a, &b], &db, &key, async || {
        // Real time: the fault lands while the storm is under way in the gateways.
        tokio::time::sleep(Duration::from_millis(50)).await;
        // Redis hangs for a second (a stand-in for a slow or partitioned server).
        let url = redis.port.to_string();
        tokio::task::spawn_blocking(move || {
            std::process::Command::new("redis-cli")
                .args(["-p", &url, "DEBUG", "SLEEP", "1"])
                .output()
                .unwrap()
        });
    })
    .await;
    replays_are_identical(&[&a, &b], &key, &body).await;
    assert!(
        a.cache_stats().errors + b.cache_stats().errors > 0,
        "the hang was noticed as timeouts"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn flushall_changes_nothing_a_client_sees() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&[]);
    let (a, b) = two_gateways(&db, &demo, &redis.url()).await;
    // Flushed while the first attempt is in flight: its lock vanishes.
    let key = new_key();
    let body = storm(&[&a, &b], &db, &key, async || {
        // Real time: the fault lands while the storm is under way in the gateways.
        tokio::time::sleep(Duration::from_millis(100)).await;
        assert_eq!(redis.cli(&["FLUSHALL"]).trim(), "OK");
    })
    .await;
    // Flushed after completion: the cached response vanishes.
    assert_eq!(redis.cli(&["FLUSHALL"]).trim(), "OK");
    replays_are_identical(&[&a, &b], &key, &body).await;
    let again = storm(&[&a, &b], &db, &key, async || {}).await;
    assert_eq!(
        again, body,
        "a storm of retries after the flush replays the one result"
    );
    assert!(
        a.cache_stats().up && b.cache_stats().up,
        "a flush is not a failure"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn eviction_under_maxmemory_changes_nothing_a_client_sees() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&["--maxmemory", "1mb", "--maxmemory-policy", "allkeys-lru"]);
    let (a, b) = two_gateways(&db, &demo, &redis.url()).await;
    let filler = "x".repeat(20_000);
    let fill = || {
        // ~4 MB of other data into a 1 MB Redis: our keys get evicted along the way.
        for i in 0..200 {
            redis.cli(&["SET", &format!("filler:{i}"), &filler]);
        }
    };
    let key = new_key();
    let body = storm(&[&a, &b], &db, &key, async || {
        // Real time: the fault lands while the storm is under way in the gateways.
        tokio::time::sleep(Duration::from_millis(50)).await;
        fill();
    })
    .await;
    fill();
    let evicted: u64 = redis
        .cli(&["INFO", "stats"])
        .lines()
        .find_map(|l| l.strip_prefix("evicted_keys:"))
        .and_then(|n| n.trim().parse().ok())
        .unwrap();
    // At 1 MB, Redis either evicts (keys, ours among them) or, when connection buffers
    // alone fill it, refuses writes with OOM. Either way the test squeezed it.
    let oom = redis.cli(&["INFO", "errorstats"]).contains("errorstat_OOM");
    assert!(evicted > 0 || oom, "the test did squeeze Redis");
    replays_are_identical(&[&a, &b], &key, &body).await;
    let again = storm(&[&a, &b], &db, &key, async || fill()).await;
    assert_eq!(again, body);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_redis_is_used_again_without_restarting_the_gateway() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let mut redis = RedisServer::start(&[]);
    let cfg = TestConfig::new(&db).redis(&redis.url());
    let gw = Gateway::start(config(cfg.payments(&demo, |r| r))).await;
    let http = Http::default();
    let key = new_key();
    let send = || {
        http.pay(
            &gw.url("/payments"),
            "acme",
            &key,
            &payment("o-restart", 100),
        )
        .send()
    };
    let first = send().await;

    redis.kill();
    let during = send().await;
    assert_eq!(
        during.body, first.body,
        "served from Postgres while Redis is down"
    );
    assert!(!gw.cache_stats().up);
    let ready = http.get(&gw.url("/readyz")).send().await;
    assert_eq!(
        ready.status,
        StatusCode::OK,
        "Postgres alone is enough to be ready"
    );
    assert!(ready.json()["redis"].as_str().unwrap().starts_with("down"));
    let metrics = http.get(&gw.url("/metrics")).send().await;
    assert!(String::from_utf8_lossy(&metrics.body).contains("\nidemgate_cache_up 0\n"));

    redis.restart(); // empty: the restart lost every key
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !gw.cache_stats().up {
        assert!(
            std::time::Instant::now() < deadline,
            "the breaker closed again"
        );
        // Real time: polling the breaker, which probes Redis on its own clock.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The first replay after the restart refills the cache from Postgres; the next ones
    // are served by Redis alone.
    assert_eq!(send().await.body, first.body);
    let calls = gw.ledger_calls();
    assert_eq!(send().await.body, first.body);
    assert_eq!(gw.ledger_calls(), calls);
    assert_eq!(
        http.get(&gw.url("/readyz")).send().await.json()["redis"],
        "up"
    );
    let metrics = http.get(&gw.url("/metrics")).send().await;
    assert!(String::from_utf8_lossy(&metrics.body).contains("\nidemgate_cache_up 1\n"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn redis_down_at_start_up_does_not_stop_the_gateway() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let nowhere = format!("redis://127.0.0.1:{}", free_port(false));
    let cfg = TestConfig::new(&db).redis(&nowhere);
    let gw = Gateway::start(config(cfg.payments(&demo, |r| r))).await;
    let http = Http::default();
    let key = new_key();
    let started = std::time::Instant::now();
    let first = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o", 1))
        .send()
        .await;
    let replay = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o", 1))
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert_eq!(replay.body, first.body);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "no waiting on a Redis that is not there"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_retry_is_woken_by_pubsub_and_gets_the_replay() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&[]);
    let (a, b) = two_gateways(&db, &demo, &redis.url()).await;
    let http = Http::default();
    let key = new_key();
    let first = in_flight(
        http.pay(&a.url("/payments"), "acme", &key, &payment("o-wait", 100))
            .demo_delay(600)
            .send(),
        Duration::from_millis(150),
    )
    .await;
    // On the other gateway, so the wake-up must cross Redis.
    let waiting = http
        .post(&b.url("/payments"))
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
async fn a_three_node_cluster_serves_the_fast_path_and_holds_the_storm() {
    let nodes: Vec<RedisServer> = (0..3)
        .map(|_| {
            RedisServer::start(&["--cluster-enabled", "yes", "--cluster-node-timeout", "2000"])
        })
        .collect();
    // Each node gets its own cluster-config file (it lives in the node's own dir).
    let addrs: Vec<String> = nodes
        .iter()
        .map(|n| format!("127.0.0.1:{}", n.port))
        .collect();
    let mut create = std::process::Command::new("redis-cli");
    create
        .arg("--cluster")
        .arg("create")
        .args(&addrs)
        .arg("--cluster-yes");
    let out = create.output().expect("redis-cli --cluster create");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while !nodes
        .iter()
        .all(|n| n.cli(&["CLUSTER", "INFO"]).contains("cluster_state:ok"))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the cluster became ready"
        );
        // Real time: polling the cluster, which converges in its own processes.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let urls: Vec<String> = nodes.iter().map(RedisServer::url).collect();
    let cfg = TestConfig::new(&db)
        .set("redis.cluster_urls", urls)
        .set("redis.timeout", "500ms")
        .set("redis.probe_interval", "200ms")
        .payments(&demo, |r| r);
    let a = Gateway::start(config(cfg.clone())).await;
    let b = Gateway::start(config(cfg)).await;
    assert!(a.cache_stats().up && b.cache_stats().up);

    let key = new_key();
    let body = storm(&[&a, &b], &db, &key, async || {}).await;
    let calls = a.ledger_calls();
    replays_are_identical(&[&a], &key, &body).await;
    assert_eq!(
        a.ledger_calls(),
        calls,
        "replays come from the cluster alone"
    );
    // Errors Redis answered (CROSSSLOT, MOVED): none. (A call not answered within the
    // 500 ms timeout is possible on a loaded two-core machine, and is not the point.)
    let stats = a.cache_stats();
    assert_eq!(
        stats.errors - stats.timeouts,
        0,
        "no CROSSSLOT or other errors: {stats:?}"
    );
    // Keys of many scopes spread over the nodes, each scope's keys in one slot.
    for _ in 0..10 {
        let key = new_key();
        let http = Http::default();
        let first = http
            .pay(&a.url("/payments"), "acme", &key, &payment("o", 1))
            .send()
            .await;
        let replay = http
            .pay(&b.url("/payments"), "acme", &key, &payment("o", 1))
            .send()
            .await;
        assert_eq!(replay.body, first.body);
    }
    let answered_errors = |s: idem_redis::CacheStats| s.errors - s.timeouts;
    assert_eq!(
        answered_errors(a.cache_stats()) + answered_errors(b.cache_stats()),
        0
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_and_releases_are_announced_over_pubsub() {
    use idem_core::{AttemptId, Cache, IdempotencyKey, Scope};
    use idem_redis::{RedisCache, RedisSettings};
    let redis = RedisServer::start(&[]);
    let settings = RedisSettings {
        urls: vec![redis.url()],
        cluster: false,
        prefix: "idem:".into(),
        timeout: Duration::from_millis(200),
        reconnect_interval: Duration::from_millis(200),
        lock: true,
    };
    let (waiter, announcer) = (
        RedisCache::start(&settings).await.unwrap(),
        RedisCache::start(&settings).await.unwrap(),
    );
    let scope = |key: &str| {
        Scope::new(
            "acme",
            "POST /payments",
            IdempotencyKey::parse(key.as_bytes()).unwrap(),
        )
    };
    let watched = {
        let (waiter, scope) = (waiter.clone(), scope("watched"));
        tokio::spawn(async move { waiter.changed(&scope).await })
    };
    let other = {
        let (waiter, scope) = (waiter.clone(), scope("other"));
        tokio::spawn(async move { waiter.changed(&scope).await })
    };
    // The subscription is made in the background: announce until it is heard.
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    while !watched.is_finished() {
        assert!(
            std::time::Instant::now() < deadline,
            "the waiter was never woken"
        );
        announcer
            .unlock(&scope("watched"), AttemptId::random())
            .await;
        // Real time: polling for an announcement that goes through a real Redis.
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        !other.is_finished(),
        "a waiter on another scope is not woken"
    );
    other.abort();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_in_process_layer_serves_hot_replays_without_any_round_trip() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&[]);
    let cfg = TestConfig::new(&db)
        .redis(&redis.url())
        .set("redis.local_cache_entries", 100);
    let gw = Gateway::start(config(cfg.payments(&demo, |r| r))).await;
    let http = Http::default();
    let key = new_key();
    let send = || {
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-local", 1))
            .send()
    };
    let first = send().await;
    let (calls, redis_before) = (gw.ledger_calls(), gw.cache_stats());
    for _ in 0..5 {
        let replay = send().await;
        assert!(replay.replayed());
        assert_eq!(replay.body, first.body);
    }
    assert_eq!(gw.ledger_calls(), calls, "no Postgres");
    let redis_after = gw.cache_stats();
    assert_eq!(
        (redis_after.hits, redis_after.misses),
        (redis_before.hits, redis_before.misses),
        "no Redis either"
    );
    // Still scoped: another tenant's same key executes.
    let other = http
        .pay(&gw.url("/payments"), "globex", &key, &payment("o-local", 1))
        .send()
        .await;
    assert!(!other.replayed());
    // And a different payload is still a mismatch.
    let reused = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-local", 2))
        .send()
        .await;
    assert_eq!(reused.problem(), "idempotency-key-reused");
}
