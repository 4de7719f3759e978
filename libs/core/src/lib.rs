//! `idem-core`: the idempotency domain, free of any I/O.
//!
//! # Layout
//! - [`key`]: what a valid `Idempotency-Key` is.
//! - [`canonical`] and [`fingerprint`]: when two requests are "the same request".
//! - [`scope`]: `(tenant, endpoint, key)`, the unit of exactly-once.
//! - [`record`]: what the ledger stores per scope, and the attempt's fencing token.
//! - [`policy`]: per-route TTL, lease, wait, and what an upstream answer means
//!   ([`policy::Disposition`]: keep, release or uncertain).
//! - [`ports`]: the [`Ledger`] and [`Cache`] traits that the storage adapters implement.
//! - [`outcome`]: what an execution did and what a request came to, the vocabulary the
//!   engine and embedded mode share.
//! - [`verdict`]: what an existing record answers (replay, mismatch, in progress), and the
//!   steps on a found record and a completed answer, which the engine and embedded mode share.
//! - [`engine`]: claim → execute → complete/release over those two.
//! - [`local`]: a bounded in-process cache of completed responses over another cache.
//! - [`reconcile`]: what the reconciler does with a key whose outcome is unknown.
//! - [`headers`]: every header rule of the HTTP contract — the names idemgate reads and
//!   sets, hop-by-hop stripping, what goes upstream, what is stored and replayed — shared
//!   by the gateway, embedded mode, the reconciler and the identity provider's client.
#![forbid(unsafe_code)]

pub mod canonical;
pub mod engine;
pub mod fingerprint;
pub mod headers;
pub mod key;
pub mod local;
pub mod outcome;
pub mod policy;
pub mod ports;
pub mod reconcile;
pub mod record;
pub mod scope;
pub mod verdict;

pub use engine::{Attempt, Engine, Request};
pub use fingerprint::{BodyKind, Fingerprint};
pub use key::{IdempotencyKey, KeyError};
pub use outcome::{Execution, Outcome, UnknownCause};
pub use policy::{Disposition, OnInProgress, Policy, StatusSet};
pub use ports::{
    Busy, Cache, CacheEntry, CacheLookup, Claim, ClaimResult, Completed, Fence, Ledger,
    LedgerError, MaybeCache, NoCache,
};
pub use record::{AttemptId, Record, RecordState, StoredResponse};
pub use scope::Scope;
pub use verdict::Verdict;

/// An error and its sources, `: `-separated, for a log line or a message. hyper's
/// errors need it: hyper-util's own message is only "client error (Connect)", and the
/// refused connection or the bad certificate is in its sources.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
