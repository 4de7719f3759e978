//! `idem-upstream`: what the gateway and the reconciler share about upstreams.
//!
//! # Layout
//! - [`client`]: one pooled HTTP/1.1 client, and [`client::Forwarded`]: answered,
//!   provably not sent, or unknown.
//! - [`headers`]: hop-by-hop stripping both ways, the headers set upstream, stored headers.
#![forbid(unsafe_code)]

pub mod client;
pub mod headers;

pub use client::{Forwarded, HttpClient, ResponseBody, UpstreamResponse, forward, pooled_client};
