//! An OTLP/HTTP (protobuf) receiver of the test's own, for processes that export their
//! traces (`OTEL_EXPORTER_OTLP_ENDPOINT`): no collector binary is needed.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use opentelemetry_proto::tonic::collector::trace::v1::ExportTraceServiceRequest;
use opentelemetry_proto::tonic::common::v1::any_value::Value as AnyValue;
pub use opentelemetry_proto::tonic::trace::v1::Span as OtlpSpan;
use prost::Message;

/// Every span posted to its `/v1/traces`.
#[derive(Clone)]
pub struct OtlpReceiver {
    /// What to set `OTEL_EXPORTER_OTLP_ENDPOINT` to.
    pub endpoint: String,
    pub spans: Arc<Mutex<Vec<OtlpSpan>>>,
}

impl OtlpReceiver {
    pub async fn start() -> Self {
        let spans: Arc<Mutex<Vec<OtlpSpan>>> = Arc::default();
        let sink = spans.clone();
        let app = axum::Router::new().route(
            "/v1/traces",
            axum::routing::post(move |body: axum::body::Bytes| {
                let sink = sink.clone();
                async move {
                    let request = ExportTraceServiceRequest::decode(body)
                        .expect("a protobuf ExportTraceServiceRequest");
                    for resource in request.resource_spans {
                        for scope in resource.scope_spans {
                            sink.lock().unwrap().extend(scope.spans);
                        }
                    }
                    (
                        [(http::header::CONTENT_TYPE, "application/x-protobuf")],
                        Vec::<u8>::new(),
                    )
                }
            }),
        );
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        Self {
            endpoint: format!("http://{addr}"),
            spans,
        }
    }

    /// The spans named `name` in each of `traces` (hex trace ids), waiting up to 10 s for
    /// the exporter's batches; panics naming what arrived if one is missing.
    pub async fn spans_in(&self, name: &str, traces: &[&str]) -> Vec<OtlpSpan> {
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            let spans = self.spans.lock().unwrap().clone();
            let found: Vec<_> = traces
                .iter()
                .filter_map(|trace| {
                    spans
                        .iter()
                        .find(|s| s.name == name && hex(&s.trace_id) == *trace)
                        .cloned()
                })
                .collect();
            if found.len() == traces.len() {
                return found;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "spans exported: {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            );
            // Real time: spans arrive on the exporter's schedule.
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
}

/// A span's attribute, as a string.
pub fn attribute(span: &OtlpSpan, key: &str) -> Option<String> {
    span.attributes
        .iter()
        .find(|kv| kv.key == key)
        .and_then(|kv| match kv.value.as_ref()?.value.as_ref()? {
            AnyValue::StringValue(s) => Some(s.clone()),
            other => Some(format!("{other:?}")),
        })
}

/// Trace and span ids as hex.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}
