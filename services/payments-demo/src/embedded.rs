//! Embedded mode (docs/embedded-mode.md): the demo as its own idempotency layer. Each payment's key
//! claim, its row, its outbox row and its stored answer commit in one transaction.

use std::path::Path;
use std::sync::Arc;

use anyhow::Context;
use axum::Extension;
use axum::Router;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;
use axum::routing::{get, post};
use idem_auth::Authenticator;
use idem_core::{AttemptId, Scope};
use idem_embedded::{Idempotency, Options, TenantFrom, Tx};
use sqlx::PgPool;
use uuid::Uuid;

use crate::{
    Input, Kind, PAYMENT, REFUND, delay, failure_injected, injected_failure, outbox, problem,
};

/// The routes of embedded mode, with the gateway config file of `PAYMENTS_DEMO_CONFIG`
/// (its `[auth]` and `[idempotency]`), the project's migrations applied.
pub(crate) async fn app(pool: PgPool) -> anyhow::Result<Router> {
    let path = std::env::var_os("PAYMENTS_DEMO_CONFIG").context(
        "PAYMENTS_DEMO_MODE=embedded needs PAYMENTS_DEMO_CONFIG=FILE: a gateway config file, whose [auth] and [idempotency] it uses",
    )?;
    let path = Path::new(&path);
    let config = idem_config::Config::load(path)
        .map_err(|errors| anyhow::anyhow!("PAYMENTS_DEMO_CONFIG={}: {errors}", path.display()))?;
    idem_embedded::migrate(&pool)
        .await
        .context("applying the idempotency migrations")?;
    let auth = Authenticator::from_config(&config.auth).context("the config's [auth]")?;
    // Keys fetched from a provider are refreshed for as long as the process runs.
    let _refresh = auth.start();
    let options = Options::from_config(&config.idempotency).tenant(TenantFrom::Jwt(Arc::new(auth)));
    let idem = Idempotency::new(pool.clone(), options);
    if outbox::enabled() {
        outbox::start(pool.clone());
    }
    Ok(Router::new()
        .route(
            "/payments",
            post(|s, a, h, tx, b| create(PAYMENT, s, a, h, tx, b))
                .route_layer(idem.layer("POST /payments")),
        )
        .route(
            "/refunds",
            post(|s, a, h, tx, b| create(REFUND, s, a, h, tx, b))
                .route_layer(idem.layer("POST /refunds")),
        )
        .route("/healthz", get(|| async { "ok" })))
}

/// One payment or refund, written through the request's transaction.
async fn create(
    kind: Kind,
    Extension(scope): Extension<Scope>,
    Extension(attempt): Extension<AttemptId>,
    headers: HeaderMap,
    mut tx: Tx,
    body: axum::body::Bytes,
) -> Response {
    let input = match Input::parse(kind, &body) {
        Ok(input) => input,
        Err((status, why)) => return problem(status, &why),
    };
    let id = Uuid::new_v4();
    let attempt = attempt.to_string();
    let key = Some(scope.key.as_str());
    if let Err(e) = input
        .insert(&mut *tx, id, &scope.tenant, key, Some(&attempt))
        .await
    {
        tracing::error!(error = %e, "insert failed");
        return problem(StatusCode::SERVICE_UNAVAILABLE, "database unavailable");
    }
    let queued = match outbox::enabled() {
        true => outbox::enqueue(&mut tx, kind.topic, &scope.tenant, &input.body(id)).await,
        false => Ok(()),
    };
    if let Err(e) = queued {
        tracing::error!(error = %e, "outbox insert failed");
        return problem(StatusCode::SERVICE_UNAVAILABLE, "database unavailable");
    }
    // After the insert, so that the rollback is what undoes it.
    if failure_injected(&headers) {
        return injected_failure();
    }
    if let Some(delay) = delay(&headers) {
        tokio::time::sleep(delay).await;
    }
    input.created(id)
}
