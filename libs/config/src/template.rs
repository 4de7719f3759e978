//! Path templates (`routes[].path`): `/payments`, `/orders/{id}/refunds`, and which
//! concrete paths they match.

use serde::Deserialize;

/// Why a `routes[].path` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TemplateError {
    #[error("must start with '/', found {0:?}")]
    NotAbsolute(String),
    #[error("{bad} in {template:?}")]
    Segment { bad: BadSegment, template: String },
}

/// A segment of a template that is not a literal or a `{name}`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum BadSegment {
    #[error("empty segment")]
    Empty,
    #[error("bad parameter {0:?}")]
    Parameter(String),
    #[error("bad segment {0:?}")]
    Literal(String),
}

impl TryFrom<String> for PathTemplate {
    type Error = TemplateError;
    fn try_from(template: String) -> Result<Self, Self::Error> {
        Self::parse(&template)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
}

/// A path template: `/payments`, `/orders/{id}/refunds`. A `{name}` matches exactly
/// one non-empty path segment.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct PathTemplate {
    source: String,
    segments: Vec<Segment>,
}

/// The name of the `{name}` at each parameter segment, in order.
fn param_names(source: &str) -> impl Iterator<Item = (usize, &str)> {
    source
        .trim_start_matches('/')
        .split('/')
        .enumerate()
        .filter_map(|(i, s)| Some((i, s.strip_prefix('{')?.strip_suffix('}')?)))
}

impl PathTemplate {
    pub fn parse(template: &str) -> Result<Self, TemplateError> {
        let rest = template
            .strip_prefix('/')
            .ok_or_else(|| TemplateError::NotAbsolute(template.to_owned()))?;
        let mut segments = Vec::new();
        if !rest.is_empty() {
            for segment in rest.split('/') {
                segments.push(
                    parse_segment(segment).map_err(|bad| TemplateError::Segment {
                        bad,
                        template: template.to_owned(),
                    })?,
                );
            }
        }
        Ok(Self {
            source: template.to_owned(),
            segments,
        })
    }

    pub fn as_str(&self) -> &str {
        &self.source
    }

    pub fn matches(&self, path: &str) -> bool {
        let Some(rest) = path.strip_prefix('/') else {
            return false;
        };
        if rest.is_empty() {
            return self.segments.is_empty();
        }
        let mut parts = rest.split('/');
        for segment in &self.segments {
            match (segment, parts.next()) {
                (Segment::Literal(lit), Some(part)) if lit == part => {}
                (Segment::Param, Some(part)) if param_value(part) => {}
                _ => return false,
            }
        }
        parts.next().is_none()
    }

    /// Whether the template has a `{name}`.
    pub fn has_param(&self, name: &str) -> bool {
        param_names(&self.source).any(|(_, n)| n == name)
    }

    /// What a concrete `path` the template matches gives its `{name}`.
    pub fn param<'p>(&self, path: &'p str, name: &str) -> Option<&'p str> {
        if !self.matches(path) {
            return None;
        }
        let (at, _) = param_names(&self.source).find(|(_, n)| *n == name)?;
        path.strip_prefix('/')?.split('/').nth(at)
    }

    /// Whether two templates match exactly the same paths.
    pub fn same_shape(&self, other: &Self) -> bool {
        self.segments == other.segments
    }
}

/// Whether a concrete path segment may fill a `{param}`: not empty, not a dot segment
/// (`.`, `..`, also percent-encoded), and no encoded `/` or `\` (nor a raw `\`). An
/// upstream that decodes or normalises the path would otherwise see another path than
/// the one matched (`/orders/..%2Fadmin/refunds`).
fn param_value(part: &str) -> bool {
    let lower = part.to_ascii_lowercase();
    let dots = lower.replace("%2e", ".");
    !part.is_empty()
        && dots != "."
        && dots != ".."
        && !lower.contains("%2f")
        && !lower.contains("%5c")
        && !part.contains('\\')
}

fn parse_segment(segment: &str) -> Result<Segment, BadSegment> {
    if segment.is_empty() {
        return Err(BadSegment::Empty);
    }
    if let Some(name) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
        if !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Ok(Segment::Param);
        }
        return Err(BadSegment::Parameter(segment.to_owned()));
    }
    if segment
        .bytes()
        .any(|b| matches!(b, b'{' | b'}' | b'?' | b'#') || !b.is_ascii_graphic())
    {
        return Err(BadSegment::Literal(segment.to_owned()));
    }
    Ok(Segment::Literal(segment.to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> PathTemplate {
        PathTemplate::parse(s).unwrap()
    }

    #[test]
    fn a_parameters_value_is_read_from_a_matching_path() {
        let t = t("/webhooks/{tenant}/billing");
        assert!(t.has_param("tenant"));
        assert!(!t.has_param("id"));
        assert_eq!(t.param("/webhooks/acme/billing", "tenant"), Some("acme"));
        assert_eq!(t.param("/webhooks/acme/other", "tenant"), None);
        assert_eq!(t.param("/webhooks/acme/billing", "id"), None);
    }

    #[test]
    fn literal_templates_match_exactly() {
        assert!(t("/payments").matches("/payments"));
        assert!(!t("/payments").matches("/payments/"));
        assert!(!t("/payments").matches("/payments/x"));
        assert!(!t("/payments").matches("/Payments"));
        assert!(!t("/payments").matches("/"));
        assert!(t("/").matches("/"));
    }

    #[test]
    fn params_match_one_nonempty_segment() {
        let refunds = t("/orders/{id}/refunds");
        assert!(refunds.matches("/orders/42/refunds"));
        assert!(refunds.matches("/orders/a-b.c/refunds"));
        assert!(!refunds.matches("/orders//refunds"));
        assert!(!refunds.matches("/orders/1/2/refunds"));
        assert!(!refunds.matches("/orders/42/refunds/x"));
    }

    #[test]
    fn params_never_match_dot_segments_or_encoded_separators() {
        let refunds = t("/orders/{id}/refunds");
        for bad in [
            "/orders/./refunds",
            "/orders/../refunds",
            "/orders/%2e%2E/refunds",
            "/orders/%2E/refunds",
            "/orders/a%2Fb/refunds",
            "/orders/a%2fb/refunds",
            "/orders/a%5Cb/refunds",
            "/orders/a%5cb/refunds",
            "/orders/a\\b/refunds",
        ] {
            assert!(!refunds.matches(bad), "{bad}");
        }
        for good in [
            "/orders/.x/refunds",
            "/orders/a..b/refunds",
            "/orders/a%20b/refunds",
        ] {
            assert!(refunds.matches(good), "{good}");
        }
    }

    #[test]
    fn bad_templates_are_refused() {
        for bad in [
            "payments", "/a//b", "/{}", "/{a-b}", "/a{b}", "/a?b", "/a b",
        ] {
            assert!(PathTemplate::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn shapes_compare_params_by_position() {
        assert!(t("/orders/{id}").same_shape(&t("/orders/{order}")));
        assert!(!t("/orders/{id}").same_shape(&t("/orders/new")));
    }
}
