//! The vocabulary of one operation, shared by the gateway's [`crate::Engine`] and embedded
//! mode (`idem-embedded`): what the execution did ([`Execution`]) and what the request came
//! to ([`Outcome`]). A leaf: it imports nothing of the engine, so the engine, the decision
//! on a found record ([`crate::verdict`]) and embedded mode all import it.

use std::time::{Duration, SystemTime};

use crate::record::StoredResponse;

/// What the execution did: the gateway's upstream call, or embedded mode's operation.
#[derive(Debug)]
pub enum Execution<R> {
    /// The upstream answered. `stored` is the response as it would be replayed;
    /// `passthrough` is what the first client gets (all its end-to-end headers). What the
    /// answer means for the key is the policy's ([`crate::Policy::disposition`]) — in
    /// embedded mode, the operation committed it.
    Responded {
        stored: StoredResponse,
        passthrough: R,
    },
    /// The operation says itself that it kept nothing (embedded mode: its transaction is
    /// rolled back, as for a status in `roll_back_on` or a job's error); the key is free
    /// and the caller gets `R`.
    Declined(R),
    /// The request provably never reached the upstream (connection refused).
    NotSent,
    /// The upstream may or may not have acted (timeout, connection broken mid-way).
    Unknown,
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
    /// This request executed the operation and its result was kept until `expires_at`,
    /// or (`None`) not kept: the fence was lost (the reconciler resolved the row
    /// meanwhile).
    Executed {
        response: R,
        expires_at: Option<SystemTime>,
    },
    /// The upstream answered with a status the route does not keep; the key is free.
    Released(R),
    /// The upstream answered, but its answer proves nothing (a 5xx on a route with a
    /// status probe): the first client gets it as it came, and the key is held for the
    /// reconciler, which asks the upstream at once.
    Uncertain(R),
    /// A completed operation's stored response.
    Replayed {
        response: StoredResponse,
        trace_context: Option<String>,
        waited: bool,
        /// When the ledger forgets the record, if known.
        expires_at: Option<SystemTime>,
    },
    /// The key was used before with a different request, whose operation is completed
    /// (or, if not `completed`, still in progress).
    Mismatch {
        trace_context: Option<String>,
        completed: bool,
    },
    /// Another attempt is running, or (`outcome_unknown`) its lease ran out without a
    /// result and the reconciler has yet to resolve it.
    InProgress {
        retry_after: Duration,
        trace_context: Option<String>,
        waited: bool,
        outcome_unknown: bool,
    },
    /// The upstream could not be reached; nothing ran and the key is free.
    UpstreamUnavailable,
    /// The upstream may have acted; the key stays held for the reconciler.
    Unknown(UnknownCause),
}

impl<R> Outcome<R> {
    /// The `idempotency.outcome` name (docs/operations.md, "Observability").
    pub fn name(&self) -> &'static str {
        match self {
            Outcome::Executed { .. } => "executed",
            Outcome::Replayed { .. } => "replayed",
            Outcome::Mismatch { .. } => "mismatch",
            Outcome::InProgress { .. } => "in_progress",
            Outcome::Released(_) | Outcome::UpstreamUnavailable => "released",
            Outcome::Unknown(_) | Outcome::Uncertain(_) => "unknown",
        }
    }

    /// The stored trace context of the execution this answer is about, when it is not
    /// this request's own (a replay, a mismatch, a 409 in progress): its span links there.
    pub fn first_execution(&self) -> Option<&str> {
        match self {
            Outcome::Replayed { trace_context, .. }
            | Outcome::Mismatch { trace_context, .. }
            | Outcome::InProgress { trace_context, .. } => trace_context.as_deref(),
            _ => None,
        }
    }
}
