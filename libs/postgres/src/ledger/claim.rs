//! The claim, and the read of a live row.
//!
//! A claim reads the live row first, by a plain read: a replay (or a retry of a key in
//! progress) takes no row lock, gets no transaction id and writes no WAL. Only a claim
//! that sees no live row upserts: it inserts, takes over an expired completed row, or —
//! a row committed concurrently, after the statement's snapshot — does nothing, and its
//! caller reads again. Claims are written in groups ([`crate::group`]): a statement over
//! arrays, one element per claim, each learning its own outcome.
//!
//! A claim whose request stopped waiting before its statement answered is released as
//! soon as the statement returns, whatever it did ([`Batch::abandoned`]), so the key is
//! never left held for a request that never ran.

use std::time::Duration;

use idem_core::{Claim, LedgerError, Scope};
use sqlx::postgres::PgRow;
use sqlx::{PgConnection, PgPool, Row};
use uuid::Uuid;

use super::row::{self, Found};
use super::{PgLedger, column, millis, rules};
use crate::conn::OneStatement;
use crate::group::Batch;

/// The claim over the rows `i` the argument selects (tenant_id, endpoint, key,
/// request_hash, attempt, lease_ms, trace_context, ttl_ms and their position n), in order:
/// inserts the row, or takes over one that is not live (completed and expired); else
/// returns the live row. One statement, whatever its rows come from.
macro_rules! claim_sql {
    ($claims:literal) => {
        concat!(
            "WITH i AS (", $claims, "), ",
            // The live rows, by a plain read first; only the claims with no live row visible
            // upsert. In the order of the arrays, which is scope order: row locks are taken in
            // one order everywhere.
            "seen AS (\
               SELECT i.n, k.* FROM i CROSS JOIN LATERAL (\
                 SELECT k.* FROM idempotency_keys AS k \
                 WHERE k.tenant_id = i.tenant_id AND k.endpoint = i.endpoint AND k.key = i.key AND ",
            rules::live!(),
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
                  trace_context = EXCLUDED.trace_context, created_at = EXCLUDED.created_at, \
                  expires_at = EXCLUDED.expires_at, ",
            rules::nothing_of_the_last_attempt!(),
            " WHERE NOT ",
            rules::live!(),
            " RETURNING k.attempt) \
             SELECT i.attempt IN (SELECT attempt FROM claimed) AS claimed, ",
            rules::record_columns!(),
            " FROM i LEFT JOIN seen AS k ON k.n = i.n ORDER BY i.n"
        )
    };
}

/// The claims of a group, over the arrays $1..$8 (tenant, endpoint, key, request hash,
/// attempt, lease ms, trace context, TTL ms), one element per claim.
pub const CLAIM_SQL: &str = claim_sql!(
    "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::bytea[], $5::uuid[], \
                          $6::float8[], $7::text[], $8::float8[]) WITH ORDINALITY \
       AS i(tenant_id, endpoint, key, request_hash, attempt, lease_ms, trace_context, \
            ttl_ms, n)"
);

/// Embedded mode's claim of one key, $1..$8 as scalars (tenant, endpoint, key, request
/// hash, attempt, lease ms, trace context, TTL ms), one per transaction: a plain insert,
/// for the key that has no row yet — the common case, and the cheapest statement that
/// claims it (`loadtest/ledger-variants`: the group's read-first form as one row cost
/// Postgres a third more). A key that has a row (a retry, an expired record) conflicts and
/// inserts nothing; [`TAKE_OVER_ONE_SQL`] then takes it over or reads it. An insert that
/// meets another transaction's uncommitted row of the key waits for that transaction's
/// end, as long as the transaction's `lock_timeout` allows.
///
/// Once the claim has run — after any wait — it sets the transaction's `lock_timeout` to
/// $9 for the rest of it (the handler's writes): a short wait for the claim and the
/// caller's own for the handler, in one round trip.
pub const CLAIM_ONE_SQL: &str = "INSERT INTO idempotency_keys AS k \
       (tenant_id, endpoint, key, request_hash, status, attempt, locked_until, \
        trace_context, created_at, expires_at) \
     VALUES ($1, $2, $3, $4, 'in_progress', $5, now() + $6::float8 * interval '1 millisecond', \
        $7, now(), now() + $8::float8 * interval '1 millisecond') \
     ON CONFLICT (tenant_id, endpoint, key) DO NOTHING \
     RETURNING set_config('lock_timeout', $9, true) AS lock_timeout_after";

/// Embedded mode's claim of a key [`CLAIM_ONE_SQL`] found a row for, with its parameters:
/// takes the row over if it is not live (completed and expired), else returns the live
/// row, read without a lock. Neither — the row went between the two statements (purged)
/// — and the claim begins again, its short lock wait unchanged. A row taken over sets
/// `lock_timeout` as the insert does.
pub const TAKE_OVER_ONE_SQL: &str = concat!(
    "WITH taken AS (\
       UPDATE idempotency_keys AS k SET request_hash = $4, status = 'in_progress', \
         attempt = $5, locked_until = now() + $6::float8 * interval '1 millisecond', \
         trace_context = $7, created_at = now(), \
         expires_at = now() + $8::float8 * interval '1 millisecond', ",
    rules::nothing_of_the_last_attempt!(),
    " WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND NOT ",
    rules::live!(),
    " RETURNING k.attempt) \
     SELECT EXISTS (SELECT 1 FROM taken) AS claimed, ",
    rules::record_columns!(),
    ", CASE WHEN EXISTS (SELECT 1 FROM taken) \
       THEN set_config('lock_timeout', $9, true) END AS lock_timeout_after \
     FROM (SELECT 1) AS one LEFT JOIN idempotency_keys AS k \
       ON k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    rules::live!()
);

/// The live row of one scope ($1, $2, $3).
pub const GET_SQL: &str = concat!(
    "SELECT ",
    rules::record_columns!(),
    " FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    rules::live!()
);

/// Releases the claims of the arrays $1..$4 (tenant, endpoint, key, attempt) whose
/// requests gave up before their statement answered: each only if still in progress
/// under its attempt.
pub const UNDO_SQL: &str = "DELETE FROM idempotency_keys AS k \
     USING unnest($1::text[], $2::text[], $3::text[], $4::uuid[]) AS u(tenant_id, endpoint, key, attempt) \
     WHERE k.tenant_id = u.tenant_id AND k.endpoint = u.endpoint AND k.key = u.key \
       AND k.attempt = u.attempt AND k.status = 'in_progress'";

/// One claim as its pipe queues it.
#[derive(Debug)]
pub(crate) struct ClaimRow {
    scope: Scope,
    fingerprint: [u8; 32],
    attempt: Uuid,
    lease_ms: f64,
    trace_context: Option<String>,
    ttl_ms: f64,
}

impl ClaimRow {
    pub(crate) fn of(c: &Claim<'_>) -> Self {
        Self {
            scope: c.scope.clone(),
            fingerprint: *c.fingerprint.as_bytes(),
            attempt: c.attempt.0,
            lease_ms: millis(c.lease),
            trace_context: c.trace_context.map(str::to_owned),
            ttl_ms: millis(c.ttl),
        }
    }
}

impl ClaimRow {
    /// This claim alone, by [`CLAIM_ONE_SQL`] and, when the key has a row,
    /// [`TAKE_OVER_ONE_SQL`]: a claim on a caller's transaction, which keeps
    /// `lock_timeout_after` as its `lock_timeout` after the claim.
    pub(crate) async fn write_one(
        &self,
        conn: &mut PgConnection,
        lock_timeout_after: Duration,
    ) -> Result<<Claims as Batch>::Outcome, sqlx::Error> {
        let lock_timeout_after = format!("{}ms", lock_timeout_after.as_millis().max(1));
        let inserted = self
            .one(CLAIM_ONE_SQL, &lock_timeout_after)
            .fetch_optional(&mut *conn)
            .await;
        let answer = match inserted {
            Ok(Some(_)) => return Ok(Ok(Some(Seen::Claimed))),
            Ok(None) => {
                self.one(TAKE_OVER_ONE_SQL, &lock_timeout_after)
                    .fetch_one(conn)
                    .await
            }
            Err(error) => Err(error),
        };
        match answer {
            Ok(answer) => Ok(claim_outcome(&answer)),
            Err(error) if super::lock_not_available(&error) => Ok(Ok(Some(Seen::Locked))),
            Err(error) => Err(error),
        }
    }

    /// `sql` (one of embedded mode's two claim statements) with this claim's values.
    fn one<'q>(
        &'q self,
        sql: &'static str,
        lock_timeout_after: &'q str,
    ) -> sqlx::query::Query<'q, sqlx::Postgres, sqlx::postgres::PgArguments> {
        sqlx::query(sql)
            .bind(self.scope.tenant.as_str())
            .bind(self.scope.endpoint.as_str())
            .bind(self.scope.key.as_str())
            .bind(&self.fingerprint[..])
            .bind(self.attempt)
            .bind(self.lease_ms)
            .bind(self.trace_context.as_deref())
            .bind(self.ttl_ms)
            .bind(lock_timeout_after)
    }
}

/// What one claim of a statement found.
#[derive(Debug)]
pub(crate) enum Seen {
    /// This attempt owns the row now.
    Claimed,
    /// The live row (another attempt's).
    Row(Found),
    /// Another transaction held the row locked past the connection's `lock_timeout`.
    Locked,
}

/// Claims, grouped: [`CLAIM_SQL`] over arrays, one element per claim.
#[derive(Debug)]
pub(crate) struct Claims;

impl Batch for Claims {
    type Row = ClaimRow;
    /// Claimed, the live row, or `None` when it conflicted with a row it could not see
    /// (committed after its snapshot): read again. A row that does not decode fails
    /// only its own request.
    type Outcome = Result<Option<Seen>, LedgerError>;
    const OPERATION: &'static str = "claim";
    const SKIP_ABANDONED: bool = true;
    const ONE_PER_SCOPE: bool = false;

    fn scope(row: &ClaimRow) -> &Scope {
        &row.scope
    }

    async fn write(
        conn: &mut PgConnection,
        rows: &[&ClaimRow],
    ) -> Result<Vec<Self::Outcome>, sqlx::Error> {
        let answered = sqlx::query(CLAIM_SQL)
            .bind(column(rows, |r| r.scope.tenant.as_str()))
            .bind(column(rows, |r| r.scope.endpoint.as_str()))
            .bind(column(rows, |r| r.scope.key.as_str()))
            .bind(column(rows, |r| &r.fingerprint[..]))
            .bind(column(rows, |r| r.attempt))
            .bind(column(rows, |r| r.lease_ms))
            .bind(column(rows, |r| r.trace_context.as_deref()))
            .bind(column(rows, |r| r.ttl_ms))
            .fetch_all(conn)
            .await;
        let answers = match answered {
            // One claim waited `lock_timeout` on its row: another transaction holds the
            // key uncommitted. (A statement of several rows is refused whole and its rows
            // go again one by one, so only the locked key's request is told.)
            Err(error) if rows.len() == 1 && super::lock_not_available(&error) => {
                return Ok(vec![Ok(Some(Seen::Locked))]);
            }
            answered => answered?,
        };
        Ok(answers.iter().map(claim_outcome).collect())
    }

    /// Releases every claim this statement made (or may have made) for a request that
    /// no longer waits for it.
    async fn abandoned(pool: &PgPool, rows: &[(&ClaimRow, Option<&Self::Outcome>)]) {
        let claimed: Vec<&ClaimRow> = rows
            .iter()
            .filter(|(_, outcome)| match outcome {
                Some(Ok(Some(Seen::Claimed))) | None => true,
                Some(_) => false,
            })
            .map(|(row, _)| *row)
            .collect();
        if claimed.is_empty() {
            return;
        }
        let undo = async {
            let mut conn = OneStatement::acquire(pool).await?;
            let answer = sqlx::query(UNDO_SQL)
                .bind(column(&claimed, |r| r.scope.tenant.as_str()))
                .bind(column(&claimed, |r| r.scope.endpoint.as_str()))
                .bind(column(&claimed, |r| r.scope.key.as_str()))
                .bind(column(&claimed, |r| r.attempt))
                .execute(&mut *conn)
                .await;
            conn.answered(answer)
        };
        match tokio::time::timeout(UNDO_TIMEOUT, undo).await {
            Ok(Ok(done)) if done.rows_affected() > 0 => tracing::warn!(
                released = done.rows_affected(),
                "claims committed after their requests gave up were released"
            ),
            Ok(Ok(_)) => {}
            Ok(Err(error)) => {
                tracing::error!(%error, keys = claimed.len(), "could not release claims whose requests gave up; they stay held for the reconciler")
            }
            Err(_) => tracing::error!(
                keys = claimed.len(),
                "releasing claims whose requests gave up timed out; they stay held for the reconciler"
            ),
        }
    }
}

/// How long the release of abandoned claims may take.
const UNDO_TIMEOUT: Duration = Duration::from_secs(10);

fn claim_outcome(row: &PgRow) -> Result<Option<Seen>, LedgerError> {
    if row
        .try_get::<bool, _>("claimed")
        .map_err(LedgerError::new)?
    {
        return Ok(Some(Seen::Claimed));
    }
    let seen = row
        .try_get::<Option<Uuid>, _>("attempt")
        .map_err(LedgerError::new)?;
    match seen {
        Some(_) => Ok(Some(Seen::Row(row::record(row)?))),
        None => Ok(None),
    }
}

impl PgLedger {
    /// The live row of `scope`, as read (a large body not yet read).
    pub(crate) async fn read(&self, scope: &Scope) -> Result<Option<Found>, LedgerError> {
        let row = self
            .bounded("get", async |c| {
                Self::on(GET_SQL, scope).fetch_optional(c).await
            })
            .await?;
        row.as_ref().map(row::record).transpose()
    }
}
