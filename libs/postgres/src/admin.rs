//! Operator access to one key: inspect it, release it by hand.

use chrono::{DateTime, Utc};
use idem_core::Scope;
use sqlx::{PgPool, Row};
use uuid::Uuid;

/// What an operator sees of one key (never the stored body itself).
#[derive(Debug, Clone)]
pub struct KeyInfo {
    pub status: String,
    pub attempt: Uuid,
    pub created_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub locked_until: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
    pub response_status: Option<i32>,
    pub response_bytes: Option<i32>,
    pub probe_attempts: i32,
    pub trace_context: Option<String>,
}

pub async fn show(pool: &PgPool, scope: &Scope) -> sqlx::Result<Option<KeyInfo>> {
    let row = sqlx::query(
        "SELECT status, attempt, created_at, completed_at, locked_until, expires_at,
                response_status, octet_length(response_body) AS response_bytes, probe_attempts, trace_context
         FROM idempotency_keys WHERE tenant_id = $1 AND endpoint = $2 AND key = $3",
    )
    .bind(&scope.tenant)
    .bind(&scope.endpoint)
    .bind(scope.key.as_str())
    .fetch_optional(pool)
    .await?;
    row.map(|r| {
        Ok(KeyInfo {
            status: r.try_get("status")?,
            attempt: r.try_get("attempt")?,
            created_at: r.try_get("created_at")?,
            completed_at: r.try_get("completed_at")?,
            locked_until: r.try_get("locked_until")?,
            expires_at: r.try_get("expires_at")?,
            response_status: r.try_get("response_status")?,
            response_bytes: r.try_get("response_bytes")?,
            probe_attempts: r.try_get("probe_attempts")?,
            trace_context: r.try_get("trace_context")?,
        })
    })
    .transpose()
}

/// Deletes an in-progress key so the next request executes. Completed keys are left
/// alone (their result is known); returns whether a row was released.
pub async fn release(pool: &PgPool, scope: &Scope) -> sqlx::Result<bool> {
    let result = sqlx::query(
        "DELETE FROM idempotency_keys
         WHERE tenant_id = $1 AND endpoint = $2 AND key = $3 AND status = 'in_progress'",
    )
    .bind(&scope.tenant)
    .bind(&scope.endpoint)
    .bind(scope.key.as_str())
    .execute(pool)
    .await?;
    Ok(result.rows_affected() == 1)
}
