//! The operator's HTTP API (docs/operations.md), on its own listener (`admin.listen`), every call
//! with the bearer token of `admin.token_file`: what `idemgate keys` does, under the same
//! rules (docs/operations.md).
//!
//! - `GET /admin/v1/tenants/{tenant}/keys/{key}?endpoint=…` → one key, every fact but its body.
//! - `GET /admin/v1/tenants/{tenant}/keys?endpoint=…&state=…&limit=…&cursor=…` → a page.
//! - `GET /admin/v1/held?limit=…` → the held keys of every tenant, oldest first.
//! - `POST /admin/v1/tenants/{tenant}/keys/{key}/release` with
//!   `{"endpoint","attempt","reason","force"}` → releases that attempt only, only once its
//!   lease is over unless `force`; otherwise 409 `release-refused` saying why, nothing changed.
//! - `GET /admin/v1/openapi.json` → the OpenAPI 3.1 document of this API and the lookup API.

use std::sync::Arc;

use axum::Json;
use axum::Router;
use axum::body::Bytes;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, Request, State};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use axum::routing::{MethodRouter, get, post};
use idem_core::{AttemptId, IdempotencyKey, Scope};
use idem_postgres::OperatorRelease;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::admin_token::AdminToken;
use crate::listing::{Params, ProblemDoc, invalid, no_nul};
use crate::lookup;
use crate::operator::{KeyState, OperatorKey};
use crate::problem::Problem;
use crate::state::AppState;

/// The admin API's routes, behind the bearer token; `document` serves its OpenAPI
/// description (given by the caller: the document is generated from these handlers).
pub fn router(
    state: Arc<AppState>,
    token: AdminToken,
    document: MethodRouter<Arc<AppState>>,
) -> Router {
    let token = Arc::new(token);
    Router::new()
        .route(
            "/admin/v1/tenants/{tenant}/keys",
            get(list).fallback(only_get),
        )
        .route(
            "/admin/v1/tenants/{tenant}/keys/{key}",
            get(show).fallback(only_get),
        )
        .route(
            "/admin/v1/tenants/{tenant}/keys/{key}/release",
            post(release).fallback(only_post),
        )
        .route("/admin/v1/held", get(held).fallback(only_get))
        .route("/admin/v1/openapi.json", document.fallback(only_get))
        .fallback(not_found)
        .layer(axum::middleware::from_fn(move |request, next| {
            authorize(token.clone(), request, next)
        }))
        .with_state(state)
}

/// How long a refused call waits for its 401: a guesser gets a few tries a second per
/// connection, an operator who mistyped does not notice.
const REFUSED_AFTER: std::time::Duration = std::time::Duration::from_millis(250);

/// Every call, the document included, names the token: the API is an operator's only.
/// A refusal is logged with the caller's address, counted
/// (`idemgate_admin_unauthorized_total`) and answered after [`REFUSED_AFTER`].
async fn authorize(token: Arc<AdminToken>, request: Request, next: Next) -> Response {
    // The bearer as every other API of idemgate reads it (the scheme in any case).
    match idem_http::request::bearer(request.headers()) {
        Ok(sent) if token.accepts(sent) => next.run(request).await,
        sent => {
            let peer = request
                .extensions()
                .get::<axum::extract::ConnectInfo<std::net::SocketAddr>>()
                .map(|c| c.0.to_string());
            tracing::warn!(
                peer = peer.as_deref().unwrap_or("unknown"),
                path = request.uri().path(),
                why = if sent.is_ok() {
                    "wrong token"
                } else {
                    "no token"
                },
                "admin call refused"
            );
            idem_telemetry::metrics::counter!("idemgate_admin_unauthorized_total").increment(1);
            tokio::time::sleep(REFUSED_AFTER).await;
            Problem::AdminUnauthorized.into_response()
        }
    }
}

async fn not_found() -> Problem {
    Problem::RouteNotFound
}

async fn only_get() -> Problem {
    Problem::MethodNotAllowed { allow: "GET" }
}

async fn only_post() -> Problem {
    Problem::MethodNotAllowed { allow: "POST" }
}

/// The scope a path and its `endpoint` name.
fn scope(
    path: Result<Path<(String, String)>, PathRejection>,
    endpoint: Option<String>,
) -> Result<Scope, Problem> {
    let Path((tenant, key)) = path.map_err(|e| invalid(&e.body_text()))?;
    let endpoint = endpoint
        .ok_or_else(|| invalid("`endpoint` is required, e.g. endpoint=POST%20%2Fpayments"))?;
    no_nul("tenant", &tenant)?;
    no_nul("endpoint", &endpoint)?;
    let key = IdempotencyKey::parse(key.as_bytes()).map_err(|e| invalid(&e.to_string()))?;
    Ok(Scope::new(tenant, endpoint, key))
}

fn unavailable(error: impl std::fmt::Display) -> Problem {
    tracing::error!(%error, "admin call: ledger unavailable");
    Problem::LedgerUnavailable
}

#[utoipa::path(
    get,
    path = "/admin/v1/tenants/{tenant}/keys/{key}",
    tag = "admin",
    security(("admin_token" = [])),
    params(
        ("tenant" = String, Path, description = "The tenant the key belongs to", pattern = r"^[^\u0000]*$"),
        ("key" = String, Path, description = "The Idempotency-Key, as sent. A key holding `%` is found too, sent as `%25` as a path segment must be; the pattern leaves `%` out because not every client encodes it", pattern = r#"^[!#$&-+\--~][!-$&-+\--~]{0,254}$"#),
        ("endpoint" = String, Query, description = "The route's endpoint, e.g. `POST /payments`", pattern = r"^[^\u0000]*$"),
    ),
    responses(
        (status = 200, description = "The key: every fact of its row but the stored body", body = OperatorKey),
        (status = 400, description = "A bad key or query", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 401, description = "Not the admin token", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 404, description = "No record of this key", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 503, description = "The ledger is unavailable", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn show(
    State(app): State<Arc<AppState>>,
    path: Result<Path<(String, String)>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let params = Params::parse(query.as_deref(), &["endpoint"])?;
    let scope = scope(path, params.endpoint)?;
    match app.engine.ledger().show(&scope).await {
        Ok(Some(info)) => Ok(Json(OperatorKey::from(&info)).into_response()),
        Ok(None) => Err(Problem::KeyNotFound),
        Err(error) => Err(unavailable(error)),
    }
}

/// A page of keys, as an operator sees them.
#[derive(Debug, Serialize, ToSchema)]
pub struct OperatorKeyPage {
    pub keys: Vec<OperatorKey>,
    /// The `cursor` of the next page; `null` at the end.
    pub next_cursor: Option<String>,
}

#[utoipa::path(
    get,
    path = "/admin/v1/tenants/{tenant}/keys",
    tag = "admin",
    security(("admin_token" = [])),
    params(
        ("tenant" = String, Path, description = "The tenant whose keys to list", pattern = r"^[^\u0000]*$"),
        ("endpoint" = Option<String>, Query, description = "Only this endpoint's keys", pattern = r"^[^\u0000]*$"),
        ("state" = Option<String>, Query, description = "Only keys in this state: `held` (or the lookup's word for it, `unknown`), `in_progress` or `completed`", pattern = "^(in_progress|completed|held|unknown)$"),
        ("limit" = Option<i64>, Query, description = "At most this many keys (default 50)", minimum = 1, maximum = 100),
        ("cursor" = Option<String>, Query, description = "The `next_cursor` of the page before", pattern = "^([0-9a-fA-F]{2})+$"),
    ),
    responses(
        (status = 200, description = "A page of the tenant's live keys, in key order", body = OperatorKeyPage),
        (status = 400, description = "A bad query", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 401, description = "Not the admin token", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 503, description = "The ledger is unavailable", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn list(
    State(app): State<Arc<AppState>>,
    tenant: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let Path(tenant) = tenant.map_err(|e| invalid(&e.body_text()))?;
    no_nul("tenant", &tenant)?;
    let _share = app.lookups.admit(None)?;
    let (page, next_cursor) =
        lookup::page(&app, &tenant, query.as_deref(), KeyState::parse_either_word).await?;
    Ok(Json(OperatorKeyPage {
        next_cursor,
        keys: page.iter().map(OperatorKey::from).collect(),
    })
    .into_response())
}

/// The held keys of every tenant.
#[derive(Debug, Serialize, ToSchema)]
pub struct HeldKeys {
    pub keys: Vec<OperatorKey>,
}

#[utoipa::path(
    get,
    path = "/admin/v1/held",
    tag = "admin",
    security(("admin_token" = [])),
    params(
        ("limit" = Option<i64>, Query, description = "At most this many keys (default 50)", minimum = 1, maximum = 100),
    ),
    responses(
        (status = 200, description = "Held keys (in progress, lease over), oldest first", body = HeldKeys),
        (status = 400, description = "A bad query", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 401, description = "Not the admin token", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 503, description = "The ledger is unavailable", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn held(
    State(app): State<Arc<AppState>>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let params = Params::parse(query.as_deref(), &["limit"])?;
    let _share = app.lookups.admit(None)?;
    let keys = app
        .engine
        .ledger()
        .list_held(params.limit()?)
        .await
        .map_err(unavailable)?;
    Ok(Json(HeldKeys {
        keys: keys.iter().map(OperatorKey::from).collect(),
    })
    .into_response())
}

/// What to release, and why.
#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct ReleaseRequest {
    /// The route's endpoint, e.g. `POST /payments`.
    #[schema(pattern = r"^[^\u0000]*$")]
    pub endpoint: String,
    /// The attempt to release, as `show` gave it: if another attempt owns the key now,
    /// nothing changes.
    #[schema(format = "uuid")]
    pub attempt: String,
    /// Why, for the log line every release writes (not only white space; no NUL: a forced
    /// release keeps it in Postgres).
    #[schema(min_length = 1, pattern = r"^[^\u0000]*\S[^\u0000]*$")]
    pub reason: String,
    /// Release even inside the attempt's lease (it may still be running: its upstream
    /// may still act, and a retry would act again).
    #[serde(default)]
    pub force: bool,
}

/// A release that happened.
#[derive(Debug, Serialize, ToSchema)]
pub struct Released {
    pub tenant: String,
    pub endpoint: String,
    pub key: String,
    #[schema(format = "uuid")]
    pub attempt: String,
    /// Released inside its lease, by `force`: that attempt may still act.
    pub forced: bool,
}

#[utoipa::path(
    post,
    path = "/admin/v1/tenants/{tenant}/keys/{key}/release",
    tag = "admin",
    security(("admin_token" = [])),
    params(
        ("tenant" = String, Path, description = "The tenant the key belongs to", pattern = r"^[^\u0000]*$"),
        ("key" = String, Path, description = "The Idempotency-Key, as sent. A key holding `%` is found too, sent as `%25` as a path segment must be; the pattern leaves `%` out because not every client encodes it", pattern = r#"^[!#$&-+\--~][!-$&-+\--~]{0,254}$"#),
    ),
    request_body(content = ReleaseRequest, content_type = "application/json"),
    responses(
        (status = 200, description = "The attempt's key is released: the next request with it executes", body = Released),
        (status = 400, description = "A bad key or body", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 401, description = "Not the admin token", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 404, description = "No record of this key", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 409, description = "Nothing changed, and why: completed, another attempt's, or inside its lease without `force`", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 503, description = "The ledger is unavailable", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn release(
    State(app): State<Arc<AppState>>,
    path: Result<Path<(String, String)>, PathRejection>,
    RawQuery(query): RawQuery,
    body: Bytes,
) -> Result<Response, Problem> {
    Params::parse(query.as_deref(), &[])?;
    let asked: ReleaseRequest = serde_json::from_slice(&body)
        .map_err(|e| invalid(&format!("the body is not a release request: {e}")))?;
    let attempt = uuid::Uuid::parse_str(&asked.attempt)
        .map(AttemptId)
        .map_err(|_| invalid("`attempt` is the attempt's UUID, as `show` gives it"))?;
    if asked.reason.trim().is_empty() {
        return Err(invalid(
            "`reason` says why, for the log line every release writes",
        ));
    }
    no_nul("reason", &asked.reason)?;
    let scope = scope(path, Some(asked.endpoint))?;
    let named = format!("{} {:?} {}", scope.tenant, scope.endpoint, scope.key);
    let done = crate::operator::release(
        app.engine.ledger(),
        &scope,
        attempt,
        asked.force,
        "admin API",
        &asked.reason,
        app.callbacks.tells(&scope.tenant),
    )
    .await
    .map_err(unavailable)?;
    match done {
        OperatorRelease::Released { forced } => Ok(Json(Released {
            tenant: scope.tenant.to_string(),
            endpoint: scope.endpoint.to_string(),
            key: scope.key.as_str().to_owned(),
            attempt: attempt.to_string(),
            forced,
        })
        .into_response()),
        OperatorRelease::Absent => Err(Problem::KeyNotFound),
        refused => Err(Problem::ReleaseRefused(
            crate::operator::why_unchanged(&refused, &named, attempt, "send \"force\": true", "")
                .unwrap_or_default(),
        )),
    }
}
