//! What an embedded request costs Postgres, counted on the wire (a [`PgCounter`] between
//! the layer's pool and Postgres): round trips the request waits for and statements it
//! runs. Counts, not timings: the same on any machine.

mod common;

use axum::http::StatusCode;
use common::*;

/// A service whose layer talks to Postgres through a counting proxy, on one connection
/// (each new one would prepare its statements again), warmed (opened, its statements
/// prepared) by two new keys.
async fn counted() -> (PgCounter, Service, Http) {
    let pg = PgCounter::start("127.0.0.1:5432".parse().unwrap()).await;
    let via = Via {
        proxy: pg.addr,
        connections: 1,
    };
    let svc = service_via(|o| o, None, Some(via)).await;
    let http = Http::default();
    for _ in 0..2 {
        let warm = http
            .pay(&svc.url, "acme", &new_key(), &order(1))
            .send()
            .await;
        assert_eq!(warm.status, StatusCode::CREATED, "{:?}", warm.body);
    }
    settled(&pg).await;
    (pg, svc, http)
}

/// What was asked once nothing more comes: a connection goes back to sqlx's pool after
/// the answer has left, and the pool checks it then with a round trip of its own.
async fn settled(pg: &PgCounter) -> Wire {
    let mut seen = pg.wire();
    loop {
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        let now = pg.wire();
        if now == seen {
            return now;
        }
        seen = now;
    }
}

/// The first three words of each statement sent.
fn heads(cost: &Wire) -> Vec<String> {
    cost.statements
        .iter()
        .map(|sql| sql.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .collect()
}

/// A new key: one statement per round trip — the transaction begun with its lock wait,
/// the claim, the handler's insert, the completion, the commit — and the pool's check of
/// the connection when it comes back (sqlx sends a `Sync` on every release). Six, where
/// the handler alone would take two (its insert, autocommitted, and the same check).
/// sqlx waits for each statement's answer before it sends the next (no pipelining), and
/// `BEGIN` is its own round trip; folding the completion into the commit would need the
/// simple-query protocol (no prepared plan), which cost more Postgres CPU than the round
/// trip saved (docs/performance.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_key_costs_five_round_trips_and_the_pools_check() {
    let (pg, svc, http) = counted().await;
    let before = pg.wire();
    let paid = http
        .pay(&svc.url, "acme", &new_key(), &order(5))
        .send()
        .await;
    assert_eq!(paid.status, StatusCode::CREATED, "{:?}", paid.body);
    let cost = settled(&pg).await.since(&before);
    let heads = heads(&cost);
    assert_eq!(
        heads,
        [
            "BEGIN",
            "SET LOCAL lock_timeout",
            "INSERT INTO idempotency_keys", // the claim
            "INSERT INTO orders",
            "UPDATE idempotency_keys AS", // the completion
            "COMMIT",
        ],
        "the statements of one new key"
    );
    // Q: BEGIN and SET LOCAL as one simple query; BECS: bind, execute, close, sync; the
    // last S is the pool's check.
    assert_eq!(
        cost.messages, "QBECSBECSBECSQS",
        "the messages of one new key"
    );
    assert_eq!(cost.round_trips, 6);
}

/// A retry of a key this process does not hold: the claim's insert conflicts and writes
/// nothing, the take-over reads the stored answer, and the transaction ends with nothing
/// to commit. One statement more than a claim that reads first would send, for a claim of
/// a new key that costs Postgres a fifth less (docs/performance.md).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_from_postgres_costs_the_insert_and_the_read() {
    let (pg, svc, http) = counted().await;
    let other = service(|o| o, Some(&svc)).await;
    let keys = [new_key(), new_key()];
    for key in &keys {
        let first = http.pay(&other.url, "acme", key, &order(5)).send().await;
        assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    }
    // The first replay prepares the take-over on the connection; the second is counted.
    let replay = |key| http.pay(&svc.url, "acme", key, &order(5)).send();
    assert!(replay(&keys[0]).await.replayed());
    let before = settled(&pg).await;
    let second = replay(&keys[1]).await;
    assert!(second.replayed(), "{:?}", second.body);
    let cost = settled(&pg).await.since(&before);
    let heads = heads(&cost);
    assert_eq!(
        heads,
        [
            "BEGIN",
            "SET LOCAL lock_timeout",
            "INSERT INTO idempotency_keys",
            "WITH taken AS",
            "ROLLBACK"
        ],
        "the statements of a replay from Postgres"
    );
    assert_eq!(
        cost.messages, "QBECSBECSQS",
        "the messages of a replay from Postgres"
    );
    assert_eq!(cost.round_trips, 5);
}

/// A replay this process holds costs Postgres nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_from_memory_costs_no_round_trip() {
    let (pg, svc, http) = counted().await;
    let key = new_key();
    let first = http.pay(&svc.url, "acme", &key, &order(5)).send().await;
    assert_eq!(first.status, StatusCode::CREATED, "{:?}", first.body);
    let before = settled(&pg).await;
    let replay = http.pay(&svc.url, "acme", &key, &order(5)).send().await;
    assert!(replay.replayed(), "{:?}", replay.body);
    let cost = settled(&pg).await.since(&before);
    assert_eq!(cost, Wire::default(), "a replay from memory asked Postgres");
}
