//! Unknown outcomes end to end: real gateway processes (killed, paused), the real
//! payments-demo, real Postgres, and `idemgate-reconciler --once` passes.

use std::sync::{Arc, Mutex};
use std::time::Duration;

mod common;

use common::*;
use http::StatusCode;
use idem_testkit::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_killed_mid_request_is_resolved_by_the_probe() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = leased(&db, &demo.url(), "900ms", Route::probed).toml();
    let mut doomed = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let send = |gw: &GatewayProcess| {
        http.post(&gw.url("/payments"))
            .tenant("acme")
            .key(&key)
            .demo_delay(800)
            .json(&payment("o-kill", 100))
            .try_send()
    };
    let in_flight = tokio::spawn(send(&doomed));
    // Real time: the claim has committed and the demo is working on it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    doomed.kill().await;
    assert!(
        in_flight.await.unwrap().is_err(),
        "the client lost its connection"
    );

    let gw = GatewayProcess::start(&cfg).await;
    let retry = send(&gw).await.unwrap();
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "held: the outcome is unknown"
    );
    assert_eq!(retry.problem(), "idempotency-key-in-progress");

    past_lease().await;
    pass_reporting(&cfg, &["completed=1"]).await;

    // The probe's answer (what really happened upstream) is what retries replay.
    let replay = send(&gw).await.unwrap();
    assert_eq!(replay.status, StatusCode::OK);
    assert!(replay.replayed());
    assert_eq!(replay.json()["orderId"], "o-kill");
    let probe = http
        .get(&format!("{}/payments/by-key/{key}", demo.url()))
        .header("x-tenant-id", "acme")
        .send()
        .await;
    assert_eq!(replay.body, probe.body);
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upstream_timeout_is_resolved_by_the_probe() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = leased(&db, &demo.url(), "300ms", Route::probed).toml();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let send = || {
        http.post(&gw.url("/payments"))
            .tenant("acme")
            .key(&key)
            .demo_delay(1000)
            .json(&payment("o-504", 100))
            .send()
    };
    assert_eq!(send().await.status, StatusCode::GATEWAY_TIMEOUT);
    assert_eq!(send().await.status, StatusCode::CONFLICT);
    past_lease().await;
    pass_reporting(&cfg, &["completed=1"]).await;
    let replay = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-504", 100))
        .send()
        .await;
    assert_eq!(replay.status, StatusCode::OK);
    assert_eq!(replay.json()["orderId"], "o-504");
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

// On main (run without `max_response_bytes`, unknown there): "nothing of the oversized
// answer is stored" failed with 300000 bytes stored — probe bodies had no cap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_answer_too_large_to_keep_completes_the_key_without_its_body() {
    let db = TestDb::create().await;
    // Probes carry no x-test-* headers: they get 200 and 300 kB.
    let upstream = TestUpstream::answering(200, Some(300_000)).await;
    let cfg = leased(&db, &upstream.url(), "300ms", |r| {
        r.probed().set("max_response_bytes", 100000)
    })
    .toml();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let send = || {
        http.post(&gw.url("/payments"))
            .tenant("acme")
            .key(&key)
            .header("x-test-bytes", "10")
            .json(&payment("o-big", 100))
    };
    let first = send().header("x-test-delay-ms", "1000").send().await;
    assert_eq!(first.status, StatusCode::GATEWAY_TIMEOUT);
    past_lease().await;
    pass_reporting(&cfg, &["completed=1"]).await;
    let (status, response_status, body) = row(&db, &key).await.unwrap();
    assert_eq!((status.as_str(), response_status), ("completed", Some(200)));
    assert_eq!(
        body.map(|b| b.len()),
        Some(0),
        "nothing of the oversized answer is stored"
    );

    let retry = send().send().await;
    assert_eq!(retry.status, StatusCode::GONE);
    assert_eq!(retry.problem(), "idempotency-result-unavailable");
    assert!(retry.replayed());
    assert_eq!(retry.json()["operation_state"], "completed");
    // The POST once, the probe once; the retry reached nobody.
    assert_eq!(upstream.calls(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_probe_404s_release_the_key_and_the_retry_executes_once() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    // The request goes into a black hole (it never reaches the payments service) ...
    let lost = leased(&db, &black_hole().await, "300ms", Route::probed).toml();
    // ... and the reconciler asks the payments service, which never saw it.
    let cfg = leased(&db, &demo.url(), "900ms", Route::probed)
        .set("reconciler.release_confirm", "1s")
        .toml();
    let http = Http::default();
    let key = new_key();
    {
        let gw = GatewayProcess::start(&lost).await;
        let timed_out = http
            .pay(&gw.url("/payments"), "acme", &key, &payment("o-404", 1))
            .send()
            .await;
        assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    }
    past_lease().await;
    pass_reporting(&cfg, &["not_found=1"]).await;
    assert!(
        row(&db, &key).await.is_some(),
        "one 404 is only \"not yet\""
    );
    // Real time: release_confirm is judged by Postgres's clock.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    pass_reporting(&cfg, &["released=1"]).await;
    assert!(row(&db, &key).await.is_none());

    let gw = GatewayProcess::start(&cfg).await;
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-404", 1))
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_paused_gateways_late_completion_is_fenced_out() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = leased(&db, &demo.url(), "900ms", Route::probed).toml();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let paused = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-pause", 100))
            .demo_delay(800)
            .try_send(),
        Duration::from_millis(300),
    )
    .await;
    signal(gw.pid(), "STOP");
    past_lease().await;
    // Real time: the demo answers the paused gateway at 800 ms.
    tokio::time::sleep(Duration::from_millis(500)).await; // the demo has answered by now
    pass_reporting(&cfg, &["completed=1"]).await;
    let resolved = row(&db, &key).await.unwrap();
    assert_eq!(resolved.0, "completed");
    assert_eq!(resolved.1, Some(200), "the probe's answer");

    signal(gw.pid(), "CONT");
    let _ = tokio::time::timeout(Duration::from_secs(5), paused).await;
    // Real time: the resumed gateway tries its late completion.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(
        row(&db, &key).await.unwrap(),
        resolved,
        "the late completion changed nothing"
    );
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

/// A gateway that stalls after its lease check and before its request leaves (a
/// failpoint stops it there; in production a paused VM, a starved node) must not send the
/// request once its lease is over: by then the reconciler may have released the key on
/// two 404s and a retry executed it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stalled_before_sending_sends_nothing_after_its_lease() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = leased(&db, &demo.url(), "900ms", Route::probed)
        .set("reconciler.release_confirm", "1s")
        .toml();
    let failpoints = std::env::temp_dir().join(format!("idemgate-failpoints-{}", new_key()));
    std::fs::create_dir_all(&failpoints).unwrap();
    let dir = failpoints.to_str().unwrap();
    let stalled = GatewayProcess::start_with_env(&cfg, &[("IDEMGATE_FAILPOINTS", dir)]).await;
    let http = Http::default();
    // One payment first, so that the stalled request finds a pooled connection ready.
    let warm = http
        .pay(
            &stalled.url("/payments"),
            "acme",
            &new_key(),
            &payment("o-warm", 1),
        )
        .send()
        .await;
    assert_eq!(warm.status, StatusCode::CREATED);
    std::fs::write(failpoints.join("stop-before-send"), "").unwrap();
    let key = new_key();
    let first = tokio::spawn(
        http.pay(
            &stalled.url("/payments"),
            "acme",
            &key,
            &payment("o-stall", 1),
        )
        .try_send(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
    while failpoints.join("stop-before-send").exists() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(row(&db, &key).await.is_some(), "claimed, then stalled");

    past_lease().await;
    pass_reporting(&cfg, &["not_found=1"]).await;
    // Real time: release_confirm is judged by Postgres's clock.
    tokio::time::sleep(Duration::from_millis(1100)).await;
    pass_reporting(&cfg, &["released=1"]).await;
    let gw = GatewayProcess::start(&cfg).await;
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-stall", 1))
        .send()
        .await;
    assert_eq!(retry.status, StatusCode::CREATED);

    signal(stalled.pid(), "CONT");
    let late = tokio::time::timeout(Duration::from_secs(5), first).await;
    let late = late
        .expect("the stalled gateway answers once resumed")
        .unwrap();
    // Real time: whatever the resumed gateway sends, the demo has it by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
    assert_eq!(
        late.map(|a| a.status),
        Ok(StatusCode::BAD_GATEWAY),
        "the late attempt is told its request was not sent"
    );
    std::fs::remove_dir_all(&failpoints).unwrap();
}

/// An upstream that records every request path and answers 404.
async fn recording_upstream() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Vec::new()));
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 4096];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]);
                if let Some(path) = head.split_whitespace().nth(1) {
                    log.lock().unwrap().push(path.to_owned());
                }
                let _ = socket
                    .write_all(
                        b"HTTP/1.1 404 Not Found\r\ncontent-length: 0\r\nconnection: close\r\n\r\n",
                    )
                    .await;
            });
        }
    });
    (format!("http://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_reconcilers_probe_each_stuck_row_exactly_once() {
    let db = TestDb::create().await;
    db.migrate().await;
    let (upstream, seen) = recording_upstream().await;
    let keys = stuck_rows(&db, "acme", "POST /payments", 100).await;
    // Small batches, so the two interleave rather than one taking everything at once.
    let cfg = leased(&db, &upstream, "900ms", Route::probed)
        .set("reconciler.batch_size", 10)
        .toml();
    let (a, b) = tokio::join!(reconcile_once(&cfg), reconcile_once(&cfg));
    assert!(a.success && b.success, "{}{}", a.stderr, b.stderr);

    let mut probed = seen.lock().unwrap().clone();
    assert_eq!(probed.len(), 100, "one probe per row");
    probed.sort();
    probed.dedup();
    assert_eq!(probed.len(), 100, "no row probed twice");
    let mut expected: Vec<String> = keys
        .iter()
        .map(|k| format!("/payments/by-key/{k}"))
        .collect();
    expected.sort();
    assert_eq!(probed, expected);
    assert_eq!(
        db.ledger_rows("acme").await,
        100,
        "a first 404 releases nothing"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_probe_keys_are_held_or_released_by_policy() {
    let db = TestDb::create().await;
    db.migrate().await;
    let nowhere = "http://127.0.0.1:9";
    let route = |path| Route::idempotent("POST", path, nowhere).set("timeout", "1s");
    let cfg = TestConfig::new(&db)
        .route(route("/payments"))
        .route(route("/refunds").set("on_unknown", "release-after:1m"))
        .route(route("/transfers").set("on_unknown", "release-after:1h"));
    let held = stuck_rows(&db, "acme", "POST /payments", 1).await;
    let released = stuck_rows(&db, "acme", "POST /refunds", 1).await; // created 2 minutes ago
    let young = stuck_rows(&db, "acme", "POST /transfers", 1).await;
    let pass = reconcile_once(&cfg.toml()).await;
    assert!(pass.success, "{}", pass.stderr);
    assert!(
        pass.stdout.contains("held=1") && pass.stdout.contains("released_after=1"),
        "{}",
        pass.stdout
    );
    assert_eq!(row(&db, &held[0]).await.unwrap().0, "in_progress");
    assert!(row(&db, &released[0]).await.is_none());
    assert_eq!(row(&db, &young[0]).await.unwrap().0, "in_progress");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_inconclusive_probe_leaves_the_key_for_later_with_backoff() {
    let db = TestDb::create().await;
    db.migrate().await;
    // Nothing listens here: every probe fails to connect.
    let nowhere = format!("http://127.0.0.1:{}", free_port(false));
    let keys = stuck_rows(&db, "acme", "POST /payments", 3).await;
    let cfg = leased(&db, &nowhere, "900ms", Route::probed).toml();
    pass_reporting(&cfg, &["probe_failed=3"]).await;
    let again = reconcile_once(&cfg).await;
    assert!(
        again.stdout.contains("probe_failed=0"),
        "backed off, not probed again at once: {}",
        again.stdout
    );
    let mut conn = db.connect().await;
    let attempts: Vec<i32> =
        sqlx::query_scalar("SELECT probe_attempts FROM idempotency_keys WHERE key = ANY($1)")
            .bind(&keys)
            .fetch_all(&mut conn)
            .await
            .unwrap();
    assert_eq!(attempts, vec![1, 1, 1]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_purge_removes_only_expired_rows_while_traffic_flows() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = leased(&db, &demo.url(), "900ms", Route::probed)
        .set("reconciler.purge_batch", 500)
        .toml();
    let gw = GatewayProcess::start(&cfg).await;
    let mut conn = db.connect().await;
    // 3000 expired completed rows, 100 live ones, and in-progress rows past expiry: one
    // still within its lease, one past it — both kept (a held key never lapses).
    for (prefix, expires, count) in [
        ("expired", "now() - interval '1 hour'", 3000),
        ("live", "now() + interval '1 hour'", 100),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotency_keys (tenant_id, endpoint, key, request_hash, status, attempt,
                 response_status, response_headers, response_body, created_at, completed_at, expires_at)
             SELECT 'old', 'POST /payments', '{prefix}-' || i, decode(repeat('00', 32), 'hex'), 'completed',
                 gen_random_uuid(), 201, '[]'::jsonb, 'x'::bytea, now(), now(), {expires}
             FROM generate_series(1, {count}) i"
        )))
        .execute(&mut conn)
        .await
        .unwrap();
    }
    for (key, locked) in [
        ("leased", "now() + interval '1 hour'"),
        ("abandoned", "now() - interval '1 hour'"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "INSERT INTO idempotency_keys (tenant_id, endpoint, key, request_hash, status, attempt,
                 locked_until, created_at, expires_at)
             VALUES ('old', 'POST /other', '{key}', decode(repeat('00', 32), 'hex'), 'in_progress',
                 gen_random_uuid(), {locked}, now(), now() - interval '1 minute')"
        )))
        .execute(&mut conn)
        .await
        .unwrap();
    }

    let http = Http::default();
    let load = tokio::spawn({
        let http = http.clone();
        let url = gw.url("/payments");
        async move {
            let token = token("acme");
            let mut statuses = Vec::new();
            for i in 0..150 {
                let answer = http
                    .post(&url)
                    .bearer(&token)
                    .key(&format!("load-{i}"))
                    .json(&payment(&format!("o-{i}"), 1))
                    .send()
                    .await;
                statuses.push(answer.status);
            }
            statuses
        }
    });
    let pass = reconcile_once(&cfg).await;
    assert!(pass.success, "{}", pass.stderr);
    let statuses = load.await.unwrap();
    assert!(
        statuses.iter().all(|s| *s == StatusCode::CREATED),
        "the load ran without errors: {statuses:?}"
    );

    let count = |filter: &'static str| {
        let url = db.url.clone();
        async move {
            let mut conn = <sqlx::PgConnection as sqlx::Connection>::connect(&url)
                .await
                .unwrap();
            sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                "SELECT count(*) FROM idempotency_keys WHERE {filter}"
            )))
            .fetch_one(&mut conn)
            .await
            .unwrap()
        }
    };
    assert_eq!(count("key LIKE 'expired-%'").await, 0);
    assert_eq!(count("key LIKE 'live-%'").await, 100);
    assert_eq!(
        count("key = 'leased'").await,
        1,
        "never an in-progress row within its lease"
    );
    assert_eq!(
        count("key = 'abandoned'").await,
        1,
        "never an in-progress row, whatever its TTL"
    );
    assert_eq!(
        count("tenant_id = 'acme'").await,
        150,
        "the load's own keys are untouched"
    );
    assert!(pass.stdout.contains("purged=3000"), "{}", pass.stdout);
}

// On main: "error: unrecognized subcommand 'list'" (there was no `keys list --held`);
// behind it, docs/operations.md's `keys release --config FILE …` answered "unexpected argument
// '--config' found", and `keys show` printed a Rust Debug dump.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn operators_can_list_show_and_release_a_held_key() {
    let db = TestDb::create().await;
    db.migrate().await;
    let keys = stuck_rows(&db, "acme", "POST /payments", 1).await;
    let path = config_file(&leased(&db, "http://127.0.0.1:9", "900ms", |r| r).toml());
    let path = path.to_str().unwrap();
    let idemgate = |args: &[&str]| {
        let out = std::process::Command::new(binary("idemgate", "services/gateway/src"))
            .args(args)
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let key = keys[0].as_str();
    let scope = ["acme", "POST /payments", key];

    let (ok, listed, err) = idemgate(&["keys", "list", "--held", "--config", path]);
    assert!(ok, "{err}");
    assert!(listed.contains(key) && listed.contains("acme"), "{listed}");

    // Both orders of --config work.
    let (ok, shown, err) = idemgate(&[&["keys", "show", "--config", path][..], &scope].concat());
    assert!(ok, "{err}");
    for line in [
        "state        held",
        "attempt",
        "created",
        "lease until",
        "probes       none",
    ] {
        assert!(shown.contains(line), "{line:?} in\n{shown}");
    }
    assert!(!shown.contains("KeyInfo {"), "no Debug dump");
    let (ok, json, err) =
        idemgate(&[&["keys", "--config", path, "show", "--json"][..], &scope].concat());
    assert!(ok, "{err}");
    let json: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(
        (json["state"].as_str(), json["key"].as_str()),
        (Some("held"), Some(key))
    );
    let attempt = json["attempt"].as_str().unwrap();

    let (ok, _, err) = idemgate(
        &[
            &["keys", "release", "--config", path][..],
            &scope,
            &["--attempt", attempt],
        ]
        .concat(),
    );
    assert!(!ok && err.contains("--reason"), "a release says why: {err}");
    let release = [
        &["keys", "release", "--config", path][..],
        &scope,
        &["--reason", "ticket 42: never charged", "--attempt", attempt],
    ]
    .concat();
    let (ok, out, err) = idemgate(&release);
    assert!(ok, "{err}");
    assert!(
        out.starts_with("released") && out.contains(attempt),
        "{out}"
    );
    assert!(
        err.contains("released by an operator") && err.contains("ticket 42"),
        "{err}"
    );
    assert!(row(&db, key).await.is_none());
    let (ok, _, _) = idemgate(&release);
    assert!(!ok, "nothing left to release");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_serves_health_and_metrics_and_stops_on_sigterm() {
    let db = TestDb::create().await;
    db.migrate().await;
    let (upstream, _) = recording_upstream().await;
    stuck_rows(&db, "acme", "POST /payments", 2).await;
    let cfg = leased(&db, &upstream, "900ms", Route::probed)
        .set("reconciler.listen", "127.0.0.1:0")
        .set("reconciler.interval", "100ms")
        .set("reconciler.release_confirm", "500ms")
        .toml();
    let mut child =
        tokio::process::Command::new(binary("idemgate-reconciler", "services/reconciler/src"))
            .arg("--config")
            .arg(config_file(&cfg))
            .env("RUST_LOG", "warn")
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .unwrap();
    let addr = read_listen_line(&mut child, "idemgate-reconciler listening on ").await;
    let http = Http::default();
    assert_eq!(
        http.get(&format!("http://{addr}/healthz"))
            .send()
            .await
            .status,
        StatusCode::OK
    );
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    // First both keys are held (one 404 each, confirmation due), then both released.
    for wanted in [
        "idemgate_held_keys 2",
        "idemgate_reconciler_actions_total{action=\"released\"} 2",
    ] {
        loop {
            let metrics = String::from_utf8_lossy(
                &http
                    .get(&format!("http://{addr}/metrics"))
                    .send()
                    .await
                    .body,
            )
            .into_owned();
            if metrics.contains(wanted) {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{wanted:?} in {metrics}"
            );
            // Real time: polling the reconciler process's metrics.
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
    signal(child.id().unwrap(), "TERM");
    let status = tokio::time::timeout(Duration::from_secs(10), child.wait())
        .await
        .expect("stopped")
        .unwrap();
    assert!(status.success(), "a clean exit on SIGTERM");
}
