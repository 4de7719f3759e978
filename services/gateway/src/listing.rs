//! What the tenant's lookup and the operator's admin API share: paging through keys
//! (`limit`, an opaque `cursor`), their query parameters and the 400s for them, and the
//! problem document's schema in their OpenAPI description; and the share of the ledger
//! they may take ([`LookupLimits`]).

use std::collections::HashMap;
use std::sync::Mutex;

use serde::Serialize;
use tokio::sync::{Semaphore, SemaphorePermit};
use utoipa::ToSchema;

use crate::problem::Problem;

/// The most keys on a page, and how many when `limit` is not given.
pub(crate) const MAX_LIMIT: i64 = 100;
pub(crate) const DEFAULT_LIMIT: i64 = 50;

/// A problem document (RFC 9457), as every refusal of these APIs is written.
#[derive(Debug, Serialize, ToSchema)]
pub struct ProblemDoc {
    /// `https://idemgate.dev/problems/<slug>`.
    #[serde(rename = "type")]
    #[schema(format = "uri")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
}

/// The last key of a page, as the next page's opaque cursor.
pub(crate) fn encode_cursor(endpoint: &str, key: &str) -> String {
    hex::encode(format!("{endpoint}\n{key}"))
}

/// A cursor is a position in (endpoint, key) order: whatever hex it holds is one (so a
/// page after any position is well defined), and only what is not hex is refused.
fn decode_cursor(cursor: &str) -> Option<(String, String)> {
    let bytes = hex::decode(cursor).ok().filter(|b| !b.is_empty())?;
    // Postgres text holds no NUL: a position is cut at one (it sorts first anyway).
    let text = String::from_utf8_lossy(&bytes);
    let text = text.split('\0').next().unwrap_or_default();
    let (endpoint, key) = text.split_once('\n').unwrap_or((text, ""));
    Some((endpoint.to_owned(), key.to_owned()))
}

pub(crate) fn invalid(why: &str) -> Problem {
    Problem::RequestInvalid(why.to_owned())
}

/// Postgres text holds no NUL: a tenant, endpoint or cursor with one names nothing there.
pub(crate) fn no_nul(name: &str, value: &str) -> Result<(), Problem> {
    if value.contains('\0') {
        return Err(invalid(&format!("`{name}` holds a NUL character")));
    }
    Ok(())
}

/// The query parameters a lookup (or an admin listing) takes; any other, or one given
/// twice, is refused.
#[derive(Debug, Default)]
pub(crate) struct Params {
    pub(crate) endpoint: Option<String>,
    pub(crate) state: Option<String>,
    pub(crate) limit: Option<String>,
    pub(crate) cursor: Option<String>,
}

impl Params {
    /// `limit`, from 1 to [`MAX_LIMIT`].
    pub(crate) fn limit(&self) -> Result<i64, Problem> {
        match self.limit.as_deref() {
            None => Ok(DEFAULT_LIMIT),
            Some(n) => n
                .parse::<i64>()
                .ok()
                .filter(|n| (1..=MAX_LIMIT).contains(n))
                .ok_or_else(|| {
                    invalid(&format!("`limit` is a whole number from 1 to {MAX_LIMIT}"))
                }),
        }
    }

    /// Where the page starts: after the (endpoint, key) of `cursor`.
    pub(crate) fn after(&self) -> Result<(String, String), Problem> {
        match self.cursor.as_deref() {
            None => Ok((String::new(), String::new())),
            Some(cursor) => {
                decode_cursor(cursor).ok_or_else(|| invalid("`cursor` is not one this API gave"))
            }
        }
    }

    pub(crate) fn parse(query: Option<&str>, allowed: &[&str]) -> Result<Self, Problem> {
        let mut params = Self::default();
        for (name, value) in form_urlencoded::parse(query.unwrap_or("").as_bytes()) {
            let slot = match name.as_ref() {
                "endpoint" => &mut params.endpoint,
                "state" => &mut params.state,
                "limit" => &mut params.limit,
                "cursor" => &mut params.cursor,
                _ => return Err(invalid(&format!("unknown query parameter {name:?}"))),
            };
            if !allowed.contains(&name.as_ref()) {
                return Err(invalid(&format!("unknown query parameter {name:?}")));
            }
            no_nul(&name, &value)?;
            if slot.replace(value.into_owned()).is_some() {
                return Err(invalid(&format!("`{name}` is given twice")));
            }
        }
        Ok(params)
    }
}

/// Lookups and listings a tenant may have in flight at once.
pub(crate) const LOOKUPS_PER_TENANT: usize = 2;

/// The operator's admin listings and lookups in flight at once: a share of their own.
pub(crate) const OPERATOR_LOOKUPS: usize = 2;

/// The share of the ledger lookups and listings may take, so that a tenant polling its
/// keys (or a stolen token doing it for him) cannot take the pool from claims and
/// completions: a few statements in all (a quarter of the pool), two per tenant. Beyond
/// a tenant's share its lookup is 429 `tenant-concurrency-limited`, beyond the whole 503
/// `overloaded`, both with `Retry-After` and at once. The operator's admin calls have
/// [`OPERATOR_LOOKUPS`] places of their own besides: tenants flooding their lookups never
/// take the admin API from the operator, who needs it most exactly then.
#[derive(Debug)]
pub struct LookupLimits {
    all: Semaphore,
    operator: Semaphore,
    per_tenant: Mutex<HashMap<String, usize>>,
    /// Told whenever a tenant's place is given back, for [`LookupLimits::admit_within`].
    freed: tokio::sync::Notify,
}

/// A lookup's place, given back when dropped.
pub(crate) struct LookupPermit<'a> {
    limits: &'a LookupLimits,
    tenant: Option<String>,
    _all: SemaphorePermit<'a>,
}

impl LookupLimits {
    /// At most `all` lookups and listings at once.
    pub fn new(all: usize) -> Self {
        Self {
            all: Semaphore::new(all.max(1)),
            operator: Semaphore::new(OPERATOR_LOOKUPS),
            per_tenant: Mutex::default(),
            freed: tokio::sync::Notify::new(),
        }
    }

    /// A place for one lookup of `tenant`, waiting up to `within` for one to be given
    /// back: a key's result reads one row, and a burst of clients asking for one key's
    /// result (its waiters, arriving or woken together) queues for the tenant's places
    /// instead of being refused; past `within`, refused as [`LookupLimits::admit`] is.
    pub(crate) async fn admit_within(
        &self,
        tenant: &str,
        within: std::time::Duration,
    ) -> Result<LookupPermit<'_>, Problem> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            let freed = self.freed.notified();
            tokio::pin!(freed);
            freed.as_mut().enable();
            match self.admit(Some(tenant)) {
                Ok(permit) => return Ok(permit),
                Err(refused @ (Problem::TenantConcurrencyLimited | Problem::Overloaded)) => {
                    if tokio::time::timeout_at(deadline, freed).await.is_err() {
                        return Err(refused);
                    }
                }
                Err(other) => return Err(other),
            }
        }
    }

    /// A place for one lookup of `tenant` (`None`: an operator's, from the operator's
    /// own places).
    pub(crate) fn admit(&self, tenant: Option<&str>) -> Result<LookupPermit<'_>, Problem> {
        let Some(tenant) = tenant else {
            let place = self
                .operator
                .try_acquire()
                .map_err(|_| Problem::Overloaded)?;
            return Ok(LookupPermit {
                limits: self,
                tenant: None,
                _all: place,
            });
        };
        let tenant = Some(tenant);
        if let Some(tenant) = tenant {
            let mut busy = self.per_tenant.lock().expect("lookup limits");
            let mine = busy.entry(tenant.to_owned()).or_default();
            if *mine >= LOOKUPS_PER_TENANT {
                return Err(Problem::TenantConcurrencyLimited);
            }
            *mine += 1;
        }
        let permit = LookupPermit {
            limits: self,
            tenant: tenant.map(str::to_owned),
            _all: match self.all.try_acquire() {
                Ok(all) => all,
                Err(_) => {
                    if let Some(tenant) = tenant {
                        self.release(tenant);
                    }
                    return Err(Problem::Overloaded);
                }
            },
        };
        Ok(permit)
    }

    fn release(&self, tenant: &str) {
        let mut busy = self.per_tenant.lock().expect("lookup limits");
        if let Some(mine) = busy.get_mut(tenant) {
            *mine -= 1;
            if *mine == 0 {
                busy.remove(tenant);
            }
        }
    }
}

impl Drop for LookupPermit<'_> {
    fn drop(&mut self) {
        if let Some(tenant) = &self.tenant {
            self.limits.release(tenant);
        }
        self.limits.freed.notify_waiters();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Tenants that take every lookup place leave the operator's own. (On eee0432 the
    /// operator's listing drew on the same places: "the operator's listing: Some(Overloaded)".)
    #[test]
    fn tenants_flooding_lookups_never_take_the_operators_places() {
        let limits = LookupLimits::new(4);
        let tenants: Vec<_> = ["a", "b", "c", "d"]
            .iter()
            .map(|t| limits.admit(Some(t)).expect("a tenant's lookup"))
            .collect();
        assert!(matches!(limits.admit(Some("e")), Err(Problem::Overloaded)));
        let operator = limits.admit(None);
        assert!(
            operator.is_ok(),
            "the operator's listing: {:?}",
            operator.err()
        );
        let second = limits.admit(None);
        assert!(second.is_ok());
        assert!(
            matches!(limits.admit(None), Err(Problem::Overloaded)),
            "its own are bounded too"
        );
        drop(tenants);
    }

    /// A key's result queues for its tenant's places rather than being refused, until
    /// its wait is over. (loadtest/waiters on d2ff041: most of 1,000 waiters arriving
    /// together were 429.)
    #[tokio::test]
    async fn a_result_queues_for_its_tenants_place() {
        let limits = LookupLimits::new(4);
        let held = [
            limits.admit(Some("a")).unwrap(),
            limits.admit(Some("a")).unwrap(),
        ];
        let short = limits
            .admit_within("a", std::time::Duration::from_millis(50))
            .await;
        assert!(matches!(short, Err(Problem::TenantConcurrencyLimited)));
        let (queued, ()) = tokio::join!(
            limits.admit_within("a", std::time::Duration::from_secs(5)),
            async { drop(held) }
        );
        assert!(queued.is_ok(), "admitted once a place was given back");
    }

    #[test]
    fn cursors_round_trip_and_strangers_are_refused() {
        let cursor = encode_cursor("POST /orders/{id}/refunds", "k-1");
        assert_eq!(
            decode_cursor(&cursor),
            Some(("POST /orders/{id}/refunds".into(), "k-1".into()))
        );
        assert_eq!(decode_cursor("00"), Some((String::new(), String::new())));
        for bad in ["", "zz", "0"] {
            assert_eq!(decode_cursor(bad), None, "{bad:?}");
        }
        assert_eq!(
            decode_cursor(&hex::encode("POST /p")),
            Some(("POST /p".into(), String::new())),
            "a position before every key of that endpoint"
        );
    }

    #[test]
    fn query_parameters_are_decoded_and_checked() {
        let p = Params::parse(
            Some("endpoint=POST%20%2Fpayments&limit=5"),
            &["endpoint", "limit"],
        )
        .unwrap();
        assert_eq!(p.endpoint.as_deref(), Some("POST /payments"));
        assert_eq!(p.limit.as_deref(), Some("5"));
        for bad in ["endpoint=a&endpoint=b", "nope=1", "state=completed"] {
            assert!(Params::parse(Some(bad), &["endpoint"]).is_err(), "{bad}");
        }
    }

    #[test]
    fn lookups_take_a_bounded_share_per_tenant_and_in_all() {
        let limits = LookupLimits::new(3);
        let a1 = limits.admit(Some("a")).unwrap();
        let a2 = limits.admit(Some("a")).unwrap();
        assert!(matches!(
            limits.admit(Some("a")),
            Err(Problem::TenantConcurrencyLimited)
        ));
        let b1 = limits.admit(Some("b")).unwrap();
        assert!(matches!(limits.admit(Some("c")), Err(Problem::Overloaded)));
        drop(a1);
        let c1 = limits.admit(Some("c")).unwrap();
        assert!(matches!(limits.admit(Some("a")), Err(Problem::Overloaded)));
        drop((a2, b1, c1));
        let _again = [
            limits.admit(Some("a")).unwrap(),
            limits.admit(Some("a")).unwrap(),
        ];
        assert!(
            limits.per_tenant.lock().unwrap().get("b").is_none(),
            "forgotten when idle"
        );
    }
}
