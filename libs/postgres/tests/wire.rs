//! What the ledger's group statements cost on the wire, counted through a proxy
//! ([`PgCounter`]): round trips, not time.

mod common;

use std::time::Duration;

use common::*;
use idem_postgres::PgLedger;
use idem_testkit::{PgCounter, TestDb};

/// Claims sent one after another each go as one statement, on a connection the pipe kept
/// from the statement before: one round trip each. (On 16d2368 every statement took its
/// connection from the pool and gave it back, and sqlx pings each connection it gets
/// back, and a connection new to the statement prepares it again: "left: 21, right:
/// 10", messages `SPDSBECSSBECSS…`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn statements_in_a_row_cost_one_round_trip_each() {
    let db = TestDb::create().await;
    db.migrate().await;
    let counter = PgCounter::start("127.0.0.1:5432".parse().unwrap()).await;
    let ledger = PgLedger::new(pool(&counter.url(&db.url)).await, Duration::from_secs(5));
    // The first statement prepares what the rest reuse.
    claim(&ledger, &scope("wire-0"), Duration::from_secs(30)).await;
    let before = counter.wire();
    for i in 1..=10 {
        claim(
            &ledger,
            &scope(&format!("wire-{i}")),
            Duration::from_secs(30),
        )
        .await;
    }
    let spent = counter.wire().since(&before);
    assert_eq!(spent.round_trips, 10, "messages: {}", spent.messages);
}

/// The kept connection goes back to the pool once the pipes have had nothing to write
/// for a moment (`WARM_IDLE`), so an idle gateway holds none out of it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kept_connection_goes_back_to_the_pool_when_there_is_nothing_to_write() {
    let db = TestDb::create().await;
    db.migrate().await;
    let pool = pool(&db.url).await;
    let ledger = PgLedger::new(pool.clone(), Duration::from_secs(5));
    claim(&ledger, &scope("kept-0"), Duration::from_secs(30)).await;
    assert_eq!(
        pool.num_idle() + 1,
        pool.size() as usize,
        "the claim's connection is kept for the next statement"
    );
    tokio::time::sleep(idem_postgres::group::WARM_IDLE * 3).await;
    assert_eq!(
        pool.num_idle(),
        pool.size() as usize,
        "given back after {:?} without work",
        idem_postgres::group::WARM_IDLE
    );
}

/// A pool of four that does not ping a connection before handing it out, as the gateway's.
async fn pool(url: &str) -> sqlx::PgPool {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .test_before_acquire(false)
        .connect(url)
        .await
        .unwrap()
}
