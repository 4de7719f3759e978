//! The connection pool against a network that fails the way real ones do.

mod common;

use std::time::{Duration, Instant};

use common::*;
use idem_core::ClaimResult;
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
