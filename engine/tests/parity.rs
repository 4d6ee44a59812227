//! The CPU backend against Hugging Face transformers on the real SmolLM2-135M-Instruct (f32):
//! logits at several positions of six prompts (one of 941 tokens, one chat-templated) and
//! greedy continuations, through one sequence alone, several sequences batched in one step on
//! scattered pages, and prompts split into prefill chunks of different sizes.

mod common;

use cache::PageId;
use common::{Fixture, Prompt, max_abs_diff, smollm2};
use engine::DType;
use engine::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use engine::cpu::{CpuBackend, CpuOptions};
use engine::model::ModelFiles;
use engine::sampling::argmax;

/// Max absolute logit error allowed against transformers' f32 forward.
const TOLERANCE: f32 = 1e-3;

fn backend(pages: usize) -> (CpuBackend, usize) {
    let model = ModelFiles::open(&smollm2(DType::F32)).expect("the converted folder opens");
    let options = CpuOptions {
        num_pages: pages,
        ..CpuOptions::for_tokens(0)
    };
    let backend = CpuBackend::load(&model, &options).expect("SmolLM2 loads on the CPU");
    let vocab = backend.info().vocab_size;
    (backend, vocab)
}

/// Page tables that interleave sequences across the pool, so no sequence's pages are
/// contiguous or start at 0.
fn scattered_pages(sequences: usize, pages_each: usize) -> Vec<Vec<PageId>> {
    (0..sequences)
        .map(|s| {
            (0..pages_each)
                .map(|i| PageId((i * sequences + (sequences - 1 - s)) as u32))
                .collect()
        })
        .collect()
}

/// Checks the logits a step returned for `prompt` tokens `start..start + n` (all positions)
/// against the fixture positions in that range; returns how many were checked.
fn check_logits(
    prompt: &Prompt,
    start: usize,
    n: usize,
    logits_of: impl Fn(usize) -> Vec<f32>,
    vocab: usize,
    what: &str,
) -> usize {
    let mut checked = 0;
    for (k, &pos) in prompt.positions.iter().enumerate() {
        if pos < start || pos >= start + n {
            continue;
        }
        let want = &prompt.logits[k * vocab..(k + 1) * vocab];
        let got = logits_of(pos - start);
        let err = max_abs_diff(&got, want);
        eprintln!(
            "{what}: prompt `{}` position {pos}: max abs error {err:.2e}",
            prompt.name
        );
        assert!(
            err < TOLERANCE,
            "{what}: prompt `{}` position {pos}: max abs error {err}",
            prompt.name
        );
        checked += 1;
    }
    checked
}

#[test]
fn logits_match_transformers_one_sequence_at_a_time() {
    let fixture = Fixture::load();
    let (mut backend, vocab) = backend(128);
    let pages: Vec<PageId> = (0..128).map(PageId).collect();
    for prompt in fixture.prompts() {
        let plan = StepPlan {
            rows: vec![RowPlan {
                tokens: prompt.ids.clone(),
                start_pos: 0,
                pages: pages.clone(),
                logits: LogitsWanted::All,
            }],
        };
        let out = backend.step(&plan).unwrap();
        let checked = check_logits(
            &prompt,
            0,
            prompt.ids.len(),
            |k| out.logits(0, k).to_vec(),
            vocab,
            "alone",
        );
        assert_eq!(checked, prompt.positions.len());
    }
}

#[test]
fn logits_match_transformers_with_all_prompts_batched_in_one_step() {
    let fixture = Fixture::load();
    let prompts = fixture.prompts();
    assert!(prompts.len() >= 5 && prompts.iter().any(|p| p.ids.len() > 500));
    let (mut backend, vocab) = backend(prompts.len() * 64);
    let tables = scattered_pages(prompts.len(), 64);
    let rows = prompts
        .iter()
        .zip(&tables)
        .map(|(p, pages)| RowPlan {
            tokens: p.ids.clone(),
            start_pos: 0,
            pages: pages.clone(),
            logits: LogitsWanted::All,
        })
        .collect();
    let out = backend.step(&StepPlan { rows }).unwrap();
    for (i, prompt) in prompts.iter().enumerate() {
        let checked = check_logits(
            prompt,
            0,
            prompt.ids.len(),
            |k| out.logits(i, k).to_vec(),
            vocab,
            "batched",
        );
        assert_eq!(checked, prompt.positions.len());
    }
}

#[test]
fn logits_match_transformers_through_chunked_prefill_of_mixed_sizes() {
    let fixture = Fixture::load();
    let prompts = fixture.prompts();
    let (mut backend, vocab) = backend(prompts.len() * 64);
    // Each prompt advances by its own chunk size; every step mixes rows at different positions.
    let chunk_sizes: Vec<usize> = (0..prompts.len())
        .map(|i| [1, 3, 7, 16, 61, 256][i % 6])
        .collect();
    let logits = logits_by_schedule(&mut backend, &prompts, &chunk_sizes, true);
    for (prompt, logits) in prompts.iter().zip(&logits) {
        let at = |k: usize| logits[k * vocab..(k + 1) * vocab].to_vec();
        let checked = check_logits(prompt, 0, prompt.ids.len(), at, vocab, "chunked");
        assert_eq!(checked, prompt.positions.len(), "prompt `{}`", prompt.name);
    }
}

/// How many leading greedy steps must agree: up to the first step whose top-1/top-2 margin in
/// transformers is under the tolerance (where rounding may legitimately pick either).
fn comparable_steps(prompt: &Prompt) -> usize {
    prompt
        .margins
        .iter()
        .position(|&m| m < TOLERANCE)
        .unwrap_or(prompt.margins.len())
}

#[test]
fn greedy_continuations_match_transformers_decoding_all_prompts_together() {
    let fixture = Fixture::load();
    let prompts = fixture.prompts();
    let (mut backend, _) = backend(prompts.len() * 64);
    let tables = scattered_pages(prompts.len(), 64);
    let rows = prompts
        .iter()
        .zip(&tables)
        .map(|(p, pages)| RowPlan {
            tokens: p.ids.clone(),
            start_pos: 0,
            pages: pages.clone(),
            logits: LogitsWanted::Last,
        })
        .collect();
    let out = backend.step(&StepPlan { rows }).unwrap();
    let mut generated: Vec<Vec<u32>> = (0..prompts.len())
        .map(|i| vec![argmax(out.last_logits(i))])
        .collect();
    let steps = prompts.iter().map(|p| p.greedy.len()).max().unwrap();
    for _ in 1..steps {
        let rows = prompts
            .iter()
            .zip(&tables)
            .zip(&generated)
            .map(|((p, pages), g)| RowPlan {
                tokens: vec![*g.last().unwrap()],
                start_pos: p.ids.len() + g.len() - 1,
                pages: pages.clone(),
                logits: LogitsWanted::Last,
            })
            .collect();
        let out = backend.step(&StepPlan { rows }).unwrap();
        for (i, g) in generated.iter_mut().enumerate() {
            g.push(argmax(out.last_logits(i)));
        }
    }
    for (prompt, ours) in prompts.iter().zip(&generated) {
        let n = comparable_steps(prompt);
        assert!(
            n >= 8,
            "prompt `{}`: only {n} steps have a healthy margin",
            prompt.name
        );
        assert_eq!(&ours[..n], &prompt.greedy[..n], "prompt `{}`", prompt.name);
    }
}

/// All logits of every prompt, `[tokens × vocab]`, from one way of scheduling the prompts.
fn logits_by_schedule(
    backend: &mut CpuBackend,
    prompts: &[Prompt],
    chunk_sizes: &[usize],
    together: bool,
) -> Vec<Vec<f32>> {
    let tables = scattered_pages(prompts.len(), 64);
    let mut logits = vec![Vec::new(); prompts.len()];
    let mut done = vec![0usize; prompts.len()];
    let groups: Vec<Vec<usize>> = if together {
        vec![(0..prompts.len()).collect()]
    } else {
        (0..prompts.len()).map(|i| vec![i]).collect()
    };
    for group in groups {
        while group.iter().any(|&i| done[i] < prompts[i].ids.len()) {
            let active: Vec<usize> = group
                .iter()
                .copied()
                .filter(|&i| done[i] < prompts[i].ids.len())
                .collect();
            let rows = active
                .iter()
                .map(|&i| {
                    let end = (done[i] + chunk_sizes[i]).min(prompts[i].ids.len());
                    RowPlan {
                        tokens: prompts[i].ids[done[i]..end].to_vec(),
                        start_pos: done[i],
                        pages: tables[i].clone(),
                        logits: LogitsWanted::All,
                    }
                })
                .collect::<Vec<_>>();
            let out = backend.step(&StepPlan { rows: rows.clone() }).unwrap();
            for (row, &i) in active.iter().enumerate() {
                logits[i].extend_from_slice(
                    &out.logits[out.row_ranges[row].start * out.vocab_size
                        ..out.row_ranges[row].end * out.vocab_size],
                );
                done[i] += rows[row].tokens.len();
            }
        }
    }
    logits
}

#[test]
fn logits_are_bit_identical_however_the_prompts_are_scheduled() {
    let fixture = Fixture::load();
    let prompts: Vec<Prompt> = fixture
        .prompts()
        .into_iter()
        .filter(|p| p.ids.len() < 200)
        .collect();
    let (mut backend, _) = backend(prompts.len() * 64);
    let whole: Vec<usize> = prompts.iter().map(|p| p.ids.len()).collect();
    let alone = logits_by_schedule(&mut backend, &prompts, &whole, false);
    let batched = logits_by_schedule(&mut backend, &prompts, &whole, true);
    let token_by_token = logits_by_schedule(&mut backend, &prompts, &vec![1; prompts.len()], true);
    let mixed: Vec<usize> = (0..prompts.len()).map(|i| [5, 2, 13, 7][i % 4]).collect();
    let chunked = logits_by_schedule(&mut backend, &prompts, &mixed, true);
    for (i, prompt) in prompts.iter().enumerate() {
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(
            bits(&alone[i]) == bits(&batched[i]),
            "prompt `{}`: batched differs from alone",
            prompt.name
        );
        assert!(
            bits(&alone[i]) == bits(&token_by_token[i]),
            "prompt `{}`: token by token differs",
            prompt.name
        );
        assert!(
            bits(&alone[i]) == bits(&chunked[i]),
            "prompt `{}`: chunked differs",
            prompt.name
        );
    }
}
