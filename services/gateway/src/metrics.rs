//! `/metrics`: the catalogue of what the gateway exports (names and help texts, the
//! "Observability" in docs/operations.md lists the same), and the scrape, which brings the ledger's,
//! the fast path's and the identity provider's own counters up to date first.

use std::sync::Arc;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use idem_core::MaybeCache;

use crate::state::AppState;

/// Prometheus text: the recorder's counters and histograms, plus the fast path's and
/// the ledger's own counters, brought up to date at scrape time.
pub(crate) async fn scrape(State(app): State<Arc<AppState>>) -> Response {
    use idem_telemetry::metrics::{counter, gauge};
    counter!("idemgate_ledger_statements_total").absolute(app.engine.ledger().calls());
    counter!("idemgate_fenced_completions_total")
        .absolute(app.fenced.load(std::sync::atomic::Ordering::Relaxed));
    counter!("idemgate_outcome_unrecorded_total")
        .absolute(app.unrecorded.load(std::sync::atomic::Ordering::Relaxed));
    gauge!("idemgate_requests_in_flight").set(app.limits.in_use() as f64);
    let bodies = app.engine.ledger().bodies();
    gauge!("idemgate_replay_bytes_in_flight").set(bodies.held_bytes as f64);
    counter!("idemgate_replay_body_reads_total").absolute(bodies.reads);
    if let MaybeCache::Some(cache) = app.engine.cache() {
        gauge!("idemgate_local_cache_entries").set(cache.len() as f64);
        gauge!("idemgate_local_cache_bytes").set(cache.bytes() as f64);
        let s = cache.inner().stats();
        gauge!("idemgate_cache_up").set(f64::from(u8::from(s.up)));
        counter!("idemgate_cache_hits_total").absolute(s.hits);
        counter!("idemgate_cache_misses_total").absolute(s.misses);
        counter!("idemgate_cache_errors_total").absolute(s.errors);
        counter!("idemgate_cache_timeouts_total").absolute(s.timeouts);
        counter!("idemgate_cache_skipped_total").absolute(s.skipped);
        counter!("idemgate_cache_refused_total").absolute(s.refused);
        gauge!("idemgate_cache_watched_channels").set(s.watched as f64);
    }
    if let Some(keys) = app.auth.remote_stats() {
        gauge!("idemgate_jwks_keys").set(keys.keys as f64);
        counter!("idemgate_jwks_fetches_total").absolute(keys.fetches);
        counter!("idemgate_jwks_refresh_errors_total").absolute(keys.refresh_errors);
        gauge!("idemgate_jwks_last_success_timestamp_seconds").set(keys.last_success_unix as f64);
    }
    (
        [(http::header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        idem_telemetry::prometheus().render(),
    )
        .into_response()
}

/// The catalogue: every metric the gateway exports, with its help text.
pub(crate) fn describe() {
    use idem_telemetry::metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(
        "idemgate_requests_total",
        "Requests by outcome and endpoint."
    );
    describe_histogram!(
        "idemgate_request_duration_seconds",
        Unit::Seconds,
        "Request latency, by outcome and endpoint."
    );
    describe_histogram!(
        "idemgate_upstream_duration_seconds",
        Unit::Seconds,
        "Upstream call latency, by endpoint."
    );
    describe_counter!(
        "idemgate_callbacks_total",
        "Deliveries of settlement callbacks, by outcome: delivered, failed (tried again \
         later), expired (given up 72 h after the settlement)."
    );
    describe_gauge!(
        "idemgate_inflight_executions",
        "Upstream executions in flight."
    );
    describe_gauge!(
        "idemgate_requests_in_flight",
        "Slots of server.max_concurrent_requests in use: requests, and the work of \
         clients that hung up, until it ends."
    );
    describe_gauge!(
        "idemgate_replay_bytes_in_flight",
        "Stored bodies held for replays being read or sent (one copy per key), \
         bounded by server.max_replay_bytes_in_flight."
    );
    describe_counter!(
        "idemgate_replay_body_reads_total",
        "Large stored bodies read from Postgres (one read serves every concurrent retry)."
    );
    describe_counter!(
        "idemgate_ledger_statements_total",
        "Calls to the Postgres ledger (claims and completions may share a statement)."
    );
    describe_counter!(
        "idemgate_ledger_errors_total",
        "Ledger statements that failed or timed out."
    );
    describe_counter!(
        "idemgate_webhooks_rejected_total",
        "Webhook deliveries refused 401 by reason (missing, invalid, stale); nothing was claimed."
    );
    describe_counter!(
        "idemgate_records_restored_total",
        "Completions whose row had vanished and were written back (a failover lost acknowledged commits)."
    );
    describe_gauge!(
        "idemgate_jwks_keys",
        "Signing keys in the identity provider's set in use (0 until the first fetch)."
    );
    describe_counter!(
        "idemgate_jwks_fetches_total",
        "Fetches of the identity provider's keys (discovery and JWKS as one)."
    );
    describe_counter!(
        "idemgate_jwks_refresh_errors_total",
        "Fetches of the identity provider's keys that failed (the last good keys stayed)."
    );
    describe_gauge!(
        "idemgate_jwks_last_success_timestamp_seconds",
        "When a fetch of the identity provider's keys last succeeded (Unix time)."
    );
    describe_counter!(
        "idemgate_fenced_completions_total",
        "Late completions rejected by the fence."
    );
    describe_counter!(
        "idemgate_outcome_unrecorded_total",
        "Executions whose answer could not be recorded: 503 outcome-unrecorded, the key held for the reconciler."
    );
    describe_counter!(
        "idemgate_admin_unauthorized_total",
        "Admin API calls refused for a missing or wrong token (each logged with the caller's address)."
    );
    describe_counter!(
        "idemgate_tenant_throttled_total",
        "Requests refused by a tenant's quota (429), by tenant (configured ones; others are `other`) and quota."
    );
    describe_gauge!("idemgate_cache_up", "1 while the Redis breaker is closed.");
    describe_gauge!(
        "idemgate_local_cache_entries",
        "Completed responses held in this process."
    );
    describe_gauge!(
        "idemgate_local_cache_bytes",
        "Bytes held by the in-process replay cache."
    );
    describe_counter!(
        "idemgate_cache_refused_total",
        "Redis writes refused for lack of memory (the breaker stays closed)."
    );
    describe_gauge!(
        "idemgate_cache_watched_channels",
        "Redis pub/sub channels subscribed for retries waiting now."
    );
    describe_counter!("idemgate_cache_hits_total", "Replays served from Redis.");
    describe_counter!(
        "idemgate_cache_misses_total",
        "Fast-path lookups without a cached response."
    );
    describe_counter!(
        "idemgate_cache_errors_total",
        "Redis calls that failed or timed out."
    );
    describe_counter!(
        "idemgate_cache_timeouts_total",
        "Of the failed Redis calls, those not answered within redis.timeout."
    );
    describe_counter!(
        "idemgate_cache_skipped_total",
        "Redis calls skipped while the breaker was open."
    );
    describe_counter!(
        "idemgate_ledger_group_statements_total",
        "Statements that wrote claims or completions (group commit), by operation."
    );
    describe_counter!(
        "idemgate_ledger_group_rows_total",
        "Claims or completions those statements carried, by operation: rows per \
         statement is how much group commit shares."
    );
}
