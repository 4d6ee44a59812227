//! Scheduling overhead per step: the four actors driving `batch` decoding sequences over a
//! backend that does no math (a real `Backend` whose forward pass returns zero logits for a
//! 16-token vocabulary), so what is timed is the messages, the planning and the bookkeeping.
//!
//!     cargo bench -p actors --bench scheduling
//!
//! Prints, for each batch size, the mean time of one step over a few thousand steps of steady
//! decoding (every sequence running, one token each per step).

use std::time::{Duration, Instant};

use actors::{GenerateRequest, ServeConfig};
use cache::{BackingId, KvGeometry, PageCopy, Tier};
use engine::EngineError;
use engine::backend::{Backend, BackendInfo, MemoryReport, StepOutput, StepPlan};
use engine::sampling::SamplingParams;
use policy::Policies;

const VOCAB: usize = 16;
const PAGE: usize = 16;
/// Steps timed per batch size: at most 3,000 positions are added to each sequence.
const WINDOW_STEPS: u64 = 3000;

/// A backend that checks and answers the plan but computes nothing.
struct NullBackend {
    info: BackendInfo,
}

impl Backend for NullBackend {
    fn info(&self) -> &BackendInfo {
        &self.info
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput, EngineError> {
        plan.validate(&self.info)?;
        let mut output = StepOutput {
            vocab_size: VOCAB,
            logits: Vec::new(),
            row_ranges: Vec::with_capacity(plan.rows.len()),
        };
        for row in &plan.rows {
            let start = output.logits.len() / VOCAB;
            output
                .logits
                .resize((start + row.logit_rows()) * VOCAB, 0.0);
            output.row_ranges.push(start..start + row.logit_rows());
        }
        Ok(output)
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
    fn copy_backing(&mut self, _: BackingId, _: BackingId) -> Result<(), EngineError> {
        Ok(())
    }
    fn memory(&self) -> MemoryReport {
        MemoryReport::default()
    }
}

async fn measure(batch: usize) -> Duration {
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
        "[cache]\npage_tokens = {PAGE}\n[admission]\nmax_running = {batch}\nmax_queue = {batch}\nstep_token_budget = {}\n",
        batch.max(64) * 16
    );
    let config = ServeConfig {
        policies: Policies::from_toml(&toml).unwrap(),
        model_id: "null".into(),
        eos_token_ids: vec![],
        seed: 1,
    };
    let handles = actors::start(Box::new(NullBackend { info }), config).unwrap();
    // Long enough that no sequence finishes while the window is timed.
    let params = SamplingParams {
        max_tokens: 8000,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let mut streams = Vec::new();
    for i in 0..batch {
        let prompt = (0..32)
            .map(|t| ((t + i) % (VOCAB - 1)) as u32 + 1)
            .collect();
        streams.push(
            handles
                .submit(GenerateRequest {
                    prompt,
                    params: params.clone(),
                })
                .await
                .unwrap(),
        );
    }
    // Warm up until every sequence is decoding, then time a window of steps.
    let steps_now = || async { handles.stats().await.scheduler.steps };
    while steps_now().await < 50 {
        actix_rt::time::sleep(Duration::from_millis(1)).await;
    }
    let (start, first) = (Instant::now(), steps_now().await);
    let mut last = first;
    while last - first < WINDOW_STEPS {
        actix_rt::time::sleep(Duration::from_millis(1)).await;
        last = steps_now().await;
    }
    let elapsed = start.elapsed();
    drop(streams);
    elapsed / (last - first) as u32
}

fn main() {
    let system = actix_rt::System::new();
    println!(
        "scheduling overhead per step, {} cores",
        std::thread::available_parallelism().map_or(1, |n| n.get())
    );
    println!(
        "{:>6} {:>14} {:>16}",
        "batch", "µs per step", "µs per sequence"
    );
    let batches: Vec<usize> = match std::env::var("BATCHES") {
        Ok(list) => list
            .split(',')
            .map(|b| b.parse().expect("BATCHES is a comma-separated list"))
            .collect(),
        Err(_) => vec![1, 32, 256],
    };
    for batch in batches {
        let per_step = system.block_on(measure(batch));
        let micros = per_step.as_secs_f64() * 1e6;
        println!("{batch:>6} {micros:>14.1} {:>16.2}", micros / batch as f64);
    }
}
