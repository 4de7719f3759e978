//! A PgBouncer of the test's own (Debian's `pgbouncer`) in front of the shared Postgres:
//! the connection pooler teams put between their services and Postgres.

use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where Debian installs it.
const BINARY: &str = "/usr/sbin/pgbouncer";

/// A running PgBouncer, stopped when dropped.
pub struct PgBouncer {
    pub port: u16,
    dir: PathBuf,
    child: Child,
}

impl PgBouncer {
    /// One in `pool_mode` (`session` or `transaction`) on a free port, to
    /// 127.0.0.1:5432 with trust auth. It ignores the startup parameter
    /// `extra_float_digits`, which every sqlx connection sends and PgBouncer refuses
    /// otherwise (docs/high-availability.md).
    pub fn start(pool_mode: &str) -> Self {
        assert!(
            std::path::Path::new(BINARY).exists(),
            "{BINARY} not found: apt-get install pgbouncer (scripts/test installs it)"
        );
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("idem-pgbouncer-{port}"));
        std::fs::create_dir_all(&dir).unwrap();
        let ini = dir.join("pgbouncer.ini");
        std::fs::write(dir.join("users.txt"), "\"postgres\" \"\"\n").unwrap();
        std::fs::write(
            &ini,
            format!(
                "[databases]\n* = host=127.0.0.1 port=5432\n[pgbouncer]\n\
                 listen_addr = 127.0.0.1\nlisten_port = {port}\nunix_socket_dir =\n\
                 auth_type = trust\nauth_file = {}\npool_mode = {pool_mode}\n\
                 ignore_startup_parameters = extra_float_digits\n\
                 max_client_conn = 200\ndefault_pool_size = 20\n",
                dir.join("users.txt").display()
            ),
        )
        .unwrap();
        let mut command = Command::new(BINARY);
        // PgBouncer refuses to run as root: as root, it is asked to become `postgres`.
        if is_root() {
            let chown = Command::new("chown")
                .args(["-R", "postgres"])
                .arg(&dir)
                .status()
                .expect("chown the PgBouncer directory");
            assert!(chown.success(), "chown -R postgres {}", dir.display());
            command.args(["-u", "postgres"]);
        }
        let child = command
            .arg(&ini)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start pgbouncer");
        let up = Instant::now() + Duration::from_secs(10);
        while std::net::TcpStream::connect(("127.0.0.1", port)).is_err() {
            assert!(
                Instant::now() < up,
                "pgbouncer did not listen on {port} within 10 s"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        Self { port, dir, child }
    }

    /// `url` (a database on 127.0.0.1:5432) through this PgBouncer.
    pub fn url_for(&self, url: &str) -> String {
        let through = url.replacen("127.0.0.1:5432", &format!("127.0.0.1:{}", self.port), 1);
        assert_ne!(through, url, "the database is on 127.0.0.1:5432");
        through + "?sslmode=disable"
    }
}

fn is_root() -> bool {
    Command::new("id")
        .arg("-u")
        .output()
        .is_ok_and(|out| String::from_utf8_lossy(&out.stdout).trim() == "0")
}

impl Drop for PgBouncer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
