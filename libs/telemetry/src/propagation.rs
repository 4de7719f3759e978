//! W3C trace context (`traceparent`, `tracestate`) in and out of HTTP headers, and the
//! span links that tie a retry to its first execution.

use http::HeaderMap;
use http::header::{HeaderName, HeaderValue};
use opentelemetry::global;
use opentelemetry::propagation::{Extractor, Injector};
use opentelemetry::trace::{SpanContext, SpanId, TraceContextExt, TraceFlags, TraceId, TraceState};
use tracing::Span;
use tracing_opentelemetry::OpenTelemetrySpanExt;

struct Extract<'a>(&'a HeaderMap);

impl Extractor for Extract<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }
    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(HeaderName::as_str).collect()
    }
}

struct Inject<'a>(&'a mut HeaderMap);

impl Injector for Inject<'_> {
    fn set(&mut self, key: &str, value: String) {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(key.as_bytes()),
            HeaderValue::from_str(&value),
        ) {
            self.0.insert(name, value);
        }
    }
}

/// Makes `span` a child of the trace context the client sent, if any.
pub fn continue_trace(span: &Span, headers: &HeaderMap) {
    let cx = global::get_text_map_propagator(|p| p.extract(&Extract(headers)));
    if cx.span().span_context().is_valid() {
        let _ = span.set_parent(cx);
    }
}

/// Writes `span`'s context into `headers`. Returns false (and leaves the headers as
/// they are) when the span is not being traced.
pub fn inject(span: &Span, headers: &mut HeaderMap) -> bool {
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return false;
    }
    global::get_text_map_propagator(|p| p.inject_context(&cx, &mut Inject(headers)));
    true
}

/// `span`'s W3C `traceparent`, if it is being traced.
pub fn traceparent(span: &Span) -> Option<String> {
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then(|| format_traceparent(&sc))
}

fn format_traceparent(sc: &SpanContext) -> String {
    format!(
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    )
}

/// The client's `traceparent`, if it sent exactly one and it is a valid W3C value.
pub fn client_traceparent(headers: &HeaderMap) -> Option<String> {
    let mut values = headers.get_all("traceparent").iter();
    match (values.next(), values.next()) {
        (Some(value), None) => value
            .to_str()
            .ok()
            .filter(|v| parse_traceparent(v).is_some())
            .map(str::to_owned),
        _ => None,
    }
}

/// What a record stores to link retries to this execution: `span`'s own context, or,
/// when idemgate does not trace, the client's valid `traceparent`.
pub fn trace_context(span: &Span, headers: &HeaderMap) -> Option<String> {
    traceparent(span).or_else(|| client_traceparent(headers))
}

/// The server span of one request, `idemgate.request` (attributes as docs/operations.md names
/// them, filled in as they become known), continuing the client's trace: the same span
/// at the gateway and in embedded mode.
pub fn request_span(method: &http::Method, path: &str, headers: &HeaderMap) -> Span {
    let span = tracing::info_span!(
        "idemgate.request",
        otel.kind = "server",
        http.request.method = %method,
        url.path = %path,
        tenant.id = tracing::field::Empty,
        idempotency.endpoint = tracing::field::Empty,
        idempotency.key = tracing::field::Empty,
        idempotency.outcome = tracing::field::Empty,
        http.response.status_code = tracing::field::Empty,
    );
    continue_trace(&span, headers);
    span
}

/// Parses a W3C `traceparent` (version 00).
pub fn parse_traceparent(value: &str) -> Option<SpanContext> {
    let mut parts = value.trim().split('-');
    let (version, trace, span, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    if version != "00"
        || parts.next().is_some()
        || trace.len() != 32
        || span.len() != 16
        || flags.len() != 2
    {
        return None;
    }
    let sc = SpanContext::new(
        TraceId::from_hex(trace).ok()?,
        SpanId::from_hex(span).ok()?,
        TraceFlags::new(u8::from_str_radix(flags, 16).ok()?),
        true,
        TraceState::default(),
    );
    sc.is_valid().then_some(sc)
}

/// The trace id of a stored W3C `traceparent` (`00-<trace id>-<span id>-<flags>`): its
/// 32 hex digits, or none.
pub fn trace_id_of(traceparent: &str) -> Option<&str> {
    let id = traceparent.split('-').nth(1)?;
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

/// Adds a link from `span` to the span whose `traceparent` is `target`.
pub fn link(span: &Span, target: &str) {
    if let Some(sc) = parse_traceparent(target) {
        span.add_link(sc);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn traceparents_round_trip() {
        let tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
        let sc = parse_traceparent(tp).unwrap();
        assert_eq!(
            sc.trace_id().to_string(),
            "0af7651916cd43dd8448eb211c80319c"
        );
        assert_eq!(format_traceparent(&sc), tp);
    }

    #[test]
    fn malformed_traceparents_are_ignored() {
        for bad in [
            "",
            "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331",
            "01-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "00-00000000000000000000000000000000-b7ad6b7169203331-01",
            "00-xyz7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
        ] {
            assert!(parse_traceparent(bad).is_none(), "{bad}");
        }
    }
}
