//! `idem-embedded`: idemgate's contract in-process, for an axum + sqlx service whose
//! business data lives in the same Postgres as its idempotency records (docs/embedded-mode.md).
//!
//! The gateway claims a key, calls the upstream and records its answer in three commits,
//! so a crash between them leaves an unknown outcome for the reconciler. Here the claim,
//! the handler's business write and the stored answer are **one transaction**: they
//! commit together or not at all, and there is nothing to reconcile.
//!
//! ```no_run
//! use axum::{Json, Router, http::StatusCode, routing::post};
//! use idem_embedded::{Idempotency, Options, TenantFrom, Tx};
//!
//! # async fn run(pool: sqlx::PgPool, verifier: std::sync::Arc<idem_auth::Authenticator>) {
//! let idem = Idempotency::new(pool.clone(), Options::default().tenant(TenantFrom::Jwt(verifier)));
//! let app: Router = Router::new()
//!     .route("/payments", post(create_payment))
//!     .route_layer(idem.layer("POST /payments"));
//! # }
//!
//! async fn create_payment(mut tx: Tx, Json(order): Json<serde_json::Value>) -> (StatusCode, String) {
//!     sqlx::query("INSERT INTO payments (order_id) VALUES ($1)")
//!         .bind(order["orderId"].as_str())
//!         .execute(&mut *tx)
//!         .await
//!         .unwrap();
//!     (StatusCode::CREATED, "paid".into())
//! }
//! ```
//!
//! What is the gateway's is taken from the gateway's crates, not written again: key
//! rules, fingerprint, scope and the decision on an existing record (`idem-core`), the
//! problems and replays (`idem-http`), the statements on the `idempotency_keys` table
//! (`idem-postgres`, whose migrations create it), tokens (`idem-auth`). So a route can
//! move between gateway and embedded mode and keep its keys.
//!
//! A queue's consumer runs a message the same way, without HTTP: [`Idempotency::once`]
//! takes a [`Job`] (tenant, endpoint, key, payload) and the operation, and commits the
//! claim, the operation's writes and its [`Stored`] result together. The HTTP layer runs
//! each request through the same engine ([`once`]): one code path for both.
//!
//! # Layout
//! - [`Idempotency`] and [`Options`]: the shared state and its settings.
//! - [`once`]: the engine (replay memory, the key's turn, claim, operation, commit), and
//!   [`Idempotency::once`] on it.
//! - [`layer`]: the tower layer, and one request through it.
//! - [`tx`]: the [`Tx`] extractor.
//! - `shared`: what every run shares (pool, settings, replay memory, bounds).
//! - `gate`: one request per key at a time from this process; its duplicates wait in memory.
#![forbid(unsafe_code)]

mod answer;
mod gate;
pub mod job;
pub mod layer;
pub mod once;
mod shared;
pub mod tx;

use std::sync::Arc;
use std::time::Duration;

use http::HeaderName;
use idem_auth::{AuthError, Authenticator};
use idem_config::IdempotencyConfig;
use idem_core::NoCache;
use idem_core::local::{Bounds, Local};
use idem_core::policy::{StatusEntry, StatusSet};
use sqlx::PgPool;

pub use idem_postgres::migrate;
pub use job::{Job, Next, Once, OnceError, Stored};
pub use layer::{IdempotencyLayer, IdempotencyService};
pub use tx::Tx;

pub(crate) use shared::Shared;

/// Where the tenant of a request comes from. There is no default: a service chooses its
/// source, and an [`Options`] without one cannot build an [`Idempotency`].
#[derive(Clone)]
pub enum TenantFrom {
    /// The bearer token, verified as the gateway does (`[auth]`).
    Jwt(Arc<Authenticator>),
    /// A header set by whatever authenticates requests before the service (its own
    /// auth middleware, a proxy in front that overwrites it). **Only** for services that
    /// never let a client's value through: a client that could set it could read another
    /// tenant's stored answers by replaying that tenant's keys. Its value follows the
    /// gateway's rules for a tenant (1 to 255 printable ASCII characters, no space); a
    /// request without it, with it twice or with another value is 401.
    Header(HeaderName),
}

impl std::fmt::Debug for TenantFrom {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Jwt(_) => f.write_str("Jwt"),
            Self::Header(name) => f.debug_tuple("Header").field(name).finish(),
        }
    }
}

impl TenantFrom {
    async fn of(&self, headers: &http::HeaderMap) -> Result<String, AuthError> {
        match self {
            Self::Jwt(verifier) => {
                let token = idem_http::request::bearer(headers)?;
                Ok(verifier.verify_fetching(token).await?.0)
            }
            Self::Header(name) => {
                let mut values = headers.get_all(name).iter();
                match (values.next(), values.next()) {
                    (Some(value), None) => value
                        .to_str()
                        .ok()
                        .filter(|tenant| idem_auth::valid_tenant(tenant))
                        .map(str::to_owned)
                        .ok_or_else(|| AuthError::TenantHeaderInvalid(name.to_string())),
                    (None, _) => Err(AuthError::TenantHeaderMissing(name.to_string())),
                    (Some(_), Some(_)) => Err(AuthError::TenantHeaderInvalid(name.to_string())),
                }
            }
        }
    }
}

/// An [`Options`] whose tenant source has not been chosen yet ([`Options::tenant`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoTenant;

/// How the layer treats requests: `[idempotency]`'s defaults, and the tenant source the
/// service chooses. Only an `Options<TenantFrom>` builds an [`Idempotency`] with a layer:
///
/// ```compile_fail
/// # async fn no_tenant(pool: sqlx::PgPool) {
/// // No tenant source: no layer, so no default can trust a header.
/// let idem = idem_embedded::Idempotency::new(pool, idem_embedded::Options::default());
/// let layer = idem.layer("POST /payments");
/// # }
/// ```
///
/// ```
/// # async fn jobs_only(pool: sqlx::PgPool) {
/// // A consumer's jobs carry their tenant: no source to choose.
/// let idem = idem_embedded::Idempotency::new(pool, idem_embedded::Options::default());
/// # let _ = idem;
/// # }
/// ```
///
/// ```
/// # async fn trusted_header(pool: sqlx::PgPool) {
/// use idem_embedded::{Idempotency, Options, TenantFrom};
/// // Behind the service's own authentication, which sets `x-org` and drops a client's.
/// let tenant = TenantFrom::Header(http::HeaderName::from_static("x-org"));
/// let idem = Idempotency::new(pool, Options::default().tenant(tenant));
/// # }
/// ```
#[derive(Debug, Clone)]
pub struct Options<T = NoTenant> {
    tenant: T,
    settings: Settings,
}

/// Everything of [`Options`] but the tenant source.
#[derive(Debug, Clone)]
pub(crate) struct Settings {
    pub(crate) ttl: Duration,
    pub(crate) lock_wait: Duration,
    pub(crate) mismatch_status: u16,
    pub(crate) max_body_bytes: usize,
    pub(crate) body_read_timeout: Duration,
    pub(crate) max_response_bytes: usize,
    pub(crate) roll_back_on: StatusSet,
    pub(crate) store_set_cookie: bool,
    pub(crate) replay_memory: Bounds,
    pub(crate) max_lock_waits: Option<usize>,
    pub(crate) max_replay_bytes_in_flight: usize,
}

impl Default for Options {
    fn default() -> Self {
        Self::from_config(&IdempotencyConfig::default())
    }
}

impl Options {
    /// The settings of a gateway's `[idempotency]` section: `ttl`, `lock_wait` and
    /// `mismatch_status` (the rest is the gateway's own business).
    pub fn from_config(config: &IdempotencyConfig) -> Self {
        Self {
            tenant: NoTenant,
            settings: Settings {
                ttl: config.ttl,
                lock_wait: config.lock_wait,
                mismatch_status: config.mismatch_status,
                max_body_bytes: 1 << 20,
                body_read_timeout: Duration::from_secs(30),
                max_response_bytes: 10 << 20,
                roll_back_on: default_roll_back_on(),
                store_set_cookie: false,
                replay_memory: Bounds {
                    entries: 10_000,
                    bytes: 64 << 20,
                },
                max_lock_waits: None,
                max_replay_bytes_in_flight: idem_postgres::ledger::bodies::DEFAULT_BUDGET,
            },
        }
    }
}

/// Every 5xx, and the statuses that by HTTP's own semantics say the request was not
/// processed (408, 425, 429: the ones the gateway releases) — also what a layer inside
/// this one answers when it cuts a handler off (a timeout's 408, a rate limiter's 429).
fn default_roll_back_on() -> StatusSet {
    let mut statuses = idem_core::policy::default_release_statuses();
    statuses.insert(StatusEntry::Class(5));
    statuses
}

impl<T> Options<T> {
    /// Where each request's tenant comes from.
    pub fn tenant(self, tenant: TenantFrom) -> Options<TenantFrom> {
        Options {
            tenant,
            settings: self.settings,
        }
    }

    /// How long a completed key is replayed.
    pub fn ttl(mut self, ttl: Duration) -> Self {
        self.settings.ttl = ttl;
        self
    }

    /// How long a duplicate waits on another request's uncommitted claim before it is
    /// answered 409 with `Retry-After`. It bounds every lock wait of the request's
    /// transaction, the handler's own too (Postgres's `lock_timeout`).
    pub fn lock_wait(mut self, wait: Duration) -> Self {
        self.settings.lock_wait = wait;
        self
    }

    /// 409 (default) or 422 for a key reused with a different request.
    pub fn mismatch_status(mut self, status: u16) -> Self {
        self.settings.mismatch_status = status;
        self
    }

    /// Larger request bodies get 413; nothing is claimed.
    pub fn max_body_bytes(mut self, limit: usize) -> Self {
        self.settings.max_body_bytes = limit;
        self
    }

    /// Larger answers are committed without their body: retries get 410.
    pub fn max_response_bytes(mut self, limit: usize) -> Self {
        self.settings.max_response_bytes = limit;
        self
    }

    /// The statuses whose answers roll the transaction back (default: every 5xx, and
    /// 408, 425 and 429): the business write is undone and the key is free.
    pub fn roll_back_on(mut self, statuses: StatusSet) -> Self {
        self.settings.roll_back_on = statuses;
        self
    }

    /// Keep `Set-Cookie` in stored answers (replayed to whoever retries the key).
    pub fn store_set_cookie(mut self, store: bool) -> Self {
        self.settings.store_set_cookie = store;
        self
    }

    /// Completed answers held in this process for replays without a statement
    /// (`entries: 0` turns it off).
    pub fn replay_memory(mut self, bounds: Bounds) -> Self {
        self.settings.replay_memory = bounds;
        self
    }

    /// Stored answers over 64 KiB held in memory at once, for replays being read from
    /// Postgres or sent (the gateway's `server.max_replay_bytes_in_flight`, default
    /// 256 MiB); past it a replay that needs one is answered 503 `overloaded`.
    pub fn max_replay_bytes_in_flight(mut self, bytes: usize) -> Self {
        self.settings.max_replay_bytes_in_flight = bytes;
        self
    }

    /// How many pooled connections may wait at once on keys that another process's
    /// request holds uncommitted (default: a quarter of the pool, at least one). Beyond
    /// it such a duplicate is answered 409 in progress at once. Duplicates of a key this
    /// process itself is serving wait in memory and take none.
    pub fn max_lock_waits(mut self, connections: usize) -> Self {
        self.settings.max_lock_waits = Some(connections);
        self
    }
}

/// The idempotency of a service: its pool, options and replay memory. Cheap to clone;
/// one per service, with a [`layer`](Idempotency::layer) per idempotent route — which
/// only an `Idempotency<TenantFrom>` has: a service that only runs jobs
/// ([`Idempotency::once`], whose tenant comes with each job) chooses no tenant source.
#[derive(Debug, Clone)]
pub struct Idempotency<T = TenantFrom> {
    shared: Arc<Shared>,
    tenant: T,
}

impl<T> Idempotency<T> {
    /// The records live in `pool`'s database, in the table the project's migrations
    /// create ([`migrate`]).
    pub fn new(pool: PgPool, options: Options<T>) -> Self {
        let Options { tenant, settings } = options;
        let begin = once::begin_waiting(once::FIRST_LOCK_WAIT.min(settings.lock_wait));
        let lock_waits = settings
            .max_lock_waits
            .unwrap_or(pool.options().get_max_connections() as usize / 4)
            .max(1);
        let replays = Local::new(NoCache, settings.replay_memory);
        let bodies =
            idem_postgres::ledger::bodies::Bodies::new(settings.max_replay_bytes_in_flight);
        Self {
            tenant,
            shared: Arc::new(Shared {
                pool,
                settings,
                begin,
                gates: gate::Gates::default(),
                lock_waits: tokio::sync::Semaphore::new(lock_waits),
                bodies,
                replays,
                fingerprints: idem_http::Fingerprinter::default(),
            }),
        }
    }
}

impl Idempotency<TenantFrom> {
    /// The layer for one route. `endpoint` names it in the records' scope, as a gateway
    /// route's method and path template do (`"POST /payments"`): a route moved from the
    /// gateway keeps its keys only under the same name.
    pub fn layer(&self, endpoint: &str) -> IdempotencyLayer {
        IdempotencyLayer::new(self.shared.clone(), self.tenant.clone(), endpoint)
    }
}
