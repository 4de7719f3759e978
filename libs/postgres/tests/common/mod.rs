//! What the ledger's tests share: a scope, a response, a ledger on a test database, and
//! the means to force interleavings (another session's uncommitted row, a held group
//! statement, a wait until a statement waits on a lock).
#![allow(dead_code)] // each test binary uses its own part

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AttemptId, BodyKind, Claim, ClaimResult, Fingerprint, IdempotencyKey, Ledger, Scope,
    StoredResponse,
};
use idem_postgres::PgLedger;
use idem_testkit::TestDb;

pub fn scope(key: &str) -> Scope {
    Scope::new(
        "acme",
        "POST /payments",
        IdempotencyKey::parse(key.as_bytes()).unwrap(),
    )
}

pub fn response(body: &'static str) -> StoredResponse {
    StoredResponse::new(
        201,
        vec![("content-type".into(), b"application/json".to_vec())],
        Bytes::from_static(body.as_bytes()),
    )
}

pub async fn ledger(db: &TestDb) -> PgLedger {
    db.migrate().await;
    PgLedger::new(
        sqlx::PgPool::connect(&db.url).await.unwrap(),
        Duration::from_secs(5),
    )
}

/// The fingerprint of every claim these tests make.
pub fn fingerprint() -> Fingerprint {
    Fingerprint::compute("POST", "/payments", BodyKind::Raw, b"x").unwrap()
}

pub async fn claim(ledger: &PgLedger, scope: &Scope, lease: Duration) -> (AttemptId, ClaimResult) {
    let fp = fingerprint();
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

/// A ledger whose pool of four allows one group statement of a kind at a time, so that a
/// test can hold that statement and queue the next one's rows behind it.
pub async fn one_statement_at_a_time(db: &TestDb) -> PgLedger {
    one_statement_at_a_time_within(db, Duration::from_secs(5)).await
}

/// [`one_statement_at_a_time`], with `op_timeout` for each ledger call.
pub async fn one_statement_at_a_time_within(db: &TestDb, op_timeout: Duration) -> PgLedger {
    db.migrate().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .connect(&db.url)
        .await
        .unwrap();
    PgLedger::new(pool, op_timeout)
}

/// Another session's uncommitted insert of `key`: a claim of it waits until the
/// session ends (`ROLLBACK` lets the claim insert).
pub async fn uncommitted_row(db: &TestDb, key: &str) -> sqlx::PgConnection {
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
pub fn claim_in_background(
    ledger: &PgLedger,
    scope: &Scope,
    trace_context: &'static str,
) -> tokio::task::JoinHandle<(AttemptId, Result<ClaimResult, idem_core::LedgerError>)> {
    let (ledger, scope) = (ledger.clone(), scope.clone());
    tokio::spawn(async move {
        let fp = fingerprint();
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
pub struct Gate {
    other: sqlx::PgConnection,
    held: tokio::task::JoinHandle<(AttemptId, Result<ClaimResult, idem_core::LedgerError>)>,
}

impl Gate {
    pub async fn close(db: &TestDb, ledger: &PgLedger) -> Self {
        let other = uncommitted_row(db, "gate").await;
        let held = claim_in_background(ledger, &scope("gate"), "t");
        until_waiting_on_a_lock(db).await;
        Self { other, held }
    }

    /// Lets the held statement go (the other session rolls back: it claims "gate").
    pub async fn open(mut self) {
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
pub async fn claimed_together(
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

pub async fn until_waiting_on_a_lock(db: &TestDb) {
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
