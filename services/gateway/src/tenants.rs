//! Tenants as the gateway serves them (docs/tenants.md): each tenant's policy on each route,
//! its body limit, and its quotas — a token bucket (`rate`, `burst`) and a number of
//! requests in flight (`max_concurrent_requests`), per tenant and per replica. A request
//! over either is refused with 429 and `Retry-After` before anything is read or claimed,
//! so a tenant far over its quota costs the others one token check per request.
//!
//! A tenant with an entry of its own (`[tenants.<id>]`) has its own bucket and counter;
//! every other tenant gets one of its own too, made from `[tenants.default]` on its first
//! request and forgotten once it has been idle for a while ([`TenantTable::tidy`]).

use std::collections::HashMap;
use std::num::NonZeroU32;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use governor::clock::{Clock, DefaultClock};
use governor::middleware::NoOpMiddleware;
use governor::state::keyed::HashMapStateStore;
use governor::state::{InMemoryState, NotKeyed};
use governor::{Quota, RateLimiter};
use idem_config::{RouteTable, TenantConfig, Tenants};
use idem_core::policy::Policy;
use idem_telemetry::metrics::counter;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::problem::Problem;

type Direct = RateLimiter<NotKeyed, InMemoryState, DefaultClock, NoOpMiddleware>;
type Keyed = RateLimiter<String, HashMapStateStore<String>, DefaultClock, NoOpMiddleware>;

/// What the gateway knows of one tenant entry (a named one, or the default).
#[derive(Debug)]
pub struct TenantRules {
    /// The tenant's policy on each route, by endpoint (the route's own if the tenant
    /// sets nothing).
    policies: HashMap<String, Arc<Policy>>,
    pub max_body_bytes: usize,
    max_concurrent: Option<usize>,
    quota: Option<Quota>,
}

impl TenantRules {
    fn new(entry: &TenantConfig, routes: &RouteTable, server_max_body: usize) -> Self {
        let policies = routes
            .routes()
            .iter()
            .map(|route| (route.endpoint.clone(), Arc::new(entry.policy(route))))
            .collect();
        let quota = entry.rate.map(|rate| {
            let burst = entry.burst().unwrap_or(NonZeroU32::MIN);
            Quota::with_period(rate.interval())
                .expect("a rate is at most one request per nanosecond")
                .allow_burst(burst)
        });
        Self {
            policies,
            max_body_bytes: entry.max_body_bytes.unwrap_or(server_max_body),
            max_concurrent: entry.max_concurrent_requests,
            quota,
        }
    }

    /// The tenant's policy on the route of `endpoint`.
    pub fn policy(&self, endpoint: &str) -> Option<&Arc<Policy>> {
        self.policies.get(endpoint)
    }
}

/// A named tenant: its rules, bucket and counter.
#[derive(Debug)]
struct Named {
    rules: TenantRules,
    bucket: Option<Direct>,
    in_flight: Option<Arc<Semaphore>>,
}

/// Every tenant's rules and quotas.
#[derive(Debug)]
pub struct TenantTable {
    named: HashMap<String, Named>,
    default: TenantRules,
    /// One bucket per tenant without an entry.
    buckets: Option<Keyed>,
    /// One counter per tenant without an entry, while it has requests in flight or
    /// has had lately.
    in_flight: Mutex<HashMap<String, Arc<Semaphore>>>,
    clock: DefaultClock,
}

/// A tenant's place among its `max_concurrent_requests`, given back when dropped. It
/// travels with the request's work as the request's [`crate::limits::Slot`] does.
#[derive(Debug)]
pub struct TenantPermit(#[allow(dead_code)] OwnedSemaphorePermit);

impl TenantTable {
    pub fn new(tenants: &Tenants, routes: &RouteTable, server_max_body: usize) -> Self {
        let named = tenants
            .named()
            .map(|(id, entry)| {
                let rules = TenantRules::new(entry, routes, server_max_body);
                let named = Named {
                    bucket: rules.quota.map(RateLimiter::direct),
                    in_flight: rules.max_concurrent.map(|n| Arc::new(Semaphore::new(n))),
                    rules,
                };
                (id.to_owned(), named)
            })
            .collect();
        let default = TenantRules::new(tenants.default_entry(), routes, server_max_body);
        Self {
            named,
            buckets: default.quota.map(RateLimiter::hashmap),
            default,
            in_flight: Mutex::new(HashMap::new()),
            clock: DefaultClock::default(),
        }
    }

    /// `tenant`'s rules.
    pub fn rules(&self, tenant: &str) -> &TenantRules {
        self.named
            .get(tenant)
            .map_or(&self.default, |named| &named.rules)
    }

    /// Takes one request of `tenant`'s quotas, or refuses it (429) with how long to wait.
    pub fn admit(&self, tenant: &str) -> Result<Option<TenantPermit>, Problem> {
        let named = self.named.get(tenant);
        let over_rate = match named {
            Some(named) => named.bucket.as_ref().map(|b| b.check()),
            None => self
                .buckets
                .as_ref()
                .map(|b| b.check_key(&tenant.to_owned())),
        };
        if let Some(Err(not_until)) = over_rate {
            throttled(tenant, named.is_some(), "rate");
            let wait = not_until.wait_time_from(self.clock.now());
            return Err(Problem::TenantRateLimited { retry_after: wait });
        }
        let semaphore = match named {
            Some(named) => named.in_flight.clone(),
            None => self.default.max_concurrent.map(|n| {
                let mut counters = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
                counters
                    .entry(tenant.to_owned())
                    .or_insert_with(|| Arc::new(Semaphore::new(n)))
                    .clone()
            }),
        };
        let Some(semaphore) = semaphore else {
            return Ok(None);
        };
        match semaphore.try_acquire_owned() {
            Ok(permit) => Ok(Some(TenantPermit(permit))),
            Err(_) => {
                throttled(tenant, named.is_some(), "concurrency");
                Err(Problem::TenantConcurrencyLimited)
            }
        }
    }

    /// Forgets the buckets and counters of tenants without an entry that have nothing
    /// in flight and whose buckets are full again, so that many tenants passing through
    /// do not grow the gateway's memory.
    pub fn tidy(&self) {
        if let Some(buckets) = &self.buckets {
            buckets.retain_recent();
            buckets.shrink_to_fit();
        }
        if let Some(n) = self.default.max_concurrent {
            let mut counters = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            counters.retain(|_, s| s.available_permits() < n || Arc::strong_count(s) > 1);
            counters.shrink_to_fit();
        }
    }
}

/// How often [`TenantTable::tidy`] runs.
pub const TIDY_EVERY: Duration = Duration::from_secs(60);

/// Counts a refusal; tenants are named only if configured (docs/tenants.md).
fn throttled(tenant: &str, named: bool, quota: &'static str) {
    let tenant = if named {
        tenant.to_owned()
    } else {
        "other".to_owned()
    };
    counter!("idemgate_tenant_throttled_total", "tenant" => tenant, "quota" => quota).increment(1);
}
