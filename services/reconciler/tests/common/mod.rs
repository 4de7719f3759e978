//! What the reconciler's tests share: the probed route, the ledger row as SQL sees it,
//! and stuck rows as crashed gateways leave them.
#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use idem_testkit::*;

/// The tests' config with `POST /payments` to `upstream` under a 3 s lease, with the
/// upstream timeout as given, changed by `route` ([`Route::probed`] for a status probe).
pub fn leased(
    db: &TestDb,
    upstream: &str,
    timeout: &str,
    route: impl FnOnce(Route) -> Route,
) -> TestConfig {
    TestConfig::new(db)
        .set("idempotency.lease", "3s")
        .route(route(
            Route::idempotent("POST", "/payments", upstream).set("timeout", timeout),
        ))
}

pub async fn row(db: &TestDb, key: &str) -> Option<(String, Option<i32>, Option<Vec<u8>>)> {
    let mut conn = db.connect().await;
    sqlx::query_as(
        "SELECT status, response_status, response_body FROM idempotency_keys WHERE key = $1",
    )
    .bind(key)
    .fetch_optional(&mut conn)
    .await
    .unwrap()
}

pub async fn past_lease() {
    // Real time: past the 3 s lease, which Postgres's clock judges.
    tokio::time::sleep(Duration::from_millis(3300)).await;
}

/// A TCP server that accepts requests and never answers: sent, outcome unknown.
pub async fn black_hole() -> String {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    format!("http://{addr}")
}

/// Inserts `n` in-progress rows whose lease ran out, as crashed gateways leave them.
pub async fn stuck_rows(db: &TestDb, tenant: &str, endpoint: &str, n: usize) -> Vec<String> {
    let mut conn = db.connect().await;
    let keys: Vec<String> = (0..n)
        .map(|i| format!("stuck-{i}-{}", uuid::Uuid::new_v4().simple()))
        .collect();
    for key in &keys {
        sqlx::query(
            "INSERT INTO idempotency_keys (tenant_id, endpoint, key, request_hash, status, attempt,
                 locked_until, created_at, expires_at)
             VALUES ($1, $2, $3, $4, 'in_progress', $5, now() - interval '1 minute',
                 now() - interval '2 minutes', now() + interval '1 day')",
        )
        .bind(tenant)
        .bind(endpoint)
        .bind(key)
        .bind(vec![0u8; 32])
        .bind(uuid::Uuid::new_v4())
        .execute(&mut conn)
        .await
        .unwrap();
    }
    keys
}

/// One `idemgate-reconciler --once` pass whose summary line must report each of `counts`
/// (`"completed=1"`, …).
pub async fn pass_reporting(config_text: &str, counts: &[&str]) -> Pass {
    let pass = reconcile_once(config_text).await;
    for count in counts {
        assert!(
            pass.stdout.contains(count),
            "{count} in: {}{}",
            pass.stdout,
            pass.stderr
        );
    }
    pass
}
