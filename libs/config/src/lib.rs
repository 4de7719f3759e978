//! `idem-config`: the configuration shared by the gateway and the reconciler — one TOML
//! file plus `IDEMGATE_<SECTION>__<KEY>` environment overrides (docs/configuration.md's
//! "Configuration"), parsed once at start-up into typed values. Every problem is a
//! [`ConfigError`] naming the key at fault.
//!
//! # Layout: one file per section, each with the table of its keys
//! - [`server`] `[server]`, [`admin`] `[admin]`, [`postgres`] `[postgres]`, [`redis`] `[redis]`,
//!   [`reconciler`] `[reconciler]`, [`idempotency`] `[idempotency]`;
//!   `[auth]` is `idem_auth::AuthConfig`.
//! - [`tenants`] `[tenants.default]` and `[tenants.<id>]`: a tenant's policy and quotas.
//! - [`routes`] `[[routes]]`, and matching a request to its route, with [`template`]
//!   (path templates) and [`upstream`] (where a route forwards).
//! - [`error`]: how problems are reported.
//!
//! Values are parsed by serde (policy words, templates and URLs through their
//! `TryFrom<String>`), then checked across keys here and in each section's `validate`.
#![forbid(unsafe_code)]

use std::path::Path;

use figment::Figment;
use figment::providers::{Env, Format, Toml};
use idem_auth::AuthConfig;
use serde::Deserialize;

pub mod admin;
pub mod error;
pub mod idempotency;
pub mod postgres;
pub mod reconciler;
pub mod redis;
pub mod routes;
pub mod server;
pub mod template;
pub mod tenants;
#[cfg(test)]
mod tests;
pub mod upstream;
pub mod webhook;

pub use admin::AdminConfig;
pub use error::{ConfigError, ConfigErrors};
pub use idem_core::reconcile::OnUnknown;
pub use idempotency::IdempotencyConfig;
pub use postgres::PostgresConfig;
pub use reconciler::ReconcilerConfig;
pub use redis::RedisConfig;
pub use routes::{Probe, Route, RouteKind, RouteTable};
pub use server::ServerConfig;
pub use template::PathTemplate;
pub use tenants::{Rate, TenantConfig, Tenants};
pub use upstream::Upstream;
pub use webhook::{SecretSource, WEBHOOK_TTL, Webhook};

/// The validated configuration.
#[derive(Debug, Clone)]
pub struct Config {
    pub server: ServerConfig,
    /// `[admin]`: the operator's HTTP API, off unless `admin.listen` is set.
    pub admin: AdminConfig,
    pub postgres: PostgresConfig,
    pub redis: Option<RedisConfig>,
    pub auth: AuthConfig,
    pub reconciler: ReconcilerConfig,
    /// `[idempotency]`, the defaults the routes start from (and embedded mode's policy).
    pub idempotency: IdempotencyConfig,
    pub routes: RouteTable,
    /// `[tenants.…]`: each tenant's policy (over the route's) and quotas.
    pub tenants: Tenants,
}

/// The file as written, before the checks across keys.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawConfig {
    #[serde(default)]
    server: ServerConfig,
    #[serde(default)]
    admin: AdminConfig,
    postgres: PostgresConfig,
    redis: Option<RedisConfig>,
    auth: AuthConfig,
    #[serde(default)]
    idempotency: IdempotencyConfig,
    #[serde(default)]
    reconciler: ReconcilerConfig,
    #[serde(default)]
    routes: Vec<routes::RawRoute>,
    #[serde(default)]
    tenants: std::collections::BTreeMap<String, TenantConfig>,
}

impl Config {
    /// Reads `path` and applies `IDEMGATE_…` environment overrides.
    pub fn load(path: &Path) -> Result<Self, ConfigErrors> {
        if !path.exists() {
            return Err(
                ConfigError::new("--config", format!("{} does not exist", path.display())).into(),
            );
        }
        let env = Env::prefixed("IDEMGATE_")
            .filter(|k| k.as_str().contains("__"))
            .split("__");
        Self::from_figment(Figment::from(Toml::file_exact(path)).merge(env))
    }

    /// Parses a TOML document, without environment overrides (for tests and tools).
    pub fn from_toml(toml: &str) -> Result<Self, ConfigErrors> {
        Self::from_figment(Figment::from(Toml::string(toml)))
    }

    fn from_figment(figment: Figment) -> Result<Self, ConfigErrors> {
        let raw: RawConfig = figment.extract().map_err(|e| {
            ConfigErrors(
                e.into_iter()
                    .map(|e| {
                        let mut path = error::key_path(&e.path);
                        // An unknown field is already in the path; a missing one is not.
                        if let figment::error::Kind::MissingField(field) = &e.kind {
                            path = error::key_path(&[path, field.to_string()]);
                        }
                        if path.is_empty() {
                            path = "(file)".into();
                        }
                        ConfigError::new(path, e.kind.to_string())
                    })
                    .collect(),
            )
        })?;
        raw.validate()
    }
}

impl RawConfig {
    fn validate(self) -> Result<Config, ConfigErrors> {
        self.server.validate()?;
        self.admin.validate()?;
        self.postgres.validate()?;
        if let Some(redis) = &self.redis {
            redis.validate()?;
        }
        self.reconciler.validate()?;
        self.idempotency.validate()?;
        let ledger_op = self.postgres.op_timeout();
        let mut routes = Vec::with_capacity(self.routes.len());
        for (i, raw) in self.routes.into_iter().enumerate() {
            let route = raw.validate(&format!("routes[{i}]"), &self.idempotency, ledger_op)?;
            if let Some(other) = routes.iter().position(|r: &Route| {
                r.method == route.method && r.template.same_shape(&route.template)
            }) {
                return Err(ConfigError::new(
                    format!("routes[{i}]"),
                    format!("{} overlaps routes[{other}]", route.endpoint),
                )
                .into());
            }
            if route.idempotent && route.max_response_bytes > self.server.max_replay_bytes_in_flight
            {
                return Err(ConfigError::new(
                    format!("routes[{i}].max_response_bytes"),
                    format!(
                        "{} is more than server.max_replay_bytes_in_flight ({}): a stored answer this large could never be replayed",
                        route.max_response_bytes, self.server.max_replay_bytes_in_flight
                    ),
                )
                .into());
            }
            routes.push(route);
        }
        let tenants = Tenants::from_raw(self.tenants)?;
        tenants::check_routes(&tenants, &routes, ledger_op)?;
        Ok(Config {
            server: self.server,
            admin: self.admin,
            postgres: self.postgres,
            redis: self.redis,
            auth: self.auth,
            reconciler: self.reconciler,
            idempotency: self.idempotency,
            routes: RouteTable::new(routes),
            tenants,
        })
    }
}
