//! A pool too small for all running jobs: a job that cannot extend backs off alone while the
//! others run, is preempted by snapshot when its attempts run out, and still finishes with the
//! tokens it gives alone. Or, configured so, fails with a clear error, alone.

mod common;

use actors::{Event, GenerateRequest, ServeError};
use common::*;
use engine::sampling::SamplingParams;

/// Eight jobs of 40 to 61 prompt tokens that each generate `max_tokens(i)` tokens.
fn crowding(vocab: usize, max_tokens: impl Fn(usize) -> usize) -> Vec<GenerateRequest> {
    (0..8)
        .map(|i| GenerateRequest {
            prompt: prompt(100 + i as u64, 40 + 3 * i, vocab),
            params: SamplingParams {
                ignore_eos: true,
                ..greedy(max_tokens(i))
            },
        })
        .collect()
}

fn crowded(on_exhausted: &str) -> String {
    crowded_with(on_exhausted, 1)
}

fn crowded_with(on_exhausted: &str, decode_steps: usize) -> String {
    format!(
        "reservation = \"optimistic\"\n[admission]\nmax_running = 8\nstep_token_budget = 256\n\
         decode_steps = {decode_steps}\n\
         [backoff]\nbase_ms = 1\nmax_ms = 4\nmax_attempts = 2\non_exhausted = \"{on_exhausted}\"\n\
         [snapshots]\ndevice_budget_bytes = 100000000\nmin_save_tokens = 1000\n"
    )
}

#[actix_rt::test]
async fn context_full_backs_off_then_preempts_by_snapshot_and_every_job_still_matches() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    // Eight jobs of up to 7 pages each share 24 pages: they cannot all grow at once.
    let requests = crowding(vocab, |_| 60);
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&model.files, r)).collect();
    let config = serve_config(&model.files, policies(&crowded("preempt")));
    let handles = actors::start(Box::new(cpu_backend(&model.files, 24)), config).unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(&completions, &expected, &[]);
    let stats = wait_idle(&handles).await;
    assert!(stats.scheduler.backoffs > 0, "no job backed off: {stats:?}");
    assert!(
        stats.scheduler.preemptions > 0,
        "no job was preempted: {stats:?}"
    );
    assert!(
        stats.store.hits > 0,
        "no preempted job was restored from its snapshot: {stats:?}"
    );
}

#[actix_rt::test]
async fn under_pressure_multi_step_decoding_still_gives_every_job_its_tokens() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let requests = crowding(vocab, |i| 57 + i);
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&model.files, r)).collect();
    let config = serve_config(&model.files, policies(&crowded_with("preempt", 4)));
    let handles = actors::start(Box::new(cpu_backend(&model.files, 24)), config).unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(&completions, &expected, &[]);
    let stats = wait_idle(&handles).await;
    let scheduler = stats.scheduler;
    assert_eq!(scheduler.finished, 8, "{scheduler:?}");
    assert!(
        scheduler.multi_steps > 0 && scheduler.backoffs > 0 && scheduler.preemptions > 0,
        "the pool was crowded and some steps ran several decode steps: {scheduler:?}"
    );
}

#[actix_rt::test]
async fn with_on_exhausted_fail_starved_jobs_fail_clearly_and_the_server_keeps_serving() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    // Eight jobs that would each grow to 7 pages, in 24 pages: growing in lockstep, some run
    // out of attempts while the pool is full (which ones depends on timing; that some do does
    // not).
    let config = serve_config(&model.files, policies(&crowded("fail")));
    let handles = actors::start(Box::new(cpu_backend(&model.files, 24)), config).unwrap();
    let mut streams = Vec::new();
    for i in 0..8 {
        let params = SamplingParams {
            ignore_eos: true,
            ..greedy(60)
        };
        streams.push(
            handles
                .submit(GenerateRequest {
                    prompt: prompt(200 + i, 40, vocab),
                    params,
                })
                .await
                .unwrap(),
        );
    }
    let mut failed = 0;
    for stream in streams {
        match stream.collect().await.end {
            Event::Finished { .. } => {}
            Event::Failed(ServeError::ContextFull { attempts, .. }) => {
                assert_eq!(attempts, 2, "failed after backoff.max_attempts");
                failed += 1;
            }
            other => panic!("unexpected end {other:?}"),
        }
    }
    assert!(failed > 0, "no job ran out of attempts");
    let small = GenerateRequest {
        prompt: prompt(300, 5, vocab),
        params: greedy(3),
    };
    let expected = solo(&model.files, &small);
    let completion = handles.submit(small).await.unwrap().collect().await;
    assert_eq!(completion.tokens, expected);
    wait_idle(&handles).await;
}

/// Verifying drafts needs pages for the drafted positions: in a crowded pool, jobs still back
/// off, are preempted and restored, give back what a verification refused, and finish with
/// their solo tokens.
#[actix_rt::test]
async fn under_pressure_speculative_decoding_still_gives_every_job_its_tokens() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let requests = crowding(vocab, |i| 57 + i);
    let expected: Vec<Vec<u32>> = requests.iter().map(|r| solo(&model.files, r)).collect();
    let toml = crowded("preempt")
        + "[speculative]\nmethod = \"prompt_lookup\"\ndraft_sizing = \"whole\"\n";
    let config = serve_config(&model.files, policies(&toml));
    let handles = actors::start(Box::new(cpu_backend(&model.files, 24)), config).unwrap();
    let completions = run_all(&handles, &requests).await;
    assert_match_solo(&completions, &expected, &[]);
    let stats = wait_idle(&handles).await;
    let scheduler = stats.scheduler;
    assert_eq!(scheduler.finished, 8, "{scheduler:?}");
    assert!(
        scheduler.drafted_tokens > 0 && scheduler.backoffs > 0 && scheduler.preemptions > 0,
        "the pool was crowded and drafts were verified: {scheduler:?}"
    );
}
