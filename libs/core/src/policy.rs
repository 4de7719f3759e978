//! Per-route idempotency policy: how long keys live, what to do with a concurrent retry,
//! and which upstream answers are kept (replayed) or released (retry may execute).

use std::fmt;
use std::str::FromStr;
use std::time::Duration;

use serde::Deserialize;

/// A policy word that is not one of its kind's.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PolicyParseError {
    #[error("expected \"reject\" or \"wait\", found {0:?}")]
    OnInProgress(String),
    #[error("expected a status code (100-599) or a class like \"5xx\", found {0:?}")]
    Status(String),
}

/// What a retry gets while the first attempt is still running.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub enum OnInProgress {
    /// 409 with `Retry-After`.
    Reject,
    /// Wait (at most `wait_timeout`) for the first attempt's result and replay it.
    Wait,
}

impl FromStr for OnInProgress {
    type Err = PolicyParseError;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "reject" => Ok(Self::Reject),
            "wait" => Ok(Self::Wait),
            other => Err(PolicyParseError::OnInProgress(other.to_owned())),
        }
    }
}

impl TryFrom<String> for OnInProgress {
    type Error = PolicyParseError;
    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// A set of HTTP statuses, written as codes (`429`) and classes (`"5xx"`).
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "Vec<String>")]
pub struct StatusSet {
    classes: [bool; 6],
    codes: Vec<u16>,
}

impl StatusSet {
    pub fn contains(&self, status: u16) -> bool {
        let class = usize::from(status / 100);
        self.classes.get(class).copied().unwrap_or(false) || self.codes.contains(&status)
    }

    /// Parses one entry: a class like `5xx` or a code from 100 to 599.
    pub fn parse_entry(entry: &str) -> Result<StatusEntry, PolicyParseError> {
        let bad = || PolicyParseError::Status(entry.to_owned());
        match entry.as_bytes() {
            [d @ b'1'..=b'5', b'x' | b'X', b'x' | b'X'] => Ok(StatusEntry::Class(d - b'0')),
            _ => match entry.parse::<u16>() {
                Ok(code) if (100..=599).contains(&code) => Ok(StatusEntry::Code(code)),
                _ => Err(bad()),
            },
        }
    }

    pub fn from_entries(entries: impl IntoIterator<Item = StatusEntry>) -> Self {
        let mut set = Self {
            classes: [false; 6],
            codes: Vec::new(),
        };
        for entry in entries {
            set.insert(entry);
        }
        set
    }

    /// Adds one entry (a class must be 1 to 5, as [`StatusSet::parse_entry`] gives).
    pub fn insert(&mut self, entry: StatusEntry) {
        match entry {
            StatusEntry::Class(c) => self.classes[usize::from(c)] = true,
            StatusEntry::Code(code) => self.codes.push(code),
        }
    }
}

impl TryFrom<Vec<String>> for StatusSet {
    type Error = PolicyParseError;
    fn try_from(entries: Vec<String>) -> Result<Self, Self::Error> {
        let entries = entries.iter().map(|e| Self::parse_entry(e));
        Ok(Self::from_entries(entries.collect::<Result<Vec<_>, _>>()?))
    }
}

impl fmt::Debug for StatusSet {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let classes = (1..6)
            .filter(|&c| self.classes[c])
            .map(|c| format!("{c}xx"));
        let codes = self.codes.iter().map(u16::to_string);
        f.debug_list().entries(classes.chain(codes)).finish()
    }
}

/// One entry of a [`StatusSet`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StatusEntry {
    Class(u8),
    Code(u16),
}

/// The statuses released by default: by HTTP's own semantics the upstream did not
/// process the request, so a retry may execute: 408 Request Timeout, 425 Too Early and
/// 429 Too Many Requests. A 5xx is not among them: it proves nothing (a sidecar's 504
/// after the service committed, an application's 500 raised after its commit).
pub fn default_release_statuses() -> StatusSet {
    StatusSet::from_entries([
        StatusEntry::Code(408),
        StatusEntry::Code(425),
        StatusEntry::Code(429),
    ])
}

/// What an upstream answer means for its key (docs/architecture.md, request steps 7 and 8).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Disposition {
    /// Store it; every retry replays it.
    Keep,
    /// The upstream provably did nothing: free the key so a retry may execute.
    Release,
    /// The upstream may have acted (a 5xx on a route with a status probe): hold the key
    /// and have the reconciler ask the upstream at once.
    Uncertain,
}

/// The policy of one idempotent route, with `[idempotency]` defaults already applied.
#[derive(Debug, Clone)]
pub struct Policy {
    /// How long a completed key is replayed.
    pub ttl: Duration,
    /// How long an in-progress claim is protected before the reconciler may act.
    pub lease: Duration,
    pub on_in_progress: OnInProgress,
    /// The longest a retry waits for the first attempt, under the `wait` policy or a
    /// client's `Prefer: wait=N`.
    pub wait_timeout: Duration,
    /// Upstream statuses after which the key is released instead of kept.
    pub release_on: StatusSet,
    /// Whether the route has a status probe the reconciler can ask.
    pub probe: bool,
}

impl Policy {
    /// What an upstream answer with `status` means for its key: released if the route
    /// lists it in `release_on`; else a 5xx is uncertain where a probe can settle it and
    /// kept (stored and replayed, Stripe's rule) where none can; anything else is kept.
    pub fn disposition(&self, status: u16) -> Disposition {
        if self.release_on.contains(status) {
            Disposition::Release
        } else if (500..600).contains(&status) && self.probe {
            Disposition::Uncertain
        } else {
            Disposition::Keep
        }
    }

    /// How long a retry waits for the first attempt: the client's `Prefer: wait=N`
    /// if it sent one, else the route's policy; never more than `wait_timeout`.
    pub fn wait_for(&self, preferred: Option<Duration>) -> Option<Duration> {
        match (preferred, self.on_in_progress) {
            (Some(d), _) => Some(d.min(self.wait_timeout)),
            (None, OnInProgress::Wait) => Some(self.wait_timeout),
            (None, OnInProgress::Reject) => None,
        }
        .filter(|d| !d.is_zero())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn policy() -> Policy {
        Policy {
            ttl: Duration::from_secs(86_400),
            lease: Duration::from_secs(30),
            on_in_progress: OnInProgress::Reject,
            wait_timeout: Duration::from_secs(5),
            release_on: default_release_statuses(),
            probe: false,
        }
    }

    #[test]
    fn only_statuses_that_mean_not_processed_release_by_default() {
        let p = policy();
        for released in [408, 425, 429] {
            assert_eq!(p.disposition(released), Disposition::Release, "{released}");
        }
        for kept in [
            200, 201, 204, 302, 400, 404, 409, 422, 500, 502, 503, 504, 599,
        ] {
            assert_eq!(p.disposition(kept), Disposition::Keep, "{kept}");
        }
    }

    #[test]
    fn a_5xx_is_uncertain_where_a_probe_can_settle_it() {
        let p = Policy {
            probe: true,
            ..policy()
        };
        for uncertain in [500, 502, 503, 504, 599] {
            assert_eq!(
                p.disposition(uncertain),
                Disposition::Uncertain,
                "{uncertain}"
            );
        }
        for kept in [200, 201, 400, 404, 499] {
            assert_eq!(p.disposition(kept), Disposition::Keep, "{kept}");
        }
        assert_eq!(p.disposition(429), Disposition::Release);
    }

    #[test]
    fn release_on_5xx_is_an_opt_in_that_wins_over_the_probe() {
        for probe in [false, true] {
            let p = Policy {
                probe,
                release_on: StatusSet::from_entries([StatusEntry::Class(5)]),
                ..policy()
            };
            assert_eq!(p.disposition(503), Disposition::Release);
            assert_eq!(
                p.disposition(429),
                Disposition::Keep,
                "the list replaces the default"
            );
        }
    }

    #[test]
    fn status_entries_parse() {
        assert_eq!(StatusSet::parse_entry("5xx"), Ok(StatusEntry::Class(5)));
        assert_eq!(StatusSet::parse_entry("4XX"), Ok(StatusEntry::Class(4)));
        assert_eq!(StatusSet::parse_entry("409"), Ok(StatusEntry::Code(409)));
        for bad in ["6xx", "0xx", "600", "99", "x", "", "5x"] {
            assert!(StatusSet::parse_entry(bad).is_err(), "{bad}");
        }
        let set = StatusSet::from_entries([StatusEntry::Class(4), StatusEntry::Code(503)]);
        assert!(set.contains(404) && set.contains(503) && !set.contains(500));
    }

    #[test]
    fn wait_comes_from_the_client_or_the_route_and_is_capped() {
        let mut p = policy();
        assert_eq!(p.wait_for(None), None);
        assert_eq!(
            p.wait_for(Some(Duration::from_secs(2))),
            Some(Duration::from_secs(2))
        );
        assert_eq!(
            p.wait_for(Some(Duration::from_secs(60))),
            Some(Duration::from_secs(5))
        );
        assert_eq!(p.wait_for(Some(Duration::ZERO)), None);
        p.on_in_progress = OnInProgress::Wait;
        assert_eq!(p.wait_for(None), Some(Duration::from_secs(5)));
    }

    #[test]
    fn on_in_progress_parses() {
        assert_eq!("wait".parse(), Ok(OnInProgress::Wait));
        assert_eq!("reject".parse(), Ok(OnInProgress::Reject));
        assert!("later".parse::<OnInProgress>().is_err());
    }
}
