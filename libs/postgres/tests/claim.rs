//! Claims against real Postgres: one row per scope, read without locking, shared
//! statements in which each claim learns its own outcome.

mod common;

use std::time::Duration;

use common::*;
use idem_core::{ClaimResult, Fence, Ledger, RecordState};
use idem_postgres::PgLedger;
use idem_testkit::TestDb;

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
        ClaimResult::Locked => panic!("no other transaction holds the row"),
    }
    assert!(
        ledger
            .take_stuck(10, Duration::from_secs(30))
            .await
            .unwrap()
            .is_empty()
    );
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
                .complete(
                    &scope,
                    attempt,
                    &fingerprint(),
                    &response("paid"),
                    Duration::from_secs(60),
                )
                .await
                .unwrap()
                .fence();
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
