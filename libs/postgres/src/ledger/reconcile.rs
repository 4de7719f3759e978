//! The reconciler's statements: taking rows whose lease ran out (each by one
//! reconciler at a time), completing one with the upstream's real answer, or leaving it
//! for a later pass. Each is fenced by the attempt the row was taken with.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_core::{AttemptId, Fence, LedgerError, Scope, StoredResponse};
use sqlx::Row;
use uuid::Uuid;

use super::{PgLedger, millis, row, rules};
use crate::headers;

/// Takes up to $1 in-progress rows whose lease ran out, oldest lease first, for $2 ms:
/// other reconcilers skip them meanwhile.
///
/// Committed without waiting for a synchronous standby (`synchronous_commit = local`, for
/// this transaction alone, set only when a row is a candidate: every row taken has it,
/// and a take that found none writes nothing to wait for). A take is a courtesy between
/// reconcilers, not a result: lost in a failover, the row is simply taken again, and what
/// the reconcilers then write is fenced by the row's attempt. Waiting, it would hang while
/// a synchronous standby is away (`synchronous_mode_strict` until the old primary has
/// rejoined): given up within its budget, it would commit later all the same, and hold its
/// rows — with no reconciler looking at them — for the whole processing lease.
pub const TAKE_SQL: &str = concat!(
    "WITH stuck AS (\
       SELECT k.tenant_id, k.endpoint, k.key, \
         set_config('synchronous_commit', 'local', true) AS unsynced \
       FROM idempotency_keys AS k \
       WHERE k.status = 'in_progress' AND ",
    rules::lease_over!(),
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

/// Completes the row taken with the attempt in $4 under a fresh attempt ($5), with the
/// answer $6..$8 and $10 (body omitted), live for $9 ms; tells the settlement (under the
/// fresh attempt, which a later mark of the row finds told) if the row is marked or $11
/// asks. Returns the rows completed.
pub const RESOLVE_SQL: &str = concat!(
    "WITH resolved AS (\
       UPDATE idempotency_keys AS k SET status = 'completed', attempt = $5, \
       response_status = $6, response_headers = $7, response_body = $8, \
       response_omitted = $10, completed_at = now(), locked_until = NULL, held_since = NULL, \
       expires_at = now() + $9::float8 * interval '1 millisecond' \
     WHERE ",
    rules::owned_by_attempt!(),
    " AND k.status = 'in_progress' \
       RETURNING k.tenant_id, k.endpoint, k.key, k.attempt, k.response_status, \
         k.trace_context, (k.callback OR $11::bool) AS tell), \
     told AS (",
    super::callbacks::tell_sql!(
        "resolved",
        "'completed'",
        "resolved.response_status",
        "resolved.tell"
    ),
    ") SELECT count(*) FROM resolved"
);

/// Looks at the row taken with the attempt in $4 again in $5 ms, counting an
/// inconclusive probe ($6) or remembering a first 404 ($7).
pub const DEFER_SQL: &str = concat!(
    "UPDATE idempotency_keys AS k \
     SET locked_until = now() + $5::float8 * interval '1 millisecond', \
         probe_attempts = k.probe_attempts + $6::bool::int, \
         first_not_found_at = CASE WHEN $7 THEN coalesce(k.first_not_found_at, now()) \
                              ELSE k.first_not_found_at END \
     WHERE ",
    rules::owned_by_attempt!(),
    " AND k.status = 'in_progress'"
);

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

impl PgLedger {
    /// Takes up to `limit` in-progress rows whose lease ran out, for `processing` time:
    /// other reconcilers skip them meanwhile (`FOR UPDATE SKIP LOCKED`, then the lease
    /// pushed forward in the same statement), so each is looked at by one reconciler.
    pub async fn take_stuck(
        &self,
        limit: i64,
        processing: Duration,
    ) -> Result<Vec<StuckRow>, LedgerError> {
        let rows = self
            .bounded("take", async |c| {
                sqlx::query(TAKE_SQL)
                    .bind(limit)
                    .bind(millis(processing))
                    .fetch_all(c)
                    .await
            })
            .await?;
        rows.iter()
            .map(|r| {
                Ok(StuckRow {
                    scope: row::scope_of(r)?,
                    attempt: AttemptId(r.try_get("attempt")?),
                    created_at: r.try_get("created_at")?,
                    probe_attempts: r.try_get("probe_attempts")?,
                    first_not_found_at: r.try_get("first_not_found_at")?,
                    trace_context: r.try_get("trace_context")?,
                    taken_at: r.try_get("taken_at")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(LedgerError::new)
    }

    /// Completes a stuck row with the upstream's real answer, if `row.attempt` still owns
    /// it, under a fresh attempt token (which fences out the original gateway); `tell`:
    /// its tenant has a callback for settlements.
    pub async fn resolve(
        &self,
        row: &StuckRow,
        response: &StoredResponse,
        ttl: Duration,
        tell: bool,
    ) -> Result<Fence, LedgerError> {
        let resolved: i64 = self
            .bounded("resolve", async |c| {
                sqlx::query_scalar(RESOLVE_SQL)
                    .bind(&row.scope.tenant)
                    .bind(&row.scope.endpoint)
                    .bind(row.scope.key.as_str())
                    .bind(row.attempt.0)
                    .bind(Uuid::new_v4())
                    .bind(i32::from(response.status))
                    .bind(headers::encode(&response.headers))
                    .bind(&response.body[..])
                    .bind(millis(ttl))
                    .bind(response.body_omitted)
                    .bind(tell)
                    .fetch_one(c)
                    .await
            })
            .await?;
        Ok(rules::fence(resolved.unsigned_abs()))
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
}
