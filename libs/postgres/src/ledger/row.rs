//! Decoding a row: the engine's [`Record`] (with a large body left to read), and the
//! scope of a row the reconciler took.

use std::time::Duration;

use bytes::Bytes;
use idem_core::{
    AttemptId, Fingerprint, IdempotencyKey, LedgerError, Record, RecordState, Scope, StoredResponse,
};
use sqlx::Row;
use sqlx::postgres::PgRow;

use crate::headers;

/// A live row as read by `record_columns!`.
#[derive(Debug)]
pub(crate) struct Found {
    pub(crate) record: Record,
    /// The length of a completed answer's body too large to come with the row
    /// ([`super::bodies::INLINE`]): it is read on its own.
    pub(crate) body_to_read: Option<usize>,
}

pub(crate) fn record(row: &PgRow) -> Result<Found, LedgerError> {
    let e = |error: sqlx::Error| LedgerError::new(error);
    let corrupt = |why| LedgerError::new(crate::Corrupt(why));
    let hash: Vec<u8> = row.try_get("request_hash").map_err(e)?;
    let hash: [u8; 32] = hash
        .try_into()
        .map_err(|_| corrupt("request_hash is not 32 bytes"))?;
    let status: String = row.try_get("status").map_err(e)?;
    let mut body_to_read = None;
    let state = match status.as_str() {
        "in_progress" => RecordState::InProgress {
            lease_expired: row.try_get("lease_expired").map_err(e)?,
        },
        "completed" => {
            let code: i32 = row.try_get("response_status").map_err(e)?;
            let stored: serde_json::Value = row.try_get("response_headers").map_err(e)?;
            let body: Option<Vec<u8>> = row.try_get("response_body").map_err(e)?;
            let body = match body {
                Some(body) => Bytes::from(body),
                None => {
                    let len: Option<i32> = row.try_get("response_bytes").map_err(e)?;
                    let len = len.ok_or_else(|| corrupt("response_body missing"))?;
                    body_to_read = Some(usize::try_from(len).unwrap_or(0));
                    Bytes::new()
                }
            };
            RecordState::Completed(StoredResponse {
                status: u16::try_from(code).map_err(|_| corrupt("response_status out of range"))?,
                headers: headers::decode(&stored)
                    .ok_or_else(|| corrupt("response_headers malformed"))?,
                body,
                body_omitted: row.try_get("response_omitted").map_err(e)?,
            })
        }
        _ => return Err(corrupt("unknown status")),
    };
    let record = Record {
        fingerprint: Fingerprint::from_bytes(hash),
        attempt: AttemptId(row.try_get("attempt").map_err(e)?),
        state,
        trace_context: row.try_get("trace_context").map_err(e)?,
        expires_in: row
            .try_get::<Option<f64>, _>("expires_in_ms")
            .map_err(e)?
            .map(|ms| Duration::from_secs_f64(ms.max(0.0) / 1000.0)),
        expires_at: row
            .try_get::<Option<i64>, _>("expires_at_us")
            .map_err(e)?
            .map(super::rules::system_time),
    };
    Ok(Found {
        record,
        body_to_read,
    })
}

pub(crate) fn scope_of(row: &PgRow) -> Result<Scope, sqlx::Error> {
    let key: String = row.try_get("key")?;
    let key = IdempotencyKey::parse(key.as_bytes())
        .map_err(|e| sqlx::Error::Decode(format!("stored key {key:?}: {e}").into()))?;
    Ok(Scope::new(
        row.try_get::<String, _>("tenant_id")?,
        row.try_get::<String, _>("endpoint")?,
        key,
    ))
}
