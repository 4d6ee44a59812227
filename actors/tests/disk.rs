//! The disk tier through the actors, on the CPU: snapshots evicted from memory are written to
//! files and read back on a hit; a clean shutdown flushes what is in memory and a restart finds
//! it; files cut short, half-written, of another model or flipped on disk are never served.

mod common;

use std::path::Path;

use actors::{Event, GenerateRequest, Handles};
use common::*;

/// Snapshot pages of the tiny model, in bytes (f32 K and V of every layer).
fn page_bytes(model: &TinyModel) -> usize {
    let c = &model.files.config;
    2 * c.num_layers * c.num_kv_heads * c.head_dim * 4 * PAGE
}

/// Memory for `memory_snapshots` three-page snapshots, the disk for `disk_snapshots`.
fn config(model: &TinyModel, dir: &Path, memory_snapshots: usize, disk_snapshots: usize) -> String {
    let snapshot = 3 * page_bytes(model);
    format!(
        "[snapshots]\nmin_save_tokens = 32\nsave_replies = false\n\
         device_budget_bytes = {}\ndisk_dir = \"{}\"\ndisk_budget_bytes = {}\n",
        memory_snapshots * snapshot,
        dir.display(),
        disk_snapshots * snapshot
    )
}

fn start(model: &TinyModel, toml: &str) -> Handles {
    let _ = tracing_subscriber::fmt().with_test_writer().try_init();
    actors::start(
        Box::new(cpu_backend(&model.files, 64)),
        serve_config(&model.files, policies(toml)),
    )
    .unwrap()
}

/// A three-page prompt of its own per `seed`, and a question after it.
fn ask(model: &TinyModel, seed: u64, question: u64) -> GenerateRequest {
    let vocab = model.files.config.vocab_size;
    GenerateRequest {
        prompt: [
            prompt(seed, 3 * PAGE + 2, vocab),
            prompt(question, 7, vocab),
        ]
        .concat(),
        params: greedy(5),
    }
}

/// Runs `request`; returns its tokens and the prompt tokens it was served from snapshots.
async fn run(handles: &Handles, request: GenerateRequest) -> (Vec<u32>, usize) {
    let completion = handles.submit(request).await.unwrap().collect().await;
    assert!(finished(&completion), "{:?}", completion.end);
    let Event::Finished { usage, .. } = &completion.end else {
        unreachable!("finished")
    };
    (completion.tokens, usage.cached_tokens)
}

fn files_in(dir: &Path, ext: &str) -> Vec<std::path::PathBuf> {
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == ext))
        .collect();
    files.sort();
    files
}

#[actix_rt::test]
async fn evicted_snapshots_go_to_disk_and_come_back_on_a_hit() {
    let model = TinyModel::new();
    let dir = tempfile::tempdir().unwrap();
    let handles = start(&model, &config(&model, dir.path(), 2, 10));
    for seed in 1..=4 {
        run(&handles, ask(&model, seed, 100 + seed)).await;
    }
    let stats = settle(&handles, 200).await;
    assert_eq!(
        (stats.store.device.snapshots, stats.store.disk.snapshots),
        (2, 2),
        "the two least recent went to disk: {:?}",
        stats.store
    );
    assert_eq!(files_in(dir.path(), "snap").len(), 2);
    let manifest: serde_json::Value =
        serde_json::from_slice(&std::fs::read(dir.path().join("manifest.json")).unwrap()).unwrap();
    assert_eq!(manifest["snapshots"].as_array().unwrap().len(), 2);

    // The first prompt again: read back from disk, restored, the cold run's tokens.
    let again = ask(&model, 1, 999);
    let expected = solo(&model.files, &again);
    let (tokens, cached) = run(&handles, again).await;
    assert_eq!(tokens, expected);
    assert_eq!(cached, 3 * PAGE, "restored after its promotion");
    let stats = settle(&handles, 200).await;
    assert_eq!(stats.store.promotions, 1);
    let mut held = handles.backings().await;
    let mut listed: Vec<_> = handles
        .snapshots()
        .await
        .iter()
        .map(|s| s.backing)
        .collect();
    held.sort();
    listed.sort();
    assert_eq!(held, listed, "every buffer and file is a listed snapshot's");
    assert_eq!(
        files_in(dir.path(), "snap").len() as u64,
        stats.store.disk.snapshots as u64
    );
}

#[actix_rt::test]
async fn a_restart_finds_what_a_clean_shutdown_flushed() {
    let model = TinyModel::new();
    let dir = tempfile::tempdir().unwrap();
    let toml = config(&model, dir.path(), 8, 10);
    let first = start(&model, &toml);
    for seed in 1..=3 {
        run(&first, ask(&model, seed, 10 + seed)).await;
    }
    settle(&first, 200).await;
    assert!(files_in(dir.path(), "snap").is_empty(), "all fit in memory");
    assert_eq!(first.flush_to_disk().await, 3);
    first.shutdown().await;
    assert_eq!(files_in(dir.path(), "snap").len(), 3);

    let second = start(&model, &toml);
    assert_eq!(second.stats().await.store.disk.snapshots, 3);
    for seed in 1..=3 {
        let request = ask(&model, seed, 50 + seed);
        let expected = solo(&model.files, &request);
        let (tokens, cached) = run(&second, request).await;
        assert_eq!(tokens, expected);
        assert_eq!(
            cached,
            3 * PAGE,
            "prompt {seed} was a hit after the restart"
        );
    }
}

#[actix_rt::test]
async fn bad_files_are_dropped_at_start_or_refused_when_read() {
    let model = TinyModel::new();
    let dir = tempfile::tempdir().unwrap();
    let toml = config(&model, dir.path(), 8, 10);
    let first = start(&model, &toml);
    for seed in 1..=4 {
        run(&first, ask(&model, seed, 10 + seed)).await;
    }
    settle(&first, 200).await;
    assert_eq!(first.flush_to_disk().await, 4);
    first.shutdown().await;
    let files = files_in(dir.path(), "snap");
    assert_eq!(files.len(), 4);
    // One cut short, one flipped in its payload, one left half-written by a crash (a kill -9
    // during its write), one of another model.
    let cut = std::fs::read(&files[0]).unwrap();
    std::fs::write(&files[0], &cut[..cut.len() - 1000]).unwrap();
    let mut flipped = std::fs::read(&files[1]).unwrap();
    let at = flipped.len() - 777;
    flipped[at] ^= 0x20;
    std::fs::write(&files[1], &flipped).unwrap();
    std::fs::write(dir.path().join("abc.tmp"), &cut[..4096]).unwrap();
    let other = TinyModel::new();
    let other_dir = tempfile::tempdir().unwrap();
    let foreign = actors::start(
        Box::new(cpu_backend(&other.files, 64)),
        actors::ServeConfig {
            model_id: "another model".into(),
            ..serve_config(
                &other.files,
                policies(&config(&other, other_dir.path(), 8, 10)),
            )
        },
    )
    .unwrap();
    run(&foreign, ask(&other, 9, 9)).await;
    settle(&foreign, 200).await;
    assert_eq!(foreign.flush_to_disk().await, 1);
    foreign.shutdown().await;
    let foreign_file = &files_in(other_dir.path(), "snap")[0];
    std::fs::copy(foreign_file, dir.path().join("f0reign.snap")).unwrap();

    let second = start(&model, &toml);
    let stats = second.stats().await;
    assert_eq!(
        stats.store.disk.snapshots, 3,
        "the cut and foreign files were dropped at start"
    );
    assert!(!files[0].exists() && !dir.path().join("abc.tmp").exists());
    assert!(!dir.path().join("f0reign.snap").exists());

    // Every prompt again: the flipped file is refused when read, and its request recomputes.
    let seeds: Vec<u64> = (1..=4).collect();
    let mut cached_by_seed = Vec::new();
    for &seed in &seeds {
        let request = ask(&model, seed, 70 + seed);
        let expected = solo(&model.files, &request);
        let (tokens, cached) = run(&second, request).await;
        assert_eq!(tokens, expected, "prompt {seed}: no corrupt KV was served");
        cached_by_seed.push(cached);
    }
    let stats = settle(&second, 200).await;
    assert_eq!(stats.scheduler.corrupt_restores, [0, 0, 1]);
    assert_eq!(
        cached_by_seed.iter().filter(|&&c| c == 0).count(),
        2,
        "the cut file's prompt and the flipped one's were computed: {cached_by_seed:?}"
    );
    assert!(!files[1].exists(), "the flipped file was deleted");
}
