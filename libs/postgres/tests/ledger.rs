//! The ledger's atomic decisions against real Postgres.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AttemptId, BodyKind, Claim, ClaimResult, Fence, Fingerprint, IdempotencyKey, Ledger,
    RecordState, Scope, StoredResponse,
};
use idem_postgres::PgLedger;
use idem_testkit::TestDb;

fn scope(key: &str) -> Scope {
    Scope::new(
        "acme",
        "POST /payments",
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
    )
}

fn response(body: &'static str) -> StoredResponse {
    StoredResponse::new(
        201,
        vec![("content-type".into(), b"application/json".to_vec())],
        Bytes::from_static(body.as_bytes()),
    )
}

async fn ledger(db: &TestDb) -> PgLedger {
    db.migrate().await;
    PgLedger::new(
        sqlx::PgPool::connect(&db.url).await.unwrap(),
        Duration::from_secs(5),
    )
}

async fn claim(ledger: &PgLedger, scope: &Scope, lease: Duration) -> (AttemptId, ClaimResult) {
    let fp = Fingerprint::compute("POST", "/payments", BodyKind::Raw, b"x").unwrap();
    let attempt = AttemptId::random();
    let claim = Claim {
        scope,
        fingerprint: &fp,
        attempt,
        lease,
        ttl: Duration::from_secs(60),
        trace_context: Some("00-abc-def-01"),
    };
    (attempt, ledger.claim(&claim).await.unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_after_the_reconciler_resolved_the_row_is_fenced_out() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("fenced");
    let (attempt, claimed) = claim(&ledger, &scope, Duration::from_millis(1)).await;
    assert!(matches!(claimed, ClaimResult::Claimed));
    // Real time: Postgres's clock judges the 1 ms lease.
    tokio::time::sleep(Duration::from_millis(20)).await;

    let stuck = ledger
        .take_stuck(10, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(stuck.len(), 1);
    assert_eq!(stuck[0].attempt, attempt);
    let fence = ledger
        .resolve(&stuck[0], &response("probe"), Duration::from_secs(60))
        .await
        .unwrap();
    assert_eq!(fence, Fence::Held);

    // The original attempt wakes up and tries to complete and to release: both lose.
    assert_eq!(
        ledger
            .complete(&scope, attempt, &response("late"), Duration::from_secs(60))
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(ledger.release(&scope, attempt).await.unwrap(), Fence::Lost);
    let record = ledger.get(&scope).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed(response("probe")));
    assert_eq!(record.trace_context.as_deref(), Some("00-abc-def-01"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolution_after_the_gateway_finished_changes_nothing() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("raced");
    let (attempt, _) = claim(&ledger, &scope, Duration::from_millis(1)).await;
    // Real time: Postgres's clock judges the 1 ms lease.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let stuck = ledger
        .take_stuck(10, Duration::from_secs(30))
        .await
        .unwrap();
    // The gateway completes between the reconciler's take and its resolution.
    assert_eq!(
        ledger
            .complete(&scope, attempt, &response("real"), Duration::from_secs(60))
            .await
            .unwrap(),
        Fence::Held
    );
    assert_eq!(
        ledger
            .release_attempt(&stuck[0].scope, Some(stuck[0].attempt))
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        ledger
            .resolve(&stuck[0], &response("probe"), Duration::from_secs(60))
            .await
            .unwrap(),
        Fence::Lost
    );
    let record = ledger.get(&scope).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed(response("real")));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_row_is_invisible_to_other_reconcilers_until_its_processing_lease_ends() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    claim(&ledger, &scope("taken"), Duration::from_millis(1)).await;
    // Real time: Postgres's clock judges the 1 ms lease.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let first = ledger
        .take_stuck(10, Duration::from_millis(300))
        .await
        .unwrap();
    let second = ledger
        .take_stuck(10, Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!((first.len(), second.len()), (1, 0));
    // Real time: Postgres's clock judges the processing lease.
    tokio::time::sleep(Duration::from_millis(400)).await;
    let later = ledger
        .take_stuck(10, Duration::from_millis(300))
        .await
        .unwrap();
    assert_eq!(
        later.len(),
        1,
        "a reconciler that died mid-probe does not strand the row"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_claim_is_not_taken_over_and_the_claim_reads_the_existing_row() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("live");
    let (first, claimed) = claim(&ledger, &scope, Duration::from_secs(30)).await;
    assert!(matches!(claimed, ClaimResult::Claimed));
    let (_, second) = claim(&ledger, &scope, Duration::from_secs(30)).await;
    match second {
        ClaimResult::Existing(record) => {
            assert_eq!(record.attempt, first);
            assert_eq!(
                record.state,
                RecordState::InProgress {
                    lease_expired: false
                }
            );
        }
        ClaimResult::Claimed => panic!("a live claim must not be taken over"),
    }
    assert!(
        ledger
            .take_stuck(10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty()
    );
}

/// The pool skips sqlx's ping before every statement, but a connection that sat idle
/// (and may have been cut meanwhile: a Postgres restart, a failover, a proxy's idle
/// timeout) is still pinged, so the next request gets a fresh connection, not an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_cut_while_idle_is_replaced_before_a_request_uses_it() {
    let db = TestDb::create().await;
    db.migrate().await;
    let pool = idem_postgres::connect(
        &db.url,
        &idem_postgres::PoolSettings {
            max_connections: 1,
            acquire_timeout: Duration::from_secs(5),
            statement_timeout: Duration::from_secs(5),
            application_name: "idle-ping-test".into(),
        },
    )
    .await
    .unwrap();
    let ledger = PgLedger::new(pool.clone(), Duration::from_secs(5));
    let backend: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();

    let admin = sqlx::PgPool::connect(&db.url).await.unwrap();
    let cut: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(backend)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(cut, "the pooled connection should have been terminated");
    admin.close().await;
    // Real time: sqlx judges idleness by the real clock; only an idle connection is pinged.
    tokio::time::sleep(Duration::from_millis(1200)).await;

    let (_, claimed) = claim(&ledger, &scope("after-cut"), Duration::from_secs(30)).await;
    assert!(matches!(claimed, ClaimResult::Claimed));
    let now: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_ne!(now, backend, "a new connection should serve the request");
}

/// sqlx never shrinks a connection's write buffer: one that stored a large body would
/// keep that much memory for its whole life, in every pooled connection that ever did.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_that_stored_a_large_body_is_closed_after_use() {
    let db = TestDb::create().await;
    db.migrate().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect(&db.url)
        .await
        .unwrap();
    let ledger = PgLedger::new(pool.clone(), Duration::from_secs(5));
    let backend = || async {
        sqlx::query_scalar::<_, i32>("SELECT pg_backend_pid()")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let store = |key: &'static str, bytes: usize| {
        let ledger = ledger.clone();
        async move {
            let scope = scope(key);
            let (attempt, _) = claim(&ledger, &scope, Duration::from_secs(30)).await;
            let body = StoredResponse::new(201, Vec::new(), Bytes::from(vec![b'x'; bytes]));
            let ttl = Duration::from_secs(60);
            assert_eq!(
                ledger.complete(&scope, attempt, &body, ttl).await.unwrap(),
                Fence::Held
            );
        }
    };
    let first = backend().await;
    store("small", 100_000).await;
    assert_eq!(backend().await, first, "a small body keeps its connection");
    store("large", 2 << 20).await;
    assert_ne!(
        backend().await,
        first,
        "the large body's connection was closed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_in_progress_row_never_expires_and_is_never_purged() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("held");
    let (attempt, _) = claim(&ledger, &scope, Duration::from_millis(1)).await;
    let mut conn = db.connect().await;
    sqlx::query("UPDATE idempotency_keys SET expires_at = now() - interval '1 day'")
        .execute(&mut conn)
        .await
        .unwrap();
    // Real time: Postgres's clock judges expiry.
    tokio::time::sleep(Duration::from_millis(20)).await;
    assert_eq!(ledger.purge_batch(100).await.unwrap(), 0);
    let (_, again) = claim(&ledger, &scope, Duration::from_secs(30)).await;
    match again {
        ClaimResult::Existing(record) => assert_eq!(record.attempt, attempt),
        ClaimResult::Claimed => panic!("an in-progress row past its TTL was taken over"),
    }
    assert!(ledger.get(&scope).await.unwrap().is_some());
    assert_eq!(ledger.count_held().await.unwrap(), 1);
    assert_eq!(
        ledger
            .take_stuck(10, Duration::from_secs(30))
            .await
            .unwrap()
            .len(),
        1
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hold_ends_the_lease_at_once_and_is_fenced() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("uncertain");
    let (attempt, _) = claim(&ledger, &scope, Duration::from_secs(300)).await;
    assert!(
        ledger
            .take_stuck(10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty()
    );
    assert_eq!(
        ledger.hold(&scope, AttemptId::random()).await.unwrap(),
        Fence::Lost
    );
    assert_eq!(ledger.hold(&scope, attempt).await.unwrap(), Fence::Held);
    let taken = ledger
        .take_stuck(10, Duration::from_secs(30))
        .await
        .unwrap();
    assert_eq!(taken.len(), 1, "probed at once, not after the 300 s lease");
    assert_eq!(ledger.count_held().await.unwrap(), 1);
}

/// A replay served by Postgres (Redis down, or a cold cache) only reads: it takes no
/// row lock, so retries of one key never queue behind each other or behind anything
/// else holding the row. (On the old main the claim was a locking upsert even for a
/// completed row: with the row locked elsewhere it waited out the 5 s op timeout.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_reads_the_row_without_locking_it() {
    use sqlx::Connection;
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    for (name, complete) in [("done", true), ("running", false)] {
        let scope = scope(name);
        let (attempt, claimed) = claim(&ledger, &scope, Duration::from_secs(30)).await;
        assert!(matches!(claimed, ClaimResult::Claimed));
        if complete {
            let fence = ledger
                .complete(&scope, attempt, &response("paid"), Duration::from_secs(60))
                .await
                .unwrap();
            assert_eq!(fence, Fence::Held);
        }
        // Someone else holds the row's lock (a reconciler pass, a slow completion).
        let mut other = sqlx::PgConnection::connect(&db.url).await.unwrap();
        let mut tx = other.begin().await.unwrap();
        sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE")
            .bind(name)
            .execute(&mut *tx)
            .await
            .unwrap();

        let started = std::time::Instant::now();
        let again = tokio::time::timeout(
            Duration::from_secs(2),
            claim(&ledger, &scope, Duration::from_secs(30)),
        )
        .await
        .unwrap_or_else(|_| panic!("the {name} key's replay waited on the row lock"))
        .1;
        let ClaimResult::Existing(record) = again else {
            panic!("{name}: {again:?}");
        };
        if complete {
            assert_eq!(record.state, RecordState::Completed(response("paid")));
        } else {
            assert!(matches!(record.state, RecordState::InProgress { .. }));
        }
        assert!(started.elapsed() < Duration::from_secs(1));
        tx.rollback().await.unwrap();
    }
}

/// A ledger whose pool of four allows one group statement of a kind at a time, so that a
/// test can hold that statement and queue the next one's rows behind it.
async fn one_statement_at_a_time(db: &TestDb) -> PgLedger {
    db.migrate().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&db.url)
        .await
        .unwrap();
    PgLedger::new(pool, Duration::from_secs(5))
}

/// Another session's uncommitted insert of `key`: a claim of it waits until the
/// session ends (`ROLLBACK` lets the claim insert).
async fn uncommitted_row(db: &TestDb, key: &str) -> sqlx::PgConnection {
    let mut other = db.connect().await;
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant_id, endpoint, key, request_hash, status, \
           attempt, locked_until, expires_at) \
         VALUES ('acme', 'POST /payments', $1, decode(repeat('00', 32), 'hex'), \
           'in_progress', gen_random_uuid(), now() + interval '30 s', now() + interval '1 h')",
    )
    .bind(key)
    .execute(&mut other)
    .await
    .unwrap();
    other
}

/// Starts a claim of `scope` in a task of its own.
fn claim_in_background(
    ledger: &PgLedger,
    scope: &Scope,
    trace_context: &'static str,
) -> tokio::task::JoinHandle<(AttemptId, Result<ClaimResult, idem_core::LedgerError>)> {
    let (ledger, scope) = (ledger.clone(), scope.clone());
    tokio::spawn(async move {
        let fp = Fingerprint::compute("POST", "/payments", BodyKind::Raw, b"x").unwrap();
        let attempt = AttemptId::random();
        let claim = Claim {
            scope: &scope,
            fingerprint: &fp,
            attempt,
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            trace_context: Some(trace_context),
        };
        (attempt, ledger.claim(&claim).await)
    })
}

/// The ledger's one claim statement, held on another session's uncommitted row: claims
/// made meanwhile queue behind it, and go together into the next statement.
struct Gate {
    other: sqlx::PgConnection,
    held: tokio::task::JoinHandle<(AttemptId, Result<ClaimResult, idem_core::LedgerError>)>,
}

impl Gate {
    async fn close(db: &TestDb, ledger: &PgLedger) -> Self {
        let other = uncommitted_row(db, "gate").await;
        let held = claim_in_background(ledger, &scope("gate"), "t");
        until_waiting_on_a_lock(db).await;
        Self { other, held }
    }

    /// Lets the held statement go (the other session rolls back: it claims "gate").
    async fn open(mut self) {
        // Real time: the queued claims' tasks reach the pipe while its statement is held.
        tokio::time::sleep(Duration::from_millis(300)).await;
        sqlx::query("ROLLBACK")
            .execute(&mut self.other)
            .await
            .unwrap();
        let (_, gate) = self.held.await.unwrap();
        assert!(matches!(gate, Ok(ClaimResult::Claimed)), "{gate:?}");
    }
}

/// Claims `keys` (each with its trace context) together, behind a [`Gate`].
async fn claimed_together(
    db: &TestDb,
    ledger: &PgLedger,
    keys: &[(&str, &'static str)],
) -> Vec<(AttemptId, Result<ClaimResult, idem_core::LedgerError>)> {
    let gate = Gate::close(db, ledger).await;
    let queued: Vec<_> = keys
        .iter()
        .map(|(key, trace)| claim_in_background(ledger, &scope(key), trace))
        .collect();
    gate.open().await;
    let mut answers = Vec::new();
    for task in queued {
        answers.push(task.await.unwrap());
    }
    answers
}

async fn until_waiting_on_a_lock(db: &TestDb) {
    let mut conn = db.connect().await;
    for _ in 0..500 {
        let waiting: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity \
             WHERE datname = current_database() AND wait_event_type = 'Lock'",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if waiting > 0 {
            return;
        }
        // Real time: Postgres's view of its sessions.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the claim never waited on the other session's row");
}

/// Claims queued together share a statement; the same key twice in the queue, and a key
/// another attempt holds live, still get their own answers: one claim each, the others
/// the live row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn claims_queued_together_share_a_statement_and_each_learns_its_own_outcome() {
    let db = TestDb::create().await;
    let ledger = one_statement_at_a_time(&db).await;
    let (holder, claimed) = claim(&ledger, &scope("live"), Duration::from_secs(30)).await;
    assert!(matches!(claimed, ClaimResult::Claimed));
    let before = ledger.written().0;

    let answers = claimed_together(
        &db,
        &ledger,
        &[
            ("a", "t"),
            ("twice", "t"),
            ("b", "t"),
            ("twice", "t"),
            ("live", "t"),
        ],
    )
    .await;

    let claimed = |i: usize| matches!(answers[i].1, Ok(ClaimResult::Claimed));
    assert!(claimed(0) && claimed(2), "{answers:?}");
    // The key queued twice: one claim, and the other sees that claim's row.
    let (first, second) = if claimed(1) { (1, 3) } else { (3, 1) };
    assert!(claimed(first), "{answers:?}");
    match &answers[second].1 {
        Ok(ClaimResult::Existing(record)) => {
            assert_eq!(record.attempt, answers[first].0);
            assert!(matches!(record.state, RecordState::InProgress { .. }));
        }
        other => panic!("the second claim of one key: {other:?}"),
    }
    match &answers[4].1 {
        Ok(ClaimResult::Existing(record)) => assert_eq!(record.attempt, holder),
        other => panic!("a key claimed live before: {other:?}"),
    }
    // The gate alone, then the five in one statement.
    let written = ledger.written().0;
    assert_eq!(written.rows - before.rows, 6, "{written:?}");
    assert_eq!(written.statements - before.statements, 2, "{written:?}");
    assert_eq!(db.ledger_rows("acme").await, 5); // live, gate, a, twice, b
}

/// A row Postgres refuses fails only its own claim: the statement is retried row by row.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_row_postgres_refuses_fails_only_its_own_claim() {
    let db = TestDb::create().await;
    let ledger = one_statement_at_a_time(&db).await;
    // text cannot hold a NUL: Postgres refuses the whole statement that carries it.
    let answers = claimed_together(
        &db,
        &ledger,
        &[("a", "t"), ("poisoned", "nul\0here"), ("b", "t")],
    )
    .await;
    assert!(
        matches!(answers[0].1, Ok(ClaimResult::Claimed)),
        "{answers:?}"
    );
    assert!(
        matches!(answers[2].1, Ok(ClaimResult::Claimed)),
        "{answers:?}"
    );
    let error = answers[1].1.as_ref().expect_err("the refused row");
    let error = error.to_string();
    assert!(
        error.starts_with("the claim failed (a statement of 1 row)"),
        "{error}"
    );
    assert_eq!(db.ledger_rows("acme").await, 3); // gate, a, b
}

/// A statement whose connection is cut before it commits fails every claim in it, each
/// with its own error, and commits none of them: a retry claims afresh.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_cut_before_its_commit_fails_each_claim_in_it_and_commits_none() {
    let db = TestDb::create().await;
    let ledger = one_statement_at_a_time(&db).await;
    let mut other = uncommitted_row(&db, "blocker").await;
    let keys = ["blocker", "x", "y"];
    // The three share the statement after the gate's, which then waits on the other
    // session's row "blocker", and is cut there.
    let gate = Gate::close(&db, &ledger).await;
    let tasks: Vec<_> = keys
        .iter()
        .map(|key| claim_in_background(&ledger, &scope(key), "t"))
        .collect();
    let before = ledger.written().0;
    gate.open().await;
    until_waiting_on_a_lock(&db).await;
    let mut admin = db.connect().await;
    let cut: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM (SELECT pg_terminate_backend(pid) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock') AS cut",
    )
    .fetch_one(&mut admin)
    .await
    .unwrap();
    assert_eq!(cut, 1);
    let mut errors = Vec::new();
    for task in tasks {
        let (_, answer) = task.await.unwrap();
        errors.push(
            answer
                .expect_err("a claim whose statement was cut")
                .to_string(),
        );
    }
    let written = ledger.written().0;
    let (statements, rows) = (
        written.statements - before.statements,
        written.rows - before.rows,
    );
    assert_eq!(
        (statements, rows),
        (2, 4),
        "the gate's, then the three: {errors:?}"
    );
    for error in &errors {
        assert!(error.contains("(a statement of 3 rows)"), "{error}");
    }
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    assert_eq!(
        db.ledger_rows("acme").await,
        1,
        "only the gate was committed"
    );
    for key in keys {
        let (_, again) = claim(&ledger, &scope(key), Duration::from_secs(30)).await;
        assert!(matches!(again, ClaimResult::Claimed), "{key}: {again:?}");
    }
}

/// Completions queued together share a statement, each fenced by its own attempt.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn completions_queued_together_are_each_fenced_by_their_own_attempt() {
    let db = TestDb::create().await;
    let ledger = one_statement_at_a_time(&db).await;
    let mut attempts = Vec::new();
    for key in ["held", "a", "b", "stale"] {
        let (attempt, claimed) = claim(&ledger, &scope(key), Duration::from_secs(30)).await;
        assert!(matches!(claimed, ClaimResult::Claimed));
        attempts.push(attempt);
    }
    // Another session holds the row "held" locked: the first completion waits on it.
    let mut other = db.connect().await;
    sqlx::query("BEGIN").execute(&mut other).await.unwrap();
    sqlx::query("SELECT 1 FROM idempotency_keys WHERE key = 'held' FOR UPDATE")
        .execute(&mut other)
        .await
        .unwrap();
    let complete = |key: &'static str, attempt: AttemptId| {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            let scope = scope(key);
            let done = response(key);
            ledger
                .complete(&scope, attempt, &done, Duration::from_secs(60))
                .await
        })
    };
    let before = ledger.written().1;
    let held = complete("held", attempts[0]);
    until_waiting_on_a_lock(&db).await;
    let queued = [
        complete("a", attempts[1]),
        complete("b", attempts[2]),
        complete("stale", AttemptId::random()), // an attempt that lost the row
    ];
    // Real time: the completions reach the pipe while its statement is held.
    tokio::time::sleep(Duration::from_millis(300)).await;
    sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    assert_eq!(held.await.unwrap().unwrap(), Fence::Held);
    let mut fences = Vec::new();
    for task in queued {
        fences.push(task.await.unwrap().unwrap());
    }
    assert_eq!(fences, [Fence::Held, Fence::Held, Fence::Lost]);
    let written = ledger.written().1;
    // The held one alone, then the three together.
    assert_eq!(written.statements - before.statements, 2, "{written:?}");
    assert_eq!(written.rows - before.rows, 4, "{written:?}");
    for key in ["a", "b"] {
        let record = ledger.get(&scope(key)).await.unwrap().unwrap();
        assert_eq!(record.state, RecordState::Completed(response(key)));
    }
    let stale = ledger.get(&scope("stale")).await.unwrap().unwrap();
    assert!(matches!(stale.state, RecordState::InProgress { .. }));
}

/// A claim statement stuck on a row lock holds back the next one only briefly: past
/// [`idem_postgres::group::SLOW`] the next starts beside it (a pool of 16 allows four).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stuck_claim_statement_does_not_stall_the_claims_behind_it() {
    let db = TestDb::create().await;
    db.migrate().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        .connect(&db.url)
        .await
        .unwrap();
    let ledger = PgLedger::new(pool, Duration::from_secs(5));
    let gate = Gate::close(&db, &ledger).await;
    let (_, other) = tokio::time::timeout(
        Duration::from_secs(2),
        claim(&ledger, &scope("other"), Duration::from_secs(30)),
    )
    .await
    .expect("a claim of another key waited for the stuck statement");
    assert!(matches!(other, ClaimResult::Claimed), "{other:?}");
    gate.open().await;
}
