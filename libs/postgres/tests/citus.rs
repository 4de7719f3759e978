//! Whether the ledger could be distributed by tenant (Citus,
//! `create_distributed_table('idempotency_keys', 'tenant_id')`): every statement the
//! ledger sends is parsed, and each that a request or a tenant's lookup sends must pin
//! every read or write of `idempotency_keys` to one tenant by a `tenant_id = $n` of its
//! own — what Citus's router planner needs to send the statement to one shard. The
//! statements that span tenants are listed here with the reason; a new one fails this
//! test until it is listed (docs/scale-out.md says how each runs distributed).

use std::collections::BTreeSet;
use std::ops::ControlFlow;

use idem_postgres::ledger::{
    bodies, callbacks, claim, complete, operator, purge, reconcile, release, settled,
};
use sqlparser::ast::{
    BinaryOperator, Expr, SetExpr, Statement, Value, visit_expressions, visit_relations,
};
use sqlparser::dialect::PostgreSqlDialect;
use sqlparser::parser::Parser;

/// Statements that name one tenant: a request's claim, completion and reads, a tenant's
/// lookups, the reconciler's and the operator's work on one key.
const ONE_TENANT: &[(&str, &str)] = &[
    ("CLAIM_ONE_SQL", claim::CLAIM_ONE_SQL),
    ("TAKE_OVER_ONE_SQL", claim::TAKE_OVER_ONE_SQL),
    ("GET_SQL", claim::GET_SQL),
    ("COMPLETE_ONE_SQL", complete::COMPLETE_ONE_SQL),
    ("BODY_SQL", bodies::BODY_SQL),
    ("RELEASE_SQL", release::RELEASE_SQL),
    ("HOLD_SQL", release::HOLD_SQL),
    ("RESOLVE_SQL", reconcile::RESOLVE_SQL),
    ("DEFER_SQL", reconcile::DEFER_SQL),
    ("SHOW_SQL", operator::SHOW_SQL),
    ("LOOKUP_SQL", operator::LOOKUP_SQL),
    ("LIST_SQL", operator::LIST_SQL),
    ("LIST_COMPLETED_SQL", operator::LIST_COMPLETED_SQL),
    ("LIST_IN_PROGRESS_SQL", operator::LIST_IN_PROGRESS_SQL),
    ("LIST_TENANT_HELD_SQL", operator::LIST_TENANT_HELD_SQL),
    ("OPERATOR_RELEASE_SQL", operator::OPERATOR_RELEASE_SQL),
    ("MARK_SQL", callbacks::MARK_SQL),
];

/// Statements for one tenant that do not yet say so where Citus would look, and why. The
/// test fails when one of them is fixed (take it off) as much as when another joins them.
/// (Embedded mode's claim was here, naming its tenant once in a CTE, until it became a
/// plain insert.)
const NOT_YET_ROUTABLE: &[(&str, &str)] = &[];

/// Statements that span tenants, and why (docs/scale-out.md: how each runs on Citus).
const CROSS_TENANT: &[(&str, &str, &str)] = &[
    (
        "CLAIM_SQL",
        claim::CLAIM_SQL,
        "group commit: one statement for the claims of many tenants",
    ),
    (
        "UNDO_SQL",
        claim::UNDO_SQL,
        "group commit: the claims of a group whose requests gave up",
    ),
    (
        "COMPLETE_SQL",
        complete::COMPLETE_SQL,
        "group commit: one statement for the completions of many tenants",
    ),
    (
        "TAKE_SQL",
        reconcile::TAKE_SQL,
        "the reconciler's scan for held keys, every tenant's",
    ),
    (
        "PURGE_SQL",
        purge::PURGE_SQL,
        "the purge of expired keys, every tenant's",
    ),
    (
        "LIST_HELD_SQL",
        operator::LIST_HELD_SQL,
        "the operator's list of held keys, every tenant's",
    ),
    (
        "COUNT_HELD_SQL",
        operator::COUNT_HELD_SQL,
        "the held-keys gauge, every tenant's",
    ),
    (
        "ENDPOINTS_SQL",
        operator::ENDPOINTS_SQL,
        "the endpoints stored, every tenant's (the rename check at start)",
    ),
    (
        "SETTLED_SQL",
        settled::SETTLED_SQL,
        "the keys a replica's result waiters wait on, every tenant's, in one statement a poll",
    ),
];

/// Statements that never touch `idempotency_keys`, and what they do.
const OTHER_TABLES: &[(&str, &str, &str)] = &[
    (
        "PURGE_FORCED_SQL",
        operator::PURGE_FORCED_SQL,
        "forgets the marks of forced releases a day old (forced_releases, keyed by tenant too)",
    ),
    (
        "TAKE_CALLBACKS_SQL",
        callbacks::TAKE_CALLBACKS_SQL,
        "a sender takes the callbacks due, of every tenant it sends for (callbacks, keyed by tenant too)",
    ),
    (
        "CALLBACK_DELIVERED_SQL",
        callbacks::CALLBACK_DELIVERED_SQL,
        "one callback, by its tenant and attempt",
    ),
    (
        "CALLBACK_FAILED_SQL",
        callbacks::CALLBACK_FAILED_SQL,
        "one callback, by its tenant and attempt",
    ),
    (
        "PURGE_CALLBACKS_SQL",
        callbacks::PURGE_CALLBACKS_SQL,
        "forgets the callbacks finished a day ago",
    ),
];

/// How often `idempotency_keys` is read or written, and how often a `tenant_id` is
/// compared with a parameter, in one statement.
fn count(sql: &str) -> (usize, usize) {
    let statements = Parser::parse_sql(&PostgreSqlDialect {}, sql)
        .unwrap_or_else(|e| panic!("the ledger's SQL does not parse: {e}\n{sql}"));
    let mut tables = 0;
    let _ = visit_relations(&statements, |relation| {
        if relation.to_string() == "idempotency_keys" {
            tables += 1;
        }
        ControlFlow::<()>::Continue(())
    });
    // An insert of one row whose tenant is a parameter: Citus routes it by that value.
    let mut pinned = statements
        .iter()
        .filter(|statement| inserts_one_tenant(statement))
        .count();
    let _ = visit_expressions(&statements, |expr| {
        if let Expr::BinaryOp {
            left,
            op: BinaryOperator::Eq,
            right,
        } = expr
            && ((names_tenant(left) && is_parameter(right))
                || (is_parameter(left) && names_tenant(right)))
        {
            pinned += 1;
        }
        ControlFlow::<()>::Continue(())
    });
    (tables, pinned)
}

/// `INSERT INTO … (…, tenant_id, …) VALUES (…, $n, …)`, one row.
fn inserts_one_tenant(statement: &Statement) -> bool {
    let Statement::Insert(insert) = statement else {
        return false;
    };
    let Some(column) = insert
        .columns
        .iter()
        .position(|c| c.to_string() == "tenant_id")
    else {
        return false;
    };
    let Some(SetExpr::Values(values)) = insert.source.as_ref().map(|query| &*query.body) else {
        return false;
    };
    matches!(&values.rows[..], [row] if row.get(column).is_some_and(is_parameter))
}

fn names_tenant(expr: &Expr) -> bool {
    match expr {
        Expr::Identifier(ident) => ident.value == "tenant_id",
        Expr::CompoundIdentifier(parts) => parts.last().is_some_and(|i| i.value == "tenant_id"),
        _ => false,
    }
}

fn is_parameter(expr: &Expr) -> bool {
    match expr {
        Expr::Value(value) => matches!(value.value, Value::Placeholder(_)),
        Expr::Cast { expr, .. } | Expr::Nested(expr) => is_parameter(expr),
        _ => false,
    }
}

#[test]
fn every_statement_for_one_tenant_names_its_tenant_wherever_it_touches_the_ledger() {
    let known: BTreeSet<&str> = NOT_YET_ROUTABLE.iter().map(|(name, _)| *name).collect();
    let mut unpinned = Vec::new();
    let mut fixed = Vec::new();
    for (name, sql) in ONE_TENANT {
        let (tables, pinned) = count(sql);
        assert!(
            tables > 0,
            "{name} does not touch idempotency_keys: list it elsewhere"
        );
        match (pinned < tables, known.contains(name)) {
            (true, false) => unpinned.push(format!(
                "{name}: idempotency_keys {tables} times, tenant_id = $n {pinned} times\n  {sql}"
            )),
            (false, true) => fixed.push(*name),
            _ => {}
        }
    }
    assert!(
        unpinned.is_empty(),
        "statements a request or a tenant sends that Citus could not route to one shard:\n{}",
        unpinned.join("\n")
    );
    assert!(
        fixed.is_empty(),
        "now routable, take them off NOT_YET_ROUTABLE: {fixed:?}"
    );
}

#[test]
fn every_statement_of_the_ledger_is_listed() {
    let listed: BTreeSet<&str> = ONE_TENANT
        .iter()
        .map(|(name, _)| *name)
        .chain(CROSS_TENANT.iter().map(|(name, _, _)| *name))
        .chain(OTHER_TABLES.iter().map(|(name, _, _)| *name))
        .collect();
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/src/ledger");
    let mut found = BTreeSet::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let text = std::fs::read_to_string(entry.unwrap().path()).unwrap();
        for line in text.lines() {
            if let Some(rest) = line.trim_start().strip_prefix("pub const ")
                && let Some((name, _)) = rest.split_once(':')
                && name.ends_with("_SQL")
            {
                found.insert(name.to_string());
            }
        }
    }
    let unlisted: Vec<_> = found
        .iter()
        .filter(|n| !listed.contains(n.as_str()))
        .collect();
    assert!(
        unlisted.is_empty(),
        "statements in src/ledger not listed in tests/citus.rs (one tenant, or spanning tenants and why): {unlisted:?}"
    );
    for (name, sql, why) in CROSS_TENANT {
        assert!(
            count(sql).0 > 0,
            "{name} ({why}) does not touch idempotency_keys"
        );
    }
    for (name, sql, why) in OTHER_TABLES {
        assert_eq!(count(sql).0, 0, "{name} ({why}) touches idempotency_keys");
    }
}
