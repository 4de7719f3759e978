//! Embedded mode as a process: payments-demo with `PAYMENTS_DEMO_MODE=embedded`, killed
//! at its failpoints, moved to and from the gateway, and its outbox.

use std::time::Duration;

use http::StatusCode;
use idem_testkit::*;

const TENANT: &str = "acme";

fn config(db: &TestDb) -> String {
    TestConfig::new(db).toml()
}

async fn payments(db: &TestDb) -> Vec<(String, String)> {
    let mut conn = db.connect().await;
    sqlx::query_as("SELECT id::text, idempotency_key FROM demo_payments ORDER BY created_at")
        .fetch_all(&mut conn)
        .await
        .expect("read demo_payments")
}

/// `loadtest/audit` over the database: no key executed twice, every completed payment
/// key with exactly one payment.
fn audit(db: &TestDb) {
    let script = workspace().join("loadtest/audit");
    let output = std::process::Command::new(&script)
        .arg(&db.url)
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "run {} ({e}); it needs psql (apt-get install postgresql-client)",
                script.display()
            )
        });
    assert!(
        output.status.success(),
        "the audit failed:\n{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
}

/// kill -9 of the demo stopped at `failpoint` while it serves a payment, then a retry of
/// the same key on a new demo process. Returns the retry's answer.
async fn killed_at(db: &TestDb, failpoint: &str, key: &str) -> Answer {
    let failpoints = Failpoints::new();
    let mut demo = Demo::embedded(db, &config(db), &failpoints.env()).await;
    failpoints.arm(failpoint);
    let http = Http::default();
    let url = format!("{}/payments", demo.url());
    let first = tokio::spawn(http.pay(&url, TENANT, key, &payment("o-1", 100)).try_send());
    failpoints.until_stopped(failpoint).await;
    demo.kill().await;
    let first = first.await.unwrap();
    assert!(first.is_err(), "the killed demo answered: {first:?}");

    let demo = Demo::embedded(db, &config(db), &[]).await;
    let url = format!("{}/payments", demo.url());
    let retry = http
        .pay(&url, TENANT, key, &payment("o-1", 100))
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
    let again = http
        .pay(&url, TENANT, key, &payment("o-1", 100))
        .send()
        .await;
    assert!(again.replayed());
    assert_eq!(again.body, retry.body);
    retry
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_killed_before_its_commit_leaves_nothing_and_the_retry_pays_once() {
    let db = TestDb::create().await;
    let key = new_key();
    let retry = killed_at(&db, "embedded-before-commit", &key).await;
    assert!(
        !retry.replayed(),
        "nothing was committed: the retry executes"
    );
    let paid = payments(&db).await;
    assert_eq!(paid.len(), 1, "{paid:?}");
    assert_eq!(retry.json()["paymentId"], paid[0].0.as_str());
    audit(&db);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_demo_killed_after_its_commit_answers_the_retry_from_the_record() {
    let db = TestDb::create().await;
    let key = new_key();
    let retry = killed_at(&db, "embedded-after-commit", &key).await;
    assert!(
        retry.replayed(),
        "the payment committed: the retry replays it"
    );
    let paid = payments(&db).await;
    assert_eq!(paid.len(), 1, "{paid:?}");
    assert_eq!(retry.json()["paymentId"], paid[0].0.as_str());
    audit(&db);
}

/// A route moved from the gateway to embedded mode (and back) keeps its keys: one
/// tenant, endpoint `POST /payments`, one database for the ledger and the payments.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_moves_between_gateway_and_embedded_mode() {
    let db = TestDb::create().await;
    let upstream = Demo::start(&db).await;
    let gateway = GatewayProcess::start(
        &TestConfig::new(&db)
            .route(Route::idempotent("POST", "/payments", &upstream.url()))
            .toml(),
    )
    .await;
    let embedded = Demo::embedded(&db, &config(&db), &[]).await;
    let at_gateway = gateway.url("/payments");
    let in_process = format!("{}/payments", embedded.url());
    let http = Http::default();

    let through_gateway = new_key();
    let first = http
        .pay(&at_gateway, TENANT, &through_gateway, &payment("o-1", 100))
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let moved = http
        .pay(&in_process, TENANT, &through_gateway, &payment("o-1", 100))
        .send()
        .await;
    assert_eq!(moved.status, StatusCode::CREATED);
    assert!(moved.replayed(), "embedded mode found the gateway's record");
    assert_eq!(moved.body, first.body);
    assert_eq!(moved.header("location"), first.header("location"));
    assert!(moved.header("idempotency-expires").is_some());
    let other = http
        .pay(&in_process, TENANT, &through_gateway, &payment("o-2", 100))
        .send()
        .await;
    assert_eq!(other.problem(), "idempotency-key-reused");

    let in_embedded = new_key();
    let first = http
        .pay(&in_process, TENANT, &in_embedded, &payment("o-3", 100))
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    let back = http
        .pay(&at_gateway, TENANT, &in_embedded, &payment("o-3", 100))
        .send()
        .await;
    assert!(back.replayed(), "the gateway found embedded mode's record");
    assert_eq!(back.body, first.body);

    let paid = payments(&db).await;
    assert_eq!(paid.len(), 2, "one payment per key: {paid:?}");
    audit(&db);
}

/// The outbox row commits with its payment and is delivered after commit; a payment
/// rolled back leaves neither.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_outbox_is_delivered_after_commit_and_rolled_back_with_its_payment() {
    let db = TestDb::create().await;
    let demo = Demo::embedded(&db, &config(&db), &[]).await;
    let url = format!("{}/payments", demo.url());
    let http = Http::default();
    let failed = http
        .pay(&url, TENANT, &new_key(), &payment("o-1", 100))
        .header("x-demo-fail", "500")
        .send()
        .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(failed.json()["operation_state"], "not_executed");
    assert_eq!(failed.json()["safe_new_key"], true);
    let paid = http
        .pay(&url, TENANT, &new_key(), &payment("o-2", 100))
        .send()
        .await;
    assert_eq!(paid.status, StatusCode::CREATED);

    let mut conn = db.connect().await;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
    loop {
        let rows: Vec<(String, bool)> = sqlx::query_as(
            "SELECT payload->>'paymentId', delivered_at IS NOT NULL FROM demo_outbox",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        assert_eq!(
            rows.len(),
            1,
            "one outbox row, the committed payment's: {rows:?}"
        );
        assert_eq!(rows[0].0, paid.json()["paymentId"].as_str().unwrap());
        if rows[0].1 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "never delivered");
        // Real time: the demo's outbox worker polls every 200 ms.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(payments(&db).await.len(), 1);
}

/// Embedded mode traces as the gateway does: each request is an `idemgate.request` span
/// with the same attributes, exported over OTLP, and a retry's span links to the first
/// execution's — here through the record in Postgres, read by another process. (On
/// d90d3dd the demo exported nothing and the layer had no span: "spans exported: []".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_in_embedded_mode_links_to_its_first_execution() {
    let db = TestDb::create().await;
    let otlp = OtlpReceiver::start().await;
    let env = [
        ("OTEL_EXPORTER_OTLP_ENDPOINT", otlp.endpoint.as_str()),
        ("OTEL_BSP_SCHEDULE_DELAY", "100"),
    ];
    let first_demo = Demo::embedded(&db, &config(&db), &env).await;
    let second_demo = Demo::embedded(&db, &config(&db), &env).await;
    let http = Http::default();
    let key = new_key();
    let first_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let retry_trace = "0af7651916cd43dd8448eb211c80319c";
    let pay = |demo: &Demo, trace: &str| {
        http.pay(
            &format!("{}/payments", demo.url()),
            TENANT,
            &key,
            &payment("o-trace", 100),
        )
        .header("traceparent", &format!("00-{trace}-00f067aa0ba902b7-01"))
        .send()
    };
    let first = pay(&first_demo, first_trace).await;
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = pay(&second_demo, retry_trace).await;
    assert!(retry.replayed(), "the other process replays from Postgres");

    let spans = otlp
        .spans_in("idemgate.request", &[first_trace, retry_trace])
        .await;
    let (first, retry) = (&spans[0], &spans[1]);
    for (name, value) in [
        ("idempotency.outcome", "executed"),
        ("tenant.id", TENANT),
        ("idempotency.endpoint", "POST /payments"),
        ("idempotency.key", key.as_str()),
        ("http.response.status_code", "201"),
    ] {
        assert_eq!(attribute(first, name).as_deref(), Some(value), "{name}");
    }
    assert_eq!(
        attribute(retry, "idempotency.outcome").as_deref(),
        Some("replayed")
    );
    assert_eq!(
        hex(&first.parent_span_id),
        "00f067aa0ba902b7",
        "the client's trace is continued"
    );
    let link = retry
        .links
        .first()
        .expect("the replay links to the first execution");
    assert_eq!(hex(&link.trace_id), first_trace);
    assert_eq!(
        link.span_id, first.span_id,
        "the link points at the first request's span"
    );
}
