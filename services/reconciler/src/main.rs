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
    init_logging();
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
    match runtime.block_on(run(cli)) {
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

fn init_logging() {
    use std::io::IsTerminal;
    use tracing_subscriber::EnvFilter;
    let filter = EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(std::io::stderr().is_terminal())
        .with_writer(std::io::stderr);
    if std::env::var("IDEMGATE_LOG_FORMAT").is_ok_and(|f| f == "json") {
        builder.json().init();
    } else {
        builder.init();
    }
}

async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
