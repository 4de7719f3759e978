//! A Postgres database of each test's own.

use sqlx::{Connection, PgConnection};

/// The server that tests create their databases on.
pub fn admin_url() -> String {
    std::env::var("IDEMGATE_TEST_POSTGRES")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// A database of this test's own, dropped when the test ends (pass or fail).
pub struct TestDb {
    pub name: String,
    pub url: String,
}

impl TestDb {
    pub async fn create() -> Self {
        let admin = admin_url();
        let mut conn = PgConnection::connect(&admin).await.unwrap_or_else(|e| {
            panic!("Postgres is not reachable at {admin} ({e}). Start it with scripts/dev-services, or set IDEMGATE_TEST_POSTGRES.")
        });
        let name = format!("idemgate_test_{}", uuid::Uuid::new_v4().simple());
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&mut conn)
            .await
            .expect("create the test database");
        let base = admin
            .rsplit_once('/')
            .map_or(admin.as_str(), |(base, _)| base);
        let url = format!("{base}/{name}");
        Self { name, url }
    }

    /// Applies idemgate's migrations (for tests that write ledger rows themselves).
    pub async fn migrate(&self) {
        let pool = sqlx::PgPool::connect(&self.url)
            .await
            .expect("connect to the test database");
        idem_postgres::migrate(&pool)
            .await
            .expect("migrations apply");
        pool.close().await;
    }

    pub async fn connect(&self) -> PgConnection {
        PgConnection::connect(&self.url)
            .await
            .expect("connect to the test database")
    }

    /// Locks the ledger row of `key` (`FOR UPDATE`, on a connection of its own) until the
    /// lock is released: another session's writes of it wait meanwhile. Panics if there is
    /// no such row yet.
    pub async fn lock_row(&self, key: &str) -> RowLock {
        let mut conn = self.connect().await;
        sqlx::query("BEGIN")
            .execute(&mut conn)
            .await
            .expect("begin");
        let locked: Option<i32> =
            sqlx::query_scalar("SELECT 1 FROM idempotency_keys WHERE key = $1 FOR UPDATE")
                .bind(key)
                .fetch_optional(&mut conn)
                .await
                .expect("lock the row");
        assert_eq!(locked, Some(1), "the claim of {key} is in the ledger");
        RowLock(conn)
    }

    /// Rows in `table` for a tenant and key: the number of executions.
    pub async fn executions(&self, table: &str, tenant: &str, key: &str) -> i64 {
        let mut conn = self.connect().await;
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT count(*) FROM {table} WHERE tenant_id = $1 AND idempotency_key = $2"
        )))
        .bind(tenant)
        .bind(key)
        .fetch_one(&mut conn)
        .await
        .expect("count executions")
    }

    /// When the ledger forgets a tenant's key, as an IMF-fixdate written by Postgres
    /// itself (what `Idempotency-Expires` must say), or `None` if the row has no expiry.
    pub async fn expiry(&self, tenant: &str, key: &str) -> Option<String> {
        let mut conn = self.connect().await;
        sqlx::query_scalar(
            "SELECT to_char(expires_at AT TIME ZONE 'UTC', 'Dy, DD Mon YYYY HH24:MI:SS \"GMT\"') \
             FROM idempotency_keys WHERE tenant_id = $1 AND key = $2",
        )
        .bind(tenant)
        .bind(key)
        .fetch_one(&mut conn)
        .await
        .expect("read the key's expiry")
    }

    /// Ledger rows for a tenant (all endpoints and keys).
    pub async fn ledger_rows(&self, tenant: &str) -> i64 {
        let mut conn = self.connect().await;
        sqlx::query_scalar("SELECT count(*) FROM idempotency_keys WHERE tenant_id = $1")
            .bind(tenant)
            .fetch_one(&mut conn)
            .await
            .expect("count ledger rows")
    }
}

impl Drop for TestDb {
    fn drop(&mut self) {
        let name = self.name.clone();
        // Drop runs outside any runtime we may block: use a thread with its own.
        let _ = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async {
                if let Ok(mut conn) = PgConnection::connect(&admin_url()).await {
                    let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                        "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
                    )))
                    .execute(&mut conn)
                    .await;
                }
            });
        })
        .join();
    }
}

/// A ledger row held locked by [`TestDb::lock_row`].
pub struct RowLock(PgConnection);

impl RowLock {
    /// Ends the lock's transaction, changing nothing.
    pub async fn release(mut self) {
        sqlx::query("ROLLBACK")
            .execute(&mut self.0)
            .await
            .expect("release the row");
    }
}
