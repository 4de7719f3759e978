//! `idemgate`: the idempotency gateway's HTTP edge and proxy.
//!
//! # Layout
//! - [`app`]: [`app::Application`] — build (connect, migrate, bind), the router, serve,
//!   drain.
//! - [`state`]: [`state::AppState`], what every request shares (a leaf: the handlers
//!   import it, it imports none of them).
//! - [`health`]: `/healthz`, and `/readyz` from a background check.
//! - [`metrics`]: the catalogue of exported metrics, and `/metrics`.
//! - [`handler`]: one request, in named phases: admit → read → identify → run → respond.
//! - [`extract`]: the extractors (the caller — a token's tenant, or a webhook delivery not
//!   yet verified — the matched route, the key header) and the body.
//! - [`webhook`]: webhook routes: unverified bodies bounded per route, signatures checked
//!   off the request threads, secrets re-read when their files change.
//! - [`observe`]: the `idemgate.request` span, request metrics and log line, as a layer;
//!   [`refusals`]: refusals logged per tenant and reason at most once per interval.
//! - [`respond`]: an engine outcome as the client's response.
//! - [`problem`]: every error response, as `application/problem+json` (in `idem-http`,
//!   shared with embedded mode).
//! - [`server`]: the listener; connection-level limits (head timeout, hard head caps).
//! - [`limits`]: per-request limits (head size, requests in flight), as middleware.
//! - [`operator`]: what `idemgate keys` prints about a key.
//! - [`lookup`]: the tenant's own lookup of its keys (`/_idemgate/v1/keys`).
//! - [`admin`]: the operator's admin API (`/admin/v1`, on `admin.listen`); [`admin_token`]
//!   its bearer token, re-read when its file changes.
//! - [`listing`]: what the lookup and the admin API share: paging, cursors, query
//!   parameters and their errors, the problem schema.
//! - [`openapi`]: the OpenAPI 3.1 document of both, generated from their handlers.
//! - [`tenants`]: each tenant's policy, body limit and quotas (429 over them).
//! - [`waiters`]: clients waiting for a key's result, woken when it settles.
//!
//! Configuration and routes live in `idem-config` and the upstream client in
//! `idem-upstream`, both shared with the reconciler; the header rules of the HTTP
//! contract in `idem-core` (`headers`), shared with embedded mode.
#![forbid(unsafe_code)]

pub mod admin;
pub mod admin_token;
pub mod app;
pub mod callbacks;
pub mod extract;
pub mod handler;
pub mod health;
pub mod limits;
pub mod listing;
pub mod lookup;
pub mod metrics;
pub mod observe;
pub mod openapi;
pub mod operator;
pub mod refusals;
pub mod respond;
pub mod server;
pub mod state;
pub mod tenants;
pub mod waiters;
pub mod webhook;

pub use idem_http::problem;

pub use app::{Application, BuildOptions};
pub use idem_config::Config;
