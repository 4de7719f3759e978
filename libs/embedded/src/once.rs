//! One execution of a keyed operation: the claim, the operation's writes and its stored
//! result in one transaction.
//!
//! [`run`] is the engine both entries share: [`Idempotency::once`](crate::Idempotency::once)
//! for a job without HTTP (a queue's message; its API in [`crate::job`]), and the HTTP
//! layer, whose handler is the operation and whose answer the result. For one key:
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
//! 4. the operation runs with the transaction (in a [`Slot`], from which a [`Tx`](crate::tx::Tx) takes
//!    it) and says how it ends: its result stored and committed, or everything rolled back
//!    and the key left free;
//! 5. the commit. One whose acknowledgement was lost is an unknown outcome: a retry finds
//!    the committed record, or none.

use std::future::Future;
use std::time::Duration;

use idem_core::verdict;
use idem_core::{
    AttemptId, CacheEntry, Claim, ClaimResult, Completed, Execution, Fingerprint, Outcome, Scope,
};
use idem_http::Problem;
use idem_postgres::ledger::in_tx;
use idem_telemetry::failpoint;
use sqlx::{Connection, Postgres, Transaction};
use tokio::time::Instant;

use crate::Shared;
use crate::answer::record_outcome;
use crate::gate::Entry;
use crate::tx::Slot;

/// Runs `operation` at most once for `scope` (see the module's steps), in the gateway's
/// vocabulary: the operation says what it did as an [`Execution`] — `Responded`: store
/// this result with its writes and commit; `Declined`: roll everything back, the key is
/// free — and the run comes to an [`Outcome`]: `Executed` (committed, kept until its
/// `expires_at`), `Released` (rolled back), or what a found record answers (a replay, a
/// mismatch, in progress). `operation` gets the transaction in a [`Slot`] and the
/// attempt's token, and must have given the transaction back to the slot (a dropped
/// [`Tx`](crate::tx::Tx) does) by the time it returns.
pub(crate) async fn run<R, F, Fut>(
    shared: &Shared,
    scope: &Scope,
    fingerprint: Fingerprint,
    trace_context: Option<String>,
    operation: F,
) -> Result<Outcome<R>, Problem>
where
    F: FnOnce(Slot, AttemptId) -> Fut,
    Fut: Future<Output = Result<Execution<R>, Problem>>,
{
    let options = &shared.settings;
    if let Some((entry, _)) = shared.replays.get(scope) {
        return Ok(verdict::cached(entry, &fingerprint));
    }

    // Duplicates of a key this process is running wait for it here, holding no pooled
    // connection; the key's turn is held until this run's transaction ends.
    let deadline = Instant::now() + options.lock_wait;
    let _turn = loop {
        match shared.gates.enter(scope) {
            Entry::Turn(turn) => break turn,
            Entry::Busy(done) => {
                if tokio::time::timeout_at(deadline, done).await.is_err() {
                    return Ok(verdict::locked_out(false));
                }
                // The first committed a result this process now holds, or went away.
                if let Some((entry, _)) = shared.replays.get(scope) {
                    return Ok(verdict::cached(entry, &fingerprint));
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
                return Ok(verdict::locked_out(false));
            };
            if left.is_zero() {
                return Ok(verdict::locked_out(false));
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
            let found = verdict::found(&shared.replays, scope, record, &fingerprint, read, false);
            return Ok(match found.await {
                verdict::Found::Answered(outcome) => outcome,
                verdict::Found::Running(record) => verdict::in_progress(&record, false),
            });
        }
        // The first run's claim is still uncommitted after `lock_wait`.
        ClaimResult::Locked => return Ok(verdict::locked_out(false)),
    }

    let slot = Slot::new(tx);
    let executed = operation(slot.clone(), attempt).await?;
    slot.given_back(scope)?;
    let mut tx = slot.take().expect("given back: the slot holds it");
    let (stored, passthrough) = match executed {
        Execution::Responded {
            stored,
            passthrough,
        } => (stored, passthrough),
        Execution::Declined(passthrough) => {
            if let Err(error) = tx.rollback().await {
                // The connection is closed with it: Postgres rolls back on its own.
                tracing::warn!(?scope, %error, "could not roll back; the connection is dropped");
            }
            record_outcome("released");
            return Ok(Outcome::Released(passthrough));
        }
        // Nothing leaves the transaction: an operation here has no call whose outcome could
        // be unknown, nor one that could not be sent.
        Execution::NotSent | Execution::Unknown => {
            tracing::error!(
                ?scope,
                "an operation in one transaction said it called out; nothing was kept"
            );
            return Err(Problem::Internal);
        }
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
    verdict::remember(&shared.replays, scope, attempt, &entry, options.ttl, begun).await;
    Ok(Outcome::Executed {
        response: passthrough,
        expires_at: Some(expires_at),
    })
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
