//! `idem-http`: idemgate's HTTP face, shared by the gateway and by embedded mode
//! (`idem-embedded`), so both answer the same request the same way.
//!
//! # Layout
//! - [`problem`]: every error response, as `application/problem+json`.
//! - [`request`]: reading the bearer token, the key header and the body.
//! - [`early`]: `Connection: close` on answers given before the body was read.
//! - [`fingerprint`]: the request's fingerprint, large bodies off the async workers.
//! - [`answer`]: an engine outcome as the client's response; replays; expiry.
#![forbid(unsafe_code)]

pub mod answer;
pub mod early;
pub mod fingerprint;
pub mod problem;
pub mod request;

pub use answer::{IDEMPOTENCY_EXPIRES, answer, replay, set_expires};
pub use fingerprint::Fingerprinter;
pub use problem::Problem;

/// What a request came to: `executed`, `replayed`, … from the engine, `proxied` on a
/// plain route, `error`, or for a request turned away the problem's slug. A bounded set:
/// it is a metrics label. Whoever answers puts it in the response's extensions; a
/// [`Problem`] does so itself.
#[derive(Debug, Clone, Copy)]
pub struct OutcomeLabel(pub &'static str);
