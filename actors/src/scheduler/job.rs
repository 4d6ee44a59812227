//! One request as the scheduler tracks it, from submission to its terminal event.
//!
//! There is no prefill phase and no decode phase: a job has `tokens` (its prompt and what it
//! generated so far) and `computed`, how many of them have KV in its pages. A step runs some of
//! `tokens[computed..]`; when it reaches the end, the backend samples the next token. A decode
//! step is the case where one token is pending.

use std::sync::Arc;
use std::time::Instant;

use crate::mailbox;
use cache::{PageId, PrefixHash, PrefixHasher, SlotHandle, SnapshotId};
use engine::sampling::{Sampler, SamplingParams, TokenLogprobs};
use policy::Backoff;

use crate::error::ServeError;
use crate::request::{Delivery, Event, FinishReason, RequestId, RequestLink, Usage};

/// The pages a running job holds.
#[derive(Debug)]
pub(crate) struct Slot {
    pub handle: SlotHandle,
    /// The page table, as the pool last reported it.
    pub pages: Vec<PageId>,
    /// Positions the job may write: those the pool counts, and those taken since inside the
    /// last of its pages.
    pub held_tokens: usize,
    /// Positions the pool counts for the job. A row that stays inside the job's last page
    /// takes its positions without asking the pool, which counts them with the next
    /// extension: a decode step needs the pool once a page, not once a token.
    pub pooled_tokens: usize,
    /// Changes whenever `pages` changes other than by growing (a new slot, a cut): a copy of
    /// a table of the same version is a head of this one.
    pub version: u64,
}

#[derive(Debug)]
pub(crate) struct Job {
    pub id: RequestId,
    events: mailbox::Sender<Delivery>,
    /// Set by the caller whose text reached a stop string.
    stopped: RequestLink,
    pub tokens: Vec<u32>,
    pub prompt_len: usize,
    /// Most tokens it may generate (already clipped to the model's context).
    pub max_new: usize,
    /// Its sampler, until the first row that picks a token hands it to the engine, which
    /// keeps it from then on (and drops it when told the request ended).
    pub sampler: Option<Box<Sampler>>,
    /// How it picks, for the stop rule and planning, wherever the sampler is.
    pub params: SamplingParams,
    /// Where the engine keeps its sampler, once handed over.
    pub sampler_slot: Option<u32>,
    /// Tokens picked by steps sent to the engine whose answers have not come back: at most
    /// one at planning time (a step planned while the one before it runs).
    pub in_flight: usize,
    /// Bumped whenever what steps in flight computed for it stops counting (its KV is
    /// recomputed, it is preempted or closes): their answers for it are dropped.
    pub epoch: u32,
    /// Chained hashes of the full pages of `tokens`, extended as needed.
    chain: Vec<PrefixHash>,
    pub slot: Option<Slot>,
    pub computed: usize,
    pub backoff: Backoff,
    /// Not scheduled before this instant (back-off).
    pub blocked_until: Option<Instant>,
    /// A restore into its pages is in flight this step.
    pub restoring: Option<SnapshotId>,
    /// Waiting in the queue for this disk snapshot to be read back into memory.
    pub awaiting: Option<SnapshotId>,
    /// Its disk snapshot could not be read back: it computes its prompt instead.
    pub skip_disk: bool,
    pub prompt_saved: bool,
    /// Its prompt is in the store: saved by it, or found already stored.
    pub prompt_stored: bool,
    /// Submitted to keep its prompt (an operator's pin): saved whatever the policy, kept.
    pub keep_prompt: bool,
    /// Why its prompt could not be kept, if it could not.
    pub keep_failure: Option<String>,
    /// Finished (its terminal event sent), its pages held one more step to save its prompt
    /// and reply for the conversation's next turn, then released.
    pub closing: bool,
    /// Its attempts to grow ran out: it runs no more, and the next step saves what it
    /// computed, then requeues it.
    pub preempted: bool,
    /// The save a closing or preempted job makes before it leaves has been charged (in the
    /// step it leaves at the end of).
    pub leave_charged: bool,
    /// Its prompt was completed by a step that charged no save for it: the next step does.
    pub save_owed: bool,
    /// Another choice of the same request (`n` > 1), waiting to take the prompt's KV from the
    /// first choice, this job, once that one has computed it. Cleared when it forks, or when
    /// the first choice is gone and it must compute the prompt itself.
    pub fork_of: Option<RequestId>,
    /// Cancelled by an explicit request; removed at the next step.
    pub cancelled: bool,
    /// Cut by a shutdown whose grace ran out; failed at the next step.
    pub cut: bool,
    pub submitted_at: Instant,
    pub usage: Usage,
    /// How often its drafted tokens were kept (speculative decoding), which sizes its drafts.
    pub acceptance: policy::Acceptance,
    /// Admitted with its full pages restoring and the logits after its whole prompt kept:
    /// its first token is picked from them, before any forward pass.
    pub first_logits: Option<Arc<[f32]>>,
    /// The key under which the logits of its pick after the prompt are kept, when this step
    /// makes that pick and its prompt is saved or restored whole.
    pub keep_logits_as: Option<PrefixHash>,
    /// The plan row an answered step handed back, with the version of the page table it
    /// holds: its next row copies only the pages added since.
    pub spare_row: Option<(engine::backend::RowPlan, u64)>,
    /// Prompt tokens (from the second) whose log-probabilities steps have been asked for
    /// (`params.prompt_logprobs`), and those that came back and went to the caller.
    pub scores_asked: usize,
    pub scores_delivered: usize,
}

impl Job {
    pub fn new(
        id: RequestId,
        prompt: Vec<u32>,
        max_new: usize,
        sampler: Sampler,
        events: mailbox::Sender<Delivery>,
        stopped: RequestLink,
        submitted_at: Instant,
    ) -> Self {
        let usage = Usage {
            prompt_tokens: prompt.len(),
            ..Usage::default()
        };
        Job {
            id,
            events,
            stopped,
            prompt_len: prompt.len(),
            tokens: prompt,
            max_new,
            params: sampler.params().clone(),
            sampler_slot: None,
            sampler: Some(Box::new(sampler)),
            in_flight: 0,
            epoch: 0,
            chain: Vec::new(),
            slot: None,
            computed: 0,
            backoff: Backoff::new(),
            blocked_until: None,
            restoring: None,
            awaiting: None,
            skip_disk: false,
            prompt_saved: false,
            prompt_stored: false,
            keep_prompt: false,
            keep_failure: None,
            closing: false,
            preempted: false,
            leave_charged: false,
            save_owed: false,
            fork_of: None,
            cancelled: false,
            cut: false,
            submitted_at,
            usage,
            acceptance: policy::Acceptance::default(),
            first_logits: None,
            keep_logits_as: None,
            spare_row: None,
            scores_asked: 0,
            scores_delivered: 0,
        }
    }

    /// Whether it still has prompt tokens to score: then it computes its whole prompt, not
    /// restoring any of it from a snapshot (a restored position has no logits).
    pub fn scores_prompt(&self) -> bool {
        self.params.prompt_logprobs.is_some() && self.scores_delivered + 1 < self.prompt_len
    }

    /// The prompt tokens a row over positions `start..end` scores: the positions whose
    /// logits score the token after them, not asked for yet, as a range.
    pub fn scored_positions(&self, start: usize, end: usize) -> std::ops::Range<usize> {
        if self.params.prompt_logprobs.is_none() {
            return 0..0;
        }
        let first = start.max(self.scores_asked);
        let last = end.min(self.prompt_len.saturating_sub(1));
        first..last.max(first)
    }

    /// Sends the caller the log-probabilities of prompt tokens, in order.
    pub fn emit_prompt_scores(
        &mut self,
        scores: Vec<TokenLogprobs>,
        waking: &mut crate::mailbox::Waking,
    ) {
        self.scores_delivered += scores.len();
        let _ = self
            .events
            .send_later(Delivery::PromptScored(scores), waking);
    }

    pub fn generated(&self) -> usize {
        self.tokens.len() - self.prompt_len
    }

    /// Its length once the steps in flight have answered: its tokens and their picks.
    pub fn planned_len(&self) -> usize {
        self.tokens.len() + self.in_flight
    }

    /// Tokens whose KV still has to be computed, the picks in flight counted as tokens; none
    /// once a pick in flight is the last it may make.
    pub fn pending(&self) -> usize {
        if self.in_flight > 0 && self.generated() + self.in_flight >= self.max_new {
            return 0;
        }
        self.planned_len() - self.computed
    }

    /// What steps in flight picked or computed for it no longer counts.
    pub fn forget_in_flight(&mut self) {
        self.in_flight = 0;
        // Scores asked for by those steps are asked for again.
        self.scores_asked = self.scores_delivered;
        self.epoch = self.epoch.wrapping_add(1);
    }

    /// Whether the caller has gone away (and with it, maybe, [`Job::stopped_by_caller`]).
    pub fn abandoned(&self) -> bool {
        self.events.is_closed()
    }

    /// Whether the caller ended the request because its text reached a stop string.
    pub fn stopped_by_caller(&self) -> bool {
        self.stopped.is_stopped()
    }

    /// Sets its prompt tokens not computed (`usage.cached_tokens`), and tells its caller.
    pub fn set_cached_tokens(&mut self, tokens: usize) {
        self.usage.cached_tokens = tokens;
        self.stopped.set_cached_tokens(tokens);
    }

    /// Whether it may run, or be admitted, now: not restoring, not backing off, and not
    /// waiting for the first choice of its request to compute their shared prompt.
    pub fn ready(&self, now: Instant) -> bool {
        self.restoring.is_none()
            && self.awaiting.is_none()
            && self.fork_of.is_none()
            && !self.closing
            && !self.preempted
            && self.blocked_until.is_none_or(|t| t <= now)
    }

    /// The chain of the first `pages` full pages of its tokens.
    pub fn chain(&mut self, hasher: &PrefixHasher, pages: usize) -> &[PrefixHash] {
        if self.chain.len() < pages {
            hasher.extend(
                &mut self.chain,
                &self.tokens[..pages * hasher.page_tokens()],
            );
        }
        &self.chain[..pages]
    }

    /// The key of its whole prompt ([`PrefixHasher::whole`]).
    pub fn prompt_key(&mut self, hasher: &PrefixHasher) -> PrefixHash {
        let pages = self.prompt_len / hasher.page_tokens();
        self.chain(hasher, pages);
        hasher.whole(&self.chain[..pages], &self.tokens[..self.prompt_len])
    }

    /// Sends the caller the tokens of one step, in one channel operation, with their
    /// log-probabilities when the request asked for them (then one per token).
    pub fn emit_tokens(
        &self,
        tokens: &[u32],
        logprobs: Vec<TokenLogprobs>,
        waking: &mut crate::mailbox::Waking,
    ) {
        let delivery = match tokens {
            [] => return,
            _ if !logprobs.is_empty() => Delivery::Scored(logprobs),
            &[token] => Delivery::Token(token),
            tokens => Delivery::Tokens(tokens.to_vec()),
        };
        // A closed channel is a cancelled request; the next sweep removes it.
        let _ = self.events.send_later(delivery, waking);
    }

    pub fn finish(self, reason: FinishReason) {
        self.announce_finish(reason);
    }

    /// Sends the caller the finished event, the job staying on (to save its reply).
    pub fn announce_finish(&self, reason: FinishReason) {
        let usage = Usage {
            completion_tokens: self.generated(),
            ..self.usage
        };
        let _ = self
            .events
            .send(Delivery::End(Box::new(Event::Finished { reason, usage })));
    }

    pub fn fail(self, error: ServeError) {
        let _ = self
            .events
            .send(Delivery::End(Box::new(Event::Failed(error))));
    }

    pub fn cancel(self) {
        let _ = self.events.send(Delivery::End(Box::new(Event::Cancelled)));
    }
}
