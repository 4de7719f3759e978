//! The engine's decisions, over an in-memory ledger (pure logic: no I/O).

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idem_core::policy::default_release_statuses;
use idem_core::{
    AttemptId, BodyKind, Cache, CacheEntry, CacheLookup, Claim, ClaimResult, Completed, Engine,
    Execution, Fence, Fingerprint, IdempotencyKey, Ledger, LedgerError, OnInProgress, Outcome,
    Policy, Record, RecordState, Request, Scope, StoredResponse, UnknownCause,
};

#[derive(Clone, Default)]
struct MemLedger {
    rows: Arc<Mutex<HashMap<Scope, Record>>>,
    fail_complete: Arc<AtomicBool>,
    /// Completions that fail before they start succeeding.
    failing_completes: Arc<AtomicUsize>,
    completes: Arc<AtomicUsize>,
    /// The next claim commits, but its reply is lost.
    lose_claim_reply: Arc<AtomicBool>,
    claims: Arc<AtomicUsize>,
    /// How long each claim and completion takes (a slow statement).
    claim_takes: Arc<Mutex<Duration>>,
    complete_takes: Arc<Mutex<Duration>>,
    /// When each completion started.
    completions_started: Arc<Mutex<Vec<tokio::time::Instant>>>,
}

#[derive(Debug)]
struct Down;
impl std::fmt::Display for Down {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ledger down")
    }
}
impl std::error::Error for Down {}

impl Ledger for MemLedger {
    async fn claim(&self, c: &Claim<'_>) -> Result<ClaimResult, LedgerError> {
        self.claims.fetch_add(1, Ordering::SeqCst);
        let takes = *self.claim_takes.lock().unwrap();
        tokio::time::sleep(takes).await;
        let mut rows = self.rows.lock().unwrap();
        if let Some(existing) = rows.get(c.scope) {
            return Ok(ClaimResult::Existing(existing.clone()));
        }
        rows.insert(
            c.scope.clone(),
            Record {
                fingerprint: *c.fingerprint,
                attempt: c.attempt,
                state: RecordState::InProgress {
                    lease_expired: false,
                },
                trace_context: c.trace_context.map(str::to_owned),
                expires_in: Some(c.ttl),
                expires_at: None,
            },
        );
        if self.lose_claim_reply.swap(false, Ordering::SeqCst) {
            return Err(LedgerError::new(Down));
        }
        Ok(ClaimResult::Claimed)
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, LedgerError> {
        Ok(self.rows.lock().unwrap().get(scope).cloned())
    }

    async fn complete(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        _: &Fingerprint,
        response: &StoredResponse,
        ttl: Duration,
    ) -> Result<Completed, LedgerError> {
        self.completes.fetch_add(1, Ordering::SeqCst);
        self.completions_started
            .lock()
            .unwrap()
            .push(tokio::time::Instant::now());
        let takes = *self.complete_takes.lock().unwrap();
        tokio::time::sleep(takes).await;
        if self.fail_complete.load(Ordering::SeqCst)
            || self
                .failing_completes
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(LedgerError::new(Down));
        }
        let mut rows = self.rows.lock().unwrap();
        match rows.get_mut(scope) {
            Some(row) if row.attempt == attempt => {
                row.state = RecordState::Completed(response.clone());
                let expires_at = LEDGER_NOW + ttl;
                row.expires_at = Some(expires_at);
                Ok(Completed::Recorded { expires_at })
            }
            _ => Ok(Completed::Lost),
        }
    }

    fn op_timeout(&self) -> Duration {
        OP_TIMEOUT
    }

    async fn release(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        let mut rows = self.rows.lock().unwrap();
        match rows.get(scope) {
            Some(row)
                if row.attempt == attempt
                    && matches!(row.state, RecordState::InProgress { .. }) =>
            {
                rows.remove(scope);
                Ok(Fence::Held)
            }
            _ => Ok(Fence::Lost),
        }
    }

    async fn hold(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        let mut rows = self.rows.lock().unwrap();
        match rows.get_mut(scope) {
            Some(row)
                if row.attempt == attempt
                    && matches!(row.state, RecordState::InProgress { .. }) =>
            {
                row.state = RecordState::InProgress {
                    lease_expired: true,
                };
                Ok(Fence::Held)
            }
            _ => Ok(Fence::Lost),
        }
    }
}

/// The longest one call of the in-memory ledger may take, as it tells the engine.
const OP_TIMEOUT: Duration = Duration::from_secs(1);

/// The in-memory ledger's clock, which dates every expiry it writes.
const LEDGER_NOW: SystemTime = SystemTime::UNIX_EPOCH;

fn policy() -> Policy {
    Policy {
        ttl: Duration::from_secs(60),
        lease: Duration::from_secs(30),
        on_in_progress: OnInProgress::Reject,
        wait_timeout: Duration::from_secs(2),
        release_on: default_release_statuses(),
        probe: false,
    }
}

fn scope() -> Scope {
    Scope::new(
        "acme",
        "POST /payments",
        IdempotencyKey::parse(b"k-1").unwrap(),
    )
}

fn fp(body: &str) -> Fingerprint {
    Fingerprint::compute("POST", "/payments", BodyKind::Json, body.as_bytes()).unwrap()
}

fn response(status: u16, body: &'static str) -> StoredResponse {
    StoredResponse::new(
        status,
        vec![("content-type".into(), b"application/json".to_vec())],
        Bytes::from_static(body.as_bytes()),
    )
}

fn answered(status: u16, body: &'static str) -> Execution<u16> {
    Execution::Responded {
        stored: response(status, body),
        passthrough: status,
    }
}

async fn run<C: Cache>(
    engine: &Engine<MemLedger, C>,
    body: &str,
    wait: Option<Duration>,
    result: Execution<u16>,
) -> (Outcome<u16>, bool) {
    run_under(engine, &policy(), body, wait, result).await
}

/// [`run`] under another route policy.
async fn run_under<C: Cache>(
    engine: &Engine<MemLedger, C>,
    policy: &Policy,
    body: &str,
    wait: Option<Duration>,
    result: Execution<u16>,
) -> (Outcome<u16>, bool) {
    let scope = scope();
    let fingerprint = fp(body);
    let executed = AtomicBool::new(false);
    let req = Request {
        scope: &scope,
        fingerprint: &fingerprint,
        policy,
        wait,
        trace_context: Some("00-trace-first"),
        gone: None,
    };
    let outcome = engine
        .run(req, |_| async {
            executed.store(true, Ordering::SeqCst);
            result
        })
        .await
        .expect("ledger up");
    (outcome, executed.load(Ordering::SeqCst))
}

#[tokio::test]
async fn executes_once_then_replays() {
    let engine = Engine::new(MemLedger::default());
    let (first, ran) = run(&engine, r#"{"a":1}"#, None, answered(201, "paid")).await;
    assert!(ran);
    let kept = LEDGER_NOW + policy().ttl;
    assert!(matches!(
        first,
        Outcome::Executed {
            response: 201,
            expires_at: Some(at),
        } if at == kept
    ));
    let (second, ran) = run(&engine, r#"{ "a" : 1 }"#, None, answered(201, "again")).await;
    assert!(!ran, "a replay never executes");
    match second {
        Outcome::Replayed {
            response,
            trace_context,
            waited,
            expires_at,
        } => {
            assert_eq!(response, self::response(201, "paid"));
            assert_eq!(trace_context.as_deref(), Some("00-trace-first"));
            assert!(!waited);
            assert_eq!(
                expires_at,
                Some(kept),
                "the replay says when the row expires"
            );
        }
        other => panic!("{other:?}"),
    }
}

#[tokio::test]
async fn a_different_payload_is_a_mismatch_completed_or_not() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    // In progress (the first attempt's outcome is unknown and the row stays).
    run(&engine, r#"{"a":1}"#, None, Execution::Unknown).await;
    let (outcome, ran) = run(&engine, r#"{"a":2}"#, None, answered(201, "x")).await;
    assert!(!ran);
    assert_eq!(outcome.name(), "mismatch");
    // Completed.
    ledger.rows.lock().unwrap().clear();
    run(&engine, r#"{"a":1}"#, None, answered(201, "x")).await;
    let (outcome, _) = run(&engine, r#"{"a":2}"#, None, answered(201, "x")).await;
    assert_eq!(outcome.name(), "mismatch");
}

#[tokio::test]
async fn in_progress_asks_to_retry_soon_or_later_once_the_lease_ran_out() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    run(&engine, "{}", None, Execution::Unknown).await;
    let (outcome, ran) = run(&engine, "{}", None, answered(201, "x")).await;
    assert!(!ran);
    assert!(
        matches!(outcome, Outcome::InProgress { retry_after, waited: false, .. } if retry_after == Duration::from_secs(1))
    );
    for row in ledger.rows.lock().unwrap().values_mut() {
        row.state = RecordState::InProgress {
            lease_expired: true,
        };
    }
    let (outcome, _) = run(&engine, "{}", None, answered(201, "x")).await;
    assert!(
        matches!(outcome, Outcome::InProgress { retry_after, .. } if retry_after == Duration::from_secs(5))
    );
}

#[tokio::test]
async fn only_statuses_that_mean_not_processed_release_the_key() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    for status in [429, 408, 425] {
        let (outcome, ran) = run(&engine, "{}", None, answered(status, "no")).await;
        assert!(ran);
        assert!(matches!(outcome, Outcome::Released(s) if s == status));
        assert!(ledger.rows.lock().unwrap().is_empty(), "{status} released");
    }
    for status in [422, 500, 503] {
        ledger.rows.lock().unwrap().clear();
        let (outcome, _) = run(&engine, "{}", None, answered(status, "kept")).await;
        assert!(
            matches!(
                outcome,
                Outcome::Executed {
                    expires_at: Some(_),
                    ..
                }
            ),
            "{status} is kept and replayed (no probe could settle it)"
        );
    }
}

#[tokio::test]
async fn a_5xx_on_a_probed_route_is_uncertain_and_held_for_the_reconciler() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    let probed = Policy {
        probe: true,
        ..policy()
    };
    let (outcome, _) = run_under(&engine, &probed, "{}", None, answered(502, "bad gateway")).await;
    assert!(matches!(outcome, Outcome::Uncertain(502)));
    assert_eq!(outcome.name(), "unknown");
    let (retry, ran) = run_under(&engine, &probed, "{}", None, answered(201, "paid")).await;
    assert!(!ran, "never executed again");
    assert!(
        matches!(
            retry,
            Outcome::InProgress {
                outcome_unknown: true,
                ..
            }
        ),
        "held, its lease ended for an immediate probe: {retry:?}"
    );
}

#[tokio::test(start_paused = true)]
async fn a_completion_that_fails_is_repeated_within_the_lease() {
    let ledger = MemLedger::default();
    ledger.failing_completes.store(3, Ordering::SeqCst);
    let engine = Engine::new(ledger.clone());
    let (outcome, _) = run(&engine, "{}", None, answered(201, "paid")).await;
    assert!(matches!(
        outcome,
        Outcome::Executed {
            expires_at: Some(_),
            ..
        }
    ));
    assert_eq!(ledger.completes.load(Ordering::SeqCst), 4);
    let (replay, ran) = run(&engine, "{}", None, answered(201, "again")).await;
    assert!(!ran);
    assert!(matches!(replay, Outcome::Replayed { .. }));
}

#[tokio::test(start_paused = true)]
async fn a_claim_whose_reply_was_lost_is_released_not_held_for_good() {
    let ledger = MemLedger::default();
    ledger.lose_claim_reply.store(true, Ordering::SeqCst);
    let engine = Engine::new(ledger.clone());
    let (scope, fingerprint, policy) = (scope(), fp("{}"), policy());
    let req = Request {
        scope: &scope,
        fingerprint: &fingerprint,
        policy: &policy,
        wait: None,
        trace_context: None,
        gone: None,
    };
    let failed = engine.run(req, |_| async { answered(201, "paid") }).await;
    assert!(failed.is_err(), "the client is told the ledger failed");
    assert!(
        ledger.rows.lock().unwrap().is_empty(),
        "the row the lost reply left behind is released"
    );
    let (outcome, ran) = run(&engine, "{}", None, answered(201, "paid")).await;
    assert!(ran, "nothing ran before, so the retry executes");
    assert!(matches!(outcome, Outcome::Executed { .. }));
}

#[tokio::test]
async fn not_sent_releases_and_unknown_holds() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    let (outcome, _) = run(&engine, "{}", None, Execution::NotSent).await;
    assert!(matches!(outcome, Outcome::UpstreamUnavailable));
    assert!(ledger.rows.lock().unwrap().is_empty());
    let (outcome, _) = run(&engine, "{}", None, Execution::Unknown).await;
    assert!(matches!(outcome, Outcome::Unknown(UnknownCause::Upstream)));
    assert_eq!(outcome.name(), "unknown");
    let rows = ledger.rows.lock().unwrap();
    assert!(matches!(
        rows.values().next().unwrap().state,
        RecordState::InProgress { .. }
    ));
}

#[tokio::test(start_paused = true)]
async fn a_result_that_cannot_be_recorded_is_not_shown_and_the_key_stays_held() {
    let ledger = MemLedger::default();
    ledger.fail_complete.store(true, Ordering::SeqCst);
    let engine = Engine::new(ledger.clone());
    let (outcome, ran) = run(&engine, "{}", None, answered(201, "paid")).await;
    assert!(ran);
    assert!(matches!(outcome, Outcome::Unknown(UnknownCause::Ledger)));
    let rows = ledger.rows.lock().unwrap();
    assert!(matches!(
        rows.values().next().unwrap().state,
        RecordState::InProgress { .. }
    ));
}

#[tokio::test]
async fn a_lost_fence_changes_nothing() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    let scope = scope();
    let fingerprint = fp("{}");
    let policy = policy();
    let req = Request {
        scope: &scope,
        fingerprint: &fingerprint,
        policy: &policy,
        wait: None,
        trace_context: None,
        gone: None,
    };
    let outcome = engine
        .run(req, |_| async {
            // Meanwhile another party (the reconciler) resolved the row.
            let mut rows = ledger.rows.lock().unwrap();
            let row = rows.get_mut(&scope).unwrap();
            row.attempt = AttemptId::random();
            row.state = RecordState::Completed(response(201, "resolved"));
            drop(rows);
            answered(201, "late")
        })
        .await
        .unwrap();
    assert!(matches!(
        outcome,
        Outcome::Executed {
            expires_at: None,
            ..
        }
    ));
    let rows = ledger.rows.lock().unwrap();
    assert_eq!(
        rows[&scope].state,
        RecordState::Completed(response(201, "resolved"))
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiting_retry_gets_the_replay_when_the_first_attempt_completes() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    run(&engine, "{}", None, Execution::Unknown).await;
    let completer = {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(80)).await; // paused time: no real wait
            for row in ledger.rows.lock().unwrap().values_mut() {
                row.state = RecordState::Completed(response(201, "done"));
            }
        })
    };
    let (outcome, ran) = run(
        &engine,
        "{}",
        Some(Duration::from_secs(2)),
        answered(201, "x"),
    )
    .await;
    completer.await.unwrap();
    assert!(!ran);
    assert!(
        matches!(outcome, Outcome::Replayed { waited: true, ref response, .. } if response.body == "done")
    );
}

#[tokio::test(start_paused = true)]
async fn a_waiting_retry_executes_itself_if_the_first_attempt_released_the_key() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    run(&engine, "{}", None, Execution::Unknown).await;
    let releaser = {
        let ledger = ledger.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(80)).await; // paused time: no real wait
            ledger.rows.lock().unwrap().clear();
        })
    };
    let (outcome, ran) = run(
        &engine,
        "{}",
        Some(Duration::from_secs(2)),
        answered(201, "mine"),
    )
    .await;
    releaser.await.unwrap();
    assert!(ran);
    assert!(matches!(
        outcome,
        Outcome::Executed {
            expires_at: Some(_),
            ..
        }
    ));
}

#[tokio::test(start_paused = true)]
async fn a_wait_that_times_out_reports_in_progress() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    run(&engine, "{}", None, Execution::Unknown).await;
    let before = ledger.claims.load(Ordering::SeqCst);
    let (outcome, ran) = run(
        &engine,
        "{}",
        Some(Duration::from_millis(150)),
        answered(201, "x"),
    )
    .await;
    assert!(!ran);
    assert!(matches!(outcome, Outcome::InProgress { waited: true, .. }));
    assert_eq!(
        ledger.claims.load(Ordering::SeqCst),
        before + 1,
        "one claim, then polling reads"
    );
}

#[tokio::test]
async fn peek_answers_from_the_in_process_cache_only() {
    use idem_core::NoCache;
    use idem_core::local::{Bounds, Local};
    let engine = Engine::with_cache(
        MemLedger::default(),
        Local::new(
            NoCache,
            Bounds {
                entries: 10,
                bytes: 1 << 20,
            },
        ),
    );
    let (scope, policy) = (scope(), policy());
    let (paid, other) = (fp(r#"{"a":1}"#), fp(r#"{"a":2}"#));
    let req = |fingerprint| Request {
        scope: &scope,
        fingerprint,
        policy: &policy,
        wait: None,
        trace_context: None,
        gone: None,
    };
    assert!(engine.peek::<u16>(req(&paid)).is_none(), "nothing held yet");
    let entry = CacheEntry {
        fingerprint: paid,
        response: response(201, "paid"),
        trace_context: None,
        expires_at: None,
    };
    engine
        .cache()
        .fill(&scope, &entry, Duration::from_secs(60))
        .await;
    assert!(matches!(
        engine.peek::<u16>(req(&paid)),
        Some(Outcome::Replayed { .. })
    ));
    assert!(matches!(
        engine.peek::<u16>(req(&other)),
        Some(Outcome::Mismatch { .. })
    ));
    assert_eq!(
        engine.ledger().claims.load(Ordering::SeqCst),
        0,
        "no ledger call"
    );
}

/// A cache that answers every lookup as the test says and records what the engine
/// asked of it: the fast path's branches without Redis.
#[derive(Default)]
struct FakeCache {
    answer: Mutex<Option<FakeLookup>>,
    calls: Mutex<Vec<String>>,
    /// The TTL of every `fill`.
    fills: Mutex<Vec<Duration>>,
}

#[derive(Clone)]
enum FakeLookup {
    Completed(CacheEntry),
    Locked(Duration),
    Acquired,
    Unavailable,
}

impl FakeCache {
    fn answering(lookup: FakeLookup) -> Self {
        let cache = Self::default();
        cache.answer(lookup);
        cache
    }

    fn answer(&self, lookup: FakeLookup) {
        *self.answer.lock().unwrap() = Some(lookup);
    }

    fn calls(&self) -> Vec<String> {
        std::mem::take(&mut self.calls.lock().unwrap())
    }

    fn note(&self, call: String) {
        self.calls.lock().unwrap().push(call);
    }
}

impl Cache for FakeCache {
    async fn lookup(&self, _: &Scope, attempt: AttemptId, _: Duration) -> CacheLookup {
        self.note(format!("lookup {}", attempt.0));
        match self.answer.lock().unwrap().clone().expect("an answer set") {
            FakeLookup::Completed(entry) => CacheLookup::Completed(entry, None),
            FakeLookup::Locked(held_for) => CacheLookup::Locked { held_for },
            FakeLookup::Acquired => CacheLookup::Acquired,
            FakeLookup::Unavailable => CacheLookup::Unavailable,
        }
    }
    async fn fill(&self, _: &Scope, entry: &CacheEntry, ttl: Duration) {
        self.note(format!("fill {}", entry.response.status));
        self.fills.lock().unwrap().push(ttl);
    }
    async fn complete(&self, _: &Scope, attempt: AttemptId, entry: &CacheEntry, _: Duration) {
        self.note(format!("complete {} {}", attempt.0, entry.response.status));
    }
    async fn unlock(&self, _: &Scope, attempt: AttemptId) {
        self.note(format!("unlock {}", attempt.0));
    }
    async fn changed(&self, _: &Scope) {
        std::future::pending().await
    }
}

/// The attempt the engine looked up with (the first call).
fn looked_up_attempt(calls: &[String]) -> &str {
    calls[0]
        .strip_prefix("lookup ")
        .expect("the lookup comes first")
}

#[tokio::test]
async fn a_cached_completion_answers_without_the_ledger_after_a_fingerprint_check() {
    let paid = CacheEntry {
        fingerprint: fp(r#"{"a":1}"#),
        response: response(201, "paid"),
        trace_context: None,
        expires_at: None,
    };
    let engine = Engine::with_cache(
        MemLedger::default(),
        FakeCache::answering(FakeLookup::Completed(paid)),
    );
    let (same, ran) = run(&engine, r#"{"a":1}"#, None, answered(201, "again")).await;
    assert!(!ran);
    assert!(matches!(same, Outcome::Replayed { ref response, .. } if response.body == "paid"));
    let (other, ran) = run(&engine, r#"{"a":2}"#, None, answered(201, "again")).await;
    assert!(!ran);
    assert!(
        matches!(
            other,
            Outcome::Mismatch {
                completed: true,
                ..
            }
        ),
        "a cached answer is never replayed to a different payload: {other:?}"
    );
    assert_eq!(engine.ledger().claims.load(Ordering::SeqCst), 0);
}

#[tokio::test]
async fn a_young_lock_turns_a_retry_away_and_an_old_one_asks_the_ledger() {
    let engine = Engine::with_cache(
        MemLedger::default(),
        FakeCache::answering(FakeLookup::Acquired),
    );
    run(&engine, r#"{"a":1}"#, None, answered(201, "paid")).await;
    engine.cache().calls();
    let claims = || engine.ledger().claims.load(Ordering::SeqCst);

    engine
        .cache()
        .answer(FakeLookup::Locked(Duration::from_millis(200)));
    let (young, ran) = run(&engine, r#"{"a":1}"#, None, answered(201, "again")).await;
    assert!(!ran);
    assert!(matches!(young, Outcome::InProgress { .. }), "{young:?}");
    assert_eq!(claims(), 1, "a young lock is trusted: no ledger call");
    engine.cache().calls();

    // A lock older than a second may outlive its attempt (a crash between the commit
    // and the unlock): the ledger knows the row completed.
    engine
        .cache()
        .answer(FakeLookup::Locked(Duration::from_secs(2)));
    let (old, ran) = run(&engine, r#"{"a":1}"#, None, answered(201, "again")).await;
    assert!(!ran);
    assert!(matches!(old, Outcome::Replayed { ref response, .. } if response.body == "paid"));
    assert_eq!(claims(), 2);
    let calls = engine.cache().calls();
    assert_eq!(calls[1..], ["fill 201"], "the replay is cached again");
}

#[tokio::test]
async fn an_acquired_lock_is_handed_over_with_the_result_or_dropped() {
    let engine = Engine::with_cache(
        MemLedger::default(),
        FakeCache::answering(FakeLookup::Acquired),
    );
    let (done, _) = run(&engine, r#"{"a":1}"#, None, answered(201, "paid")).await;
    assert!(matches!(
        done,
        Outcome::Executed {
            expires_at: Some(_),
            ..
        }
    ));
    let calls = engine.cache().calls();
    let attempt = looked_up_attempt(&calls);
    assert_eq!(calls[1..], [format!("complete {attempt} 201")], "{calls:?}");

    // Released (a 429 proves nothing ran): the lock goes, no result is cached.
    let released = Scope::new(
        "acme",
        "POST /payments",
        IdempotencyKey::parse(b"k-2").unwrap(),
    );
    let fingerprint = fp(r#"{"a":1}"#);
    let policy = policy();
    let request = Request {
        scope: &released,
        fingerprint: &fingerprint,
        policy: &policy,
        wait: None,
        trace_context: None,
        gone: None,
    };
    engine
        .run(request, |_| async { answered(429, "slow down") })
        .await
        .unwrap();
    let calls = engine.cache().calls();
    assert_eq!(
        calls[1..],
        [format!("unlock {}", looked_up_attempt(&calls))]
    );

    // The lock was free but the ledger has the row (Redis lost its copy): the lock is
    // dropped and the ledger's answer replayed.
    let (replay, ran) = run(&engine, r#"{"a":1}"#, None, answered(201, "again")).await;
    assert!(!ran);
    assert!(matches!(replay, Outcome::Replayed { .. }));
    let calls = engine.cache().calls();
    assert_eq!(
        calls[1..],
        [
            format!("unlock {}", looked_up_attempt(&calls)),
            "fill 201".into()
        ]
    );
}

#[tokio::test]
async fn an_unavailable_cache_leaves_every_decision_to_the_ledger() {
    let engine = Engine::with_cache(
        MemLedger::default(),
        FakeCache::answering(FakeLookup::Unavailable),
    );
    let (first, ran) = run(&engine, r#"{"a":1}"#, None, answered(201, "paid")).await;
    assert!(ran && matches!(first, Outcome::Executed { .. }));
    let (again, ran) = run(&engine, r#"{"a":1}"#, None, answered(201, "again")).await;
    assert!(
        !ran && matches!(again, Outcome::Replayed { ref response, .. } if response.body == "paid")
    );
    let (other, ran) = run(&engine, r#"{"a":2}"#, None, answered(201, "again")).await;
    assert!(!ran && matches!(other, Outcome::Mismatch { .. }));
    assert_eq!(engine.ledger().claims.load(Ordering::SeqCst), 3);
}

/// The whole attempt — claim, upstream call and completion — ends within its lease, so
/// the reconciler never acts on a row whose completion is still running: the upstream
/// gets what the lease leaves after one ledger call, and a failed completion is repeated
/// only while a repeat would still end within the lease. (On 7fa843d the last repeat
/// started 25 ms before the lease's end and ran a whole op timeout past it.)
#[tokio::test(start_paused = true)]
async fn every_completion_ends_within_the_lease() {
    let ledger = MemLedger::default();
    ledger.fail_complete.store(true, Ordering::SeqCst);
    *ledger.complete_takes.lock().unwrap() = OP_TIMEOUT;
    let engine = Engine::new(ledger.clone());
    let lease = Duration::from_secs(3);
    let policy = Policy { lease, ..policy() };
    let (scope, fingerprint) = (scope(), fp("{}"));
    let req = Request {
        scope: &scope,
        fingerprint: &fingerprint,
        policy: &policy,
        wait: None,
        trace_context: None,
        gone: None,
    };
    let started = tokio::time::Instant::now();
    let deadline = Mutex::new(None);
    let outcome = engine
        .run(req, |attempt| {
            *deadline.lock().unwrap() = Some(attempt.deadline);
            async {
                // The upstream answers after 900 ms.
                tokio::time::sleep(Duration::from_millis(900)).await;
                answered(201, "paid")
            }
        })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::Unknown(UnknownCause::Ledger)));
    let deadline = deadline.lock().unwrap().expect("executed");
    assert!(
        deadline <= started + lease - OP_TIMEOUT,
        "the upstream may run until {:?} of a {lease:?} lease",
        deadline - started
    );
    let starts = ledger.completions_started.lock().unwrap().clone();
    assert!(starts.len() >= 2, "repeated: {starts:?}");
    for start in starts {
        assert!(
            start + OP_TIMEOUT <= started + lease,
            "a completion ran until {:?} of a {lease:?} lease",
            start + OP_TIMEOUT - started
        );
    }
}

/// A replay read from the ledger is cached for what is left of the row's life as the
/// ledger measured it when the statement began, less everything since: never past the
/// row. (On 7fa843d a claim statement that took 2 s left the cached copy 2 s longer than
/// its row.)
#[tokio::test(start_paused = true)]
async fn a_replay_cached_from_the_ledger_never_outlives_its_row() {
    let ledger = MemLedger::default();
    let cache = FakeCache::answering(FakeLookup::Unavailable);
    let engine = Engine::with_cache(ledger.clone(), cache);
    run(&engine, "{}", None, answered(201, "paid")).await;
    // The row lives 10 s more, as the ledger sees it when a statement starts; the next
    // claim statement takes 2 s.
    for row in ledger.rows.lock().unwrap().values_mut() {
        row.expires_in = Some(Duration::from_secs(10));
    }
    *ledger.claim_takes.lock().unwrap() = Duration::from_secs(2);
    let (outcome, _) = run(&engine, "{}", None, answered(201, "again")).await;
    assert!(matches!(outcome, Outcome::Replayed { .. }));
    let fills = engine.cache().fills.lock().unwrap().clone();
    assert_eq!(fills.len(), 1);
    assert!(
        fills[0] <= Duration::from_secs(8),
        "cached for {:?} of a row with 8 s left",
        fills[0]
    );
}

/// A retry waiting for another attempt stops as soon as its client is gone: it holds
/// its slot and polls the ledger for nobody otherwise.
#[tokio::test(start_paused = true)]
async fn a_waiter_whose_client_left_stops_waiting() {
    let ledger = MemLedger::default();
    let engine = Engine::new(ledger.clone());
    run(&engine, "{}", None, Execution::Unknown).await;
    let (scope, fingerprint, policy) = (scope(), fp("{}"), policy());
    let gone = tokio_util::sync::CancellationToken::new();
    let req = Request {
        scope: &scope,
        fingerprint: &fingerprint,
        policy: &policy,
        wait: Some(Duration::from_secs(2)),
        trace_context: None,
        gone: Some(&gone),
    };
    let started = tokio::time::Instant::now();
    let leaving = gone.clone();
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(50)).await;
        leaving.cancel();
    });
    let outcome = engine
        .run(req, |_| async { answered(201, "never") })
        .await
        .unwrap();
    assert!(matches!(outcome, Outcome::InProgress { .. }), "{outcome:?}");
    assert!(
        started.elapsed() < Duration::from_millis(100),
        "waited {:?} for a client that left at 50 ms",
        started.elapsed()
    );
}
