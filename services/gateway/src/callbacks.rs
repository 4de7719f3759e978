//! Settlement callbacks (docs/http-api.md, "Told when it settles"): a tenant with a
//! `callback_url` is told how each of its keys settled when the key's client was not given
//! the final answer — answered 202 (`Prefer: respond-async`), or 504, 503 or 409 while the
//! key was held and the reconciler or an operator settled it.
//!
//! The settlement's own statement writes the callback to the ledger's outbox
//! (`idem_postgres::ledger::callbacks`), so none is lost with a replica. Every replica runs
//! a sender ([`Callbacks::turn`]): each turn it takes the callbacks due for a lease (one sender per
//! row, whichever replica), POSTs each signed as Standard Webhooks signs, and records
//! the outcome; one not delivered is tried again with backoff ([`backoff`]) until it has
//! waited [`RETRY_FOR`] since its settlement. A receiver may see one twice (a sender killed
//! after the receiver's 2xx, before recording it): `webhook-id` is the same every time.
//! Nothing of the request or its answer but the status goes out.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use idem_config::{TenantConfig, Tenants};
use idem_postgres::PgLedger;
use idem_postgres::ledger::callbacks::{DueCallback, Whose};
use idem_webhooks::{Scheme, Secrets};

/// How long a callback is tried, from its settlement (then given up, counted `expired`).
pub const RETRY_FOR: Duration = Duration::from_secs(72 * 3600);

/// How often a sender looks for callbacks due.
pub const TURN: Duration = Duration::from_secs(1);

/// The most callbacks a replica sends at once: a turn takes no more than are free, and
/// does not wait for a slow receiver's before the next turn takes more.
const IN_FLIGHT: usize = 64;

/// The longest a receiver is given to answer.
const DELIVERY_TIMEOUT: Duration = Duration::from_secs(10);

/// How long a taken callback is the taker's: longer than its delivery and its report.
const LEASE: Duration = Duration::from_secs(30);

/// The longest wait between two deliveries of one callback.
const MAX_BACKOFF: Duration = Duration::from_secs(600);

/// Where one tenant's callbacks go.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Target {
    url: http::Uri,
    secret_file: PathBuf,
}

impl Target {
    /// The URL as logs and the outbox's `last_error` show it: scheme, host and port, never
    /// a path or query that may carry a token.
    fn shown(&self) -> String {
        let scheme = self.url.scheme_str().unwrap_or("http");
        let host = self.url.authority().map_or("", |a| a.as_str());
        format!("{scheme}://{host}")
    }

    fn of(entry: &TenantConfig) -> Option<Arc<Self>> {
        let url = entry.callback_url.as_ref()?.parse().ok()?;
        let secret_file = entry.callback_secret_file.clone()?;
        Some(Arc::new(Self { url, secret_file }))
    }

    /// The secrets to sign with, read afresh (a rotation needs no restart).
    async fn secrets(&self) -> Result<Secrets, String> {
        let file = self.secret_file.clone();
        tokio::task::spawn_blocking(move || read_secrets(&file))
            .await
            .map_err(|e| e.to_string())?
    }
}

/// The Standard Webhooks secrets of `file`, or why not: at start and for each delivery.
fn read_secrets(file: &std::path::Path) -> Result<Secrets, String> {
    let text = std::fs::read_to_string(file)
        .map_err(|e| format!("cannot read {}: {e}", file.display()))?;
    Secrets::parse(Scheme::StandardWebhooks, &text).map_err(|e| format!("{}: {e}", file.display()))
}

/// Every tenant's callback target, as configured.
#[derive(Debug)]
pub struct Callbacks {
    named: HashMap<String, Option<Arc<Target>>>,
    default: Option<Arc<Target>>,
    /// The named tenants with a target (the sender takes only theirs, unless the default
    /// entry has one).
    telling: Vec<String>,
    client: Client<hyper_rustls::HttpsConnector<HttpConnector>, Full<Bytes>>,
    /// Places for deliveries in flight.
    sending: Arc<tokio::sync::Semaphore>,
}

impl Callbacks {
    pub fn new(tenants: &Tenants) -> anyhow::Result<Self> {
        let connector = idem_auth::https_connector(None)?;
        let named: HashMap<_, _> = tenants
            .named()
            .map(|(id, entry)| (id.to_owned(), Target::of(entry)))
            .collect();
        Ok(Self {
            telling: named
                .iter()
                .filter(|(_, target)| target.is_some())
                .map(|(id, _)| id.clone())
                .collect(),
            named,
            default: Target::of(tenants.default_entry()),
            client: Client::builder(TokioExecutor::new()).build(connector),
            sending: Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT)),
        })
    }

    fn target(&self, tenant: &str) -> Option<&Arc<Target>> {
        match self.named.get(tenant) {
            Some(target) => target.as_ref(),
            None => self.default.as_ref(),
        }
    }

    /// Whether `tenant` is told its keys' settlements.
    pub fn tells(&self, tenant: &str) -> bool {
        self.target(tenant).is_some()
    }

    /// Whether any tenant is: a replica runs a sender only then.
    pub fn any(&self) -> bool {
        self.default.is_some() || self.named.values().any(Option::is_some)
    }

    /// One sender's turn: takes as many callbacks due as it has free places (each for a
    /// lease) and starts their deliveries, each outcome recorded when it comes. Run every
    /// [`TURN`] by every replica.
    pub async fn turn(self: &Arc<Self>, ledger: &PgLedger) {
        let free = self.sending.available_permits();
        if free == 0 {
            return;
        }
        let tenants = match self.default {
            Some(_) => Whose::Every,
            None => Whose::Only(&self.telling),
        };
        let due = match ledger.take_callbacks(free as i64, LEASE, tenants).await {
            Ok(due) => due,
            Err(error) => {
                tracing::warn!(%error, "could not take the callbacks due; trying again");
                return;
            }
        };
        for due in due {
            // Only turns take places, one at a time: as many as were free still are.
            let Ok(place) = self.sending.clone().try_acquire_owned() else {
                break; // (the rest are taken again after their lease)
            };
            let (me, ledger) = (self.clone(), ledger.clone());
            tokio::spawn(async move {
                me.deliver(&ledger, due).await;
                drop(place);
            });
        }
    }

    /// One delivery of `due`, and its outcome recorded (fenced by the delivery).
    async fn deliver(&self, ledger: &PgLedger, due: DueCallback) {
        let sent = match self.target(&due.scope.tenant) {
            Some(target) => self.send(target, &due).await,
            None => Err(format!("tenant {:?} has no callback_url", due.scope.tenant)),
        };
        let outcome = match sent {
            Ok(()) => match ledger.callback_delivered(&due).await {
                Ok(_) => "delivered",
                Err(error) => {
                    // Sent: another delivery, after the lease, is harmless (same id).
                    tracing::warn!(%error, "a delivered callback could not be recorded");
                    "delivered"
                }
            },
            Err(why) => {
                let after = backoff(due.delivery, jitter());
                match ledger.callback_failed(&due, &why, after, RETRY_FOR).await {
                    Ok(Some(true)) => {
                        tracing::error!(
                            tenant.id = %due.scope.tenant,
                            idempotency.endpoint = %due.scope.endpoint,
                            idempotency.key = %due.scope.key,
                            deliveries = due.delivery,
                            %why,
                            "settlement callback given up: not delivered for 72 h"
                        );
                        "expired"
                    }
                    Ok(_) => {
                        tracing::info!(
                            tenant.id = %due.scope.tenant,
                            idempotency.key = %due.scope.key,
                            delivery = due.delivery,
                            retry_in = ?after,
                            %why,
                            "settlement callback not delivered; tried again later"
                        );
                        "failed"
                    }
                    Err(error) => {
                        tracing::warn!(%error, %why, "a failed callback could not be recorded; tried again after its lease");
                        "failed"
                    }
                }
            }
        };
        idem_telemetry::metrics::counter!("idemgate_callbacks_total", "outcome" => outcome)
            .increment(1);
    }

    /// POSTs `due` to `target`, signed; `Err` says why it was not delivered.
    async fn send(&self, target: &Target, due: &DueCallback) -> Result<(), String> {
        let secrets = target.secrets().await?;
        let body = Bytes::from(body(due));
        let id = message_id(due);
        let timestamp = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default()
            .as_secs();
        let signature = idem_webhooks::sign_standard(&secrets, &id, timestamp, &body);
        let request = http::Request::post(target.url.clone())
            .header(http::header::CONTENT_TYPE, "application/json")
            .header(http::header::USER_AGENT, "idemgate")
            .header("webhook-id", &id)
            .header("webhook-timestamp", timestamp.to_string())
            .header("webhook-signature", signature)
            .body(Full::new(body))
            .map_err(|e| e.to_string())?;
        let exchange = async {
            let response = self
                .client
                .request(request)
                .await
                .map_err(|e| format!("{}: {}", target.shown(), idem_core::error_chain(&e)))?;
            let status = response.status();
            // Read (and drop) a bounded body, so the connection can carry the next one.
            let _ = http_body_util::Limited::new(response.into_body(), 64 * 1024)
                .collect()
                .await;
            if status.is_success() {
                Ok(())
            } else {
                Err(format!("{} answered {status}", target.shown()))
            }
        };
        match tokio::time::timeout(DELIVERY_TIMEOUT, exchange).await {
            Ok(result) => result,
            Err(_) => Err(format!(
                "{} did not answer within {DELIVERY_TIMEOUT:?}",
                target.shown()
            )),
        }
    }

    /// Each tenant's callback secrets file read and parsed: one that cannot be would
    /// leave every callback of that tenant undelivered.
    pub fn check_secrets(tenants: &Tenants) -> anyhow::Result<()> {
        for (at, entry) in tenants.entries() {
            let Some(file) = &entry.callback_secret_file else {
                continue;
            };
            read_secrets(file)
                .map_err(|why| anyhow::anyhow!("{at}.callback_secret_file: {why}"))?;
        }
        Ok(())
    }
}

/// The callback's `webhook-id`: the same for every delivery of one settlement (the
/// tenant's attempt, which names its key), different for every other.
pub fn message_id(due: &DueCallback) -> String {
    format!("msg_{}", due.attempt.simple())
}

/// The callback's body: how the key settled, never its request or its answer's body.
pub fn body(due: &DueCallback) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "type": "idempotency.settled",
        "key": due.scope.key.as_str(),
        "endpoint": due.scope.endpoint,
        "state": due.state.as_str(),
        "response_status": due.response_status,
        "trace_id": due.trace_context.as_deref().and_then(idem_telemetry::propagation::trace_id_of),
        "settled_at": due.settled_at.to_rfc3339_opts(chrono::SecondsFormat::Millis, true),
    }))
    .expect("a callback's body serializes")
}

/// The wait after the `delivery`-th delivery failed: 1 s, doubling, at most
/// [`MAX_BACKOFF`], stretched by `jitter` (0 to 1: up to a fifth longer) so that callbacks
/// failed together are not all tried again together.
pub fn backoff(delivery: i32, jitter: f64) -> Duration {
    let doublings = u32::try_from(delivery.saturating_sub(1))
        .unwrap_or(0)
        .min(16);
    let base = Duration::from_secs(1u64 << doublings).min(MAX_BACKOFF);
    base.mul_f64(1.0 + 0.2 * jitter.clamp(0.0, 1.0))
}

/// A number in [0, 1), from a fresh UUID's random bits.
fn jitter() -> f64 {
    (uuid::Uuid::new_v4().as_u128() >> 75) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backoff_doubles_from_a_second_to_ten_minutes_with_a_fifth_of_jitter() {
        assert_eq!(backoff(1, 0.0), Duration::from_secs(1));
        assert_eq!(backoff(2, 0.0), Duration::from_secs(2));
        assert_eq!(backoff(4, 0.0), Duration::from_secs(8));
        assert_eq!(backoff(11, 0.0), Duration::from_secs(600));
        assert_eq!(backoff(400, 0.0), Duration::from_secs(600));
        assert_eq!(backoff(1, 1.0), Duration::from_millis(1200));
        let j = jitter();
        assert!((0.0..1.0).contains(&j), "{j}");
    }
}
