//! [`PgLedger`]: the engine's durable ledger on Postgres.
//!
//! Every decision is one atomic statement, so any number of gateways can share a
//! database: the claim is an upsert that inserts a new row or takes over an expired
//! one, and completion and release are fenced by the attempt token.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AttemptId, Claim, ClaimResult, Fence, Fingerprint, Ledger, LedgerError, Record, RecordState,
    Scope, StoredResponse,
};
use sqlx::postgres::PgRow;
use sqlx::{PgPool, Row};
use tracing::Instrument;
use uuid::Uuid;

use crate::headers;

/// A connection that wrote a response body larger than this is closed after use.
const CLOSE_AFTER_BYTES: usize = 1 << 20;

/// How often a claim is retried when the row it conflicted with vanished before it
/// could be read (released in between).
const CLAIM_ROUNDS: usize = 3;

/// The Postgres ledger. Cheap to clone (the pool is shared).
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    /// Upper bound on one ledger call, so a hung connection cannot hang a request.
    op_timeout: Duration,
    /// Statements sent, for metrics and for tests that prove a path never touched Postgres.
    calls: Arc<AtomicU64>,
}

impl PgLedger {
    pub fn new(pool: PgPool, op_timeout: Duration) -> Self {
        Self {
            pool,
            op_timeout,
            calls: Arc::default(),
        }
    }

    /// How many statements this ledger (and its clones) has sent.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Runs one statement within the op timeout, in a client span, counting it.
    async fn bounded<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, LedgerError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!(
            "postgres",
            otel.kind = "client",
            db.system.name = "postgresql",
            db.operation.name = operation
        );
        let result = match tokio::time::timeout(self.op_timeout, fut)
            .instrument(span)
            .await
        {
            Ok(result) => result.map_err(LedgerError::new),
            Err(_) => Err(LedgerError::new(crate::Timeout(self.op_timeout))),
        };
        if result.is_err() {
            idem_telemetry::metrics::counter!("idemgate_ledger_errors_total").increment(1);
        }
        result
    }

    async fn try_claim(&self, c: &Claim<'_>) -> Result<Option<ClaimResult>, LedgerError> {
        // One round trip: claim (insert, or take over an expired row) and, if another
        // attempt holds the key, read its row in the same statement. The read sees the
        // statement's snapshot, which may predate a row committed concurrently; then
        // it returns nothing and we read again below.
        let row = self
            .bounded(
                "claim",
                sqlx::query(CLAIM_SQL)
                    .bind(&c.scope.tenant)
                    .bind(&c.scope.endpoint)
                    .bind(c.scope.key.as_str())
                    .bind(&c.fingerprint.as_bytes()[..])
                    .bind(c.attempt.0)
                    .bind(millis(c.lease))
                    .bind(c.trace_context)
                    .bind(millis(c.ttl))
                    .fetch_one(&self.pool),
            )
            .await?;
        if row
            .try_get::<bool, _>("claimed")
            .map_err(LedgerError::new)?
        {
            return Ok(Some(ClaimResult::Claimed));
        }
        if row
            .try_get::<Option<Uuid>, _>("attempt")
            .map_err(LedgerError::new)?
            .is_some()
        {
            return Ok(Some(ClaimResult::Existing(record(&row)?)));
        }
        Ok(self.get(c.scope).await?.map(ClaimResult::Existing))
    }
}

impl Ledger for PgLedger {
    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimResult, LedgerError> {
        for _ in 0..CLAIM_ROUNDS {
            if let Some(result) = self.try_claim(claim).await? {
                return Ok(result);
            }
        }
        Err(LedgerError::new(crate::Contended))
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, LedgerError> {
        let row = self
            .bounded(
                "get",
                sqlx::query(GET_SQL)
                    .bind(&scope.tenant)
                    .bind(&scope.endpoint)
                    .bind(scope.key.as_str())
                    .fetch_optional(&self.pool),
            )
            .await?;
        row.as_ref().map(record).transpose()
    }

    async fn complete(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fence, LedgerError> {
        // Fenced by the attempt alone (not by status), so that repeating a completion
        // whose reply was lost finds its own row again instead of reporting a lost fence.
        const SQL: &str = "UPDATE idempotency_keys SET status = 'completed', \
             response_status = $5, response_headers = $6, response_body = $7, \
             response_omitted = $9, completed_at = now(), locked_until = NULL, \
             expires_at = now() + $8::float8 * interval '1 millisecond' \
             WHERE tenant_id = $1 AND endpoint = $2 AND key = $3 AND attempt = $4";
        let statement = sqlx::query(SQL)
            .bind(&scope.tenant)
            .bind(&scope.endpoint)
            .bind(scope.key.as_str())
            .bind(attempt.0)
            .bind(i32::from(response.status))
            .bind(headers::encode(&response.headers))
            .bind(&response.body[..])
            .bind(millis(ttl))
            .bind(response.body_omitted);
        let result = self
            .bounded("complete", async {
                let mut conn = self.pool.acquire().await?;
                if response.body.len() > CLOSE_AFTER_BYTES {
                    // The connection's write buffer grew to hold this body, and sqlx never
                    // shrinks it: a pool of such connections would keep one large body's
                    // worth of memory each, for good. This one is closed after use.
                    conn.close_on_drop();
                }
                statement.execute(&mut *conn).await
            })
            .await?;
        Ok(fence(result.rows_affected()))
    }

    async fn release(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        const SQL: &str = "DELETE FROM idempotency_keys \
             WHERE tenant_id = $1 AND endpoint = $2 AND key = $3 AND attempt = $4 \
             AND status = 'in_progress'";
        let result = self
            .bounded(
                "release",
                sqlx::query(SQL)
                    .bind(&scope.tenant)
                    .bind(&scope.endpoint)
                    .bind(scope.key.as_str())
                    .bind(attempt.0)
                    .execute(&self.pool),
            )
            .await?;
        Ok(fence(result.rows_affected()))
    }
}

// The statements, spelled out once so the liveness rule and the column list cannot
// drift. A live row: not expired, unless it is an in-progress row still within its lease.
macro_rules! live {
    () => {
        "NOT (k.expires_at <= now() AND (k.status = 'completed' OR k.locked_until <= now()))"
    };
}
macro_rules! record_columns {
    () => {
        "k.request_hash, k.status, k.attempt, \
         coalesce(k.locked_until <= now(), false) AS lease_expired, \
         k.response_status, k.response_headers, k.response_body, k.response_omitted, \
         k.trace_context, \
         (extract(epoch from (k.expires_at - now())) * 1000)::float8 AS expires_in_ms"
    };
}

const CLAIM_SQL: &str = concat!(
    "WITH claimed AS (\
       INSERT INTO idempotency_keys AS k \
         (tenant_id, endpoint, key, request_hash, status, attempt, locked_until, \
          trace_context, created_at, expires_at) \
       VALUES ($1, $2, $3, $4, 'in_progress', $5, \
          now() + $6::float8 * interval '1 millisecond', $7, now(), \
          now() + $8::float8 * interval '1 millisecond') \
       ON CONFLICT (tenant_id, endpoint, key) DO UPDATE SET \
          request_hash = EXCLUDED.request_hash, status = 'in_progress', \
          attempt = EXCLUDED.attempt, locked_until = EXCLUDED.locked_until, \
          response_status = NULL, response_headers = NULL, response_body = NULL, \
          response_omitted = false, \
          trace_context = EXCLUDED.trace_context, created_at = EXCLUDED.created_at, \
          completed_at = NULL, expires_at = EXCLUDED.expires_at \
       WHERE NOT (",
    live!(),
    ") RETURNING 1) \
     SELECT EXISTS (SELECT 1 FROM claimed) AS claimed, ",
    record_columns!(),
    " FROM (SELECT 1) AS one \
     LEFT JOIN idempotency_keys AS k \
       ON k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    live!()
);

const GET_SQL: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    live!()
);

fn fence(rows: u64) -> Fence {
    if rows == 1 { Fence::Held } else { Fence::Lost }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn record(row: &PgRow) -> Result<Record, LedgerError> {
    let hash: Vec<u8> = row.try_get("request_hash").map_err(LedgerError::new)?;
    let hash: [u8; 32] = hash
        .try_into()
        .map_err(|_| LedgerError::new(crate::Corrupt("request_hash is not 32 bytes")))?;
    let status: String = row.try_get("status").map_err(LedgerError::new)?;
    let state = match status.as_str() {
        "in_progress" => RecordState::InProgress {
            lease_expired: row.try_get("lease_expired").map_err(LedgerError::new)?,
        },
        "completed" => {
            let code: i32 = row.try_get("response_status").map_err(LedgerError::new)?;
            let headers: serde_json::Value =
                row.try_get("response_headers").map_err(LedgerError::new)?;
            let body: Vec<u8> = row.try_get("response_body").map_err(LedgerError::new)?;
            RecordState::Completed(StoredResponse {
                status: u16::try_from(code).map_err(|_| {
                    LedgerError::new(crate::Corrupt("response_status out of range"))
                })?,
                headers: headers::decode(&headers).ok_or_else(|| {
                    LedgerError::new(crate::Corrupt("response_headers malformed"))
                })?,
                body: Bytes::from(body),
                body_omitted: row.try_get("response_omitted").map_err(LedgerError::new)?,
            })
        }
        _ => return Err(LedgerError::new(crate::Corrupt("unknown status"))),
    };
    Ok(Record {
        fingerprint: Fingerprint::from_bytes(hash),
        attempt: AttemptId(row.try_get("attempt").map_err(LedgerError::new)?),
        state,
        trace_context: row.try_get("trace_context").map_err(LedgerError::new)?,
        expires_in: row
            .try_get::<Option<f64>, _>("expires_in_ms")
            .map_err(LedgerError::new)?
            .map(|ms| Duration::from_secs_f64(ms.max(0.0) / 1000.0)),
    })
}
