//! Large stored answers: read once per scope, shared by every retry that replays them,
//! and bounded in bytes all together.
//!
//! A claim or a read of a live row carries its stored body only up to [`INLINE`] bytes.
//! A larger one is read by a statement of its own ([`BODY_SQL`]) through [`Bodies`]:
//! concurrent readers of one row (the same scope and attempt) wait for one read, and
//! whoever comes while a copy is still held by anyone (an answer being written, a slow
//! client) gets that copy. The copies held count against a budget
//! (`server.max_replay_bytes_in_flight`); a read that would go past it is refused at
//! once ([`Busy`]), before anything is read, and the request gets 503 `overloaded`. A
//! copy's bytes go back to the budget when its last holder lets go of it — when the
//! answer's last byte has been written, or its connection closed.
//!
//! A tenant holds at most a quarter of the budget ([`TENANT_SHARE`]), or one body if that
//! is larger: one tenant's replays to clients that do not read (each holding its copy
//! until `server.response_write_timeout`) cannot take the budget from every other
//! tenant's. And tenants that already hold bodies leave a quarter of the budget free
//! between them: a tenant's first body may use it, its next ones may not — so a few noisy
//! tenants, each within its quarter, cannot take it all from the rest either.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, Weak};

use bytes::Bytes;
use idem_core::{Busy, LedgerError, Scope};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, watch};
use uuid::Uuid;

/// Bodies up to this size come with the row; larger ones are read on their own. (The
/// same number is written into the SQL of `record_columns!`.)
pub const INLINE: usize = 64 * 1024;

/// The default of `server.max_replay_bytes_in_flight`.
pub const DEFAULT_BUDGET: usize = 256 << 20;

/// Reads one row's response body, fenced by its attempt: `None` when the row no longer
/// holds that attempt's completed answer.
pub const BODY_SQL: &str = concat!(
    "SELECT k.response_body FROM idempotency_keys AS k WHERE ",
    super::rules::owned_by_attempt!(),
    " AND k.status = 'completed'"
);

/// The share of the budget one tenant may hold (one body always fits, whatever its size).
pub const TENANT_SHARE: usize = 4;

/// Bytes of large bodies held, by tenant.
type Tenants = Arc<Mutex<HashMap<String, usize>>>;

/// One stored body: its row's scope and attempt.
type Key = (Scope, Uuid);

/// What the registry knows of one body.
enum Slot {
    /// Being read; the reader announces how it went (or drops the sender: read again).
    Reading(watch::Receiver<Option<Read>>),
    /// Held by someone, for as long as anyone holds it.
    Held(Weak<Held>),
}

/// How a read shared by several callers went.
#[derive(Clone)]
enum Read {
    Held(Weak<Held>),
    Busy(Busy),
    Failed(Arc<LedgerError>),
}

/// What one caller does about a body.
enum Role {
    Read(watch::Sender<Option<Read>>),
    Wait(watch::Receiver<Option<Read>>),
}

type Slots = Arc<Mutex<HashMap<Key, Slot>>>;

/// The large bodies in memory, and their budget: the gateway's ledger has one, and so
/// does each embedded-mode service ([`super::in_tx::claim`]).
pub struct Bodies {
    slots: Slots,
    tenants: Tenants,
    /// The budget in KiB (a semaphore counts up to `u32` per acquire).
    budget: Arc<Semaphore>,
    budget_bytes: usize,
    reads: AtomicU64,
}

impl std::fmt::Debug for Bodies {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Bodies")
            .field("budget_bytes", &self.budget_bytes)
            .field("held_bytes", &self.held_bytes())
            .finish_non_exhaustive()
    }
}

/// One body in memory. Its bytes leave the budget when it is dropped.
struct Held {
    body: Vec<u8>,
    key: Key,
    slots: Slots,
    _share: Share,
    _permit: OwnedSemaphorePermit,
}

impl Drop for Held {
    fn drop(&mut self) {
        let mut slots = self.slots.lock().expect("bodies lock");
        if let Some(Slot::Held(weak)) = slots.get(&self.key)
            && weak.strong_count() == 0
        {
            slots.remove(&self.key);
        }
    }
}

/// What a [`Bytes`] of a held body keeps alive.
struct Owner(Arc<Held>);

impl AsRef<[u8]> for Owner {
    fn as_ref(&self) -> &[u8] {
        &self.0.body
    }
}

fn shared(held: Arc<Held>) -> Bytes {
    Bytes::from_owner(Owner(held))
}

/// Bytes of one body counted in its tenant's share, given back when dropped (however
/// the read that took them ends).
struct Share {
    tenants: Tenants,
    tenant: String,
    len: usize,
}

impl Share {
    /// `len` more bytes for `tenant`, if it holds none yet, or they fit in `limit` and
    /// leave the reserve free (`leaves_reserve`): tenants that already hold bodies leave
    /// it to those that hold none.
    fn take(
        tenants: &Tenants,
        tenant: &str,
        len: usize,
        limit: usize,
        leaves_reserve: impl FnOnce() -> bool,
    ) -> Option<Self> {
        let mut held = tenants.lock().expect("bodies lock");
        let mine = held.get(tenant).copied().unwrap_or(0);
        if mine > 0 && (mine + len > limit || !leaves_reserve()) {
            return None;
        }
        *held.entry(tenant.to_owned()).or_default() += len;
        Some(Self {
            tenants: tenants.clone(),
            tenant: tenant.to_owned(),
            len,
        })
    }

    /// Counts `len` bytes instead (the body read was not the size its row said).
    fn resize(&mut self, len: usize) {
        let mut held = self.tenants.lock().expect("bodies lock");
        let bytes = held.entry(self.tenant.clone()).or_default();
        *bytes = bytes.saturating_sub(self.len) + len;
        self.len = len;
    }
}

impl Drop for Share {
    fn drop(&mut self) {
        let mut held = self.tenants.lock().expect("bodies lock");
        if let Some(bytes) = held.get_mut(&self.tenant) {
            *bytes = bytes.saturating_sub(self.len);
            if *bytes == 0 {
                held.remove(&self.tenant);
            }
        }
    }
}

fn kib(bytes: usize) -> u32 {
    u32::try_from(bytes.div_ceil(1024)).unwrap_or(u32::MAX)
}

/// Drops the registry's `Reading` slot of a read that did not finish (its future was
/// dropped, or it failed), so that the next reader starts afresh.
struct Unfinished<'a> {
    slots: &'a Slots,
    key: Option<Key>,
}

impl Drop for Unfinished<'_> {
    fn drop(&mut self) {
        if let Some(key) = self.key.take() {
            let mut slots = self.slots.lock().expect("bodies lock");
            if matches!(slots.get(&key), Some(Slot::Reading(_))) {
                slots.remove(&key);
            }
        }
    }
}

impl Bodies {
    /// At most `budget_bytes` of large bodies held at once.
    pub fn new(budget_bytes: usize) -> Self {
        Self {
            slots: Arc::default(),
            tenants: Arc::default(),
            budget: Arc::new(Semaphore::new(kib(budget_bytes) as usize)),
            budget_bytes,
            reads: AtomicU64::new(0),
        }
    }

    /// Bytes of large bodies held now (rounded up to KiB per body).
    pub fn held_bytes(&self) -> usize {
        let free = self.budget.available_permits();
        (kib(self.budget_bytes) as usize).saturating_sub(free) * 1024
    }

    /// Large bodies read from Postgres so far.
    pub(crate) fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }

    /// The body of `key` (`len` bytes), shared with whoever else holds it; read with
    /// `read` only if nobody does or is reading it. `None`: the row changed meanwhile.
    pub(crate) async fn get<F, Fut>(
        &self,
        key: Key,
        len: usize,
        read: F,
    ) -> Result<Option<Bytes>, LedgerError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Option<Vec<u8>>, LedgerError>>,
    {
        let mut read = Some(read);
        loop {
            let role = {
                let mut slots = self.slots.lock().expect("bodies lock");
                let live = match slots.get(&key) {
                    Some(Slot::Held(weak)) => weak.upgrade().map(Ok),
                    Some(Slot::Reading(rx)) => Some(Err(rx.clone())),
                    None => None,
                };
                match live {
                    Some(Ok(held)) => return Ok(Some(shared(held))),
                    Some(Err(rx)) => Role::Wait(rx),
                    None => {
                        let (tx, rx) = watch::channel(None);
                        slots.insert(key.clone(), Slot::Reading(rx));
                        Role::Read(tx)
                    }
                }
            };
            let mut waiting = match role {
                Role::Read(tx) => {
                    let read = read.take().expect("a caller reads at most once");
                    return self.read(key, len, read, tx).await;
                }
                Role::Wait(rx) => rx,
            };
            // Another caller is reading this body: take its outcome.
            if waiting.changed().await.is_err() {
                continue; // it gave up: read again
            }
            let outcome = waiting.borrow().clone();
            match outcome {
                Some(Read::Held(weak)) => {
                    if let Some(held) = weak.upgrade() {
                        return Ok(Some(shared(held)));
                    }
                }
                Some(Read::Busy(busy)) => return Err(LedgerError::busy(busy)),
                Some(Read::Failed(error)) => return Err(LedgerError::new(Shared(error))),
                None => {}
            }
        }
    }

    async fn read<F, Fut>(
        &self,
        key: Key,
        len: usize,
        read: F,
        tx: watch::Sender<Option<Read>>,
    ) -> Result<Option<Bytes>, LedgerError>
    where
        F: FnOnce() -> Fut,
        Fut: Future<Output = Result<Option<Vec<u8>>, LedgerError>>,
    {
        let mut unfinished = Unfinished {
            slots: &self.slots,
            key: Some(key.clone()),
        };
        let limit = self.budget_bytes / TENANT_SHARE;
        // A quarter of the budget stays free for tenants that hold nothing yet.
        let reserve = kib(self.budget_bytes) as usize / TENANT_SHARE;
        let leaves_reserve = || self.budget.available_permits() >= kib(len) as usize + reserve;
        let share = Share::take(&self.tenants, &key.0.tenant, len, limit, leaves_reserve);
        let permit = share
            .as_ref()
            .and_then(|_| self.budget.clone().try_acquire_many_owned(kib(len)).ok());
        let (Some(mut share), Some(permit)) = (share, permit) else {
            let busy = Busy {
                needed: len,
                budget: self.budget_bytes,
            };
            let _ = tx.send(Some(Read::Busy(busy.clone())));
            return Err(LedgerError::busy(busy));
        };
        self.reads.fetch_add(1, Ordering::Relaxed);
        let body = match read().await {
            Ok(Some(body)) => body,
            // The row moved on: nothing to share; each caller reads the row again.
            Ok(None) => return Ok(None),
            Err(error) => {
                let error = Arc::new(error);
                let _ = tx.send(Some(Read::Failed(error.clone())));
                return Err(LedgerError::new(Shared(error)));
            }
        };
        if body.len() != len {
            share.resize(body.len());
        }
        let held = Arc::new(Held {
            body,
            key: key.clone(),
            slots: self.slots.clone(),
            _share: share,
            _permit: permit,
        });
        self.slots
            .lock()
            .expect("bodies lock")
            .insert(key, Slot::Held(Arc::downgrade(&held)));
        unfinished.key = None;
        let _ = tx.send(Some(Read::Held(Arc::downgrade(&held))));
        Ok(Some(shared(held)))
    }
}

/// An error of a read shared by several callers.
#[derive(Debug, thiserror::Error)]
#[error(transparent)]
struct Shared(Arc<LedgerError>);

#[cfg(test)]
mod tests {
    use super::*;

    const BODY: usize = 512 * 1024;

    /// `tenant`'s read of its `n`th body of [`BODY`] bytes, held by the caller.
    async fn read(bodies: &Bodies, tenant: &str, n: usize) -> Result<Bytes, LedgerError> {
        let key = idem_core::IdempotencyKey::parse(format!("k-{n}").as_bytes()).unwrap();
        let scope = Scope::new(tenant, "POST /payments", key);
        bodies
            .get((scope, Uuid::new_v4()), BODY, || async {
                Ok(Some(vec![7; BODY]))
            })
            .await
            .map(|body| body.expect("read"))
    }

    /// Tenants that already hold bodies leave a quarter of the budget to those that hold
    /// none: four noisy tenants, each within its own quarter, cannot take it all. (On
    /// eee0432 they could: "a quarter was kept: 8 bodies held".)
    #[tokio::test]
    async fn four_tenants_cannot_take_the_whole_replay_budget() {
        let bodies = Bodies::new(4 * 1024 * 1024);
        let mut held = Vec::new();
        for tenant in ["a", "b", "c", "d"] {
            for n in 0..2 {
                // Each within its quarter (2 × 512 KiB = 1 MiB); some refused all the same.
                if let Ok(body) = read(&bodies, tenant, n).await {
                    held.push(body);
                }
            }
        }
        assert!(
            held.len() < 8,
            "a quarter was kept: {} bodies held",
            held.len()
        );
        let fifth = read(&bodies, "e", 0).await;
        assert!(fifth.is_ok(), "a fifth tenant's first replay: {fifth:?}");
    }

    #[test]
    fn the_inline_limit_is_the_one_in_the_sql() {
        let sql = super::super::rules::record_columns!();
        assert!(
            sql.contains(&format!(
                "octet_length(k.response_body) <= {}",
                super::INLINE
            )),
            "{sql}"
        );
    }
}
