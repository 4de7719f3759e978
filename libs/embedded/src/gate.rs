//! One request per key at a time goes to Postgres from this process; its duplicates wait
//! here, in memory, holding no pooled connection, until it is done.
//!
//! Without it, every duplicate of a key whose first request is still running waits on
//! that request's row lock holding a connection of its own, for up to `lock_wait`, even
//! after its client hung up: a slow first request and a burst of retries take the pool,
//! and every tenant waits.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use idem_core::Scope;
use tokio::sync::Notify;
use tokio::sync::futures::OwnedNotified;

/// The keys whose requests are between their claim and their transaction's end.
#[derive(Debug, Default)]
pub(crate) struct Gates {
    busy: Mutex<HashMap<Scope, Arc<Notify>>>,
}

/// What [`Gates::enter`] gives.
pub(crate) enum Entry<'a> {
    /// This request has the key's turn until the guard is dropped.
    Turn(Turn<'a>),
    /// Another request of this process has it: ready when that one is done (created
    /// before the turn could end, so no wake-up is missed).
    Busy(OwnedNotified),
}

/// A key's turn; dropping it (however the request ends) wakes the waiters.
pub(crate) struct Turn<'a> {
    gates: &'a Gates,
    scope: &'a Scope,
}

impl Gates {
    pub(crate) fn enter<'a>(&'a self, scope: &'a Scope) -> Entry<'a> {
        let mut busy = self.busy.lock().expect("gates");
        match busy.get(scope) {
            Some(done) => Entry::Busy(done.clone().notified_owned()),
            None => {
                busy.insert(scope.clone(), Arc::default());
                Entry::Turn(Turn { gates: self, scope })
            }
        }
    }
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        let done = self.gates.busy.lock().expect("gates").remove(self.scope);
        if let Some(done) = done {
            done.notify_waiters();
        }
    }
}
