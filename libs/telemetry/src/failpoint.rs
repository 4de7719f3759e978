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
        // A stop sent to a process reaches its threads in no set order: a thread that
        // only sent it could run on (and send its request) before the stop reaches it.
        // So a child sends it and stays until this process is continued, and this thread
        // waits for the child.
        let _ = std::process::Command::new("sh")
            .arg("-c")
            .arg(STOP_UNTIL_CONTINUED)
            .arg("failpoint")
            .arg(std::process::id().to_string())
            .status();
    }
}

/// `sh -c` script: stop process `$1`, wait (up to 5 s) until it has stopped (or is gone,
/// killed where it stopped), then until it is continued or gone.
#[cfg(debug_assertions)]
const STOP_UNTIL_CONTINUED: &str = r#"kill -STOP "$1" || exit 1
stopped() { grep -q '^State:[[:space:]]*T' "/proc/$1/status" 2>/dev/null; }
gone() { [ ! -e "/proc/$1" ]; }
i=0; until stopped "$1" || gone "$1" || [ "$i" -ge 250 ]; do i=$((i + 1)); sleep 0.02; done
while stopped "$1"; do sleep 0.05; done"#;

#[cfg(not(debug_assertions))]
pub fn stop_here(_: &str) {}
