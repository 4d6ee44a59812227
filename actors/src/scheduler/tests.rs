//! The scheduler driven synchronously through the real pool, store and CPU backend (the
//! actors' own `apply`/`run`, without a runtime), with exact expectations on the steps.

use std::time::Instant;

use engine::backend::StepPlan;
use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};
use engine::sampling::SamplingParams;
use policy::{Policies, ReservationPolicy};

use super::Scheduler;
use crate::engine::Engine;
use crate::kv_pool::KvPool;
use crate::request::{Event, GenerateRequest, RequestStream};
use crate::snapshot_store::SnapshotStore;

struct Harness {
    _dir: tempfile::TempDir,
    scheduler: Scheduler,
    pool: KvPool,
    store: SnapshotStore,
    engine: Engine,
}

impl Harness {
    fn new(pages: usize, toml: &str) -> Self {
        let dir = tempfile::tempdir().unwrap();
        synthetic::write(dir.path(), &SyntheticSpec::tiny(3)).unwrap();
        let files = ModelFiles::open(dir.path()).unwrap();
        let backend = CpuBackend::load(
            &files,
            &CpuOptions {
                threads: 1,
                page_tokens: 16,
                num_pages: pages,
            },
        )
        .unwrap();
        let config = crate::ServeConfig {
            policies: Policies::from_toml(toml).unwrap(),
            model_id: "tiny".into(),
            eos_token_ids: vec![],
            seed: 1,
        };
        let parts = crate::build(Box::new(backend), config).unwrap();
        Harness {
            _dir: dir,
            scheduler: parts.scheduler,
            pool: parts.pool,
            store: parts.store,
            engine: parts.engine,
        }
    }

    fn submit(&mut self, prompt_len: usize, max_tokens: usize) -> RequestStream {
        let prompt = (0..prompt_len as u32).map(|i| 3 + i % 200).collect();
        let params = SamplingParams {
            max_tokens,
            ..SamplingParams::default()
        };
        self.scheduler
            .submit(GenerateRequest { prompt, params })
            .unwrap()
    }

    /// Runs one step; returns the (start, token count) of each row the engine ran.
    fn step(&mut self) -> Vec<(usize, usize)> {
        let now = Instant::now();
        let lookups = self.scheduler.begin_step(now);
        let replies = lookups.into_iter().map(|op| self.store.apply(op)).collect();
        let ops = self.scheduler.plan_pool(replies);
        let replies: Vec<_> = ops.into_iter().map(|op| self.pool.apply(op)).collect();
        let stats = self.pool.stats();
        let ops = self.scheduler.plan_store(replies, Some(stats), now);
        let replies = ops.into_iter().map(|op| self.store.apply(op)).collect();
        let step = self.scheduler.plan_engine(replies);
        let rows = step.as_ref().map_or_else(Vec::new, |s| rows_of(&s.plan));
        let reply = step.map(|s| self.engine.run(s));
        self.scheduler.finish_step(reply, now);
        rows
    }
}

fn rows_of(plan: &StepPlan) -> Vec<(usize, usize)> {
    plan.rows
        .iter()
        .map(|r| (r.start_pos, r.tokens.len()))
        .collect()
}

fn tokens(stream: &mut RequestStream) -> (Vec<u32>, Option<Event>) {
    let mut out = Vec::new();
    while let Some(event) = stream.try_next() {
        match event {
            Event::Token(t) => out.push(t),
            end => return (out, Some(end)),
        }
    }
    (out, None)
}

#[test]
fn decode_rows_come_first_and_prompts_fill_the_budget_in_chunks() {
    let mut h = Harness::new(64, "[admission]\nmax_running = 2\nstep_token_budget = 10\n");
    let mut a = h.submit(4, 5);
    assert_eq!(h.step(), vec![], "the first step admits");
    assert_eq!(h.step(), vec![(0, 4)], "a's prompt");
    let mut b = h.submit(30, 2);
    assert_eq!(h.step(), vec![(4, 1)], "b is admitted while a decodes");
    assert_eq!(
        h.step(),
        vec![(5, 1), (0, 9)],
        "a's decode row first, then 9 of b's prompt"
    );
    assert_eq!(h.step(), vec![(6, 1), (9, 9)]);
    assert_eq!(h.step(), vec![(7, 1), (18, 9)], "a's fifth token");
    assert_eq!(
        h.step(),
        vec![(27, 3)],
        "a finished; the rest of b's prompt, and its first token"
    );
    assert_eq!(h.step(), vec![(30, 1)]);
    assert_eq!(
        h.step(),
        vec![],
        "b finished after 2 tokens; the next step releases its pages"
    );
    assert_eq!(tokens(&mut a).0.len(), 5);
    assert!(matches!(tokens(&mut b), (t, Some(Event::Finished { .. })) if t.len() == 2));
    assert_eq!(h.pool.stats().free_pages, 64);
}

#[test]
fn worst_case_admission_waits_for_the_whole_reservation() {
    let mut h = Harness::new(4, "[cache]\nreservation = \"worst_case\"\n");
    let _a = h.submit(20, 20);
    let _b = h.submit(20, 20);
    h.step();
    let stats = h.scheduler.stats();
    assert_eq!(
        (stats.running, stats.queued),
        (1, 1),
        "a reserves 3 of 4 pages; b needs 3"
    );
    assert_eq!(h.pool.stats().reserved_pages, 3);
}

#[test]
fn optimistic_admission_needs_room_for_the_prompt_and_one_more_token() {
    let mut h = Harness::new(4, "[cache]\nreservation = \"optimistic\"\n");
    let _a = h.submit(31, 8);
    let _b = h.submit(16, 8);
    h.step();
    // a needs 2 pages (32 tokens), b 2 (17 tokens): both fit 4 pages.
    assert_eq!(h.scheduler.stats().running, 2, "{:?}", h.scheduler.stats());
    assert_eq!(h.pool.stats().reserved_pages, 0, "nothing is promised");
    assert_eq!(ReservationPolicy::Optimistic.tokens_at_admission(31, 8), 0);
}

#[test]
fn a_dropped_stream_releases_its_pages_within_one_step() {
    let mut h = Harness::new(16, "");
    let a = h.submit(40, 100);
    h.step();
    h.step();
    assert_eq!(h.pool.stats().used_pages, 3);
    drop(a);
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
    assert_eq!(h.scheduler.stats().cancelled, 1);
}

#[test]
fn a_multi_step_decode_runs_several_tokens_per_step_and_stops_at_max_tokens() {
    let mut h = Harness::new(64, "[admission]\ndecode_steps = 4\n");
    let mut a = h.submit(4, 10);
    h.step();
    assert_eq!(h.step(), vec![(0, 4)], "the prompt, and the first token");
    assert_eq!(tokens(&mut a).0.len(), 1);
    assert_eq!(h.step(), vec![(4, 1)], "one row, fed back by the engine");
    assert_eq!(tokens(&mut a).0.len(), 4, "four decode steps");
    h.step();
    assert_eq!(tokens(&mut a).0.len(), 4);
    assert_eq!(h.step(), vec![(12, 1)]);
    let (last, end) = tokens(&mut a);
    assert_eq!(last.len(), 1, "only what max_tokens leaves");
    assert!(matches!(end, Some(Event::Finished { .. })), "{end:?}");
    h.step();
    assert_eq!(h.pool.stats().free_pages, 64);
}

#[test]
fn a_multi_step_decode_waits_while_requests_queue() {
    let mut h = Harness::new(
        64,
        "[admission]\ndecode_steps = 4\nmax_running = 1\nstep_token_budget = 16\n",
    );
    let mut a = h.submit(4, 20);
    let _b = h.submit(4, 20);
    h.step();
    h.step();
    assert_eq!(tokens(&mut a).0.len(), 1);
    h.step();
    assert_eq!(
        tokens(&mut a).0.len(),
        1,
        "b waits for a slot: one token per step"
    );
}
