//! The request's fingerprint, computed where it cannot hold up other requests: small
//! bodies in place, large ones on the blocking pool, a bounded number at a time — the
//! same for the gateway and for embedded mode.

use std::sync::Arc;

use bytes::Bytes;
use idem_core::canonical::JsonError;
use idem_core::{BodyKind, Fingerprint};
use tokio::sync::Semaphore;

use crate::Problem;
use crate::request::is_json;

/// Bodies larger than this are fingerprinted on the blocking pool: canonical JSON costs
/// roughly 2-4 ms of CPU per MiB (loadtest/bench), long enough on an async worker to
/// delay every other request's I/O behind it. Smaller bodies cost tens of microseconds
/// and are done in place.
pub const INLINE_UP_TO: usize = 32 * 1024;

/// Fingerprints requests, with large bodies on at most all cores but one at a time: a
/// flood of large bodies queues here, and the request threads keep a core for everyone
/// else's I/O. Cheap to clone; one per process.
#[derive(Debug, Clone)]
pub struct Fingerprinter {
    slots: Arc<Semaphore>,
}

impl Default for Fingerprinter {
    fn default() -> Self {
        let cpus = std::thread::available_parallelism().map_or(1, usize::from);
        Self::with_slots(cpus.saturating_sub(1).max(1))
    }
}

impl Fingerprinter {
    /// At most `slots` large bodies fingerprinted at once.
    pub fn with_slots(slots: usize) -> Self {
        Self {
            slots: Arc::new(Semaphore::new(slots.max(1))),
        }
    }

    /// The fingerprint of a request as it came (method, path and query, body as JSON if
    /// its content type says so); a body that is not acceptable JSON is a 400 problem.
    /// `held` lives as long as the work, as in [`Fingerprinter::compute`].
    pub async fn of_request<H: Send + 'static>(
        &self,
        parts: &http::request::Parts,
        body: &Bytes,
        held: H,
    ) -> Result<Fingerprint, Problem> {
        let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
        let kind = if is_json(&parts.headers) {
            BodyKind::Json
        } else {
            BodyKind::Raw
        };
        self.compute(parts.method.as_str(), target, kind, body, held)
            .await
            .map_err(|why| {
                Problem::RequestInvalid(format!("the body is not acceptable JSON: {why}"))
            })
    }

    /// The fingerprint of a request. `held` lives as long as the work (the gateway's
    /// request slot: a client that hangs up frees no slot while its body is still being
    /// hashed).
    pub async fn compute<H: Send + 'static>(
        &self,
        method: &str,
        target: &str,
        kind: BodyKind,
        body: &Bytes,
        held: H,
    ) -> Result<Fingerprint, JsonError> {
        if body.len() <= INLINE_UP_TO {
            return Fingerprint::compute(method, target, kind, body);
        }
        let permit = self
            .slots
            .clone()
            .acquire_owned()
            .await
            .expect("the fingerprint slots are never closed");
        let (method, target, body) = (method.to_owned(), target.to_owned(), body.clone());
        tokio::task::spawn_blocking(move || {
            let (_permit, _held) = (permit, held);
            Fingerprint::compute(&method, &target, kind, &body)
        })
        .await
        .expect("fingerprinting never panics")
    }
}
