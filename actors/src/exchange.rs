//! What the scheduler exchanges with the other actors in a step: the pool's operations, the
//! store's and the engine's step, with their answers. Plain data: the actix messages that carry
//! them are their actors' business (`kv_pool`, `snapshot_store`, `engine`), so the scheduler's
//! vocabulary does not depend on actix.

use std::time::Duration;

use cache::{
    BackingId, CacheError, Eviction, Found, PageClone, PageCopy, PageId, PrefixHash, Promotion,
    SaveReservation, SaveStart, SlotHandle, SnapshotId, Tier,
};
use engine::backend::StepPlan;
use engine::sampling::{Sampler, TokenLogprobs};

use crate::request::RequestId;

/// One change to the pool.
#[derive(Debug, Clone, PartialEq)]
pub enum PoolOp {
    Release(SlotHandle),
    /// Opens a slot and allocates its first `initial_tokens` positions (a restored prefix).
    Admit {
        prompt_tokens: usize,
        max_new_tokens: usize,
        initial_tokens: usize,
    },
    /// Grows a sequence by `tokens` positions.
    Extend {
        handle: SlotHandle,
        tokens: usize,
    },
    /// Cuts a sequence back to its first `tokens` positions (drafted tokens refused, a
    /// multi-step decode ended early), freeing the pages past them.
    Truncate {
        handle: SlotHandle,
        tokens: usize,
    },
}

/// The answer to one [`PoolOp`], in the same position.
#[derive(Debug, Clone, PartialEq)]
pub enum PoolReply {
    Released(Result<usize, CacheError>),
    /// The new slot and its page table.
    Admitted(Result<(SlotHandle, Vec<PageId>), CacheError>),
    /// The pages added, in order.
    Extended(Result<Vec<PageId>, CacheError>),
    /// How many pages were freed.
    Truncated(Result<usize, CacheError>),
}

/// One request to the store. A step sends the store one list of them, before the pool's.
#[derive(Debug, PartialEq)]
pub enum StoreOp {
    /// A request about to be admitted: the longest stored prefix of `chain`, pinned for its
    /// restore when it is in memory, or read back into memory when it is on disk and
    /// `promote` is set ([`cache::SnapshotStore::find`]).
    Find {
        chain: Vec<PrefixHash>,
        promote: bool,
    },
    FinishRestore(SnapshotId),
    /// Charges a snapshot of `chain` in `tier`, evicting as needed.
    BeginSave {
        chain: Vec<PrefixHash>,
        tier: Tier,
    },
    /// The same, the snapshot kept until discarded (an operator's pinned prefix).
    BeginKeptSave {
        chain: Vec<PrefixHash>,
        tier: Tier,
    },
    /// The same for a prompt, of as much of `chain` as the save policy's sightings allow.
    BeginPromptSave {
        chain: Vec<PrefixHash>,
        tier: Tier,
    },
    CommitSave(SaveReservation),
    AbortSave(SaveReservation),
    CommitDemotion(SnapshotId),
    AbortDemotion(SnapshotId),
    /// A restore found the snapshot corrupt: drop it.
    DropCorrupt(SnapshotId),
    CommitPromotion(SnapshotId),
    /// A promotion failed; `corrupt`: its file was found corrupt (and is dropped).
    AbortPromotion {
        snapshot: SnapshotId,
        corrupt: bool,
    },
}

/// The answer to one [`StoreOp`], in the same position.
#[derive(Debug, PartialEq)]
pub enum StoreReply {
    Found(Found),
    Save(Result<SaveStart, CacheError>),
    Done(Result<(), CacheError>),
    /// Done, and these buffers are to be freed.
    Freed(Result<Vec<Eviction>, CacheError>),
}

/// A snapshot to fill: allocate `backing` and copy pool pages into it.
#[derive(Debug)]
pub struct SaveCopy {
    pub backing: BackingId,
    pub tier: Tier,
    pub bytes: u64,
    pub copies: Vec<PageCopy>,
    /// What the backing will hold: its frame's identity.
    pub snapshot: SnapshotId,
    /// The chained hash of each page saved.
    pub chain: Vec<PrefixHash>,
    /// The restore of this step (by position) whose pages this save copies: if that restore
    /// is refused as corrupt, so is the save.
    pub after_restore: Option<usize>,
    /// It copies KV computed by earlier steps, from pages its job gives back in this very
    /// step: copied first, before anything of the step can write them (restores, forks, the
    /// forward pass), and whether or not the forward pass works.
    pub before_forward: bool,
}

/// A snapshot to copy into pool pages before the forward pass.
#[derive(Debug)]
pub struct RestoreCopy {
    pub backing: BackingId,
    pub copies: Vec<PageCopy>,
    /// What the backing must hold: this snapshot, whose page `copies.len() - 1` has the
    /// chained hash `prefix`. Checked against the frame the save left.
    pub snapshot: SnapshotId,
    pub prefix: PrefixHash,
    pub tier: Tier,
}

/// Why a restore did not give its pages their bytes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RestoreFault {
    /// The copy could not run.
    Failed(String),
    /// The backing's frame or a block's checksum did not match: the bytes are not used.
    Corrupt { tier: Tier, reason: String },
}

impl std::fmt::Display for RestoreFault {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RestoreFault::Failed(reason) => f.write_str(reason),
            RestoreFault::Corrupt { tier, reason } => {
                write!(f, "the {tier} tier's copy is corrupt: {reason}")
            }
        }
    }
}

/// Everything the backend does for one scheduler step.
pub struct EngineStep {
    /// The scheduler's number for the step, which its answer carries back.
    pub id: u64,
    pub evictions: Vec<Eviction>,
    /// Disk snapshots to read back into memory, beside the steps (after the evictions).
    pub promotions: Vec<Promotion>,
    pub restores: Vec<RestoreCopy>,
    /// Pool pages to copy onto others after the restores, before the forward pass: one list
    /// per choice of an `n` > 1 request taking the prompt's KV from its first choice.
    pub forks: Vec<Vec<PageClone>>,
    pub plan: StepPlan,
    /// One per plan row: whose row it is, and whether and how it picks a token.
    pub rows: Vec<RowRequest>,
    /// Requests that ended, with the slots of their samplers: the engine drops them before
    /// the rows run (none of them has a row in this step; a slot may be handed to another).
    pub forget: Vec<(u32, RequestId)>,
    /// Empty for one step. Otherwise one per plan row, every row one token with a sampler:
    /// row `i` runs up to `row_steps[i]` decode steps, each fed the token the one before
    /// sampled, and stops early after a stop token of its sampler or the model's.
    pub row_steps: Vec<usize>,
    /// Empty when no row verifies a draft. Otherwise one per plan row: how many of the row's
    /// last tokens are drafted, to be kept while its sampler's picks agree with them
    /// ([`engine::backend::Backend::step_and_verify`]). Never with `row_steps`.
    pub drafts: Vec<usize>,
    pub saves: Vec<SaveCopy>,
    /// Empty unless some rows score their request's prompt tokens: those rows, ascending,
    /// each with what it scores (it wants the logits after every token). Never with
    /// `row_steps` or `drafts`.
    pub scores: Vec<(usize, PromptScore)>,
}

/// Which request a plan row belongs to, and how it picks a token, if it does.
#[derive(Debug)]
pub struct RowRequest {
    pub request: RequestId,
    /// The row ends at its request's end: it picks the next token.
    pub pick: Option<Pick>,
}

/// Prompt tokens a row scores ([`engine::sampling::SamplingParams::prompt_logprobs`]): the
/// logits after the row's token `from + i` score `targets[i]`, the prompt token after it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptScore {
    pub from: usize,
    pub targets: Vec<u32>,
    /// How many of the likeliest alternatives to report with each.
    pub top: usize,
}

/// How a row picks its token.
///
/// The engine keeps a request's sampler from the first row that picks for it (which hands it
/// over) until the request ends ([`EngineStep::forget`]), in a slot the scheduler numbers, so
/// steps may follow one another without waiting for each other's answers: a row planned
/// before the step ahead of it answered takes as its token the one that step picked for its
/// request (`follows`).
#[derive(Debug)]
pub struct Pick {
    /// Where the engine keeps the request's sampler.
    pub slot: u32,
    /// The request's sampler, handed over with its first row that picks.
    pub sampler: Option<Box<Sampler>>,
    /// The row's one token is the one the engine last picked for this request, unknown when
    /// the row was planned: the engine writes it into the row, whose token may hold anything
    /// until then (often the pick it wrote there the step before).
    pub follows: bool,
    /// Keep a copy of the logits this pick is made from (after a whole prompt).
    pub keep_logits: bool,
}

/// What a row's pick left besides its tokens, for the rows that left something.
#[derive(Debug, Default)]
pub struct PickOutcome {
    /// One per token sampled, when the request asked for them.
    pub logprobs: Vec<TokenLogprobs>,
    /// What [`Pick::keep_logits`] asked for.
    pub kept_logits: Option<Vec<f32>>,
    /// The request's grammar failed: its picks are not to be delivered.
    pub failure: Option<String>,
    /// What the row's [`PromptScore`] asked for ([`EngineStep::scores`]), in order (a row may score without
    /// picking: a prompt's chunk before its last).
    pub prompt_logprobs: Vec<TokenLogprobs>,
}

/// The tokens each plan row sampled, in order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SampledTokens {
    /// Room per row: the most steps any row ran.
    stride: usize,
    /// Row `i`'s tokens are `tokens[i * stride..][..counts[i]]`.
    tokens: Vec<u32>,
    counts: Vec<usize>,
}

impl SampledTokens {
    pub(crate) fn new(rows: usize, stride: usize) -> Self {
        SampledTokens {
            stride,
            tokens: vec![0; rows * stride],
            counts: vec![0; rows],
        }
    }

    /// The tokens row `i` sampled, first to last.
    pub fn row(&self, i: usize) -> &[u32] {
        &self.tokens[i * self.stride..][..self.counts[i]]
    }

    pub fn rows(&self) -> usize {
        self.counts.len()
    }

    pub(crate) fn push(&mut self, i: usize, token: u32) {
        self.tokens[i * self.stride + self.counts[i]] = token;
        self.counts[i] += 1;
    }

    pub(crate) fn last(&self, i: usize) -> Option<u32> {
        self.row(i).last().copied()
    }
}

pub struct EngineStepReply {
    /// The step's number ([`EngineStep::id`]).
    pub id: u64,
    /// Demotions whose copy ended since the last step (started in this step or earlier), and
    /// whether it worked.
    pub demotions: Vec<(SnapshotId, bool)>,
    /// The engine is gone: demotions it had started will never be reported.
    pub engine_gone: bool,
    /// Promotions whose read ended since the last step, and how.
    pub promotions: Vec<(SnapshotId, Result<(), RestoreFault>)>,
    /// Tiers where a copy other than a restore (a write to disk) found corrupt bytes: that
    /// snapshot's demotion failed and it is gone.
    pub corrupt_found: Vec<Tier>,
    pub restores: Vec<Result<(), RestoreFault>>,
    /// One per fork of the step, in order.
    pub forks: Vec<Result<(), String>>,
    /// The tokens each row sampled, or why the forward pass failed.
    pub forward: Result<SampledTokens, String>,
    /// Seconds the forward pass's first step took, sampling included (0 without rows).
    pub first_step_seconds: f64,
    /// The first step captured a CUDA graph: its time is not what such a step costs, and the
    /// scheduler's step-time models leave it out.
    pub first_step_captured: bool,
    /// A multi-step decode ended before its rows' step counts because the interrupt was
    /// raised (a request arrived or was cancelled).
    pub cut_short: bool,
    /// The backend's decode steps launched before they were asked for, so far: kept (they
    /// were the step asked for next) and left unread.
    pub run_ahead: (u64, u64),
    /// The engine's time from the end of its last step to the start of this one (none for
    /// its first): for a step planned while the one before it ran, the scheduling the device
    /// waited for.
    pub waited: Option<Duration>,
    /// What the picks left besides their tokens, by plan row, for the rows that left
    /// something (logprobs, kept logits, a grammar's failure), in row order.
    pub outcomes: Vec<(usize, PickOutcome)>,
    pub saves: Vec<Result<(), String>>,
    /// The plan, handed back so its buffers are refilled next step rather than reallocated.
    pub plan: StepPlan,
}

/// How many outcomes of each kind a step's reply carries.
#[derive(Debug, Clone, Copy)]
pub struct StepShape {
    id: u64,
    restores: usize,
    forks: usize,
    saves: usize,
}

impl EngineStepReply {
    pub fn shape_of(step: &EngineStep) -> StepShape {
        StepShape {
            id: step.id,
            restores: step.restores.len(),
            forks: step.forks.len(),
            saves: step.saves.len(),
        }
    }

    /// The reply of a step that never ran because the engine thread is gone: everything in
    /// it failed. (Demotions it carried stay `Demoting` in the store; nothing serves then.)
    pub fn failed(shape: StepShape, reason: &str) -> Self {
        EngineStepReply {
            id: shape.id,
            demotions: Vec::new(),
            engine_gone: true,
            promotions: Vec::new(),
            corrupt_found: Vec::new(),
            restores: vec![Err(RestoreFault::Failed(reason.to_string())); shape.restores],
            forks: vec![Err(reason.to_string()); shape.forks],
            forward: Err(reason.to_string()),
            first_step_seconds: 0.0,
            first_step_captured: false,
            cut_short: false,
            run_ahead: (0, 0),
            waited: None,
            outcomes: Vec::new(),
            saves: vec![Err(reason.to_string()); shape.saves],
            plan: StepPlan::default(),
        }
    }
}
