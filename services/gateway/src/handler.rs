//! The proxy handler: authenticate, match the route, validate, then either proxy
//! plainly or run the request through the idempotency engine.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::body::Body;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderValue};
use http::request::Parts;
use http::{Request, StatusCode};
use http_body_util::{BodyExt, Full, Limited};
use idem_core::{
    BodyKind, Execution, Fingerprint, IdempotencyKey, Outcome, Scope, StoredResponse, UnknownCause,
};

use crate::app::AppState;
use crate::problem::Problem;
use idem_config::Route;
use idem_upstream::headers::{self as h, IDEMPOTENCY_KEY, IDEMPOTENT_REPLAYED, PREFERENCE_APPLIED};
use idem_upstream::{self as upstream, Forwarded, UpstreamResponse};

pub async fn handle(State(app): State<Arc<AppState>>, request: Request<Body>) -> Response {
    let started = Instant::now();
    let (parts, body) = request.into_parts();
    let tenant = match bearer(&parts.headers).and_then(|t| app.auth.verify(t)) {
        Ok(tenant) => tenant.0,
        Err(why) => return Problem::Unauthorized(why).into_response(),
    };
    let Some(route) = app.routes.find(&parts.method, parts.uri.path()) else {
        return Problem::RouteNotFound.into_response();
    };
    let key = if route.idempotent {
        match idempotency_key(&parts.headers) {
            Ok(Some(key)) => Some(key),
            Ok(None) if !route.key_required => None,
            Ok(None) => return Problem::KeyMissing.into_response(),
            Err(why) => return Problem::KeyInvalid(why).into_response(),
        }
    } else {
        None
    };
    let body = match read_body(body, &parts.headers, app.max_body_bytes).await {
        Ok(body) => body,
        Err(problem) => return problem.into_response(),
    };
    let Some(key) = key else {
        // Not idempotent (or key-less on a roll-out route): proxy as it is.
        let forwarded = forward(&app, route, &parts, &tenant, None, body, route.timeout).await;
        return match forwarded {
            Forwarded::Answered(response) => passthrough(response),
            Forwarded::NotSent(_) => Problem::UpstreamUnavailable.into_response(),
            Forwarded::Unknown(_) => Problem::UpstreamTimeout.into_response(),
        };
    };

    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let kind = if is_json(&parts.headers) {
        BodyKind::Json
    } else {
        BodyKind::Raw
    };
    let fingerprint = match Fingerprint::compute(parts.method.as_str(), target, kind, &body) {
        Ok(fp) => fp,
        Err(why) => {
            return Problem::RequestInvalid(format!("the body is not acceptable JSON: {why}"))
                .into_response();
        }
    };
    let wait = route.policy.wait_for(preferred_wait(&parts.headers));
    let scope = Scope::new(tenant.clone(), route.endpoint.clone(), key.clone());
    let trace_context = parts
        .headers
        .get(h::TRACEPARENT)
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);

    // Claim, forward and store in a task of its own: a client that hangs up drops
    // this handler's future, and must not cancel the forward-and-store half way.
    let task = {
        let app = app.clone();
        let route = route.clone();
        let scope = scope.clone();
        app.tasks.clone().spawn(async move {
            let request = idem_core::Request {
                scope: &scope,
                fingerprint: &fingerprint,
                policy: &route.policy,
                wait,
                trace_context: trace_context.as_deref(),
            };
            let (app_ref, route_ref, parts_ref, tenant_ref, key_ref) = (&app, &route, &parts, &tenant, &key);
            let execute = |attempt: idem_core::Attempt| async move {
                let (app, route, parts, tenant, key) = (app_ref, route_ref, parts_ref, tenant_ref, key_ref);
                // Never run past the lease: after it the reconciler may act on the row.
                let left = attempt.deadline.saturating_duration_since(Instant::now());
                let timeout = route.timeout.min(left);
                if timeout.is_zero() {
                    tracing::warn!(endpoint = %route.endpoint, "lease ran out before the request could be sent; key released");
                    return Execution::NotSent;
                }
                match forward(app, route, parts, tenant, Some(key), body, timeout).await {
                    Forwarded::Answered(response) => Execution::Responded {
                        stored: h::to_stored(
                            response.status.as_u16(),
                            &response.headers,
                            response.body.clone(),
                            route.policy.store_set_cookie,
                        ),
                        passthrough: response,
                    },
                    Forwarded::NotSent(why) => {
                        tracing::warn!(endpoint = %route.endpoint, %why, "upstream unreachable; key released");
                        Execution::NotSent
                    }
                    Forwarded::Unknown(why) => {
                        tracing::warn!(endpoint = %route.endpoint, %why, "upstream outcome unknown; key held");
                        Execution::Unknown
                    }
                }
            };
            app.engine.run(request, execute).await
        })
    };
    let result = task.await;
    let (response, outcome) = match result {
        Ok(Ok(outcome)) => {
            let name = outcome.name();
            if let Outcome::Executed {
                recorded: false, ..
            } = outcome
            {
                app.fenced
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            }
            (respond(outcome, route, wait), name)
        }
        Ok(Err(error)) => {
            tracing::error!(%error, endpoint = %route.endpoint, "ledger unavailable");
            (Problem::LedgerUnavailable.into_response(), "error")
        }
        Err(error) => {
            tracing::error!(%error, endpoint = %route.endpoint, "request task failed");
            (Problem::Internal.into_response(), "error")
        }
    };
    tracing::info!(
        tenant.id = %scope.tenant,
        idempotency.endpoint = %scope.endpoint,
        idempotency.key = %scope.key,
        idempotency.outcome = outcome,
        http.status = response.status().as_u16(),
        duration_ms = started.elapsed().as_secs_f64() * 1000.0,
        "request"
    );
    response
}

fn respond(outcome: Outcome<UpstreamResponse>, route: &Route, wait: Option<Duration>) -> Response {
    let applied = |response: &mut Response, waited: bool| {
        if let (true, Some(wait)) = (waited, wait) {
            let value = format!("wait={}", wait.as_secs());
            if let Ok(value) = HeaderValue::from_str(&value) {
                response.headers_mut().insert(PREFERENCE_APPLIED, value);
            }
        }
    };
    match outcome {
        Outcome::Executed { response, .. } | Outcome::Released(response) => passthrough(response),
        Outcome::Replayed {
            response, waited, ..
        } => {
            let mut response = replay(response);
            applied(&mut response, waited);
            response
        }
        Outcome::Mismatch { .. } => Problem::KeyReused {
            status: route.policy.mismatch_status,
        }
        .into_response(),
        Outcome::InProgress {
            retry_after,
            waited,
            ..
        } => {
            let mut response = Problem::InProgress { retry_after }.into_response();
            applied(&mut response, waited);
            response
        }
        Outcome::UpstreamUnavailable => Problem::UpstreamUnavailable.into_response(),
        Outcome::Unknown(UnknownCause::Upstream) => Problem::UpstreamTimeout.into_response(),
        Outcome::Unknown(UnknownCause::Ledger) => Problem::OutcomeUnrecorded.into_response(),
    }
}

/// The first execution's answer, as the upstream sent it (hop-by-hop removed).
fn passthrough(upstream: UpstreamResponse) -> Response {
    let mut response = Response::new(Body::from(upstream.body));
    *response.status_mut() = upstream.status;
    *response.headers_mut() = h::passthrough_response_headers(upstream.headers);
    response
}

/// A stored response, replayed: same status, body and kept headers; a fresh `Date`
/// (added by the server) and a `Content-Length` computed from the body.
fn replay(stored: StoredResponse) -> Response {
    let mut response = Response::new(Body::from(stored.body));
    *response.status_mut() = StatusCode::from_u16(stored.status).unwrap_or(StatusCode::OK);
    let mut headers = h::from_stored(&stored.headers);
    headers.insert(IDEMPOTENT_REPLAYED, HeaderValue::from_static("true"));
    *response.headers_mut() = headers;
    response
}

async fn forward(
    app: &AppState,
    route: &Route,
    parts: &Parts,
    tenant: &str,
    key: Option<&IdempotencyKey>,
    body: Bytes,
    timeout: Duration,
) -> Forwarded {
    let target = parts.uri.path_and_query().map_or("/", |pq| pq.as_str());
    let uri = match route.upstream.uri_for(target) {
        Ok(uri) => uri,
        Err(e) => return Forwarded::NotSent(format!("cannot build the upstream URI: {e}")),
    };
    let mut request = Request::new(Full::new(body));
    *request.method_mut() = parts.method.clone();
    *request.uri_mut() = uri;
    *request.headers_mut() = h::upstream_request_headers(&parts.headers, tenant, key);
    upstream::forward(&app.client, request, timeout).await
}

fn bearer(headers: &HeaderMap) -> Result<&str, idem_auth::AuthError> {
    use idem_auth::AuthError;
    let mut values = headers.get_all(header::AUTHORIZATION).iter();
    let (Some(value), None) = (values.next(), values.next()) else {
        return Err(AuthError::Missing);
    };
    let value = value.to_str().map_err(|_| AuthError::Malformed)?;
    match value.split_once(' ') {
        Some((scheme, token))
            if scheme.eq_ignore_ascii_case("bearer") && !token.trim().is_empty() =>
        {
            Ok(token.trim())
        }
        _ => Err(AuthError::Missing),
    }
}

fn idempotency_key(headers: &HeaderMap) -> Result<Option<IdempotencyKey>, String> {
    let mut values = headers.get_all(IDEMPOTENCY_KEY).iter();
    let Some(value) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err("send exactly one Idempotency-Key header".into());
    }
    IdempotencyKey::parse(value.as_bytes())
        .map(Some)
        .map_err(|e| e.to_string())
}

/// `Content-Type: application/json` or any `+json` type.
fn is_json(headers: &HeaderMap) -> bool {
    let Some(ct) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
    else {
        return false;
    };
    let media = ct
        .split(';')
        .next()
        .unwrap_or("")
        .trim()
        .to_ascii_lowercase();
    media == "application/json" || (media.starts_with("application/") && media.ends_with("+json"))
}

/// `Prefer: wait=N` (RFC 7240), in seconds.
fn preferred_wait(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get_all("prefer")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .filter_map(|p| {
            let (name, value) = p.trim().split_once('=')?;
            if !name.trim().eq_ignore_ascii_case("wait") {
                return None;
            }
            value.trim().trim_matches('"').parse::<u64>().ok()
        })
        .map(Duration::from_secs)
        .next()
}

async fn read_body(body: Body, headers: &HeaderMap, limit: usize) -> Result<Bytes, Problem> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|len| len > limit as u64) {
        return Err(Problem::PayloadTooLarge { limit });
    }
    match Limited::new(body, limit).collect().await {
        Ok(collected) => Ok(collected.to_bytes()),
        Err(e) if e.is::<http_body_util::LengthLimitError>() => {
            Err(Problem::PayloadTooLarge { limit })
        }
        Err(e) => Err(Problem::RequestInvalid(format!(
            "the request body could not be read: {e}"
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                http::HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn json_media_types() {
        assert!(is_json(&headers(&[("content-type", "application/json")])));
        assert!(is_json(&headers(&[(
            "content-type",
            "Application/JSON; charset=utf-8"
        )])));
        assert!(is_json(&headers(&[(
            "content-type",
            "application/merge-patch+json"
        )])));
        assert!(!is_json(&headers(&[("content-type", "text/plain")])));
        assert!(!is_json(&headers(&[])));
    }

    #[test]
    fn prefer_wait_is_found_among_other_preferences() {
        assert_eq!(
            preferred_wait(&headers(&[("prefer", "respond-async, wait=3")])),
            Some(Duration::from_secs(3))
        );
        assert_eq!(
            preferred_wait(&headers(&[("prefer", "return=minimal")])),
            None
        );
        assert_eq!(preferred_wait(&headers(&[("prefer", "wait=soon")])), None);
    }

    #[test]
    fn one_key_header_only() {
        assert!(
            idempotency_key(&headers(&[
                ("idempotency-key", "a"),
                ("idempotency-key", "b")
            ]))
            .is_err()
        );
        assert_eq!(idempotency_key(&headers(&[])), Ok(None));
        assert_eq!(
            idempotency_key(&headers(&[("idempotency-key", "\"k\"")]))
                .unwrap()
                .unwrap()
                .as_str(),
            "k"
        );
    }

    #[test]
    fn bearer_tokens() {
        assert_eq!(
            bearer(&headers(&[("authorization", "Bearer abc")])),
            Ok("abc")
        );
        assert_eq!(
            bearer(&headers(&[("authorization", "bearer abc")])),
            Ok("abc")
        );
        assert!(bearer(&headers(&[("authorization", "Basic abc")])).is_err());
        assert!(bearer(&headers(&[("authorization", "Bearer ")])).is_err());
        assert!(bearer(&headers(&[])).is_err());
    }
}
