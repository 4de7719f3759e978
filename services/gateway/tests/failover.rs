//! What the gateway does when Postgres fails over under it (docs/faults.md), on real
//! Postgres: rows lost by the failover, connections that must leave the pool.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;

async fn scrape(http: &Http, gw: &GatewayProcess, name: &str) -> f64 {
    let answer = http.get(&gw.url("/metrics")).send().await;
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    metric(&text, name).unwrap_or(0.0)
}

/// A failover to a standby that had not received the claim's commit: the row is gone
/// while the payment runs. The completion writes the record back, so the retry replays
/// and the payment ran once. (On d90d3dd the completion was "fenced out" and the retry
/// claimed the key afresh and paid again: "the retry replays the written-back record".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_lost_under_a_running_payment_is_written_back_and_replayed() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let gw = GatewayProcess::start(&TestConfig::new(&db).payments(&demo, |r| r).toml()).await;
    let http = Http::default();
    let key = new_key();
    let body = payment("o-lost", 5);
    let first = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &body)
            .demo_delay(1500)
            .send(),
        Duration::from_millis(500),
    )
    .await;
    assert_eq!(db.ledger_rows("acme").await, 1, "claimed, and running");
    let mut conn = db.connect().await;
    sqlx::query("DELETE FROM idempotency_keys WHERE tenant_id = 'acme' AND key = $1")
        .bind(&key)
        .execute(&mut conn)
        .await
        .unwrap();

    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &body)
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(
        retry.replayed(),
        "the retry replays the written-back record"
    );
    assert_eq!(retry.body, first.body);
    assert_eq!(
        db.executions("demo_payments", "acme", &key).await,
        1,
        "payments for one key"
    );
    assert_eq!(
        scrape(&http, &gw, "idemgate_records_restored_total").await,
        1.0
    );
}
