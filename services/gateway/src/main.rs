//! The `idemgate` binary: parse the command line, load the config, run.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use idemgate::{Application, BuildOptions, Config};
use secrecy::ExposeSecret;

/// mimalloc instead of glibc's malloc: the request path allocates and frees many small
/// buffers across threads, where glibc spent about a sixth of the gateway's CPU
/// (loadtest/bench, case c). `--cfg heap_profile` leaves it out, for a heap profiler
/// that hooks malloc (heaptrack).
#[cfg(not(heap_profile))]
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

#[derive(Debug, Parser)]
#[command(
    name = "idemgate",
    version,
    about = "A multi-tenant idempotency gateway"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, clap::Args)]
struct ConfigArg {
    /// The TOML config file (IDEMGATE_<SECTION>__<KEY> variables override it). Given
    /// before or after a subcommand: `keys --config F show …` = `keys show --config F …`.
    #[arg(
        long,
        env = "IDEMGATE_CONFIG",
        default_value = "idemgate.toml",
        global = true
    )]
    config: PathBuf,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Serve requests (applies pending migrations first unless --no-migrate).
    Serve {
        #[command(flatten)]
        config: ConfigArg,
        /// Do not apply migrations at start-up.
        #[arg(long)]
        no_migrate: bool,
    },
    /// Apply pending database migrations and exit.
    Migrate {
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Validate a config file (and the auth keys it names); exit non-zero naming the problem.
    CheckConfig {
        #[command(flatten)]
        config: ConfigArg,
    },
    /// Inspect keys, list the held ones, or release one (operators: a held key whose
    /// outcome you established).
    Keys {
        #[command(flatten)]
        config: ConfigArg,
        #[command(subcommand)]
        action: KeysAction,
    },
    /// Mint a development token with the config's hs256_secret.
    Token {
        #[command(flatten)]
        config: ConfigArg,
        /// The tenant to put in the token.
        #[arg(long)]
        tenant: String,
        /// How long the token is valid.
        #[arg(long, default_value = "1h")]
        ttl: humantime::Duration,
    },
}

#[derive(Debug, Subcommand)]
enum KeysAction {
    /// Print a key's record (never its stored body).
    Show {
        #[command(flatten)]
        key: KeyArgs,
        /// One JSON object instead of text.
        #[arg(long)]
        json: bool,
    },
    /// List keys that wait on a probe, a policy or a person, oldest first.
    List {
        /// Only held keys (in progress, lease over): the only listing there is, for now.
        #[arg(long, required = true)]
        held: bool,
        /// At most this many.
        #[arg(long, default_value_t = 100)]
        limit: i64,
        /// One JSON object per line instead of text.
        #[arg(long)]
        json: bool,
    },
    /// Release an in-progress key so the next request executes. Do this only once you
    /// know the upstream did not act (or you accept that it may act again). Only the
    /// attempt `keys show` printed is released, and only once its lease is over.
    Release {
        #[command(flatten)]
        key: KeyArgs,
        /// The attempt to release, as `keys show` printed it: if another attempt owns the
        /// key by now, nothing changes.
        #[arg(long)]
        attempt: uuid::Uuid,
        /// Release even inside the attempt's lease (it may still be running: its upstream
        /// call can still act, and a retry would act again).
        #[arg(long)]
        force: bool,
        /// Why, for the log line every release writes (with who ran it).
        #[arg(long)]
        reason: String,
    },
}

#[derive(Debug, clap::Args)]
struct KeyArgs {
    /// The tenant id.
    tenant: String,
    /// The endpoint as configured, e.g. "POST /payments".
    endpoint: String,
    /// The Idempotency-Key (unquoted).
    key: String,
}

impl KeyArgs {
    fn scope(&self) -> anyhow::Result<idem_core::Scope> {
        let key = idem_core::IdempotencyKey::parse(self.key.as_bytes())
            .map_err(|e| anyhow::anyhow!("KEY: {e}"))?;
        Ok(idem_core::Scope::new(&self.tenant, &self.endpoint, key))
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        // The config is read before the runtime starts: it says how many threads to run.
        Command::Serve { config, no_migrate } => match load(&config.config) {
            Ok(config) => idem_telemetry::process::run(
                "idemgate",
                config.server.worker_threads,
                serve(config, !no_migrate),
            ),
            Err(e) => {
                eprintln!("error: {e:#}");
                ExitCode::from(2)
            }
        },
        command => idem_telemetry::process::run("idemgate", None, run(command)),
    }
}

async fn serve(config: Config, migrate: bool) -> anyhow::Result<()> {
    let app = Application::build(config, BuildOptions { migrate }).await?;
    // On stdout, so a supervisor or test that bound port 0 can read the port.
    println!("idemgate listening on {}", app.local_addr());
    app.run_until_stopped(idem_telemetry::process::shutdown_signal())
        .await
}

/// The administrative commands: everything but `serve`, which `main` runs itself.
async fn run(command: Command) -> anyhow::Result<()> {
    match command {
        Command::Serve { .. } => unreachable!("main() reads the config and serves"),
        Command::Migrate { config } => migrate(&load(&config.config)?).await,
        Command::Keys { config, action } => keys(&load(&config.config)?, action).await,
        Command::CheckConfig { config } => check_config(&config.config).await,
        Command::Token {
            config,
            tenant,
            ttl,
        } => token(&load(&config.config)?, &tenant, ttl.into()),
    }
}

async fn migrate(config: &Config) -> anyhow::Result<()> {
    let pool = admin_pool(config).await?;
    idem_postgres::migrate(&pool)
        .await
        .context("applying migrations")?;
    println!("migrations applied");
    Ok(())
}

/// `keys show | list --held | release`.
async fn keys(config: &Config, action: KeysAction) -> anyhow::Result<()> {
    let ledger = idem_postgres::PgLedger::new(admin_pool(config).await?, ADMIN_TIMEOUT);
    match action {
        KeysAction::Show { key, json } => {
            let scope = key.scope()?;
            let info = ledger.show(&scope).await?.with_context(|| {
                format!(
                    "no record for {} {:?} {}",
                    scope.tenant, scope.endpoint, scope.key
                )
            })?;
            if json {
                println!("{}", idemgate::operator::to_json(&info));
            } else {
                print!("{}", idemgate::operator::describe(&info));
            }
        }
        KeysAction::List {
            held: _,
            limit,
            json,
        } => {
            for info in ledger.list_held(limit).await? {
                if json {
                    println!("{}", idemgate::operator::to_json(&info));
                } else {
                    println!("{}", idemgate::operator::held_line(&info));
                }
            }
        }
        KeysAction::Release {
            key,
            attempt,
            force,
            reason,
        } => {
            let scope = key.scope()?;
            if config.routes.by_endpoint(&scope.endpoint).is_none() {
                tracing::warn!(endpoint = %scope.endpoint, "no configured route has this endpoint");
            }
            let attempt = idem_core::AttemptId(attempt);
            let named = format!("{} {:?} {}", scope.tenant, scope.endpoint, scope.key);
            let by = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
            let tell = config.tenants.get(&scope.tenant).tells_settlements();
            let done =
                idemgate::operator::release(&ledger, &scope, attempt, force, &by, &reason, tell)
                    .await?;
            let idem_postgres::OperatorRelease::Released { forced } = done else {
                anyhow::bail!(
                    "{}",
                    idemgate::operator::why_unchanged(
                        &done,
                        &named,
                        attempt,
                        "pass --force",
                        " (see `keys show`)",
                    )
                    .unwrap_or_default()
                );
            };
            println!(
                "released {named}, attempt {attempt}{}",
                if forced {
                    ", inside its lease (forced: that attempt may still act)"
                } else {
                    ""
                }
            );
        }
    }
    Ok(())
}

/// What `serve` would refuse, refused the same way ([`idemgate::app::Preflight`]), and
/// the endpoints stored in the ledger when it can be reached.
async fn check_config(path: &Path) -> anyhow::Result<()> {
    let config = load(path)?;
    let preflight = idemgate::app::Preflight::check(&config)?;
    for warning in &preflight.warnings {
        eprintln!("warning: {warning}");
    }
    let stored = match admin_pool(&config).await {
        Ok(pool) => idem_postgres::PgLedger::new(pool, ADMIN_TIMEOUT)
            .stored_endpoints()
            .await
            .map_err(anyhow::Error::new),
        Err(e) => Err(e),
    };
    match stored {
        Ok(stored) => idemgate::app::check_stored_endpoints(&config, &stored)?,
        Err(e) => {
            eprintln!("note: endpoints stored in the ledger not checked against the routes: {e:#}")
        }
    }
    let routes = config.routes.routes();
    let endpoints: Vec<&str> = routes.iter().map(|r| r.endpoint.as_str()).collect();
    println!(
        "{}: OK ({} route(s): {})",
        path.display(),
        routes.len(),
        endpoints.join(", ")
    );
    Ok(())
}

/// A development token for `tenant`, signed with `auth.hs256_secret`.
fn token(config: &Config, tenant: &str, ttl: std::time::Duration) -> anyhow::Result<()> {
    let secret =
        config.auth.hs256_secret.as_ref().context(
            "auth.hs256_secret: `idemgate token` mints HS256 dev tokens and needs it set",
        )?;
    let token = idem_auth::mint_hs256(
        secret,
        &config.auth.tenant_claim,
        tenant,
        ttl,
        config.auth.issuer.as_deref(),
        config.auth.audience.as_deref(),
    )?;
    println!("{token}");
    Ok(())
}

/// The longest one administrative statement may take.
const ADMIN_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(600);

/// A one-connection pool for the administrative commands.
async fn admin_pool(config: &Config) -> anyhow::Result<sqlx::PgPool> {
    idem_postgres::connect(
        config.postgres.url.expose_secret(),
        &idem_postgres::PoolSettings {
            max_connections: 1,
            statement_timeout: ADMIN_TIMEOUT,
            lock_timeout: ADMIN_TIMEOUT,
            application_name: "idemgate-admin".into(),
            ..(&config.postgres).into()
        },
    )
    .await
    .context("connecting to postgres.url")
}

fn load(path: &Path) -> anyhow::Result<Config> {
    Ok(Config::load(path)?)
}
