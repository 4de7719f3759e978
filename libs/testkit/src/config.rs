//! Config files for the processes the tests start.

use crate::*;

/// A config file's text for tests: server, Postgres at `db`, HS256 auth, then `extra`.
pub fn config_toml(db: &TestDb, extra: &str) -> String {
    config_toml_with(db, "max_body_bytes = 4096", extra)
}

/// [`config_toml`] with `server` as the `[server]` keys beyond the listener (instead
/// of the 4 KiB body limit).
pub fn config_toml_with(db: &TestDb, server: &str, extra: &str) -> String {
    config_toml_parts(db, server, "", extra)
}

/// The ledger's limits in tests: a route's timeout plus these two must be shorter than
/// its lease (DESIGN §6), and tests use leases of a few seconds.
const TEST_POSTGRES: &str = "acquire_timeout = \"1s\"\nstatement_timeout = \"1s\"";

/// [`config_toml_with`] with `postgres` as `[postgres]` keys beyond the URL and pool
/// size (in place of the tests' default one-second timeouts).
pub fn config_toml_parts(db: &TestDb, server: &str, postgres: &str, extra: &str) -> String {
    let postgres = if postgres.is_empty() {
        TEST_POSTGRES
    } else {
        postgres
    };
    format!(
        r#"
        [server]
        listen = "127.0.0.1:0"
        shutdown_grace = "5s"
        {server}
        [postgres]
        url = "{url}"
        max_connections = 8
        {postgres}
        [auth]
        hs256_secret = "{SECRET}"
        {extra}
        "#,
        url = db.url
    )
}

/// The usual payments route against the demo (and refunds), with extra route keys.
pub fn payments_routes(demo: &Demo, route_extra: &str) -> String {
    let timeout = if route_extra.contains("timeout") {
        ""
    } else {
        "timeout = \"5s\""
    };
    format!(
        r#"
        [[routes]]
        method = "POST"
        path = "/payments"
        upstream = "{url}"
        idempotent = true
        {timeout}
        {route_extra}

        [[routes]]
        method = "POST"
        path = "/refunds"
        upstream = "{url}"
        idempotent = true
        timeout = "5s"

        [[routes]]
        method = "GET"
        path = "/payments/by-key/{{key}}"
        upstream = "{url}"
        "#,
        url = demo.url()
    )
}

/// The `[redis]` section for one server, with short timeouts for tests, and without
/// the in-process layer, so tests see Redis itself.
pub fn redis_section(url: &str) -> String {
    format!(
        "[redis]\nurl = \"{url}\"\ntimeout = \"200ms\"\nprobe_interval = \"200ms\"\nlocal_cache_entries = 0\n"
    )
}
