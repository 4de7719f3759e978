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
