//! What a bad configuration is reported as: every problem names the key at fault, e.g.
//! `routes[0].timeout: must be shorter than the lease (30s)`.

/// A configuration problem, naming the key at fault.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{key}: {message}")]
pub struct ConfigError {
    pub key: String,
    pub message: String,
}

impl ConfigError {
    pub(crate) fn new(key: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            key: key.into(),
            message: message.into(),
        }
    }

    /// The first of `checks` that holds, as "`key`: must be greater than 0".
    pub(crate) fn first_zero<'a>(
        checks: impl IntoIterator<Item = (&'a str, bool)>,
    ) -> Result<(), Self> {
        match checks.into_iter().find(|&(_, zero)| zero) {
            Some((key, _)) => Err(Self::new(key, "must be greater than 0")),
            None => Ok(()),
        }
    }
}

/// A list of configuration problems (figment reports all it finds at once).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid configuration:\n  {}", .0.iter().map(ToString::to_string).collect::<Vec<_>>().join("\n  "))]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl From<ConfigError> for ConfigErrors {
    fn from(e: ConfigError) -> Self {
        Self(vec![e])
    }
}

/// `["routes", "0", "timeout"]` → `routes[0].timeout`, the form validation errors use.
pub(crate) fn key_path(segments: &[String]) -> String {
    let mut path = String::new();
    for segment in segments.iter().filter(|s| !s.is_empty()) {
        if segment.parse::<usize>().is_ok() {
            path.push_str(&format!("[{segment}]"));
        } else {
            if !path.is_empty() {
                path.push('.');
            }
            path.push_str(segment);
        }
    }
    path
}
