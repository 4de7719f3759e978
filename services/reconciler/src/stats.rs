//! What the reconciler did, as counters for `/metrics` and the pass report.

use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};

/// One counter per action.
#[derive(Debug, Default)]
pub struct ActionCounts {
    /// Rows completed with the upstream's real answer (probe 2xx).
    pub completed: AtomicU64,
    /// Rows released because the upstream never ran them (two probe 404s at least
    /// `reconciler.release_confirm` apart).
    pub released: AtomicU64,
    /// Probe 404s not yet confirmed: asked again at `release_confirm`.
    pub not_found: AtomicU64,
    /// Rows released by a route's `on_unknown = "release-after:…"` policy.
    pub released_after: AtomicU64,
    /// Rows held for an operator (`on_unknown = "hold"`, or no such route any more).
    pub held: AtomicU64,
    /// Probes that failed or answered neither 2xx nor 404; retried with backoff.
    pub probe_failed: AtomicU64,
    /// Resolutions that lost the fence (the gateway finished first): nothing changed.
    pub fenced: AtomicU64,
    /// Expired rows deleted.
    pub purged: AtomicU64,
    pub passes: AtomicU64,
    /// Keys held right now (in progress, lease over), as of the last pass: a gauge.
    pub held_keys: AtomicU64,
}

impl ActionCounts {
    pub fn add(counter: &AtomicU64, n: u64) {
        counter.fetch_add(n, Ordering::Relaxed);
    }

    fn pairs(&self) -> [(&'static str, u64); 8] {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        [
            ("completed", get(&self.completed)),
            ("released", get(&self.released)),
            ("not_found", get(&self.not_found)),
            ("released_after", get(&self.released_after)),
            ("held", get(&self.held)),
            ("probe_failed", get(&self.probe_failed)),
            ("fenced", get(&self.fenced)),
            ("purged", get(&self.purged)),
        ]
    }

    /// `completed=1 released=0 … held_keys=2`, for the log line at the end of a pass.
    pub fn summary(&self) -> String {
        let mut out = String::new();
        for (name, value) in self.pairs() {
            let _ = write!(out, "{name}={value} ");
        }
        let _ = write!(out, "held_keys={}", self.held_keys.load(Ordering::Relaxed));
        out
    }

    /// The process's metrics as Prometheus text: these counters, copied into the one
    /// recorder both services export through (`idem_telemetry::prometheus`), with
    /// whatever else was recorded (the ledger's errors, say).
    pub fn prometheus(&self) -> String {
        use idem_telemetry::metrics::{counter, gauge};
        let exporter = idem_telemetry::prometheus();
        describe();
        for (action, value) in self.pairs() {
            counter!("idemgate_reconciler_actions_total", "action" => action).absolute(value);
        }
        counter!("idemgate_reconciler_passes_total").absolute(self.passes.load(Ordering::Relaxed));
        gauge!("idemgate_held_keys").set(self.held_keys.load(Ordering::Relaxed) as f64);
        exporter.render()
    }
}

/// The metrics' help texts, once per process.
fn describe() {
    use idem_telemetry::metrics::{describe_counter, describe_gauge};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        describe_counter!(
            "idemgate_reconciler_actions_total",
            "What the reconciler did with stuck or expired keys."
        );
        describe_counter!("idemgate_reconciler_passes_total", "Passes run.");
        describe_gauge!(
            "idemgate_held_keys",
            "Keys in progress whose lease is over, waiting on a probe, a policy or a person."
        );
    });
}
