//! The `Engine` actor: owns the backend (weights, KV page bytes, snapshot buffers, device
//! context) on its own thread, since a step blocks.
//!
//! One [`EngineStep`] per scheduler step carries everything the backend does in order: make
//! room for new snapshots (free or demote evicted ones), restore snapshots into pool pages,
//! run the forward pass and sample, then copy finished prompts into their snapshot buffers.
//! Each part reports its own outcome, so one failure costs only the requests it touched.

use actix::{Actor, Handler, Message, MessageResult, SyncContext};
use cache::{BackingId, Eviction, PageCopy, SnapshotId, Tier};
use engine::backend::{Backend, MemoryReport, StepPlan};
use engine::sampling::Sampler;

pub struct Engine {
    backend: Box<dyn Backend>,
}

impl Engine {
    pub fn new(backend: Box<dyn Backend>) -> Self {
        Engine { backend }
    }
}

impl Actor for Engine {
    type Context = SyncContext<Self>;
}

/// A snapshot to fill: allocate `backing` and copy pool pages into it.
#[derive(Debug)]
pub struct SaveCopy {
    pub backing: BackingId,
    pub tier: Tier,
    pub bytes: u64,
    pub copies: Vec<PageCopy>,
}

/// A snapshot to copy into pool pages before the forward pass.
#[derive(Debug)]
pub struct RestoreCopy {
    pub backing: BackingId,
    pub copies: Vec<PageCopy>,
}

/// Everything the backend does for one scheduler step.
#[derive(Message)]
#[rtype(result = "EngineStepReply")]
pub struct EngineStep {
    pub evictions: Vec<Eviction>,
    pub restores: Vec<RestoreCopy>,
    pub plan: StepPlan,
    /// One per plan row: rows with a sampler get their next token.
    pub samplers: Vec<Option<Box<Sampler>>>,
    pub saves: Vec<SaveCopy>,
}

pub struct EngineStepReply {
    /// Evictions that were demotions, and whether the copy to the host tier worked.
    pub demotions: Vec<(SnapshotId, bool)>,
    pub restores: Vec<Result<(), String>>,
    /// The sampled token of each row, or why the forward pass failed.
    pub forward: Result<Vec<Option<u32>>, String>,
    /// The samplers, handed back in row order.
    pub samplers: Vec<Option<Box<Sampler>>>,
    pub saves: Vec<Result<(), String>>,
    /// The plan, handed back so its buffers are refilled next step rather than reallocated.
    pub plan: StepPlan,
}

/// How many outcomes of each kind a step's reply carries.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    restores: usize,
    rows: usize,
    saves: usize,
}

impl EngineStepReply {
    pub fn shape_of(step: &EngineStep) -> StepShape {
        StepShape {
            restores: step.restores.len(),
            rows: step.plan.rows.len(),
            saves: step.saves.len(),
        }
    }

    /// The reply of a step that never ran because the engine thread is gone: everything in
    /// it failed. (Demotions it carried stay `Demoting` in the store; nothing serves then.)
    pub fn failed(shape: StepShape, reason: &str) -> Self {
        EngineStepReply {
            demotions: Vec::new(),
            restores: vec![Err(reason.to_string()); shape.restores],
            forward: Err(reason.to_string()),
            samplers: (0..shape.rows).map(|_| None).collect(),
            saves: vec![Err(reason.to_string()); shape.saves],
            plan: StepPlan::default(),
        }
    }
}

impl Engine {
    /// Drops evicted buffers, first copying demoted ones to their host buffer.
    fn evict(&mut self, evictions: &[Eviction]) -> Vec<(SnapshotId, bool)> {
        let mut demotions = Vec::new();
        for eviction in evictions {
            if let Some(to) = eviction.demoted_to {
                let moved = self
                    .backend
                    .alloc_backing(to, Tier::Host, eviction.bytes)
                    .and_then(|()| self.backend.copy_backing(eviction.backing, to));
                if moved.is_err() {
                    let _ = self.backend.free_backing(to);
                }
                demotions.push((eviction.snapshot, moved.is_ok()));
            }
            if let Err(e) = self.backend.free_backing(eviction.backing) {
                tracing::error!("freeing evicted {}: {e}", eviction.backing);
            }
        }
        demotions
    }

    fn save(&mut self, save: &SaveCopy) -> Result<(), String> {
        self.backend
            .alloc_backing(save.backing, save.tier, save.bytes)
            .map_err(|e| e.to_string())?;
        self.backend
            .save_pages(save.backing, &save.copies)
            .map_err(|e| {
                let _ = self.backend.free_backing(save.backing);
                e.to_string()
            })
    }

    fn forward(
        &mut self,
        plan: &StepPlan,
        samplers: &mut [Option<Box<Sampler>>],
    ) -> Result<Vec<Option<u32>>, String> {
        if plan.rows.is_empty() {
            return Ok(Vec::new());
        }
        let mut lent: Vec<Option<&mut Sampler>> =
            samplers.iter_mut().map(|s| s.as_deref_mut()).collect();
        self.backend
            .step_and_sample(plan, &mut lent)
            .map_err(|e| e.to_string())
    }
}

impl Engine {
    /// Does a step's work in order: evictions, restores, forward pass and sampling, saves.
    pub fn run(&mut self, mut step: EngineStep) -> EngineStepReply {
        let demotions = self.evict(&step.evictions);
        let restores = step
            .restores
            .iter()
            .map(|r| {
                self.backend
                    .restore_pages(r.backing, &r.copies)
                    .map_err(|e| e.to_string())
            })
            .collect();
        let forward = self.forward(&step.plan, &mut step.samplers);
        let saves = match &forward {
            Ok(_) => step.saves.iter().map(|s| self.save(s)).collect(),
            Err(e) => step
                .saves
                .iter()
                .map(|_| Err(format!("not saved: the step failed: {e}")))
                .collect(),
        };
        EngineStepReply {
            demotions,
            restores,
            forward,
            samplers: step.samplers,
            saves,
            plan: step.plan,
        }
    }
}

impl Handler<EngineStep> for Engine {
    type Result = MessageResult<EngineStep>;

    fn handle(&mut self, step: EngineStep, _: &mut SyncContext<Self>) -> Self::Result {
        MessageResult(self.run(step))
    }
}

/// Frees a snapshot buffer the store gave up outside a step.
#[derive(Debug, Message)]
#[rtype(result = "()")]
pub struct FreeBacking(pub BackingId);

impl Handler<FreeBacking> for Engine {
    type Result = ();

    fn handle(&mut self, msg: FreeBacking, _: &mut SyncContext<Self>) {
        if let Err(e) = self.backend.free_backing(msg.0) {
            tracing::error!("freeing {}: {e}", msg.0);
        }
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
