//! Prompt snapshots through the actors: a request sharing a long prefix with an earlier one
//! restores the earlier prompt's snapshot instead of prefilling it, and gives the same tokens
//! as a cold run, also when every pool page the snapshot was saved from has been reused.

mod common;

use actors::GenerateRequest;
use common::*;

const SNAPSHOTS: &str = "[snapshots]\nmin_save_tokens = 32\ndevice_budget_bytes = 100000000\n";

#[actix_rt::test]
async fn a_shared_prefix_is_restored_and_gives_the_cold_run_s_tokens() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let system = prompt(1, 6 * PAGE + 3, vocab);
    let first = GenerateRequest {
        prompt: system.clone(),
        params: greedy(8),
    };
    let second = GenerateRequest {
        prompt: [system.clone(), prompt(2, 21, vocab)].concat(),
        params: greedy(12),
    };
    let expected = solo(&model.files, &second);

    let handles = actors::start(
        Box::new(cpu_backend(&model.files, 64)),
        serve_config(&model.files, policies(SNAPSHOTS)),
    )
    .unwrap();
    let done = handles.submit(first).await.unwrap().collect().await;
    assert!(finished(&done));
    let before = wait_idle(&handles).await;
    assert_eq!(
        before.store.saves_committed, 1,
        "the first prompt was saved"
    );

    let completion = handles.submit(second).await.unwrap().collect().await;
    assert!(finished(&completion));
    assert_eq!(completion.tokens, expected);
    let after = wait_idle(&handles).await;
    assert_eq!(
        after.store.hits,
        before.store.hits + 1,
        "the second prompt found the snapshot"
    );
    assert_eq!(
        after.scheduler.restored_tokens,
        (6 * PAGE) as u64,
        "six full pages were restored, not prefilled"
    );
    if let actors::Event::Finished { usage, .. } = completion.end {
        assert_eq!(usage.cached_tokens, 6 * PAGE);
    }
}

#[actix_rt::test]
async fn a_snapshot_restores_into_other_pages_after_its_own_were_reused() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let system = prompt(3, 4 * PAGE, vocab);
    let first = GenerateRequest {
        prompt: system.clone(),
        params: greedy(4),
    };
    // Holds the pool while the second request runs: it is handed the pages the first one
    // freed (the free list is last-in first-out) and overwrites them.
    let filler = GenerateRequest {
        prompt: prompt(4, 5 * PAGE, vocab),
        params: greedy(60),
    };
    let second = GenerateRequest {
        prompt: [system, prompt(5, 9, vocab)].concat(),
        params: greedy(10),
    };
    let expected = solo(&model.files, &second);

    // 15 pages: the filler's 9 (the first request's 5 among them) and the second's 6.
    let handles = actors::start(
        Box::new(cpu_backend(&model.files, 15)),
        serve_config(&model.files, policies(SNAPSHOTS)),
    )
    .unwrap();
    assert!(finished(
        &handles.submit(first).await.unwrap().collect().await
    ));
    wait_idle(&handles).await;
    let mut filler = handles.submit(filler).await.unwrap();
    filler
        .next()
        .await
        .expect("the filler started and holds its pages");
    let completion = handles.submit(second).await.unwrap().collect().await;
    assert!(finished(&completion), "{:?}", completion.end);
    assert_eq!(
        completion.tokens, expected,
        "the relocated restore changed the output"
    );
    let stats = handles.stats().await;
    assert_eq!(stats.store.hits, 1);
    assert_eq!(stats.scheduler.restored_tokens, (4 * PAGE) as u64);
    assert!(finished(&filler.collect().await));
}

/// With `save_after_sightings = 2`, a prompt seen once is not saved (and that is counted); seen
/// twice it is, and the third request restores it with the cold run's tokens.
#[actix_rt::test]
async fn a_prompt_is_saved_on_its_second_sighting() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let request = GenerateRequest {
        prompt: prompt(6, 5 * PAGE + 2, vocab),
        params: greedy(6),
    };
    let expected = solo(&model.files, &request);
    let toml = format!("{SNAPSHOTS}save_after_sightings = 2\n");
    let handles = actors::start(
        Box::new(cpu_backend(&model.files, 64)),
        serve_config(&model.files, policies(&toml)),
    )
    .unwrap();
    let mut saved = Vec::new();
    for _ in 0..3 {
        let completion = handles
            .submit(request.clone())
            .await
            .unwrap()
            .collect()
            .await;
        assert!(finished(&completion));
        assert_eq!(completion.tokens, expected);
        let stats = wait_idle(&handles).await;
        saved.push((
            stats.store.saves_skipped,
            stats.store.saves_committed,
            stats.store.hits,
        ));
    }
    assert_eq!(
        saved,
        [(1, 0, 0), (1, 1, 0), (1, 1, 1)],
        "(skipped, saved, hits) after each request"
    );
}
