//! The gateway's test harness: everything from `idem-testkit`, plus gateways built
//! in-process on port 0 (so tests can read their counters).
#![allow(dead_code)]

use std::net::SocketAddr;

pub use idem_testkit::*;
use idemgate::{Application, BuildOptions, Config};

/// The gateway's config from a test's [`TestConfig`].
pub fn config(config: TestConfig) -> Config {
    Config::from_toml(&config.toml()).unwrap_or_else(|e| panic!("test config: {e}"))
}

/// A gateway running in this process, stopped when dropped (or via `stop`).
pub struct Gateway {
    pub addr: SocketAddr,
    /// The admin API's address, when `admin.listen` is set.
    pub admin: Option<SocketAddr>,
    /// Upstream processes that live as long as this gateway.
    upstreams: Vec<Demo>,
    pub state: std::sync::Arc<idemgate::state::AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
}

impl Gateway {
    pub async fn start(config: Config) -> Self {
        let app = Application::build(config, BuildOptions::default())
            .await
            .unwrap_or_else(|e| panic!("gateway failed to start: {e:#}"));
        let addr = app.local_addr();
        let admin = app.admin_addr();
        let state = app.state();
        let (tx, rx) = tokio::sync::oneshot::channel();
        let task = tokio::spawn(app.run_until_stopped(async {
            let _ = rx.await;
        }));
        Self {
            addr,
            admin,
            upstreams: Vec::new(),
            state,
            stop: Some(tx),
            task: Some(task),
        }
    }

    pub fn url(&self, path: &str) -> String {
        format!("http://{}{}", self.addr, path)
    }

    /// Keeps an upstream process alive for as long as this gateway.
    pub fn keep(&mut self, demo: Demo) {
        self.upstreams.push(demo);
    }

    /// A URL of the admin API (panics if `admin.listen` is not set).
    pub fn admin_url(&self, path: &str) -> String {
        let admin = self.admin.expect("this gateway has no admin.listen");
        format!("http://{admin}{path}")
    }

    /// Statements this gateway has sent to Postgres.
    pub fn ledger_calls(&self) -> u64 {
        self.state.engine.ledger().calls()
    }

    /// The Redis fast path's counters (panics if `[redis]` is not configured).
    pub fn cache_stats(&self) -> idem_redis::CacheStats {
        match self.state.engine.cache() {
            idem_core::MaybeCache::Some(cache) => cache.inner().stats(),
            idem_core::MaybeCache::None => panic!("this gateway has no [redis]"),
        }
    }

    /// Signals shutdown; returns the serve task to await.
    pub fn stop(&mut self) -> tokio::task::JoinHandle<anyhow::Result<()>> {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.take().expect("not stopped before")
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
    }
}

/// The usual setup: a fresh database, the payments demo (kept alive by the gateway),
/// one gateway on the payments routes, and a client.
pub async fn setup() -> (TestDb, Gateway, Http) {
    setup_with(|config| config, |payments| payments).await
}

/// [`setup`], with the config and the `POST /payments` route changed as given.
pub async fn setup_with(
    change: impl FnOnce(TestConfig) -> TestConfig,
    payments: impl FnOnce(Route) -> Route,
) -> (TestDb, Gateway, Http) {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let test_config = change(TestConfig::new(&db)).payments(&demo, payments);
    let mut gw = Gateway::start(config(test_config)).await;
    gw.upstreams.push(demo);
    (db, gw, Http::default())
}
