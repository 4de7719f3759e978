//! The decision on an existing record, shared by the gateway's engine and embedded mode:
//! pure functions, tested without I/O.

use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idem_core::verdict::{
    self, Decision, RETRY_LATER, RETRY_SOON, Verdict, cached, in_progress, locked_out,
};
use idem_core::{
    AttemptId, BodyKind, CacheEntry, Fingerprint, Outcome, Record, RecordState, StoredResponse,
};

fn fp(body: &str) -> Fingerprint {
    Fingerprint::compute("POST", "/payments", BodyKind::Raw, body.as_bytes()).unwrap()
}

fn paid() -> StoredResponse {
    StoredResponse::new(201, vec![], Bytes::from_static(b"paid"))
}

fn record(body: &str, state: RecordState, expires_in: Option<Duration>) -> Record {
    Record {
        fingerprint: fp(body),
        attempt: AttemptId::random(),
        state,
        trace_context: Some("00-first-01".into()),
        expires_in,
        expires_at: Some(SystemTime::UNIX_EPOCH + Duration::from_secs(2_000_000_000)),
    }
}

fn decide(verdict: Verdict, since_read: Duration) -> Decision<()> {
    verdict.decide(since_read, false)
}

#[test]
fn the_same_completed_request_replays_and_may_be_kept_until_the_row_ends() {
    let found = record(
        "a",
        RecordState::Completed(paid()),
        Some(Duration::from_secs(10)),
    );
    match decide(Verdict::of(found, &fp("a")), Duration::from_secs(3)) {
        Decision::Replay {
            entry, keep_for, ..
        } => {
            assert_eq!(entry.response, paid());
            assert_eq!(entry.trace_context.as_deref(), Some("00-first-01"));
            assert_eq!(
                keep_for,
                Some(Duration::from_secs(7)),
                "the row's life as read, less the time since the read"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_row_about_to_end_is_replayed_but_never_kept() {
    for (left, since_read) in [(Some(2), 2), (Some(1), 5), (None, 0)] {
        let found = record(
            "a",
            RecordState::Completed(paid()),
            left.map(Duration::from_secs),
        );
        match decide(
            Verdict::of(found, &fp("a")),
            Duration::from_secs(since_read),
        ) {
            Decision::Replay { keep_for, .. } => {
                assert_eq!(keep_for, None, "{left:?} left, read {since_read}s ago")
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn another_request_under_the_key_is_a_mismatch_whatever_its_state() {
    for (state, completed) in [
        (RecordState::Completed(paid()), true),
        (
            RecordState::InProgress {
                lease_expired: false,
            },
            false,
        ),
    ] {
        let found = record("a", state, Some(Duration::from_secs(10)));
        match decide(Verdict::of(found, &fp("b")), Duration::ZERO) {
            Decision::Answer(Outcome::Mismatch {
                completed: c,
                trace_context,
            }) => {
                assert_eq!(c, completed);
                assert_eq!(trace_context.as_deref(), Some("00-first-01"));
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn the_same_request_in_progress_is_running_and_answers_409_soon_or_later() {
    for (lease_expired, retry_after) in [(false, RETRY_SOON), (true, RETRY_LATER)] {
        let found = record("a", RecordState::InProgress { lease_expired }, None);
        let Decision::Running(running) = decide(Verdict::of(found, &fp("a")), Duration::ZERO)
        else {
            panic!("not running");
        };
        match in_progress::<()>(&running, true) {
            Outcome::InProgress {
                retry_after: r,
                trace_context,
                waited,
                outcome_unknown,
            } => {
                assert_eq!(r, retry_after);
                assert_eq!(outcome_unknown, lease_expired, "past its lease: unknown");
                assert!(waited);
                assert_eq!(
                    trace_context.as_deref(),
                    Some("00-first-01"),
                    "linked to the first"
                );
            }
            other => panic!("{other:?}"),
        }
    }
}

#[test]
fn a_cached_answer_replays_the_same_request_and_refuses_another() {
    let entry = || CacheEntry {
        fingerprint: fp("a"),
        response: paid(),
        trace_context: None,
        expires_at: None,
    };
    match cached::<()>(entry(), &fp("a")) {
        Outcome::Replayed {
            response, waited, ..
        } => {
            assert_eq!(response, paid());
            assert!(!waited);
        }
        other => panic!("{other:?}"),
    }
    assert!(matches!(
        cached::<()>(entry(), &fp("b")),
        Outcome::Mismatch {
            completed: true,
            ..
        }
    ));
    match decide(Verdict::of_cached(entry(), &fp("a")), Duration::ZERO) {
        Decision::Replay { keep_for, .. } => {
            assert_eq!(keep_for, None, "a cached copy is not cached again")
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_key_locked_by_another_transaction_is_in_progress_soon_over() {
    assert!(matches!(
        locked_out::<()>(false),
        Outcome::InProgress {
            retry_after: RETRY_SOON,
            trace_context: None,
            waited: false,
            outcome_unknown: false,
        }
    ));
    let replay = verdict::replayed::<()>(
        CacheEntry {
            fingerprint: fp("a"),
            response: paid(),
            trace_context: None,
            expires_at: None,
        },
        true,
    );
    assert!(matches!(replay, Outcome::Replayed { waited: true, .. }));
}
