//! Which response headers may be stored and replayed.

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
