//! How an attempt ends when it does not complete: a release (the upstream provably did
//! nothing, or the reconciler has the evidence) deletes the row so a retry may execute;
//! a hold (an answer that proves nothing) ends the lease at once for the reconciler's
//! probe. Both are fenced by the attempt.

use idem_core::{AttemptId, Fence, LedgerError, Scope};

use super::{PgLedger, rules};

/// Deletes the in-progress row of the scope $1..$3 owned by the attempt in $4, and tells
/// its settlement (`not_executed`) if the row is marked or $5 asks (the reconciler's, for a
/// tenant with a callback). Completed rows are never released. Returns the rows deleted.
pub const RELEASE_SQL: &str = concat!(
    "WITH released AS (DELETE FROM idempotency_keys AS k WHERE ",
    rules::owned_by_attempt!(),
    " AND k.status = 'in_progress' \
       RETURNING k.tenant_id, k.endpoint, k.key, k.attempt, k.trace_context, \
         (k.callback OR $5::bool) AS tell), \
     told AS (",
    super::callbacks::tell_sql!("released", "'not_executed'", "NULL::int4", "released.tell"),
    ") SELECT count(*) FROM released"
);

/// Ends the lease of the in-progress row owned by the attempt in $4 now, and marks it
/// held (for the reconciler, which probes it on its next pass).
pub const HOLD_SQL: &str = concat!(
    "UPDATE idempotency_keys AS k SET locked_until = now(), \
       held_since = coalesce(k.held_since, now()) \
     WHERE ",
    rules::owned_by_attempt!(),
    " AND k.status = 'in_progress'"
);

impl PgLedger {
    /// Deletes an in-progress row so a retry may execute, if `attempt` still owns it;
    /// its settlement is told if its client was answered 202, or if `tell`.
    pub async fn release_attempt(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        tell: bool,
    ) -> Result<Fence, LedgerError> {
        let released: i64 = self
            .bounded("release", async |c| {
                sqlx::query_scalar(RELEASE_SQL)
                    .bind(&scope.tenant)
                    .bind(&scope.endpoint)
                    .bind(scope.key.as_str())
                    .bind(attempt.0)
                    .bind(tell)
                    .fetch_one(c)
                    .await
            })
            .await?;
        Ok(rules::fence(released.unsigned_abs()))
    }

    /// Ends `attempt`'s lease now, keeping its row in progress for the reconciler.
    pub async fn hold_attempt(
        &self,
        scope: &Scope,
        attempt: AttemptId,
    ) -> Result<Fence, LedgerError> {
        self.fenced("hold", Self::on(HOLD_SQL, scope).bind(attempt.0))
            .await
    }
}
