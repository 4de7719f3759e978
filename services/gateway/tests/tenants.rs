//! Tenants through real HTTP, real Postgres and the real demo (docs/tenants.md): a tenant's
//! own policy, body limit and quotas, each holding for that tenant alone.

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use tokio::task::JoinHandle;

/// Sends every call at once; their answers, in order.
async fn all(calls: Vec<Call>) -> Vec<Answer> {
    let sent: Vec<JoinHandle<Answer>> = calls.into_iter().map(|c| tokio::spawn(c.send())).collect();
    let mut answers = Vec::with_capacity(sent.len());
    for answer in sent {
        answers.push(answer.await.unwrap());
    }
    answers
}

/// Ledger calls short enough for a tenant's lease (and so its ttl) of 2 s: the lease
/// must outlast every route's timeout plus the ledger's op timeout (1 s here).
fn short(config: TestConfig) -> TestConfig {
    config
        .set("postgres.acquire_timeout", "500ms")
        .set("postgres.statement_timeout", "500ms")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_ttl_is_its_own() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let test_config = short(TestConfig::new(&db))
        .set("tenants.brief.ttl", "2s")
        .set("tenants.brief.lease", "2s")
        .route(Route::idempotent("POST", "/payments", &demo.url()).set("timeout", "500ms"));
    let gw = Gateway::start(config(test_config)).await;
    let http = Http::default();
    let key = new_key();
    let pay = |tenant: &str| {
        http.pay(
            &gw.url("/payments"),
            tenant,
            &key,
            &payment("order-ttl", 100),
        )
        .send()
    };
    for tenant in ["brief", "acme"] {
        assert_eq!(pay(tenant).await.status, StatusCode::CREATED);
        let replay = pay(tenant).await;
        assert!(replay.replayed(), "{tenant}: a replay within its ttl");
    }

    // Real time: Postgres's clock judges the 2 s ttl.
    tokio::time::sleep(Duration::from_millis(2500)).await;
    let brief = pay("brief").await;
    assert_eq!(brief.status, StatusCode::CREATED);
    assert!(!brief.replayed(), "brief's key expired after its 2 s");
    assert_eq!(db.executions("demo_payments", "brief", &key).await, 2);
    let acme = pay("acme").await;
    assert!(acme.replayed(), "acme's key is kept for the route's 24 h");
    assert_eq!(db.executions("demo_payments", "acme", &key).await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_rate_gets_429_while_another_is_served() {
    let (db, gw, http) = setup_with(
        |c| {
            c.set("tenants.default.rate", "5/s")
                .set("tenants.rate-noisy.rate", "5/s")
                .set("tenants.rate-calm.rate", "10000/s")
        },
        |payments| payments,
    )
    .await;
    let url = gw.url("/payments");
    let call = |tenant: &str| http.pay(&url, tenant, &new_key(), &payment("order-rate", 100));
    // Both at once: 40 requests from each, far over the noisy one's 5 a second.
    let tenants: Vec<&str> = (0..40).flat_map(|_| ["rate-noisy", "rate-calm"]).collect();
    let answers = all(tenants.iter().map(|t| call(t)).collect()).await;
    let answers: Vec<(&str, Answer)> = tenants.into_iter().zip(answers).collect();

    let (mut created, mut limited) = (0, 0);
    for (tenant, answer) in &answers {
        match *tenant {
            "rate-calm" => assert_eq!(answer.status, StatusCode::CREATED, "the calm tenant"),
            _ if answer.status == StatusCode::CREATED => created += 1,
            _ => {
                assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
                assert_eq!(answer.problem(), "tenant-rate-limited");
                let retry: u64 = answer.header("retry-after").unwrap().parse().unwrap();
                assert_eq!(
                    retry, 1,
                    "Retry-After: the next token is at most 200 ms away"
                );
                assert!(
                    answer.json().get("operation_state").is_none(),
                    "nothing was claimed"
                );
                limited += 1;
            }
        }
    }
    // The bucket holds one second of the rate: 5, and perhaps one more refilled meanwhile.
    assert!((5..=7).contains(&created), "{created} of 40 admitted");
    assert_eq!(created + limited, 40);
    // Nothing of the refused requests was claimed or executed.
    assert_eq!(db.ledger_rows("rate-noisy").await, created);
    assert_eq!(db.ledger_rows("rate-calm").await, 40);

    // Tenants without an entry get a bucket each from the default.
    for tenant in ["rate-unnamed-1", "rate-unnamed-2"] {
        for _ in 0..5 {
            assert_eq!(
                call(tenant).send().await.status,
                StatusCode::CREATED,
                "{tenant}"
            );
        }
        let over = call(tenant).send().await;
        assert_eq!(over.status, StatusCode::TOO_MANY_REQUESTS, "{tenant}");
    }

    let metrics = http.get(&gw.url("/metrics")).send().await;
    let text = String::from_utf8(metrics.body.to_vec()).unwrap();
    let counted = metric(
        &text,
        "idemgate_tenant_throttled_total{tenant=\"rate-noisy\",quota=\"rate\"}",
    );
    assert_eq!(counted, Some(limited as f64), "{text}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_at_its_concurrency_gets_429_and_its_places_come_back() {
    let (db, gw, http) = setup_with(
        |c| c.set("tenants.busy.max_concurrent_requests", 2),
        |payments| payments,
    )
    .await;
    let url = gw.url("/payments");
    let slow = |tenant: &str| {
        http.pay(&url, tenant, &new_key(), &payment("order-busy", 100))
            .demo_delay(600)
    };
    let tenants = [
        "busy", "busy", "busy", "busy", "busy", "busy", "acme", "acme", "acme",
    ];
    let answers = all(tenants.map(slow).into()).await;
    let statuses: Vec<StatusCode> = answers.iter().map(|a| a.status).collect();
    let busy = &answers[..6];
    assert_eq!(
        busy.iter()
            .filter(|a| a.status == StatusCode::CREATED)
            .count(),
        2,
        "{statuses:?}"
    );
    for refused in busy.iter().filter(|a| a.status != StatusCode::CREATED) {
        assert_eq!(refused.status, StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(refused.problem(), "tenant-concurrency-limited");
        assert_eq!(refused.header("retry-after"), Some("1"));
    }
    assert!(
        answers[6..].iter().all(|a| a.status == StatusCode::CREATED),
        "{statuses:?}"
    );
    assert_eq!(db.ledger_rows("busy").await, 2);
    // Both places are free again once those requests ended.
    let again = all(vec![slow("busy"), slow("busy")]).await;
    assert!(again.iter().all(|a| a.status == StatusCode::CREATED));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_body_limit_is_its_own() {
    let (db, gw, http) = setup_with(
        |c| c.set("tenants.small.max_body_bytes", 40),
        |payments| payments,
    )
    .await;
    let body = payment("order-with-a-long-enough-reference", 100);
    assert!(body.len() > 40);
    let small = http
        .pay(&gw.url("/payments"), "small", &new_key(), &body)
        .send()
        .await;
    assert_eq!(small.status, StatusCode::PAYLOAD_TOO_LARGE);
    assert_eq!(small.problem(), "payload-too-large");
    assert_eq!(db.ledger_rows("small").await, 0);
    let acme = http
        .pay(&gw.url("/payments"), "acme", &new_key(), &body)
        .send()
        .await;
    assert_eq!(acme.status, StatusCode::CREATED);
}

const TRACEPARENT: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// `GET /_idemgate/v1/keys/{key}?endpoint=…` as the tenant sees it.
fn lookup(http: &Http, gw: &Gateway, tenant: &str, key: &str) -> Call {
    http.get(&gw.url(&format!(
        "/_idemgate/v1/keys/{key}?endpoint=POST%20%2Fpayments"
    )))
    .tenant(tenant)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_looks_up_its_key_in_progress_then_completed_and_never_anothers() {
    let (_db, gw, http) = setup().await;
    let key = new_key();
    let paying = in_flight(
        http.pay(
            &gw.url("/payments"),
            "acme",
            &key,
            &payment("order-look", 100),
        )
        .header("traceparent", TRACEPARENT)
        .demo_delay(800)
        .send(),
        Duration::from_millis(300),
    )
    .await;
    let running = lookup(&http, &gw, "acme", &key).send().await;
    assert_eq!(running.status, StatusCode::OK);
    assert_eq!(running.header("content-type"), Some("application/json"));
    let body = running.json();
    assert_eq!(body["state"], "in_progress", "{body}");
    assert_eq!(body["key"], key.as_str());
    assert_eq!(body["endpoint"], "POST /payments");
    assert_eq!(
        body["expires_at"],
        serde_json::Value::Null,
        "held keys have no expiry"
    );
    assert_eq!(body["safe_new_key"], false);

    assert_eq!(paying.await.unwrap().status, StatusCode::CREATED);
    let done = lookup(&http, &gw, "acme", &key).send().await.json();
    assert_eq!(done["state"], "completed", "{done}");
    assert_eq!(done["response_status"], 201);
    assert!(
        done["completed_at"].is_string() && done["expires_at"].is_string(),
        "{done}"
    );
    // The trace the payment ran in (the client's, continued), to find it by.
    assert_eq!(
        done["trace_id"], "4bf92f3577b34da6a3ce929d0e0e4736",
        "{done}"
    );
    let text =
        String::from_utf8(lookup(&http, &gw, "acme", &key).send().await.body.to_vec()).unwrap();
    assert!(!text.contains("order-look"), "never the body: {text}");

    // Another tenant's key and a key never used: the same answer, byte for byte.
    let others = lookup(&http, &gw, "globex", &key).send().await;
    let absent = lookup(&http, &gw, "acme", &new_key()).send().await;
    assert_eq!(others.status, StatusCode::NOT_FOUND);
    assert_eq!(others.problem(), "idempotency-key-not-found");
    assert_eq!(
        (others.status, others.body.clone()),
        (absent.status, absent.body.clone())
    );
    // Bad input: a clear 400, and no token: 401.
    let no_endpoint = http
        .get(&gw.url(&format!("/_idemgate/v1/keys/{key}")))
        .tenant("acme")
        .send()
        .await;
    assert_eq!(no_endpoint.status, StatusCode::BAD_REQUEST);
    assert_eq!(no_endpoint.problem(), "request-invalid");
    let anonymous = http
        .get(&gw.url(&format!(
            "/_idemgate/v1/keys/{key}?endpoint=POST%20%2Fpayments"
        )))
        .send()
        .await;
    assert_eq!(anonymous.status, StatusCode::UNAUTHORIZED);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_pages_through_its_own_keys_by_state() {
    let (_db, gw, http) = setup().await;
    let mut mine = Vec::new();
    for n in 0..5 {
        let key = format!("page-{n}-{}", new_key());
        let paid = http
            .pay(
                &gw.url("/payments"),
                "acme",
                &key,
                &payment(&format!("o-{n}"), 100),
            )
            .send()
            .await;
        assert_eq!(paid.status, StatusCode::CREATED);
        mine.push(key);
    }
    let other = http
        .pay(
            &gw.url("/payments"),
            "globex",
            &new_key(),
            &payment("o-g", 100),
        )
        .send()
        .await;
    assert_eq!(other.status, StatusCode::CREATED);
    mine.sort();

    let mut seen = Vec::new();
    let mut cursor: Option<String> = None;
    for _ in 0..5 {
        let mut url = "/_idemgate/v1/keys?state=completed&limit=2".to_owned();
        if let Some(c) = &cursor {
            url.push_str(&format!("&cursor={c}"));
        }
        let page = http.get(&gw.url(&url)).tenant("acme").send().await;
        assert_eq!(page.status, StatusCode::OK);
        let page = page.json();
        let keys = page["keys"].as_array().unwrap();
        assert!(keys.len() <= 2);
        seen.extend(keys.iter().map(|k| k["key"].as_str().unwrap().to_owned()));
        match page["next_cursor"].as_str() {
            Some(next) => cursor = Some(next.to_owned()),
            None => break,
        }
    }
    assert_eq!(
        seen, mine,
        "every key of acme's, once, in order, and none of globex's"
    );
    let held = http
        .get(&gw.url("/_idemgate/v1/keys?state=unknown"))
        .tenant("acme")
        .send()
        .await
        .json();
    assert_eq!(held["keys"].as_array().unwrap().len(), 0, "{held}");
    let posted = http
        .post(&gw.url("/_idemgate/v1/keys"))
        .tenant("acme")
        .send()
        .await;
    assert_eq!(posted.status, StatusCode::METHOD_NOT_ALLOWED);
    assert_eq!(posted.problem(), "method-not-allowed");
    assert_eq!(posted.header("allow"), Some("GET"));
    for bad in [
        "state=lost",
        "limit=0",
        "limit=101",
        "cursor=zz",
        "color=red",
    ] {
        let answer = http
            .get(&gw.url(&format!("/_idemgate/v1/keys?{bad}")))
            .tenant("acme")
            .send()
            .await;
        assert_eq!(answer.status, StatusCode::BAD_REQUEST, "{bad}");
        assert_eq!(answer.problem(), "request-invalid", "{bad}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idempotency_expires_is_the_records_expiry_on_the_first_answer_and_every_replay() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let redis = RedisServer::start(&[]);
    let base = TestConfig::new(&db)
        .set("tenants.hourly.ttl", "1h")
        .payments(&demo, |r| r);
    // Two gateways on one Redis, and one without: replays from this process's memory,
    // from Redis, and from the ledger.
    let cached = base.clone().redis(&redis.url());
    let a = Gateway::start(config(cached.clone())).await;
    let b = Gateway::start(config(cached)).await;
    let ledger_only = Gateway::start(config(base)).await;
    let http = Http::default();
    for tenant in ["hourly", "acme"] {
        let key = new_key();
        let pay = |gw: &Gateway| {
            http.pay(
                &gw.url("/payments"),
                tenant,
                &key,
                &payment("order-exp", 100),
            )
            .send()
        };
        let first = pay(&a).await;
        assert_eq!(first.status, StatusCode::CREATED);
        let expiry = db
            .expiry(tenant, &key)
            .await
            .expect("a completed key expires");
        assert_eq!(
            first.header("idempotency-expires"),
            Some(expiry.as_str()),
            "{tenant}: the first answer"
        );
        for (from, gw) in [("memory", &a), ("redis", &b), ("ledger", &ledger_only)] {
            let replay = pay(gw).await;
            assert!(replay.replayed(), "{tenant}: a replay from {from}");
            assert_eq!(
                replay.header("idempotency-expires"),
                Some(expiry.as_str()),
                "{tenant}: a replay from {from}"
            );
        }
    }
    assert_eq!(b.cache_stats().hits, 2, "b replayed both keys from Redis");
}

/// A tenant far over its rate writes at most one log line per reason per
/// `server.refusal_log_interval`, with the count, not a line per refusal; the requests it
/// is served keep their access-log lines. (With the refusal branch of `observe` taken out,
/// as on 3d57104, every 429 wrote an access line of its own and none a count: "one line per
/// interval: []".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flood_of_refusals_is_one_log_line_per_interval_with_its_count() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let config = TestConfig::new(&db)
        .set("tenants.acme.rate", "1/s")
        .set("server.refusal_log_interval", "2s")
        .route(Route::idempotent("POST", "/payments", &upstream.url()));
    let gw = GatewayProcess::start_logged(&config.toml()).await;
    let http = Http::default();
    let url = gw.url("/payments");
    let mut refused = 0;
    for _ in 0..150 {
        let answer = http.pay(&url, "acme", &new_key(), "{}").send().await;
        if answer.status == StatusCode::TOO_MANY_REQUESTS {
            refused += 1;
        }
    }
    assert!(refused >= 140, "{refused} refused");
    let served = http.pay(&url, "globex", &new_key(), "{}").send().await;
    assert_eq!(served.status, StatusCode::CREATED);
    // Real time: the interval is the gateway's, written on its own clock.
    tokio::time::sleep(Duration::from_millis(3500)).await;

    let lines: Vec<_> = gw
        .logs("refused")
        .into_iter()
        .filter(|l| l["tenant.id"] == "acme" && l["reason"] == "tenant-rate-limited")
        .collect();
    assert!(
        (1..=3).contains(&lines.len()),
        "one line per interval: {lines:?}"
    );
    let counted: u64 = lines.iter().map(|l| l["count"].as_u64().unwrap()).sum();
    assert_eq!(counted, refused, "every refusal counted: {lines:?}");
    let refusals_logged_as_requests = gw
        .logs("request")
        .iter()
        .filter(|l| l["http.status"] == 429)
        .count();
    assert_eq!(
        refusals_logged_as_requests, 0,
        "one line per interval, not per refusal"
    );
    assert!(
        gw.logs("request").iter().any(|l| l["http.status"] == 201),
        "served requests keep their lines"
    );
}
