//! `payments-demo`: a small but real upstream for idemgate (docs/architecture.md, "The demo upstream").
//!
//! It deliberately does **no** deduplication of its own: every `POST` that reaches it
//! inserts a row, so counting rows in `demo_payments` counts executions.
//!
//! - `POST /payments` `{"orderId": "…", "amountUah": 100}` → 201, one `demo_payments` row
//! - `POST /refunds` `{"paymentId": "…", "amountUah": 50}` → 201, one `demo_refunds` row
//! - `POST /webhooks/payments`: `POST /payments`, for a webhook route in front of it
//! - `GET /payments/by-key/{key}`, `GET /refunds/by-key/{key}` → 200 with the same body, or 404;
//!   with `Idempotency-Attempt`, only the operation that attempt made (each row keeps the
//!   `Idempotency-Attempt` it arrived with, in `idempotency_attempt`)
//! - `X-Demo-Delay-Ms: N` sleeps after the insert committed; `X-Demo-Fail: 500` answers
//!   500 without inserting.
//!
//! Environment: `PAYMENTS_DEMO_LISTEN` (default `127.0.0.1:9090`) and
//! `PAYMENTS_DEMO_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/payments_demo`).
//!
//! With `PAYMENTS_DEMO_MODE=embedded` (docs/embedded-mode.md) it is its own idempotency layer instead
//! of idemgate's upstream: `POST /payments` and `POST /refunds` run behind `idem-embedded`
//! (endpoints `"POST /payments"`, `"POST /refunds"`), with the `[auth]` and
//! `[idempotency]` of the gateway config file in `PAYMENTS_DEMO_CONFIG`. The key's claim,
//! the payment row, an outbox row and the stored answer commit in one transaction; a small
//! worker delivers the outbox after commit ([`outbox`]). `X-Demo-Delay-Ms` then sleeps
//! after the insert and before the commit, and `X-Demo-Fail: 500` answers 500 after the
//! insert (so it is rolled back).
//!
//! With `PAYMENTS_DEMO_MODE=consumer` it pays the commands of a Redis Stream instead, each
//! at most once, through `idem-embedded`'s `once` ([`consumer`]); it serves only
//! `GET /healthz` then.
//!
//! With `PAYMENTS_DEMO_MODE=processor` it is a card processor instead ([`processor`]):
//! `POST /charges` charges once per `Idempotency-Key`, as the downstream a payment service
//! calls out to.
//!
//! # Why one file of ~400 lines
//! The demo is read as one page: its routes, the rows they write and the headers that
//! bend them for tests (delay, failure, probe) side by side; its embedded mode
//! (`embedded.rs`) and outbox worker (`outbox.rs`) are modules of their own.
#![forbid(unsafe_code)]

mod consumer;
mod embedded;
mod outbox;
mod processor;

use std::time::Duration;

use anyhow::Context;
use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use sqlx::{PgPool, Row};
use uuid::Uuid;

/// mimalloc instead of glibc's malloc, as in the gateway: the demo is the upstream of
/// every benchmark case, and glibc's allocator was a visible share of its CPU.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SCHEMA: &[&str] = &[
    "CREATE TABLE IF NOT EXISTS demo_payments (
        id uuid PRIMARY KEY,
        tenant_id text NOT NULL,
        idempotency_key text,
        order_id text NOT NULL,
        amount_uah bigint NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    "CREATE INDEX IF NOT EXISTS demo_payments_key_idx ON demo_payments (tenant_id, idempotency_key)",
    "CREATE TABLE IF NOT EXISTS demo_refunds (
        id uuid PRIMARY KEY,
        tenant_id text NOT NULL,
        idempotency_key text,
        payment_id text NOT NULL,
        amount_uah bigint NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp())",
    "CREATE INDEX IF NOT EXISTS demo_refunds_key_idx ON demo_refunds (tenant_id, idempotency_key)",
    // Added later: tables made by an older demo gain it in place.
    "ALTER TABLE demo_payments ADD COLUMN IF NOT EXISTS idempotency_attempt text",
    "ALTER TABLE demo_refunds ADD COLUMN IF NOT EXISTS idempotency_attempt text",
    // Embedded mode's outbox: what is to be sent after a payment commits (outbox.rs).
    "CREATE TABLE IF NOT EXISTS demo_outbox (
        id uuid PRIMARY KEY,
        tenant_id text NOT NULL,
        topic text NOT NULL,
        payload jsonb NOT NULL,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp(),
        delivered_at timestamptz)",
    "CREATE INDEX IF NOT EXISTS demo_outbox_pending_idx ON demo_outbox (created_at) WHERE delivered_at IS NULL",
    processor::SCHEMA,
];

/// The two kinds of operation the demo performs; they differ only in names.
#[derive(Clone, Copy)]
pub(crate) struct Kind {
    table: &'static str,
    id_field: &'static str,
    ref_field: &'static str,
    ref_column: &'static str,
    path: &'static str,
    /// The outbox topic of a new one (embedded mode).
    topic: &'static str,
    /// The insert of a new one: id, tenant, key, attempt, reference, amount.
    insert: &'static str,
}

macro_rules! insert_sql {
    ($table:literal, $ref_column:literal) => {
        concat!(
            "INSERT INTO ",
            $table,
            " (id, tenant_id, idempotency_key, idempotency_attempt, ",
            $ref_column,
            ", amount_uah) VALUES ($1, $2, $3, $4, $5, $6)"
        )
    };
}

pub(crate) const PAYMENT: Kind = Kind {
    table: "demo_payments",
    id_field: "paymentId",
    ref_field: "orderId",
    ref_column: "order_id",
    path: "/payments",
    topic: "payment.created",
    insert: insert_sql!("demo_payments", "order_id"),
};
const REFUND: Kind = Kind {
    table: "demo_refunds",
    id_field: "refundId",
    ref_field: "paymentId",
    ref_column: "payment_id",
    path: "/refunds",
    topic: "refund.created",
    insert: insert_sql!("demo_refunds", "payment_id"),
};

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    // Logs, and traces over OTLP when OTEL_EXPORTER_OTLP_ENDPOINT is set (embedded mode's
    // `idemgate.request` spans, as the gateway exports them).
    let telemetry = idem_telemetry::init("payments-demo");
    let listen = std::env::var("PAYMENTS_DEMO_LISTEN").unwrap_or_else(|_| "127.0.0.1:9090".into());
    let url = std::env::var("PAYMENTS_DEMO_DATABASE_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/payments_demo".into());
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(16)
        // No ping before every statement (sqlx's default): it doubles the round trips
        // and costs Postgres CPU that the benchmark would book against idemgate.
        .test_before_acquire(false)
        .connect(&url)
        .await
        .with_context(|| format!("connecting to PAYMENTS_DEMO_DATABASE_URL={url}"))?;
    create_schema(&pool)
        .await
        .context("creating the demo tables")?;

    let mut consuming = None;
    let app = match std::env::var("PAYMENTS_DEMO_MODE").as_deref() {
        Ok("upstream") | Err(_) => upstream_app(pool.clone()),
        Ok("embedded") => embedded::app(pool.clone()).await?,
        Ok("processor") => processor::app(pool.clone()),
        Ok("consumer") => {
            let consumer = consumer::Consumer::from_env(pool.clone()).await?;
            let membership = consumer.membership();
            let run = tokio::spawn(consumer.run());
            let abort = run.abort_handle();
            tokio::spawn(async move {
                // It never returns; a panic ends the process, to be restarted like any
                // crashed consumer (what it left pending is taken over), rather than leave
                // a process that answers /healthz and consumes nothing.
                let ended = run.await;
                if ended.as_ref().is_err_and(|e| e.is_cancelled()) {
                    return;
                }
                tracing::error!(?ended, "the consumer stopped; exiting");
                std::process::exit(1);
            });
            consuming = Some((abort, membership));
            let metrics = idem_telemetry::prometheus();
            Router::new()
                .route("/healthz", get(|| async { "ok" }))
                .route("/metrics", get(move || async move { metrics.render() }))
        }
        Ok(other) => anyhow::bail!(
            "PAYMENTS_DEMO_MODE={other:?}: expected \"upstream\", \"embedded\", \"consumer\" or \"processor\""
        ),
    };
    let listener = tokio::net::TcpListener::bind(&listen)
        .await
        .with_context(|| format!("binding PAYMENTS_DEMO_LISTEN={listen}"))?;
    // On stdout, so a test that bound port 0 can read the port.
    println!("payments-demo listening on {}", listener.local_addr()?);
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let mut term =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
                    .expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        })
        .await?;
    // A clean exit: the consumer is stopped (a message cut off half way stays pending, for
    // another consumer: then this one stays in the group) and leaves its group.
    if let Some((consumer, membership)) = consuming {
        consumer.abort();
        membership.leave().await;
    }
    telemetry.shutdown();
    Ok(())
}

/// The demo as idemgate's upstream: every request that reaches it executes.
fn upstream_app(pool: PgPool) -> Router {
    Router::new()
        .route("/payments", post(|s, h, b| create(PAYMENT, s, h, b)))
        .route("/refunds", post(|s, h, b| create(REFUND, s, h, b)))
        // The same payment, delivered as a provider's webhook (docs/webhooks.md).
        .route(
            "/webhooks/payments",
            post(|s, h, b| create(PAYMENT, s, h, b)),
        )
        .route(
            "/payments/by-key/{key}",
            get(|s, h, k| by_key(PAYMENT, s, h, k)),
        )
        .route(
            "/refunds/by-key/{key}",
            get(|s, h, k| by_key(REFUND, s, h, k)),
        )
        .route("/healthz", get(|| async { "ok" }))
        .with_state(pool)
}

/// Creates the tables, serialised by an advisory lock so that several demos starting
/// at once do not race on `CREATE TABLE IF NOT EXISTS`.
async fn create_schema(pool: &PgPool) -> sqlx::Result<()> {
    let mut tx = pool.begin().await?;
    sqlx::query("SELECT pg_advisory_xact_lock(727272)")
        .execute(&mut *tx)
        .await?;
    for statement in SCHEMA {
        sqlx::query(sqlx::AssertSqlSafe(*statement))
            .execute(&mut *tx)
            .await?;
    }
    tx.commit().await
}

pub(crate) fn problem(status: StatusCode, detail: &str) -> Response {
    (status, Json(json!({"error": detail}))).into_response()
}

fn tenant(headers: &HeaderMap) -> Option<String> {
    headers
        .get("x-tenant-id")
        .and_then(|v| v.to_str().ok())
        .filter(|t| !t.is_empty())
        .map(str::to_owned)
}

async fn create(
    kind: Kind,
    State(pool): State<PgPool>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let Some(tenant) = tenant(&headers) else {
        return problem(StatusCode::BAD_REQUEST, "X-Tenant-Id is required");
    };
    if failure_injected(&headers) {
        return injected_failure();
    }
    let input = match Input::parse(kind, &body) {
        Ok(input) => input,
        Err((status, why)) => return problem(status, &why),
    };
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
    let attempt = headers
        .get("idempotency-attempt")
        .and_then(|v| v.to_str().ok());
    let id = Uuid::new_v4();
    if let Err(e) = input.insert(&pool, id, &tenant, key, attempt).await {
        tracing::error!(error = %e, "insert failed");
        return problem(StatusCode::SERVICE_UNAVAILABLE, "database unavailable");
    }
    if let Some(delay) = delay(&headers) {
        tokio::time::sleep(delay).await;
    }
    input.created(id)
}

/// `X-Demo-Fail: 500`.
pub(crate) fn failure_injected(headers: &HeaderMap) -> bool {
    headers.get("x-demo-fail").is_some_and(|v| v == "500")
}

pub(crate) fn injected_failure() -> Response {
    let mut response = (
        StatusCode::INTERNAL_SERVER_ERROR,
        Json(json!({
            "type": "about:blank",
            "title": "Internal Server Error",
            "status": 500,
            "detail": "injected failure (X-Demo-Fail)",
        })),
    )
        .into_response();
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/problem+json"),
    );
    response
}

/// `X-Demo-Delay-Ms: N`.
pub(crate) fn delay(headers: &HeaderMap) -> Option<Duration> {
    headers
        .get("x-demo-delay-ms")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .map(Duration::from_millis)
}

/// A valid payment or refund, as asked for.
pub(crate) struct Input {
    kind: Kind,
    pub(crate) reference: String,
    pub(crate) amount: i64,
}

impl Input {
    /// The body as JSON, or why not (400, 422).
    pub(crate) fn parse(kind: Kind, body: &[u8]) -> Result<Self, (StatusCode, String)> {
        let Ok(json) = serde_json::from_slice::<Value>(body) else {
            return Err((StatusCode::BAD_REQUEST, "the body must be JSON".into()));
        };
        let reference = json
            .get(kind.ref_field)
            .and_then(Value::as_str)
            .filter(|s| !s.is_empty());
        let amount = json
            .get("amountUah")
            .and_then(Value::as_i64)
            .filter(|a| *a > 0);
        let (Some(reference), Some(amount)) = (reference, amount) else {
            let detail = format!(
                "expected {{\"{}\": string, \"amountUah\": positive integer}}",
                kind.ref_field
            );
            return Err((StatusCode::UNPROCESSABLE_ENTITY, detail));
        };
        Ok(Self {
            kind,
            reference: reference.to_owned(),
            amount,
        })
    }

    /// Inserts its row: one execution.
    pub(crate) async fn insert<'e>(
        &self,
        db: impl sqlx::PgExecutor<'e>,
        id: Uuid,
        tenant: &str,
        key: Option<&str>,
        attempt: Option<&str>,
    ) -> sqlx::Result<()> {
        sqlx::query(self.kind.insert)
            .bind(id)
            .bind(tenant)
            .bind(key)
            .bind(attempt)
            .bind(&self.reference)
            .bind(self.amount)
            .execute(db)
            .await
            .map(drop)
    }

    /// What the client is told of it (201, with its `Location`).
    pub(crate) fn created(&self, id: Uuid) -> Response {
        let mut response = (StatusCode::CREATED, Json(self.body(id))).into_response();
        if let Ok(location) = HeaderValue::from_str(&format!("{}/{id}", self.kind.path)) {
            response.headers_mut().insert(header::LOCATION, location);
        }
        response
    }

    pub(crate) fn body(&self, id: Uuid) -> Value {
        body_of(self.kind, id, &self.reference, self.amount)
    }
}

fn body_of(kind: Kind, id: Uuid, reference: &str, amount: i64) -> Value {
    let mut body = serde_json::Map::new();
    body.insert(kind.id_field.into(), json!(id));
    body.insert(kind.ref_field.into(), json!(reference));
    body.insert("amountUah".into(), json!(amount));
    Value::Object(body)
}

async fn by_key(
    kind: Kind,
    State(pool): State<PgPool>,
    headers: HeaderMap,
    Path(key): Path<String>,
) -> Response {
    let Some(tenant) = tenant(&headers) else {
        return problem(StatusCode::BAD_REQUEST, "X-Tenant-Id is required");
    };
    // With an attempt, only the operation that attempt made: an earlier life of the key
    // (its record at the gateway expired, the key was used again) is another operation.
    let attempt = headers
        .get("idempotency-attempt")
        .and_then(|v| v.to_str().ok());
    let sql = format!(
        "SELECT id, {} AS reference, amount_uah FROM {} \
         WHERE tenant_id = $1 AND idempotency_key = $2 \
           AND ($3::text IS NULL OR idempotency_attempt = $3) \
         ORDER BY created_at LIMIT 1",
        kind.ref_column, kind.table
    );
    match sqlx::query(sqlx::AssertSqlSafe(sql))
        .bind(&tenant)
        .bind(&key)
        .bind(attempt)
        .fetch_optional(&pool)
        .await
    {
        Ok(Some(row)) => {
            let id: Uuid = row.get("id");
            let reference: String = row.get("reference");
            let amount: i64 = row.get("amount_uah");
            (StatusCode::OK, Json(body_of(kind, id, &reference, amount))).into_response()
        }
        Ok(None) => problem(StatusCode::NOT_FOUND, "no such operation"),
        Err(e) => {
            tracing::error!(error = %e, "lookup failed");
            problem(StatusCode::SERVICE_UNAVAILABLE, "database unavailable")
        }
    }
}

#[cfg(test)]
mod tests {
    use idem_postgres::ledger::claim::CLAIM_ONE_SQL;
    use idem_postgres::ledger::complete::COMPLETE_ONE_SQL;

    const SCRIPT: &str = "../../loadtest/lib/pgbench-embedded.sql";

    /// `sql` with its parameters `$1`, `$2`, … replaced by `values[0]`, `values[1]`, ….
    fn with_values(sql: &str, values: &[&str]) -> String {
        let mut out = String::with_capacity(sql.len());
        let mut rest = sql;
        while let Some(at) = rest.find('$') {
            out.push_str(&rest[..at]);
            let digits = rest[at + 1..]
                .find(|c: char| !c.is_ascii_digit())
                .unwrap_or(rest.len() - at - 1);
            let n: usize = rest[at + 1..at + 1 + digits].parse().expect("a parameter");
            out.push_str(values[n - 1]);
            rest = &rest[at + 1 + digits..];
        }
        out + rest
    }

    /// Case (m) of `loadtest/bench` is embedded mode's Postgres work for one new key (case
    /// k) sent by pgbench: the very statements idem-embedded and this demo send, with
    /// pgbench's values for their parameters. The script is generated from the
    /// statements; `PAYMENTS_DEMO_WRITE_PGBENCH=1 cargo test -p payments-demo` rewrites it
    /// after they change.
    #[test]
    fn the_benchs_case_m_sends_embedded_modes_statements() {
        let key = "'pg-' || :client_id::text || '-' || :n::text";
        let hash = "decode(md5(:n::text) || md5(:n::text), 'hex')";
        let attempt = "md5(:n::text)::uuid";
        let tenant = "'pgbench-m'";
        let endpoint = "'POST /payments'";
        // tenant, endpoint, key, request hash, attempt, lease ms, trace context, TTL ms,
        // the lock wait after the claim.
        let claim = with_values(
            CLAIM_ONE_SQL,
            &[
                tenant, endpoint, key, hash, attempt, "5000", "NULL", "86400000", "'5000ms'",
            ],
        );
        // id, tenant, key, attempt, reference, amount.
        let insert = with_values(
            super::PAYMENT.insert,
            &[
                "gen_random_uuid()",
                tenant,
                key,
                "md5(:n::text)",
                "'order-1'",
                "100",
            ],
        );
        // tenant, endpoint, key, attempt, status, headers, body, TTL ms, body omitted.
        let headers =
            r#"'[["content-type","application/json"],["location","/payments/x"]]'::jsonb"#;
        let body = r"'\x7b7d'::bytea";
        let complete = with_values(
            COMPLETE_ONE_SQL,
            &[
                tenant, endpoint, key, attempt, "201", headers, body, "86400000", "false",
            ],
        );
        let script = format!(
            "-- (m) Embedded mode's Postgres work for one new key (case k), sent by pgbench: the\n\
             -- statements idem-embedded and payments-demo send, one per line, with pgbench's\n\
             -- values for their parameters (prepared, like sqlx; BEGIN and its lock wait are one\n\
             -- simple query in case k, two statements here). Generated from the statements by\n\
             -- payments-demo's test the_benchs_case_m_sends_embedded_modes_statements: do not edit.\n\
             \\set n random(1, 9000000000000000000)\n\
             BEGIN;\n\
             SET LOCAL lock_timeout = '20ms';\n\
             {claim};\n\
             {insert};\n\
             {complete};\n\
             COMMIT;\n"
        );
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(SCRIPT);
        if std::env::var_os("PAYMENTS_DEMO_WRITE_PGBENCH").is_some() {
            std::fs::write(&path, &script).unwrap();
        }
        let committed = std::fs::read_to_string(&path).unwrap();
        assert!(
            committed == script,
            "{SCRIPT} is not the statements embedded mode sends: rewrite it with \
             PAYMENTS_DEMO_WRITE_PGBENCH=1 cargo test -p payments-demo"
        );
    }
}
