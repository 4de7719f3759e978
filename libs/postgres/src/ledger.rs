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
//! completion or a release, never by time (held keys never lapse: docs/architecture.md, "Promises"). Completion
//! and release are fenced by the attempt token, so a late writer changes nothing; the
//! reconciler installs a fresh token when it resolves a row, which fences out the
//! original gateway.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
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

use crate::group::{Batch, Pipe, Written};
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
    /// Calls made, for metrics and for tests that prove a path never touched Postgres
    /// (claims and completions may share a statement: see [`crate::group`]).
    calls: Arc<AtomicU64>,
    /// The group-commit pipes, started on first use (on the runtime that uses them).
    pipes: Arc<Pipes>,
}

#[derive(Debug, Default)]
struct Pipes {
    claims: OnceLock<Pipe<Claims>>,
    completions: OnceLock<Pipe<Completions>>,
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
            pipes: Arc::default(),
        }
    }

    /// Group statements of one kind in flight at most (one at a time unless it is slow):
    /// a quarter of the pool each for claims and completions, so single-row statements
    /// (reads, releases, holds) always find connections too.
    fn in_flight(&self) -> usize {
        (self.pool.options().get_max_connections() as usize / 4).max(1)
    }

    fn claims(&self) -> &Pipe<Claims> {
        self.pipes
            .claims
            .get_or_init(|| Pipe::start(self.pool.clone(), self.in_flight(), self.op_timeout))
    }

    fn completions(&self) -> &Pipe<Completions> {
        self.pipes
            .completions
            .get_or_init(|| Pipe::start(self.pool.clone(), self.in_flight(), self.op_timeout))
    }

    /// What group commit has written for claims and for completions so far.
    pub fn written(&self) -> (Written, Written) {
        (
            self.pipes
                .claims
                .get()
                .map(Pipe::written)
                .unwrap_or_default(),
            self.pipes
                .completions
                .get()
                .map(Pipe::written)
                .unwrap_or_default(),
        )
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
        self.traced(operation, async {
            match tokio::time::timeout(self.op_timeout, fut).await {
                Ok(result) => result.map_err(LedgerError::new),
                Err(_) => Err(LedgerError::new(crate::Timeout(self.op_timeout))),
            }
        })
        .await
    }

    /// Runs one call, already bounded (by itself, or by its pipe), in a client span,
    /// counting it.
    async fn traced<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!(
            "postgres",
            otel.kind = "client",
            db.system.name = "postgresql",
            db.operation.name = operation
        );
        let result = fut.instrument(span).await;
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
        // With whatever other claims are queued, in one round trip: read the live row, or
        // else claim (insert, or take over an expired completed row). The read sees the
        // statement's snapshot, which may predate a row committed concurrently; then the
        // upsert conflicts, claims nothing, and we read again below.
        let row = ClaimRow {
            scope: c.scope.clone(),
            fingerprint: *c.fingerprint.as_bytes(),
            attempt: c.attempt.0,
            lease_ms: millis(c.lease),
            trace_context: c.trace_context.map(str::to_owned),
            ttl_ms: millis(c.ttl),
        };
        match self.traced("claim", self.claims().write(row)).await?? {
            Some(result) => Ok(Some(result)),
            None => Ok(self.get(c.scope).await?.map(ClaimResult::Existing)),
        }
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
        idem_telemetry::failpoint::stop_here("stop-before-complete");
        let row = CompleteRow {
            scope: scope.clone(),
            attempt: attempt.0,
            status: i32::from(response.status),
            headers: headers::encode(&response.headers),
            body: response.body.clone(),
            ttl_ms: millis(ttl),
            omitted: response.body_omitted,
        };
        self.traced("complete", self.completions().write(row)).await
    }

    async fn release(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        self.release_attempt(scope, Some(attempt)).await
    }

    async fn hold(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        self.fenced("hold", Self::on(HOLD_SQL, scope).bind(attempt.0))
            .await
    }
}

/// One claim as its pipe queues it.
#[derive(Debug)]
struct ClaimRow {
    scope: Scope,
    fingerprint: [u8; 32],
    attempt: Uuid,
    lease_ms: f64,
    trace_context: Option<String>,
    ttl_ms: f64,
}

/// Claims, grouped: [`CLAIM_SQL`] over arrays, one element per claim.
#[derive(Debug)]
struct Claims;

impl Batch for Claims {
    type Row = ClaimRow;
    /// Claimed, the live row, or `None` when it conflicted with a row it could not see
    /// (committed after its snapshot): read again. A row that does not decode fails
    /// only its own request.
    type Outcome = Result<Option<ClaimResult>, LedgerError>;
    const OPERATION: &'static str = "claim";
    const SKIP_ABANDONED: bool = true;
    const ONE_PER_SCOPE: bool = false;

    fn scope(row: &ClaimRow) -> &Scope {
        &row.scope
    }

    async fn write(pool: &PgPool, rows: &[&ClaimRow]) -> Result<Vec<Self::Outcome>, sqlx::Error> {
        let answers = sqlx::query(CLAIM_SQL)
            .bind(column(rows, |r| r.scope.tenant.as_str()))
            .bind(column(rows, |r| r.scope.endpoint.as_str()))
            .bind(column(rows, |r| r.scope.key.as_str()))
            .bind(column(rows, |r| &r.fingerprint[..]))
            .bind(column(rows, |r| r.attempt))
            .bind(column(rows, |r| r.lease_ms))
            .bind(column(rows, |r| r.trace_context.as_deref()))
            .bind(column(rows, |r| r.ttl_ms))
            .fetch_all(pool)
            .await?;
        Ok(answers.iter().map(claim_outcome).collect())
    }
}

fn claim_outcome(row: &PgRow) -> Result<Option<ClaimResult>, LedgerError> {
    if row
        .try_get::<bool, _>("claimed")
        .map_err(LedgerError::new)?
    {
        return Ok(Some(ClaimResult::Claimed));
    }
    let seen = row
        .try_get::<Option<Uuid>, _>("attempt")
        .map_err(LedgerError::new)?;
    match seen {
        Some(_) => Ok(Some(ClaimResult::Existing(record(row)?))),
        None => Ok(None),
    }
}

/// One completion as its pipe queues it.
#[derive(Debug)]
struct CompleteRow {
    scope: Scope,
    attempt: Uuid,
    status: i32,
    headers: serde_json::Value,
    body: Bytes,
    ttl_ms: f64,
    omitted: bool,
}

/// Completions, grouped: [`COMPLETE_SQL`] over arrays, each row fenced by its attempt.
#[derive(Debug)]
struct Completions;

impl Batch for Completions {
    type Row = CompleteRow;
    type Outcome = Fence;
    const OPERATION: &'static str = "complete";
    const SKIP_ABANDONED: bool = false;
    const ONE_PER_SCOPE: bool = true;

    fn scope(row: &CompleteRow) -> &Scope {
        &row.scope
    }

    fn bytes(row: &CompleteRow) -> usize {
        row.body.len()
    }

    async fn write(pool: &PgPool, rows: &[&CompleteRow]) -> Result<Vec<Fence>, sqlx::Error> {
        let mut conn = pool.acquire().await?;
        if rows.iter().map(|r| r.body.len()).sum::<usize>() > CLOSE_AFTER_BYTES {
            // The connection's write buffer grew to hold these bodies, and sqlx never
            // shrinks it: a pool of such connections would keep one large body's worth
            // of memory each, for good. This one is closed after use.
            conn.close_on_drop();
        }
        let held: Vec<i64> = sqlx::query_scalar(COMPLETE_SQL)
            .bind(column(rows, |r| r.scope.tenant.as_str()))
            .bind(column(rows, |r| r.scope.endpoint.as_str()))
            .bind(column(rows, |r| r.scope.key.as_str()))
            .bind(column(rows, |r| r.attempt))
            .bind(column(rows, |r| r.status))
            .bind(column(rows, |r| &r.headers))
            .bind(column(rows, |r| &r.body[..]))
            .bind(column(rows, |r| r.ttl_ms))
            .bind(column(rows, |r| r.omitted))
            .fetch_all(&mut *conn)
            .await?;
        // The statement returns the (1-based) positions of the rows it changed.
        Ok((1..=rows.len() as i64)
            .map(|n| fence(u64::from(held.contains(&n))))
            .collect())
    }
}

/// One array parameter: a field of every row.
fn column<'r, R, T>(rows: &[&'r R], field: impl Fn(&'r R) -> T) -> Vec<T> {
    rows.iter().map(|row| field(row)).collect()
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

/// For each claim of the arrays $1..$8 (tenant, endpoint, key, request hash, attempt,
/// lease ms, trace context, TTL ms), in order: inserts the row, or takes over one that is
/// not live (completed and expired); else returns the live row.
pub const CLAIM_SQL: &str = concat!(
    "WITH i AS (\
       SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::uuid[], \
                            $6::float8[], $7::text[], $8::float8[]) WITH ORDINALITY \
         AS i(tenant_id, endpoint, key, request_hash, attempt, lease_ms, trace_context, \
              ttl_ms, n)), ",
    // The live rows, by a plain read first: a replay (or a retry of a key in progress)
    // takes no row lock, gets no transaction id and writes no WAL. Only the claims with
    // no live row visible upsert: each inserts, takes over an expired row, or (a row
    // committed concurrently) does nothing and its caller reads again. In the order of
    // the arrays, which is scope order: row locks are taken in one order everywhere.
    "seen AS (\
       SELECT i.n, k.* FROM i CROSS JOIN LATERAL (\
         SELECT k.* FROM idempotency_keys AS k \
         WHERE k.tenant_id = i.tenant_id AND k.endpoint = i.endpoint AND k.key = i.key AND ",
    live!(),
    // OFFSET 0 keeps the lookup a subquery of its own, run per claim by the key's index,
    // rather than flattened into a join the planner may answer by scanning live rows.
    " OFFSET 0) AS k), ",
    // A key twice in the arrays (a double click, a retry) upserts once, by its first
    // claim; the later ones read the row again (it may not be visible to this statement).
    "claimed AS (\
       INSERT INTO idempotency_keys AS k \
         (tenant_id, endpoint, key, request_hash, status, attempt, locked_until, \
          trace_context, created_at, expires_at) \
       SELECT i.tenant_id, i.endpoint, i.key, i.request_hash, 'in_progress', i.attempt, \
          now() + i.lease_ms * interval '1 millisecond', i.trace_context, now(), \
          now() + i.ttl_ms * interval '1 millisecond' \
       FROM i WHERE NOT EXISTS (SELECT 1 FROM seen WHERE seen.n = i.n) \
         AND NOT EXISTS (SELECT 1 FROM i AS earlier WHERE earlier.n < i.n \
           AND earlier.tenant_id = i.tenant_id AND earlier.endpoint = i.endpoint \
           AND earlier.key = i.key) \
       ORDER BY i.n \
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
    " RETURNING k.attempt) \
     SELECT i.attempt IN (SELECT attempt FROM claimed) AS claimed, ",
    record_columns!(),
    " FROM i LEFT JOIN seen AS k ON k.n = i.n ORDER BY i.n"
);

pub const GET_SQL: &str = concat!(
    "SELECT ",
    record_columns!(),
    " FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    live!()
);

/// For each completion of the arrays $1..$9 (tenant, endpoint, key, attempt, status,
/// headers, body, TTL ms, body omitted): fenced by its attempt alone (not by status), so
/// that repeating a completion whose reply was lost finds its own row again instead of
/// reporting a lost fence. Returns the positions of the rows it changed. The rows are
/// locked first, in the order of the arrays (scope order), as claims lock them.
pub const COMPLETE_SQL: &str = "WITH i AS (\
       SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[], $5::int4[], \
                            $6::jsonb[], $7::bytea[], $8::float8[], $9::bool[]) \
         WITH ORDINALITY AS i(tenant_id, endpoint, key, attempt, status, headers, body, \
                              ttl_ms, omitted, n)), \
     mine AS (\
       SELECT i.*, k.ctid AS row FROM i CROSS JOIN LATERAL (\
         SELECT k.ctid FROM idempotency_keys AS k \
         WHERE k.tenant_id = i.tenant_id AND k.endpoint = i.endpoint AND k.key = i.key \
           AND k.attempt = i.attempt \
         FOR UPDATE) AS k) \
     UPDATE idempotency_keys AS k SET status = 'completed', \
       response_status = mine.status, response_headers = mine.headers, \
       response_body = mine.body, response_omitted = mine.omitted, completed_at = now(), \
       locked_until = NULL, held_since = NULL, \
       expires_at = now() + mine.ttl_ms * interval '1 millisecond' \
     FROM mine WHERE k.ctid = mine.row \
     RETURNING mine.n";

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
