//! The connection pool against a network that fails the way real ones do.

use std::time::{Duration, Instant};

use idem_postgres::PoolSettings;
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
