//! Completions against real Postgres: fenced by their attempt, grouped, and kind to
//! the pool's memory.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use idem_core::{AttemptId, ClaimResult, Completed, Fence, Ledger, RecordState, StoredResponse};
use idem_postgres::PgLedger;
use idem_testkit::TestDb;

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
        .resolve(
            &stuck[0],
            &response("probe"),
            Duration::from_secs(60),
            false,
        )
        .await
        .unwrap();
    assert_eq!(fence, Fence::Held);

    // The original attempt wakes up and tries to complete and to release: both lose.
    assert_eq!(
        ledger
            .complete(
                &scope,
                attempt,
                &fingerprint(),
                &response("late"),
                Duration::from_secs(60)
            )
            .await
            .unwrap(),
        Completed::Lost
    );
    assert_eq!(ledger.release(&scope, attempt).await.unwrap(), Fence::Lost);
    let record = ledger.get(&scope).await.unwrap().unwrap();
    assert_eq!(record.state, RecordState::Completed(response("probe")));
    assert_eq!(record.trace_context.as_deref(), Some("00-abc-def-01"));
}

/// What `Idempotency-Expires` says: the expiry the completion wrote, to the microsecond,
/// as the completion returns it and as every later read gives it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_says_when_its_row_expires_as_the_row_says_it() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("expiry");
    let (attempt, _) = claim(&ledger, &scope, Duration::from_secs(30)).await;
    let ttl = Duration::from_secs(3600);
    let Completed::Recorded { expires_at } = ledger
        .complete(&scope, attempt, &fingerprint(), &response("paid"), ttl)
        .await
        .unwrap()
    else {
        panic!("the attempt owns its row");
    };
    let mut conn = db.connect().await;
    let (written, now): (i64, i64) = sqlx::query_as(
        "SELECT (extract(epoch from expires_at) * 1000000)::int8, \
                (extract(epoch from now()) * 1000000)::int8 \
         FROM idempotency_keys WHERE key = 'expiry'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    let micros = |at: std::time::SystemTime| {
        at.duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros() as i64
    };
    assert_eq!(micros(expires_at), written, "the completion's answer");
    let left = written - now;
    assert!(
        (3_590_000_000..=3_600_000_000).contains(&left),
        "an hour from the completion: {left} µs"
    );
    let record = ledger.get(&scope).await.unwrap().unwrap();
    assert_eq!(record.expires_at, Some(expires_at), "a later read");

    // The same completion again (its reply was lost): the record keeps its expiry, which
    // a retry may have replayed already.
    tokio::time::sleep(Duration::from_millis(20)).await;
    let again = ledger
        .complete(&scope, attempt, &fingerprint(), &response("paid"), ttl)
        .await
        .unwrap();
    assert_eq!(again, Completed::Recorded { expires_at }, "a repeat");
    let record = ledger.get(&scope).await.unwrap().unwrap();
    assert_eq!(record.expires_at, Some(expires_at), "read after the repeat");
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
                ledger
                    .complete(&scope, attempt, &fingerprint(), &body, ttl)
                    .await
                    .unwrap()
                    .fence(),
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
                .complete(
                    &scope,
                    attempt,
                    &fingerprint(),
                    &done,
                    Duration::from_secs(60),
                )
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
    assert_eq!(held.await.unwrap().unwrap().fence(), Fence::Held);
    let mut fences = Vec::new();
    for task in queued {
        fences.push(task.await.unwrap().unwrap().fence());
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

/// A failover to a standby that had not received the claim's commit loses the row while
/// its attempt runs. The completion then finds no row at all — not a row another attempt
/// owns — and writes the completed record back, so a retry replays instead of claiming
/// the key afresh and executing again; a row another attempt claimed meanwhile is still
/// never overwritten. (On d90d3dd the completion answered `Lost` and wrote nothing:
/// "a completion whose row vanished: Lost".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_whose_row_vanished_writes_it_back() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let mut conn = db.connect().await;
    const DELETE: &str = "DELETE FROM idempotency_keys WHERE key = $1";

    let vanished = scope("vanished");
    let (attempt, _) = claim(&ledger, &vanished, Duration::from_secs(30)).await;
    sqlx::query(DELETE)
        .bind("vanished")
        .execute(&mut conn)
        .await
        .unwrap();
    let completed = ledger
        .complete(
            &vanished,
            attempt,
            &fingerprint(),
            &response("paid"),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert!(
        matches!(completed, Completed::Recorded { .. }),
        "a completion whose row vanished: {completed:?}"
    );
    let record = ledger.get(&vanished).await.unwrap().expect("written back");
    assert_eq!(record.attempt, attempt);
    assert_eq!(record.fingerprint, fingerprint(), "the claim's fingerprint");
    let RecordState::Completed(stored) = &record.state else {
        panic!("restored in progress: {record:?}");
    };
    assert_eq!(stored.body, Bytes::from_static(b"paid"));
    assert_eq!(
        record.expires_at,
        match completed {
            Completed::Recorded { expires_at } => Some(expires_at),
            Completed::Lost => None,
        }
    );
    // A retry's claim now finds the answer: it replays.
    let (_, retried) = claim(&ledger, &vanished, Duration::from_secs(30)).await;
    assert!(
        matches!(retried, ClaimResult::Existing(ref r) if r.attempt == attempt),
        "a retry after the write-back: {retried:?}"
    );

    // The row vanished and another attempt claimed the key since: that row is its own.
    let taken = scope("taken");
    let (first, _) = claim(&ledger, &taken, Duration::from_secs(30)).await;
    sqlx::query(DELETE)
        .bind("taken")
        .execute(&mut conn)
        .await
        .unwrap();
    let (second, _) = claim(&ledger, &taken, Duration::from_secs(30)).await;
    assert_ne!(first, second);
    let late = ledger
        .complete(
            &taken,
            first,
            &fingerprint(),
            &response("late"),
            Duration::from_secs(60),
        )
        .await
        .unwrap();
    assert_eq!(late, Completed::Lost, "another attempt's row");
    let record = ledger.get(&taken).await.unwrap().unwrap();
    assert_eq!(record.attempt, second);
    assert!(
        matches!(record.state, RecordState::InProgress { .. }),
        "{record:?}"
    );
}
