//! The reconciler's decisions, row by row of the "Unknown outcomes" table in docs/operations.md, with time as an input.

use std::time::{Duration, SystemTime};

use idem_core::reconcile::{History, OnUnknown, ProbeAnswer, Released, Resolution, Rules, decide};

const S: Duration = Duration::from_secs(1);

fn rules(probe: bool, on_unknown: OnUnknown) -> Rules {
    Rules {
        probe,
        on_unknown,
        release_confirm: 30 * S,
        backoff: 5 * S,
        max_backoff: 600 * S,
    }
}

fn probed() -> Rules {
    rules(true, OnUnknown::Hold)
}

/// A row created `age` before `now`, with its first 404 `not_found` before `now`.
fn history(now: SystemTime, age: Duration, attempts: u32, not_found: Option<Duration>) -> History {
    History {
        created_at: now - age,
        probe_attempts: attempts,
        first_not_found: not_found.map(|ago| now - ago),
    }
}

fn at() -> SystemTime {
    SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000)
}

#[test]
fn a_probe_that_finds_the_operation_completes_the_key() {
    let now = at();
    for not_found in [None, Some(10 * S), Some(60 * S)] {
        assert_eq!(
            decide(
                &probed(),
                Some(ProbeAnswer::Found),
                &history(now, 40 * S, 3, not_found),
                now
            ),
            Resolution::Complete,
            "a 2xx wins over any earlier 404: the upstream committed late"
        );
    }
}

#[test]
fn a_first_404_is_only_not_yet_and_is_asked_again_after_release_confirm() {
    let now = at();
    assert_eq!(
        decide(
            &probed(),
            Some(ProbeAnswer::NotFound),
            &history(now, 31 * S, 0, None),
            now
        ),
        Resolution::ConfirmLater { after: 30 * S }
    );
}

#[test]
fn a_second_404_too_soon_waits_for_the_confirmation_time_not_for_backoff() {
    let now = at();
    assert_eq!(
        decide(
            &probed(),
            Some(ProbeAnswer::NotFound),
            &history(now, 50 * S, 7, Some(12 * S)),
            now
        ),
        Resolution::ConfirmLater { after: 18 * S },
        "due 30 s after the first 404, whatever the backoff of 7 attempts"
    );
}

#[test]
fn two_404s_release_confirm_apart_release_the_key() {
    let now = at();
    for apart in [30 * S, 31 * S, 3600 * S] {
        assert_eq!(
            decide(
                &probed(),
                Some(ProbeAnswer::NotFound),
                &history(now, 2 * apart, 0, Some(apart)),
                now
            ),
            Resolution::Release(Released::NotFoundTwice)
        );
    }
}

#[test]
fn an_inconclusive_probe_backs_off_exponentially_up_to_the_cap() {
    let now = at();
    let after = |attempts| match decide(
        &probed(),
        Some(ProbeAnswer::Inconclusive),
        &history(now, 40 * S, attempts, None),
        now,
    ) {
        Resolution::Retry { after } => after,
        other => panic!("{other:?}"),
    };
    assert_eq!(after(0), 5 * S);
    assert_eq!(after(1), 10 * S);
    assert_eq!(after(4), 80 * S);
    assert_eq!(after(7), 600 * S, "capped at max_backoff");
    assert_eq!(after(u32::MAX), 600 * S, "no overflow");
}

#[test]
fn an_inconclusive_probe_between_two_404s_does_not_forget_the_first() {
    let now = at();
    // 404 at t-40, inconclusive meanwhile (the row keeps its first 404), 404 now.
    let h = history(now, 90 * S, 2, Some(40 * S));
    assert!(matches!(
        decide(&probed(), Some(ProbeAnswer::Inconclusive), &h, now),
        Resolution::Retry { .. }
    ));
    assert_eq!(
        decide(&probed(), Some(ProbeAnswer::NotFound), &h, now),
        Resolution::Release(Released::NotFoundTwice)
    );
}

#[test]
fn a_clock_that_went_backwards_never_releases_early() {
    let now = at();
    let h = History {
        created_at: now + 60 * S,
        probe_attempts: 0,
        first_not_found: Some(now + 60 * S),
    };
    assert_eq!(
        decide(&probed(), Some(ProbeAnswer::NotFound), &h, now),
        Resolution::ConfirmLater { after: 30 * S }
    );
    let release_after = rules(false, OnUnknown::ReleaseAfter(600 * S));
    assert_eq!(
        decide(&release_after, None, &h, now),
        Resolution::Wait { after: 600 * S }
    );
}

#[test]
fn without_a_probe_hold_leaves_the_key_to_an_operator_however_old() {
    let now = at();
    for age in [S, 86_400 * S, 365 * 86_400 * S] {
        assert_eq!(
            decide(
                &rules(false, OnUnknown::Hold),
                None,
                &history(now, age, 0, None),
                now
            ),
            Resolution::Hold { after: 600 * S },
            "held keys never lapse ({age:?} old)"
        );
    }
}

#[test]
fn without_a_probe_release_after_waits_until_the_key_is_old_enough() {
    let now = at();
    let r = rules(false, OnUnknown::ReleaseAfter(600 * S));
    assert_eq!(
        decide(&r, None, &history(now, 100 * S, 0, None), now),
        Resolution::Wait { after: 500 * S }
    );
    assert_eq!(
        decide(&r, None, &history(now, 600 * S, 0, None), now),
        Resolution::Release(Released::Policy)
    );
    assert_eq!(
        decide(&r, None, &history(now, 7200 * S, 0, None), now),
        Resolution::Release(Released::Policy)
    );
}
