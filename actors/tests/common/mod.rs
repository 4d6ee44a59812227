//! Shared by the actor tests: real models (a small random-weight one written by the test, and
//! the real SmolLM2), CPU backends, configurations and the solo-run oracle.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use actors::{Completion, Event, FinishReason, GenerateRequest, Handles, ServeConfig};
use cache::{BackingId, PageClone, PageCopy, Tier};
use engine::backend::{Backend, BackendInfo, HostRun, MemoryReport, StepOutput, StepPlan};
use engine::cpu::{CpuBackend, CpuOptions};
use engine::generate::{Vocabulary, generate};
use engine::model::ModelFiles;
use engine::model::synthetic::{self, SyntheticSpec};
use engine::sampling::SamplingParams;
use engine::{DType, EngineError};
use policy::Policies;

pub const PAGE: usize = 16;

/// A two-layer random-weight model, written into a temporary folder.
pub struct TinyModel {
    _dir: tempfile::TempDir,
    pub files: ModelFiles,
}

impl TinyModel {
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let spec = SyntheticSpec {
            max_position_embeddings: 512,
            ..SyntheticSpec::tiny(42)
        };
        synthetic::write(dir.path(), &spec).unwrap();
        let files = ModelFiles::open(dir.path()).unwrap();
        TinyModel { _dir: dir, files }
    }
}

/// The real SmolLM2 f32 folder, fetched into the shared model cache on first use.
pub fn smollm2() -> PathBuf {
    let cache = std::env::var_os("SNAPSERVE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| engine::fetch::default_cache_dir(std::env::home_dir().as_deref()));
    engine::fetch::fetch(
        &engine::fetch::SMOLLM2,
        &engine::fetch::FetchOptions::new(cache, DType::F32),
    )
    .expect("fetching SmolLM2")
}

pub fn cpu_backend(files: &ModelFiles, pages: usize) -> CpuBackend {
    CpuBackend::load(
        files,
        &CpuOptions {
            threads: 2,
            page_tokens: PAGE,
            num_pages: pages,
            int8_inputs: false,
        },
    )
    .unwrap()
}

/// Policies from TOML, with the page size the tests' backends use.
pub fn policies(toml: &str) -> Policies {
    Policies::from_toml(&format!("[cache]\npage_tokens = {PAGE}\n{toml}")).unwrap()
}

pub fn serve_config(files: &ModelFiles, policies: Policies) -> ServeConfig {
    ServeConfig {
        policies,
        model_id: files.dir.display().to_string(),
        eos_token_ids: files.eos_token_ids.clone(),
        seed: 7,
        verify_steps: Vec::new(),
    }
}

pub fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..SamplingParams::default()
    }
}

/// A prompt of `len` token ids drawn from `seed` (ids 3.. avoid the specials).
pub fn prompt(seed: u64, len: usize, vocab: usize) -> Vec<u32> {
    let mut s = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            3 + ((s >> 33) % (vocab as u64 - 3)) as u32
        })
        .collect()
}

/// What `request` produces run alone, start to finish, on a fresh backend of its own.
pub fn solo(files: &ModelFiles, request: &GenerateRequest) -> Vec<u32> {
    let mut backend = cpu_backend(
        files,
        (request.prompt.len() + request.params.max_tokens).div_ceil(PAGE) + 1,
    );
    let vocab = Vocabulary {
        tokenizer: &files.tokenizer,
        eos_token_ids: &files.eos_token_ids,
    };
    generate(
        &mut backend,
        &vocab,
        &request.prompt,
        &request.params,
        64,
        |_| {},
    )
    .unwrap()
    .tokens
}

/// Submits every request (so they all run together), then reads each stream to its end.
pub async fn run_all(handles: &Handles, requests: &[GenerateRequest]) -> Vec<Completion> {
    // Sent in one poll: every request is in the admission's mailbox (an actor on this thread)
    // before it handles the first, so which step admits which request does not depend on the
    // engine's speed. Awaited one by one, each submission waited
    // for its reply while the first steps ran, and how many joined which step depended on the
    // timing (a multi-step GPU test comparing tokens bit for bit failed one run in three).
    let submitted =
        futures_util::future::join_all(requests.iter().map(|r| handles.submit(r.clone()))).await;
    let streams: Vec<_> = submitted.into_iter().map(Result::unwrap).collect();
    let mut completions = Vec::new();
    for stream in streams {
        completions.push(stream.collect().await);
    }
    completions
}

/// Asserts that each request finished with exactly the tokens of its solo run.
pub fn assert_match_solo(completions: &[Completion], expected: &[Vec<u32>], labels: &[String]) {
    for (i, (completion, expected)) in completions.iter().zip(expected).enumerate() {
        let label = labels.get(i).map_or(String::new(), |l| format!(" ({l})"));
        assert!(
            finished(completion),
            "request {i}{label} ended with {:?}",
            completion.end
        );
        assert_eq!(
            &completion.tokens, expected,
            "request {i}{label} differs from its solo run"
        );
    }
}

pub fn finished(completion: &Completion) -> bool {
    matches!(
        completion.end,
        Event::Finished {
            reason: FinishReason::Stop | FinishReason::Length,
            ..
        }
    )
}

/// Waits until the scheduler has no work and every page is free again.
pub async fn wait_idle(handles: &Handles) -> actors::Stats {
    for _ in 0..500 {
        let stats = handles.stats().await;
        if stats.scheduler.running == 0
            && stats.scheduler.queued == 0
            && stats.pool.free_pages == stats.pool.total_pages
        {
            return stats;
        }
        actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("not idle: {:?}", handles.stats().await);
}

/// Waits (up to `polls` checks 10 ms apart) until the actors are idle and no snapshot is moving
/// between tiers: every demotion and promotion has landed in the store.
pub async fn settle(handles: &Handles, polls: usize) -> actors::Stats {
    for _ in 0..polls {
        let stats = wait_idle(handles).await;
        let moving = handles
            .snapshots()
            .await
            .iter()
            .any(|s| s.state != cache::SnapshotState::Ready);
        if !moving {
            return stats;
        }
        actix_rt::time::sleep(std::time::Duration::from_millis(10)).await;
    }
    panic!("snapshots still moving between tiers");
}

/// A CPU backend whose forward pass fails at one chosen step: the engine error of a real
/// device (an out-of-memory, a driver fault), injected where a test wants it.
pub struct FailingBackend {
    pub inner: CpuBackend,
    pub fail_at_step: usize,
    pub steps: usize,
    /// Set when the backend is dropped.
    pub dropped: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Drop for FailingBackend {
    fn drop(&mut self) {
        self.dropped
            .store(true, std::sync::atomic::Ordering::SeqCst);
    }
}

impl Backend for FailingBackend {
    fn info(&self) -> &BackendInfo {
        self.inner.info()
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput, EngineError> {
        self.steps += 1;
        if self.steps == self.fail_at_step {
            return Err(EngineError::InvalidStep(format!(
                "injected failure at step {}",
                self.steps
            )));
        }
        self.inner.step(plan)
    }

    fn alloc_backing(
        &mut self,
        backing: BackingId,
        tier: Tier,
        bytes: u64,
    ) -> Result<(), EngineError> {
        self.inner.alloc_backing(backing, tier, bytes)
    }

    fn free_backing(&mut self, backing: BackingId) -> Result<(), EngineError> {
        self.inner.free_backing(backing)
    }

    fn save_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<(), EngineError> {
        self.inner.save_pages(backing, copies)
    }

    fn restore_pages(
        &mut self,
        backing: BackingId,
        copies: &[PageCopy],
    ) -> Result<(), EngineError> {
        self.inner.restore_pages(backing, copies)
    }

    fn clone_pages(&mut self, clones: &[PageClone]) -> Result<(), EngineError> {
        self.inner.clone_pages(clones)
    }

    fn copy_backing(&mut self, from: BackingId, to: BackingId) -> Result<(), EngineError> {
        self.inner.copy_backing(from, to)
    }

    fn finished_copies(&mut self, wait: bool) -> Vec<(BackingId, Result<(), EngineError>)> {
        self.inner.finished_copies(wait)
    }

    fn backing_ids(&self) -> Vec<BackingId> {
        self.inner.backing_ids()
    }

    fn restore_verdicts(&mut self) -> Result<Vec<bool>, EngineError> {
        self.inner.restore_verdicts()
    }
    fn backing_sums(&mut self, backing: BackingId) -> Result<Vec<u64>, EngineError> {
        self.inner.backing_sums(backing)
    }
    fn set_backing_sums(&mut self, backing: BackingId, sums: &[u64]) -> Result<(), EngineError> {
        self.inner.set_backing_sums(backing, sums)
    }
    fn host_runs(&mut self, backing: BackingId) -> Result<Vec<HostRun>, EngineError> {
        self.inner.host_runs(backing)
    }
    fn read_backing(&mut self, backing: BackingId) -> Result<Vec<u8>, EngineError> {
        self.inner.read_backing(backing)
    }
    fn flip_byte(&mut self, backing: BackingId, offset: u64, mask: u8) -> Result<(), EngineError> {
        self.inner.flip_byte(backing, offset, mask)
    }
    fn memory(&self) -> MemoryReport {
        self.inner.memory()
    }
}

pub fn model_dir_of(files: &ModelFiles) -> &Path {
    &files.dir
}
