//! The shared connection and its circuit breaker.
//!
//! deadpool-redis makes connections (with its timeouts, for one node or a cluster); the
//! hot path then shares one multiplexed connection, so a request costs exactly its own
//! round trip (a pooled checkout would add a recycle `PING` to every request). On any
//! error or timeout the breaker opens: the connection is dropped, requests go to
//! Postgres alone without waiting on Redis, and a background task tries to reconnect
//! every `reconnect_interval` until Redis answers, then closes the breaker.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::Duration;

use deadpool_redis::Runtime;
use redis::aio::{ConnectionLike, MultiplexedConnection};
use redis::cluster_async::ClusterConnection;
use redis::{Cmd, Pipeline, RedisFuture, Value};
use tracing::Instrument;

use crate::StartError;

/// Why a connection could not be made (or did not answer its `PING`).
#[derive(Debug, thiserror::Error)]
enum ConnectError {
    /// The single and the cluster pool fail with the same type.
    #[error("no connection from the pool: {0}")]
    Pool(#[from] deadpool_redis::PoolError),
    #[error("PING failed: {0}")]
    Ping(#[from] redis::RedisError),
}

/// One node or a cluster.
#[derive(Clone)]
pub enum Conn {
    Single(MultiplexedConnection),
    Cluster(ClusterConnection),
}

impl ConnectionLike for Conn {
    fn req_packed_command<'a>(&'a mut self, cmd: &'a Cmd) -> RedisFuture<'a, Value> {
        match self {
            Conn::Single(c) => c.req_packed_command(cmd),
            Conn::Cluster(c) => c.req_packed_command(cmd),
        }
    }

    fn req_packed_commands<'a>(
        &'a mut self,
        cmd: &'a Pipeline,
        offset: usize,
        count: usize,
    ) -> RedisFuture<'a, Vec<Value>> {
        match self {
            Conn::Single(c) => c.req_packed_commands(cmd, offset, count),
            Conn::Cluster(c) => c.req_packed_commands(cmd, offset, count),
        }
    }

    fn get_db(&self) -> i64 {
        match self {
            Conn::Single(c) => c.get_db(),
            Conn::Cluster(c) => c.get_db(),
        }
    }
}

/// Where connections come from.
pub enum Pools {
    Single(deadpool_redis::Pool),
    Cluster(deadpool_redis::cluster::Pool),
}

impl Pools {
    pub fn single(url: &str) -> Result<Self, StartError> {
        deadpool_redis::Config::from_url(url)
            .create_pool(Some(Runtime::Tokio1))
            .map(Pools::Single)
            .map_err(|e| StartError::Pool(e.into()))
    }

    pub fn cluster(urls: Vec<String>) -> Result<Self, StartError> {
        deadpool_redis::cluster::Config::from_urls(urls)
            .create_pool(Some(Runtime::Tokio1))
            .map(Pools::Cluster)
            .map_err(|e| StartError::Pool(e.into()))
    }

    async fn connect(&self) -> Result<Conn, ConnectError> {
        let mut conn = match self {
            Pools::Single(pool) => {
                Conn::Single(deadpool_redis::Connection::take(pool.get().await?))
            }
            Pools::Cluster(pool) => {
                Conn::Cluster(deadpool_redis::cluster::Connection::take(pool.get().await?))
            }
        };
        redis::cmd("PING").query_async::<String>(&mut conn).await?;
        Ok(conn)
    }
}

/// Counters the gateway exports as metrics.
#[derive(Debug, Default)]
pub struct Stats {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub errors: AtomicU64,
    /// Of the errors, calls Redis did not answer within the op timeout.
    pub timeouts: AtomicU64,
    /// Calls skipped because the breaker was open.
    pub skipped: AtomicU64,
    /// Writes Redis refused because it was out of memory (the breaker stays closed).
    pub refused: AtomicU64,
}

/// The breaker: `Some(conn)` while closed, `None` while open.
pub struct Breaker {
    pools: Pools,
    conn: RwLock<Option<Conn>>,
    reconnecting: AtomicBool,
    op_timeout: Duration,
    connect_timeout: Duration,
    reconnect_interval: Duration,
    pub stats: Stats,
}

impl Breaker {
    pub fn new(pools: Pools, op_timeout: Duration, reconnect_interval: Duration) -> Arc<Self> {
        Arc::new(Self {
            pools,
            conn: RwLock::new(None),
            reconnecting: AtomicBool::new(false),
            op_timeout,
            connect_timeout: (op_timeout * 10).max(Duration::from_millis(500)),
            reconnect_interval,
            stats: Stats::default(),
        })
    }

    /// Tries to connect now; if Redis is not there, starts with the breaker open and
    /// keeps trying in the background.
    pub async fn start(self: &Arc<Self>) {
        match tokio::time::timeout(self.connect_timeout, self.pools.connect()).await {
            Ok(Ok(conn)) => *self.conn.write().expect("breaker lock") = Some(conn),
            Ok(Err(error)) => {
                tracing::warn!(%error, "Redis unavailable at start-up; serving from Postgres alone until it answers");
                self.reconnect_in_background();
            }
            Err(_) => {
                tracing::warn!(
                    "Redis did not answer at start-up; serving from Postgres alone until it does"
                );
                self.reconnect_in_background();
            }
        }
    }

    pub fn is_closed(&self) -> bool {
        self.conn.read().expect("breaker lock").is_some()
    }

    /// Runs one operation on the shared connection, bounded by the op timeout. `None`
    /// when the breaker is open or the operation failed (which opens it).
    pub async fn run<T, F, Fut>(self: &Arc<Self>, operation: &'static str, op: F) -> Option<T>
    where
        F: FnOnce(Conn) -> Fut,
        Fut: Future<Output = redis::RedisResult<T>>,
    {
        let Some(conn) = self.conn.read().expect("breaker lock").clone() else {
            self.stats.skipped.fetch_add(1, Ordering::Relaxed);
            return None;
        };
        let span = tracing::info_span!(
            "redis",
            otel.kind = "client",
            db.system.name = "redis",
            db.operation.name = operation
        );
        match tokio::time::timeout(self.op_timeout, op(conn))
            .instrument(span)
            .await
        {
            Ok(Ok(value)) => Some(value),
            // Out of memory under `maxmemory` with `noeviction`: Redis is up and answers,
            // it only cannot take this write. No reason to stop asking it.
            Ok(Err(error)) if error.code() == Some("OOM") => {
                self.stats.refused.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(%error, operation, "Redis refused a write (out of memory)");
                None
            }
            Ok(Err(error)) => {
                self.trip(&error.to_string());
                None
            }
            Err(_) => {
                self.stats.timeouts.fetch_add(1, Ordering::Relaxed);
                self.trip(&format!("no answer within {:?}", self.op_timeout));
                None
            }
        }
    }

    fn trip(self: &Arc<Self>, error: &str) {
        self.stats.errors.fetch_add(1, Ordering::Relaxed);
        if self.conn.write().expect("breaker lock").take().is_some() {
            tracing::warn!(%error, "Redis failed; breaker open, serving from Postgres alone");
        }
        self.reconnect_in_background();
    }

    fn reconnect_in_background(self: &Arc<Self>) {
        if self.reconnecting.swap(true, Ordering::AcqRel) {
            return;
        }
        let this = Arc::clone(self);
        tokio::spawn(async move {
            loop {
                tokio::time::sleep(this.reconnect_interval).await;
                if let Ok(Ok(conn)) =
                    tokio::time::timeout(this.connect_timeout, this.pools.connect()).await
                {
                    *this.conn.write().expect("breaker lock") = Some(conn);
                    this.reconnecting.store(false, Ordering::Release);
                    tracing::info!("Redis answers again; breaker closed");
                    return;
                }
            }
        });
    }
}
