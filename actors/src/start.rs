//! Starting the actors around a backend, and the handles callers use.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use actix::{Actor, Addr, SyncArbiter};
use cache::{
    CacheError, PagePool, PoolConfig, PoolStats, PrefixSalt, SnapshotGeometry, SnapshotId,
    SnapshotInfo, SnapshotStore as Store, StoreStats, Tier,
};
use engine::backend::{Backend, MemoryReport};
use policy::Policies;

use crate::admission::{
    Admission, Cancel, CutAll, Drain, GetSchedulerStats, Submit, SubmitChoices, SubmitKept,
};
use crate::engine::{Engine, FlipByte, FlushToDisk, FreeBacking, GetBackings, GetMemory};
use crate::error::ServeError;
use crate::kv_pool::{GetPoolStats, KvPool};
use crate::request::{Event, GenerateRequest, RequestId, RequestStream, Usage};
use crate::scheduler::{Scheduler, SchedulerConfig, SchedulerStats, SequenceLimit};
use crate::snapshot_store::{
    DiscardSnapshot, GetSnapshot, GetStoreStats, ListSnapshots, PlanFlush, SnapshotStore,
};
use engine::disk::DiskTier;

/// What the actors are built from besides the backend.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    pub policies: Policies,
    /// Names the model in prefix hashes, so one model's snapshots never match another's.
    pub model_id: String,
    pub eos_token_ids: Vec<u32>,
    /// Seeds back-off jitter.
    pub seed: u64,
    /// Verification steps timed at start-up (their tokens, seconds): the scheduler's cost of
    /// drafts starts from them and keeps them as anchors ([`policy::StepTimeModel::anchor`]).
    pub verify_steps: Vec<(usize, f64)>,
}

/// The running actors.
#[derive(Clone)]
pub struct Handles {
    pub admission: Addr<Admission>,
    pub pool: Addr<KvPool>,
    pub store: Addr<SnapshotStore>,
    pub engine: Addr<Engine>,
    /// The most positions one sequence may hold (the model's context, or a smaller pool).
    pub limit: SequenceLimit,
    engine_alive: Arc<AtomicBool>,
}

/// Every actor's counters at one moment.
#[derive(Debug, Clone, PartialEq)]
pub struct Stats {
    pub scheduler: SchedulerStats,
    pub pool: PoolStats,
    pub store: StoreStats,
    pub memory: MemoryReport,
}

/// The four actors' states before they start: what [`start`] runs, and what a benchmark or
/// test can drive on one thread without messages.
pub struct Parts {
    pub scheduler: Scheduler,
    pub pool: KvPool,
    pub store: SnapshotStore,
    pub engine: Engine,
    /// The `Admission` mailbox's capacity.
    pub mailbox: usize,
}

/// Builds the actors' states around a backend.
///
/// Fails when the configuration does not fit the backend (its pages are another size).
pub fn build(backend: Box<dyn Backend>, config: ServeConfig) -> Result<Parts, ServeError> {
    let info = backend.info().clone();
    let policies = &config.policies;
    let page_tokens = info.geometry.page_tokens;
    if policies.cache.page_tokens() != page_tokens {
        let configured = policies.cache.page_tokens();
        return Err(ServeError::Invalid(format!(
            "cache.page_tokens is {configured} but the backend was built with {page_tokens}-token pages"
        )));
    }
    let max_running = policies.admission.max_running();
    let pool = PagePool::new(PoolConfig {
        total_pages: info.num_pages as u32,
        page_tokens,
        max_slots: max_running as u32,
        reservation: policies.cache.reservation(),
    });
    let on_gpu = info.name == "cuda";
    let mut store = Store::new(
        SnapshotGeometry {
            kv: info.geometry,
            fixed_state_bytes: 0,
        },
        &policies.snapshots,
    );
    store.set_save_after_sightings(policies.snapshots.save_after_sightings(on_gpu));
    let salt = PrefixSalt::new(&config.model_id, None);
    let mut engine = Engine::new(backend, config.eos_token_ids.clone());
    if let Some(dir) = policies.snapshots.disk_dir() {
        if on_gpu && policies.snapshots.host_budget_bytes() == 0 {
            tracing::warn!(
                "snapshots.disk_dir is set without snapshots.host_budget_bytes: on a GPU the \
                 disk tier reads snapshots back into the host tier, so none will be restored"
            );
        }
        let (mut disk, found) = DiskTier::open(dir, salt.0, store.geometry()).map_err(|e| {
            ServeError::Invalid(format!("opening snapshots.disk_dir {}: {e}", dir.display()))
        })?;
        // Oldest use first: the most recent are the last the budget would refuse.
        let (mut adopted, mut bytes) = (0, 0);
        for file in found {
            match store.adopt_disk(&file.chain, file.kept) {
                Ok((_, backing)) => {
                    disk.bind(backing, &file);
                    adopted += 1;
                    bytes += file.bytes;
                }
                Err(e) => {
                    tracing::warn!(
                        "snapshot disk tier: not keeping {}: {e}",
                        file.path.display()
                    );
                    let _ = std::fs::remove_file(&file.path);
                }
            }
        }
        if adopted > 0 {
            tracing::info!(
                "snapshot disk tier: {adopted} snapshots ({:.2} GiB) from before the start are findable",
                bytes as f64 / (1u64 << 30) as f64
            );
        }
        engine = engine.with_disk(disk);
    }
    let mut scheduler = Scheduler::new(SchedulerConfig {
        max_queue: policies.admission.max_queue(),
        max_running,
        step_token_budget: policies.admission.step_token_budget(),
        max_step: policies.admission.max_step(on_gpu),
        decode_steps: policies.admission.decode_steps(),
        page_tokens,
        total_pages: info.num_pages,
        context_tokens: info.max_positions,
        vocab_size: info.vocab_size,
        eos_token_ids: config.eos_token_ids.clone(),
        reservation: policies.cache.reservation(),
        backoff: policies.backoff.clone(),
        save_prompts: policies.snapshots.save_prompts(),
        min_save_tokens: policies.snapshots.min_save_tokens(),
        save_replies: policies.snapshots.save_replies(),
        prompt_logits_bytes: policies.snapshots.prompt_logits_bytes(),
        save_tier: Tier::Device,
        speculative: policies.speculative.clone(),
        overlap: policies.admission.overlap_steps(),
        salt,
        seed: config.seed,
    });
    scheduler.anchor_verify_steps(&config.verify_steps);
    Ok(Parts {
        scheduler,
        pool: KvPool::new(pool),
        store: SnapshotStore::new(store),
        engine,
        mailbox: policies.admission.max_queue() + 64,
    })
}

/// Starts the four actors on the current actix system; the backend moves to its own thread.
///
/// Fails when the configuration does not fit the backend (its pages are another size).
pub fn start(backend: Box<dyn Backend>, config: ServeConfig) -> Result<Handles, ServeError> {
    let parts = build(backend, config)?;
    let engine_alive = parts.engine.alive();
    let interrupt = parts.engine.interrupt();
    let limit = parts.scheduler.limit();
    // The arbiter asks for a factory it may call again; the engine exists once.
    let engine = std::sync::Mutex::new(Some(parts.engine));
    let engine = SyncArbiter::start(1, move || {
        let engine = engine.lock().expect("no panic holds this lock").take();
        engine.expect("the engine actor is created once")
    });
    let pool = parts.pool.start();
    let store = parts.store.start();
    let admission = Admission::new(
        parts.scheduler,
        pool.clone(),
        store.clone(),
        engine.clone(),
        interrupt,
        parts.mailbox,
    )
    .start();
    Ok(Handles {
        admission,
        pool,
        store,
        engine,
        limit,
        engine_alive,
    })
}

impl Handles {
    /// Queues a request; `Overloaded` when the queue is full, `Invalid` when it can never run.
    pub async fn submit(&self, request: GenerateRequest) -> Result<RequestStream, ServeError> {
        self.admission
            .send(Submit(request))
            .await
            .map_err(|_| ServeError::ShuttingDown)?
    }

    /// Submits `n` choices of one request, which compute the prompt once: one stream each, in
    /// order, choice `i` drawing from `seed + i` when seeded.
    pub async fn submit_choices(
        &self,
        request: GenerateRequest,
        n: usize,
    ) -> Result<Vec<RequestStream>, ServeError> {
        let mut streams = self.submit_prompts(vec![request], n).await?;
        Ok(streams.pop().expect("one prompt submitted"))
    }

    /// Submits `n` choices of each request of a list (a completion's list of prompts), all or
    /// none: the streams per request, in order.
    pub async fn submit_prompts(
        &self,
        requests: Vec<GenerateRequest>,
        n: usize,
    ) -> Result<Vec<Vec<RequestStream>>, ServeError> {
        self.admission
            .send(SubmitChoices(requests, n))
            .await
            .map_err(|_| ServeError::ShuttingDown)?
    }

    /// Computes `prompt` and keeps its whole pages as a snapshot that is never evicted (an
    /// operator's pinned prefix); answers that snapshot once saved.
    pub async fn keep_prefix(&self, prompt: Vec<u32>) -> Result<SnapshotInfo, ServeError> {
        let stream = self
            .admission
            .send(SubmitKept(prompt))
            .await
            .map_err(|_| ServeError::ShuttingDown)??;
        match stream.collect().await.end {
            Event::Finished {
                usage:
                    Usage {
                        kept: Some(snapshot),
                        ..
                    },
                ..
            } => self.published(snapshot).await,
            Event::Finished { .. } => Err(ServeError::NotKept("its prompt was not saved".into())),
            Event::Failed(error) => Err(error),
            Event::Cancelled => Err(ServeError::Cancelled),
            Event::Token(_) => unreachable!("collect ends at the terminal event"),
        }
    }

    /// Snapshot `id` once its save is committed (at the step after its copy; the scheduler
    /// runs that step at once).
    async fn published(&self, id: SnapshotId) -> Result<SnapshotInfo, ServeError> {
        for _ in 0..1000 {
            match self.snapshot(id).await {
                Ok(info) if info.state == cache::SnapshotState::Saving => {
                    actix_rt::time::sleep(std::time::Duration::from_millis(1)).await;
                }
                Ok(info) => return Ok(info),
                Err(e) => {
                    return Err(ServeError::NotKept(format!(
                        "{id} went before it was answered: {e}"
                    )));
                }
            }
        }
        Err(ServeError::NotKept(format!("{id} is still being saved")))
    }

    /// Every snapshot the store holds.
    pub async fn snapshots(&self) -> Vec<SnapshotInfo> {
        self.store.send(ListSnapshots).await.unwrap_or_default()
    }

    /// What the store knows of one snapshot.
    pub async fn snapshot(&self, id: SnapshotId) -> Result<SnapshotInfo, CacheError> {
        self.store
            .send(GetSnapshot(id))
            .await
            .unwrap_or(Err(CacheError::UnknownSnapshot { snapshot: id }))
    }

    /// Drops a snapshot, kept or not, unless a restore is reading it; the engine frees its
    /// buffer after the steps already queued.
    pub async fn discard_snapshot(&self, id: SnapshotId) -> Result<(), CacheError> {
        let backing = self
            .store
            .send(DiscardSnapshot(id))
            .await
            .unwrap_or(Err(CacheError::UnknownSnapshot { snapshot: id }))?;
        self.engine.do_send(FreeBacking(backing));
        Ok(())
    }

    /// The snapshot buffers the engine holds now (every one should be a stored snapshot's).
    pub async fn backings(&self) -> Vec<cache::BackingId> {
        self.engine.send(GetBackings).await.unwrap_or_default()
    }

    /// Fault injection for drills and tests: XORs byte `offset` of snapshot `id`'s buffer with
    /// `mask` (a bad memory cell). The next restore of it is refused and recomputes.
    pub async fn corrupt_snapshot(
        &self,
        id: SnapshotId,
        offset: u64,
        mask: u8,
    ) -> Result<(), String> {
        let info = self
            .store
            .send(GetSnapshot(id))
            .await
            .map_err(|e| e.to_string())?
            .map_err(|e| e.to_string())?;
        let backing = info.demoting_from.unwrap_or(info.backing);
        self.engine
            .send(FlipByte {
                backing,
                offset,
                mask,
            })
            .await
            .map_err(|e| e.to_string())?
    }

    /// Cancels a request; it ends with `Cancelled` within one step.
    pub fn cancel(&self, id: RequestId) {
        self.admission.do_send(Cancel(id));
    }

    /// Stops taking requests: new ones are refused with `ShuttingDown`, those in flight go on.
    pub async fn drain(&self) {
        let _ = self.admission.send(Drain).await;
    }

    /// Ends every request in flight with `ShuttingDown` within a step; returns how many.
    pub async fn cut_all(&self) -> usize {
        self.admission.send(CutAll).await.unwrap_or(0)
    }

    /// Whether the engine can still run steps: false after [`Handles::shutdown`] or once its
    /// thread has died.
    pub fn engine_alive(&self) -> bool {
        self.engine_alive.load(Ordering::SeqCst)
    }

    /// Writes the snapshots still in memory to the disk tier (most recently used first, as
    /// many as its budget holds) and waits for every file; answers how many were written. Call
    /// it once no request runs: a clean shutdown's last step before [`Handles::shutdown`].
    pub async fn flush_to_disk(&self) -> usize {
        let Ok(plan) = self.store.send(PlanFlush).await else {
            return 0;
        };
        self.engine.send(FlushToDisk(plan)).await.unwrap_or(0)
    }

    /// Releases the backend on the engine's thread and waits until it is gone; requests still
    /// running fail. Call it before the process exits, so no thread is still tearing a GPU
    /// context down when the CUDA libraries unload.
    pub async fn shutdown(&self) {
        let _ = self.engine.send(crate::engine::Shutdown).await;
    }

    /// The scheduler's counters alone: answered while the engine runs a step (`stats` waits for
    /// the step to end, since the engine reports its memory between steps).
    pub async fn scheduler_stats(&self) -> SchedulerStats {
        self.admission
            .send(GetSchedulerStats)
            .await
            .expect("the actors run as long as their handles")
    }

    pub async fn stats(&self) -> Stats {
        let stopped = "the actors run as long as their handles";
        Stats {
            scheduler: self.admission.send(GetSchedulerStats).await.expect(stopped),
            pool: self.pool.send(GetPoolStats).await.expect(stopped),
            store: self.store.send(GetStoreStats).await.expect(stopped),
            memory: self.engine.send(GetMemory).await.expect(stopped),
        }
    }
}
