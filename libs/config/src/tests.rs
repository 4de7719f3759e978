//! The configuration as a user writes it: defaults, overrides, and every refusal naming its key.

use std::time::Duration;

use idem_core::reconcile::OnUnknown;

use crate::{Config, ConfigErrors};
use idem_core::Disposition;

const BASE: &str = r#"
    [postgres]
    url = "postgres://postgres@127.0.0.1:5432/idemgate"
    [auth]
    hs256_secret = "dev-secret-123"
"#;

fn with(extra: &str) -> Result<Config, ConfigErrors> {
    Config::from_toml(&format!("{BASE}\n{extra}"))
}

fn error_key(extra: &str) -> String {
    let errors = with(extra).expect_err("should be rejected");
    errors.0[0].key.clone()
}

const ROUTE: &str = r#"
    [[routes]]
    method = "POST"
    path = "/payments"
    upstream = "http://127.0.0.1:9090"
    idempotent = true
"#;

#[test]
fn the_design_example_parses_with_defaults() {
    let config = with(ROUTE).unwrap();
    assert_eq!(config.server.listen.to_string(), "127.0.0.1:8080");
    assert_eq!(config.server.max_body_bytes, 1024 * 1024);
    assert_eq!(config.server.worker_threads, None);
    let route = &config.routes.routes()[0];
    assert_eq!(route.endpoint, "POST /payments");
    assert_eq!(route.policy.ttl, Duration::from_secs(86_400));
    assert_eq!(route.policy.lease, Duration::from_secs(30));
    assert_eq!(route.timeout, Duration::from_secs(10));
    assert!(route.key_required);
    assert_eq!(route.on_unknown, OnUnknown::Hold);
    assert_eq!(config.reconciler.release_confirm, Duration::from_secs(30));
    // A 5xx proves nothing: kept where no probe can settle it, never released.
    assert_eq!(route.policy.disposition(500), Disposition::Keep);
    assert_eq!(route.policy.disposition(429), Disposition::Release);
}

#[test]
fn a_route_whose_timeout_and_ledger_call_outlast_its_lease_is_refused() {
    // 10 s + 2 s + 5 s < 30 s: the defaults fit.
    assert!(with(ROUTE).is_ok());
    let tight = format!("[idempotency]\nlease = \"16s\"\n{ROUTE}");
    let errors = with(&tight).expect_err("10 s + 7 s is not shorter than 16 s");
    assert_eq!(errors.0[0].key, "routes[0].timeout");
    assert!(
        errors.0[0].message.contains("postgres.acquire_timeout"),
        "{}",
        errors.0[0].message
    );
    let faster = format!(
        "[postgres]\nurl = \"postgres://x\"\nstatement_timeout = \"1s\"\n[auth]\nhs256_secret = \"dev-secret-123\"\n[idempotency]\nlease = \"16s\"\n{ROUTE}"
    );
    assert!(Config::from_toml(&faster).is_ok(), "10 s + 3 s < 16 s");
    // A route that is not idempotent has no lease to outlast.
    let plain = ROUTE.replace("idempotent = true", "idempotent = false");
    assert!(with(&format!("[idempotency]\nlease = \"11s\"\n{plain}")).is_ok());
}

#[test]
fn the_limits_have_their_documented_defaults_and_bad_values_are_named() {
    let config = with(&format!("[redis]\nurl = \"redis://a\"\n{ROUTE}")).unwrap();
    let server = &config.server;
    assert_eq!(
        (
            server.max_header_bytes,
            server.max_headers,
            server.max_concurrent_requests
        ),
        (16384, 100, 1024)
    );
    assert_eq!(server.header_read_timeout, Duration::from_secs(10));
    assert_eq!(server.body_read_timeout, Duration::from_secs(30));
    assert_eq!(server.response_write_timeout, Duration::from_secs(30));
    assert_eq!(server.max_replay_bytes_in_flight, 256 << 20);
    assert_eq!(config.redis.unwrap().local_cache_bytes, 64 << 20);
    assert_eq!(config.routes.routes()[0].max_response_bytes, 10 << 20);
    for (bad, key) in [
        (
            "[server]\nmax_header_bytes = 512",
            "server.max_header_bytes",
        ),
        ("[server]\nmax_headers = 0", "server.max_headers"),
        (
            "[server]\nheader_read_timeout = \"0s\"",
            "server.header_read_timeout",
        ),
        (
            "[server]\nbody_read_timeout = \"soon\"",
            "server.body_read_timeout",
        ),
        (
            "[server]\nmax_concurrent_requests = 0",
            "server.max_concurrent_requests",
        ),
        (
            "[server]\nmax_concurrent_requests = -1",
            "server.max_concurrent_requests",
        ),
        (
            "[server]\nresponse_write_timeout = \"0s\"",
            "server.response_write_timeout",
        ),
        (
            "[server]\nmax_replay_bytes_in_flight = 0",
            "server.max_replay_bytes_in_flight",
        ),
    ] {
        assert_eq!(error_key(bad), key, "{bad}");
    }
    assert_eq!(
        error_key(&format!("{ROUTE}\nmax_response_bytes = 0")),
        "routes[0].max_response_bytes"
    );
    assert_eq!(
        error_key("[redis]\nurl = \"redis://a\"\nlocal_cache_bytes = 0"),
        "redis.local_cache_bytes"
    );
    // A stored answer the replay budget could never hold is refused up front.
    assert_eq!(
        error_key(&format!(
            "[server]\nmax_replay_bytes_in_flight = 1048576\n{ROUTE}\nmax_response_bytes = 2097152"
        )),
        "routes[0].max_response_bytes"
    );
}

#[test]
fn probe_status_needs_a_probe_and_a_2xx() {
    const PROBE: &str = "probe = \"GET /payments/by-key/{key}\"";
    let config = with(&format!("{ROUTE}\n{PROBE}\nprobe_status = 201")).unwrap();
    assert_eq!(config.routes.routes()[0].probe_status, Some(201));
    assert_eq!(with(ROUTE).unwrap().routes.routes()[0].probe_status, None);
    assert_eq!(
        error_key(&format!("{ROUTE}\nprobe_status = 201")),
        "routes[0].probe_status"
    );
    assert_eq!(
        error_key(&format!("{ROUTE}\n{PROBE}\nprobe_status = 404")),
        "routes[0].probe_status"
    );
}

#[test]
fn a_renamed_path_parameter_is_refused_against_stored_endpoints() {
    let config = with(
        r#"
        [[routes]]
        method = "POST"
        path = "/orders/{order_id}/refunds"
        upstream = "http://127.0.0.1:9090"
        idempotent = true
        "#,
    )
    .unwrap();
    let routes = &config.routes;
    assert!(
        routes
            .check_renames(["POST /orders/{order_id}/refunds"])
            .is_ok()
    );
    assert!(
        routes
            .check_renames(["GET /orders/{id}/refunds", "POST /payments"])
            .is_ok()
    );
    let refusal = routes
        .check_renames(["POST /orders/{id}/refunds"])
        .unwrap_err();
    assert!(
        refusal.contains("POST /orders/{id}/refunds")
            && refusal.contains("POST /orders/{order_id}/refunds"),
        "{refusal}"
    );
}

#[test]
fn unknown_keys_are_named() {
    assert_eq!(error_key("[server]\nlisten_on = \"x\""), "server.listen_on");
    assert_eq!(error_key("[extra]\na = 1"), "extra");
    assert_eq!(
        error_key(&format!("{ROUTE}\nretries = 3")),
        "routes[0].retries"
    );
}

#[test]
fn bad_durations_and_values_are_named() {
    assert_eq!(
        error_key("[idempotency]\nttl = \"forever\""),
        "idempotency.ttl"
    );
    assert_eq!(
        error_key("[idempotency]\non_in_progress = \"later\""),
        "idempotency.on_in_progress"
    );
    assert_eq!(
        error_key("[idempotency]\nmismatch_status = 400"),
        "idempotency.mismatch_status"
    );
    assert_eq!(error_key("[server]\nlisten = \"nowhere\""), "server.listen");
    assert_eq!(
        error_key("[server]\nworker_threads = 0"),
        "server.worker_threads"
    );
    assert_eq!(
        error_key(&format!("{ROUTE}\ntimeout = \"10 parsecs\"")),
        "routes[0].timeout"
    );
}

#[test]
fn route_timeout_must_be_shorter_than_the_lease() {
    let errors = with(&format!("{ROUTE}\ntimeout = \"30s\"")).unwrap_err();
    assert_eq!(errors.0[0].key, "routes[0].timeout");
    assert!(errors.0[0].message.contains("lease"), "{errors}");
    // A per-route lease can make room for a longer timeout.
    assert!(with(&format!("{ROUTE}\ntimeout = \"30s\"\nlease = \"1m\"")).is_ok());
}

#[test]
fn route_fields_are_validated() {
    assert_eq!(
        error_key(&ROUTE.replace("POST", "post")),
        "routes[0].method"
    );
    assert_eq!(
        error_key(&ROUTE.replace("/payments", "payments")),
        "routes[0].path"
    );
    assert_eq!(
        error_key(&ROUTE.replace("http://127.0.0.1:9090", "https://x")),
        "routes[0].upstream"
    );
    assert_eq!(
        error_key(&format!("{ROUTE}\nprobe = \"GET /payments\"")),
        "routes[0].probe"
    );
    assert_eq!(
        error_key(&format!("{ROUTE}\non_unknown = \"release\"")),
        "routes[0].on_unknown"
    );
    assert_eq!(
        error_key(&format!("{ROUTE}\non_unknown = \"release-after:soon\"")),
        "routes[0].on_unknown"
    );
    assert_eq!(
        error_key(&format!("{ROUTE}\nrelease_on = [\"6xx\"]")),
        "routes[0].release_on"
    );
    assert_eq!(error_key(&format!("{ROUTE}{ROUTE}")), "routes[1]");
}

#[test]
fn per_route_settings_override_defaults() {
    let config = with(&format!(
        "[idempotency]\nttl = \"1h\"\n{ROUTE}\nttl = \"10m\"\nmismatch_status = 422\non_unknown = \"release-after:10m\"\nprobe = \"GET /payments/by-key/{{key}}\"\nrelease_on = [\"5xx\"]"
    ))
    .unwrap();
    let route = &config.routes.routes()[0];
    assert_eq!(route.policy.ttl, Duration::from_secs(600));
    assert_eq!(route.mismatch_status, 422);
    assert_eq!(
        route.on_unknown,
        OnUnknown::ReleaseAfter(Duration::from_secs(600))
    );
    assert_eq!(route.probe.as_ref().unwrap().path, "/payments/by-key/{key}");
    assert_eq!(route.policy.disposition(503), Disposition::Release);
    assert_eq!(
        route.policy.disposition(429),
        Disposition::Keep,
        "the list replaces the default"
    );
}

#[test]
fn redis_needs_one_of_url_or_cluster_urls() {
    assert!(
        with("[redis]\nurl = \"redis://127.0.0.1:6379\"")
            .unwrap()
            .redis
            .is_some()
    );
    assert!(with("[redis]\ncluster_urls = [\"redis://127.0.0.1:7000\"]").is_ok());
    assert_eq!(error_key("[redis]\nprefix = \"x\""), "redis");
    assert_eq!(
        error_key("[redis]\nurl = \"redis://a\"\ncluster_urls = [\"redis://b\"]"),
        "redis"
    );
    assert_eq!(
        error_key("[redis]\nurl = \"redis://a\"\nprefix = \"{x}\""),
        "redis.prefix"
    );
    assert_eq!(
        error_key("[redis]\nurl = \"redis://a\"\ntimeout = \"fast\""),
        "redis.timeout"
    );
}

#[test]
fn missing_sections_are_named() {
    let errors = Config::from_toml("[auth]\nhs256_secret = \"x\"").unwrap_err();
    assert!(errors.0.iter().any(|e| e.key == "postgres"), "{errors}");
}

#[test]
fn a_tenants_policy_wins_over_the_routes_and_quotas_come_from_the_default() {
    let config = with(&format!(
        r#"{ROUTE}
        ttl = "1h"
        [tenants.default]
        rate = "500/s"
        max_concurrent_requests = 256
        [tenants.acme]
        ttl = "72h"
        max_body_bytes = 4096
        [tenants."globex.example"]
        wait_timeout = "1s"
        "#
    ))
    .unwrap();
    let route = &config.routes.routes()[0];
    assert_eq!(route.policy.ttl, Duration::from_secs(3600));
    let acme = config.tenants.get("acme");
    assert_eq!(acme.policy(route).ttl, Duration::from_secs(72 * 3600));
    assert_eq!(acme.policy(route).lease, route.policy.lease);
    assert_eq!(acme.max_body_bytes, Some(4096));
    assert_eq!(acme.max_concurrent_requests, Some(256), "from the default");
    assert_eq!(acme.burst().unwrap().get(), 500);
    // A tenant without an entry: the default's quotas, the route's policy.
    let other = config.tenants.get("initech");
    assert_eq!(other.policy(route).ttl, Duration::from_secs(3600));
    assert_eq!(other.rate, acme.rate);
    assert_eq!(
        config
            .tenants
            .get("globex.example")
            .policy(route)
            .wait_timeout,
        Duration::from_secs(1)
    );
}

#[test]
fn a_bad_tenant_entry_is_named() {
    assert_eq!(
        error_key("[tenants.acme]\nrate = \"fast\""),
        "tenants.acme.rate"
    );
    assert_eq!(
        error_key("[tenants.acme]\nttl = \"0s\""),
        "tenants.acme.ttl"
    );
    assert_eq!(error_key("[tenants.acme]\nburst = 5"), "tenants.acme.burst");
    assert_eq!(
        error_key("[tenants.default]\nmax_concurrent_requests = 0"),
        "tenants.default.max_concurrent_requests"
    );
    assert_eq!(error_key("[tenants.acme]\nquota = 5"), "tenants.acme.quota");
    assert_eq!(
        error_key("[tenants.\"a b\"]\nmax_body_bytes = 0"),
        "tenants.\"a b\".max_body_bytes"
    );
}

#[test]
fn the_lease_rule_holds_for_every_tenant_and_route() {
    // The route's own 30 s lease is fine for its 10 s timeout; acme's 5 s is not.
    let errors = with(&format!(
        "{ROUTE}\n[tenants.acme]\nlease = \"5s\"\nttl = \"1h\""
    ))
    .unwrap_err();
    assert_eq!(errors.0[0].key, "tenants.acme.lease");
    assert!(
        errors.0[0].message.contains("routes[0] (POST /payments)"),
        "{errors}"
    );
    // A lease longer than the tenant's ttl, on a route.
    let errors = with(&format!("{ROUTE}\n[tenants.default]\nttl = \"20s\"")).unwrap_err();
    assert_eq!(errors.0[0].key, "tenants.default.lease", "{errors}");
    assert!(with(&format!("{ROUTE}\n[tenants.acme]\nlease = \"2m\"")).is_ok());
}

#[test]
fn no_route_may_live_under_idemgates_own_paths() {
    let route = ROUTE.replace("/payments", "/_idemgate/v1/keys");
    assert_eq!(error_key(&route), "routes[0].path");
}

#[test]
fn the_admin_api_is_off_by_default_and_needs_a_token_file_of_a_long_token() {
    let config = with("").unwrap();
    assert!(config.admin.listen.is_none());
    assert!(config.admin.token().unwrap().is_none());
    assert_eq!(
        error_key("[admin]\nlisten = \"127.0.0.1:9100\""),
        "admin.token_file"
    );
    assert_eq!(error_key("[admin]\ntoken_file = \"/x\""), "admin.listen");
    assert_eq!(error_key("[admin]\nlisten = \"nowhere\""), "admin.listen");

    let dir = std::env::temp_dir().join(format!("idem-admin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("token");
    let admin = |token: Option<&str>| {
        match token {
            Some(token) => std::fs::write(&file, token).unwrap(),
            None => std::fs::remove_file(&file).unwrap(),
        }
        with(&format!(
            "[admin]\nlisten = \"127.0.0.1:9100\"\ntoken_file = {:?}",
            file.to_str().unwrap()
        ))
        .unwrap()
        .admin
        .token()
    };
    assert_eq!(admin(Some("short\n")).unwrap_err().key, "admin.token_file");
    use secrecy::ExposeSecret;
    let token = admin(Some("0123456789abcdef0123\n")).unwrap().unwrap();
    assert_eq!(token.expose_secret(), "0123456789abcdef0123", "trimmed");
    assert_eq!(
        admin(None).unwrap_err().key,
        "admin.token_file",
        "a missing file"
    );
}

/// A webhook route as docs/webhooks.md writes it, over a secrets file of the test's own.
fn webhook_route(path: &str, section: &str) -> String {
    format!(
        "[[routes]]\nmethod = \"POST\"\npath = \"{path}\"\nupstream = \"http://127.0.0.1:9090\"\n\
         idempotent = true\n[routes.webhook]\n{section}"
    )
}

fn secret_file(name: &str, text: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("idem-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join(name);
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn a_webhook_route_reads_its_secrets_names_its_tenant_and_keeps_keys_72h() {
    let file = secret_file(
        "billing.secret",
        "whsec_aWRlbWdhdGUtY29uZmlnLXRlc3Qtc2VjcmV0\n",
    );
    let config = with(&webhook_route(
        "/webhooks/billing",
        &format!(
            "scheme = \"standard-webhooks\"\nsecret_file = {:?}\ntenant = \"acme\"",
            file.display().to_string()
        ),
    ))
    .unwrap();
    let route = &config.routes.routes()[0];
    let webhook = route.webhook.as_ref().unwrap();
    assert_eq!(webhook.scheme, idem_webhooks::Scheme::StandardWebhooks);
    assert_eq!(webhook.tenant.as_deref(), Some("acme"));
    assert_eq!(webhook.tolerance, Duration::from_secs(300));
    assert_eq!(webhook.secrets, crate::SecretSource::File(file.clone()));
    assert_eq!(route.policy.ttl, crate::WEBHOOK_TTL);
    // A route's own ttl wins; a route without [routes.webhook] keeps the default.
    let short = webhook_route(
        "/webhooks/billing",
        &format!(
            "scheme = \"github\"\nsecret_file = {:?}\ntenant = \"acme\"",
            file.display().to_string()
        ),
    )
    .replace("idempotent = true", "idempotent = true\nttl = \"1h\"");
    assert_eq!(
        with(&short).unwrap().routes.routes()[0].policy.ttl,
        Duration::from_secs(3600)
    );

    let dir = file.parent().unwrap().display().to_string();
    let per_tenant = with(&webhook_route(
        "/webhooks/{tenant}/billing",
        &format!("scheme = \"stripe\"\nsecret_dir = {dir:?}\ntolerance = \"1m\""),
    ))
    .unwrap();
    let webhook = per_tenant.routes.routes()[0].webhook.clone().unwrap();
    assert_eq!(webhook.tenant, None);
    assert_eq!(webhook.tolerance, Duration::from_secs(60));
    assert_eq!(webhook.secrets, crate::SecretSource::Dir(dir.into()));
}

#[test]
fn a_webhook_route_that_could_verify_nothing_or_names_no_tenant_is_refused() {
    let good = secret_file(
        "good.secret",
        "whsec_aWRlbWdhdGUtY29uZmlnLXRlc3Qtc2VjcmV0\n",
    );
    let good = good.display().to_string();
    let empty = secret_file("empty.secret", "\n").display().to_string();
    let dir = std::env::temp_dir().display().to_string();
    let cases = [
        (
            "/w",
            format!("scheme = \"svix\"\nsecret_file = {good:?}\ntenant = \"acme\""),
            "routes[0].webhook.scheme",
        ),
        (
            "/w",
            format!("scheme = \"stripe\"\nsecret_file = {good:?}"),
            "routes[0].webhook",
        ),
        (
            "/w/{tenant}",
            format!("scheme = \"stripe\"\nsecret_dir = {dir:?}\ntenant = \"acme\""),
            "routes[0].webhook.tenant",
        ),
        (
            "/w",
            "scheme = \"stripe\"\nsecret_file = \"/nonexistent/secret\"\ntenant = \"acme\"".into(),
            "routes[0].webhook.secret_file",
        ),
        (
            "/w",
            format!("scheme = \"github\"\nsecret_file = {empty:?}\ntenant = \"acme\""),
            "routes[0].webhook.secret_file",
        ),
        (
            "/w",
            format!("scheme = \"github\"\nsecret_dir = {dir:?}\ntenant = \"acme\""),
            "routes[0].webhook.secret_file",
        ),
        (
            "/w/{tenant}",
            format!("scheme = \"github\"\nsecret_file = {good:?}"),
            "routes[0].webhook.secret_dir",
        ),
        (
            "/w",
            format!(
                "scheme = \"github\"\nsecret_file = {good:?}\ntenant = \"acme\"\ntolerance = \"0s\""
            ),
            "routes[0].webhook.tolerance",
        ),
    ];
    for (path, section, key) in cases {
        // Refused as written, or — a file that cannot be read or holds no secret — by the
        // check the gateway and check-config run at start.
        let refused = match with(&webhook_route(path, &section)) {
            Err(errors) => errors.0[0].key.clone(),
            Ok(config) => {
                config
                    .routes
                    .check_webhook_secrets()
                    .expect_err(&section)
                    .key
            }
        };
        assert_eq!(refused, key, "{section}");
    }
    // A webhook route deduplicates: it must be idempotent.
    let plain = webhook_route(
        "/w",
        &format!("scheme = \"github\"\nsecret_file = {good:?}\ntenant = \"acme\""),
    )
    .replace("idempotent = true", "idempotent = false");
    assert_eq!(error_key(&plain), "routes[0].webhook");
}

/// docs/webhooks.md, "what your receiver must do": the route's ttl is the one that
/// counts, its tolerance stays under it, and a receiver's 5xx is released.
#[test]
fn a_webhook_routes_ttl_and_release_rules_are_its_own() {
    let file = secret_file(
        "rules.secret",
        "whsec_aWRlbWdhdGUtY29uZmlnLXRlc3Qtc2VjcmV0\n",
    );
    let section = format!(
        "scheme = \"standard-webhooks\"\nsecret_file = {:?}\ntenant = \"acme\"",
        file.display().to_string()
    );
    let config = with(&format!(
        "{ROUTE}\n{}\n[tenants.default]\nttl = \"1h\"\n[tenants.acme]\nttl = \"40m\"",
        webhook_route("/webhooks/billing", &section)
    ))
    .unwrap();
    let [payments, webhook] = config.routes.routes() else {
        panic!("two routes")
    };
    for tenant in ["acme", "initech"] {
        let rules = config.tenants.get(tenant);
        assert_eq!(rules.policy(webhook).ttl, crate::WEBHOOK_TTL, "{tenant}");
        assert!(rules.policy(payments).ttl <= Duration::from_secs(3600));
    }
    assert_eq!(
        config.tenants.get("acme").policy(payments).ttl,
        Duration::from_secs(2400)
    );
    for status in [500, 502, 503, 504, 599, 408, 425, 429] {
        assert!(webhook.policy.release_on.contains(status), "{status}");
    }
    assert!(!webhook.policy.release_on.contains(200));
    assert!(
        !payments.policy.release_on.contains(500),
        "API routes keep 5xx"
    );
    let Some(w) = &webhook.webhook else { panic!() };
    assert_eq!(
        (w.max_body_bytes, w.body_read_timeout, w.max_unverified),
        (262_144, Duration::from_secs(5), 64)
    );
    // Neither a probe nor on_unknown: warned of, as is a ttl under 72h.
    let warnings = config.routes.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("on_unknown"), "{warnings:?}");
    let short = webhook_route("/webhooks/billing", &section).replace(
        "idempotent = true",
        "idempotent = true\nttl = \"1h\"\non_unknown = \"hold\"",
    );
    let warnings = with(&short).unwrap().routes.warnings();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("shorter than the 72h"), "{warnings:?}");

    // A tolerance at or above the ttl, a bad tenant id, a zero bound: refused.
    let cases = [
        (
            section.clone() + "\ntolerance = \"100h\"",
            "routes[0].webhook.tolerance",
        ),
        (
            section.replace("acme", "acme corp"),
            "routes[0].webhook.tenant",
        ),
        (
            section.clone() + "\nmax_unverified = 0",
            "routes[0].webhook.max_unverified",
        ),
        (
            section.clone() + "\nmax_body_bytes = 0",
            "routes[0].webhook.max_body_bytes",
        ),
    ];
    for (section, key) in cases {
        assert_eq!(error_key(&webhook_route("/w", &section)), key, "{section}");
    }
    let at_ttl = webhook_route("/w", &(section.clone() + "\ntolerance = \"1h\""))
        .replace("idempotent = true", "idempotent = true\nttl = \"1h\"");
    assert_eq!(error_key(&at_ttl), "routes[0].webhook.tolerance");
}

#[test]
fn a_secrets_file_read_by_two_schemes_is_refused() {
    let stripe = secret_file("stripe", "whsec_stripe_test_secret_0123\n");
    let dir = stripe.parent().unwrap().display().to_string();
    let stripe = stripe.display().to_string();
    let tenant_dir = webhook_route(
        "/webhooks/{tenant}/billing",
        &format!("scheme = \"standard-webhooks\"\nsecret_dir = {dir:?}"),
    );
    let stripe_route = webhook_route(
        "/webhooks/stripe",
        &format!("scheme = \"stripe\"\nsecret_file = {stripe:?}\ntenant = \"acme\""),
    );
    let clash = with(&format!("{tenant_dir}\n{stripe_route}")).unwrap();
    let refused = clash.routes.check_webhook_secrets().unwrap_err();
    assert_eq!(refused.key, "routes[1].webhook.secret_file");
    assert!(refused.message.contains("standard-webhooks"), "{refused}");
    // The same file, by two routes of the same scheme, is fine; so is a file of its own.
    let same_scheme = stripe_route.replace("/webhooks/stripe", "/webhooks/stripe-too");
    with(&format!("{stripe_route}\n{same_scheme}"))
        .unwrap()
        .routes
        .check_webhook_secrets()
        .unwrap();
    let own = secret_file("own/stripe", "whsec_stripe_test_secret_0123\n");
    let apart = stripe_route.replace(&stripe, &own.display().to_string());
    with(&format!("{tenant_dir}\n{apart}"))
        .unwrap()
        .routes
        .check_webhook_secrets()
        .unwrap();
}
