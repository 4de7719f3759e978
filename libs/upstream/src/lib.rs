//! `idem-upstream`: what the gateway and the reconciler share about upstreams.
//!
//! # Layout
//! - [`client`]: one pooled HTTP/1.1 client whose requests cannot leave after their
//!   deadline, and [`client::Forwarded`]: answered,
//!   provably not sent, or unknown.
//!
//! The header rules it applies are the HTTP contract's, in `idem_core::headers`.
#![forbid(unsafe_code)]

pub mod client;

pub use client::{
    ConnectError, Forwarded, HttpClient, Late, NotSent, ResponseBody, Unknown, UpstreamResponse,
    forward, pooled_client,
};

pub use idem_core::error_chain;
