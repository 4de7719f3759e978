//! No tenant takes a shared resource from the others: here the budget of stored answers
//! held for replays (`server.max_replay_bytes_in_flight`).

mod common;

use std::time::Duration;

use common::*;
use http::StatusCode;
use tokio::io::AsyncWriteExt;

/// A replay of `key` for `tenant`, on a connection whose client never reads: the answer
/// holds its stored body until `server.response_write_timeout`.
async fn stalled_replay(gw: &GatewayProcess, tenant: &str, key: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.set_recv_buffer_size(4 * 1024).unwrap();
    let mut stream = socket.connect(gw.addr).await.unwrap();
    let request = format!(
        "POST /payments HTTP/1.1\r\nhost: idemgate\r\nauthorization: Bearer {}\r\n\
         idempotency-key: {key}\r\ncontent-type: application/json\r\n\
         content-length: 2\r\n\r\n{{}}",
        token(tenant)
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    stream
}

/// One tenant's replays of its large answers to clients that never read hold at most its
/// share of `server.max_replay_bytes_in_flight`: another tenant's large replay is still
/// served. (On d90d3dd the first tenant held the whole budget: "another tenant's large
/// replay, left: 503, right: 201".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_slow_readers_cannot_take_the_replay_budget() {
    let db = TestDb::create().await;
    let upstream = TestUpstream::start().await;
    let size: usize = 6 << 20;
    let cfg = TestConfig::new(&db)
        .set("server.max_replay_bytes_in_flight", 64 << 20)
        .set("server.response_write_timeout", "20s")
        .route(
            Route::idempotent("POST", "/payments", &upstream.url())
                .set("max_response_bytes", 8 << 20),
        );
    let gw = GatewayProcess::start(&cfg.toml()).await;
    let http = Http::default();
    let pay = |tenant: &str, key: &str| {
        http.pay(&gw.url("/payments"), tenant, key, "{}")
            .header("x-test-bytes", &size.to_string())
            .send()
    };
    let noisy: Vec<String> = (0..12)
        .map(|i| format!("noisy-{i}-{}", new_key()))
        .collect();
    for key in &noisy {
        assert_eq!(pay("acme", key).await.status, StatusCode::CREATED);
    }
    let calm = new_key();
    let first = pay("globex", &calm).await;
    assert_eq!(first.status, StatusCode::CREATED);

    // acme replays all twelve (72 MiB) to clients that read nothing.
    let mut stalled = Vec::new();
    for key in &noisy {
        stalled.push(stalled_replay(&gw, "acme", key).await);
    }
    // Real time: the replays read their bodies and stall on the clients' windows.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let replay = pay("globex", &calm).await;
    assert_eq!(
        replay.status,
        StatusCode::CREATED,
        "another tenant's large replay"
    );
    assert!(replay.replayed());
    assert_eq!(replay.body.len(), size);
    drop(stalled);
}

/// One tenant with 500,000 completed keys polls its listing of held keys from 32 clients
/// while another tenant pays with new keys: every payment is served. Listings take a
/// bounded share of the ledger (429 or 503 beyond it) and read only what they return.
/// (On d90d3dd each listing walked the tenant's whole index on the shared pool, and the
/// other tenant's claims waited past `acquire_timeout`: "payments not served: [503, 503,
/// 503, 503, 503] (3 paid)".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenants_listing_flood_does_not_starve_another_tenants_claims() {
    let db = TestDb::create().await;
    let demo = Demo::start(&db).await;
    let cfg = TestConfig::new(&db)
        .set("postgres.max_connections", 4)
        .set("postgres.acquire_timeout", "500ms")
        .payments(&demo, |r| r);
    let gw = GatewayProcess::start(&cfg.toml()).await;
    let mut conn = db.connect().await;
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant_id, endpoint, key, request_hash, status, attempt, \
           response_status, response_headers, response_body, created_at, completed_at, expires_at) \
         SELECT 'lister', 'POST /payments', 'k-' || lpad(g::text, 7, '0'), \
           decode(repeat('ab', 32), 'hex'), 'completed', gen_random_uuid(), 201, '[]'::jsonb, \
           '\\x7b7d'::bytea, now(), now(), now() + interval '1 day' \
         FROM generate_series(1, 500000) AS g",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("ANALYZE idempotency_keys")
        .execute(&mut conn)
        .await
        .unwrap();

    let http = Http::default();
    let until = std::time::Instant::now() + Duration::from_secs(4);
    let listing = gw.url("/_idemgate/v1/keys?state=unknown&limit=100");
    let flood: Vec<_> = (0..32)
        .map(|_| {
            let (http, listing) = (http.clone(), listing.clone());
            tokio::spawn(async move {
                let mut answered = 0;
                while std::time::Instant::now() < until {
                    let answer = http.get(&listing).tenant("lister").send().await;
                    assert!(
                        [200, 429, 503].contains(&answer.status.as_u16()),
                        "{:?}",
                        answer.body
                    );
                    answered += usize::from(answer.status == StatusCode::OK);
                }
                answered
            })
        })
        .collect();
    let mut refused = Vec::new();
    let mut paid = 0;
    while std::time::Instant::now() < until {
        let payments: Vec<_> = (0..4)
            .map(|i| {
                tokio::spawn(
                    http.pay(
                        &gw.url("/payments"),
                        "calm",
                        &new_key(),
                        &payment(&format!("o-{i}"), 1),
                    )
                    .send(),
                )
            })
            .collect();
        for payment in payments {
            let answer = payment.await.unwrap();
            match answer.status {
                StatusCode::CREATED => paid += 1,
                other => refused.push(other.as_u16()),
            }
        }
    }
    let mut listings = 0;
    for lister in flood {
        listings += lister.await.unwrap();
    }
    assert!(
        refused.is_empty(),
        "payments not served: {refused:?} ({paid} paid)"
    );
    assert!(
        paid > 0 && listings > 0,
        "{paid} paid, {listings} listings answered"
    );
}
