//! [`Tx`]: the request's transaction, handed to the handler.
//!
//! The layer begins the transaction and claims the key on it, then leaves it in the
//! request's extensions in a [`Slot`]. The handler's `Tx` takes it out of the slot and
//! puts it back when it is dropped (when the handler returns), so the layer can store
//! the answer on it and commit. A handler cannot commit or roll back itself: the
//! transaction's end is the layer's.

use std::ops::{Deref, DerefMut};
use std::sync::{Arc, Mutex};

use axum::extract::FromRequestParts;
use axum::response::{IntoResponse, Response};
use http::request::Parts;
use idem_core::Scope;
use idem_http::Problem;
use sqlx::{PgConnection, Postgres, Transaction};

/// The request's transaction, as the handler sees it: `&mut *tx` is a connection to write
/// the business data through. Whatever it writes commits together with the key's stored
/// answer, or not at all.
pub struct Tx {
    tx: Option<Transaction<'static, Postgres>>,
    slot: Slot,
}

impl Tx {
    /// The transaction a fresh slot holds, for an operation run without a request.
    pub(crate) fn in_slot(slot: Slot) -> Self {
        let tx = slot.take();
        assert!(tx.is_some(), "a fresh slot holds its transaction");
        Self { tx, slot }
    }
}

impl std::fmt::Debug for Tx {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tx").finish_non_exhaustive()
    }
}

impl Deref for Tx {
    type Target = PgConnection;
    fn deref(&self) -> &PgConnection {
        self.tx
            .as_ref()
            .expect("a Tx holds its transaction until dropped")
    }
}

impl DerefMut for Tx {
    fn deref_mut(&mut self) -> &mut PgConnection {
        self.tx
            .as_mut()
            .expect("a Tx holds its transaction until dropped")
    }
}

impl Drop for Tx {
    fn drop(&mut self) {
        self.slot.put(self.tx.take());
    }
}

/// Where the transaction waits while the handler does not hold it.
#[derive(Clone, Default)]
pub(crate) struct Slot(Arc<Mutex<Option<Transaction<'static, Postgres>>>>);

impl Slot {
    pub(crate) fn new(tx: Transaction<'static, Postgres>) -> Self {
        Self(Arc::new(Mutex::new(Some(tx))))
    }

    /// Whether the operation (a handler, a job's closure) has given the transaction back:
    /// its `Tx` dropped. If it moved its `Tx` somewhere that outlives it (an answer's body,
    /// a task), nothing written through it meanwhile may commit: the run is refused, and
    /// the transaction ends (rolls back) when that `Tx` is dropped.
    pub(crate) fn given_back(&self, scope: &Scope) -> Result<(), Problem> {
        if self.0.lock().expect("transaction slot").is_some() {
            return Ok(());
        }
        tracing::error!(
            ?scope,
            "the operation kept its Tx after it returned; its transaction is rolled back"
        );
        Err(Problem::Internal)
    }

    pub(crate) fn take(&self) -> Option<Transaction<'static, Postgres>> {
        self.0.lock().expect("transaction slot").take()
    }

    fn put(&self, tx: Option<Transaction<'static, Postgres>>) {
        *self.0.lock().expect("transaction slot") = tx;
    }
}

/// Refused when the handler's route has no idempotency layer, or the handler asked for
/// two `Tx`: a programming error of the service, answered 500.
#[derive(Debug)]
pub struct NoTransaction;

impl IntoResponse for NoTransaction {
    fn into_response(self) -> Response {
        tracing::error!(
            "Tx asked for on a route without the idempotency layer, or asked for twice"
        );
        Problem::Internal.into_response()
    }
}

impl<S: Send + Sync> FromRequestParts<S> for Tx {
    type Rejection = NoTransaction;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, NoTransaction> {
        let slot = parts.extensions.get::<Slot>().ok_or(NoTransaction)?.clone();
        let tx = slot.take().ok_or(NoTransaction)?;
        Ok(Self { tx: Some(tx), slot })
    }
}
