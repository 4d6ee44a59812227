//! One sequence generated start to finish on a backend: the `generate` command's loop, and
//! what a request produces when it runs alone (the oracle for batched runs in tests).
//!
//! The sequence owns pages `0..n` of the backend; nothing else may run on the backend meanwhile.

use std::time::{Duration, Instant};

use cache::PageId;

use crate::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use crate::error::{EngineError, Result};
use crate::sampling::{Sampler, SamplingParams};
use crate::speculative::DraftSource;
pub use crate::stop::FinishReason;
use crate::stop::{StopMatcher, finish_after};
use crate::tokenizer::{TextStream, Tokenizer};

/// The result of [`generate`].
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_tokens: usize,
    /// Every sampled id, the one that stopped generation included.
    pub tokens: Vec<u32>,
    /// The generated text, stop strings and special tokens excluded.
    pub text: String,
    pub finish_reason: FinishReason,
    pub prefill_time: Duration,
    pub decode_time: Duration,
    /// Draft tokens proposed and kept, when speculating.
    pub drafted: usize,
    pub accepted: usize,
}

/// Speculative decoding for [`generate_speculative`]: where drafts come from and how many to
/// verify per step.
pub struct Speculation<'a> {
    pub source: &'a mut dyn DraftSource,
    pub draft_tokens: usize,
}

/// The model side of a generation: tokenizer and end-of-sequence ids.
pub struct Vocabulary<'a> {
    pub tokenizer: &'a Tokenizer,
    pub eos_token_ids: &'a [u32],
}

/// Generates from `prompt` on pages `0..` of `backend`, prefilling `prefill_chunk` tokens per
/// step and calling `on_text` with each piece of final text as it is produced.
pub fn generate(
    backend: &mut dyn Backend,
    vocab: &Vocabulary,
    prompt: &[u32],
    params: &SamplingParams,
    prefill_chunk: usize,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    let sampler = Sampler::new(params, prompt);
    generate_with(backend, vocab, prompt, sampler, prefill_chunk, on_text)
}

/// [`generate`] with a sampler of the caller's (one held to a grammar, say).
pub fn generate_with(
    backend: &mut dyn Backend,
    vocab: &Vocabulary,
    prompt: &[u32],
    sampler: Sampler,
    prefill_chunk: usize,
    on_text: impl FnMut(&str),
) -> Result<Generation> {
    generate_speculative(
        backend,
        vocab,
        prompt,
        sampler,
        prefill_chunk,
        None,
        on_text,
    )
}

/// [`generate_with`], verifying drafted tokens when `speculation` is given: each step runs the
/// last token and up to `draft_tokens` drafted ones in one pass, and the sampler picks at every
/// position in turn exactly as it would one step at a time (penalties, grammar and seeded draws
/// included), keeping drafted tokens while its picks agree. The output is the same token for
/// token as without speculation (a batch-invariant backend gives each position the same
/// logits either way); a draft the sampler disagrees with costs only its compute. Positions
/// past the kept ones are overwritten by the next step: nothing reads them before.
pub fn generate_speculative(
    backend: &mut dyn Backend,
    vocab: &Vocabulary,
    prompt: &[u32],
    mut sampler: Sampler,
    prefill_chunk: usize,
    mut speculation: Option<Speculation>,
    mut on_text: impl FnMut(&str),
) -> Result<Generation> {
    let params = &sampler.params().clone();
    params.validate()?;
    if prompt.is_empty() {
        return Err(EngineError::EmptyPrompt);
    }
    let info = backend.info().clone();
    let capacity = info
        .max_positions
        .min(info.num_pages * info.geometry.page_tokens);
    if prompt.len() >= capacity {
        return Err(EngineError::PromptTooLong {
            tokens: prompt.len(),
            limit: capacity - 1,
        });
    }
    let max_new = params.max_tokens.min(capacity - prompt.len());
    let pages: Vec<PageId> = (0..info.geometry.pages_for(prompt.len() + max_new) as u32)
        .map(PageId)
        .collect();
    let mut stream = TextStream::new(true);
    let mut stops = StopMatcher::new(&params.stop);
    let mut run = |tokens: &[u32], start_pos: usize, logits: LogitsWanted| {
        let row = RowPlan {
            tokens: tokens.to_vec(),
            start_pos,
            pages: pages.clone(),
            logits,
        };
        backend.step(&StepPlan { rows: vec![row] })
    };

    let started = Instant::now();
    let mut output = None;
    for (i, chunk) in prompt.chunks(prefill_chunk.max(1)).enumerate() {
        let last = (i + 1) * prefill_chunk.max(1) >= prompt.len();
        output = Some(run(
            chunk,
            i * prefill_chunk.max(1),
            if last {
                LogitsWanted::Last
            } else {
                LogitsWanted::None
            },
        )?);
    }
    let first = output.expect("a non-empty prompt has a chunk");
    // The distributions not used yet: row `i` follows the last token and `draft[..i]`.
    let mut rows = vec![first.last_logits(0).to_vec()];
    let mut draft: Vec<u32> = Vec::new();
    let prefill_time = started.elapsed();

    let started = Instant::now();
    let (mut tokens, mut text) = (Vec::new(), String::new());
    let (mut drafted, mut accepted) = (0, 0);
    let mut context = prompt.to_vec();
    // The draft length follows what the last verification kept: one more than it kept (so a
    // run of agreement grows it by one a step, to `draft_tokens`), one after a refusal of
    // everything, where a longer draft would mostly be computed for nothing.
    let mut budget = speculation.as_ref().map_or(0, |s| s.draft_tokens);
    let finish_reason = 'generation: loop {
        let kept_before = accepted;
        let mut last = None;
        for (i, logits) in rows.iter_mut().enumerate() {
            let token = sampler.sample(logits);
            if let Some(failure) = sampler.failure() {
                return Err(EngineError::Grammar(failure.to_owned()));
            }
            sampler.accept(token);
            tokens.push(token);
            context.push(token);
            let ended = finish_after(params, vocab.eos_token_ids, token, tokens.len(), max_new);
            if ended == Some(FinishReason::Stop) {
                break 'generation FinishReason::Stop;
            }
            let piece = stops.push(&stream.push(vocab.tokenizer, token)?);
            on_text(&piece.text);
            text.push_str(&piece.text);
            if piece.matched.is_some() {
                break 'generation FinishReason::Stop;
            }
            if let Some(reason) = ended {
                break 'generation reason;
            }
            last = Some(token);
            if draft.get(i) != Some(&token) {
                break;
            }
            accepted += 1;
        }
        let token = last.expect("every step picks at least one token");
        if let Some(s) = &speculation
            && !draft.is_empty()
        {
            budget = (accepted - kept_before + 1).clamp(1, s.draft_tokens);
        }
        // A draft no longer than the room left (the last token of the room needs no draft).
        let room = max_new - tokens.len();
        draft = match &mut speculation {
            Some(s) if room > 1 => s.source.propose(&context, budget.min(room - 1)),
            _ => Vec::new(),
        };
        drafted += draft.len();
        let mut row = Vec::with_capacity(draft.len() + 1);
        row.push(token);
        row.extend_from_slice(&draft);
        let wanted = if draft.is_empty() {
            LogitsWanted::Last
        } else {
            LogitsWanted::All
        };
        let output = run(&row, prompt.len() + tokens.len() - 1, wanted)?;
        rows = (0..row.len().min(output.row_ranges[0].len()))
            .map(|k| output.logits(0, k).to_vec())
            .collect();
    };
    if !stops.is_finished() {
        let rest = stops.push(&stream.finish(vocab.tokenizer)?).text + &stops.finish();
        on_text(&rest);
        text.push_str(&rest);
    }
    let decode_time = started.elapsed();
    Ok(Generation {
        prompt_tokens: prompt.len(),
        tokens,
        text,
        finish_reason,
        prefill_time,
        decode_time,
        drafted,
        accepted,
    })
}
