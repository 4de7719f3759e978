//! Every error response idemgate writes itself, in the gateway and in embedded mode:
//! `application/problem+json` (RFC 9457) with a stable `type` URI. Bodies never echo the
//! stored request, response or fingerprint, so a stolen key is not a read oracle.
//!
//! # Error policy
//! The libraries return typed errors (enums with their `#[source]`), never strings and
//! never HTTP. This is the one place they become HTTP:
//! - bad input (`AuthError`, `KeyHeaderError`, a body too large, late or not JSON) → a
//!   4xx naming what to fix; nothing was claimed;
//! - `LedgerError` before anything ran → 503 `service-unavailable` (retry, same key);
//!   after the upstream answered → 503 `outcome-unrecorded` (the key stays held);
//! - an upstream call provably not sent → 502 (the key was released); one whose outcome
//!   is unknown → 504 (held);
//! - Redis errors never reach a client: the breaker opens and Postgres answers alone.
//!
//! Causes go to the log (`tracing::error!`/`warn!` with the error's whole chain), not to
//! the client.

use std::sync::OnceLock;
use std::time::Duration;

use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::{HeaderValue, StatusCode, header};
use idem_auth::AuthError;
use idem_core::KeyError;
use serde_json::json;

use crate::OutcomeLabel;

/// `operation_state` of an attempt that provably did nothing (its key was released, or
/// its transaction rolled back): the same key, or a new one, is safe.
pub const NOT_EXECUTED: &str = "not_executed";

/// The base of every problem `type` URI.
pub const TYPE_BASE: &str = "https://idemgate.dev/problems/";

/// Why an `Idempotency-Key` header was refused. The message is safe to show the client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyHeaderError {
    #[error("send exactly one Idempotency-Key header")]
    Repeated,
    #[error(transparent)]
    Invalid(#[from] KeyError),
}

/// A client-visible failure. Mapping to HTTP happens here and only here.
#[derive(Debug)]
pub enum Problem {
    KeyMissing,
    KeyInvalid(KeyHeaderError),
    KeyReused {
        status: u16,
        /// Whether the operation the key belongs to is completed (else in progress).
        completed: bool,
    },
    InProgress {
        retry_after: Duration,
        /// The first attempt's lease ran out without a result: it may have acted.
        outcome_unknown: bool,
    },
    /// The operation completed once, but its response was too large to keep.
    ResultUnavailable,
    /// The lookup found no live record of the key for this tenant and endpoint: the
    /// same answer whether it was never used, has expired, or is another tenant's.
    KeyNotFound,
    /// The key was released while its result was awaited: its operation did not run.
    KeyReleased,
    Unauthorized(AuthError),
    /// A webhook delivery whose signature is missing, invalid or stale: the reason, and
    /// what it means.
    WebhookSignatureInvalid {
        reason: &'static str,
        explanation: &'static str,
    },
    /// An admin call without the bearer token of `admin.token_file`.
    AdminUnauthorized,
    /// An operator's release that changed nothing, and why (docs/operations.md).
    ReleaseRefused(String),
    PayloadTooLarge {
        limit: usize,
    },
    /// The request head is over `server.max_header_bytes` or `server.max_headers`.
    HeadersTooLarge(String),
    /// The body did not arrive within `server.body_read_timeout`.
    RequestTimeout {
        after: Duration,
    },
    /// `server.max_concurrent_requests` are in flight.
    Overloaded,
    /// The tenant is over its `rate` (docs/tenants.md): its bucket has a request again after
    /// `retry_after`.
    TenantRateLimited {
        retry_after: Duration,
    },
    /// The tenant has its `max_concurrent_requests` in flight.
    TenantConcurrencyLimited,
    RequestInvalid(String),
    RouteNotFound,
    /// One of idemgate's own paths (lookup, admin), with a method it does not serve:
    /// `allow` lists the ones it does.
    MethodNotAllowed {
        allow: &'static str,
    },
    UpstreamUnavailable,
    UpstreamTimeout,
    /// The ledger could not be reached; nothing was executed.
    LedgerUnavailable,
    /// The upstream answered but its result could not be recorded.
    OutcomeUnrecorded,
    Internal,
}

impl Problem {
    /// The end of the `type` URI: a stable, bounded name (also a metrics label).
    pub fn slug(&self) -> &'static str {
        self.parts().1
    }

    /// What the request came to, for the request metrics: the slug, except for
    /// idemgate's own failures, which are `error`.
    pub fn outcome(&self) -> &'static str {
        match self {
            Problem::LedgerUnavailable | Problem::Internal => "error",
            other => other.slug(),
        }
    }

    /// For the idempotency problems: where the operation stands (`in_progress`,
    /// `completed`, `unknown` or `not_executed`) and whether a new key is safe, i.e.
    /// whether the operation provably did not run. `None` for problems that claimed
    /// nothing.
    pub fn operation(&self) -> Option<(&'static str, bool)> {
        use Problem::*;
        match self {
            KeyReused { completed, .. } => Some((
                if *completed {
                    "completed"
                } else {
                    "in_progress"
                },
                false,
            )),
            InProgress {
                outcome_unknown, ..
            } => Some((
                if *outcome_unknown {
                    "unknown"
                } else {
                    "in_progress"
                },
                false,
            )),
            ResultUnavailable => Some(("completed", false)),
            // Connection refused: the upstream never saw it, and the key was released.
            UpstreamUnavailable | KeyReleased => Some((NOT_EXECUTED, true)),
            UpstreamTimeout | LedgerUnavailable | OutcomeUnrecorded => Some(("unknown", false)),
            _ => None,
        }
    }

    fn parts(&self) -> (StatusCode, &'static str, &'static str, String) {
        use Problem::*;
        match self {
            KeyMissing => (
                StatusCode::BAD_REQUEST,
                "idempotency-key-missing",
                "Idempotency-Key required",
                "This route is idempotent: send an Idempotency-Key header, one unique value per logical operation.".into(),
            ),
            KeyInvalid(why) => (
                StatusCode::BAD_REQUEST,
                "idempotency-key-invalid",
                "Idempotency-Key invalid",
                why.to_string(),
            ),
            KeyReused { status, .. } => (
                StatusCode::from_u16(*status).unwrap_or(StatusCode::CONFLICT),
                "idempotency-key-reused",
                "Idempotency-Key reused with a different request",
                "This key was already used for a request with a different method, path or body. Use a new key for a new operation.".into(),
            ),
            InProgress { .. } => (
                StatusCode::CONFLICT,
                "idempotency-key-in-progress",
                "Request with this Idempotency-Key is in progress",
                "An earlier request with this key has not finished yet. Retry after the interval in Retry-After; the result will be replayed.".into(),
            ),
            ResultUnavailable => (
                StatusCode::GONE,
                "idempotency-result-unavailable",
                "Result not available for replay",
                "The operation with this key was executed once, but its response was too large to keep, so it cannot be replayed. It will not be executed again.".into(),
            ),
            Unauthorized(why) => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Unauthorized",
                why.to_string(),
            ),
            WebhookSignatureInvalid {
                reason,
                explanation,
            } => (
                StatusCode::UNAUTHORIZED,
                "webhook-signature-invalid",
                "Webhook signature invalid",
                format!(
                    "This route takes deliveries signed by its provider, and this one's signature is {reason}: {explanation}. Nothing was recorded."
                ),
            ),
            AdminUnauthorized => (
                StatusCode::UNAUTHORIZED,
                "unauthorized",
                "Unauthorized",
                "Admin calls need `Authorization: Bearer` with the token of admin.token_file.".into(),
            ),
            ReleaseRefused(why) => (
                StatusCode::CONFLICT,
                "release-refused",
                "Release refused",
                why.clone(),
            ),
            PayloadTooLarge { limit } => (
                StatusCode::PAYLOAD_TOO_LARGE,
                "payload-too-large",
                "Payload too large",
                format!("The request body exceeds the limit of {limit} bytes."),
            ),
            HeadersTooLarge(why) => (
                StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE,
                "request-header-fields-too-large",
                "Request header fields too large",
                why.clone(),
            ),
            RequestTimeout { after } => (
                StatusCode::REQUEST_TIMEOUT,
                "request-timeout",
                "Request timeout",
                format!(
                    "The request body did not arrive within {}; nothing was executed.",
                    humantime::format_duration(*after)
                ),
            ),
            Overloaded => (
                StatusCode::SERVICE_UNAVAILABLE,
                "overloaded",
                "Overloaded",
                "Too many requests are in flight; nothing was executed. Retry after the interval in Retry-After.".into(),
            ),
            KeyNotFound => (
                StatusCode::NOT_FOUND,
                "idempotency-key-not-found",
                "Idempotency-Key not found",
                "No record of this key for this tenant and endpoint: it was never used, or it has expired.".into(),
            ),
            KeyReleased => (
                StatusCode::NOT_FOUND,
                "idempotency-key-not-found",
                "Idempotency-Key not found",
                "The key was released while you waited: its operation did not run. The same key, or a new one, is safe to send.".into(),
            ),
            TenantRateLimited { .. } => (
                StatusCode::TOO_MANY_REQUESTS,
                "tenant-rate-limited",
                "Tenant rate limit",
                "This tenant is over its request rate; nothing was executed. Retry after the interval in Retry-After.".into(),
            ),
            TenantConcurrencyLimited => (
                StatusCode::TOO_MANY_REQUESTS,
                "tenant-concurrency-limited",
                "Tenant concurrency limit",
                "This tenant has as many requests in flight as it may; nothing was executed. Retry after the interval in Retry-After.".into(),
            ),
            RequestInvalid(why) => (
                StatusCode::BAD_REQUEST,
                "request-invalid",
                "Request invalid",
                why.clone(),
            ),
            RouteNotFound => (
                StatusCode::NOT_FOUND,
                "route-not-found",
                "Route not found",
                "No route is configured for this method and path.".into(),
            ),
            MethodNotAllowed { allow } => (
                StatusCode::METHOD_NOT_ALLOWED,
                "method-not-allowed",
                "Method not allowed",
                format!("This path answers {allow} only."),
            ),
            UpstreamUnavailable => (
                StatusCode::BAD_GATEWAY,
                "upstream-unavailable",
                "Upstream unavailable",
                "The upstream could not be reached; the request was not executed and the key was released. It is safe to retry.".into(),
            ),
            UpstreamTimeout => (
                StatusCode::GATEWAY_TIMEOUT,
                "upstream-timeout",
                "Upstream outcome unknown",
                "The upstream did not answer in time; it may or may not have acted. The key is held until the outcome is known: retry with the same key later to get the result.".into(),
            ),
            LedgerUnavailable => (
                StatusCode::SERVICE_UNAVAILABLE,
                "service-unavailable",
                "Service unavailable",
                "The idempotency ledger is unavailable; nothing was executed. Retry with the same key.".into(),
            ),
            OutcomeUnrecorded => (
                StatusCode::SERVICE_UNAVAILABLE,
                "outcome-unrecorded",
                "Outcome not recorded",
                "The upstream answered but its result could not be recorded yet; the key is held until it is. Retry with the same key later to get the result.".into(),
            ),
            Internal => (
                StatusCode::INTERNAL_SERVER_ERROR,
                "internal",
                "Internal error",
                "An internal error occurred.".into(),
            ),
        }
    }
}

impl Problem {
    /// Its status and problem document.
    fn render(&self) -> (StatusCode, Bytes) {
        let (status, slug, title, detail) = self.parts();
        let mut body = json!({
            "type": format!("{TYPE_BASE}{slug}"),
            "title": title,
            "status": status.as_u16(),
            "detail": detail,
        });
        if let Some((state, safe_new_key)) = self.operation() {
            body["operation_state"] = state.into();
            body["safe_new_key"] = safe_new_key.into();
        }
        (status, Bytes::from(body.to_string()))
    }

    /// [`Self::render`], once for a problem whose document never varies: the refusals
    /// that come in floods (a tenant over its quota, a gateway over its limits, a ledger
    /// gone, a client without keys), so that refusing costs no more than it must.
    fn rendered(&self) -> (StatusCode, Bytes) {
        static DOCUMENTS: [OnceLock<(StatusCode, Bytes)>; 5] = [const { OnceLock::new() }; 5];
        let at = match self {
            Problem::TenantRateLimited { .. } => 0,
            Problem::TenantConcurrencyLimited => 1,
            Problem::Overloaded => 2,
            Problem::LedgerUnavailable => 3,
            Problem::KeyMissing => 4,
            _ => return self.render(),
        };
        DOCUMENTS[at].get_or_init(|| self.render()).clone()
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let mut response = self.rendered().into_response();
        response
            .extensions_mut()
            .insert(OutcomeLabel(self.outcome()));
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        match &self {
            Problem::InProgress { retry_after, .. } => {
                headers.insert(
                    header::RETRY_AFTER,
                    HeaderValue::from(retry_after.as_secs().max(1)),
                );
            }
            Problem::LedgerUnavailable
            | Problem::OutcomeUnrecorded
            | Problem::Overloaded
            | Problem::TenantConcurrencyLimited => {
                headers.insert(header::RETRY_AFTER, HeaderValue::from(1));
            }
            Problem::TenantRateLimited { retry_after } => {
                // Whole seconds, rounded up: a client that waits that long finds a token.
                let seconds = retry_after.as_secs() + u64::from(retry_after.subsec_nanos() > 0);
                headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
            }
            // The rest of the body may still be on its way: this connection is done.
            Problem::RequestTimeout { .. } => {
                headers.insert(header::CONNECTION, HeaderValue::from_static("close"));
            }
            Problem::MethodNotAllowed { allow } => {
                headers.insert(header::ALLOW, HeaderValue::from_static(allow));
            }
            Problem::AdminUnauthorized => {
                headers.insert(
                    header::WWW_AUTHENTICATE,
                    HeaderValue::from_static("Bearer realm=\"idemgate-admin\""),
                );
            }
            Problem::Unauthorized(why) => {
                let challenge = match why {
                    AuthError::Missing => "Bearer realm=\"idemgate\"".to_owned(),
                    other => format!(
                        "Bearer realm=\"idemgate\", error=\"invalid_token\", error_description=\"{}\"",
                        other.to_string().replace('"', "'")
                    ),
                };
                if let Ok(value) = HeaderValue::from_str(&challenge) {
                    headers.insert(header::WWW_AUTHENTICATE, value);
                }
            }
            _ => {}
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The documents rendered once are the ones rendered afresh, and carry nothing of
    /// the request (a rate limit's wait is in its header, never in its body).
    #[test]
    fn documents_rendered_once_are_the_same_documents() {
        let constant = [
            Problem::TenantRateLimited {
                retry_after: Duration::from_millis(1500),
            },
            Problem::TenantConcurrencyLimited,
            Problem::Overloaded,
            Problem::LedgerUnavailable,
            Problem::KeyMissing,
        ];
        for problem in &constant {
            assert_eq!(problem.rendered(), problem.render(), "{problem:?}");
            assert_eq!(problem.rendered(), problem.rendered(), "{problem:?}");
        }
        let later = Problem::TenantRateLimited {
            retry_after: Duration::from_secs(30),
        };
        assert_eq!(later.render(), constant[0].render());
        let response = later.into_response();
        assert_eq!(response.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(response.headers()[header::RETRY_AFTER], "30");
    }
}
