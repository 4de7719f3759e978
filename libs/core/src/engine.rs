//! The engine: claim → execute → complete or release, over a durable [`Ledger`] and an
//! optional fast [`Cache`].
//!
//! The engine decides nothing about HTTP. It is handed a scope, a fingerprint and a
//! policy, and a closure that performs the upstream call for a given attempt; it returns
//! what happened as an [`Outcome`]. Only the ledger decides that an operation may
//! execute: the cache can turn a request away early (a replay, a live lock) but a cache
//! that says "go ahead" is always followed by the ledger's claim.
//!
//! # Why one file of ~500 lines
//! [`Engine::run`] is one state machine (cache, claim, wait, execute, complete or
//! release), and its steps share the attempt, its deadline and the cache lock it may
//! hold; split across files they would have to pass all of that around. What does not
//! share them is elsewhere already: the decision on an existing record in
//! [`crate::verdict`], the policy in [`crate::policy`], the ports in [`crate::ports`].

use std::future::Future;
use std::pin::pin;
use std::time::Duration;

use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::fingerprint::Fingerprint;
use crate::outcome::{Execution, Outcome, UnknownCause};
use crate::policy::{Disposition, Policy};
use crate::ports::{
    Cache, CacheEntry, CacheLookup, Claim, ClaimResult, Completed, Fence, Ledger, LedgerError,
    NoCache,
};
use crate::record::{AttemptId, Record, RecordState, StoredResponse};
use crate::scope::Scope;
use crate::verdict::{self, Found, RETRY_SOON, cached, in_progress, locked_out};

/// The attempt that won the claim, as handed to the upstream call.
///
/// Its lease is measured from before the claim was sent, so it never ends later than the
/// ledger's. The whole attempt fits in it: the claim, the upstream call until
/// `deadline`, and a completion, which may take one ledger op (`Ledger::op_timeout`) —
/// so the reconciler, which acts only once the ledger's lease is over, never finds an
/// attempt still running.
#[derive(Debug, Clone, Copy)]
pub struct Attempt {
    pub id: AttemptId,
    /// When the upstream call must be over (and a call not yet sent must not be): the
    /// lease's end less one ledger op, kept for recording the answer.
    pub deadline: Instant,
    /// When the lease runs out.
    pub lease_end: Instant,
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
    /// Cancelled when nobody waits for the answer any more (the client hung up): a wait
    /// for another attempt stops. What this request started (its execution, its
    /// completion) still runs to its end.
    pub gone: Option<&'a CancellationToken>,
}

/// How often a released key may be re-claimed within one request.
const MAX_CLAIM_ROUNDS: usize = 3;
/// A cache lock younger than this turns a duplicate away without asking the ledger.
/// An older one may be stale (its holder crashed, or its unlock was lost while the
/// ledger completed the row), so the ledger is asked: a stale lock over a completed row
/// must give a replay, not a 409.
const LOCK_TRUSTED_FOR: Duration = Duration::from_secs(1);
/// The longest pause between ledger reads while waiting for another attempt.
const MAX_POLL: Duration = Duration::from_millis(200);
/// The first pause before a failed completion is repeated; it doubles up to the next.
const FIRST_COMPLETION_RETRY: Duration = Duration::from_millis(25);
const MAX_COMPLETION_RETRY: Duration = Duration::from_secs(1);

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

    pub fn cache(&self) -> &C {
        &self.cache
    }

    /// Answers a request from a completed response held in this process, if there is
    /// one: a replay or a mismatch, decided without I/O. `None`: [`Engine::run`] it.
    pub fn peek<R>(&self, req: Request<'_>) -> Option<Outcome<R>> {
        self.cache
            .peek(req.scope)
            .map(|entry| cached(entry, req.fingerprint))
    }

    /// Runs one request. `execute` is called at most once, and only after the ledger
    /// granted this attempt the claim.
    pub async fn run<R, F, Fut>(
        &self,
        req: Request<'_>,
        execute: F,
    ) -> Result<Outcome<R>, LedgerError>
    where
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Execution<R>>,
    {
        let attempt = AttemptId::random();
        let mut locked = false;
        match self
            .cache
            .lookup(req.scope, attempt, req.policy.lease)
            .await
        {
            CacheLookup::Completed(entry, _) => return Ok(cached(entry, req.fingerprint)),
            CacheLookup::Locked { held_for }
                if held_for < LOCK_TRUSTED_FOR && req.wait.is_none() =>
            {
                return Ok(Outcome::InProgress {
                    retry_after: RETRY_SOON,
                    trace_context: None,
                    waited: false,
                    outcome_unknown: false,
                });
            }
            CacheLookup::Acquired => locked = true,
            CacheLookup::InLedger
            | CacheLookup::Locked { .. }
            | CacheLookup::Absent
            | CacheLookup::Unavailable => {}
        }

        let deadline = req.wait.map(|w| Instant::now() + w);
        let claim = Claim {
            scope: req.scope,
            fingerprint: req.fingerprint,
            attempt,
            lease: req.policy.lease,
            ttl: req.policy.ttl,
            trace_context: req.trace_context,
        };
        let mut execute = Some(execute);
        let mut waited = false;
        for _ in 0..MAX_CLAIM_ROUNDS {
            let claim_sent = Instant::now();
            let claimed = self.ledger.claim(&claim).await;
            if !matches!(claimed, Ok(ClaimResult::Claimed)) && std::mem::take(&mut locked) {
                self.cache.unlock(req.scope, attempt).await;
            }
            if claimed.as_ref().is_err_and(|e| !e.is_busy()) {
                // The claim may have committed with only its reply lost. Nothing was
                // executed, and the attempt token is this request's alone: free the row
                // if it is ours, so the key is not held for a request that never ran.
                self.release(req.scope, attempt).await;
            }
            let record = match claimed? {
                ClaimResult::Claimed => {
                    let execute = execute.take().expect("executed at most once");
                    let lease_end = claim_sent + req.policy.lease;
                    let attempt = Attempt {
                        id: attempt,
                        deadline: lease_end
                            .checked_sub(self.ledger.op_timeout())
                            .unwrap_or(claim_sent)
                            .max(claim_sent),
                        lease_end,
                    };
                    return Ok(self.execute(req, attempt, execute).await);
                }
                ClaimResult::Existing(record) => record,
                ClaimResult::Locked => return Ok(locked_out(waited)),
            };
            let record = match self.answer_existing(req, record, claim_sent, waited).await {
                Found::Answered(outcome) => return Ok(outcome),
                Found::Running(record) => record,
            };
            let Some(deadline) = deadline else {
                return Ok(in_progress(&record, waited));
            };
            waited = true;
            match self.wait(req, deadline, record).await? {
                Waited::Current(record, read) => {
                    match self.answer_existing(req, record, read, true).await {
                        Found::Answered(outcome) => return Ok(outcome),
                        Found::Running(record) => return Ok(in_progress(&record, true)),
                    }
                }
                // The first attempt released the key: claim it again.
                Waited::Released => continue,
            }
        }
        Ok(Outcome::InProgress {
            retry_after: RETRY_SOON,
            trace_context: None,
            waited,
            outcome_unknown: false,
        })
    }

    /// Decides what an existing record means for this request. `read` is when the
    /// statement that read it was sent: the record's remaining life was measured by the
    /// ledger no earlier than that.
    async fn answer_existing<R>(
        &self,
        req: Request<'_>,
        record: Record,
        read: Instant,
        waited: bool,
    ) -> Found<R> {
        verdict::found(
            &self.cache,
            req.scope,
            record,
            req.fingerprint,
            read,
            waited,
        )
        .await
    }

    /// Polls the ledger until the record leaves `in_progress` or the deadline passes,
    /// woken early when the cache announces a change; stops at once (with the record as
    /// last read) when the client is gone.
    async fn wait(
        &self,
        req: Request<'_>,
        deadline: Instant,
        mut last: Box<Record>,
    ) -> Result<Waited, LedgerError> {
        let mut interval = Duration::from_millis(10);
        let mut read = Instant::now();
        let gone = async {
            match req.gone {
                Some(gone) => gone.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let mut gone = pin!(gone);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if !left.is_zero() {
                let changed = pin!(self.cache.changed(req.scope));
                tokio::select! {
                    biased;
                    () = &mut gone => return Ok(Waited::Current(*last, read)),
                    _ = tokio::time::timeout(interval.min(left), changed) => {}
                }
                interval = (interval * 2).min(MAX_POLL);
            }
            read = Instant::now();
            match self.ledger.get(req.scope).await? {
                None => return Ok(Waited::Released),
                Some(record) if matches!(record.state, RecordState::InProgress { .. }) => {
                    if record.fingerprint != *req.fingerprint || Instant::now() >= deadline {
                        return Ok(Waited::Current(record, read));
                    }
                    *last = record;
                }
                Some(record) => return Ok(Waited::Current(record, read)),
            }
        }
    }

    async fn execute<R, F, Fut>(&self, req: Request<'_>, attempt: Attempt, execute: F) -> Outcome<R>
    where
        F: FnOnce(Attempt) -> Fut,
        Fut: Future<Output = Execution<R>>,
    {
        let scope = req.scope;
        match execute(attempt).await {
            Execution::Responded {
                stored,
                passthrough,
            } => match req.policy.disposition(stored.status) {
                Disposition::Keep => self.record(req, attempt, stored, passthrough).await,
                Disposition::Release => {
                    self.release(scope, attempt.id).await;
                    Outcome::Released(passthrough)
                }
                Disposition::Uncertain => {
                    self.hold(scope, attempt.id).await;
                    Outcome::Uncertain(passthrough)
                }
            },
            Execution::Declined(passthrough) => {
                self.release(scope, attempt.id).await;
                Outcome::Released(passthrough)
            }
            Execution::NotSent => {
                self.release(scope, attempt.id).await;
                Outcome::UpstreamUnavailable
            }
            // The cache lock is left to expire with the lease: the ledger holds the key.
            Execution::Unknown => Outcome::Unknown(UnknownCause::Upstream),
        }
    }

    /// Records a kept answer, then caches it. A completion that fails (pool exhausted,
    /// connection cut, statement timeout) is repeated with backoff while the lease
    /// lasts: fenced by the attempt, it is safe to repeat, and an answer the upstream
    /// gave must not be thrown away for a passing fault.
    async fn record<R>(
        &self,
        req: Request<'_>,
        attempt: Attempt,
        stored: StoredResponse,
        passthrough: R,
    ) -> Outcome<R> {
        let scope = req.scope;
        let mut pause = FIRST_COMPLETION_RETRY;
        let (completed, committing) = loop {
            let committing = Instant::now();
            match self
                .ledger
                .complete(scope, attempt.id, req.fingerprint, &stored, req.policy.ttl)
                .await
            {
                Ok(completed) => break (completed, committing),
                // Repeated only while the repeat, too, would end within the lease.
                Err(error)
                    if Instant::now() + pause + self.ledger.op_timeout() <= attempt.lease_end =>
                {
                    tracing::warn!(?scope, %error, retry_in = ?pause, "could not record the answer yet; repeating the completion within the lease");
                    tokio::time::sleep(pause).await;
                    pause = (pause * 2).min(MAX_COMPLETION_RETRY);
                }
                Err(error) => {
                    tracing::error!(?scope, %error, "could not record a completed execution within its lease; the key stays held for the reconciler");
                    return Outcome::Unknown(UnknownCause::Ledger);
                }
            }
        };
        match completed {
            Completed::Recorded { expires_at } => {
                let entry = CacheEntry {
                    fingerprint: *req.fingerprint,
                    response: stored,
                    trace_context: req.trace_context.map(str::to_owned),
                    expires_at: Some(expires_at),
                };
                // The row expires `ttl` after its commit, which came after `committing`.
                verdict::remember(
                    &self.cache,
                    scope,
                    attempt.id,
                    &entry,
                    req.policy.ttl,
                    committing,
                )
                .await;
                Outcome::Executed {
                    response: passthrough,
                    expires_at: Some(expires_at),
                }
            }
            Completed::Lost => {
                tracing::warn!(
                    ?scope,
                    "completion fenced out: the row was resolved by another party"
                );
                self.cache.unlock(scope, attempt.id).await;
                Outcome::Executed {
                    response: passthrough,
                    expires_at: None,
                }
            }
        }
    }

    /// Keeps the key in progress with its lease ended, so the reconciler probes it on
    /// its next pass. The cache lock is left to expire: the ledger holds the key.
    async fn hold(&self, scope: &Scope, attempt: AttemptId) {
        match self.ledger.hold(scope, attempt).await {
            Ok(Fence::Held) => {
                tracing::warn!(
                    ?scope,
                    "uncertain answer: key held for the reconciler's probe"
                )
            }
            Ok(Fence::Lost) => tracing::warn!(
                ?scope,
                "hold fenced out: the row was resolved by another party"
            ),
            Err(error) => {
                tracing::error!(?scope, %error, "could not mark an uncertain key for a probe; the reconciler takes it when its lease runs out")
            }
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

/// How a wait for a running record ended.
enum Waited {
    /// The record as it stands (and when the statement that read it was sent):
    /// finished, or still running at the deadline or when the client left.
    Current(Record, Instant),
    /// The record is gone: the first attempt gave the key up.
    Released,
}
