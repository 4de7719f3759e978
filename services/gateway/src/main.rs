//! The `idemgate` binary: parse the command line, load the config, run.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use anyhow::Context;
use clap::{Parser, Subcommand};
use idemgate::{Application, BuildOptions, Config};
use secrecy::ExposeSecret;

/// mimalloc instead of glibc's malloc: the request path allocates and frees many small
/// buffers across threads, where glibc spent about a sixth of the gateway's CPU
/// (loadtest/bench, case c).
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
    /// The TOML config file (IDEMGATE_<SECTION>__<KEY> variables override it).
    #[arg(long, env = "IDEMGATE_CONFIG", default_value = "idemgate.toml")]
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
    /// Inspect or release one key (operators: a stuck key whose outcome you established).
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
    Show(KeyArgs),
    /// Release an in-progress key so the next request executes. Do this only once you
    /// know the upstream did not act (or you accept that it may act again).
    Release(KeyArgs),
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
        Command::Migrate { config } => {
            let pool = admin_pool(&load(&config.config)?).await?;
            idem_postgres::migrate(&pool)
                .await
                .context("applying migrations")?;
            println!("migrations applied");
            Ok(())
        }
        Command::Keys { config, action } => {
            let config = load(&config.config)?;
            let pool = admin_pool(&config).await?;
            match action {
                KeysAction::Show(args) => {
                    let scope = args.scope()?;
                    let info = idem_postgres::admin::show(&pool, &scope)
                        .await?
                        .with_context(|| format!("no record for {scope:?}"))?;
                    println!("{info:#?}");
                    Ok(())
                }
                KeysAction::Release(args) => {
                    let scope = args.scope()?;
                    if config.routes.by_endpoint(&scope.endpoint).is_none() {
                        tracing::warn!(endpoint = %scope.endpoint, "no configured route has this endpoint");
                    }
                    if idem_postgres::admin::release(&pool, &scope).await? {
                        tracing::warn!(?scope, "key released by an operator");
                        println!("released");
                        Ok(())
                    } else {
                        anyhow::bail!(
                            "no in-progress record for {scope:?} (completed keys are not released)"
                        )
                    }
                }
            }
        }
        Command::CheckConfig { config: path } => {
            let config = load(&path.config)?;
            idem_auth::Authenticator::from_config(&config.auth)?;
            println!(
                "{}: OK ({} route(s): {})",
                path.config.display(),
                config.routes.routes().len(),
                config
                    .routes
                    .routes()
                    .iter()
                    .map(|r| r.endpoint.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            Ok(())
        }
        Command::Token {
            config,
            tenant,
            ttl,
        } => {
            let config = load(&config.config)?;
            let secret = config.auth.hs256_secret.as_ref().context(
                "auth.hs256_secret: `idemgate token` mints HS256 dev tokens and needs it set",
            )?;
            let token = idem_auth::mint_hs256(
                secret,
                &config.auth.tenant_claim,
                &tenant,
                ttl.into(),
                config.auth.issuer.as_deref(),
                config.auth.audience.as_deref(),
            )?;
            println!("{token}");
            Ok(())
        }
    }
}

/// A one-connection pool for the administrative commands.
async fn admin_pool(config: &Config) -> anyhow::Result<sqlx::PgPool> {
    idem_postgres::connect(
        config.postgres.url.expose_secret(),
        &idem_postgres::PoolSettings {
            max_connections: 1,
            acquire_timeout: config.postgres.acquire_timeout,
            statement_timeout: std::time::Duration::from_secs(600),
            application_name: "idemgate-admin".into(),
        },
    )
    .await
    .context("connecting to postgres.url")
}

fn load(path: &Path) -> anyhow::Result<Config> {
    Ok(Config::load(path)?)
}
