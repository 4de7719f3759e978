//! `idemgate-reconciler`: resolves claims whose outcome is unknown and purges expired keys.
//!
//! A pass (1) takes stuck rows — `in_progress` past their lease, or ended at once by an
//! uncertain 5xx — in batches, `FOR UPDATE SKIP LOCKED` with a processing lease, so any
//! number of reconcilers cooperate and each row is probed once per pass; (2) resolves
//! each one (see [`resolve`]) as [`idem_core::reconcile::decide`] says: a status probe's
//! 2xx completes it with the upstream's real answer, two 404s `release_confirm` apart
//! release it, anything else leaves it for later with backoff; without a probe, the
//! route's `on_unknown` policy holds it for an operator or releases it after a set time;
//! (3) purges expired completed rows in small batches within a time budget (a held key
//! never lapses); (4) counts the held keys for the `idemgate_held_keys` gauge.
//!
//! # Layout
//! - [`resolve`]: one stuck row.
//! - [`stats`]: counters for the pass log line, exported on `/metrics` through the
//!   same recorder as the gateway's.
#![forbid(unsafe_code)]

pub mod resolve;
pub mod stats;

use std::future::Future;
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use axum::Router;
use axum::extract::State;
use axum::routing::get;
use futures_util::StreamExt;
use idem_config::Config;
use idem_core::Fence;
use idem_core::reconcile::retry_after;
use idem_postgres::{Later, PgLedger, PoolSettings, StuckRow};
use idem_upstream::HttpClient;
use secrecy::ExposeSecret;

use crate::stats::ActionCounts;

/// One reconciler.
pub struct Reconciler {
    pub(crate) ledger: PgLedger,
    pub(crate) config: Config,
    pub(crate) client: HttpClient,
    pub stats: Arc<ActionCounts>,
}

impl Reconciler {
    pub async fn connect(config: Config) -> anyhow::Result<Self> {
        let settings = PoolSettings {
            max_connections: config.reconciler.concurrency.saturating_add(2),
            application_name: "idemgate-reconciler".into(),
            ..(&config.postgres).into()
        };
        let pool = idem_postgres::connect(config.postgres.url.expose_secret(), &settings)
            .await
            .context("connecting to postgres.url")?;
        let op_timeout = config.postgres.op_timeout();
        Ok(Self {
            ledger: PgLedger::new(pool, op_timeout),
            config,
            client: idem_upstream::pooled_client(),
            stats: Arc::default(),
        })
    }

    /// One pass: resolve every stuck row it can take, then purge within the budget.
    pub async fn pass(&self) -> anyhow::Result<()> {
        let settings = &self.config.reconciler;
        let batch = i64::from(settings.batch_size);
        loop {
            let rows = self
                .ledger
                .take_stuck(batch, settings.processing_lease)
                .await
                .context("taking stuck rows")?;
            let taken = rows.len();
            futures_util::stream::iter(rows)
                .map(|row| self.resolve_or_retry_soon(row))
                .buffer_unordered(settings.concurrency as usize)
                .collect::<()>()
                .await;
            if (taken as i64) < batch {
                break;
            }
        }
        self.purge().await?;
        let held = self
            .ledger
            .count_held()
            .await
            .context("counting held keys")?;
        self.stats.held_keys.store(
            u64::try_from(held).unwrap_or(0),
            std::sync::atomic::Ordering::Relaxed,
        );
        ActionCounts::add(&self.stats.passes, 1);
        Ok(())
    }

    /// Resolves one taken row. When that fails (the ledger's connection lost mid-write, as
    /// in a failover) the row is looked at again after the backoff of an inconclusive
    /// probe — one interval at first, doubling up to `max_backoff` while failures repeat —
    /// not after the rest of the processing lease: deferred, fenced by its attempt, so
    /// nothing changes should the failed write have committed after all. Only if the defer
    /// fails too does the row wait for the lease.
    async fn resolve_or_retry_soon(&self, row: StuckRow) {
        let Err(error) = self.resolve(row.clone()).await else {
            return;
        };
        let settings = &self.config.reconciler;
        let attempts = u32::try_from(row.probe_attempts).unwrap_or(0);
        let after = retry_after(settings.interval, settings.max_backoff, attempts);
        match self.ledger.defer(&row, after, Later::Inconclusive).await {
            Ok(Fence::Held) => {
                tracing::error!(%error, scope = ?row.scope, retry_in = ?after, "resolving a stuck row failed; it is tried again")
            }
            Ok(Fence::Lost) => {
                tracing::info!(%error, scope = ?row.scope, "resolving a stuck row reported a failure, but the row has moved on (the write took effect)")
            }
            Err(again) => {
                tracing::error!(%error, %again, scope = ?row.scope, "resolving a stuck row failed; it is tried again after the processing lease")
            }
        }
    }

    /// Deletes expired completed rows in small batches, for at most the purge budget.
    async fn purge(&self) -> anyhow::Result<()> {
        let settings = &self.config.reconciler;
        let started = Instant::now();
        loop {
            let deleted = self
                .ledger
                .purge_batch(i64::from(settings.purge_batch))
                .await
                .context("purging expired rows")?;
            ActionCounts::add(&self.stats.purged, deleted);
            if deleted < u64::from(settings.purge_batch)
                || started.elapsed() >= settings.purge_budget
            {
                return Ok(());
            }
        }
    }

    /// Runs passes every `interval` until `shutdown` resolves (finishing the pass in
    /// progress), serving `/healthz` and `/metrics` on `reconciler.listen` meanwhile.
    pub async fn run(
        self,
        shutdown: impl Future<Output = ()> + Send + 'static,
    ) -> anyhow::Result<()> {
        idem_telemetry::prometheus(); // record from the first pass on
        let listener = tokio::net::TcpListener::bind(self.config.reconciler.listen)
            .await
            .with_context(|| {
                format!(
                    "binding reconciler.listen = {}",
                    self.config.reconciler.listen
                )
            })?;
        println!(
            "idemgate-reconciler listening on {}",
            listener.local_addr()?
        );
        let (stop_tx, mut stop_rx) = tokio::sync::watch::channel(false);
        tokio::spawn(async move {
            shutdown.await;
            let _ = stop_tx.send(true);
        });
        let app = Router::new()
            .route("/healthz", get(|| async { "ok" }))
            .route(
                "/metrics",
                get(|State(stats): State<Arc<ActionCounts>>| async move { stats.prometheus() }),
            )
            .with_state(self.stats.clone());
        let mut http_stop = stop_rx.clone();
        let server = tokio::spawn(async move {
            axum::serve(listener, app)
                .with_graceful_shutdown(async move {
                    let _ = http_stop.wait_for(|stop| *stop).await;
                })
                .await
        });
        let interval = self.config.reconciler.interval;
        loop {
            match self.pass().await {
                Ok(()) => tracing::info!(totals = %self.stats.summary(), "pass done"),
                Err(error) => {
                    tracing::error!(error = %format!("{error:#}"), "pass failed; retrying next interval")
                }
            }
            tokio::select! {
                _ = tokio::time::sleep(interval) => {}
                _ = stop_rx.wait_for(|stop| *stop) => break,
            }
        }
        tracing::info!("reconciler stopped");
        server.await??;
        Ok(())
    }
}
