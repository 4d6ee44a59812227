//! The scheduler's invariants under random traffic, without a GPU: random sequences of
//! submissions (some of several choices, `n`), cancellations, callers that go away, stop
//! strings, failed engine steps, prefixes kept and snapshots discarded by an operator, bytes
//! of stored snapshots going bad, and a pool and snapshot tiers (a disk tier among them) too
//! small for the load, under both reservation policies, driven through the real pool, store,
//! engine actor and CPU backend, one step at a time or as the `Admission` actor overlaps them
//! (the next step planned before the one in flight answers). After every step:
//!
//! - no request has more than one terminal event, and nothing follows it;
//! - the pool's free and used pages add up to its size, and its used pages are exactly those
//!   of the running jobs plus the slots waiting to be released;
//! - once the store has taken the last step's outcomes, its snapshots' backings and files (a
//!   moving snapshot's source included) are exactly the engine's, and none is half-saved;
//! - every sampler the engine keeps is a request's that is queued or running, or one the
//!   scheduler is yet to tell it to drop.
//!
//! And a request that scores its prompt (`prompt_logprobs`) has read each prompt token's score
//! exactly once by the time it finishes, over chunks, overlapped steps and preemptions.
//!
//! And once everything has ended: every request still listened to got exactly one terminal
//! event, every submitted request was counted exactly once, no page is held, nothing is left
//! `Demoting`, and the engine keeps no sampler.

use std::collections::{BTreeSet, VecDeque};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use cache::{BackingId, PageClone, PageCopy, SnapshotState, Tier};
use engine::EngineError;
use engine::backend::{Backend, BackendInfo, HostRun, MemoryReport, StepOutput, StepPlan};
use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};
use engine::sampling::{Sampler, SamplingParams};
use policy::Policies;
use proptest::prelude::*;
use proptest::sample::Index;

use super::tests::{drive_step, plan_step};
use super::{Scheduler, StepOutcome};
use crate::engine::{Engine, EngineStepReply};
use crate::kv_pool::KvPool;
use crate::request::{Event, GenerateRequest, RequestId, RequestStream};
use crate::snapshot_store::SnapshotStore;

/// The CPU backend, with forward passes that fail on demand (everything else untouched).
struct Flaky {
    inner: CpuBackend,
    fail_next: Arc<AtomicBool>,
}

impl Flaky {
    fn injected(&self) -> Result<(), EngineError> {
        if self.fail_next.swap(false, Ordering::SeqCst) {
            return Err(EngineError::InvalidStep("injected failure".into()));
        }
        Ok(())
    }
}

impl Backend for Flaky {
    fn info(&self) -> &BackendInfo {
        self.inner.info()
    }
    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput, EngineError> {
        self.injected()?;
        self.inner.step(plan)
    }
    fn step_and_sample(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
    ) -> Result<Vec<Option<u32>>, EngineError> {
        self.injected()?;
        self.inner.step_and_sample(plan, samplers)
    }
    fn alloc_backing(&mut self, id: BackingId, tier: Tier, bytes: u64) -> Result<(), EngineError> {
        self.inner.alloc_backing(id, tier, bytes)
    }
    fn free_backing(&mut self, id: BackingId) -> Result<(), EngineError> {
        self.inner.free_backing(id)
    }
    fn save_pages(&mut self, id: BackingId, copies: &[PageCopy]) -> Result<(), EngineError> {
        self.inner.save_pages(id, copies)
    }
    fn restore_pages(&mut self, id: BackingId, copies: &[PageCopy]) -> Result<(), EngineError> {
        self.inner.restore_pages(id, copies)
    }
    fn clone_pages(&mut self, clones: &[PageClone]) -> Result<(), EngineError> {
        self.inner.clone_pages(clones)
    }
    fn copy_backing(&mut self, from: BackingId, to: BackingId) -> Result<(), EngineError> {
        self.inner.copy_backing(from, to)
    }
    fn finished_copies(&mut self, wait: bool) -> Vec<(BackingId, Result<(), EngineError>)> {
        self.inner.finished_copies(wait)
    }
    fn backing_ids(&self) -> Vec<BackingId> {
        self.inner.backing_ids()
    }
    fn restore_verdicts(&mut self) -> Result<Vec<bool>, EngineError> {
        self.inner.restore_verdicts()
    }
    fn backing_sums(&mut self, backing: BackingId) -> Result<Vec<u64>, EngineError> {
        self.inner.backing_sums(backing)
    }
    fn set_backing_sums(&mut self, backing: BackingId, sums: &[u64]) -> Result<(), EngineError> {
        self.inner.set_backing_sums(backing, sums)
    }
    fn host_runs(&mut self, backing: BackingId) -> Result<Vec<HostRun>, EngineError> {
        self.inner.host_runs(backing)
    }
    fn read_backing(&mut self, backing: BackingId) -> Result<Vec<u8>, EngineError> {
        self.inner.read_backing(backing)
    }
    fn flip_byte(&mut self, backing: BackingId, offset: u64, mask: u8) -> Result<(), EngineError> {
        self.inner.flip_byte(backing, offset, mask)
    }
    fn memory(&self) -> MemoryReport {
        self.inner.memory()
    }
}

/// The shape of one run.
#[derive(Debug, Clone)]
struct Setup {
    pages: usize,
    optimistic: bool,
    max_running: usize,
    step_token_budget: usize,
    decode_steps: usize,
    device_snapshot_pages: u64,
    host_snapshot_pages: u64,
    disk_snapshot_pages: u64,
    /// Steps overlap as the `Admission` actor runs them.
    overlap: bool,
}

#[derive(Debug, Clone)]
enum Op {
    Submit {
        prefix: u8,
        suffix: u8,
        max_tokens: u8,
        stop_token: Option<u8>,
        /// OpenAI's `n`: choices sharing the prompt's KV.
        choices: u8,
    },
    Step(u8),
    /// Through the scheduler, by id.
    Cancel(Index),
    /// The caller goes away.
    Drop(Index),
    /// The caller's text reached a stop string.
    Stop(Index),
    FailNextStep,
    /// An operator keeps a prefix (`POST /v1/snapshots`); discards one now and then.
    Keep(u8),
    Discard(Index),
    /// A byte of a stored snapshot's memory goes bad.
    Corrupt(Index, u16),
}

fn setup() -> impl Strategy<Value = Setup> {
    (
        2usize..24,
        any::<bool>(),
        1usize..6,
        16usize..96,
        prop_oneof![Just(1usize), Just(3)],
        0u64..6,
        0u64..4,
        prop_oneof![Just(0u64), 1u64..8],
        any::<bool>(),
    )
        .prop_map(
            |(pages, optimistic, max_running, budget, steps, dev, host, disk, overlap)| Setup {
                pages,
                optimistic,
                max_running,
                step_token_budget: budget,
                decode_steps: steps,
                device_snapshot_pages: dev,
                host_snapshot_pages: host,
                disk_snapshot_pages: disk,
                overlap,
            },
        )
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (
            0u8..3,
            0u8..40,
            1u8..24,
            proptest::option::weighted(0.2, 3u8..200),
            prop_oneof![3 => Just(1u8), 1 => 2u8..4],
        )
            .prop_map(|(prefix, suffix, max_tokens, stop_token, choices)| Op::Submit {
                prefix,
                suffix,
                max_tokens,
                stop_token,
                choices,
            }),
        4 => (1u8..4).prop_map(Op::Step),
        1 => any::<Index>().prop_map(Op::Cancel),
        1 => any::<Index>().prop_map(Op::Drop),
        1 => any::<Index>().prop_map(Op::Stop),
        1 => Just(Op::FailNextStep),
        1 => (16u8..60).prop_map(Op::Keep),
        1 => any::<Index>().prop_map(Op::Discard),
        1 => (any::<Index>(), any::<u16>()).prop_map(|(i, at)| Op::Corrupt(i, at)),
    ]
}

/// A request the test still listens to.
struct Listener {
    stream: RequestStream,
    ends: usize,
    /// Prompt tokens whose log-probabilities it asked for (`prompt_logprobs`), and those
    /// read: exactly all of them by a `Finished` end, however often it was preempted.
    scores_wanted: usize,
    scores_read: usize,
}

impl Listener {
    fn new(stream: RequestStream, scores_wanted: usize) -> Self {
        Listener {
            stream,
            ends: 0,
            scores_wanted,
            scores_read: 0,
        }
    }
}

struct World {
    _dir: tempfile::TempDir,
    scheduler: Scheduler,
    pool: KvPool,
    store: SnapshotStore,
    engine: Engine,
    fail_next: Arc<AtomicBool>,
    listeners: Vec<Listener>,
    ids: Vec<RequestId>,
    overlap: bool,
    /// With overlap: the answers of the steps sent, which the engine ran as they were sent
    /// (it runs steps in order), not yet given to the scheduler.
    in_flight: VecDeque<EngineStepReply>,
    /// The last plan found nothing to do: as the actor does, wait for the answer in flight
    /// (or a new request) before planning again.
    stalled: bool,
}

impl World {
    fn new(setup: &Setup) -> World {
        let dir = tempfile::tempdir().unwrap();
        synthetic::write(dir.path(), &SyntheticSpec::tiny(5)).unwrap();
        let files = ModelFiles::open(dir.path()).unwrap();
        let options = CpuOptions {
            threads: 1,
            page_tokens: 16,
            num_pages: setup.pages,
            int8_inputs: false,
        };
        let inner = CpuBackend::load(&files, &options).unwrap();
        let page_bytes = inner.info().geometry.page_bytes() as u64;
        let fail_next = Arc::new(AtomicBool::new(false));
        let backend = Flaky {
            inner,
            fail_next: fail_next.clone(),
        };
        let toml = format!(
            "[cache]\nreservation = \"{}\"\n\
             [admission]\nmax_running = {}\nmax_queue = 8\nstep_token_budget = {}\n\
             decode_steps = {}\n\
             [snapshots]\ndevice_budget_bytes = {}\nhost_budget_bytes = {}\n\
             demote_to_host = {}\nsave_prompts = true\nmin_save_tokens = 16\n\
             save_after_sightings = 1\n{}\
             [backoff]\nbase_ms = 1\nmax_ms = 2\nmax_attempts = 2\non_exhausted = \"preempt\"\n",
            if setup.optimistic {
                "optimistic"
            } else {
                "worst_case"
            },
            setup.max_running,
            setup.step_token_budget,
            setup.decode_steps,
            setup.device_snapshot_pages * page_bytes,
            setup.host_snapshot_pages * page_bytes,
            setup.host_snapshot_pages > 0,
            if setup.disk_snapshot_pages > 0 {
                format!(
                    "disk_dir = \"{}\"\ndisk_budget_bytes = {}\n",
                    dir.path().join("disk").display(),
                    setup.disk_snapshot_pages * page_bytes
                )
            } else {
                String::new()
            },
        );
        let config = crate::ServeConfig {
            policies: Policies::from_toml(&toml).unwrap(),
            model_id: "tiny".into(),
            eos_token_ids: vec![1],
            seed: 7,
            verify_steps: Vec::new(),
        };
        let parts = crate::build(Box::new(backend), config).unwrap();
        World {
            _dir: dir,
            scheduler: parts.scheduler,
            pool: parts.pool,
            store: parts.store,
            engine: parts.engine,
            fail_next,
            listeners: Vec::new(),
            ids: Vec::new(),
            overlap: setup.overlap,
            in_flight: VecDeque::new(),
            stalled: false,
        }
    }

    fn submit(
        &mut self,
        prefix: u8,
        suffix: u8,
        max_tokens: u8,
        stop_token: Option<u8>,
        choices: u8,
    ) {
        let opening = (0..40u32).map(|i| 3 + (i * 7 + prefix as u32 * 53) % 190);
        let rest = (0..suffix as u32).map(|i| 3 + (i * 13 + suffix as u32) % 190);
        // A third of the single choices score their prompt (a completion's echo with logprobs).
        let scores = choices == 1 && suffix.is_multiple_of(3);
        let params = SamplingParams {
            max_tokens: max_tokens as usize,
            stop_token_ids: stop_token.map(u32::from).into_iter().collect(),
            prompt_logprobs: scores.then_some(1),
            ..SamplingParams::default()
        };
        let request = GenerateRequest {
            prompt: opening.chain(rest).collect(),
            params,
        };
        let wanted = if scores { request.prompt.len() - 1 } else { 0 };
        // Refusals (a full queue, a request larger than the pool) are answers, not events.
        if let Ok(streams) = self.scheduler.submit_choices(request, choices as usize) {
            for stream in streams {
                self.ids.push(stream.id);
                self.listeners.push(Listener::new(stream, wanted));
            }
        }
    }

    fn pick(&self, index: &Index) -> Option<usize> {
        (!self.listeners.is_empty()).then(|| index.index(self.listeners.len()))
    }

    /// One step as the `Admission` actor drives it, checking the store against the engine
    /// once the last step's outcomes are in the store, and the pages and events after it.
    fn step(&mut self) -> StepOutcome {
        let outcome = if self.overlap {
            self.overlapped_event()
        } else {
            let (scheduler, pool, store, engine) = (
                &mut self.scheduler,
                &mut self.pool,
                &mut self.store,
                &mut self.engine,
            );
            drive_step(scheduler, pool, store, engine, check_backings).1
        };
        self.check_pages();
        self.check_samplers();
        self.read_events();
        outcome
    }

    /// What the `Admission` actor does next with overlap: plans a step if one may be planned
    /// (none in flight, or the scheduler may plan ahead of the one that is), else applies the
    /// oldest answer.
    fn overlapped_event(&mut self) -> StepOutcome {
        let may_plan = match self.in_flight.len() {
            0 => true,
            1 => self.scheduler.can_plan_ahead(),
            _ => false,
        };
        let now = Instant::now();
        if may_plan && !self.stalled && self.scheduler.readiness(now).0 {
            // The store and the engine agree only when no step is in flight.
            let settled = self.in_flight.is_empty();
            let (scheduler, pool, store, engine) = (
                &mut self.scheduler,
                &mut self.pool,
                &mut self.store,
                &mut self.engine,
            );
            let between = |store: &SnapshotStore, engine: &Engine, freeing: &[BackingId]| {
                if settled {
                    check_backings(store, engine, freeing);
                }
            };
            match plan_step(scheduler, pool, store, engine, between) {
                Some(step) => {
                    self.in_flight.push_back(self.engine.run(step));
                    return StepOutcome {
                        ready: true,
                        wake_at: None,
                    };
                }
                None => {
                    let outcome = self.scheduler.finish_step(None, Instant::now());
                    self.stalled = !outcome.ready;
                    return StepOutcome {
                        ready: outcome.ready || !self.in_flight.is_empty(),
                        ..outcome
                    };
                }
            }
        }
        self.stalled = false;
        match self.in_flight.pop_front() {
            Some(reply) => {
                let outcome = self.scheduler.finish_step(Some(reply), Instant::now());
                StepOutcome {
                    ready: outcome.ready || !self.in_flight.is_empty(),
                    ..outcome
                }
            }
            None => {
                let (_, wake_at) = self.scheduler.readiness(now);
                StepOutcome {
                    ready: false,
                    wake_at,
                }
            }
        }
    }

    /// Every sampler the engine keeps is a queued or running request's, or one it is yet to
    /// be told to drop.
    fn check_samplers(&self) {
        let scheduler = &self.scheduler;
        let known: BTreeSet<RequestId> = scheduler
            .running
            .iter()
            .chain(&scheduler.queue)
            .map(|job| job.id)
            .chain(scheduler.samplers_to_forget().iter().copied())
            .collect();
        for id in self.engine.kept_samplers() {
            assert!(known.contains(&id), "the engine keeps a sampler for {id:?}");
        }
    }

    /// Steps while the scheduler says one can run, waiting out back-offs, up to `max`.
    fn run_steps(&mut self, max: usize) {
        for _ in 0..max {
            let outcome = self.step();
            if outcome.ready {
                continue;
            }
            match outcome.wake_at {
                Some(at) => std::thread::sleep(at.saturating_duration_since(Instant::now())),
                None => return,
            }
        }
    }

    fn check_pages(&self) {
        let stats = self.pool.stats();
        assert_eq!(
            stats.free_pages + stats.used_pages,
            stats.total_pages,
            "{stats:?}"
        );
        let pool = self.pool.inner();
        let running: usize = self
            .scheduler
            .running
            .iter()
            .map(|job| {
                // A job leaving at the end of a step has given its pages back in it.
                let Some(slot) = job.slot.as_ref() else {
                    assert!(
                        job.leave_charged,
                        "running jobs hold a slot until they leave"
                    );
                    return 0;
                };
                assert_eq!(pool.page_table(slot.handle).unwrap(), slot.pages.as_slice());
                // Positions taken inside its last page without the pool are inside its pages.
                let pt = self.scheduler.config.page_tokens;
                assert!(
                    slot.held_tokens <= slot.pages.len() * pt,
                    "holds {} positions in {} pages",
                    slot.held_tokens,
                    slot.pages.len()
                );
                slot.pages.len()
            })
            .sum();
        let releasing: usize = self
            .scheduler
            .releases
            .iter()
            .map(|&handle| pool.page_table(handle).unwrap().len())
            .sum();
        assert_eq!(
            stats.used_pages,
            running + releasing,
            "used pages are the running jobs' and those being released"
        );
    }

    fn read_events(&mut self) {
        for listener in &mut self.listeners {
            while let Some(event) = listener.stream.try_next() {
                assert_eq!(
                    listener.ends, 0,
                    "request {:?}: {event:?} after its end",
                    listener.stream.id
                );
                listener.scores_read += listener.stream.take_prompt_logprobs().len();
                assert!(
                    listener.scores_read <= listener.scores_wanted,
                    "request {:?}: {} prompt scores of {}",
                    listener.stream.id,
                    listener.scores_read,
                    listener.scores_wanted
                );
                if matches!(event, Event::Finished { .. }) {
                    assert_eq!(
                        listener.scores_read, listener.scores_wanted,
                        "request {:?} finished without all its prompt's scores",
                        listener.stream.id
                    );
                }
                if !matches!(event, Event::Token(_)) {
                    listener.ends += 1;
                }
            }
        }
    }

    fn apply(&mut self, op: &Op) {
        self.stalled = false;
        match op {
            Op::Submit {
                prefix,
                suffix,
                max_tokens,
                stop_token,
                choices,
            } => self.submit(*prefix, *suffix, *max_tokens, *stop_token, *choices),
            Op::Step(n) => self.run_steps(*n as usize),
            Op::Cancel(index) => {
                if !self.ids.is_empty() {
                    self.scheduler.cancel(self.ids[index.index(self.ids.len())]);
                }
            }
            Op::Drop(index) => {
                if let Some(at) = self.pick(index) {
                    drop(self.listeners.swap_remove(at));
                }
            }
            Op::Stop(index) => {
                if let Some(at) = self.pick(index) {
                    self.listeners.swap_remove(at).stream.stop();
                }
            }
            Op::FailNextStep => self.fail_next.store(true, Ordering::SeqCst),
            Op::Keep(len) => {
                let prompt = (0..*len as u32).map(|i| 3 + (i * 11 + 5) % 190).collect();
                if let Ok(stream) = self.scheduler.submit_kept(prompt) {
                    self.ids.push(stream.id);
                    self.listeners.push(Listener::new(stream, 0));
                }
            }
            Op::Corrupt(index, at) => {
                // A published snapshot at rest in memory (one moving between tiers is skipped:
                // the store hears of a landed copy only at the next step).
                let ids: Vec<_> = self.store.inner().snapshot_ids().collect();
                if !ids.is_empty() {
                    let info = self
                        .store
                        .inner()
                        .info(ids[index.index(ids.len())])
                        .unwrap();
                    if info.state == SnapshotState::Ready && info.tier != Tier::Disk {
                        let offset = *at as u64 % info.bytes;
                        if let Err(e) = self.engine.flip_byte(info.backing, offset, 0x10) {
                            panic!("{info:?}: {e}");
                        }
                    }
                }
            }
            Op::Discard(index) => {
                // As the admin API does: the store drops it, the engine frees its buffer.
                let ids: Vec<_> = self.store.inner().snapshot_ids().collect();
                if !ids.is_empty() {
                    let id = ids[index.index(ids.len())];
                    if let Ok(backing) = self.store.inner_mut().discard(id) {
                        self.engine.free_backing(backing);
                    }
                }
            }
        }
    }

    /// Runs until every request has ended and every demotion has landed.
    fn drain(&mut self) {
        self.fail_next.store(false, Ordering::SeqCst);
        for _ in 0..2000 {
            let stats = self.scheduler.stats();
            // `running` holds finished jobs saving their reply too, until they are released.
            let closing = self.scheduler.running.len();
            if stats.queued + closing == 0 && self.scheduler.demotions_in_flight == 0 {
                while !self.in_flight.is_empty() {
                    self.step();
                }
                // One more step hands the store the outcomes of the last.
                self.step();
                while !self.in_flight.is_empty() {
                    self.step();
                }
                return;
            }
            self.run_steps(1);
        }
        panic!("not drained: {:?}", self.scheduler.stats());
    }

    fn check_end(&self) {
        for listener in &self.listeners {
            assert_eq!(
                listener.ends, 1,
                "request {:?} ended {} times",
                listener.stream.id, listener.ends
            );
        }
        let stats = self.scheduler.stats();
        assert_eq!(
            stats.submitted,
            stats.finished + stats.failed + stats.cancelled,
            "every request counted once: {stats:?}"
        );
        assert_eq!(self.pool.stats().used_pages, 0);
        let store = self.store.inner();
        for id in store.snapshot_ids() {
            assert_eq!(
                store.info(id).unwrap().state,
                SnapshotState::Ready,
                "{id} is left behind"
            );
        }
        check_backings(&self.store, &self.engine, &[]);
        assert_eq!(self.engine.demotions_in_flight(), 0);
        assert_eq!(
            self.engine.kept_samplers(),
            Vec::new(),
            "samplers left behind"
        );
    }
}

/// The store's snapshots' backings (a demoting one's device copy included) are exactly the
/// engine's, and none is half-saved: to be called once the store has the last step's outcomes.
/// `freeing`: buffers the store has just given up, which the engine frees in the coming step.
fn check_backings(store: &SnapshotStore, engine: &Engine, freeing: &[BackingId]) {
    let store = store.inner();
    let mut held: BTreeSet<BackingId> = freeing.iter().copied().collect();
    for id in store.snapshot_ids() {
        let info = store.info(id).unwrap();
        assert_ne!(
            info.state,
            SnapshotState::Saving,
            "{id} is still saving after its step"
        );
        held.insert(info.backing);
        held.extend(info.demoting_from);
        held.extend(info.promoting_from);
    }
    let engine: BTreeSet<BackingId> = engine.backing_ids().into_iter().collect();
    assert_eq!(held, engine, "the store's backings and the engine's differ");
}

proptest! {
    // A case takes ~10 ms; a livelock two requests fell into about once in 2,500 cases (see
    // `Scheduler::preempt_for`) went unseen at 128 a run.
    #![proptest_config(ProptestConfig {
        cases: 1024,
        failure_persistence: None,
        ..ProptestConfig::default()
    })]

    #[test]
    fn every_request_ends_once_and_every_page_and_snapshot_is_accounted_for(
        setup in setup(),
        ops in proptest::collection::vec(op(), 1..60),
    ) {
        let mut world = World::new(&setup);
        for op in &ops {
            world.apply(op);
        }
        world.drain();
        world.read_events();
        world.check_end();
    }
}
