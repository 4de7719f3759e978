//! The ledger on a caller's transaction, for embedded mode (docs/embedded-mode.md): the claim
//! of one key ([`CLAIM_ONE_SQL`], a plain insert; [`TAKE_OVER_ONE_SQL`] when the key has a
//! row) and a completion of the transaction's own row ([`COMPLETE_ONE_SQL`]), on a
//! connection inside the service's own transaction, so the claim, the service's business
//! write and the stored answer commit together or not at all.
//!
//! A claim that meets another transaction's uncommitted claim of the same scope waits on
//! it (Postgres makes an insert that conflicts with an uncommitted row wait for that
//! transaction's end), as long as the transaction's `lock_timeout` allows: then it finds
//! the committed answer, or — the other rolled back — claims the key itself.
//!
//! [`CLAIM_ONE_SQL`]: super::claim::CLAIM_ONE_SQL
//! [`TAKE_OVER_ONE_SQL`]: super::claim::TAKE_OVER_ONE_SQL
//! [`COMPLETE_ONE_SQL`]: super::complete::COMPLETE_ONE_SQL

use std::time::Duration;

use idem_core::{
    AttemptId, Claim, ClaimResult, Completed, Fingerprint, LedgerError, RecordState, Scope,
    StoredResponse,
};
use sqlx::{PgConnection, Row};

use super::CLAIM_ROUNDS;
use super::bodies::{self, Bodies};
use super::claim::{ClaimRow, Seen};
use super::complete::CompleteRow;

/// Claims `claim.scope` on `conn` (inside a transaction): this attempt owns the key until
/// the transaction ends, or the live record is returned, or [`ClaimResult::Locked`]:
/// another transaction's claim of the scope was still uncommitted when the transaction's
/// `lock_timeout` ran out (the transaction is then aborted). Once claimed, the transaction
/// keeps `lock_timeout_after` as its `lock_timeout`: the claim may wait briefly and the
/// caller's writes after it longer, or the other way round.
pub async fn claim(
    conn: &mut PgConnection,
    claim: &Claim<'_>,
    lock_timeout_after: Duration,
    bodies: &Bodies,
) -> Result<ClaimResult, LedgerError> {
    let row = ClaimRow::of(claim);
    let scope = claim.scope;
    for _ in 0..CLAIM_ROUNDS {
        match row
            .write_one(conn, lock_timeout_after)
            .await
            .map_err(LedgerError::new)??
        {
            Some(Seen::Claimed) => return Ok(ClaimResult::Claimed),
            Some(Seen::Locked) => return Ok(ClaimResult::Locked),
            Some(Seen::Row(found)) => {
                let mut record = found.record;
                if let Some(len) = found.body_to_read {
                    // A large stored answer: read within the replay budget (or refused,
                    // busy), on this transaction's connection.
                    let attempt = record.attempt.0;
                    let on = &mut *conn;
                    let read = move || async move {
                        let body = sqlx::query(bodies::BODY_SQL)
                            .bind(&scope.tenant)
                            .bind(&scope.endpoint)
                            .bind(scope.key.as_str())
                            .bind(attempt)
                            .fetch_optional(on)
                            .await
                            .map_err(LedgerError::new)?;
                        body.map(|row| row.try_get::<Vec<u8>, _>("response_body"))
                            .transpose()
                            .map_err(LedgerError::new)
                    };
                    // The row changed between the two reads (purged, taken over): again.
                    let Some(body) = bodies.get((scope.clone(), attempt), len, read).await? else {
                        continue;
                    };
                    if let RecordState::Completed(response) = &mut record.state {
                        response.body = body;
                    }
                }
                return Ok(ClaimResult::Existing(record));
            }
            // The claim waited on a row committed after its snapshot: read it again.
            None => continue,
        }
    }
    Err(LedgerError::new(crate::Contended))
}

/// Records the answer of `attempt` on `conn`, in the transaction that claimed it.
pub async fn complete(
    conn: &mut PgConnection,
    scope: &Scope,
    attempt: AttemptId,
    fingerprint: &Fingerprint,
    response: &StoredResponse,
    ttl: Duration,
) -> Result<Completed, LedgerError> {
    CompleteRow::of(scope, attempt, fingerprint, response, ttl)
        .write_one(conn)
        .await
        .map_err(LedgerError::new)
}

/// Whether a failed commit surely changed nothing: Postgres answered it with an error,
/// so the transaction rolled back. Otherwise (the connection broke, the answer never
/// came) the commit may have happened.
pub fn rolled_back(error: &sqlx::Error) -> bool {
    matches!(error, sqlx::Error::Database(_))
}
