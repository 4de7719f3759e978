//! The embedded-mode tests' service: an axum router of the test's own, with an `orders`
//! table and the idempotency layer on its route, on a real socket and real Postgres.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, SystemTime};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::Extension;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use idem_core::Scope;
use idem_embedded::{Idempotency, Options, TenantFrom, Tx};
pub use idem_testkit::*;
use serde_json::{Value, json};
use sqlx::PgPool;
use uuid::Uuid;

/// Lets the second half of an `x-trickle-kib` answer go.
pub static RELEASE: tokio::sync::Semaphore = tokio::sync::Semaphore::const_new(0);

/// The test's service: `POST /orders` inserts one order through the request's
/// transaction; `x-sleep-ms` holds the transaction open that long after the insert;
/// `x-fail` answers 500 after the insert; `x-pad-kib: N` answers N KiB more;
/// `x-trickle-kib: N` answers N KiB in 1 KiB chunks, the second half after [`RELEASE`];
/// `x-leak-tx` answers with a body that holds the Tx and inserts another order through it
/// while it is read (a defect of the service's).
pub struct Service {
    pub url: String,
    pub db_url: String,
    /// The database, unless it is another service's.
    pub db: Option<TestDb>,
    pub pool: PgPool,
    server: tokio::task::JoinHandle<()>,
}

impl Drop for Service {
    fn drop(&mut self) {
        self.server.abort();
    }
}

async fn create_order(
    Extension(scope): Extension<Scope>,
    headers: HeaderMap,
    mut tx: Tx,
    axum::Json(order): axum::Json<Value>,
) -> Response {
    let id = Uuid::new_v4();
    sqlx::query(
        "INSERT INTO orders (id, tenant_id, idempotency_key, amount) VALUES ($1, $2, $3, $4)",
    )
    .bind(id)
    .bind(&scope.tenant)
    .bind(scope.key.as_str())
    .bind(order["amount"].as_i64())
    .execute(&mut *tx)
    .await
    .expect("insert the order");
    if let Some(ms) = headers.get("x-sleep-ms").and_then(|v| v.to_str().ok()) {
        // Real time: the transaction stays open while a duplicate arrives.
        tokio::time::sleep(Duration::from_millis(ms.parse().unwrap())).await;
    }
    let kib = |name: &str| {
        headers
            .get(name)
            .map(|v| v.to_str().unwrap().parse::<usize>().unwrap())
    };
    if let Some(kib) = kib("x-pad-kib") {
        let pad = "x".repeat(kib * 1024);
        return (
            StatusCode::CREATED,
            axum::Json(json!({"orderId": id, "pad": pad})),
        )
            .into_response();
    }
    if let Some(kib) = kib("x-trickle-kib") {
        // `kib` chunks of 1 KiB; the second half waits for the test's word (RELEASE).
        let chunks = futures_util::stream::unfold(0, move |sent| async move {
            if sent == kib {
                return None;
            }
            if sent == kib / 2 {
                RELEASE.acquire().await.unwrap().forget();
            }
            Some((
                Ok::<_, std::io::Error>(Bytes::from(vec![b'x'; 1024])),
                sent + 1,
            ))
        });
        return (StatusCode::CREATED, Body::from_stream(chunks)).into_response();
    }
    if headers.contains_key("x-leak-tx") {
        let written_while_read = futures_util::stream::unfold(Some(tx), |tx: Option<Tx>| async {
            let mut tx = tx?;
            sqlx::query(
                "INSERT INTO orders (id, tenant_id, idempotency_key, amount) \
                 VALUES ($1, 'leak', 'leak', 0)",
            )
            .bind(Uuid::new_v4())
            .execute(&mut *tx)
            .await
            .expect("insert through the kept Tx");
            Some((Ok::<_, std::io::Error>(Bytes::from_static(b"leaked")), None))
        });
        return (StatusCode::CREATED, Body::from_stream(written_while_read)).into_response();
    }
    if headers.contains_key("x-fail") {
        let problem =
            json!({"type": "about:blank", "title": "Internal Server Error", "status": 500});
        return (
            StatusCode::INTERNAL_SERVER_ERROR,
            [(header::CONTENT_TYPE, "application/problem+json")],
            problem.to_string(),
        )
            .into_response();
    }
    (
        StatusCode::CREATED,
        [(header::LOCATION, format!("/orders/{id}"))],
        axum::Json(json!({"orderId": id, "amount": order["amount"]})),
    )
        .into_response()
}

/// Layers a service may put between the idempotency layer and its handler, each cutting
/// the handler off as such layers do: `x-rate-limited` answers 429 without running it;
/// `x-timeout-ms` answers 408 once the handler has run that long (the handler's future is
/// dropped before the answer leaves, as in a `tokio::time::timeout` middleware).
async fn cut_off(request: axum::extract::Request, next: axum::middleware::Next) -> Response {
    let headers = request.headers();
    if headers.contains_key("x-rate-limited") {
        return (StatusCode::TOO_MANY_REQUESTS, "slow down").into_response();
    }
    match headers
        .get("x-timeout-ms")
        .map(|ms| Duration::from_millis(ms.to_str().unwrap().parse().unwrap()))
    {
        Some(limit) => tokio::time::timeout(limit, next.run(request))
            .await
            .unwrap_or_else(|_| StatusCode::REQUEST_TIMEOUT.into_response()),
        None => next.run(request).await,
    }
}

/// Starts the service on a database of its own, or on `beside`'s (a second process of
/// the same service).
pub async fn service(
    options: impl FnOnce(Options<TenantFrom>) -> Options<TenantFrom>,
    beside: Option<&Service>,
) -> Service {
    service_via(options, beside, None).await
}

/// Where the layer's pool connects instead of Postgres: a proxy (a [`FaultProxy`], a
/// [`PgCounter`]) in front of it, with that many connections.
pub struct Via {
    pub proxy: std::net::SocketAddr,
    pub connections: u32,
}

/// [`service`], its layer's connections to Postgres through `via` when given (the test's
/// own reads go straight to Postgres). The layer's pool, like payments-demo's, does not
/// ping a connection before each use.
pub async fn service_via(
    options: impl FnOnce(Options<TenantFrom>) -> Options<TenantFrom>,
    beside: Option<&Service>,
    via: Option<Via>,
) -> Service {
    let (db, url) = match beside {
        Some(other) => (None, other.db_url.clone()),
        None => {
            let db = TestDb::create().await;
            db.migrate().await;
            let mut conn = db.connect().await;
            sqlx::query(
                "CREATE TABLE orders (id uuid PRIMARY KEY, tenant_id text NOT NULL, \
                 idempotency_key text NOT NULL, amount bigint)",
            )
            .execute(&mut conn)
            .await
            .unwrap();
            let url = db.url.clone();
            (Some(db), url)
        }
    };
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(64)
        .connect(&url)
        .await
        .expect("connect to the test database");
    let config = idem_config::Config::from_toml(
        &TestConfig::bare()
            .set("postgres.url", url.as_str())
            .set("auth.hs256_secret", SECRET)
            .toml(),
    )
    .expect("test config");
    let auth = idem_auth::Authenticator::from_config(&config.auth).expect("HS256 auth");
    let options = options(Options::default().tenant(TenantFrom::Jwt(Arc::new(auth))));
    let layer_pool = match via {
        Some(Via { proxy, connections }) => {
            let via = url.replacen("127.0.0.1:5432", &proxy.to_string(), 1);
            assert_ne!(via, url, "the test database is on 127.0.0.1:5432");
            sqlx::postgres::PgPoolOptions::new()
                .max_connections(connections)
                .test_before_acquire(false)
                .connect(&format!("{via}?sslmode=disable"))
                .await
                .expect("connect through the proxy")
        }
        None => pool.clone(),
    };
    let idem = Idempotency::new(layer_pool, options);
    let app = Router::new().route(
        "/orders",
        post(create_order)
            .layer(axum::middleware::from_fn(cut_off))
            .route_layer(idem.layer("POST /orders")),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let base = format!("http://{}", listener.local_addr().unwrap());
    let server = tokio::spawn(async move {
        axum::serve(listener, app).await.unwrap();
    });
    Service {
        url: format!("{base}/orders"),
        db_url: url,
        db,
        pool,
        server,
    }
}

impl Service {
    /// The `host:port` the service listens on.
    pub fn addr(&self) -> &str {
        let authority = self.url.trim_start_matches("http://");
        authority.split('/').next().unwrap_or(authority)
    }

    pub async fn count(&self, sql: &str) -> i64 {
        sqlx::query_scalar(sqlx::AssertSqlSafe(sql.to_owned()))
            .fetch_one(&self.pool)
            .await
            .unwrap()
    }

    pub async fn orders(&self) -> i64 {
        self.count("SELECT count(*) FROM orders").await
    }

    pub async fn records(&self) -> i64 {
        self.count("SELECT count(*) FROM idempotency_keys").await
    }
}

pub fn order(amount: u64) -> String {
    format!(r#"{{"amount": {amount}}}"#)
}

pub fn expires(answer: &Answer) -> SystemTime {
    let value = answer
        .header("idempotency-expires")
        .unwrap_or_else(|| panic!("no Idempotency-Expires on {}", answer.status));
    httpdate::parse_http_date(value).expect("an IMF-fixdate")
}

/// Sessions of the test's database waiting on a lock right now.
pub async fn lock_waiters(svc: &Service) -> i64 {
    svc.count(
        "SELECT count(*) FROM pg_stat_activity \
         WHERE datname = current_database() AND wait_event_type = 'Lock'",
    )
    .await
}
