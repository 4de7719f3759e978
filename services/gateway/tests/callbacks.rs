//! Settlement callbacks (docs/http-api.md, "Told when it settles") through real HTTP: a
//! tenant's receiver written as tenants write one (`callbacks/receiver.py`, verifying each
//! delivery with the Standard Webhooks library from PyPI), gateway processes killed and
//! started again, the real payments demo and a reconciler pass.

mod common;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use common::*;
use http::StatusCode;
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

const SECRET: &str = "whsec_aWRlbWdhdGUtdGVzdC1zZWNyZXQtMDEyMzQ1Njc4OWFi";

/// A file of the test's own holding the callback secret.
fn secret_file() -> PathBuf {
    let path = std::env::temp_dir().join(format!(
        "idemgate-callback-secret-{}",
        uuid::Uuid::new_v4().simple()
    ));
    std::fs::write(&path, format!("{SECRET}\n")).unwrap();
    path
}

/// `config` telling acme's settlements to 127.0.0.1:`port`.
fn telling(config: TestConfig, port: u16) -> TestConfig {
    config
        .set(
            "tenants.acme.callback_url",
            format!("http://127.0.0.1:{port}/idemgate/settled"),
        )
        .set(
            "tenants.acme.callback_secret_file",
            secret_file().display().to_string(),
        )
}

/// A tenant's callback receiver: a Python process verifying with the Standard Webhooks
/// library; what it received is read from its file.
struct Receiver {
    _child: Child,
    out: PathBuf,
}

impl Receiver {
    async fn start(port: u16) -> Self {
        let out = std::env::temp_dir().join(format!(
            "idemgate-callbacks-{}.jsonl",
            uuid::Uuid::new_v4().simple()
        ));
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/callbacks/receiver.py");
        let mut child = Command::new("python3")
            .arg(script)
            .args([&port.to_string(), SECRET, &out.display().to_string()])
            .stdout(std::process::Stdio::piped())
            .kill_on_drop(true)
            .spawn()
            .expect("python3 runs the receiver");
        let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
        let first = tokio::time::timeout(Duration::from_secs(20), lines.next_line())
            .await
            .expect("the receiver starts within 20 s");
        assert_eq!(
            first.unwrap().as_deref(),
            Some("receiver listening"),
            "the receiver did not start (pip install standardwebhooks)"
        );
        Self { _child: child, out }
    }

    /// Every delivery received so far: verified ones as (webhook-id, body).
    fn received(&self) -> Vec<serde_json::Value> {
        std::fs::read_to_string(&self.out)
            .unwrap_or_default()
            .lines()
            .map(|line| serde_json::from_str(line).unwrap())
            .collect()
    }

    /// The deliveries once at least `n` have come (within `within`), and a little after,
    /// so that a duplicate would have come too.
    async fn wait_for(&self, n: usize, within: Duration) -> Vec<serde_json::Value> {
        let deadline = Instant::now() + within;
        while self.received().len() < n {
            assert!(
                Instant::now() < deadline,
                "{} of {n} callbacks within {within:?}: {:?}",
                self.received().len(),
                self.received()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        tokio::time::sleep(Duration::from_secs(3)).await;
        self.received()
    }
}

/// The verified deliveries by `webhook-id`, each id's deliveries; a refused one fails.
fn by_id(received: &[serde_json::Value]) -> BTreeMap<String, Vec<serde_json::Value>> {
    let mut ids: BTreeMap<String, Vec<serde_json::Value>> = BTreeMap::new();
    for line in received {
        assert!(
            line.get("refused").is_none(),
            "a callback did not verify: {line}"
        );
        ids.entry(line["id"].as_str().unwrap().to_owned())
            .or_default()
            .push(line["body"].clone());
    }
    ids
}

/// The outbox's rows for `keys`: (key, deliveries, delivered).
async fn outbox(db: &TestDb, keys: &[String]) -> Vec<(String, i32, bool)> {
    let mut conn = db.connect().await;
    sqlx::query_as(
        "SELECT key, deliveries, finished_at IS NOT NULL FROM callbacks \
         WHERE key = ANY($1) ORDER BY key",
    )
    .bind(keys)
    .fetch_all(&mut conn)
    .await
    .unwrap()
}

/// Three payments answered 202 settle while their tenant's receiver is down; the gateway
/// that ran them is killed (-9) and another started; the receiver comes up and gets each
/// settlement once, by its `webhook-id`, verified by the Standard Webhooks library. A
/// client that got its answer is not told again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_receiver_down_at_first_gets_each_settlement_once_across_a_restart() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let port = free_port(false);
    let cfg = telling(TestConfig::new(&db).payments(&demo, |r| r), port).toml();
    let mut first = GatewayProcess::start(&cfg).await;
    let http = Http::default();
    let keys: Vec<String> = (0..3).map(|_| new_key()).collect();
    for key in &keys {
        let accepted = http
            .pay(
                &first.url("/payments"),
                "acme",
                key,
                &payment("o-told", 100),
            )
            .header("prefer", "respond-async")
            .demo_delay(700)
            .send()
            .await;
        assert_eq!(accepted.status, StatusCode::ACCEPTED, "{:?}", accepted.body);
    }
    let answered = new_key();
    let paid = http
        .pay(
            &first.url("/payments"),
            "acme",
            &answered,
            &payment("o-answered", 100),
        )
        .send()
        .await;
    assert_eq!(paid.status, StatusCode::CREATED);
    // Settled, and each callback tried at least twice against a receiver not there.
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        let rows = outbox(&db, &keys).await;
        if rows.len() == 3 && rows.iter().all(|(_, deliveries, _)| *deliveries >= 2) {
            break;
        }
        assert!(Instant::now() < deadline, "not tried twice: {rows:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    first.kill().await;
    let second = GatewayProcess::start(&cfg).await;
    let receiver = Receiver::start(port).await;
    let ids = by_id(&receiver.wait_for(3, Duration::from_secs(30)).await);
    assert_eq!(ids.len(), 3, "one settlement per operation: {ids:?}");
    let mut told = BTreeSet::new();
    for (id, bodies) in &ids {
        assert_eq!(bodies.len(), 1, "{id} delivered {} times", bodies.len());
        let body = &bodies[0];
        assert_eq!(body["type"], "idempotency.settled");
        assert_eq!(body["endpoint"], "POST /payments");
        assert_eq!(body["state"], "completed");
        assert_eq!(body["response_status"], 201);
        assert!(body["settled_at"].as_str().is_some(), "{body}");
        assert!(body.get("request").is_none() && body.get("body").is_none());
        told.insert(body["key"].as_str().unwrap().to_owned());
    }
    assert_eq!(told, keys.iter().cloned().collect::<BTreeSet<_>>());
    let rows = outbox(&db, &[keys.clone(), vec![answered.clone()]].concat()).await;
    assert_eq!(
        rows.len(),
        3,
        "the answered client's key is not told: {rows:?}"
    );
    assert!(rows.iter().all(|(_, _, delivered)| *delivered), "{rows:?}");
    for key in &keys {
        assert_eq!(db.executions("demo_payments", "acme", key).await, 1);
    }
    let metrics = Http::default().get(&second.url("/metrics")).send().await;
    assert!(
        String::from_utf8_lossy(&metrics.body)
            .contains("idemgate_callbacks_total{outcome=\"delivered\"} 3"),
        "{}",
        String::from_utf8_lossy(&metrics.body)
    );
}

/// Keys whose clients were answered 504 (the route's timeout) are held; the reconciler
/// settles them — one completed with its probe's answer, one released by the route's
/// `on_unknown` policy — and the tenant is told each: `completed` with the probe's status,
/// and `not_executed`. A client waiting for the held payment's result is woken with the
/// probe's answer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settlements_by_the_reconciler_wake_their_waiters_and_are_told() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let upstream = TestUpstream::start().await;
    let port = free_port(false);
    let receiver = Receiver::start(port).await;
    let cfg = telling(
        TestConfig::new(&db)
            .set("idempotency.lease", "3s")
            .route(
                Route::idempotent("POST", "/payments", &demo.url())
                    .probed()
                    .set("timeout", "500ms"),
            )
            .route(
                Route::idempotent("POST", "/transfers", &upstream.url())
                    .set("timeout", "500ms")
                    .set("on_unknown", "release-after:1s"),
            ),
        port,
    );
    let mut gw = Gateway::start(config(cfg.clone())).await;
    gw.keep(demo);
    let http = Http::default();
    let (paid, transferred) = (new_key(), new_key());
    let timed_out = http
        .pay(&gw.url("/payments"), "acme", &paid, &payment("o-held", 100))
        .demo_delay(1000)
        .send()
        .await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    let timed_out = http
        .pay(&gw.url("/transfers"), "acme", &transferred, "{}")
        .header("x-test-delay-ms", "1000")
        .send()
        .await;
    assert_eq!(timed_out.status, StatusCode::GATEWAY_TIMEOUT);
    let location = format!("/_idemgate/v1/keys/{paid}/result?endpoint=POST%20%2Fpayments");
    let waiter = {
        let call = http
            .get(&gw.url(&location))
            .tenant("acme")
            .header("prefer", "wait=30");
        tokio::spawn(async move { call.send().await })
    };
    // Past the lease the reconciler takes them.
    tokio::time::sleep(Duration::from_secs(4)).await;
    let pass = reconcile_once(&cfg.toml()).await;
    assert!(pass.success, "{}", pass.stderr);
    let woken = waiter.await.unwrap();
    let ids = by_id(&receiver.wait_for(2, Duration::from_secs(15)).await);
    let bodies: BTreeMap<String, serde_json::Value> = ids
        .values()
        .map(|bodies| {
            assert_eq!(bodies.len(), 1, "{bodies:?}");
            (
                bodies[0]["key"].as_str().unwrap().to_owned(),
                bodies[0].clone(),
            )
        })
        .collect();
    assert_eq!(bodies.len(), 2, "{bodies:?}");
    let mut conn = db.connect().await;
    let probed: i32 =
        sqlx::query_scalar("SELECT response_status FROM idempotency_keys WHERE key = $1")
            .bind(&paid)
            .fetch_one(&mut conn)
            .await
            .unwrap();
    assert_eq!(woken.status.as_u16(), u16::try_from(probed).unwrap());
    assert!(
        woken.replayed(),
        "the waiter gets the probe's stored answer"
    );
    assert_eq!(bodies[&paid]["state"], "completed");
    assert_eq!(bodies[&paid]["response_status"], probed);
    assert_eq!(bodies[&transferred]["state"], "not_executed");
    assert_eq!(bodies[&transferred]["endpoint"], "POST /transfers");
    assert!(bodies[&transferred]["response_status"].is_null());
    assert_eq!(db.executions("demo_payments", "acme", &paid).await, 1);
}
