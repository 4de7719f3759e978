//! A bounded in-process cache of completed responses, in front of another [`Cache`].
//!
//! A completed result never changes until its key expires, so a copy held in memory is
//! exact as long as it never outlives the ledger row: every entry carries the
//! row-bounded TTL it was stored with (from the ledger, or Redis's `PTTL`). Only
//! completed responses live here; locks and wake-ups always go to the inner cache.
//!
//! It is bounded twice, by entries and by bytes (an honest count of what each entry
//! holds: body, headers, scope and trace context, plus bookkeeping). When either bound is
//! passed, the least recently used entries go first; a hit moves an entry to the back of
//! the eviction order, so hot keys stay. An entry bigger than [`MAX_ENTRY_BYTES`] (or
//! than the whole budget) is never held: copies in process are for hot, small replays,
//! and one large body would push out hundreds of them (it is replayed from Redis or
//! Postgres instead). Time is `tokio::time`, so tests can pause and advance it.

use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Duration;

use bytes::Bytes;
use tokio::time::Instant;

use crate::ports::{Cache, CacheEntry, CacheLookup};
use crate::record::AttemptId;
use crate::scope::Scope;

/// What one entry costs beyond its variable-length parts: the map slot, the order
/// entry, the scope's and the entry's own struct sizes (an estimate on the safe side).
const ENTRY_OVERHEAD: usize = 256;
/// Per stored header: its two vectors' headers and allocation slack.
const HEADER_OVERHEAD: usize = 48;
/// The largest entry held in process.
pub const MAX_ENTRY_BYTES: usize = 1 << 20;

/// The bounds of a [`Local`] cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Bounds {
    pub entries: usize,
    pub bytes: usize,
}

/// The in-process layer over `inner`.
#[derive(Debug)]
pub struct Local<C> {
    inner: C,
    bounds: Bounds,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    entries: HashMap<Scope, Slot>,
    /// Use order, least recent first: `tick` → scope. Exactly one item per entry.
    order: BTreeMap<u64, Scope>,
    next_tick: u64,
    bytes: usize,
}

#[derive(Debug)]
struct Slot {
    entry: CacheEntry,
    until: Instant,
    size: usize,
    tick: u64,
}

impl State {
    fn remove(&mut self, scope: &Scope) {
        if let Some(slot) = self.entries.remove(scope) {
            self.order.remove(&slot.tick);
            self.bytes -= slot.size;
        }
    }

    fn tick(&mut self) -> u64 {
        self.next_tick += 1;
        self.next_tick
    }
}

/// The bytes one entry holds in this cache.
pub fn entry_size(scope: &Scope, entry: &CacheEntry) -> usize {
    let headers: usize = entry
        .response
        .headers
        .iter()
        .map(|(n, v)| n.len() + v.len() + HEADER_OVERHEAD)
        .sum();
    ENTRY_OVERHEAD
        + entry.response.body.len()
        + headers
        + entry.trace_context.as_ref().map_or(0, String::len)
        // The scope is held twice: as the map's key and in the eviction order.
        + 2 * (scope.tenant.len() + scope.endpoint.len() + scope.key.as_str().len())
}

impl<C> Local<C> {
    pub fn new(inner: C, bounds: Bounds) -> Self {
        Self {
            inner,
            bounds,
            state: Mutex::default(),
        }
    }

    pub fn inner(&self) -> &C {
        &self.inner
    }

    /// The entry held for `scope` and how much longer it lives (never longer than its
    /// row), without asking the inner cache.
    pub fn get(&self, scope: &Scope) -> Option<(CacheEntry, Duration)> {
        let mut state = self.state.lock().expect("local cache lock");
        let (until, old_tick) = state.entries.get(scope).map(|s| (s.until, s.tick))?;
        if until <= Instant::now() {
            state.remove(scope);
            return None;
        }
        // A hit moves the entry to the back of the eviction order.
        let tick = state.tick();
        let key = state
            .order
            .remove(&old_tick)
            .expect("every entry is ordered");
        state.order.insert(tick, key);
        let slot = state.entries.get_mut(scope).expect("looked up above");
        slot.tick = tick;
        Some((
            slot.entry.clone(),
            until.saturating_duration_since(Instant::now()),
        ))
    }

    fn put(&self, scope: &Scope, entry: &CacheEntry, ttl: Duration) {
        let size = entry_size(scope, entry);
        if self.bounds.entries == 0
            || ttl.is_zero()
            || size > self.bounds.bytes.min(MAX_ENTRY_BYTES)
        {
            return;
        }
        let until = Instant::now() + ttl;
        // A compact copy: the body may be a slice of a much larger receive buffer, which
        // a shared `Bytes` would keep alive for as long as the entry lives.
        let mut entry = entry.clone();
        entry.response.body = Bytes::copy_from_slice(&entry.response.body);
        let mut state = self.state.lock().expect("local cache lock");
        state.remove(scope);
        let tick = state.tick();
        state.order.insert(tick, scope.clone());
        state.entries.insert(
            scope.clone(),
            Slot {
                entry,
                until,
                size,
                tick,
            },
        );
        state.bytes += size;
        while state.entries.len() > self.bounds.entries || state.bytes > self.bounds.bytes {
            let Some((_, oldest)) = state.order.pop_first() else {
                break;
            };
            let slot = state
                .entries
                .remove(&oldest)
                .expect("ordered entries exist");
            state.bytes -= slot.size;
        }
    }

    pub fn len(&self) -> usize {
        self.state.lock().expect("local cache lock").entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes the entries hold now (as [`entry_size`] counts them).
    pub fn bytes(&self) -> usize {
        self.state.lock().expect("local cache lock").bytes
    }
}

impl<C: Cache> Cache for Local<C> {
    async fn lookup(&self, scope: &Scope, attempt: AttemptId, lease: Duration) -> CacheLookup {
        if let Some((entry, left)) = self.get(scope) {
            return CacheLookup::Completed(entry, Some(left));
        }
        match self.inner.lookup(scope, attempt, lease).await {
            CacheLookup::Completed(entry, Some(ttl)) => {
                self.put(scope, &entry, ttl);
                CacheLookup::Completed(entry, Some(ttl))
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
        self.get(scope).map(|(entry, _)| entry)
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

    fn entry(body: usize) -> CacheEntry {
        CacheEntry {
            fingerprint: Fingerprint::from_bytes([1; 32]),
            response: StoredResponse::new(201, Vec::new(), Bytes::from(vec![b'x'; body])),
            trace_context: None,
            expires_at: None,
        }
    }

    fn local(entries: usize, bytes: usize) -> Local<NoCache> {
        Local::new(NoCache, Bounds { entries, bytes })
    }

    const HOUR: Duration = Duration::from_secs(3600);

    #[tokio::test(start_paused = true)]
    async fn serves_what_it_was_given_until_it_expires() {
        let local = local(10, 1 << 20);
        local
            .fill(&scope("a"), &entry(2), Duration::from_millis(50))
            .await;
        assert!(matches!(
            local
                .lookup(&scope("a"), AttemptId::random(), Duration::ZERO)
                .await,
            CacheLookup::Completed(..)
        ));
        assert!(matches!(
            local
                .lookup(&scope("b"), AttemptId::random(), Duration::ZERO)
                .await,
            CacheLookup::Unavailable
        ));
        tokio::time::advance(Duration::from_millis(50)).await;
        assert!(matches!(
            local
                .lookup(&scope("a"), AttemptId::random(), Duration::ZERO)
                .await,
            CacheLookup::Unavailable
        ));
        assert_eq!((local.len(), local.bytes()), (0, 0), "expired entries go");
    }

    #[tokio::test]
    async fn stays_within_its_entries_dropping_the_least_recently_used() {
        let local = local(3, 1 << 20);
        for key in ["a", "b", "c"] {
            local.fill(&scope(key), &entry(2), HOUR).await;
        }
        assert!(local.get(&scope("a")).is_some(), "a is now the most recent");
        local.fill(&scope("d"), &entry(2), HOUR).await;
        assert_eq!(local.len(), 3);
        assert!(local.get(&scope("b")).is_none(), "b was the least recent");
        for key in ["a", "c", "d"] {
            assert!(local.get(&scope(key)).is_some(), "{key}");
        }
    }

    #[tokio::test]
    async fn stays_within_its_bytes_and_counts_them_honestly() {
        let one = entry_size(&scope("a"), &entry(10_000));
        assert!(one > 10_000 && one < 10_600, "{one}");
        let local = local(1000, 3 * one);
        for key in ["a", "b", "c", "d", "e"] {
            local.fill(&scope(key), &entry(10_000), HOUR).await;
            assert!(local.bytes() <= 3 * one);
        }
        assert_eq!((local.len(), local.bytes()), (3, 3 * one));
        // Refilling one key replaces its entry: no second copy, no stale order item.
        for _ in 0..10 {
            local.fill(&scope("e"), &entry(10_000), HOUR).await;
        }
        assert_eq!((local.len(), local.bytes()), (3, 3 * one));
        assert_eq!(local.state.lock().unwrap().order.len(), 3);
        // An entry bigger than the whole budget is not held (and evicts nothing).
        local.fill(&scope("huge"), &entry(40_000), HOUR).await;
        assert!(local.get(&scope("huge")).is_none());
        assert_eq!(local.len(), 3);
    }

    #[tokio::test]
    async fn a_large_body_is_never_held_in_process_however_big_the_budget() {
        let local = local(10, 64 << 20);
        local.fill(&scope("small"), &entry(1000), HOUR).await;
        local
            .fill(&scope("large"), &entry(MAX_ENTRY_BYTES), HOUR)
            .await;
        assert!(local.get(&scope("large")).is_none());
        assert!(
            local.get(&scope("small")).is_some(),
            "and it evicted nothing"
        );
    }

    #[tokio::test]
    async fn tenants_never_share_an_entry() {
        let local = local(10, 1 << 20);
        local.fill(&scope("k"), &entry(2), HOUR).await;
        let other = Scope::new(
            "globex",
            "POST /payments",
            IdempotencyKey::parse(b"k").unwrap(),
        );
        assert!(local.get(&other).is_none());
    }
}
