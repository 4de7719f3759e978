//! Which of the keys awaited (a result's long-poll, `Prefer: wait` on
//! `/_idemgate/v1/keys/{key}/result`) have settled: one statement for every key a replica's
//! waiters wait on, whichever tenant's, sent at most every poll interval while any wait —
//! so a thousand idle waiters cost a statement a poll, not a thousand.

use idem_core::{LedgerError, Scope};

use super::{PgLedger, column};

/// The positions (1-based) of the scopes $1..$3 (tenant, endpoint, key arrays) that no
/// longer have an in-progress row: completed, released, or never claimed.
pub const SETTLED_SQL: &str = "SELECT u.n FROM unnest($1::text[], $2::text[], $3::text[]) \
       WITH ORDINALITY AS u(tenant_id, endpoint, key, n) \
     WHERE NOT EXISTS (SELECT 1 FROM idempotency_keys AS k \
       WHERE k.tenant_id = u.tenant_id AND k.endpoint = u.endpoint AND k.key = u.key \
         AND k.status = 'in_progress')";

impl PgLedger {
    /// For each of `scopes`, whether its operation has settled (no in-progress row).
    pub async fn settled(&self, scopes: &[&Scope]) -> Result<Vec<bool>, LedgerError> {
        let positions: Vec<i64> = self
            .bounded("settled", async |c| {
                sqlx::query_scalar(SETTLED_SQL)
                    .bind(column(scopes, |s| s.tenant.as_str()))
                    .bind(column(scopes, |s| s.endpoint.as_str()))
                    .bind(column(scopes, |s| s.key.as_str()))
                    .fetch_all(c)
                    .await
            })
            .await?;
        let mut settled = vec![false; scopes.len()];
        for n in positions {
            if let Some(slot) = usize::try_from(n - 1).ok().and_then(|i| settled.get_mut(i)) {
                *slot = true;
            }
        }
        Ok(settled)
    }
}
