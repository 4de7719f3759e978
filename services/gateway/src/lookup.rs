//! The tenant's own lookup (DESIGN §14): what happened to a key, with the tenant's own
//! token, never showing a body.
//!
//! - `GET /_idemgate/v1/keys/{key}?endpoint=POST%20%2Fpayments` → 200 with the key's
//!   state, times, response status and trace id, or 404 `idempotency-key-not-found` —
//!   the same status, type and body for a key never used, expired, or another tenant's
//!   (the lookup only ever reads the caller's own scope).
//! - `GET /_idemgate/v1/keys?endpoint=…&state=…&limit=…&cursor=…` → a page of the
//!   tenant's live keys in key order, and the cursor of the next page (`null` at the end).

use std::sync::Arc;

use axum::Json;
use axum::extract::{Path, RawQuery, State};
use axum::response::{IntoResponse, Response};
use chrono::{DateTime, SecondsFormat, Utc};
use idem_core::{IdempotencyKey, Scope};
use idem_postgres::ledger::KeyInfo;
use serde_json::{Value, json};

use crate::app::AppState;
use crate::extract::Tenant;
use crate::problem::Problem;

/// Where the lookup lives (no route may be configured under `/_idemgate/`).
pub const KEYS: &str = "/_idemgate/v1/keys";

/// The most keys one page holds, and how many it holds unless asked.
const MAX_LIMIT: i64 = 100;
const DEFAULT_LIMIT: i64 = 50;

/// `GET /_idemgate/v1/keys/{key}?endpoint=…`.
pub async fn show(
    State(app): State<Arc<AppState>>,
    Tenant(tenant): Tenant,
    Path(key): Path<String>,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let _quota = app.tenants.admit(&tenant)?;
    let params = Params::parse(query.as_deref(), &["endpoint"])?;
    let endpoint = params
        .endpoint
        .ok_or_else(|| invalid("`endpoint` is required, e.g. endpoint=POST%20%2Fpayments"))?;
    let key = IdempotencyKey::parse(key.as_bytes()).map_err(|e| invalid(&e.to_string()))?;
    let scope = Scope::new(tenant, endpoint, key);
    match app.engine.ledger().lookup(&scope).await {
        Ok(Some(info)) => Ok(Json(view(&info)).into_response()),
        Ok(None) => Err(Problem::KeyNotFound),
        Err(error) => {
            tracing::error!(%error, "key lookup failed");
            Err(Problem::LedgerUnavailable)
        }
    }
}

/// `GET /_idemgate/v1/keys?endpoint=…&state=…&limit=…&cursor=…`.
pub async fn list(
    State(app): State<Arc<AppState>>,
    Tenant(tenant): Tenant,
    RawQuery(query): RawQuery,
) -> Result<Response, Problem> {
    let _quota = app.tenants.admit(&tenant)?;
    let params = Params::parse(query.as_deref(), &["endpoint", "state", "limit", "cursor"])?;
    let state = match params.state.as_deref() {
        None | Some("in_progress" | "completed" | "unknown") => params.state.as_deref(),
        Some(_) => return Err(invalid("`state` is one of in_progress, completed, unknown")),
    };
    let limit = match params.limit.as_deref() {
        None => DEFAULT_LIMIT,
        Some(n) => n
            .parse::<i64>()
            .ok()
            .filter(|n| (1..=MAX_LIMIT).contains(n))
            .ok_or_else(|| invalid(&format!("`limit` is a whole number from 1 to {MAX_LIMIT}")))?,
    };
    let after = match params.cursor.as_deref() {
        None => (String::new(), String::new()),
        Some(cursor) => {
            decode_cursor(cursor).ok_or_else(|| invalid("`cursor` is not one this API gave"))?
        }
    };
    let page = app
        .engine
        .ledger()
        .list_keys(
            &tenant,
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
    let next = (page.len() as i64 == limit)
        .then(|| {
            page.last()
                .map(|last| encode_cursor(&last.endpoint, &last.key))
        })
        .flatten();
    let keys: Vec<Value> = page.iter().map(view).collect();
    Ok(Json(json!({ "keys": keys, "next_cursor": next })).into_response())
}

/// A key as its tenant sees it: never its body, request or fingerprint.
fn view(info: &KeyInfo) -> Value {
    let state = match (info.status.as_str(), info.held) {
        ("completed", _) => "completed",
        (_, true) => "unknown",
        _ => "in_progress",
    };
    let completed = state == "completed";
    json!({
        "key": info.key,
        "endpoint": info.endpoint,
        "state": state,
        "created_at": time(&info.created_at),
        "completed_at": info.completed_at.as_ref().map(time),
        // An in-progress key is remembered until it is settled, whatever its TTL.
        "expires_at": completed.then(|| time(&info.expires_at)),
        "response_status": info.response_status,
        "trace_id": info.trace_context.as_deref().and_then(trace_id),
        // A key the lookup finds was claimed, and may have acted: never safe to replace.
        "safe_new_key": false,
    })
}

fn time(at: &DateTime<Utc>) -> String {
    at.to_rfc3339_opts(SecondsFormat::Millis, true)
}

/// The trace id of a stored W3C `traceparent` (`00-<trace id>-<span id>-<flags>`).
fn trace_id(traceparent: &str) -> Option<String> {
    let id = traceparent.split('-').nth(1)?;
    (id.len() == 32 && id.bytes().all(|b| b.is_ascii_hexdigit())).then(|| id.to_owned())
}

/// The last key of a page, as the next page's opaque cursor.
fn encode_cursor(endpoint: &str, key: &str) -> String {
    hex::encode(format!("{endpoint}\n{key}"))
}

fn decode_cursor(cursor: &str) -> Option<(String, String)> {
    let text = String::from_utf8(hex::decode(cursor).ok()?).ok()?;
    let (endpoint, key) = text.split_once('\n')?;
    Some((endpoint.to_owned(), key.to_owned()))
}

fn invalid(why: &str) -> Problem {
    Problem::RequestInvalid(why.to_owned())
}

/// The query parameters a lookup takes; any other, or one given twice, is refused.
#[derive(Debug, Default)]
struct Params {
    endpoint: Option<String>,
    state: Option<String>,
    limit: Option<String>,
    cursor: Option<String>,
}

impl Params {
    fn parse(query: Option<&str>, allowed: &[&str]) -> Result<Self, Problem> {
        let mut params = Self::default();
        for (name, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            let slot = match name.as_ref() {
                "endpoint" => &mut params.endpoint,
                "state" => &mut params.state,
                "limit" => &mut params.limit,
                "cursor" => &mut params.cursor,
                _ => return Err(invalid(&format!("unknown query parameter {name:?}"))),
            };
            if !allowed.contains(&name.as_ref()) {
                return Err(invalid(&format!("unknown query parameter {name:?}")));
            }
            if slot.replace(value.into_owned()).is_some() {
                return Err(invalid(&format!("`{name}` is given twice")));
            }
        }
        Ok(params)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursors_round_trip_and_strangers_are_refused() {
        let cursor = encode_cursor("POST /orders/{id}/refunds", "k-1");
        assert_eq!(
            decode_cursor(&cursor),
            Some(("POST /orders/{id}/refunds".into(), "k-1".into()))
        );
        for bad in ["", "zz", "00", &hex::encode("no newline")] {
            assert_eq!(decode_cursor(bad), None, "{bad:?}");
        }
    }

    #[test]
    fn query_parameters_are_decoded_and_checked() {
        let p = Params::parse(
            Some("endpoint=POST%20%2Fpayments&limit=5"),
            &["endpoint", "limit"],
        )
        .unwrap();
        assert_eq!(p.endpoint.as_deref(), Some("POST /payments"));
        assert_eq!(p.limit.as_deref(), Some("5"));
        for bad in ["endpoint=a&endpoint=b", "nope=1", "state=completed"] {
            assert!(Params::parse(Some(bad), &["endpoint"]).is_err(), "{bad}");
        }
    }

    #[test]
    fn the_trace_id_is_the_traceparents_second_field() {
        assert_eq!(
            trace_id("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01").as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id("garbage"), None);
    }
}
