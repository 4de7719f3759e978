//! A bounded in-process cache of completed responses, in front of another [`Cache`].
//!
//! A completed result never changes until its key expires, so a copy held in memory is
//! exact as long as it never outlives the ledger row: every entry carries the
//! row-bounded TTL it was stored with (from the ledger, or Redis's `PTTL`). Only
//! completed responses live here; locks and wake-ups always go to the inner cache.
//! When full, the oldest entries are dropped first.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use bytes::Bytes;

use crate::ports::{Cache, CacheEntry, CacheProbe};
use crate::record::AttemptId;
use crate::scope::Scope;

/// The in-process layer over `inner`.
#[derive(Debug)]
pub struct Local<C> {
    inner: C,
    capacity: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<Scope, (CacheEntry, Instant)>,
    /// Insertion order, for dropping the oldest when full.
    order: VecDeque<Scope>,
}

impl<C> Local<C> {
    /// Holds at most `capacity` responses.
    pub fn new(inner: C, capacity: usize) -> Self {
        Self {
            inner,
            capacity,
            state: Mutex::default(),
        }
    }

    pub fn inner(&self) -> &C {
        &self.inner
    }

    fn get(&self, scope: &Scope) -> Option<CacheEntry> {
        let mut state = self.state.lock().expect("local cache lock");
        match state.entries.get(scope) {
            Some((entry, until)) if *until > Instant::now() => Some(entry.clone()),
            Some(_) => {
                state.entries.remove(scope);
                None
            }
            None => None,
        }
    }

    fn put(&self, scope: &Scope, entry: &CacheEntry, ttl: Duration) {
        if self.capacity == 0 || ttl.is_zero() {
            return;
        }
        let until = Instant::now() + ttl;
        // A compact copy: the body may be a slice of a much larger receive buffer, which
        // a shared `Bytes` would keep alive for as long as the entry lives.
        let mut entry = entry.clone();
        entry.response.body = Bytes::copy_from_slice(&entry.response.body);
        let mut state = self.state.lock().expect("local cache lock");
        if state
            .entries
            .insert(scope.clone(), (entry, until))
            .is_none()
        {
            state.order.push_back(scope.clone());
        }
        while state.entries.len() > self.capacity {
            match state.order.pop_front() {
                Some(oldest) => {
                    state.entries.remove(&oldest);
                }
                None => break,
            }
        }
        // Keep the order queue from growing with keys that were already evicted.
        if state.order.len() > self.capacity * 2 {
            let State { entries, order } = &mut *state;
            order.retain(|s| entries.contains_key(s));
        }
    }

    pub fn len(&self) -> usize {
        self.state.lock().expect("local cache lock").entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl<C: Cache> Cache for Local<C> {
    async fn probe(&self, scope: &Scope, attempt: AttemptId, lease: Duration) -> CacheProbe {
        if let Some(entry) = self.get(scope) {
            return CacheProbe::Completed(entry, None);
        }
        match self.inner.probe(scope, attempt, lease).await {
            CacheProbe::Completed(entry, Some(ttl)) => {
                self.put(scope, &entry, ttl);
                CacheProbe::Completed(entry, Some(ttl))
            }
            other => other,
        }
    }

    async fn fill(&self, scope: &Scope, entry: &CacheEntry, ttl: Duration) {
        self.put(scope, entry, ttl);
        self.inner.fill(scope, entry, ttl).await;
    }

    async fn complete(&self, scope: &Scope, attempt: AttemptId, entry: &CacheEntry, ttl: Duration) {
        self.put(scope, entry, ttl);
        self.inner.complete(scope, attempt, entry, ttl).await;
    }

    async fn unlock(&self, scope: &Scope, attempt: AttemptId) {
        self.inner.unlock(scope, attempt).await;
    }

    async fn changed(&self, scope: &Scope) {
        self.inner.changed(scope).await;
    }

    fn peek(&self, scope: &Scope) -> Option<CacheEntry> {
        self.get(scope)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fingerprint::Fingerprint;
    use crate::key::IdempotencyKey;
    use crate::ports::NoCache;
    use crate::record::StoredResponse;

    fn scope(key: &str) -> Scope {
        Scope::new(
            "acme",
            "POST /payments",
            IdempotencyKey::parse(key.as_bytes()).unwrap(),
        )
    }

    fn entry() -> CacheEntry {
        CacheEntry {
            fingerprint: Fingerprint::from_bytes([1; 32]),
            response: StoredResponse {
                status: 201,
                headers: Vec::new(),
                body: Bytes::from_static(b"{}"),
            },
            trace_context: None,
        }
    }

    #[tokio::test]
    async fn serves_what_it_was_given_until_it_expires() {
        let local = Local::new(NoCache, 10);
        local
            .fill(&scope("a"), &entry(), Duration::from_millis(50))
            .await;
        assert!(matches!(
            local
                .probe(&scope("a"), AttemptId::random(), Duration::ZERO)
                .await,
            CacheProbe::Completed(..)
        ));
        assert!(matches!(
            local
                .probe(&scope("b"), AttemptId::random(), Duration::ZERO)
                .await,
            CacheProbe::Unavailable
        ));
        tokio::time::sleep(Duration::from_millis(60)).await;
        assert!(matches!(
            local
                .probe(&scope("a"), AttemptId::random(), Duration::ZERO)
                .await,
            CacheProbe::Unavailable
        ));
    }

    #[tokio::test]
    async fn stays_within_its_capacity_dropping_the_oldest() {
        let local = Local::new(NoCache, 3);
        for key in ["a", "b", "c", "d"] {
            local
                .fill(&scope(key), &entry(), Duration::from_secs(60))
                .await;
        }
        assert_eq!(local.len(), 3);
        assert!(local.get(&scope("a")).is_none());
        assert!(local.get(&scope("d")).is_some());
    }

    #[tokio::test]
    async fn tenants_never_share_an_entry() {
        let local = Local::new(NoCache, 10);
        local
            .fill(&scope("k"), &entry(), Duration::from_secs(60))
            .await;
        let other = Scope::new(
            "globex",
            "POST /payments",
            IdempotencyKey::parse(b"k").unwrap(),
        );
        assert!(local.get(&other).is_none());
    }
}
