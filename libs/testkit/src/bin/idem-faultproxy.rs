//! `idem-faultproxy`: [`idem_testkit::FaultProxy`] as a process, for `loadtest/chaos`.
//!
//!     idem-faultproxy LISTEN TARGET CONTROL
//!
//! proxies LISTEN to TARGET (both host:port) and takes one command per line on the
//! CONTROL port: `pass`, `blackhole`, `stall-open` or `latency MILLIS`; it answers
//! `ok` or an error line.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use idem_testkit::{Fault, FaultProxy};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

#[tokio::main(flavor = "current_thread")]
async fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [listen, target, control] = args.as_slice() else {
        eprintln!("usage: idem-faultproxy LISTEN TARGET CONTROL (each host:port)");
        std::process::exit(2);
    };
    let parse = |what: &str, text: &str| -> SocketAddr {
        text.parse().unwrap_or_else(|e| {
            eprintln!("idem-faultproxy: {what} {text:?}: {e}");
            std::process::exit(2)
        })
    };
    let proxy =
        Arc::new(FaultProxy::listen(parse("LISTEN", listen), parse("TARGET", target)).await);
    let control = TcpListener::bind(parse("CONTROL", control))
        .await
        .expect("bind the control port");
    println!(
        "idem-faultproxy {} -> {target}, control {}",
        proxy.addr,
        control.local_addr().unwrap()
    );
    while let Ok((conn, _)) = control.accept().await {
        let proxy = proxy.clone();
        tokio::spawn(async move {
            let (read, mut write) = conn.into_split();
            let mut lines = BufReader::new(read).lines();
            while let Ok(Some(line)) = lines.next_line().await {
                let fault = match line.split_whitespace().collect::<Vec<_>>().as_slice() {
                    ["pass"] => Ok(Fault::None),
                    ["blackhole"] => Ok(Fault::Blackhole),
                    ["stall-open"] => Ok(Fault::StallOpen {
                        opened_before: proxy.opened(),
                    }),
                    ["latency", ms] => ms
                        .parse()
                        .map(|ms| Fault::Latency(Duration::from_millis(ms)))
                        .map_err(|_| format!("not a number of milliseconds: {ms}")),
                    _ => Err(format!("unknown command: {line}")),
                };
                let reply = match fault {
                    Ok(fault) => {
                        proxy.set(fault);
                        "ok\n".to_owned()
                    }
                    Err(e) => format!("error: {e}\n"),
                };
                if write.write_all(reply.as_bytes()).await.is_err() {
                    return;
                }
            }
        });
    }
}
