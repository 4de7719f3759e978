//! Jobs without HTTP: [`Idempotency::once`] runs a [`Job`] — a queue's message, say — at
//! most once on the engine the HTTP layer runs on ([`crate::once::run`]), its closure's
//! writes and its [`Stored`] result committed with the claim, and says how it ended
//! ([`Once`], or an [`OnceError`] that tells a final refusal from one worth retrying).

use std::future::Future;
use std::time::Duration;

use bytes::Bytes;
use http::HeaderMap;
use idem_core::fingerprint::BodyKind;
use idem_core::{Execution, IdempotencyKey, Outcome, Scope, StoredResponse};
use idem_http::Problem;
use idem_telemetry::propagation;
use tracing::Span;

use crate::Idempotency;
use crate::once::run;
use crate::tx::Tx;

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

/// What a consumer does next with a job that ended in a [`OnceError`] ([`OnceError::next`]).
#[derive(Debug, PartialEq, Eq)]
pub enum Next<'a, E> {
    /// Done: the job can never run as it is (invalid, its key used for another payload,
    /// or run once already with a result too large to keep). Acknowledge the message.
    Acknowledge,
    /// Nothing was kept, or the outcome is not known yet: deliver it again later (leave
    /// the message pending).
    Redeliver,
    /// The operation's own error, everything it wrote rolled back and the key free:
    /// whether it is final is the operation's to say.
    Operation(&'a E),
}

impl<E> OnceError<E> {
    /// What to do with the job's message: the one place that says which errors are final.
    pub fn next(&self) -> Next<'_, E> {
        match self {
            Self::Invalid(_) | Self::Mismatch | Self::NotKept => Next::Acknowledge,
            Self::Failed(error) => Next::Operation(error),
            Self::InProgress { .. }
            | Self::Unavailable
            | Self::OutcomeUnknown
            | Self::Overloaded
            | Self::Internal => Next::Redeliver,
        }
    }

    fn of(problem: Problem) -> Self {
        match problem {
            Problem::LedgerUnavailable => Self::Unavailable,
            Problem::OutcomeUnrecorded => Self::OutcomeUnknown,
            Problem::Overloaded => Self::Overloaded,
            _ => Self::Internal,
        }
    }
}

impl<T> Idempotency<T> {
    /// Runs `operation` at most once for `job`'s key: the claim, everything `operation`
    /// writes through its [`Tx`] and the [`Stored`] result it returns commit together, or
    /// not at all. A redelivery of the job finds the committed record and gets
    /// [`Once::Replayed`] without running `operation`; a concurrent duplicate waits for the
    /// first up to `lock_wait`, then replays (or runs, if the first rolled back), else
    /// [`OnceError::InProgress`]. `operation`'s error rolls everything back and leaves the
    /// key free ([`OnceError::Failed`]).
    ///
    /// Acknowledge a queue's message only once this returns `Ok`, or an error whose
    /// [`OnceError::next`] says the message is done.
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
                    Ok(stored) => Execution::Responded {
                        stored: stored.to_stored(limit),
                        passthrough: Ok(stored),
                    },
                    Err(error) => Execution::Declined(Err(error)),
                })
            }
        })
        .await
        .map_err(OnceError::of)?;
        job_outcome(ran)
    }
}

/// What a job's run came to, for its caller: the operation's own result or error, or what
/// its key's record answers.
fn job_outcome<E>(outcome: Outcome<Result<Stored, E>>) -> Result<Once, OnceError<E>> {
    match outcome {
        // The result as the operation gave it, even if too large to keep.
        Outcome::Executed {
            response: Ok(stored),
            ..
        } => Ok(Once::Ran(stored)),
        Outcome::Released(Err(error)) => Err(OnceError::Failed(error)),
        Outcome::Replayed { response, .. } if response.body_omitted => Err(OnceError::NotKept),
        Outcome::Replayed { response, .. } => Ok(Once::Replayed(Stored::of(response))),
        Outcome::Mismatch { .. } => Err(OnceError::Mismatch),
        Outcome::InProgress { retry_after, .. } => Err(OnceError::InProgress { retry_after }),
        // Not what a job's run comes to.
        Outcome::Executed { .. }
        | Outcome::Released(_)
        | Outcome::Uncertain(_)
        | Outcome::UpstreamUnavailable
        | Outcome::Unknown(_) => Err(OnceError::Internal),
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    #[test]
    fn which_errors_are_final_is_said_once() {
        let next = |error: OnceError<&str>| match error.next() {
            Next::Acknowledge => "ack",
            Next::Redeliver => "redeliver",
            Next::Operation(_) => "operation",
        };
        for done in [
            OnceError::Invalid("no key".into()),
            OnceError::Mismatch,
            OnceError::NotKept,
        ] {
            assert_eq!(next(done), "ack");
        }
        for passing in [
            OnceError::InProgress {
                retry_after: Duration::from_secs(1),
            },
            OnceError::Unavailable,
            OnceError::OutcomeUnknown,
            OnceError::Overloaded,
            OnceError::Internal,
        ] {
            assert_eq!(next(passing), "redeliver");
        }
        assert_eq!(next(OnceError::Failed("card declined")), "operation");
    }
}
