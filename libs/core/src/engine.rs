//! The engine: claim → execute → complete or release, over a durable [`Ledger`] and an
//! optional fast [`Cache`].
//!
//! The engine decides nothing about HTTP. It is handed a scope, a fingerprint and a
//! policy, and a closure that performs the upstream call for a given attempt; it returns
//! what happened as an [`Outcome`]. Only the ledger decides that an operation may
//! execute: the cache can turn a request away early (a replay, a live lock) but a cache
//! that says "go ahead" is always followed by the ledger's claim.

use std::future::Future;
use std::time::{Duration, Instant};

use crate::fingerprint::Fingerprint;
use crate::policy::Policy;
use crate::record::{AttemptId, Record, RecordState, StoredResponse};
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
}

/// Whether a fenced write still held the claim.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fence {
    Held,
    /// The row no longer belongs to this attempt: nothing was changed.
    Lost,
}

/// The durable source of truth (Postgres).
pub trait Ledger: Send + Sync {
    /// Atomically claims the scope for `claim.attempt`, or returns the existing record.
    /// A record past its expiry behaves as absent: it is taken over by the claim.
    fn claim(
        &self,
        claim: &Claim<'_>,
    ) -> impl Future<Output = Result<ClaimResult, LedgerError>> + Send;

    /// Reads the live record of a scope (an expired one is `None`).
    fn get(
        &self,
        scope: &Scope,
    ) -> impl Future<Output = Result<Option<Record>, LedgerError>> + Send;

    /// Stores the response and marks the record completed, fenced by `attempt`.
    fn complete(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        response: &StoredResponse,
        ttl: Duration,
    ) -> impl Future<Output = Result<Fence, LedgerError>> + Send;

    /// Deletes an in-progress record so a retry may execute, fenced by `attempt`.
    fn release(
        &self,
        scope: &Scope,
        attempt: AttemptId,
    ) -> impl Future<Output = Result<Fence, LedgerError>> + Send;
}

/// What the fast path knows about a scope, from one round trip.
#[derive(Debug)]
pub enum CacheProbe {
    /// A completed response is cached.
    Completed {
        fingerprint: Fingerprint,
        response: StoredResponse,
        trace_context: Option<String>,
    },
    /// Another attempt holds the in-progress lock.
    Locked,
    /// The lock was taken for this attempt.
    Acquired,
    /// The cache knows nothing, or could not be asked: the ledger decides.
    Unavailable,
}

/// The fast path (Redis). Implementations swallow and count their own errors: a cache
/// failure only ever means "ask the ledger".
pub trait Cache: Send + Sync {
    fn probe(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        lease: Duration,
    ) -> impl Future<Output = CacheProbe> + Send;

    /// Caches a completed response (after the ledger committed it).
    fn fill(
        &self,
        scope: &Scope,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        trace_context: Option<&str>,
        ttl: Duration,
    ) -> impl Future<Output = ()> + Send;

    /// Drops this attempt's lock, if it still holds it.
    fn unlock(&self, scope: &Scope, attempt: AttemptId) -> impl Future<Output = ()> + Send;
}

/// No cache: every request goes to the ledger.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoCache;

impl Cache for NoCache {
    async fn probe(&self, _: &Scope, _: AttemptId, _: Duration) -> CacheProbe {
        CacheProbe::Unavailable
    }
    async fn fill(
        &self,
        _: &Scope,
        _: &Fingerprint,
        _: &StoredResponse,
        _: Option<&str>,
        _: Duration,
    ) {
    }
    async fn unlock(&self, _: &Scope, _: AttemptId) {}
}

/// What the upstream call did.
#[derive(Debug)]
pub enum Execution<R> {
    /// The upstream answered. `stored` is the response as it would be replayed;
    /// `passthrough` is what the first client gets (all its end-to-end headers).
    Responded {
        stored: StoredResponse,
        passthrough: R,
    },
    /// The request provably never reached the upstream (connection refused).
    NotSent,
    /// The upstream may or may not have acted (timeout, connection broken mid-way).
    Unknown,
}

/// One request through the engine.
#[derive(Debug, Clone, Copy)]
pub struct Request<'a> {
    pub scope: &'a Scope,
    pub fingerprint: &'a Fingerprint,
    pub policy: &'a Policy,
    /// How long the client is willing to wait for a concurrent attempt, if at all.
    pub wait: Option<Duration>,
    /// This request's W3C `traceparent`, stored with the claim.
    pub trace_context: Option<&'a str>,
}

/// Why an operation's outcome is unknown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UnknownCause {
    /// The upstream timed out or broke off after the request was sent.
    Upstream,
    /// The upstream answered but the ledger could not record it.
    Ledger,
}

/// What happened to a request.
#[derive(Debug)]
pub enum Outcome<R> {
    /// This request executed the operation and its result was kept. `recorded` is
    /// false when the fence was lost (the reconciler resolved the row meanwhile).
    Executed { response: R, recorded: bool },
    /// The upstream answered with a status the route does not keep; the key is free.
    Released(R),
    /// A completed operation's stored response.
    Replayed {
        response: StoredResponse,
        trace_context: Option<String>,
        waited: bool,
    },
    /// The key was used before with a different request.
    Mismatch { trace_context: Option<String> },
    /// Another attempt is running (or its outcome is unknown).
    InProgress {
        retry_after: Duration,
        trace_context: Option<String>,
        waited: bool,
    },
    /// The upstream could not be reached; nothing ran and the key is free.
    UpstreamUnavailable,
    /// The upstream may have acted; the key stays held for the reconciler.
    Unknown(UnknownCause),
}

impl<R> Outcome<R> {
    /// The `idempotency.outcome` name of DESIGN §8.
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Executed { .. } => "executed",
            Outcome::Replayed { .. } => "replayed",
            Outcome::Mismatch { .. } => "mismatch",
            Outcome::InProgress { .. } => "in_progress",
            Outcome::Released(_) | Outcome::UpstreamUnavailable => "released",
            Outcome::Unknown(_) => "unknown",
        }
    }
}

/// `Retry-After` while the first attempt is within its lease.
const RETRY_SOON: Duration = Duration::from_secs(1);
/// `Retry-After` once the lease has run out and the reconciler has the row.
const RETRY_LATER: Duration = Duration::from_secs(5);
/// How often a released key may be re-claimed within one request.
const MAX_CLAIM_ROUNDS: usize = 3;

/// Drives requests through a ledger and a cache.
#[derive(Debug, Clone)]
pub struct Engine<L, C = NoCache> {
    ledger: L,
    cache: C,
}

impl<L: Ledger> Engine<L, NoCache> {
    pub fn new(ledger: L) -> Self {
        Self {
            ledger,
            cache: NoCache,
        }
    }
}

impl<L: Ledger, C: Cache> Engine<L, C> {
    pub fn with_cache(ledger: L, cache: C) -> Self {
        Self { ledger, cache }
    }

    pub fn ledger(&self) -> &L {
        &self.ledger
    }

    /// Runs one request. `execute` is called at most once, and only after the ledger
    /// granted this attempt the claim.
    pub async fn run<R, F, Fut>(
        &self,
        req: Request<'_>,
        execute: F,
    ) -> Result<Outcome<R>, LedgerError>
    where
        F: FnOnce(AttemptId) -> Fut,
        Fut: Future<Output = Execution<R>>,
    {
        let attempt = AttemptId::random();
        let policy = req.policy;
        match self.cache.probe(req.scope, attempt, policy.lease).await {
            CacheProbe::Completed {
                fingerprint,
                response,
                trace_context,
            } => {
                return Ok(if fingerprint == *req.fingerprint {
                    Outcome::Replayed {
                        response,
                        trace_context,
                        waited: false,
                    }
                } else {
                    Outcome::Mismatch { trace_context }
                });
            }
            CacheProbe::Locked if req.wait.is_none() => {
                return Ok(Outcome::InProgress {
                    retry_after: RETRY_SOON,
                    trace_context: None,
                    waited: false,
                });
            }
            CacheProbe::Locked | CacheProbe::Acquired | CacheProbe::Unavailable => {}
        }

        let deadline = req.wait.map(|w| Instant::now() + w);
        let claim = Claim {
            scope: req.scope,
            fingerprint: req.fingerprint,
            attempt,
            lease: policy.lease,
            ttl: policy.ttl,
            trace_context: req.trace_context,
        };
        let mut execute = Some(execute);
        let mut waited = false;
        for _ in 0..MAX_CLAIM_ROUNDS {
            let record = match self.ledger.claim(&claim).await {
                Ok(ClaimResult::Claimed) => {
                    let execute = execute.take().expect("executed at most once");
                    return Ok(self.execute(req, attempt, execute).await);
                }
                Ok(ClaimResult::Existing(record)) => record,
                Err(e) => {
                    self.cache.unlock(req.scope, attempt).await;
                    return Err(e);
                }
            };
            self.cache.unlock(req.scope, attempt).await;
            let record = match self.settle(req, record, waited).await {
                Settled::Done(outcome) => return Ok(outcome),
                Settled::Running(record) => record,
            };
            let Some(deadline) = deadline else {
                return Ok(in_progress(&record, waited));
            };
            waited = true;
            match self.wait(req, deadline).await? {
                Waited::Settled(record) => match self.settle(req, record, true).await {
                    Settled::Done(outcome) => return Ok(outcome),
                    Settled::Running(record) => return Ok(in_progress(&record, true)),
                },
                // The first attempt released the key: claim it again.
                Waited::Released => continue,
            }
        }
        Ok(Outcome::InProgress {
            retry_after: RETRY_SOON,
            trace_context: None,
            waited,
        })
    }

    /// Decides what an existing record means for this request.
    async fn settle<R>(&self, req: Request<'_>, record: Record, waited: bool) -> Settled<R> {
        if record.fingerprint != *req.fingerprint {
            return Settled::Done(Outcome::Mismatch {
                trace_context: record.trace_context,
            });
        }
        match record.state {
            RecordState::Completed(response) => {
                self.cache
                    .fill(
                        req.scope,
                        &record.fingerprint,
                        &response,
                        record.trace_context.as_deref(),
                        req.policy.ttl,
                    )
                    .await;
                Settled::Done(Outcome::Replayed {
                    response,
                    trace_context: record.trace_context,
                    waited,
                })
            }
            RecordState::InProgress { .. } => Settled::Running(Box::new(record)),
        }
    }

    /// Polls the ledger until the record leaves `in_progress` or the deadline passes.
    async fn wait(&self, req: Request<'_>, deadline: Instant) -> Result<Waited, LedgerError> {
        let mut interval = Duration::from_millis(10);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return match self.ledger.get(req.scope).await? {
                    Some(record) => Ok(Waited::Settled(record)),
                    None => Ok(Waited::Released),
                };
            }
            tokio::time::sleep(interval.min(left)).await;
            interval = (interval * 2).min(Duration::from_millis(200));
            match self.ledger.get(req.scope).await? {
                None => return Ok(Waited::Released),
                Some(record) if matches!(record.state, RecordState::InProgress { .. }) => {
                    if record.fingerprint != *req.fingerprint {
                        return Ok(Waited::Settled(record));
                    }
                }
                Some(record) => return Ok(Waited::Settled(record)),
            }
        }
    }

    async fn execute<R, F, Fut>(
        &self,
        req: Request<'_>,
        attempt: AttemptId,
        execute: F,
    ) -> Outcome<R>
    where
        F: FnOnce(AttemptId) -> Fut,
        Fut: Future<Output = Execution<R>>,
    {
        let scope = req.scope;
        match execute(attempt).await {
            Execution::Responded {
                stored,
                passthrough,
            } if req.policy.keeps(stored.status) => {
                match self
                    .ledger
                    .complete(scope, attempt, &stored, req.policy.ttl)
                    .await
                {
                    Ok(Fence::Held) => {
                        self.cache
                            .fill(
                                scope,
                                req.fingerprint,
                                &stored,
                                req.trace_context,
                                req.policy.ttl,
                            )
                            .await;
                        self.cache.unlock(scope, attempt).await;
                        Outcome::Executed {
                            response: passthrough,
                            recorded: true,
                        }
                    }
                    Ok(Fence::Lost) => {
                        tracing::warn!(
                            ?scope,
                            "completion fenced out: the row was resolved by another party"
                        );
                        Outcome::Executed {
                            response: passthrough,
                            recorded: false,
                        }
                    }
                    Err(error) => {
                        tracing::error!(?scope, %error, "could not record a completed execution; the key stays in progress");
                        Outcome::Unknown(UnknownCause::Ledger)
                    }
                }
            }
            Execution::Responded { passthrough, .. } => {
                self.release(scope, attempt).await;
                Outcome::Released(passthrough)
            }
            Execution::NotSent => {
                self.release(scope, attempt).await;
                Outcome::UpstreamUnavailable
            }
            Execution::Unknown => Outcome::Unknown(UnknownCause::Upstream),
        }
    }

    async fn release(&self, scope: &Scope, attempt: AttemptId) {
        match self.ledger.release(scope, attempt).await {
            Ok(Fence::Held) => {}
            Ok(Fence::Lost) => tracing::warn!(
                ?scope,
                "release fenced out: the row was resolved by another party"
            ),
            Err(error) => {
                tracing::error!(?scope, %error, "could not release a key; it stays held until the reconciler resolves it");
            }
        }
        self.cache.unlock(scope, attempt).await;
    }
}

enum Settled<R> {
    Done(Outcome<R>),
    Running(Box<Record>),
}

enum Waited {
    Settled(Record),
    Released,
}

fn in_progress<R>(record: &Record, waited: bool) -> Outcome<R> {
    let lease_expired = matches!(
        record.state,
        RecordState::InProgress {
            lease_expired: true
        }
    );
    Outcome::InProgress {
        retry_after: if lease_expired {
            RETRY_LATER
        } else {
            RETRY_SOON
        },
        trace_context: record.trace_context.clone(),
        waited,
    }
}
