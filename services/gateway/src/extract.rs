//! Reading a request: the extractors [`Caller`] (or [`Tenant`]), [`Matched`] and [`Key`]
//! (run by axum in that order, before the handler); the key header and the body are read
//! by `idem_http::request`, as in embedded mode. Every failure is a [`Problem`] and
//! nothing is claimed.

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

/// Who sent a request, as far as is known before its body is read: the tenant a bearer
/// token proves, or — on a webhook route — nobody yet: a delivery is proved by its
/// signature, which is checked once its body is read ([`crate::webhook`]).
#[derive(Debug, Clone)]
pub enum Caller {
    Token(String),
    Unverified,
}

impl FromRequestParts<Arc<AppState>> for Caller {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
        if Matched::webhook(parts, app) {
            return Ok(Self::Unverified);
        }
        let Tenant(tenant) = Tenant::from_request_parts(parts, app).await?;
        Ok(Self::Token(tenant))
    }
}

/// The tenant the bearer token proves (401 without one).
#[derive(Debug, Clone)]
pub struct Tenant(pub String);

impl FromRequestParts<Arc<AppState>> for Tenant {
    type Rejection = Problem;

    async fn from_request_parts(parts: &mut Parts, app: &Arc<AppState>) -> Result<Self, Problem> {
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
    /// The request's route, matched once (by the limits in front of every route, which
    /// must know a webhook route, or here) and kept in the request's extensions.
    fn of(parts: &mut Parts, app: &AppState) -> Option<Self> {
        let matched = Self::find(app, &parts.method, &parts.uri, &mut parts.extensions)?;
        // Here, inside the request's span (the limits run before it opens).
        Span::current().record("idempotency.endpoint", matched.0.endpoint.as_str());
        Some(matched)
    }

    pub fn find(
        app: &AppState,
        method: &http::Method,
        uri: &http::Uri,
        extensions: &mut http::Extensions,
    ) -> Option<Self> {
        if let Some(matched) = extensions.get::<Self>() {
            return Some(matched.clone());
        }
        let route = app.routes.find(method, uri.path())?;
        let matched = Self(route.clone());
        extensions.insert(matched.clone());
        Some(matched)
    }

    /// Whether the request is for a webhook route (never one of idemgate's own paths,
    /// which match no route: the lookup API takes its tenant from a token only).
    pub fn webhook(parts: &mut Parts, app: &AppState) -> bool {
        Self::find(app, &parts.method, &parts.uri, &mut parts.extensions)
            .is_some_and(|Matched(route)| route.webhook.is_some())
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
        if !matches!(route.kind(), idem_config::RouteKind::Keyed) {
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
