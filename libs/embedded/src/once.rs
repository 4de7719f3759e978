//! One execution of a keyed operation: the claim, the operation's writes and its stored
//! result in one transaction.
//!
//! [`run`] is the engine both entries share: [`Idempotency::once`](crate::Idempotency::once)
//! for a job without HTTP (a queue's message), and the HTTP layer, whose handler is the
//! operation and whose answer the result. For one key:
//!
//! 1. a completed result held in this process is replayed at once;
//! 2. the key's turn in this process (`gate.rs`): a duplicate of a key this process is
//!    running waits in memory (at most `lock_wait`, then in progress), holding no
//!    connection;
//! 3. `BEGIN`, then the gateway's claim on the transaction, waiting on another
//!    transaction's uncommitted claim of the key for `FIRST_LOCK_WAIT` (20 ms) — beyond it
//!    on one of `max_lock_waits` connections for the rest of `lock_wait`, or not at all. A
//!    live record answers as at the gateway (replay, mismatch, in progress), decided by
//!    [`idem_core::verdict`]; a first that rolled back leaves the key to claim;
//! 4. the operation runs with the transaction (in a [`Slot`], from which a [`Tx`] takes
//!    it) and says how it ends: its result stored and committed, or everything rolled back
//!    and the key left free;
//! 5. the commit. One whose acknowledgement was lost is an unknown outcome: a retry finds
//!    the committed record, or none.

use std::convert::Infallible;
use std::future::Future;
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::HeaderMap;
use idem_core::fingerprint::BodyKind;
use idem_core::verdict;
use idem_core::{
    AttemptId, Cache, CacheEntry, Claim, ClaimResult, Completed, Fingerprint, IdempotencyKey,
    Outcome, Scope, StoredResponse, Verdict,
};
use idem_http::Problem;
use idem_postgres::ledger::in_tx;
use idem_telemetry::{failpoint, propagation};
use sqlx::{Connection, Postgres, Transaction};
use tokio::time::Instant;
use tracing::Span;

use crate::answer::record_outcome;
use crate::gate::Entry;
use crate::tx::{Slot, Tx};
use crate::{Idempotency, Shared};

/// How the operation ends, decided by its caller once it has run.
pub(crate) enum Finish<C, B> {
    /// Store this result with the record and commit; `C` is handed back after the commit.
    Commit(StoredResponse, C),
    /// Roll everything back: nothing of the operation is kept and the key is free; `B` is
    /// handed back.
    RollBack(B),
}

/// What one [`run`] came to.
pub(crate) enum Run<C, B> {
    /// Decided without running the operation: a replay, a mismatch, in progress.
    Answered(Outcome<Infallible>),
    /// The operation ran and committed with its result, kept until `expires_at`.
    Committed { expires_at: SystemTime, carry: C },
    /// The operation ran and was rolled back.
    RolledBack(B),
}

/// Runs `operation` at most once for `scope` (see the module's steps). `operation` gets the
/// transaction in a [`Slot`] and the attempt's token, and must have given the transaction
/// back to the slot (a dropped [`Tx`] does) by the time it returns.
pub(crate) async fn run<C, B, F, Fut>(
    shared: &Shared,
    scope: &Scope,
    fingerprint: Fingerprint,
    trace_context: Option<String>,
    operation: F,
) -> Result<Run<C, B>, Problem>
where
    F: FnOnce(Slot, AttemptId) -> Fut,
    Fut: Future<Output = Result<Finish<C, B>, Problem>>,
{
    let options = &shared.settings;
    if let Some((entry, _)) = shared.replays.get(scope) {
        return Ok(Run::Answered(verdict::cached(entry, &fingerprint)));
    }

    // Duplicates of a key this process is running wait for it here, holding no pooled
    // connection; the key's turn is held until this run's transaction ends.
    let deadline = Instant::now() + options.lock_wait;
    let _turn = loop {
        match shared.gates.enter(scope) {
            Entry::Turn(turn) => break turn,
            Entry::Busy(done) => {
                if tokio::time::timeout_at(deadline, done).await.is_err() {
                    return Ok(Run::Answered(verdict::locked_out(false)));
                }
                // The first committed a result this process now holds, or went away.
                if let Some((entry, _)) = shared.replays.get(scope) {
                    return Ok(Run::Answered(verdict::cached(entry, &fingerprint)));
                }
            }
        }
    };

    let begun = Instant::now();
    let attempt = AttemptId::random();
    let claim = Claim {
        scope,
        fingerprint: &fingerprint,
        attempt,
        // Nobody sees the claim before it commits completed, so no reconciler ever
        // judges this lease; it is the lock wait's, for the record.
        lease: options.lock_wait,
        ttl: options.ttl,
        trace_context: trace_context.as_deref(),
    };
    let (tx, claimed) = match claim_on(shared, &claim, None).await? {
        (tx, ClaimResult::Locked) => {
            // Another process's run (or a gateway's statement) holds the key: wait for it
            // on one of the few connections set aside for such waits, or not at all.
            drop(tx);
            let left = deadline.saturating_duration_since(Instant::now());
            let Ok(_waiting) = shared.lock_waits.try_acquire() else {
                return Ok(Run::Answered(verdict::locked_out(false)));
            };
            if left.is_zero() {
                return Ok(Run::Answered(verdict::locked_out(false)));
            }
            claim_on(shared, &claim, Some(left)).await?
        }
        claimed => claimed,
    };
    let read = Instant::now();
    match claimed {
        ClaimResult::Claimed => {}
        ClaimResult::Existing(record) => {
            let mut tx = tx;
            if record_bytes(&record) > LARGE {
                tx.shrink_buffers();
            }
            drop(tx);
            let verdict = Verdict::of(record, &fingerprint);
            return Ok(Run::Answered(existing(shared, scope, verdict, read).await));
        }
        // The first run's claim is still uncommitted after `lock_wait`.
        ClaimResult::Locked => return Ok(Run::Answered(verdict::locked_out(false))),
    }

    let slot = Slot::new(tx);
    let finish = operation(slot.clone(), attempt).await?;
    slot.given_back(scope)?;
    let mut tx = slot.take().expect("given back: the slot holds it");
    let (stored, carry) = match finish {
        Finish::RollBack(carry) => {
            if let Err(error) = tx.rollback().await {
                // The connection is closed with it: Postgres rolls back on its own.
                tracing::warn!(?scope, %error, "could not roll back; the connection is dropped");
            }
            record_outcome("released");
            return Ok(Run::RolledBack(carry));
        }
        Finish::Commit(stored, carry) => (stored, carry),
    };

    let completed = in_tx::complete(&mut tx, scope, attempt, &fingerprint, &stored, options.ttl);
    let expires_at = match completed.await {
        Ok(Completed::Recorded { expires_at }) => expires_at,
        Ok(Completed::Lost) => {
            // No one else can see the uncommitted claim: this cannot happen.
            tracing::error!(?scope, "the claim vanished inside its own transaction");
            return Err(Problem::Internal);
        }
        Err(error) => return Err(unavailable(scope, "complete", &error)),
    };
    if stored.body.len() > LARGE {
        // Its buffers grew to the body's size: back to their usual size before the
        // connection returns to the pool.
        tx.shrink_buffers();
    }
    failpoint::stop_here("embedded-before-commit");
    if let Err(error) = tx.commit().await {
        return Err(if in_tx::rolled_back(&error) {
            tracing::error!(?scope, %error, "the commit was refused; nothing was kept");
            record_outcome("error");
            Problem::LedgerUnavailable
        } else {
            tracing::error!(?scope, %error, "the commit's answer was lost; it may have committed");
            record_outcome("unknown");
            Problem::OutcomeUnrecorded
        });
    }
    record_outcome("executed");
    failpoint::stop_here("embedded-after-commit");
    let entry = CacheEntry {
        fingerprint,
        response: stored,
        trace_context,
        expires_at: Some(expires_at),
    };
    // The row expires `ttl` after its transaction began (Postgres's `now()`), which
    // was after `begun`.
    let left = options.ttl.saturating_sub(begun.elapsed());
    if !entry.response.body_omitted {
        shared.replays.fill(scope, &entry, left).await;
    }
    Ok(Run::Committed { expires_at, carry })
}

/// What a live record found by the claim comes to. `read`: when the statement that read
/// it was answered, to hold a copy no longer than the row lives.
async fn existing(
    shared: &Shared,
    scope: &Scope,
    verdict: Verdict,
    read: Instant,
) -> Outcome<Infallible> {
    match verdict.decide(read.elapsed(), false) {
        verdict::Decision::Replay {
            entry,
            keep_for,
            waited,
        } => {
            if let Some(left) = keep_for
                && !entry.response.body_omitted
            {
                shared.replays.fill(scope, &entry, left).await;
            }
            verdict::replayed(entry, waited)
        }
        verdict::Decision::Answer(outcome) => outcome,
        verdict::Decision::Running(record) => verdict::in_progress(&record, false),
    }
}

/// Begins the run's transaction and claims the key on it, waiting on another
/// transaction's claim of the key at most [`FIRST_LOCK_WAIT`] (or `wait`); the
/// transaction keeps `lock_wait` as its lock timeout for the operation.
async fn claim_on(
    shared: &Shared,
    claim: &Claim<'_>,
    wait: Option<Duration>,
) -> Result<(Transaction<'static, Postgres>, ClaimResult), Problem> {
    let begin = match wait {
        None => shared.begin.clone(),
        Some(wait) => begin_waiting(wait),
    };
    let mut tx = shared
        .pool
        .begin_with(sqlx::AssertSqlSafe(begin))
        .await
        .map_err(|error| unavailable(claim.scope, "begin", &error))?;
    let claimed = in_tx::claim(&mut tx, claim, shared.settings.lock_wait, &shared.bodies)
        .await
        .map_err(|error| {
            if error.is_busy() {
                // A large stored result would go past `max_replay_bytes_in_flight`.
                tracing::warn!(scope = ?claim.scope, %error, "refused: too many stored answers in flight");
                Problem::Overloaded
            } else {
                unavailable(claim.scope, "claim", &error)
            }
        })?;
    Ok((tx, claimed))
}

/// How long a claim first waits on another transaction's claim of its key: longer than a
/// gateway's statement holds one, far shorter than another run's operation does.
pub(crate) const FIRST_LOCK_WAIT: Duration = Duration::from_millis(20);

/// The statement that begins a run's transaction, its claim waiting at most `wait`.
pub(crate) fn begin_waiting(wait: Duration) -> String {
    format!(
        "BEGIN; SET LOCAL lock_timeout = '{}ms'",
        wait.as_millis().max(1)
    )
}

/// A result this large leaves the connection that carried it with its buffers shrunk back.
const LARGE: usize = 1 << 20;

fn record_bytes(record: &idem_core::Record) -> usize {
    match &record.state {
        idem_core::RecordState::Completed(response) => response.body.len(),
        idem_core::RecordState::InProgress { .. } => 0,
    }
}

/// The ledger could not be used before anything was committed: nothing happened.
fn unavailable(scope: &Scope, step: &str, error: &dyn std::fmt::Display) -> Problem {
    tracing::error!(?scope, step, %error, "the idempotency ledger is unavailable; nothing was executed");
    Problem::LedgerUnavailable
}

// --- jobs without HTTP: Idempotency::once ----------------------------------------------

/// One logical operation to run at most once: a queue message, say. Its scope is (tenant,
/// endpoint, key) as for an HTTP request — `endpoint` names the source, e.g.
/// `"stream:payments"` — and the payload is fingerprinted byte for byte: the same key with
/// another payload is [`OnceError::Mismatch`].
#[derive(Debug, Clone)]
pub struct Job {
    tenant: String,
    endpoint: String,
    key: String,
    payload: Bytes,
}

impl Job {
    /// The job's fields are checked by [`Idempotency::once`] (the gateway's rules for a
    /// tenant and an `Idempotency-Key`), which refuses a bad one with
    /// [`OnceError::Invalid`] and runs nothing.
    pub fn new(tenant: &str, endpoint: &str, key: &str, payload: &[u8]) -> Self {
        Self {
            tenant: tenant.to_owned(),
            endpoint: endpoint.to_owned(),
            key: key.to_owned(),
            payload: Bytes::copy_from_slice(payload),
        }
    }

    pub fn tenant(&self) -> &str {
        &self.tenant
    }

    pub fn endpoint(&self) -> &str {
        &self.endpoint
    }

    pub fn key(&self) -> &str {
        &self.key
    }

    pub fn payload(&self) -> &Bytes {
        &self.payload
    }

    fn scope(&self) -> Result<Scope, String> {
        if !idem_auth::valid_tenant(&self.tenant) {
            return Err(format!(
                "the tenant {:?} is not 1 to 255 printable ASCII characters without spaces",
                self.tenant
            ));
        }
        if self.endpoint.is_empty() {
            return Err("the endpoint is empty".into());
        }
        let key = IdempotencyKey::parse(self.key.as_bytes())
            .map_err(|error| format!("the key {:?}: {error}", self.key))?;
        Ok(Scope::new(
            self.tenant.as_str(),
            self.endpoint.as_str(),
            key,
        ))
    }
}

/// An operation's result, stored with its record and given back to every redelivery: a
/// status (HTTP's codes, or the consumer's own) and a body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stored {
    status: u16,
    body: Bytes,
    json: bool,
}

impl Stored {
    /// A result with an opaque body.
    pub fn new(status: u16, body: impl Into<Bytes>) -> Self {
        Self {
            status,
            body: body.into(),
            json: false,
        }
    }

    /// A result whose body is `value` as JSON (stored with `content-type:
    /// application/json`, as an HTTP answer would be).
    pub fn json<T: serde::Serialize + ?Sized>(
        status: u16,
        value: &T,
    ) -> Result<Self, serde_json::Error> {
        Ok(Self {
            status,
            body: serde_json::to_vec(value)?.into(),
            json: true,
        })
    }

    pub fn status(&self) -> u16 {
        self.status
    }

    pub fn body(&self) -> &Bytes {
        &self.body
    }

    /// The body read back as JSON.
    pub fn parse<T: serde::de::DeserializeOwned>(&self) -> Result<T, serde_json::Error> {
        serde_json::from_slice(&self.body)
    }

    /// The record's result: kept whole up to `limit` bytes (`max_response_bytes`), beyond
    /// it without its body — redeliveries then get [`OnceError::NotKept`].
    fn to_stored(&self, limit: usize) -> StoredResponse {
        let headers = if self.json {
            vec![("content-type".to_owned(), b"application/json".to_vec())]
        } else {
            Vec::new()
        };
        let mut stored = StoredResponse::new(self.status, headers, self.body.clone());
        if self.body.len() > limit {
            stored.body = Bytes::new();
            stored.body_omitted = true;
        }
        stored
    }

    fn of(stored: StoredResponse) -> Self {
        let json = stored
            .headers
            .iter()
            .any(|(name, value)| name == "content-type" && value.starts_with(b"application/json"));
        Self {
            status: stored.status,
            body: stored.body,
            json,
        }
    }
}

/// What [`Idempotency::once`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Once {
    /// The operation ran here, and its result committed with its writes.
    Ran(Stored),
    /// The key's operation had run before (or ran meanwhile elsewhere): its stored result,
    /// and nothing ran here.
    Replayed(Stored),
}

impl Once {
    /// The result, however it came.
    pub fn stored(&self) -> &Stored {
        match self {
            Self::Ran(stored) | Self::Replayed(stored) => stored,
        }
    }
}

/// Why [`Idempotency::once`] ran nothing, or kept nothing of what it ran.
#[derive(Debug, thiserror::Error)]
pub enum OnceError<E> {
    /// The job's tenant, endpoint or key breaks the rules; nothing was claimed.
    #[error("the job is invalid: {0}")]
    Invalid(String),
    /// The key was used before with another payload; nothing ran.
    #[error("the key was used before with another payload")]
    Mismatch,
    /// Another run of the key holds it (uncommitted) past `lock_wait`; nothing ran. Try
    /// again after `retry_after` (a message left unacknowledged is redelivered).
    #[error("another run of the key is in progress; retry after {retry_after:?}")]
    InProgress { retry_after: Duration },
    /// The key's operation ran once, but its result was larger than `max_response_bytes`
    /// and was committed without its body.
    #[error("the key's operation ran, but its result was too large to keep")]
    NotKept,
    /// The operation failed: everything it wrote was rolled back and the key is free.
    #[error("the operation failed and was rolled back: {0}")]
    Failed(E),
    /// Postgres could not be used, or refused the commit: nothing was kept (the
    /// operation may have run and been rolled back; what it did outside the transaction
    /// stays done). The key is free.
    #[error("the idempotency ledger is unavailable; nothing was kept")]
    Unavailable,
    /// The commit's acknowledgement was lost: it may have committed. A retry finds the
    /// committed record (and replays it), or none (and runs).
    #[error("the commit's outcome is unknown; retry to learn it")]
    OutcomeUnknown,
    /// Too many large stored results are being read at once; nothing ran. Try again.
    #[error("too many large stored results in flight; nothing was run")]
    Overloaded,
    /// A defect (the operation kept its `Tx` after returning): nothing was kept.
    #[error("internal error; nothing was kept")]
    Internal,
}

impl<E> OnceError<E> {
    fn of(problem: Problem) -> Self {
        match problem {
            Problem::LedgerUnavailable => Self::Unavailable,
            Problem::OutcomeUnrecorded => Self::OutcomeUnknown,
            Problem::Overloaded => Self::Overloaded,
            _ => Self::Internal,
        }
    }
}

impl Idempotency {
    /// Runs `operation` at most once for `job`'s key: the claim, everything `operation`
    /// writes through its [`Tx`] and the [`Stored`] result it returns commit together, or
    /// not at all. A redelivery of the job finds the committed record and gets
    /// [`Once::Replayed`] without running `operation`; a concurrent duplicate waits for the
    /// first up to `lock_wait`, then replays (or runs, if the first rolled back), else
    /// [`OnceError::InProgress`]. `operation`'s error rolls everything back and leaves the
    /// key free ([`OnceError::Failed`]).
    ///
    /// Acknowledge a queue's message only once this returns `Ok` (or an error that says
    /// the message is done: [`OnceError::Mismatch`], [`OnceError::Invalid`]).
    pub async fn once<E, F, Fut>(&self, job: Job, operation: F) -> Result<Once, OnceError<E>>
    where
        F: FnOnce(Tx) -> Fut,
        Fut: Future<Output = Result<Stored, E>>,
    {
        let shared = &*self.shared;
        let scope = job.scope().map_err(OnceError::Invalid)?;
        let fingerprint = shared
            .fingerprints
            .compute("JOB", &job.endpoint, BodyKind::Raw, &job.payload, ())
            .await
            .map_err(|_| OnceError::Internal)?;
        let span = Span::current();
        let trace_context = propagation::trace_context(&span, &HeaderMap::new());
        let limit = shared.settings.max_response_bytes;
        let ran = run(shared, &scope, fingerprint, trace_context, |slot, _| {
            let tx = Tx::in_slot(slot);
            async move {
                Ok(match operation(tx).await {
                    Ok(stored) => Finish::Commit(stored.to_stored(limit), stored),
                    Err(error) => Finish::RollBack(error),
                })
            }
        })
        .await
        .map_err(OnceError::of)?;
        match ran {
            // The result as the operation gave it, even if too large to keep.
            Run::Committed { carry, .. } => Ok(Once::Ran(carry)),
            Run::RolledBack(error) => Err(OnceError::Failed(error)),
            Run::Answered(outcome) => answered(outcome),
        }
    }
}

/// A job's outcome decided without running it.
fn answered<E>(outcome: Outcome<Infallible>) -> Result<Once, OnceError<E>> {
    match outcome {
        Outcome::Replayed { response, .. } if response.body_omitted => Err(OnceError::NotKept),
        Outcome::Replayed { response, .. } => Ok(Once::Replayed(Stored::of(response))),
        Outcome::Mismatch { .. } => Err(OnceError::Mismatch),
        Outcome::InProgress { retry_after, .. } => Err(OnceError::InProgress { retry_after }),
        // Not what a record decides without running anything.
        Outcome::Executed { .. }
        | Outcome::Released(_)
        | Outcome::Uncertain(_)
        | Outcome::UpstreamUnavailable
        | Outcome::Unknown(_) => Err(OnceError::Internal),
    }
}
