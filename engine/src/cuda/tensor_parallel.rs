//! One model split over several GPUs of this host (tensor parallelism), behind the same
//! [`Backend`] interface as one GPU, so the actors do not change shape.
//!
//! Rank 0 runs on the caller's thread (the engine actor's) and every other rank on a thread of
//! its own, each a [`CudaBackend`] owning its device's context, stream, weights shard, KV pool
//! and snapshot buffers. A step goes to every rank at once: rank 0 runs it as one GPU would,
//! with the samplers; the others run the same passes (the same graphs, the same exchanges, see
//! [`super::collective`]) and return nothing but success. The pool's page ids and the snapshot
//! store's buffer ids are the same on every rank, each rank holding its own KV heads' bytes
//! for them; a snapshot copy is done when every rank has done it, and a restore is sound only
//! if every rank's copy checks out. A rank's failure fails the call, and a failed step resets
//! every rank's exchanges, so the ranks never go on out of step.

use std::any::Any;
use std::collections::HashMap;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::mpsc;
use std::thread::JoinHandle;

use cache::{BackingId, PageClone, PageCopy, Tier};
use policy::PoolSize;

use super::collective::HostFence;
use super::{CudaBackend, CudaOptions, WeightSource};
use crate::backend::{Backend, BackendInfo, HostRun, MemoryReport, StepOutput, StepPlan};
use crate::error::{EngineError, Result};
use crate::model::{ModelConfig, ModelFiles, Shard, Weights};
use crate::sampling::Sampler;

/// Set to `EAGER` where ranks share a GPU (see [`prepare_process`]).
const MODULE_LOADING: &str = "CUDA_MODULE_LOADING";

/// Whether two ranks are named on one GPU.
fn shares_a_device(devices: &[usize]) -> bool {
    devices
        .iter()
        .enumerate()
        .any(|(i, d)| devices[..i].contains(d))
}

/// Call at start-up, while the process has one thread and before anything calls CUDA, with
/// the ranks' devices. Where ranks share a GPU, it has CUDA load every kernel when its module
/// loads: loading one lazily, at its first launch, waits for the context to finish what it
/// runs, and one rank's exchange waiting for a peer's launch would then never finish.
pub fn prepare_process(devices: &[usize]) {
    if shares_a_device(devices) && std::env::var_os(MODULE_LOADING).is_none() {
        // SAFETY: the caller promises one thread and no CUDA yet, so nothing reads the
        // environment meanwhile, and the driver reads it when it initializes.
        unsafe { std::env::set_var(MODULE_LOADING, "EAGER") };
    }
}

type Reply = Result<Box<dyn Any + Send>>;
type Job = Box<dyn FnOnce(&mut CudaBackend) -> Reply + Send>;

/// A rank past 0, on its own thread.
struct Follower {
    rank: usize,
    jobs: Option<mpsc::Sender<Job>>,
    replies: mpsc::Receiver<Reply>,
    thread: Option<JoinHandle<()>>,
}

pub struct TensorParallel {
    lead: CudaBackend,
    followers: Vec<Follower>,
    copies: CopyTally,
    /// Every rank's memory plan.
    plans: Vec<String>,
}

impl TensorParallel {
    /// Loads `model`'s weights split over `options.tensor_parallel` GPUs.
    pub fn load(model: &ModelFiles, options: &CudaOptions) -> Result<Self> {
        let weights = Weights::open(&model.dir)?;
        Self::build(
            model.config.clone(),
            options,
            WeightSource::Checkpoint(&weights),
        )
    }

    /// A model of `config`'s shape with weights drawn on the GPUs from `seed`: the same values
    /// as [`CudaBackend::random`] draws on one.
    pub fn random(config: ModelConfig, seed: u64, options: &CudaOptions) -> Result<Self> {
        Self::build(config, options, WeightSource::Random { seed })
    }

    fn build(model: ModelConfig, options: &CudaOptions, source: WeightSource) -> Result<Self> {
        let shards = Shard::group(&model, options.tensor_parallel)?;
        let devices = options.rank_devices();
        if devices.len() != shards.len() {
            return Err(EngineError::TensorParallel(format!(
                "tensor_parallel = {} but {} devices are named ({devices:?})",
                shards.len(),
                devices.len()
            )));
        }
        let shared = shares_a_device(&devices);
        let eager = std::env::var(MODULE_LOADING).is_ok_and(|v| v == "EAGER");
        if shared && !eager {
            return Err(EngineError::TensorParallel(format!(
                "ranks on one GPU ({devices:?}) need {MODULE_LOADING}=EAGER in the environment: \
                 loading a kernel at its first launch waits for the GPU to finish what it runs, \
                 and one rank's exchange waits for the other's launch"
            )));
        }
        // Ranks on one GPU share its `gpu_memory_fraction`: rank 0 plans its pool first, and
        // every rank must then find room for as many pages.
        let sharing = |rank: usize| devices.iter().filter(|&&d| d == devices[rank]).count();
        let on = |rank: usize, pool: PoolSize| CudaOptions {
            device: devices[rank],
            tensor_parallel: 1,
            devices: Vec::new(),
            pool,
            gpu_memory_fraction: options.gpu_memory_fraction / sharing(rank) as f64,
            // A programmatic dependent's blocks sit on the GPU waiting for the kernel before
            // them; on a GPU two ranks share, one rank's waiting blocks can leave no room for
            // the other's exchange, which the kernel before them waits for.
            programmatic_launch: options.programmatic_launch && !shared,
            ..options.clone()
        };
        let fence = shared.then(|| HostFence::new(shards.len()));
        // Rank 0 plans the pool; every other rank holds as many pages.
        let lead = CudaBackend::build(
            model.clone(),
            &on(0, options.pool),
            source,
            shards[0],
            fence.clone(),
        )?;
        let pages = lead.info.num_pages;
        let pool = PoolSize::Tokens((pages * options.page_tokens) as u64);
        let mut ranks = vec![lead];
        let built: Vec<Result<CudaBackend>> = std::thread::scope(|scope| {
            let handles: Vec<_> = shards[1..]
                .iter()
                .map(|&shard| {
                    let (model, options) = (model.clone(), on(shard.rank, pool));
                    let fence = fence.clone();
                    scope.spawn(move || CudaBackend::build(model, &options, source, shard, fence))
                })
                .collect();
            handles
                .into_iter()
                .map(|h| h.join().unwrap_or_else(|_| Err(panicked("loading"))))
                .collect()
        });
        for (rank, backend) in (1..).zip(built) {
            let backend = backend.map_err(|e| rank_error(rank, e))?;
            if backend.info.num_pages != pages {
                return Err(EngineError::TensorParallel(format!(
                    "rank {rank} holds {} KV pages, rank 0 {pages}",
                    backend.info.num_pages
                )));
            }
            ranks.push(backend);
        }
        let plans = ranks
            .iter()
            .enumerate()
            .map(|(rank, b)| format!("rank {rank} of {}: {}", ranks.len(), b.memory_plan()))
            .collect();
        connect(&ranks)?;
        let mut ranks = ranks.into_iter();
        let lead = ranks.next().expect("rank 0 is built first");
        let followers = ranks.enumerate().map(|(i, b)| spawn(i + 1, b)).collect();
        Ok(TensorParallel {
            lead,
            followers,
            copies: CopyTally {
                world: shards.len(),
                pending: HashMap::new(),
            },
            plans,
        })
    }

    pub fn world(&self) -> usize {
        self.followers.len() + 1
    }

    /// Rank 0's backend: its memory plan, device and configuration.
    pub fn lead(&self) -> &CudaBackend {
        &self.lead
    }

    /// Queues `job` on every rank past 0.
    fn send<R: Send + 'static>(
        &self,
        job: impl FnOnce(&mut CudaBackend) -> Result<R> + Send + Clone + 'static,
    ) {
        for follower in &self.followers {
            let job = job.clone();
            let boxed: Job = Box::new(move |b| job(b).map(|r| Box::new(r) as Box<dyn Any + Send>));
            // A follower that has stopped answers nothing: `collect` reports it.
            let _ = follower.jobs.as_ref().map(|jobs| jobs.send(boxed));
        }
    }

    /// Every follower's reply to the job sent last, in rank order; the first failure.
    fn collect<R: 'static>(&self) -> Result<Vec<R>> {
        let mut replies = Vec::with_capacity(self.followers.len());
        let mut failure = None;
        for follower in &self.followers {
            match follower.replies.recv() {
                Ok(Ok(reply)) => {
                    replies.push(*reply.downcast::<R>().expect("a reply of the job's type"))
                }
                Ok(Err(e)) => {
                    failure.get_or_insert(rank_error(follower.rank, e));
                }
                Err(_) => {
                    failure.get_or_insert(EngineError::TensorParallel(format!(
                        "rank {} has stopped",
                        follower.rank
                    )));
                }
            }
        }
        failure.map_or(Ok(replies), Err)
    }

    /// `job` on every rank at once: rank 0's on this thread.
    fn on_all<R: Send + 'static>(
        &mut self,
        job: impl FnOnce(&mut CudaBackend) -> Result<R> + Send + Clone + 'static,
    ) -> Result<(R, Vec<R>)> {
        self.send(job.clone());
        let led = job(&mut self.lead);
        let followed = self.collect::<R>();
        Ok((led?, followed?))
    }

    /// A step's passes on every rank: `follow` on the others while `lead` runs on rank 0. A
    /// failure anywhere, or an exchange that gave up waiting, fails the step on every rank.
    fn step_on_all<L>(
        &mut self,
        follow: impl FnOnce(&mut CudaBackend) -> Result<()> + Send + Clone + 'static,
        lead: impl FnOnce(&mut CudaBackend) -> Result<L>,
    ) -> Result<L> {
        self.send(follow);
        let led = lead(&mut self.lead);
        let followed = self.collect::<()>();
        let outcome = match (led, followed) {
            (Ok(led), Ok(_)) => match self.lead.exchange_timeout() {
                Ok(None) => return Ok(led),
                Ok(Some(_)) => self.timeout_error(),
                Err(e) => e,
            },
            (Err(e), _) | (_, Err(e)) => e,
        };
        if let Err(reset) = self.reset_exchanges() {
            tracing::error!("resetting the ranks' exchanges after a failed step: {reset}");
        }
        Err(outcome)
    }

    /// A step whose exchanges gave up waiting: where each rank waited, and how many exchanges
    /// each ran.
    fn timeout_error(&mut self) -> EngineError {
        let states = self.on_all(|b| b.exchange_state());
        let detail = match states {
            Ok((lead, followed)) => std::iter::once(lead)
                .chain(followed)
                .enumerate()
                .map(|(rank, (timeout, ran))| {
                    format!(
                        "rank {rank} ran {ran} exchanges{}",
                        timeout.map_or(String::new(), |t| format!(": {t}"))
                    )
                })
                .collect::<Vec<_>>()
                .join("; "),
            Err(e) => format!("(the ranks' state could not be read: {e})"),
        };
        EngineError::TensorParallel(format!(
            "a rank did not reach an exchange of the step in time: {detail}"
        ))
    }

    /// Waits for every rank's queued work, then zeroes every rank's exchange state.
    fn reset_exchanges(&mut self) -> Result<()> {
        let reset = self.on_all(|b| b.reset_exchanges()).map(drop);
        if let Some(fence) = self.lead.tp.as_ref().and_then(|tp| tp.collective.fence()) {
            fence.reset();
        }
        reset
    }

    /// Flips bits of a byte of rank `rank`'s copy of a snapshot buffer (tests of validation).
    pub fn flip_byte_on(
        &mut self,
        rank: usize,
        backing: BackingId,
        offset: u64,
        mask: u8,
    ) -> Result<()> {
        if rank == 0 {
            return self.lead.flip_byte(backing, offset, mask);
        }
        let follower = self.followers.iter().position(|f| f.rank == rank);
        let follower = follower
            .ok_or_else(|| EngineError::TensorParallel(format!("there is no rank {rank}")))?;
        let f = &self.followers[follower];
        let job: Job = Box::new(move |b| {
            b.flip_byte(backing, offset, mask)
                .map(|()| Box::new(()) as Box<dyn Any + Send>)
        });
        f.jobs
            .as_ref()
            .and_then(|jobs| jobs.send(job).ok())
            .ok_or_else(|| EngineError::TensorParallel(format!("rank {rank} has stopped")))?;
        match f.replies.recv() {
            Ok(reply) => reply.map(drop),
            Err(_) => Err(EngineError::TensorParallel(format!(
                "rank {rank} has stopped"
            ))),
        }
    }
}

/// Snapshot copies (demotions, promotions) some ranks have reported finished.
struct CopyTally {
    world: usize,
    /// How many ranks reported each, and the first failure.
    pending: HashMap<BackingId, (usize, Result<(), String>)>,
}

impl CopyTally {
    /// Takes one poll's reports from every rank; returns the copies every rank has now
    /// finished, failed where any rank's failed.
    fn add(
        &mut self,
        reports: impl IntoIterator<Item = (BackingId, Result<(), String>)>,
    ) -> Vec<(BackingId, Result<(), String>)> {
        let mut done = Vec::new();
        for (id, result) in reports {
            let entry = self.pending.entry(id).or_insert((0, Ok(())));
            entry.0 += 1;
            if entry.1.is_ok() {
                entry.1 = result;
            }
            if entry.0 == self.world {
                let (_, result) = self.pending.remove(&id).expect("just counted");
                done.push((id, result));
            }
        }
        done
    }
}

/// The verdicts of the restores queued since the last call, one list per rank: a restore is
/// sound only where every rank's copy checked out.
fn every_rank_agrees(mut lead: Vec<bool>, followed: Vec<Vec<bool>>) -> Result<Vec<bool>> {
    for (rank, theirs) in (1..).zip(followed) {
        if theirs.len() != lead.len() {
            return Err(EngineError::TensorParallel(format!(
                "rank {rank} has {} restore verdicts, rank 0 {}",
                theirs.len(),
                lead.len()
            )));
        }
        lead.iter_mut().zip(theirs).for_each(|(v, t)| *v &= t);
    }
    Ok(lead)
}

fn panicked(what: &str) -> EngineError {
    EngineError::TensorParallel(format!("a rank panicked while {what}"))
}

fn rank_error(rank: usize, e: EngineError) -> EngineError {
    match e {
        EngineError::TensorParallel(reason) => EngineError::TensorParallel(reason),
        other => EngineError::TensorParallel(format!("rank {rank}: {other}")),
    }
}

/// Lets every rank reach every other's memory and gives each the group's table.
fn connect(ranks: &[CudaBackend]) -> Result<()> {
    let endpoints: Vec<_> = ranks
        .iter()
        .map(|b| b.endpoint().expect("a rank of a split model has exchanges"))
        .collect();
    for (a, backend) in ranks.iter().enumerate() {
        for (b, peer) in ranks.iter().enumerate() {
            if a != b {
                backend.device().enable_peer_access(peer.device())?;
            }
        }
        backend.connect(&endpoints)?;
    }
    Ok(())
}

/// Starts rank `rank`'s thread, which runs the jobs it is sent until its queue closes.
fn spawn(rank: usize, mut backend: CudaBackend) -> Follower {
    let (jobs, queue) = mpsc::channel::<Job>();
    let (answer, replies) = mpsc::channel();
    let thread = std::thread::Builder::new()
        .name(format!("tp-rank-{rank}"))
        .spawn(move || {
            for job in queue {
                let reply = catch_unwind(AssertUnwindSafe(|| job(&mut backend)))
                    .unwrap_or_else(|_| Err(panicked("running a step")));
                if answer.send(reply).is_err() {
                    break;
                }
            }
        })
        .expect("spawning a rank's thread");
    Follower {
        rank,
        jobs: Some(jobs),
        replies,
        thread: Some(thread),
    }
}

impl Drop for TensorParallel {
    fn drop(&mut self) {
        for follower in &mut self.followers {
            follower.jobs = None;
            if let Some(thread) = follower.thread.take() {
                let _ = thread.join();
            }
        }
    }
}

fn no_disk_tier() -> EngineError {
    EngineError::TensorParallel(
        "the disk snapshot tier does not run with tensor_parallel > 1 yet".into(),
    )
}

impl Backend for TensorParallel {
    fn info(&self) -> &BackendInfo {
        self.lead.info()
    }

    fn step(&mut self, plan: &StepPlan) -> Result<StepOutput> {
        let follow = plan.clone();
        self.step_on_all(move |b| b.step(&follow).map(drop), |b| b.step(plan))
    }

    fn step_and_sample(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
    ) -> Result<Vec<Option<u32>>> {
        let follow = plan.clone();
        self.step_on_all(
            move |b| {
                let mut none: Vec<Option<&mut Sampler>> =
                    (0..follow.rows.len()).map(|_| None).collect();
                b.step_and_sample(&follow, &mut none).map(drop)
            },
            |b| b.step_and_sample(plan, samplers),
        )
    }

    fn step_and_verify(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<&mut Sampler>],
        drafts: &[usize],
    ) -> Result<Vec<Vec<u32>>> {
        crate::backend::check_verify(plan, samplers, drafts)?;
        let route = self.lead.verify_route(plan, samplers, drafts);
        let (follow, follow_drafts) = (plan.clone(), drafts.to_vec());
        self.step_on_all(
            move |b| b.follow_verify(&follow, &follow_drafts, route),
            |b| b.step_and_verify(plan, samplers, drafts),
        )
    }

    fn last_step_kernels(&self) -> Option<usize> {
        self.lead.last_step_kernels()
    }

    fn last_step_captured(&self) -> bool {
        self.lead.last_step_captured()
    }

    fn alloc_backing(&mut self, backing: BackingId, tier: Tier, bytes: u64) -> Result<()> {
        let allocated = self.on_all(move |b| b.alloc_backing(backing, tier, bytes));
        if allocated.is_err() {
            // Some ranks may hold it: none may.
            let _ = self.on_all(move |b| {
                let _ = b.free_backing(backing);
                Ok(())
            });
        }
        allocated.map(drop)
    }

    fn free_backing(&mut self, backing: BackingId) -> Result<()> {
        self.on_all(move |b| b.free_backing(backing)).map(drop)
    }

    fn save_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()> {
        let copies = copies.to_vec();
        self.on_all(move |b| b.save_pages(backing, &copies))
            .map(drop)
    }

    fn restore_pages(&mut self, backing: BackingId, copies: &[PageCopy]) -> Result<()> {
        let copies = copies.to_vec();
        self.on_all(move |b| b.restore_pages(backing, &copies))
            .map(drop)
    }

    fn clone_pages(&mut self, clones: &[PageClone]) -> Result<()> {
        let clones = clones.to_vec();
        self.on_all(move |b| b.clone_pages(&clones)).map(drop)
    }

    fn copy_backing(&mut self, from: BackingId, to: BackingId) -> Result<()> {
        self.on_all(move |b| b.copy_backing(from, to)).map(drop)
    }

    /// A copy is finished once every rank has finished it; it failed if any rank's failed.
    fn finished_copies(&mut self, wait: bool) -> Vec<(BackingId, Result<()>)> {
        let lists = self.on_all(move |b| {
            Ok(b.finished_copies(wait)
                .into_iter()
                .map(|(id, r)| (id, r.map_err(|e| e.to_string())))
                .collect::<Vec<_>>())
        });
        let (led, followed) = match lists {
            Ok(lists) => lists,
            Err(e) => {
                tracing::error!("polling the ranks' snapshot copies: {e}");
                return Vec::new();
            }
        };
        let reports = led.into_iter().chain(followed.into_iter().flatten());
        self.copies
            .add(reports)
            .into_iter()
            .map(|(id, result)| {
                (
                    id,
                    result.map_err(|e| EngineError::Backing(id.to_string(), e)),
                )
            })
            .collect()
    }

    fn backing_ids(&self) -> Vec<BackingId> {
        self.lead.backing_ids()
    }

    /// A restore is sound only where every rank's copy checked out.
    fn restore_verdicts(&mut self) -> Result<Vec<bool>> {
        let (lead, followed) = self.on_all(|b| b.restore_verdicts())?;
        every_rank_agrees(lead, followed)
    }

    fn backing_sums(&mut self, _backing: BackingId) -> Result<Vec<u64>> {
        Err(no_disk_tier())
    }

    fn set_backing_sums(&mut self, _backing: BackingId, _sums: &[u64]) -> Result<()> {
        Err(no_disk_tier())
    }

    fn host_runs(&mut self, _backing: BackingId) -> Result<Vec<HostRun>> {
        Err(no_disk_tier())
    }

    fn read_backing(&mut self, _backing: BackingId) -> Result<Vec<u8>> {
        Err(no_disk_tier())
    }

    fn flip_byte(&mut self, backing: BackingId, offset: u64, mask: u8) -> Result<()> {
        self.lead.flip_byte(backing, offset, mask)
    }

    fn memory_plans(&self) -> Vec<String> {
        self.plans.clone()
    }

    /// Two all-reduces a layer and one for the embedding, 64 graphs' worth of replays.
    fn time_all_reduces(&mut self, tokens: usize) -> Result<Option<(usize, usize, f64)>> {
        let count = 2 * self.lead.config.num_layers + 1;
        let bytes = tokens * self.lead.config.hidden_size * 2;
        let timed = self.on_all(move |b| b.time_all_reduces(tokens, count, 64));
        match timed {
            Ok((each, _)) => Ok(Some((count, bytes, each))),
            Err(e) => {
                if let Err(reset) = self.reset_exchanges() {
                    tracing::error!("resetting the ranks' exchanges after timing them: {reset}");
                }
                Err(e)
            }
        }
    }

    /// Every rank's together: each holds what rank 0 holds (the same shares of the weights, the
    /// same pool, and a buffer of the same size for each snapshot), so the bytes are rank 0's
    /// times the ranks; the snapshots are counted once.
    fn memory(&self) -> MemoryReport {
        let lead = self.lead.memory();
        let ranks = 1 + self.followers.len() as u64;
        MemoryReport {
            weights_bytes: lead.weights_bytes * ranks,
            pool_bytes: lead.pool_bytes * ranks,
            device_snapshot_bytes: lead.device_snapshot_bytes * ranks,
            host_snapshot_bytes: lead.host_snapshot_bytes * ranks,
            backings: lead.backings,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_copy_is_done_once_every_rank_has_done_it_and_failed_if_any_failed() {
        let mut tally = CopyTally {
            world: 2,
            pending: HashMap::new(),
        };
        let (a, b, c) = (BackingId(1), BackingId(2), BackingId(3));
        // Rank 0 finishes a and b first; rank 1 only b, which failed there.
        let first = tally.add([(a, Ok(())), (b, Ok(())), (b, Err("rank 1: bad".into()))]);
        assert_eq!(first, vec![(b, Err("rank 1: bad".to_string()))]);
        // A later poll: rank 1 finishes a, and c comes in from rank 0 alone.
        assert_eq!(tally.add([(c, Ok(())), (a, Ok(()))]), vec![(a, Ok(()))]);
        assert_eq!(tally.add([(c, Ok(()))]), vec![(c, Ok(()))]);
        assert!(tally.pending.is_empty(), "each reported once");
    }

    #[test]
    fn a_restore_is_sound_only_where_every_rank_s_copy_checked_out() {
        let verdicts =
            every_rank_agrees(vec![true, true, false], vec![vec![true, false, true]]).unwrap();
        assert_eq!(verdicts, [true, false, false]);
        assert_eq!(every_rank_agrees(vec![true], Vec::new()).unwrap(), [true]);
        let err = every_rank_agrees(vec![true], vec![vec![true, true]]).unwrap_err();
        assert!(
            err.to_string().contains("rank 1 has 2 restore verdicts"),
            "{err}"
        );
    }
}
