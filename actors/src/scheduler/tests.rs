//! The scheduler driven synchronously through the real pool, store and CPU backend (the
//! actors' own `apply`/`run`, without a runtime), with exact expectations on the steps.

use std::time::Instant;

use engine::backend::StepPlan;
use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};
use engine::sampling::SamplingParams;
use policy::{Policies, ReservationPolicy};

use super::{Scheduler, StepOutcome};
use crate::engine::Engine;
use crate::error::ServeError;
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
                int8_inputs: false,
            },
        )
        .unwrap();
        let config = crate::ServeConfig {
            policies: Policies::from_toml(toml).unwrap(),
            model_id: "tiny".into(),
            eos_token_ids: vec![],
            seed: 1,
            verify_steps: Vec::new(),
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

    /// Submits `prompt`, greedy, generating exactly `max_tokens` (end-of-sequence ignored).
    fn submit_exactly(&mut self, prompt: Vec<u32>, max_tokens: usize) -> RequestStream {
        let params = SamplingParams {
            max_tokens,
            ignore_eos: true,
            ..SamplingParams::default()
        };
        self.scheduler
            .submit(GenerateRequest { prompt, params })
            .unwrap()
    }

    /// Runs one step; returns the (start, token count) of each row the engine ran.
    fn step(&mut self) -> Vec<(usize, usize)> {
        self.step_outcome().0
    }

    /// Runs one step; returns its rows and what the scheduler said of the next.
    fn step_outcome(&mut self) -> (Vec<(usize, usize)>, StepOutcome) {
        let (scheduler, pool, store, engine) = (
            &mut self.scheduler,
            &mut self.pool,
            &mut self.store,
            &mut self.engine,
        );
        drive_step(scheduler, pool, store, engine, |_, _, _| {})
    }

    fn try_submit(
        &mut self,
        prompt_len: usize,
        max_tokens: usize,
    ) -> Result<RequestStream, ServeError> {
        let prompt = (0..prompt_len as u32).map(|i| 3 + i % 200).collect();
        let params = SamplingParams {
            max_tokens,
            ..SamplingParams::default()
        };
        self.scheduler.submit(GenerateRequest { prompt, params })
    }
}

/// One step as the `Admission` actor drives it, through the actors' own `apply`/`run` without
/// a runtime; `between` looks at the store and the engine once the store has taken the last
/// step's outcomes. Returns the (start, token count) of each row the engine ran, and what the
/// scheduler said of the next step.
pub(super) fn drive_step(
    scheduler: &mut Scheduler,
    pool: &mut KvPool,
    store: &mut SnapshotStore,
    engine: &mut Engine,
    between: impl FnOnce(&SnapshotStore, &Engine, &[cache::BackingId]),
) -> (Vec<(usize, usize)>, StepOutcome) {
    let step = plan_step(scheduler, pool, store, engine, between);
    let rows = step.as_ref().map_or_else(Vec::new, |s| rows_of(&s.plan));
    let reply = step.map(|s| engine.run(s));
    let outcome = scheduler.finish_step(reply, Instant::now());
    (rows, outcome)
}

/// Plans one step as the `Admission` actor does (the store's exchange, then the pool's) and
/// returns its engine step; with none, the step waits for `finish_step(None)`.
pub(super) fn plan_step(
    scheduler: &mut Scheduler,
    pool: &mut KvPool,
    store: &mut SnapshotStore,
    engine: &mut Engine,
    between: impl FnOnce(&SnapshotStore, &Engine, &[cache::BackingId]),
) -> Option<crate::exchange::EngineStep> {
    use crate::exchange::{StoreOp, StoreReply};
    let now = Instant::now();
    let ops = scheduler.begin_step(now);
    // The follow-ups of the last steps come first: once the store has taken them, it and the
    // engine agree (but for the buffers those follow-ups gave up, which this step frees).
    let follow_ups = ops
        .iter()
        .take_while(|op| {
            !matches!(
                op,
                StoreOp::Find { .. }
                    | StoreOp::BeginSave { .. }
                    | StoreOp::BeginKeptSave { .. }
                    | StoreOp::BeginPromptSave { .. }
            )
        })
        .count();
    let mut ops = ops.into_iter();
    let mut replies: Vec<_> = ops
        .by_ref()
        .take(follow_ups)
        .map(|op| store.apply(op))
        .collect();
    let freeing: Vec<cache::BackingId> = replies
        .iter()
        .filter_map(|reply| match reply {
            StoreReply::Freed(Ok(freed)) => Some(freed),
            _ => None,
        })
        .flatten()
        .map(|eviction| eviction.backing)
        .collect();
    between(store, engine, &freeing);
    replies.extend(ops.map(|op| store.apply(op)));
    let ops = scheduler.plan_pool(replies);
    let replies: Vec<_> = ops.into_iter().map(|op| pool.apply(op)).collect();
    let stats = pool.stats();
    scheduler.plan_engine(replies, Some(stats), now)
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
    assert_eq!(
        h.step(),
        vec![(0, 4)],
        "a is admitted and runs its prompt in one step"
    );
    let mut b = h.submit(30, 2);
    assert_eq!(
        h.step(),
        vec![(4, 1), (0, 9)],
        "a's decode row first; b is admitted with 9 of its prompt"
    );
    assert_eq!(h.step(), vec![(5, 1), (9, 9)]);
    assert_eq!(h.step(), vec![(6, 1), (18, 9)]);
    assert_eq!(
        h.step(),
        vec![(7, 1), (27, 3)],
        "a's fifth token; the rest of b's prompt, and its first token"
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
fn a_one_token_request_is_answered_by_one_step() {
    let mut h = Harness::new(8, "");
    let mut a = h.submit(1, 1);
    assert_eq!(h.step(), vec![(0, 1)], "admitted and run in the same step");
    let (got, end) = tokens(&mut a);
    assert_eq!(got.len(), 1);
    assert!(matches!(end, Some(Event::Finished { .. })), "{end:?}");
    assert_eq!(h.step(), vec![], "the next step only releases its page");
    assert_eq!(h.pool.stats().used_pages, 0);
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
    let pool = h.pool.stats();
    assert_eq!(
        (pool.used_pages, pool.reserved_pages),
        (2, 1),
        "a's prompt holds 2 of its pages, the third stays promised"
    );
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
fn a_stream_stopped_by_its_caller_finishes_and_releases_its_pages_within_one_step() {
    let mut h = Harness::new(16, "");
    let mut a = h.submit(40, 100);
    h.step();
    h.step();
    assert!(!tokens(&mut a).0.is_empty(), "the prompt step sampled");
    a.stop();
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
    let stats = h.scheduler.stats();
    assert_eq!((stats.finished, stats.cancelled), (1, 0));
}

#[test]
fn a_multi_step_decode_runs_several_tokens_per_step_and_stops_at_max_tokens() {
    let mut h = Harness::new(64, "[admission]\ndecode_steps = 4\n");
    let mut a = h.submit(4, 10);
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
    assert_eq!(tokens(&mut a).0.len(), 1);
    h.step();
    assert_eq!(
        tokens(&mut a).0.len(),
        1,
        "b waits for a slot: one token per step"
    );
}

/// Reads a stream's events until its end, if it has ended.
fn ended(stream: &mut RequestStream) -> Option<Event> {
    loop {
        match stream.try_next()? {
            Event::Token(_) => {}
            end => return Some(end),
        }
    }
}

/// Drives steps as the `Admission` actor would (at once while the scheduler says a step can
/// run, else after the next back-off ends, else not at all) until `streams` have all ended.
/// Panics if a step that the scheduler asked for found nothing to do, or after `max_steps`.
fn drive_to_the_end(h: &mut Harness, streams: &mut [RequestStream], max_steps: usize) {
    let mut ends: Vec<Option<Event>> = vec![None; streams.len()];
    for step in 0..max_steps {
        let idle_before = h.scheduler.stats().idle_steps;
        let (_, outcome) = h.step_outcome();
        assert_eq!(
            h.scheduler.stats().idle_steps,
            idle_before,
            "step {step} was asked for and found nothing to do"
        );
        for (stream, end) in streams.iter_mut().zip(&mut ends) {
            if end.is_none() {
                *end = ended(stream);
            }
        }
        if ends.iter().all(Option::is_some) {
            return;
        }
        if !outcome.ready {
            let wake = outcome
                .wake_at
                .expect("requests are waiting, so something must wake the scheduler");
            std::thread::sleep(wake.saturating_duration_since(Instant::now()));
        }
    }
    panic!("requests still running after {max_steps} steps: {ends:?}");
}

/// Requests of every size against pools of every size from one page: each is either refused
/// when submitted (its prompt cannot fit the pool) or ends, and the pool is whole afterwards.
#[test]
fn every_pool_size_makes_progress_or_refuses() {
    let sizes = [
        (1, 1),
        (5, 30),
        (15, 1),
        (16, 1),
        (17, 40),
        (40, 10),
        (70, 3),
        (3, 200),
    ];
    for reservation in ["worst_case", "optimistic"] {
        for pages in 1..=8 {
            let toml = format!(
                "[cache]\nreservation = \"{reservation}\"\n[admission]\nmax_running = 3\n\
                 [backoff]\nbase_ms = 1\nmax_ms = 2\nmax_attempts = 2\n"
            );
            let mut h = Harness::new(pages, &toml);
            let mut streams = Vec::new();
            for (prompt, max_tokens) in sizes {
                match h.try_submit(prompt, max_tokens) {
                    Ok(stream) => streams.push(stream),
                    Err(ServeError::Invalid(reason)) => {
                        assert!(prompt >= pages * 16, "{pages} pages, {prompt}: {reason}");
                        assert!(reason.contains("KV pool"), "{reason}");
                    }
                    Err(e) => panic!("{pages} pages, {prompt} tokens: {e}"),
                }
            }
            drive_to_the_end(&mut h, &mut streams, 5_000);
            h.step();
            let pool = h.pool.stats();
            assert_eq!(
                pool.free_pages, pages,
                "{reservation}, {pages} pages: {pool:?}"
            );
            assert_eq!(pool.reserved_pages, 0);
        }
    }
}

#[test]
fn a_request_that_could_never_fit_the_pool_is_refused_at_once() {
    let mut h = Harness::new(2, "");
    let Err(ServeError::Invalid(reason)) = h.try_submit(40, 4) else {
        panic!("a 40-token prompt was accepted by a 32-token pool");
    };
    assert_eq!(
        reason,
        "the prompt has 40 tokens; this server's KV pool (32 positions) holds 31 with room \
         for one generated token"
    );
    // One that fits runs, with what the pool leaves it to generate.
    let mut a = h.submit(30, 100);
    drive_to_the_end(&mut h, std::slice::from_mut(&mut a), 100);
    assert_eq!(h.scheduler.limit().tokens, 32);
    assert!(h.scheduler.stats().finished == 1);
}

#[test]
fn a_short_prompt_goes_before_a_long_prompts_remaining_chunks() {
    let mut h = Harness::new(64, "[admission]\nmax_running = 4\nstep_token_budget = 16\n");
    let _long = h.submit(100, 2);
    assert_eq!(h.step(), vec![(0, 16)]);
    let _short = h.submit(5, 2);
    assert_eq!(h.step(), vec![(16, 16)], "the short one is admitted");
    assert_eq!(
        h.step(),
        vec![(0, 5), (32, 11)],
        "the short prompt first, the long one's chunk in what is left"
    );
}

#[test]
fn prompt_chunks_are_cut_to_the_step_time_the_model_predicts() {
    let mut h = Harness::new(
        64,
        "[admission]\nmax_step_ms = 100\nstep_token_budget = 1000\nmax_running = 8\n",
    );
    assert_eq!(
        h.scheduler.prefill_budget(2),
        998,
        "untimed: the token budget"
    );
    // 20 ms a step plus 2 ms a token: 40 tokens fit in 100 ms, 38 beside 2 decode rows.
    for tokens in [1, 10, 50, 3] {
        h.scheduler
            .step_time
            .observe(tokens, 0.02 + 0.002 * tokens as f64);
    }
    assert_eq!(h.scheduler.prefill_budget(2), 38);
    // However slow decoding gets, a prompt still moves a page a step.
    h.scheduler.step_time.observe(1, 5.0);
    h.scheduler.step_time.observe(2, 10.0);
    assert_eq!(h.scheduler.prefill_budget(8), 16);
}

#[test]
fn a_cut_ends_every_request_with_shutting_down_and_returns_its_pages() {
    let mut h = Harness::new(16, "[admission]\nmax_running = 1\n");
    let mut running = h.submit(20, 50);
    let mut queued = h.submit(20, 50);
    h.step();
    h.step();
    assert_eq!(h.scheduler.stats().running, 1);
    assert_eq!(h.scheduler.cut_all(), 2);
    assert_eq!(
        ended(&mut queued),
        Some(Event::Failed(ServeError::ShuttingDown))
    );
    h.step();
    assert_eq!(
        ended(&mut running),
        Some(Event::Failed(ServeError::ShuttingDown))
    );
    h.step();
    assert_eq!(h.pool.stats().free_pages, 16);
    let stats = h.scheduler.stats();
    assert_eq!(
        (stats.cut, stats.failed, stats.running, stats.queued),
        (2, 2, 0, 0)
    );
    assert_eq!(h.try_submit(4, 4).err(), Some(ServeError::ShuttingDown));
}

#[test]
fn a_drain_refuses_new_requests_and_lets_the_running_finish() {
    let mut h = Harness::new(16, "");
    let mut a = h.submit(10, 5);
    h.scheduler.drain();
    assert_eq!(h.try_submit(4, 4).err(), Some(ServeError::ShuttingDown));
    drive_to_the_end(&mut h, std::slice::from_mut(&mut a), 100);
    assert_eq!(h.scheduler.stats().finished, 1);
}

/// Submits `n` seeded choices of one 40-token prompt (two and a half pages, so the copy takes a
/// partly filled page too), sampling at temperature 1 so that the choices differ.
fn submit_choices(h: &mut Harness, n: usize, seed: u64) -> Vec<RequestStream> {
    let prompt = (0..40u32).map(|i| 3 + (i * 11) % 200).collect();
    let params = SamplingParams {
        max_tokens: 12,
        temperature: 1.0,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    h.scheduler
        .submit_choices(GenerateRequest { prompt, params }, n)
        .unwrap()
}

/// A list of prompts is queued whole or not at all: too many sequences for the queue ever,
/// too little room in it now, or one invalid prompt (named by its place) leave the queue as it
/// was; a list that fits queues each prompt's choices, the first of each computing its prompt.
#[test]
fn a_list_of_prompts_is_queued_all_or_none() {
    let mut h = Harness::new(64, "[admission]\nmax_queue = 4\n");
    let request = |len: u32| GenerateRequest {
        prompt: (0..len).map(|i| 3 + i).collect(),
        params: greedy_exactly(3),
    };
    let queued = |h: &Harness| h.scheduler.stats().queued;
    let refused = h
        .scheduler
        .submit_prompts(vec![request(5), request(6), request(7)], 2)
        .err();
    assert_eq!(
        refused,
        Some(ServeError::TooManyChoices {
            prompts: 3,
            n: 2,
            max_queue: 4
        })
    );
    let first = h.scheduler.submit(request(4)).unwrap();
    let refused = h
        .scheduler
        .submit_prompts(vec![request(5), request(6)], 2)
        .err();
    assert!(
        matches!(refused, Some(ServeError::Overloaded { .. })),
        "{refused:?}"
    );
    let mut bad = request(6);
    bad.prompt.push(1_000_000);
    let refused = h.scheduler.submit_prompts(vec![request(5), bad], 1).err();
    match refused {
        Some(ServeError::Invalid(why)) => assert!(why.starts_with("prompt 1: token id"), "{why}"),
        other => panic!("{other:?}"),
    }
    assert_eq!(queued(&h), 1, "nothing of a refused list was queued");

    let groups = h
        .scheduler
        .submit_prompts(vec![request(5), request(9), request(17)], 1)
        .unwrap();
    assert_eq!(groups.iter().map(Vec::len).collect::<Vec<_>>(), [1, 1, 1]);
    assert_eq!(queued(&h), 4);
    let mut streams: Vec<RequestStream> = groups.into_iter().flatten().collect();
    streams.insert(0, first);
    drive_to_the_end(&mut h, &mut streams, 100);
    assert_eq!(h.scheduler.stats().finished, 4);
}

/// The (start, token count) of each row of each step.
type StepRows = Vec<Vec<(usize, usize)>>;

/// Steps until every stream has ended; returns each stream's tokens and the rows of every step.
fn run_choices(h: &mut Harness, streams: &mut [RequestStream]) -> (Vec<Vec<u32>>, StepRows) {
    let mut out = vec![Vec::new(); streams.len()];
    let mut done = vec![false; streams.len()];
    let mut steps = Vec::new();
    for _ in 0..100 {
        steps.push(h.step());
        for ((stream, out), done) in streams.iter_mut().zip(&mut out).zip(&mut done) {
            let (tokens, end) = tokens(stream);
            out.extend(tokens);
            if let Some(end) = end {
                assert!(matches!(end, Event::Finished { .. }), "{end:?}");
                *done = true;
            }
        }
        if done.iter().all(|&d| d) {
            return (out, steps);
        }
    }
    panic!("choices still running after 100 steps");
}

#[test]
fn choices_compute_the_prompt_once_and_draw_what_lone_requests_with_their_seeds_draw() {
    let mut h = Harness::new(64, "");
    let mut streams = submit_choices(&mut h, 3, 11);
    let (choices, steps) = run_choices(&mut h, &mut streams);
    assert_eq!(
        steps[0],
        vec![(0, 40)],
        "the first choice computes the prompt"
    );
    assert_eq!(
        steps[1],
        vec![(40, 1), (39, 1), (39, 1)],
        "the others copy its KV and run only the prompt's last token"
    );
    let prompt_tokens: usize = steps
        .iter()
        .flatten()
        .filter(|&&(start, _)| start < 40)
        .map(|&(_, n)| n)
        .sum();
    assert_eq!(prompt_tokens, 42);
    assert_eq!(h.scheduler.stats().forked_tokens, 2 * 39);
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
    for (i, choice) in choices.iter().enumerate() {
        let mut alone = Harness::new(64, "");
        let mut stream = submit_choices(&mut alone, 1, 11 + i as u64);
        let (lone, _) = run_choices(&mut alone, &mut stream);
        assert_eq!(
            choice,
            &lone[0],
            "choice {i} and a lone request seeded {}",
            11 + i
        );
    }
    assert!(
        choices[0] != choices[1] || choices[1] != choices[2],
        "three seeds drew one text: {choices:?}"
    );
}

#[test]
fn choices_whose_first_ended_before_they_could_copy_compute_the_prompt_themselves() {
    // One running slot: the other choices wait for it, and the first choice ends (and gives up
    // its pages) before they can be admitted.
    let mut h = Harness::new(64, "[admission]\nmax_running = 1\n");
    let mut streams = submit_choices(&mut h, 2, 5);
    let (choices, steps) = run_choices(&mut h, &mut streams);
    assert!(
        steps.iter().flatten().filter(|&&r| r == (0, 40)).count() == 2,
        "each choice computed the prompt: {steps:?}"
    );
    assert_eq!(h.scheduler.stats().forked_tokens, 0);
    assert_eq!(choices.iter().map(Vec::len).collect::<Vec<_>>(), [12, 12]);
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
}

#[test]
fn dropping_the_first_choice_before_it_runs_lets_the_others_go_alone() {
    let mut h = Harness::new(64, "");
    let mut streams = submit_choices(&mut h, 3, 5);
    drop(streams.remove(0));
    let (choices, _) = run_choices(&mut h, &mut streams);
    assert_eq!(choices.iter().map(Vec::len).collect::<Vec<_>>(), [12, 12]);
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
}

#[test]
fn a_finished_reply_is_saved_so_the_next_turn_restores_it_whole() {
    let mut h = Harness::new(64, "");
    let first: Vec<u32> = (0..70u32).map(|i| 3 + (i * 7) % 200).collect();
    let params = SamplingParams {
        max_tokens: 30,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let request = GenerateRequest {
        prompt: first.clone(),
        params: params.clone(),
    };
    let mut stream = h.scheduler.submit(request).unwrap();
    let (replies, _) = run_choices(&mut h, std::slice::from_mut(&mut stream));
    assert_eq!(replies[0].len(), 30);
    // Finished and answered; its pages stay one step for the save, then go.
    assert_eq!(h.scheduler.stats().running, 0);
    h.step();
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
    assert_eq!(
        h.store.inner().snapshot_ids().count(),
        2,
        "the prompt and the reply"
    );

    // The next turn: everything before, plus a new message.
    let mut second = first;
    second.extend(&replies[0]);
    second.extend([9, 8, 7, 6, 5]);
    let request = GenerateRequest {
        prompt: second,
        params: SamplingParams {
            max_tokens: 1,
            ..params
        },
    };
    let mut stream = h.scheduler.submit(request).unwrap();
    run_choices(&mut h, std::slice::from_mut(&mut stream));
    // 70 prompt tokens and 29 of the reply's have KV: six whole pages of 16.
    assert_eq!(h.scheduler.stats().restored_tokens, 96);
}

#[test]
fn a_reply_whose_prompt_nobody_showed_before_is_not_saved() {
    let mut h = Harness::new(64, "[snapshots]\nsave_after_sightings = 2\n");
    let prompt: Vec<u32> = (0..70u32).map(|i| 3 + (i * 7) % 200).collect();
    let mut stream = h.submit_exactly(prompt, 30);
    run_choices(&mut h, std::slice::from_mut(&mut stream));
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
    assert_eq!(h.store.inner().snapshot_ids().count(), 0);
}

/// Runs one request to its end; after every step checks that each running job holds no position past its
/// tokens, in its own table and in the pool once the deferred truncations are applied.
/// Returns its tokens and the scheduler's counters.
fn run_repeating(toml: &str, max_tokens: usize) -> (Vec<u32>, super::SchedulerStats) {
    let mut h = Harness::new(64, toml);
    // This model repeats the pattern's last token, 7, from its first token on; with "6 7 7"
    // once in the middle, the draft after its first token continues the pattern from there,
    // and is refused.
    let mut prompt: Vec<u32> = (0..40u32).map(|i| 3 + i % 5).collect();
    prompt[10] = 7;
    let mut stream = h.submit_exactly(prompt, max_tokens);
    let mut out = Vec::new();
    let pt = h.scheduler.config.page_tokens;
    for _ in 0..4 * max_tokens {
        h.step();
        for job in &h.scheduler.running {
            let slot = job.slot.as_ref().unwrap();
            let pending = h
                .scheduler
                .truncates
                .iter()
                .find(|(s, _)| *s == slot.handle);
            let pooled = pending.map_or_else(|| h.pool.slot_tokens(slot.handle).unwrap(), |p| p.1);
            assert!(
                slot.held_tokens <= job.tokens.len(),
                "holds past its tokens"
            );
            assert_eq!(pooled, slot.pooled_tokens, "the pool and the job disagree");
            assert!(
                pooled <= slot.held_tokens && slot.held_tokens <= slot.pages.len() * pt,
                "holds positions outside its pages"
            );
            assert_eq!(
                slot.pages.len(),
                pooled.div_ceil(pt),
                "the pool's count needs other pages"
            );
        }
        let (tokens, end) = tokens(&mut stream);
        out.extend(tokens);
        if let Some(end) = end {
            assert!(matches!(end, Event::Finished { .. }), "{end:?}");
            // Its release goes out with the next step's exchange.
            h.step();
            assert_eq!(h.pool.stats().free_pages, 64, "every page is free again");
            return (out, h.scheduler.stats());
        }
    }
    panic!("the request did not end");
}

#[test]
fn verified_drafts_give_the_tokens_of_one_token_steps_and_refused_positions_go_back() {
    let (plain, off) = run_repeating("", 50);
    assert_eq!(off.drafted_tokens, 0);
    for reservation in ["worst_case", "optimistic"] {
        let toml = format!(
            "[cache]\nreservation = \"{reservation}\"\n[speculative]\nmethod = \"prompt_lookup\"\n\
             draft_sizing = \"whole\"\n"
        );
        let (speculated, on) = run_repeating(&toml, 50);
        assert_eq!(
            speculated, plain,
            "{reservation}: speculation changed the output"
        );
        assert!(
            on.drafted_tokens > 0,
            "{reservation}: nothing drafted: {on:?}"
        );
        let refused: u64 = on.verified[..policy::MAX_VERIFY_WIDTH - 2].iter().sum();
        assert!(refused > 0, "{reservation}: no draft was cut short: {on:?}");
        assert!(
            on.steps < off.steps,
            "{reservation}: {} steps with speculation, {} without",
            on.steps,
            off.steps
        );
    }
}

#[test]
fn no_draft_is_longer_than_draft_tokens() {
    let toml =
        "[speculative]\nmethod = \"prompt_lookup\"\ndraft_tokens = 2\ndraft_sizing = \"whole\"\n";
    let (_, on) = run_repeating(toml, 40);
    let verifications: u64 = on.verified.iter().sum();
    assert!(verifications > 0, "{on:?}");
    assert!(on.drafted_tokens <= 2 * verifications, "{on:?}");
    assert_eq!(on.verified[3..].iter().sum::<u64>(), 0, "{on:?}");
}

/// Drafts are sized by what a drafted token is expected to add against what it costs: none
/// for a request whose drafts are seldom kept where each token adds a quarter of a step, the
/// whole proposal where tokens are nearly free. (The learnt step time, and in the first case
/// the request's acceptance, are set before each step, so the tiny model's own timings do not
/// enter.)
#[test]
fn drafts_are_sized_by_what_a_drafted_token_costs() {
    let mut h = Harness::new(64, "[speculative]\nmethod = \"prompt_lookup\"\n");
    let prompt: Vec<u32> = (0..40u32).map(|i| 3 + i % 5).collect();
    let mut stream = h.submit_exactly(prompt, 200);
    // Eight steps, each planned with a step time of 10 ms plus `per_token` a token beyond the
    // first, learnt from steps without drafts (one token) and with (two and eight; nothing
    // learnt with `None`), and with `refused` the request's last ten drafts all refused: the
    // tokens drafted.
    let run = |h: &mut Harness, per_token: Option<f64>, refused: bool| {
        let before = h.scheduler.stats().drafted_tokens;
        for _ in 0..8 {
            let (mut plain, mut verify) =
                (policy::StepTimeModel::new(), policy::StepTimeModel::new());
            if let Some(per_token) = per_token {
                for tokens in [2, 8, 2, 8] {
                    plain.observe(1, 0.010);
                    verify.observe(tokens, 0.010 + per_token * (tokens - 1) as f64);
                }
            }
            h.scheduler.plain_time = plain;
            h.scheduler.verify_time = verify;
            if refused && let Some(job) = h.scheduler.running.first_mut() {
                for _ in 0..10 {
                    job.acceptance.observe(7, 0);
                }
            }
            h.step();
        }
        h.scheduler.stats().drafted_tokens - before
    };
    // Prefill, and the first verifications: the whole proposals.
    assert!(
        run(&mut h, None, false) > 0,
        "no drafts before anything is learnt"
    );
    assert_eq!(
        run(&mut h, Some(0.0025), true),
        0,
        "drafts seldom kept, at a quarter of a step a token"
    );
    let cheap = run(&mut h, Some(0.0001), false);
    assert!(
        cheap >= 8 * 4,
        "nearly free tokens, only {cheap} drafted in 8 steps"
    );
    let (tokens, end) = tokens(&mut stream);
    assert!(
        tokens.len() > 8 && end.is_none(),
        "{} tokens, {end:?}",
        tokens.len()
    );
}

/// Runs `prompt` to its end with `params`; returns its tokens, the rows of every step, and
/// how many first tokens came from kept logits so far.
fn run_prompt(
    h: &mut Harness,
    prompt: &[u32],
    params: &SamplingParams,
) -> (Vec<u32>, StepRows, u64) {
    let request = GenerateRequest {
        prompt: prompt.to_vec(),
        params: params.clone(),
    };
    let mut stream = h.scheduler.submit(request).unwrap();
    let (mut out, steps) = run_choices(h, std::slice::from_mut(&mut stream));
    h.step();
    (
        out.pop().unwrap(),
        steps,
        h.scheduler.stats().first_tokens_from_kept_logits,
    )
}

fn greedy_exactly(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ignore_eos: true,
        ..SamplingParams::default()
    }
}

#[test]
fn a_repeated_prompt_s_first_token_comes_from_its_kept_logits_before_any_forward() {
    // 70 tokens: four whole pages restore, and the partial fifth runs with the first token.
    let mut h = Harness::new(64, "");
    let prompt: Vec<u32> = (0..70u32).map(|i| 3 + (i * 13) % 200).collect();
    let (cold, cold_steps, kept) = run_prompt(&mut h, &prompt, &greedy_exactly(8));
    assert_eq!(kept, 0);
    assert_eq!(cold_steps[0], [(0, 70)]);
    let stats = h.scheduler.stats().kept_logits;
    let row_bytes = 4 * h.scheduler.config.vocab_size as u64;
    assert_eq!(
        (stats.rows, stats.bytes),
        (1, row_bytes),
        "one row of f32 logits"
    );

    let mut stream = h.submit_exactly(prompt.clone(), 8);
    let rows = h.step();
    assert_eq!(
        rows,
        [(64, 7)],
        "the partial page and the first token, after the restore"
    );
    let (first, _) = tokens(&mut stream);
    assert_eq!(
        first,
        cold[..2],
        "the first token without a forward, the second from it"
    );
    let (mut rest, _) = run_choices(&mut h, std::slice::from_mut(&mut stream));
    let mut repeat = first;
    repeat.append(&mut rest[0]);
    assert_eq!(repeat, cold);
    assert_eq!(h.scheduler.stats().first_tokens_from_kept_logits, 1);
    assert_eq!(h.scheduler.stats().restored_tokens, 64);
}

#[test]
fn a_first_token_from_kept_logits_wakes_its_reader_before_the_step_runs() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll, Wake, Waker};
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }
    let mut h = Harness::new(64, "");
    let prompt: Vec<u32> = (0..70u32).map(|i| 3 + (i * 13) % 200).collect();
    run_prompt(&mut h, &prompt, &greedy_exactly(8));
    let mut stream = h.submit_exactly(prompt, 8);
    // The reader waits, as a response stream does.
    let count = Arc::new(Count(AtomicUsize::new(0)));
    let waker = Waker::from(count.clone());
    {
        let next = std::pin::pin!(stream.next());
        assert!(next.poll(&mut Context::from_waker(&waker)).is_pending());
    }
    let Harness {
        scheduler,
        pool,
        store,
        engine,
        ..
    } = &mut h;
    let step = plan_step(scheduler, pool, store, engine, |_, _, _| {});
    assert_eq!(scheduler.stats().first_tokens_from_kept_logits, 1);
    assert_eq!(
        count.0.load(Ordering::SeqCst),
        1,
        "woken when the token was picked, before the engine step that follows it"
    );
    let reply = step.map(|s| engine.run(s));
    scheduler.finish_step(reply, Instant::now());
    let next = std::pin::pin!(stream.next());
    assert!(matches!(
        next.poll(&mut Context::from_waker(&waker)),
        Poll::Ready(Some(Event::Token(_)))
    ));
}

#[test]
fn a_page_aligned_repeat_runs_its_first_token_as_a_decode_row() {
    let mut h = Harness::new(64, "");
    let prompt: Vec<u32> = (0..64u32).map(|i| 3 + (i * 17) % 200).collect();
    let (cold, _, _) = run_prompt(&mut h, &prompt, &greedy_exactly(6));
    let (repeat, steps, kept) = run_prompt(&mut h, &prompt, &greedy_exactly(6));
    assert_eq!(repeat, cold);
    assert_eq!(kept, 1);
    assert_eq!(steps[0], [(64, 1)], "nothing of the prompt runs again");
}

#[test]
fn a_one_token_repeat_is_answered_without_restoring_or_computing_anything() {
    let mut h = Harness::new(64, "");
    let prompt: Vec<u32> = (0..70u32).map(|i| 3 + (i * 19) % 200).collect();
    let (cold, _, _) = run_prompt(&mut h, &prompt, &greedy_exactly(3));
    let restored = h.scheduler.stats().restored_tokens;
    let mut stream = h.submit_exactly(prompt.clone(), 1);
    assert_eq!(h.step(), [], "no row");
    let (out, end) = tokens(&mut stream);
    assert_eq!(out, cold[..1]);
    match end {
        Some(Event::Finished { usage, .. }) => {
            assert_eq!((usage.completion_tokens, usage.cached_tokens), (1, 70))
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(
        h.scheduler.stats().restored_tokens,
        restored,
        "nothing restored"
    );
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
}

#[test]
fn a_seeded_repeat_draws_what_the_first_request_drew() {
    let mut h = Harness::new(64, "");
    let prompt: Vec<u32> = (0..75u32).map(|i| 3 + (i * 23) % 200).collect();
    let params = SamplingParams {
        max_tokens: 10,
        temperature: 1.0,
        seed: Some(5),
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let (cold, _, _) = run_prompt(&mut h, &prompt, &params);
    let (repeat, steps, kept) = run_prompt(&mut h, &prompt, &params);
    assert_eq!(kept, 1);
    assert_eq!(steps[0], [(64, 12)]);
    assert_eq!(repeat, cold);
}

#[test]
fn kept_logits_serve_only_the_same_whole_prompt_and_only_when_enabled() {
    let mut h = Harness::new(64, "");
    let prompt: Vec<u32> = (0..70u32).map(|i| 3 + (i * 29) % 200).collect();
    run_prompt(&mut h, &prompt, &greedy_exactly(2));
    // The same whole pages, another partial page: restored, but its own first token computed.
    let mut other = prompt.clone();
    other[69] += 1;
    let (_, steps, kept) = run_prompt(&mut h, &other, &greedy_exactly(2));
    assert_eq!((kept, steps[0].clone()), (0, vec![(64, 6)]));
    // One token more: five whole pages are not stored, so nothing is kept for it.
    let mut longer = prompt.clone();
    longer.push(9);
    let (_, _, kept) = run_prompt(&mut h, &longer, &greedy_exactly(2));
    assert_eq!(kept, 0);

    let mut off = Harness::new(64, "[snapshots]\nprompt_logits_bytes = 0\n");
    run_prompt(&mut off, &prompt, &greedy_exactly(2));
    let (_, steps, kept) = run_prompt(&mut off, &prompt, &greedy_exactly(2));
    assert_eq!((kept, steps[0].clone()), (0, vec![(64, 6)]));
    assert_eq!(off.scheduler.stats().kept_logits.rows, 0);
}

/// Steps driven as the `Admission` actor drives them with overlap: the next step is planned
/// before the one in flight answers. The engine runs each step when it is sent (it runs them in
/// order); its answer reaches the scheduler only after the next step was planned.
struct Overlapped {
    in_flight: std::collections::VecDeque<crate::exchange::EngineStepReply>,
    /// The rows of each step the engine ran, in order.
    rows: Vec<Vec<(usize, usize)>>,
}

impl Overlapped {
    fn new() -> Self {
        Overlapped {
            in_flight: Default::default(),
            rows: Vec::new(),
        }
    }

    /// Plans as many steps ahead as the scheduler allows, then applies the oldest answer.
    /// Returns false once nothing is in flight and nothing is to be done.
    fn event(&mut self, h: &mut Harness) -> bool {
        loop {
            let may_plan = match self.in_flight.len() {
                0 => true,
                1 => h.scheduler.can_plan_ahead(),
                _ => false,
            };
            if !may_plan || !h.scheduler.readiness(Instant::now()).0 {
                break;
            }
            if !self.in_flight.is_empty() {
                let ahead_of = self.rows.last().expect("a step is in flight");
                assert!(
                    ahead_of.iter().all(|&(_, n)| n == 1),
                    "a step was planned ahead of one with a prompt chunk: {ahead_of:?}"
                );
            }
            let (scheduler, pool, store, engine) =
                (&mut h.scheduler, &mut h.pool, &mut h.store, &mut h.engine);
            match plan_step(scheduler, pool, store, engine, |_, _, _| {}) {
                Some(step) => {
                    self.rows.push(rows_of(&step.plan));
                    self.in_flight.push_back(h.engine.run(step));
                }
                None => {
                    h.scheduler.finish_step(None, Instant::now());
                    break;
                }
            }
        }
        match self.in_flight.pop_front() {
            Some(reply) => {
                h.scheduler.finish_step(Some(reply), Instant::now());
                true
            }
            None => false,
        }
    }

    /// Drives until nothing is in flight or to be done, at most `max` answers.
    fn run(&mut self, h: &mut Harness, max: usize) {
        for _ in 0..max {
            if !self.event(h) {
                return;
            }
        }
        panic!("still stepping after {max} answers");
    }
}

/// Greedy prompts of several lengths, each generating exactly `max_tokens`.
fn mixed_prompts(h: &mut Harness, max_tokens: usize) -> Vec<RequestStream> {
    [5usize, 21, 40, 3]
        .iter()
        .enumerate()
        .map(|(i, &len)| {
            let prompt = (0..len as u32)
                .map(|t| 3 + (t * 7 + i as u32) % 200)
                .collect();
            h.submit_exactly(prompt, max_tokens)
        })
        .collect()
}

fn collect(streams: &mut [RequestStream]) -> Vec<(Vec<u32>, Option<Event>)> {
    streams.iter_mut().map(tokens).collect()
}

#[test]
fn steps_planned_ahead_give_the_tokens_of_steps_one_at_a_time() {
    let toml = "[admission]\nmax_running = 4\nstep_token_budget = 16\n";
    let mut alone = Harness::new(64, toml);
    let mut streams = mixed_prompts(&mut alone, 20);
    for _ in 0..200 {
        if !alone.step_outcome().1.ready {
            break;
        }
    }
    let expected = collect(&mut streams);
    assert_eq!(alone.scheduler.stats().planned_ahead, 0);
    // No step was planned ahead: no engine wait is counted, though the engine timed each.
    assert_eq!(alone.scheduler.stats().engine_waits, 0);

    let mut ahead = Harness::new(64, toml);
    let mut streams = mixed_prompts(&mut ahead, 20);
    let mut driver = Overlapped::new();
    driver.run(&mut ahead, 200);
    assert_eq!(collect(&mut streams), expected);
    for (tokens, end) in &expected {
        assert_eq!(tokens.len(), 20);
        assert!(matches!(end, Some(Event::Finished { .. })), "{end:?}");
    }
    // Only behind steps of decode rows (the driver checks that), which most steps were.
    let stats = ahead.scheduler.stats();
    assert!(stats.planned_ahead >= 15, "{stats:?}");
    // Each answered step planned ahead reports the engine's time since the step before.
    assert_eq!(stats.engine_waits, stats.planned_ahead, "{stats:?}");
    assert!(stats.engine_waited_nanos > 0, "{stats:?}");
    // Every running job's last pick was in flight when the next step was planned: a row
    // that starts from it ran, and nothing was computed twice.
    let computed: usize = driver.rows.iter().flatten().map(|&(_, n)| n).sum();
    assert_eq!(computed, 5 + 21 + 40 + 3 + 4 * 19);
    assert_eq!(ahead.pool.stats().used_pages, 0);
}

#[test]
fn a_stop_seen_after_the_next_step_was_planned_ends_the_request_there() {
    // A prompt whose free run picks a new token after its second: one picked by a decode
    // step planned ahead.
    let (prompt, free_run, first_stop) = (0..40u32)
        .find_map(|seed| {
            let prompt: Vec<u32> = (0..12u32).map(|t| 3 + (t * 11 + seed * 17) % 200).collect();
            let mut alone = Harness::new(64, "");
            let mut stream = alone.submit_exactly(prompt.clone(), 8);
            for _ in 0..50 {
                if !alone.step_outcome().1.ready {
                    break;
                }
            }
            let (free_run, _) = tokens(&mut stream);
            assert_eq!(free_run.len(), 8);
            let first_stop =
                (2..free_run.len()).find(|&i| !free_run[..i].contains(&free_run[i]))?;
            Some((prompt, free_run, first_stop))
        })
        .expect("some prompt's free run picks a new token after its second");
    // Stop on it: the step after it was planned before it was seen.
    let stop = free_run[first_stop];
    let mut h = Harness::new(64, "");
    let params = SamplingParams {
        max_tokens: 8,
        ignore_eos: true,
        stop_token_ids: vec![stop],
        ..SamplingParams::default()
    };
    let mut stream = h
        .scheduler
        .submit(GenerateRequest { prompt, params })
        .unwrap();
    let mut driver = Overlapped::new();
    driver.run(&mut h, 50);
    let (delivered, end) = tokens(&mut stream);
    assert_eq!(delivered, free_run[..=first_stop]);
    assert!(
        matches!(
            end,
            Some(Event::Finished {
                reason: crate::request::FinishReason::Stop,
                ..
            })
        ),
        "{end:?}"
    );
    // The row planned after the stop ran and its pick was dropped.
    let decode_rows = driver.rows.iter().flatten().filter(|r| r.1 == 1).count();
    assert_eq!(decode_rows, first_stop + 1);
    assert_eq!(h.pool.stats().used_pages, 0);
    assert!(h.engine.kept_samplers().len() <= h.scheduler.samplers_to_forget().len());
}

#[test]
fn a_request_cancelled_with_two_steps_in_flight_ends_once_and_gives_back_its_pages() {
    let mut h = Harness::new(64, "");
    let mut doomed = h.submit_exactly((3..30).collect(), 30);
    let mut other = h.submit_exactly((5..20).collect(), 6);
    let mut driver = Overlapped::new();
    for _ in 0..4 {
        assert!(driver.event(&mut h));
    }
    h.scheduler.cancel(doomed.id);
    driver.run(&mut h, 100);
    let (_, end) = tokens(&mut doomed);
    assert_eq!(end, Some(Event::Cancelled));
    assert_eq!(doomed.try_next(), None);
    let (delivered, end) = tokens(&mut other);
    assert_eq!(delivered.len(), 6);
    assert!(matches!(end, Some(Event::Finished { .. })), "{end:?}");
    assert_eq!(h.pool.stats().used_pages, 0);
    // The cancelled request's sampler is dropped with the next step the engine runs.
    h.submit_exactly(vec![3, 4, 5], 1);
    driver.run(&mut h, 10);
    assert_eq!(h.engine.kept_samplers(), Vec::new());
}

/// Three requests admitted optimistically into a pool that holds one to its end, with no
/// room in the store for what a preempted one computed: each time one runs dry, the youngest
/// gives way, so the oldest always progresses and all three end. (Had each preempted itself,
/// two could take turns losing their work for ever.)
#[test]
fn the_youngest_request_gives_way_when_the_pool_runs_dry() {
    let toml = "[cache]\nreservation = \"optimistic\"\n[snapshots]\ndevice_budget_bytes = 0\n\
                [backoff]\nbase_ms = 1\nmax_ms = 1\nmax_attempts = 1\non_exhausted = \"preempt\"\n";
    let mut h = Harness::new(6, toml);
    let mut streams: Vec<RequestStream> = (0..3)
        .map(|i| {
            let prompt = (0..20u32).map(|t| 3 + (t * 5 + i) % 200).collect();
            h.submit_exactly(prompt, 60)
        })
        .collect();
    let mut usages = vec![None; streams.len()];
    for _ in 0..2_000 {
        let (_, outcome) = h.step_outcome();
        for (stream, usage) in streams.iter_mut().zip(&mut usages) {
            while let Some(event) = stream.try_next() {
                match event {
                    Event::Token(_) => {}
                    Event::Finished { usage: u, .. } => *usage = Some(u),
                    other => panic!("{other:?}"),
                }
            }
        }
        if usages.iter().all(Option::is_some) {
            break;
        }
        if !outcome.ready
            && let Some(wake) = outcome.wake_at
        {
            std::thread::sleep(wake.saturating_duration_since(Instant::now()));
        }
    }
    let usages: Vec<_> = usages
        .into_iter()
        .map(|u| u.expect("every request ends"))
        .collect();
    assert!(usages.iter().all(|u| u.completion_tokens == 60));
    assert_eq!(usages[0].preemptions, 0, "the oldest never gave way");
    assert!(h.scheduler.stats().preemptions > 0, "the pool did run dry");
    h.step();
    assert_eq!(h.pool.stats().used_pages, 0);
}

/// A prompt whose first chunk completes it only because a stored prefix shortened it (its
/// save could not be charged with its lookup, in the step's one exchange with the store) is
/// saved from the next step, and a repeat restores all of it.
#[test]
fn a_prompt_completed_thanks_to_a_restore_is_saved_the_step_after() {
    // A step takes 64 prompt tokens: an 81-token prompt needs two chunks cold.
    let toml = "[admission]\nstep_token_budget = 64\n";
    let mut h = Harness::new(32, toml);
    let head: Vec<u32> = (0..64u32).map(|i| 3 + (i * 7) % 200).collect();
    let mut long = head.clone();
    long.extend((0..16u32).map(|i| 100 + i));
    long.push(7);
    let mut stream = h.submit_exactly(head, 1);
    drive_to_the_end(&mut h, std::slice::from_mut(&mut stream), 20);
    // The 64-token head is stored: the longer prompt restores it, and its first chunk (its
    // other 17 tokens) completes it in one step.
    let mut stream = h.submit_exactly(long.clone(), 4);
    h.step();
    assert_eq!(h.scheduler.stats().restored_tokens, 64);
    assert!(
        !tokens(&mut stream).0.is_empty(),
        "its first token, one step in"
    );
    drive_to_the_end(&mut h, std::slice::from_mut(&mut stream), 20);
    h.step();
    let mut repeat = h.submit_exactly(long, 1);
    drive_to_the_end(&mut h, std::slice::from_mut(&mut repeat), 20);
    assert_eq!(
        h.scheduler.stats().restored_tokens,
        64 + 80,
        "the repeat restored the whole 80-token head"
    );
}
