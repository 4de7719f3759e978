//! Failpoints armed from a test, for the processes it starts.

use std::time::Duration;

/// A directory of failpoints for one process (see `idem_telemetry::failpoint`): pass
/// [`Failpoints::env`] to the process, [`Failpoints::arm`] one, and the process stops
/// itself (`SIGSTOP`) when it next passes it.
pub struct Failpoints(std::path::PathBuf);

impl Default for Failpoints {
    fn default() -> Self {
        Self::new()
    }
}

impl Failpoints {
    pub fn new() -> Self {
        let dir = std::env::temp_dir().join(format!(
            "idemgate-failpoints-{}",
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        Self(dir)
    }

    pub fn env(&self) -> [(&str, &str); 1] {
        [("IDEMGATE_FAILPOINTS", self.0.to_str().unwrap())]
    }

    pub fn arm(&self, name: &str) {
        std::fs::write(self.0.join(name), "").unwrap();
    }

    /// Waits (up to 5 s) until the process has passed the armed failpoint and stopped.
    pub async fn until_stopped(&self, name: &str) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(5);
        while self.0.join(name).exists() {
            assert!(
                tokio::time::Instant::now() < deadline,
                "the process never reached {name}"
            );
            // Real time: the process reaching its failpoint.
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Failpoints {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
