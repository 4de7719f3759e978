//! The `idemgate` binary's offline commands.

use std::process::Command;

use idem_testkit::{Route, TestConfig};

fn idemgate(args: &[&str], config: &str) -> (bool, String, String) {
    idemgate_env(args, config, &[])
}

fn idemgate_env(args: &[&str], config: &str, env: &[(&str, &str)]) -> (bool, String, String) {
    let dir = std::env::temp_dir().join(format!("idemgate-cli-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("idemgate.toml");
    std::fs::write(&path, config).unwrap();
    let output = Command::new(env!("CARGO_BIN_EXE_idemgate"))
        .args(args)
        .arg("--config")
        .arg(&path)
        .env_remove("IDEMGATE_CONFIG")
        .envs(env.iter().copied())
        .output()
        .expect("run idemgate");
    std::fs::remove_dir_all(&dir).ok();
    (
        output.status.success(),
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// A good file, as a user writes it: Postgres, a secret and one route, all else default.
fn good() -> TestConfig {
    TestConfig::bare()
        .set(
            "postgres.url",
            "postgres://postgres@127.0.0.1:5432/idemgate",
        )
        .set("auth.hs256_secret", "dev-secret-123")
        .route(good_route())
}

fn good_route() -> Route {
    Route::plain("POST", "/payments", "http://127.0.0.1:9090").set("idempotent", true)
}

#[test]
fn check_config_accepts_a_good_file() {
    let (ok, stdout, stderr) = idemgate(&["check-config"], &good().toml());
    assert!(ok, "{stderr}");
    assert!(
        stdout.contains("OK") && stdout.contains("POST /payments"),
        "{stdout}"
    );
}

#[test]
fn check_config_names_an_unknown_key() {
    let (ok, _, stderr) = idemgate(
        &["check-config"],
        &TestConfig::bare()
            .set(
                "postgres.url",
                "postgres://postgres@127.0.0.1:5432/idemgate",
            )
            .set("auth.hs256_secret", "dev-secret-123")
            .route(good_route().set("retry", 3))
            .toml(),
    );
    assert!(!ok);
    assert!(stderr.contains("routes[0].retry"), "{stderr}");
}

#[test]
fn check_config_names_a_bad_duration() {
    let (ok, _, stderr) = idemgate(
        &["check-config"],
        &good().set("idempotency.lease", "half a minute").toml(),
    );
    assert!(!ok);
    assert!(stderr.contains("idempotency.lease"), "{stderr}");
}

#[test]
fn check_config_names_a_bad_tenant_entry() {
    for (tenant, key, value, named) in [
        ("acme", "rate", "lots", "tenants.acme.rate"),
        ("acme", "lease", "5s", "tenants.acme.lease"),
        (
            "globex.example",
            "max_concurrent_requests",
            "0",
            "tenants.\"globex.example\".max_concurrent_requests",
        ),
    ] {
        let toml = format!(
            "{}\n[tenants.\"{tenant}\"]\n{key} = {}\n",
            good().toml(),
            if value.parse::<u64>().is_ok() {
                value.to_owned()
            } else {
                format!("{value:?}")
            }
        );
        let (ok, _, stderr) = idemgate(&["check-config"], &toml);
        assert!(!ok, "{toml}");
        assert!(stderr.contains(named), "{named}: {stderr}");
    }
}

/// A completion sent at the upstream deadline must land within the lease.
#[test]
fn check_config_refuses_a_timeout_and_ledger_call_that_outlast_the_lease() {
    // 10 s (the route's default timeout) + 2 s + 5 s is not shorter than 15 s.
    let (ok, _, stderr) = idemgate(
        &["check-config"],
        &good().set("idempotency.lease", "15s").toml(),
    );
    assert!(!ok);
    assert!(
        stderr.contains("routes[0].timeout") && stderr.contains("postgres.statement_timeout"),
        "{stderr}"
    );
    let (ok, _, stderr) = idemgate(
        &["check-config"],
        &good().set("idempotency.lease", "18s").toml(),
    );
    assert!(ok, "{stderr}");
}

#[test]
fn check_config_checks_the_auth_keys() {
    let (ok, _, stderr) = idemgate(
        &["check-config"],
        &good()
            .unset("auth.hs256_secret")
            .set("auth.public_key_pem_file", "/nonexistent/key.pem")
            .toml(),
    );
    assert!(!ok);
    assert!(stderr.contains("auth.public_key_pem_file"), "{stderr}");
}

#[test]
fn the_dev_config_is_valid() {
    let dev = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../config/idemgate.dev.toml"
    ))
    .unwrap();
    let (ok, _, stderr) = idemgate(&["check-config"], &dev);
    assert!(ok, "{stderr}");
}

#[test]
fn token_mints_a_verifiable_dev_token() {
    let (ok, stdout, stderr) = idemgate(
        &["token", "--tenant", "acme", "--ttl", "5m"],
        &good().toml(),
    );
    assert!(ok, "{stderr}");
    let config = idemgate::Config::from_toml(&good().toml()).unwrap();
    let auth = idem_auth::Authenticator::from_config(&config.auth).unwrap();
    assert_eq!(auth.verify(stdout.trim()).unwrap().0, "acme");
}

#[test]
fn environment_variables_override_the_file() {
    let (ok, _, stderr) = idemgate_env(
        &["check-config"],
        &good().toml(),
        &[("IDEMGATE_SERVER__LISTEN", "not-an-address")],
    );
    assert!(!ok);
    assert!(stderr.contains("server.listen"), "{stderr}");
    let (ok, _, stderr) = idemgate_env(
        &["check-config"],
        &good().toml(),
        &[("IDEMGATE_IDEMPOTENCY__LEASE", "5s")],
    );
    assert!(
        !ok,
        "the route's default 10s timeout is no longer shorter than the lease"
    );
    assert!(stderr.contains("routes[0].timeout"), "{stderr}");
    // Variables without a section separator are not config keys (IDEMGATE_LOG_FORMAT).
    let (ok, _, stderr) = idemgate_env(
        &["check-config"],
        &good().toml(),
        &[("IDEMGATE_LOG_FORMAT", "json")],
    );
    assert!(ok, "{stderr}");
}

/// An identity provider is trusted over https:// only (http:// on loopback, for
/// development); a provider's tokens for any audience are accepted only when said.
#[test]
fn check_config_refuses_plain_http_to_a_provider_and_warns_without_an_audience() {
    let provider = |url: &str| {
        good()
            .unset("auth.hs256_secret")
            .set("auth.jwks_url", url)
            .toml()
    };
    let (ok, _, stderr) = idemgate(&["check-config"], &provider("http://idp.example.com/jwks"));
    assert!(!ok);
    assert!(
        stderr.contains("auth.jwks_url") && stderr.contains("https://"),
        "{stderr}"
    );

    let (ok, _, stderr) = idemgate(&["check-config"], &provider("https://idp.example.com/jwks"));
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("warning: auth.audience is not set"),
        "{stderr}"
    );

    let said = good()
        .unset("auth.hs256_secret")
        .set("auth.oidc_issuer", "http://127.0.0.1:9/realms/acme")
        .set("auth.allow_any_audience", true)
        .toml();
    let (ok, _, stderr) = idemgate(&["check-config"], &said);
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
}

/// `check-config` reads a webhook route's secrets (a file that cannot be read verifies
/// nothing) and warns when its ttl is shorter than the 72 h providers redeliver for, or
/// when nothing but an operator settles a receiver's timeout.
#[test]
fn check_config_reads_webhook_secrets_and_warns_of_a_short_ttl() {
    let dir =
        std::env::temp_dir().join(format!("idemgate-cli-wh-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let secret = dir.join("billing.secret");
    std::fs::write(&secret, "whsec_aWRlbWdhdGUtY29uZmlnLXRlc3Qtc2VjcmV0\n").unwrap();
    let route = |file: &str, ttl: &str| {
        good().route(
            Route::idempotent("POST", "/webhooks/billing", "http://127.0.0.1:9090")
                .set("ttl", ttl)
                .set("on_unknown", "hold")
                .webhook(&[
                    ("scheme", "standard-webhooks"),
                    ("secret_file", file),
                    ("tenant", "acme"),
                ]),
        )
    };
    let file = secret.display().to_string();
    let (ok, _, stderr) = idemgate(&["check-config"], &route(&file, "72h").toml());
    assert!(ok, "{stderr}");
    assert!(!stderr.contains("warning"), "{stderr}");
    let (ok, _, stderr) = idemgate(&["check-config"], &route(&file, "1h").toml());
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("warning: POST /webhooks/billing") && stderr.contains("72h"),
        "{stderr}"
    );
    let unsettled = route(&file, "72h")
        .toml()
        .replace("on_unknown = \"hold\"\n", "");
    let (ok, _, stderr) = idemgate(&["check-config"], &unsettled);
    assert!(ok, "{stderr}");
    assert!(
        stderr.contains("neither `probe` nor `on_unknown`"),
        "{stderr}"
    );
    let missing = dir.join("nope").display().to_string();
    let (ok, _, stderr) = idemgate(&["check-config"], &route(&missing, "72h").toml());
    assert!(!ok);
    assert!(stderr.contains("routes[1].webhook.secret_file"), "{stderr}");
    std::fs::remove_dir_all(&dir).ok();
}
