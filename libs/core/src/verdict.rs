//! What a request gets from a record that already exists, decided without I/O: the one
//! decision the gateway's [`crate::Engine`] and embedded mode (`idem-embedded`, which
//! finds its records on its own transaction) both take, so the two modes answer alike.
//!
//! A record comes from the ledger (with its remaining life as the ledger measured it) or
//! from a cache of completed answers (with none: the cache bounded it when it was
//! filled). [`Verdict::of`] / [`Verdict::of_cached`] say what it means for this request;
//! [`Verdict::decide`] says what to answer, and for how long a cache may keep a copy.
//! [`found`] and [`remember`] are the two steps both modes take with a cache: a found
//! record answered (its replay kept while its row lives), and a completed answer kept.

use std::time::Duration;

use tokio::time::Instant;

use crate::fingerprint::Fingerprint;
use crate::outcome::Outcome;
use crate::ports::{Cache, CacheEntry};
use crate::record::{AttemptId, Record, RecordState};
use crate::scope::Scope;

/// `Retry-After` while the first attempt is within its lease.
pub const RETRY_SOON: Duration = Duration::from_secs(1);
/// `Retry-After` once the lease has run out and the reconciler has the row.
pub const RETRY_LATER: Duration = Duration::from_secs(5);

/// What a live record found for a request means.
#[derive(Debug)]
pub enum Verdict {
    /// A completed operation of this same request: replay it. `expires_in` is how long
    /// the record still lives, as read from the ledger (`None` from a cache).
    Replay {
        entry: CacheEntry,
        expires_in: Option<Duration>,
    },
    /// The key was used for another request, whose operation is `completed` (or else
    /// still in progress).
    Mismatch {
        completed: bool,
        trace_context: Option<String>,
    },
    /// The same request, still in progress under another attempt.
    Running(Box<Record>),
}

/// What to answer for a [`Verdict`].
#[derive(Debug)]
pub enum Decision<R> {
    /// Replay `entry`. A cache may keep a copy for `keep_for`, never past the row's end
    /// (`None`: not at all — the row is about to end, or the entry came from a cache).
    Replay {
        entry: CacheEntry,
        keep_for: Option<Duration>,
        waited: bool,
    },
    /// Answer this at once.
    Answer(Outcome<R>),
    /// Another attempt is still running: wait for it, or answer [`in_progress`].
    Running(Box<Record>),
}

impl Verdict {
    /// A record read from the ledger, for a request with `fingerprint`.
    pub fn of(record: Record, fingerprint: &Fingerprint) -> Self {
        if record.fingerprint != *fingerprint {
            return Self::Mismatch {
                completed: matches!(record.state, RecordState::Completed(_)),
                trace_context: record.trace_context,
            };
        }
        match record.state {
            RecordState::Completed(response) => Self::Replay {
                entry: CacheEntry {
                    fingerprint: record.fingerprint,
                    response,
                    trace_context: record.trace_context,
                    expires_at: record.expires_at,
                },
                expires_in: record.expires_in,
            },
            RecordState::InProgress { .. } => Self::Running(Box::new(record)),
        }
    }

    /// A completed answer held in a cache, for a request with `fingerprint`.
    pub fn of_cached(entry: CacheEntry, fingerprint: &Fingerprint) -> Self {
        if entry.fingerprint == *fingerprint {
            Self::Replay {
                entry,
                expires_in: None,
            }
        } else {
            Self::Mismatch {
                completed: true,
                trace_context: entry.trace_context,
            }
        }
    }

    /// What to answer, `since_read` after the statement that read the record was sent
    /// (the record's remaining life was measured no earlier), for a request that has
    /// `waited` for another attempt or not.
    pub fn decide<R>(self, since_read: Duration, waited: bool) -> Decision<R> {
        match self {
            Self::Replay { entry, expires_in } => Decision::Replay {
                entry,
                keep_for: expires_in
                    .map(|left| left.saturating_sub(since_read))
                    .filter(|left| !left.is_zero()),
                waited,
            },
            Self::Mismatch {
                completed,
                trace_context,
            } => Decision::Answer(Outcome::Mismatch {
                trace_context,
                completed,
            }),
            Self::Running(record) => Decision::Running(record),
        }
    }
}

/// A record found for a request (by a claim, or a wait): an answer now, or still running.
#[derive(Debug)]
pub enum Found<R> {
    Answered(Outcome<R>),
    Running(Box<Record>),
}

/// What `record`, read by a statement sent at `read`, comes to for a request with
/// `fingerprint`; a replay is kept in `cache` for as long as its row lives (the ledger
/// measured that no earlier than `read`) — an answer stored without its body too: a
/// retry gets the same answer from the copy as from the row.
pub async fn found<R>(
    cache: &impl Cache,
    scope: &Scope,
    record: Record,
    fingerprint: &Fingerprint,
    read: Instant,
    waited: bool,
) -> Found<R> {
    match Verdict::of(record, fingerprint).decide(read.elapsed(), waited) {
        Decision::Replay {
            entry,
            keep_for,
            waited,
        } => {
            if let Some(ttl) = keep_for {
                cache.fill(scope, &entry, ttl).await;
            }
            Found::Answered(replayed(entry, waited))
        }
        Decision::Answer(outcome) => Found::Answered(outcome),
        Decision::Running(record) => Found::Running(record),
    }
}

/// Keeps `entry`, the answer `attempt` just recorded, in `cache` for as long as its row
/// lives: `ttl` from the commit, which came after `committing`.
pub async fn remember(
    cache: &impl Cache,
    scope: &Scope,
    attempt: AttemptId,
    entry: &CacheEntry,
    ttl: Duration,
    committing: Instant,
) {
    let left = ttl.saturating_sub(committing.elapsed());
    cache.complete(scope, attempt, entry, left).await;
}

/// The answer that replays `entry`.
pub fn replayed<R>(entry: CacheEntry, waited: bool) -> Outcome<R> {
    Outcome::Replayed {
        response: entry.response,
        trace_context: entry.trace_context,
        waited,
        expires_at: entry.expires_at,
    }
}

/// A cached completed answer for a request: a replay if it is the same request, a
/// mismatch otherwise. Nothing to keep: it came from the cache.
pub fn cached<R>(entry: CacheEntry, fingerprint: &Fingerprint) -> Outcome<R> {
    match Verdict::of_cached(entry, fingerprint).decide(Duration::ZERO, false) {
        Decision::Replay { entry, .. } => replayed(entry, false),
        Decision::Answer(outcome) => outcome,
        Decision::Running(_) => unreachable!("a cached entry is a completed answer"),
    }
}

/// A retry's answer while `record` is in progress under another attempt: 409 soon, or
/// later once its lease has run out and the outcome is unknown.
pub fn in_progress<R>(record: &Record, waited: bool) -> Outcome<R> {
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
        outcome_unknown: lease_expired,
    }
}

/// A request's answer while another transaction holds its key uncommitted: in progress,
/// soon over (such a transaction is bounded by its own lock wait or statement timeout).
pub fn locked_out<R>(waited: bool) -> Outcome<R> {
    Outcome::InProgress {
        retry_after: RETRY_SOON,
        trace_context: None,
        waited,
        outcome_unknown: false,
    }
}
