//! `snapserve bench`: prefill and decode throughput of a backend, measured by running steps.
//!
//! Prefill: one fresh sequence of `length` random tokens in one step. Decode: `batch`
//! sequences are prefilled (untimed) to `context` tokens, then `decode_steps` steps of one
//! token per sequence are timed. Each figure is the median of `repeats` runs. Tokens are drawn
//! from a seeded generator, so two runs measure the same work.

use std::time::{Duration, Instant};

use cache::PageId;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use crate::error::{EngineError, Result};

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchSpec {
    pub prompt_lengths: Vec<usize>,
    pub decode_batches: Vec<usize>,
    pub contexts: Vec<usize>,
    pub decode_steps: usize,
    pub repeats: usize,
    /// Largest prefill step when filling decode contexts.
    pub prefill_chunk: usize,
    pub seed: u64,
}

impl BenchSpec {
    /// Positions the largest configuration needs at once (sizes the KV pool).
    pub fn tokens_needed(&self) -> usize {
        let prefill = self.prompt_lengths.iter().copied().max().unwrap_or(0);
        let decode = self.decode_batches.iter().copied().max().unwrap_or(0)
            * (self.contexts.iter().copied().max().unwrap_or(0) + self.decode_steps + 16);
        prefill.max(decode)
    }
}

/// One measured figure.
#[derive(Debug, Clone, PartialEq)]
pub enum BenchRow {
    Prefill {
        length: usize,
        tokens_per_s: f64,
        step: Duration,
    },
    Decode {
        batch: usize,
        context: usize,
        tokens_per_s: f64,
        step: Duration,
    },
}

impl std::fmt::Display for BenchRow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BenchRow::Prefill {
                length,
                tokens_per_s,
                step,
            } => {
                write!(
                    f,
                    "prefill  length {length:>6}            {tokens_per_s:>10.1} tok/s  {:>9.3} ms/step",
                    step.as_secs_f64() * 1e3
                )
            }
            BenchRow::Decode {
                batch,
                context,
                tokens_per_s,
                step,
            } => {
                write!(
                    f,
                    "decode   batch {batch:>4}  context {context:>6} {tokens_per_s:>10.1} tok/s  {:>9.3} ms/step",
                    step.as_secs_f64() * 1e3
                )
            }
        }
    }
}

/// Runs every measurement of `spec`, reporting each row as it is done.
pub fn run(
    backend: &mut dyn Backend,
    spec: &BenchSpec,
    mut on_row: impl FnMut(&BenchRow),
) -> Result<Vec<BenchRow>> {
    let mut rng = ChaCha8Rng::seed_from_u64(spec.seed);
    let mut rows = Vec::new();
    for &length in &spec.prompt_lengths {
        let step = median(
            (0..spec.repeats.max(1))
                .map(|_| prefill_once(backend, &mut rng, length))
                .collect::<Result<_>>()?,
        );
        rows.push(BenchRow::Prefill {
            length,
            tokens_per_s: length as f64 / step.as_secs_f64(),
            step,
        });
        on_row(rows.last().expect("just pushed"));
    }
    for &context in &spec.contexts {
        for &batch in &spec.decode_batches {
            let runs = (0..spec.repeats.max(1))
                .map(|_| decode_once(backend, &mut rng, spec, batch, context))
                .collect::<Result<_>>()?;
            let step = median(runs);
            rows.push(BenchRow::Decode {
                batch,
                context,
                tokens_per_s: batch as f64 / step.as_secs_f64(),
                step,
            });
            on_row(rows.last().expect("just pushed"));
        }
    }
    Ok(rows)
}

fn median(mut times: Vec<Duration>) -> Duration {
    times.sort();
    times[times.len() / 2]
}

fn random_tokens(rng: &mut ChaCha8Rng, vocab: usize, n: usize) -> Vec<u32> {
    (0..n).map(|_| rng.random_range(0..vocab as u32)).collect()
}

fn check_capacity(backend: &dyn Backend, tokens: usize) -> Result<()> {
    let info = backend.info();
    let capacity = info.num_pages * info.geometry.page_tokens;
    if tokens > capacity {
        return Err(EngineError::InvalidStep(format!(
            "the benchmark needs {tokens} KV positions; the pool holds {capacity}"
        )));
    }
    Ok(())
}

fn prefill_once(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    length: usize,
) -> Result<Duration> {
    check_capacity(backend, length)?;
    let pages = (0..backend.info().geometry.pages_for(length) as u32)
        .map(PageId)
        .collect();
    let tokens = random_tokens(rng, backend.info().vocab_size, length);
    let plan = StepPlan {
        rows: vec![RowPlan {
            tokens,
            start_pos: 0,
            pages,
            logits: LogitsWanted::Last,
        }],
    };
    let started = Instant::now();
    backend.step(&plan)?;
    Ok(started.elapsed())
}

/// Mean time of one decode step of `batch` sequences sitting at `context` positions.
fn decode_once(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    spec: &BenchSpec,
    batch: usize,
    context: usize,
) -> Result<Duration> {
    let per_seq = backend
        .info()
        .geometry
        .pages_for(context + spec.decode_steps);
    check_capacity(
        backend,
        batch * per_seq * backend.info().geometry.page_tokens,
    )?;
    let vocab = backend.info().vocab_size;
    let tables: Vec<Vec<PageId>> = (0..batch)
        .map(|s| {
            (0..per_seq)
                .map(|i| PageId((s * per_seq + i) as u32))
                .collect()
        })
        .collect();
    for pages in &tables {
        let prompt = random_tokens(rng, vocab, context);
        for (i, chunk) in prompt.chunks(spec.prefill_chunk.max(1)).enumerate() {
            let row = RowPlan {
                tokens: chunk.to_vec(),
                start_pos: i * spec.prefill_chunk.max(1),
                pages: pages.clone(),
                logits: LogitsWanted::None,
            };
            backend.step(&StepPlan { rows: vec![row] })?;
        }
    }
    let started = Instant::now();
    for step in 0..spec.decode_steps {
        let rows = tables
            .iter()
            .map(|pages| RowPlan {
                tokens: random_tokens(rng, vocab, 1),
                start_pos: context + step,
                pages: pages.clone(),
                logits: LogitsWanted::Last,
            })
            .collect();
        backend.step(&StepPlan { rows })?;
    }
    Ok(started.elapsed() / spec.decode_steps.max(1) as u32)
}
