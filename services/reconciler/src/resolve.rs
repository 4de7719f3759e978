//! What to do with one stuck row: probe the upstream, or follow the route's
//! `on_unknown` policy. Never re-execute on a guess: a row is released only on evidence
//! (a probe's 404) or by an explicit policy.

use std::time::Duration;

use bytes::Bytes;
use http::{HeaderValue, Method, Request};
use http_body_util::Full;
use idem_config::{OnUnknown, Probe, Route};
use idem_core::Fence;
use idem_postgres::reconcile::{self, StuckRow};
use idem_telemetry::propagation;
use idem_upstream::headers::{IDEMPOTENCY_KEY, X_TENANT_ID, to_stored};
use idem_upstream::{Forwarded, UpstreamResponse};
use tracing::Instrument;

use crate::Reconciler;
use crate::stats::Stats;

impl Reconciler {
    /// Resolves one row in an `idemgate.reconcile` span linked to the first execution.
    pub(crate) async fn resolve(&self, row: StuckRow) -> sqlx::Result<()> {
        let span = tracing::info_span!(
            "idemgate.reconcile",
            tenant.id = %row.scope.tenant,
            idempotency.endpoint = %row.scope.endpoint,
            idempotency.key = %row.scope.key,
        );
        if let Some(first) = &row.trace_context {
            propagation::link(&span, first);
        }
        self.decide(row).instrument(span).await
    }

    async fn decide(&self, row: StuckRow) -> sqlx::Result<()> {
        let scope = &row.scope;
        let Some(route) = self.config.routes.by_endpoint(&scope.endpoint) else {
            tracing::warn!(
                ?scope,
                "stuck key of an endpoint no longer configured; held for an operator"
            );
            Stats::add(&self.stats.held, 1);
            return reconcile::defer(&self.pool, &row, self.config.reconciler.max_backoff, false)
                .await;
        };
        match (&route.probe, &route.on_unknown) {
            (Some(probe), _) => self.probe(route, probe, &row).await,
            (None, OnUnknown::Hold) => {
                tracing::warn!(?scope, created_at = %row.created_at, "outcome unknown and no probe: held for an operator (idemgate keys show|release)");
                Stats::add(&self.stats.held, 1);
                reconcile::defer(&self.pool, &row, self.config.reconciler.max_backoff, false).await
            }
            (None, OnUnknown::ReleaseAfter(after)) => {
                let age = (chrono::Utc::now() - row.created_at)
                    .to_std()
                    .unwrap_or_default();
                if age >= *after {
                    self.settle(
                        &row,
                        reconcile::release(&self.pool, &row).await?,
                        &self.stats.released_after,
                        "released by on_unknown policy",
                    );
                    Ok(())
                } else {
                    reconcile::defer(&self.pool, &row, *after - age, false).await
                }
            }
        }
    }

    async fn probe(&self, route: &Route, probe: &Probe, row: &StuckRow) -> sqlx::Result<()> {
        let scope = &row.scope;
        match self.ask(route, probe, row).await {
            Forwarded::Answered(answer) if answer.status.is_success() => {
                // A body past the route's max_response_bytes is recorded without it (and
                // not read further): retries then learn the operation happened (410).
                let stored = to_stored(
                    answer.status.as_u16(),
                    &answer.headers,
                    answer.body.full().cloned(),
                    route.policy.store_set_cookie,
                );
                let fence = reconcile::complete(&self.pool, row, &stored, route.policy.ttl).await?;
                self.settle(
                    row,
                    fence,
                    &self.stats.completed,
                    "completed with the upstream's answer",
                );
                Ok(())
            }
            Forwarded::Answered(UpstreamResponse { status, .. })
                if status == http::StatusCode::NOT_FOUND =>
            {
                let fence = reconcile::release(&self.pool, row).await?;
                self.settle(
                    row,
                    fence,
                    &self.stats.released,
                    "released: the upstream never ran it",
                );
                Ok(())
            }
            other => {
                let why = match other {
                    Forwarded::Answered(a) => format!("probe answered {}", a.status),
                    Forwarded::NotSent(e) | Forwarded::Unknown(e) => e,
                };
                let backoff = self.backoff(row.probe_attempts);
                tracing::warn!(?scope, %why, retry_in = ?backoff, "probe inconclusive; the key stays held");
                Stats::add(&self.stats.probe_failed, 1);
                reconcile::defer(&self.pool, row, backoff, true).await
            }
        }
    }

    /// Sends the route's status probe for this row.
    async fn ask(&self, route: &Route, probe: &Probe, row: &StuckRow) -> Forwarded {
        let path = probe
            .path
            .replace("{key}", &percent_encode(row.scope.key.as_str()));
        let uri = match route.upstream.uri_for(&path) {
            Ok(uri) => uri,
            Err(e) => return Forwarded::NotSent(format!("bad probe URI: {e}")),
        };
        let mut request = Request::new(Full::new(Bytes::new()));
        *request.method_mut() = probe.method.clone();
        if probe.method != Method::GET {
            tracing::debug!(method = %probe.method, "probing with a method other than GET");
        }
        *request.uri_mut() = uri;
        let headers = request.headers_mut();
        if let Ok(tenant) = HeaderValue::from_str(&row.scope.tenant) {
            headers.insert(X_TENANT_ID, tenant);
        }
        if let Ok(key) = HeaderValue::from_str(row.scope.key.as_str()) {
            headers.insert(IDEMPOTENCY_KEY, key);
        }
        idem_upstream::forward(
            &self.client,
            request,
            route.timeout,
            route.max_response_bytes,
        )
        .await
    }

    fn settle(
        &self,
        row: &StuckRow,
        fence: Fence,
        counter: &std::sync::atomic::AtomicU64,
        what: &str,
    ) {
        let scope = &row.scope;
        match fence {
            Fence::Held => {
                tracing::info!(
                    ?scope,
                    trace_context = row.trace_context.as_deref(),
                    "{what}"
                );
                Stats::add(counter, 1);
            }
            Fence::Lost => {
                tracing::info!(
                    ?scope,
                    "resolution fenced out: the original attempt finished first; nothing changed"
                );
                Stats::add(&self.stats.fenced, 1);
            }
        }
    }

    fn backoff(&self, attempts: i32) -> Duration {
        let exp = u32::try_from(attempts.clamp(0, 16)).unwrap_or(16);
        (self.config.reconciler.interval * 2u32.pow(exp)).min(self.config.reconciler.max_backoff)
    }
}

/// Percent-encodes everything outside RFC 3986's unreserved set, for a path segment.
fn percent_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || matches!(b, b'-' | b'.' | b'_' | b'~') {
            out.push(char::from(b));
        } else {
            out.push_str(&format!("%{b:02X}"));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn keys_are_percent_encoded_in_probe_paths() {
        assert_eq!(super::percent_encode("abc-1_2.3~"), "abc-1_2.3~");
        assert_eq!(super::percent_encode("a/b?c#d%e"), "a%2Fb%3Fc%23d%25e");
    }
}
