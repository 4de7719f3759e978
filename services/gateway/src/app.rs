//! Building and running the gateway: [`Application::build`] connects, migrates and binds
//! (port 0 works, for tests); [`Application::run_until_stopped`] serves until the
//! shutdown future resolves, then drains in-flight work within the grace period.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::handler::Handler;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use http::StatusCode;
use idem_auth::Authenticator;
use idem_core::local::{Bounds, Local};
use idem_core::{Engine, MaybeCache};
use idem_postgres::{PgLedger, PoolSettings};
use idem_redis::{RedisCache, RedisSettings};
use secrecy::ExposeSecret;
use serde_json::json;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use crate::limits::{self, RequestLimits};
use crate::tenants::{self, TenantTable};
use crate::{handler, lookup, observe, server};
use idem_config::Config;
use idem_config::RouteTable;
use idem_upstream::{self as upstream, HttpClient};

/// Everything a request needs, shared by all of them.
pub struct AppState {
    pub auth: Authenticator,
    pub routes: RouteTable,
    pub engine: Engine<PgLedger, MaybeCache<Local<RedisCache>>>,
    pub client: HttpClient,
    /// Each tenant's policy, body limit and quotas (see [`crate::tenants`]).
    pub tenants: TenantTable,
    pub body_read_timeout: Duration,
    /// Head size and requests in flight (see [`crate::limits`]).
    pub limits: RequestLimits,
    /// Fingerprints of large bodies, off the async workers and bounded.
    pub fingerprints: idem_http::Fingerprinter,
    /// Forward-and-store tasks, awaited on shutdown.
    pub tasks: TaskTracker,
    /// Completions that lost the fence (the reconciler resolved the row first).
    pub fenced: std::sync::atomic::AtomicU64,
    /// Executions whose answer could not be recorded (503 `outcome-unrecorded`).
    pub unrecorded: std::sync::atomic::AtomicU64,
    /// Fetches and refreshes an identity provider's keys, for as long as the state lives.
    pub key_refresh: Option<tokio_util::task::AbortOnDropHandle<()>>,
    /// Whether a writable Postgres answered lately: refreshed in the background.
    pub postgres_ready: Arc<AtomicBool>,
    /// Refreshes `postgres_ready`, for as long as the state lives.
    pub readiness: tokio_util::task::AbortOnDropHandle<()>,
}

/// Whether a writable Postgres answers within 2 s.
async fn postgres_writable(ledger: &PgLedger) -> bool {
    tokio::time::timeout(Duration::from_secs(2), ledger.writable())
        .await
        .is_ok_and(|answer| answer.is_ok_and(|writable| writable))
}

/// How often readiness asks Postgres, however many probes ask the gateway.
const READINESS_EVERY: Duration = Duration::from_secs(1);

/// Keeps `ready` true while a writable Postgres answers (one short query a second, so a
/// flood of `/readyz` never reaches Postgres).
async fn watch_readiness(ledger: PgLedger, ready: Arc<AtomicBool>) {
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

/// A gateway, bound and ready to serve.
pub struct Application {
    listener: TcpListener,
    /// The admin API's listener and token, when `admin.listen` is set.
    admin: Option<(TcpListener, secrecy::SecretString)>,
    state: Arc<AppState>,
    grace: Duration,
    limits: server::Limits,
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
        for warning in auth.warnings() {
            tracing::warn!("{warning}");
        }
        let key_refresh = auth.start().map(tokio_util::task::AbortOnDropHandle::new);
        idem_telemetry::prometheus(); // record from the first request on
        describe_metrics();
        let pool = idem_postgres::connect(
            config.postgres.url.expose_secret(),
            &PoolSettings::from(&config.postgres),
        )
        .await
        .context("connecting to postgres.url")?;
        if options.migrate {
            idem_postgres::migrate(&pool)
                .await
                .context("applying migrations")?;
        }
        let cache = match &config.redis {
            Some(redis) => MaybeCache::Some(Local::new(
                RedisCache::start(&RedisSettings::from(redis))
                    .await
                    .context("redis")?,
                Bounds {
                    entries: redis.local_cache_entries,
                    bytes: redis.local_cache_bytes,
                },
            )),
            None => MaybeCache::None,
        };
        let listener = TcpListener::bind(config.server.listen)
            .await
            .with_context(|| format!("binding server.listen = {}", config.server.listen))?;
        let admin = match (config.admin.listen, config.admin.token()?) {
            (Some(at), Some(token)) => Some((
                TcpListener::bind(at)
                    .await
                    .with_context(|| format!("binding admin.listen = {at}"))?,
                token,
            )),
            _ => None,
        };
        let op_timeout = config.postgres.op_timeout();
        let server = &config.server;
        let ledger =
            PgLedger::with_replay_budget(pool, op_timeout, server.max_replay_bytes_in_flight);
        let stored = ledger
            .stored_endpoints()
            .await
            .context("reading the endpoints stored in the ledger")?;
        config
            .routes
            .check_renames(stored.iter().map(String::as_str))
            .map_err(anyhow::Error::msg)
            .context("routes")?;
        // Known before the first request: a gateway that just started is ready at once.
        let postgres_ready = Arc::new(AtomicBool::new(postgres_writable(&ledger).await));
        let readiness = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(watch_readiness(
            ledger.clone(),
            postgres_ready.clone(),
        )));
        let tenants = TenantTable::new(&config.tenants, &config.routes, server.max_body_bytes);
        let state = AppState {
            auth,
            tenants,
            routes: config.routes,
            engine: Engine::with_cache(ledger, cache),
            client: upstream::pooled_client(),
            body_read_timeout: server.body_read_timeout,
            limits: RequestLimits::new(
                server.max_header_bytes,
                server.max_headers,
                server.max_concurrent_requests,
            ),
            fingerprints: idem_http::Fingerprinter::default(),
            tasks: TaskTracker::new(),
            fenced: Default::default(),
            unrecorded: Default::default(),
            key_refresh,
            postgres_ready,
            readiness,
        };
        let state = Arc::new(state);
        // Forgets idle tenants' buckets and counters, for as long as the state lives.
        let weak = Arc::downgrade(&state);
        tokio::spawn(async move {
            let mut every = tokio::time::interval(tenants::TIDY_EVERY);
            every.tick().await;
            loop {
                every.tick().await;
                let Some(state) = weak.upgrade() else { return };
                state.tenants.tidy();
            }
        });
        Ok(Self {
            listener,
            admin,
            state,
            grace: server.shutdown_grace,
            limits: server::Limits {
                header_read_timeout: server.header_read_timeout,
                max_header_bytes: server.max_header_bytes,
                max_headers: server.max_headers,
                response_write_timeout: server.response_write_timeout,
            },
        })
    }

    /// The shared state (for tests and embedding: ledger and cache counters).
    pub fn state(&self) -> Arc<AppState> {
        self.state.clone()
    }

    /// Where the admin API serves, when it is on.
    pub fn admin_addr(&self) -> Option<SocketAddr> {
        self.admin
            .as_ref()
            .map(|(l, _)| l.local_addr().expect("a bound listener has an address"))
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
        let stopping = tokio_util::sync::CancellationToken::new();
        // The admin API stops accepting when the gateway does; its calls are short.
        let _admin = self.admin.map(|(listener, token)| {
            let router = crate::admin::router(self.state.clone(), token);
            tokio_util::task::AbortOnDropHandle::new(tokio::spawn(server::serve(
                listener,
                router,
                self.limits,
                stopping.clone().cancelled_owned(),
            )))
        });
        let served = server::serve(self.listener, router, self.limits, async move {
            shutdown.await;
            stopping.cancel();
            let _ = stopping_tx.send(());
        });
        let mut server = tokio::spawn(served);
        tokio::select! {
            result = &mut server => return Ok(result?),
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
            Ok(result) => Ok(result?),
            Err(_) => {
                tracing::warn!(grace = ?self.grace, "grace period over; abandoning requests still in flight");
                Ok(())
            }
        }
    }
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(readyz))
        .route("/metrics", get(metrics))
        // The tenant's own lookup of its keys (DESIGN §14), traced and counted as requests.
        .route(
            lookup::KEYS,
            get(lookup::list)
                .fallback(not_here)
                .layer(axum::middleware::from_fn(observe::observe)),
        )
        .route(
            &format!("{}/{{key}}", lookup::KEYS),
            get(lookup::show)
                .fallback(not_here)
                .layer(axum::middleware::from_fn(observe::observe)),
        )
        // Limits first (their refusals are counted, not traced), then the span, the
        // metrics and the log line around the request itself.
        .fallback(handler::handle.layer(axum::middleware::from_fn(observe::observe)))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            limits::enforce,
        ))
        .with_state(state)
}

/// Another method on the lookup's paths: 405, naming the one they answer.
async fn not_here() -> crate::problem::Problem {
    crate::problem::Problem::MethodNotAllowed { allow: "GET" }
}

/// From what the background check last saw: a probe never reaches Postgres itself.
async fn readyz(State(app): State<Arc<AppState>>) -> Response {
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

/// Prometheus text: the recorder's counters and histograms, plus the fast path's and
/// the ledger's own counters, brought up to date at scrape time.
async fn metrics(State(app): State<Arc<AppState>>) -> Response {
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

fn describe_metrics() {
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
