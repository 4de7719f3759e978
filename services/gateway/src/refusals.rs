//! Refusals (401 `unauthorized` or `webhook-signature-invalid`, 429 over a tenant's quota,
//! 503 `overloaded`) in the log: at most one line per tenant and
//! reason per `server.refusal_log_interval`, with how many there were. A tenant far over
//! its rate, or a flood of unsigned requests, is a flood of counts, not of log lines — it
//! can fill neither a disk nor a log pipeline. Every refusal is still counted per request
//! in `idemgate_requests_total`; served requests keep their access-log line each.
//!
//! The first refusal of a tenant and reason is logged at once; those that follow within
//! the interval are counted, and written as one line once the interval since the last line
//! is over ([`Refusals::flush`], every second).

use std::collections::HashMap;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// The refusals seen since each tenant's and reason's last line.
#[derive(Debug)]
pub struct Refusals {
    interval: Duration,
    tallies: Mutex<HashMap<(String, &'static str), Tally>>,
}

#[derive(Debug)]
struct Tally {
    /// When this tenant's and reason's last line was written.
    logged_at: Instant,
    /// Refusals since then, not yet in a line.
    count: u64,
    status: u16,
}

/// The tenant of a refusal nobody could be named for (no valid token, an unverified
/// delivery).
pub const UNKNOWN: &str = "-";

impl Refusals {
    pub fn new(interval: Duration) -> Self {
        Self {
            interval,
            tallies: Mutex::default(),
        }
    }

    /// Whether a request that came to `outcome` was refused by idemgate itself (and is
    /// logged here rather than in an access-log line). An upstream's own 401 or 429,
    /// passed on or replayed, is an answer served like any other.
    pub fn is_refusal(outcome: &str) -> bool {
        matches!(
            outcome,
            "unauthorized"
                | "tenant-rate-limited"
                | "tenant-concurrency-limited"
                | "overloaded"
                | "webhook-signature-invalid"
        )
    }

    /// One refusal: written at once when it is its tenant's and reason's first since the
    /// interval, else counted for the next line.
    pub fn refused(&self, tenant: &str, reason: &'static str, status: u16) {
        let mut tallies = self.tallies.lock().expect("refusals");
        match tallies.get_mut(&(tenant.to_owned(), reason)) {
            Some(tally) => {
                tally.count += 1;
                tally.status = status;
            }
            None => {
                log(tenant, reason, status, 1, None);
                tallies.insert(
                    (tenant.to_owned(), reason),
                    Tally {
                        logged_at: Instant::now(),
                        count: 0,
                        status,
                    },
                );
            }
        }
    }

    /// Writes one line for each tenant and reason whose interval is over and that was
    /// refused again meanwhile; forgets those that were not.
    pub fn flush(&self) {
        let mut tallies = self.tallies.lock().expect("refusals");
        tallies.retain(|(tenant, reason), tally| {
            let since = tally.logged_at.elapsed();
            if since < self.interval {
                return true;
            }
            if tally.count == 0 {
                return false;
            }
            log(tenant, reason, tally.status, tally.count, Some(since));
            tally.count = 0;
            tally.logged_at = Instant::now();
            true
        });
    }
}

fn log(tenant: &str, reason: &str, status: u16, count: u64, over: Option<Duration>) {
    tracing::info!(
        tenant.id = tenant,
        reason,
        http.status = status,
        count,
        over_s = over.map(|d| d.as_secs_f64()),
        "refused"
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_flood_is_one_line_per_interval_with_its_count() {
        let refusals = Refusals::new(Duration::from_secs(10));
        for _ in 0..1000 {
            refusals.refused("acme", "tenant-rate-limited", 429);
        }
        refusals.refused("globex", "tenant-rate-limited", 429);
        let tally = |tenant: &str| {
            refusals.tallies.lock().unwrap()[&(tenant.to_owned(), "tenant-rate-limited")].count
        };
        assert_eq!(
            tally("acme"),
            999,
            "the first was written, the rest counted"
        );
        refusals.flush();
        assert_eq!(tally("acme"), 999, "not before the interval is over");
        tokio::time::advance(Duration::from_secs(10)).await;
        refusals.flush();
        assert_eq!(tally("acme"), 0, "written");
        tokio::time::advance(Duration::from_secs(10)).await;
        refusals.flush();
        assert!(
            refusals.tallies.lock().unwrap().is_empty(),
            "quiet ones forgotten"
        );
    }
}
