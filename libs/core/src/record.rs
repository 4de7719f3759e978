//! What the ledger holds for one scope.

use bytes::Bytes;
use uuid::Uuid;

use crate::fingerprint::Fingerprint;

/// The fencing token of one attempt. Every completion and release names it, so an
/// attempt that lost its claim (paused past its lease, taken over) changes nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct AttemptId(pub Uuid);

impl AttemptId {
    pub fn random() -> Self {
        Self(Uuid::new_v4())
    }
}

/// As it goes upstream in `Idempotency-Attempt` and as `keys show` prints it: the
/// hyphenated UUID.
impl std::fmt::Display for AttemptId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.hyphenated().fmt(f)
    }
}

/// A response as stored and replayed: status, the headers worth keeping, and the body
/// bytes exactly as the upstream sent them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// Header names are lowercase; values are raw bytes.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
    /// The body was larger than the route's `max_response_bytes` and was not kept
    /// (`body` is empty): the operation happened once, but it cannot be replayed, so
    /// retries are told so (410) rather than executed again.
    pub body_omitted: bool,
}

impl StoredResponse {
    /// A response kept whole.
    pub fn new(status: u16, headers: Vec<(String, Vec<u8>)>, body: Bytes) -> Self {
        Self {
            status,
            headers,
            body,
            body_omitted: false,
        }
    }

    /// A response recorded without its (oversized) body.
    pub fn without_body(status: u16, headers: Vec<(String, Vec<u8>)>) -> Self {
        Self {
            status,
            headers,
            body: Bytes::new(),
            body_omitted: true,
        }
    }
}

/// Where an operation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// An attempt owns the operation. `lease_expired` (judged by the ledger's clock): its
    /// lease is over, or the key was ever held for the reconciler: the outcome is unknown.
    InProgress {
        lease_expired: bool,
    },
    Completed(StoredResponse),
}

/// One ledger row.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Record {
    pub fingerprint: Fingerprint,
    pub attempt: AttemptId,
    pub state: RecordState,
    /// The W3C `traceparent` of the first execution, for linking retries to it.
    pub trace_context: Option<String>,
    /// How long the record still lives, by the ledger's clock when it was read (what a
    /// cached copy may live, whatever the clocks of the two machines say).
    pub expires_in: Option<std::time::Duration>,
    /// When the ledger forgets it, as the ledger wrote it (`Idempotency-Expires`).
    pub expires_at: Option<std::time::SystemTime>,
}
