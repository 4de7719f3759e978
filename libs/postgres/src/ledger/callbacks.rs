//! Settlement callbacks: the outbox (`callbacks`, migration 0007) that tells a tenant's
//! `callback_url` how a key settled when its client was not given the final answer.
//!
//! A settlement writes its callback in its own statement ([`tell_sql!`] in the
//! completion, the releases and the reconciler's resolution), so a settlement is never
//! committed without it. The row is the attempt's: `(tenant_id, attempt)` is its key, and
//! a second write of the same settlement (a completion repeated after a lost reply)
//! changes nothing. Senders take due rows ([`TAKE_CALLBACKS_SQL`]) for a lease, one sender per row,
//! and each report of theirs is fenced by the delivery they took.

use std::time::Duration;

use chrono::{DateTime, Utc};
use idem_core::{LedgerError, Scope};
use sqlx::Row;
use uuid::Uuid;

use super::{PgLedger, millis};

/// The callback of each row of `$from` for which `$when` holds: settled as `$state`
/// (`'completed'` or `'not_executed'`) with the answer's status `$status`, under the
/// attempt `$from.attempt`. A settlement already told is not told again.
macro_rules! tell_sql {
    ($from:literal, $state:literal, $status:literal, $when:literal) => {
        concat!(
            "INSERT INTO callbacks (tenant_id, attempt, endpoint, key, state, \
               response_status, trace_context) \
             SELECT ",
            $from,
            ".tenant_id, ",
            $from,
            ".attempt, ",
            $from,
            ".endpoint, ",
            $from,
            ".key, ",
            $state,
            ", ",
            $status,
            ", ",
            $from,
            ".trace_context FROM ",
            $from,
            " WHERE ",
            $when,
            " ON CONFLICT (tenant_id, attempt) DO NOTHING"
        )
    };
}

pub(crate) use tell_sql;

/// Marks the live row of the scope $1..$3 as one whose client was answered 202: its
/// settlement will be told. A row already completed is told now, in this statement (its
/// completion, committed first, saw no mark).
pub const MARK_SQL: &str = concat!(
    "WITH marked AS (\
       UPDATE idempotency_keys AS k SET callback = true \
       WHERE k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND ",
    super::rules::live!(),
    " RETURNING k.tenant_id, k.endpoint, k.key, k.attempt, k.status, k.response_status, \
         k.trace_context), \
     told AS (",
    tell_sql!(
        "marked",
        "'completed'",
        "marked.response_status",
        "marked.status = 'completed'"
    ),
    ") SELECT count(*) FROM marked"
);

/// Takes up to $1 callbacks due, oldest first, for $2 ms (their `next_at` pushed past the
/// lease; other senders skip them meanwhile), counting the delivery: every tenant's if $3,
/// else those of the tenants $4 (the tenants whose callback the sender knows: a replica
/// still on an older config leaves a new tenant's callbacks to the others).
pub const TAKE_CALLBACKS_SQL: &str = "WITH due AS (\
       SELECT c.tenant_id, c.attempt FROM callbacks AS c \
       WHERE c.finished_at IS NULL AND c.next_at <= now() \
         AND ($3::bool OR c.tenant_id = ANY($4::text[])) \
       ORDER BY c.next_at LIMIT $1 FOR UPDATE SKIP LOCKED) \
     UPDATE callbacks AS c SET next_at = now() + $2::float8 * interval '1 millisecond', \
       deliveries = c.deliveries + 1 \
     FROM due WHERE c.tenant_id = due.tenant_id AND c.attempt = due.attempt \
     RETURNING c.tenant_id, c.attempt, c.endpoint, c.key, c.state, c.response_status, \
       c.trace_context, c.settled_at, c.deliveries";

/// The callback ($1, $2) delivered, by the delivery $3 that took it.
pub const CALLBACK_DELIVERED_SQL: &str = "UPDATE callbacks AS c SET finished_at = now(), last_error = NULL \
     WHERE c.tenant_id = $1 AND c.attempt = $2 AND c.deliveries = $3 AND c.finished_at IS NULL";

/// The callback ($1, $2) not delivered by the delivery $3 (why: $4): tried again in $5 ms,
/// or given up (finished) once it settled more than $6 ms ago. Returns whether it was
/// given up.
pub const CALLBACK_FAILED_SQL: &str = "UPDATE callbacks AS c SET last_error = $4, \
       next_at = now() + $5::float8 * interval '1 millisecond', \
       finished_at = CASE WHEN c.settled_at < now() - $6::float8 * interval '1 millisecond' \
                     THEN now() END \
     WHERE c.tenant_id = $1 AND c.attempt = $2 AND c.deliveries = $3 AND c.finished_at IS NULL \
     RETURNING c.finished_at IS NOT NULL AS given_up";

/// Forgets up to $1 callbacks finished a day ago (delivered or given up): a repeated
/// completion comes within seconds of the first; and those settled four days ago that no
/// sender took (their tenant's callback removed from every replica's config), past the 72
/// hours any would have been tried. Run with the purge of expired keys.
pub const PURGE_CALLBACKS_SQL: &str = "DELETE FROM callbacks AS gone USING (\
       SELECT c.tenant_id, c.attempt FROM callbacks AS c \
       WHERE c.finished_at < now() - interval '1 day' \
          OR c.settled_at < now() - interval '4 days' \
       ORDER BY c.settled_at LIMIT $1 \
       FOR UPDATE SKIP LOCKED) old \
     WHERE gone.tenant_id = old.tenant_id AND gone.attempt = old.attempt";

/// How a key settled, as its callback tells it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Settled {
    /// Its answer is recorded (by its execution, or by the reconciler's probe).
    Completed,
    /// Released: nothing was executed, a new key is safe.
    NotExecuted,
}

impl Settled {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Completed => "completed",
            Self::NotExecuted => "not_executed",
        }
    }
}

/// Whose callbacks a sender takes (the tenants it can send for).
#[derive(Debug, Clone, Copy)]
pub enum Whose<'a> {
    Every,
    Only(&'a [String]),
}

/// A callback a sender took, to deliver once.
#[derive(Debug, Clone)]
pub struct DueCallback {
    pub scope: Scope,
    /// The attempt that settled: with the tenant, the callback's identity.
    pub attempt: Uuid,
    pub state: Settled,
    pub response_status: Option<u16>,
    /// The W3C `traceparent` of the first execution, if it was traced.
    pub trace_context: Option<String>,
    pub settled_at: DateTime<Utc>,
    /// Which delivery this is (1 for the first): it fences the sender's report.
    pub delivery: i32,
}

impl PgLedger {
    /// Marks the key's live row so that its settlement is told (its client was answered
    /// 202); told at once if it has completed already. False when there is no live row.
    pub async fn mark_callback(&self, scope: &Scope) -> Result<bool, LedgerError> {
        let marked: i64 = self
            .bounded("mark_callback", async |c| {
                sqlx::query_scalar(MARK_SQL)
                    .bind(&scope.tenant)
                    .bind(&scope.endpoint)
                    .bind(scope.key.as_str())
                    .fetch_one(c)
                    .await
            })
            .await?;
        Ok(marked > 0)
    }

    /// Takes up to `limit` callbacks due, for `lease`, of every tenant or of `tenants`:
    /// no other sender takes them meanwhile.
    pub async fn take_callbacks(
        &self,
        limit: i64,
        lease: Duration,
        tenants: Whose<'_>,
    ) -> Result<Vec<DueCallback>, LedgerError> {
        let (every, named) = match tenants {
            Whose::Every => (true, &[][..]),
            Whose::Only(named) => (false, named),
        };
        let rows = self
            .bounded("take_callbacks", async |c| {
                sqlx::query(TAKE_CALLBACKS_SQL)
                    .bind(limit)
                    .bind(millis(lease))
                    .bind(every)
                    .bind(named)
                    .fetch_all(c)
                    .await
            })
            .await?;
        rows.iter()
            .map(|r| {
                let state: String = r.try_get("state")?;
                let state = match state.as_str() {
                    "completed" => Settled::Completed,
                    _ => Settled::NotExecuted,
                };
                let status: Option<i32> = r.try_get("response_status")?;
                Ok(DueCallback {
                    scope: super::row::scope_of(r)?,
                    attempt: r.try_get("attempt")?,
                    state,
                    response_status: status.and_then(|s| u16::try_from(s).ok()),
                    trace_context: r.try_get("trace_context")?,
                    settled_at: r.try_get("settled_at")?,
                    delivery: r.try_get("deliveries")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(LedgerError::new)
    }

    /// Records `due` as delivered. False if another sender took it since (its lease ran
    /// out): that sender reports it.
    pub async fn callback_delivered(&self, due: &DueCallback) -> Result<bool, LedgerError> {
        let result = self
            .bounded("callback_delivered", async |c| {
                sqlx::query(CALLBACK_DELIVERED_SQL)
                    .bind(&due.scope.tenant)
                    .bind(due.attempt)
                    .bind(due.delivery)
                    .execute(c)
                    .await
            })
            .await?;
        Ok(result.rows_affected() == 1)
    }

    /// Records that `due` was not delivered (`why`): tried again `after` from now, or
    /// given up if it settled more than `retry_for` ago. `Some(true)` when given up;
    /// `None` if another sender took it since.
    pub async fn callback_failed(
        &self,
        due: &DueCallback,
        why: &str,
        after: Duration,
        retry_for: Duration,
    ) -> Result<Option<bool>, LedgerError> {
        self.bounded("callback_failed", async |c| {
            sqlx::query_scalar(CALLBACK_FAILED_SQL)
                .bind(&due.scope.tenant)
                .bind(due.attempt)
                .bind(due.delivery)
                .bind(why)
                .bind(millis(after))
                .bind(millis(retry_for))
                .fetch_optional(c)
                .await
        })
        .await
    }
}
