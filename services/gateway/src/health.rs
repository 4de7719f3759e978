//! Health: `/readyz` from what a background check last saw (once before serving, then
//! every second), so a flood of probes never reaches Postgres; `/healthz` is a constant.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use axum::extract::State;
use axum::response::{IntoResponse, Response};
use http::StatusCode;
use idem_core::MaybeCache;
use idem_postgres::PgLedger;
use serde_json::json;

use crate::state::AppState;

/// Whether a writable Postgres answers within 2 s.
pub(crate) async fn postgres_writable(ledger: &PgLedger) -> bool {
    tokio::time::timeout(Duration::from_secs(2), ledger.writable())
        .await
        .is_ok_and(|answer| answer.is_ok_and(|writable| writable))
}

/// How often readiness asks Postgres, however many probes ask the gateway.
const READINESS_EVERY: Duration = Duration::from_secs(1);

/// Keeps `ready` true while a writable Postgres answers (one short query a second, so a
/// flood of `/readyz` never reaches Postgres).
pub(crate) async fn watch_readiness(ledger: PgLedger, ready: Arc<AtomicBool>) {
    let start = tokio::time::Instant::now() + READINESS_EVERY;
    let mut every = tokio::time::interval_at(start, READINESS_EVERY);
    every.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        every.tick().await;
        let writable = postgres_writable(&ledger).await;
        if ready.swap(writable, Ordering::Relaxed) != writable {
            tracing::info!(ready = writable, "postgres readiness changed");
        }
    }
}

/// From what the background check last saw: a probe never reaches Postgres itself.
pub(crate) async fn readyz(State(app): State<Arc<AppState>>) -> Response {
    let postgres = app.postgres_ready.load(Ordering::Relaxed);
    let redis = match app.engine.cache() {
        MaybeCache::Some(cache) if cache.inner().stats().up => "up",
        MaybeCache::Some(_) => "down (serving from Postgres alone)",
        MaybeCache::None => "not configured",
    };
    // A provider's keys: until the first fetch succeeds no token can be verified.
    let keys = app.auth.ready();
    let mut body = json!({
        "status": if postgres && keys { "ready" } else { "not ready" },
        "postgres": if postgres { "up" } else { "down" },
        "redis": redis,
    });
    if app.auth.remote_stats().is_some() {
        body["auth_keys"] = json!(if keys { "loaded" } else { "not loaded yet" });
    }
    let status = if postgres && keys {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}
