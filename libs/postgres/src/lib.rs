//! `idem-postgres`: the durable ledger of idempotency records, on Postgres.
//!
//! # Layout
//! - [`ledger`]: [`PgLedger`] and the `idempotency_keys` row: every statement the
//!   gateway (the engine's [`idem_core::Ledger`]), the reconciler and `idemgate keys`
//!   run on it, each one atomic, bounded and traced, one family per module, with the
//!   row's states and transitions in [`ledger::rules`].
//! - [`group`]: group commit, the pipes that let concurrent claims (and completions)
//!   share one statement and one commit.
//! - [`headers`]: how response headers are stored, byte for byte.
//! - [`connect`] and [`migrate`]: the pool and the embedded migrations of `migrations/`.
#![forbid(unsafe_code)]

mod conn;
pub mod group;
pub mod headers;
pub mod ledger;

use std::str::FromStr;
use std::time::Duration;

use sqlx::postgres::{PgConnectOptions, PgPoolOptions};
use sqlx::{Connection, PgPool};

pub use conn::unfit;
pub use ledger::{BodyStats, KeyInfo, Later, OperatorRelease, PgLedger, StuckRow};

/// The schema, embedded from the workspace's `migrations/` at build time.
pub static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../../migrations");

/// Pool settings.
#[derive(Debug, Clone)]
pub struct PoolSettings {
    pub max_connections: u32,
    /// How long a request waits for a free connection before failing.
    pub acquire_timeout: Duration,
    /// `statement_timeout` on every connection: the server gives up on a statement
    /// that takes longer.
    pub statement_timeout: Duration,
    /// `lock_timeout` on every connection: a statement that waits this long for a row
    /// lock gives up (55P03). Every lock a gateway statement takes is held for one short
    /// statement; only another transaction (an embedded-mode request, holding its key's
    /// claim for as long as its handler runs) holds one longer, and a claim that meets it
    /// is answered "in progress" rather than stalling every claim of its group.
    pub lock_timeout: Duration,
    pub application_name: String,
}

/// The gateway's and the reconciler's lock wait ([`PoolSettings::lock_timeout`]): far
/// longer than any lock they hold themselves, far shorter than a request's budget.
pub const LOCK_TIMEOUT: Duration = Duration::from_millis(100);

/// The gateway's pool, as `[postgres]` sets it; other processes change what differs
/// (`PoolSettings { application_name: …, ..(&config.postgres).into() }`).
impl From<&idem_config::PostgresConfig> for PoolSettings {
    fn from(postgres: &idem_config::PostgresConfig) -> Self {
        Self {
            max_connections: postgres.max_connections,
            acquire_timeout: postgres.acquire_timeout,
            statement_timeout: postgres.statement_timeout,
            lock_timeout: LOCK_TIMEOUT.min(postgres.statement_timeout),
            application_name: "idemgate".into(),
        }
    }
}

/// Opens a pool. Fails if the database cannot be reached.
pub async fn connect(url: &str, settings: &PoolSettings) -> Result<PgPool, sqlx::Error> {
    let options = PgConnectOptions::from_str(url)?.application_name(&settings.application_name);
    // The session's settings are set by a statement on each new connection, not sent as
    // startup `options`: a pooler in front (PgBouncer) refuses startup options, or drops
    // them silently when told to ignore them, and a gateway without its
    // statement_timeout has no bound on a hung statement.
    let session = format!(
        "SET statement_timeout = '{}ms'; SET lock_timeout = '{}ms'; \
         SET plan_cache_mode = force_generic_plan; SET enable_seqscan = off",
        settings.statement_timeout.as_millis(),
        settings.lock_timeout.as_millis().max(1),
    );
    let ping_timeout = settings.acquire_timeout / PING_SHARE_OF_ACQUIRE;
    PgPoolOptions::new()
        .max_connections(settings.max_connections)
        .acquire_timeout(settings.acquire_timeout)
        // sqlx pings every connection it hands out by default: one extra round trip per
        // statement (about a tenth of Postgres's CPU per new key in loadtest/bench). A
        // connection that answered a moment ago needs no proof of life; one that sat
        // idle (across a restart, a failover, an idle-killing proxy) still gets it.
        .test_before_acquire(false)
        // Every statement is prepared once per connection and then planned once (generic
        // plans, `plan_cache_mode`): a claim for a batch of keys otherwise costs Postgres
        // a fresh plan per execution (0.5-0.9 ms, more than running it), because the
        // planner cannot guess an array's length and so never trusts a generic plan of
        // it. And every statement finds its rows by an index (the key's, the lease's, the
        // expiry's; `enable_seqscan`): a plan made while the table was small could
        // otherwise scan it whole, and be kept while it grows, until the next ANALYZE.
        .after_connect(move |conn, _| {
            let session = session.clone();
            Box::pin(async move {
                sqlx::raw_sql(sqlx::AssertSqlSafe(session))
                    .execute(conn)
                    .await
                    .map(|_| ())
            })
        })
        .before_acquire(move |conn, meta| {
            Box::pin(async move {
                if meta.idle_for >= PING_IF_IDLE_FOR {
                    // A connection a middlebox forgot never answers and never closes: give
                    // up on it in time for a fresh one (an error drops it unclosed).
                    tokio::time::timeout(ping_timeout, conn.ping())
                        .await
                        .map_err(|_| {
                            sqlx::Error::Io(std::io::Error::new(
                                std::io::ErrorKind::TimedOut,
                                format!("an idle connection did not answer a ping within {ping_timeout:?}"),
                            ))
                        })??;
                }
                Ok(true)
            })
        })
        .connect_with(options)
        .await
}

/// A pooled connection idle for this long is pinged before it is handed out.
const PING_IF_IDLE_FOR: Duration = Duration::from_secs(1);

/// That ping may take this share of the acquire timeout; the rest is left for opening
/// a new connection in place of one that did not answer. (A quarter was too little: a
/// process just resumed, or starved of CPU, gave up on healthy connections.)
const PING_SHARE_OF_ACQUIRE: u32 = 2;

/// The checksum `migrations/0004_held_keys.sql` was released with. Its first comment then
/// cited design notes that are not part of this repository; it now says the same in the
/// repository's words. No statement changed, but sqlx compares every applied migration's
/// checksum of its whole text, so a database that applied the released text is told the
/// new checksum once, before migrating ([`accept_reworded_comments`]).
pub const RELEASED_0004: [u8; 48] = [
    0x2e, 0x0c, 0x59, 0xed, 0xed, 0x36, 0x6c, 0xbb, 0xc8, 0x1a, 0xba, 0xb3, 0x94, 0x2b, 0x84, 0xa6,
    0xa4, 0x97, 0x55, 0x7d, 0x21, 0xaa, 0x34, 0x15, 0xec, 0x2b, 0xbf, 0xba, 0x9b, 0xe5, 0xc8, 0x71,
    0x50, 0x0d, 0x33, 0x2d, 0x4f, 0x8a, 0x6f, 0xa0, 0xb9, 0xda, 0x85, 0xbd, 0x98, 0xb3, 0x4c, 0xa5,
];

/// Records the checksum of a migration whose comment was reworded after its release, on a
/// database that applied the released text (and only there: any other checksum is left
/// for the migrator to refuse).
async fn accept_reworded_comments(conn: &mut sqlx::PgConnection) -> Result<(), sqlx::Error> {
    let Some(now) = MIGRATOR.iter().find(|m| m.version == 4) else {
        return Ok(());
    };
    let applied: bool = sqlx::query_scalar("SELECT to_regclass('_sqlx_migrations') IS NOT NULL")
        .fetch_one(&mut *conn)
        .await?;
    if applied {
        sqlx::query(
            "UPDATE _sqlx_migrations SET checksum = $1 WHERE version = 4 AND checksum = $2",
        )
        .bind(&now.checksum[..])
        .bind(&RELEASED_0004[..])
        .execute(conn)
        .await?;
    }
    Ok(())
}

/// Applies pending migrations. Safe to run from several processes at once (the
/// migrator takes an advisory lock).
pub async fn migrate(pool: &PgPool) -> Result<(), sqlx::migrate::MigrateError> {
    let mut conn = pool.acquire().await?;
    // Migrations wait for locks as DDL does (the advisory lock while another process
    // migrates, a table's lock behind running statements), bounded by the statement
    // timeout, not by the pool's short `lock_timeout`. The connection is closed after,
    // so the pool never hands out one with that setting.
    conn.close_on_drop();
    sqlx::query("SET lock_timeout = 0")
        .execute(&mut *conn)
        .await?;
    accept_reworded_comments(&mut conn).await?;
    MIGRATOR.run(&mut *conn).await
}

/// A ledger call that did not finish in time.
#[derive(Debug, thiserror::Error)]
#[error("the ledger did not answer within {0:?}")]
pub struct Timeout(pub Duration);

/// A claim that kept conflicting with rows that vanished before they could be read.
#[derive(Debug, thiserror::Error)]
#[error("the claim kept racing with releases; try again")]
pub struct Contended;

/// A row that does not have the shape the schema promises.
#[derive(Debug, thiserror::Error)]
#[error("corrupt ledger row: {0}")]
pub struct Corrupt(pub &'static str);
