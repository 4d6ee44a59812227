//! Scheduling overhead per step: the four actors driving `batch` decoding sequences over a
//! backend that does no math (a real `Backend` whose forward pass returns zero logits for a
//! 16-token vocabulary), so what is timed is the messages, the planning and the bookkeeping.
//!
//!     cargo bench -p actors --bench scheduling
//!
//! Prints, for each batch size, the mean time of one decode step (every sequence running, one
//! token each) over a few thousand steps of steady decoding: through the actors, and on one
//! thread with no messages (the planning alone). Each for `decode_steps` 1 and 8 (override
//! with `DECODE_STEPS=1,4`; batch sizes with `BATCHES=1,32,256`): with 8, one scheduler step
//! hands the engine up to 8 decode steps. Callers read their streams as tokens arrive.
//! Through the actors, with the next step planned while the engine runs the one before it
//! (`[admission] overlap_steps`, the default) and without (`OVERLAP=on,off` picks). The
//! callers read their streams on the actors' thread, or with `READERS=thread` on a thread of
//! their own, as a server's HTTP workers do; either way through a stream inbox on the readers'
//! thread, as those workers have (`INBOX=off`: each stream delivered to on its own). Through
//! the actors it also prints the processor
//! time the actors' thread spent a step (the scheduler's messages, planning and bookkeeping,
//! and the readers when they share it): what must fit under the engine's step for planning
//! to stay hidden behind it, while the wall-clock figure also holds the waits of a step's
//! hand-offs between threads, which a real engine's step overlaps. The last two columns take
//! the scheduler's part apart, both ways: µs a step in `begin_step`, `plan_pool`,
//! `plan_engine` and `finish_step` ([`Phase`]); through the actors, what is left of the
//! thread's time is the messages, the actix machinery and the readers.
//!
//! The last column is what a GPU would feel: the engine's time between the end of a step and
//! the start of the next one planned ahead of it (`SchedulerStats::engine_waited_nanos`, the
//! server's `snapserve_engine_wait_microseconds_total`). With the default null step it is the
//! planning's whole time, as nothing hides it; `ENGINE_US=2000` makes each step take 2 ms, as
//! a forward pass at batch 256 does, and then it is the scheduling the planning ahead leaves
//! unhidden (the handing over of the step).

use std::time::{Duration, Instant};

/// The server's allocator (`src/main.rs`): what is timed is the server's step.
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

use actors::scheduler::{Phase, Scheduler};
use actors::{GenerateRequest, Parts, ServeConfig};
use cache::{BackingId, KvGeometry, PageClone, PageCopy, Tier};
use engine::EngineError;
use engine::backend::{Backend, BackendInfo, HostRun, MemoryReport, StepOutput, StepPlan};
use engine::sampling::SamplingParams;
use policy::Policies;

const VOCAB: usize = 16;
const PAGE: usize = 16;
/// Steps timed per batch size: at most 3,000 positions are added to each sequence.
const WINDOW_STEPS: u64 = 3000;

/// A backend that checks and answers the plan but computes nothing, taking `step_time` a step
/// (`ENGINE_US`, default 0) as a GPU's forward pass would.
struct NullBackend {
    info: BackendInfo,
    step_time: Duration,
}

impl Backend for NullBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput, EngineError> {
        let began = Instant::now();
        let output = self.answer(plan);
        // A forward pass's time: slept (the engine's thread blocks on the device), the last
        // stretch spun, as sleeps overshoot by tens of µs.
        let due = began + self.step_time;
        if let Some(sleep) = self.step_time.checked_sub(Duration::from_micros(200)) {
            std::thread::sleep(sleep.saturating_sub(began.elapsed()));
        }
        while Instant::now() < due {
            std::hint::spin_loop();
        }
        output
    }

    fn alloc_backing(&mut self, _: BackingId, _: Tier, _: u64) -> Result<(), EngineError> {
        Ok(())
    }
    fn free_backing(&mut self, _: BackingId) -> Result<(), EngineError> {
        Ok(())
    }
    fn save_pages(&mut self, _: BackingId, _: &[PageCopy]) -> Result<(), EngineError> {
        Ok(())
    }
    fn restore_pages(&mut self, _: BackingId, _: &[PageCopy]) -> Result<(), EngineError> {
        Ok(())
    }
    fn clone_pages(&mut self, _: &[PageClone]) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn copy_backing(&mut self, _: BackingId, _: BackingId) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn finished_copies(&mut self, _: bool) -> Vec<(BackingId, Result<(), EngineError>)> {
        Vec::new()
    }
    fn backing_ids(&self) -> Vec<BackingId> {
        Vec::new()
    }
    fn restore_verdicts(&mut self) -> Result<Vec<bool>, EngineError> {
        Ok(Vec::new())
    }
    fn backing_sums(&mut self, _: BackingId) -> Result<Vec<u64>, EngineError> {
        Ok(Vec::new())
    }
    fn set_backing_sums(&mut self, _: BackingId, _: &[u64]) -> Result<(), EngineError> {
        Ok(())
    }
    fn host_runs(&mut self, _: BackingId) -> Result<Vec<HostRun>, EngineError> {
        Ok(Vec::new())
    }
    fn read_backing(&mut self, _: BackingId) -> Result<Vec<u8>, EngineError> {
        Ok(Vec::new())
    }
    fn flip_byte(&mut self, _: BackingId, _: u64, _: u8) -> Result<(), EngineError> {
        Ok(())
    }
    fn memory(&self) -> MemoryReport {
        MemoryReport::default()
    }
}

impl NullBackend {
    fn answer(&self, plan: &StepPlan) -> Result<StepOutput, EngineError> {
        plan.validate(&self.info)?;
        let logit_rows: usize = plan.rows.iter().map(|row| row.logit_rows()).sum();
        let mut output = StepOutput {
            vocab_size: VOCAB,
            logits: vec![0.0; logit_rows * VOCAB],
            row_ranges: Vec::with_capacity(plan.rows.len()),
        };
        let mut start = 0;
        for row in &plan.rows {
            output.row_ranges.push(start..start + row.logit_rows());
            start += row.logit_rows();
        }
        Ok(output)
    }
}

fn setup(
    batch: usize,
    decode_steps: usize,
    overlap: bool,
    step_time: Duration,
) -> (NullBackend, ServeConfig) {
    let geometry = KvGeometry {
        layers: 30,
        kv_heads: 3,
        head_dim: 64,
        page_tokens: PAGE,
        dtype_bytes: 2,
    };
    let info = BackendInfo {
        name: "null",
        geometry,
        num_pages: batch * 520,
        vocab_size: VOCAB,
        max_positions: 8192,
    };
    let toml = format!(
        "[cache]\npage_tokens = {PAGE}\n[admission]\nmax_running = {batch}\nmax_queue = {batch}\nstep_token_budget = {}\ndecode_steps = {decode_steps}\noverlap_steps = {overlap}\n",
        batch.max(64) * 16
    );
    let config = ServeConfig {
        policies: Policies::from_toml(&toml).unwrap(),
        model_id: "null".into(),
        eos_token_ids: vec![],
        seed: 1,
        verify_steps: Vec::new(),
    };
    (NullBackend { info, step_time }, config)
}

/// The requests of one run: long enough that no sequence finishes while the window is timed.
fn requests(batch: usize) -> impl Iterator<Item = GenerateRequest> {
    let params = SamplingParams {
        max_tokens: 8000,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    (0..batch).map(move |i| GenerateRequest {
        prompt: (0..32)
            .map(|t| ((t + i) % (VOCAB - 1)) as u32 + 1)
            .collect(),
        params: params.clone(),
    })
}

/// The same step loop as the `Admission` actor's, on one thread with no messages: the planning
/// and bookkeeping alone.
fn measure_inline(batch: usize, decode_steps: usize) -> (Duration, Phases) {
    let (backend, config) = setup(batch, decode_steps, false, Duration::ZERO);
    let Parts {
        mut scheduler,
        mut pool,
        mut store,
        mut engine,
        ..
    } = actors::build(Box::new(backend), config).unwrap();
    let mut streams: Vec<_> = requests(batch)
        .map(|r| scheduler.submit(r).unwrap())
        .collect();
    let mut step = |scheduler: &mut Scheduler| {
        let now = Instant::now();
        let ops = scheduler.begin_step(now);
        let replies = ops.into_iter().map(|op| store.apply(op)).collect();
        let ops = scheduler.plan_pool(replies);
        let (replies, stats) = if ops.is_empty() {
            (Vec::new(), None)
        } else {
            let replies = ops.into_iter().map(|op| pool.apply(op)).collect();
            (replies, Some(pool.stats()))
        };
        let reply = scheduler
            .plan_engine(replies, stats, now)
            .map(|s| engine.run(s));
        scheduler.finish_step(reply, now);
    };
    // Callers read their tokens as they come, as a server's response streams do.
    let drain = |streams: &mut Vec<actors::RequestStream>| {
        for stream in streams.iter_mut() {
            while stream.try_next().is_some() {}
        }
    };
    for _ in 0..50 {
        step(&mut scheduler);
        drain(&mut streams);
    }
    let (start, first) = (Instant::now(), scheduler.stats().generated_tokens);
    let phases_before = scheduler.stats().phase_nanos;
    while scheduler.stats().generated_tokens - first < WINDOW_STEPS * batch as u64 {
        step(&mut scheduler);
        drain(&mut streams);
    }
    let decoded = (scheduler.stats().generated_tokens - first) / batch as u64;
    let elapsed = start.elapsed();
    let phases = Phases::between(phases_before, scheduler.stats().phase_nanos, decoded);
    (elapsed / decoded as u32, phases)
}

/// Processor time this thread has used.
fn thread_cpu_time() -> Duration {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `t` is a valid timespec for the call to fill.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) };
    assert_eq!(rc, 0, "clock_gettime(CLOCK_THREAD_CPUTIME_ID)");
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// Wall-clock time a decode step through the actors, the actors' thread's processor time a
/// step, and the scheduler's part of it.
async fn measure(batch: usize, decode_steps: usize, overlap: bool) -> Measured {
    let (backend, config) = setup(batch, decode_steps, overlap, engine_step_time());
    let handles = actors::start(Box::new(backend), config).unwrap();
    let mut streams = Vec::new();
    for request in requests(batch) {
        streams.push(handles.submit(request).await.unwrap());
    }
    // The HTTP server's workers deliver through an inbox a thread (`INBOX=off`: each stream
    // on its own).
    let inbox = std::env::var("INBOX").map_or(true, |i| i != "off");
    if std::env::var("READERS").is_ok_and(|r| r == "thread") {
        std::thread::spawn(move || {
            actix_rt::System::new().block_on(async move {
                if inbox {
                    actors::install_stream_inbox();
                }
                let readers: Vec<_> = streams
                    .into_iter()
                    .map(|mut s| actix_rt::spawn(async move { while s.next().await.is_some() {} }))
                    .collect();
                for reader in readers {
                    let _ = reader.await;
                }
            })
        });
    } else {
        if inbox {
            actors::install_stream_inbox();
        }
        for mut stream in streams {
            actix_rt::spawn(async move { while stream.next().await.is_some() {} });
        }
    }
    // Warm up until every sequence is decoding, then time a window of decode steps.
    let tokens_now = || async { handles.stats().await.scheduler.generated_tokens };
    let scheduler_now = || async { handles.stats().await.scheduler };
    while tokens_now().await < 50 * batch as u64 {
        actix_rt::time::sleep(Duration::from_millis(1)).await;
    }
    let (start, first) = (Instant::now(), tokens_now().await);
    let cpu_start = thread_cpu_time();
    let before = scheduler_now().await;
    let mut last = first;
    while last - first < WINDOW_STEPS * batch as u64 {
        actix_rt::time::sleep(Duration::from_millis(1)).await;
        last = tokens_now().await;
    }
    let (elapsed, cpu) = (start.elapsed(), thread_cpu_time() - cpu_start);
    let after = scheduler_now().await;
    for id in 0..batch {
        handles.cancel(actors::RequestId(id as u64));
    }
    let steps = ((last - first) / batch as u64) as u32;
    let phases = Phases::between(before.phase_nanos, after.phase_nanos, steps as u64);

    let waits = after.engine_waits - before.engine_waits;
    Measured {
        wall: elapsed / steps,
        cpu: cpu / steps,
        phases,
        engine_wait: (waits > 0).then(|| {
            Duration::from_nanos((after.engine_waited_nanos - before.engine_waited_nanos) / waits)
        }),
    }
}

/// One run through the actors, a step's share: the wall clock, the actors' thread's processor
/// time, the scheduler's phases, and the engine's wait between a step and the next one
/// planned ahead of it (`SchedulerStats::engine_waited_nanos`).
struct Measured {
    wall: Duration,
    cpu: Duration,
    phases: Phases,
    /// None where no step was planned ahead (`OVERLAP=off`).
    engine_wait: Option<Duration>,
}

/// The forward pass's time the null backend takes a step (`ENGINE_US`, µs; default 0).
fn engine_step_time() -> Duration {
    std::env::var("ENGINE_US").map_or(Duration::ZERO, |us| {
        Duration::from_micros(us.parse().expect("ENGINE_US: a number of µs"))
    })
}

/// The scheduler's time a step in each of its phases ([`Phase`]), in µs.
#[derive(Clone, Copy)]
struct Phases([f64; Phase::ALL.len()]);

impl Phases {
    fn between(before: [u64; 4], after: [u64; 4], steps: u64) -> Self {
        Phases(std::array::from_fn(|i| {
            (after[i] - before[i]) as f64 / 1e3 / steps as f64
        }))
    }

    const NONE: Phases = Phases([f64::NAN; 4]);
}

impl std::fmt::Display for Phases {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let [begin, pool, engine, finish] = self.0;
        write!(f, "{begin:.1}/{pool:.1}/{engine:.1}/{finish:.1}")
    }
}

fn main() {
    let system = actix_rt::System::new();
    println!(
        "scheduling overhead per step, {} cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    let list = |var: &str, default: &[usize]| match std::env::var(var) {
        Ok(list) => list
            .split(',')
            .map(|b| b.parse().expect("a comma-separated list of numbers"))
            .collect(),
        Err(_) => default.to_vec(),
    };
    let batches = list("BATCHES", &[1, 32, 256]);
    let decode_steps = list("DECODE_STEPS", &[1, 8]);
    let overlaps: Vec<bool> = match std::env::var("OVERLAP") {
        Ok(list) => list.split(',').map(|o| o == "on").collect(),
        Err(_) => vec![true, false],
    };
    println!(
        "{:>6} {:>12} {:>8} {:>18} {:>18} {:>24} {:>22} {:>24} {:>24} {:>20}",
        "batch",
        "decode_steps",
        "overlap",
        "µs per decode step",
        "µs per sequence",
        "actors' thread: CPU µs",
        "one thread: µs/step",
        "actors: b/p/e/f µs",
        "one thread: b/p/e/f µs",
        "engine wait µs/step"
    );
    for batch in batches {
        for &k in &decode_steps {
            // `ONLY=inline` or `ONLY=actors` runs one of the two (for a profiler).
            let only = std::env::var("ONLY").unwrap_or_default();
            let (inline, inline_phases) = match only.as_str() {
                "actors" => (f64::NAN, Phases::NONE),
                _ => {
                    let (step, phases) = measure_inline(batch, k);
                    (step.as_secs_f64() * 1e6, phases)
                }
            };
            for &overlap in &overlaps {
                let micros = |d: Duration| d.as_secs_f64() * 1e6;
                let (wall, cpu, phases, wait) = match only.as_str() {
                    "inline" => (f64::NAN, f64::NAN, Phases::NONE, f64::NAN),
                    _ => {
                        let m = system.block_on(measure(batch, k, overlap));
                        (
                            micros(m.wall),
                            micros(m.cpu),
                            m.phases,
                            m.engine_wait.map_or(f64::NAN, micros),
                        )
                    }
                };
                let overlap = if overlap { "on" } else { "off" };
                println!(
                    "{batch:>6} {k:>12} {overlap:>8} {wall:>18.1} {:>18.2} {cpu:>24.1} {inline:>22.1} {:>24} {:>24} {wait:>20.1}",
                    wall / batch as f64,
                    phases.to_string(),
                    inline_phases.to_string()
                );
            }
        }
    }
}
