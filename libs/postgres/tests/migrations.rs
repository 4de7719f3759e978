//! The migrations against real Postgres: a database that applied a migration before its
//! comment was reworded still migrates.

use idem_postgres::{MIGRATOR, RELEASED_0004};
use idem_testkit::TestDb;
use sha2::{Digest, Sha384};

/// sqlx records a migration's checksum as the SHA-384 of its whole text (so the released
/// text's checksum, kept in `RELEASED_0004`, is what older databases hold).
#[test]
fn a_migrations_checksum_is_the_sha384_of_its_text() {
    let first = MIGRATOR.iter().find(|m| m.version == 1).unwrap();
    let text = include_bytes!("../../../migrations/0001_idempotency_keys.sql");
    assert_eq!(&first.checksum[..], &Sha384::digest(text)[..]);
}

/// A database that applied 0004 as it was released (its comment citing notes outside the
/// repository) migrates as before, and keeps the new checksum. (Without the rewording's
/// repair, sqlx refused it: "migrates: VersionMismatch(4)".)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_database_that_applied_the_released_0004_still_migrates() {
    let db = TestDb::create().await;
    db.migrate().await;
    let mut conn = db.connect().await;
    sqlx::query("UPDATE _sqlx_migrations SET checksum = $1 WHERE version = 4")
        .bind(&RELEASED_0004[..])
        .execute(&mut conn)
        .await
        .unwrap();
    let pool = sqlx::PgPool::connect(&db.url).await.unwrap();
    idem_postgres::migrate(&pool).await.expect("migrates");
    let now: Vec<u8> =
        sqlx::query_scalar("SELECT checksum FROM _sqlx_migrations WHERE version = 4")
            .fetch_one(&mut conn)
            .await
            .unwrap();
    let expected = MIGRATOR.iter().find(|m| m.version == 4).unwrap();
    assert_eq!(now, &expected.checksum[..]);
}
