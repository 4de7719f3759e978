//! Where a route forwards (`routes[].upstream`): `http://host:port` with an optional
//! path prefix.

use http::Uri;
use serde::Deserialize;

/// Why a `routes[].upstream` is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UpstreamError {
    #[error("{url:?} is not a URL: {reason}")]
    NotUrl { url: String, reason: String },
    #[error(
        "only http:// upstreams are supported (found {0}://); terminate TLS in front of the upstream"
    )]
    Scheme(String),
    #[error("{0:?} needs a scheme, like http://127.0.0.1:9090")]
    NoScheme(String),
    #[error("{0:?} has no host")]
    NoHost(String),
    #[error("{0:?} must not have a query")]
    Query(String),
}

impl TryFrom<String> for Upstream {
    type Error = UpstreamError;
    fn try_from(url: String) -> Result<Self, Self::Error> {
        Self::parse(&url)
    }
}

/// Where a route forwards: `http://host:port` with an optional path prefix.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(try_from = "String")]
pub struct Upstream {
    authority: String,
    prefix: String,
}

impl Upstream {
    pub fn parse(url: &str) -> Result<Self, UpstreamError> {
        // `InvalidUri` says only what is wrong, and the field must be reported in full.
        let uri: Uri = url
            .parse()
            .map_err(|e: http::uri::InvalidUri| UpstreamError::NotUrl {
                url: url.to_owned(),
                reason: e.to_string(),
            })?;
        match uri.scheme_str() {
            Some("http") => {}
            Some(other) => return Err(UpstreamError::Scheme(other.to_owned())),
            None => return Err(UpstreamError::NoScheme(url.to_owned())),
        }
        let authority = uri
            .authority()
            .ok_or_else(|| UpstreamError::NoHost(url.to_owned()))?
            .to_string();
        if uri.query().is_some() {
            return Err(UpstreamError::Query(url.to_owned()));
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
