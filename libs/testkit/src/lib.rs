//! `idem-testkit`: what the integration tests of every service share — a fresh Postgres
//! database per test, the real payments-demo, gateway and reconciler processes, Redis
//! servers of the tests' own, and a small HTTP client.
//!
//! Nothing here skips: a missing service or binary fails the test and says how to fix it.
//!
//! # Layout
//! - [`db`]: [`TestDb`], a database per test.
//! - [`processes`]: the built binaries ([`Demo`], upstream or embedded, [`GatewayProcess`],
//!   [`reconcile_once`]),
//!   signals, and [`TestUpstream`], an upstream of the test's own.
//! - [`redis`]: [`RedisServer`], a redis-server per test.
//! - [`config`]: the config files those processes read.
//! - [`client`]: [`Http`], tokens, answers and metrics.
//! - [`failpoints`]: [`Failpoints`], armed for a process the test starts.
//! - [`proxy`]: [`FaultProxy`], a TCP proxy that can cut or slow a connection.
//! - [`idp`]: [`Idp`], a real OpenID Connect provider (Node's `oidc-provider`).
//! - [`otlp`]: [`OtlpReceiver`], where processes export their traces.
//! - [`pgbouncer`]: [`PgBouncer`], Debian's connection pooler in front of Postgres.
//! - [`pgwire`]: [`PgCounter`], a proxy that counts a client's round trips and statements.

pub mod client;
pub mod config;
pub mod db;
pub mod failpoints;
pub mod idp;
pub mod otlp;
pub mod pgbouncer;
pub mod pgwire;
pub mod processes;
pub mod proxy;
pub mod redis;

pub use client::*;
pub use config::*;
pub use db::*;
pub use failpoints::*;
pub use idp::*;
pub use otlp::*;
pub use pgbouncer::*;
pub use pgwire::*;
pub use processes::*;
pub use proxy::*;
pub use redis::*;

pub const SECRET: &str = "integration-test-secret";
/// The base of idemgate's problem `type` URIs.
pub const PROBLEM_BASE: &str = "https://idemgate.dev/problems/";
