//! Reading a request: the extractors [`Tenant`], [`Matched`] and [`Key`] (run by axum
//! in that order, before the handler); the key header and the body are read by
//! `idem_http::request`, as in embedded mode. Every failure is a [`Problem`] and nothing
//! is claimed.

use std::sync::Arc;

use axum::extract::FromRequestParts;
use http::request::Parts;
use idem_config::Route;
use idem_core::IdempotencyKey;
pub use idem_http::request::read_body;
use idem_http::request::{bearer, idempotency_key};
use tracing::Span;

use crate::problem::Problem;
use crate::state::AppState;

/// The tenant the bearer token proves (401 without one); on a webhook route, the
/// route's tenant (its signature is checked once the body is read: [`crate::webhook`]).
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

impl FromRequestParts<Arc<AppState>> for Tenant {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
        // Never on idemgate's own paths (a `{tenant}` template could match one): the
        // lookup API takes its tenant from a token only.
        if !parts.uri.path().starts_with(idem_config::routes::RESERVED)
            && let Some(Matched(route)) = Matched::of(parts, app)
            && let Some(webhook) = &route.webhook
        {
            let tenant = crate::webhook::tenant(&route, webhook, parts.uri.path())?;
            Span::current().record("tenant.id", tenant.as_str());
            return Ok(Self(tenant));
        }
        let token = bearer(&parts.headers).map_err(Problem::Unauthorized)?;
        let tenant = app
            .auth
            .verify_fetching(token)
            .await
            .map_err(Problem::Unauthorized)?;
        Span::current().record("tenant.id", tenant.0.as_str());
        Ok(Self(tenant.0))
    }
}

/// The route configured for the request's method and path (404 without one). Kept
/// in the request's extensions once matched, so [`Key`] reads the same one.
#[derive(Debug, Clone)]
pub struct Matched(pub Arc<Route>);

impl FromRequestParts<Arc<AppState>> for Matched {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
        Self::of(parts, app).ok_or(Problem::RouteNotFound)
    }
}

impl Matched {
    /// The request's route, matched once (by [`Tenant`], which must know whether it is a
    /// webhook route, or here) and kept in the request's extensions.
    fn of(parts: &mut Parts, app: &AppState) -> Option<Self> {
        if let Some(matched) = parts.extensions.get::<Self>() {
            return Some(matched.clone());
        }
        let route = app.routes.find(&parts.method, parts.uri.path())?;
        Span::current().record("idempotency.endpoint", route.endpoint.as_str());
        let matched = Self(route.clone());
        parts.extensions.insert(matched.clone());
        Some(matched)
    }
}

/// The request's idempotency key: `None` on a route that is not idempotent, or on one
/// whose keys are optional (`key_required = false`) when none was sent; 400 otherwise.
/// `None` on a webhook route too, whose key is the verified delivery's
/// ([`crate::webhook::verify`]): an `Idempotency-Key` sent there is ignored.
#[derive(Debug, Clone)]
pub struct Key(pub Option<IdempotencyKey>);

impl FromRequestParts<Arc<AppState>> for Key {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
        let Matched(route) = Matched::from_request_parts(parts, app).await?;
        if !route.idempotent || route.webhook.is_some() {
            return Ok(Self(None));
        }
        match idempotency_key(&parts.headers).map_err(Problem::KeyInvalid)? {
            Some(key) => {
                Span::current().record("idempotency.key", key.as_str());
                Ok(Self(Some(key)))
            }
            None if !route.key_required => Ok(Self(None)),
            None => Err(Problem::KeyMissing),
        }
    }
}
