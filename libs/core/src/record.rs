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

/// A response as stored and replayed: status, the headers worth keeping, and the body
/// bytes exactly as the upstream sent them.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredResponse {
    pub status: u16,
    /// Header names are lowercase; values are raw bytes.
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Bytes,
}

/// Where an operation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RecordState {
    /// An attempt owns the operation. `lease_expired` is judged by the ledger's clock.
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
    /// How long the record still lives, by the ledger's clock when it was read.
    pub expires_in: Option<std::time::Duration>,
}
