//! [`PgLedger`]: the `idempotency_keys` row, and every statement anyone runs on it — the
//! gateway (as the engine's [`Ledger`]), the reconciler and `idemgate keys`. One
//! liveness rule, one fence, one release; every call bounded by the op timeout, traced
//! as a client span and counted.
//!
//! | from | to | statement | run by |
//! | --- | --- | --- | --- |
//! | absent, or completed past `expires_at` | in progress | [`CLAIM_SQL`] | gateway |
//! | in progress | completed | [`COMPLETE_SQL`] (fenced by its attempt) | gateway |
//! | in progress | in progress, lease ended (uncertain 5xx) | [`HOLD_SQL`] (fenced) | gateway |
//! | in progress | absent | [`RELEASE_SQL`] (fenced by the attempt, or by an operator) | gateway, reconciler, `keys release` |
//! | in progress, lease ended | in progress, taken for a while | [`TAKE_SQL`] | reconciler |
//! | in progress | completed, fresh attempt | [`RESOLVE_SQL`] (fenced) | reconciler |
//! | in progress | in progress, looked at again later | [`DEFER_SQL`] (fenced) | reconciler |
//! | completed past `expires_at` | absent | [`PURGE_SQL`] | reconciler |
//!
//! An in-progress row never expires, whatever its TTL: it leaves that state only by a
//! completion or a release, never by time (DESIGN §6: held keys never lapse). Completion
//! and release are fenced by the attempt token, so a late writer changes nothing; the
//! reconciler installs a fresh token when it resolves a row, which fences out the
//! original gateway.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use bytes::Bytes;
use chrono::{DateTime, Utc};
use idem_core::{
    AttemptId, Claim, ClaimResult, Fence, Fingerprint, IdempotencyKey, Ledger, LedgerError, Record,
    RecordState, Scope, StoredResponse,
};
use sqlx::postgres::{PgArguments, PgRow};
use sqlx::query::Query;
use sqlx::{PgPool, Postgres, Row};
use tracing::Instrument;
use uuid::Uuid;

use crate::headers;

/// How often a claim is retried when the row it conflicted with vanished before it
/// could be read (released in between).
const CLAIM_ROUNDS: usize = 3;

/// A connection that wrote a response body larger than this is closed after use.
const CLOSE_AFTER_BYTES: usize = 1 << 20;

/// The Postgres ledger. Cheap to clone (the pool is shared).
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    /// Upper bound on one ledger call, so a hung connection cannot hang a request.
    op_timeout: Duration,
    /// Statements sent, for metrics and for tests that prove a path never touched Postgres.
    calls: Arc<AtomicU64>,
}

/// An in-progress row whose lease ran out, as the reconciler took it.
#[derive(Debug, Clone)]
pub struct StuckRow {
    pub scope: Scope,
    /// The attempt that owned the row when it was taken.
    pub attempt: AttemptId,
    pub created_at: DateTime<Utc>,
    pub probe_attempts: i32,
    pub first_not_found_at: Option<DateTime<Utc>>,
    pub trace_context: Option<String>,
    /// The database's clock when the row was taken: the reconciler decides by this clock,
    /// the one every timestamp of the row was written by.
    pub taken_at: DateTime<Utc>,
}

/// How the reconciler leaves a row for later.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Later {
    /// A probe told nothing: counts a probe attempt (for backoff).
    Inconclusive,
    /// A probe said 404: remembers when the first one came (kept if one already did).
    NotFound,
    /// No probe was asked (held for an operator, or waiting for a policy's time).
    Unprobed,
}

/// What an operator sees of one key (never the stored body itself).
#[derive(Debug, Clone)]
pub struct KeyInfo {
    pub tenant: String,
    pub endpoint: String,
    pub key: String,
    pub status: String,
    pub attempt: Uuid,
    pub created_at: DateTime<Utc>,
    pub completed_at: Option<DateTime<Utc>>,
    pub locked_until: Option<DateTime<Utc>>,
    pub expires_at: DateTime<Utc>,
    pub held_since: Option<DateTime<Utc>>,
    pub response_status: Option<i32>,
    pub response_bytes: Option<i32>,
    pub response_omitted: bool,
    pub probe_attempts: i32,
    pub first_not_found_at: Option<DateTime<Utc>>,
    pub trace_context: Option<String>,
    /// Whether the key waits on the reconciler or a person (the one rule, `held!`).
    pub held: bool,
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

    /// A statement naming one row by its scope ($1, $2, $3).
    fn on<'q>(sql: &'static str, scope: &'q Scope) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(sql)
            .bind(&scope.tenant)
            .bind(&scope.endpoint)
            .bind(scope.key.as_str())
    }

    /// Runs a fenced write: it changed the row only if its attempt still owned it.
    async fn fenced(
        &self,
        operation: &'static str,
        statement: Query<'_, Postgres, PgArguments>,
    ) -> Result<Fence, LedgerError> {
        let result = self
            .bounded(operation, statement.execute(&self.pool))
            .await?;
        Ok(fence(result.rows_affected()))
    }

    async fn try_claim(&self, c: &Claim<'_>) -> Result<Option<ClaimResult>, LedgerError> {
        // One round trip: read the live row, or else claim (insert, or take over an
        // expired completed row). The read sees the statement's snapshot, which may
        // predate a row committed concurrently; then the upsert conflicts, claims nothing,
        // and we read again below.
        let row = self
            .bounded(
                "claim",
                Self::on(CLAIM_SQL, c.scope)
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

    /// Deletes an in-progress row so a retry may execute: fenced by `attempt`, or by
    /// nothing but its state for an operator (`None`). Completed rows are never released.
    pub async fn release_attempt(
        &self,
        scope: &Scope,
        attempt: Option<AttemptId>,
    ) -> Result<Fence, LedgerError> {
        self.fenced(
            "release",
            Self::on(RELEASE_SQL, scope).bind(attempt.map(|a| a.0)),
        )
        .await
    }

    /// Takes up to `limit` in-progress rows whose lease ran out, for `processing` time:
    /// other reconcilers skip them meanwhile (`FOR UPDATE SKIP LOCKED`, then the lease
    /// pushed forward in the same statement), so each is looked at by one reconciler.
    pub async fn take_stuck(
        &self,
        limit: i64,
        processing: Duration,
    ) -> Result<Vec<StuckRow>, LedgerError> {
        let rows = self
            .bounded(
                "take",
                sqlx::query(TAKE_SQL)
                    .bind(limit)
                    .bind(millis(processing))
                    .fetch_all(&self.pool),
            )
            .await?;
        rows.iter()
            .map(|row| {
                Ok(StuckRow {
                    scope: scope_of(row)?,
                    attempt: AttemptId(row.try_get("attempt")?),
                    created_at: row.try_get("created_at")?,
                    probe_attempts: row.try_get("probe_attempts")?,
                    first_not_found_at: row.try_get("first_not_found_at")?,
                    trace_context: row.try_get("trace_context")?,
                    taken_at: row.try_get("taken_at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(LedgerError::new)
    }

    /// Completes a stuck row with the upstream's real answer, if `row.attempt` still owns
    /// it, under a fresh attempt token (which fences out the original gateway).
    pub async fn resolve(
        &self,
        row: &StuckRow,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Fence, LedgerError> {
        self.fenced(
            "resolve",
            Self::on(RESOLVE_SQL, &row.scope)
                .bind(row.attempt.0)
                .bind(Uuid::new_v4())
                .bind(i32::from(response.status))
                .bind(headers::encode(&response.headers))
                .bind(&response.body[..])
                .bind(millis(ttl))
                .bind(response.body_omitted),
        )
        .await
    }

    /// Leaves a stuck row for a later pass, `after` from now.
    pub async fn defer(
        &self,
        row: &StuckRow,
        after: Duration,
        why: Later,
    ) -> Result<Fence, LedgerError> {
        self.fenced(
            "defer",
            Self::on(DEFER_SQL, &row.scope)
                .bind(row.attempt.0)
                .bind(millis(after))
                .bind(why == Later::Inconclusive)
                .bind(why == Later::NotFound),
        )
        .await
    }

    /// Deletes up to `limit` completed rows past their expiry and returns how many. Rows
    /// another transaction holds are skipped, never waited for.
    pub async fn purge_batch(&self, limit: i64) -> Result<u64, LedgerError> {
        let result = self
            .bounded(
                "purge",
                sqlx::query(PURGE_SQL).bind(limit).execute(&self.pool),
            )
            .await?;
        Ok(result.rows_affected())
    }

    /// How many keys are held: in progress with their lease over, waiting on the
    /// reconciler or a person.
    pub async fn count_held(&self) -> Result<i64, LedgerError> {
        self.bounded(
            "count_held",
            sqlx::query_scalar(COUNT_HELD_SQL).fetch_one(&self.pool),
        )
        .await
    }

    /// One key as an operator sees it.
    pub async fn show(&self, scope: &Scope) -> Result<Option<KeyInfo>, LedgerError> {
        let row = self
            .bounded("show", Self::on(SHOW_SQL, scope).fetch_optional(&self.pool))
            .await?;
        row.as_ref()
            .map(key_info)
            .transpose()
            .map_err(LedgerError::new)
    }

    /// Held keys, oldest first, at most `limit`.
    pub async fn list_held(&self, limit: i64) -> Result<Vec<KeyInfo>, LedgerError> {
        let rows = self
            .bounded(
                "list_held",
                sqlx::query(LIST_HELD_SQL).bind(limit).fetch_all(&self.pool),
            )
            .await?;
        rows.iter()
            .map(key_info)
            .collect::<Result<_, _>>()
            .map_err(LedgerError::new)
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
            .bounded("get", Self::on(GET_SQL, scope).fetch_optional(&self.pool))
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
        crate::failpoint::stop_here("stop-before-complete");
        let statement = Self::on(COMPLETE_SQL, scope)
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
        self.release_attempt(scope, Some(attempt)).await
    }

    async fn hold(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        self.fenced("hold", Self::on(HOLD_SQL, scope).bind(attempt.0))
            .await
    }
}

// The rules, spelled out once. A live row: in progress (never expired, whatever its
// TTL), or completed and not yet expired.
macro_rules! live {
    () => {
        "(k.status = 'in_progress' OR k.expires_at > now())"
    };
}
// The first attempt's lease is over: the reconciler may act.
macro_rules! lease_over {
    () => {
        "k.locked_until <= now()"
    };
}
// A held row: in progress with its lease over, or taken by the reconciler before.
macro_rules! held {
    () => {
        concat!(
            "k.status = 'in_progress' AND (k.held_since IS NOT NULL OR ",
            lease_over!(),
            ")"
        )
    };
}
// The row of the statement's scope, fenced by the attempt in $4.
macro_rules! owned_by_attempt {
    () => {
        "k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND k.attempt = $4"
    };
}
macro_rules! record_columns {
    () => {
        concat!(
            "k.request_hash, k.status, k.attempt, (coalesce(",
            lease_over!(),
            ", false) OR k.held_since IS NOT NULL) AS lease_expired, \
             k.response_status, k.response_headers, k.response_body, k.response_omitted, \
             k.trace_context, \
             (extract(epoch from (k.expires_at - now())) * 1000)::float8 AS expires_in_ms"
        )
    };
}
macro_rules! key_columns {
    () => {
        concat!(
            "k.tenant_id, k.endpoint, k.key, k.status, k.attempt, k.created_at, k.completed_at, \
         k.locked_until, k.expires_at, k.held_since, k.response_status, \
         octet_length(k.response_body) AS response_bytes, k.response_omitted, \
         k.probe_attempts, k.first_not_found_at, k.trace_context, (",
            held!(),
            ") AS held"
        )
    };
}

/// Inserts the row, or takes over one that is not live (completed and expired); else
/// returns the live row.
pub const CLAIM_SQL: &str = concat!(
    // The live row, if any, by a plain read first: a replay (or a retry of a key in
    // progress) takes no row lock, gets no transaction id and writes no WAL. Only when
    // no live row is visible does the upsert run: it inserts, takes over an expired
    // row, or (a row committed concurrently) does nothing and the caller reads again.
    "WITH seen AS (\
       SELECT k.* FROM idempotency_keys AS k \
       WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    live!(),
    "), claimed AS (\
       INSERT INTO idempotency_keys AS k \
         (tenant_id, endpoint, key, request_hash, status, attempt, locked_until, \
          trace_context, created_at, expires_at) \
       SELECT $1, $2, $3, $4, 'in_progress', $5, \
          now() + $6::float8 * interval '1 millisecond', $7, now(), \
          now() + $8::float8 * interval '1 millisecond' \
       WHERE NOT EXISTS (SELECT 1 FROM seen) \
       ON CONFLICT (tenant_id, endpoint, key) DO UPDATE SET \
          request_hash = EXCLUDED.request_hash, status = 'in_progress', \
          attempt = EXCLUDED.attempt, locked_until = EXCLUDED.locked_until, \
          response_status = NULL, response_headers = NULL, response_body = NULL, \
          response_omitted = false, held_since = NULL, first_not_found_at = NULL, \
          probe_attempts = 0, \
          trace_context = EXCLUDED.trace_context, created_at = EXCLUDED.created_at, \
          completed_at = NULL, expires_at = EXCLUDED.expires_at \
       WHERE NOT ",
    live!(),
    " RETURNING 1) \
     SELECT EXISTS (SELECT 1 FROM claimed) AS claimed, ",
    record_columns!(),
    " FROM (SELECT 1) AS one LEFT JOIN seen AS k ON true"
);

pub const GET_SQL: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    live!()
);

/// Fenced by the attempt alone (not by status), so that repeating a completion whose
/// reply was lost finds its own row again instead of reporting a lost fence.
pub const COMPLETE_SQL: &str = concat!(
    "UPDATE idempotency_keys AS k SET status = 'completed', \
       response_status = $5, response_headers = $6, response_body = $7, \
       response_omitted = $9, completed_at = now(), locked_until = NULL, held_since = NULL, \
       expires_at = now() + $8::float8 * interval '1 millisecond' \
     WHERE ",
    owned_by_attempt!()
);

pub const RESOLVE_SQL: &str = concat!(
    "UPDATE idempotency_keys AS k SET status = 'completed', attempt = $5, \
       response_status = $6, response_headers = $7, response_body = $8, \
       response_omitted = $10, completed_at = now(), locked_until = NULL, held_since = NULL, \
       expires_at = now() + $9::float8 * interval '1 millisecond' \
     WHERE ",
    owned_by_attempt!(),
    " AND k.status = 'in_progress'"
);

/// The one release: fenced by the attempt in $4, or (NULL) by an operator's hand.
pub const RELEASE_SQL: &str = "DELETE FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 \
       AND k.status = 'in_progress' AND ($4::uuid IS NULL OR k.attempt = $4)";

pub const HOLD_SQL: &str = concat!(
    "UPDATE idempotency_keys AS k SET locked_until = now(), \
       held_since = coalesce(k.held_since, now()) \
     WHERE ",
    owned_by_attempt!(),
    " AND k.status = 'in_progress'"
);

pub const TAKE_SQL: &str = concat!(
    "WITH stuck AS (\
       SELECT k.tenant_id, k.endpoint, k.key FROM idempotency_keys AS k \
       WHERE k.status = 'in_progress' AND ",
    lease_over!(),
    " ORDER BY k.locked_until \
       LIMIT $1 \
       FOR UPDATE SKIP LOCKED) \
     UPDATE idempotency_keys AS k \
     SET locked_until = now() + $2::float8 * interval '1 millisecond', \
         held_since = coalesce(k.held_since, now()) \
     FROM stuck \
     WHERE k.tenant_id = stuck.tenant_id AND k.endpoint = stuck.endpoint AND k.key = stuck.key \
     RETURNING k.tenant_id, k.endpoint, k.key, k.attempt, k.created_at, k.probe_attempts, \
       k.first_not_found_at, k.trace_context, now() AS taken_at"
);

pub const DEFER_SQL: &str = concat!(
    "UPDATE idempotency_keys AS k \
     SET locked_until = now() + $5::float8 * interval '1 millisecond', \
         probe_attempts = k.probe_attempts + $6::bool::int, \
         first_not_found_at = CASE WHEN $7 THEN coalesce(k.first_not_found_at, now()) \
                              ELSE k.first_not_found_at END \
     WHERE ",
    owned_by_attempt!(),
    " AND k.status = 'in_progress'"
);

pub const PURGE_SQL: &str = concat!(
    "DELETE FROM idempotency_keys AS gone \
     USING (SELECT k.tenant_id, k.endpoint, k.key FROM idempotency_keys AS k \
            WHERE NOT ",
    live!(),
    " ORDER BY k.expires_at \
            LIMIT $1 \
            FOR UPDATE SKIP LOCKED) expired \
     WHERE gone.tenant_id = expired.tenant_id AND gone.endpoint = expired.endpoint \
       AND gone.key = expired.key"
);

pub const COUNT_HELD_SQL: &str =
    concat!("SELECT count(*) FROM idempotency_keys AS k WHERE ", held!());

pub const SHOW_SQL: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3"
);

pub const LIST_HELD_SQL: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys AS k WHERE ",
    held!(),
    " ORDER BY k.created_at LIMIT $1"
);

/// A fenced write held its row if it changed exactly one.
fn fence(rows: u64) -> Fence {
    if rows == 1 { Fence::Held } else { Fence::Lost }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

fn scope_of(row: &PgRow) -> Result<Scope, sqlx::Error> {
    let key: String = row.try_get("key")?;
    let key = IdempotencyKey::parse(key.as_bytes())
        .map_err(|e| sqlx::Error::Decode(format!("stored key {key:?}: {e}").into()))?;
    Ok(Scope::new(
        row.try_get::<String, _>("tenant_id")?,
        row.try_get::<String, _>("endpoint")?,
        key,
    ))
}

fn key_info(r: &PgRow) -> Result<KeyInfo, sqlx::Error> {
    Ok(KeyInfo {
        tenant: r.try_get("tenant_id")?,
        endpoint: r.try_get("endpoint")?,
        key: r.try_get("key")?,
        status: r.try_get("status")?,
        attempt: r.try_get("attempt")?,
        created_at: r.try_get("created_at")?,
        completed_at: r.try_get("completed_at")?,
        locked_until: r.try_get("locked_until")?,
        expires_at: r.try_get("expires_at")?,
        held_since: r.try_get("held_since")?,
        response_status: r.try_get("response_status")?,
        response_bytes: r.try_get("response_bytes")?,
        response_omitted: r.try_get("response_omitted")?,
        probe_attempts: r.try_get("probe_attempts")?,
        first_not_found_at: r.try_get("first_not_found_at")?,
        trace_context: r.try_get("trace_context")?,
        held: r.try_get("held")?,
    })
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
