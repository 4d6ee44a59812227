//! Speculative decoding in the one-sequence loop: with prompt-lookup drafts the output is the
//! same token for token as without (greedy, with penalties, and seeded sampling), and on the
//! real SmolLM2 asked to repeat a given text most drafted tokens are kept.

mod common;

use engine::DType;
use engine::chat::ChatMessage;
use engine::cpu::{CpuBackend, CpuOptions};
use engine::fetch;
use engine::generate::{Generation, Speculation, Vocabulary, generate_speculative};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};
use engine::sampling::{Sampler, SamplingParams};
use engine::speculative::PromptLookup;

fn backend(files: &ModelFiles, pages: usize, int8_inputs: bool) -> CpuBackend {
    CpuBackend::load(
        files,
        &CpuOptions {
            threads: 2,
            page_tokens: 16,
            num_pages: pages,
            int8_inputs,
        },
    )
    .unwrap()
}

fn run(files: &ModelFiles, prompt: &[u32], params: &SamplingParams, speculate: bool) -> Generation {
    run_on(files, prompt, params, speculate, false)
}

fn run_on(
    files: &ModelFiles,
    prompt: &[u32],
    params: &SamplingParams,
    speculate: bool,
    int8_inputs: bool,
) -> Generation {
    let pages = (prompt.len() + params.max_tokens).div_ceil(16) + 2;
    let mut backend = backend(files, pages, int8_inputs);
    let vocab = Vocabulary {
        tokenizer: &files.tokenizer,
        eos_token_ids: &files.eos_token_ids,
    };
    let mut lookup = PromptLookup {
        ngram_min: 1,
        ngram_max: 3,
    };
    let speculation = speculate.then_some(Speculation {
        source: &mut lookup,
        draft_tokens: 7,
    });
    let sampler = Sampler::new(params, prompt);
    generate_speculative(
        &mut backend,
        &vocab,
        prompt,
        sampler,
        64,
        speculation,
        |_| {},
    )
    .unwrap()
}

#[test]
fn speculation_changes_no_token_on_a_batch_invariant_backend() {
    let dir = tempfile::tempdir().unwrap();
    synthetic::write(dir.path(), &SyntheticSpec::tiny(13)).unwrap();
    let files = ModelFiles::open(dir.path()).unwrap();
    // A pattern that repeats: prompt lookup has drafts to offer.
    let prompt: Vec<u32> = (0..90u32).map(|i| 3 + (i % 9) * 17 % 200).collect();
    let base = SamplingParams {
        max_tokens: 48,
        ignore_eos: true,
        ..SamplingParams::default()
    };
    let variants = [
        base.clone(),
        SamplingParams {
            repetition_penalty: 1.3,
            frequency_penalty: 0.4,
            ..base.clone()
        },
        SamplingParams {
            temperature: 0.8,
            top_p: 0.9,
            seed: Some(5),
            ..base.clone()
        },
    ];
    for params in &variants {
        let plain = run(&files, &prompt, params, false);
        let fast = run(&files, &prompt, params, true);
        assert_eq!(fast.tokens, plain.tokens, "{params:?}");
        assert_eq!(fast.finish_reason, plain.finish_reason);
        assert!(fast.drafted > 0, "prompt lookup proposed nothing");
        assert!(fast.accepted <= fast.drafted);
    }
}

#[test]
fn smollm2_repeating_a_given_text_keeps_most_drafts_and_the_same_text() {
    let dir = common::smollm2(DType::F32);
    repeat_a_given_text(&ModelFiles::open(&dir).unwrap(), false);
}

/// The CPU's integer products (`quantization = "int8"`) are batch-invariant too: a
/// verification's rows are the bits of one-token steps, so speculation changes no token.
#[test]
fn smollm2_on_integer_products_speculates_the_same_text() {
    let options = fetch::FetchOptions {
        keep_blocks: true,
        ..fetch::FetchOptions::new(common::cache_dir(), DType::F32)
    };
    let dir = fetch::fetch(&fetch::SMOLLM2, &options).unwrap();
    repeat_a_given_text(&ModelFiles::open(&dir).unwrap(), true);
}

fn repeat_a_given_text(files: &ModelFiles, int8_inputs: bool) {
    let text = "The snapshot store keeps the KV of prompt prefixes in their own buffers, \
                charged against a byte budget before they are allocated and evicted by least \
                recent use. A restore copies a snapshot into any free pages of the working pool.";
    let message = ChatMessage::new(
        "user",
        &format!("Repeat the following text exactly, word for word:\n\n{text}"),
    );
    let rendered = files
        .chat_template
        .as_ref()
        .expect("SmolLM2 has a chat template")
        .render(&[message], true)
        .unwrap();
    let prompt = files.tokenizer.encode_rendered(&rendered).unwrap();
    let params = SamplingParams {
        max_tokens: 60,
        ..SamplingParams::default()
    };
    let plain = run_on(files, &prompt, &params, false, int8_inputs);
    let fast = run_on(files, &prompt, &params, true, int8_inputs);
    assert_eq!(fast.text, plain.text);
    assert_eq!(fast.tokens, plain.tokens);
    let kept = fast.accepted as f64 / fast.drafted.max(1) as f64;
    eprintln!(
        "{} tokens; drafted {}, kept {} ({:.0}%); decode {:.2} s plain, {:.2} s speculating",
        fast.tokens.len(),
        fast.drafted,
        fast.accepted,
        100.0 * kept,
        plain.decode_time.as_secs_f64(),
        fast.decode_time.as_secs_f64()
    );
    assert!(
        fast.accepted * 2 >= fast.tokens.len(),
        "at least half the tokens came from kept drafts: {} of {}",
        fast.accepted,
        fast.tokens.len()
    );
}
