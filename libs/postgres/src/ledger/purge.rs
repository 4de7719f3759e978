//! Deleting completed rows past their expiry, in small batches that skip rows others
//! hold. An in-progress row is never purged, whatever its TTL.

use idem_core::LedgerError;

use super::{PgLedger, rules};

/// Deletes up to $1 rows that are not live (completed and expired), oldest first.
pub const PURGE_SQL: &str = concat!(
    "DELETE FROM idempotency_keys AS gone \
     USING (SELECT k.tenant_id, k.endpoint, k.key FROM idempotency_keys AS k \
            WHERE NOT ",
    rules::live!(),
    // The same test by the statement's clock, which the expiry index can bound (the
    // row's own clock, in `live!`, is volatile and could not).
    " AND k.expires_at <= now() ORDER BY k.expires_at \
            LIMIT $1 \
            FOR UPDATE SKIP LOCKED) expired \
     WHERE gone.tenant_id = expired.tenant_id AND gone.endpoint = expired.endpoint \
       AND gone.key = expired.key"
);

impl PgLedger {
    /// Deletes up to `limit` completed rows past their expiry and returns how many. Rows
    /// another transaction holds are skipped, never waited for.
    /// The marks of forced releases and the callbacks finished a day ago go with them.
    pub async fn purge_batch(&self, limit: i64) -> Result<u64, LedgerError> {
        let result = self
            .bounded("purge", async |c| {
                let purged = sqlx::query(PURGE_SQL).bind(limit).execute(&mut *c).await?;
                sqlx::query(super::operator::PURGE_FORCED_SQL)
                    .execute(&mut *c)
                    .await?;
                sqlx::query(super::callbacks::PURGE_CALLBACKS_SQL)
                    .bind(limit)
                    .execute(c)
                    .await?;
                Ok(purged)
            })
            .await?;
        Ok(result.rows_affected())
    }
}
