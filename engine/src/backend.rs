//! The step interface every backend implements.
//!
//! There is no prefill phase and no decode phase: a step is a batch of rows, one per sequence,
//! each carrying the tokens to add at consecutive positions after what its pages already hold
//! (a whole prompt, a prefill chunk, or one decode token). The backend writes their K and V into
//! the pages the row's page table names and returns the logits the rows ask for. Which pages a
//! sequence owns is decided outside, by the pool; a backend only trusts the plan it is given,
//! after checking it is well-formed.
//!
//! A backend also holds the bytes of snapshots: each snapshot owns one buffer (its backing),
//! allocated on request in a tier, filled from pool pages on save and copied back into any
//! pool pages on restore. Which backings exist and what they may cost is the store's business.
//! Copies between backings (demotions) may run beside the steps: a backend reports each one
//! when it has ended ([`Backend::finished_copies`]), and until then its source stays
//! allocated and readable. Every copy that fills a backing records the sum of each block it
//! wrote, and every restore checks the blocks it reads against them
//! ([`Backend::restore_verdicts`]): bytes that went bad in any tier are refused, never served.

use std::ops::Range;

use cache::{BackingId, KvGeometry, PageClone, PageCopy, PageId, Tier};

use crate::error::{EngineError, Result};
use crate::sampling::{Sampler, SamplingParams};

/// Which logits a row wants back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum LogitsWanted {
    /// None: a prefill chunk that does not end its prompt.
    None,
    /// The logits after the row's last token: the next token's distribution.
    Last,
    /// Logits after every token of the row (parity checks, speculative verification).
    All,
}

/// One sequence's part of a step.
#[derive(Debug, Clone, PartialEq)]
pub struct RowPlan {
    /// Tokens to add, at positions `start_pos..start_pos + tokens.len()`.
    pub tokens: Vec<u32>,
    /// Positions before this are already in the sequence's pages.
    pub start_pos: usize,
    /// Page `i` holds positions `i * page_tokens..(i + 1) * page_tokens` of this sequence.
    pub pages: Vec<PageId>,
    pub logits: LogitsWanted,
}

impl RowPlan {
    pub fn end_pos(&self) -> usize {
        self.start_pos + self.tokens.len()
    }

    /// How many logit rows this row produces.
    pub fn logit_rows(&self) -> usize {
        match self.logits {
            LogitsWanted::None => 0,
            LogitsWanted::Last => 1,
            LogitsWanted::All => self.tokens.len(),
        }
    }
}

/// A batch of rows run as one forward pass.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepPlan {
    pub rows: Vec<RowPlan>,
}

impl StepPlan {
    pub fn total_tokens(&self) -> usize {
        self.rows.iter().map(|r| r.tokens.len()).sum()
    }

    /// Checks that the plan fits the backend: ids in the vocabulary, positions within the
    /// context, page tables covering every position and naming existing pages.
    pub fn validate(&self, limits: &BackendInfo) -> Result<()> {
        for (i, row) in self.rows.iter().enumerate() {
            let fail = |reason: String| Err(EngineError::InvalidStep(format!("row {i}: {reason}")));
            if row.tokens.is_empty() {
                return fail("no tokens".into());
            }
            if let Some(&bad) = row
                .tokens
                .iter()
                .find(|&&t| t as usize >= limits.vocab_size)
            {
                return fail(format!(
                    "token id {bad} is outside the vocabulary of {}",
                    limits.vocab_size
                ));
            }
            if row.end_pos() > limits.max_positions {
                return fail(format!(
                    "position {} exceeds the context of {}",
                    row.end_pos() - 1,
                    limits.max_positions
                ));
            }
            let needed = limits.geometry.pages_for(row.end_pos());
            if row.pages.len() < needed {
                return fail(format!(
                    "{} pages cover fewer than {} positions",
                    row.pages.len(),
                    row.end_pos()
                ));
            }
            let highest = highest_page(&row.pages[..needed]);
            if highest as usize >= limits.num_pages {
                return fail(format!(
                    "page {highest} does not exist (the pool has {})",
                    limits.num_pages
                ));
            }
        }
        Ok(())
    }
}

/// Picks the next token of every row whose sampler is given from a step's logits after its
/// last token (which the sampler overwrites); rows without a sampler get `None`. What
/// [`Backend::step_and_sample`] does on the host.
pub fn sample_on_host(
    output: &mut StepOutput,
    samplers: &mut [Option<&mut Sampler>],
) -> Result<Vec<Option<u32>>> {
    let vocab = output.vocab_size;
    let mut tokens = Vec::with_capacity(samplers.len());
    for (row, sampler) in samplers.iter_mut().enumerate() {
        let range = output.row_ranges[row].clone();
        tokens.push(match sampler {
            Some(sampler) if !range.is_empty() => {
                let last = (range.end - 1) * vocab;
                Some(sampler.sample(&mut output.logits[last..last + vocab]))
            }
            Some(_) => {
                return Err(EngineError::InvalidStep(format!(
                    "row {row} has a sampler but asks for no logits"
                )));
            }
            None => None,
        });
    }
    Ok(tokens)
}

/// [`Backend::step_and_verify`] with every pick made on the host, from the step's logits.
pub fn verify_on_host<B: Backend + ?Sized>(
    backend: &mut B,
    plan: &StepPlan,
    samplers: &mut [Option<&mut Sampler>],
    drafts: &[usize],
) -> Result<Vec<Vec<u32>>> {
    check_verify(plan, samplers, drafts)?;
    let mut output = backend.step(plan)?;
    let vocab = output.vocab_size;
    let mut picks = Vec::with_capacity(samplers.len());
    for (row, sampler) in samplers.iter_mut().enumerate() {
        let Some(sampler) = sampler else {
            picks.push(Vec::new());
            continue;
        };
        let range = output.row_ranges[row].clone();
        let logits = &mut output.logits[range.start * vocab..range.end * vocab];
        picks.push(verify_row(&plan.rows[row], drafts[row], |k| {
            let at = range.len() - 1 - drafts[row] + k;
            sampler.sample(&mut logits[at * vocab..(at + 1) * vocab])
        }));
    }
    Ok(picks)
}

/// One row's picks in a verification: `pick(k)` is the pick after the row's last undrafted
/// token and the first `k` drafted ones; picking stops after the first that differs from the
/// draft, or after the last.
pub fn verify_row(row: &RowPlan, drafted: usize, mut pick: impl FnMut(usize) -> u32) -> Vec<u32> {
    let draft = &row.tokens[row.tokens.len() - drafted..];
    let mut picked = Vec::with_capacity(drafted + 1);
    for k in 0..=drafted {
        let token = pick(k);
        picked.push(token);
        if draft.get(k) != Some(&token) {
            break;
        }
    }
    picked
}

/// Checks a verification step's shape ([`Backend::step_and_verify`]): one draft count and one
/// sampler slot per row; a row with a draft has a sampler, asks for every logit and holds at
/// least one token before its draft.
pub fn check_verify(
    plan: &StepPlan,
    samplers: &[Option<&mut Sampler>],
    drafts: &[usize],
) -> Result<()> {
    if samplers.len() != plan.rows.len() || drafts.len() != plan.rows.len() {
        return Err(EngineError::InvalidStep(format!(
            "{} samplers and {} draft counts for {} rows",
            samplers.len(),
            drafts.len(),
            plan.rows.len()
        )));
    }
    for (i, ((row, sampler), &draft)) in plan.rows.iter().zip(samplers).zip(drafts).enumerate() {
        let fail = |reason: &str| Err(EngineError::InvalidStep(format!("row {i}: {reason}")));
        if sampler.is_some() && row.logits == LogitsWanted::None {
            return fail("it has a sampler but asks for no logits");
        }
        if draft == 0 {
            continue;
        }
        if sampler.is_none() {
            return fail("it has a draft to verify but no sampler");
        }
        if row.logits != LogitsWanted::All {
            return fail("it has a draft to verify but does not ask for every logit");
        }
        if draft >= row.tokens.len() {
            return fail(&format!(
                "a draft of {draft} needs a token before it; the row has {}",
                row.tokens.len()
            ));
        }
    }
    Ok(())
}

/// The largest page id in a page table (compiled for wide vectors: it runs over every page of
/// every row of every step).
#[multiversion::multiversion(targets("x86_64+avx512f", "x86_64+avx2"))]
fn highest_page(pages: &[PageId]) -> u32 {
    pages.iter().fold(0, |highest, page| highest.max(page.0))
}

/// The logits a step returns, rows in plan order.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct StepOutput {
    pub vocab_size: usize,
    /// `logit_rows × vocab_size` values.
    pub logits: Vec<f32>,
    /// For each plan row, which logit rows are its.
    pub row_ranges: Vec<Range<usize>>,
}

impl StepOutput {
    /// The logits of plan row `row`, its `k`-th logit row.
    pub fn logits(&self, row: usize, k: usize) -> &[f32] {
        let index = self.row_ranges[row].start + k;
        assert!(
            index < self.row_ranges[row].end,
            "row {row} has no logit row {k}"
        );
        &self.logits[index * self.vocab_size..(index + 1) * self.vocab_size]
    }

    /// The last logit row of plan row `row`.
    pub fn last_logits(&self, row: usize) -> &[f32] {
        let range = &self.row_ranges[row];
        assert!(!range.is_empty(), "row {row} asked for no logits");
        self.logits(row, range.len() - 1)
    }
}

/// What a backend is and what it can hold.
#[derive(Debug, Clone, PartialEq)]
pub struct BackendInfo {
    pub name: &'static str,
    pub geometry: KvGeometry,
    pub num_pages: usize,
    pub vocab_size: usize,
    /// The most positions one sequence may reach (the model's context).
    pub max_positions: usize,
}

/// Bytes a backend holds, by purpose.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemoryReport {
    pub weights_bytes: u64,
    pub pool_bytes: u64,
    pub device_snapshot_bytes: u64,
    pub host_snapshot_bytes: u64,
    pub backings: usize,
}

/// A device that runs steps of one model over its own KV pages and holds snapshot buffers.
pub trait Backend: Send {
    fn info(&self) -> &BackendInfo;

    /// Runs one step. A plan that fails [`StepPlan::validate`] is refused before anything is
    /// written.
    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput>;

    /// Runs one step and picks the next token of every row whose sampler is given, from the
    /// logits after its last token; rows without a sampler get `None`. Backends that can sample
    /// on the device override this; the default samples on the host.
    fn step_and_sample(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
    ) -> Result<Vec<Option<u32>>> {
        assert_eq!(plan.rows.len(), samplers.len(), "one sampler slot per row");
        let mut output = self.step(plan)?;
        sample_on_host(&mut output, samplers)
    }

    /// Runs one step in which rows may verify drafted tokens: the last `drafts[i]` tokens of
    /// row `i` were proposed (by a [`crate::speculative::DraftSource`]), not sampled, and such
    /// a row asks for the logits after every token. Its sampler picks at each drafted position
    /// in turn, exactly as it would one step at a time (grammar, seeded draws and logprobs
    /// included), for as long as its pick equals the next drafted token: the picks returned
    /// are the kept draft and the token after it. Rows without a draft pick once, from their
    /// last logits; rows without a sampler get nothing. Backends that can pick on the device
    /// override this; the default picks on the host.
    fn step_and_verify(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        drafts: &[usize],
    ) -> Result<Vec<Vec<u32>>> {
        verify_on_host(self, plan, samplers, drafts)
    }

    /// What the backend found while starting that a benchmark should show beside its figures
    /// (on CUDA: what GEMM tuning kept), a line each.
    fn start_up_notes(&self) -> Vec<String> {
        Vec::new()
    }

    /// Kernels the last [`Backend::step_and_sample`] launched, where the backend counted every
    /// one (on CUDA: a decode step replayed from a graph, whose nodes include cuBLAS's).
    fn last_step_kernels(&self) -> Option<usize> {
        None
    }

    /// Decode steps this backend launched before they were asked for, so far: those that were
    /// the step asked for next, and those left unread (see `CudaOptions::run_ahead`).
    fn steps_run_ahead(&self) -> (u64, u64) {
        (0, 0)
    }

    /// Whether the last step paid a one-time cost that the same step will not pay again (on
    /// CUDA: it captured the graph it then replayed), so its time says little of what such a
    /// step costs.
    fn last_step_captured(&self) -> bool {
        false
    }

    /// Allocates the buffer of a snapshot of `bytes` in `tier`. Fails, holding nothing, when
    /// the memory is not there.
    fn alloc_backing(&mut self, backing: BackingId, tier: Tier, bytes: u64) -> Result<()>;

    /// Releases a snapshot's buffer.
    fn free_backing(&mut self, backing: BackingId) -> Result<()>;

    /// Copies pool page `pool_page` into page `snapshot_page` of the backing, for each copy.
    fn save_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()>;

    /// Copies page `snapshot_page` of the backing into pool page `pool_page`, for each copy.
    fn restore_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()>;

    /// Copies working-pool page `from` into page `to`, every layer's K and V, for each clone,
    /// in order and before the next step's forward pass. No page is both a source and a target.
    fn clone_pages(&mut self, clones: &[PageClone]) -> Result<()>;

    /// Starts copying one backing into another of the same size (a demotion to the host
    /// tier). The copy may still run when this returns, beside later steps: `from` must stay
    /// allocated, and `to` unread, until [`Backend::finished_copies`] reports it. An error
    /// means the copy did not start.
    fn copy_backing(&mut self, from: BackingId, to: BackingId) -> Result<()>;

    /// The copies [`Backend::copy_backing`] started that have ended since the last call, by
    /// their target, each with its outcome. With `wait`, first waits for every started copy to
    /// end (copies only: never for the steps). Each copy is reported exactly once.
    fn finished_copies(&mut self, wait: bool) -> Vec<(BackingId, Result<()>)>;

    /// The backings allocated now, in no particular order.
    fn backing_ids(&self) -> Vec<BackingId>;

    /// For each [`Backend::restore_pages`] since the last call, in order, whether every block
    /// it read had the sum its snapshot was filled with ([`cache::checksum`]): a `false`
    /// restore wrote bytes that must not be used. Answers once the restores have run (on a
    /// device, after the step that followed them).
    fn restore_verdicts(&mut self) -> Result<Vec<bool>>;

    /// The block sums a backing was filled with, one per block in snapshot order.
    fn backing_sums(&mut self, backing: BackingId) -> Result<Vec<u64>>;

    /// Sets the block sums of a backing filled outside the backend (read from a file).
    fn set_backing_sums(&mut self, backing: BackingId, sums: &[u64]) -> Result<()>;

    /// Where a host-tier backing's bytes are, in snapshot order. The memory stays valid, and
    /// is written by nothing else, until the backing is freed; the caller keeps it alive
    /// while another thread reads or writes through these runs.
    fn host_runs(&mut self, backing: BackingId) -> Result<Vec<HostRun>>;

    /// A copy of a backing's bytes (any tier), once everything queued before has run.
    fn read_backing(&mut self, backing: BackingId) -> Result<Vec<u8>>;

    /// Fault injection for drills and tests: XORs byte `offset` of a backing with `mask`, as a
    /// bad memory cell would.
    fn flip_byte(&mut self, backing: BackingId, offset: u64, mask: u8) -> Result<()>;

    fn memory(&self) -> MemoryReport;

    /// For a model split over several GPUs: how many all-reduces one step of `tokens` tokens
    /// runs, the bytes of each, and the seconds each takes inside a CUDA graph, timed alone.
    /// None for one device.
    fn time_all_reduces(&mut self, _tokens: usize) -> Result<Option<(usize, usize, f64)>> {
        Ok(None)
    }

    /// What the backend planned to hold on its devices at start-up, one line block per device
    /// (a rank each where the model is split); none on the CPU.
    fn memory_plans(&self) -> Vec<String> {
        Vec::new()
    }
}

/// A contiguous range of host memory holding part of a backing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRun {
    pub ptr: *mut u8,
    pub len: usize,
}

// SAFETY: a plain address; whoever dereferences it answers for the memory (see `host_runs`).
unsafe impl Send for HostRun {}

/// What a warm-up measured.
#[derive(Debug, Clone, PartialEq)]
pub struct WarmUp {
    /// The whole warm-up, first-use setup included.
    pub took: std::time::Duration,
    /// One batch-1 decode step once warm; `None` when the pool was too small to run one.
    pub decode_step: Option<std::time::Duration>,
    /// One verification of each width asked for (its tokens, the drafted ones included), once
    /// warm.
    pub verify_steps: Vec<(usize, std::time::Duration)>,
}

/// Runs one prefill of `prompt_tokens` tokens and two decode steps, sampled greedily, through
/// the first pages of the pool, then one verification of each width in `verify_widths` (a
/// token and its draft: speculative decoding's steps), so that what a backend sets up on first
/// use (kernels loaded, GEMM plans chosen, the batch-1 decode graph and the verification
/// graphs captured) is paid before the first request rather than by it; the second decode step
/// is timed. The pages written hold nothing anyone reads: a page's bytes are only trusted once
/// a sequence has written them.
pub fn warm_up(
    backend: &mut dyn Backend,
    prompt_tokens: usize,
    verify_widths: &[usize],
) -> Result<WarmUp> {
    let started = std::time::Instant::now();
    let info = backend.info().clone();
    let widest = verify_widths.iter().copied().max().unwrap_or(0);
    let tokens = prompt_tokens.clamp(1, info.max_positions.saturating_sub(2 + widest).max(1));
    let pages = info.geometry.pages_for(tokens + 2 + widest);
    if pages > info.num_pages || tokens + 2 + widest > info.max_positions {
        return Ok(WarmUp {
            took: started.elapsed(),
            decode_step: None,
            verify_steps: Vec::new(),
        });
    }
    let table: Vec<PageId> = (0..pages as u32).map(PageId).collect();
    let mut sampler = Sampler::new(&SamplingParams::default(), &[]);
    let prefill = StepPlan {
        rows: vec![RowPlan {
            tokens: (0..tokens as u32)
                .map(|t| t % info.vocab_size as u32)
                .collect(),
            start_pos: 0,
            pages: table.clone(),
            logits: LogitsWanted::Last,
        }],
    };
    let mut token = backend.step_and_sample(&prefill, &mut [Some(&mut sampler)])?[0];
    let mut decode_step = None;
    for position in [tokens, tokens + 1] {
        let decode = StepPlan {
            rows: vec![RowPlan {
                tokens: vec![token.unwrap_or(0)],
                start_pos: position,
                pages: table.clone(),
                logits: LogitsWanted::Last,
            }],
        };
        let step_started = std::time::Instant::now();
        token = backend.step_and_sample(&decode, &mut [Some(&mut sampler)])?[0];
        decode_step = Some(step_started.elapsed());
    }
    let mut verify_steps = Vec::new();
    for &width in verify_widths.iter().filter(|&&w| w > 1) {
        let verify = StepPlan {
            rows: vec![RowPlan {
                tokens: (0..width as u32)
                    .map(|t| t % info.vocab_size as u32)
                    .collect(),
                start_pos: tokens + 2,
                pages: table.clone(),
                logits: LogitsWanted::All,
            }],
        };
        // The first sets up (a graph captured), the second is timed.
        backend.step_and_verify(&verify, &mut [Some(&mut sampler)], &[width - 1])?;
        let step_started = std::time::Instant::now();
        backend.step_and_verify(&verify, &mut [Some(&mut sampler)], &[width - 1])?;
        verify_steps.push((width, step_started.elapsed()));
    }
    Ok(WarmUp {
        took: started.elapsed(),
        decode_step,
        verify_steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::{CpuBackend, CpuOptions};
    use crate::model::ModelFiles;
    use crate::model::synthetic::{self, SyntheticSpec};

    /// A row of the token 0 and the draft `draft`, for [`verify_row`].
    fn verify_plan_row(draft: &[u32]) -> RowPlan {
        RowPlan {
            tokens: [&[0u32][..], draft].concat(),
            start_pos: 0,
            pages: Vec::new(),
            logits: LogitsWanted::All,
        }
    }

    #[test]
    fn greedy_verification_keeps_the_agreeing_prefix_then_the_target_s_token() {
        // One-hot logits whose argmax after the token and `k` drafted ones is `argmax[k]`.
        let verify = |draft: &[u32], argmax: &[u32]| {
            let mut sampler = Sampler::new(&SamplingParams::default(), &[]);
            verify_row(&verify_plan_row(draft), draft.len(), |k| {
                let mut logits = vec![0.0f32; 10];
                logits[argmax[k] as usize] = 1.0;
                sampler.sample(&mut logits)
            })
        };
        assert_eq!(verify(&[5, 6, 7], &[5, 6, 9, 1]), vec![5, 6, 9]);
        assert_eq!(verify(&[5, 6, 7], &[5, 6, 7, 8]), vec![5, 6, 7, 8]);
        assert_eq!(verify(&[5, 6, 7], &[1, 6, 7, 8]), vec![1]);
        assert_eq!(verify(&[], &[4]), vec![4]);
    }

    /// Verification with a seeded sampler emits the target's distribution: the first token,
    /// and the second when the first was a kept draft token, checked over 200,000 trials
    /// against the exact probabilities, within 4.5 standard errors.
    #[test]
    fn sampled_verification_emits_the_target_s_distribution() {
        let probs = [
            [0.1f32, 0.5, 0.3, 0.1],
            [0.25, 0.25, 0.4, 0.1],
            [0.7, 0.1, 0.1, 0.1],
        ];
        let draft = [1u32, 2];
        let row = verify_plan_row(&draft);
        let params = SamplingParams {
            temperature: 1.0,
            seed: Some(3),
            ..SamplingParams::default()
        };
        let mut sampler = Sampler::new(&params, &[]);
        let trials = 200_000;
        let (mut first, mut second_after_1, mut after_1) = ([0usize; 4], [0usize; 4], 0);
        let mut kept = [0usize; 3];
        for _ in 0..trials {
            let tokens = verify_row(&row, draft.len(), |k| {
                let mut logits: Vec<f32> = probs[k].iter().map(|p| p.ln()).collect();
                sampler.sample(&mut logits)
            });
            let agreed = tokens
                .iter()
                .zip(&draft)
                .take_while(|(t, d)| t == d)
                .count();
            kept[agreed] += 1;
            first[tokens[0] as usize] += 1;
            if tokens[0] == 1 {
                after_1 += 1;
                second_after_1[tokens[1] as usize] += 1;
            }
        }
        let check = |counts: &[usize; 4], n: usize, p: &[f32; 4]| {
            for (i, (&c, &pi)) in counts.iter().zip(p).enumerate() {
                let pi = pi as f64;
                let se = (pi * (1.0 - pi) / n as f64).sqrt();
                let got = c as f64 / n as f64;
                assert!(
                    (got - pi).abs() < 4.5 * se,
                    "token {i}: {got:.4} against {pi:.4} (se {se:.5})"
                );
            }
        };
        check(&first, trials, &probs[0]);
        check(&second_after_1, after_1, &probs[1]);
        // Draft token 1 is kept with p0(1) = 0.5, then token 2 with p1(2) = 0.4.
        let kept_both = kept[2] as f64 / trials as f64;
        assert!((kept_both - 0.2).abs() < 0.01, "{kept_both}");
    }

    #[test]
    fn a_warmed_up_backend_computes_what_a_fresh_one_does() {
        let dir = tempfile::tempdir().unwrap();
        synthetic::write(dir.path(), &SyntheticSpec::tiny(9)).unwrap();
        let files = ModelFiles::open(dir.path()).unwrap();
        let options = CpuOptions {
            threads: 1,
            page_tokens: 16,
            num_pages: 8,
            int8_inputs: false,
        };
        let plan = StepPlan {
            rows: vec![RowPlan {
                tokens: (3..40).collect(),
                start_pos: 0,
                pages: (0..3).map(PageId).collect(),
                logits: LogitsWanted::All,
            }],
        };
        let mut fresh = CpuBackend::load(&files, &options).unwrap();
        let expected = fresh.step(&plan).unwrap();
        let mut warmed = CpuBackend::load(&files, &options).unwrap();
        let warm = warm_up(&mut warmed, 64, &[2, 8]).unwrap();
        assert!(warm.decode_step.is_some_and(|step| step <= warm.took));
        assert_eq!(
            warm.verify_steps.iter().map(|s| s.0).collect::<Vec<_>>(),
            [2, 8]
        );
        assert_eq!(warmed.step(&plan).unwrap(), expected);
        // A pool too small for the warm-up is left alone.
        let mut small = CpuBackend::load(
            &files,
            &CpuOptions {
                num_pages: 2,
                ..options
            },
        )
        .unwrap();
        assert_eq!(warm_up(&mut small, 64, &[]).unwrap().decode_step, None);
    }
}
