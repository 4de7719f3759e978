//! Failpoints for the fault-injection suite (`loadtest/chaos`) and the tests that stall
//! a process, in debug builds only.
//!
//! A pause at a random moment almost never lands between the upstream's answer and
//! the completion write (`stop-before-complete`), or between the lease check and the
//! request leaving for the upstream (`stop-before-send`), so the fences there are never
//! put to the test from outside. With `IDEMGATE_FAILPOINTS=DIR` set, a file `DIR/NAME` arms
//! the failpoint `NAME` once: the next time the process passes it, it removes the file
//! and stops itself (`SIGSTOP`) until someone sends `SIGCONT`.

/// Stops the process here if the failpoint `name` is armed.
#[cfg(debug_assertions)]
pub fn stop_here(name: &str) {
    use std::path::PathBuf;
    use std::sync::OnceLock;

    static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();
    let Some(dir) = DIR.get_or_init(|| std::env::var_os("IDEMGATE_FAILPOINTS").map(PathBuf::from))
    else {
        return;
    };
    if std::fs::remove_file(dir.join(name)).is_ok() {
        tracing::warn!(
            failpoint = name,
            "failpoint: stopping this process until SIGCONT"
        );
        // `kill` returns once the signal is sent: every thread of ours stops before
        // this one goes on.
        let _ = std::process::Command::new("kill")
            .arg("-STOP")
            .arg(std::process::id().to_string())
            .status();
    }
}

#[cfg(not(debug_assertions))]
pub fn stop_here(_: &str) {}
