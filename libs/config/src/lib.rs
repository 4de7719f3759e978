//! `idem-config`: the configuration shared by the gateway and the reconciler.
//!
//! # Layout
//! - [`config`]: the TOML file plus `IDEMGATE_<SECTION>__<KEY>` overrides, validated into
//!   a typed [`Config`]; every error names its key.
//! - [`routes`]: path templates, upstreams, and matching a request to a route.
#![forbid(unsafe_code)]

pub mod config;
pub mod routes;

pub use config::{Config, ConfigError, ConfigErrors, OnUnknown, Probe, ReconcilerConfig};
pub use routes::{PathTemplate, Route, RouteTable, Upstream};
