//! `idem-redis`: the fast path — an in-progress lock and a response cache on Redis, one
//! round trip per request.
//!
//! Redis never decides that an operation may execute (docs/architecture.md, "Promises"): a cached
//! response is only ever written after Postgres committed it, and a lock taken here is
//! always followed by the Postgres claim. Redis down, slow, flushed, evicted or restarted
//! therefore changes nothing a client sees; it only costs the Postgres round trips the
//! cache would have saved.
//!
//! # Layout
//! - [`keys`]: the key layout (one hash tag per scope: Redis Cluster safe).
//! - [`codec`]: the cached response's binary form.
//! - [`scripts`]: the Lua scripts (lookup, complete, unlock).
//! - [`conn`]: the shared connection, deadpool-made, behind a circuit breaker.
//! - [`notify`]: pub/sub wake-ups for retries that wait.
#![forbid(unsafe_code)]

pub mod codec;
pub mod conn;
pub mod keys;
pub mod notify;
pub mod scripts;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use idem_core::{AttemptId, Cache, CacheEntry, CacheLookup, Scope};
use redis::Value;

use crate::conn::{Breaker, Pools};
use crate::notify::Notifier;

/// How to reach Redis.
#[derive(Debug, Clone)]
pub struct RedisSettings {
    /// One node (`redis://127.0.0.1:6379`), or the seed nodes of a cluster.
    pub urls: Vec<String>,
    pub cluster: bool,
    /// Prepended to every key (must not contain `{` or `}`).
    pub prefix: String,
    /// Upper bound on one Redis call; past it the breaker opens.
    pub timeout: Duration,
    /// How often an open breaker tries to reconnect (`redis.probe_interval`).
    pub reconnect_interval: Duration,
    /// Whether a lookup that finds no answer takes the in-progress lock (`redis.lock`).
    pub lock: bool,
}

impl From<&idem_config::RedisConfig> for RedisSettings {
    fn from(redis: &idem_config::RedisConfig) -> Self {
        use secrecy::ExposeSecret;
        let (urls, cluster) = match (&redis.url, &redis.cluster_urls) {
            (Some(url), _) => (vec![url.expose_secret().to_owned()], false),
            (None, Some(urls)) => (
                urls.iter().map(|u| u.expose_secret().to_owned()).collect(),
                true,
            ),
            (None, None) => (Vec::new(), false),
        };
        Self {
            urls,
            cluster,
            prefix: redis.prefix.clone(),
            timeout: redis.timeout,
            reconnect_interval: redis.probe_interval,
            lock: redis.lock,
        }
    }
}

/// Why the cache could not be set up (a Redis that does not answer is not one of
/// these: the breaker starts open).
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    #[error("no Redis URL")]
    NoUrl,
    #[error("bad Redis configuration: {0}")]
    Pool(#[source] Box<dyn std::error::Error + Send + Sync>),
}

/// A point-in-time view of the fast path, for `/readyz` and metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CacheStats {
    pub up: bool,
    pub hits: u64,
    pub misses: u64,
    pub errors: u64,
    /// Of the errors, calls not answered in time.
    pub timeouts: u64,
    pub skipped: u64,
    /// Writes refused for lack of memory (the breaker stayed closed).
    pub refused: u64,
    /// Pub/sub channels subscribed for requests waiting right now.
    pub watched: usize,
}

/// The Redis cache. Cheap to clone.
#[derive(Clone)]
pub struct RedisCache {
    breaker: Arc<Breaker>,
    notifier: Arc<Notifier>,
    prefix: Arc<str>,
    lock: bool,
}

impl std::fmt::Debug for RedisCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisCache")
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl RedisCache {
    /// Builds the cache and tries to connect. A Redis that is down does not fail this:
    /// the breaker starts open and the gateway serves from Postgres until Redis answers.
    pub async fn start(settings: &RedisSettings) -> Result<Self, StartError> {
        let first = settings.urls.first().ok_or(StartError::NoUrl)?.clone();
        let pools = if settings.cluster {
            Pools::cluster(settings.urls.clone())?
        } else {
            Pools::single(&first)?
        };
        let breaker = Breaker::new(pools, settings.timeout, settings.reconnect_interval);
        breaker.start().await;
        Ok(Self {
            breaker,
            notifier: Arc::new(Notifier::start(first)),
            prefix: settings.prefix.as_str().into(),
            lock: settings.lock,
        })
    }

    pub fn stats(&self) -> CacheStats {
        let s = &self.breaker.stats;
        CacheStats {
            up: self.breaker.is_closed(),
            hits: s.hits.load(Ordering::Relaxed),
            misses: s.misses.load(Ordering::Relaxed),
            errors: s.errors.load(Ordering::Relaxed),
            timeouts: s.timeouts.load(Ordering::Relaxed),
            skipped: s.skipped.load(Ordering::Relaxed),
            refused: s.refused.load(Ordering::Relaxed),
            watched: self.notifier.watched(),
        }
    }
}

fn token(attempt: AttemptId) -> String {
    attempt.0.simple().to_string()
}

fn millis(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
}

impl Cache for RedisCache {
    async fn lookup(&self, scope: &Scope, attempt: AttemptId, lease: Duration) -> CacheLookup {
        let keys = keys::scope_keys(&self.prefix, scope);
        let script = if self.lock {
            &scripts::LOOKUP
        } else {
            &scripts::READ
        };
        let reply = self
            .breaker
            .run("lookup", |mut conn| async move {
                script
                    .key(&keys.response)
                    .key(&keys.lock)
                    .arg(token(attempt))
                    .arg(millis(lease))
                    .invoke_async::<Vec<Value>>(&mut conn)
                    .await
            })
            .await;
        let stats = &self.breaker.stats;
        match reply.as_deref() {
            Some([Value::Int(1), Value::BulkString(bytes), Value::Int(_)])
                if codec::body_in_ledger(bytes) =>
            {
                stats.hits.fetch_add(1, Ordering::Relaxed);
                CacheLookup::InLedger
            }
            Some([Value::Int(1), Value::BulkString(bytes), Value::Int(pttl)]) => {
                match codec::decode(bytes) {
                    Some(entry) => {
                        stats.hits.fetch_add(1, Ordering::Relaxed);
                        let left = u64::try_from(*pttl).ok().map(Duration::from_millis);
                        CacheLookup::Completed(entry, left)
                    }
                    None => {
                        stats.errors.fetch_add(1, Ordering::Relaxed);
                        tracing::warn!(?scope, "undecodable cache entry; asking Postgres");
                        CacheLookup::Unavailable
                    }
                }
            }
            Some([Value::Int(2)]) => {
                stats.misses.fetch_add(1, Ordering::Relaxed);
                CacheLookup::Acquired
            }
            Some([Value::Int(5)]) => {
                stats.misses.fetch_add(1, Ordering::Relaxed);
                CacheLookup::Absent
            }
            Some([Value::Int(3), Value::Int(held)]) => {
                stats.misses.fetch_add(1, Ordering::Relaxed);
                CacheLookup::Locked {
                    held_for: Duration::from_millis(u64::try_from(*held).unwrap_or(0)),
                }
            }
            Some([Value::Int(4), reason]) => {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                tracing::debug!(?reason, "Redis refused the lock; asking Postgres");
                CacheLookup::Unavailable
            }
            Some(other) => {
                stats.errors.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(?other, "unexpected lookup reply; asking Postgres");
                CacheLookup::Unavailable
            }
            None => CacheLookup::Unavailable,
        }
    }

    async fn fill(&self, scope: &Scope, entry: &CacheEntry, ttl: Duration) {
        let key = keys::scope_keys(&self.prefix, scope).response;
        let Some(value) = codec::encode(entry) else {
            return;
        };
        self.breaker
            .run("fill", |mut conn| async move {
                redis::cmd("SET")
                    .arg(key)
                    .arg(value)
                    .arg("PX")
                    .arg(millis(ttl))
                    .query_async::<()>(&mut conn)
                    .await
            })
            .await;
    }

    async fn complete(&self, scope: &Scope, attempt: AttemptId, entry: &CacheEntry, ttl: Duration) {
        let Some(value) = codec::encode(entry) else {
            // Not cacheable: the ledger serves its replays; still unlock and announce.
            return self.unlock(scope, attempt).await;
        };
        let keys = keys::scope_keys(&self.prefix, scope);
        self.breaker
            .run("complete", |mut conn| async move {
                scripts::COMPLETE
                    .key(&keys.response)
                    .key(&keys.lock)
                    .arg(value)
                    .arg(millis(ttl))
                    .arg(token(attempt))
                    .arg(&keys.channel)
                    .invoke_async::<i64>(&mut conn)
                    .await
            })
            .await;
    }

    async fn unlock(&self, scope: &Scope, attempt: AttemptId) {
        let keys = keys::scope_keys(&self.prefix, scope);
        self.breaker
            .run("unlock", |mut conn| async move {
                scripts::UNLOCK
                    .key(&keys.lock)
                    .arg(token(attempt))
                    .arg(&keys.channel)
                    .invoke_async::<i64>(&mut conn)
                    .await
            })
            .await;
    }

    async fn changed(&self, scope: &Scope) {
        let channel = keys::scope_keys(&self.prefix, scope).channel;
        self.notifier.fired(channel).await;
    }
}
