//! The `Engine` actor: owns the backend (weights, KV page bytes, snapshot buffers, device
//! context) on its own thread, since a step blocks.
//!
//! One [`EngineStep`] per scheduler step carries everything the backend does in order: make
//! room for new snapshots (free or demote evicted ones), restore snapshots into pool pages,
//! run the forward pass and sample, then copy finished prompts into their snapshot buffers.
//! Each part reports its own outcome, so one failure costs only the requests it touched.
//! A demotion's copy runs beside the steps; each step's reply carries the demotions that landed
//! since the last one, and only then is the device copy freed.
//!
//! A step may ask for several decode steps ([`EngineStep::row_steps`]): the engine then runs
//! the forward pass again on the rows still going, each fed the token it just sampled, so the
//! scheduler's overhead is paid once for all of them. A request that arrives (or is cancelled)
//! meanwhile cuts it short after the decode step it is in ([`Engine::interrupt`]), so the
//! newcomer waits one decode step to be admitted, not `decode_steps`.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use actix::{Actor, Handler, Message, MessageResult, SyncContext};
use cache::{
    BackingId, Eviction, FlushPlan, PageClone, PageCopy, PrefixHash, Promotion, SnapshotId, Tier,
};
use engine::EngineError;
use engine::backend::{
    Backend, BackendInfo, HostRun, MemoryReport, RowPlan, StepOutput, StepPlan, sample_on_host,
};
use engine::disk::{DiskDone, DiskFault, DiskSource, DiskTier, WriteJob};
use engine::sampling::{Sampler, TokenLogprobs, token_logprobs};
use engine::stop::is_stop_token;

use crate::request::RequestId;

pub use crate::exchange::{
    EngineStep, EngineStepReply, Pick, PickOutcome, PromptScore, RestoreCopy, RestoreFault,
    RowRequest, SampledTokens, SaveCopy, StepShape,
};

pub struct Engine {
    backend: Box<dyn Backend>,
    /// The model's end-of-sequence tokens: a row of a multi-step decode stops after one.
    eos_token_ids: Vec<u32>,
    /// True while the engine can run steps; cleared when it shuts down or its thread dies
    /// (a backend that panicked drops the engine while unwinding).
    alive: Arc<AtomicBool>,
    /// Raised by `Admission` when a request arrives or is cancelled while a step runs: a
    /// multi-step decode ends after the decode step it is in. A flag rather than a message
    /// because the engine's mailbox is not read until the step ends.
    interrupt: Arc<AtomicBool>,
    /// Demotions whose copy is running, by their host backing.
    demoting: HashMap<BackingId, Demotion>,
    /// Device backings of demotions reported this step, freed once the step's restores
    /// (which may still read them) are queued.
    demoted_sources: Vec<BackingId>,
    /// What each filled backing holds, as its save recorded it: a restore that names another
    /// snapshot or prefix is refused (a store that pointed at the wrong buffer would restore
    /// someone else's KV, seed 002).
    frames: HashMap<BackingId, BackingFrame>,
    /// The disk tier's files, if there is one.
    disk: Option<DiskTier>,
    /// Promotions whose read runs, by their memory backing: the snapshot and its file.
    promoting: HashMap<BackingId, (SnapshotId, BackingId)>,
    /// Tiers where a copy other than a restore found corrupt bytes since the last reply.
    corrupt_found: Vec<Tier>,
    /// The sampler of every request that has picked a token and not ended, in the slot the
    /// scheduler gave it, with the token it last picked: a row planned before the step ahead
    /// of it answered starts from that token.
    samplers: Vec<Option<Resident>>,
    /// When the last step ended (its reply built).
    last_step_end: Option<Instant>,
}

/// A request's sampler, kept between its steps.
#[derive(Debug)]
struct Resident {
    request: RequestId,
    sampler: Box<Sampler>,
    last: Option<u32>,
}

/// The identity half of a backing's frame; the bytes' half is the backend's block sums.
#[derive(Debug, Clone)]
struct BackingFrame {
    snapshot: SnapshotId,
    chain: Arc<[PrefixHash]>,
}

/// A demotion whose copy runs beside the steps.
#[derive(Debug, Clone, Copy)]
struct Demotion {
    snapshot: SnapshotId,
    /// The device backing: it stays allocated, and restores read it, until the copy is
    /// reported. The store learns of the copy only through the step's reply, so no restore
    /// planned after that reads it.
    from: BackingId,
    from_tier: Tier,
}

impl Engine {
    pub fn new(backend: Box<dyn Backend>, eos_token_ids: Vec<u32>) -> Self {
        Engine {
            backend,
            eos_token_ids,
            alive: Arc::new(AtomicBool::new(true)),
            interrupt: Arc::new(AtomicBool::new(false)),
            demoting: HashMap::new(),
            demoted_sources: Vec::new(),
            frames: HashMap::new(),
            disk: None,
            promoting: HashMap::new(),
            corrupt_found: Vec::new(),
            samplers: Vec::new(),
            last_step_end: None,
        }
    }

    /// Gives the engine the disk tier's files (opened and adopted by the store already).
    pub fn with_disk(mut self, disk: DiskTier) -> Self {
        self.disk = Some(disk);
        self
    }

    /// The backings the backend holds now (tests compare them with the store's).
    pub fn backing_ids(&self) -> Vec<BackingId> {
        let mut ids = self.backend.backing_ids();
        if let Some(disk) = &self.disk {
            ids.extend(disk.ids());
        }
        ids
    }

    /// Fault injection: XORs byte `offset` of a memory backing with `mask`.
    pub fn flip_byte(&mut self, backing: BackingId, offset: u64, mask: u8) -> Result<(), String> {
        self.backend
            .flip_byte(backing, offset, mask)
            .map_err(|e| e.to_string())
    }

    /// Demotions whose copy has not been reported yet.
    pub fn demotions_in_flight(&self) -> usize {
        self.demoting.len()
    }

    /// A flag other threads can read: whether this engine can still run steps.
    pub fn alive(&self) -> Arc<AtomicBool> {
        self.alive.clone()
    }

    /// The flag that cuts a multi-step decode short: whoever raises it lowers it before the
    /// next step is planned (the `Admission` actor, when that step starts).
    pub fn interrupt(&self) -> Arc<AtomicBool> {
        self.interrupt.clone()
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.alive.store(false, Ordering::SeqCst);
    }
}

impl Actor for Engine {
    type Context = SyncContext<Self>;
}

impl Engine {
    /// Drops evicted buffers; a demoted one is first copied to its new tier (a host buffer,
    /// or a file), a copy that runs beside the steps and is reported by
    /// [`Engine::reap_demotions`]. A demotion that cannot start is reported failed at once.
    fn evict(&mut self, evictions: &[Eviction], demotions: &mut Vec<(SnapshotId, bool)>) {
        for eviction in evictions {
            if eviction.from == Tier::Disk {
                if let Some(disk) = &mut self.disk {
                    disk.delete(eviction.backing);
                }
                continue;
            }
            if let Some(to) = eviction.demoted_to {
                let started = if eviction.demoted_tier == Tier::Disk {
                    self.start_disk_write(eviction, to, false)
                } else {
                    self.backend
                        .alloc_backing(to, eviction.demoted_tier, eviction.bytes)
                        .and_then(|()| self.backend.copy_backing(eviction.backing, to))
                        .map_err(|e| {
                            let _ = self.backend.free_backing(to);
                            e.to_string()
                        })
                };
                match started {
                    Ok(()) => {
                        if let Some(frame) = self.frames.get(&eviction.backing).cloned() {
                            self.frames.insert(to, frame);
                        }
                        let demotion = Demotion {
                            snapshot: eviction.snapshot,
                            from: eviction.backing,
                            from_tier: eviction.from,
                        };
                        self.demoting.insert(to, demotion);
                        continue;
                    }
                    Err(e) => {
                        tracing::warn!("demoting {}: {e}", eviction.snapshot);
                        demotions.push((eviction.snapshot, false));
                    }
                }
            }
            self.frames.remove(&eviction.backing);
            if let Err(e) = self.backend.free_backing(eviction.backing) {
                tracing::error!("freeing evicted {}: {e}", eviction.backing);
            }
        }
    }

    /// Starts writing an evicted buffer to its file: from its host memory where it has some,
    /// else from a copy.
    fn start_disk_write(
        &mut self,
        eviction: &Eviction,
        to: BackingId,
        kept: bool,
    ) -> Result<(), String> {
        let Some(disk) = &mut self.disk else {
            return Err("there is no disk tier".into());
        };
        let frame = self
            .frames
            .get(&eviction.backing)
            .cloned()
            .ok_or("its buffer has no frame")?;
        let sums = self
            .backend
            .backing_sums(eviction.backing)
            .map_err(|e| e.to_string())?;
        let source = match self.backend.host_runs(eviction.backing) {
            Ok(runs) => DiskSource::Runs(runs),
            Err(_) => DiskSource::Owned(
                self.backend
                    .read_backing(eviction.backing)
                    .map_err(|e| e.to_string())?,
            ),
        };
        disk.write(WriteJob {
            to,
            snapshot: frame.snapshot,
            chain: frame.chain,
            sums,
            kept,
            source,
        });
        Ok(())
    }

    /// Starts reading disk snapshots back into memory buffers it allocates; a promotion that
    /// cannot start is reported failed at once.
    fn promote(
        &mut self,
        promotions: &[Promotion],
        done: &mut Vec<(SnapshotId, Result<(), RestoreFault>)>,
    ) {
        for promotion in promotions {
            let started = match &mut self.disk {
                None => Err("there is no disk tier".to_string()),
                Some(disk) => self
                    .backend
                    .alloc_backing(promotion.to, promotion.tier, promotion.bytes)
                    .and_then(|()| self.backend.host_runs(promotion.to))
                    .map(|runs| disk.read(promotion.from, promotion.to, runs))
                    .map_err(|e| {
                        let _ = self.backend.free_backing(promotion.to);
                        e.to_string()
                    }),
            };
            match started {
                Ok(()) => {
                    tracing::info!(
                        "reading {} ({} bytes) back from the disk tier into the {} tier",
                        promotion.snapshot,
                        promotion.bytes,
                        promotion.tier
                    );
                    self.promoting
                        .insert(promotion.to, (promotion.snapshot, promotion.from));
                }
                Err(e) => done.push((promotion.snapshot, Err(RestoreFault::Failed(e)))),
            }
        }
    }

    /// Collects the disk copies that ended: demotions to files and promotions from them.
    fn reap_disk(
        &mut self,
        wait: bool,
        demotions: &mut Vec<(SnapshotId, bool)>,
        promotions: &mut Vec<(SnapshotId, Result<(), RestoreFault>)>,
    ) {
        let Some(disk) = &mut self.disk else { return };
        for done in disk.finished(wait) {
            match done {
                DiskDone::Written { to, result } => {
                    let Some(demotion) = self.demoting.remove(&to) else {
                        tracing::error!("a write of {to} ended that no demotion started");
                        continue;
                    };
                    match &result {
                        Err(DiskFault::Corrupt(e)) => {
                            tracing::error!(
                                "{} ({} tier) not written to disk, its bytes are corrupt: {e}",
                                demotion.snapshot,
                                demotion.from_tier
                            );
                            self.corrupt_found.push(demotion.from_tier);
                        }
                        Err(e) => tracing::warn!("writing {} to disk: {e}", demotion.snapshot),
                        Ok(()) => {}
                    }
                    self.frames.remove(&to);
                    self.demoted_sources.push(demotion.from);
                    demotions.push((demotion.snapshot, result.is_ok()));
                }
                DiskDone::Read { to, result, .. } => {
                    let Some((snapshot, _file)) = self.promoting.remove(&to) else {
                        tracing::error!("a read into {to} ended that no promotion started");
                        continue;
                    };
                    let landed = result
                        .map_err(|fault| match fault {
                            DiskFault::Corrupt(reason) => RestoreFault::Corrupt {
                                tier: Tier::Disk,
                                reason,
                            },
                            DiskFault::Io(reason) => RestoreFault::Failed(reason),
                        })
                        .and_then(|tables| {
                            self.backend
                                .set_backing_sums(to, &tables.sums)
                                .map_err(|e| RestoreFault::Failed(e.to_string()))?;
                            let frame = BackingFrame {
                                snapshot,
                                chain: tables.chain.into(),
                            };
                            self.frames.insert(to, frame);
                            Ok(())
                        });
                    if landed.is_err() {
                        let _ = self.backend.free_backing(to);
                    }
                    promotions.push((snapshot, landed));
                }
            }
        }
    }

    /// Collects the demotions whose copy ended (with `wait`, every one in flight): each is
    /// reported in this step's reply, and its device backing freed after the step's restores.
    fn reap_demotions(&mut self, wait: bool, demotions: &mut Vec<(SnapshotId, bool)>) {
        if self.demoting.is_empty() {
            return;
        }
        for (to, result) in self.backend.finished_copies(wait) {
            let Some(demotion) = self.demoting.remove(&to) else {
                tracing::error!("a copy into {to} ended that no demotion started");
                continue;
            };
            if let Err(e) = &result {
                tracing::warn!("demoting {}: {e}", demotion.snapshot);
                self.frames.remove(&to);
                if let Err(e) = self.backend.free_backing(to) {
                    tracing::error!("freeing {to}: {e}");
                }
            }
            self.demoted_sources.push(demotion.from);
            demotions.push((demotion.snapshot, result.is_ok()));
        }
    }

    fn free_demoted_sources(&mut self) {
        for from in self.demoted_sources.drain(..) {
            self.frames.remove(&from);
            if let Err(e) = self.backend.free_backing(from) {
                tracing::error!("freeing demoted {from}: {e}");
            }
        }
    }

    /// Fills a new snapshot. Its memory may still be held by demotions in flight (their
    /// sources): then it waits for those copies (not for the steps) and tries again.
    fn save(
        &mut self,
        save: &SaveCopy,
        demotions: &mut Vec<(SnapshotId, bool)>,
    ) -> Result<(), String> {
        let mut allocated = self
            .backend
            .alloc_backing(save.backing, save.tier, save.bytes);
        if matches!(allocated, Err(EngineError::OutOfMemory(_))) && !self.demoting.is_empty() {
            self.reap_demotions(true, demotions);
            self.free_demoted_sources();
            allocated = self
                .backend
                .alloc_backing(save.backing, save.tier, save.bytes);
        }
        allocated.map_err(|e| e.to_string())?;
        self.backend
            .save_pages(save.backing, &save.copies)
            .map_err(|e| {
                let _ = self.backend.free_backing(save.backing);
                e.to_string()
            })?;
        let frame = BackingFrame {
            snapshot: save.snapshot,
            chain: save.chain.as_slice().into(),
        };
        self.frames.insert(save.backing, frame);
        Ok(())
    }

    /// Queues one restore after checking the backing's frame names what the store asked for.
    /// `Ok(true)`: queued, its checksums verdict to come; `Ok(false)`: refused by its frame.
    fn restore(&mut self, restore: &RestoreCopy) -> Result<bool, String> {
        let pages = restore.copies.len();
        let matches = self.frames.get(&restore.backing).is_some_and(|frame| {
            frame.snapshot == restore.snapshot
                && pages > 0
                && frame.chain.get(pages - 1) == Some(&restore.prefix)
        });
        if !matches {
            return Ok(false);
        }
        self.backend
            .restore_pages(restore.backing, &restore.copies)
            .map(|()| true)
            .map_err(|e| e.to_string())
    }

    /// Each restore's outcome once the step ran: the backend's checksum verdicts joined to the
    /// restores they belong to. A corrupt one's backing is forgotten here (the store drops it).
    fn restore_outcomes(
        &mut self,
        restores: &[RestoreCopy],
        queued: Vec<Result<bool, String>>,
    ) -> Vec<Result<(), RestoreFault>> {
        let verdicts = self.backend.restore_verdicts();
        let mut verdicts = match verdicts {
            Ok(verdicts) => verdicts.into_iter(),
            Err(e) => {
                let reason = format!("reading the restores' checksums: {e}");
                return queued
                    .iter()
                    .map(|_| Err(RestoreFault::Failed(reason.clone())))
                    .collect();
            }
        };
        restores
            .iter()
            .zip(queued)
            .map(|(restore, queued)| {
                let reason = match queued {
                    Err(e) => return Err(RestoreFault::Failed(e)),
                    Ok(false) => "its frame names another snapshot or prefix",
                    Ok(true) if verdicts.next().unwrap_or(false) => return Ok(()),
                    Ok(true) => "a block's checksum does not match",
                };
                tracing::error!(
                    "{} ({} tier, {}): refused, recomputing: {reason}",
                    restore.snapshot,
                    restore.tier,
                    restore.backing
                );
                Err(RestoreFault::Corrupt {
                    tier: restore.tier,
                    reason: reason.into(),
                })
            })
            .collect()
    }

    fn forward(
        &mut self,
        plan: &mut StepPlan,
        samplers: &mut [Option<Box<Sampler>>],
        row_steps: &[usize],
        drafts: &[usize],
        first_step: &mut (f64, bool),
        cut_short: &mut bool,
    ) -> Result<SampledTokens, String> {
        let rows = plan.rows.len();
        if rows == 0 {
            return Ok(SampledTokens::default());
        }
        if !drafts.is_empty() {
            if !row_steps.is_empty() {
                return Err("a step cannot both verify drafts and decode several steps".into());
            }
            return self.verify(plan, samplers, drafts, first_step);
        }
        let steps = row_steps.iter().copied().max().unwrap_or(1);
        if steps > 1 {
            check_multi_step(plan, samplers, row_steps)?;
        }
        let mut sampled = SampledTokens::new(rows, steps);
        let mut lent: Vec<Option<&mut Sampler>> =
            samplers.iter_mut().map(|s| s.as_deref_mut()).collect();
        let started = Instant::now();
        let first = self
            .backend
            .step_and_sample(plan, &mut lent)
            .map_err(|e| e.to_string())?;
        *first_step = (
            started.elapsed().as_secs_f64(),
            self.backend.last_step_captured(),
        );
        for (i, token) in first.into_iter().enumerate() {
            if let Some(token) = token {
                sampled.push(i, token);
            }
        }
        if steps == 1 {
            return Ok(sampled);
        }
        // Further decode steps run on the rows still going, kept at the front of the plan;
        // the plan goes back in its own order whatever happens, since its rows carry the
        // jobs' page tables.
        let mut order: Vec<usize> = (0..rows).collect();
        let mut parked: Vec<(usize, RowPlan)> = Vec::new();
        let result = self.decode_more(
            plan,
            &mut lent,
            row_steps,
            &mut sampled,
            &mut order,
            &mut parked,
            cut_short,
        );
        if !parked.is_empty() {
            let mut all: Vec<(usize, RowPlan)> =
                order.into_iter().zip(plan.rows.drain(..)).collect();
            all.append(&mut parked);
            all.sort_unstable_by_key(|(i, _)| *i);
            plan.rows.extend(all.into_iter().map(|(_, row)| row));
        }
        result.map(|()| sampled)
    }

    /// A step in which some rows score their request's prompt tokens: every row's logits come
    /// to the host (the scoring rows' after every token), the scores are read from them into
    /// `scores` (by plan row), and the rows that pick sample there. One step, no drafts.
    fn score(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<Box<Sampler>>],
        scored: &[(usize, PromptScore)],
        (row_steps, drafts): (&[usize], &[usize]),
        first_step: &mut (f64, bool),
        scores: &mut Vec<(usize, Vec<TokenLogprobs>)>,
    ) -> Result<SampledTokens, String> {
        if !row_steps.is_empty() || !drafts.is_empty() {
            return Err(
                "a step that scores a prompt runs one decode step and verifies no draft (a bug \
                 in the scheduler)"
                    .into(),
            );
        }
        let started = Instant::now();
        let mut output = self.backend.step(plan).map_err(|e| e.to_string())?;
        *first_step = (
            started.elapsed().as_secs_f64(),
            self.backend.last_step_captured(),
        );
        let vocab = output.vocab_size;
        for (n, (i, score)) in scored.iter().enumerate() {
            let range = match output.row_ranges.get(*i) {
                Some(range) if n == 0 || scored[n - 1].0 < *i => range.clone(),
                _ => {
                    return Err(format!(
                        "a score for row {i} of {}, after one for row {:?} (a bug in the \
                         scheduler)",
                        plan.rows.len(),
                        n.checked_sub(1).map(|p| scored[p].0)
                    ));
                }
            };
            if range.len() < score.from + score.targets.len() {
                return Err(format!(
                    "row {i} scores {} prompt tokens from its token {} but has {} rows of \
                         logits (a bug in the scheduler)",
                    score.targets.len(),
                    score.from,
                    range.len()
                ));
            }
            let logits = |k: usize| {
                let at = (range.start + score.from + k) * vocab;
                &output.logits[at..at + vocab]
            };
            let list = score
                .targets
                .iter()
                .enumerate()
                .map(|(k, &target)| token_logprobs(logits(k), target, score.top))
                .collect();
            scores.push((*i, list));
        }
        let mut lent: Vec<Option<&mut Sampler>> =
            samplers.iter_mut().map(|s| s.as_deref_mut()).collect();
        let picks = sample_on_host(&mut output, &mut lent).map_err(|e| e.to_string())?;
        let mut sampled = SampledTokens::new(plan.rows.len(), 1);
        for (i, token) in picks.into_iter().enumerate() {
            if let Some(token) = token {
                sampled.push(i, token);
            }
        }
        Ok(sampled)
    }

    /// A step whose rows verify drafted tokens: each row's picks, the kept draft and the
    /// token after it.
    fn verify(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<Box<Sampler>>],
        drafts: &[usize],
        first_step: &mut (f64, bool),
    ) -> Result<SampledTokens, String> {
        let mut lent: Vec<Option<&mut Sampler>> =
            samplers.iter_mut().map(|s| s.as_deref_mut()).collect();
        let started = Instant::now();
        let picks = self
            .backend
            .step_and_verify(plan, &mut lent, drafts)
            .map_err(|e| e.to_string())?;
        *first_step = (
            started.elapsed().as_secs_f64(),
            self.backend.last_step_captured(),
        );
        let stride = picks.iter().map(Vec::len).max().unwrap_or(1);
        let mut sampled = SampledTokens::new(plan.rows.len(), stride);
        for (i, row) in picks.into_iter().enumerate() {
            for token in row {
                sampled.push(i, token);
            }
        }
        Ok(sampled)
    }

    /// Decode steps 2 and on of a multi-step decode. `order[r]` is the original index of plan
    /// row `r`; rows that stop move to `parked`. Ends early, with `cut_short` set, when the
    /// interrupt is raised.
    #[allow(clippy::too_many_arguments)]
    fn decode_more(
        &mut self,
        plan: &mut StepPlan,
        lent: &mut Vec<Option<&mut Sampler>>,
        row_steps: &[usize],
        sampled: &mut SampledTokens,
        order: &mut Vec<usize>,
        parked: &mut Vec<(usize, RowPlan)>,
        cut_short: &mut bool,
    ) -> Result<(), String> {
        let steps = row_steps.iter().copied().max().unwrap_or(1);
        for step in 1..steps {
            if self.interrupt.load(Ordering::Acquire) {
                *cut_short = true;
                break;
            }
            let mut kept = 0;
            for r in 0..plan.rows.len() {
                let i = order[r];
                let params = lent[r].as_deref().expect("checked above").params();
                let last = sampled.last(i).expect("every row sampled");
                if step < row_steps[i] && !is_stop_token(params, &self.eos_token_ids, last) {
                    plan.rows.swap(kept, r);
                    lent.swap(kept, r);
                    order.swap(kept, r);
                    kept += 1;
                }
            }
            parked.extend(order.drain(kept..).zip(plan.rows.drain(kept..)));
            lent.truncate(kept);
            if kept == 0 {
                break;
            }
            for (row, &i) in plan.rows.iter_mut().zip(order.iter()) {
                row.start_pos += 1;
                row.tokens[0] = sampled.last(i).expect("every row sampled");
            }
            let tokens = self
                .backend
                .step_and_sample(plan, lent)
                .map_err(|e| e.to_string())?;
            for (&i, token) in order.iter().zip(tokens) {
                sampled.push(i, token.expect("every row samples"));
            }
        }
        Ok(())
    }
}

impl Engine {
    /// The samplers of the rows that pick a token, in row order: handed over with the row, or
    /// taken from those the engine keeps. A row that follows its request's last pick gets
    /// that token. The second value says why the step cannot run: a row that picks with no
    /// sampler anywhere, or whose slot holds another request's.
    fn lend_samplers(
        &mut self,
        step: &mut EngineStep,
    ) -> (Vec<Option<Box<Sampler>>>, Option<String>) {
        let mut lent: Vec<Option<Box<Sampler>>> = (0..step.rows.len()).map(|_| None).collect();
        if step.rows.len() != step.plan.rows.len() {
            let why = format!(
                "{} row requests for {} rows (a bug in the scheduler)",
                step.rows.len(),
                step.plan.rows.len()
            );
            return (lent, Some(why));
        }
        let mut missing = None;
        for ((request, row), lent) in step.rows.iter_mut().zip(&mut step.plan.rows).zip(&mut lent) {
            let Some(pick) = request.pick.as_mut() else {
                continue;
            };
            let slot = pick.slot as usize;
            if slot >= self.samplers.len() {
                self.samplers.resize_with(slot + 1, || None);
            }
            let kept = match self.samplers[slot].take() {
                Some(r) if r.request != request.request => {
                    missing = Some(format!(
                        "sampler slot {slot} holds request {}'s sampler, not {}'s (a bug in the \
                         scheduler)",
                        r.request.0, request.request.0
                    ));
                    self.samplers[slot] = Some(r);
                    continue;
                }
                kept => kept,
            };
            if pick.follows {
                // None only when the step before failed for this request; the scheduler then
                // drops whatever this row picks.
                row.tokens[0] = kept.as_ref().and_then(|r| r.last).unwrap_or(0);
            }
            *lent = pick.sampler.take().or(kept.map(|r| r.sampler));
            match lent.as_mut() {
                Some(sampler) if pick.keep_logits => sampler.keep_next_logits(),
                Some(_) => {}
                None => {
                    missing = Some(format!(
                        "no sampler for request {} (a bug in the scheduler)",
                        request.request.0
                    ))
                }
            }
        }
        (lent, missing)
    }

    /// Takes back the lent samplers, each having accepted its row's tokens, and collects what
    /// their picks left for the scheduler.
    fn keep_samplers(
        &mut self,
        rows: &[RowRequest],
        samplers: Vec<Option<Box<Sampler>>>,
        forward: &Result<SampledTokens, String>,
    ) -> Vec<(usize, PickOutcome)> {
        let mut outcomes = Vec::new();
        for (r, (request, sampler)) in rows.iter().zip(samplers).enumerate() {
            let (Some(pick), Some(mut sampler)) = (&request.pick, sampler) else {
                continue;
            };
            let tokens = forward.as_ref().map_or(&[][..], |sampled| sampled.row(r));
            for &token in tokens {
                sampler.accept(token);
            }
            let outcome = PickOutcome {
                logprobs: sampler.take_logprobs(),
                kept_logits: if pick.keep_logits {
                    sampler.take_kept_logits()
                } else {
                    None
                },
                failure: sampler.failure().map(str::to_owned),
                prompt_logprobs: Vec::new(),
            };
            if !outcome.logprobs.is_empty()
                || outcome.kept_logits.is_some()
                || outcome.failure.is_some()
            {
                outcomes.push((r, outcome));
            }
            self.samplers[pick.slot as usize] = Some(Resident {
                request: request.request,
                sampler,
                last: tokens.last().copied(),
            });
        }
        outcomes
    }

    /// The requests whose samplers the engine keeps (tests compare them with the
    /// scheduler's).
    pub fn kept_samplers(&self) -> Vec<RequestId> {
        let mut ids: Vec<RequestId> = self.samplers.iter().flatten().map(|r| r.request).collect();
        ids.sort_unstable();
        ids
    }
}

/// Puts each row's prompt scores with what its pick left (`outcomes` and `scores` both by
/// plan row, ascending).
fn add_scores(outcomes: &mut Vec<(usize, PickOutcome)>, scores: Vec<(usize, Vec<TokenLogprobs>)>) {
    for (row, list) in scores {
        match outcomes.binary_search_by_key(&row, |(r, _)| *r) {
            Ok(at) => outcomes[at].1.prompt_logprobs = list,
            Err(at) => outcomes.insert(
                at,
                (
                    row,
                    PickOutcome {
                        prompt_logprobs: list,
                        ..PickOutcome::default()
                    },
                ),
            ),
        }
    }
}

/// A multi-step decode needs every row to be one token with a sampler.
fn check_multi_step(
    plan: &StepPlan,
    samplers: &[Option<Box<Sampler>>],
    row_steps: &[usize],
) -> Result<(), String> {
    if row_steps.len() != plan.rows.len() {
        return Err(format!(
            "{} row step counts for {} rows",
            row_steps.len(),
            plan.rows.len()
        ));
    }
    for (i, (row, sampler)) in plan.rows.iter().zip(samplers).enumerate() {
        if row.tokens.len() != 1 || sampler.is_none() || row_steps[i] == 0 {
            return Err(format!(
                "row {i} cannot take part in a multi-step decode: {} tokens, {}, {} steps",
                row.tokens.len(),
                if sampler.is_some() {
                    "a sampler"
                } else {
                    "no sampler"
                },
                row_steps[i]
            ));
        }
    }
    Ok(())
}

impl Engine {
    /// Does a step's work in order: evictions, promotions, the saves of pages given back this
    /// step, restores, forks, forward pass and sampling, the other saves.
    pub fn run(&mut self, mut step: EngineStep) -> EngineStepReply {
        let began = Instant::now();
        let waited = self
            .last_step_end
            .map(|end| began.saturating_duration_since(end));
        for &(slot, request) in &step.forget {
            if let Some(kept) = self.samplers.get_mut(slot as usize)
                && kept.as_ref().is_some_and(|r| r.request == request)
            {
                *kept = None;
            }
        }
        let mut demotions = Vec::new();
        let mut promotions = Vec::new();
        self.reap_demotions(false, &mut demotions);
        self.reap_disk(false, &mut demotions, &mut promotions);
        self.evict(&step.evictions, &mut demotions);
        self.promote(&step.promotions, &mut promotions);
        // Saves of KV earlier steps computed, from pages given back in this step: before
        // anything writes them.
        let mut saves: Vec<Option<Result<(), String>>> = step
            .saves
            .iter()
            .map(|s| s.before_forward.then(|| self.save(s, &mut demotions)))
            .collect();
        let queued: Vec<Result<bool, String>> =
            step.restores.iter().map(|r| self.restore(r)).collect();
        let forks = step
            .forks
            .iter()
            .map(|clones| self.backend.clone_pages(clones).map_err(|e| e.to_string()))
            .collect();
        // Restores planned while a snapshot was demoting are queued: its device copy may go.
        self.free_demoted_sources();
        let mut first_step = (0.0, false);
        let mut cut_short = false;
        let (mut samplers, missing) = self.lend_samplers(&mut step);
        let mut scores = Vec::new();
        let forward = match missing {
            Some(e) => Err(e),
            None if !step.scores.is_empty() => self.score(
                &step.plan,
                &mut samplers,
                &step.scores,
                (&step.row_steps, &step.drafts),
                &mut first_step,
                &mut scores,
            ),
            None => self.forward(
                &mut step.plan,
                &mut samplers,
                &step.row_steps,
                &step.drafts,
                &mut first_step,
                &mut cut_short,
            ),
        };
        let mut outcomes = self.keep_samplers(&step.rows, samplers, &forward);
        add_scores(&mut outcomes, scores);
        let forwarded = began.elapsed();
        let restores = self.restore_outcomes(&step.restores, queued);
        for (s, done) in step.saves.iter().zip(&mut saves) {
            if done.is_some() {
                continue;
            }
            *done = Some(match (&forward, s.after_restore.map(|r| &restores[r])) {
                (Err(e), _) => Err(format!("not saved: the step failed: {e}")),
                (Ok(_), Some(Err(fault))) => Err(format!("not saved: its restore failed: {fault}")),
                (Ok(_), _) => self.save(s, &mut demotions),
            });
        }
        let saves = saves
            .into_iter()
            .map(|done| done.expect("every save was done before or after the forward"))
            .collect();
        tracing::debug!(
            "engine step: {} rows, {} restores, {} saves, {} evictions, {} promotions: \
             {:.1} ms to the forward's end, {:.1} ms in all",
            step.plan.rows.len(),
            step.restores.len(),
            step.saves.len(),
            step.evictions.len(),
            step.promotions.len(),
            forwarded.as_secs_f64() * 1e3,
            began.elapsed().as_secs_f64() * 1e3
        );
        self.last_step_end = Some(Instant::now());
        EngineStepReply {
            id: step.id,
            demotions,
            engine_gone: false,
            promotions,
            corrupt_found: std::mem::take(&mut self.corrupt_found),
            restores,
            forks,
            forward,
            first_step_seconds: first_step.0,
            first_step_captured: first_step.1,
            cut_short,
            run_ahead: self.backend.steps_run_ahead(),
            waited,
            outcomes,
            saves,
            plan: step.plan,
        }
    }
}

impl Message for EngineStep {
    type Result = EngineStepReply;
}

impl Handler<EngineStep> for Engine {
    type Result = MessageResult<EngineStep>;

    fn handle(&mut self, step: EngineStep, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(self.run(step))
    }
}

/// Releases the backend (its device memory, context and libraries' state) on the engine's own
/// thread and answers once it is gone, so that a process can exit without the engine thread
/// still tearing a GPU context down. Every later step fails with `ShutDown`.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct Shutdown;

impl Handler<Shutdown> for Engine {
    type Result = ();

    fn handle(&mut self, _: Shutdown, _: &mut SyncContext<Self>) {
        let info = self.backend.info().clone();
        self.alive.store(false, Ordering::SeqCst);
        // Dropped here, before the reply.
        self.backend = Box::new(Stopped { info });
    }
}

/// The backend after [`Shutdown`]: holds nothing and refuses everything.
struct Stopped {
    info: BackendInfo,
}

impl Backend for Stopped {
    fn info(&self) -> &BackendInfo {
        &self.info
    }
    fn step(&mut self, _: &StepPlan) -> Result<StepOutput, EngineError> {
        Err(EngineError::ShutDown)
    }
    fn alloc_backing(&mut self, _: BackingId, _: Tier, _: u64) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn free_backing(&mut self, _: BackingId) -> Result<(), EngineError> {
        Ok(())
    }
    fn save_pages(&mut self, _: BackingId, _: &[PageCopy]) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn restore_pages(&mut self, _: BackingId, _: &[PageCopy]) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn clone_pages(&mut self, _: &[PageClone]) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn copy_backing(&mut self, _: BackingId, _: BackingId) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn finished_copies(&mut self, _: bool) -> Vec<(BackingId, Result<(), EngineError>)> {
        Vec::new()
    }
    fn backing_ids(&self) -> Vec<BackingId> {
        Vec::new()
    }
    fn restore_verdicts(&mut self) -> Result<Vec<bool>, EngineError> {
        Ok(Vec::new())
    }
    fn backing_sums(&mut self, _: BackingId) -> Result<Vec<u64>, EngineError> {
        Err(EngineError::ShutDown)
    }
    fn set_backing_sums(&mut self, _: BackingId, _: &[u64]) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn host_runs(&mut self, _: BackingId) -> Result<Vec<HostRun>, EngineError> {
        Err(EngineError::ShutDown)
    }
    fn read_backing(&mut self, _: BackingId) -> Result<Vec<u8>, EngineError> {
        Err(EngineError::ShutDown)
    }
    fn flip_byte(&mut self, _: BackingId, _: u64, _: u8) -> Result<(), EngineError> {
        Err(EngineError::ShutDown)
    }
    fn memory(&self) -> MemoryReport {
        MemoryReport::default()
    }
}

/// Frees a snapshot buffer the store gave up outside a step.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct FreeBacking(pub BackingId);

impl Handler<FreeBacking> for Engine {
    type Result = ();

    fn handle(&mut self, msg: FreeBacking, _: &mut SyncContext<Self>) {
        self.free_backing(msg.0);
    }
}

/// Writes snapshots to the disk tier at shutdown and waits for the files; answers how many
/// were written.
#[derive(Debug, Message)]
#[rtype(result = "usize")]
pub struct FlushToDisk(pub FlushPlan);

impl Handler<FlushToDisk> for Engine {
    type Result = usize;

    fn handle(&mut self, msg: FlushToDisk, _: &mut SyncContext<Self>) -> usize {
        self.flush_to_disk(msg.0)
    }
}

impl Engine {
    /// Writes `plan`'s snapshots to their files (several at once) and waits for them all.
    pub fn flush_to_disk(&mut self, plan: FlushPlan) -> usize {
        if self.disk.is_none() {
            return 0;
        }
        let started = Instant::now();
        // Demotions still copying: their sources stay as they are, the copies are let end.
        let (mut demotions, mut promotions) = (Vec::new(), Vec::new());
        self.reap_demotions(true, &mut demotions);
        self.reap_disk(true, &mut demotions, &mut promotions);
        self.evict(&plan.deletions, &mut demotions);
        let mut writing = Vec::new();
        for copy in &plan.copies {
            let eviction = Eviction {
                snapshot: copy.snapshot,
                from: copy.from_tier,
                backing: copy.from,
                bytes: 0,
                demoted_to: Some(copy.to),
                demoted_tier: Tier::Disk,
            };
            match self.start_disk_write(&eviction, copy.to, copy.kept) {
                Ok(()) => writing.push(copy.to),
                Err(e) => tracing::warn!("flushing {} to disk: {e}", copy.snapshot),
            }
        }
        let disk = self.disk.as_mut().expect("checked above");
        let written = disk
            .finished(true)
            .into_iter()
            .filter(|done| {
                matches!(done, DiskDone::Written { to, result: Ok(()) } if writing.contains(to))
            })
            .count();
        tracing::info!(
            "flushed {written} of {} snapshots to the disk tier in {:.1} s",
            plan.copies.len(),
            started.elapsed().as_secs_f64()
        );
        written
    }

    /// Frees a snapshot buffer the store gave up outside a step.
    pub fn free_backing(&mut self, backing: BackingId) {
        if let Some(disk) = self.disk.as_mut().filter(|d| d.holds(backing)) {
            disk.delete(backing);
            return;
        }
        self.frames.remove(&backing);
        if let Err(e) = self.backend.free_backing(backing) {
            tracing::error!("freeing {backing}: {e}");
        }
    }
}

/// Fault injection: XORs one byte of a snapshot buffer (see `Handles::corrupt_snapshot`).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), String>")]
pub struct FlipByte {
    pub backing: BackingId,
    pub offset: u64,
    pub mask: u8,
}

impl Handler<FlipByte> for Engine {
    type Result = Result<(), String>;

    fn handle(&mut self, msg: FlipByte, _: &mut SyncContext<Self>) -> Self::Result {
        self.flip_byte(msg.backing, msg.offset, msg.mask)
    }
}

/// The snapshot buffers the backend holds now.
#[derive(Debug, Message)]
#[rtype(result = "Vec<BackingId>")]
pub struct GetBackings;

impl Handler<GetBackings> for Engine {
    type Result = MessageResult<GetBackings>;

    fn handle(&mut self, _: GetBackings, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(self.backing_ids())
    }
}

/// What the backend holds.
#[derive(Debug, Message)]
#[rtype(result = "MemoryReport")]
pub struct GetMemory;

impl Handler<GetMemory> for Engine {
    type Result = MessageResult<GetMemory>;

    fn handle(&mut self, _: GetMemory, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(self.backend.memory())
    }
}
