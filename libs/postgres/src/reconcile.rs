//! The reconciler's statements: find stuck claims, resolve them (fenced), purge expired keys.
//!
//! Several reconcilers may run at once. [`take_stuck`] selects rows `FOR UPDATE SKIP
//! LOCKED` and, in the same transaction, pushes their `locked_until` forward by a
//! processing lease, so once it commits no other reconciler sees them until that lease
//! runs out: each stuck row is probed by one reconciler per pass.
//!
//! Resolution is fenced by the attempt token read at take time: if the original gateway
//! completes first, the resolution changes nothing; if the resolution lands first, it
//! installs a fresh attempt token, so the gateway's late completion changes nothing.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_core::{AttemptId, Fence, IdempotencyKey, Scope, StoredResponse};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::headers;

/// An in-progress row whose lease ran out.
#[derive(Debug, Clone)]
pub struct StuckRow {
    pub scope: Scope,
    /// The attempt that owned the row when it was taken.
    pub attempt: AttemptId,
    pub created_at: DateTime<Utc>,
    pub probe_attempts: i32,
    pub trace_context: Option<String>,
}

/// Takes up to `limit` stuck rows for this reconciler for `processing` time. Rows past
/// their expiry are left to the purge: they already behave as absent.
pub async fn take_stuck(
    pool: &PgPool,
    limit: i64,
    processing: Duration,
) -> sqlx::Result<Vec<StuckRow>> {
    let rows = sqlx::query(
        "WITH stuck AS (
             SELECT tenant_id, endpoint, key FROM idempotency_keys
             WHERE status = 'in_progress' AND locked_until <= now() AND expires_at > now()
             ORDER BY locked_until
             LIMIT $1
             FOR UPDATE SKIP LOCKED)
         UPDATE idempotency_keys k
         SET locked_until = now() + $2::float8 * interval '1 millisecond'
         FROM stuck
         WHERE k.tenant_id = stuck.tenant_id AND k.endpoint = stuck.endpoint AND k.key = stuck.key
         RETURNING k.tenant_id, k.endpoint, k.key, k.attempt, k.created_at, k.probe_attempts, k.trace_context",
    )
    .bind(limit)
    .bind(processing.as_secs_f64() * 1000.0)
    .fetch_all(pool)
    .await?;
    rows.iter()
        .map(|row| {
            let key: String = row.try_get("key")?;
            let key = IdempotencyKey::parse(key.as_bytes())
                .map_err(|e| sqlx::Error::Decode(format!("stored key {key:?}: {e}").into()))?;
            Ok(StuckRow {
                scope: Scope::new(
                    row.try_get::<String, _>("tenant_id")?,
                    row.try_get::<String, _>("endpoint")?,
                    key,
                ),
                attempt: AttemptId(row.try_get("attempt")?),
                created_at: row.try_get("created_at")?,
                probe_attempts: row.try_get("probe_attempts")?,
                trace_context: row.try_get("trace_context")?,
            })
        })
        .collect()
}

/// Completes a stuck row with the upstream's real answer, if `attempt` still owns it.
/// The row gets a fresh attempt token, which fences out the original gateway.
pub async fn complete(
    pool: &PgPool,
    row: &StuckRow,
    response: &StoredResponse,
    ttl: Duration,
) -> sqlx::Result<Fence> {
    let result = sqlx::query(
        "UPDATE idempotency_keys SET status = 'completed', attempt = $5,
             response_status = $6, response_headers = $7, response_body = $8,
             response_omitted = $10, completed_at = now(), locked_until = NULL,
             expires_at = now() + $9::float8 * interval '1 millisecond'
         WHERE tenant_id = $1 AND endpoint = $2 AND key = $3 AND attempt = $4 AND status = 'in_progress'",
    )
    .bind(&row.scope.tenant)
    .bind(&row.scope.endpoint)
    .bind(row.scope.key.as_str())
    .bind(row.attempt.0)
    .bind(Uuid::new_v4())
    .bind(i32::from(response.status))
    .bind(headers::encode(&response.headers))
    .bind(&response.body[..])
    .bind(ttl.as_secs_f64() * 1000.0)
    .bind(response.body_omitted)
    .execute(pool)
    .await?;
    Ok(fence(result.rows_affected()))
}

/// Releases a stuck row (the upstream never ran it, or the route's policy says so), if
/// `attempt` still owns it.
pub async fn release(pool: &PgPool, row: &StuckRow) -> sqlx::Result<Fence> {
    let result = sqlx::query(
        "DELETE FROM idempotency_keys
         WHERE tenant_id = $1 AND endpoint = $2 AND key = $3 AND attempt = $4 AND status = 'in_progress'",
    )
    .bind(&row.scope.tenant)
    .bind(&row.scope.endpoint)
    .bind(row.scope.key.as_str())
    .bind(row.attempt.0)
    .execute(pool)
    .await?;
    Ok(fence(result.rows_affected()))
}

/// Leaves a stuck row for a later pass, `after` from now, counting a probe attempt.
pub async fn defer(
    pool: &PgPool,
    row: &StuckRow,
    after: Duration,
    probed: bool,
) -> sqlx::Result<()> {
    sqlx::query(
        "UPDATE idempotency_keys
         SET locked_until = now() + $5::float8 * interval '1 millisecond',
             probe_attempts = probe_attempts + $6
         WHERE tenant_id = $1 AND endpoint = $2 AND key = $3 AND attempt = $4 AND status = 'in_progress'",
    )
    .bind(&row.scope.tenant)
    .bind(&row.scope.endpoint)
    .bind(row.scope.key.as_str())
    .bind(row.attempt.0)
    .bind(after.as_secs_f64() * 1000.0)
    .bind(i32::from(probed))
    .execute(pool)
    .await?;
    Ok(())
}

/// Deletes up to `limit` expired rows (never an in-progress row within its lease) and
/// returns how many. Rows another transaction holds are skipped, never waited for.
pub async fn purge_batch(pool: &PgPool, limit: i64) -> sqlx::Result<u64> {
    let result = sqlx::query(
        "DELETE FROM idempotency_keys k
         USING (SELECT tenant_id, endpoint, key FROM idempotency_keys
                WHERE expires_at <= now() AND (status = 'completed' OR locked_until <= now())
                ORDER BY expires_at
                LIMIT $1
                FOR UPDATE SKIP LOCKED) expired
         WHERE k.tenant_id = expired.tenant_id AND k.endpoint = expired.endpoint AND k.key = expired.key",
    )
    .bind(limit)
    .execute(pool)
    .await?;
    Ok(result.rows_affected())
}

fn fence(rows: u64) -> Fence {
    if rows == 1 { Fence::Held } else { Fence::Lost }
}
