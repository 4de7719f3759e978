//! Races in the ledger that no fault schedule had hit, each forced here against real
//! Postgres: another session holding a row, a group statement held on a lock, many
//! replays of one key at once.

mod common;

use std::time::Duration;

use bytes::Bytes;
use common::*;
use idem_core::{ClaimResult, Fence, Ledger, RecordState, StoredResponse};
use idem_postgres::PgLedger;
use idem_testkit::TestDb;

/// A completion that waited on another statement's update of its row (the reconciler's
/// defer at lease end, or the same completion repeated after its reply was lost) still
/// owns the row and completes it: writes are fenced by the key and the attempt, never
/// by where the row happened to be stored. (On 7fa843d both came back `Lost`: the
/// completion looked the row up by its old physical address.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_completion_that_waited_on_another_update_of_its_row_still_completes_it() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    for (key, update) in [
        (
            "deferred",
            "UPDATE idempotency_keys SET locked_until = now() + interval '1 minute', \
               probe_attempts = probe_attempts + 1 \
             WHERE key = $1 AND attempt = $2",
        ),
        (
            "repeated",
            "UPDATE idempotency_keys SET status = 'completed', response_status = 201, \
               response_headers = '[]', response_body = 'paid', completed_at = now(), \
               locked_until = NULL \
             WHERE key = $1 AND attempt = $2",
        ),
    ] {
        let scope = scope(key);
        let (attempt, claimed) = claim(&ledger, &scope, Duration::from_secs(30)).await;
        assert!(matches!(claimed, ClaimResult::Claimed));
        let mut other = db.connect().await;
        sqlx::query("BEGIN").execute(&mut other).await.unwrap();
        sqlx::query(update)
            .bind(key)
            .bind(attempt.0)
            .execute(&mut other)
            .await
            .unwrap();
        let completing = {
            let (ledger, scope) = (ledger.clone(), scope.clone());
            tokio::spawn(async move {
                let paid = response("paid");
                ledger
                    .complete(
                        &scope,
                        attempt,
                        &fingerprint(),
                        &paid,
                        Duration::from_secs(60),
                    )
                    .await
            })
        };
        until_waiting_on_a_lock(&db).await;
        sqlx::query("COMMIT").execute(&mut other).await.unwrap();
        assert_eq!(
            completing.await.unwrap().unwrap().fence(),
            Fence::Held,
            "{key}: the attempt still owns its row"
        );
        let record = ledger.get(&scope).await.unwrap().unwrap();
        assert_eq!(
            record.state,
            RecordState::Completed(response("paid")),
            "{key}"
        );
    }
}

/// Concurrent replays of one large stored answer read its body once and share one copy,
/// however many retries ask at once. (On 7fa843d each of the 64 got a copy of its own:
/// 384 MiB for one 6 MiB answer.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_replays_of_a_large_answer_share_one_copy_of_its_body() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("large");
    let (attempt, _) = claim(&ledger, &scope, Duration::from_secs(30)).await;
    let body = Bytes::from(vec![7u8; 6 << 20]);
    let stored = StoredResponse::new(201, Vec::new(), body.clone());
    let fence = ledger
        .complete(
            &scope,
            attempt,
            &fingerprint(),
            &stored,
            Duration::from_secs(60),
        )
        .await
        .unwrap()
        .fence();
    assert_eq!(fence, Fence::Held);

    // Half of them claim (a retry), half read the row (a waiter polling it).
    let replays: Vec<_> = (0..64)
        .map(|i| {
            let (ledger, scope) = (ledger.clone(), scope.clone());
            tokio::spawn(async move {
                let record = if i % 2 == 0 {
                    match claim(&ledger, &scope, Duration::from_secs(30)).await.1 {
                        ClaimResult::Existing(record) => record,
                        ClaimResult::Claimed => panic!("a completed key was claimed again"),
                        ClaimResult::Locked => panic!("no other transaction holds the row"),
                    }
                } else {
                    ledger.get(&scope).await.unwrap().expect("the row")
                };
                match record.state {
                    RecordState::Completed(response) => response.body,
                    other => panic!("not completed: {other:?}"),
                }
            })
        })
        .collect();
    let mut bodies = Vec::new();
    for replay in replays {
        bodies.push(replay.await.unwrap());
    }
    assert!(bodies.iter().all(|b| *b == body), "every replay is whole");
    let mut copies: Vec<usize> = bodies.iter().map(|b| b.as_ptr() as usize).collect();
    copies.sort_unstable();
    copies.dedup();
    assert_eq!(copies.len(), 1, "one copy shared by 64 replays");
    let held = ledger.bodies();
    assert_eq!(held.reads, 1, "read from Postgres once: {held:?}");
    assert_eq!(held.held_bytes, 6 << 20, "one copy counted: {held:?}");
    drop(bodies);
    assert_eq!(
        ledger.bodies().held_bytes,
        0,
        "given back once nobody holds it"
    );
}

/// Large stored answers held at once are bounded in bytes: a replay that would hold
/// more is refused at once (the gateway answers 503 `overloaded`), before anything is
/// read, and goes through once the memory is free again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replays_beyond_the_bytes_in_flight_are_refused_until_memory_is_free() {
    let db = TestDb::create().await;
    db.migrate().await;
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    let ledger = PgLedger::with_replay_budget(pool, Duration::from_secs(5), 10 << 20);
    let mut scopes = Vec::new();
    for key in ["one", "two"] {
        let scope = scope(key);
        let (attempt, _) = claim(&ledger, &scope, Duration::from_secs(30)).await;
        let stored = StoredResponse::new(201, Vec::new(), Bytes::from(vec![1u8; 6 << 20]));
        let ttl = Duration::from_secs(60);
        let fence = ledger
            .complete(&scope, attempt, &fingerprint(), &stored, ttl)
            .await
            .unwrap()
            .fence();
        assert_eq!(fence, Fence::Held);
        scopes.push(scope);
    }
    let first = ledger.get(&scopes[0]).await.unwrap().unwrap();
    let refused = ledger.get(&scopes[1]).await.unwrap_err();
    assert!(refused.is_busy(), "{refused}");
    let claimed = claim_result(&ledger, &scopes[1]).await;
    assert!(claimed.as_ref().is_err_and(|e| e.is_busy()), "{claimed:?}");
    drop(first);
    let second = ledger.get(&scopes[1]).await.unwrap().unwrap();
    assert!(matches!(second.state, RecordState::Completed(_)));
}

async fn claim_result(
    ledger: &PgLedger,
    scope: &idem_core::Scope,
) -> Result<ClaimResult, idem_core::LedgerError> {
    claim_in_background(ledger, scope, "t").await.unwrap().1
}

/// A claim whose request stopped waiting (its statement was held on another session's
/// row past the op timeout), and whose release therefore found nothing to delete, is
/// released once its statement goes on and commits it after all. (On 7fa843d the key
/// stayed in progress for good: on a route without a probe, held until an operator came.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_commits_after_its_request_gave_up_is_released() {
    let db = TestDb::create().await;
    let ledger = one_statement_at_a_time_within(&db, Duration::from_secs(1)).await;
    let mut blocker = uncommitted_row(&db, "a-blocked").await;
    // The two claims queue behind the gate's statement and then share the next one,
    // which waits on the other session's row "a-blocked" (rows go in key order).
    let gate = Gate::close(&db, &ledger).await;
    let queued = [
        claim_in_background(&ledger, &scope("a-blocked"), "t"),
        claim_in_background(&ledger, &scope("b-mine"), "t"),
    ];
    gate.open().await;
    until_waiting_on_a_lock(&db).await;
    for (key, task) in ["a-blocked", "b-mine"].into_iter().zip(queued) {
        let (attempt, answer) = task.await.unwrap();
        assert!(
            answer.is_err(),
            "{key}: past the 1 s op timeout: {answer:?}"
        );
        // What the engine does with a claim that failed: release its attempt, in case
        // the claim committed with only its reply lost. Nothing is there yet.
        let released = ledger.release(&scope(key), attempt).await.unwrap();
        assert_eq!(released, Fence::Lost, "{key}: not committed yet");
    }
    // The other session gives its row up: the held statement goes on and commits.
    sqlx::query("ROLLBACK").execute(&mut blocker).await.unwrap();
    let mut conn = db.connect().await;
    let mut left = Vec::new();
    for _ in 0..300 {
        left = sqlx::query_scalar::<_, String>(
            "SELECT key FROM idempotency_keys WHERE key IN ('a-blocked', 'b-mine') ORDER BY key",
        )
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let running: i64 = sqlx::query_scalar(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() \
             AND state = 'active' AND pid <> pg_backend_pid()",
        )
        .fetch_one(&mut conn)
        .await
        .unwrap();
        if left.is_empty() && running == 0 {
            break;
        }
        // Real time: the held statement finishes on Postgres's side.
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    assert!(
        left.is_empty(),
        "claims whose requests gave up are left held: {left:?}"
    );
}
