//! A TCP proxy that puts the network's faults between a process and a server.
//!
//! A real partition rarely closes a connection: packets just stop arriving, and the
//! peer learns nothing until some timeout of its own fires. [`FaultProxy`] does the
//! same on loopback: in [`Fault::Blackhole`] it keeps every connection open and
//! forwards nothing (what was sent is held and delivered when the fault heals, as TCP
//! would retransmit it); [`Fault::StallOpen`] does that only to connections opened
//! before the fault (a NAT or firewall that forgot them, while new ones work); and
//! [`Fault::Latency`] delays every chunk in both directions; [`Fault::CutAt`] ends a
//! connection at a given request, delivered or not (a commit whose answer is lost).
//!
//! The tests use it in-process; `idem-faultproxy` wraps it in a small binary for
//! `loadtest/chaos`, steered over a control port.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;

/// What the proxy does to the bytes it carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Forward everything at once.
    None,
    /// Forward nothing, close nothing: every connection, old and new, goes silent.
    Blackhole,
    /// Connections opened before the fault go silent; new ones pass.
    StallOpen { opened_before: u64 },
    /// Hold every chunk this long before forwarding it.
    Latency(Duration),
    /// The first chunk a client sends that contains `pattern` (a `COMMIT`) ends its
    /// connection: forwarded first when `deliver` (the server acts on it, and its answer
    /// is lost), or not at all. Other chunks pass.
    CutAt {
        pattern: &'static [u8],
        deliver: bool,
    },
}

/// A proxy from its own port on 127.0.0.1 to `target`, stopped when dropped.
pub struct FaultProxy {
    pub addr: SocketAddr,
    fault: watch::Sender<Fault>,
    opened: Arc<AtomicU64>,
    /// Bytes forwarded from clients to the target.
    sent: Arc<AtomicU64>,
    task: tokio::task::JoinHandle<()>,
}

impl FaultProxy {
    pub async fn start(target: SocketAddr) -> Self {
        Self::listen("127.0.0.1:0".parse().unwrap(), target).await
    }

    pub async fn listen(listen: SocketAddr, target: SocketAddr) -> Self {
        let listener = TcpListener::bind(listen)
            .await
            .expect("bind the fault proxy");
        let addr = listener.local_addr().unwrap();
        let (fault, watching) = watch::channel(Fault::None);
        let opened = Arc::new(AtomicU64::new(0));
        let sent = Arc::new(AtomicU64::new(0));
        let (counter, sending) = (opened.clone(), sent.clone());
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let id = counter.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(carry(client, target, id, watching.clone(), sending.clone()));
            }
        });
        Self {
            addr,
            fault,
            opened,
            sent,
            task,
        }
    }

    /// Sets the fault from now on (for bytes not yet forwarded, too).
    pub fn set(&self, fault: Fault) {
        self.fault.send_replace(fault);
    }

    /// How many connections the proxy has accepted so far.
    pub fn opened(&self) -> u64 {
        self.opened.load(Ordering::SeqCst)
    }

    /// How many bytes clients have sent to the target through the proxy so far.
    pub fn sent(&self) -> u64 {
        self.sent.load(Ordering::SeqCst)
    }

    /// [`Fault::StallOpen`] for the connections open now.
    pub fn stall_open(&self) {
        self.set(Fault::StallOpen {
            opened_before: self.opened(),
        });
    }

    pub fn heal(&self) {
        self.set(Fault::None);
    }
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// One proxied connection: a pump each way, until either side closes.
async fn carry(
    client: TcpStream,
    target: SocketAddr,
    id: u64,
    fault: watch::Receiver<Fault>,
    sent: Arc<AtomicU64>,
) {
    // Connecting is held by a fault like any byte: a blackholed SYN never comes back.
    let Some(()) = pass(&mut fault.clone(), id).await else {
        return;
    };
    let Ok(server) = TcpStream::connect(target).await else {
        return; // the client sees its connection close, as with a refused one
    };
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (client_read, client_write) = client.into_split();
    let (server_read, server_write) = server.into_split();
    tokio::select! {
        () = pump(client_read, server_write, id, fault.clone(), Some(sent)) => {}
        () = pump(server_read, client_write, id, fault, None) => {}
    }
}

async fn pump(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    id: u64,
    mut fault: watch::Receiver<Fault>,
    counted: Option<Arc<AtomicU64>>,
) {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        if let Some(counted) = &counted {
            counted.fetch_add(n as u64, Ordering::SeqCst);
        }
        if pass(&mut fault, id).await.is_none() {
            return;
        }
        let now = *fault.borrow();
        if let (Some(_), Fault::CutAt { pattern, deliver }) = (&counted, now)
            && buf[..n].windows(pattern.len()).any(|w| w == pattern)
        {
            if deliver {
                let _ = to.write_all(&buf[..n]).await;
            }
            // Both directions close with this pump: the answer never reaches the client.
            return;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            return;
        }
    }
}

/// Waits until connection `id` may forward its next chunk; `None` once the proxy is gone.
async fn pass(fault: &mut watch::Receiver<Fault>, id: u64) -> Option<()> {
    loop {
        let now = *fault.borrow_and_update();
        match now {
            Fault::None | Fault::CutAt { .. } => return Some(()),
            Fault::StallOpen { opened_before } if id >= opened_before => return Some(()),
            Fault::Latency(delay) => {
                // The latency this proxy was asked to add.
                tokio::time::sleep(delay).await;
                return Some(());
            }
            Fault::Blackhole | Fault::StallOpen { .. } => fault.changed().await.ok()?,
        }
    }
}
