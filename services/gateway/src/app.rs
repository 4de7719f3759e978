//! Building and running the gateway: [`Application::build`] connects, migrates and binds
//! (port 0 works, for tests); [`Application::run_until_stopped`] serves until the
//! shutdown future resolves, then drains in-flight work within the grace period.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::Context;
use axum::Router;
use axum::handler::Handler;
use axum::routing::get;
use idem_auth::Authenticator;
use idem_config::Config;
use idem_core::local::{Bounds, Local};
use idem_core::{Engine, MaybeCache};
use idem_postgres::{PgLedger, PoolSettings};
use idem_redis::{RedisCache, RedisSettings};
use idem_upstream as upstream;
use secrecy::ExposeSecret;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;

use crate::admin_token::AdminToken;
use crate::limits::{self, RequestLimits};
use crate::state::AppState;
use crate::tenants::{self, TenantTable};
use crate::{handler, health, lookup, metrics, observe, server};

/// A gateway, bound and ready to serve.
pub struct Application {
    listener: TcpListener,
    /// The admin API's listener and token, when `admin.listen` is set.
    admin: Option<(TcpListener, AdminToken)>,
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

/// What `serve` and `check-config` check of a config before anything runs, one way for
/// both: the auth keys it names, every webhook route's secrets (one that cannot be read
/// would refuse every delivery; one file read by two schemes is refused), every tenant's
/// callback secrets, the admin token; and what they warn of.
pub struct Preflight {
    pub auth: Authenticator,
    /// The admin API's token, when `admin.token_file` is set.
    pub admin_token: Option<AdminToken>,
    pub warnings: Vec<String>,
}

impl Preflight {
    pub fn check(config: &Config) -> anyhow::Result<Self> {
        let auth = Authenticator::from_config(&config.auth)?;
        config.routes.check_webhook_secrets()?;
        crate::callbacks::Callbacks::check_secrets(&config.tenants)?;
        let admin_token = AdminToken::load(&config.admin)?;
        let warnings = auth
            .warnings()
            .iter()
            .cloned()
            .chain(config.routes.warnings())
            .collect();
        Ok(Self {
            auth,
            admin_token,
            warnings,
        })
    }
}

/// Whether the routes keep the endpoints the ledger holds keys under (`stored`): a route
/// that spells one differently would forget its keys and execute their retries again.
pub fn check_stored_endpoints(config: &Config, stored: &[String]) -> anyhow::Result<()> {
    config
        .routes
        .check_renames(stored.iter().map(String::as_str))
        .map_err(anyhow::Error::msg)
        .context("routes")
}

impl Application {
    pub async fn build(config: Config, options: BuildOptions) -> anyhow::Result<Self> {
        let Preflight {
            auth,
            admin_token,
            warnings,
        } = Preflight::check(&config)?;
        for warning in warnings {
            tracing::warn!("{warning}");
        }
        let key_refresh = auth.start().map(tokio_util::task::AbortOnDropHandle::new);
        idem_telemetry::prometheus(); // record from the first request on
        metrics::describe();
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
        let admin = match (config.admin.listen, admin_token) {
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
        check_stored_endpoints(&config, &stored)?;
        // Known before the first request: a gateway that just started is ready at once.
        let postgres_ready = Arc::new(AtomicBool::new(health::postgres_writable(&ledger).await));
        let readiness = tokio_util::task::AbortOnDropHandle::new(tokio::spawn(
            health::watch_readiness(ledger.clone(), postgres_ready.clone()),
        ));
        let tenants = TenantTable::new(&config.tenants, &config.routes, server.max_body_bytes);
        let webhooks = Arc::new(crate::webhook::Receivers::new(&config.routes));
        let callbacks = Arc::new(crate::callbacks::Callbacks::new(&config.tenants)?);
        let state = AppState {
            auth,
            tenants,
            routes: config.routes,
            engine: Engine::with_cache(ledger, cache),
            client: upstream::pooled_client(),
            body_read_timeout: server.body_read_timeout,
            limits: Arc::new(RequestLimits::new(
                server.max_header_bytes,
                server.max_headers,
                server.max_concurrent_requests,
            )),
            lookups: crate::listing::LookupLimits::new(
                config.postgres.max_connections as usize / 4,
            ),
            fingerprints: idem_http::Fingerprinter::default(),
            tasks: TaskTracker::new(),
            fenced: Default::default(),
            unrecorded: Default::default(),
            webhooks,
            refusals: crate::refusals::Refusals::new(server.refusal_log_interval),
            waiters: crate::waiters::Waiters::new(server.max_result_waiters),
            max_result_wait: server.max_result_wait,
            callbacks,
            key_refresh,
            postgres_ready,
            readiness,
        };
        let state = Arc::new(state);
        // Wakes the result waiters whose keys settled.
        every(&state, crate::waiters::POLL, |state| async move {
            state.waiters.poll(state.engine.ledger()).await;
        });
        // Sends the settlement callbacks due, if any tenant has a callback (whichever
        // replica settled their keys).
        if state.callbacks.any() {
            every(&state, crate::callbacks::TURN, |state| async move {
                state.callbacks.turn(state.engine.ledger()).await;
            });
        }
        // Writes the refusals counted since their last line.
        every(&state, Duration::from_secs(1), |state| async move {
            state.refusals.flush();
        });
        // Forgets idle tenants' buckets and counters.
        every(&state, tenants::TIDY_EVERY, |state| async move {
            state.tenants.tidy()
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
            let document = get(crate::openapi::serve);
            let router = crate::admin::router(self.state.clone(), token, document);
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

/// Runs `turn` every `period` (the first at once; a late one delays the next), for as long
/// as the state lives: the task holds it only during a turn.
fn every<F, Fut>(state: &Arc<AppState>, period: Duration, turn: F)
where
    F: Fn(Arc<AppState>) -> Fut + Send + 'static,
    Fut: Future<Output = ()> + Send,
{
    let weak = Arc::downgrade(state);
    tokio::spawn(async move {
        let mut ticks = tokio::time::interval(period);
        ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            ticks.tick().await;
            let Some(state) = weak.upgrade() else { return };
            turn(state).await;
        }
    });
}

pub fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(health::readyz))
        .route("/metrics", get(metrics::scrape))
        // The tenant's own lookup of its keys (docs/tenants.md), traced and counted as requests.
        .route(lookup::KEYS, lookup_route(lookup::list, &state))
        .route(
            &format!("{}/{{key}}", lookup::KEYS),
            lookup_route(lookup::show, &state),
        )
        .route(
            &format!("{}/{{key}}/result", lookup::KEYS),
            lookup_route(lookup::result, &state),
        )
        // Limits first (their refusals are counted, not traced), then the span, the
        // metrics and the log line around the request itself.
        .fallback(handler::handle.layer(axum::middleware::from_fn_with_state(
            state.clone(),
            observe::observe,
        )))
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            limits::enforce,
        ))
        .with_state(state)
}

/// A lookup path: `GET` only (405 otherwise), traced and counted as requests.
fn lookup_route<H, T>(
    handler: H,
    state: &Arc<AppState>,
) -> axum::routing::MethodRouter<Arc<AppState>>
where
    H: Handler<T, Arc<AppState>>,
    T: 'static,
{
    get(handler)
        .fallback(not_here)
        .layer(axum::middleware::from_fn_with_state(
            state.clone(),
            observe::observe,
        ))
}

/// Another method on the lookup's paths: 405, naming the one they answer.
async fn not_here() -> crate::problem::Problem {
    crate::problem::Problem::MethodNotAllowed { allow: "GET" }
}
