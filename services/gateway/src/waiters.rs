//! Result waiters: a client that asks for a key's result with `Prefer: wait=N` waits for
//! its operation to settle, up to `server.max_result_wait`, and is answered within about
//! half a second of the settlement on any replica, whoever settled it — the first
//! execution here or on another replica, the reconciler's probe, an operator.
//!
//! A waiter holds no Postgres connection and no request slot: it waits on its scope's
//! [`Notify`]. One task per replica ([`Waiters::poll`], every [`POLL`]) asks the ledger,
//! in one statement for every key waited on, which have settled, and wakes their waiters —
//! a wake-up never depends on Redis; where Redis is up, its announcement of a completion
//! wakes them sooner. A tenant has at most `server.max_result_waiters` waiters per replica
//! (beyond, 429 `tenant-concurrency-limited`).

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use idem_core::Scope;
use idem_postgres::PgLedger;
use tokio::sync::Notify;

use crate::problem::Problem;

/// How often the keys waited on are asked after.
pub const POLL: Duration = Duration::from_millis(500);

/// Every waiter of this replica.
#[derive(Debug)]
pub struct Waiters {
    max_per_tenant: usize,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    per_tenant: HashMap<String, usize>,
    scopes: HashMap<Scope, Watched>,
}

#[derive(Debug)]
struct Watched {
    settled: Arc<Notify>,
    waiters: usize,
}

/// One waiter's place, given back when dropped.
#[derive(Debug)]
pub struct Waiting<'a> {
    waiters: &'a Waiters,
    scope: Scope,
    settled: Arc<Notify>,
}

impl Waiters {
    pub fn new(max_per_tenant: usize) -> Self {
        Self {
            max_per_tenant,
            state: Mutex::default(),
        }
    }

    /// A place to wait on `scope`'s settlement, within its tenant's cap.
    pub fn wait_on(&self, scope: &Scope) -> Result<Waiting<'_>, Problem> {
        let mut state = self.state.lock().expect("waiters");
        let mine = state
            .per_tenant
            .entry(scope.tenant.to_string())
            .or_default();
        if *mine >= self.max_per_tenant {
            return Err(Problem::TenantConcurrencyLimited);
        }
        *mine += 1;
        let watched = state
            .scopes
            .entry(scope.clone())
            .or_insert_with(|| Watched {
                settled: Arc::new(Notify::new()),
                waiters: 0,
            });
        watched.waiters += 1;
        let settled = watched.settled.clone();
        Ok(Waiting {
            waiters: self,
            scope: scope.clone(),
            settled,
        })
    }

    /// Waiters now, in all (a gauge).
    pub fn count(&self) -> usize {
        let state = self.state.lock().expect("waiters");
        state.per_tenant.values().sum()
    }

    /// Asks the ledger which of the keys waited on have settled, in one statement, and
    /// wakes their waiters. Nothing is asked while nobody waits.
    pub async fn poll(&self, ledger: &PgLedger) {
        let watched: Vec<(Scope, Arc<Notify>)> = {
            let state = self.state.lock().expect("waiters");
            state
                .scopes
                .iter()
                .map(|(scope, w)| (scope.clone(), w.settled.clone()))
                .collect()
        };
        if watched.is_empty() {
            return;
        }
        let scopes: Vec<&Scope> = watched.iter().map(|(scope, _)| scope).collect();
        match ledger.settled(&scopes).await {
            Ok(settled) => {
                for ((_, notify), settled) in watched.iter().zip(settled) {
                    if settled {
                        notify.notify_waiters();
                    }
                }
            }
            // The waiters' own deadlines still end their waits.
            Err(error) => tracing::warn!(%error, "result waiters: the ledger could not be asked"),
        }
    }
}

impl Waiting<'_> {
    /// Resolves once the poll (or Redis, via the caller) found the scope settled.
    pub fn settled(&self) -> tokio::sync::futures::Notified<'_> {
        self.settled.notified()
    }
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        let mut state = self.waiters.state.lock().expect("waiters");
        if let Some(mine) = state.per_tenant.get_mut(self.scope.tenant.as_str()) {
            *mine -= 1;
            if *mine == 0 {
                state.per_tenant.remove(self.scope.tenant.as_str());
            }
        }
        if let Some(watched) = state.scopes.get_mut(&self.scope) {
            watched.waiters -= 1;
            if watched.waiters == 0 {
                state.scopes.remove(&self.scope);
            }
        }
    }
}
