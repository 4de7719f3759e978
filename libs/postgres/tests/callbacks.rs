//! The settlement callbacks' outbox against real Postgres: written by the settlement's own
//! statement, once per settled attempt whatever the order of the mark and the settlement,
//! taken by one sender at a time, and each sender's report fenced by its delivery.

mod common;

use std::time::Duration;

use common::*;
use idem_core::{ClaimResult, Completed, Fence, Ledger};
use idem_postgres::OperatorRelease;
use idem_postgres::ledger::callbacks::{Settled, Whose};
use idem_testkit::TestDb;

const LEASE: Duration = Duration::from_secs(30);
const KEEP: Duration = Duration::from_secs(60);

async fn outbox(db: &TestDb) -> Vec<(String, String, Option<i32>)> {
    let mut conn = db.connect().await;
    sqlx::query_as("SELECT key, state, response_status FROM callbacks ORDER BY key")
        .fetch_all(&mut conn)
        .await
        .unwrap()
}

/// A key marked while it runs is told by its completion; one marked after it completed
/// is told by the mark; a completion repeated after a lost reply tells nothing more; an
/// unmarked key's completion tells nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_marked_settlement_is_told_once_whichever_comes_first() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let (before, after, unmarked) = (
        scope("marked-before"),
        scope("marked-after"),
        scope("quiet"),
    );
    let mut attempts = Vec::new();
    for scope in [&before, &after, &unmarked] {
        let (attempt, claimed) = claim(&ledger, scope, LEASE).await;
        assert!(matches!(claimed, ClaimResult::Claimed));
        attempts.push(attempt);
    }
    assert!(ledger.mark_callback(&before).await.unwrap());
    for (scope, attempt) in [&before, &after, &unmarked].into_iter().zip(&attempts) {
        for _ in 0..2 {
            // The second: a completion repeated after its reply was lost.
            let done = ledger
                .complete(scope, *attempt, &fingerprint(), &response("paid"), KEEP)
                .await
                .unwrap();
            assert!(matches!(done, Completed::Recorded { .. }), "{done:?}");
        }
    }
    assert!(ledger.mark_callback(&after).await.unwrap());
    assert!(ledger.mark_callback(&after).await.unwrap(), "marked twice");
    assert!(!ledger.mark_callback(&scope("never-claimed")).await.unwrap());
    let completed = |key: &str| (key.to_owned(), "completed".to_owned(), Some(201));
    assert_eq!(
        outbox(&db).await,
        vec![completed("marked-after"), completed("marked-before")]
    );
}

/// A release tells `not_executed` when the key is marked or the caller asks (the
/// reconciler's, for a tenant with a callback), and a resolution `completed` under the
/// attempt the reconciler took.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn releases_and_resolutions_are_told_when_marked_or_asked() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let keys = [
        "released-marked",
        "released-asked",
        "released-quiet",
        "resolved",
    ];
    let mut attempts = Vec::new();
    for key in keys {
        attempts.push(
            claim(&ledger, &scope(key), Duration::from_millis(1))
                .await
                .0,
        );
    }
    ledger.mark_callback(&scope(keys[0])).await.unwrap();
    for (key, (attempt, tell)) in keys[..3]
        .iter()
        .zip(attempts.iter().zip([false, true, false]))
    {
        let released = ledger.release_attempt(&scope(key), *attempt, tell).await;
        assert_eq!(released.unwrap(), Fence::Held);
    }
    tokio::time::sleep(Duration::from_millis(20)).await;
    let stuck = ledger.take_stuck(10, LEASE).await.unwrap();
    assert_eq!(stuck.len(), 1);
    let resolved = ledger
        .resolve(&stuck[0], &response("probe"), KEEP, true)
        .await;
    assert_eq!(resolved.unwrap(), Fence::Held);
    let not_executed = |key: &str| (key.to_owned(), "not_executed".to_owned(), None);
    assert_eq!(
        outbox(&db).await,
        vec![
            not_executed("released-asked"),
            not_executed("released-marked"),
            ("resolved".into(), "completed".into(), Some(201)),
        ]
    );
    // Told under the attempt the row settled with (the reconciler's fresh one), which a
    // later mark of the row finds.
    let due = ledger
        .take_callbacks(10, LEASE, Whose::Every)
        .await
        .unwrap();
    let resolved = due
        .iter()
        .find(|d| d.scope.key.as_str() == "resolved")
        .unwrap();
    let record = ledger.get(&scope("resolved")).await.unwrap().unwrap();
    assert_eq!(resolved.attempt, record.attempt.0);
    assert_ne!(resolved.attempt, attempts[3].0);
    assert_eq!(resolved.state, Settled::Completed);
}

/// A callback taken is no other sender's until its lease runs out; a report by a delivery
/// that was taken over changes nothing; a failure is tried again later, and given up once
/// the callback is older than the retry period.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_sender_per_callback_and_reports_fenced_by_the_delivery() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("sent");
    let (attempt, _) = claim(&ledger, &scope, LEASE).await;
    ledger.mark_callback(&scope).await.unwrap();
    ledger
        .complete(&scope, attempt, &fingerprint(), &response("paid"), KEEP)
        .await
        .unwrap();
    let only_others = ["globex".to_owned()];
    let none = ledger
        .take_callbacks(10, LEASE, Whose::Only(&only_others))
        .await
        .unwrap();
    assert!(none.is_empty(), "another tenant's sender took it");
    let first = ledger
        .take_callbacks(10, Duration::from_millis(1), Whose::Every)
        .await
        .unwrap();
    assert_eq!(first.len(), 1);
    assert_eq!(first[0].delivery, 1);
    tokio::time::sleep(Duration::from_millis(20)).await;
    // Its lease ran out: taken again, by another sender.
    let second = ledger
        .take_callbacks(10, LEASE, Whose::Every)
        .await
        .unwrap();
    assert_eq!(second.len(), 1);
    assert_eq!(second[0].delivery, 2);
    assert!(
        ledger
            .take_callbacks(10, LEASE, Whose::Every)
            .await
            .unwrap()
            .is_empty()
    );
    // The first sender's late reports change nothing.
    assert!(!ledger.callback_delivered(&first[0]).await.unwrap());
    let late = ledger
        .callback_failed(&first[0], "late", Duration::ZERO, LEASE)
        .await
        .unwrap();
    assert_eq!(late, None);
    // The second's failure: tried again at once (after zero), not given up yet.
    let failed = ledger
        .callback_failed(&second[0], "answered 503", Duration::ZERO, KEEP)
        .await
        .unwrap();
    assert_eq!(failed, Some(false));
    let third = ledger
        .take_callbacks(10, LEASE, Whose::Every)
        .await
        .unwrap();
    assert_eq!(third[0].delivery, 3);
    // Past the retry period: given up.
    let given_up = ledger
        .callback_failed(&third[0], "answered 503", Duration::ZERO, Duration::ZERO)
        .await
        .unwrap();
    assert_eq!(given_up, Some(true));
    assert!(
        ledger
            .take_callbacks(10, LEASE, Whose::Every)
            .await
            .unwrap()
            .is_empty()
    );
}

/// A settlement told is told once under one id, whoever asks again: a mark after the
/// reconciler's resolution (a retry answered 202 meanwhile) finds it told already.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mark_after_a_resolution_tells_nothing_more() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("resolved-then-marked");
    claim(&ledger, &scope, Duration::from_millis(1)).await;
    assert!(ledger.mark_callback(&scope).await.unwrap());
    tokio::time::sleep(Duration::from_millis(20)).await;
    let stuck = ledger.take_stuck(10, LEASE).await.unwrap();
    let resolved = ledger
        .resolve(&stuck[0], &response("probe"), KEEP, false)
        .await;
    assert_eq!(resolved.unwrap(), Fence::Held);
    assert!(ledger.mark_callback(&scope).await.unwrap());
    let told = ledger
        .take_callbacks(10, LEASE, Whose::Every)
        .await
        .unwrap();
    assert_eq!(told.len(), 1, "{told:?}");
}

/// A new attempt on a key whose marked record expired starts unmarked: its client is
/// answered as any other, and its completion tells nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_attempt_on_an_expired_marked_key_is_not_marked() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let scope = scope("expired-then-claimed");
    let (first, _) = claim(&ledger, &scope, LEASE).await;
    ledger.mark_callback(&scope).await.unwrap();
    let done = ledger
        .complete(
            &scope,
            first,
            &fingerprint(),
            &response("paid"),
            Duration::from_millis(1),
        )
        .await
        .unwrap();
    assert!(matches!(done, Completed::Recorded { .. }));
    tokio::time::sleep(Duration::from_millis(20)).await;
    let (second, claimed) = claim(&ledger, &scope, LEASE).await;
    assert!(matches!(claimed, ClaimResult::Claimed), "{claimed:?}");
    ledger
        .complete(
            &scope,
            second,
            &fingerprint(),
            &response("paid again"),
            KEEP,
        )
        .await
        .unwrap();
    assert_eq!(outbox(&db).await.len(), 1, "{:?}", outbox(&db).await);
}

/// An operator's release tells `not_executed` for a tenant with a callback.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operators_release_is_told_when_asked() {
    let db = TestDb::create().await;
    let ledger = ledger(&db).await;
    let (told, quiet) = (scope("operator-told"), scope("operator-quiet"));
    let (a, _) = claim(&ledger, &told, Duration::from_millis(1)).await;
    let (b, _) = claim(&ledger, &quiet, Duration::from_millis(1)).await;
    tokio::time::sleep(Duration::from_millis(20)).await;
    for (scope, attempt, tell) in [(&told, a, true), (&quiet, b, false)] {
        let released = ledger
            .release_by_operator(scope, attempt, false, "test: held", tell)
            .await
            .unwrap();
        assert!(matches!(
            released,
            OperatorRelease::Released { forced: false }
        ));
    }
    assert_eq!(
        outbox(&db).await,
        vec![("operator-told".into(), "not_executed".into(), None)]
    );
}
