//! The cached response's binary form:
//!
//! ```text
//! version u8 (3) | flags u8 (bit 0: body omitted, bit 1: body in the ledger)
//! | expires_at u64 (Unix milliseconds, 0 if unknown) | fingerprint [32] | status u16
//! | trace len u16 | trace | header count u16
//! | (name len u16 | name | value len u32 | value)* | body
//! ```
//!
//! Versions 2 (without `expires_at`) and 1 (without the flags byte either) are still
//! read, with no expiry. An entry whose parts do
//! not fit their length fields is not encoded at all (the ledger serves that scope).
//!
//! A body larger than [`INLINE`] is not cached: the entry is written without it, marked
//! "in the ledger", so a lookup stays one small round trip that still says "completed"
//! (and takes no lock), and the ledger serves the body, read once for all the retries
//! that want it at the same moment. A few large values in one round trip were enough to
//! overrun `redis.timeout` and open the breaker, exactly when replays were many.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idem_core::{CacheEntry, Fingerprint, StoredResponse};

const VERSION: u8 = 3;
const FLAG_OMITTED: u8 = 1;
const FLAG_IN_LEDGER: u8 = 2;

/// The largest body cached in Redis.
pub const INLINE: usize = 64 * 1024;

/// Whether the entry's body was left to the ledger (too large to cache).
pub fn body_in_ledger(bytes: &[u8]) -> bool {
    matches!(bytes, [2 | VERSION, flags, ..] if flags & FLAG_IN_LEDGER != 0)
}

/// The entry's bytes; `None` if a part is too long for its length field.
pub fn encode(entry: &CacheEntry) -> Option<Vec<u8>> {
    let r = &entry.response;
    let in_ledger = r.body.len() > INLINE;
    let body: &[u8] = if in_ledger { &[] } else { &r.body };
    let trace = entry.trace_context.as_deref().unwrap_or("").as_bytes();
    let headers: usize = r.headers.iter().map(|(n, v)| 6 + n.len() + v.len()).sum();
    let mut out = Vec::with_capacity(2 + 8 + 32 + 2 + 2 + trace.len() + 2 + headers + body.len());
    out.push(VERSION);
    let omitted = if r.body_omitted { FLAG_OMITTED } else { 0 };
    out.push(omitted | if in_ledger { FLAG_IN_LEDGER } else { 0 });
    let expires_at = entry
        .expires_at
        .and_then(|at| at.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0, |since| u64::try_from(since.as_millis()).unwrap_or(0));
    out.extend_from_slice(&expires_at.to_be_bytes());
    out.extend_from_slice(entry.fingerprint.as_bytes());
    out.extend_from_slice(&r.status.to_be_bytes());
    out.extend_from_slice(&u16::try_from(trace.len()).ok()?.to_be_bytes());
    out.extend_from_slice(trace);
    out.extend_from_slice(&u16::try_from(r.headers.len()).ok()?.to_be_bytes());
    for (name, value) in &r.headers {
        out.extend_from_slice(&u16::try_from(name.len()).ok()?.to_be_bytes());
        out.extend_from_slice(name.as_bytes());
        out.extend_from_slice(&u32::try_from(value.len()).ok()?.to_be_bytes());
        out.extend_from_slice(value);
    }
    out.extend_from_slice(body);
    Some(out)
}

/// `None` if the bytes are not a cache entry of a known version. (An entry whose body is
/// in the ledger decodes with an empty body: see [`body_in_ledger`].)
pub fn decode(bytes: &[u8]) -> Option<CacheEntry> {
    let mut r = Reader(bytes);
    let (flags, expires_at) = match r.take(1)? {
        [1] => (0, 0),
        [2] => (r.take(1)?[0], 0),
        [VERSION] => (r.take(1)?[0], r.u64()?),
        _ => return None,
    };
    let fingerprint = Fingerprint::from_bytes(r.take(32)?.try_into().ok()?);
    let status = r.u16()?;
    let trace_len = usize::from(r.u16()?);
    let trace = std::str::from_utf8(r.take(trace_len)?).ok()?;
    let count = r.u16()?;
    let mut headers = Vec::with_capacity(usize::from(count));
    for _ in 0..count {
        let name_len = usize::from(r.u16()?);
        let name = std::str::from_utf8(r.take(name_len)?).ok()?.to_owned();
        let value_len = r.u32()? as usize;
        headers.push((name, r.take(value_len)?.to_vec()));
    }
    Some(CacheEntry {
        fingerprint,
        response: StoredResponse {
            status,
            headers,
            body: Bytes::copy_from_slice(r.0),
            body_omitted: flags & FLAG_OMITTED != 0,
        },
        trace_context: (!trace.is_empty()).then(|| trace.to_owned()),
        expires_at: (expires_at != 0)
            .then(|| SystemTime::UNIX_EPOCH + Duration::from_millis(expires_at)),
    })
}

struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, rest) = self.0.split_at(n);
        self.0 = rest;
        Some(head)
    }
    fn u16(&mut self) -> Option<u16> {
        Some(u16::from_be_bytes(self.take(2)?.try_into().ok()?))
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_be_bytes(self.take(4)?.try_into().ok()?))
    }
    fn u64(&mut self) -> Option<u64> {
        Some(u64::from_be_bytes(self.take(8)?.try_into().ok()?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(trace: Option<&str>) -> CacheEntry {
        CacheEntry {
            fingerprint: Fingerprint::from_bytes([7; 32]),
            response: StoredResponse::new(
                201,
                vec![
                    ("content-type".into(), b"application/json".to_vec()),
                    ("x-bin".into(), vec![0, 255, 10]),
                ],
                Bytes::from_static(b"{\"paymentId\":\"p\"}\x00\xff"),
            ),
            trace_context: trace.map(str::to_owned),
            // Whole milliseconds: the precision kept.
            expires_at: Some(SystemTime::UNIX_EPOCH + Duration::from_millis(1_796_000_000_123)),
        }
    }

    #[test]
    fn round_trips() {
        for e in [
            entry(None),
            entry(Some(
                "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            )),
        ] {
            assert_eq!(decode(&encode(&e).unwrap()), Some(e));
        }
        let mut omitted = entry(None);
        omitted.response = StoredResponse::without_body(201, Vec::new());
        assert_eq!(decode(&encode(&omitted).unwrap()), Some(omitted));
    }

    #[test]
    fn a_large_body_is_left_to_the_ledger() {
        let mut large = entry(None);
        large.response.body = Bytes::from(vec![1u8; INLINE + 1]);
        let bytes = encode(&large).unwrap();
        assert!(bytes.len() < 200, "{} bytes", bytes.len());
        assert!(body_in_ledger(&bytes));
        let small = encode(&entry(None)).unwrap();
        assert!(!body_in_ledger(&small));
    }

    #[test]
    fn reads_versions_one_and_two_without_an_expiry() {
        let mut e = entry(None);
        let mut v2 = encode(&e).unwrap();
        v2.drain(2..10);
        v2[0] = 2;
        let mut v1 = v2.clone();
        v1.remove(1);
        v1[0] = 1;
        e.expires_at = None;
        assert_eq!(decode(&v2), Some(e.clone()));
        assert_eq!(decode(&v1), Some(e));
    }

    #[test]
    fn an_unknown_expiry_round_trips() {
        let mut e = entry(None);
        e.expires_at = None;
        assert_eq!(decode(&encode(&e).unwrap()), Some(e));
    }

    #[test]
    fn refuses_truncated_or_foreign_bytes() {
        let bytes = encode(&entry(None)).unwrap();
        assert!(decode(&bytes[..40]).is_none());
        assert!(decode(b"").is_none());
        let mut other = bytes.clone();
        other[0] = 4;
        assert!(decode(&other).is_none());
    }

    #[test]
    fn parts_too_long_for_their_length_field_are_not_encoded() {
        // A 64 KiB trace context once wrapped its u16 length and corrupted the entry.
        let long = "0".repeat(70_000);
        assert!(encode(&entry(Some(&long))).is_none());
        let mut many = entry(None);
        many.response.headers = vec![("x".into(), Vec::new()); 70_000];
        assert!(encode(&many).is_none());
    }
}
