//! The `idemgate-reconciler` binary.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::Parser;
use idem_config::Config;
use idemgate_reconciler::Reconciler;

#[derive(Debug, Parser)]
#[command(
    name = "idemgate-reconciler",
    version,
    about = "Resolves stuck idempotency claims and purges expired keys"
)]
struct Cli {
    /// The gateway's TOML config file (IDEMGATE_<SECTION>__<KEY> variables override it).
    #[arg(long, env = "IDEMGATE_CONFIG", default_value = "idemgate.toml")]
    config: PathBuf,
    /// Run one pass and exit (for tests and cron-style deployments).
    #[arg(long)]
    once: bool,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    idem_telemetry::process::run("idemgate-reconciler", None, run(cli))
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = Config::load(&cli.config)?;
    let reconciler = Reconciler::connect(config).await?;
    if cli.once {
        reconciler.pass().await?;
        println!("{}", reconciler.stats.summary());
        return Ok(());
    }
    reconciler
        .run(idem_telemetry::process::shutdown_signal())
        .await
}
