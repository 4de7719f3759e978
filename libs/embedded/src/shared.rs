//! What every run of the service's idempotency shares: its pool, settings, replay memory
//! and the bounds of its waits. A leaf: the engine (`once`), the layer and the answers
//! import it; it imports none of them.

use idem_core::NoCache;
use idem_core::local::Local;
use sqlx::PgPool;

use crate::Settings;
use crate::gate;

#[derive(Debug)]
pub(crate) struct Shared {
    pub(crate) pool: PgPool,
    pub(crate) settings: Settings,
    /// The statement that begins a request's transaction, its claim's first lock wait.
    pub(crate) begin: String,
    /// Keys this process is serving: their duplicates wait here.
    pub(crate) gates: gate::Gates,
    /// Connections that may wait on another process's claim at once.
    pub(crate) lock_waits: tokio::sync::Semaphore,
    /// Large stored answers in memory, within `max_replay_bytes_in_flight`.
    pub(crate) bodies: idem_postgres::ledger::bodies::Bodies,
    pub(crate) replays: Local<NoCache>,
    pub(crate) fingerprints: idem_http::Fingerprinter,
}
