//! Config files for the processes the tests start, built as typed TOML values.
//!
//! ```ignore
//! let config = TestConfig::new(&db)
//!     .redis(&redis.url())
//!     .set("idempotency.lease", "3s")
//!     .route(Route::idempotent("POST", "/payments", &demo.url()).set("probe", PROBE))
//!     .toml();
//! ```

use std::path::PathBuf;

use toml::{Table, Value};

use crate::{Demo, SECRET, TestDb};

/// The payments service's status probe, as a route's `probe`.
pub const PROBE: &str = "GET /payments/by-key/{key}";

/// A gateway's (or the reconciler's) config. [`TestConfig::new`] holds the tests'
/// defaults; every other key is set by its dotted path.
#[derive(Debug, Clone)]
pub struct TestConfig {
    root: Table,
    routes: Vec<Route>,
}

impl TestConfig {
    /// A listener on a free port, Postgres at `db` (8 connections; acquire and
    /// statement timeouts of 1 s, so that leases of a few seconds pass the lease
    /// check), HS256 with [`SECRET`], bodies up to 4 KiB, a 5 s shutdown grace.
    pub fn new(db: &TestDb) -> Self {
        Self::bare()
            .set("server.listen", "127.0.0.1:0")
            .set("server.shutdown_grace", "5s")
            .set("server.max_body_bytes", 4096)
            .set("postgres.url", db.url.as_str())
            .set("postgres.max_connections", 8)
            .set("postgres.acquire_timeout", "1s")
            .set("postgres.statement_timeout", "1s")
            .set("auth.hs256_secret", SECRET)
    }

    /// An empty file: every key at the program's default until set.
    pub fn bare() -> Self {
        Self {
            root: Table::new(),
            routes: Vec::new(),
        }
    }

    /// Sets `path` (`section.key`, or `key` at the top) to `value`.
    pub fn set(mut self, path: &str, value: impl Into<Value>) -> Self {
        let (table, key) = at(&mut self.root, path);
        table.insert(key.to_owned(), value.into());
        self
    }

    /// Removes `path`, back to the program's own default.
    pub fn unset(mut self, path: &str) -> Self {
        let (table, key) = at(&mut self.root, path);
        table.remove(key);
        self
    }

    /// A `[redis]` section for one server, with short timeouts for tests, and without
    /// the in-process layer, so tests see Redis itself.
    pub fn redis(self, url: &str) -> Self {
        self.set("redis.url", url)
            .set("redis.timeout", "200ms")
            .set("redis.probe_interval", "200ms")
            .set("redis.local_cache_entries", 0)
    }

    pub fn route(mut self, route: Route) -> Self {
        self.routes.push(route);
        self
    }

    /// The usual routes against the demo: `POST /payments` (as `payments` makes it),
    /// `POST /refunds` and the plain `GET /payments/by-key/{key}`.
    pub fn payments(self, demo: &Demo, payments: impl FnOnce(Route) -> Route) -> Self {
        let url = demo.url();
        self.route(payments(Route::idempotent("POST", "/payments", &url)))
            .route(Route::idempotent("POST", "/refunds", &url))
            .route(Route::plain("GET", "/payments/by-key/{key}", &url))
    }

    pub fn toml(&self) -> String {
        let mut root = self.root.clone();
        if !self.routes.is_empty() {
            let routes = self.routes.iter().map(|r| Value::Table(r.0.clone()));
            root.insert("routes".into(), Value::Array(routes.collect()));
        }
        root.to_string()
    }

    /// Writes the config to a file of its own.
    pub fn file(&self) -> PathBuf {
        config_file(&self.toml())
    }
}

/// One `[[routes]]` entry.
#[derive(Debug, Clone)]
pub struct Route(Table);

impl Route {
    /// An idempotent route with a 5 s upstream timeout.
    pub fn idempotent(method: &str, path: &str, upstream: &str) -> Self {
        Self::plain(method, path, upstream)
            .set("idempotent", true)
            .set("timeout", "5s")
    }

    /// A route that passes requests through unprotected.
    pub fn plain(method: &str, path: &str, upstream: &str) -> Self {
        Self(Table::new())
            .set("method", method)
            .set("path", path)
            .set("upstream", upstream)
    }

    pub fn set(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.0.insert(key.to_owned(), value.into());
        self
    }

    pub fn unset(mut self, key: &str) -> Self {
        self.0.remove(key);
        self
    }

    /// With a `[routes.webhook]` section of these keys (docs/webhooks.md).
    pub fn webhook(self, keys: &[(&str, &str)]) -> Self {
        let table: Table = keys
            .iter()
            .map(|(k, v)| ((*k).to_owned(), Value::from(*v)))
            .collect();
        self.set("webhook", Value::Table(table))
    }

    /// Sets one key of the route's `[routes.webhook]` section (after [`Route::webhook`]).
    pub fn webhook_set(mut self, key: &str, value: impl Into<Value>) -> Self {
        self.0
            .get_mut("webhook")
            .and_then(Value::as_table_mut)
            .expect("Route::webhook first")
            .insert(key.to_owned(), value.into());
        self
    }

    /// With the payments service's status probe.
    pub fn probed(self) -> Self {
        self.set("probe", PROBE)
    }
}

/// The table holding `path`'s last key, created on the way.
fn at<'a, 'p>(root: &'a mut Table, path: &'p str) -> (&'a mut Table, &'p str) {
    let mut parts: Vec<&str> = path.split('.').collect();
    let key = parts.pop().expect("a key");
    let mut table = root;
    for part in parts {
        table = table
            .entry(part)
            .or_insert_with(|| Value::Table(Table::new()))
            .as_table_mut()
            .unwrap_or_else(|| panic!("{part} in {path} is not a table"));
    }
    (table, key)
}

/// Writes `text` to a config file of its own and returns the path.
pub fn config_file(text: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("idemgate-test-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idemgate.toml");
    std::fs::write(&path, text).unwrap();
    path
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_sections_and_routes_as_toml() {
        let db = TestDb {
            name: "n".into(),
            url: "postgres://h/n".into(),
        };
        let text = TestConfig::new(&db)
            .set("idempotency.lease", "3s")
            .unset("server.max_body_bytes")
            .route(Route::idempotent("POST", "/payments", "http://u").probed())
            .toml();
        let parsed: Table = text.parse().unwrap();
        assert_eq!(parsed["idempotency"]["lease"].as_str(), Some("3s"));
        assert!(parsed["server"].get("max_body_bytes").is_none());
        assert_eq!(parsed["routes"][0]["probe"].as_str(), Some(PROBE));
        assert_eq!(parsed["routes"][0]["idempotent"].as_bool(), Some(true));
        std::mem::forget(db); // never created, nothing to drop
    }
}
