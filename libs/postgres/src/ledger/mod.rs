//! [`PgLedger`]: the `idempotency_keys` row, and every statement anyone runs on it — the
//! gateway (as the engine's [`Ledger`]), the reconciler and `idemgate keys` — one family
//! of statements per module, each next to the code that runs it:
//!
//! - [`rules`]: the row's states and transitions, and the rules every statement is
//!   written with (liveness, lease, held, the attempt's fence), once;
//! - [`claim`]: the claim (group commit) and the read of a live row;
//! - [`complete`]: the completion (group commit);
//! - [`in_tx`]: the claim and the completion on a caller's transaction (embedded mode);
//! - [`release`]: what a gateway's attempt ends with when it does not complete: a
//!   release (nothing ran) or a hold (an uncertain answer);
//! - [`reconcile`]: the reconciler's take, resolution and deferral;
//! - [`purge`]: deleting expired completed rows;
//! - [`operator`]: what `idemgate keys` reads and does, and the endpoints stored;
//! - [`callbacks`]: the settlement callbacks' outbox: a 202's mark, the senders' take
//!   and reports;
//! - [`bodies`]: large stored answers, read once per scope and shared, within a budget;
//! - [`row`]: decoding a row.
//!
//! Every call is bounded by the op timeout, traced as a client span and counted.

pub mod bodies;
pub mod callbacks;
pub mod claim;
pub mod complete;
pub mod in_tx;
pub mod operator;
pub mod purge;
pub mod reconcile;
pub mod release;
mod row;
pub mod rules;
pub mod settled;

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use idem_core::{
    AttemptId, Claim, ClaimResult, Completed, Fence, Fingerprint, Ledger, LedgerError, Record,
    RecordState, Scope, StoredResponse,
};
use sqlx::postgres::PgArguments;
use sqlx::query::Query;
use sqlx::{PgConnection, PgPool, Postgres};
use tracing::Instrument;

use crate::conn::OneStatement;
use crate::group::{Pipe, Written};
use bodies::Bodies;
use claim::{Claims, Seen};
use complete::Completions;
pub use operator::{KeyInfo, OperatorRelease};
pub use reconcile::{Later, StuckRow};
use row::Found;

/// How often a claim is retried when the row it conflicted with vanished before it
/// could be read (released in between).
const CLAIM_ROUNDS: usize = 3;

/// A connection that wrote or read a response body larger than this is closed after use
/// (sqlx never shrinks a connection's buffers).
const CLOSE_AFTER_BYTES: usize = 1 << 20;

/// The Postgres ledger. Cheap to clone (the pool is shared).
#[derive(Debug, Clone)]
pub struct PgLedger {
    pool: PgPool,
    /// Upper bound on one ledger call, so a hung connection cannot hang a request.
    op_timeout: Duration,
    /// Calls made, for metrics and for tests that prove a path never touched Postgres
    /// (claims and completions may share a statement: see [`crate::group`]).
    calls: Arc<AtomicU64>,
    /// The group-commit pipes, started on first use (on the runtime that uses them).
    pipes: Arc<Pipes>,
    /// Large stored answers in memory, shared by the replays that send them.
    bodies: Arc<Bodies>,
}

#[derive(Debug, Default)]
struct Pipes {
    claims: OnceLock<Pipe<Claims>>,
    completions: OnceLock<Pipe<Completions>>,
}

/// What the ledger holds in memory of large stored answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BodyStats {
    /// Large bodies read from Postgres so far (once per scope for concurrent replays).
    pub reads: u64,
    /// Their bytes held now, by answers being written or read.
    pub held_bytes: usize,
}

impl PgLedger {
    /// A ledger whose large replays may hold [`bodies::DEFAULT_BUDGET`] bytes at once.
    pub fn new(pool: PgPool, op_timeout: Duration) -> Self {
        Self::with_replay_budget(pool, op_timeout, bodies::DEFAULT_BUDGET)
    }

    /// A ledger whose large replays hold at most `budget` bytes of stored bodies at once
    /// (`server.max_replay_bytes_in_flight`).
    pub fn with_replay_budget(pool: PgPool, op_timeout: Duration, budget: usize) -> Self {
        Self {
            pool,
            op_timeout,
            calls: Arc::default(),
            pipes: Arc::default(),
            bodies: Arc::new(Bodies::new(budget)),
        }
    }

    /// Group statements of one kind in flight at most (one at a time unless it is slow):
    /// a quarter of the pool each for claims and completions, so single-row statements
    /// (reads, releases, holds) always find connections too.
    fn in_flight(&self) -> usize {
        (self.pool.options().get_max_connections() as usize / 4).max(1)
    }

    fn claims(&self) -> &Pipe<Claims> {
        self.pipes
            .claims
            .get_or_init(|| Pipe::start(self.pool.clone(), self.in_flight(), self.op_timeout))
    }

    fn completions(&self) -> &Pipe<Completions> {
        self.pipes
            .completions
            .get_or_init(|| Pipe::start(self.pool.clone(), self.in_flight(), self.op_timeout))
    }

    /// What group commit has written for claims and for completions so far.
    pub fn written(&self) -> (Written, Written) {
        (
            self.pipes
                .claims
                .get()
                .map(Pipe::written)
                .unwrap_or_default(),
            self.pipes
                .completions
                .get()
                .map(Pipe::written)
                .unwrap_or_default(),
        )
    }

    /// How many statements this ledger (and its clones) has sent.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::Relaxed)
    }

    /// Large stored answers read and held.
    pub fn bodies(&self) -> BodyStats {
        BodyStats {
            reads: self.bodies.reads(),
            held_bytes: self.bodies.held_bytes(),
        }
    }

    pub fn pool(&self) -> &PgPool {
        &self.pool
    }

    /// Whether Postgres answers and takes writes (not a standby): a readiness check,
    /// within the op timeout. Not counted among [`Self::calls`] nor traced: it runs on a
    /// clock, not for a request.
    pub async fn writable(&self) -> Result<bool, LedgerError> {
        let check = async {
            let mut conn = OneStatement::acquire(&self.pool).await?;
            let answer = sqlx::query_scalar("SELECT NOT pg_is_in_recovery()")
                .fetch_one(&mut *conn)
                .await;
            if matches!(answer, Ok(false)) {
                // A standby: this connection would answer every write with 25006.
                conn.close_after_use();
            }
            conn.answered(answer)
        };
        match tokio::time::timeout(self.op_timeout, check).await {
            Ok(answer) => answer.map_err(LedgerError::new),
            Err(_) => Err(LedgerError::new(crate::Timeout(self.op_timeout))),
        }
    }

    /// Runs one statement on a connection of its own (closed unless the statement
    /// answered and left it fit: [`OneStatement`]), within the op timeout, in a client
    /// span, counting it.
    async fn bounded<T>(
        &self,
        operation: &'static str,
        statement: impl AsyncFnOnce(&mut PgConnection) -> Result<T, sqlx::Error>,
    ) -> Result<T, LedgerError> {
        self.within(operation, async {
            let mut conn = OneStatement::acquire(&self.pool).await?;
            let answer = statement(&mut conn).await;
            conn.answered(answer)
        })
        .await
    }

    /// Runs `fut` within the op timeout, in a client span, counting it.
    async fn within<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, sqlx::Error>>,
    ) -> Result<T, LedgerError> {
        self.traced(operation, async {
            match tokio::time::timeout(self.op_timeout, fut).await {
                Ok(result) => result.map_err(LedgerError::new),
                Err(_) => Err(LedgerError::new(crate::Timeout(self.op_timeout))),
            }
        })
        .await
    }

    /// Runs one call, already bounded (by itself, or by its pipe), in a client span,
    /// counting it.
    async fn traced<T>(
        &self,
        operation: &'static str,
        fut: impl Future<Output = Result<T, LedgerError>>,
    ) -> Result<T, LedgerError> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let span = tracing::info_span!(
            "postgres",
            otel.kind = "client",
            db.system.name = "postgresql",
            db.operation.name = operation
        );
        let result = fut.instrument(span).await;
        if result.as_ref().is_err_and(|e| !e.is_busy()) {
            idem_telemetry::metrics::counter!("idemgate_ledger_errors_total").increment(1);
        }
        result
    }

    /// A statement naming one row by its scope ($1, $2, $3).
    fn on<'q>(sql: &'static str, scope: &'q Scope) -> Query<'q, Postgres, PgArguments> {
        sqlx::query(sql)
            .bind(&scope.tenant)
            .bind(&scope.endpoint)
            .bind(scope.key.as_str())
    }

    /// Runs a fenced write: it changed the row only if its attempt still owned it.
    async fn fenced(
        &self,
        operation: &'static str,
        statement: Query<'_, Postgres, PgArguments>,
    ) -> Result<Fence, LedgerError> {
        let result = self
            .bounded(operation, async |c| statement.execute(c).await)
            .await?;
        Ok(rules::fence(result.rows_affected()))
    }

    /// A row as read, with its large body (if any) read too, shared with every other
    /// reader of it. `None`: the row changed before its body could be read.
    async fn whole(&self, scope: &Scope, found: Found) -> Result<Option<Record>, LedgerError> {
        let Found {
            mut record,
            body_to_read,
        } = found;
        let Some(len) = body_to_read else {
            return Ok(Some(record));
        };
        let attempt = record.attempt;
        let read = || self.read_body(scope, attempt, len);
        let Some(body) = self
            .bodies
            .get((scope.clone(), attempt.0), len, read)
            .await?
        else {
            return Ok(None);
        };
        if let RecordState::Completed(response) = &mut record.state {
            response.body = body;
        }
        Ok(Some(record))
    }

    /// Reads one large body, on a connection closed after use.
    async fn read_body(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        len: usize,
    ) -> Result<Option<Vec<u8>>, LedgerError> {
        self.within("body", async {
            let mut conn = OneStatement::acquire(&self.pool).await?;
            if len > CLOSE_AFTER_BYTES {
                conn.close_after_use();
            }
            let answer = Self::on(bodies::BODY_SQL, scope)
                .bind(attempt.0)
                .fetch_optional(&mut *conn)
                .await;
            conn.answered(answer)?
                .map(|row| sqlx::Row::try_get::<Vec<u8>, _>(&row, "response_body"))
                .transpose()
        })
        .await
    }

    async fn try_claim(&self, c: &Claim<'_>) -> Result<Option<ClaimResult>, LedgerError> {
        // With whatever other claims are queued, in one round trip: read the live row, or
        // else claim (insert, or take over an expired completed row). The read sees the
        // statement's snapshot, which may predate a row committed concurrently; then the
        // upsert conflicts, claims nothing, and we read again below.
        let seen = self
            .traced("claim", self.claims().write(claim::ClaimRow::of(c)))
            .await??;
        // The paths past a new key's claim are boxed: a future is as large as its largest
        // branch, and a statement on a pooled connection is a large one (sqlx's acquire
        // alone is 14 KiB), which every new key would otherwise carry, and copy, through
        // its task.
        let found = match seen {
            Some(Seen::Claimed) => return Ok(Some(ClaimResult::Claimed)),
            Some(Seen::Locked) => return Ok(Some(ClaimResult::Locked)),
            Some(Seen::Row(found)) => Some(found),
            None => Box::pin(self.read(c.scope)).await?,
        };
        match found {
            Some(found) => Ok(Box::pin(self.whole(c.scope, found))
                .await?
                .map(ClaimResult::Existing)),
            None => Ok(None),
        }
    }
}

impl Ledger for PgLedger {
    fn op_timeout(&self) -> Duration {
        self.op_timeout
    }

    async fn claim(&self, claim: &Claim<'_>) -> Result<ClaimResult, LedgerError> {
        for _ in 0..CLAIM_ROUNDS {
            if let Some(result) = self.try_claim(claim).await? {
                return Ok(result);
            }
        }
        Err(LedgerError::new(crate::Contended))
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, LedgerError> {
        for _ in 0..CLAIM_ROUNDS {
            // Boxed, as in a claim: waits and lookups call this, not every request.
            let Some(found) = Box::pin(self.read(scope)).await? else {
                return Ok(None);
            };
            if let Some(record) = Box::pin(self.whole(scope, found)).await? {
                return Ok(Some(record));
            }
        }
        Err(LedgerError::new(crate::Contended))
    }

    async fn complete(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        fingerprint: &Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Completed, LedgerError> {
        idem_telemetry::failpoint::stop_here("stop-before-complete");
        let row = complete::CompleteRow::of(scope, attempt, fingerprint, response, ttl);
        self.traced("complete", self.completions().write(row)).await
    }

    async fn release(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        self.release_attempt(scope, attempt, false).await
    }

    async fn hold(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        self.hold_attempt(scope, attempt).await
    }
}

fn millis(d: Duration) -> f64 {
    d.as_secs_f64() * 1000.0
}

/// One array parameter: a field of every row.
fn column<'r, R, T>(rows: &[&'r R], field: impl Fn(&'r R) -> T) -> Vec<T> {
    rows.iter().map(|row| field(row)).collect()
}

/// Whether a statement failed with `lock_not_available` (55P03): it waited the
/// connection's `lock_timeout` for a row lock another transaction held.
fn lock_not_available(error: &sqlx::Error) -> bool {
    error
        .as_database_error()
        .and_then(|e| e.code())
        .is_some_and(|code| code == "55P03")
}
