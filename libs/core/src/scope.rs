//! The scope of an operation: one (tenant, endpoint, key) is one logical operation.

use std::fmt;

use crate::key::IdempotencyKey;

/// `(tenant, endpoint, key)`. The endpoint is the route's method and path template as
/// configured (`POST /orders/{id}/refunds`), so a key used on two endpoints, or by two
/// tenants, names two different operations.
#[derive(Clone, PartialEq, Eq, Hash)]
pub struct Scope {
    pub tenant: String,
    pub endpoint: String,
    pub key: IdempotencyKey,
}

impl Scope {
    pub fn new(
        tenant: impl Into<String>,
        endpoint: impl Into<String>,
        key: IdempotencyKey,
    ) -> Self {
        Self {
            tenant: tenant.into(),
            endpoint: endpoint.into(),
            key,
        }
    }
}

impl fmt::Debug for Scope {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "Scope({:?}, {:?}, {:?})",
            self.tenant,
            self.endpoint,
            self.key.as_str()
        )
    }
}
