//! A proxy to Postgres that counts what its clients ask of the server, message by message
//! of the frontend protocol: how many round trips a request costs and which statements it
//! runs. A client waits for the server at each `Sync` of the extended protocol and at each
//! simple `Query`; those are the round trips. A statement runs at each `Execute`, and once
//! per statement of a simple query.
//!
//! The proxy refuses TLS (it answers `N` to an `SSLRequest`, as a server without TLS does),
//! so the bytes it reads are the protocol's own.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// What clients asked through a [`PgCounter`] so far.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Wire {
    /// Each `Sync` and each simple `Query`: the client waited for the server that often.
    pub round_trips: u64,
    /// The SQL of each statement run: an `Execute`'s prepared text (as its `Parse` named
    /// it), or a simple query's text.
    pub statements: Vec<String>,
    /// Every message's type, in order (`P`arse, `B`ind, `D`escribe, `E`xecute, `S`ync,
    /// `Q`uery, …): what a round trip carried.
    pub messages: String,
}

impl Wire {
    /// What was asked after `earlier` was read.
    pub fn since(&self, earlier: &Wire) -> Wire {
        Wire {
            round_trips: self.round_trips - earlier.round_trips,
            statements: self.statements[earlier.statements.len()..].to_vec(),
            messages: self.messages[earlier.messages.len()..].to_owned(),
        }
    }
}

/// A counting proxy from its own port on 127.0.0.1 to `target`, stopped when dropped.
pub struct PgCounter {
    pub addr: SocketAddr,
    wire: Arc<Mutex<Wire>>,
    task: tokio::task::JoinHandle<()>,
}

impl PgCounter {
    pub async fn start(target: SocketAddr) -> Self {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("bind the counting proxy");
        let addr = listener.local_addr().unwrap();
        let wire = Arc::new(Mutex::new(Wire::default()));
        let counting = wire.clone();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                tokio::spawn(carry(client, target, counting.clone()));
            }
        });
        Self { addr, wire, task }
    }

    /// `url` (a Postgres URL on 127.0.0.1:5432) through this proxy, without TLS.
    pub fn url(&self, url: &str) -> String {
        let via = url.replacen("127.0.0.1:5432", &self.addr.to_string(), 1);
        assert_ne!(via, url, "the database is not on 127.0.0.1:5432: {url}");
        let joint = if via.contains('?') { '&' } else { '?' };
        format!("{via}{joint}sslmode=disable")
    }

    /// What clients asked so far.
    pub fn wire(&self) -> Wire {
        self.wire.lock().unwrap().clone()
    }
}

impl Drop for PgCounter {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn carry(mut client: TcpStream, target: SocketAddr, wire: Arc<Mutex<Wire>>) {
    let Ok(mut server) = TcpStream::connect(target).await else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    // The untyped messages first: TLS or GSS encryption asked for (refused here), then
    // the startup message, forwarded.
    loop {
        let mut len = [0u8; 4];
        if client.read_exact(&mut len).await.is_err() {
            return;
        }
        let mut rest = vec![0u8; (u32::from_be_bytes(len) as usize).saturating_sub(4)];
        if client.read_exact(&mut rest).await.is_err() {
            return;
        }
        let code = rest
            .get(..4)
            .map(|c| u32::from_be_bytes(c.try_into().unwrap()));
        if matches!(code, Some(SSL_REQUEST | GSSENC_REQUEST)) {
            if client.write_all(b"N").await.is_err() {
                return;
            }
            continue;
        }
        if server.write_all(&len).await.is_err() || server.write_all(&rest).await.is_err() {
            return;
        }
        break;
    }
    let (mut from_client, mut to_client) = client.into_split();
    let (mut from_server, mut to_server) = server.into_split();
    let answers = tokio::spawn(async move {
        let _ = tokio::io::copy(&mut from_server, &mut to_client).await;
        let _ = to_client.shutdown().await;
    });
    let mut frontend = Frontend::default();
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match from_client.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        frontend.read(&chunk[..n], &wire);
        if to_server.write_all(&chunk[..n]).await.is_err() {
            break;
        }
    }
    let _ = to_server.shutdown().await;
    let _ = answers.await;
}

const SSL_REQUEST: u32 = 80_877_103;
const GSSENC_REQUEST: u32 = 80_877_104;

/// The typed messages a client sends after startup, read as they arrive in chunks.
#[derive(Default)]
struct Frontend {
    pending: Vec<u8>,
    /// Prepared statements' text by name, as their `Parse` gave it.
    prepared: std::collections::HashMap<String, String>,
    /// The statement the next `Execute` runs: the last `Bind`'s.
    bound: Option<String>,
}

impl Frontend {
    fn read(&mut self, chunk: &[u8], wire: &Mutex<Wire>) {
        self.pending.extend_from_slice(chunk);
        let mut at = 0;
        while self.pending.len() - at >= 5 {
            let kind = self.pending[at];
            let len = u32::from_be_bytes(self.pending[at + 1..at + 5].try_into().unwrap()) as usize;
            if self.pending.len() - at < 1 + len {
                break;
            }
            let body = self.pending[at + 5..at + 1 + len].to_vec();
            self.message(kind, &body, wire);
            at += 1 + len;
        }
        self.pending.drain(..at);
    }

    fn message(&mut self, kind: u8, body: &[u8], wire: &Mutex<Wire>) {
        wire.lock().unwrap().messages.push(char::from(kind));
        let mut strings = body
            .split(|b| *b == 0)
            .map(|s| String::from_utf8_lossy(s).into_owned());
        match kind {
            b'Q' => {
                let sql = strings.next().unwrap_or_default();
                let mut wire = wire.lock().unwrap();
                wire.round_trips += 1;
                wire.statements.extend(
                    sql.split(';')
                        .map(str::trim)
                        .filter(|s| !s.is_empty())
                        .map(str::to_owned),
                );
            }
            b'P' => {
                let name = strings.next().unwrap_or_default();
                let sql = strings.next().unwrap_or_default();
                self.prepared.insert(name, sql);
            }
            b'B' => {
                let _portal = strings.next();
                let name = strings.next().unwrap_or_default();
                self.bound = self.prepared.get(&name).cloned();
            }
            b'E' => {
                let sql = self.bound.clone().unwrap_or_else(|| "(unknown)".into());
                wire.lock().unwrap().statements.push(sql);
            }
            b'S' => wire.lock().unwrap().round_trips += 1,
            _ => {}
        }
    }
}
