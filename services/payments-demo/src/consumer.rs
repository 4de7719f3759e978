//! Consumer mode (`PAYMENTS_DEMO_MODE=consumer`, docs/embedded-mode.md): payment commands from a
//! Redis Stream, each run at most once by `idem-embedded`'s [`Idempotency::once`].
//!
//! A message's fields: `tenant`, `key` (the producer's id for the logical operation, so a
//! producer that publishes twice is deduplicated too) and `body` (the payment JSON of
//! `POST /payments`). The consumer reads with `XREADGROUP` in the group `payments-demo`
//! (created if missing), runs the message through `once` — the key's claim, the payment row
//! and the stored receipt in one transaction — and `XACK`s it only after the commit. A
//! consumer killed between its commit and its ack leaves the message pending: once it has
//! been idle for `PAYMENTS_DEMO_CLAIM_IDLE` (default 5 s) any consumer of the group takes
//! it over (`XAUTOCLAIM`), and `once` replays the stored receipt instead of paying again.
//!
//! A message that can never be paid — one Postgres refuses every time (an `orderId`
//! holding `\u0000`), or whose processing always fails — is not redelivered forever: once
//! it has been delivered `PAYMENTS_DEMO_MAX_DELIVERIES` times (default 5), it is moved to
//! the dead-letter stream `PAYMENTS_DEMO_DEAD_LETTER` (default `<stream>:dead`, its fields
//! plus `source_id` and `deliveries`) and acknowledged, logged once and counted in
//! `payments_demo_dead_lettered_total` (`GET /metrics`). On a clean exit (SIGTERM) the
//! consumer leaves its group (`XGROUP DELCONSUMER`) when it holds nothing pending, so the
//! group's list of consumers does not grow with every restart.
//!
//! Environment: `PAYMENTS_DEMO_CONFIG` (a gateway config file: its `[redis] url` and
//! `[idempotency]`), `PAYMENTS_DEMO_STREAM` (default `payments`; the records' endpoint is
//! `stream:<name>`), `PAYMENTS_DEMO_CONSUMER` (default `<hostname>-<pid>`),
//! `PAYMENTS_DEMO_CLAIM_IDLE`, `PAYMENTS_DEMO_MAX_DELIVERIES`, `PAYMENTS_DEMO_DEAD_LETTER`.

use std::path::Path;
use std::time::Duration;

use anyhow::Context;
use idem_embedded::{Idempotency, Job, Next, NoTenant, Once, Options, Stored};
use idem_telemetry::failpoint;
use redis::aio::MultiplexedConnection;
use redis::streams::{StreamAutoClaimOptions, StreamAutoClaimReply, StreamId, StreamReadReply};
use secrecy::ExposeSecret;
use sqlx::PgPool;
use uuid::Uuid;

use crate::{Input, PAYMENT};

/// The consumer group every payments-demo consumer of a stream joins.
pub(crate) const GROUP: &str = "payments-demo";

/// How long one `XREADGROUP` waits for new messages.
const BLOCK: Duration = Duration::from_secs(1);

/// Messages taken per read.
const BATCH: usize = 32;

/// The most one message may take. Past it the message is left pending (its transaction
/// rolled back, or its commit's outcome unknown: either way a later delivery replays or
/// runs it), and this consumer goes on — a commit hung on a lost connection would
/// otherwise stop it for good.
const MESSAGE_BUDGET: Duration = Duration::from_secs(30);

/// The consumer's settings, from the environment.
pub(crate) struct Consumer {
    stream: String,
    endpoint: String,
    name: String,
    claim_idle: Duration,
    /// Deliveries after which a message that was never done goes to `dead_letter`.
    max_deliveries: u64,
    dead_letter: String,
    redis: redis::Client,
    idem: Idempotency<NoTenant>,
}

impl Consumer {
    /// Reads the environment and the config file, and applies the project's migrations.
    pub(crate) async fn from_env(pool: PgPool) -> anyhow::Result<Self> {
        let path = std::env::var_os("PAYMENTS_DEMO_CONFIG").context(
            "PAYMENTS_DEMO_MODE=consumer needs PAYMENTS_DEMO_CONFIG=FILE: a gateway config file, whose [redis] url and [idempotency] it uses",
        )?;
        let path = Path::new(&path);
        let config = idem_config::Config::load(path).map_err(|errors| {
            anyhow::anyhow!("PAYMENTS_DEMO_CONFIG={}: {errors}", path.display())
        })?;
        let url = config
            .redis
            .as_ref()
            .and_then(|redis| redis.url.as_ref())
            .with_context(|| {
                format!(
                    "PAYMENTS_DEMO_CONFIG={}: consumer mode reads its stream from [redis] url",
                    path.display()
                )
            })?;
        let redis = redis::Client::open(url.expose_secret())
            .context("PAYMENTS_DEMO_CONFIG's [redis] url")?;
        let stream = std::env::var("PAYMENTS_DEMO_STREAM").unwrap_or_else(|_| "payments".into());
        let name = std::env::var("PAYMENTS_DEMO_CONSUMER").unwrap_or_else(|_| {
            // Unique across containers whose processes all have pid 1.
            let host = std::fs::read_to_string("/proc/sys/kernel/hostname")
                .unwrap_or_else(|_| "consumer".into());
            format!("{}-{}", host.trim(), std::process::id())
        });
        let claim_idle = match std::env::var("PAYMENTS_DEMO_CLAIM_IDLE") {
            Ok(text) => humantime::parse_duration(&text)
                .with_context(|| format!("PAYMENTS_DEMO_CLAIM_IDLE={text:?}: expected e.g. 5s"))?,
            Err(_) => Duration::from_secs(5),
        };
        let max_deliveries = match std::env::var("PAYMENTS_DEMO_MAX_DELIVERIES") {
            Ok(text) => text
                .parse::<u64>()
                .ok()
                .filter(|n| *n > 0)
                .with_context(|| {
                    format!(
                        "PAYMENTS_DEMO_MAX_DELIVERIES={text:?}: expected a whole number above 0"
                    )
                })?,
            Err(_) => 5,
        };
        let dead_letter =
            std::env::var("PAYMENTS_DEMO_DEAD_LETTER").unwrap_or_else(|_| format!("{stream}:dead"));
        idem_embedded::migrate(&pool)
            .await
            .context("applying the idempotency migrations")?;
        // No HTTP in this mode: the tenant comes with each message.
        let idem = Idempotency::new(pool.clone(), Options::from_config(&config.idempotency));
        Ok(Self {
            endpoint: format!("stream:{stream}"),
            stream,
            name,
            claim_idle,
            max_deliveries,
            dead_letter,
            redis,
            idem,
        })
    }

    /// What the process needs to leave the group on a clean exit.
    pub(crate) fn membership(&self) -> Membership {
        Membership {
            redis: self.redis.clone(),
            stream: self.stream.clone(),
            name: self.name.clone(),
        }
    }

    /// Consumes until the process ends; Redis errors are logged and retried.
    pub(crate) async fn run(self) {
        tracing::info!(stream = %self.stream, consumer = %self.name, "consuming");
        // On stdout: how to give it something to do.
        println!(
            "payments-demo consuming the stream {stream} as {name} (group {GROUP}); publish a payment with\n  \
             redis-cli XADD {stream} '*' tenant acme key order-1 body '{{\"orderId\": \"order-1\", \"amountUah\": 100}}'",
            stream = self.stream,
            name = self.name,
        );
        loop {
            if let Err(error) = self.session().await {
                tracing::warn!(%error, "the stream could not be read; trying again in 1 s");
                tokio::time::sleep(Duration::from_secs(1)).await;
            }
        }
    }

    /// One connection's worth of consuming.
    async fn session(&self) -> redis::RedisResult<()> {
        // A blocking read holds the connection for `BLOCK`: the reply may take that long.
        let config = redis::AsyncConnectionConfig::new()
            .set_connection_timeout(Some(Duration::from_secs(2)))
            .set_response_timeout(Some(BLOCK + Duration::from_secs(2)));
        let mut conn = self
            .redis
            .get_multiplexed_async_connection_with_config(&config)
            .await?;
        self.join_group(&mut conn).await?;
        let mut cursor = "0-0".to_owned();
        loop {
            // Messages another consumer (or this one, before a restart) took and left
            // unacknowledged for `claim_idle`: taken over, run again (`once` replays them if
            // their commit happened).
            let claimed: StreamAutoClaimReply = redis::cmd("XAUTOCLAIM")
                .arg(&self.stream)
                .arg(GROUP)
                .arg(&self.name)
                .arg(self.claim_idle.as_millis() as u64)
                .arg(&cursor)
                .arg(StreamAutoClaimOptions::default().count(BATCH))
                .query_async(&mut conn)
                .await?;
            cursor = claimed.next_stream_id;
            for message in &claimed.claimed {
                // Taken over: delivered before, and never done. One that can never be
                // done goes to the dead letters rather than round again forever.
                let deliveries = self.deliveries(&mut conn, &message.id).await?;
                if deliveries > self.max_deliveries {
                    self.dead_letter(&mut conn, message, deliveries).await?;
                    continue;
                }
                self.handle(&mut conn, message).await?;
            }
            let read: StreamReadReply = redis::cmd("XREADGROUP")
                .arg("GROUP")
                .arg(GROUP)
                .arg(&self.name)
                .arg("COUNT")
                .arg(BATCH)
                .arg("BLOCK")
                .arg(BLOCK.as_millis() as u64)
                .arg("STREAMS")
                .arg(&self.stream)
                .arg(">")
                .query_async(&mut conn)
                .await?;
            for message in read.keys.iter().flat_map(|key| &key.ids) {
                self.handle(&mut conn, message).await?;
            }
        }
    }

    /// Creates the group (reading the stream from its start) unless it exists.
    async fn join_group(&self, conn: &mut MultiplexedConnection) -> redis::RedisResult<()> {
        let created: redis::RedisResult<()> = redis::cmd("XGROUP")
            .arg("CREATE")
            .arg(&self.stream)
            .arg(GROUP)
            .arg("0")
            .arg("MKSTREAM")
            .query_async(conn)
            .await;
        match created {
            Err(error) if error.code() == Some("BUSYGROUP") => Ok(()),
            other => other,
        }
    }

    /// Runs one message at most once and acknowledges it once its outcome is final. A
    /// message whose outcome is not (the ledger unreachable, a commit unacknowledged, a
    /// duplicate still running) stays pending and is taken over after `claim_idle`.
    async fn handle(
        &self,
        conn: &mut MultiplexedConnection,
        message: &StreamId,
    ) -> redis::RedisResult<()> {
        let field = |name: &str| message.get::<String>(name);
        let (Some(tenant), Some(key), Some(body)) = (field("tenant"), field("key"), field("body"))
        else {
            tracing::error!(id = %message.id, "a message without tenant, key or body is dropped (acknowledged)");
            return self.ack(conn, message).await;
        };
        let job = Job::new(&tenant, &self.endpoint, &key, body.as_bytes());
        let pay = self.idem.once(job, async |mut tx| {
            let input = Input::parse(PAYMENT, body.as_bytes()).map_err(Refused::Input)?;
            let id = Uuid::new_v4();
            input
                .insert(&mut *tx, id, &tenant, Some(&key), None)
                .await
                .map_err(Refused::Db)?;
            Ok(Stored::json(201, &input.body(id)).expect("a JSON value serialises"))
        });
        let Ok(paid) = tokio::time::timeout(MESSAGE_BUDGET, pay).await else {
            tracing::warn!(id = %message.id, %key, "not done within {MESSAGE_BUDGET:?}; left pending");
            return Ok(());
        };
        match paid {
            Ok(Once::Ran(_)) => tracing::info!(id = %message.id, %key, "paid"),
            Ok(Once::Replayed(_)) => {
                tracing::info!(id = %message.id, %key, "already paid: the stored receipt replayed")
            }
            Err(error) => match error.next() {
                // Final: the message can never be paid as it is.
                Next::Acknowledge | Next::Operation(Refused::Input(_)) => {
                    tracing::error!(id = %message.id, %key, %error, "refused (acknowledged)");
                }
                Next::Redeliver | Next::Operation(Refused::Db(_)) => {
                    tracing::warn!(id = %message.id, %key, %error, "left pending: taken over after the claim idle time");
                    return Ok(());
                }
            },
        }
        failpoint::stop_here("consumer-before-ack");
        self.ack(conn, message).await
    }

    /// How many times the group has delivered `id` (this delivery included).
    async fn deliveries(
        &self,
        conn: &mut MultiplexedConnection,
        id: &str,
    ) -> redis::RedisResult<u64> {
        let pending: Vec<(String, String, u64, u64)> = redis::cmd("XPENDING")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(id)
            .arg(id)
            .arg(1)
            .query_async(conn)
            .await?;
        Ok(pending
            .first()
            .map_or(1, |(_, _, _, deliveries)| *deliveries))
    }

    /// Moves a message delivered `deliveries` times, and never done, to the dead-letter
    /// stream and acknowledges it, in one transaction: it is in exactly one of the two.
    async fn dead_letter(
        &self,
        conn: &mut MultiplexedConnection,
        message: &StreamId,
        deliveries: u64,
    ) -> redis::RedisResult<()> {
        let mut entry: Vec<(String, Vec<u8>)> = message
            .map
            .iter()
            .filter_map(|(field, value)| {
                redis::from_redis_value::<Vec<u8>>(value.clone())
                    .ok()
                    .map(|bytes| (field.clone(), bytes))
            })
            .collect();
        entry.push(("source_id".into(), message.id.clone().into_bytes()));
        entry.push(("deliveries".into(), deliveries.to_string().into_bytes()));
        let _: () = redis::pipe()
            .atomic()
            .cmd("XADD")
            .arg(&self.dead_letter)
            .arg("*")
            .arg(&entry)
            .ignore()
            .cmd("XACK")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(&message.id)
            .ignore()
            .query_async(conn)
            .await?;
        idem_telemetry::metrics::counter!("payments_demo_dead_lettered_total").increment(1);
        tracing::error!(
            id = %message.id,
            deliveries,
            dead_letter = %self.dead_letter,
            "delivered {deliveries} times and never done: moved to the dead letters (acknowledged)"
        );
        Ok(())
    }

    async fn ack(
        &self,
        conn: &mut MultiplexedConnection,
        message: &StreamId,
    ) -> redis::RedisResult<()> {
        redis::cmd("XACK")
            .arg(&self.stream)
            .arg(GROUP)
            .arg(&message.id)
            .query_async(conn)
            .await
    }
}

/// A consumer's place in its group, left on a clean exit.
pub(crate) struct Membership {
    redis: redis::Client,
    stream: String,
    name: String,
}

impl Membership {
    /// Leaves the group (`XGROUP DELCONSUMER`) if this consumer holds nothing pending:
    /// deleting a consumer drops what it holds from the group's pending list, and a
    /// message committed but not yet acknowledged must stay there for another consumer to
    /// take over.
    pub(crate) async fn leave(self) {
        // The check and the deletion in one script: nothing can be delivered to this
        // consumer between them.
        const LEAVE: &str = "if #redis.call('XPENDING', KEYS[1], ARGV[1], '-', '+', 1, ARGV[2]) > 0 \
             then return 0 end \
             redis.call('XGROUP', 'DELCONSUMER', KEYS[1], ARGV[1], ARGV[2]) return 1";
        let left = async {
            let mut conn = self.redis.get_multiplexed_async_connection().await?;
            let left: i64 = redis::cmd("EVAL")
                .arg(LEAVE)
                .arg(1)
                .arg(&self.stream)
                .arg(GROUP)
                .arg(&self.name)
                .query_async(&mut conn)
                .await?;
            Ok::<_, redis::RedisError>(left == 1)
        };
        match tokio::time::timeout(Duration::from_secs(2), left).await {
            Ok(Ok(true)) => tracing::info!(consumer = %self.name, "left the group"),
            Ok(Ok(false)) => tracing::info!(
                consumer = %self.name,
                "stays in the group: it holds messages pending, for another consumer to take over"
            ),
            Ok(Err(error)) => tracing::warn!(%error, "could not leave the group"),
            Err(_) => tracing::warn!("could not leave the group within 2 s"),
        }
    }
}

/// Why a payment command was not paid.
#[derive(Debug, thiserror::Error)]
enum Refused {
    #[error("the payment is invalid: {}", .0.1)]
    Input((axum::http::StatusCode, String)),
    #[error("the payment could not be written: {0}")]
    Db(sqlx::Error),
}
