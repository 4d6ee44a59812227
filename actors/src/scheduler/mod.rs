//! The scheduler: the queue, every job's progress, and the steps built from them.
//!
//! The invariant everything here keeps: there is no prefill phase and no decode phase. Each job
//! has `tokens` (prompt plus output so far) and `computed` (those with KV in its pages); a step
//! runs a slice of `tokens[computed..]` for as many jobs as the token budget allows, one-token
//! rows first so long prompts never starve decodes, and samples for every row that reaches
//! its job's end.
//!
//! Pure state: no actix, no I/O, no clock of its own (callers pass `now`); what it exchanges
//! with the actors is [`crate::exchange`]'s plain data. The `Admission` actor drives each step
//! through the other actors, one exchange with each:
//!
//! 1. [`Scheduler::begin_step`]: sweeps cancelled jobs, plans rows, and returns the store's
//!    requests: the last steps' follow-ups (commits, unpins), the saves of KV the running
//!    jobs hold or complete in this step's rows, and for each job that may be admitted a
//!    lookup that pins the prefix it finds (or starts reading it back from disk), with the
//!    save of its prompt when its first chunk completes it whatever the lookup finds;
//! 2. [`Scheduler::plan_pool`]: with the store's answers, the pool changes (releases, the
//!    pages of jobs leaving this step, admissions with their restored prefix and first prompt
//!    chunk, extensions for the rows);
//! 3. [`Scheduler::plan_engine`]: with the pool's answers, the engine step, if any: the
//!    restores into the new slots' pages, the saves matched with the pages they copy (or given
//!    up, when their row did not run), the rows; a job the pool refused backs off alone, and
//!    when its attempts run out the youngest running request gives way;
//! 4. [`Scheduler::finish_step`]: with the engine's answer, tokens go out, jobs end, and what
//!    must follow (releases, commits) is queued for the next step.
//!
//! A save that could not be charged in the step that needed it is charged by the next: a
//! prompt completed only thanks to a restore (its job keeps running), and the saves of jobs
//! that leave (a finished reply worth keeping, a preempted job's work), whose pages go back in
//! that same step once the engine has copied them, before anything else of the step runs.

mod job;
mod step;

use std::collections::VecDeque;
use std::time::{Duration, Instant};

use cache::{PrefixHasher, PrefixSalt, Tier};
use engine::sampling::{Sampler, SamplingParams};
use policy::{BackoffPolicy, ReservationPolicy, StepTimeModel};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

use crate::error::ServeError;
use crate::request::{GenerateRequest, RequestId, RequestLink, RequestStream};
use job::Job;
pub use step::StepOutcome;
use step::{Draft, StoreFollowUp};

/// What the scheduler is built from.
#[derive(Debug, Clone)]
pub struct SchedulerConfig {
    pub max_queue: usize,
    pub max_running: usize,
    pub step_token_budget: usize,
    /// The longest an engine step should take; prompt chunks are sized to it.
    pub max_step: Duration,
    /// Decode steps one engine step may run when nothing else is to be done (see
    /// `policy::AdmissionConfig::decode_steps`).
    pub decode_steps: usize,
    pub page_tokens: usize,
    pub total_pages: usize,
    /// The most positions a sequence may reach in the model.
    pub context_tokens: usize,
    pub vocab_size: usize,
    pub eos_token_ids: Vec<u32>,
    pub reservation: ReservationPolicy,
    pub backoff: BackoffPolicy,
    pub save_prompts: bool,
    pub min_save_tokens: usize,
    /// Save a finished request's prompt and reply when its prompt was saved or restored.
    pub save_replies: bool,
    /// Host bytes for the logits after whole prompts that were saved or restored
    /// (`snapshots.prompt_logits_bytes`).
    pub prompt_logits_bytes: u64,
    pub save_tier: Tier,
    /// Speculative decoding: drafts by prompt lookup, verified in the steps.
    pub speculative: policy::SpeculativeConfig,
    /// Plan a step while the one before it runs ([`Scheduler::can_plan_ahead`]).
    pub overlap: bool,
    pub salt: PrefixSalt,
    /// Seeds back-off jitter, so tests replay exactly.
    pub seed: u64,
}

/// Counters of the scheduler's own decisions.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub submitted: u64,
    pub finished: u64,
    pub failed: u64,
    pub cancelled: u64,
    pub backoffs: u64,
    pub preemptions: u64,
    /// Requests failed because a shutdown's grace ran out before they finished (also
    /// counted in `failed`).
    pub cut: u64,
    /// Scheduler steps; one may run several decode steps.
    pub steps: u64,
    /// Steps that handed the engine more than one decode step.
    pub multi_steps: u64,
    /// Of those, the ones a request's arrival or cancellation cut short.
    pub multi_steps_cut_short: u64,
    /// Steps sent to the engine while the one before them was still running.
    pub planned_ahead: u64,
    /// The backend's decode steps launched on the device before the engine asked for them:
    /// kept, and left unread ([`crate::exchange::EngineStepReply::run_ahead`]).
    pub steps_run_ahead: (u64, u64),
    /// Of those answered, how many, and the engine's time between the end of the step
    /// before and the start of each ([`crate::exchange::EngineStepReply::waited`]): what the
    /// device waits for the scheduler a step in steady work.
    pub engine_waits: u64,
    pub engine_waited_nanos: u64,
    /// Steps that found nothing to do. Each was started on a readiness that was wrong; the
    /// loop then waits for the next event instead of spinning.
    pub idle_steps: u64,
    /// Tokens sampled and delivered.
    pub generated_tokens: u64,
    pub restored_tokens: u64,
    /// Prompt tokens whose KV a request's other choices (`n` > 1) copied from its first one
    /// instead of computing.
    pub forked_tokens: u64,
    /// Restores refused because the snapshot's frame or checksums did not match, by the tier
    /// read (device, host, disk: a file refused when read back); each request recomputed its
    /// prompt.
    pub corrupt_restores: [u64; 3],
    /// Speculative decoding: tokens drafted, drafted tokens kept, and verifications by how
    /// many drafted tokens they kept (index 0: none).
    pub drafted_tokens: u64,
    pub accepted_tokens: u64,
    pub verified: [u64; policy::MAX_VERIFY_WIDTH],
    /// Requests whose first token came from the logits kept after their prompt
    /// ([`cache::PromptLogits`]): no forward pass ran before it.
    pub first_tokens_from_kept_logits: u64,
    /// The kept logits: rows kept and dropped for room since the start, and held now.
    pub kept_logits: cache::PromptLogitsStats,
    /// Time the scheduler's thread spent in each phase of its steps, in nanoseconds, indexed
    /// by [`Phase`]: planning and applying answers, not waiting for them. Next to the
    /// engine's forward time it says whether planning stays hidden behind the engine.
    pub phase_nanos: [u64; Phase::ALL.len()],
    pub queued: usize,
    pub running: usize,
}

/// The scheduler's side of a step, in order: [`Scheduler::begin_step`] (sweep, rows, lookups
/// and saves for the store), [`Scheduler::plan_pool`], [`Scheduler::plan_engine`] and
/// [`Scheduler::finish_step`] (the engine's answer applied, tokens delivered).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    Begin,
    Pool,
    Engine,
    Finish,
}

impl Phase {
    pub const ALL: [Phase; 4] = [Phase::Begin, Phase::Pool, Phase::Engine, Phase::Finish];

    pub fn name(self) -> &'static str {
        match self {
            Phase::Begin => "begin",
            Phase::Pool => "pool",
            Phase::Engine => "engine",
            Phase::Finish => "finish",
        }
    }
}

/// The most positions one sequence may hold, and what sets it: the model's context, or a
/// working pool smaller than that context.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SequenceLimit {
    pub tokens: usize,
    pub pool_bound: bool,
}

impl SequenceLimit {
    pub fn new(context_tokens: usize, total_pages: usize, page_tokens: usize) -> Self {
        let pool_tokens = total_pages * page_tokens;
        SequenceLimit {
            tokens: context_tokens.min(pool_tokens),
            pool_bound: pool_tokens < context_tokens,
        }
    }

    /// What holds the limit, for messages: "this model's context" or the pool's size.
    pub fn holder(&self) -> String {
        if self.pool_bound {
            format!("this server's KV pool ({} positions)", self.tokens)
        } else {
            format!("this model's context ({} positions)", self.tokens)
        }
    }
}

pub struct Scheduler {
    config: SchedulerConfig,
    limit: SequenceLimit,
    /// Learns how long a step of so many tokens takes, to size prompt chunks.
    step_time: StepTimeModel,
    /// The same, over steps of one-token rows only, without drafts ([`policy::DraftCost`]).
    plain_time: StepTimeModel,
    /// The same, over steps of one-token rows with drafts: what verifying costs.
    verify_time: StepTimeModel,
    /// The last engine step queued saves, which the next one's forward waits behind.
    saved_last_step: bool,
    hasher: PrefixHasher,
    /// The logits after whole prompts saved or restored, for their repeats' first tokens.
    prompt_logits: cache::PromptLogits,
    rng: ChaCha8Rng,
    next_id: u64,
    queue: VecDeque<Job>,
    running: Vec<Job>,
    /// Deferred to the next step's pool exchange: slots whose pages may be freed.
    releases: Vec<cache::SlotHandle>,
    /// Deferred to the next step's pool exchange, before the releases: slots to cut back to
    /// so many positions (what a verification refused).
    truncates: Vec<(cache::SlotHandle, usize)>,
    /// Deferred to the next step's store exchange.
    follow_ups: Vec<StoreFollowUp>,
    draft: Option<Draft>,
    /// Steps sent to the engine, oldest first, waiting for their answers: at most two, the
    /// second planned while the first ran ([`Scheduler::can_plan_ahead`]).
    sent: VecDeque<Draft>,
    next_step_id: u64,
    /// Requests gone whose samplers the engine keeps, with their slots: it drops them with
    /// the next step.
    forget: Vec<(u32, RequestId)>,
    /// Sampler slots free for the next request to pick its first token (after `forget`
    /// has cleared them at the engine: both go out with the same step, forgets first).
    free_sampler_slots: Vec<u32>,
    sampler_slots: u32,
    /// Row buffers of past steps, refilled instead of reallocated.
    spare_rows: Vec<engine::backend::RowPlan>,
    /// The next page-table version ([`job::Slot::version`]).
    next_table_version: u64,
    /// Pages nobody holds or is promised, as the pool last said; admission stops at the first
    /// queued job whose reservation does not fit (first come, first served).
    available_pages: usize,
    stats: SchedulerStats,
    /// Smoothed submit-to-end time of requests, for `retry_after`.
    latency_ewma: Duration,
    /// Set by a shutdown: new requests are refused, those in flight run on.
    draining: bool,
    /// Demotions the engine started and has not reported: until it does, steps keep coming
    /// (empty ones when idle, every [`DEMOTION_POLL`]) so each lands in the store.
    demotions_in_flight: usize,
    /// When the next step collecting copies between tiers is due.
    next_poll: Instant,
    /// The callers this step delivered tokens to, woken together once it is applied.
    waking: crate::mailbox::Waking,
}

/// How often an idle scheduler asks the engine whether its demotions have landed.
const DEMOTION_POLL: Duration = Duration::from_millis(1);

impl Scheduler {
    pub fn new(config: SchedulerConfig) -> Self {
        Scheduler {
            limit: SequenceLimit::new(
                config.context_tokens,
                config.total_pages,
                config.page_tokens,
            ),
            step_time: StepTimeModel::new(),
            plain_time: StepTimeModel::new(),
            verify_time: StepTimeModel::new(),
            saved_last_step: false,
            hasher: PrefixHasher::new(config.salt, config.page_tokens),
            prompt_logits: cache::PromptLogits::new(config.prompt_logits_bytes),
            rng: ChaCha8Rng::seed_from_u64(config.seed),
            next_id: 0,
            queue: VecDeque::new(),
            running: Vec::new(),
            releases: Vec::new(),
            truncates: Vec::new(),
            follow_ups: Vec::new(),
            draft: None,
            sent: VecDeque::new(),
            next_step_id: 0,
            forget: Vec::new(),
            free_sampler_slots: Vec::new(),
            sampler_slots: 0,
            spare_rows: Vec::new(),
            next_table_version: 0,
            available_pages: config.total_pages,
            stats: SchedulerStats::default(),
            latency_ewma: Duration::from_millis(500),
            draining: false,
            demotions_in_flight: 0,
            next_poll: Instant::now(),
            waking: crate::mailbox::Waking::default(),
            config,
        }
    }

    /// The most positions one sequence may hold.
    pub fn limit(&self) -> SequenceLimit {
        self.limit
    }

    pub fn stats(&self) -> SchedulerStats {
        SchedulerStats {
            queued: self.queue.len(),
            // Finished jobs saving their reply are no longer requests in flight.
            running: self.running.iter().filter(|j| !j.closing).count(),
            kept_logits: self.prompt_logits.stats(),
            ..self.stats
        }
    }

    /// Queues a request, or refuses it: invalid input, or a full queue.
    pub fn submit(&mut self, request: GenerateRequest) -> Result<RequestStream, ServeError> {
        let mut streams = self.submit_choices(request, 1)?;
        Ok(streams.pop().expect("one choice asked for"))
    }

    /// Queues `n` choices of one request (OpenAI's `n`), each a request of its own with its own
    /// stream, or refuses them all. Choice `i` draws from `seed + i` when the request is seeded.
    /// The prompt is computed once: the first choice computes it, and each other one copies
    /// its KV pages once it has, then runs only the prompt's last token for its own logits.
    /// (A choice that cannot copy in time, its first choice gone, computes the prompt itself.)
    pub fn submit_choices(
        &mut self,
        request: GenerateRequest,
        n: usize,
    ) -> Result<Vec<RequestStream>, ServeError> {
        let mut streams = self.submit_prompts(vec![request], n)?;
        Ok(streams.pop().expect("one prompt submitted"))
    }

    /// Queues `n` choices of each of several requests (a completion's list of prompts), each
    /// prompt's as [`Scheduler::submit_choices`] queues them, or refuses them all: one invalid
    /// request (named by its place in the list), more sequences than the queue holds, or too
    /// little room in it now. The streams come per request, in order.
    pub fn submit_prompts(
        &mut self,
        requests: Vec<GenerateRequest>,
        n: usize,
    ) -> Result<Vec<Vec<RequestStream>>, ServeError> {
        if self.draining {
            return Err(ServeError::ShuttingDown);
        }
        let prompts = requests.len();
        for (i, request) in requests.iter().enumerate() {
            match self.validate(request) {
                Err(ServeError::Invalid(reason)) if prompts > 1 => {
                    return Err(ServeError::Invalid(format!("prompt {i}: {reason}")));
                }
                checked => checked?,
            }
        }
        if n == 0 {
            return Err(ServeError::Invalid("n must be at least 1".into()));
        }
        let sequences = prompts.saturating_mul(n);
        if sequences > self.config.max_queue {
            return Err(ServeError::TooManyChoices {
                prompts,
                n,
                max_queue: self.config.max_queue,
            });
        }
        if self.queue.len() + sequences > self.config.max_queue {
            return Err(ServeError::Overloaded {
                retry_after: self.retry_after(),
            });
        }
        Ok(requests
            .into_iter()
            .map(|request| self.queue_choices(request, n))
            .collect())
    }

    /// Queues `n` choices of a request already checked, the first computing the prompt.
    fn queue_choices(&mut self, request: GenerateRequest, n: usize) -> Vec<RequestStream> {
        let room = self.limit.tokens - request.prompt.len();
        let max_new = request.params.max_tokens.min(room);
        let first = RequestId(self.next_id);
        let mut streams = Vec::with_capacity(n);
        for i in 0..n {
            let id = RequestId(self.next_id);
            self.next_id += 1;
            let mut params = request.params.clone();
            params.seed = params.seed.map(|seed| seed.wrapping_add(i as u64));
            let sampler = Sampler::new(&params, &request.prompt);
            let (events, receiver) = crate::mailbox::channel();
            let stopped = RequestLink::default();
            let mut job = Job::new(
                id,
                request.prompt.clone(),
                max_new,
                sampler,
                events,
                stopped.clone(),
                Instant::now(),
            );
            job.fork_of = (i > 0).then_some(first);
            self.queue.push_back(job);
            self.stats.submitted += 1;
            streams.push(RequestStream::new(id, receiver, stopped));
        }
        streams
    }

    /// Queues a prompt to compute and keep (an operator's pinned prefix): its whole pages are
    /// saved in the save tier whatever the save policy says, and kept until discarded. The
    /// request generates one (greedy) token; its `Finished` usage names the snapshot (`kept`),
    /// or it fails with [`ServeError::NotKept`].
    pub fn submit_kept(&mut self, prompt: Vec<u32>) -> Result<RequestStream, ServeError> {
        let pt = self.config.page_tokens;
        if prompt.len() < pt {
            return Err(ServeError::Invalid(format!(
                "a prefix to keep needs at least one whole page of {pt} tokens; it has {}",
                prompt.len()
            )));
        }
        let params = SamplingParams {
            max_tokens: 1,
            temperature: 0.0,
            ..SamplingParams::default()
        };
        let request = GenerateRequest { prompt, params };
        let stream = self.submit(request)?;
        let job = self.queue.back_mut().expect("submit queued it");
        job.keep_prompt = true;
        Ok(stream)
    }

    fn validate(&self, request: &GenerateRequest) -> Result<(), ServeError> {
        let invalid = |reason: String| Err(ServeError::Invalid(reason));
        let prompt = &request.prompt;
        if prompt.is_empty() {
            return invalid("the prompt is empty".into());
        }
        if let Some(&bad) = prompt
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return invalid(format!(
                "token id {bad} is outside the vocabulary of {}",
                self.config.vocab_size
            ));
        }
        if prompt.len() >= self.limit.tokens {
            return invalid(format!(
                "the prompt has {} tokens; {} holds {} with room for one generated token",
                prompt.len(),
                self.limit.holder(),
                self.limit.tokens - 1,
            ));
        }
        request
            .params
            .validate()
            .map_err(|e| ServeError::Invalid(e.to_string()))
    }

    /// How long a refused caller should wait: the queue ahead of it, drained `max_running`
    /// at a time at the recent request latency.
    fn retry_after(&self) -> Duration {
        let rounds = self.queue.len().div_ceil(self.config.max_running.max(1)) as u32;
        (self.latency_ewma * rounds.max(1))
            .clamp(Duration::from_millis(100), Duration::from_secs(60))
    }

    /// Marks a request cancelled by its caller; it ends at the next step.
    pub fn cancel(&mut self, id: RequestId) {
        if let Some(index) = self.queue.iter().position(|j| j.id == id) {
            let job = self.queue.remove(index).expect("position is in range");
            self.stats.cancelled += 1;
            self.release_forks(id);
            self.retire(&job);
            job.cancel();
        } else if let Some(job) = self.running.iter_mut().find(|j| j.id == id) {
            job.cancelled = true;
        }
    }

    /// Stops taking requests; those queued or running go on.
    pub fn drain(&mut self) {
        self.draining = true;
    }

    /// Ends every request in flight with `ShuttingDown`: the queued ones now, the running
    /// ones at the next step (which releases their pages). Returns how many.
    pub fn cut_all(&mut self) -> usize {
        self.draining = true;
        let queued = self.queue.len();
        for job in std::mem::take(&mut self.queue) {
            tracing::warn!(
                request = job.id.0,
                "cut at shutdown while queued ({} prompt tokens)",
                job.prompt_len
            );
            self.retire(&job);
            job.fail(ServeError::ShuttingDown);
        }
        self.stats.failed += queued as u64;
        self.stats.cut += queued as u64;
        for job in &mut self.running {
            job.cut = true;
        }
        queued + self.running.len()
    }

    /// Anchors the cost of verify steps ([`policy::StepTimeModel::anchor`]) with steps timed
    /// before serving: `(tokens, seconds)` each.
    pub fn anchor_verify_steps(&mut self, steps: &[(usize, f64)]) {
        for &(tokens, seconds) in steps {
            self.verify_time.anchor(tokens, seconds);
        }
    }

    /// Whether the next step may be planned now, while the one sent last runs: overlapping
    /// is on and `decode_steps` is 1 (the two are alternatives), exactly one step is in
    /// flight, it runs one decode step a row and verifies no draft (so its rows' outcomes are
    /// one pick each, which the next step's rows can start from unseen), it carries no prompt
    /// chunk, and no request is being given drafts (a draft is proposed from known tokens).
    ///
    /// A request that arrives while a step runs joins the step after the one planned ahead,
    /// so planning ahead delays it by a step. Behind a prompt chunk that step is long and the
    /// scheduler's time a small part of it: there the next step is planned once this one has
    /// answered (BENCHMARKS.md: SmolLM2's time to first token at 256 in flight, 43 → 33 ms).
    pub fn can_plan_ahead(&self) -> bool {
        self.config.overlap
            && self.config.decode_steps <= 1
            && self.draft.is_none()
            && self.sent.len() == 1
            && self
                .sent
                .iter()
                .all(|step| step.plain && !step.sent_prompt_chunk)
            && !self.speculating()
    }

    /// The number of the oldest step in flight: the next answer to apply is its.
    pub fn oldest_in_flight(&self) -> Option<u64> {
        self.sent.front().map(|step| step.id)
    }

    /// Whether drafts are proposed now: prompt lookup is on and few enough requests run.
    fn speculating(&self) -> bool {
        let spec = &self.config.speculative;
        let requests = self.running.iter().filter(|j| !j.closing).count();
        spec.method == policy::SpeculativeMethod::PromptLookup && requests <= spec.max_batch
    }

    /// Notes that `job` is gone for good: the engine's copy of its sampler, if it has one, is
    /// dropped with the next step.
    fn retire(&mut self, job: &Job) {
        self.retire_sampler(job.id, job.sampler_slot);
    }

    fn retire_sampler(&mut self, id: RequestId, slot: Option<u32>) {
        if let Some(slot) = slot {
            self.forget.push((slot, id));
            self.free_sampler_slots.push(slot);
        }
    }

    /// A slot for a sampler the engine is to keep.
    fn sampler_slot(&mut self) -> u32 {
        self.free_sampler_slots.pop().unwrap_or_else(|| {
            self.sampler_slots += 1;
            self.sampler_slots - 1
        })
    }

    /// Requests whose samplers the engine is yet to be told to drop.
    #[cfg(test)]
    pub(crate) fn samplers_to_forget(&self) -> Vec<RequestId> {
        self.forget.iter().map(|&(_, id)| id).collect()
    }

    /// Whether a step could do something now, and else when one could.
    pub fn readiness(&self, now: Instant) -> (bool, Option<Instant>) {
        // Samplers to forget: a job that gave its pages back in the step it left at the end of
        // leaves nothing else for the next step, which still has the engine drop its sampler.
        let pending_work = !self.releases.is_empty()
            || !self.truncates.is_empty()
            || !self.follow_ups.is_empty()
            || !self.forget.is_empty();
        let runnable = self.running.iter().any(|j| {
            ((j.closing || j.preempted) && !j.leave_charged)
                || j.cancelled
                || j.cut
                || j.abandoned()
                || (j.ready(now) && j.pending() > 0)
        });
        let admissible =
            self.running.len() < self.config.max_running && self.next_admission_fits(now);
        let abandoned = self.queue.iter().any(Job::abandoned);
        // Copies between tiers are collected by steps: with some running, a step (empty if
        // need be) runs every DEMOTION_POLL, so each lands in the store, and the requests
        // waiting for a promotion go on, even when nothing else would step.
        let copying = self.demotions_in_flight > 0;
        let poll_due = copying && now >= self.next_poll;
        let poll = copying.then_some(self.next_poll.max(now));
        let wake = self
            .running
            .iter()
            .chain(&self.queue)
            .filter_map(|j| j.blocked_until)
            .filter(|&t| t > now)
            .chain(poll)
            .min();
        (
            pending_work || runnable || admissible || abandoned || poll_due,
            wake,
        )
    }

    /// Whether the first queued job not backing off would be admitted now: the same test, in
    /// the same order, as `begin_step` makes.
    fn next_admission_fits(&self, now: Instant) -> bool {
        self.queue
            .iter()
            .find(|job| job.ready(now))
            .is_some_and(|job| self.admission_pages(job) <= self.available_pages)
    }
}

#[cfg(test)]
mod properties;
#[cfg(test)]
mod tests;
