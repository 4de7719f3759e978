//! The life of a service process: a runtime, telemetry for as long as it runs, a flush
//! at the end, and the signals that ask it to stop.

use std::fmt::Display;
use std::future::Future;
use std::process::ExitCode;

/// Runs `main` on a multi-threaded runtime (`worker_threads` threads, or one per CPU)
/// with telemetry installed for `service`, flushes traces afterwards, and turns an error
/// into exit code 2 with the error on stderr.
pub fn run<E: Display>(
    service: &str,
    worker_threads: Option<usize>,
    main: impl Future<Output = Result<(), E>>,
) -> ExitCode {
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = worker_threads {
        builder.worker_threads(threads);
    }
    let runtime = match builder.enable_all().build() {
        Ok(runtime) => runtime,
        Err(e) => {
            eprintln!("error: cannot start the runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let result = runtime.block_on(async {
        let telemetry = crate::init(service);
        let result = main.await;
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

/// Resolves on SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .expect("installing the SIGTERM handler");
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}
