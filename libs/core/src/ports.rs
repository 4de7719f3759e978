//! The two stores the engine talks to: the durable [`Ledger`] (Postgres) and the fast
//! [`Cache`] (Redis). Adapters implement these; the engine never sees SQL or Redis.

use std::future::Future;
use std::time::{Duration, SystemTime};

use crate::fingerprint::Fingerprint;
use crate::record::{AttemptId, Record, StoredResponse};
use crate::scope::Scope;

/// An error of the durable ledger (connection lost, timeout, ...). Opaque on purpose:
/// the cause is logged where it is handled and never shown to clients.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
pub struct LedgerError(#[from] pub Box<dyn std::error::Error + Send + Sync>);

impl LedgerError {
    pub fn new(e: impl std::error::Error + Send + Sync + 'static) -> Self {
        Self(Box::new(e))
    }

    /// The ledger turned the call away without writing anything, to bound its memory
    /// ([`Busy`]): the request may simply be tried again.
    pub fn busy(why: Busy) -> Self {
        Self::new(why)
    }

    pub fn is_busy(&self) -> bool {
        self.0.is::<Busy>()
    }
}

/// A call the ledger refused before doing anything: answering it would hold more stored
/// bodies in memory than it may (`server.max_replay_bytes_in_flight`).
#[derive(Debug, Clone, thiserror::Error)]
#[error("{needed} bytes of stored answers would be held beyond the {budget}-byte budget")]
pub struct Busy {
    pub needed: usize,
    pub budget: usize,
}

/// A request for a claim.
#[derive(Debug, Clone, Copy)]
pub struct Claim<'a> {
    pub scope: &'a Scope,
    pub fingerprint: &'a Fingerprint,
    pub attempt: AttemptId,
    pub lease: Duration,
    pub ttl: Duration,
    pub trace_context: Option<&'a str>,
}

/// What a claim found.
#[derive(Debug)]
pub enum ClaimResult {
    /// This attempt owns the operation and must execute it.
    Claimed,
    /// Another attempt owns (or owned) it.
    Existing(Record),
    /// Another transaction holds the key uncommitted (an embedded-mode request still
    /// running, or a claim still committing) past the ledger's lock wait: in progress,
    /// with nothing to read of it yet.
    Locked,
}

/// Whether a fenced write still held the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    Held,
    /// The row no longer belongs to this attempt: nothing was changed.
    Lost,
}

/// What a fenced completion did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Completed {
    /// The answer is recorded; the ledger forgets it at `expires_at` (by its own clock).
    Recorded { expires_at: SystemTime },
    /// The row no longer belongs to this attempt: nothing was changed.
    Lost,
}

impl Completed {
    /// Whether the completion still held the claim.
    pub fn fence(self) -> Fence {
        match self {
            Self::Recorded { .. } => Fence::Held,
            Self::Lost => Fence::Lost,
        }
    }
}

/// The durable source of truth (Postgres). Only the ledger decides that an operation
/// may execute.
pub trait Ledger: Send + Sync {
    /// The longest one call may take, its statement's run on the server included: an
    /// attempt leaves this much of its lease for recording its result.
    fn op_timeout(&self) -> std::time::Duration;

    /// Atomically claims the scope for `claim.attempt`, or returns the existing record.
    /// A completed record past its expiry behaves as absent: it is taken over by the
    /// claim. An in-progress record never expires.
    fn claim(
        &self,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimResult, LedgerError>> + Send;

    /// Reads the live record of a scope (an expired completed one is `None`).
    fn get(
        &self,
        scope: &Scope,
    ) -> impl Future<Output = Result<Option<Record>, LedgerError>> + Send;

    /// Stores the response and marks the record completed, fenced by `attempt`; the
    /// record expires `ttl` after the ledger's clock at the write. `fingerprint` is the
    /// claim's: a ledger that finds the record absent (lost by a failover, not taken by
    /// another attempt) may write it back whole.
    fn complete(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<Completed, LedgerError>> + Send;

    /// Deletes an in-progress record so a retry may execute, fenced by `attempt`.
    fn release(
        &self,
        scope: &Scope,
        attempt: AttemptId,
    ) -> impl Future<Output = Result<Fence, LedgerError>> + Send;

    /// Ends `attempt`'s lease now, keeping the record in progress: the upstream may
    /// have acted (an uncertain answer), so the reconciler is to ask it at once.
    fn hold(
        &self,
        scope: &Scope,
        attempt: AttemptId,
    ) -> impl Future<Output = Result<Fence, LedgerError>> + Send;
}

/// A completed operation as the cache holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheEntry {
    pub fingerprint: Fingerprint,
    pub response: StoredResponse,
    pub trace_context: Option<String>,
    /// When the ledger forgets the record (`Idempotency-Expires`), if known.
    pub expires_at: Option<SystemTime>,
}

/// What the fast path knows about a scope, from one round trip.
#[derive(Debug)]
pub enum CacheLookup {
    /// A completed response is cached, for at most this much longer (when known).
    Completed(CacheEntry, Option<Duration>),
    /// The operation is completed, but its answer is too large for the fast path: only
    /// the ledger has it (no lock was taken).
    InLedger,
    /// Another attempt took the in-progress lock `held_for` ago.
    Locked { held_for: Duration },
    /// The lock was taken for this attempt.
    Acquired,
    /// No answer is cached, and no lock was taken (`redis.lock = false`): the ledger
    /// decides.
    Absent,
    /// The cache could not be asked (down, slow, circuit open): the ledger decides.
    Unavailable,
}

/// The fast path (Redis). Implementations swallow and count their own errors: a cache
/// failure only ever means "ask the ledger". Nothing a cache says can make an operation
/// execute; at most it can turn a request away early.
pub trait Cache: Send + Sync {
    /// One round trip: the cached response, or the lock's state (taking it if free).
    fn lookup(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        lease: Duration,
    ) -> impl Future<Output = CacheLookup> + Send;

    /// Caches a completed response read from the ledger. `ttl` must not outlive the row.
    fn fill(
        &self,
        scope: &Scope,
        entry: &CacheEntry,
        ttl: Duration,
    ) -> impl Future<Output = ()> + Send;

    /// After the ledger committed this attempt's result: cache it, drop the attempt's
    /// lock and wake waiting retries, in one round trip where possible.
    fn complete(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        entry: &CacheEntry,
        ttl: Duration,
    ) -> impl Future<Output = ()> + Send;

    /// Drops this attempt's lock (if it still holds it) and wakes waiting retries.
    fn unlock(&self, scope: &Scope, attempt: AttemptId) -> impl Future<Output = ()> + Send;

    /// Resolves when the scope may have changed (a completion or release was announced).
    /// A cache that cannot tell never resolves; the engine polls the ledger anyway.
    fn changed(&self, scope: &Scope) -> impl Future<Output = ()> + Send;

    /// A completed response held in this process, if any: no I/O and no side effect
    /// (unlike [`Cache::lookup`], which may take a lock).
    fn peek(&self, _scope: &Scope) -> Option<CacheEntry> {
        None
    }
}

/// No cache: every request goes to the ledger.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCache;

impl Cache for NoCache {
    async fn lookup(&self, _: &Scope, _: AttemptId, _: Duration) -> CacheLookup {
        CacheLookup::Unavailable
    }
    async fn fill(&self, _: &Scope, _: &CacheEntry, _: Duration) {}
    async fn complete(&self, _: &Scope, _: AttemptId, _: &CacheEntry, _: Duration) {}
    async fn unlock(&self, _: &Scope, _: AttemptId) {}
    async fn changed(&self, _: &Scope) {
        std::future::pending::<()>().await
    }
}

/// Either a cache or none, chosen at start-up (`[redis]` present or not).
#[derive(Debug, Clone)]
pub enum MaybeCache<C> {
    Some(C),
    None,
}

impl<C: Cache> Cache for MaybeCache<C> {
    async fn lookup(&self, scope: &Scope, attempt: AttemptId, lease: Duration) -> CacheLookup {
        match self {
            Self::Some(c) => c.lookup(scope, attempt, lease).await,
            Self::None => CacheLookup::Unavailable,
        }
    }
    async fn fill(&self, scope: &Scope, entry: &CacheEntry, ttl: Duration) {
        if let Self::Some(c) = self {
            c.fill(scope, entry, ttl).await;
        }
    }
    async fn complete(&self, scope: &Scope, attempt: AttemptId, entry: &CacheEntry, ttl: Duration) {
        if let Self::Some(c) = self {
            c.complete(scope, attempt, entry, ttl).await;
        }
    }
    async fn unlock(&self, scope: &Scope, attempt: AttemptId) {
        if let Self::Some(c) = self {
            c.unlock(scope, attempt).await;
        }
    }
    fn peek(&self, scope: &Scope) -> Option<CacheEntry> {
        match self {
            Self::Some(c) => c.peek(scope),
            Self::None => None,
        }
    }
    async fn changed(&self, scope: &Scope) {
        match self {
            Self::Some(c) => c.changed(scope).await,
            Self::None => std::future::pending::<()>().await,
        }
    }
}
