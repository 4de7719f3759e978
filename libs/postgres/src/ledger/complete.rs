//! The completion: the attempt's answer written to its row, fenced by the attempt.
//! Completions are written in groups ([`crate::group`]), one row per scope per statement.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{AttemptId, Completed, Scope, StoredResponse};
use sqlx::PgConnection;
use uuid::Uuid;

use super::{CLOSE_AFTER_BYTES, column, millis, rules};
use crate::group::Batch;
use crate::headers;

/// The completion of the rows `i` the argument selects (tenant_id, endpoint, key, attempt,
/// status, headers, body, ttl_ms, omitted and their position n): each fenced by its key and
/// attempt alone (not by status), so that repeating a completion whose reply was lost finds
/// its own row again instead of reporting a lost fence. Returns the positions of the rows
/// it changed, each with its new expiry.
///
/// The rows are locked first, in the order of `i` (scope order), as claims lock them. The
/// update then finds each row by its key again, never by where the row was when it was
/// locked: a row another statement updated meanwhile (the reconciler's defer at lease end,
/// the same completion repeated) has moved, and the update re-checks the row's newest
/// version against the key and the attempt.
///
/// A repeated completion (its first reply was lost) keeps the row's `completed_at` and
/// `expires_at`: a retry may already have replayed the answer with that expiry, and the
/// record is remembered until then, not later.
macro_rules! complete_sql {
    ($completions:literal) => {
        concat!(
            "WITH i AS (",
            $completions,
            "), \
             mine AS MATERIALIZED (\
               SELECT i.* FROM i CROSS JOIN LATERAL (\
                 SELECT 1 FROM idempotency_keys AS k \
                 WHERE k.tenant_id = i.tenant_id AND k.endpoint = i.endpoint \
                   AND k.key = i.key AND k.attempt = i.attempt \
                 FOR UPDATE) AS locked) \
             UPDATE idempotency_keys AS k SET status = 'completed', \
               response_status = mine.status, response_headers = mine.headers, \
               response_body = mine.body, response_omitted = mine.omitted, \
               completed_at = CASE WHEN k.status = 'completed' THEN k.completed_at ELSE now() END, \
               locked_until = NULL, held_since = NULL, \
               expires_at = CASE WHEN k.status = 'completed' THEN k.expires_at \
                 ELSE now() + mine.ttl_ms * interval '1 millisecond' END \
             FROM mine WHERE k.tenant_id = mine.tenant_id AND k.endpoint = mine.endpoint \
               AND k.key = mine.key AND k.attempt = mine.attempt \
             RETURNING mine.n, ",
            $crate::ledger::rules::epoch_micros!("k.expires_at"),
            " AS expires_at_us"
        )
    };
}

/// The completions of a group, over the arrays $1..$9 (tenant, endpoint, key, attempt,
/// status, headers, body, TTL ms, body omitted), one element per completion.
pub const COMPLETE_SQL: &str = complete_sql!(
    "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[], $5::int4[], \
                          $6::jsonb[], $7::bytea[], $8::float8[], $9::bool[]) \
       WITH ORDINALITY AS i(tenant_id, endpoint, key, attempt, status, headers, body, \
                            ttl_ms, omitted, n)"
);

/// The same completion of one row, $1..$9 as scalars: embedded mode's, in the transaction
/// that claimed it. Planned once per connection, as [`super::claim::CLAIM_ONE_SQL`] is.
pub const COMPLETE_ONE_SQL: &str = complete_sql!(
    "SELECT $1::text AS tenant_id, $2::text AS endpoint, $3::text AS key, \
       $4::uuid AS attempt, $5::int4 AS status, $6::jsonb AS headers, $7::bytea AS body, \
       $8::float8 AS ttl_ms, $9::bool AS omitted, 1::int8 AS n"
);

/// One completion as its pipe queues it.
#[derive(Debug)]
pub(crate) struct CompleteRow {
    scope: Scope,
    attempt: Uuid,
    status: i32,
    headers: serde_json::Value,
    body: Bytes,
    ttl_ms: f64,
    omitted: bool,
}

impl CompleteRow {
    pub(crate) fn of(
        scope: &Scope,
        attempt: AttemptId,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Self {
        Self {
            scope: scope.clone(),
            attempt: attempt.0,
            status: i32::from(response.status),
            headers: headers::encode(&response.headers),
            body: response.body.clone(),
            ttl_ms: millis(ttl),
            omitted: response.body_omitted,
        }
    }
}

impl CompleteRow {
    /// This completion alone, by [`COMPLETE_ONE_SQL`]: on the transaction that claimed it.
    pub(crate) async fn write_one(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Completed, sqlx::Error> {
        let held: Option<(i64, i64)> = sqlx::query_as(COMPLETE_ONE_SQL)
            .bind(self.scope.tenant.as_str())
            .bind(self.scope.endpoint.as_str())
            .bind(self.scope.key.as_str())
            .bind(self.attempt)
            .bind(self.status)
            .bind(&self.headers)
            .bind(&self.body[..])
            .bind(self.ttl_ms)
            .bind(self.omitted)
            .fetch_optional(conn)
            .await?;
        Ok(completed(held.map(|(_, expires_at)| expires_at)))
    }
}

/// Completions, grouped: [`COMPLETE_SQL`] over arrays, each row fenced by its attempt.
#[derive(Debug)]
pub(crate) struct Completions;

impl Batch for Completions {
    type Row = CompleteRow;
    type Outcome = Completed;
    const OPERATION: &'static str = "complete";
    const SKIP_ABANDONED: bool = false;
    const ONE_PER_SCOPE: bool = true;

    fn scope(row: &CompleteRow) -> &Scope {
        &row.scope
    }

    fn bytes(row: &CompleteRow) -> usize {
        row.body.len()
    }

    /// The connection's write buffer grew to hold these bodies, and sqlx never shrinks
    /// it: a pool of such connections would keep one large body's worth of memory each.
    fn close_after(rows: &[&CompleteRow]) -> bool {
        rows.iter().map(|r| r.body.len()).sum::<usize>() > CLOSE_AFTER_BYTES
    }

    async fn write(
        conn: &mut PgConnection,
        rows: &[&CompleteRow],
    ) -> Result<Vec<Completed>, sqlx::Error> {
        let held: Vec<(i64, i64)> = sqlx::query_as(COMPLETE_SQL)
            .bind(column(rows, |r| r.scope.tenant.as_str()))
            .bind(column(rows, |r| r.scope.endpoint.as_str()))
            .bind(column(rows, |r| r.scope.key.as_str()))
            .bind(column(rows, |r| r.attempt))
            .bind(column(rows, |r| r.status))
            .bind(column(rows, |r| &r.headers))
            .bind(column(rows, |r| &r.body[..]))
            .bind(column(rows, |r| r.ttl_ms))
            .bind(column(rows, |r| r.omitted))
            .fetch_all(conn)
            .await?;
        // The statement returns the (1-based) positions of the rows it changed.
        Ok((1..=rows.len() as i64)
            .map(|n| completed(held.iter().find(|(at, _)| *at == n).map(|&(_, e)| e)))
            .collect())
    }
}

/// A completion that changed its row (and gave the row's new expiry), or did not.
fn completed(expires_at_us: Option<i64>) -> Completed {
    match expires_at_us {
        Some(us) => Completed::Recorded {
            expires_at: rules::system_time(us),
        },
        None => Completed::Lost,
    }
}
