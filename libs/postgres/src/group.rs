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
//!   connection fails every request in it, each with its own error;
//! - each request's deadline is its own: one queued past it (or too close to it) is
//!   answered without being sent, and one whose statement is still running at its
//!   deadline is answered then — but the statement is not abandoned with it. It runs
//!   on (Postgres bounds it by `statement_timeout`), and what it did for the requests
//!   that stopped waiting is undone once it returns ([`Batch::abandoned`]: a claim whose
//!   request gave up is released, whatever the statement did and whenever it commits).
//!   A statement that has not returned an op timeout after its last request's deadline
//!   is given up: its connection is closed, never pooled again, and its rows are undone
//!   then and once more an op timeout later, when nothing it started can still commit.
//!
//! Between statements the driver keeps the last one's connection ([`Warm`]), when the pool
//! can spare it, for at most [`WARM_IDLE`] without work and [`WARM_FOR`] in all: given back
//! to the pool after every statement, a connection costs a round trip of its own (sqlx pings
//! each connection it gets back), as many as the statements themselves.
//!
//! # Why one file of ~590 lines
//! The driver, the batch it takes and the statement it sends share one set of rules
//! (the list above: every job its own deadline, its own outcome, undone if abandoned);
//! they are read together or not at all. The statements themselves are in `ledger/`.

use std::collections::{HashSet, VecDeque};
use std::pin::pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::{LedgerError, Scope};
use idem_telemetry::metrics;
use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;

/// Rows in one statement at most.
pub const MAX_ROWS: usize = 64;

/// Response bytes in one statement at most (a larger completion is written alone).
pub const MAX_BYTES: usize = 1 << 20;

/// A statement running longer than this lets the next one start beside it.
pub const SLOW: Duration = Duration::from_millis(20);

/// A job is sent only with at least this much of its op timeout left: less is no
/// budget for a round trip, let alone a commit.
pub const MIN_BUDGET: Duration = Duration::from_millis(10);

/// A connection kept between statements is given back after this long without one...
pub const WARM_IDLE: Duration = Duration::from_millis(100);

/// ...and after this long in all, so the pool's own rules (lifetime, idle checks) still
/// see it.
pub const WARM_FOR: Duration = Duration::from_secs(60);

/// One kind of row written in groups.
pub trait Batch: Send + Sync + 'static {
    type Row: Send + Sync + 'static;
    type Outcome: Send + Sync + 'static;
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

    /// Whether the connection is closed after writing these rows (rather than pooled).
    fn close_after(_rows: &[&Self::Row]) -> bool {
        false
    }

    /// Writes `rows` (in scope order, each scope once) as one statement; one outcome
    /// per row, in order.
    fn write(
        conn: &mut PgConnection,
        rows: &[&Self::Row],
    ) -> impl Future<Output = Result<Vec<Self::Outcome>, sqlx::Error>> + Send;

    /// Undoes, where it matters, what a statement did for rows whose requests stopped
    /// waiting before it answered: each with its outcome, or `None` where the
    /// statement's fate is unknown (its connection lost, or given up on).
    fn abandoned(
        _pool: &PgPool,
        _rows: &[(&Self::Row, Option<&Self::Outcome>)],
    ) -> impl Future<Output = ()> + Send {
        async {}
    }
}

struct Job<B: Batch> {
    row: B::Row,
    wait: Wait<B>,
}

/// A job's request, for as long as it waits.
struct Wait<B: Batch> {
    /// When its request stops waiting: the op timeout after it was queued.
    deadline: Instant,
    /// `None` once answered.
    reply: Option<oneshot::Sender<Result<B::Outcome, LedgerError>>>,
}

impl<B: Batch> Wait<B> {
    fn answer(&mut self, outcome: Result<B::Outcome, LedgerError>) {
        if let Some(reply) = self.reply.take() {
            let _ = reply.send(outcome);
        }
    }

    /// Whether its request still waits for the answer.
    fn waiting(&self) -> bool {
        self.reply.as_ref().is_some_and(|r| !r.is_closed())
    }
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
            warm: Arc::default(),
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
            wait: Wait {
                deadline: Instant::now() + self.op_timeout,
                reply: Some(reply),
            },
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
    warm: Arc<Mutex<Option<Warm>>>,
}

/// The connection the last statement used, kept for the next one.
struct Warm {
    conn: PoolConnection<Postgres>,
    since: Instant,
    last: Instant,
}

/// Why a statement has no outcomes.
enum Failure {
    /// No connection: nothing was sent.
    NotSent(Arc<sqlx::Error>),
    /// Postgres refused it: nothing of it was committed.
    Refused(Arc<sqlx::Error>),
    /// Its connection was lost (or it failed after it ran): it may have committed.
    Lost(Arc<sqlx::Error>),
    /// It did not return an op timeout after its last request's deadline.
    GivenUp,
    /// It answered another number of rows than it was sent.
    Miscounted,
}

impl Failure {
    fn of_statement(error: sqlx::Error) -> Self {
        match &error {
            sqlx::Error::Database(db) if refused(&**db) => Self::Refused(Arc::new(error)),
            _ => Self::Lost(Arc::new(error)),
        }
    }

    /// Whether the statement may have committed rows nobody was told about.
    fn fate_unknown(&self) -> bool {
        matches!(self, Self::Lost(_) | Self::GivenUp)
    }

    /// The error each of its `rows` requests gets.
    fn error<B: Batch>(&self, driver: &Driver, rows: usize) -> LedgerError {
        match self {
            Self::NotSent(cause) | Self::Refused(cause) | Self::Lost(cause) => {
                failed::<B>(rows, cause.clone())
            }
            Self::GivenUp => driver.timeout(),
            Self::Miscounted => driver.miscounted::<B>(),
        }
    }
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
                let next = loop {
                    match tokio::time::timeout(WARM_IDLE, jobs.recv()).await {
                        Ok(next) => break next,
                        Err(_) => {
                            // Nothing to write for a while: the kept connection goes back.
                            // Once no statement runs (this turn holds one place, and no other
                            // can start without the turn), none can keep one again before
                            // the next job: wait for it without waking up.
                            let idle = running.available_permits() + 1 >= self.in_flight;
                            drop(self.warm.lock().expect("warm connection").take());
                            if idle {
                                break jobs.recv().await;
                            }
                        }
                    }
                };
                match next {
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
    /// if the kind says so), at most [`MAX_ROWS`] and [`MAX_BYTES`] (a larger row goes
    /// alone). Jobs without [`MIN_BUDGET`] left are answered here, unsent.
    fn take_batch<B: Batch>(&self, waiting: &mut VecDeque<Job<B>>) -> Vec<Job<B>> {
        let now = Instant::now();
        let mut batch: Vec<Job<B>> = Vec::new();
        let mut scopes = HashSet::new();
        let mut bytes = 0;
        let mut left = VecDeque::with_capacity(waiting.len());
        while let Some(mut job) = waiting.pop_front() {
            if job.wait.deadline <= now + MIN_BUDGET {
                job.wait.answer(Err(self.timeout()));
                continue;
            }
            if B::SKIP_ABANDONED && !job.wait.waiting() {
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

    /// Writes one statement and answers each of its jobs; then undoes what it did for
    /// the jobs that stopped waiting.
    async fn write<B: Batch>(
        self,
        mut batch: Vec<Job<B>>,
        turn: OwnedSemaphorePermit,
        place: OwnedSemaphorePermit,
    ) {
        batch.sort_by(|a, b| order(B::scope(&a.row)).cmp(&order(B::scope(&b.row))));
        let (rows, mut waits): (Vec<B::Row>, Vec<Wait<B>>) =
            batch.into_iter().map(|job| (job.row, job.wait)).unzip();
        let rows: Vec<&B::Row> = rows.iter().collect();
        let mut turn = Some(turn);
        let ended = self.statement::<B>(&rows, &mut waits, &mut turn).await;
        drop(turn);
        let mut unknown: Vec<&B::Row> = Vec::new();
        match ended {
            Ok(outcomes) => self.settle::<B>(&rows, &mut waits, outcomes).await,
            // Postgres refused the statement, so nothing of it was committed: one row may
            // be at fault (a value it rejects, a lock it waited on too long). Each row
            // whose request still waits goes again alone, so only its own request hears.
            Err(Failure::Refused(_)) if rows.len() > 1 => {
                for (i, row) in rows.iter().enumerate() {
                    if waits[i].reply.is_none() {
                        continue;
                    }
                    let one = [*row];
                    let wait = &mut waits[i..=i];
                    match self.statement::<B>(&one, wait, &mut None).await {
                        Ok(outcomes) => self.settle::<B>(&one, wait, outcomes).await,
                        Err(failure) => {
                            wait[0].answer(Err(failure.error::<B>(&self, 1)));
                            if failure.fate_unknown() {
                                unknown.push(row);
                            }
                        }
                    }
                }
            }
            Err(failure) => {
                for wait in &mut waits {
                    wait.answer(Err(failure.error::<B>(&self, rows.len())));
                }
                if failure.fate_unknown() {
                    unknown.extend(rows.iter().copied());
                }
            }
        }
        drop(place);
        if !unknown.is_empty() {
            // The statement may still commit (its connection cut while the server goes
            // on, a commit held up): undo now, and again once nothing it started can
            // still be running.
            let rows: Vec<_> = unknown.iter().map(|row| (*row, None)).collect();
            B::abandoned(&self.pool, &rows).await;
            tokio::time::sleep(self.op_timeout).await;
            B::abandoned(&self.pool, &rows).await;
        }
    }

    /// Answers the jobs still waiting with their outcomes; undoes the others'.
    async fn settle<B: Batch>(
        &self,
        rows: &[&B::Row],
        waits: &mut [Wait<B>],
        outcomes: Vec<B::Outcome>,
    ) {
        let mut abandoned = Vec::new();
        for ((row, wait), outcome) in rows.iter().zip(waits.iter_mut()).zip(outcomes) {
            if wait.waiting() {
                wait.answer(Ok(outcome));
            } else {
                abandoned.push((*row, outcome));
            }
        }
        if !abandoned.is_empty() {
            let rows: Vec<_> = abandoned.iter().map(|(row, o)| (*row, Some(o))).collect();
            B::abandoned(&self.pool, &rows).await;
        }
    }

    /// Sends one statement on a connection of its own and waits for it, answering each
    /// job whose deadline passes meanwhile (with a timeout) without giving the statement
    /// up; past [`SLOW`] it hands the turn on. A statement still running an op timeout
    /// after the last deadline is given up, and its connection closed.
    async fn statement<B: Batch>(
        &self,
        rows: &[&B::Row],
        waits: &mut [Wait<B>],
        turn: &mut Option<OwnedSemaphorePermit>,
    ) -> Result<Vec<B::Outcome>, Failure> {
        let last = waits.iter().map(|w| w.deadline).max();
        let give_up_at = last.expect("a statement has a row") + self.op_timeout;
        let mut conn: Option<PoolConnection<Postgres>> = None;
        let warm = self.take_warm();
        let warm_since = warm.as_ref().map(|(_, since)| *since);
        let ended = {
            let (pool, held) = (&self.pool, &mut conn);
            let statement = async move {
                let conn = match warm {
                    Some((conn, _)) => held.insert(conn),
                    None => {
                        let acquired = Box::pin(pool.acquire()).await;
                        held.insert(acquired.map_err(|e| Failure::NotSent(Arc::new(e)))?)
                    }
                };
                B::write(conn, rows).await.map_err(Failure::of_statement)
            };
            let mut statement = pin!(statement);
            let mut slow = pin!(tokio::time::sleep(SLOW));
            loop {
                let next = waits
                    .iter()
                    .filter(|w| w.reply.is_some())
                    .map(|w| w.deadline)
                    .min();
                tokio::select! {
                    biased;
                    ended = &mut statement => break ended,
                    () = &mut slow, if turn.is_some() => *turn = None,
                    () = tokio::time::sleep_until(next.unwrap_or(give_up_at)), if next.is_some() => {
                        let now = Instant::now();
                        for wait in waits.iter_mut().filter(|w| w.deadline <= now) {
                            wait.answer(Err(self.timeout()));
                        }
                    }
                    () = tokio::time::sleep_until(give_up_at) => break Err(Failure::GivenUp),
                }
            }
        };
        self.counts.add::<B>(rows.len());
        if let Some(mut conn) = conn {
            if matches!(ended, Err(Failure::GivenUp)) || B::close_after(rows) || unfit(&ended) {
                // Given up mid-statement (its state unknown), grown large, or unfit for the
                // next statement (its session lost, the server a standby now): never pooled.
                conn.close_on_drop();
            } else if matches!(&ended, Ok(outcomes) if outcomes.len() == rows.len())
                && waits.iter().all(Wait::waiting)
            {
                // Kept only when nothing of it is to be undone: an undo needs a connection
                // of the pool's while this statement still holds its place.
                self.keep_warm(conn, warm_since);
            }
        }
        match ended {
            Ok(outcomes) if outcomes.len() != rows.len() => Err(Failure::Miscounted),
            ended => ended,
        }
    }

    /// The kept connection and since when it is kept, if it is still fresh (a stale one
    /// goes back to the pool).
    fn take_warm(&self) -> Option<(PoolConnection<Postgres>, Instant)> {
        let warm = self.warm.lock().expect("warm connection").take()?;
        let now = Instant::now();
        (now - warm.last < WARM_IDLE && now - warm.since < WARM_FOR)
            .then_some((warm.conn, warm.since))
    }

    /// Keeps `conn` for the next statement, unless another is kept already or the pool
    /// has none to spare for anyone else (then it goes back).
    fn keep_warm(&self, conn: PoolConnection<Postgres>, since: Option<Instant>) {
        let max = self.pool.options().get_max_connections();
        let spare = self.pool.num_idle() > 0 || self.pool.size() < max;
        let mut warm = self.warm.lock().expect("warm connection");
        if warm.is_none() && spare {
            let now = Instant::now();
            *warm = Some(Warm {
                conn,
                since: since.unwrap_or(now),
                last: now,
            });
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
/// (A standby's 25006 is a refusal: nothing was written. Its connection is closed; the
/// rows tried again one by one may meet other pooled connections to the same node, each
/// closed at its own 25006, until the pool holds only connections the node in front
/// opened to the new primary.)
fn refused(error: &dyn sqlx::error::DatabaseError) -> bool {
    !error
        .code()
        .is_some_and(|code| code.starts_with("08") || code.starts_with("57"))
}

/// Whether a statement's end leaves its connection unfit for the next one ([`crate::unfit`]).
fn unfit<T>(ended: &Result<T, Failure>) -> bool {
    match ended {
        Err(Failure::Refused(error) | Failure::Lost(error)) => crate::unfit(error),
        _ => false,
    }
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
