//! A pooled connection for one statement, given back to the pool only when the
//! statement answered and the answer says the connection is fit for the next one.
//!
//! sqlx gives a dropped connection back to its pool and pings it there, waiting for it
//! to be ready. A statement cut off mid-way (its time was up, its request went away)
//! leaves the connection busy until the statement ends, and a statement can hang far
//! longer than any timeout: a `COMMIT` waiting for a synchronous standby that is gone
//! ignores `statement_timeout` (Postgres disables it before the commit). Such a
//! connection would hold its place in the pool for as long. So a connection is closed
//! instead — its socket shut, its place free at once — when its statement did not answer,
//! or answered with an error that says the session is no use ([`unfit`]).

use std::ops::{Deref, DerefMut};

use sqlx::pool::PoolConnection;
use sqlx::{PgConnection, PgPool, Postgres};

/// A connection taken from the pool for one statement; closed when dropped unless
/// [`OneStatement::answered`] was told an answer that leaves it fit.
pub(crate) struct OneStatement {
    conn: PoolConnection<Postgres>,
    fit: bool,
}

impl OneStatement {
    pub(crate) async fn acquire(pool: &PgPool) -> Result<Self, sqlx::Error> {
        Ok(Self {
            conn: pool.acquire().await?,
            fit: false,
        })
    }

    /// The statement's answer, passed through; it decides whether the connection goes
    /// back to the pool.
    pub(crate) fn answered<T>(mut self, answer: Result<T, sqlx::Error>) -> Result<T, sqlx::Error> {
        self.fit = answer.as_ref().err().is_none_or(|error| !unfit(error));
        answer
    }

    /// Closes the connection after use whatever the answer (a large body grew its buffers).
    pub(crate) fn close_after_use(&mut self) {
        self.conn.close_on_drop();
    }
}

impl Drop for OneStatement {
    fn drop(&mut self) {
        if !self.fit {
            self.conn.close_on_drop();
        }
    }
}

impl Deref for OneStatement {
    type Target = PgConnection;

    fn deref(&self) -> &PgConnection {
        &self.conn
    }
}

impl DerefMut for OneStatement {
    fn deref_mut(&mut self) -> &mut PgConnection {
        &mut self.conn
    }
}

/// Whether an error says the connection is no use for another statement: the session or
/// its transport failed (I/O, TLS, the protocol out of step, SQLSTATE class 08), the
/// server is shutting down or terminated the backend (57P01, 57P02, 57P03), or the server
/// no longer takes writes (25006: the node is a standby now — after a failover a pooled
/// connection to the old primary answers every write so, until it is closed).
pub fn unfit(error: &sqlx::Error) -> bool {
    match error {
        sqlx::Error::Database(db) => db.code().is_some_and(|code| unfit_code(&code)),
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::Protocol(_)
        | sqlx::Error::WorkerCrashed => true,
        _ => false,
    }
}

/// The SQLSTATEs of [`unfit`].
pub(crate) fn unfit_code(code: &str) -> bool {
    code.starts_with("08") || matches!(code, "57P01" | "57P02" | "57P03" | "25006")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_session_lost_or_on_a_standby_is_unfit_and_a_refused_statement_is_not() {
        for code in ["08006", "08003", "57P01", "57P02", "57P03", "25006"] {
            assert!(unfit_code(code), "{code}");
        }
        // A unique violation, a lock wait, a cancelled statement, a serialization
        // failure, a check: the statement was refused, the session is fine.
        for code in ["23505", "55P03", "57014", "40001", "23514"] {
            assert!(!unfit_code(code), "{code}");
        }
        let reset = std::io::Error::from(std::io::ErrorKind::ConnectionReset);
        assert!(unfit(&sqlx::Error::Io(reset)));
        assert!(unfit(&sqlx::Error::Protocol(
            "unexpected response from SSLRequest: 0x00".into()
        )));
        assert!(!unfit(&sqlx::Error::RowNotFound));
        assert!(!unfit(&sqlx::Error::PoolTimedOut));
    }
}
