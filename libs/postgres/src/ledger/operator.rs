//! What `idemgate keys` reads and does: one key as an operator sees it (never its stored
//! body), the held keys, and a release by hand — of the attempt the operator looked at,
//! only once its lease is over unless forced. And the endpoints the ledger holds keys
//! under, for the start-up check that a renamed path parameter does not re-scope keys.

use chrono::{DateTime, Utc};
use idem_core::{AttemptId, LedgerError, Scope};
use sqlx::Row;
use sqlx::postgres::PgRow;
use uuid::Uuid;

use super::{PgLedger, rules};

macro_rules! key_columns {
    () => {
        concat!(
            "k.tenant_id, k.endpoint, k.key, k.status, k.attempt, k.created_at, k.completed_at, \
             k.locked_until, k.expires_at, k.held_since, k.response_status, \
             octet_length(k.response_body) AS response_bytes, k.response_omitted, \
             k.probe_attempts, k.first_not_found_at, k.trace_context, (",
            rules::held!(),
            ") AS held"
        )
    };
}

/// One row, whatever its state ($1, $2, $3).
pub const SHOW_SQL: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3"
);

/// The held rows, oldest first, at most $1.
pub const LIST_HELD_SQL: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys AS k WHERE ",
    rules::held!(),
    " ORDER BY k.created_at LIMIT $1"
);

/// The live row of one scope ($1, $2, $3), as its tenant may see it: an expired
/// completed row is no row.
pub const LOOKUP_SQL: &str = concat!(
    "SELECT ",
    key_columns!(),
    " FROM idempotency_keys AS k \
     WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    rules::live!()
);

/// A page of one tenant's rows ($1) in key order after ($3 endpoint, $4 key), of the
/// endpoint $2 if not null, at most $5, keeping those `$state` selects. One statement per
/// state, each of whose rows it reads is one it returns (or an expired one not yet
/// purged): its cost is the page's, not the tenant's. The in-progress states read the
/// partial index of in-progress rows (`migrations/0005_in_progress_index.sql`), so a
/// tenant with a million completed keys and three held ones pays for three.
macro_rules! list_sql {
    ($state:expr) => {
        concat!(
            "SELECT ",
            key_columns!(),
            " FROM idempotency_keys AS k \
             WHERE k.tenant_id = $1 AND ($2::text IS NULL OR k.endpoint = $2) \
               AND (k.endpoint, k.key) > ($3, $4) AND ",
            $state,
            " ORDER BY k.endpoint, k.key LIMIT $5"
        )
    };
}

/// [`list_sql!`] of every live row.
pub const LIST_SQL: &str = list_sql!(rules::live!());

/// [`list_sql!`] of the completed live rows.
pub const LIST_COMPLETED_SQL: &str = list_sql!("k.status = 'completed' AND k.expires_at > now()");

/// [`list_sql!`] of the in-progress rows still inside their lease.
pub const LIST_IN_PROGRESS_SQL: &str = list_sql!(concat!(
    "k.status = 'in_progress' AND NOT (",
    rules::held!(),
    ")"
));

/// [`list_sql!`] of the held rows (the tenant's `unknown`).
pub const LIST_TENANT_HELD_SQL: &str = list_sql!(concat!(
    "k.status = 'in_progress' AND (",
    rules::held!(),
    ")"
));

pub const COUNT_HELD_SQL: &str = concat!(
    "SELECT count(*) FROM idempotency_keys AS k WHERE ",
    rules::held!()
);

/// An operator's release: the in-progress row of the scope $1..$3 owned by the attempt
/// in $4, only while held (its lease over) unless $5 forces it. A forced release leaves
/// its mark, with the reason $6, in the same statement: that attempt may still complete,
/// and its completion then knows the row was released on purpose. The settlement
/// (`not_executed`) is told if $7 (the tenant has a callback) or the row is marked.
pub const OPERATOR_RELEASE_SQL: &str = concat!(
    "WITH released AS (DELETE FROM idempotency_keys AS k WHERE ",
    rules::owned_by_attempt!(),
    " AND k.status = 'in_progress' AND ((",
    rules::held!(),
    ") OR $5) RETURNING k.tenant_id, k.endpoint, k.key, k.attempt, k.trace_context, \
       (k.callback OR $7::bool) AS tell, (",
    rules::held!(),
    ") AS held), \
     marked AS (INSERT INTO forced_releases (tenant_id, attempt, endpoint, key, reason) \
       SELECT tenant_id, attempt, endpoint, key, $6 FROM released WHERE NOT held \
       ON CONFLICT (tenant_id, attempt) DO NOTHING), \
     told AS (",
    super::callbacks::tell_sql!("released", "'not_executed'", "NULL::int4", "released.tell"),
    ") SELECT held FROM released"
);

/// Forgets the marks of forced releases a day old: any attempt they could concern has
/// long ended (its timeout is shorter than its lease).
pub const PURGE_FORCED_SQL: &str =
    "DELETE FROM forced_releases WHERE released_at < now() - interval '1 day'";

/// Every endpoint the ledger holds keys under, by a loose scan of the primary key (one
/// index probe per tenant and endpoint, however many keys each has).
pub const ENDPOINTS_SQL: &str = "WITH RECURSIVE pairs AS (\
       (SELECT k.tenant_id, k.endpoint FROM idempotency_keys AS k \
        ORDER BY k.tenant_id, k.endpoint LIMIT 1) \
       UNION ALL \
       SELECT next.tenant_id, next.endpoint FROM pairs CROSS JOIN LATERAL (\
         SELECT k.tenant_id, k.endpoint FROM idempotency_keys AS k \
         WHERE (k.tenant_id, k.endpoint) > (pairs.tenant_id, pairs.endpoint) \
         ORDER BY k.tenant_id, k.endpoint LIMIT 1) AS next) \
     SELECT DISTINCT endpoint FROM pairs ORDER BY endpoint";

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

/// What an operator's release did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OperatorRelease {
    /// Released; `forced` when it was still inside its lease.
    Released { forced: bool },
    /// Nothing changed: no record of the key.
    Absent,
    /// Nothing changed: the key is completed (completed keys are never released).
    Completed,
    /// Nothing changed: another attempt owns the key now.
    OtherAttempt { current: Uuid },
    /// Nothing changed: the attempt may still be running, within its lease.
    InsideLease { until: Option<DateTime<Utc>> },
}

impl PgLedger {
    /// How many keys are held: in progress with their lease over, waiting on the
    /// reconciler or a person.
    pub async fn count_held(&self) -> Result<i64, LedgerError> {
        self.bounded("count_held", async |c| {
            sqlx::query_scalar(COUNT_HELD_SQL).fetch_one(c).await
        })
        .await
    }

    /// One key as an operator sees it.
    pub async fn show(&self, scope: &Scope) -> Result<Option<KeyInfo>, LedgerError> {
        self.one_key("show", SHOW_SQL, scope).await
    }

    /// The row of `scope` that `sql` (by $1..$3) finds.
    async fn one_key(
        &self,
        operation: &'static str,
        sql: &'static str,
        scope: &Scope,
    ) -> Result<Option<KeyInfo>, LedgerError> {
        let row = self
            .bounded(operation, async |c| {
                Self::on(sql, scope).fetch_optional(c).await
            })
            .await?;
        row.as_ref()
            .map(key_info)
            .transpose()
            .map_err(LedgerError::new)
    }

    /// The live record of `scope`, as its tenant may see it.
    pub async fn lookup(&self, scope: &Scope) -> Result<Option<KeyInfo>, LedgerError> {
        self.one_key("lookup", LOOKUP_SQL, scope).await
    }

    /// A page of `tenant`'s live keys in key order, after `after` (endpoint, key), of
    /// `endpoint` and in `state` when given (`completed`, `in_progress`, or `unknown`:
    /// held), each state by a statement of its own.
    pub async fn list_keys(
        &self,
        tenant: &str,
        endpoint: Option<&str>,
        state: Option<&str>,
        after: (&str, &str),
        limit: i64,
    ) -> Result<Vec<KeyInfo>, LedgerError> {
        let sql = match state {
            None => LIST_SQL,
            Some("completed") => LIST_COMPLETED_SQL,
            Some("in_progress") => LIST_IN_PROGRESS_SQL,
            Some("unknown") => LIST_TENANT_HELD_SQL,
            Some(_) => {
                return Err(LedgerError::new(crate::Corrupt(
                    "a key listing asked for a state the ledger does not know",
                )));
            }
        };
        let rows = self
            .bounded("list_keys", async |c| {
                sqlx::query(sql)
                    .bind(tenant)
                    .bind(endpoint)
                    .bind(after.0)
                    .bind(after.1)
                    .bind(limit)
                    .fetch_all(c)
                    .await
            })
            .await?;
        rows.iter()
            .map(key_info)
            .collect::<Result<_, _>>()
            .map_err(LedgerError::new)
    }

    /// Held keys, oldest first, at most `limit`.
    pub async fn list_held(&self, limit: i64) -> Result<Vec<KeyInfo>, LedgerError> {
        let rows = self
            .bounded("list_held", async |c| {
                sqlx::query(LIST_HELD_SQL).bind(limit).fetch_all(c).await
            })
            .await?;
        rows.iter()
            .map(key_info)
            .collect::<Result<_, _>>()
            .map_err(LedgerError::new)
    }

    /// Releases `attempt`'s in-progress key by an operator's hand: only that attempt,
    /// and only once its lease is over unless `force` (then `reason` is kept with the
    /// release's mark, for the attempt's completion to log); `tell`: the tenant has a
    /// callback for settlements. When nothing changed, says why.
    pub async fn release_by_operator(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        force: bool,
        reason: &str,
        tell: bool,
    ) -> Result<OperatorRelease, LedgerError> {
        let released = self
            .bounded("operator_release", async |c| {
                Self::on(OPERATOR_RELEASE_SQL, scope)
                    .bind(attempt.0)
                    .bind(force)
                    .bind(reason)
                    .bind(tell)
                    .fetch_optional(c)
                    .await
            })
            .await?;
        if let Some(row) = released {
            let held: bool = row.try_get("held").map_err(LedgerError::new)?;
            return Ok(OperatorRelease::Released { forced: !held });
        }
        // Nothing changed: read the key again to say why (for the operator only; the
        // decision was the statement's).
        Ok(match self.show(scope).await? {
            None => OperatorRelease::Absent,
            Some(info) if info.status == "completed" => OperatorRelease::Completed,
            Some(info) if info.attempt != attempt.0 => OperatorRelease::OtherAttempt {
                current: info.attempt,
            },
            Some(info) => OperatorRelease::InsideLease {
                until: info.locked_until,
            },
        })
    }

    /// Every endpoint the ledger holds keys under.
    pub async fn stored_endpoints(&self) -> Result<Vec<String>, LedgerError> {
        self.bounded("endpoints", async |c| {
            sqlx::query_scalar(ENDPOINTS_SQL).fetch_all(c).await
        })
        .await
    }
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
