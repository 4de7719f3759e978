//! `idem-telemetry`: logs, traces and metrics for idemgate's processes.
//!
//! - **Logs**: human-readable on stderr, or JSON lines with `IDEMGATE_LOG_FORMAT=json`;
//!   `RUST_LOG` filters (default `info`).
//! - **Traces**: exported over OTLP/HTTP (protobuf, batched) when
//!   `OTEL_EXPORTER_OTLP_ENDPOINT` (or `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) is set; the
//!   standard `OTEL_*` variables apply and `OTEL_SERVICE_NAME` defaults to the process's
//!   name. Unset, no OpenTelemetry layer is installed at all. W3C `traceparent` /
//!   `tracestate` are extracted from requests and injected into upstream calls.
//! - **Metrics**: one Prometheus recorder per process ([`prometheus`]), rendered at
//!   `GET /metrics`.
//!
//! # Layout
//! - [`failpoint`]: debug-build stops for the fault tests.
//! - [`propagation`]: W3C trace context in and out of HTTP headers, span links.
//! - [`process`]: a service's `main`: runtime, telemetry, flush, stop signals.
//! - [`metrics`] re-exports the `metrics` macros used across the workspace.
#![forbid(unsafe_code)]

pub mod failpoint;
pub mod process;
pub mod propagation;

use std::sync::OnceLock;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_sdk::Resource;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::util::SubscriberInitExt;
use tracing_subscriber::{EnvFilter, Layer};

pub use metrics;

/// Keeps the trace exporter alive; [`Telemetry::shutdown`] flushes what is batched.
#[derive(Debug)]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    /// Flushes the log writer when dropped.
    _logs: tracing_appender::non_blocking::WorkerGuard,
}

impl Telemetry {
    /// Flushes and stops the exporter (call before the process exits).
    pub fn shutdown(self) {
        if let Some(provider) = self.provider
            && let Err(error) = provider.shutdown()
        {
            eprintln!("warning: flushing traces failed: {error}");
        }
    }
}

/// Installs logging and, when configured, trace export. `service` is the default
/// `service.name`. Call once, early, from `main`, inside the tokio runtime.
pub fn init(service: &str) -> Telemetry {
    use std::io::IsTerminal;
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let json = std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|f| f == "json");
    // Log lines are written by a thread of their own, so a request never waits on a
    // write(2) to stderr; when its buffer is full, writers wait rather than drop lines.
    let (writer, guard) = tracing_appender::non_blocking::NonBlockingBuilder::default()
        .lossy(false)
        .finish(std::io::stderr());
    let fmt = tracing_subscriber::fmt::layer()
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(writer);
    let fmt = if json {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    };

    let (provider, error) = match exporter_configured().then(|| tracer_provider(service)) {
        Some(Ok(provider)) => (Some(provider), None),
        Some(Err(error)) => (None, Some(error)),
        None => (None, None),
    };
    let otel = provider.as_ref().map(|p| {
        tracing_opentelemetry::layer()
            .with_tracer(p.tracer("idemgate"))
            .with_filter(EnvFilter::new("info"))
    });
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .with(otel)
        .init();
    if let Some(error) = error {
        tracing::error!(%error, "OTLP trace export could not start; traces are not exported");
    }
    Telemetry {
        provider,
        _logs: guard,
    }
}

fn exporter_configured() -> bool {
    [
        "OTEL_EXPORTER_OTLP_ENDPOINT",
        "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    ]
    .iter()
    .any(|v| std::env::var(v).is_ok_and(|s| !s.is_empty()))
        && !std::env::var("OTEL_SDK_DISABLED").is_ok_and(|v| v.eq_ignore_ascii_case("true"))
}

fn tracer_provider(service: &str) -> Result<SdkTracerProvider, String> {
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .build()
        .map_err(|e| e.to_string())?;
    let name = std::env::var("OTEL_SERVICE_NAME").unwrap_or_else(|_| service.to_owned());
    // The batch processor runs as a task on the tokio runtime, as the async hyper-based
    // HTTP exporter needs (the default thread-based one has no reactor).
    let batch =
        opentelemetry_sdk::trace::span_processor_with_async_runtime::BatchSpanProcessor::builder(
            exporter,
            opentelemetry_sdk::runtime::Tokio,
        )
        .build();
    Ok(SdkTracerProvider::builder()
        .with_span_processor(batch)
        .with_resource(Resource::builder().with_service_name(name).build())
        .build())
}

/// Latency buckets (seconds) for the request and upstream histograms: from 250 µs (a
/// cached replay) to 30 s (a slow upstream).
const LATENCY_BUCKETS: &[f64] = &[
    0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
    30.0,
];

/// The process's Prometheus recorder, installed on first use.
pub fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let handle = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_duration_seconds".into()), LATENCY_BUCKETS)
            .expect("valid buckets")
            .install_recorder()
            .expect("the only metrics recorder of this process");
        // Histogram samples queue up until drained into their buckets: drain them
        // regularly, or memory grows with every request between scrapes.
        let upkeep = handle.clone();
        std::thread::Builder::new()
            .name("metrics-upkeep".into())
            .spawn(move || {
                loop {
                    std::thread::sleep(std::time::Duration::from_secs(1));
                    upkeep.run_upkeep();
                }
            })
            .expect("spawn the metrics upkeep thread");
        handle
    })
}
