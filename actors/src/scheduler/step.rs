//! One step of the scheduler, phase by phase (see the module above for the order).
//!
//! Jobs are found by their index in `running`, which only changes at the start of a step
//! (cancelled jobs swept) and at its end (finished jobs removed, admitted ones appended), so the
//! indices a draft holds stay valid in between.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use cache::{
    CacheError, Eviction, Found, LookupHit, PageClone, PinnedRestore, PoolStats, Promotion,
    PromotionStart, SaveReservation, SaveStart, SnapshotId, Tier, page_clones,
};
use engine::backend::{LogitsWanted, RowPlan, StepPlan};
use policy::{BackoffStep, OnExhausted, ReservationPolicy};

use super::job::{Job, Slot};
use super::{Phase, Scheduler};
use crate::error::ServeError;
use crate::exchange::{
    EngineStep, EngineStepReply, Pick, PickOutcome, PoolOp, PoolReply, PromptScore, RestoreCopy,
    RestoreFault, RowRequest, SampledTokens, SaveCopy, StoreOp, StoreReply,
};
use crate::request::{FinishReason, RequestId};

/// A slice of one running job's tokens to compute this step.
#[derive(Debug, Clone, Copy)]
struct Row {
    job: usize,
    start: usize,
    end: usize,
    /// Decode steps the engine runs for it (1 but in a multi-step decode).
    steps: usize,
    /// Drafted tokens it verifies after its token (speculative decoding): the draft buffer's
    /// `draft_at..draft_at + draft`.
    draft: usize,
    draft_at: usize,
    /// Its job had a draft to offer and none of it was worth verifying.
    declined: bool,
    /// Dropped when the pool could not extend the job.
    live: bool,
    /// It picks its job's next token (set when the step is sent).
    samples: bool,
}

impl Row {
    fn new(job: usize, start: usize, end: usize) -> Self {
        Row {
            job,
            start,
            end,
            steps: 1,
            draft: 0,
            draft_at: 0,
            declined: false,
            live: true,
            samples: false,
        }
    }

    /// The end of the positions it may write: one more per extra decode step or drafted
    /// token.
    fn reach(&self) -> usize {
        self.end + self.steps - 1 + self.draft
    }
}

/// What a save copies, and for whom.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SaveKind {
    Prompt,
    Preemption,
    /// A finished request's prompt and reply, for the conversation's next turn.
    Reply,
    /// A prompt submitted to be kept (an operator's pinned prefix).
    Kept,
}

/// A store change that waits for the next step, once the engine has done its part.
#[derive(Debug)]
pub(super) enum StoreFollowUp {
    FinishRestore(SnapshotId),
    Commit(SaveReservation),
    Abort(SaveReservation),
    CommitDemotion(SnapshotId),
    AbortDemotion(SnapshotId),
    DropCorrupt(SnapshotId),
    CommitPromotion(SnapshotId),
    AbortPromotion(SnapshotId, bool),
}

impl StoreFollowUp {
    fn into_op(self) -> StoreOp {
        match self {
            StoreFollowUp::FinishRestore(id) => StoreOp::FinishRestore(id),
            StoreFollowUp::Commit(r) => StoreOp::CommitSave(r),
            StoreFollowUp::Abort(r) => StoreOp::AbortSave(r),
            StoreFollowUp::CommitDemotion(id) => StoreOp::CommitDemotion(id),
            StoreFollowUp::AbortDemotion(id) => StoreOp::AbortDemotion(id),
            StoreFollowUp::DropCorrupt(id) => StoreOp::DropCorrupt(id),
            StoreFollowUp::CommitPromotion(id) => StoreOp::CommitPromotion(id),
            StoreFollowUp::AbortPromotion(snapshot, corrupt) => {
                StoreOp::AbortPromotion { snapshot, corrupt }
            }
        }
    }
}

/// What each pool operation of the step was for.
#[derive(Debug, Clone, Copy)]
enum PoolPurpose {
    Truncate,
    Release,
    Extend(usize),
    Admit(usize),
    Fork(usize),
}

/// Whose save a store operation charges: a running job's (by index) or a candidate's (by
/// its place among the step's candidates).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum SaveFor {
    Running(usize),
    Candidate(usize),
}

/// What each store operation of the step (after the follow-ups) was for.
#[derive(Debug, Clone, Copy)]
enum StorePurpose {
    /// Candidate `c`'s lookup.
    Find(usize),
    /// A save. `row`: of a prompt a row of this step completes, and only worth copying if
    /// that row runs; else of KV computed before the step.
    Save {
        target: SaveFor,
        kind: SaveKind,
        row: bool,
    },
}

/// A job taken from the queue to admit this step.
pub(super) struct Candidate {
    job: Job,
    hit: Option<LookupHit>,
    /// The hit, pinned for its restore (a hit in memory).
    pinned: Option<PinnedRestore>,
    /// The prompt tokens it runs in this very step (its first chunk, allocated with the slot).
    first: usize,
    /// Its prompt's save was charged with its lookup, for a first chunk that completes it.
    save_charged: bool,
}

/// The step being built, between the phases.
#[derive(Default)]
pub(super) struct Draft {
    rows: Vec<Row>,
    /// The drafted tokens of every row, each row's run at its `draft_at`.
    drafted: Vec<u32>,
    /// How many of phase 1's store operations were follow-ups of the last step.
    follow_ups: usize,
    /// Jobs taken from the queue to admit.
    candidates: Vec<Candidate>,
    /// Other choices of a request to admit with a copy of their first choice's prompt KV:
    /// the job, the first choice's index in `running`, and whether the prompt's last token
    /// runs in this step (else in the next).
    forks: Vec<(Job, usize, bool)>,
    /// The page copies of the forks admitted, with their job's and their first choice's
    /// indices in `running`.
    fork_copies: Vec<(usize, usize, Vec<PageClone>)>,
    /// Prompt tokens the step may still take: what admitted jobs' first chunks share.
    prefill_left: usize,
    pool_purposes: Vec<PoolPurpose>,
    store_purposes: Vec<StorePurpose>,
    /// Preempted jobs (their attempts ran out in an earlier step): saved (if possible) and
    /// requeued this step.
    preempting: Vec<usize>,
    /// Running jobs that end this step without running (context full, `on_exhausted = fail`).
    failing: Vec<(usize, ServeError)>,
    /// Finished jobs whose reply save is over (made or not): released this step.
    closed: Vec<usize>,
    /// Jobs that ended on the first token picked from kept logits, at their admission.
    first_ends: Vec<(usize, End)>,
    restores: Vec<(usize, SnapshotId)>,
    /// The page tables of the jobs leaving at the end of this step (closing, preempted),
    /// whose pages go back in this step's exchange with the pool, once their saves copied.
    leaving_pages: Vec<(usize, Vec<cache::PageId>)>,
    /// Some save copies KV of earlier steps before the forward pass.
    saves_before_forward: bool,
    /// Saves the store charged, not yet matched with the pages they copy.
    reserved: Vec<(SaveFor, SaveKind, bool, SaveReservation)>,
    saves: Vec<(usize, SaveKind, SaveReservation)>,
    /// Buffers the store gave up (corrupt snapshots, room made for saves and promotions):
    /// freed, or demoted, by this step.
    freed: Vec<Eviction>,
    /// Disk snapshots candidates found, read back into memory beside this step.
    promotions: Vec<Promotion>,
    /// Jobs whose restored (or forked) KV was refused as corrupt: what they sampled is not
    /// delivered, and they compute their prompt again from the start.
    recompute: Vec<usize>,
    /// Plan row index to draft row index, for the rows sent to the engine.
    sent_rows: Vec<usize>,
    /// The page-table version of each row sent, by plan row.
    sent_versions: Vec<u64>,
    /// Tokens of the rows sent to the engine (of its first decode step, in a multi-step one).
    sent_tokens: usize,
    /// Whether a row sent holds more than one token before its draft (a prompt chunk).
    pub(super) sent_prompt_chunk: bool,
    /// Jobs swept and operations sent to the store and the pool so far: a step with none and
    /// no engine step changed nothing.
    changes: usize,
    /// Once sent: its number, which the engine's answer carries.
    pub(super) id: u64,
    /// Once sent, and `running` changed before its answer came: every running job's id and
    /// epoch, by index, as they were when it was sent, to find them again. Kept at the first
    /// change ([`Scheduler::keep_refs`]); until then its indices hold as they are.
    refs: Option<Vec<(RequestId, u32)>>,
    /// It runs one decode step a row and verifies no draft: the next step may be planned
    /// before it answers.
    pub(super) plain: bool,
    /// Once sent: some row of it verifies drafted tokens.
    verifies: bool,
    /// Once sent: some row of it scores prompt tokens (its logits all came to the host, so
    /// its time says little of a step's).
    scores: bool,
    /// Once sent: it went to the engine while the step before it ran.
    planned_ahead: bool,
}

/// The index of a job that left `running` (or whose epoch moved on) while a step naming it
/// ran: `running.get` finds nothing there.
const GONE: usize = usize::MAX;

/// What the step left for the driver to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepOutcome {
    /// Another step can run right away.
    pub ready: bool,
    /// If not, the earliest moment one can (a back-off ends).
    pub wake_at: Option<Instant>,
}

impl Scheduler {
    /// Phase 1: sweeps cancelled jobs and plans rows. Returns the step's one store exchange:
    /// the last steps' follow-ups (so a snapshot saved then is findable now), the saves of
    /// KV the running jobs hold or compute this step, and a lookup per admission candidate,
    /// with the save of its prompt when its first chunk completes it.
    pub fn begin_step(&mut self, now: Instant) -> Vec<StoreOp> {
        let started = Instant::now();
        assert!(self.draft.is_none(), "one step at a time");
        let swept = self.sweep_cancelled();
        let mut drafted = Vec::new();
        let (rows, prefill_left) = self.plan_rows(now, &mut drafted);
        for row in rows.iter().filter(|row| row.declined) {
            self.running[row.job].acceptance.declined();
        }
        let mut draft = Draft {
            rows,
            drafted,
            prefill_left,
            changes: swept,
            ..Draft::default()
        };
        let mut ops: Vec<StoreOp> = self
            .follow_ups
            .drain(..)
            .map(StoreFollowUp::into_op)
            .collect();
        draft.follow_ups = ops.len();
        self.plan_running_saves(&mut draft, &mut ops);
        let free_slots = self.config.max_running.saturating_sub(self.running.len());
        let mut waiting = VecDeque::new();
        let mut available = self.available_pages;
        while draft.candidates.len() + draft.forks.len() < free_slots {
            let Some(mut job) = self.queue.pop_front() else {
                break;
            };
            if let Some(first) = job.fork_of {
                match self.fork_source(first, job.tokens.len(), &waiting, &draft) {
                    ForkSource::Wait => {
                        waiting.push_back(job);
                        continue;
                    }
                    ForkSource::From(leader) => {
                        let pages = self.admission_pages(&job);
                        if pages > available {
                            waiting.push_back(job);
                            break;
                        }
                        available -= pages;
                        let runs_now = draft.prefill_left > 0;
                        draft.prefill_left -= runs_now as usize;
                        draft.forks.push((job, leader, runs_now));
                        continue;
                    }
                    ForkSource::Gone => job.fork_of = None,
                }
            }
            if !job.ready(now) {
                waiting.push_back(job);
                continue;
            }
            let pages = self.admission_pages(&job);
            if pages > available {
                waiting.push_back(job);
                break;
            }
            available -= pages;
            // A prompt to score is computed whole: nothing restored (an empty chain finds none).
            let pages = if job.scores_prompt() {
                0
            } else {
                job.tokens.len() / self.config.page_tokens
            };
            ops.push(StoreOp::Find {
                chain: job.chain(&self.hasher, pages).to_vec(),
                promote: !job.skip_disk,
            });
            draft
                .store_purposes
                .push(StorePurpose::Find(draft.candidates.len()));
            draft.candidates.push(Candidate {
                job,
                hit: None,
                pinned: None,
                first: 0,
                save_charged: false,
            });
        }
        waiting.extend(self.queue.drain(..));
        self.queue = waiting;
        self.plan_candidate_saves(&mut draft, &mut ops);
        // Several decode steps in one are planned only when no step is in flight: their rows
        // must start from known tokens.
        let nothing_waits =
            draft.candidates.is_empty() && draft.forks.is_empty() && self.queue.is_empty();
        if nothing_waits && self.sent.is_empty() {
            self.plan_decode_steps(&mut draft.rows);
        }
        draft.changes += ops.len() + draft.forks.len();
        self.draft = Some(draft);
        self.charge(Phase::Begin, started);
        ops
    }

    /// The save a prompt completed by a row wants, if any: kept whatever the policy for an
    /// operator's prefix, else saved when the policy says so and it was not already.
    fn prompt_save_kind(&self, job: &Job) -> Option<SaveKind> {
        let pt = self.config.page_tokens;
        if job.keep_prompt {
            Some(SaveKind::Kept)
        } else if self.config.save_prompts
            && !job.prompt_saved
            && job.prompt_len >= self.config.min_save_tokens.max(pt)
        {
            Some(SaveKind::Prompt)
        } else {
            None
        }
    }

    /// Charges, with the step's lookups, the saves of KV running jobs hold or compute: the
    /// prompts this step's rows complete (copied only if those rows run), prompts completed
    /// earlier without a save charged ([`Job::save_owed`]), the replies of closing jobs and
    /// what preempted jobs computed (each then leaves at the end of this step).
    fn plan_running_saves(&mut self, draft: &mut Draft, ops: &mut Vec<StoreOp>) {
        let pt = self.config.page_tokens;
        let mut wanted: Vec<(usize, usize, SaveKind, bool)> = Vec::new();
        for row in &draft.rows {
            let job = &self.running[row.job];
            if row.start < job.prompt_len
                && row.end >= job.prompt_len
                && let Some(kind) = self.prompt_save_kind(job)
            {
                wanted.push((row.job, job.prompt_len / pt, kind, true));
            }
        }
        for (index, job) in self.running.iter_mut().enumerate() {
            if job.save_owed {
                job.save_owed = false;
                if !(job.prompt_saved || job.closing || job.preempted) {
                    wanted.push((index, job.prompt_len / pt, SaveKind::Prompt, false));
                }
            }
            // A preempted job whose last row is still in flight leaves once it has answered.
            if !(job.closing || job.preempted) || job.leave_charged || job.in_flight > 0 {
                continue;
            }
            // Its pages go back in this step's exchange with the pool; its save copies them
            // first thing in the engine step.
            job.leave_charged = true;
            let slot = job.slot.take().expect("running jobs hold a slot");
            self.releases.push(slot.handle);
            draft.leaving_pages.push((index, slot.pages));
            if job.closing {
                wanted.push((index, job.computed / pt, SaveKind::Reply, false));
            } else {
                draft.preempting.push(index);
                if job.computed / pt > 0 {
                    wanted.push((index, job.computed / pt, SaveKind::Preemption, false));
                }
            }
        }
        for (index, pages, kind, row) in wanted {
            let chain = self.running[index].chain(&self.hasher, pages).to_vec();
            ops.push(save_op(kind, chain, self.config.save_tier));
            draft.store_purposes.push(StorePurpose::Save {
                target: SaveFor::Running(index),
                kind,
                row,
            });
        }
    }

    /// Charges the save of each candidate's prompt that its first chunk will complete
    /// whatever its lookup finds: the chunk it gets without a hit covers the prompt (a hit
    /// only shortens the chunks, leaving more of the budget to the candidates after it). A
    /// candidate whose first chunk completes its prompt only thanks to a hit saves it from
    /// the next step ([`Job::save_owed`]); an operator's prefix to keep instead waits a step
    /// with its last token, which then runs as a row of a running job, whose save is charged.
    fn plan_candidate_saves(&mut self, draft: &mut Draft, ops: &mut Vec<StoreOp>) {
        let pt = self.config.page_tokens;
        let mut left = draft.prefill_left;
        for c in 0..draft.candidates.len() {
            let job = &draft.candidates[c].job;
            let first = job.tokens.len().min(left);
            left -= first;
            if first < job.prompt_len {
                continue;
            }
            let Some(kind) = self.prompt_save_kind(job) else {
                continue;
            };
            let candidate = &mut draft.candidates[c];
            let chain = candidate
                .job
                .chain(&self.hasher, candidate.job.prompt_len / pt)
                .to_vec();
            candidate.save_charged = true;
            ops.push(save_op(kind, chain, self.config.save_tier));
            draft.store_purposes.push(StorePurpose::Save {
                target: SaveFor::Candidate(c),
                kind,
                row: true,
            });
        }
    }

    /// Where a choice waiting to fork from the request's first choice `first` (for a prompt of
    /// `prompt_len` tokens) stands: the first choice runs with the prompt's KV computed up to
    /// its last token (restores landed), or is still on its way there (queued, admitted this
    /// step, or computing the prompt), or is gone.
    fn fork_source(
        &self,
        first: RequestId,
        prompt_len: usize,
        waiting: &VecDeque<Job>,
        draft: &Draft,
    ) -> ForkSource {
        if let Some(index) = self.running.iter().position(|j| j.id == first) {
            let leader = &self.running[index];
            if leader.slot.is_none() {
                // Leaving: a preempted one comes back; a finished one gave its pages back.
                return if leader.preempted {
                    ForkSource::Wait
                } else {
                    ForkSource::Gone
                };
            }
            return if leader.restoring.is_none() && leader.computed + 1 >= prompt_len {
                ForkSource::From(index)
            } else {
                ForkSource::Wait
            };
        }
        let queued = self
            .queue
            .iter()
            .chain(waiting)
            .chain(draft.candidates.iter().map(|c| &c.job))
            .any(|j| j.id == first);
        if queued {
            ForkSource::Wait
        } else {
            ForkSource::Gone
        }
    }

    /// Lets the choices waiting to fork from `first`, which has ended, compute their prompt
    /// themselves.
    pub(super) fn release_forks(&mut self, first: RequestId) {
        for job in self.queue.iter_mut().filter(|j| j.fork_of == Some(first)) {
            job.fork_of = None;
        }
    }

    /// With `decode_steps` above 1 and nothing waiting, lets every row run several decode
    /// steps in one engine step, when each is one token at its job's end and (under the
    /// optimistic reservation) the pool has room for all their extra positions. A row runs
    /// no more steps than its job may still generate.
    fn plan_decode_steps(&self, rows: &mut [Row]) {
        let k = self.config.decode_steps;
        // Samplers that read their history need each token accepted before the next pick.
        let pure_decode = rows.iter().all(|row| {
            let job = &self.running[row.job];
            row.end - row.start == 1
                && row.draft == 0
                && row.end == job.tokens.len()
                && !job.params.reads_history()
        });
        if k <= 1 || rows.is_empty() || !pure_decode {
            return;
        }
        let pt = self.config.page_tokens;
        let mut extra_pages = 0;
        let mut steps = Vec::with_capacity(rows.len());
        for row in rows.iter() {
            let job = &self.running[row.job];
            let left = (job.max_new - job.generated()).min(self.limit.tokens - job.tokens.len());
            let n = k.min(left).max(1);
            let held = job
                .slot
                .as_ref()
                .expect("running jobs hold a slot")
                .pages
                .len();
            extra_pages += (row.start + n).div_ceil(pt).saturating_sub(held);
            steps.push(n);
        }
        if self.config.reservation == ReservationPolicy::Optimistic
            && extra_pages > self.available_pages
        {
            return;
        }
        for (row, n) in rows.iter_mut().zip(steps) {
            row.steps = n;
        }
    }

    /// Pages that must be free to admit `job`: its reservation, or under the optimistic
    /// policy room for everything it holds plus its next token, so that a job preempted for
    /// want of pages comes back only once there are more of them than it gave up.
    pub(super) fn admission_pages(&self, job: &Job) -> usize {
        let tokens = match self.config.reservation {
            ReservationPolicy::WorstCase => job.tokens.len() + job.max_new - job.generated(),
            ReservationPolicy::Optimistic => job.tokens.len() + 1,
        };
        tokens.div_ceil(self.config.page_tokens)
    }

    /// Ends the running jobs that were cancelled, abandoned by their caller or cut by a
    /// shutdown, and drops the queued ones whose caller went away. Returns how many.
    fn sweep_cancelled(&mut self) -> usize {
        let mut swept = 0;
        let mut index = 0;
        while index < self.running.len() {
            let job = &self.running[index];
            // A finished job saving its reply is past its caller (who has gone, often).
            if job.closing || !(job.cancelled || job.cut || job.abandoned()) {
                index += 1;
                continue;
            }
            self.keep_refs();
            let mut job = self.running.remove(index);
            swept += 1;
            self.release_forks(job.id);
            self.retire(&job);
            if let Some(slot) = job.slot.take() {
                self.releases.push(slot.handle);
            }
            if job.stopped_by_caller() {
                self.stats.finished += 1;
                job.finish(FinishReason::Stop);
            } else if job.cut && !job.abandoned() {
                tracing::warn!(
                    request = job.id.0,
                    "cut at shutdown after {} of at most {} tokens",
                    job.generated(),
                    job.max_new
                );
                self.stats.cut += 1;
                self.end_failed(job, ServeError::ShuttingDown);
            } else {
                self.stats.cancelled += 1;
                job.cancel();
            }
        }
        let before = self.queue.len();
        let stats = &mut self.stats;
        let mut gone = Vec::new();
        self.queue.retain(|job| {
            if !job.abandoned() {
                return true;
            }
            gone.push((job.id, job.sampler_slot));
            // A preempted job waits here with text already sent: its caller may have stopped it.
            if job.stopped_by_caller() {
                stats.finished += 1;
            } else {
                stats.cancelled += 1;
            }
            false
        });
        for (id, sampler_slot) in gone {
            self.release_forks(id);
            self.retire_sampler(id, sampler_slot);
        }
        swept + before - self.queue.len()
    }

    /// One-token rows first, each with its draft when speculating ([`Scheduler::plan_drafts`]);
    /// then prompt chunks, the fewest pending tokens first, so that a short prompt never waits
    /// behind a long one's prefill. Prompt chunks share what is left of the step's budget
    /// ([`Scheduler::prefill_budget`]); what they leave is returned, for the first chunks of
    /// the jobs admitted this step.
    fn plan_rows(&self, now: Instant, drafted: &mut Vec<u32>) -> (Vec<Row>, usize) {
        let mut rows = Vec::with_capacity(self.running.len());
        let ready = |job: &Job| job.ready(now) && job.pending() > 0;
        let mut decode_budget = self.config.step_token_budget;
        for (index, job) in self.running.iter().enumerate() {
            if decode_budget > 0 && ready(job) && job.pending() == 1 {
                rows.push(Row::new(index, job.computed, job.computed + 1));
                decode_budget -= 1;
            }
        }
        self.plan_drafts(&mut rows, drafted, decode_budget);
        let decode_tokens = rows.iter().map(|row| 1 + row.draft).sum();
        let mut prompts: Vec<usize> = (0..self.running.len())
            .filter(|&index| ready(&self.running[index]) && self.running[index].pending() > 1)
            .collect();
        prompts.sort_by_key(|&index| self.running[index].pending());
        let mut budget = self.prefill_budget(decode_tokens);
        for index in prompts {
            if budget == 0 {
                break;
            }
            let job = &self.running[index];
            let mut n = job.pending().min(budget);
            if job.scores_prompt() {
                // Its logits after every token come to the host: a bounded chunk a step.
                let most = SCORED_LOGITS_BYTES / (4 * self.config.vocab_size.max(1));
                n = n.min(most.max(self.config.page_tokens));
            }
            rows.push(Row::new(index, job.computed, job.computed + n));
            budget -= n;
        }
        (rows, budget)
    }

    /// Speculative decoding: with prompt lookup on and no more running requests than
    /// `speculative.max_batch`, gives each decode row the tokens the lookup proposes after its
    /// job's tokens, as many as [`policy::draft_lengths`] finds worth their cost, `budget` in
    /// all, and no more than it may still generate (less one: the verification adds a token of
    /// its own) or its sequence may hold. Under the optimistic reservation a draft takes new
    /// pages only from those no decode row needs. Samplers that read their history (penalties)
    /// pick one token a step.
    fn plan_drafts(&self, rows: &mut [Row], drafted: &mut Vec<u32>, mut budget: usize) {
        let spec = &self.config.speculative;
        if !self.speculating() || !self.sent.is_empty() {
            return;
        }
        let pt = self.config.page_tokens;
        let held_pages = |job: &Job| job.slot.as_ref().map_or(0, |slot| slot.pages.len());
        let own_pages: usize = rows
            .iter()
            .map(|row| {
                let job = &self.running[row.job];
                row.end.div_ceil(pt).saturating_sub(held_pages(job))
            })
            .sum();
        let mut spare_pages = match self.config.reservation {
            ReservationPolicy::Optimistic => self.available_pages.saturating_sub(own_pages),
            ReservationPolicy::WorstCase => usize::MAX,
        };
        let mut lookup = engine::speculative::PromptLookup {
            ngram_min: spec.ngram_min,
            ngram_max: spec.ngram_max,
        };
        let mut proposals: Vec<(usize, Vec<u32>)> = Vec::new();
        for (r, row) in rows.iter().enumerate() {
            let job = &self.running[row.job];
            let at_end = row.end == job.tokens.len();
            let plain = !job.params.reads_history();
            let room = (job.max_new - job.generated())
                .saturating_sub(1)
                .min(self.limit.tokens.saturating_sub(row.end));
            let most = spec.draft_tokens.min(room).min(budget);
            if !at_end || !plain || most == 0 {
                continue;
            }
            let proposal =
                engine::speculative::DraftSource::propose(&mut lookup, &job.tokens, most);
            if !proposal.is_empty() {
                proposals.push((r, proposal));
            }
        }
        let offers: Vec<policy::DraftOffer> = proposals
            .iter()
            .map(|(r, proposal)| self.running[rows[*r].job].acceptance.offer(proposal.len()))
            .collect();
        let tokens: usize = rows.iter().map(|row| row.end - row.start).sum();
        let cost = match spec.draft_sizing {
            policy::DraftSizing::ByCost => self
                .plain_time
                .fit()
                .zip(self.verify_time.fit_or_flat())
                .map(|(plain, verify)| policy::DraftCost {
                    plain_seconds: plain.seconds(tokens),
                    verify,
                }),
            policy::DraftSizing::Whole => None,
        };
        let lengths = policy::draft_lengths(&offers, tokens, rows.len(), cost);
        tracing::trace!("drafts: offers {offers:?}, cost {cost:?}: lengths {lengths:?}");
        for ((r, mut proposal), length) in proposals.into_iter().zip(lengths) {
            proposal.truncate(length.min(budget));
            let row = &mut rows[r];
            row.declined = length == 0;
            let job = &self.running[row.job];
            let pages = (row.end + proposal.len())
                .div_ceil(pt)
                .saturating_sub(held_pages(job).max(row.end.div_ceil(pt)));
            if proposal.is_empty() || pages > spare_pages {
                continue;
            }
            spare_pages = spare_pages.saturating_sub(pages);
            budget -= proposal.len();
            row.draft = proposal.len();
            row.draft_at = drafted.len();
            drafted.extend(proposal);
        }
    }

    /// Prompt tokens a step with `decode_rows` one-token rows may add: what the step's
    /// predicted time leaves under `max_step` (everything the token budget allows until a step
    /// has been timed), but at least a page, so prompts progress however busy decoding is.
    pub(super) fn prefill_budget(&self, decode_rows: usize) -> usize {
        let tokens_budget = self.config.step_token_budget.saturating_sub(decode_rows);
        let within_time = self.step_time.fit().map_or(usize::MAX, |fit| {
            fit.tokens_within(self.config.max_step)
                .saturating_sub(decode_rows)
        });
        within_time.max(self.config.page_tokens).min(tokens_budget)
    }

    /// Phase 2: the pool changes, given the store's answers to phase 1.
    pub fn plan_pool(&mut self, replies: Vec<StoreReply>) -> Vec<PoolOp> {
        let started = Instant::now();
        let mut draft = self.draft.take().expect("begin_step ran");
        let mut replies = replies.into_iter();
        for reply in replies.by_ref().take(draft.follow_ups) {
            match reply {
                StoreReply::Done(Err(e)) | StoreReply::Freed(Err(e)) => {
                    tracing::error!("snapshot store follow-up: {e}");
                }
                StoreReply::Freed(Ok(freed)) => draft.freed.extend(freed),
                _ => {}
            }
        }
        let purposes = std::mem::take(&mut draft.store_purposes);
        assert_eq!(
            purposes.len(),
            replies.len(),
            "one answer per store request"
        );
        for (purpose, reply) in purposes.into_iter().zip(replies) {
            match (purpose, reply) {
                (StorePurpose::Find(c), StoreReply::Found(found)) => {
                    self.apply_found(&mut draft, c, found)
                }
                (StorePurpose::Save { target, kind, row }, StoreReply::Save(result)) => {
                    self.apply_save_start(&mut draft, target, kind, row, result)
                }
                (purpose, reply) => unreachable!("store answered {reply:?} to {purpose:?}"),
            }
        }
        let mut ops = Vec::new();
        for (handle, tokens) in self.truncates.drain(..) {
            ops.push(PoolOp::Truncate { handle, tokens });
            draft.pool_purposes.push(PoolPurpose::Truncate);
        }
        for handle in self.releases.drain(..) {
            ops.push(PoolOp::Release(handle));
            draft.pool_purposes.push(PoolPurpose::Release);
        }
        let pt = self.config.page_tokens;
        for (r, row) in draft.rows.iter().enumerate() {
            let slot = self.running[row.job]
                .slot
                .as_mut()
                .expect("running jobs hold a slot");
            let reach = row.reach();
            if reach <= slot.held_tokens {
                continue;
            }
            if reach <= slot.pages.len() * pt {
                slot.held_tokens = reach;
                continue;
            }
            ops.push(PoolOp::Extend {
                handle: slot.handle,
                tokens: reach - slot.pooled_tokens,
            });
            draft.pool_purposes.push(PoolPurpose::Extend(r));
        }
        // A job whose prefix is on its way back from disk waits in the queue; the rest are
        // admitted.
        let mut parked = Vec::new();
        let mut admitting = Vec::with_capacity(draft.candidates.len());
        let mut moved = Vec::with_capacity(draft.candidates.len());
        for candidate in std::mem::take(&mut draft.candidates) {
            if candidate.job.awaiting.is_some() {
                moved.push(None);
                parked.push(candidate.job);
            } else {
                moved.push(Some(admitting.len()));
                admitting.push(candidate);
            }
        }
        draft.candidates = admitting;
        for job in parked.into_iter().rev() {
            self.queue.push_front(job);
        }
        // A parked candidate's save waits for its admission.
        for (target, kind, row, reservation) in std::mem::take(&mut draft.reserved) {
            let target = match target {
                SaveFor::Candidate(c) => match moved[c] {
                    Some(now) => SaveFor::Candidate(now),
                    None => {
                        self.follow_ups.push(StoreFollowUp::Abort(reservation));
                        continue;
                    }
                },
                running => running,
            };
            draft.reserved.push((target, kind, row, reservation));
        }
        for (c, candidate) in draft.candidates.iter_mut().enumerate() {
            let job = &mut candidate.job;
            let found = candidate.pinned.as_ref().and(candidate.hit);
            job.first_logits = found.and_then(|h| self.kept_first_logits(job, h));
            // The new slot comes with the restored prefix and the first chunk after it, which
            // runs in this step: a short request's first token needs no step of its own. (With
            // kept logits, the chunk is the prompt's partial page and its first token.)
            let restored = found.map_or(0, |h| h.tokens);
            let pending = job.tokens.len() + job.first_logits.is_some() as usize;
            let resume = resume_at(job, restored);
            let mut first = (pending - resume).min(draft.prefill_left);
            if job.keep_prompt && !candidate.save_charged {
                // Its save is charged next step, with its last token's row.
                first = first.min((job.prompt_len - 1).saturating_sub(resume));
            }
            candidate.first = first;
            draft.prefill_left -= first;
            let initial_tokens = initial_tokens(job, restored, first);
            ops.push(PoolOp::Admit {
                prompt_tokens: job.tokens.len(),
                max_new_tokens: job.max_new - job.generated(),
                initial_tokens,
            });
            draft.pool_purposes.push(PoolPurpose::Admit(c));
        }
        for (f, (job, _, runs_now)) in draft.forks.iter().enumerate() {
            ops.push(PoolOp::Admit {
                prompt_tokens: job.tokens.len(),
                max_new_tokens: job.max_new - job.generated(),
                initial_tokens: job.tokens.len() - 1 + *runs_now as usize,
            });
            draft.pool_purposes.push(PoolPurpose::Fork(f));
        }
        draft.changes += ops.len();
        self.draft = Some(draft);
        self.charge(Phase::Pool, started);
        ops
    }

    /// Phase 3: applies the pool's answers and returns the engine step, if there is work.
    /// `stats` is `None` when phase 2 had nothing for the pool, which then did not change.
    pub fn plan_engine(
        &mut self,
        replies: Vec<PoolReply>,
        stats: Option<PoolStats>,
        now: Instant,
    ) -> Option<EngineStep> {
        let started = Instant::now();
        if let Some(stats) = stats {
            self.available_pages = stats.available_pages;
        }
        let mut draft = self.draft.take().expect("plan_pool ran");
        let purposes = std::mem::take(&mut draft.pool_purposes);
        let mut admitted = Vec::new();
        let mut refused = Vec::new();
        let mut candidates: Vec<Option<Candidate>> = std::mem::take(&mut draft.candidates)
            .into_iter()
            .map(Some)
            .collect();
        let mut forks: Vec<Option<(Job, usize, bool)>> = std::mem::take(&mut draft.forks)
            .into_iter()
            .map(Some)
            .collect();
        let mut forked = Vec::new();
        for (purpose, reply) in purposes.into_iter().zip(replies) {
            match (purpose, reply) {
                (PoolPurpose::Release, PoolReply::Released(result)) => {
                    if let Err(e) = result {
                        tracing::error!("releasing a slot: {e}");
                    }
                }
                (PoolPurpose::Truncate, PoolReply::Truncated(result)) => {
                    if let Err(e) = result {
                        tracing::error!("cutting a slot back: {e}");
                    }
                }
                (PoolPurpose::Extend(r), PoolReply::Extended(result)) => {
                    self.apply_extend(&mut draft, r, result, now)
                }
                (PoolPurpose::Admit(c), PoolReply::Admitted(result)) => {
                    let candidate = candidates[c]
                        .take()
                        .expect("each candidate is admitted once");
                    match result {
                        Ok((handle, pages)) => {
                            let restored = candidate.pinned.as_ref().map_or(0, |p| p.tokens());
                            let held_tokens =
                                initial_tokens(&candidate.job, restored, candidate.first);
                            let slot = Slot {
                                handle,
                                held_tokens,
                                pooled_tokens: held_tokens,
                                pages,
                                version: self.table_version(),
                            };
                            admitted.push((c, candidate, slot));
                        }
                        Err(e) => {
                            if let Some(pinned) = &candidate.pinned {
                                self.follow_ups
                                    .push(StoreFollowUp::FinishRestore(pinned.snapshot));
                            }
                            match e {
                                CacheError::LargerThanPool {
                                    needed_pages,
                                    total_pages,
                                } => {
                                    let reason = format!(
                                        "the request needs {needed_pages} KV pages; the pool has {total_pages}"
                                    );
                                    self.end_failed(candidate.job, ServeError::Invalid(reason));
                                }
                                _ => refused.push(candidate.job),
                            }
                        }
                    }
                }
                (PoolPurpose::Fork(f), PoolReply::Admitted(result)) => {
                    let (job, leader, runs_now) =
                        forks[f].take().expect("each fork is admitted once");
                    match result {
                        Ok((handle, pages)) => {
                            let held_tokens = job.tokens.len() - 1 + runs_now as usize;
                            let slot = Slot {
                                handle,
                                held_tokens,
                                pooled_tokens: held_tokens,
                                pages,
                                version: self.table_version(),
                            };
                            forked.push((job, leader, runs_now, slot));
                        }
                        // Never a pool too small: the first choice, as large, fits.
                        Err(_) => refused.push(job),
                    }
                }
                (purpose, reply) => unreachable!("pool answered {reply:?} to {purpose:?}"),
            }
        }
        for job in refused.into_iter().rev() {
            self.queue.push_front(job);
        }
        let mut step = EngineStep {
            id: 0,
            evictions: std::mem::take(&mut draft.freed),
            promotions: std::mem::take(&mut draft.promotions),
            restores: Vec::new(),
            forks: Vec::new(),
            plan: StepPlan::default(),
            rows: Vec::new(),
            forget: Vec::new(),
            row_steps: Vec::new(),
            drafts: Vec::new(),
            saves: Vec::new(),
            scores: Vec::new(),
        };
        // Where each candidate now runs, if it was admitted.
        let mut admitted_at = vec![None; candidates.len()];
        for (c, candidate, slot) in admitted {
            admitted_at[c] = Some(self.running.len());
            self.admit(candidate, slot, &mut draft, &mut step);
        }
        for (job, leader, runs_now, slot) in forked {
            self.admit_fork(job, leader, runs_now, slot, &mut draft);
        }
        step.forks = draft
            .fork_copies
            .iter_mut()
            .map(|(_, _, clones)| std::mem::take(clones))
            .collect();
        self.plan_save_copies(&mut draft, &mut step, &admitted_at);
        // First tokens picked from kept logits go out now, not with the step's answer.
        self.waking.wake();
        let step = self.plan_rows_sent(draft, step);
        self.charge(Phase::Engine, started);
        step
    }

    fn apply_extend(
        &mut self,
        draft: &mut Draft,
        r: usize,
        result: Result<Vec<cache::PageId>, CacheError>,
        now: Instant,
    ) {
        let row = draft.rows[r];
        let job = &mut self.running[row.job];
        match result {
            Ok(pages) => {
                let slot = job.slot.as_mut().expect("running jobs hold a slot");
                slot.pages.extend(pages);
                slot.held_tokens = row.reach();
                slot.pooled_tokens = row.reach();
                job.backoff.on_progress();
            }
            Err(CacheError::ContextFull {
                needed_pages,
                free_pages,
            }) => {
                draft.rows[r].live = false;
                match job.backoff.on_refused(&self.config.backoff, &mut self.rng) {
                    BackoffStep::Retry { delay_ms, .. } => {
                        self.stats.backoffs += 1;
                        job.blocked_until = Some(now + Duration::from_millis(delay_ms));
                    }
                    BackoffStep::Exhausted {
                        action: OnExhausted::Preempt,
                        ..
                    } => self.preempt_for(row.job, draft),
                    BackoffStep::Exhausted {
                        attempts,
                        action: OnExhausted::Fail,
                    } => {
                        draft.failing.push((
                            row.job,
                            ServeError::ContextFull {
                                needed_pages,
                                free_pages,
                                attempts,
                            },
                        ));
                    }
                }
            }
            Err(e) => {
                draft.rows[r].live = false;
                draft.failing.push((
                    row.job,
                    ServeError::Engine(format!("the pool refused to extend the sequence: {e}")),
                ));
            }
        }
    }

    /// Job `index` ran out of attempts to grow: the youngest running request gives way (it
    /// runs no more; the next step saves what it computed, gives its pages back and requeues
    /// it), and `index` tries again at once, with the pages it frees. When none is younger,
    /// `index` tries again too if a job preempted before it is yet to give its pages back,
    /// else it gives way itself. The oldest request thus always progresses, whatever the
    /// pool's size: two requests that each preempted themselves whenever they ran dry (in the
    /// same step, say) could both lose their work for ever, or restore it only to run dry
    /// together again.
    fn preempt_for(&mut self, index: usize, draft: &mut Draft) {
        let key = |job: &Job| (job.submitted_at, job.id.0);
        let younger = self
            .running
            .iter()
            .enumerate()
            .filter(|(_, job)| job.slot.is_some() && !job.closing && !job.preempted)
            .max_by_key(|(_, job)| key(job))
            .map(|(victim, _)| victim)
            .filter(|&victim| key(&self.running[victim]) > key(&self.running[index]));
        let pages_coming = self
            .running
            .iter()
            .any(|job| job.preempted && !job.leave_charged);
        if younger.is_none() && !pages_coming {
            self.running[index].preempted = true;
            return;
        }
        let job = &mut self.running[index];
        job.backoff = policy::Backoff::new();
        job.blocked_until = None;
        if let Some(victim) = younger {
            // It runs nothing more, this step included.
            for row in draft.rows.iter_mut().filter(|row| row.job == victim) {
                row.live = false;
            }
            self.running[victim].preempted = true;
        }
    }

    /// A job that got a slot: running from now on, restoring its prefix first if one was
    /// pinned for it, and running its first prompt tokens after it in this step (the engine
    /// restores before the forward pass).
    fn admit(
        &mut self,
        candidate: Candidate,
        slot: Slot,
        draft: &mut Draft,
        step: &mut EngineStep,
    ) {
        let Candidate {
            mut job,
            mut pinned,
            mut first,
            ..
        } = candidate;
        let index = self.running.len();
        if let Some(logits) = job.first_logits.take() {
            self.stats.first_tokens_from_kept_logits += 1;
            if let Some(end) = self.first_token_from(&mut job, &logits) {
                // Done before computing anything: its pages are never written, so nothing
                // restores into them and nothing saves from them.
                job.set_cached_tokens(job.prompt_len);
                first = 0;
                if let Some(pinned) = pinned.take() {
                    self.follow_ups
                        .push(StoreFollowUp::FinishRestore(pinned.snapshot));
                }
                draft.first_ends.push((index, end));
            }
        }
        if let Some(pinned) = pinned {
            let plan = pinned
                .plan(&slot.pages)
                .expect("a new slot holds the positions it restores");
            job.computed = resume_at(&job, plan.tokens);
            job.restoring = Some(plan.snapshot);
            job.set_cached_tokens(job.usage.cached_tokens + job.computed);
            self.stats.restored_tokens += job.computed as u64;
            draft.restores.push((index, plan.snapshot));
            step.restores.push(RestoreCopy {
                backing: plan.backing,
                copies: plan.copies,
                snapshot: plan.snapshot,
                prefix: plan.prefix,
                tier: plan.tier,
            });
        }
        if first > 0 {
            draft
                .rows
                .push(Row::new(index, job.computed, job.computed + first));
        }
        job.slot = Some(slot);
        job.blocked_until = None;
        self.running.push(job);
    }

    /// The logits kept after `job`'s whole prompt, when it has generated nothing yet and `hit`
    /// restores every full page of its prompt (from memory: a disk hit is read back first).
    fn kept_first_logits(&mut self, job: &mut Job, hit: LookupHit) -> Option<Arc<[f32]>> {
        let pt = self.config.page_tokens;
        let whole_pages = job.prompt_len / pt;
        if job.generated() > 0 || whole_pages == 0 || hit.tokens != whole_pages * pt {
            return None;
        }
        // A sampler the engine holds has picked for this request before.
        job.sampler.as_ref()?;
        if hit.tier == Tier::Disk {
            return None;
        }
        let key = job.prompt_key(&self.hasher);
        self.prompt_logits.get(&key)
    }

    /// Picks a job's first token from the logits kept after its prompt, as a step would have
    /// from the logits it computed, and sends it. The token joins its tokens uncomputed: the
    /// prompt's partial page and it run as the job's next row. Returns how the job ends, if
    /// this token ends it (or its grammar failed).
    fn first_token_from(&mut self, job: &mut Job, logits: &[f32]) -> Option<End> {
        let sampler = job
            .sampler
            .as_mut()
            .expect("the sampler is home between steps");
        let token = sampler.sample(&mut logits.to_vec());
        let logprobs = sampler.take_logprobs();
        if let Some(failure) = sampler.failure() {
            return Some(End::Failed(ServeError::Grammar(failure.to_owned())));
        }
        sampler.accept(token);
        let params = sampler.params();
        let eos = &self.config.eos_token_ids;
        let reason = engine::stop::finish_after(params, eos, token, 1, job.max_new);
        job.tokens.push(token);
        job.emit_tokens(&[token], logprobs, &mut self.waking);
        self.stats.generated_tokens += 1;
        reason.map(End::Finished)
    }

    /// A choice that got a slot to fork into: the copy of its first choice's prompt KV but
    /// the last token's is planned for this step, before the forward pass, and that last
    /// token runs after it (this step when `runs_now`, else the next), for its own logits.
    fn admit_fork(
        &mut self,
        mut job: Job,
        leader: usize,
        runs_now: bool,
        slot: Slot,
        draft: &mut Draft,
    ) {
        let copied = job.tokens.len() - 1;
        let pages = copied.div_ceil(self.config.page_tokens);
        let source = &self.running[leader]
            .slot
            .as_ref()
            .expect("running jobs hold a slot")
            .pages;
        let clones = page_clones(pages, source, &slot.pages)
            .expect("both page tables hold the prompt's positions");
        let index = self.running.len();
        draft.fork_copies.push((index, leader, clones));
        job.computed = copied;
        job.fork_of = None;
        if runs_now {
            draft.rows.push(Row::new(index, copied, copied + 1));
        }
        job.slot = Some(slot);
        job.blocked_until = None;
        self.stats.forked_tokens += copied as u64;
        self.running.push(job);
    }

    /// Matches each save the store charged with the pages it copies: those of the job it is
    /// for, if that job runs (and, for a prompt its row completes, if that row runs), else
    /// the save is given up.
    fn plan_save_copies(
        &mut self,
        draft: &mut Draft,
        step: &mut EngineStep,
        admitted_at: &[Option<usize>],
    ) {
        for (target, kind, row, reservation) in std::mem::take(&mut draft.reserved) {
            let index = match target {
                SaveFor::Running(index) => Some(index),
                SaveFor::Candidate(c) => admitted_at[c],
            };
            let copied = index.filter(|&index| {
                !row || draft
                    .rows
                    .iter()
                    .any(|r| r.job == index && r.live && r.end >= self.running[index].prompt_len)
            });
            let Some(index) = copied else {
                self.follow_ups.push(StoreFollowUp::Abort(reservation));
                continue;
            };
            let pages = match draft.leaving_pages.iter().find(|(i, _)| *i == index) {
                Some((_, pages)) => pages,
                None => {
                    &self.running[index]
                        .slot
                        .as_ref()
                        .expect("saving jobs hold a slot")
                        .pages
                }
            };
            let copies = reservation
                .copies(pages)
                .expect("a save covers at most the pages the job holds");
            let chain = self.running[index]
                .chain(&self.hasher, reservation.pages())
                .to_vec();
            let after_restore = draft.restores.iter().position(|&(i, _)| i == index);
            step.saves.push(SaveCopy {
                backing: reservation.backing(),
                tier: reservation.tier(),
                bytes: reservation.bytes(),
                copies,
                snapshot: reservation.snapshot(),
                chain,
                after_restore,
                before_forward: !row,
            });
            draft.saves_before_forward |= !row;
            if kind == SaveKind::Kept {
                self.running[index].usage.kept = Some(reservation.snapshot());
            }
            draft.saves.push((index, kind, reservation));
        }
    }

    /// Phase 3's end: the rows that run, with how each picks, into the engine step; `None`
    /// when the step has nothing for the engine.
    fn plan_rows_sent(&mut self, mut draft: Draft, mut step: EngineStep) -> Option<EngineStep> {
        // A step that scores prompt tokens brings its logits to the host: one step, no drafts.
        let scores = draft.rows.iter().any(|row| {
            row.live
                && !self.running[row.job]
                    .scored_positions(row.start, row.end)
                    .is_empty()
        });
        if scores {
            for row in &mut draft.rows {
                row.steps = 1;
                row.draft = 0;
            }
        }
        draft.scores = scores;
        let multi_step = draft.rows.iter().any(|row| row.live && row.steps > 1);
        let verify = draft.rows.iter().any(|row| row.live && row.draft > 0);
        self.stats.multi_steps += multi_step as u64;
        // Sized once: grown row by row, 256 rows moved a step ~30 KB through reallocations.
        let rows = draft.rows.len();
        step.plan.rows.reserve(rows);
        step.rows.reserve(rows);
        // The lists' memory was last the engine thread's (it read them, or freed what the
        // allocator hands back): taken over a line at a time as rows are pushed, each row's
        // store waited out a round trip to the other core (Rust's moves of a row go through
        // the stack in stores a wider load cannot forward from, which drain the store queue).
        // Owned together first, the round trips overlap: 13.7 to 8.6 µs at 256 rows.
        crate::lines::own_lines(step.plan.rows.spare_capacity_mut());
        crate::lines::own_lines(step.rows.spare_capacity_mut());
        draft.sent_rows.reserve(rows);
        draft.sent_versions.reserve(rows);
        for r in 0..draft.rows.len() {
            let row = draft.rows[r];
            if !row.live {
                continue;
            }
            let sample = row.end == self.running[row.job].planned_len();
            if sample && self.running[row.job].sampler_slot.is_none() {
                let slot = self.sampler_slot();
                self.running[row.job].sampler_slot = Some(slot);
            }
            let job = &mut self.running[row.job];
            // Its one token is the pick of the step in flight, which the engine fills in.
            let follows = row.start == job.tokens.len();
            let slot = job.slot.as_ref().expect("running jobs hold a slot");
            // The row its job's last answered step handed back holds its page table as it was
            // then, which this one extends (a table only grows between versions).
            let (mut plan_row, had) = match job.spare_row.take() {
                Some((row, version)) if version == slot.version => {
                    let had = row.pages.len();
                    (row, had)
                }
                spare => {
                    let row = spare.map(|(row, _)| row).or_else(|| self.spare_rows.pop());
                    let row = row.unwrap_or_else(|| RowPlan {
                        tokens: Vec::new(),
                        start_pos: 0,
                        pages: Vec::new(),
                        logits: LogitsWanted::None,
                    });
                    (row, 0)
                }
            };
            draft.sent_versions.push(slot.version);
            if follows && row.draft == 0 && plan_row.tokens.len() == 1 {
                // The row's one token is the pick the engine writes in, over its last: the
                // line stays the engine's, not pulled to this thread and back each step.
            } else {
                plan_row.tokens.clear();
                if follows {
                    plan_row.tokens.push(0);
                } else {
                    plan_row
                        .tokens
                        .extend_from_slice(&job.tokens[row.start..row.end]);
                }
                plan_row
                    .tokens
                    .extend_from_slice(&draft.drafted[row.draft_at..row.draft_at + row.draft]);
            }
            // Copied, not lent: the next step may be planned before this one answers.
            plan_row.pages.truncate(had.min(slot.pages.len()));
            plan_row
                .pages
                .extend_from_slice(&slot.pages[plan_row.pages.len()..]);
            plan_row.start_pos = row.start;
            let mut scores_row = false;
            if scores {
                let scored = job.scored_positions(row.start, row.end);
                if !scored.is_empty() {
                    let score = PromptScore {
                        from: scored.start - row.start,
                        targets: job.tokens[scored.start + 1..scored.end + 1].to_vec(),
                        top: job.params.prompt_logprobs.unwrap_or(0),
                    };
                    step.scores.push((step.plan.rows.len(), score));
                    job.scores_asked = scored.end;
                    scores_row = true;
                }
            }
            plan_row.logits = match (sample, row.draft, scores_row) {
                (_, _, true) => LogitsWanted::All,
                (false, _, _) => LogitsWanted::None,
                (true, 0, _) => LogitsWanted::Last,
                (true, _, _) => LogitsWanted::All,
            };
            step.plan.rows.push(plan_row);
            let mut keep_logits = false;
            if sample
                && job.generated() + job.in_flight == 0
                && self.prompt_logits.keeps(self.config.vocab_size)
                && prompt_whole_in_store(job, row.job, &draft.saves, self.config.page_tokens)
            {
                let key = job.prompt_key(&self.hasher);
                if !self.prompt_logits.contains(&key) {
                    job.keep_logits_as = Some(key);
                    keep_logits = true;
                }
            }
            let pick = sample.then(|| Pick {
                slot: job
                    .sampler_slot
                    .expect("given above to every job that picks"),
                sampler: job.sampler.take(),
                follows,
                keep_logits,
            });
            step.rows.push(RowRequest {
                request: job.id,
                pick,
            });
            // Counted now, so that the next step can be planned before this one answers.
            job.computed = row.end;
            job.in_flight += sample as usize;
            draft.rows[r].samples = sample;
            if multi_step {
                step.row_steps.push(row.steps);
            }
            if verify {
                step.drafts.push(row.draft);
            }
            draft.sent_rows.push(r);
            draft.sent_tokens += row.end - row.start + row.draft;
            draft.sent_prompt_chunk |= row.end - row.start > 1;
        }
        let idle = step.plan.rows.is_empty()
            && step.restores.is_empty()
            && step.forks.is_empty()
            && step.saves.is_empty()
            && step.evictions.is_empty();
        // An empty step still collects the demotions that landed, and has the engine drop
        // the samplers of requests that ended (each may hold a vocabulary-sized buffer).
        if idle && self.demotions_in_flight == 0 && self.forget.is_empty() {
            self.draft = Some(draft);
            return None;
        }
        step.forget = std::mem::take(&mut self.forget);
        step.id = self.next_step_id;
        draft.id = self.next_step_id;
        self.next_step_id += 1;
        draft.plain = !multi_step && !verify;
        draft.verifies = verify;
        draft.planned_ahead = !self.sent.is_empty();
        self.stats.planned_ahead += draft.planned_ahead as u64;
        self.sent.push_back(draft);
        Some(step)
    }

    /// What candidate `c`'s lookup found: a prefix pinned for its restore, a disk snapshot
    /// on its way back into memory (the candidate then waits in the queue for it), or
    /// nothing it can use (it computes its prompt).
    fn apply_found(&mut self, draft: &mut Draft, c: usize, found: Found) {
        let candidate = &mut draft.candidates[c];
        candidate.hit = found.hit;
        match found.restore {
            Some(Ok(pinned)) => candidate.pinned = Some(pinned),
            Some(Err(e)) => tracing::warn!("restore refused, prefilling cold: {e}"),
            None => {}
        }
        let Some(hit) = found.hit.filter(|h| h.tier == Tier::Disk) else {
            return;
        };
        match found.promotion {
            Some(Ok(PromotionStart::Started {
                promotion,
                evictions,
            })) => {
                self.demotions_in_flight +=
                    1 + evictions.iter().filter(|e| e.demoted_to.is_some()).count();
                draft.freed.extend(evictions);
                draft.promotions.push(promotion);
                candidate.job.awaiting = Some(hit.snapshot);
            }
            Some(Ok(PromotionStart::InFlight)) => candidate.job.awaiting = Some(hit.snapshot),
            Some(Err(e)) => {
                tracing::warn!("{} stays on disk, prefilling instead: {e}", hit.snapshot);
                candidate.job.skip_disk = true;
                self.stop_awaiting(hit.snapshot, false);
            }
            // Its read back failed before: it computes its prompt.
            None => {}
        }
    }

    /// The store's answer to a save: charged (to be matched with its pages once the pool has
    /// answered), or not needed, or refused.
    fn apply_save_start(
        &mut self,
        draft: &mut Draft,
        target: SaveFor,
        kind: SaveKind,
        row: bool,
        result: Result<SaveStart, CacheError>,
    ) {
        let job = match target {
            SaveFor::Running(index) => &mut self.running[index],
            SaveFor::Candidate(c) => &mut draft.candidates[c].job,
        };
        match result {
            Ok(SaveStart::Reserved {
                reservation,
                evictions,
            }) => {
                self.demotions_in_flight +=
                    evictions.iter().filter(|e| e.demoted_to.is_some()).count();
                draft.freed.extend(evictions);
                draft.reserved.push((target, kind, row, reservation));
                return;
            }
            Ok(SaveStart::AlreadyStored(id)) => match kind {
                SaveKind::Prompt => {
                    job.prompt_saved = true;
                    job.prompt_stored = true;
                }
                SaveKind::Kept => job.usage.kept = Some(id),
                SaveKind::Preemption | SaveKind::Reply => {}
            },
            Ok(SaveStart::NotSeenEnough) => {
                if kind == SaveKind::Prompt {
                    job.prompt_saved = true;
                }
            }
            Err(e) => {
                if kind == SaveKind::Kept {
                    job.keep_failure = Some(e.to_string());
                }
            }
        }
        if let (SaveKind::Reply, SaveFor::Running(index)) = (kind, target) {
            draft.closed.push(index);
        }
    }

    /// Phase 5: applies the engine's answer (`None` when no engine step ran) and says what next.
    ///
    /// A step that changed nothing (no exchange with any actor) never asks for another at once:
    /// the next one starts when a message or a back-off's end changes something, so no state
    /// can make the loop spin.
    pub fn finish_step(&mut self, reply: Option<EngineStepReply>, now: Instant) -> StepOutcome {
        let started = Instant::now();
        let mut draft = match &reply {
            Some(reply) => {
                assert!(
                    self.draft.is_none(),
                    "a step answers between plans, not during one"
                );
                let draft = self.sent.pop_front().expect("an answer is to a step sent");
                assert_eq!(
                    draft.id, reply.id,
                    "answers come in the order steps were sent"
                );
                draft
            }
            None => self.draft.take().expect("plan_engine ran"),
        };
        self.rebase(&mut draft);
        self.stats.steps += 1;
        self.next_poll = now + super::DEMOTION_POLL;
        let did_work = draft.changes > 0 || reply.is_some();
        let mut ended: Vec<(usize, End)> = Vec::new();
        if let Some(reply) = reply {
            self.stats.multi_steps_cut_short += reply.cut_short as u64;
            self.stats.steps_run_ahead = reply.run_ahead;
            tracing::trace!(
                "step {}: {} tokens, verifies {}, forward {:.3} ms, captured {}",
                draft.id,
                draft.sent_tokens,
                draft.verifies,
                reply.first_step_seconds * 1e3,
                reply.first_step_captured
            );
            if reply.forward.is_ok()
                && draft.sent_tokens > 0
                && !reply.first_step_captured
                && !draft.scores
            {
                self.step_time
                    .observe(draft.sent_tokens, reply.first_step_seconds);
                // What drafts cost is learnt from steps of one-token rows and their drafts
                // alone (the forward waits for copies queued before it: this step's restores
                // and forks, the last step's saves), steps with drafts apart from steps
                // without: a verify step takes another path through the engine.
                let copies_before = !draft.restores.is_empty()
                    || !draft.fork_copies.is_empty()
                    || draft.saves_before_forward
                    || self.saved_last_step;
                if !draft.sent_prompt_chunk && !copies_before {
                    let model = if draft.verifies {
                        &mut self.verify_time
                    } else {
                        &mut self.plain_time
                    };
                    model.observe(draft.sent_tokens, reply.first_step_seconds);
                }
            }
            // Between a step and the next one planned ahead of it the engine waits only for
            // scheduling: the handing over of the step, and its planning if that took longer
            // than the step before.
            if let Some(waited) = reply.waited.filter(|_| draft.planned_ahead) {
                self.stats.engine_waited_nanos += waited.as_nanos() as u64;
                self.stats.engine_waits += 1;
            }
            self.saved_last_step = !draft.saves.is_empty();
            self.apply_engine_reply(&mut draft, reply, &mut ended);
        }
        ended.extend(
            draft
                .failing
                .iter()
                .map(|(index, error)| (*index, End::Failed(error.clone()))),
        );
        ended.append(&mut draft.first_ends);
        ended.retain(|(index, _)| *index != GONE);
        self.remove_ended(ended, &draft.preempting, &draft.closed, now);
        self.waking.wake();
        let (ready, wake_at) = self.readiness(now);
        if !did_work {
            self.stats.idle_steps += 1;
        }
        self.charge(Phase::Finish, started);
        StepOutcome {
            ready: ready && did_work,
            wake_at,
        }
    }

    /// Moves the job indices of a step sent earlier to where those jobs are now in `running`;
    /// the jobs that left it since, or whose epoch moved on, become [`GONE`] (and leave the
    /// lists that only name jobs).
    fn rebase(&self, draft: &mut Draft) {
        let Some(refs) = draft.refs.take() else {
            return;
        };
        let now = self.current_indices(&refs);
        let at = |index: usize| now.get(index).copied().flatten().unwrap_or(GONE);
        for row in &mut draft.rows {
            row.job = at(row.job);
        }
        for (index, _) in &mut draft.restores {
            *index = at(*index);
        }
        for (index, leader, _) in &mut draft.fork_copies {
            *index = at(*index);
            *leader = at(*leader);
        }
        for (index, ..) in &mut draft.saves {
            *index = at(*index);
        }
        for (index, _) in &mut draft.failing {
            *index = at(*index);
        }
        for (index, _) in &mut draft.first_ends {
            *index = at(*index);
        }
        for index in draft.preempting.iter_mut().chain(&mut draft.closed) {
            *index = at(*index);
        }
        draft.preempting.retain(|&index| index != GONE);
        draft.closed.retain(|&index| index != GONE);
    }

    /// Called before a job leaves `running` or its epoch moves on: each step in flight that
    /// has not kept its jobs' ids and epochs keeps them now, as they were when it was sent
    /// (only jobs joined since, at the end, are new, and no row of it names them). A step of
    /// 256 rows no longer copies them all when nothing changes, as most decode steps.
    pub(super) fn keep_refs(&mut self) {
        for draft in self.sent.iter_mut().filter(|d| d.refs.is_none()) {
            draft.refs = Some(self.running.iter().map(|job| (job.id, job.epoch)).collect());
        }
    }

    /// Where each job of `refs` (`running` as it was) is now, if it is still there at the
    /// same epoch. Jobs only leave `running` or join at its end, so those still there keep
    /// their order: one walk finds them.
    fn current_indices(&self, refs: &[(RequestId, u32)]) -> Vec<Option<usize>> {
        let mut next = 0;
        refs.iter()
            .map(|&(id, epoch)| {
                let job = self.running.get(next).filter(|job| job.id == id)?;
                next += 1;
                (job.epoch == epoch).then_some(next - 1)
            })
            .collect()
    }

    fn apply_engine_reply(
        &mut self,
        draft: &mut Draft,
        mut reply: EngineStepReply,
        ended: &mut Vec<(usize, End)>,
    ) {
        // Each row goes back to its job, if it is still here, for its next row to extend.
        for (row, (&r, &version)) in reply
            .plan
            .rows
            .drain(..)
            .zip(draft.sent_rows.iter().zip(&draft.sent_versions))
        {
            match self.running.get_mut(draft.rows[r].job) {
                Some(job) => {
                    if let Some((old, _)) = job.spare_row.replace((row, version)) {
                        self.spare_rows.push(old);
                    }
                }
                None => self.spare_rows.push(row),
            }
        }
        self.spare_rows.append(&mut reply.plan.rows);
        let mut corrupt = Vec::new();
        for (&(index, snapshot), result) in draft.restores.iter().zip(reply.restores) {
            self.follow_ups.push(StoreFollowUp::FinishRestore(snapshot));
            if let Some(job) = self.running.get_mut(index) {
                job.restoring = None;
            }
            match result {
                Ok(()) => {}
                Err(RestoreFault::Corrupt { tier, .. }) => {
                    self.stats.corrupt_restores[tier_slot(tier)] += 1;
                    if !corrupt.contains(&snapshot) {
                        corrupt.push(snapshot);
                    }
                    if index != GONE {
                        draft.recompute.push(index);
                    }
                }
                Err(e @ RestoreFault::Failed(_)) if index != GONE => ended.push((
                    index,
                    End::Failed(ServeError::Engine(format!("restoring a snapshot: {e}"))),
                )),
                Err(RestoreFault::Failed(_)) => {}
            }
        }
        // After every restore of the step is unpinned.
        self.follow_ups
            .extend(corrupt.into_iter().map(StoreFollowUp::DropCorrupt));
        for &(index, leader, _) in &draft.fork_copies {
            if index != GONE && draft.recompute.contains(&leader) {
                draft.recompute.push(index);
            }
        }
        for &index in &draft.recompute {
            self.recompute(index);
        }
        for (&(index, _, _), result) in draft.fork_copies.iter().zip(reply.forks) {
            if let Err(e) = result
                && index != GONE
            {
                let reason =
                    format!("copying the prompt's KV from the request's first choice: {e}");
                ended.push((index, End::Failed(ServeError::Engine(reason))));
            }
        }
        // A gone engine will report nothing more: stop asking.
        self.demotions_in_flight = if reply.engine_gone {
            0
        } else {
            self.demotions_in_flight
                .saturating_sub(reply.demotions.len())
        };
        for &tier in &reply.corrupt_found {
            self.stats.corrupt_restores[tier_slot(tier)] += 1;
        }
        self.demotions_in_flight = self
            .demotions_in_flight
            .saturating_sub(reply.promotions.len());
        for (snapshot, result) in reply.promotions {
            match result {
                Ok(()) => {
                    self.follow_ups
                        .push(StoreFollowUp::CommitPromotion(snapshot));
                    self.stop_awaiting(snapshot, true);
                }
                Err(fault) => {
                    tracing::warn!("reading {snapshot} back from disk: {fault}");
                    let corrupt = matches!(fault, RestoreFault::Corrupt { .. });
                    if corrupt {
                        self.stats.corrupt_restores[tier_slot(Tier::Disk)] += 1;
                    }
                    self.follow_ups
                        .push(StoreFollowUp::AbortPromotion(snapshot, corrupt));
                    self.stop_awaiting(snapshot, false);
                }
            }
        }
        for (snapshot, moved) in reply.demotions {
            self.follow_ups.push(if moved {
                StoreFollowUp::CommitDemotion(snapshot)
            } else {
                StoreFollowUp::AbortDemotion(snapshot)
            });
        }
        self.apply_forward(draft, reply.forward, reply.outcomes, ended);
        for ((index, kind, reservation), result) in std::mem::take(&mut draft.saves)
            .into_iter()
            .zip(reply.saves)
        {
            let job = self.running.get_mut(index);
            match result {
                Ok(()) => {
                    if let Some(job) = job
                        && kind == SaveKind::Prompt
                    {
                        job.prompt_saved = true;
                        job.prompt_stored = true;
                    }
                    self.follow_ups.push(StoreFollowUp::Commit(reservation));
                }
                Err(e) => {
                    tracing::warn!("snapshot save failed: {e}");
                    self.follow_ups.push(StoreFollowUp::Abort(reservation));
                    if let Some(job) = job
                        && kind == SaveKind::Kept
                    {
                        job.usage.kept = None;
                        job.keep_failure = Some(format!("copying its KV failed: {e}"));
                    }
                }
            }
            if kind == SaveKind::Reply && index != GONE {
                draft.closed.push(index);
            }
        }
    }

    fn apply_forward(
        &mut self,
        draft: &Draft,
        forward: Result<SampledTokens, String>,
        outcomes: Vec<(usize, PickOutcome)>,
        ended: &mut Vec<(usize, End)>,
    ) {
        if let Ok(sampled) = &forward {
            assert_eq!(
                sampled.rows(),
                draft.sent_rows.len(),
                "one row of tokens per row"
            );
        }
        // The rows of jobs still here, each with what its pick left besides its tokens (the
        // engine lists those in row order). One pass: a job has one row a step.
        let mut outcomes = outcomes.into_iter().peekable();
        for (p, &r) in draft.sent_rows.iter().enumerate() {
            // Most rows left nothing besides their tokens: no outcome is made up for them.
            let mut outcome = outcomes.next_if(|(at, _)| *at == p).map(|(_, o)| o);
            let row = draft.rows[r];
            let Some(job) = self.running.get_mut(row.job) else {
                continue;
            };
            // A job recomputing its prompt has forgotten every pick in flight already.
            let recomputing = draft.recompute.contains(&row.job);
            if !recomputing {
                job.in_flight -= row.samples as usize;
            }
            // Its KV did not arrive (a failed or corrupt restore or fork): neither the logits
            // kept after its prompt nor what it sampled count.
            let arrived = !recomputing && !ended.iter().any(|(i, _)| *i == row.job);
            let kept = outcome.as_mut().and_then(|o| o.kept_logits.take());
            if let Some(key) = job.keep_logits_as.take()
                && let Some(kept) = kept.filter(|_| forward.is_ok() && arrived)
            {
                self.prompt_logits.insert(key, kept.into());
            }
            let sampled = match &forward {
                Ok(sampled) => sampled,
                Err(e) => {
                    ended.push((row.job, End::Failed(ServeError::Engine(e.clone()))));
                    continue;
                }
            };
            if !arrived {
                continue;
            }
            if let Some(o) = outcome.as_mut().filter(|o| !o.prompt_logprobs.is_empty()) {
                let scores = std::mem::take(&mut o.prompt_logprobs);
                self.running[row.job].emit_prompt_scores(scores, &mut self.waking);
            }
            let tokens = sampled.row(p);
            let job = &mut self.running[row.job];
            // Each decode step after the first computed the token the one before sampled.
            job.computed += tokens.len().saturating_sub(1);
            if let Some(failure) = outcome.as_mut().and_then(|o| o.failure.take()) {
                // This step's picks were not held to the grammar: none of them is delivered.
                ended.push((row.job, End::Failed(ServeError::Grammar(failure))));
                continue;
            }
            let mut logprobs = outcome.map(|o| o.logprobs).unwrap_or_default();
            let before = job.tokens.len();
            for &token in tokens {
                self.running[row.job].tokens.push(token);
                if let Some(reason) = self.stop_reason(row.job, token) {
                    ended.push((row.job, End::Finished(reason)));
                    break;
                }
            }
            let job = &self.running[row.job];
            logprobs.truncate(job.tokens.len() - before);
            job.emit_tokens(&job.tokens[before..], logprobs, &mut self.waking);
            self.stats.generated_tokens += (job.tokens.len() - before) as u64;
            if row.draft > 0 {
                self.verified(row, tokens.len() - 1);
            }
            let ending = ended.iter().any(|(index, _)| *index == row.job);
            if !ending {
                self.trim(row.job);
                self.owe_prompt_save(draft, row);
            }
        }
    }

    /// A row that completed its job's prompt without a save charged for it (its first chunk
    /// completed it only thanks to a hit): the save is charged next step, if the policy wants
    /// one.
    fn owe_prompt_save(&mut self, draft: &Draft, row: Row) {
        let job = &self.running[row.job];
        let completed = row.start < job.prompt_len && row.end >= job.prompt_len;
        if completed
            && self.prompt_save_kind(job) == Some(SaveKind::Prompt)
            && !draft.saves.iter().any(|(index, ..)| *index == row.job)
        {
            self.running[row.job].save_owed = true;
        }
    }

    /// Counts a verification that kept `kept` of the row's drafted tokens, and teaches the
    /// job's acceptance, which sizes its next drafts.
    fn verified(&mut self, row: Row, kept: usize) {
        self.stats.drafted_tokens += row.draft as u64;
        self.stats.accepted_tokens += kept as u64;
        self.stats.verified[kept.min(policy::MAX_VERIFY_WIDTH - 1)] += 1;
        self.running[row.job].acceptance.observe(row.draft, kept);
    }

    /// Gives back the positions a job holds past its tokens (drafted tokens refused, or a
    /// multi-step decode cut short): the pool truncates it at the next step's exchange, and
    /// its page table here now, so the next step extends from where it really is.
    fn trim(&mut self, index: usize) {
        let pt = self.config.page_tokens;
        let job = &mut self.running[index];
        let tokens = job.planned_len();
        let slot = job.slot.as_mut().expect("running jobs hold a slot");
        if slot.held_tokens <= tokens {
            return;
        }
        slot.held_tokens = tokens;
        // Positions inside its last page the pool never counted are given back here alone.
        if slot.pooled_tokens <= tokens {
            return;
        }
        slot.pooled_tokens = tokens;
        slot.pages.truncate(tokens.div_ceil(pt));
        slot.version = self.next_table_version;
        self.next_table_version += 1;
        self.truncates.push((slot.handle, tokens));
    }

    /// The shared rule ([`engine::stop::finish_after`]); `max_new` was clipped to the room
    /// left under the sequence limit at submission.
    /// The queued jobs waiting for `snapshot` to be read back from disk go on: to restore it
    /// (`landed`) or to compute their prompt.
    fn stop_awaiting(&mut self, snapshot: SnapshotId, landed: bool) {
        for job in self
            .queue
            .iter_mut()
            .filter(|j| j.awaiting == Some(snapshot))
        {
            job.awaiting = None;
            job.skip_disk |= !landed;
        }
    }

    /// A job whose restored or forked KV was refused: it computes its prompt from the start
    /// in the pages it holds, and reports no cached tokens.
    fn recompute(&mut self, index: usize) {
        self.keep_refs();
        let job = &mut self.running[index];
        self.stats.restored_tokens = self
            .stats
            .restored_tokens
            .saturating_sub(job.usage.cached_tokens as u64);
        job.set_cached_tokens(0);
        job.computed = 0;
        job.forget_in_flight();
        // What it found stored was the corrupt snapshot: its prompt is saved anew.
        job.prompt_saved = false;
        job.prompt_stored = false;
    }

    fn stop_reason(&self, index: usize, token: u32) -> Option<FinishReason> {
        let job = &self.running[index];
        let eos = &self.config.eos_token_ids;
        engine::stop::finish_after(&job.params, eos, token, job.generated(), job.max_new)
    }

    /// Removes ended, preempted and closed jobs from `running`, highest index first so the
    /// others keep their places; preempted ones go back to the front of the queue. A job that
    /// finished with a reply worth saving stays, closing, for its save in the next step.
    fn remove_ended(
        &mut self,
        mut ended: Vec<(usize, End)>,
        preempting: &[usize],
        closed: &[usize],
        now: Instant,
    ) {
        ended.sort_by_key(|(index, _)| std::cmp::Reverse(*index));
        ended.dedup_by_key(|(index, _)| *index);
        let mut requeue = Vec::new();
        let mut order: Vec<usize> = ended
            .iter()
            .map(|(i, _)| *i)
            .chain(preempting.iter().copied())
            .chain(closed.iter().copied())
            .collect();
        order.sort_unstable_by(|a, b| b.cmp(a));
        order.dedup();
        let mut ends = ended.into_iter().peekable();
        for index in order {
            let end = ends.next_if(|(i, _)| *i == index).map(|(_, end)| end);
            if let Some(End::Finished(reason)) = end
                && self.saves_reply(&self.running[index])
            {
                self.close(index, reason, now);
                continue;
            }
            self.keep_refs();
            let mut job = self.running.remove(index);
            if let Some(slot) = job.slot.take() {
                self.releases.push(slot.handle);
            }
            if job.closing {
                // Its finished event went out when it finished.
                self.release_forks(job.id);
                self.retire(&job);
                continue;
            }
            match end {
                Some(end) => self.end(job, end, now),
                None => {
                    self.stats.preemptions += 1;
                    job.usage.preemptions += 1;
                    job.preempted = false;
                    job.leave_charged = false;
                    job.computed = 0;
                    job.forget_in_flight();
                    job.backoff = policy::Backoff::new();
                    job.blocked_until = None;
                    requeue.push(job);
                }
            }
        }
        for job in requeue {
            self.queue.push_front(job);
        }
    }

    /// Whether a job that finished leaves its prompt and reply in the store: when the policy
    /// says so, its prompt was stored or restored (someone showed it before), and the reply
    /// fills at least one more page than the prompt did.
    fn saves_reply(&self, job: &Job) -> bool {
        let pt = self.config.page_tokens;
        self.config.save_replies
            && (job.prompt_stored || job.usage.cached_tokens > 0)
            && job.computed / pt > job.prompt_len / pt
            && job.computed >= self.config.min_save_tokens.max(pt)
    }

    /// Answers the finished job `index` now and keeps its pages for its reply's save.
    fn close(&mut self, index: usize, reason: FinishReason, now: Instant) {
        self.keep_refs();
        let job = &mut self.running[index];
        job.announce_finish(reason);
        job.closing = true;
        // Its reply's save is charged next step (a preemption's, if one was, is not needed).
        job.preempted = false;
        job.leave_charged = false;
        // A step planned before it finished may have a row for it: that pick is not its.
        job.forget_in_flight();
        let latency = now.saturating_duration_since(job.submitted_at);
        self.latency_ewma = (self.latency_ewma * 7 + latency) / 8;
        self.stats.finished += 1;
    }

    fn end(&mut self, mut job: Job, end: End, now: Instant) {
        self.release_forks(job.id);
        self.retire(&job);
        let end = match end {
            End::Finished(_) if job.keep_prompt && job.usage.kept.is_none() => {
                let why = job
                    .keep_failure
                    .take()
                    .unwrap_or_else(|| "its prompt was not saved".into());
                End::Failed(ServeError::NotKept(why))
            }
            end => end,
        };
        let latency = now.saturating_duration_since(job.submitted_at);
        self.latency_ewma = (self.latency_ewma * 7 + latency) / 8;
        match end {
            End::Finished(reason) => {
                self.stats.finished += 1;
                job.finish(reason);
            }
            End::Failed(error) => self.end_failed(job, error),
        }
    }

    fn end_failed(&mut self, job: Job, error: ServeError) {
        self.release_forks(job.id);
        self.retire(&job);
        self.stats.failed += 1;
        job.fail(error);
    }
}

impl Scheduler {
    /// A version for a new page table.
    /// Adds the time since `started` to `phase`'s ([`SchedulerStats::phase_nanos`]).
    fn charge(&mut self, phase: Phase, started: Instant) {
        self.stats.phase_nanos[phase as usize] += started.elapsed().as_nanos() as u64;
    }

    fn table_version(&mut self) -> u64 {
        self.next_table_version += 1;
        self.next_table_version - 1
    }
}

/// The store request charging a save of `kind` of `chain`.
fn save_op(kind: SaveKind, chain: Vec<cache::PrefixHash>, tier: Tier) -> StoreOp {
    match kind {
        SaveKind::Prompt => StoreOp::BeginPromptSave { chain, tier },
        SaveKind::Preemption | SaveKind::Reply => StoreOp::BeginSave { chain, tier },
        SaveKind::Kept => StoreOp::BeginKeptSave { chain, tier },
    }
}

/// The index of a tier in [`SchedulerStats::corrupt_restores`].
pub(crate) fn tier_slot(tier: Tier) -> usize {
    match tier {
        Tier::Device => 0,
        Tier::Host => 1,
        Tier::Disk => 2,
    }
}

/// Where a job admitted with `restored` tokens from a snapshot resumes: after them, but a
/// snapshot covering every token still leaves the last one to run, for its logits (unless
/// they were kept: [`Job::first_logits`]).
fn resume_at(job: &Job, restored: usize) -> usize {
    if job.first_logits.is_some() {
        return restored;
    }
    restored.min(job.tokens.len() - 1)
}

/// Positions a new slot is allocated with: the restored prefix and the first chunk after it.
fn initial_tokens(job: &Job, restored: usize, first: usize) -> usize {
    restored.max(resume_at(job, restored) + first)
}

/// Whether `job` (at `index` in `running`), about to pick after its prompt, has that whole
/// prompt's full pages in the store: restored whole, or saved whole by this step.
fn prompt_whole_in_store(
    job: &Job,
    index: usize,
    saves: &[(usize, SaveKind, SaveReservation)],
    page_tokens: usize,
) -> bool {
    let whole_pages = job.prompt_len / page_tokens;
    whole_pages > 0
        && (job.usage.cached_tokens == whole_pages * page_tokens
            || saves.iter().any(|(i, kind, reservation)| {
                *i == index
                    && matches!(kind, SaveKind::Prompt | SaveKind::Kept)
                    && reservation.pages() == whole_pages
            }))
}

/// Where a choice waiting to fork stands (see [`Scheduler::fork_source`]).
enum ForkSource {
    /// Its first choice runs, at this index, with the prompt's KV in its pages.
    From(usize),
    /// Its first choice is on its way there.
    Wait,
    /// Its first choice has ended: it computes the prompt itself.
    Gone,
}

/// How a running job ends this step.
#[derive(Debug, Clone)]
enum End {
    Finished(FinishReason),
    Failed(ServeError),
}

/// The most logits a step brings to the host for a prompt it scores (a chunk of 1,365
/// positions of a 49,152-token vocabulary, 512 of a 128,256-token one).
const SCORED_LOGITS_BYTES: usize = 256 << 20;
