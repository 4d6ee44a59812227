//! The cache behaviours of the actor tests again, on the real SmolLM2-135M-Instruct (f32 on
//! the CPU): a restored system prompt, and preemption by snapshot under a pool too small for
//! everyone, both giving exactly the tokens of a solo run.

mod common;

use actors::{Event, GenerateRequest};
use common::*;
use engine::model::ModelFiles;
use engine::sampling::SamplingParams;

fn chat(files: &ModelFiles, system: &str, user: &str) -> Vec<u32> {
    let text = format!(
        "<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
    );
    files.tokenizer.encode_rendered(&text).unwrap()
}

const SYSTEM: &str = "You are a careful assistant for a shipping company. Answer in one short sentence, \
    cite the relevant rule number when there is one, and never invent rules. Rule 1: parcels over 30 kg \
    need two handlers. Rule 2: fragile goods travel in the top rack. Rule 3: refrigerated goods leave first.";

#[actix_rt::test]
async fn a_saved_system_prompt_is_restored_for_a_conversation_and_changes_nothing() {
    let files = ModelFiles::open(&smollm2()).unwrap();
    let system = files
        .tokenizer
        .encode_rendered(&format!("<|im_start|>system\n{SYSTEM}<|im_end|>\n"))
        .unwrap();
    let conversation = chat(&files, SYSTEM, "Where do I put a glass vase?");
    assert!(
        conversation.starts_with(&system),
        "the system turn tokenizes the same inside the conversation"
    );
    let request = GenerateRequest {
        prompt: conversation,
        params: greedy(12),
    };
    let expected = solo(&files, &request);

    let config = serve_config(&files, policies("[snapshots]\nmin_save_tokens = 32\n"));
    let handles = actors::start(Box::new(cpu_backend(&files, 64)), config).unwrap();
    let warm = GenerateRequest {
        prompt: system.clone(),
        params: greedy(1),
    };
    assert!(finished(
        &handles.submit(warm).await.unwrap().collect().await
    ));
    wait_idle(&handles).await;
    let completion = handles.submit(request).await.unwrap().collect().await;
    assert_eq!(completion.tokens, expected);
    let stats = wait_idle(&handles).await;
    let restored = (system.len() / PAGE * PAGE) as u64;
    assert_eq!(stats.scheduler.restored_tokens, restored, "{stats:?}");
    match completion.end {
        Event::Finished { usage, .. } => assert_eq!(usage.cached_tokens as u64, restored),
        other => panic!("{other:?}"),
    }
}

#[actix_rt::test]
async fn a_conversation_restores_the_system_prompt_it_shares_with_an_earlier_one() {
    // The system prompt is not saved on its own: the first conversation saves its whole
    // prompt, and the second restores the head the two share.
    let files = ModelFiles::open(&smollm2()).unwrap();
    let system = SYSTEM.repeat(5);
    let first = chat(&files, &system, "Where do I put a glass vase?");
    let second = chat(&files, &system, "How many people lift a 40 kg parcel?");
    let shared = first
        .iter()
        .zip(&second)
        .take_while(|(a, b)| a == b)
        .count();
    assert!(
        shared >= 16 * PAGE,
        "the conversations share {shared} tokens"
    );
    let request = GenerateRequest {
        prompt: second,
        params: greedy(12),
    };
    let expected = solo(&files, &request);

    let config = serve_config(&files, policies("[snapshots]\nmin_save_tokens = 32\n"));
    let handles = actors::start(Box::new(cpu_backend(&files, 96)), config).unwrap();
    let warm = GenerateRequest {
        prompt: first,
        params: greedy(2),
    };
    assert!(finished(
        &handles.submit(warm).await.unwrap().collect().await
    ));
    wait_idle(&handles).await;
    let completion = handles.submit(request).await.unwrap().collect().await;
    assert_eq!(completion.tokens, expected);
    let stats = wait_idle(&handles).await;
    let restored = (shared / PAGE * PAGE) as u64;
    assert_eq!(stats.scheduler.restored_tokens, restored, "{stats:?}");
    assert_eq!(stats.store.hits, 1, "{stats:?}");
}

#[actix_rt::test]
async fn preemption_by_snapshot_on_smollm2_keeps_every_output() {
    let files = ModelFiles::open(&smollm2()).unwrap();
    let questions = [
        "Name three fruits.",
        "What is 12 times 12?",
        "Say hello in French.",
        "Name a planet.",
        "What colour is the sky?",
        "Count to five.",
    ];
    let requests: Vec<GenerateRequest> = questions
        .iter()
        .map(|q| GenerateRequest {
            prompt: chat(&files, "Be brief.", q),
            params: SamplingParams {
                ignore_eos: true,
                ..greedy(40)
            },
        })
        .collect();
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&files, r)).collect();
    let toml = "reservation = \"optimistic\"\n[admission]\nmax_running = 6\n\
                [backoff]\nbase_ms = 1\nmax_ms = 4\nmax_attempts = 2\non_exhausted = \"preempt\"\n\
                [snapshots]\nmin_save_tokens = 1000\n";
    // Six sequences of ~70 tokens (5 pages each) in 16 pages.
    let handles = actors::start(
        Box::new(cpu_backend(&files, 16)),
        serve_config(&files, policies(toml)),
    )
    .unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(
        &completions,
        &expected,
        &questions.iter().map(|q| q.to_string()).collect::<Vec<_>>(),
    );
    let stats = wait_idle(&handles).await;
    assert!(
        stats.scheduler.preemptions > 0 && stats.store.hits > 0,
        "{stats:?}"
    );
}
