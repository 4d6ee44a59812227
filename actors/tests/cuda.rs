//! The same actors serving on the CUDA backend (run on a GPU machine with `--ignored`): many
//! concurrent requests finish, a shared prefix is restored from a snapshot held in device
//! memory, and cancelled requests and finished ones give every page back. (Token-for-token
//! equality with solo runs is a property of the CPU backend's batch-invariant kernels; cuBLAS
//! picks its kernels by batch size, so on the GPU it is not asserted.)

mod common;

use actors::{Event, GenerateRequest};
use common::*;
use engine::DType;
use engine::cuda::{CudaBackend, CudaOptions};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};
use engine::sampling::SamplingParams;

fn model() -> (tempfile::TempDir, ModelFiles) {
    let dir = tempfile::tempdir().unwrap();
    let spec = SyntheticSpec {
        dtype: DType::BF16,
        max_position_embeddings: 1024,
        ..SyntheticSpec::smollm2(5)
    };
    synthetic::write(dir.path(), &spec).unwrap();
    let files = ModelFiles::open(dir.path()).unwrap();
    (dir, files)
}

fn cuda_backend(files: &ModelFiles, pages: usize) -> CudaBackend {
    CudaBackend::load(
        files,
        &CudaOptions {
            // The store's default device budget: the arena is sized to it.
            device_snapshot_bytes: 1 << 30,
            ..CudaOptions::for_tokens(pages * PAGE, 2048, 64)
        },
    )
    .expect("these tests need a CUDA device")
}

#[actix_rt::test]
#[ignore = "needs a CUDA device"]
async fn the_actors_serve_on_the_gpu() {
    let (_dir, files) = model();
    let vocab = files.config.vocab_size;
    // Every prompt is saved at first sight (a GPU's default waits for a second).
    let toml = "[admission]\nmax_running = 64\nstep_token_budget = 2048\n\
                [snapshots]\nmin_save_tokens = 32\nsave_after_sightings = 1\n";
    let handles = actors::start(
        Box::new(cuda_backend(&files, 1024)),
        serve_config(&files, policies(toml)),
    )
    .unwrap();

    let mut streams = Vec::new();
    for i in 0..64 {
        let params = SamplingParams {
            ignore_eos: true,
            ..greedy(8 + i as usize % 9)
        };
        streams.push(
            handles
                .submit(GenerateRequest {
                    prompt: prompt(i, 5 + (i as usize * 13) % 120, vocab),
                    params,
                })
                .await
                .unwrap(),
        );
    }
    for (i, stream) in streams.into_iter().enumerate() {
        let completion = stream.collect().await;
        assert!(finished(&completion), "request {i}: {:?}", completion.end);
        assert_eq!(completion.tokens.len(), 8 + i % 9);
    }
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.scheduler.finished, 64);
    assert!(
        stats.memory.device_snapshot_bytes > 0,
        "prompts were saved on the device: {stats:?}"
    );

    // A longer request sharing a saved prompt restores it.
    let shared = prompt(40, 5 + (40 * 13) % 120, vocab);
    let longer = GenerateRequest {
        prompt: [shared.clone(), prompt(99, 20, vocab)].concat(),
        params: greedy(6),
    };
    let hits = stats.store.hits;
    let completion = handles.submit(longer).await.unwrap().collect().await;
    assert!(finished(&completion));
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.store.hits, hits + 1);
    assert_eq!(
        stats.scheduler.restored_tokens,
        (shared.len() / PAGE * PAGE) as u64
    );

    // A prompt sharing 18 pages with a longer saved one restores that head.
    let document = prompt(77, 25 * PAGE, vocab);
    let saved = GenerateRequest {
        prompt: document.clone(),
        params: greedy(2),
    };
    assert!(finished(
        &handles.submit(saved).await.unwrap().collect().await
    ));
    let before = wait_idle(&handles).await;
    let question = GenerateRequest {
        prompt: [&document[..18 * PAGE + 5], &prompt(78, 30, vocab)[..]].concat(),
        params: greedy(4),
    };
    assert!(finished(
        &handles.submit(question).await.unwrap().collect().await
    ));
    let after = wait_idle(&handles).await;
    assert_eq!(after.store.hits, before.store.hits + 1);
    assert_eq!(
        after.scheduler.restored_tokens - before.scheduler.restored_tokens,
        (18 * PAGE) as u64
    );

    // Cancelled mid-stream: every page comes back.
    let mut streams = Vec::new();
    for i in 0..16 {
        let params = SamplingParams {
            ignore_eos: true,
            ..greedy(200)
        };
        streams.push(
            handles
                .submit(GenerateRequest {
                    prompt: prompt(200 + i, 30, vocab),
                    params,
                })
                .await
                .unwrap(),
        );
    }
    for stream in &mut streams {
        assert!(matches!(stream.next().await, Some(Event::Token(_))));
    }
    drop(streams);
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.pool.free_pages, stats.pool.total_pages);
}

/// Runs `requests` together on a fresh GPU backend with `decode_steps`, steps overlapped or
/// not; returns the tokens and the scheduler's counters.
async fn serve_on_gpu(
    files: &ModelFiles,
    requests: &[GenerateRequest],
    decode_steps: usize,
    overlap: bool,
) -> (Vec<Vec<u32>>, actors::scheduler::SchedulerStats) {
    // Prompt chunks are not cut by the step times learnt while running: those vary from run
    // to run, and so did which tokens shared a step (seen with the same requests on the CPU:
    // the second step held 60, 33 or 37 tokens), and with them the GPU's bits.
    let toml = format!(
        "[admission]\nmax_running = 64\ndecode_steps = {decode_steps}\noverlap_steps = {overlap}\n\
         max_step_ms = 1000000\n"
    );
    let handles = actors::start(
        Box::new(cuda_backend(files, 1024)),
        serve_config(files, policies(&toml)),
    )
    .unwrap();
    let completions = run_all(&handles, requests).await;
    for (i, completion) in completions.iter().enumerate() {
        assert!(finished(completion), "request {i}: {:?}", completion.end);
    }
    let stats = wait_idle(&handles).await;
    let tokens = completions.into_iter().map(|c| c.tokens).collect();
    (tokens, stats.scheduler)
}

#[actix_rt::test]
#[ignore = "needs a CUDA device"]
async fn multi_step_decoding_on_the_gpu_feeds_back_the_sampled_tokens() {
    let (_dir, files) = model();
    let vocab = files.config.vocab_size;
    // Same lengths, so every decode step has the same batch as with one step at a time and
    // cuBLAS picks the same kernels: the tokens must be equal, bit for bit.
    let requests: Vec<GenerateRequest> = (0..16)
        .map(|i| GenerateRequest {
            prompt: prompt(300 + i, 5 + (i as usize * 11) % 90, vocab),
            params: SamplingParams {
                ignore_eos: true,
                ..greedy(30)
            },
        })
        .collect();
    let (one, one_stats) = serve_on_gpu(&files, &requests, 1, false).await;
    let (four, four_stats) = serve_on_gpu(&files, &requests, 4, false).await;
    assert_eq!(
        one, four,
        "4 decode steps per scheduler step change the tokens"
    );
    let (one_steps, four_steps) = (one_stats.steps, four_stats.steps);
    assert!(
        four_steps * 2 < one_steps,
        "{four_steps} scheduler steps with decode_steps = 4, {one_steps} with 1"
    );
    // Steps planned while the one before them runs, their rows starting from the token the
    // engine picked last: the same tokens again.
    let (overlapped, stats) = serve_on_gpu(&files, &requests, 1, true).await;
    assert_eq!(one, overlapped, "overlapped steps change the tokens");
    assert!(
        stats.planned_ahead * 2 > stats.steps,
        "most steps were planned ahead: {stats:?}"
    );
}

/// A prompt repeated whole on the GPU takes its first token from the logits kept when it was
/// saved: the same first token as the request that computed it (greedy, and seeded at
/// temperature 1, whose uniform the device drew for the first request and the host for the
/// repeat), and as many tokens after it.
#[actix_rt::test]
#[ignore = "needs a CUDA device"]
async fn a_repeated_prompt_s_first_token_comes_from_its_kept_logits_on_the_gpu() {
    let (_dir, files) = model();
    let vocab = files.config.vocab_size;
    let toml = "[snapshots]\nmin_save_tokens = 32\nsave_after_sightings = 1\n";
    let handles = actors::start(
        Box::new(cuda_backend(&files, 1024)),
        serve_config(&files, policies(toml)),
    )
    .unwrap();
    let seeded = SamplingParams {
        temperature: 1.0,
        seed: Some(11),
        ignore_eos: true,
        ..greedy(12)
    };
    let plain = SamplingParams {
        ignore_eos: true,
        ..greedy(12)
    };
    for (i, (len, params)) in [(200, &plain), (213, &plain), (181, &seeded)]
        .into_iter()
        .enumerate()
    {
        let request = GenerateRequest {
            prompt: prompt(500 + i as u64, len, vocab),
            params: params.clone(),
        };
        let cold = handles
            .submit(request.clone())
            .await
            .unwrap()
            .collect()
            .await;
        let before = wait_idle(&handles)
            .await
            .scheduler
            .first_tokens_from_kept_logits;
        let repeat = handles.submit(request).await.unwrap().collect().await;
        assert!(finished(&cold) && finished(&repeat), "prompt {i}");
        let after = wait_idle(&handles)
            .await
            .scheduler
            .first_tokens_from_kept_logits;
        assert_eq!(after, before + 1, "prompt {i} of {len} tokens");
        assert_eq!(repeat.tokens[0], cold.tokens[0], "prompt {i}");
        assert_eq!(repeat.tokens.len(), 12);
    }
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.pool.free_pages, stats.pool.total_pages);
}

/// The corruption drill on the GPU: a thousand prompt snapshots across the device, host and
/// disk tiers, a hundred of them damaged where they lie: one byte flipped in memory, or in a
/// file, or a file cut short. Every request over a damaged snapshot reports no cached tokens
/// (it recomputed), every other restores; each damage is found and counted once (by the
/// restore that read it, the disk read, or the disk write of a demotion); afterwards the
/// engine holds exactly the store's buffers and files, the pool is whole and the server serves.
#[actix_rt::test]
#[ignore = "needs a CUDA device"]
async fn a_corruption_drill_refuses_every_damaged_snapshot_on_the_gpu() {
    use rand::{RngExt, SeedableRng};
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    let (_dir, files) = model();
    let disk = tempfile::tempdir().unwrap();
    let vocab = files.config.vocab_size;
    const PROMPTS: u64 = 1000;
    let page_bytes = (2 * files.config.num_layers * files.config.num_kv_heads)
        * files.config.head_dim
        * 2
        * PAGE;
    let snapshot = 3 * page_bytes as u64;
    // The device tier holds 300 three-page prompts, the host 300, the disk the rest (and room
    // for what the drill saves anew: nothing damaged is evicted unread).
    let toml = format!(
        "[admission]\nmax_running = 64\n\
         [snapshots]\nmin_save_tokens = 32\nsave_after_sightings = 1\nsave_replies = false\n\
         device_budget_bytes = {}\nhost_budget_bytes = {}\ndemote_to_host = true\n\
         disk_dir = \"{}\"\ndisk_budget_bytes = {}\n",
        300 * snapshot,
        300 * snapshot,
        disk.path().display(),
        3 * PROMPTS * snapshot,
    );
    let mut backend = CudaBackend::load(
        &files,
        &CudaOptions {
            device_snapshot_bytes: 300 * snapshot,
            // Room beside the budget for buffers whose disk write is still running.
            host_snapshot_bytes: 600 * snapshot,
            ..CudaOptions::for_tokens(1024 * PAGE, 2048, 64)
        },
    )
    .expect("these tests need a CUDA device");
    backend.wait_for_snapshot_arenas();
    let config = serve_config(&files, policies(&toml));
    let hasher = cache::PrefixHasher::new(cache::PrefixSalt::new(&config.model_id, None), PAGE);
    let handles = actors::start(Box::new(backend), config).unwrap();
    let prompts: Vec<Vec<u32>> = (0..PROMPTS)
        .map(|i| prompt(10_000 + i, 3 * PAGE + 2, vocab))
        .collect();
    for chunk in prompts.chunks(50) {
        let requests: Vec<GenerateRequest> = chunk
            .iter()
            .map(|p| GenerateRequest {
                prompt: p.clone(),
                params: greedy(1),
            })
            .collect();
        for completion in run_all(&handles, &requests).await {
            assert!(finished(&completion), "{:?}", completion.end);
        }
    }
    let saved = settle(&handles, 3000).await;
    let mut stored = handles.snapshots().await;
    stored.sort_by_key(|s| s.id);
    assert_eq!(
        stored.len(),
        PROMPTS as usize,
        "every prompt was saved: {:?}",
        saved.store
    );
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    let mut damaged = std::collections::HashMap::new();
    while damaged.len() < 100 {
        let i = rng.random_range(0..stored.len());
        let info = stored[i];
        if damaged.contains_key(&info.id) {
            continue;
        }
        if info.tier == cache::Tier::Disk {
            let end = hasher.chain(&prompts[i])[2].0;
            let path = disk.path().join(format!("{end:032x}.snap"));
            let mut bytes = std::fs::read(&path).unwrap();
            if damaged.len() % 2 == 0 {
                let at = bytes.len() - 1 - rng.random_range(0..info.bytes as usize);
                bytes[at] ^= 1 << rng.random_range(0..8u32);
            } else {
                bytes.truncate(bytes.len() - 1 - rng.random_range(0..1000usize));
            }
            std::fs::write(&path, bytes).unwrap();
        } else {
            let offset = rng.random_range(0..info.bytes);
            let mask = 1u8 << rng.random_range(0..8u32);
            handles
                .corrupt_snapshot(info.id, offset, mask)
                .await
                .unwrap();
        }
        damaged.insert(info.id, info.tier);
    }
    let tiers = |tier| damaged.values().filter(|&&t| t == tier).count();
    let by_tier = [
        tiers(cache::Tier::Device),
        tiers(cache::Tier::Host),
        tiers(cache::Tier::Disk),
    ];
    assert!(
        by_tier.iter().all(|&n| n > 10),
        "damaged by tier: {by_tier:?}"
    );

    // Each prompt again with a new question, one at a time, in the order saved.
    let mut refused = 0;
    for (info, prompt_tokens) in stored.iter().zip(&prompts) {
        let request = GenerateRequest {
            prompt: [prompt_tokens.clone(), prompt(info.id.0, 5, vocab)].concat(),
            params: greedy(2),
        };
        let completion = handles.submit(request).await.unwrap().collect().await;
        assert!(finished(&completion), "{:?}", completion.end);
        let Event::Finished { usage, .. } = &completion.end else {
            unreachable!("finished")
        };
        if damaged.contains_key(&info.id) {
            assert_eq!(usage.cached_tokens, 0, "{} was damaged", info.id);
            refused += 1;
        } else {
            assert_eq!(usage.cached_tokens, 3 * PAGE, "{} is intact", info.id);
        }
    }
    assert_eq!(refused, 100);
    let stats = settle(&handles, 3000).await;
    // A damaged snapshot may have moved down a tier before it was read (the damage travels
    // with it, sums and all), so only the total is exact.
    let found = stats.scheduler.corrupt_restores;
    assert_eq!(found.iter().sum::<u64>(), 100, "found by tier: {found:?}");
    assert_eq!(stats.pool.free_pages, stats.pool.total_pages);
    let mut held = handles.backings().await;
    let mut listed: Vec<_> = handles
        .snapshots()
        .await
        .iter()
        .map(|s| s.backing)
        .collect();
    held.sort();
    listed.sort();
    assert_eq!(held, listed, "no buffer or file leaked");
    eprintln!(
        "drill: {PROMPTS} snapshots, 100 damaged (device, host, disk: {by_tier:?}), 100 refused and \
         recomputed, found where read (device, host, disk): {found:?}"
    );
}

/// A prompt scored on the GPU (`prompt_logprobs`, a completion's `echo` with `logprobs`):
/// every token after the first gets a log-probability, over chunks of 32 tokens; the
/// likeliest token after a prefix has what a greedy pick after that prefix reports (within
/// the GPU's batch-dependent rounding; on random weights the likeliest may be a near tie, so
/// the logprobs are compared, not the tokens).
#[actix_rt::test]
#[ignore = "needs a CUDA device"]
async fn a_prompt_is_scored_on_the_gpu() {
    let (_dir, files) = model();
    let vocab = files.config.vocab_size;
    let toml = "[admission]\nstep_token_budget = 32\n";
    let handles = actors::start(
        Box::new(cuda_backend(&files, 1024)),
        serve_config(&files, policies(toml)),
    )
    .unwrap();
    let prompt = prompt(900, 100, vocab);
    let params = SamplingParams {
        prompt_logprobs: Some(1),
        ignore_eos: true,
        ..greedy(1)
    };
    let mut stream = handles
        .submit(GenerateRequest {
            prompt: prompt.clone(),
            params,
        })
        .await
        .unwrap();
    assert!(matches!(stream.next().await, Some(Event::Token(_))));
    let scores = stream.take_prompt_logprobs();
    assert_eq!(scores.len(), prompt.len() - 1);
    for (k, score) in scores.iter().enumerate() {
        assert_eq!(score.token, prompt[k + 1]);
        assert_eq!(score.top.len(), 1);
        assert!(score.logprob <= score.top[0].1 + 1e-4, "token {}", k + 1);
    }
    for k in [1, 31, 32, 33, 64, 99] {
        let params = SamplingParams {
            logprobs: Some(0),
            ignore_eos: true,
            ..greedy(1)
        };
        let mut greedy = handles
            .submit(GenerateRequest {
                prompt: prompt[..k].to_vec(),
                params,
            })
            .await
            .unwrap();
        assert!(matches!(greedy.next().await, Some(Event::Token(_))));
        let picked = greedy.logprobs().expect("asked for").logprob;
        let likeliest = scores[k - 1].top[0].1;
        assert!(
            (picked - likeliest).abs() < 0.05,
            "after {k} tokens: greedy {picked}, scored {likeliest}"
        );
    }
    let stats = wait_idle(&handles).await;
    assert_eq!(stats.pool.free_pages, stats.pool.total_pages);
}
