//! What `idemgate keys` prints: one key in words (or JSON for scripts), and the held
//! keys waiting on a person, one per line.

use chrono::{DateTime, Utc};
use idem_core::{AttemptId, LedgerError, Scope};
use idem_postgres::{KeyInfo, OperatorRelease, PgLedger};

/// Where a key stands: completed, in progress (its first attempt running), or held (in
/// progress with its lease over: the outcome is unknown until a probe, a policy or an
/// operator settles it). One state, two words for the last: the operator's `held`
/// (`idemgate keys`, the admin API) is the tenant's `unknown` (the lookup API of
/// docs/tenants.md, in the words of the `operation_state` of 409 problems).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KeyState {
    InProgress,
    Completed,
    Held,
}

impl KeyState {
    pub fn of(info: &KeyInfo) -> Self {
        match info.status.as_str() {
            "completed" => Self::Completed,
            _ if info.held => Self::Held,
            _ => Self::InProgress,
        }
    }

    /// In the operator's words: `in_progress`, `completed`, `held`.
    pub fn operator_word(self) -> &'static str {
        match self {
            Self::Held => "held",
            other => other.tenant_word(),
        }
    }

    /// In the tenant's words: `in_progress`, `completed`, `unknown`.
    pub fn tenant_word(self) -> &'static str {
        match self {
            Self::InProgress => "in_progress",
            Self::Completed => "completed",
            Self::Held => "unknown",
        }
    }

    /// A `state=` filter in the tenant's words (the lookup API's).
    pub fn parse_tenant_word(word: &str) -> Option<Self> {
        match word {
            "in_progress" => Some(Self::InProgress),
            "completed" => Some(Self::Completed),
            "unknown" => Some(Self::Held),
            _ => None,
        }
    }

    /// A `state=` filter in either's words (the admin API's).
    pub fn parse_either_word(word: &str) -> Option<Self> {
        match word {
            "held" => Some(Self::Held),
            other => Self::parse_tenant_word(other),
        }
    }
}

/// Where a key stands, in the operator's words.
pub fn state(info: &KeyInfo) -> &'static str {
    KeyState::of(info).operator_word()
}

/// A key in words, one fact per line.
pub fn describe(info: &KeyInfo) -> String {
    let at = |t: &DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
    let or_none = |t: &Option<DateTime<Utc>>| t.as_ref().map_or("-".to_owned(), at);
    let state = match state(info) {
        "held" => "held: in progress, lease over; the outcome is unknown until a probe, a policy or an operator settles it".to_owned(),
        "in_progress" => "in progress: its first attempt is running".to_owned(),
        other => other.to_owned(),
    };
    let response = match (info.response_status, info.response_bytes) {
        (Some(status), _) if info.response_omitted => {
            format!(
                "{status}, body not stored (over the route's max_response_bytes); retries get 410 (a webhook route's redeliveries: a 2xx with no body)"
            )
        }
        (Some(status), Some(bytes)) => format!("{status}, {bytes} bytes"),
        _ => "-".to_owned(),
    };
    let probes = match (&info.first_not_found_at, info.probe_attempts) {
        (Some(first), n) => format!("first 404 at {}; {n} inconclusive", at(first)),
        (None, 0) => "none".to_owned(),
        (None, n) => format!("{n} inconclusive"),
    };
    let lines = [
        (
            "key",
            format!("{} {:?} {}", info.tenant, info.endpoint, info.key),
        ),
        ("state", state),
        ("attempt", info.attempt.to_string()),
        ("created", at(&info.created_at)),
        ("completed", or_none(&info.completed_at)),
        ("expires", at(&info.expires_at)),
        ("lease until", or_none(&info.locked_until)),
        ("held since", or_none(&info.held_since)),
        ("probes", probes),
        ("response", response),
        ("trace id", trace_id(info).unwrap_or("-").to_owned()),
    ];
    lines
        .iter()
        .map(|(name, value)| format!("{name:<12} {value}\n"))
        .collect()
}

/// The key as an operator sees it, in `keys show --json` and the admin API: every fact
/// of the row but its stored body; times in RFC 3339.
#[derive(Debug, serde::Serialize, utoipa::ToSchema)]
pub struct OperatorKey {
    pub tenant: String,
    pub endpoint: String,
    pub key: String,
    /// `completed`, `in_progress` (its first attempt is running) or `held` (its lease is
    /// over: the outcome is unknown until a probe, a policy or an operator settles it).
    #[schema(pattern = "^(completed|in_progress|held)$")]
    pub state: &'static str,
    /// The row's own status: `in_progress` or `completed`.
    #[schema(pattern = "^(completed|in_progress)$")]
    pub status: String,
    /// The attempt that owns the key: what a release must name.
    #[schema(format = "uuid")]
    pub attempt: String,
    #[schema(format = DateTime)]
    pub created_at: String,
    #[schema(format = DateTime)]
    pub completed_at: Option<String>,
    #[schema(format = DateTime)]
    pub expires_at: String,
    #[schema(format = DateTime)]
    pub lease_until: Option<String>,
    #[schema(format = DateTime)]
    pub held_since: Option<String>,
    pub probe_attempts: i32,
    #[schema(format = DateTime)]
    pub first_not_found_at: Option<String>,
    pub response_status: Option<i32>,
    pub response_bytes: Option<i32>,
    pub response_omitted: bool,
    pub trace_id: Option<String>,
}

impl From<&KeyInfo> for OperatorKey {
    fn from(info: &KeyInfo) -> Self {
        let at = |t: &DateTime<Utc>| t.to_rfc3339_opts(chrono::SecondsFormat::Millis, true);
        let maybe = |t: &Option<DateTime<Utc>>| t.as_ref().map(at);
        Self {
            tenant: info.tenant.clone(),
            endpoint: info.endpoint.clone(),
            key: info.key.clone(),
            state: state(info),
            status: info.status.clone(),
            attempt: info.attempt.to_string(),
            created_at: at(&info.created_at),
            completed_at: maybe(&info.completed_at),
            expires_at: at(&info.expires_at),
            lease_until: maybe(&info.locked_until),
            held_since: maybe(&info.held_since),
            probe_attempts: info.probe_attempts,
            first_not_found_at: maybe(&info.first_not_found_at),
            response_status: info.response_status,
            response_bytes: info.response_bytes,
            response_omitted: info.response_omitted,
            trace_id: trace_id(info).map(str::to_owned),
        }
    }
}

/// The key as one JSON object (see [`OperatorKey`]).
pub fn to_json(info: &KeyInfo) -> serde_json::Value {
    serde_json::to_value(OperatorKey::from(info)).expect("a key serializes")
}

/// One held key per line: since when, which key, how far its probes got.
pub fn held_line(info: &KeyInfo) -> String {
    let since = info.held_since.unwrap_or(info.created_at);
    format!(
        "{}  {}  {:?}  {}  probes: {}{}",
        since.to_rfc3339_opts(chrono::SecondsFormat::Secs, true),
        info.tenant,
        info.endpoint,
        info.key,
        info.probe_attempts,
        if info.first_not_found_at.is_some() {
            ", one 404"
        } else {
            ""
        }
    )
}

/// The trace id of the first execution's stored W3C `traceparent` (`00-<trace id>-<span
/// id>-<flags>`): 32 hex digits, or none — what the CLI, the admin API and the tenant's
/// lookup all show.
pub fn trace_id(info: &KeyInfo) -> Option<&str> {
    idem_telemetry::propagation::trace_id_of(info.trace_context.as_deref()?)
}

/// An operator's release of `attempt`'s key, the one way both the CLI and the admin API
/// release (`by` says which, and who): only that attempt, only past its lease unless
/// `force`. A release is logged with its `reason`; a forced one also keeps it with its
/// mark, so the attempt's completion, if it comes, says whose release it was. `tell`:
/// the tenant has a settlement callback (it is told `not_executed`).
pub async fn release(
    ledger: &PgLedger,
    scope: &Scope,
    attempt: AttemptId,
    force: bool,
    by: &str,
    reason: &str,
    tell: bool,
) -> Result<OperatorRelease, LedgerError> {
    let done = ledger
        .release_by_operator(scope, attempt, force, &format!("{by}: {reason}"), tell)
        .await?;
    if let OperatorRelease::Released { forced } = done {
        log_release(scope, attempt, forced, by, reason);
    }
    Ok(done)
}

/// The line every release by an operator writes (docs/operations.md): which key, which attempt,
/// whether forced, by whom and why.
fn log_release(scope: &Scope, attempt: AttemptId, forced: bool, by: &str, reason: &str) {
    tracing::warn!(
        tenant.id = %scope.tenant,
        idempotency.endpoint = %scope.endpoint,
        idempotency.key = %scope.key,
        idempotency.attempt = %attempt,
        forced,
        operator = %by,
        %reason,
        "key released by an operator{}",
        if forced { " (forced, inside its lease)" } else { "" }
    );
}

/// Why an operator's release changed nothing, in the same words from the CLI and the admin
/// API (`None`: it released). `force` says how to ask for a forced release there, `look`
/// where to see the key again.
pub fn why_unchanged(
    done: &OperatorRelease,
    named: &str,
    attempt: AttemptId,
    force: &str,
    look: &str,
) -> Option<String> {
    Some(match done {
        OperatorRelease::Released { .. } => return None,
        OperatorRelease::Absent => format!("no record for {named}; nothing changed"),
        OperatorRelease::Completed => {
            format!("{named} is completed: completed keys are never released; nothing changed")
        }
        OperatorRelease::OtherAttempt { current } => format!(
            "attempt {attempt} no longer owns {named}: attempt {current} does now{look}; nothing changed"
        ),
        OperatorRelease::InsideLease { until } => format!(
            "attempt {attempt} may still be running: its lease lasts until {}; {force} to release it anyway (the upstream may still act, and a retry would act again); nothing changed",
            until.map_or("-".to_owned(), |t| t
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true))
        ),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn info() -> KeyInfo {
        let at = chrono::DateTime::UNIX_EPOCH;
        KeyInfo {
            tenant: "acme".into(),
            endpoint: "POST /payments".into(),
            key: "k".into(),
            status: "completed".into(),
            attempt: uuid::Uuid::nil(),
            created_at: at,
            completed_at: Some(at),
            locked_until: None,
            expires_at: at,
            held_since: None,
            response_status: Some(201),
            response_bytes: Some(2),
            response_omitted: false,
            probe_attempts: 0,
            first_not_found_at: None,
            trace_context: None,
            held: false,
        }
    }

    #[test]
    fn the_trace_id_is_the_traceparents_second_field_when_it_is_one() {
        let with = |trace_context: &str| KeyInfo {
            trace_context: Some(trace_context.to_owned()),
            ..info()
        };
        assert_eq!(
            trace_id(&with(
                "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
            )),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(trace_id(&with("garbage")), None);
        assert_eq!(trace_id(&with("00-not-hex-01")), None);
    }
}
