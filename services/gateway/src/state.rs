//! [`AppState`]: everything a request needs, shared by all of them. A leaf: the
//! handlers import it, and it imports none of them.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64};
use std::time::Duration;

use idem_auth::Authenticator;
use idem_config::RouteTable;
use idem_core::local::Local;
use idem_core::{Engine, MaybeCache};
use idem_postgres::PgLedger;
use idem_redis::RedisCache;
use idem_upstream::HttpClient;
use tokio_util::task::{AbortOnDropHandle, TaskTracker};

use crate::limits::RequestLimits;
use crate::tenants::TenantTable;

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
    pub limits: Arc<RequestLimits>,
    /// The share of the ledger lookups and listings may take.
    pub lookups: crate::listing::LookupLimits,
    /// Fingerprints of large bodies, off the async workers and bounded.
    pub fingerprints: idem_http::Fingerprinter,
    /// Forward-and-store tasks, awaited on shutdown.
    pub tasks: TaskTracker,
    /// Completions that lost the fence (the reconciler resolved the row first).
    pub fenced: AtomicU64,
    /// Executions whose answer could not be recorded (503 `outcome-unrecorded`).
    pub unrecorded: AtomicU64,
    /// The webhook routes' places for unverified bodies and their secrets, read again
    /// when their files change.
    pub webhooks: Arc<crate::webhook::Receivers>,
    /// Refusals, logged per tenant and reason at most once per interval.
    pub refusals: crate::refusals::Refusals,
    /// Clients waiting for a key's result (`Prefer: wait` on the result).
    pub waiters: crate::waiters::Waiters,
    /// The longest a result waits (`server.max_result_wait`).
    pub max_result_wait: Duration,
    /// Each tenant's settlement callback, and their sender.
    pub callbacks: Arc<crate::callbacks::Callbacks>,
    /// Fetches and refreshes an identity provider's keys, for as long as the state lives.
    pub key_refresh: Option<AbortOnDropHandle<()>>,
    /// Whether a writable Postgres answered lately: refreshed in the background.
    pub postgres_ready: Arc<AtomicBool>,
    /// Refreshes `postgres_ready`, for as long as the state lives.
    pub readiness: AbortOnDropHandle<()>,
}
