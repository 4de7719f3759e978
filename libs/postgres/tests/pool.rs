//! The connection pool against a network that fails the way real ones do.

mod common;

use std::time::{Duration, Instant};

use common::*;
use idem_core::{AttemptId, Claim, ClaimResult, Ledger};
use idem_postgres::{PgLedger, PoolSettings};
use idem_testkit::{FaultProxy, TestDb};

/// A connection that sat idle can have been forgotten by a NAT or firewall on the way:
/// its packets vanish, nothing closes it. The pool pings such a connection before
/// handing it out; the ping must give up soon enough that a fresh connection still
/// fits in the acquire timeout. (On the old main the ping had no bound: the acquire
/// failed with "pool timed out while waiting for an open connection" after 2 s although
/// the server took new connections all along.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_idle_connection_gone_silent_is_replaced_within_the_acquire_timeout() {
    let db = TestDb::create().await;
    let server: std::net::SocketAddr = "127.0.0.1:5432".parse().unwrap();
    let proxy = FaultProxy::start(server).await;
    // Plain TCP: over TLS, sqlx's close of the silent connection waits to read the
    // server's close_notify until the acquire's deadline (the connection is dropped then,
    // and the next acquire opens a fresh one).
    let url = db
        .url
        .replacen("127.0.0.1:5432", &proxy.addr.to_string(), 1)
        + "?sslmode=disable";
    assert_ne!(url, db.url, "the test database is on 127.0.0.1:5432");
    let settings = PoolSettings {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(2),
        statement_timeout: Duration::from_secs(2),
        lock_timeout: idem_postgres::LOCK_TIMEOUT,
        application_name: "pool-test".into(),
    };
    let pool = idem_postgres::connect(&url, &settings).await.unwrap();
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(one, 1);

    // Real time: sqlx judges idleness by the real clock, and only a connection idle
    // this long is pinged.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    proxy.stall_open();

    let started = Instant::now();
    let answer: Result<i32, _> = sqlx::query_scalar("SELECT 2").fetch_one(&pool).await;
    assert_eq!(
        answer.as_ref().ok(),
        Some(&2),
        "a fresh connection answers after the silent one is given up ({answer:?} after {:?})",
        started.elapsed()
    );
    assert!(started.elapsed() < settings.acquire_timeout);
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
            lock_timeout: idem_postgres::LOCK_TIMEOUT,
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

/// Through PgBouncer in session pooling, every pooled connection keeps the session's
/// settings (`statement_timeout` and `lock_timeout` among them), and the ledger works. (On
/// d90d3dd they were startup `options`, which PgBouncer refuses: "unsupported startup
/// parameter: options" — or, told to ignore them, drops silently.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_sessions_settings_hold_through_pgbouncer() {
    let db = TestDb::create().await;
    db.migrate().await;
    let bouncer = idem_testkit::PgBouncer::start("session");
    let settings = PoolSettings {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(5),
        statement_timeout: Duration::from_millis(1234),
        lock_timeout: Duration::from_millis(99),
        application_name: "pgbouncer-test".into(),
    };
    let pool = idem_postgres::connect(&bouncer.url_for(&db.url), &settings)
        .await
        .expect("connect through pgbouncer");
    for _ in 0..4 {
        let set: (String, String, String) = sqlx::query_as(
            "SELECT current_setting('statement_timeout'), current_setting('lock_timeout'), \
             current_setting('plan_cache_mode')",
        )
        .fetch_one(&pool)
        .await
        .unwrap();
        assert_eq!(
            set,
            ("1234ms".into(), "99ms".into(), "force_generic_plan".into()),
            "the session's settings through pgbouncer"
        );
    }
    let ledger = PgLedger::new(pool, Duration::from_secs(5));
    let (_, claimed) = claim(
        &ledger,
        &scope("through-pgbouncer"),
        Duration::from_secs(30),
    )
    .await;
    assert!(matches!(claimed, ClaimResult::Claimed));
}

/// The pool of the tests below: two connections, short budgets.
fn small_pool(name: &str) -> PoolSettings {
    PoolSettings {
        max_connections: 2,
        acquire_timeout: Duration::from_secs(2),
        statement_timeout: Duration::from_secs(2),
        lock_timeout: idem_postgres::LOCK_TIMEOUT,
        application_name: name.into(),
    }
}

/// After a failover, a pooled connection to the old primary — a standby now, or about to
/// be — answers every write with 25006 `read_only_sql_transaction` for as long as it is
/// pooled: the node in front (haproxy on Patroni's `/primary`) routes new connections to
/// the new primary, not the ones already open. Such a connection is closed at its first
/// 25006, whichever statement met it. (On d9ae635 it went back to the pool: "a
/// connection that answered 25006 was pooled again", left: 1, right: 0.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_to_a_standby_is_closed_at_its_first_refused_write() {
    let db = TestDb::create().await;
    db.migrate().await;
    // Every session read-only, as every session on a standby is.
    let url = format!("{}?options=-c%20default_transaction_read_only%3Don", db.url);
    let pool = idem_postgres::connect(&url, &small_pool("standby-test"))
        .await
        .unwrap();
    let ledger = PgLedger::new(pool.clone(), Duration::from_secs(5));
    let scope = scope("on-a-standby");

    // A statement of its own (a fenced write), then a group statement (a claim).
    let released = ledger.release(&scope, AttemptId::random()).await;
    assert!(
        released
            .as_ref()
            .is_err_and(|e| format!("{e:?}").contains("25006")),
        "{released:?}"
    );
    settle(&pool).await;
    assert_eq!(
        pool.size(),
        0,
        "a connection that answered 25006 was pooled again"
    );
    let fp = fingerprint();
    let claim = Claim {
        scope: &scope,
        fingerprint: &fp,
        attempt: AttemptId::random(),
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
        trace_context: None,
    };
    let claimed = ledger.claim(&claim).await;
    assert!(
        claimed
            .as_ref()
            .is_err_and(|e| format!("{e:?}").contains("25006")),
        "{claimed:?}"
    );
    settle(&pool).await;
    assert_eq!(
        pool.size(),
        0,
        "a group statement's connection that answered 25006 was pooled again"
    );
}

/// A statement that outlives its budget — its network gone silent, or a `COMMIT` hung on
/// a synchronous standby that is gone — gives its connection up: closed, its place in
/// the pool free at once, not handed back to be pinged behind the statement that never
/// ends. (On d9ae635 the connection went back to sqlx's pool, whose ping waited on it
/// with no bound: "the timed-out statement still holds its place in the pool", left: 1,
/// right: 0 — and a pool of one then had nothing to give the next request.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_statement_past_its_budget_gives_its_connection_up() {
    let db = TestDb::create().await;
    db.migrate().await;
    let proxy = FaultProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let url = db
        .url
        .replacen("127.0.0.1:5432", &proxy.addr.to_string(), 1)
        + "?sslmode=disable";
    let pool = idem_postgres::connect(&url, &small_pool("budget-test"))
        .await
        .unwrap();
    let ledger = PgLedger::new(pool.clone(), Duration::from_millis(500));
    let scope = scope("past-its-budget");
    assert!(ledger.release(&scope, AttemptId::random()).await.is_ok());
    // Back in the pool (sqlx gives it back on a task of its own), for the next statement.
    for _ in 0..40 {
        if pool.num_idle() == 1 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(25)).await;
    }
    assert_eq!((pool.size(), pool.num_idle()), (1, 1));

    proxy.stall_open();
    let released = ledger.release(&scope, AttemptId::random()).await;
    assert!(
        released
            .as_ref()
            .is_err_and(|e| format!("{e:?}").contains("Timeout")),
        "{released:?}"
    );
    settle(&pool).await;
    assert_eq!(
        pool.size(),
        0,
        "the timed-out statement still holds its place in the pool"
    );
    // The next statement gets a fresh connection, which the stall does not touch.
    assert!(ledger.release(&scope, AttemptId::random()).await.is_ok());
}

/// Lets connections being closed or given back finish (both run on tasks of sqlx's).
async fn settle(pool: &sqlx::PgPool) {
    for _ in 0..20 {
        if pool.size() == 0 {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
