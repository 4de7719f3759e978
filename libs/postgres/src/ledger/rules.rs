//! The row's life: its states, who moves it between them, and the rules every statement
//! on it is written with, spelled out once as SQL fragments (`live!`, `lease_over!`,
//! `held!`, `owned_by_attempt!`) that the statement families of the sibling modules
//! put together.
//!
//! | from | to | statement | run by |
//! | --- | --- | --- | --- |
//! | absent, or completed past `expires_at` | in progress | [`CLAIM_SQL`] | gateway |
//! | absent, or completed past `expires_at` | in progress | [`CLAIM_ONE_SQL`], [`TAKE_OVER_ONE_SQL`] | embedded mode |
//! | in progress | completed | [`COMPLETE_ONE_SQL`] (its own transaction's row) | embedded mode |
//! | in progress | completed | [`COMPLETE_SQL`] (fenced by its attempt) | gateway |
//! | in progress | in progress, lease ended (uncertain 5xx) | [`HOLD_SQL`] (fenced) | gateway |
//! | in progress | absent | [`RELEASE_SQL`] (fenced by the attempt) | gateway, reconciler |
//! | in progress | absent | [`OPERATOR_RELEASE_SQL`] (the attempt shown, held unless forced) | `keys release` |
//! | in progress, lease ended | in progress, taken for a while | [`TAKE_SQL`] | reconciler |
//! | in progress | completed, fresh attempt | [`RESOLVE_SQL`] (fenced) | reconciler |
//! | in progress | in progress, looked at again later | [`DEFER_SQL`] (fenced) | reconciler |
//! | completed past `expires_at` | absent | [`PURGE_SQL`] | reconciler |
//! | live (its client answered 202) | the same, marked `callback` | [`MARK_SQL`] | gateway |
//!
//! Every settlement (completion, release, resolution) of a row marked `callback`, and the
//! reconciler's and operators' of any row of a tenant with a callback, writes the
//! settlement to the callbacks outbox in the same statement ([`super::callbacks`]).
//!
//! - An in-progress row never expires, whatever its TTL: it leaves that state only by a
//!   completion, a resolution or a release, never by time (held keys never lapse).
//! - Every write that ends an attempt names it: the row's key **and** its attempt token
//!   (`owned_by_attempt!`), never a physical row address, so a write that waited on
//!   another statement's update of the row still finds it, and a late writer changes
//!   nothing. The reconciler installs a fresh token when it resolves a row, which fences
//!   out the original gateway.
//! - A lease is judged by Postgres's clock alone (`now()`), which wrote every timestamp.
//!
//! [`CLAIM_SQL`]: super::claim::CLAIM_SQL
//! [`CLAIM_ONE_SQL`]: super::claim::CLAIM_ONE_SQL
//! [`TAKE_OVER_ONE_SQL`]: super::claim::TAKE_OVER_ONE_SQL
//! [`COMPLETE_ONE_SQL`]: super::complete::COMPLETE_ONE_SQL
//! [`COMPLETE_SQL`]: super::complete::COMPLETE_SQL
//! [`HOLD_SQL`]: super::release::HOLD_SQL
//! [`RELEASE_SQL`]: super::release::RELEASE_SQL
//! [`OPERATOR_RELEASE_SQL`]: super::operator::OPERATOR_RELEASE_SQL
//! [`TAKE_SQL`]: super::reconcile::TAKE_SQL
//! [`RESOLVE_SQL`]: super::reconcile::RESOLVE_SQL
//! [`DEFER_SQL`]: super::reconcile::DEFER_SQL
//! [`PURGE_SQL`]: super::purge::PURGE_SQL
//! [`MARK_SQL`]: super::callbacks::MARK_SQL

use std::time::{Duration, SystemTime};

use idem_core::Fence;

/// A live row: in progress (never expired, whatever its TTL), or completed and not yet
/// expired — judged when the row is read (`clock_timestamp()`), not when the transaction
/// began (`now()`): a claim that waited on a row lock must not replay a record that
/// expired during the wait.
macro_rules! live {
    () => {
        "(k.status = 'in_progress' OR k.expires_at > clock_timestamp())"
    };
}
/// The first attempt's lease is over: the reconciler may act.
macro_rules! lease_over {
    () => {
        "k.locked_until <= now()"
    };
}
/// A held row: in progress with its lease over, or taken by the reconciler before.
macro_rules! held {
    () => {
        concat!(
            "k.status = 'in_progress' AND (k.held_since IS NOT NULL OR ",
            $crate::ledger::rules::lease_over!(),
            ")"
        )
    };
}
/// The row of the statement's scope ($1, $2, $3), fenced by the attempt in $4.
macro_rules! owned_by_attempt {
    () => {
        "k.tenant_id = $1 AND k.endpoint = $2 AND k.key = $3 AND k.attempt = $4"
    };
}
/// A row taken over by a new attempt keeps nothing of the last one's: its answer, its
/// hold, the reconciler's probes, its completion.
macro_rules! nothing_of_the_last_attempt {
    () => {
        "response_status = NULL, response_headers = NULL, response_body = NULL, \
         response_omitted = false, held_since = NULL, first_not_found_at = NULL, \
         probe_attempts = 0, completed_at = NULL, callback = false"
    };
}
/// What the engine reads of a live row: a body only up to [`super::bodies::INLINE`]
/// bytes (larger ones are read on their own, once per scope: [`super::bodies`]). The
/// row's remaining life is measured when it is read (`clock_timestamp()`), not when the
/// transaction began (`now()`): a statement that waited on a row lock would otherwise
/// give it as long as the wait too many.
macro_rules! record_columns {
    () => {
        concat!(
            "k.request_hash, k.status, k.attempt, (coalesce(",
            $crate::ledger::rules::lease_over!(),
            ", false) OR k.held_since IS NOT NULL) AS lease_expired, \
             k.response_status, k.response_headers, \
             CASE WHEN octet_length(k.response_body) <= 65536 THEN k.response_body END \
               AS response_body, \
             octet_length(k.response_body) AS response_bytes, k.response_omitted, \
             k.trace_context, \
             (extract(epoch from (k.expires_at - clock_timestamp())) * 1000)::float8 \
               AS expires_in_ms, \
             ",
            $crate::ledger::rules::epoch_micros!("k.expires_at"),
            " AS expires_at_us"
        )
    };
}

/// A timestamp as whole microseconds since the Unix epoch (exact: `extract` gives a
/// numeric), to be read with [`system_time`].
macro_rules! epoch_micros {
    ($column:literal) => {
        concat!("(extract(epoch from ", $column, ") * 1000000)::int8")
    };
}

pub(crate) use {
    epoch_micros, held, lease_over, live, nothing_of_the_last_attempt, owned_by_attempt,
    record_columns,
};

/// A timestamp read by `epoch_micros!`.
pub(crate) fn system_time(micros: i64) -> SystemTime {
    let since = Duration::from_micros(micros.unsigned_abs());
    if micros >= 0 {
        SystemTime::UNIX_EPOCH + since
    } else {
        SystemTime::UNIX_EPOCH - since
    }
}

/// A fenced write held its row if it changed exactly one.
pub(crate) fn fence(rows: u64) -> Fence {
    if rows == 1 { Fence::Held } else { Fence::Lost }
}
