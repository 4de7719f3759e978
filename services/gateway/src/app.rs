//! Building and running the gateway: [`Application::build`] connects, migrates and binds
//! (port 0 works, for tests); [`Application::run_until_stopped`] serves until the
//! shutdown future resolves, then drains in-flight work within the grace period.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::StatusCode;
use idem_auth::Authenticator;
use idem_core::Engine;
use idem_postgres::{PgLedger, PoolSettings};
use secrecy::ExposeSecret;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use crate::config::Config;
use crate::handler;
use crate::routes::RouteTable;
use crate::upstream::{self, HttpClient};

/// Everything a request needs, shared by all of them.
pub struct AppState {
    pub auth: Authenticator,
    pub routes: RouteTable,
    pub engine: Engine<PgLedger>,
    pub client: HttpClient,
    pub max_body_bytes: usize,
    pub redis_configured: bool,
    /// Forward-and-store tasks, awaited on shutdown.
    pub tasks: TaskTracker,
}

/// A gateway, bound and ready to serve.
pub struct Application {
    listener: TcpListener,
    state: Arc<AppState>,
    grace: Duration,
}

/// Build options beyond the config file.
#[derive(Debug, Clone, Copy)]
pub struct BuildOptions {
    /// Apply pending migrations before serving.
    pub migrate: bool,
}

impl Default for BuildOptions {
    fn default() -> Self {
        Self { migrate: true }
    }
}

impl Application {
    pub async fn build(config: Config, options: BuildOptions) -> anyhow::Result<Self> {
        let auth = Authenticator::from_config(&config.auth)?;
        let pool =
            idem_postgres::connect(config.postgres.url.expose_secret(), &pool_settings(&config))
                .await
                .context("connecting to postgres.url")?;
        if options.migrate {
            idem_postgres::migrate(&pool)
                .await
                .context("applying migrations")?;
        }
        if config.redis.is_some() {
            tracing::warn!("[redis] is configured but this version serves from Postgres alone");
        }
        let listener = TcpListener::bind(config.server.listen)
            .await
            .with_context(|| format!("binding server.listen = {}", config.server.listen))?;
        let op_timeout = config.postgres.statement_timeout + config.postgres.acquire_timeout;
        let state = AppState {
            auth,
            routes: config.routes,
            engine: Engine::new(PgLedger::new(pool, op_timeout)),
            client: upstream::client(),
            max_body_bytes: config.server.max_body_bytes,
            redis_configured: config.redis.is_some(),
            tasks: TaskTracker::new(),
        };
        Ok(Self {
            listener,
            state: Arc::new(state),
            grace: config.server.shutdown_grace,
        })
    }

    pub fn local_addr(&self) -> SocketAddr {
        self.listener
            .local_addr()
            .expect("a bound listener has an address")
    }

    /// Serves until `shutdown` resolves; then stops accepting, lets in-flight requests
    /// and their forward-and-store tasks finish for up to the grace period, and returns.
    pub async fn run_until_stopped(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        let router = router(self.state.clone());
        let (stopping_tx, stopping_rx) = tokio::sync::oneshot::channel::<()>();
        let server = axum::serve(self.listener, router).with_graceful_shutdown(async move {
            shutdown.await;
            let _ = stopping_tx.send(());
        });
        let mut server = tokio::spawn(async move { server.await });
        tokio::select! {
            result = &mut server => return Ok(result??),
            _ = stopping_rx => {}
        }
        tracing::info!(grace = ?self.grace, "shutting down: draining in-flight requests");
        let tasks = self.state.tasks.clone();
        tasks.close();
        let drained = tokio::time::timeout(self.grace, async {
            let served = server.await;
            tasks.wait().await;
            served
        })
        .await;
        match drained {
            Ok(result) => Ok(result??),
            Err(_) => {
                tracing::warn!(grace = ?self.grace, "grace period over; abandoning requests still in flight");
                Ok(())
            }
        }
    }
}

fn pool_settings(config: &Config) -> PoolSettings {
    PoolSettings {
        max_connections: config.postgres.max_connections,
        acquire_timeout: config.postgres.acquire_timeout,
        statement_timeout: config.postgres.statement_timeout,
        application_name: "idemgate".into(),
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .fallback(handler::handle)
        .with_state(state)
}

async fn readyz(State(app): State<Arc<AppState>>) -> Response {
    let pool = app.engine.ledger().pool();
    let postgres = tokio::time::timeout(
        Duration::from_secs(2),
        sqlx::query("SELECT 1").execute(pool),
    )
    .await
    .is_ok_and(|r| r.is_ok());
    let redis = if app.redis_configured {
        "unused"
    } else {
        "not configured"
    };
    let body = json!({
        "status": if postgres { "ready" } else { "not ready" },
        "postgres": if postgres { "up" } else { "down" },
        "redis": redis,
    });
    let status = if postgres {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, axum::Json(body)).into_response()
}
