//! Redis servers of the tests' own.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use crate::*;

/// A redis-server process of this test's own, on its own port, killed when dropped.
pub struct RedisServer {
    pub port: u16,
    args: Vec<String>,
    child: Option<std::process::Child>,
    dir: Option<PathBuf>,
}

impl RedisServer {
    pub fn start(args: &[&str]) -> Self {
        let mut server = Self {
            port: free_port(args.contains(&"--cluster-enabled")),
            args: args.iter().map(|a| a.to_string()).collect(),
            child: None,
            dir: None,
        };
        server.spawn();
        server
    }

    fn spawn(&mut self) {
        let dir = std::env::temp_dir().join(format!(
            "idemgate-redis-{}-{}",
            self.port,
            uuid::Uuid::new_v4().simple()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        let child = std::process::Command::new("redis-server")
            .args([
                "--port",
                &self.port.to_string(),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
            ])
            .arg("--dir")
            .arg(&dir)
            .args(&self.args)
            .stdout(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| {
                panic!("redis-server could not start ({e}): install it with scripts/dev-services")
            });
        self.child = Some(child);
        self.dir = Some(dir);
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while self.cli(&["PING"]).trim() != "PONG" {
            assert!(
                std::time::Instant::now() < deadline,
                "redis-server on port {} did not answer",
                self.port
            );
            // Real time: polling a redis-server process that is starting.
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    /// Runs redis-cli against this server and returns its output.
    pub fn cli(&self, args: &[&str]) -> String {
        let out = std::process::Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("redis-cli runs");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// SIGKILL: the server vanishes with its data, as in a crash.
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        if let Some(dir) = self.dir.take() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }

    /// Starts it again on the same port, empty.
    pub fn restart(&mut self) {
        self.kill();
        self.spawn();
    }
}

impl Drop for RedisServer {
    fn drop(&mut self) {
        self.kill();
    }
}
