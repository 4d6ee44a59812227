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

/// A snapshot whose bytes went bad in memory is refused when restored: the request computes
/// its prompt instead and gives the cold run's tokens, reports no cached tokens, the snapshot
/// is dropped (and its buffer freed), and the corruption is counted by tier. The next request
/// saves the prefix anew and restores it.
#[actix_rt::test]
async fn a_corrupt_snapshot_is_refused_dropped_and_recomputed() {
    let model = TinyModel::new();
    let vocab = model.files.config.vocab_size;
    let system = prompt(41, 6 * PAGE + 3, vocab);
    let ask = |seed: u64, tokens: usize| GenerateRequest {
        prompt: [system.clone(), prompt(seed, 11, vocab)].concat(),
        params: greedy(tokens),
    };
    let handles = actors::start(
        Box::new(cpu_backend(&model.files, 64)),
        serve_config(
            &model.files,
            policies(&format!("{SNAPSHOTS}save_replies = false\n")),
        ),
    )
    .unwrap();
    assert!(finished(
        &handles.submit(ask(42, 4)).await.unwrap().collect().await
    ));
    wait_idle(&handles).await;
    let saved = handles.snapshots().await;
    assert_eq!(saved.len(), 1, "the first prompt was saved");
    let bad = saved[0].id;
    // One bit of one element in the fourth page's third block.
    let page_bytes = saved[0].bytes / saved[0].pages as u64;
    handles
        .corrupt_snapshot(bad, 3 * page_bytes + 2 * page_bytes / 4 + 1, 0x08)
        .await
        .unwrap();

    let second = ask(43, 9);
    let expected = solo(&model.files, &second);
    let completion = handles.submit(second).await.unwrap().collect().await;
    assert!(finished(&completion), "{:?}", completion.end);
    assert_eq!(completion.tokens, expected, "no corrupt KV was used");
    if let actors::Event::Finished { usage, .. } = &completion.end {
        assert_eq!(
            usage.cached_tokens, 0,
            "nothing was served from the snapshot"
        );
    }
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.scheduler.corrupt_restores.iter().sum::<u64>(), 1);
    assert_eq!(stats.store.corrupt, 1);
    let now = handles.snapshots().await;
    assert!(
        now.iter().all(|s| s.id != bad),
        "the corrupt snapshot is gone"
    );
    let mut held = handles.backings().await;
    let mut listed: Vec<_> = now.iter().map(|s| s.backing).collect();
    held.sort();
    listed.sort();
    assert_eq!(
        held, listed,
        "every buffer the engine holds is a listed snapshot's"
    );

    // The recomputed prompt was saved again, intact: the next one restores it.
    let third = ask(44, 6);
    let expected = solo(&model.files, &third);
    let completion = handles.submit(third).await.unwrap().collect().await;
    assert_eq!(completion.tokens, expected);
    if let actors::Event::Finished { usage, .. } = &completion.end {
        assert_eq!(usage.cached_tokens, 6 * PAGE);
    }
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.scheduler.corrupt_restores.iter().sum::<u64>(), 1);
}
