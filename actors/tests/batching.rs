//! Continuous batching through the four actors on the CPU backend: concurrent requests give
//! exactly what each gives alone, on a random-weight model and on the real SmolLM2.

mod common;

use actors::{Event, GenerateRequest};
use common::*;

/// Prompts for SmolLM2: plain text, code, a count and a chat turn.
const PROMPTS: [&str; 8] = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a village by the sea,",
    "1, 2, 3, 4,",
    "<|im_start|>user\nName a color.<|im_end|>\n<|im_start|>assistant\n",
    "The quick brown fox",
    "Water boils at",
    "In 1492,",
];

#[actix_rt::test]
async fn sixty_four_concurrent_greedy_requests_match_their_solo_runs() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let requests: Vec<GenerateRequest> = (0..64)
        .map(|i| GenerateRequest {
            prompt: prompt(i, 1 + (i as usize * 37) % 150, vocab),
            params: greedy(4 + (i as usize * 7) % 28),
        })
        .collect();
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&model.files, r)).collect();

    let config = serve_config(
        &model.files,
        policies("[admission]\nmax_running = 64\nmax_queue = 64\nstep_token_budget = 512\n"),
    );
    let handles = actors::start(Box::new(cpu_backend(&model.files, 1024)), config).unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(&completions, &expected, &[]);
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.scheduler.finished, 64);
    // With 64 running and a 512-token budget, steps must have mixed prefill chunks and decodes.
    assert!(
        stats.scheduler.steps < 64 * 4,
        "{} steps: requests were not batched",
        stats.scheduler.steps
    );
}

#[actix_rt::test]
async fn concurrent_requests_on_smollm2_match_their_solo_runs() {
    let files = engine::model::ModelFiles::open(&smollm2()).unwrap();
    let texts = PROMPTS;
    let requests: Vec<GenerateRequest> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| GenerateRequest {
            prompt: files.tokenizer.encode_rendered(t).unwrap(),
            params: greedy(6 + 2 * i),
        })
        .collect();
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&files, r)).collect();
    let config = serve_config(
        &files,
        policies("[admission]\nmax_running = 8\nstep_token_budget = 64\n"),
    );
    let handles = actors::start(Box::new(cpu_backend(&files, 64)), config).unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(
        &completions,
        &expected,
        &texts.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
    );
    wait_idle(&handles).await;
}

#[actix_rt::test]
async fn every_request_ends_with_exactly_one_terminal_event() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let handles = actors::start(
        Box::new(cpu_backend(&model.files, 256)),
        serve_config(&model.files, policies("")),
    )
    .unwrap();
    let mut streams = Vec::new();
    for i in 0..8 {
        streams.push(
            handles
                .submit(GenerateRequest {
                    prompt: prompt(i, 20, vocab),
                    params: greedy(5),
                })
                .await
                .unwrap(),
        );
    }
    for mut stream in streams {
        let mut terminal = 0;
        while let Some(event) = stream.next().await {
            terminal += event.is_terminal() as usize;
            if let Event::Finished { usage, .. } = &event {
                assert_eq!(usage.prompt_tokens, 20);
                assert!(usage.completion_tokens >= 1 && usage.completion_tokens <= 5);
            }
        }
        assert_eq!(terminal, 1);
    }
}

#[actix_rt::test]
async fn multi_step_decoding_on_smollm2_gives_every_request_its_solo_tokens() {
    let files = engine::model::ModelFiles::open(&smollm2()).unwrap();
    let texts = PROMPTS;
    // Greedy and seeded sampled requests, max_tokens that are not multiples of the 4 steps,
    // and stop token ids taken from a request's own solo run, so that rows stop part-way
    // through a multi-step decode.
    let mut requests: Vec<GenerateRequest> = texts
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let mut params = greedy(9 + 3 * i);
            if i % 2 == 1 {
                params.temperature = 0.8;
                params.seed = Some(100 + i as u64);
            }
            GenerateRequest {
                prompt: files.tokenizer.encode_rendered(t).unwrap(),
                params,
            }
        })
        .collect();
    for request in requests.iter_mut().skip(2).step_by(3) {
        let tokens = solo(&files, request);
        request.params.stop_token_ids = vec![tokens[tokens.len() / 2]];
    }
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&files, r)).collect();
    let stopped = requests
        .iter()
        .zip(&expected)
        .filter(|(r, e)| e.len() < r.params.max_tokens && e.len() % 4 != 0)
        .count();
    assert!(stopped > 0, "some request stops part-way through 4 steps");

    let config = serve_config(
        &files,
        policies("[admission]\nmax_running = 8\nstep_token_budget = 256\ndecode_steps = 4\n"),
    );
    let handles = actors::start(Box::new(cpu_backend(&files, 64)), config).unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(
        &completions,
        &expected,
        &texts.iter().map(|t| t.to_string()).collect::<Vec<_>>(),
    );
    let stats = wait_idle(&handles).await;
    assert!(
        stats.scheduler.multi_steps > 0,
        "no step ran several decode steps: {:?}",
        stats.scheduler
    );
}

/// A request that arrives while the engine runs a multi-step decode cuts it short: it is
/// admitted after the decode step in flight, not after all of them, and both requests still
/// give exactly their solo tokens.
#[actix_rt::test]
async fn an_arrival_cuts_a_multi_step_decode_short() {
    let files = engine::model::ModelFiles::open(&smollm2()).unwrap();
    let encode = |text: &str| files.tokenizer.encode_rendered(text).unwrap();
    let mut params = greedy(24);
    params.ignore_eos = true;
    let long = GenerateRequest {
        prompt: encode(PROMPTS[2]),
        params,
    };
    let short = GenerateRequest {
        prompt: encode(PROMPTS[0]),
        params: greedy(2),
    };
    let expected = [solo(&files, &long), solo(&files, &short)];

    // One multi-step decode could run every token the long request has left after its first.
    let config = serve_config(
        &files,
        policies("[admission]\nmax_running = 8\ndecode_steps = 32\n"),
    );
    let handles = actors::start(Box::new(cpu_backend(&files, 64)), config).unwrap();
    let long_stream = handles.submit(long).await.unwrap();
    let mut polls = 0;
    while handles.scheduler_stats().await.multi_steps == 0 {
        polls += 1;
        assert!(
            polls < 2_000,
            "the long request never started a multi-step decode"
        );
        actix_rt::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    let mut short_stream = handles.submit(short).await.unwrap();
    let first = short_stream.next().await;
    assert!(matches!(first, Some(Event::Token(_))), "{first:?}");
    let at_first_token = handles.scheduler_stats().await;
    assert_eq!(
        at_first_token.running, 2,
        "the short request was admitted only after the long one ended: {at_first_token:?}"
    );
    let (short_done, long_done) = (short_stream.collect().await, long_stream.collect().await);
    let mut short_tokens = vec![match first {
        Some(Event::Token(token)) => token,
        _ => unreachable!("asserted above"),
    }];
    short_tokens.extend(&short_done.tokens);
    assert_match_solo(&[long_done], &expected[..1], &["long".into()]);
    assert!(finished(&short_done), "{:?}", short_done.end);
    assert_eq!(
        short_tokens, expected[1],
        "the short request differs from its solo run"
    );
    let stats = wait_idle(&handles).await;
    assert!(
        stats.scheduler.multi_steps_cut_short >= 1,
        "no multi-step decode was cut short: {:?}",
        stats.scheduler
    );
}

/// Speculative decoding in the server: drafts from prompt lookup verified in the batched
/// steps give every request exactly its solo tokens (greedy and seeded sampled ones, several
/// at once, across page boundaries), keep some drafted tokens on prompts whose answer copies
/// their input, and give back every page.
#[actix_rt::test]
async fn speculative_decoding_on_smollm2_gives_every_request_its_solo_tokens() {
    let files = engine::model::ModelFiles::open(&smollm2()).unwrap();
    let prompts = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../scripts/speculation_prompts.txt"
    ))
    .unwrap();
    let texts: Vec<String> = prompts.lines().map(str::to_owned).collect();
    assert!(texts.len() >= 3, "the shipped prompts are there");
    let mut requests: Vec<GenerateRequest> = texts
        .iter()
        .chain(
            PROMPTS[..3]
                .iter()
                .map(|t| t.to_string())
                .collect::<Vec<_>>()
                .iter(),
        )
        .enumerate()
        .map(|(i, text)| {
            let chat = format!("<|im_start|>user\n{text}<|im_end|>\n<|im_start|>assistant\n");
            let mut params = greedy(40 + 3 * i);
            if i % 3 == 2 {
                params.temperature = 0.7;
                params.seed = Some(7 + i as u64);
            }
            GenerateRequest {
                prompt: files.tokenizer.encode_rendered(&chat).unwrap(),
                params,
            }
        })
        .collect();
    requests.truncate(6);
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&files, r)).collect();
    let config = serve_config(
        &files,
        policies(
            "[admission]\nmax_running = 8\nstep_token_budget = 256\n\
             [speculative]\nmethod = \"prompt_lookup\"\n",
        ),
    );
    let handles = actors::start(Box::new(cpu_backend(&files, 96)), config).unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(&completions, &expected, &texts);
    let stats = wait_idle(&handles).await;
    let scheduler = stats.scheduler;
    let verified: u64 = scheduler.verified.iter().sum();
    assert!(
        scheduler.accepted_tokens > 0 && verified > 0,
        "no drafted token was kept: {scheduler:?}"
    );
    assert!(scheduler.accepted_tokens <= scheduler.drafted_tokens);
}
