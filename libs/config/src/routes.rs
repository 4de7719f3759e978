//! The configured routes: path templates, upstreams, and matching a request to a route.

use std::time::Duration;

use http::{Method, Uri};
use idem_core::Policy;

use crate::config::{OnUnknown, Probe};

/// One configured route.
#[derive(Debug, Clone)]
pub struct Route {
    /// `"POST /orders/{id}/refunds"`: the method and template, the scope's endpoint.
    pub endpoint: String,
    pub method: Method,
    pub template: PathTemplate,
    pub upstream: Upstream,
    pub idempotent: bool,
    pub key_required: bool,
    pub timeout: Duration,
    /// Response bodies up to this size are stored; larger ones are recorded without it.
    pub max_response_bytes: usize,
    pub policy: Policy,
    pub probe: Option<Probe>,
    pub on_unknown: OnUnknown,
}

/// All routes, matched in configuration order.
#[derive(Debug, Clone, Default)]
pub struct RouteTable {
    routes: Vec<Route>,
}

impl RouteTable {
    pub fn new(routes: Vec<Route>) -> Self {
        Self { routes }
    }

    pub fn routes(&self) -> &[Route] {
        &self.routes
    }

    /// The route for a method and concrete path, if any.
    pub fn find(&self, method: &Method, path: &str) -> Option<&Route> {
        self.routes
            .iter()
            .find(|r| r.method == *method && r.template.matches(path))
    }

    /// The route whose endpoint is `endpoint` (as stored in the ledger).
    pub fn by_endpoint(&self, endpoint: &str) -> Option<&Route> {
        self.routes.iter().find(|r| r.endpoint == endpoint)
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Segment {
    Literal(String),
    Param,
}

/// A path template: `/payments`, `/orders/{id}/refunds`. A `{name}` matches exactly
/// one non-empty path segment.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PathTemplate {
    source: String,
    segments: Vec<Segment>,
}

impl PathTemplate {
    pub fn parse(template: &str) -> Result<Self, String> {
        let rest = template
            .strip_prefix('/')
            .ok_or_else(|| format!("must start with '/', found {template:?}"))?;
        let mut segments = Vec::new();
        if !rest.is_empty() {
            for segment in rest.split('/') {
                segments.push(parse_segment(segment).map_err(|e| format!("{e} in {template:?}"))?);
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

fn parse_segment(segment: &str) -> Result<Segment, String> {
    if segment.is_empty() {
        return Err("empty segment".into());
    }
    if let Some(name) = segment.strip_prefix('{').and_then(|s| s.strip_suffix('}')) {
        if !name.is_empty() && name.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
            return Ok(Segment::Param);
        }
        return Err(format!("bad parameter {segment:?}"));
    }
    if segment
        .bytes()
        .any(|b| matches!(b, b'{' | b'}' | b'?' | b'#') || !b.is_ascii_graphic())
    {
        return Err(format!("bad segment {segment:?}"));
    }
    Ok(Segment::Literal(segment.to_owned()))
}

/// Where a route forwards: `http://host:port` with an optional path prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Upstream {
    authority: String,
    prefix: String,
}

impl Upstream {
    pub fn parse(url: &str) -> Result<Self, String> {
        let uri: Uri = url
            .parse()
            .map_err(|e| format!("{url:?} is not a URL: {e}"))?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => {
                return Err(format!(
                    "only http:// upstreams are supported (found {other}://); terminate TLS in front of the upstream"
                ));
            }
            None => {
                return Err(format!(
                    "{url:?} needs a scheme, like http://127.0.0.1:9090"
                ));
            }
        }
        let authority = uri
            .authority()
            .ok_or_else(|| format!("{url:?} has no host"))?
            .to_string();
        if uri.query().is_some() {
            return Err(format!("{url:?} must not have a query"));
        }
        Ok(Self {
            authority,
            prefix: uri.path().trim_end_matches('/').to_owned(),
        })
    }

    /// The upstream URI for a request's path and query.
    pub fn uri_for(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme("http")
            .authority(self.authority.as_str())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(s: &str) -> PathTemplate {
        PathTemplate::parse(s).unwrap()
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

    #[test]
    fn upstreams_are_plain_http_with_an_optional_prefix() {
        let u = Upstream::parse("http://127.0.0.1:9090").unwrap();
        assert_eq!(
            u.uri_for("/payments?x=1").unwrap().to_string(),
            "http://127.0.0.1:9090/payments?x=1"
        );
        let u = Upstream::parse("http://api.internal/v2/").unwrap();
        assert_eq!(
            u.uri_for("/payments").unwrap().to_string(),
            "http://api.internal/v2/payments"
        );
        for bad in ["https://x", "127.0.0.1:9090", "http://x/?a=1", "not a url"] {
            assert!(Upstream::parse(bad).is_err(), "{bad}");
        }
    }
}
