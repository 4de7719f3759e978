//! The outbox pattern, worked (embedded mode). A side effect outside the database — the
//! call to a card processor, a webhook, a message — cannot be in the request's
//! transaction, so it is not covered by it: a crash after the call and before the commit
//! would call it for a payment that never was, and a crash after the commit and before
//! the call would never call it. Instead the handler writes an **outbox row** through
//! its `Tx`: it commits with the payment or not at all. This worker then sends committed
//! rows and marks them delivered.
//!
//! Delivery is at least once: a crash between sending and marking sends again after the
//! restart. So each send carries the outbox row's id as its own idempotency key, and the
//! receiver (idemgate in front of it, or its own dedup) keeps it once.

use std::sync::OnceLock;
use std::time::Duration;

use serde_json::Value;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

/// How often the worker looks for committed rows.
const POLL: Duration = Duration::from_millis(200);
/// Rows sent per transaction.
const BATCH: i64 = 100;

static ENABLED: OnceLock<bool> = OnceLock::new();

/// Whether payments write outbox rows (`PAYMENTS_DEMO_OUTBOX=off` turns it off, for a
/// benchmark of the same business write as the upstream demo's).
pub(crate) fn enabled() -> bool {
    *ENABLED.get_or_init(|| std::env::var("PAYMENTS_DEMO_OUTBOX").as_deref() != Ok("off"))
}

/// Queues an event, in the caller's transaction.
pub(crate) async fn enqueue(
    conn: &mut PgConnection,
    topic: &str,
    tenant: &str,
    payload: &Value,
) -> sqlx::Result<()> {
    sqlx::query("INSERT INTO demo_outbox (id, tenant_id, topic, payload) VALUES ($1, $2, $3, $4)")
        .bind(Uuid::new_v4())
        .bind(tenant)
        .bind(topic)
        .bind(payload)
        .execute(conn)
        .await
        .map(drop)
}

/// Starts the worker.
pub(crate) fn start(pool: PgPool) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        loop {
            match deliver(&pool).await {
                Ok(n) if n as i64 == BATCH => continue,
                Ok(_) => {}
                Err(error) => tracing::warn!(%error, "outbox delivery failed; trying again"),
            }
            tokio::time::sleep(POLL).await;
        }
    })
}

/// Sends one batch of committed, undelivered rows and marks them, in one transaction.
/// `SKIP LOCKED`: several demos share the work without sending a row twice at once.
async fn deliver(pool: &PgPool) -> sqlx::Result<usize> {
    let mut tx = pool.begin().await?;
    let rows = sqlx::query(
        "SELECT id, tenant_id, topic, payload FROM demo_outbox WHERE delivered_at IS NULL \
         ORDER BY created_at LIMIT $1 FOR UPDATE SKIP LOCKED",
    )
    .bind(BATCH)
    .fetch_all(&mut *tx)
    .await?;
    let mut sent = Vec::with_capacity(rows.len());
    for row in &rows {
        let id: Uuid = row.try_get("id")?;
        let tenant: String = row.try_get("tenant_id")?;
        let topic: String = row.try_get("topic")?;
        let payload: Value = row.try_get("payload")?;
        send(id, &tenant, &topic, &payload);
        sent.push(id);
    }
    if !sent.is_empty() {
        sqlx::query("UPDATE demo_outbox SET delivered_at = clock_timestamp() WHERE id = ANY($1)")
            .bind(&sent)
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await?;
    Ok(sent.len())
}

/// Where a real service calls out (with `Idempotency-Key: <id>`). The demo logs it.
fn send(id: Uuid, tenant: &str, topic: &str, payload: &Value) {
    tracing::info!(outbox.id = %id, tenant, topic, %payload, "outbox event delivered");
}
