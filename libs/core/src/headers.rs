//! Every header rule idemgate has, in one place: the names it reads and sets,
//! hop-by-hop stripping both ways, what is forwarded upstream, and which response
//! headers are stored and replayed. (The ledger and the cache only encode what this
//! module decided to store: `idem_postgres::headers`, `idem_redis::codec`.)

use std::time::Duration;

use crate::{AttemptId, IdempotencyKey, StoredResponse};
use bytes::Bytes;
use http::header::{self, AsHeaderName, HeaderMap, HeaderName, HeaderValue};

pub const IDEMPOTENCY_KEY: HeaderName = HeaderName::from_static("idempotency-key");
pub const IDEMPOTENCY_ATTEMPT: HeaderName = HeaderName::from_static("idempotency-attempt");
pub const X_TENANT_ID: HeaderName = HeaderName::from_static("x-tenant-id");
pub const IDEMPOTENT_REPLAYED: HeaderName = HeaderName::from_static("idempotent-replayed");
pub const PREFERENCE_APPLIED: HeaderName = HeaderName::from_static("preference-applied");
pub const TRACEPARENT: HeaderName = HeaderName::from_static("traceparent");
/// RFC 7240: a client's `wait=N`.
pub const PREFER: HeaderName = HeaderName::from_static("prefer");

/// Hop-by-hop headers (RFC 9110 §7.6.1, plus the de-facto `keep-alive` and
/// `proxy-connection`): they describe one connection and never cross a proxy.
pub const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// Whether `name` (lowercase) is hop-by-hop.
pub fn is_hop_by_hop(name: &str) -> bool {
    HOP_BY_HOP.contains(&name)
}

/// Whether a response header (lowercase name, already known not to be hop-by-hop or
/// named in `Connection`) is kept for replays. `Date` is made fresh for each replay and
/// `Content-Length` recomputed; `Set-Cookie` is kept only where the route opts in, so
/// that one client's session never reaches another's retry by accident.
pub fn is_replayable(name: &str, store_set_cookie: bool) -> bool {
    match name {
        "date" | "content-length" => false,
        "set-cookie" => store_set_cookie,
        _ => !is_hop_by_hop(name),
    }
}

/// The headers named in `Connection` (hop-by-hop for this one connection).
fn connection_named(headers: &HeaderMap) -> Vec<HeaderName> {
    list(headers, header::CONNECTION)
        .filter_map(|token| HeaderName::from_bytes(token.as_bytes()).ok())
        .collect()
}

/// Whether a client's `Prefer` (RFC 7240) names the preference `token` (`respond-async`),
/// among its others.
pub fn prefers(headers: &HeaderMap, token: &str) -> bool {
    list(headers, PREFER).any(|item| {
        let name = item.split(['=', ';']).next().unwrap_or("").trim();
        name.eq_ignore_ascii_case(token)
    })
}

/// A client's `Prefer: wait=N` (RFC 7240), among its other preferences.
pub fn preferred_wait(headers: &HeaderMap) -> Option<Duration> {
    seconds(headers, PREFER, "wait")
}

/// `Cache-Control: max-age=N`, if an answer carries it.
pub fn max_age(headers: &HeaderMap) -> Option<Duration> {
    seconds(headers, header::CACHE_CONTROL, "max-age")
}

/// The first `directive=N` item of a comma-separated header whose N is whole seconds
/// (quoted or not); the directive's name is matched without regard to case.
fn seconds(headers: &HeaderMap, name: impl AsHeaderName, directive: &str) -> Option<Duration> {
    list(headers, name)
        .find_map(|item| {
            let (key, value) = item.split_once('=')?;
            key.trim()
                .eq_ignore_ascii_case(directive)
                .then(|| value.trim().trim_matches('"').parse().ok())?
        })
        .map(Duration::from_secs)
}

/// The trimmed items of a comma-separated header, over all its lines.
fn list(headers: &HeaderMap, name: impl AsHeaderName) -> impl Iterator<Item = &str> {
    headers
        .get_all(name)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(str::trim)
}

/// Removes hop-by-hop headers: the fixed list and every header named in `Connection`.
pub fn strip_hop_by_hop(headers: &mut HeaderMap) {
    for name in connection_named(headers) {
        headers.remove(name);
    }
    for name in HOP_BY_HOP {
        headers.remove(name);
    }
}

/// The headers idemgate sets upstream, never taken from the client.
const OWNED: [HeaderName; 4] = [
    IDEMPOTENCY_KEY,
    IDEMPOTENCY_ATTEMPT,
    X_TENANT_ID,
    TRACEPARENT,
];

/// Whether a client header is one idemgate sets, in any spelling: CGI-style servers
/// (Rack, PHP-FPM, older gunicorn) read `X_Tenant_Id` and `X-Tenant-Id` as the same
/// variable, so a `_` counts as a `-` (names are already lowercase).
fn spells_an_owned_header(name: &HeaderName) -> bool {
    let name = name.as_str().as_bytes();
    OWNED.iter().any(|owned| {
        let owned = owned.as_str().as_bytes();
        name.len() == owned.len()
            && name
                .iter()
                .zip(owned)
                .all(|(&a, &b)| a == b || (a == b'_' && b == b'-'))
    })
}

/// The headers sent upstream: the client's end-to-end headers, minus those idemgate
/// owns (in any spelling), plus the tenant from the token, the key exactly as scoped,
/// the attempt's fencing token (so the upstream and its probe can tell two lives of one
/// key apart) and the trace context (a client's valid `traceparent`, or idemgate's own span's,
/// which the client injects over it when tracing).
pub fn upstream_request_headers(
    client: &HeaderMap,
    tenant: &str,
    key: Option<(&IdempotencyKey, AttemptId)>,
    traceparent: Option<&str>,
) -> HeaderMap {
    let mut headers = client.clone();
    strip_hop_by_hop(&mut headers);
    // Host is set from the upstream URI; Content-Length from the body we send, which
    // is already read in full (so there is nothing to `Expect: 100-continue` for).
    headers.remove(header::HOST);
    headers.remove(header::CONTENT_LENGTH);
    headers.remove(header::EXPECT);
    let owned: Vec<HeaderName> = headers
        .keys()
        .filter(|name| spells_an_owned_header(name))
        .cloned()
        .collect();
    for name in owned {
        headers.remove(name);
    }
    if let Ok(tenant) = HeaderValue::from_str(tenant) {
        headers.insert(X_TENANT_ID, tenant);
    }
    if let Some((key, attempt)) = key {
        if let Ok(key) = HeaderValue::from_str(key.as_str()) {
            headers.insert(IDEMPOTENCY_KEY, key);
        }
        if let Ok(attempt) = HeaderValue::from_str(&attempt.to_string()) {
            headers.insert(IDEMPOTENCY_ATTEMPT, attempt);
        }
    }
    if let Some(tp) = traceparent.and_then(|tp| HeaderValue::from_str(tp).ok()) {
        headers.insert(TRACEPARENT, tp);
    }
    headers
}

/// The upstream's response headers as the first client gets them.
pub fn passthrough_response_headers(mut headers: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut headers);
    headers.remove(header::CONTENT_LENGTH);
    headers
}

/// The response as it is stored for replays; `body` is `None` for a body too large
/// to keep (recorded without it).
pub fn to_stored(
    status: u16,
    headers: &HeaderMap,
    body: Option<Bytes>,
    store_set_cookie: bool,
) -> StoredResponse {
    let per_connection = connection_named(headers);
    let headers = headers
        .iter()
        .filter(|(name, _)| !per_connection.contains(name))
        .filter(|(name, _)| is_replayable(name.as_str(), store_set_cookie))
        .map(|(name, value)| (name.as_str().to_owned(), value.as_bytes().to_vec()))
        .collect();
    match body {
        Some(body) => StoredResponse::new(status, headers, body),
        None => StoredResponse::without_body(status, headers),
    }
}

/// Rebuilds stored headers for a replay (invalid stored entries are skipped).
pub fn from_stored(stored: &[(String, Vec<u8>)]) -> HeaderMap {
    let mut headers = HeaderMap::with_capacity(stored.len() + 2);
    for (name, value) in stored {
        if let (Ok(name), Ok(value)) = (
            HeaderName::from_bytes(name.as_bytes()),
            HeaderValue::from_bytes(value),
        ) {
            headers.append(name, value);
        }
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn map(pairs: &[(&str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(
                HeaderName::from_bytes(k.as_bytes()).unwrap(),
                HeaderValue::from_str(v).unwrap(),
            );
        }
        h
    }

    #[test]
    fn strips_fixed_and_connection_named_headers() {
        let mut h = map(&[
            ("connection", "close, x-secret-hop"),
            ("x-secret-hop", "1"),
            ("keep-alive", "timeout=5"),
            ("transfer-encoding", "chunked"),
            ("upgrade", "h2c"),
            ("content-type", "application/json"),
        ]);
        strip_hop_by_hop(&mut h);
        assert_eq!(h, map(&[("content-type", "application/json")]));
    }

    #[test]
    fn tenant_and_key_are_ours_not_the_clients() {
        let client = map(&[
            ("x-tenant-id", "evil"),
            ("idempotency-key", "\"quoted\""),
            ("host", "gateway:8080"),
            ("content-length", "10"),
            ("authorization", "Bearer t"),
        ]);
        let key = IdempotencyKey::parse(b"\"quoted\"").unwrap();
        let h = upstream_request_headers(&client, "acme", Some((&key, AttemptId::random())), None);
        assert_eq!(
            h.get_all("x-tenant-id").iter().collect::<Vec<_>>(),
            ["acme"]
        );
        assert_eq!(h["idempotency-key"], "quoted");
        assert!(h.get("host").is_none() && h.get("content-length").is_none());
        assert_eq!(h["authorization"], "Bearer t");
    }

    #[test]
    fn stored_headers_drop_date_length_and_cookies() {
        let h = map(&[
            ("connection", "x-hop"),
            ("x-hop", "1"),
            ("date", "Mon, 01 Jan 2024 00:00:00 GMT"),
            ("content-length", "3"),
            ("set-cookie", "s=1"),
            ("location", "/payments/1"),
            ("x-multi", "a"),
            ("x-multi", "b"),
        ]);
        let stored = to_stored(201, &h, Some(Bytes::from_static(b"abc")), false);
        assert_eq!(
            stored.headers,
            vec![
                ("location".to_owned(), b"/payments/1".to_vec()),
                ("x-multi".to_owned(), b"a".to_vec()),
                ("x-multi".to_owned(), b"b".to_vec()),
            ]
        );
        assert_eq!(
            from_stored(&stored.headers)
                .get_all("x-multi")
                .iter()
                .count(),
            2
        );
        let with_cookie = to_stored(201, &h, Some(Bytes::new()), true);
        assert!(with_cookie.headers.iter().any(|(n, _)| n == "set-cookie"));
        let omitted = to_stored(201, &h, None, false);
        assert!(omitted.body_omitted && omitted.body.is_empty());
        assert_eq!(omitted.headers, stored.headers);
    }

    #[test]
    fn owned_headers_are_dropped_in_any_spelling() {
        let client = map(&[
            ("x_tenant_id", "globex"),
            ("idempotency_key", "other"),
            ("idempotency_attempt", "forged"),
            ("x-tenant_id", "globex"),
            (
                "traceparent",
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            ),
            ("trace_parent", "x"),
            ("x_request_id", "kept"),
        ]);
        let key = IdempotencyKey::parse(b"k").unwrap();
        let attempt = AttemptId::random();
        let h = upstream_request_headers(&client, "acme", Some((&key, attempt)), None);
        assert_eq!(
            h,
            map(&[
                ("trace_parent", "x"),
                ("x_request_id", "kept"),
                ("x-tenant-id", "acme"),
                ("idempotency-key", "k"),
                ("idempotency-attempt", &attempt.to_string()),
            ])
        );
        let traced = upstream_request_headers(&client, "acme", None, Some("00-1-2-01"));
        assert_eq!(traced["traceparent"], "00-1-2-01");
    }

    #[test]
    fn hop_by_hop_headers_are_never_replayed() {
        for name in HOP_BY_HOP {
            assert!(is_hop_by_hop(name));
            assert!(!is_replayable(name, true), "{name}");
        }
    }

    #[test]
    fn date_length_and_cookies() {
        assert!(!is_replayable("date", false));
        assert!(!is_replayable("content-length", false));
        assert!(!is_replayable("set-cookie", false));
        assert!(is_replayable("set-cookie", true));
        assert!(is_replayable("content-type", false));
        assert!(is_replayable("location", false));
    }

    #[test]
    fn prefer_wait_is_found_among_other_preferences() {
        assert_eq!(
            preferred_wait(&map(&[("prefer", "respond-async, wait=3")])),
            Some(Duration::from_secs(3))
        );
        assert_eq!(preferred_wait(&map(&[("prefer", "return=minimal")])), None);
        assert_eq!(preferred_wait(&map(&[("prefer", "wait=soon")])), None);
    }

    #[test]
    fn max_age_is_read_from_cache_control() {
        let mut headers = HeaderMap::new();
        headers.insert(
            header::CACHE_CONTROL,
            "public, Max-Age=\"120\", must-revalidate".parse().unwrap(),
        );
        assert_eq!(max_age(&headers), Some(Duration::from_secs(120)));
        assert_eq!(max_age(&HeaderMap::new()), None);
    }
}
