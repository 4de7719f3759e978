//! `idemgate`: the idempotency gateway's HTTP edge and proxy.
//!
//! # Layout
//! - [`config`]: the TOML file and `IDEMGATE_…` overrides, validated into [`config::Config`].
//! - [`routes`]: path templates, upstreams, route matching.
//! - [`app`]: [`app::Application`] — build (connect, migrate, bind), serve, drain.
//! - [`handler`]: one request: auth → route → key → body → engine → response.
//! - [`upstream`]: the pooled HTTP client and what a forward did (answered / not sent / unknown).
//! - [`headers`]: hop-by-hop stripping, headers set upstream, stored headers.
//! - [`problem`]: every error response, as `application/problem+json`.
#![forbid(unsafe_code)]

pub mod app;
pub mod config;
pub mod handler;
pub mod headers;
pub mod problem;
pub mod routes;
pub mod upstream;

pub use app::{Application, BuildOptions};
pub use config::Config;
