//! `snapserve bench`: prefill and decode throughput of a backend, measured by running steps.
//!
//! Prefill: one fresh sequence of `length` random tokens in one step, its next token picked
//! greedily. Decode: one sequence is prefilled (untimed) to `context` tokens and its pages
//! copied, through a snapshot buffer, to `batch - 1` more sequences; then `decode_steps` steps
//! of one greedy token per sequence are timed, after one untimed step (which captures a CUDA
//! graph where the backend uses them). Tokens come back through `step_and_sample`, as a server
//! takes them: no logits leave the device. Each figure is the median of `repeats` runs; the
//! decode runs continue the same sequences, each step's tokens the picks of the one before, as
//! a server's are (so a backend that launches the next step ahead of the picks' reading, as
//! the CUDA one does, keeps it). Prompts are drawn from a seeded generator, so two runs
//! measure the same work. A configuration the KV pool cannot hold is reported as skipped.

use std::time::{Duration, Instant};

use cache::{BackingId, PageCopy, PageId, Tier};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

use crate::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use crate::error::Result;
use crate::sampling::{Sampler, SamplingParams};

/// What to measure.
#[derive(Debug, Clone, PartialEq)]
pub struct BenchSpec {
    pub prompt_lengths: Vec<usize>,
    pub decode_batches: Vec<usize>,
    pub contexts: Vec<usize>,
    pub decode_steps: usize,
    /// When above 1: after each decode figure, steps whose rows each verify a draft of
    /// `verify_width - 1` tokens after their last one, timed the same way.
    pub verify_width: usize,
    /// Contexts whose restore from a device snapshot is timed: the copy back into the pool
    /// alone, and with the one-token step that gives a fully restored prompt its first token.
    pub restore_contexts: Vec<usize>,
    pub repeats: usize,
    /// Largest prefill step when filling decode contexts.
    pub prefill_chunk: usize,
    pub seed: u64,
}

impl BenchSpec {
    /// Positions one decode sequence reaches at `context`.
    fn positions_per_sequence(&self, context: usize) -> usize {
        context + (self.repeats.max(1) * self.decode_steps) + 1 + self.verify_width
    }

    /// Positions the largest configuration needs at once (sizes a KV pool).
    pub fn tokens_needed(&self, page_tokens: usize) -> usize {
        let prefill = self.prompt_lengths.iter().copied().max().unwrap_or(0);
        let longest = self.contexts.iter().copied().max().unwrap_or(0);
        let per_sequence = self
            .positions_per_sequence(longest)
            .next_multiple_of(page_tokens);
        let decode = self.decode_batches.iter().copied().max().unwrap_or(0) * per_sequence;
        let restore = self
            .restore_contexts
            .iter()
            .map(|&c| 2 * c.next_multiple_of(page_tokens))
            .max()
            .unwrap_or(0);
        prefill.max(decode).max(restore)
    }

    /// The most rows one step holds: a verify step runs each row's positions as rows of their
    /// own (on CUDA), so a backend sized for fewer would run it without its graphs.
    pub fn max_rows(&self) -> usize {
        let batch = self.decode_batches.iter().copied().max().unwrap_or(1);
        batch.max(1) * self.verify_width.max(1)
    }

    /// The most tokens one step holds.
    pub fn max_step_tokens(&self) -> usize {
        let prefill = self.prompt_lengths.iter().copied().max().unwrap_or(0);
        let batch = self.decode_batches.iter().copied().max().unwrap_or(0);
        prefill
            .max(self.prefill_chunk)
            .max(batch * self.verify_width.max(1))
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
        /// Kernels one step launched, where the backend counts them.
        kernels: Option<usize>,
        /// Timed steps the backend had launched before they were asked for, of all timed.
        ahead: (u64, u64),
    },
    /// Steps verifying a draft per row (speculative decoding), next to the decode step of the
    /// same batch and context.
    Verify {
        batch: usize,
        context: usize,
        width: usize,
        step: Duration,
        decode_step: Duration,
    },
    /// A sequence's pages scattered back from a device snapshot of `context` tokens.
    Restore {
        context: usize,
        bytes: u64,
        copy: Duration,
        /// The copy and then the step that computes the prompt's last token again and picks
        /// the next: the engine's part of a fully restored prompt's first token.
        first_token: Duration,
    },
    /// A split model's all-reduces of one decode step of `batch` rows, timed alone inside a
    /// graph, against that step.
    AllReduce {
        batch: usize,
        count: usize,
        bytes: usize,
        each: Duration,
        step: Duration,
    },
    /// A configuration the backend cannot hold.
    Skipped { what: String, reason: String },
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
                kernels,
                ahead: (kept, timed),
            } => {
                write!(
                    f,
                    "decode   batch {batch:>4}  context {context:>6} {tokens_per_s:>10.1} tok/s  {:>9.3} ms/step",
                    step.as_secs_f64() * 1e3
                )?;
                if let Some(kernels) = kernels {
                    write!(f, "  {kernels:>5} kernels/step")?;
                }
                if *kept > 0 {
                    write!(f, "  {kept}/{timed} launched ahead")?;
                }
                Ok(())
            }
            BenchRow::Verify {
                batch,
                context,
                width,
                step,
                decode_step,
            } => write!(
                f,
                "verify   batch {batch:>4}  context {context:>6}  width {width}  {:>9.3} ms/step  \
                 {:.2}x a decode step",
                step.as_secs_f64() * 1e3,
                step.as_secs_f64() / decode_step.as_secs_f64()
            ),
            BenchRow::Restore {
                context,
                bytes,
                copy,
                first_token,
            } => write!(
                f,
                "restore  context {context:>6}  {:>8.1} MB  {:>9.3} ms copy ({:.0} GB/s)  \
                 {:>9.3} ms with the first token",
                *bytes as f64 / 1e6,
                copy.as_secs_f64() * 1e3,
                *bytes as f64 / copy.as_secs_f64() / 1e9,
                first_token.as_secs_f64() * 1e3
            ),
            BenchRow::AllReduce {
                batch,
                count,
                bytes,
                each,
                step,
            } => {
                let all = each.as_secs_f64() * *count as f64;
                write!(
                    f,
                    "allreduce batch {batch:>4}  {count} of {} KiB a step, {:.2} µs each in a \
                     graph: {:.3} ms, {:.1}% of the step",
                    bytes / 1024,
                    each.as_secs_f64() * 1e6,
                    all * 1e3,
                    100.0 * all / step.as_secs_f64()
                )
            }
            BenchRow::Skipped { what, reason } => write!(f, "{what}: skipped ({reason})"),
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
    let mut report = |row: BenchRow| {
        on_row(&row);
        rows.push(row);
    };
    for &length in &spec.prompt_lengths {
        let what = format!("prefill length {length}");
        if let Err(reason) = check_capacity(backend, 1, length) {
            report(BenchRow::Skipped { what, reason });
            continue;
        }
        prefill_once(backend, &mut rng, length)?; // warm-up
        let runs = (0..spec.repeats.max(1))
            .map(|_| prefill_once(backend, &mut rng, length))
            .collect::<Result<_>>()?;
        let step = median(runs);
        report(BenchRow::Prefill {
            length,
            tokens_per_s: length as f64 / step.as_secs_f64(),
            step,
        });
    }
    for &context in &spec.contexts {
        for &batch in &spec.decode_batches {
            let row = decode(backend, &mut rng, spec, batch, context)?;
            let decode_step = match row {
                BenchRow::Decode { step, .. } => Some(step),
                _ => None,
            };
            report(row);
            if let Some(step) = decode_step
                && let Some((count, bytes, each)) = backend.time_all_reduces(batch)?
            {
                report(BenchRow::AllReduce {
                    batch,
                    count,
                    bytes,
                    each: Duration::from_secs_f64(each),
                    step,
                });
            }
            if let Some(decode_step) = decode_step
                && spec.verify_width > 1
            {
                report(verify(
                    backend,
                    &mut rng,
                    spec,
                    batch,
                    context,
                    decode_step,
                )?);
            }
        }
    }
    for &context in &spec.restore_contexts {
        report(restore(backend, &mut rng, spec, context)?);
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

/// Whether the pool holds `sequences` sequences of `positions` positions each, and the model
/// reaches that far; the reason when not.
fn check_capacity(
    backend: &dyn Backend,
    sequences: usize,
    positions: usize,
) -> std::result::Result<(), String> {
    let info = backend.info();
    let capacity = info.num_pages * info.geometry.page_tokens;
    let needed = sequences * info.geometry.pages_for(positions) * info.geometry.page_tokens;
    if needed > capacity {
        return Err(format!(
            "needs {needed} KV positions; the pool holds {capacity}"
        ));
    }
    if positions > info.max_positions {
        return Err(format!(
            "needs {positions} positions; the model's context is {}",
            info.max_positions
        ));
    }
    Ok(())
}

/// Computes `context` random tokens into the pages of `table`, in chunks of
/// `spec.prefill_chunk`; returns the tokens.
fn prefill_context(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    spec: &BenchSpec,
    table: &[PageId],
    context: usize,
) -> Result<Vec<u32>> {
    let vocab = backend.info().vocab_size;
    let chunk = spec.prefill_chunk.max(1);
    let prompt = random_tokens(rng, vocab, context);
    for (i, part) in prompt.chunks(chunk).enumerate() {
        let row = RowPlan {
            tokens: part.to_vec(),
            start_pos: i * chunk,
            pages: table.to_vec(),
            logits: LogitsWanted::None,
        };
        backend.step(&StepPlan { rows: vec![row] })?;
    }
    Ok(prompt)
}

/// Times restoring a `context`-token snapshot into a second sequence's pages, as a server
/// does when a prompt repeats: the copy with its checksum verdict, and the copy followed by
/// the step that computes the last prompt token again and picks the first new one.
fn restore(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    spec: &BenchSpec,
    context: usize,
) -> Result<BenchRow> {
    let what = format!("restore context {context}");
    if let Err(reason) = check_capacity(backend, 2, context) {
        return Ok(BenchRow::Skipped { what, reason });
    }
    let geometry = backend.info().geometry;
    let pages = geometry.pages_for(context);
    let table =
        |s: usize| -> Vec<PageId> { (0..pages).map(|i| PageId((s * pages + i) as u32)).collect() };
    let (source, target) = (table(0), table(1));
    let prompt = prefill_context(backend, rng, spec, &source, context)?;
    let bytes = (pages * geometry.page_bytes()) as u64;
    let backing = BackingId(u64::MAX - 1);
    backend.alloc_backing(backing, Tier::Device, bytes)?;
    let copies = page_copies(&target);
    backend.save_pages(backing, &page_copies(&source))?;
    let copy_back = |backend: &mut dyn Backend| -> Result<()> {
        backend.restore_pages(backing, &copies)?;
        let verdicts = backend.restore_verdicts()?;
        if verdicts.iter().all(|&intact| intact) {
            Ok(())
        } else {
            Err(crate::error::EngineError::InvalidStep(
                "bench: a restore read corrupt blocks".into(),
            ))
        }
    };
    copy_back(backend)?; // warm-up
    let last = RowPlan {
        tokens: vec![prompt[context - 1]],
        start_pos: context - 1,
        pages: target.clone(),
        logits: LogitsWanted::Last,
    };
    sample_step(backend, vec![last.clone()])?; // warm-up
    let (mut copy_runs, mut token_runs) = (Vec::new(), Vec::new());
    for _ in 0..spec.repeats.max(1) {
        let started = Instant::now();
        copy_back(backend)?;
        copy_runs.push(started.elapsed());
        let started = Instant::now();
        backend.restore_pages(backing, &copies)?;
        sample_step(backend, vec![last.clone()])?;
        backend.restore_verdicts()?;
        token_runs.push(started.elapsed());
    }
    backend.free_backing(backing)?;
    Ok(BenchRow::Restore {
        context,
        bytes,
        copy: median(copy_runs),
        first_token: median(token_runs),
    })
}

fn greedy() -> Sampler {
    Sampler::new(&SamplingParams::default(), &[])
}

/// One step picking every row's next token greedily.
fn sample_step(backend: &mut dyn Backend, rows: Vec<RowPlan>) -> Result<Vec<Option<u32>>> {
    let mut samplers: Vec<Sampler> = rows.iter().map(|_| greedy()).collect();
    let mut slots: Vec<Option<&mut Sampler>> = samplers.iter_mut().map(Some).collect();
    backend.step_and_sample(&StepPlan { rows }, &mut slots)
}

fn prefill_once(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    length: usize,
) -> Result<Duration> {
    let pages = (0..backend.info().geometry.pages_for(length) as u32)
        .map(PageId)
        .collect();
    let row = RowPlan {
        tokens: random_tokens(rng, backend.info().vocab_size, length),
        start_pos: 0,
        pages,
        logits: LogitsWanted::Last,
    };
    let started = Instant::now();
    sample_step(backend, vec![row])?;
    Ok(started.elapsed())
}

/// Measures decode of `batch` sequences holding `context` tokens, or says why it cannot.
fn decode(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    spec: &BenchSpec,
    batch: usize,
    context: usize,
) -> Result<BenchRow> {
    let geometry = backend.info().geometry;
    let per_seq = geometry.pages_for(spec.positions_per_sequence(context));
    let what = format!("decode batch {batch} context {context}");
    if let Err(reason) = check_capacity(backend, batch, spec.positions_per_sequence(context)) {
        return Ok(BenchRow::Skipped { what, reason });
    }
    let tables: Vec<Vec<PageId>> = (0..batch)
        .map(|s| {
            (0..per_seq)
                .map(|i| PageId((s * per_seq + i) as u32))
                .collect()
        })
        .collect();
    fill_contexts(backend, rng, spec, &tables, context)?;
    let vocab = backend.info().vocab_size;
    let mut pos = context;
    // Each sequence's last pick, its next token.
    let mut picks: Vec<u32> = Vec::new();
    let mut step = |backend: &mut dyn Backend, rng: &mut ChaCha8Rng| -> Result<()> {
        let rows = tables
            .iter()
            .enumerate()
            .map(|(s, pages)| RowPlan {
                tokens: match picks.get(s) {
                    Some(&token) => vec![token],
                    None => random_tokens(rng, vocab, 1),
                },
                start_pos: pos,
                pages: pages.clone(),
                logits: LogitsWanted::Last,
            })
            .collect();
        picks = sample_step(backend, rows)?
            .into_iter()
            .map(|token| token.expect("every row samples"))
            .collect();
        pos += 1;
        Ok(())
    };
    step(backend, rng)?; // warm-up, and graph capture
    let before = backend.steps_run_ahead().0;
    let step = time_steps(backend, rng, spec, step)?;
    let timed = (spec.repeats.max(1) * spec.decode_steps) as u64;
    Ok(BenchRow::Decode {
        batch,
        context,
        tokens_per_s: batch as f64 / step.as_secs_f64(),
        step,
        kernels: backend.last_step_kernels(),
        ahead: (backend.steps_run_ahead().0 - before, timed),
    })
}

/// Measures steps of `batch` rows that each verify a draft of `verify_width - 1` random tokens
/// at `context` (the sequences [`decode`] left; every step rewrites the same positions), picked
/// greedily as the server's verification does.
fn verify(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    spec: &BenchSpec,
    batch: usize,
    context: usize,
    decode_step: Duration,
) -> Result<BenchRow> {
    let geometry = backend.info().geometry;
    let per_seq = geometry.pages_for(spec.positions_per_sequence(context));
    let vocab = backend.info().vocab_size;
    let width = spec.verify_width;
    let start_pos = context + spec.repeats.max(1) * spec.decode_steps + 1;
    let step = |backend: &mut dyn Backend, rng: &mut ChaCha8Rng| -> Result<()> {
        let rows = (0..batch)
            .map(|s| RowPlan {
                tokens: random_tokens(rng, vocab, width),
                start_pos,
                pages: (0..per_seq)
                    .map(|i| PageId((s * per_seq + i) as u32))
                    .collect(),
                logits: LogitsWanted::All,
            })
            .collect();
        let mut samplers: Vec<Sampler> = (0..batch).map(|_| greedy()).collect();
        let mut slots: Vec<Option<&mut Sampler>> = samplers.iter_mut().map(Some).collect();
        backend.step_and_verify(&StepPlan { rows }, &mut slots, &vec![width - 1; batch])?;
        Ok(())
    };
    step(backend, rng)?; // warm-up, and graph capture
    Ok(BenchRow::Verify {
        batch,
        context,
        width,
        step: time_steps(backend, rng, spec, step)?,
        decode_step,
    })
}

/// The median over `spec.repeats` runs of the time of one of `spec.decode_steps` steps.
fn time_steps(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    spec: &BenchSpec,
    mut step: impl FnMut(&mut dyn Backend, &mut ChaCha8Rng) -> Result<()>,
) -> Result<Duration> {
    let mut runs = Vec::new();
    for _ in 0..spec.repeats.max(1) {
        let started = Instant::now();
        for _ in 0..spec.decode_steps {
            step(backend, rng)?;
        }
        runs.push(started.elapsed() / spec.decode_steps.max(1) as u32);
    }
    Ok(median(runs))
}

/// Prefills the first sequence to `context` tokens and copies its pages to the others through
/// a snapshot buffer (decode speed does not depend on what the KV holds).
fn fill_contexts(
    backend: &mut dyn Backend,
    rng: &mut ChaCha8Rng,
    spec: &BenchSpec,
    tables: &[Vec<PageId>],
    context: usize,
) -> Result<()> {
    prefill_context(backend, rng, spec, &tables[0], context)?;
    let geometry = backend.info().geometry;
    let pages = geometry.pages_for(context);
    let backing = BackingId(u64::MAX - context as u64);
    backend.alloc_backing(
        backing,
        Tier::Device,
        (pages * geometry.page_bytes()) as u64,
    )?;
    backend.save_pages(backing, &page_copies(&tables[0][..pages]))?;
    for table in &tables[1..] {
        backend.restore_pages(backing, &page_copies(&table[..pages]))?;
    }
    backend.free_backing(backing)
}

/// Snapshot page `i` to or from pool page `table[i]`, for every page of `table`.
fn page_copies(table: &[PageId]) -> Vec<PageCopy> {
    table
        .iter()
        .enumerate()
        .map(|(i, &pool_page)| PageCopy {
            snapshot_page: i as u32,
            pool_page,
        })
        .collect()
}
