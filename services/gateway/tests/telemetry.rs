//! Traces that follow a retry to its first execution, received by an OTLP/HTTP endpoint
//! inside the test; and Prometheus metrics that move as requests are sent.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use http::StatusCode;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// An upstream that answers 201 and records the `traceparent` of each request.
async fn traced_upstream() -> (String, Arc<Mutex<Vec<String>>>) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let log = seen.clone();
    tokio::spawn(async move {
        while let Ok((mut socket, _)) = listener.accept().await {
            let log = log.clone();
            tokio::spawn(async move {
                let mut buf = vec![0u8; 8192];
                let n = socket.read(&mut buf).await.unwrap_or(0);
                let head = String::from_utf8_lossy(&buf[..n]).to_ascii_lowercase();
                if let Some(tp) = head.lines().find_map(|l| l.strip_prefix("traceparent:")) {
                    log.lock().unwrap().push(tp.trim().to_owned());
                }
                let body = br#"{"paymentId":"p-1"}"#;
                let head = format!(
                    "HTTP/1.1 201 Created\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                    body.len()
                );
                let _ = socket.write_all(head.as_bytes()).await;
                let _ = socket.write_all(body).await;
            });
        }
    });
    (format!("http://{addr}"), seen)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retrys_trace_links_to_the_first_execution() {
    let db = TestDb::create().await;
    let OtlpReceiver {
        endpoint: collector,
        spans,
    } = OtlpReceiver::start().await;
    let (upstream, seen) = traced_upstream().await;
    let route = Route::idempotent("POST", "/payments", &upstream);
    let gw = GatewayProcess::start_with_env(
        &TestConfig::new(&db).route(route).toml(),
        &[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", &collector),
            ("OTEL_BSP_SCHEDULE_DELAY", "100"),
        ],
    )
    .await;
    let http = Http::default();
    let key = new_key();
    let first_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let retry_trace = "0af7651916cd43dd8448eb211c80319c";
    let send = |trace: &str| {
        http.post(&gw.url("/payments"))
            .tenant("acme")
            .key(&key)
            .header("traceparent", &format!("00-{trace}-00f067aa0ba902b7-01"))
            .json(&payment("o-trace", 100))
            .send()
    };
    assert_eq!(send(first_trace).await.status, StatusCode::CREATED);
    let retry = send(retry_trace).await;
    assert!(retry.replayed());

    // The upstream saw the client's trace continued, not a new one.
    let upstream_saw = seen.lock().unwrap().clone();
    assert_eq!(upstream_saw.len(), 1);
    assert!(
        upstream_saw[0].starts_with(&format!("00-{first_trace}-")),
        "{upstream_saw:?}"
    );
    assert!(
        !upstream_saw[0].contains("00f067aa0ba902b7"),
        "the parent is idemgate's span, not the client's"
    );

    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let (first, replay) = loop {
        let spans = spans.lock().unwrap().clone();
        let request = |trace: &str| {
            spans
                .iter()
                .find(|s| s.name == "idemgate.request" && hex(&s.trace_id) == trace)
                .cloned()
        };
        if let (Some(first), Some(replay)) = (request(first_trace), request(retry_trace)) {
            break (first, replay);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "spans exported: {:?}",
            spans.iter().map(|s| &s.name).collect::<Vec<_>>()
        );
        // Real time: polling for spans, which arrive on the exporter's schedule.
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(
        attribute(&first, "idempotency.outcome").as_deref(),
        Some("executed")
    );
    assert_eq!(attribute(&first, "tenant.id").as_deref(), Some("acme"));
    assert_eq!(
        attribute(&first, "idempotency.endpoint").as_deref(),
        Some("POST /payments")
    );
    assert_eq!(
        attribute(&first, "idempotency.key").as_deref(),
        Some(key.as_str())
    );
    assert_eq!(
        attribute(&replay, "idempotency.outcome").as_deref(),
        Some("replayed")
    );
    let link = replay
        .links
        .first()
        .expect("the replay links to the first execution");
    assert_eq!(hex(&link.trace_id), first_trace);
    assert_eq!(
        link.span_id, first.span_id,
        "the link points at the first request's span"
    );

    // The first request's children: the ledger, and the upstream call.
    let spans = spans.lock().unwrap().clone();
    let children: Vec<&str> = spans
        .iter()
        .filter(|s| hex(&s.trace_id) == first_trace && s.parent_span_id == first.span_id)
        .map(|s| s.name.as_str())
        .collect();
    assert!(
        children.contains(&"postgres") && children.contains(&"upstream"),
        "{children:?}"
    );
}

/// Checks that every line of `text` is Prometheus exposition format.
fn assert_prometheus_text(text: &str) {
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        if let Some(comment) = line.strip_prefix("# ") {
            let kind = comment.split_whitespace().next().unwrap_or("");
            assert!(matches!(kind, "HELP" | "TYPE"), "comment line {line:?}");
            continue;
        }
        let (series, value) = line
            .rsplit_once(' ')
            .unwrap_or_else(|| panic!("no value: {line:?}"));
        assert!(
            value.parse::<f64>().is_ok() || value == "+Inf" || value == "NaN",
            "value in {line:?}"
        );
        let name_end = series.find('{').unwrap_or(series.len());
        let name = &series[..name_end];
        assert!(
            !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':'),
            "metric name in {line:?}"
        );
        if name_end < series.len() {
            assert!(series.ends_with('}'), "labels in {line:?}");
        }
    }
}

fn sample(text: &str, series: &str) -> f64 {
    text.lines()
        .find_map(|l| {
            l.strip_prefix(series)
                .and_then(|rest| rest.strip_prefix(' '))
        })
        .map_or(0.0, |v| v.parse().unwrap())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_parse_as_prometheus_text_and_move_with_requests() {
    let redis = RedisServer::start(&[]);
    let (_db, gw, http) = setup_with(|c| c.redis(&redis.url()), |r| r).await;
    let scrape = async || {
        String::from_utf8(http.get(&gw.url("/metrics")).send().await.body.to_vec()).unwrap()
    };
    let executed = r#"idemgate_requests_total{outcome="executed",endpoint="POST /payments"}"#;
    let replayed = r#"idemgate_requests_total{outcome="replayed",endpoint="POST /payments"}"#;
    let missing =
        r#"idemgate_requests_total{outcome="idempotency-key-missing",endpoint="POST /payments"}"#;
    let before = scrape().await;

    let key = new_key();
    for _ in 0..3 {
        http.pay(&gw.url("/payments"), "acme", &key, &payment("o-m", 1))
            .send()
            .await;
    }
    http.post(&gw.url("/payments"))
        .tenant("acme")
        .json(&payment("o-m", 1))
        .send()
        .await;
    let after = scrape().await;

    assert_prometheus_text(&after);
    assert_eq!(sample(&after, executed) - sample(&before, executed), 1.0);
    assert_eq!(sample(&after, replayed) - sample(&before, replayed), 2.0);
    assert_eq!(sample(&after, missing) - sample(&before, missing), 1.0);
    assert!(
        sample(&after, "idemgate_cache_hits_total")
            >= sample(&before, "idemgate_cache_hits_total") + 2.0
    );
    assert_eq!(sample(&after, "idemgate_cache_up"), 1.0);
    for histogram in [
        "idemgate_request_duration_seconds_bucket",
        "idemgate_upstream_duration_seconds_bucket",
    ] {
        assert!(after.contains(histogram), "{histogram} in\n{after}");
    }
    assert!(after.contains("# TYPE idemgate_requests_total counter"));
}
