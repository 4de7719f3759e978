//! The ledger on a caller's transaction (embedded mode) against real Postgres: what its
//! statements cost Postgres to plan. Each request is a transaction of its own with one
//! claim and one completion, so a statement Postgres plans afresh on every execution
//! costs every request its planning (the group pipes' array statements cost more to plan
//! than to run).

mod common;

use std::time::Duration;

use idem_postgres::ledger::bodies::Bodies;

use common::*;
use idem_core::{AttemptId, BodyKind, Claim, ClaimResult, Fence, Fingerprint, Scope};
use idem_postgres::ledger::claim::{CLAIM_ONE_SQL, TAKE_OVER_ONE_SQL};
use idem_postgres::ledger::complete::COMPLETE_ONE_SQL;
use idem_postgres::ledger::in_tx;
use idem_testkit::TestDb;
use sqlx::{Connection, PgConnection};

/// A claim of `scope` by `attempt` with a 30 s lease and a minute's ttl.
fn claim_of<'a>(scope: &'a Scope, fingerprint: &'a Fingerprint, attempt: AttemptId) -> Claim<'a> {
    Claim {
        scope,
        fingerprint,
        attempt,
        lease: Duration::from_secs(30),
        ttl: Duration::from_secs(60),
        trace_context: None,
    }
}

/// `claim` on the transaction `tx`, as embedded mode sends it.
async fn claim_in(tx: &mut sqlx::PgConnection, claim: &Claim<'_>) -> ClaimResult {
    in_tx::claim(tx, claim, Duration::from_secs(5), &Bodies::new(1 << 20))
        .await
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_transactions_claim_and_completion_are_planned_once_per_connection_by_the_keys_index() {
    let db = TestDb::create().await;
    db.migrate().await;
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    // A table worth an index: with a few rows, a scan would be as good a plan.
    sqlx::query(
        "INSERT INTO idempotency_keys (tenant_id, endpoint, key, request_hash, status, \
           attempt, response_status, response_headers, response_body, completed_at, expires_at) \
         SELECT 'acme', 'POST /payments', 'old-' || n, decode(repeat('ab', 32), 'hex'), \
           'completed', gen_random_uuid(), 201, '[]', '\\x7b7d', now(), now() + interval '1 day' \
         FROM generate_series(1, 20000) AS n",
    )
    .execute(&mut conn)
    .await
    .unwrap();
    sqlx::query("ANALYZE idempotency_keys")
        .execute(&mut conn)
        .await
        .unwrap();

    let fingerprint = Fingerprint::compute("POST", "/payments", BodyKind::Raw, b"x").unwrap();
    let requests = 12;
    for n in 0..requests {
        let scope = scope(&format!("new-{n}"));
        let attempt = AttemptId::random();
        let mut tx = conn.begin().await.unwrap();
        let claim = claim_of(&scope, &fingerprint, attempt);
        let claimed = claim_in(&mut tx, &claim).await;
        assert!(matches!(claimed, ClaimResult::Claimed), "{claimed:?}");
        let fence = in_tx::complete(
            &mut tx,
            &scope,
            attempt,
            &fingerprint,
            &response("{}"),
            claim.ttl,
        )
        .await
        .unwrap()
        .fence();
        assert_eq!(fence, Fence::Held);
        tx.commit().await.unwrap();
    }

    // Retries of stored keys: the insert conflicts, the take-over reads the live row.
    for n in 1..=requests {
        let scope = scope(&format!("old-{n}"));
        let mut tx = conn.begin().await.unwrap();
        let claim = claim_of(&scope, &fingerprint, AttemptId::random());
        let found = claim_in(&mut tx, &claim).await;
        assert!(matches!(found, ClaimResult::Existing(_)), "{found:?}");
        tx.rollback().await.unwrap();
    }

    let prepared: Vec<(String, String, i64, i64)> = sqlx::query_as(
        "SELECT name, statement, generic_plans, custom_plans FROM pg_prepared_statements",
    )
    .fetch_all(&mut conn)
    .await
    .unwrap();
    let claim_args = "'acme', 'POST /payments', 'x', decode(repeat('ab', 32), 'hex'), \
                      gen_random_uuid(), 1000, NULL, 1000, '5000ms'";
    let complete_args =
        "'acme', 'POST /payments', 'x', gen_random_uuid(), 201, '[]', '\\x00', 1000, false";
    for (what, sql, args) in [
        ("claim", CLAIM_ONE_SQL, claim_args),
        ("take-over", TAKE_OVER_ONE_SQL, claim_args),
        ("completion", COMPLETE_ONE_SQL, complete_args),
    ] {
        let (name, _, generic, custom) = prepared
            .iter()
            .find(|(_, statement, _, _)| statement == sql)
            .unwrap_or_else(|| panic!("the {what} was not sent as a prepared statement"));
        // Postgres plans the first five executions for their values; from then on, a
        // statement whose generic plan is as good keeps that one plan.
        assert!(
            *generic >= requests - 5,
            "the {what} was planned for every execution: {custom} custom plans, {generic} generic"
        );
        // And that plan finds the key by its index, whatever the table holds.
        sqlx::query("SET plan_cache_mode = force_generic_plan")
            .execute(&mut conn)
            .await
            .unwrap();
        let plan: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "EXPLAIN EXECUTE {name}({args})"
        )))
        .fetch_all(&mut conn)
        .await
        .unwrap();
        let plan = plan.join("\n");
        assert!(
            plan.contains("idempotency_keys_pkey") && !plan.contains("Seq Scan"),
            "the {what}'s generic plan does not look the key up by its index:\n{plan}"
        );
    }
}

/// A claim that waited on another transaction's claim of its key judges the record it
/// then finds by the clock when it reads it, not by its transaction's start: a record
/// that expired during the wait is taken over, never replayed past its `expires_at`. (On
/// eee0432 `live!` compared with `now()`, the transaction's start: the claim got the
/// expired record back, "Existing(Record { … Completed … })".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_claim_that_waited_never_replays_a_record_past_its_expiry() {
    let db = TestDb::create().await;
    db.migrate().await;
    let fingerprint = Fingerprint::compute("POST", "/payments", BodyKind::Raw, b"x").unwrap();
    let scope = scope("expires-during-the-wait");
    // The first request claims the key with a short ttl and completes, uncommitted.
    let mut conn = PgConnection::connect(&db.url).await.unwrap();
    let first = AttemptId::random();
    let mut tx = conn.begin().await.unwrap();
    let claim = Claim {
        ttl: Duration::from_millis(800),
        ..claim_of(&scope, &fingerprint, first)
    };
    assert!(matches!(
        claim_in(&mut tx, &claim).await,
        ClaimResult::Claimed
    ));
    in_tx::complete(
        &mut tx,
        &scope,
        first,
        &fingerprint,
        &response("{}"),
        claim.ttl,
    )
    .await
    .unwrap();
    // A retry's claim waits on that uncommitted claim.
    let retry = tokio::spawn({
        let url = db.url.clone();
        let scope = scope.clone();
        async move {
            let mut conn = PgConnection::connect(&url).await.unwrap();
            let mut tx = conn.begin().await.unwrap();
            let claim = claim_of(&scope, &fingerprint, AttemptId::random());
            let claimed = claim_in(&mut tx, &claim).await;
            tx.rollback().await.unwrap();
            claimed
        }
    });
    // Real time: Postgres's clock judges the expiry. The first commits once its record
    // has expired.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    tx.commit().await.unwrap();
    let claimed = retry.await.unwrap();
    assert!(matches!(claimed, ClaimResult::Claimed), "{claimed:?}");
}
