//! The completion: the attempt's answer written to its row, fenced by the attempt.
//! Completions are written in groups ([`crate::group`]), one row per scope per statement.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{AttemptId, Completed, Fingerprint, Scope, StoredResponse};
use sqlx::PgConnection;
use uuid::Uuid;

use super::{CLOSE_AFTER_BYTES, column, millis, rules};
use crate::group::Batch;
use crate::headers;

/// The completion of the rows `i` the argument selects (tenant_id, endpoint, key, attempt,
/// status, headers, body, ttl_ms, omitted, request_hash and their position n): each fenced
/// by its key and attempt alone (not by status), so that repeating a completion whose
/// reply was lost finds its own row again instead of reporting a lost fence. Returns the
/// positions of the rows it wrote, each with its new expiry, whether it was restored, and
/// — restored after an operator's forced release — that release's reason.
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
///
/// A row marked `callback` (its client was answered 202) writes its settlement to the
/// callbacks outbox in the same statement; a repeated completion finds it there already.
///
/// A row that is **absent** — no attempt's row at all for the key, not one another attempt
/// owns — is written back, completed (`restored`). Nothing of the gateway deletes a row
/// whose attempt is still inside its lease, so an absent row means the ledger lost a
/// commit it had acknowledged (a failover to a standby that had not received it) — unless
/// an operator forced its release, which leaves a mark (`forced_releases`) the statement
/// returns. Either way the upstream did act: without the write-back a retry would claim
/// the key afresh and execute again. The insert is fenced like any claim: a row another
/// attempt inserted since (visible or not to this statement) conflicts, and nothing is
/// written.
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
                 FOR UPDATE) AS locked), \
             done AS (\
               UPDATE idempotency_keys AS k SET status = 'completed', \
                 response_status = mine.status, response_headers = mine.headers, \
                 response_body = mine.body, response_omitted = mine.omitted, \
                 completed_at = CASE WHEN k.status = 'completed' THEN k.completed_at ELSE now() END, \
                 locked_until = NULL, held_since = NULL, \
                 expires_at = CASE WHEN k.status = 'completed' THEN k.expires_at \
                   ELSE now() + mine.ttl_ms * interval '1 millisecond' END \
               FROM mine WHERE k.tenant_id = mine.tenant_id AND k.endpoint = mine.endpoint \
                 AND k.key = mine.key AND k.attempt = mine.attempt \
               RETURNING mine.n, k.expires_at, k.tenant_id, k.endpoint, k.key, k.attempt, \
                 k.response_status, k.callback, k.trace_context), \
             told AS (",
            $crate::ledger::callbacks::tell_sql!("done", "'completed'", "done.response_status", "done.callback"),
            "), \
             restored AS (\
               INSERT INTO idempotency_keys AS k \
                 (tenant_id, endpoint, key, request_hash, status, attempt, response_status, \
                  response_headers, response_body, response_omitted, created_at, completed_at, \
                  expires_at) \
               SELECT i.tenant_id, i.endpoint, i.key, i.request_hash, 'completed', i.attempt, \
                  i.status, i.headers, i.body, i.omitted, now(), now(), \
                  now() + i.ttl_ms * interval '1 millisecond' \
               FROM i WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys AS k \
                 WHERE k.tenant_id = i.tenant_id AND k.endpoint = i.endpoint AND k.key = i.key) \
               ON CONFLICT (tenant_id, endpoint, key) DO NOTHING \
               RETURNING k.tenant_id, k.endpoint, k.key, k.expires_at) \
             SELECT done.n, ",
            $crate::ledger::rules::epoch_micros!("done.expires_at"),
            " AS expires_at_us, false AS restored, NULL::text AS released_by FROM done \
             UNION ALL \
             SELECT i.n, ",
            $crate::ledger::rules::epoch_micros!("restored.expires_at"),
            ", true, (SELECT f.reason FROM forced_releases AS f \
                WHERE f.tenant_id = i.tenant_id AND f.attempt = i.attempt) \
             FROM restored JOIN i ON i.tenant_id = restored.tenant_id \
               AND i.endpoint = restored.endpoint AND i.key = restored.key"
        )
    };
}

/// The completions of a group, over the arrays $1..$10 (tenant, endpoint, key, attempt,
/// status, headers, body, TTL ms, body omitted, request hash), one element per completion
/// (one per scope: the write-back joins its rows to them by key).
pub const COMPLETE_SQL: &str = complete_sql!(
    "SELECT * FROM unnest($1::text[], $2::text[], $3::text[], $4::uuid[], $5::int4[], \
                          $6::jsonb[], $7::bytea[], $8::float8[], $9::bool[], $10::bytea[]) \
       WITH ORDINALITY AS i(tenant_id, endpoint, key, attempt, status, headers, body, \
                            ttl_ms, omitted, request_hash, n)"
);

/// [`COMPLETE_SQL`]; in a debug build started with `IDEMGATE_NO_WRITE_BACK` set, the same
/// statement with the write-back of absent rows switched off — for `loadtest/chaos`'s
/// drill that counts what asynchronous replication loses without it. Release builds
/// always write back.
#[cfg(debug_assertions)]
fn complete_sql() -> &'static str {
    static SQL: std::sync::OnceLock<&'static str> = std::sync::OnceLock::new();
    SQL.get_or_init(|| {
        if std::env::var_os("IDEMGATE_NO_WRITE_BACK").is_none() {
            return COMPLETE_SQL;
        }
        const RESTORE: &str = "FROM i WHERE NOT EXISTS";
        assert!(
            COMPLETE_SQL.contains(RESTORE),
            "the write-back's condition moved"
        );
        tracing::warn!("IDEMGATE_NO_WRITE_BACK: completions never write back an absent row");
        String::leak(COMPLETE_SQL.replacen(RESTORE, "FROM i WHERE false AND NOT EXISTS", 1))
    })
}

#[cfg(not(debug_assertions))]
fn complete_sql() -> &'static str {
    COMPLETE_SQL
}

/// The completion of one row, $1..$9 (tenant, endpoint, key, attempt, status, headers,
/// body, TTL ms, body omitted): embedded mode's, in the transaction that claimed the row.
/// That transaction's own uncommitted row: no other transaction can lock it, move it or
/// delete it, and it is completed once. So none of the group's care is needed — no lock
/// taken first, no completion repeated, no row written back — and the statement is a
/// plain update by the key's index, planned once per connection.
pub const COMPLETE_ONE_SQL: &str = concat!(
    "UPDATE idempotency_keys AS k SET status = 'completed', \
       response_status = $5, response_headers = $6, response_body = $7, \
       response_omitted = $9, completed_at = now(), locked_until = NULL, held_since = NULL, \
       expires_at = now() + $8::float8 * interval '1 millisecond' \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND k.attempt = $4 \
     RETURNING ",
    rules::epoch_micros!("k.expires_at")
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
    fingerprint: [u8; 32],
}

impl CompleteRow {
    pub(crate) fn of(
        scope: &Scope,
        attempt: AttemptId,
        fingerprint: &Fingerprint,
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
            fingerprint: *fingerprint.as_bytes(),
        }
    }
}

impl CompleteRow {
    /// This completion alone, by [`COMPLETE_ONE_SQL`]: on the transaction that claimed it.
    pub(crate) async fn write_one(
        &self,
        conn: &mut PgConnection,
    ) -> Result<Completed, sqlx::Error> {
        let expires_at: Option<i64> = sqlx::query_scalar(COMPLETE_ONE_SQL)
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
        Ok(self.completed(expires_at.map(|expires_at| (expires_at, Absent::No))))
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
        let held: Vec<(i64, i64, bool, Option<String>)> = sqlx::query_as(complete_sql())
            .bind(column(rows, |r| r.scope.tenant.as_str()))
            .bind(column(rows, |r| r.scope.endpoint.as_str()))
            .bind(column(rows, |r| r.scope.key.as_str()))
            .bind(column(rows, |r| r.attempt))
            .bind(column(rows, |r| r.status))
            .bind(column(rows, |r| &r.headers))
            .bind(column(rows, |r| &r.body[..]))
            .bind(column(rows, |r| r.ttl_ms))
            .bind(column(rows, |r| r.omitted))
            .bind(column(rows, |r| &r.fingerprint[..]))
            .fetch_all(conn)
            .await?;
        // The statement returns the (1-based) positions of the rows it wrote.
        Ok(rows
            .iter()
            .zip(1..)
            .map(|(row, n)| {
                let wrote = held.iter().find(|(at, ..)| *at == n);
                row.completed(wrote.map(|(_, expires_at, restored, released_by)| {
                    let absent = match (restored, released_by) {
                        (false, _) => Absent::No,
                        (true, Some(reason)) => Absent::ForcedRelease(reason),
                        (true, None) => Absent::Lost,
                    };
                    (*expires_at, absent)
                }))
            })
            .collect())
    }
}

/// Why a completion found its row absent, and wrote it back.
enum Absent<'a> {
    /// It was not: the row was there.
    No,
    /// The ledger lost a commit it had acknowledged.
    Lost,
    /// An operator force-released the row while its attempt ran, for this reason.
    ForcedRelease(&'a str),
}

impl CompleteRow {
    /// What this completion did: wrote its row (with the row's new expiry, and whether and
    /// why it had to write the row back), or nothing.
    fn completed(&self, wrote: Option<(i64, Absent<'_>)>) -> Completed {
        let Some((expires_at_us, absent)) = wrote else {
            return Completed::Lost;
        };
        if let Absent::ForcedRelease(reason) = absent {
            // Not a lost commit: an operator released the row while this attempt ran.
            tracing::warn!(
                tenant = %self.scope.tenant,
                endpoint = %self.scope.endpoint,
                key = %self.scope.key.as_str(),
                attempt = %self.attempt,
                released_by = %reason,
                "an attempt whose key an operator force-released has completed: the upstream \
                 acted, so its answer was written back and retries replay it"
            );
        } else if let Absent::Lost = absent {
            idem_telemetry::metrics::counter!("idemgate_records_restored_total").increment(1);
            tracing::error!(
                tenant = %self.scope.tenant,
                endpoint = %self.scope.endpoint,
                key = %self.scope.key.as_str(),
                attempt = %self.attempt,
                "the completion found no row for its key, although its attempt held the \
                 claim: the ledger lost a commit it had acknowledged (most likely a failover \
                 to a standby that had not received it: is replication synchronous?). The \
                 completed record was written back, so retries replay this answer"
            );
        }
        Completed::Recorded {
            expires_at: rules::system_time(expires_at_us),
        }
    }
}
