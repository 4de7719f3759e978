//! The reconciler's statements, holds and the purge against real Postgres: held keys
//! never lapse, each taken row is looked at by one reconciler, every write is fenced.

mod common;

use std::time::Duration;

use common::*;
use idem_core::{AttemptId, ClaimResult, Fence, Ledger, RecordState};
use idem_testkit::TestDb;

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
            .complete(
                &scope,
                attempt,
                &fingerprint(),
                &response("real"),
                Duration::from_secs(60)
            )
            .await
            .unwrap()
            .fence(),
        Fence::Held
    );
    assert_eq!(
        ledger
            .release_attempt(&stuck[0].scope, stuck[0].attempt, false)
            .await
            .unwrap(),
        Fence::Lost
    );
    assert_eq!(
        ledger
            .resolve(
                &stuck[0],
                &response("probe"),
                Duration::from_secs(60),
                false
            )
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
        ClaimResult::Locked => panic!("no other transaction holds the row"),
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_take_never_waits_for_a_synchronous_standby() {
    // A take committed only once a synchronous standby confirms it hangs while that
    // standby is away; given up, it commits later all the same and holds its rows for the
    // processing lease with no reconciler looking (found by `loadtest/chaos ha-lagging`:
    // 8 keys held past the settle). The shared Postgres has no standby to take away, so
    // this looks at the setting the take's transaction commits with (in a transaction
    // block, to read it before the commit; in production the take is a statement of its
    // own, whose implicit transaction commits with the same setting).
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    claim(&ledger, &scope("unsynced"), Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    let mut conn = db.connect().await;
    let own: String = sqlx::query_scalar("SHOW synchronous_commit")
        .fetch_one(&mut conn)
        .await
        .unwrap();
    assert_ne!(own, "local", "the test needs a session that does wait");
    let commits_with = async |conn: &mut sqlx::PgConnection| {
        sqlx::query("BEGIN").execute(&mut *conn).await.unwrap();
        let taken = sqlx::query(idem_postgres::ledger::reconcile::TAKE_SQL)
            .bind(10_i64)
            .bind(30_000.0_f64)
            .fetch_all(&mut *conn)
            .await
            .unwrap()
            .len();
        let setting: String = sqlx::query_scalar("SHOW synchronous_commit")
            .fetch_one(&mut *conn)
            .await
            .unwrap();
        sqlx::query("COMMIT").execute(&mut *conn).await.unwrap();
        (taken, setting)
    };
    assert_eq!(commits_with(&mut conn).await, (1, "local".to_owned()));
    // Nothing taken, nothing written: the session's own setting is left alone.
    assert_eq!(commits_with(&mut conn).await, (0, own));
}
