//! Races seen from outside the real `idemgate` binary: clients that hang up while their
//! work goes on, clients that never read their answer, and readiness probes in a flood.
//! Each test says what it failed with on 7fa843d.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use tokio::io::AsyncWriteExt;
use tokio::net::TcpStream;

/// A whole `POST /payments` for tenant acme, as bytes on the wire.
fn raw_payment(key: &str, extra_headers: &str, body: &str) -> String {
    format!(
        "POST /payments HTTP/1.1\r\nhost: idemgate\r\nauthorization: Bearer {}\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
         {extra_headers}\r\n{body}",
        token("acme"),
        body.len()
    )
}

/// Sends `request` on a connection of its own and resets the connection `after` that,
/// reading nothing: a client that gave up (at once, or once its request was under way).
async fn hang_up_after(addr: std::net::SocketAddr, request: &str, after: Duration) {
    let mut stream = TcpStream::connect(addr).await.unwrap();
    stream.write_all(request.as_bytes()).await.unwrap();
    // Real time: how long the client waits before it gives up.
    tokio::time::sleep(after).await;
    stream.set_zero_linger().unwrap();
    drop(stream);
}

/// A gateway in front of payments-demo with `max_concurrent_requests = 4`.
async fn four_slots() -> (TestDb, Demo, GatewayProcess) {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = TestConfig::new(&db)
        .set("server.max_concurrent_requests", 4)
        .payments(&demo, |r| r);
    let gw = GatewayProcess::start(&cfg.toml()).await;
    (db, demo, gw)
}

async fn scrape(http: &Http, gw: &GatewayProcess, name: &str) -> f64 {
    let answer = http.get(&gw.url("/metrics")).send().await;
    let text = String::from_utf8(answer.body.to_vec()).unwrap();
    metric(&text, name).unwrap_or_else(|| panic!("no {name} in /metrics"))
}

// On 7fa843d: 12 payments ran at once behind `max_concurrent_requests = 4` (each hung-up
// client's slot was freed while its payment went on).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_up_clients_keep_their_slots_until_their_work_ends() {
    let (db, _demo, gw) = four_slots().await;
    // One after another, each hanging up once its payment is under way.
    for i in 0..12 {
        let body = payment(&format!("o-{i}"), 1);
        let request = raw_payment(&new_key(), "x-demo-delay-ms: 3000\r\n", &body);
        hang_up_after(gw.addr, &request, Duration::from_millis(100)).await;
    }
    // Real time: the last one let in has reached the demo (it inserts, then sleeps 3 s).
    tokio::time::sleep(Duration::from_millis(200)).await;
    let running = db.ledger_rows("acme").await;
    assert!(
        (1..=4).contains(&running),
        "{running} payments at once with 4 slots"
    );
    // Real time: past the demo's delay; each payment completes although nobody waits.
    tokio::time::sleep(Duration::from_millis(3000)).await;
    let mut conn = db.connect().await;
    let completed: i64 = sqlx::query_scalar(
        "SELECT count(*) FROM idempotency_keys WHERE tenant_id = 'acme' AND status = 'completed'",
    )
    .fetch_one(&mut conn)
    .await
    .unwrap();
    assert_eq!(completed, running, "each one that ran was recorded");
    let http = Http::default();
    assert_eq!(
        scrape(&http, &gw, "idemgate_requests_in_flight").await,
        0.0,
        "every slot given back once the work ended"
    );
}

// On 7fa843d: the gateway sent 1,200–1,400 ledger statements in the second after the
// flood (every hung-up waiter went on polling for its 5 s).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hung_up_waiters_stop_waiting() {
    let (db, _demo, gw) = four_slots().await;
    let http = Http::default();
    let key = new_key();
    let body = payment("o-held", 1);
    // The first attempt holds the key for 3 s, inside the route's 5 s timeout (and one
    // of the four slots).
    let first = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &body)
            .demo_delay(3000)
            .send(),
        Duration::from_millis(300),
    )
    .await;
    for _ in 0..200 {
        let request = raw_payment(&key, "prefer: wait=5\r\n", &body);
        hang_up_after(gw.addr, &request, Duration::ZERO).await;
    }
    // Real time: the gateway notices the hang-ups.
    tokio::time::sleep(Duration::from_millis(500)).await;
    let before = scrape(&http, &gw, "idemgate_ledger_statements_total").await;
    // Real time: a second in which a waiter that went on would poll Postgres ~5 times.
    tokio::time::sleep(Duration::from_secs(1)).await;
    let after = scrape(&http, &gw, "idemgate_ledger_statements_total").await;
    assert!(
        after - before <= 2.0,
        "{} ledger statements in the second after the flood: hung-up waiters went on",
        after - before
    );
    assert_eq!(
        scrape(&http, &gw, "idemgate_requests_in_flight").await,
        1.0,
        "only the first attempt still holds a slot"
    );
    let other = http
        .pay(&gw.url("/payments"), "globex", &new_key(), &payment("o", 1))
        .send()
        .await;
    assert_eq!(
        other.status,
        StatusCode::CREATED,
        "another tenant is served"
    );
    assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

// On 7fa843d (run without `server.response_write_timeout`, unknown there): the
// connection stayed open with the answer pending for as long as the client liked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_does_not_read_its_answer_is_cut_off() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let cfg = TestConfig::new(&db)
        .set("server.response_write_timeout", "1s")
        .route(Route::idempotent("POST", "/payments", &upstream.url()));
    let gw = GatewayProcess::start(&cfg.toml()).await;
    let http = Http::default();
    let key = new_key();
    let size = 8 << 20;
    let first = http
        .pay(&gw.url("/payments"), "acme", &key, "{}")
        .header("x-test-bytes", &size.to_string())
        .send()
        .await;
    assert_eq!(first.body.len(), size);

    // A replay to a client with a small receive window that reads nothing for 3 s.
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(16 * 1024).unwrap();
    let mut stream = socket.connect(gw.addr).await.unwrap();
    let request = raw_payment(&key, "x-test-bytes: 8388608\r\n", "{}");
    stream.write_all(request.as_bytes()).await.unwrap();
    // Real time: past the 1 s write timeout.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let got = read_until_closed(&mut stream, Duration::from_secs(5)).await;
    let got = got.expect("the gateway closed the connection");
    assert!(
        got.len() < size,
        "the whole answer arrived ({} bytes): nothing cut the stalled client off",
        got.len()
    );
    // The gateway goes on serving.
    assert!(
        http.pay(&gw.url("/payments"), "acme", &key, "{}")
            .send()
            .await
            .replayed()
    );
}

/// Reads until the peer closes or `within` passes; `None` if still open at the end.
async fn read_until_closed(stream: &mut TcpStream, within: Duration) -> Option<Vec<u8>> {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    loop {
        let mut buf = [0u8; 65536];
        match tokio::time::timeout_at(deadline, stream.read(&mut buf)).await {
            Err(_) => return None,
            Ok(Ok(0)) | Ok(Err(_)) => return Some(got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
        }
    }
}

/// `postgres://user@host:port/db` with `host:port` replaced.
fn via(url: &str, addr: std::net::SocketAddr) -> String {
    let (scheme_user, rest) = url.split_once('@').expect("a user in the URL");
    let (_, db) = rest.split_once('/').expect("a database in the URL");
    format!("{scheme_user}@{addr}/{db}")
}

// On 7fa843d: 300 readiness probes sent ~25 kB of queries to Postgres (one per probe).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn readiness_probes_do_not_reach_postgres() {
    let db = TestDb::create().await;
    db.migrate().await;
    let target = db
        .url
        .split_once('@')
        .and_then(|(_, rest)| rest.split_once('/'))
        .map(|(addr, _)| addr.parse().expect("host:port"))
        .unwrap();
    let proxy = FaultProxy::start(target).await;
    let upstream = TestUpstream::start().await;
    let cfg = TestConfig::new(&db)
        .set("postgres.url", via(&db.url, proxy.addr).as_str())
        .route(Route::idempotent("POST", "/payments", &upstream.url()));
    let gw = GatewayProcess::start(&cfg.toml()).await;
    let http = Http::default();
    assert_eq!(
        http.get(&gw.url("/readyz")).send().await.status,
        StatusCode::OK
    );
    let before = proxy.sent();
    let probes: Vec<_> = (0..300)
        .map(|_| tokio::spawn(http.get(&gw.url("/readyz")).send()))
        .collect();
    for probe in probes {
        assert_eq!(probe.await.unwrap().status, StatusCode::OK);
    }
    let sent = proxy.sent() - before;
    assert!(
        sent < 1000,
        "{sent} bytes went to Postgres for 300 readiness probes"
    );
}

// On d90d3dd: a gateway claim of a key that an embedded-mode transaction held uncommitted
// waited in its group statement until `statement_timeout`, and was answered 503 (the
// claims batched with it waited as long): "the held key: left: 503, right: 409".
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_key_held_by_an_uncommitted_embedded_claim_is_in_progress_and_others_go_on() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let gw = GatewayProcess::start(&TestConfig::new(&db).payments(&demo, |r| r).toml()).await;
    let http = Http::default();
    // Embedded mode's claim of acme's key, on a transaction that stays open (its handler
    // still running).
    let key = new_key();
    let scope = idem_core::Scope::new(
        "acme",
        "POST /payments",
        idem_core::IdempotencyKey::parse(key.as_bytes()).unwrap(),
    );
    let fingerprint =
        idem_core::Fingerprint::compute("POST", "/payments", idem_core::BodyKind::Raw, b"")
            .unwrap();
    let mut embedded = db.connect().await;
    sqlx::query("BEGIN").execute(&mut embedded).await.unwrap();
    let claimed = idem_postgres::ledger::in_tx::claim(
        &mut embedded,
        &idem_core::Claim {
            scope: &scope,
            fingerprint: &fingerprint,
            attempt: idem_core::AttemptId::random(),
            lease: Duration::from_secs(30),
            ttl: Duration::from_secs(60),
            trace_context: None,
        },
        Duration::from_secs(30),
        &idem_postgres::ledger::bodies::Bodies::new(1 << 20),
    )
    .await
    .unwrap();
    assert!(matches!(claimed, idem_core::ClaimResult::Claimed));

    // The held key, among other tenants' new keys sent at the same moment.
    let held = tokio::spawn(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-held", 5))
            .send(),
    );
    let others: Vec<_> = (0..20)
        .map(|i| {
            let call = http.pay(
                &gw.url("/payments"),
                "globex",
                &new_key(),
                &payment(&format!("o-{i}"), 1),
            );
            tokio::spawn(call.send())
        })
        .collect();
    let held = held.await.unwrap();
    assert_eq!(
        held.status,
        StatusCode::CONFLICT,
        "the held key: {:?}",
        held.body
    );
    assert_eq!(held.problem(), "idempotency-key-in-progress");
    assert_eq!(held.json()["operation_state"], "in_progress");
    assert!(held.header("retry-after").is_some());
    for other in others {
        let other = other.await.unwrap();
        assert_eq!(
            other.status,
            StatusCode::CREATED,
            "another tenant's new key: {:?}",
            other.body
        );
    }

    // The embedded request rolls back: the key is free, and the gateway executes it once.
    sqlx::query("ROLLBACK")
        .execute(&mut embedded)
        .await
        .unwrap();
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-held", 5))
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}
