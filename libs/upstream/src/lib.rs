//! `idem-upstream`: what the gateway and the reconciler share about upstreams.
//!
//! # Layout
//! - [`client`]: one pooled HTTP/1.1 client whose requests cannot leave after their
//!   deadline, and [`client::Forwarded`]: answered,
//!   provably not sent, or unknown.
//! - [`headers`]: every header rule — names, hop-by-hop stripping both ways, what goes
//!   upstream, what is stored and replayed.
#![forbid(unsafe_code)]

pub mod client;
pub mod headers;

pub use client::{
    ConnectError, Forwarded, HttpClient, Late, NotSent, ResponseBody, Unknown, UpstreamResponse,
    forward, pooled_client,
};

/// An error and its sources, `: `-separated, for a log line or a message. hyper's
/// errors need it: hyper-util's own message is only "client error (Connect)", and the
/// refused connection or the bad certificate is in its sources.
pub fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        message.push_str(": ");
        message.push_str(&cause.to_string());
        source = cause.source();
    }
    message
}
