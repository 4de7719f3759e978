//! Races between a gateway's attempt and whoever else may act on its key — the
//! reconciler's probe and an operator — through real gateway processes, the real
//! payments-demo, real Postgres and `idemgate-reconciler --once` passes. Each test says
//! what it failed with on 7fa843d.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use idem_testkit::*;

/// A gateway stalled after its last check and before a request without a body leaves
/// must not send it once its lease is over: by then the key may have been released and
/// a retry executed it. (On 7fa843d, with the failpoint after the gateway's own deadline
/// check, the upstream saw the stalled request after the retry: 2 executions. A body-less
/// request is written without its body ever being asked for, so the body's own deadline
/// never ran.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gateway_stalled_before_a_bodyless_request_leaves_sends_nothing_after_its_lease() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let cfg = leased(&db, &upstream.url(), "900ms", |r| {
        r.set("on_unknown", "release-after:1s")
    })
    .toml();
    let failpoints = Failpoints::new();
    let stalled = GatewayProcess::start_with_env(&cfg, &failpoints.env()).await;
    let http = Http::default();
    let capture = |gw: &GatewayProcess, key: &str| {
        // No body at all: a capture, a confirmation, a "pay the invoice" click.
        http.post(&gw.url("/payments"))
            .tenant("acme")
            .key(key)
            .try_send()
    };
    // One request first, so that the stalled one finds a pooled connection ready.
    let warm = capture(&stalled, &new_key()).await.unwrap();
    assert_eq!(warm.status, StatusCode::CREATED);
    failpoints.arm("stop-before-send");
    let key = new_key();
    let first = tokio::spawn(capture(&stalled, &key));
    failpoints.until_stopped("stop-before-send").await;
    assert!(row(&db, &key).await.is_some(), "claimed, then stalled");

    past_lease().await;
    pass_reporting(&cfg, &["released_after=1"]).await;
    let gw = GatewayProcess::start(&cfg).await;
    let retry = capture(&gw, &key).await.unwrap();
    assert_eq!(retry.status, StatusCode::CREATED);
    assert_eq!(upstream.calls(), 2, "the warm-up and the retry");

    signal(stalled.pid(), "CONT");
    let late = tokio::time::timeout(Duration::from_secs(5), first)
        .await
        .expect("the stalled gateway answers once resumed")
        .unwrap();
    // Real time: whatever the resumed gateway sends, the upstream has it by now.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(upstream.calls(), 2, "the stalled request never left");
    assert_eq!(
        late.map(|a| a.status),
        Ok(StatusCode::BAD_GATEWAY),
        "the late attempt is told its request was not sent"
    );
}

/// A key used again after its record expired is a new operation: the probe asks about
/// this attempt, not about the key, so an earlier payment under the same key is never
/// stored as the new operation's result. (On 7fa843d the pass said `completed=1`: the
/// probe found the first payment, and the retry was answered with it.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_never_takes_an_earlier_life_of_the_key_for_this_one() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = leased(&db, &demo.url(), "900ms", |r| r.probed().set("ttl", "3s")).toml();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let first = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-first", 100))
        .send()
        .await;
    assert_eq!(first.status, StatusCode::CREATED);
    // Real time: past the 3 s TTL, which Postgres's clock judges.
    tokio::time::sleep(Duration::from_millis(3300)).await;

    // The key again, for another payment, which fails without paying: uncertain, held.
    let second = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-second", 7))
        .header("x-demo-fail", "500")
        .send()
        .await;
    assert_eq!(second.status, StatusCode::INTERNAL_SERVER_ERROR);
    pass_reporting(&cfg, &["not_found=1", "completed=0"]).await;
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-second", 7))
        .send()
        .await;
    assert_eq!(
        retry.status,
        StatusCode::CONFLICT,
        "still unknown, not the first payment: {}",
        String::from_utf8_lossy(&retry.body)
    );
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

/// A route's `probe_status` is the status replayed for an operation the probe found:
/// the one the first client would have seen, not the probe's 200. (On 7fa843d the
/// config was refused: `probe_status` was unknown.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probed_result_replays_with_the_routes_probe_status() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = leased(&db, &demo.url(), "900ms", |r| {
        r.probed().set("probe_status", 201)
    })
    .toml();
    let mut doomed = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let key = new_key();
    let send = |gw: &GatewayProcess| {
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-kill", 100))
            .demo_delay(800)
            .try_send()
    };
    let in_flight = tokio::spawn(send(&doomed));
    // Real time: the claim has committed and the demo is working on it.
    tokio::time::sleep(Duration::from_millis(300)).await;
    doomed.kill().await;
    assert!(in_flight.await.unwrap().is_err());
    past_lease().await;
    pass_reporting(&cfg, &["completed=1"]).await;
    let gw = GatewayProcess::start(&cfg).await;
    let replay = send(&gw).await.unwrap();
    assert!(replay.replayed());
    assert_eq!(replay.status, StatusCode::CREATED);
    assert_eq!(replay.json()["orderId"], "o-kill");
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

/// `idemgate keys release` releases only the attempt an operator looked at, and only
/// once its lease is over (or with `--force`). (On 7fa843d a release without an attempt,
/// of a payment still running inside its lease, printed "released", and the retry paid
/// a second time: 2 executions.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_releases_only_the_attempt_shown_and_only_past_its_lease() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = TestConfig::new(&db).payments(&demo, |r| r).toml();
    let path = config_file(&cfg);
    let path = path.to_str().unwrap();
    let gw = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let idemgate = |args: &[&str]| {
        let out = std::process::Command::new(binary("idemgate", "services/gateway/src"))
            .args(["keys"])
            .args(args)
            .args(["--config", path])
            .output()
            .unwrap();
        let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
        (out.status.success(), text(&out.stdout), text(&out.stderr))
    };
    let key = new_key();
    let scope = ["acme", "POST /payments", key.as_str()];
    let running = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-op", 1))
            .demo_delay(2500)
            .send(),
        Duration::from_millis(300),
    )
    .await;

    let release = |extra: &[&str]| {
        idemgate(&[&["release"][..], &scope, &["--reason", "ticket 7"], extra].concat())
    };
    let (ok, out, err) = release(&[]);
    assert!(!ok, "a release names its attempt: {out}{err}");
    let (ok, shown, err) = idemgate(&[&["show", "--json"][..], &scope].concat());
    assert!(ok, "{err}");
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    let attempt = shown["attempt"].as_str().unwrap().to_owned();

    let (ok, _, err) = release(&["--attempt", &uuid::Uuid::new_v4().to_string()]);
    assert!(!ok && err.contains("attempt"), "another attempt: {err}");
    let (ok, _, err) = release(&["--attempt", &attempt]);
    assert!(!ok && err.contains("--force"), "inside its lease: {err}");
    assert!(row(&db, &key).await.is_some(), "nothing changed");

    assert_eq!(running.await.unwrap().status, StatusCode::CREATED);
    let (ok, _, err) = release(&["--attempt", &attempt, "--force"]);
    assert!(!ok && err.contains("completed"), "a completed key: {err}");
    let retry = http
        .pay(&gw.url("/payments"), "acme", &key, &payment("o-op", 1))
        .send()
        .await;
    assert!(retry.replayed());
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);

    // With --force, inside the lease, and said so.
    let key = new_key();
    let scope = ["acme", "POST /payments", key.as_str()];
    let running = in_flight(
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-force", 1))
            .demo_delay(1500)
            .send(),
        Duration::from_millis(300),
    )
    .await;
    let (_, shown, _) = idemgate(&[&["show", "--json"][..], &scope].concat());
    let shown: serde_json::Value = serde_json::from_str(&shown).unwrap();
    let attempt = shown["attempt"].as_str().unwrap();
    let (ok, out, err) = idemgate(
        &[
            &["release"][..],
            &scope,
            &["--reason", "ticket 8", "--attempt", attempt, "--force"],
        ]
        .concat(),
    );
    assert!(ok, "{err}");
    assert!(
        out.contains("released") && out.contains(attempt) && out.contains("inside its lease"),
        "{out}"
    );
    assert!(err.contains("ticket 8") && err.contains("forced"), "{err}");
    let _ = running.await;
}
