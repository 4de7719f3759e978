//! The tenant's own lookup (docs/tenants.md): what happened to a key, with the tenant's own
//! token, never showing a body.
//!
//! - `GET /_idemgate/v1/keys/{key}?endpoint=POST%20%2Fpayments` → 200 with the key's
//!   state, times, response status and trace id, or 404 `idempotency-key-not-found` —
//!   the same status, type and body for a key never used, expired, or another tenant's
//!   (the lookup only ever reads the caller's own scope).
//! - `GET /_idemgate/v1/keys?endpoint=…&state=…&limit=…&cursor=…` → a page of the
//!   tenant's live keys in key order, and the cursor of the next page (`null` at the end).
//! - `GET /_idemgate/v1/keys/{key}/result?endpoint=…` → the operation's handle: its stored
//!   answer byte for byte once completed (`Idempotent-Replayed: true`), 202 with the
//!   lookup's JSON and `Retry-After` while it runs or is held, the lookup's 404 otherwise.
//!   With `Prefer: wait=N` it waits for the operation to settle first ([`crate::waiters`]).
//!   Where `Prefer: respond-async` answers 202, its `Location` points here ([`location`]).

use std::sync::Arc;
use std::time::Duration;

use axum::Json;
use axum::extract::rejection::PathRejection;
use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use http::{HeaderMap, HeaderValue, StatusCode, header};
use idem_core::{Cache as _, IdempotencyKey, Ledger as _, MaybeCache, Record, RecordState, Scope};
use idem_postgres::ledger::KeyInfo;
use serde::Serialize;
use utoipa::ToSchema;

use crate::extract::Tenant;
use crate::listing::{Params, ProblemDoc, encode_cursor, invalid};
use crate::operator::KeyState;
use crate::problem::Problem;
use crate::state::AppState;

/// Where the lookup lives (no route may be configured under `/_idemgate/`).
pub const KEYS: &str = "/_idemgate/v1/keys";

/// What an answered lookup came to, for `idemgate_requests_total{outcome}` (without it,
/// a request whose answer names no outcome counts as an `error`).
const LOOKUP: axum::Extension<crate::observe::OutcomeLabel> =
    axum::Extension(crate::observe::OutcomeLabel("lookup"));

/// A lookup of one key let in: its tenant's quota and its share of the ledger taken (held
/// for as long as this lives), and the scope it names.
struct OneKey<'a> {
    scope: Scope,
    /// Both given back before a result's wait: a waiter holds no place among its
    /// tenant's requests in flight and no share of the ledger.
    quota: Option<crate::tenants::TenantPermit>,
    share: Option<crate::listing::LookupPermit<'a>>,
}

impl<'a> OneKey<'a> {
    /// Its quota and share taken, the share waited for up to `queue` (a key's result,
    /// whose waiters arrive together; zero: refused at once, as every other lookup).
    async fn admit(
        app: &'a AppState,
        tenant: String,
        key: Result<Path<String>, PathRejection>,
        query: Option<&str>,
        queue: std::time::Duration,
    ) -> Result<Self, Problem> {
        let quota = app.tenants.admit(&tenant)?;
        let share = Some(app.lookups.admit_within(&tenant, queue).await?);
        let scope = scope_of(tenant, key, query)?;
        Ok(Self {
            scope,
            quota,
            share,
        })
    }
}

/// The scope a lookup names: the caller's tenant, the `endpoint` query parameter, the
/// key in the path.
fn scope_of(
    tenant: String,
    key: Result<Path<String>, PathRejection>,
    query: Option<&str>,
) -> Result<Scope, Problem> {
    let Path(key) = key.map_err(|e| invalid(&e.body_text()))?;
    let params = Params::parse(query, &["endpoint"])?;
    let endpoint = params
        .endpoint
        .ok_or_else(|| invalid("`endpoint` is required, e.g. endpoint=POST%20%2Fpayments"))?;
    let key = IdempotencyKey::parse(key.as_bytes()).map_err(|e| invalid(&e.to_string()))?;
    Ok(Scope::new(tenant, endpoint, key))
}

/// `GET /_idemgate/v1/keys/{key}?endpoint=…`.
#[utoipa::path(
    get,
    path = "/_idemgate/v1/keys/{key}",
    tag = "lookup",
    security(("tenant_token" = [])),
    params(
        ("key" = String, Path, description = "The Idempotency-Key, as sent. A key holding `%` is found too, sent as `%25` as a path segment must be; the pattern leaves `%` out because not every client encodes it", pattern = r#"^[!#$&-+\--~][!-$&-+\--~]{0,254}$"#),
        ("endpoint" = String, Query, description = "The route's endpoint, e.g. `POST /payments`", pattern = r"^[^\u0000]*$"),
    ),
    responses(
        (status = 200, description = "The key, as its tenant may see it", body = TenantKey),
        (status = 400, description = "A bad key or query", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 401, description = "No valid tenant token", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 404, description = "No live record of this key for this tenant and endpoint (also another tenant's key)", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its quota", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 503, description = "The ledger is unavailable", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn show(
    State(app): State<Arc<AppState>>,
    Tenant(tenant): Tenant,
    key: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let one = OneKey::admit(&app, tenant, key, query.as_deref(), Duration::ZERO).await?;
    match app.engine.ledger().lookup(&one.scope).await {
        Ok(Some(info)) => Ok((LOOKUP, Json(TenantKey::from(&info))).into_response()),
        Ok(None) => Err(Problem::KeyNotFound),
        Err(error) => {
            tracing::error!(%error, "key lookup failed");
            Err(Problem::LedgerUnavailable)
        }
    }
}

/// How long a client is told to wait before it asks for a running operation's result
/// again.
const RESULT_RETRY_AFTER: u64 = 1;

/// How long a result's read may queue for its tenant's share of the ledger.
const SHARE_WAIT: Duration = Duration::from_secs(2);

/// `GET /_idemgate/v1/keys/{key}/result?endpoint=…`.
#[utoipa::path(
    get,
    path = "/_idemgate/v1/keys/{key}/result",
    tag = "lookup",
    security(("tenant_token" = [])),
    params(
        ("key" = String, Path, description = "The Idempotency-Key, as sent. A key holding `%` is found too, sent as `%25` as a path segment must be; the pattern leaves `%` out because not every client encodes it", pattern = r#"^[!#$&-+\--~][!-$&-+\--~]{0,254}$"#),
        ("endpoint" = String, Query, description = "The route's endpoint, e.g. `POST /payments`", pattern = r"^[^\u0000]*$"),
        ("Prefer" = Option<String>, Header, description = "`wait=N`: wait up to N seconds (at most `server.max_result_wait`) for a running or held operation to settle"),
    ),
    responses(
        (status = "default", description = "Completed: the operation's stored answer, byte for byte — whatever status, headers and body the upstream answered — with `Idempotent-Replayed: true`"),
        (status = 202, description = "Still running, or held until its outcome is known: ask again after `Retry-After`", body = TenantKey),
        (status = 400, description = "A bad key or query", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 401, description = "No valid tenant token", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 404, description = "No live record of this key for this tenant and endpoint (also another tenant's key)", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 410, description = "Completed, but its answer was too large to keep", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its quota, or has `server.max_result_waiters` waiting", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 503, description = "The ledger is unavailable", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn result(
    State(app): State<Arc<AppState>>,
    Tenant(tenant): Tenant,
    key: Result<Path<String>, PathRejection>,
    RawQuery(query): RawQuery,
    headers: HeaderMap,
) -> Result<Response, Problem> {
    let mut one = OneKey::admit(&app, tenant, key, query.as_deref(), SHARE_WAIT).await?;
    let wait = idem_core::headers::preferred_wait(&headers)
        .map(|wait| wait.min(app.max_result_wait))
        .filter(|wait| !wait.is_zero());
    let scope = one.scope.clone();
    let mut record = read_record(&app, &scope).await?;
    if let (
        Some(wait),
        Some(Record {
            state: RecordState::InProgress { .. },
            ..
        }),
    ) = (wait, &record)
    {
        // Waits holding nothing of the ledger or of the tenant's places, until the
        // record settles or the wait is over — a wake-up that finds it still running
        // (another retry's announcement) waits on. A released key tells the waiter so.
        let waiting = app.waiters.wait_on(&scope)?;
        drop((one.share.take(), one.quota.take()));
        let deadline = tokio::time::Instant::now() + wait;
        loop {
            let settled = waiting.settled();
            let changed = async {
                match app.engine.cache() {
                    MaybeCache::Some(cache) => cache.changed(&scope).await,
                    MaybeCache::None => std::future::pending().await,
                }
            };
            tokio::select! {
                () = settled => {}
                () = changed => {}
                () = tokio::time::sleep_until(deadline) => {}
            }
            // The read after the wait takes its share of the ledger as any lookup does,
            // queued behind the other waiters woken with it.
            let _share = app.lookups.admit_within(&scope.tenant, SHARE_WAIT).await?;
            record = read_record(&app, &scope).await?;
            let running = matches!(
                record,
                Some(Record {
                    state: RecordState::InProgress { .. },
                    ..
                })
            );
            if !running || tokio::time::Instant::now() >= deadline {
                break;
            }
        }
        drop(waiting);
        if record.is_none() {
            return Err(Problem::KeyReleased);
        }
    }
    let Some(record) = record else {
        return Err(Problem::KeyNotFound);
    };
    match record.state {
        RecordState::Completed(stored) => {
            let mut answer = idem_http::answer::replay(stored);
            if let Some(at) = record.expires_at {
                idem_http::answer::set_expires(&mut answer, at);
            }
            Ok((LOOKUP, answer).into_response())
        }
        RecordState::InProgress { .. } => {
            Ok((LOOKUP, Box::pin(accepted(&app, &scope)).await?).into_response())
        }
    }
}

/// The live record of `scope`, its stored body included.
async fn read_record(app: &AppState, scope: &Scope) -> Result<Option<Record>, Problem> {
    app.engine.ledger().get(scope).await.map_err(|error| {
        if error.is_busy() {
            return Problem::Overloaded;
        }
        tracing::error!(%error, "result lookup failed");
        Problem::LedgerUnavailable
    })
}

/// 202: the operation runs (or is held until its outcome is known), with the lookup's
/// JSON, `Retry-After` and the `Location` of its result — what `Prefer: respond-async`
/// answers, and the result while there is none yet.
pub(crate) async fn accepted(app: &AppState, scope: &Scope) -> Result<Response, Problem> {
    let info = app.engine.ledger().lookup(scope).await.map_err(|error| {
        if error.is_busy() {
            return Problem::Overloaded;
        }
        tracing::error!(%error, "key lookup failed");
        Problem::LedgerUnavailable
    })?;
    // Gone meanwhile (released, or completed and purged): ask the handle again.
    let Some(info) = info else {
        return Err(Problem::KeyNotFound);
    };
    let mut response = (StatusCode::ACCEPTED, Json(TenantKey::from(&info))).into_response();
    let headers = response.headers_mut();
    headers.insert(header::RETRY_AFTER, HeaderValue::from(RESULT_RETRY_AFTER));
    if let Ok(at) = HeaderValue::from_str(&location(scope)) {
        headers.insert(header::LOCATION, at);
    }
    Ok(response)
}

/// Where a key's result is asked for: its path segment and endpoint percent-encoded.
pub fn location(scope: &Scope) -> String {
    format!(
        "{KEYS}/{}/result?endpoint={}",
        encode(scope.key.as_str()),
        encode(&scope.endpoint)
    )
}

/// Every byte but RFC 3986's unreserved ones as `%XX`.
fn encode(text: &str) -> String {
    let mut encoded = String::with_capacity(text.len() * 3);
    for byte in text.bytes() {
        if byte.is_ascii_alphanumeric() || matches!(byte, b'-' | b'.' | b'_' | b'~') {
            encoded.push(byte as char);
        } else {
            encoded.push_str(&format!("%{byte:02X}"));
        }
    }
    encoded
}

/// `GET /_idemgate/v1/keys?endpoint=…&state=…&limit=…&cursor=…`.
#[utoipa::path(
    get,
    path = "/_idemgate/v1/keys",
    tag = "lookup",
    security(("tenant_token" = [])),
    params(
        ("endpoint" = Option<String>, Query, description = "Only this endpoint's keys", pattern = r"^[^\u0000]*$"),
        ("state" = Option<String>, Query, description = "Only keys in this state", pattern = "^(in_progress|completed|unknown)$"),
        ("limit" = Option<i64>, Query, description = "At most this many keys (default 50)", minimum = 1, maximum = 100),
        ("cursor" = Option<String>, Query, description = "The `next_cursor` of the page before", pattern = "^([0-9a-fA-F]{2})+$"),
    ),
    responses(
        (status = 200, description = "A page of the tenant's live keys, in key order", body = TenantKeyPage),
        (status = 400, description = "A bad query", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 401, description = "No valid tenant token", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 429, description = "The tenant is over its quota", body = ProblemDoc, content_type = "application/problem+json"),
        (status = 503, description = "The ledger is unavailable", body = ProblemDoc, content_type = "application/problem+json"),
    ),
)]
pub async fn list(
    State(app): State<Arc<AppState>>,
    Tenant(tenant): Tenant,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let _quota = app.tenants.admit(&tenant)?;
    let _share = app.lookups.admit(Some(&tenant))?;
    let (page, next_cursor) =
        page(&app, &tenant, query.as_deref(), KeyState::parse_tenant_word).await?;
    let keys = page.iter().map(TenantKey::from).collect();
    Ok((LOOKUP, Json(TenantKeyPage { keys, next_cursor })).into_response())
}

/// A page of `tenant`'s live keys as the query (`endpoint`, `state` in the words `word`
/// reads, `limit`, `cursor`) asks, and the cursor of the next page: the lookup's listing
/// and the admin API's.
pub(crate) async fn page(
    app: &AppState,
    tenant: &str,
    query: Option<&str>,
    word: fn(&str) -> Option<KeyState>,
) -> Result<(Vec<KeyInfo>, Option<String>), Problem> {
    let params = Params::parse(query, &["endpoint", "state", "limit", "cursor"])?;
    // The ledger's listing takes the tenant's word for a held key.
    let state = match params.state.as_deref().map(word) {
        None => None,
        Some(Some(state)) => Some(state.tenant_word()),
        Some(None) => {
            return Err(invalid(
                "`state` is one of in_progress, completed, unknown (held, to an operator)",
            ));
        }
    };
    let limit = params.limit()?;
    let after = params.after()?;
    let page = app
        .engine
        .ledger()
        .list_keys(
            tenant,
            params.endpoint.as_deref(),
            state,
            (&after.0, &after.1),
            limit,
        )
        .await
        .map_err(|error| {
            tracing::error!(%error, "key listing failed");
            Problem::LedgerUnavailable
        })?;
    let next = next_cursor(&page, limit);
    Ok((page, next))
}

/// The cursor of the page after `page` (of at most `limit` keys), if there may be one.
fn next_cursor(page: &[KeyInfo], limit: i64) -> Option<String> {
    (page.len() as i64 == limit)
        .then(|| {
            page.last()
                .map(|last| encode_cursor(&last.endpoint, &last.key))
        })
        .flatten()
}

/// A key as its tenant sees it: never its body, request or fingerprint.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantKey {
    pub key: String,
    pub endpoint: String,
    /// `in_progress`, `completed`, or `unknown` (its lease ran out without a result: the
    /// reconciler settles it; keep retrying the same key).
    #[schema(pattern = "^(in_progress|completed|unknown)$")]
    pub state: &'static str,
    #[schema(format = DateTime)]
    pub created_at: String,
    #[schema(format = DateTime)]
    pub completed_at: Option<String>,
    /// When the key is forgotten; none while it is not completed.
    #[schema(format = DateTime)]
    pub expires_at: Option<String>,
    pub response_status: Option<i32>,
    /// The trace of the first execution.
    pub trace_id: Option<String>,
    /// Always false: a key the lookup finds was claimed, and may have acted.
    pub safe_new_key: bool,
}

impl From<&KeyInfo> for TenantKey {
    fn from(info: &KeyInfo) -> Self {
        let state = KeyState::of(info);
        let completed = state == KeyState::Completed;
        Self {
            key: info.key.clone(),
            endpoint: info.endpoint.clone(),
            state: state.tenant_word(),
            created_at: time(&info.created_at),
            completed_at: info.completed_at.as_ref().map(time),
            // An in-progress key is remembered until it is settled, whatever its TTL.
            expires_at: completed.then(|| time(&info.expires_at)),
            response_status: info.response_status,
            trace_id: crate::operator::trace_id(info).map(str::to_owned),
            safe_new_key: false,
        }
    }
}

/// A page of a tenant's keys.
#[derive(Debug, Serialize, ToSchema)]
pub struct TenantKeyPage {
    pub keys: Vec<TenantKey>,
    /// The `cursor` of the next page; `null` at the end.
    pub next_cursor: Option<String>,
}

fn time(at: &DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

#[cfg(test)]
mod sizes {
    /// The size of the future an async fn of five arguments returns.
    fn future_of<F, A, B, C, D, E, R>(_: &F) -> usize
    where
        F: Fn(A, B, C, D, E) -> R,
    {
        std::mem::size_of::<R>()
    }

    /// A result's waiter holds its handler's future for up to a minute: the 202's lookup
    /// in it is boxed, so the wait holds a little more than a kilobyte, not the size of
    /// that lookup (22 KiB in a debug build, 73 KiB in a release build before it was:
    /// loadtest/waiters measured 123 KiB of RSS per waiter, 37 KiB after).
    #[test]
    fn a_results_waiter_holds_a_small_future() {
        let size = future_of(&super::result);
        assert!(size < 4096, "the result's future is {size} bytes");
    }
}
