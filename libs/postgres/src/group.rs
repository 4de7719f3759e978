//! Group commit: claims (and completions) that arrive while others are being written
//! share one statement, so one transaction and one WAL flush.
//!
//! A [`Pipe`] is a queue and a driver task. The driver takes whatever is queued — at once
//! when the pipe is idle, so a lone request never waits — up to [`MAX_ROWS`] rows (and
//! [`MAX_BYTES`] of response bodies), and writes them as one statement. The next
//! statement starts when that one returns, so the queue fills meanwhile: batches grow
//! with load and shrink back to one row when it falls, with no timer and no added wait.
//! A statement still running after [`SLOW`] (a row waiting on a lock, a slow flush) no
//! longer holds the next one back, up to `in_flight` statements at a time, so that one
//! stuck row cannot stall every request behind it. (More statements at once mean
//! smaller batches: in `loadtest/bench` four at a time cost Postgres 700 µs of CPU per
//! new key, one at a time 542 µs, at 2.07 and 1.19 commits per request.)
//!
//! Each request learns exactly its own outcome:
//! - where a kind says so ([`Batch::ONE_PER_SCOPE`]: completions), a scope appears once
//!   per statement, and a second row for it goes into the next statement (claims handle
//!   a key twice in their own SQL: every retry of one key shares a statement);
//! - rows go in scope order, so two statements never wait on each other's row locks in
//!   opposite orders;
//! - nothing is answered before the statement, and so its commit, has returned;
//! - a statement refused by Postgres (one row's fault fails them all) is retried row by
//!   row, so only that row's request gets the error; a statement lost with its
//!   connection or its deadline fails every request in it, each with its own error, and
//!   each request's deadline is its own: one queued past it is answered without being
//!   sent.

use std::collections::{HashSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use idem_core::{LedgerError, Scope};
use idem_telemetry::metrics;
use sqlx::PgPool;
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio::time::error::Elapsed;

/// Rows in one statement at most.
pub const MAX_ROWS: usize = 64;

/// Response bytes in one statement at most (a larger completion is written alone).
pub const MAX_BYTES: usize = 1 << 20;

/// A statement running longer than this lets the next one start beside it.
pub const SLOW: Duration = Duration::from_millis(20);

/// One kind of row written in groups.
pub trait Batch: Send + Sync + 'static {
    type Row: Send + Sync + 'static;
    type Outcome: Send + 'static;
    /// For metrics and errors: `claim`, `complete`.
    const OPERATION: &'static str;
    /// Whether a row whose request stopped waiting is left out (a claim nobody will
    /// act on), rather than written anyway (a completion: the upstream has answered).
    const SKIP_ABANDONED: bool;
    /// Whether a statement may carry only one row per scope.
    const ONE_PER_SCOPE: bool;

    fn scope(row: &Self::Row) -> &Scope;

    /// The response bytes the row carries.
    fn bytes(_row: &Self::Row) -> usize {
        0
    }

    /// Writes `rows` (in scope order, each scope once) as one statement; one outcome
    /// per row, in order.
    fn write(
        pool: &PgPool,
        rows: &[&Self::Row],
    ) -> impl Future<Output = Result<Vec<Self::Outcome>, sqlx::Error>> + Send;
}

struct Job<B: Batch> {
    row: B::Row,
    /// When its request stops waiting: the op timeout after it was queued.
    deadline: Instant,
    reply: oneshot::Sender<Result<B::Outcome, LedgerError>>,
}

/// The queue of one kind of write, drained by its driver task.
pub struct Pipe<B: Batch> {
    queue: mpsc::UnboundedSender<Job<B>>,
    op_timeout: Duration,
    counts: Arc<Counts>,
}

/// What a pipe has written so far.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Written {
    /// Statements sent.
    pub statements: u64,
    /// Rows they carried (rows retried alone after a refused statement count again).
    pub rows: u64,
}

#[derive(Debug, Default)]
struct Counts {
    statements: AtomicU64,
    rows: AtomicU64,
}

impl Counts {
    fn add<B: Batch>(&self, rows: usize) {
        self.statements.fetch_add(1, Ordering::Relaxed);
        self.rows.fetch_add(rows as u64, Ordering::Relaxed);
        let operation = B::OPERATION;
        metrics::counter!("idemgate_ledger_group_statements_total", "operation" => operation)
            .increment(1);
        metrics::counter!("idemgate_ledger_group_rows_total", "operation" => operation)
            .increment(rows as u64);
    }
}

impl<B: Batch> std::fmt::Debug for Pipe<B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Pipe")
            .field("operation", &B::OPERATION)
            .finish_non_exhaustive()
    }
}

impl<B: Batch> Pipe<B> {
    /// Starts the driver on the current runtime. It ends when the pipe is dropped.
    pub fn start(pool: PgPool, in_flight: usize, op_timeout: Duration) -> Self {
        let (queue, jobs) = mpsc::unbounded_channel();
        let counts = Arc::new(Counts::default());
        let driver = Driver {
            pool,
            in_flight: in_flight.max(1),
            op_timeout,
            counts: counts.clone(),
        };
        tokio::spawn(driver.drive::<B>(jobs));
        Self {
            queue,
            op_timeout,
            counts,
        }
    }

    /// What it has written so far.
    pub fn written(&self) -> Written {
        Written {
            statements: self.counts.statements.load(Ordering::Relaxed),
            rows: self.counts.rows.load(Ordering::Relaxed),
        }
    }

    /// Writes `row` with whatever else is queued, and answers its own outcome within the
    /// op timeout: queueing and the statement both count against it.
    pub async fn write(&self, row: B::Row) -> Result<B::Outcome, LedgerError> {
        let (reply, answer) = oneshot::channel();
        let job = Job {
            row,
            deadline: Instant::now() + self.op_timeout,
            reply,
        };
        if self.queue.send(job).is_err() {
            return Err(LedgerError::new(Stopped));
        }
        // The driver always answers (by the deadline, or with the statement's own result
        // when it was sent before then); it only drops the reply when it stops.
        answer
            .await
            .unwrap_or_else(|_| Err(LedgerError::new(Stopped)))
    }
}

/// What the driver and its statements share.
#[derive(Clone)]
struct Driver {
    pool: PgPool,
    in_flight: usize,
    op_timeout: Duration,
    counts: Arc<Counts>,
}

impl Driver {
    async fn drive<B: Batch>(self, mut jobs: mpsc::UnboundedReceiver<Job<B>>) {
        // The turn to start a statement: one at a time, handed on when a statement returns
        // or turns out slow. And a place among the statements running at all.
        let turn = Arc::new(Semaphore::new(1));
        let running = Arc::new(Semaphore::new(self.in_flight));
        // Queued jobs not yet sent, oldest first: what the last statement left over (a
        // scope it already had, bytes it had no room for) before anything newer.
        let mut waiting: VecDeque<Job<B>> = VecDeque::new();
        loop {
            let (Ok(turn), Ok(place)) = (
                turn.clone().acquire_owned().await,
                running.clone().acquire_owned().await,
            ) else {
                return;
            };
            if waiting.is_empty() {
                match jobs.recv().await {
                    Some(job) => waiting.push_back(job),
                    None => return,
                }
            }
            while let Ok(job) = jobs.try_recv() {
                waiting.push_back(job);
            }
            let batch = self.take_batch::<B>(&mut waiting);
            if !batch.is_empty() {
                tokio::spawn(self.clone().write::<B>(batch, turn, place));
            }
        }
    }

    /// Takes the next statement's jobs out of `waiting`: oldest first (each scope once,
    /// if the kind says so), at most [`MAX_ROWS`] and [`MAX_BYTES`] (a larger row goes alone). Jobs past their
    /// deadline are answered here, unsent.
    fn take_batch<B: Batch>(&self, waiting: &mut VecDeque<Job<B>>) -> Vec<Job<B>> {
        let now = Instant::now();
        let mut batch: Vec<Job<B>> = Vec::new();
        let mut scopes = HashSet::new();
        let mut bytes = 0;
        let mut left = VecDeque::with_capacity(waiting.len());
        while let Some(job) = waiting.pop_front() {
            if job.deadline <= now {
                let _ = job.reply.send(Err(self.timeout()));
                continue;
            }
            if B::SKIP_ABANDONED && job.reply.is_closed() {
                continue;
            }
            let size = B::bytes(&job.row);
            let fits = batch.is_empty() || (batch.len() < MAX_ROWS && bytes + size <= MAX_BYTES);
            if fits && (!B::ONE_PER_SCOPE || scopes.insert(B::scope(&job.row).clone())) {
                bytes += size;
                batch.push(job);
            } else {
                left.push_back(job);
            }
        }
        *waiting = left;
        batch
    }

    /// Writes one statement and answers each of its jobs.
    async fn write<B: Batch>(
        self,
        mut batch: Vec<Job<B>>,
        turn: OwnedSemaphorePermit,
        place: OwnedSemaphorePermit,
    ) {
        batch.sort_by(|a, b| order(B::scope(&a.row)).cmp(&order(B::scope(&b.row))));
        let deadline = batch.iter().map(|job| job.deadline).min();
        let deadline = deadline.expect("a batch has a job");
        let mut turn = Some(turn);
        let written = {
            let rows: Vec<&B::Row> = batch.iter().map(|job| &job.row).collect();
            let statement = tokio::time::timeout_at(deadline, B::write(&self.pool, &rows));
            let mut statement = std::pin::pin!(statement);
            tokio::select! {
                written = &mut statement => written,
                () = tokio::time::sleep(SLOW) => {
                    turn = None; // slow: the next statement may start beside it
                    statement.await
                }
            }
        };
        drop(turn);
        self.counts.add::<B>(batch.len());
        match written {
            Ok(Ok(outcomes)) if outcomes.len() == batch.len() => {
                for (job, outcome) in batch.into_iter().zip(outcomes) {
                    let _ = job.reply.send(Ok(outcome));
                }
            }
            // Postgres refused the statement, so nothing of it was committed: one row may
            // be at fault (a value it rejects, a lock it waited on too long). Each row
            // alone, so that only its own request hears of it.
            Ok(Err(sqlx::Error::Database(error))) if batch.len() > 1 && refused(&*error) => {
                for job in batch {
                    let row = [&job.row];
                    let alone = tokio::time::timeout_at(job.deadline, B::write(&self.pool, &row));
                    let alone = alone.await;
                    self.counts.add::<B>(1);
                    let _ = job.reply.send(self.answer::<B>(alone));
                }
            }
            written => {
                let rows = batch.len();
                let error: Box<dyn Fn() -> LedgerError + Send> = match written {
                    Ok(Ok(_)) => Box::new(|| self.miscounted::<B>()),
                    Ok(Err(cause)) => {
                        let cause = Arc::new(cause);
                        Box::new(move || failed::<B>(rows, cause.clone()))
                    }
                    Err(_) => Box::new(|| self.timeout()),
                };
                for job in batch {
                    let _ = job.reply.send(Err(error()));
                }
            }
        }
        drop(place);
    }

    /// The answer to one row written alone.
    fn answer<B: Batch>(
        &self,
        written: Result<Result<Vec<B::Outcome>, sqlx::Error>, Elapsed>,
    ) -> Result<B::Outcome, LedgerError> {
        match written {
            Ok(Ok(mut outcomes)) if outcomes.len() == 1 => Ok(outcomes.remove(0)),
            Ok(Ok(_)) => Err(self.miscounted::<B>()),
            Ok(Err(cause)) => Err(failed::<B>(1, Arc::new(cause))),
            Err(_) => Err(self.timeout()),
        }
    }

    fn timeout(&self) -> LedgerError {
        LedgerError::new(crate::Timeout(self.op_timeout))
    }

    fn miscounted<B: Batch>(&self) -> LedgerError {
        tracing::error!(
            operation = B::OPERATION,
            "a group write answered another number of rows than it was sent"
        );
        LedgerError::new(crate::Corrupt(
            "a group write answered another number of rows than it was sent",
        ))
    }
}

fn failed<B: Batch>(rows: usize, cause: Arc<sqlx::Error>) -> LedgerError {
    LedgerError::new(Failed {
        operation: B::OPERATION,
        rows,
        cause,
    })
}

/// Whether Postgres refused the statement itself, rather than losing its session
/// (SQLSTATE classes 08, connection exception, and 57, operator intervention: a
/// terminated backend, a shutdown), after which nothing is worth trying row by row.
fn refused(error: &dyn sqlx::error::DatabaseError) -> bool {
    !error
        .code()
        .is_some_and(|code| code.starts_with("08") || code.starts_with("57"))
}

/// The order rows are written in (and so row locks taken): by bytes, the same in every
/// process.
fn order(scope: &Scope) -> (&[u8], &[u8], &[u8]) {
    (
        scope.tenant.as_bytes(),
        scope.endpoint.as_bytes(),
        scope.key.as_str().as_bytes(),
    )
}

/// A group write that failed; every request in it gets one of these.
#[derive(Debug, thiserror::Error)]
#[error("the {operation} failed (a statement of {rows} row{}): {cause}", if *rows == 1 { "" } else { "s" })]
pub struct Failed {
    operation: &'static str,
    rows: usize,
    cause: Arc<sqlx::Error>,
}

/// The pipe's driver is gone (the runtime is shutting down).
#[derive(Debug, thiserror::Error)]
#[error("the ledger's group writer has stopped")]
pub struct Stopped;
