//! One stuck row: ask the route's status probe (if it has one), let
//! [`idem_core::reconcile::decide`] say what that means, and carry it out, fenced by the
//! attempt the row was taken with. Never re-execute on a guess: a row is released only
//! on evidence (two 404s `release_confirm` apart) or by an explicit policy.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use http::{HeaderValue, Method, Request};
use http_body_util::Full;
use idem_config::{Probe, Route};
use idem_core::headers::{IDEMPOTENCY_ATTEMPT, IDEMPOTENCY_KEY, X_TENANT_ID, to_stored};
use idem_core::reconcile::{self as rules, History, ProbeAnswer, Released, Resolution, Rules};
use idem_core::{Fence, LedgerError, StoredResponse};
use idem_postgres::{Later, StuckRow};
use idem_telemetry::propagation;
use idem_upstream::Forwarded;
use tracing::Instrument;

use crate::Reconciler;
use crate::stats::ActionCounts;

impl Reconciler {
    /// Resolves one row in an `idemgate.reconcile` span linked to the first execution.
    pub(crate) async fn resolve(&self, row: StuckRow) -> Result<(), LedgerError> {
        let span = tracing::info_span!(
            "idemgate.reconcile",
            tenant.id = %row.scope.tenant,
            idempotency.endpoint = %row.scope.endpoint,
            idempotency.key = %row.scope.key,
        );
        if let Some(first) = &row.trace_context {
            propagation::link(&span, first);
        }
        self.reconcile_row(row).instrument(span).await
    }

    /// Asks the route's status probe (if any), decides, and writes the decision fenced.
    async fn reconcile_row(&self, row: StuckRow) -> Result<(), LedgerError> {
        let scope = &row.scope;
        let settings = &self.config.reconciler;
        let Some(route) = self.config.routes.by_endpoint(&scope.endpoint) else {
            tracing::warn!(
                ?scope,
                "stuck key of an endpoint no longer configured; held for an operator"
            );
            ActionCounts::add(&self.stats.held, 1);
            self.ledger
                .defer(&row, settings.max_backoff, Later::Unprobed)
                .await?;
            return Ok(());
        };
        let taken = std::time::Instant::now();
        let (answer, found) = match &route.probe {
            Some(probe) => {
                let (answer, found) = self.ask(route, probe, &row).await;
                (Some(answer), found)
            }
            None => (None, None),
        };
        let rules = Rules {
            probe: route.probe.is_some(),
            on_unknown: route.on_unknown,
            release_confirm: settings.release_confirm,
            backoff: settings.interval,
            max_backoff: settings.max_backoff,
        };
        // Decided by the database's clock, which wrote every timestamp of the row.
        let now = SystemTime::from(row.taken_at) + taken.elapsed();
        let history = History {
            created_at: row.created_at.into(),
            probe_attempts: u32::try_from(row.probe_attempts).unwrap_or(0),
            first_not_found: row.first_not_found_at.map(SystemTime::from),
        };
        // Its client was answered 409, 503 or 504 meanwhile: its tenant is told how it
        // settled, if it has a callback.
        let tell = self.config.tenants.get(&scope.tenant).tells_settlements();
        match rules::decide(&rules, answer, &history, now) {
            Resolution::Complete => {
                let stored = found.expect("a found answer comes with its response");
                let fence = self
                    .ledger
                    .resolve(&row, &stored, route.policy.ttl, tell)
                    .await?;
                self.report(
                    &row,
                    fence,
                    &self.stats.completed,
                    "completed with the upstream's answer",
                );
            }
            Resolution::Release(why) => {
                let fence = self
                    .ledger
                    .release_attempt(scope, row.attempt, tell)
                    .await?;
                let (counter, what) = match why {
                    Released::NotFoundTwice => (
                        &self.stats.released,
                        "released: the upstream answered 404 twice, release_confirm apart",
                    ),
                    Released::Policy => {
                        (&self.stats.released_after, "released by on_unknown policy")
                    }
                };
                self.report(&row, fence, counter, what);
            }
            Resolution::ConfirmLater { after } => {
                tracing::info!(?scope, confirm_in = ?after, "probe said 404; asked again before the key is released");
                ActionCounts::add(&self.stats.not_found, 1);
                self.later(&row, after, Later::NotFound).await?;
            }
            Resolution::Retry { after } => {
                tracing::warn!(?scope, retry_in = ?after, "probe inconclusive; the key stays held");
                ActionCounts::add(&self.stats.probe_failed, 1);
                self.later(&row, after, Later::Inconclusive).await?;
            }
            Resolution::Hold { after } => {
                tracing::warn!(?scope, created_at = %row.created_at, "outcome unknown and no probe: held for an operator (idemgate keys show|release)");
                ActionCounts::add(&self.stats.held, 1);
                self.later(&row, after, Later::Unprobed).await?;
            }
            Resolution::Wait { after } => self.later(&row, after, Later::Unprobed).await?,
        }
        Ok(())
    }

    async fn later(&self, row: &StuckRow, after: Duration, why: Later) -> Result<(), LedgerError> {
        if self.ledger.defer(row, after, why).await? == Fence::Lost {
            tracing::info!(scope = ?row.scope, "the original attempt finished meanwhile; nothing changed");
        }
        Ok(())
    }

    /// Asks the upstream; a 2xx comes with the response to store (a body past the
    /// route's `max_response_bytes` is recorded without it, and not read further).
    async fn ask(
        &self,
        route: &Route,
        probe: &Probe,
        row: &StuckRow,
    ) -> (ProbeAnswer, Option<StoredResponse>) {
        match self.send_probe(route, probe, row).await {
            Forwarded::Answered(answer) if answer.status.is_success() => {
                // What the first client would have seen, where the route says so.
                let status = route.probe_status.unwrap_or(answer.status.as_u16());
                let stored = to_stored(
                    status,
                    &answer.headers,
                    answer.body.full().cloned(),
                    route.store_set_cookie,
                );
                (ProbeAnswer::Found, Some(stored))
            }
            Forwarded::Answered(answer) if answer.status == http::StatusCode::NOT_FOUND => {
                (ProbeAnswer::NotFound, None)
            }
            other => {
                let why = match other {
                    Forwarded::Answered(a) => format!("probe answered {}", a.status),
                    Forwarded::NotSent(e) => e.to_string(),
                    Forwarded::Unknown(e) => e.to_string(),
                };
                tracing::debug!(scope = ?row.scope, %why, "probe inconclusive");
                (ProbeAnswer::Inconclusive, None)
            }
        }
    }

    /// Sends the route's status probe for this row.
    async fn send_probe(&self, route: &Route, probe: &Probe, row: &StuckRow) -> Forwarded {
        let attempt = row.attempt.to_string();
        let path = probe
            .path
            .replace("{key}", &percent_encode(row.scope.key.as_str()))
            .replace("{attempt}", &attempt);
        let uri = match route.upstream.uri_for(&path) {
            Ok(uri) => uri,
            Err(e) => return Forwarded::NotSent(idem_upstream::NotSent::Uri(e)),
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
        // This life of the key only: an operation an earlier attempt made under the same
        // key (its record since expired) is not this one's.
        if let Ok(attempt) = HeaderValue::from_str(&attempt) {
            headers.insert(IDEMPOTENCY_ATTEMPT, attempt);
        }
        idem_upstream::forward(
            &self.client,
            request,
            route.timeout,
            route.max_response_bytes,
        )
        .await
    }

    /// Logs and counts a fenced write: `what` happened, or the first attempt won.
    fn report(
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
                ActionCounts::add(counter, 1);
            }
            Fence::Lost => {
                tracing::info!(
                    ?scope,
                    "resolution fenced out: the original attempt finished first; nothing changed"
                );
                ActionCounts::add(&self.stats.fenced, 1);
            }
        }
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
