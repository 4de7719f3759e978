//! Key layout. Every key of a scope shares one hash tag, so the lock, the cached
//! response and the scope's channel live in one Redis Cluster slot, and scripts that
//! touch both keys never fail with `CROSSSLOT`:
//!
//! ```text
//! {prefix}{<tenant>|<endpoint>|<key>}:l      the in-progress lock  ("<token>:<ms since epoch>")
//! {prefix}{<tenant>|<endpoint>|<key>}:r      the completed response (see `codec`)
//! {prefix}{<tenant>|<endpoint>|<key>}:done   pub/sub channel: completed or released
//! ```
//!
//! Components are percent-escaped (`%`, `{`, `}`, `|`), so two different scopes can never
//! map to one key and the hash tag always spans the whole scope. The tenant is always
//! part of the key.

use idem_core::Scope;

/// The keys of one scope.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScopeKeys {
    pub lock: String,
    pub response: String,
    pub channel: String,
}

pub fn scope_keys(prefix: &str, scope: &Scope) -> ScopeKeys {
    let base = format!(
        "{prefix}{{{}|{}|{}}}",
        escape(&scope.tenant),
        escape(&scope.endpoint),
        escape(scope.key.as_str())
    );
    ScopeKeys {
        lock: format!("{base}:l"),
        response: format!("{base}:r"),
        channel: format!("{base}:done"),
    }
}

fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '%' => out.push_str("%25"),
            '{' => out.push_str("%7B"),
            '}' => out.push_str("%7D"),
            '|' => out.push_str("%7C"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::IdempotencyKey;

    fn keys(tenant: &str, endpoint: &str, key: &str) -> ScopeKeys {
        scope_keys(
            "idem:",
            &Scope::new(
                tenant,
                endpoint,
                IdempotencyKey::parse(key.as_bytes()).unwrap(),
            ),
        )
    }

    #[test]
    fn layout_carries_the_tenant_in_one_hash_tag() {
        let k = keys("acme", "POST /payments", "k-1");
        assert_eq!(k.lock, "idem:{acme|POST /payments|k-1}:l");
        assert_eq!(k.response, "idem:{acme|POST /payments|k-1}:r");
        assert_eq!(k.channel, "idem:{acme|POST /payments|k-1}:done");
    }

    #[test]
    fn separators_and_braces_in_components_cannot_merge_scopes() {
        assert_ne!(keys("a|b", "POST /p", "k"), keys("a", "b|POST /p", "k"));
        let k = keys("acme", "POST /p", "a}b{c");
        assert_eq!(k.lock, "idem:{acme|POST /p|a%7Db%7Bc}:l");
        // The hash tag is everything between the first '{' and the next '}'.
        let tag = &k.lock[k.lock.find('{').unwrap()..=k.lock.find('}').unwrap()];
        assert_eq!(tag, "{acme|POST /p|a%7Db%7Bc}");
    }
}
