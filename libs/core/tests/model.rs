//! The engine, model-checked: random sequences of requests (alone or two at once, so they
//! interleave at every await), retries, changed bodies, other tenants, crashes between any
//! two steps, lost replies, failing stores, cache flushes, lease expiry and reconciler
//! passes, over an in-memory ledger, cache and upstream — checked after every step
//! against a write-once model of each scope: never two executions, never a replay of
//! another result, never a recorded answer the ledger does not hold.
//!
//! `MODEL_CASES` sets the number of cases (scripts/test runs 10,000).

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use bytes::Bytes;
use idem_core::policy::default_release_statuses;
use idem_core::reconcile::{self, History, OnUnknown, ProbeAnswer, Resolution, Rules};
use idem_core::{
    AttemptId, BodyKind, Cache, CacheEntry, CacheLookup, Claim, ClaimResult, Completed,
    Disposition, Engine, Execution, Fence, Fingerprint, IdempotencyKey, Ledger, LedgerError,
    OnInProgress, Outcome, Policy, Record, RecordState, Request, Scope, StoredResponse,
};
use proptest::prelude::*;
use tokio::time::Instant;

const LEASE: Duration = Duration::from_secs(30);

// ---- the world: ledger, cache and upstream, all in memory ---------------------------

#[derive(Debug, Clone)]
struct Row {
    record: Record,
    lease_until: Instant,
    held: bool,
    first_not_found: Option<SystemTime>,
    probes: u32,
}

#[derive(Debug)]
enum Slot {
    Locked { attempt: AttemptId, since: Instant },
    Completed(CacheEntry),
}

/// What the upstream did for a scope: each effective execution's request body (which
/// variant) and answer.
#[derive(Debug, Default)]
struct World {
    rows: Mutex<HashMap<Scope, Row>>,
    cache: Mutex<HashMap<Scope, Slot>>,
    executions: Mutex<HashMap<Scope, Vec<(usize, StoredResponse)>>>,
    serial: AtomicUsize,
}

/// A fault planted in one request: at its `at`-th step (a ledger or cache call, or the
/// upstream call before or after it acts), the request crashes (its future is dropped
/// there), the call fails before doing anything, or it takes effect and its reply is lost.
#[derive(Debug, Clone, Copy)]
enum FaultKind {
    Crash,
    FailBefore,
    LoseReply,
}

#[derive(Debug, Clone, Copy)]
struct Fault {
    at: usize,
    kind: FaultKind,
}

/// Per request: its fault and the steps it took so far.
struct Plan {
    fault: Option<Fault>,
    steps: AtomicUsize,
    crashed: tokio::sync::Notify,
}

tokio::task_local! {
    static PLAN: Arc<Plan>;
}

#[derive(Debug)]
struct Injected;
impl std::fmt::Display for Injected {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("injected fault")
    }
}
impl std::error::Error for Injected {}

/// One step of the current request: yields (so concurrent requests interleave here),
/// then applies the request's fault if it is due. `Err(true)`: fail before the effect;
/// `Ok(true)`: lose the reply after it.
async fn step() -> Result<bool, LedgerError> {
    tokio::task::yield_now().await;
    let Ok(plan) = PLAN.try_with(Arc::clone) else {
        return Ok(false);
    };
    let n = plan.steps.fetch_add(1, Ordering::SeqCst);
    match plan.fault {
        Some(Fault { at, kind }) if at == n => match kind {
            FaultKind::Crash => {
                plan.crashed.notify_one();
                std::future::pending().await
            }
            FaultKind::FailBefore => Err(LedgerError::new(Injected)),
            FaultKind::LoseReply => Ok(true),
        },
        _ => Ok(false),
    }
}

/// A new expiry for each completion of the model's ledger, so that an answer that names
/// an expiry can be traced to the row's.
fn next_expiry() -> SystemTime {
    static COMPLETIONS: AtomicUsize = AtomicUsize::new(1);
    SystemTime::UNIX_EPOCH + Duration::from_secs(COMPLETIONS.fetch_add(1, Ordering::Relaxed) as u64)
}

fn lost<T>(lose: bool, value: T) -> Result<T, LedgerError> {
    if lose {
        Err(LedgerError::new(Injected))
    } else {
        Ok(value)
    }
}

#[derive(Clone, Default)]
struct Ledger_(Arc<World>);

impl Ledger for Ledger_ {
    fn op_timeout(&self) -> Duration {
        Duration::ZERO
    }

    async fn claim(&self, c: &Claim<'_>) -> Result<ClaimResult, LedgerError> {
        let lose = step().await?;
        let mut rows = self.0.rows.lock().unwrap();
        let now = Instant::now();
        let result = match rows.get(c.scope) {
            Some(row) => ClaimResult::Existing(view(row, now)),
            None => {
                rows.insert(
                    c.scope.clone(),
                    Row {
                        record: Record {
                            fingerprint: *c.fingerprint,
                            attempt: c.attempt,
                            state: RecordState::InProgress {
                                lease_expired: false,
                            },
                            trace_context: None,
                            expires_in: Some(c.ttl),
                            expires_at: None,
                        },
                        lease_until: now + c.lease,
                        held: false,
                        first_not_found: None,
                        probes: 0,
                    },
                );
                ClaimResult::Claimed
            }
        };
        lost(lose, result)
    }

    async fn get(&self, scope: &Scope) -> Result<Option<Record>, LedgerError> {
        let lose = step().await?;
        let rows = self.0.rows.lock().unwrap();
        lost(lose, rows.get(scope).map(|row| view(row, Instant::now())))
    }

    async fn complete(
        &self,
        scope: &Scope,
        attempt: AttemptId,
        _: &Fingerprint,
        response: &StoredResponse,
        _: Duration,
    ) -> Result<Completed, LedgerError> {
        let lose = step().await?;
        let mut rows = self.0.rows.lock().unwrap();
        let completed = match rows.get_mut(scope) {
            Some(row) if row.record.attempt == attempt => {
                // A repeat (its first reply was lost) keeps the first completion's expiry.
                let expires_at = match (&row.record.state, row.record.expires_at) {
                    (RecordState::Completed(_), Some(kept)) => kept,
                    _ => next_expiry(),
                };
                row.record.state = RecordState::Completed(response.clone());
                row.record.expires_at = Some(expires_at);
                Completed::Recorded { expires_at }
            }
            _ => Completed::Lost,
        };
        lost(lose, completed)
    }

    async fn release(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        let lose = step().await?;
        let mut rows = self.0.rows.lock().unwrap();
        let fence = match rows.get(scope) {
            Some(row) if row.record.attempt == attempt && in_progress(row) => {
                rows.remove(scope);
                Fence::Held
            }
            _ => Fence::Lost,
        };
        lost(lose, fence)
    }

    async fn hold(&self, scope: &Scope, attempt: AttemptId) -> Result<Fence, LedgerError> {
        let lose = step().await?;
        let mut rows = self.0.rows.lock().unwrap();
        let fence = match rows.get_mut(scope) {
            Some(row) if row.record.attempt == attempt && in_progress(row) => {
                row.lease_until = Instant::now();
                row.held = true;
                Fence::Held
            }
            _ => Fence::Lost,
        };
        lost(lose, fence)
    }
}

fn in_progress(row: &Row) -> bool {
    matches!(row.record.state, RecordState::InProgress { .. })
}

fn view(row: &Row, now: Instant) -> Record {
    let mut record = row.record.clone();
    if let RecordState::InProgress { lease_expired } = &mut record.state {
        *lease_expired = row.held || now >= row.lease_until;
    }
    record
}

/// The fast path: a lock per scope and completed entries, flushed at random.
#[derive(Clone, Default)]
struct Cache_(Arc<World>);

impl Cache for Cache_ {
    async fn lookup(&self, scope: &Scope, attempt: AttemptId, lease: Duration) -> CacheLookup {
        if step().await.is_err() {
            return CacheLookup::Unavailable;
        }
        let mut cache = self.0.cache.lock().unwrap();
        let now = Instant::now();
        match cache.get(scope) {
            Some(Slot::Completed(entry)) => CacheLookup::Completed(entry.clone(), None),
            Some(Slot::Locked { since, .. }) if now < *since + lease => CacheLookup::Locked {
                held_for: now - *since,
            },
            _ => {
                cache.insert(
                    scope.clone(),
                    Slot::Locked {
                        attempt,
                        since: now,
                    },
                );
                CacheLookup::Acquired
            }
        }
    }

    async fn fill(&self, scope: &Scope, entry: &CacheEntry, _: Duration) {
        if step().await.is_ok() {
            let mut cache = self.0.cache.lock().unwrap();
            cache.insert(scope.clone(), Slot::Completed(entry.clone()));
        }
    }

    async fn complete(&self, scope: &Scope, _: AttemptId, entry: &CacheEntry, _: Duration) {
        if step().await.is_ok() {
            let mut cache = self.0.cache.lock().unwrap();
            cache.insert(scope.clone(), Slot::Completed(entry.clone()));
        }
    }

    async fn unlock(&self, scope: &Scope, attempt: AttemptId) {
        if step().await.is_ok() {
            let mut cache = self.0.cache.lock().unwrap();
            if matches!(cache.get(scope), Some(Slot::Locked { attempt: a, .. }) if *a == attempt) {
                cache.remove(scope);
            }
        }
    }

    async fn changed(&self, _: &Scope) {
        std::future::pending().await
    }
}

// ---- the operations -----------------------------------------------------------------

/// What the upstream does with a request that reaches it.
#[derive(Debug, Clone, Copy)]
enum Upstream {
    /// Acts and answers with this status.
    Answers(u16),
    /// Acts, then the answer never arrives (timeout, broken connection).
    ActsThenTimesOut,
    /// Never reached (connection refused).
    Refused,
}

#[derive(Debug, Clone)]
struct Send {
    scope: usize,
    body: usize,
    upstream: Upstream,
    wait: bool,
    fault: Option<Fault>,
}

#[derive(Debug, Clone)]
enum Op {
    Send(Send),
    Both(Send, Send),
    FlushCache,
    PastTheLease,
    Reconcile,
}

fn scopes() -> Vec<Scope> {
    let key = |k: &str| IdempotencyKey::parse(k.as_bytes()).unwrap();
    vec![
        Scope::new("acme", "POST /payments", key("k1")),
        Scope::new("acme", "POST /payments", key("k2")),
        Scope::new("globex", "POST /payments", key("k1")),
    ]
}

fn send() -> impl Strategy<Value = Send> {
    let upstream = prop_oneof![
        4 => prop_oneof![Just(201u16), Just(200), Just(422), Just(500), Just(503), Just(429)]
            .prop_map(Upstream::Answers),
        1 => Just(Upstream::ActsThenTimesOut),
        1 => Just(Upstream::Refused),
    ];
    let fault = proptest::option::weighted(
        0.4,
        (
            0..8usize,
            prop_oneof![
                Just(FaultKind::Crash),
                Just(FaultKind::FailBefore),
                Just(FaultKind::LoseReply)
            ],
        )
            .prop_map(|(at, kind)| Fault { at, kind }),
    );
    (
        0..3usize,
        0..2usize,
        upstream,
        proptest::bool::weighted(0.2),
        fault,
    )
        .prop_map(|(scope, body, upstream, wait, fault)| Send {
            scope,
            body,
            upstream,
            wait,
            fault,
        })
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        8 => send().prop_map(Op::Send),
        3 => (send(), send()).prop_map(|(a, b)| Op::Both(a, b)),
        1 => Just(Op::FlushCache),
        2 => Just(Op::PastTheLease),
        2 => Just(Op::Reconcile),
    ]
}

fn policy() -> Policy {
    Policy {
        ttl: Duration::from_secs(86_400),
        lease: LEASE,
        on_in_progress: OnInProgress::Reject,
        wait_timeout: Duration::from_secs(5),
        release_on: default_release_statuses(),
        probe: true,
    }
}

// ---- running them, and the model ---------------------------------------------------

struct Harness {
    world: Arc<World>,
    engine: Engine<Ledger_, Cache_>,
    scopes: Vec<Scope>,
    policy: Policy,
}

impl Harness {
    fn new() -> Self {
        let world = Arc::new(World::default());
        Self {
            engine: Engine::with_cache(Ledger_(world.clone()), Cache_(world.clone())),
            world,
            scopes: scopes(),
            policy: policy(),
        }
    }

    /// One request through the engine; `None` if it crashed.
    async fn send(&self, s: &Send) -> Option<Result<Outcome<StoredResponse>, LedgerError>> {
        let scope = &self.scopes[s.scope];
        let body = format!("{{\"amount\":{}}}", s.body);
        let fingerprint =
            Fingerprint::compute("POST", "/payments", BodyKind::Json, body.as_bytes()).unwrap();
        let req = Request {
            scope,
            fingerprint: &fingerprint,
            policy: &self.policy,
            wait: s.wait.then_some(Duration::from_secs(2)),
            trace_context: None,
            gone: None,
        };
        let plan = Arc::new(Plan {
            fault: s.fault,
            steps: AtomicUsize::new(0),
            crashed: tokio::sync::Notify::new(),
        });
        let world = self.world.clone();
        let upstream = s.upstream;
        let variant = s.body;
        let run = self.engine.run(req, move |_| async move {
            // A crash here: the upstream was never reached.
            if step().await.is_err() {
                return Execution::NotSent;
            }
            if let Upstream::Refused = upstream {
                return Execution::NotSent;
            }
            let n = world.serial.fetch_add(1, Ordering::SeqCst);
            let status = match upstream {
                Upstream::Answers(status) => status,
                _ => 201,
            };
            let response = StoredResponse::new(
                status,
                Vec::new(),
                Bytes::from(format!("execution {n} of {}", scope.key.as_str())),
            );
            // 429 says "not processed": it is no execution of the operation.
            if !default_release_statuses().contains(status) {
                let mut executions = world.executions.lock().unwrap();
                executions
                    .entry(scope.clone())
                    .or_default()
                    .push((variant, response.clone()));
            }
            // A crash here: the upstream acted, the gateway died before hearing of it.
            let _ = step().await;
            match upstream {
                Upstream::ActsThenTimesOut => Execution::Unknown,
                _ => Execution::Responded {
                    stored: response.clone(),
                    passthrough: response,
                },
            }
        });
        let crashed = plan.crashed.notified();
        PLAN.scope(plan.clone(), async {
            tokio::select! {
                outcome = run => Some(outcome),
                () = crashed => None,
            }
        })
        .await
    }

    /// One reconciler pass over every row whose lease is over, probing the upstream.
    fn reconcile(&self, now_wall: SystemTime) {
        let rules = Rules {
            probe: true,
            on_unknown: OnUnknown::Hold,
            release_confirm: Duration::from_secs(30),
            backoff: Duration::from_secs(5),
            max_backoff: Duration::from_secs(600),
        };
        let executions = self.world.executions.lock().unwrap();
        let mut rows = self.world.rows.lock().unwrap();
        let now = Instant::now();
        let stuck: Vec<Scope> = rows
            .iter()
            .filter(|(_, row)| in_progress(row) && (row.held || now >= row.lease_until))
            .map(|(scope, _)| scope.clone())
            .collect();
        for scope in stuck {
            let found = executions
                .get(&scope)
                .and_then(|e| e.last())
                .map(|(_, r)| r.clone());
            let answer = if found.is_some() {
                ProbeAnswer::Found
            } else {
                ProbeAnswer::NotFound
            };
            let row = rows.get_mut(&scope).unwrap();
            let history = History {
                created_at: now_wall - Duration::from_secs(60),
                probe_attempts: row.probes,
                first_not_found: row.first_not_found,
            };
            match reconcile::decide(&rules, Some(answer), &history, now_wall) {
                Resolution::Complete => {
                    let found = found.unwrap();
                    // The probe's answer: what happened, as a 200.
                    let probe = StoredResponse::new(200, Vec::new(), found.body.clone());
                    row.record.state = RecordState::Completed(probe);
                    row.record.expires_at = Some(next_expiry());
                    row.record.attempt = AttemptId::random();
                    row.held = false;
                }
                Resolution::Release(_) => {
                    rows.remove(&scope);
                }
                Resolution::ConfirmLater { after } => {
                    row.first_not_found.get_or_insert(now_wall);
                    row.lease_until = now + after;
                    row.held = false;
                }
                Resolution::Retry { after }
                | Resolution::Hold { after }
                | Resolution::Wait { after } => {
                    row.probes += 1;
                    row.lease_until = now + after;
                    row.held = false;
                }
            }
        }
    }

    /// The model: per scope at most one execution, and every replay or recorded answer
    /// is that execution's (or the probe's account of it).
    fn check(&self, s: &Send, outcome: &Outcome<StoredResponse>) -> Result<(), String> {
        let scope = &self.scopes[s.scope];
        let executions = self.world.executions.lock().unwrap();
        let done = executions.get(scope).map_or(&[][..], Vec::as_slice);
        match outcome {
            Outcome::Replayed {
                response,
                expires_at,
                ..
            } => {
                let kept = self
                    .world
                    .rows
                    .lock()
                    .unwrap()
                    .get(scope)
                    .map(|r| r.record.expires_at);
                if let Some(kept) = kept
                    && *expires_at != kept
                {
                    return Err(format!(
                        "{scope:?}: a replay said it expires at {expires_at:?}, the row at {kept:?}"
                    ));
                }
                let (variant, first) = done
                    .first()
                    .ok_or_else(|| format!("a replay of {scope:?}, which never executed"))?;
                if *variant != s.body {
                    return Err(format!(
                        "{scope:?}: body {} got the replay of body {variant}'s result",
                        s.body
                    ));
                }
                if response.body != first.body {
                    return Err(format!(
                        "{scope:?} replayed {:?}, but executed {:?}",
                        response.body, first.body
                    ));
                }
            }
            Outcome::Executed {
                response,
                expires_at: Some(at),
            } if self.policy.disposition(response.status) == Disposition::Keep => {
                let rows = self.world.rows.lock().unwrap();
                match rows
                    .get(scope)
                    .map(|r| (&r.record.state, r.record.expires_at))
                {
                    Some((RecordState::Completed(stored), kept))
                        if stored.body == response.body && kept == Some(*at) => {}
                    other => {
                        return Err(format!(
                            "{scope:?} said recorded, but the ledger holds {other:?}"
                        ));
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    fn check_world(&self) -> Result<(), String> {
        for (scope, done) in self.world.executions.lock().unwrap().iter() {
            if done.len() > 1 {
                return Err(format!("{scope:?} executed {} times: {done:?}", done.len()));
            }
        }
        Ok(())
    }
}

fn run_case(ops: Vec<Op>) -> Result<(), String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_time()
        .start_paused(true)
        .build()
        .unwrap();
    runtime.block_on(async move {
        let h = Harness::new();
        let mut wall = SystemTime::UNIX_EPOCH + Duration::from_secs(1_800_000_000);
        for op in &ops {
            match op {
                Op::Send(s) => {
                    if let Some(Ok(outcome)) = h.send(s).await {
                        h.check(s, &outcome)?;
                    }
                }
                Op::Both(a, b) => {
                    let (x, y) = tokio::join!(h.send(a), h.send(b));
                    if let Some(Ok(outcome)) = x {
                        h.check(a, &outcome)?;
                    }
                    if let Some(Ok(outcome)) = y {
                        h.check(b, &outcome)?;
                    }
                }
                Op::FlushCache => h.world.cache.lock().unwrap().clear(),
                Op::PastTheLease => {
                    tokio::time::advance(LEASE + Duration::from_secs(1)).await;
                    wall += LEASE + Duration::from_secs(1);
                }
                Op::Reconcile => h.reconcile(wall),
            }
            h.check_world()?;
        }
        Ok(())
    })
}

fn cases() -> u32 {
    std::env::var("MODEL_CASES")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1000)
}

proptest! {
    #![proptest_config(ProptestConfig {
        cases: cases(),
        failure_persistence: None,
        max_shrink_iters: 10_000,
        ..ProptestConfig::default()
    })]

    #[test]
    fn no_scope_ever_executes_twice_or_replays_another_result(
        ops in proptest::collection::vec(op(), 1..40)
    ) {
        if let Err(violation) = run_case(ops) {
            return Err(TestCaseError::fail(violation));
        }
    }
}
