//! Embedded mode through real HTTP, against real Postgres: a service of the test's own
//! (an axum router with an `orders` table and the layer on its route) on a real socket.

mod common;

use std::time::{Duration, SystemTime};

use axum::http::StatusCode;
use common::*;
use idem_embedded::TenantFrom;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn parallel_requests_with_one_key_execute_once_and_answer_alike() {
    let svc = service(|o| o, None).await;
    let http = Http::default();
    for n in [2usize, 50] {
        let key = new_key();
        let calls = (0..n).map(|_| {
            let call = http
                .pay(&svc.url, "acme", &key, &order(7))
                .header("x-sleep-ms", "300");
            tokio::spawn(call.send())
        });
        let mut answers = Vec::new();
        for call in calls.collect::<Vec<_>>() {
            answers.push(call.await.unwrap());
        }
        let orders: i64 =
            sqlx::query_scalar("SELECT count(*) FROM orders WHERE idempotency_key = $1")
                .bind(&key)
                .fetch_one(&svc.pool)
                .await
                .unwrap();
        assert_eq!(orders, 1, "{n} requests with one key made {orders} orders");
        let first = &answers[0];
        for answer in &answers {
            assert_eq!(answer.status, StatusCode::CREATED, "{:?}", answer.body);
            assert_eq!(answer.body, first.body, "every answer is the first one's");
            assert_eq!(answer.header("location"), first.header("location"));
        }
        let replayed = answers.iter().filter(|a| a.replayed()).count();
        assert_eq!(replayed, n - 1, "all but the one that executed are replays");
    }
    assert_eq!(svc.records().await, 2, "one record per key");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_different_payload_is_refused_and_writes_nothing() {
    for status in [409u16, 422] {
        let svc = service(|o| o.mismatch_status(status), None).await;
        let http = Http::default();
        let key = new_key();
        let first = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
        assert_eq!(first.status, StatusCode::CREATED);
        let other = http.pay(&svc.url, "acme", &key, &order(8)).send().await;
        assert_eq!(other.status.as_u16(), status);
        assert_eq!(other.problem(), "idempotency-key-reused");
        assert_eq!(other.json()["operation_state"], "completed");
        assert_eq!((svc.orders().await, svc.records().await), (1, 1));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_whose_answer_keeps_its_tx_commits_nothing() {
    // The answer's body holds the Tx and writes through it while it is read: nothing of
    // it may commit with the answer.
    let svc = service(|o| o, None).await;
    let http = Http::default();
    let leaked = http
        .pay(&svc.url, "acme", &new_key(), &order(7))
        .header("x-leak-tx", "1")
        .send()
        .await;
    assert_eq!(leaked.status, StatusCode::INTERNAL_SERVER_ERROR);
    assert_eq!(
        (svc.orders().await, svc.records().await),
        (0, 0),
        "neither order nor record committed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_that_fails_after_its_insert_leaves_nothing_and_a_retry_executes_once() {
    let svc = service(|o| o, None).await;
    let http = Http::default();
    let key = new_key();
    let failed = http
        .pay(&svc.url, "acme", &key, &order(7))
        .header("x-fail", "1")
        .send()
        .await;
    assert_eq!(failed.status, StatusCode::INTERNAL_SERVER_ERROR);
    let problem = failed.json();
    assert_eq!(problem["operation_state"], "not_executed", "{problem}");
    assert_eq!(problem["safe_new_key"], true, "{problem}");
    assert_eq!(
        problem["title"], "Internal Server Error",
        "the handler's own problem"
    );
    assert_eq!(
        (svc.orders().await, svc.records().await),
        (0, 0),
        "the order and the claim rolled back together"
    );
    let retry = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    assert_eq!(retry.status, StatusCode::CREATED);
    assert!(!retry.replayed());
    let again = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    assert!(again.replayed());
    assert_eq!((svc.orders().await, svc.records().await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_of_a_claim_that_rolls_back_runs_itself() {
    let svc = service(|o| o, None).await;
    let http = Http::default();
    let key = new_key();
    let first = in_flight(
        http.pay(&svc.url, "acme", &key, &order(7))
            .header("x-sleep-ms", "500")
            .header("x-fail", "1")
            .send(),
        Duration::from_millis(150),
    )
    .await;
    let second = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    assert_eq!(
        first.await.unwrap().status,
        StatusCode::INTERNAL_SERVER_ERROR
    );
    assert_eq!(
        second.status,
        StatusCode::CREATED,
        "it waited, then claimed the freed key"
    );
    assert!(!second.replayed());
    assert_eq!((svc.orders().await, svc.records().await), (1, 1));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_waits_past_lock_wait_gets_409_with_retry_after() {
    let svc = service(|o| o.lock_wait(Duration::from_millis(300)), None).await;
    let http = Http::default();
    let key = new_key();
    let first = in_flight(
        http.pay(&svc.url, "acme", &key, &order(7))
            .header("x-sleep-ms", "3000")
            .send(),
        Duration::from_millis(200),
    )
    .await;
    let second = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    assert!(
        !first.is_finished(),
        "the first request still holds its claim"
    );
    assert_eq!(second.status, StatusCode::CONFLICT);
    assert_eq!(second.problem(), "idempotency-key-in-progress");
    assert_eq!(second.header("retry-after"), Some("1"));
    assert_eq!(second.json()["operation_state"], "in_progress");
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    let retry = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    assert!(retry.replayed());
    assert_eq!(retry.body, first.body);
    assert_eq!(svc.orders().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_is_byte_identical_from_memory_and_from_postgres() {
    let svc = service(|o| o, None).await;
    let http = Http::default();
    let key = new_key();
    let first = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(!first.replayed());
    // A second process of the service without replay memory reads the record.
    let cold = service(
        |o| {
            o.replay_memory(idem_core::local::Bounds {
                entries: 0,
                bytes: 0,
            })
        },
        Some(&svc),
    )
    .await;
    let db = svc.db.as_ref().expect("the first service's database");
    let expiry = db
        .expiry("acme", &key)
        .await
        .expect("a completed key expires");
    assert_eq!(
        first.header("idempotency-expires"),
        Some(expiry.as_str()),
        "the first answer says the record's expiry"
    );
    for url in [&svc.url, &cold.url] {
        let replay = http.pay(url, "acme", &key, &order(7)).send().await;
        assert_eq!(replay.status, first.status);
        assert_eq!(replay.body, first.body, "byte-identical");
        assert_eq!(replay.header("location"), first.header("location"));
        assert_eq!(replay.header("content-type"), first.header("content-type"));
        assert!(replay.replayed());
        assert_eq!(
            replay.header("idempotency-expires"),
            Some(expiry.as_str()),
            "a replay says the record's expiry"
        );
    }
    let ttl = expires(&first).duration_since(SystemTime::now()).unwrap();
    assert!(
        ttl > Duration::from_secs(86_300),
        "expires in a day: {ttl:?}"
    );
    assert_eq!(svc.orders().await, 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_problem_and_changes_nothing() {
    let svc = service(|o| o.max_body_bytes(1024), None).await;
    let http = Http::default();
    let missing = http
        .post(&svc.url)
        .tenant("acme")
        .json(&order(7))
        .send()
        .await;
    assert_eq!(missing.status, StatusCode::BAD_REQUEST);
    assert_eq!(missing.problem(), "idempotency-key-missing");
    let invalid = http.pay(&svc.url, "acme", "a b", &order(7)).send().await;
    assert_eq!(invalid.problem(), "idempotency-key-invalid");
    let unsigned = http
        .post(&svc.url)
        .bearer("not-a-token")
        .key(&new_key())
        .json(&order(7))
        .send()
        .await;
    assert_eq!(unsigned.status, StatusCode::UNAUTHORIZED);
    assert_eq!(unsigned.problem(), "unauthorized");
    let not_json = http
        .pay(
            &svc.url,
            "acme",
            &new_key(),
            r#"{"amount": 1, "amount": 2}"#,
        )
        .send()
        .await;
    assert_eq!(not_json.problem(), "request-invalid");
    let huge = http
        .pay(
            &svc.url,
            "acme",
            &new_key(),
            &format!(r#"{{"pad": "{}"}}"#, "x".repeat(2048)),
        )
        .send()
        .await;
    assert_eq!(huge.problem(), "payload-too-large");
    assert_eq!((svc.orders().await, svc.records().await), (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tenants_do_not_share_keys() {
    let svc = service(|o| o, None).await;
    let http = Http::default();
    let key = new_key();
    let acme = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    let globex = http.pay(&svc.url, "globex", &key, &order(7)).send().await;
    assert_eq!(
        (acme.status, globex.status),
        (StatusCode::CREATED, StatusCode::CREATED)
    );
    assert!(!globex.replayed());
    assert_ne!(acme.body, globex.body);
    assert_eq!((svc.orders().await, svc.records().await), (2, 2));
}

/// A layer inside the idempotency layer that answers for the handler (a timeout's 408, a
/// rate limiter's 429) leaves nothing: the handler's insert rolls back with the claim and
/// a retry executes. (On d90d3dd the 408 was stored and the order committed behind it:
/// "a timed-out handler's order, left: (1, 1), right: (0, 0)".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handler_cut_off_by_an_inner_layer_commits_nothing() {
    let svc = service(|o| o, None).await;
    let http = Http::default();
    let timed_out = new_key();
    let answer = http
        .pay(&svc.url, "acme", &timed_out, &order(7))
        .header("x-sleep-ms", "1000")
        .header("x-timeout-ms", "200")
        .send()
        .await;
    assert_eq!(answer.status, StatusCode::REQUEST_TIMEOUT);
    assert_eq!(
        (svc.orders().await, svc.records().await),
        (0, 0),
        "a timed-out handler's order"
    );
    let limited = new_key();
    let answer = http
        .pay(&svc.url, "acme", &limited, &order(7))
        .header("x-rate-limited", "1")
        .send()
        .await;
    assert_eq!(answer.status, StatusCode::TOO_MANY_REQUESTS);
    assert_eq!(svc.records().await, 0, "a refused request's claim");
    for key in [&timed_out, &limited] {
        let retry = http.pay(&svc.url, "acme", key, &order(7)).send().await;
        assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
        assert!(!retry.replayed(), "the retry executes");
    }
    assert_eq!((svc.orders().await, svc.records().await), (2, 2));
}

/// A service behind its own authentication names the tenant in a header it sets: that
/// header, and only it, is the tenant, under the gateway's rules for a tenant. (On
/// d90d3dd a tenant with a space was accepted, and a missing header was reported as "the
/// token carries no tenant in claim \"x-org\"".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trusted_tenant_header_names_the_tenant() {
    let header = TenantFrom::Header(axum::http::HeaderName::from_static("x-org"));
    let svc = service(|o| o.tenant(header), None).await;
    let http = Http::default();
    let key = new_key();
    let send = |org: &[&str]| {
        let mut call = http.post(&svc.url).key(&key).json(&order(7));
        for org in org {
            call = call.header("x-org", org);
        }
        call.send()
    };
    let acme = send(&["acme"]).await;
    assert_eq!(acme.status, StatusCode::CREATED, "{:?}", acme.body);
    let globex = send(&["globex"]).await;
    assert_eq!(globex.status, StatusCode::CREATED);
    assert!(
        !globex.replayed(),
        "another tenant's key is another operation"
    );
    assert!(send(&["acme"]).await.replayed());
    // A bearer token names no tenant here: only the header does.
    let token_only = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
    assert_eq!(token_only.status, StatusCode::UNAUTHORIZED);
    assert!(
        token_only.json()["detail"]
            .as_str()
            .unwrap()
            .contains("header \"x-org\""),
        "{}",
        token_only.json()
    );
    for bad in [&["ac me"][..], &["acme", "globex"], &[""], &["ü"]] {
        let refused = send(bad).await;
        assert_eq!(refused.status, StatusCode::UNAUTHORIZED, "{bad:?}");
        assert_eq!(refused.problem(), "unauthorized");
    }
    assert_eq!((svc.orders().await, svc.records().await), (2, 2));
}

/// A duplicate that waited on the first request's uncommitted claim (from another
/// process) measures the record's remaining life when it reads it, not when its transaction began: its process
/// never replays the answer past the record's end. (On d90d3dd it read the expiry as long
/// as its wait too many, and replayed a record that had expired: "a request after the
/// record's end executes": it was replayed.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_duplicate_that_waited_never_replays_past_the_records_end() {
    let svc = service(|o| o.ttl(Duration::from_secs(3)), None).await;
    // The duplicate's process: it waits on the first's claim in Postgres.
    let other = service(|o| o.ttl(Duration::from_secs(3)), Some(&svc)).await;
    let http = Http::default();
    let key = new_key();
    let first = in_flight(
        http.pay(&svc.url, "acme", &key, &order(7))
            .header("x-sleep-ms", "2500")
            .send(),
        Duration::from_millis(200),
    )
    .await;
    let duplicate = http.pay(&other.url, "acme", &key, &order(7)).send().await;
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    assert!(duplicate.replayed(), "the duplicate waited, then replayed");
    // The record ends 3 s after the first transaction began, about 0.5 s from now; a
    // duplicate that took its own start for the read would keep it 2.8 s from now.
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let later = http.pay(&other.url, "acme", &key, &order(7)).send().await;
    assert_eq!(later.status, StatusCode::CREATED);
    assert!(
        !later.replayed(),
        "a request after the record's end executes"
    );
    assert_eq!(svc.orders().await, 2);
}

/// A commit whose answer is lost (the connection cut right after `COMMIT` left, or just
/// before) is 503 `outcome-unrecorded`, and a retry finds the committed record — or none,
/// and executes: one order either way. (It had no test on d90d3dd.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_whose_answer_is_lost_is_outcome_unrecorded_and_the_retry_settles_it() {
    let proxy = FaultProxy::start("127.0.0.1:5432".parse().unwrap()).await;
    let svc = service_via(
        |o| o,
        None,
        Some(Via {
            proxy: proxy.addr,
            connections: 8,
        }),
    )
    .await;
    let http = Http::default();
    for (delivered, retry_replays) in [(true, true), (false, false)] {
        let key = new_key();
        proxy.set(Fault::CutAt {
            pattern: b"COMMIT",
            deliver: delivered,
        });
        let lost = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
        proxy.heal();
        assert_eq!(
            lost.status,
            StatusCode::SERVICE_UNAVAILABLE,
            "{:?}",
            lost.body
        );
        assert_eq!(lost.problem(), "outcome-unrecorded");
        assert!(lost.header("retry-after").is_some());
        let retry = http.pay(&svc.url, "acme", &key, &order(7)).send().await;
        assert_eq!(retry.status, StatusCode::CREATED, "{:?}", retry.body);
        assert_eq!(
            retry.replayed(),
            retry_replays,
            "the commit reached Postgres: {delivered}"
        );
        let orders: i64 =
            sqlx::query_scalar("SELECT count(*) FROM orders WHERE idempotency_key = $1")
                .bind(&key)
                .fetch_one(&svc.pool)
                .await
                .unwrap();
        assert_eq!(
            orders, 1,
            "orders for one key, commit delivered: {delivered}"
        );
    }
}

/// Duplicates of a key this process is serving wait in memory, not on the first
/// request's row lock with a pooled connection each. (On d90d3dd each held a connection:
/// "sessions waiting on a row lock while 30 duplicates wait, left: 30, right: 0".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicates_of_a_running_key_hold_no_connection() {
    let svc = service(|o| o, None).await;
    let http = Http::default();
    let key = new_key();
    let first = in_flight(
        http.pay(&svc.url, "acme", &key, &order(7))
            .header("x-sleep-ms", "1500")
            .send(),
        Duration::from_millis(200),
    )
    .await;
    let duplicates: Vec<_> = (0..30)
        .map(|_| tokio::spawn(http.pay(&svc.url, "acme", &key, &order(7)).send()))
        .collect();
    // Real time: the duplicates are under way, the first still holds its claim.
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!first.is_finished());
    assert_eq!(
        lock_waiters(&svc).await,
        0,
        "sessions waiting on a row lock while 30 duplicates wait"
    );
    let other = http
        .pay(&svc.url, "globex", &new_key(), &order(1))
        .send()
        .await;
    assert_eq!(other.status, StatusCode::CREATED);
    let first = first.await.unwrap();
    assert_eq!(first.status, StatusCode::CREATED);
    for duplicate in duplicates {
        let duplicate = duplicate.await.unwrap();
        assert_eq!(duplicate.status, StatusCode::CREATED);
        assert!(duplicate.replayed());
        assert_eq!(duplicate.body, first.body);
    }
    assert_eq!(svc.orders().await, 2);
}

/// A duplicate of a key another process holds uncommitted waits on it with a connection
/// of the few set aside for such waits (`max_lock_waits`); beyond them it is answered
/// 409 at once. (On d90d3dd every such duplicate waited with a connection of its own:
/// "beyond the cap, left: 201, right: 409".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waits_on_another_processs_keys_are_capped() {
    let a = service(|o| o, None).await;
    let b = service(|o| o.max_lock_waits(1), Some(&a)).await;
    let http = Http::default();
    let (k1, k2) = (new_key(), new_key());
    let held: Vec<_> = [&k1, &k2]
        .map(|key| {
            tokio::spawn(
                http.pay(&a.url, "acme", key, &order(7))
                    .header("x-sleep-ms", "1500")
                    .send(),
            )
        })
        .into();
    // Real time: both keys are claimed on A, uncommitted.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let waiting = in_flight(
        http.pay(&b.url, "acme", &k1, &order(7)).send(),
        Duration::from_millis(300),
    )
    .await;
    let beyond = http.pay(&b.url, "acme", &k2, &order(7)).send().await;
    assert_eq!(beyond.status, StatusCode::CONFLICT, "beyond the cap");
    assert_eq!(beyond.problem(), "idempotency-key-in-progress");
    assert!(beyond.header("retry-after").is_some());
    let waited = waiting.await.unwrap();
    assert_eq!(waited.status, StatusCode::CREATED, "{:?}", waited.body);
    assert!(waited.replayed(), "it waited for A's answer");
    for first in held {
        assert_eq!(first.await.unwrap().status, StatusCode::CREATED);
    }
    assert_eq!(a.orders().await, 2);
}
