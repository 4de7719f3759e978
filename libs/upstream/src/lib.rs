//! `idem-upstream`: what the gateway and the reconciler share about upstreams.
//!
//! # Layout
//! - [`client`]: one pooled HTTP/1.1 client, and [`client::Forwarded`]: answered,
//!   provably not sent, or unknown.
//! - [`headers`]: every header rule — names, hop-by-hop stripping both ways, what goes
//!   upstream, what is stored and replayed.
#![forbid(unsafe_code)]

pub mod client;
pub mod headers;

pub use client::{
    Forwarded, HttpClient, NotSent, ResponseBody, Unknown, UpstreamResponse, forward, pooled_client,
};
