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
    let runtime = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let telemetry = idem_telemetry::init("idemgate-reconciler");
        let result = run(cli).await;
        // Flush batched spans before the process exits.
        let _ = tokio::task::spawn_blocking(move || telemetry.shutdown()).await;
        result
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

async fn run(cli: Cli) -> anyhow::Result<()> {
    let config = Config::load(&cli.config)?;
    let reconciler = Reconciler::connect(config).await?;
    if cli.once {
        reconciler.pass().await?;
        println!("{}", reconciler.stats.summary());
        return Ok(());
    }
    reconciler.run(shutdown_signal()).await
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
