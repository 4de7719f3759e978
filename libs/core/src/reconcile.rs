//! What the reconciler does with a key whose outcome is unknown (docs/operations.md, "Unknown outcomes"), as one pure
//! function of the route's rules, what its status probe said, the row's history and the
//! time. The reconciler only does the I/O around [`decide`].
//!
//! | route | probe says | row's history | resolution |
//! | --- | --- | --- | --- |
//! | probe | 2xx | — | [`Resolution::Complete`] with the probe's answer |
//! | probe | 404 | no 404 yet | [`Resolution::ConfirmLater`]: ask again `release_confirm` from now |
//! | probe | 404 | first 404 less than `release_confirm` ago | [`Resolution::ConfirmLater`] at `release_confirm` after the first |
//! | probe | 404 | first 404 at least `release_confirm` ago | [`Resolution::Release`] (never ran, twice confirmed) |
//! | probe | anything else, or no answer | — | [`Resolution::Retry`] with exponential backoff |
//! | none | — | `on_unknown = "hold"` | [`Resolution::Hold`]: an operator decides |
//! | none | — | `release-after:D`, created at least D ago | [`Resolution::Release`] (by policy) |
//! | none | — | `release-after:D`, younger | [`Resolution::Wait`] until it is D old |
//!
//! A 404 is "not yet" until proven "never": the gateway's timeout ends only its side of
//! the call, and an upstream can commit long after it (a lock wait, a slow commit).

use std::time::{Duration, SystemTime};

use serde::Deserialize;

/// What the reconciler does with a stuck key of a route without a status probe:
/// written `"hold"` or `"release-after:DURATION"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(try_from = "String")]
pub enum OnUnknown {
    /// Keep answering 409 until an operator resolves it (`idemgate keys`).
    #[default]
    Hold,
    /// Release once the key is this old: the route's upstream is known to give up by then.
    ReleaseAfter(Duration),
}

/// An `on_unknown` that is neither `"hold"` nor `"release-after:DURATION"`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum OnUnknownError {
    #[error("expected \"hold\" or \"release-after:DURATION\", found {0:?}")]
    Word(String),
    #[error("bad duration {duration:?}: {source}")]
    Duration {
        duration: String,
        #[source]
        source: humantime::DurationError,
    },
}

impl TryFrom<String> for OnUnknown {
    type Error = OnUnknownError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        if s == "hold" {
            return Ok(Self::Hold);
        }
        let d = s
            .strip_prefix("release-after:")
            .ok_or(OnUnknownError::Word(s.clone()))?;
        humantime::parse_duration(d.trim())
            .map(Self::ReleaseAfter)
            .map_err(|source| OnUnknownError::Duration {
                duration: d.to_owned(),
                source,
            })
    }
}

/// The rules one route's stuck keys are resolved by.
#[derive(Debug, Clone, Copy)]
pub struct Rules {
    /// Whether the route has a status probe.
    pub probe: bool,
    pub on_unknown: OnUnknown,
    /// Two 404s at least this far apart release a key.
    pub release_confirm: Duration,
    /// The first backoff after an inconclusive probe; it doubles with every attempt.
    pub backoff: Duration,
    /// The longest backoff, and how often a held key is looked at again.
    pub max_backoff: Duration,
}

/// What a status probe answered.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeAnswer {
    /// 2xx: the operation happened; its answer is what retries replay.
    Found,
    /// 404: the upstream does not know the key (yet).
    NotFound,
    /// Anything else: another status, a timeout, a refused connection.
    Inconclusive,
}

/// What the ledger row remembers of the key.
#[derive(Debug, Clone, Copy)]
pub struct History {
    pub created_at: SystemTime,
    /// Inconclusive probes so far (for backoff).
    pub probe_attempts: u32,
    /// When a probe first answered 404, if one has.
    pub first_not_found: Option<SystemTime>,
}

/// Why a key is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Released {
    /// Two 404s at least `release_confirm` apart.
    NotFoundTwice,
    /// The route's `on_unknown = "release-after:…"`.
    Policy,
}

/// What to do with the key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Resolution {
    /// Complete the row with the probe's answer.
    Complete,
    /// Delete the row so a retry may execute.
    Release(Released),
    /// A 404 that is not yet confirmed: remember the first one (if this is it) and ask
    /// again `after` from now — when the confirmation is due, not after backoff.
    ConfirmLater { after: Duration },
    /// The probe told nothing: count the attempt and ask again `after` from now.
    Retry { after: Duration },
    /// No probe and the policy holds: leave it to an operator, look again `after`.
    Hold { after: Duration },
    /// No probe and the release time has not come: look again `after`.
    Wait { after: Duration },
}

/// Decides what happens to a stuck key. `answer` is `None` for a route without a probe.
pub fn decide(
    rules: &Rules,
    answer: Option<ProbeAnswer>,
    history: &History,
    now: SystemTime,
) -> Resolution {
    let since = |then: SystemTime| now.duration_since(then).unwrap_or_default();
    match answer {
        Some(ProbeAnswer::Found) => Resolution::Complete,
        Some(ProbeAnswer::NotFound) => match history.first_not_found {
            Some(first) if since(first) >= rules.release_confirm => {
                Resolution::Release(Released::NotFoundTwice)
            }
            Some(first) => Resolution::ConfirmLater {
                after: rules.release_confirm - since(first),
            },
            None => Resolution::ConfirmLater {
                after: rules.release_confirm,
            },
        },
        Some(ProbeAnswer::Inconclusive) => Resolution::Retry {
            after: backoff(rules, history.probe_attempts),
        },
        None => match rules.on_unknown {
            OnUnknown::Hold => Resolution::Hold {
                after: rules.max_backoff,
            },
            OnUnknown::ReleaseAfter(after) if since(history.created_at) >= after => {
                Resolution::Release(Released::Policy)
            }
            OnUnknown::ReleaseAfter(after) => Resolution::Wait {
                after: after - since(history.created_at),
            },
        },
    }
}

/// `backoff × 2^attempts`, at most `max_backoff`.
fn backoff(rules: &Rules, attempts: u32) -> Duration {
    retry_after(rules.backoff, rules.max_backoff, attempts)
}

/// `base × 2^attempts`, at most `max`: how long a key waits before it is looked at again
/// after `attempts` looks that told nothing.
pub fn retry_after(base: Duration, max: Duration, attempts: u32) -> Duration {
    base.saturating_mul(2u32.saturating_pow(attempts.min(16)))
        .min(max)
}
