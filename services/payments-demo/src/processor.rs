//! `PAYMENTS_DEMO_MODE=processor`: a card processor as payment services call one — a
//! downstream that dedupes by `Idempotency-Key` itself, as Stripe's API does, so that a
//! service calling it out of embedded mode (docs/embedded-mode.md, "Calls out") can send a
//! call again with the same key and be charged once.
//!
//! - `POST /charges` with `Idempotency-Key` and `{"orderId": "…", "amountUah": 100}` →
//!   201 `{"chargeId", "orderId", "amountUah"}`: one `processor_charges` row per key, its
//!   `calls` counting every call received with that key. A call again with the key gets
//!   the same 201 and body (`Idempotent-Replayed: true`); with another order or amount,
//!   409. No key: 400.
//! - `GET /charges/by-key/{key}` → 200 with the charge's body, or 404: what a service
//!   asks before calling again when it cannot tell whether its call arrived.
//! - `X-Demo-Delay-Ms: N` sleeps after the charge committed; `X-Demo-Fail: 500` answers
//!   500 without charging (nor counting).

use axum::extract::{Path, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{Value, json};
use sqlx::{PgPool, Row};
use uuid::Uuid;

use crate::{Input, PAYMENT, delay, failure_injected, injected_failure, problem};

/// The processor's table (created with the demo's others).
pub(crate) const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS processor_charges (
        idempotency_key text PRIMARY KEY,
        charge_id uuid NOT NULL,
        order_id text NOT NULL,
        amount_uah bigint NOT NULL,
        calls int NOT NULL DEFAULT 1,
        created_at timestamptz NOT NULL DEFAULT clock_timestamp())";

/// One charge per key; a call again counts and gets the first charge back.
const CHARGE_SQL: &str = "INSERT INTO processor_charges \
       (idempotency_key, charge_id, order_id, amount_uah) VALUES ($1, $2, $3, $4) \
     ON CONFLICT (idempotency_key) DO UPDATE SET calls = processor_charges.calls + 1 \
     RETURNING charge_id, order_id, amount_uah, calls";

pub(crate) fn app(pool: PgPool) -> Router {
    Router::new()
        .route("/charges", post(charge))
        .route("/charges/by-key/{key}", get(by_key))
        .route("/healthz", get(|| async { "ok" }))
        .with_state(pool)
}

async fn charge(
    State(pool): State<PgPool>,
    headers: HeaderMap,
    body: axum::body::Bytes,
) -> Response {
    let Some(key) = headers
        .get("idempotency-key")
        .and_then(|v| v.to_str().ok())
        .filter(|k| !k.is_empty())
    else {
        return problem(StatusCode::BAD_REQUEST, "Idempotency-Key is required");
    };
    if failure_injected(&headers) {
        return injected_failure();
    }
    let input = match Input::parse(PAYMENT, &body) {
        Ok(input) => input,
        Err((status, why)) => return problem(status, &why),
    };
    let row = sqlx::query(CHARGE_SQL)
        .bind(key)
        .bind(Uuid::new_v4())
        .bind(&input.reference)
        .bind(input.amount)
        .fetch_one(&pool)
        .await;
    let row = match row {
        Ok(row) => row,
        Err(e) => {
            tracing::error!(error = %e, "charge failed");
            return problem(StatusCode::SERVICE_UNAVAILABLE, "database unavailable");
        }
    };
    let charge = Charge::of(&row);
    if let Some(delay) = delay(&headers) {
        tokio::time::sleep(delay).await;
    }
    if charge.order_id != input.reference || charge.amount != input.amount {
        return problem(
            StatusCode::CONFLICT,
            "this Idempotency-Key was used for another charge",
        );
    }
    let calls: i32 = row.get("calls");
    let mut response = (StatusCode::CREATED, Json(charge.body())).into_response();
    if calls > 1 {
        response
            .headers_mut()
            .insert("idempotent-replayed", HeaderValue::from_static("true"));
    }
    response
}

async fn by_key(State(pool): State<PgPool>, Path(key): Path<String>) -> Response {
    let row = sqlx::query(
        "SELECT charge_id, order_id, amount_uah FROM processor_charges WHERE idempotency_key = $1",
    )
    .bind(&key)
    .fetch_optional(&pool)
    .await;
    match row {
        Ok(Some(row)) => (StatusCode::OK, Json(Charge::of(&row).body())).into_response(),
        Ok(None) => problem(StatusCode::NOT_FOUND, "no charge with this key"),
        Err(e) => {
            tracing::error!(error = %e, "lookup failed");
            problem(StatusCode::SERVICE_UNAVAILABLE, "database unavailable")
        }
    }
}

/// A charge as stored.
struct Charge {
    id: Uuid,
    order_id: String,
    amount: i64,
}

impl Charge {
    fn of(row: &sqlx::postgres::PgRow) -> Self {
        Self {
            id: row.get("charge_id"),
            order_id: row.get("order_id"),
            amount: row.get("amount_uah"),
        }
    }

    fn body(&self) -> Value {
        json!({"chargeId": self.id, "orderId": self.order_id, "amountUah": self.amount})
    }
}
