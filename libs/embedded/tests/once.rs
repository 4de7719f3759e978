//! `Idempotency::once`: a job without HTTP (a queue's message) run at most once, its
//! writes and its stored result in one transaction, on real Postgres.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use idem_embedded::{Idempotency, Job, Once, OnceError, Options, Stored, TenantFrom, Tx};
use idem_testkit::TestDb;
use serde_json::{Value, json};
use sqlx::PgPool;

const ENDPOINT: &str = "stream:payments";

struct Consumer {
    db: TestDb,
    pool: PgPool,
    idem: Idempotency,
    /// How many times an operation ran (committed or not).
    runs: Arc<AtomicUsize>,
    /// A permit per operation that has inserted its payment (and holds its claim).
    inserted: Arc<tokio::sync::Semaphore>,
}

async fn consumer(options: impl FnOnce(Options<TenantFrom>) -> Options<TenantFrom>) -> Consumer {
    let db = TestDb::create().await;
    db.migrate().await;
    let pool = PgPool::connect(&db.url).await.expect("connect");
    sqlx::query(
        "CREATE TABLE payments (tenant_id text NOT NULL, idempotency_key text NOT NULL, \
         amount bigint NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    let idem = another(&pool, options);
    Consumer {
        db,
        pool,
        idem,
        runs: Arc::default(),
        inserted: Arc::new(tokio::sync::Semaphore::new(0)),
    }
}

/// A second process's `Idempotency` on the same database.
fn another(
    pool: &PgPool,
    options: impl FnOnce(Options<TenantFrom>) -> Options<TenantFrom>,
) -> Idempotency {
    // No HTTP here: the tenant source is never asked.
    let tenant = TenantFrom::Header(http::HeaderName::from_static("x-tenant"));
    Idempotency::new(pool.clone(), options(Options::default().tenant(tenant)))
}

/// A payment command, as a queue would carry it.
fn job(tenant: &str, key: &str, amount: i64) -> Job {
    let payload = json!({"amount": amount}).to_string();
    Job::new(tenant, ENDPOINT, key, payload.as_bytes())
}

#[derive(Debug)]
enum PayError {
    Db(#[expect(dead_code, reason = "shown by Debug when an assertion fails")] sqlx::Error),
    Declined,
}

impl From<sqlx::Error> for PayError {
    fn from(error: sqlx::Error) -> Self {
        Self::Db(error)
    }
}

impl Consumer {
    /// Pays: inserts the payment through the job's transaction, holds it `hold` more, and
    /// answers 201 with a receipt — or, with `decline`, fails after the insert.
    async fn pay(
        &self,
        idem: &Idempotency,
        job: Job,
        hold: Duration,
        decline: bool,
    ) -> Result<Once, OnceError<PayError>> {
        let (runs, inserted) = (self.runs.clone(), self.inserted.clone());
        let (tenant, key) = (job.tenant().to_owned(), job.key().to_owned());
        idem.once(job, async move |mut tx: Tx| {
            runs.fetch_add(1, Ordering::SeqCst);
            sqlx::query("INSERT INTO payments VALUES ($1, $2, 100)")
                .bind(&tenant)
                .bind(&key)
                .execute(&mut *tx)
                .await?;
            inserted.add_permits(1);
            // Real time: the transaction stays open while a duplicate arrives.
            tokio::time::sleep(hold).await;
            if decline {
                return Err(PayError::Declined);
            }
            Ok(Stored::json(201, &json!({"paid": key})).unwrap())
        })
        .await
    }

    async fn payments(&self, tenant: &str, key: &str) -> i64 {
        self.db.executions("payments", tenant, key).await
    }

    /// Waits until an operation has inserted its payment: its claim is held from then on.
    async fn first_inserted(&self) {
        self.inserted.acquire().await.unwrap().forget();
        // Let a second waiter through too.
        self.inserted.add_permits(1);
    }

    fn runs(&self) -> usize {
        self.runs.load(Ordering::SeqCst)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_runs_once_and_every_redelivery_gets_its_result() {
    let c = consumer(|o| o).await;
    let first = c
        .pay(&c.idem, job("t1", "op-1", 100), Duration::ZERO, false)
        .await
        .unwrap();
    let Once::Ran(stored) = &first else {
        panic!("the first delivery runs: {first:?}");
    };
    assert_eq!(stored.status(), 201);
    assert_eq!(stored.parse::<Value>().unwrap(), json!({"paid": "op-1"}));
    // Redelivered: by this process (its memory), and by another (from Postgres).
    let again = c
        .pay(&c.idem, job("t1", "op-1", 100), Duration::ZERO, false)
        .await
        .unwrap();
    let elsewhere = another(&c.pool, |o| o);
    let there = c
        .pay(&elsewhere, job("t1", "op-1", 100), Duration::ZERO, false)
        .await
        .unwrap();
    assert_eq!(again, Once::Replayed(stored.clone()));
    assert_eq!(there, Once::Replayed(stored.clone()));
    assert_eq!((c.runs(), c.payments("t1", "op-1").await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_same_key_with_another_payload_runs_nothing() {
    let c = consumer(|o| o).await;
    c.pay(&c.idem, job("t1", "op-2", 100), Duration::ZERO, false)
        .await
        .unwrap();
    let other = c
        .pay(&c.idem, job("t1", "op-2", 999), Duration::ZERO, false)
        .await;
    assert!(matches!(other, Err(OnceError::Mismatch)), "{other:?}");
    assert_eq!((c.runs(), c.payments("t1", "op-2").await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_job_keeps_nothing_and_leaves_its_key_free() {
    let c = consumer(|o| o).await;
    let failed = c
        .pay(&c.idem, job("t1", "op-3", 100), Duration::ZERO, true)
        .await;
    assert!(
        matches!(failed, Err(OnceError::Failed(PayError::Declined))),
        "{failed:?}"
    );
    assert_eq!(c.payments("t1", "op-3").await, 0, "its insert rolled back");
    assert_eq!(c.db.ledger_rows("t1").await, 0, "and its claim");
    let retried = c
        .pay(&c.idem, job("t1", "op-3", 100), Duration::ZERO, false)
        .await
        .unwrap();
    assert!(matches!(retried, Once::Ran(_)), "{retried:?}");
    assert_eq!((c.runs(), c.payments("t1", "op-3").await), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_tenants_with_one_key_are_two_jobs() {
    let c = consumer(|o| o).await;
    for tenant in ["t1", "t2"] {
        let ran = c
            .pay(&c.idem, job(tenant, "op-4", 100), Duration::ZERO, false)
            .await
            .unwrap();
        assert!(matches!(ran, Once::Ran(_)), "{tenant}: {ran:?}");
    }
    assert_eq!(
        (
            c.payments("t1", "op-4").await,
            c.payments("t2", "op-4").await
        ),
        (1, 1)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_job_is_refused_before_anything_is_claimed() {
    let c = consumer(|o| o).await;
    for bad in [
        job("t1", "", 100),
        job("t1", &"k".repeat(300), 100),
        job("a tenant", "op-5", 100),
        Job::new("t1", "", "op-5", b"{}"),
    ] {
        let refused = c.pay(&c.idem, bad, Duration::ZERO, false).await;
        assert!(matches!(refused, Err(OnceError::Invalid(_))), "{refused:?}");
    }
    assert_eq!((c.runs(), c.db.ledger_rows("t1").await), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_concurrent_duplicate_waits_for_the_first_and_gets_its_result() {
    let c = consumer(|o| o.lock_wait(Duration::from_secs(5))).await;
    let elsewhere = another(&c.pool, |o| o.lock_wait(Duration::from_secs(5)));
    // The first holds its transaction open; a duplicate in this process waits in memory,
    // one in another process on the row.
    let (first, here, there) = tokio::join!(
        c.pay(
            &c.idem,
            job("t1", "op-6", 100),
            Duration::from_millis(400),
            false
        ),
        async {
            c.first_inserted().await;
            c.pay(&c.idem, job("t1", "op-6", 100), Duration::ZERO, false)
                .await
        },
        async {
            c.first_inserted().await;
            c.pay(&elsewhere, job("t1", "op-6", 100), Duration::ZERO, false)
                .await
        },
    );
    let Once::Ran(stored) = first.unwrap() else {
        panic!("the first runs");
    };
    assert_eq!(here.unwrap(), Once::Replayed(stored.clone()));
    assert_eq!(there.unwrap(), Once::Replayed(stored));
    assert_eq!((c.runs(), c.payments("t1", "op-6").await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_past_lock_wait_is_told_to_come_back() {
    let c = consumer(|o| o.lock_wait(Duration::from_millis(200))).await;
    let elsewhere = another(&c.pool, |o| o.lock_wait(Duration::from_millis(200)));
    let (first, duplicate) = tokio::join!(
        c.pay(
            &c.idem,
            job("t1", "op-7", 100),
            Duration::from_millis(1500),
            false
        ),
        async {
            c.first_inserted().await;
            c.pay(&elsewhere, job("t1", "op-7", 100), Duration::ZERO, false)
                .await
        },
    );
    assert!(matches!(first, Ok(Once::Ran(_))), "{first:?}");
    match duplicate {
        Err(OnceError::InProgress { retry_after }) => assert!(retry_after > Duration::ZERO),
        other => panic!("expected in progress, got {other:?}"),
    }
    assert_eq!((c.runs(), c.payments("t1", "op-7").await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_first_lets_its_waiting_duplicate_run() {
    let c = consumer(|o| o.lock_wait(Duration::from_secs(5))).await;
    let elsewhere = another(&c.pool, |o| o.lock_wait(Duration::from_secs(5)));
    let (first, duplicate) = tokio::join!(
        c.pay(
            &c.idem,
            job("t1", "op-8", 100),
            Duration::from_millis(400),
            true
        ),
        async {
            c.first_inserted().await;
            c.pay(&elsewhere, job("t1", "op-8", 100), Duration::ZERO, false)
                .await
        },
    );
    assert!(matches!(first, Err(OnceError::Failed(_))), "{first:?}");
    assert!(matches!(duplicate, Ok(Once::Ran(_))), "{duplicate:?}");
    assert_eq!((c.runs(), c.payments("t1", "op-8").await), (2, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_that_keeps_its_tx_commits_nothing() {
    let c = consumer(|o| o).await;
    let kept: Arc<std::sync::Mutex<Option<Tx>>> = Arc::default();
    let keep = kept.clone();
    let result = c
        .idem
        .once(job("t1", "op-9", 100), async move |mut tx: Tx| {
            sqlx::query("INSERT INTO payments VALUES ('t1', 'op-9', 100)")
                .execute(&mut *tx)
                .await?;
            // A defect of the consumer's: its transaction outlives the operation.
            *keep.lock().unwrap() = Some(tx);
            Ok::<_, sqlx::Error>(Stored::new(201, "kept"))
        })
        .await;
    assert!(matches!(result, Err(OnceError::Internal)), "{result:?}");
    drop(kept.lock().unwrap().take()); // rolls it back
    assert_eq!(c.payments("t1", "op-9").await, 0);
    assert_eq!(c.db.ledger_rows("t1").await, 0);
}
