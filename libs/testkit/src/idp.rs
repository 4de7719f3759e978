//! A real OpenID Connect provider for the tests: `oidc-provider` (npm) run by Node
//! from `libs/auth/tests/idp`, with tokens got over real client-credentials requests.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::workspace;

/// The resource (audience) the provider's access tokens are for.
pub const IDP_AUDIENCE: &str = "https://idemgate.test/payments";

/// An identity provider process, killed when dropped.
pub struct Idp {
    /// Its issuer, e.g. `http://127.0.0.1:41234`.
    pub url: String,
    pub port: u16,
    env: Vec<(String, String)>,
    /// The CA its certificate chains to, when it serves HTTPS.
    ca: Option<PathBuf>,
    child: Option<Child>,
}

fn dir() -> PathBuf {
    workspace().join("libs/auth/tests/idp")
}

impl Idp {
    /// Starts a provider on a port it picks, with these `IDP_*` variables.
    pub async fn start(env: &[(&str, &str)]) -> Self {
        Self::start_on(0, env).await
    }

    pub async fn start_on(port: u16, env: &[(&str, &str)]) -> Self {
        let mut idp = Self {
            url: String::new(),
            port,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            ca: None,
            child: None,
        };
        idp.spawn().await;
        idp
    }

    /// Serves HTTPS with a certificate for 127.0.0.1 from a CA of its own (see [`ca`]).
    pub async fn start_tls(ca: &TestCa) -> Self {
        let (cert, key) = (ca.cert.to_str().unwrap(), ca.key.to_str().unwrap());
        let mut idp = Self::start(&[("IDP_TLS_CERT", cert), ("IDP_TLS_KEY", key)]).await;
        idp.ca = Some(ca.root.clone());
        idp
    }

    async fn spawn(&mut self) {
        let dir = dir();
        assert!(
            dir.join("node_modules/oidc-provider").is_dir(),
            "the test identity provider is not installed: run `npm ci --prefix libs/auth/tests/idp` \
             (scripts/test does)"
        );
        // Its stderr goes to a file, named when it does not come up.
        let log = std::env::temp_dir().join(format!(
            "idemgate-idp-{}.log",
            uuid::Uuid::new_v4().simple()
        ));
        let stderr = std::fs::File::create(&log).expect("the provider's log file");
        let mut child = Command::new("node")
            .arg(dir.join("provider.mjs"))
            .env("IDP_PORT", self.port.to_string())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .stderr(stderr)
            .kill_on_drop(true)
            .spawn()
            .expect("run node (Node.js 20 or later must be installed)");
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        // Up to a minute: eight of these loading oidc-provider at once on two cores, beside
        // the other test binaries, once took over half a minute.
        let url = tokio::time::timeout(Duration::from_secs(60), async {
            while let Some(line) = lines.next_line().await.expect("read stdout") {
                if let Some(url) = line.strip_prefix("idp listening on ") {
                    return Some(url.to_owned());
                }
            }
            None
        })
        .await
        .ok()
        .flatten()
        .unwrap_or_else(|| {
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            panic!(
                "the identity provider did not listen (port {}, 0 = any): {said}",
                self.port
            )
        });
        let _ = std::fs::remove_file(&log); // it came up: nothing to read later
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        // Port 0 asked the provider to pick one; a restart keeps it.
        self.port = url
            .rsplit(':')
            .next()
            .and_then(|port| port.parse().ok())
            .unwrap_or_else(|| panic!("no port in the provider's URL {url}"));
        self.url = url;
        self.child = Some(child);
    }

    /// SIGKILL, and wait until it is gone.
    pub async fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.start_kill();
            let _ = child.wait().await;
        }
    }

    /// Restarts on the same port, with `env` changed (another `IDP_JWKS_FILE`, say).
    pub async fn restart(&mut self, env: &[(&str, &str)]) {
        self.kill().await;
        for (k, v) in env {
            self.env.retain(|(key, _)| key != k);
            self.env.push((k.to_string(), v.to_string()));
        }
        self.spawn().await;
    }

    /// An access token for client `acme` or `globex` (secret: the id + `-secret`),
    /// from a real client-credentials request.
    pub fn token(&self, client: &str) -> String {
        let answer = self.curl(&[
            "-u",
            &format!("{client}:{client}-secret"),
            "-d",
            "grant_type=client_credentials",
            "-d",
            "scope=payments",
            "--data-urlencode",
            &format!("resource={IDP_AUDIENCE}"),
            &format!("{}/token", self.url),
        ]);
        let json: serde_json::Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("token answer {answer:?}: {e}"));
        json["access_token"]
            .as_str()
            .unwrap_or_else(|| panic!("no access_token in {answer}"))
            .to_owned()
    }

    /// How many times its JWKS was fetched.
    pub fn jwks_fetches(&self) -> u64 {
        let answer = self.curl(&[&format!("{}/_stats", self.url)]);
        let json: serde_json::Value = serde_json::from_str(&answer).expect("stats JSON");
        json["jwks_fetches"].as_u64().expect("jwks_fetches")
    }

    fn curl(&self, args: &[&str]) -> String {
        let mut command = std::process::Command::new("curl");
        command.args(["-sS", "--fail-with-body", "--max-time", "10"]);
        if let Some(ca) = &self.ca {
            command.arg("--cacert").arg(ca);
        }
        let output = command.args(args).output().expect("run curl");
        let text = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "curl {args:?}: {text}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        text
    }
}

/// Writes a private JWKS (one RSA key per `rsa:`-less kid, EC P-256 for `ec:KID`) for
/// `IDP_JWKS_FILE`.
pub fn idp_keys(path: &Path, kids: &[&str]) {
    let status = std::process::Command::new("node")
        .arg(dir().join("genkeys.mjs"))
        .arg(path)
        .args(kids)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .expect("run node genkeys.mjs");
    assert!(status.success(), "genkeys.mjs {kids:?}");
}

/// A CA of the test's own and a server certificate for 127.0.0.1 it signed.
pub struct TestCa {
    pub root: PathBuf,
    pub cert: PathBuf,
    pub key: PathBuf,
}

/// Makes a [`TestCa`] with the `openssl` command in a fresh directory.
pub fn ca() -> TestCa {
    let dir = std::env::temp_dir().join(format!("idemgate-ca-{}", uuid::Uuid::new_v4().simple()));
    std::fs::create_dir_all(&dir).unwrap();
    let at = |name: &str| dir.join(name).to_str().unwrap().to_owned();
    let openssl = |args: &[&str]| {
        let output = std::process::Command::new("openssl")
            .args(args)
            .output()
            .expect("run openssl");
        assert!(
            output.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-days",
        "2",
        "-subj",
        "/CN=idemgate test CA",
        "-addext",
        "basicConstraints=critical,CA:TRUE",
        "-addext",
        "keyUsage=critical,keyCertSign,cRLSign",
        "-keyout",
        &at("ca.key"),
        "-out",
        &at("ca.pem"),
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-subj",
        "/CN=127.0.0.1",
        "-keyout",
        &at("server.key"),
        "-out",
        &at("server.csr"),
    ]);
    std::fs::write(
        at("ext.cnf"),
        "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        &at("server.csr"),
        "-CA",
        &at("ca.pem"),
        "-CAkey",
        &at("ca.key"),
        "-CAcreateserial",
        "-days",
        "2",
        "-extfile",
        &at("ext.cnf"),
        "-out",
        &at("server.pem"),
    ]);
    TestCa {
        root: dir.join("ca.pem"),
        cert: dir.join("server.pem"),
        key: dir.join("server.key"),
    }
}
