//! payments-demo as a card processor (`PAYMENTS_DEMO_MODE=processor`), against a Postgres
//! of the test's own: one charge per `Idempotency-Key`, every call counted, the same answer
//! for every call with the key.

use idem_testkit::{Demo, Http, TestDb};

async fn charges(db: &TestDb, key: &str) -> Vec<(String, i64, i32)> {
    let mut conn = db.connect().await;
    sqlx::query_as(
        "SELECT order_id, amount_uah, calls FROM processor_charges WHERE idempotency_key = $1",
    )
    .bind(key)
    .fetch_all(&mut conn)
    .await
    .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_is_charged_once_and_every_call_gets_the_same_answer() {
    let db = TestDb::create().await;
    let processor = Demo::processor(&db).await;
    let http = Http::default();
    let charge = |key: &str, body: &str| {
        http.post(&format!("{}/charges", processor.url()))
            .key(key)
            .json(body)
    };
    let body = r#"{"orderId": "order-7", "amountUah": 100}"#;
    let first = charge("call-1", body).send().await;
    assert_eq!(first.status.as_u16(), 201, "{:?}", first.body);
    assert_eq!(first.json()["orderId"], "order-7");
    assert!(first.header("idempotent-replayed").is_none());
    let again = charge("call-1", body).send().await;
    assert_eq!(again.status.as_u16(), 201);
    assert_eq!(again.body, first.body, "the same answer");
    assert_eq!(again.header("idempotent-replayed"), Some("true"));
    assert_eq!(
        charges(&db, "call-1").await,
        vec![("order-7".into(), 100, 2)]
    );

    // The key used for another charge: refused, the first charge kept.
    let other = charge("call-1", r#"{"orderId": "order-8", "amountUah": 100}"#)
        .send()
        .await;
    assert_eq!(other.status.as_u16(), 409, "{:?}", other.body);
    assert_eq!(charges(&db, "call-1").await[0].0, "order-7");

    // What a caller asks when it cannot tell whether its call arrived.
    let found = http
        .get(&format!("{}/charges/by-key/call-1", processor.url()))
        .send()
        .await;
    assert_eq!(found.status.as_u16(), 200);
    assert_eq!(found.body, first.body);
    let absent = http
        .get(&format!("{}/charges/by-key/never-called", processor.url()))
        .send()
        .await;
    assert_eq!(absent.status.as_u16(), 404);

    // No key, or an injected failure: nothing charged.
    let keyless = http
        .post(&format!("{}/charges", processor.url()))
        .json(body)
        .send()
        .await;
    assert_eq!(keyless.status.as_u16(), 400);
    let failed = charge("call-2", body)
        .header("x-demo-fail", "500")
        .send()
        .await;
    assert_eq!(failed.status.as_u16(), 500);
    assert!(charges(&db, "call-2").await.is_empty());
}
