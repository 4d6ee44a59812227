//! What a caller submits, and the events that come back on the request's own channel.
//!
//! Tokens reach the caller through a channel per request, never one by one through an actor
//! mailbox. Every admitted request ends with exactly one terminal event (`Finished`, `Failed`
//! or `Cancelled`), after which the channel closes. Dropping the [`RequestStream`] cancels the
//! request: the scheduler sees the closed channel and frees its pages within one step.
//! [`RequestStream::stop`] ends it the same way but as finished, for a caller whose text
//! reached one of the request's stop strings.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use engine::sampling::{SamplingParams, TokenLogprobs};
pub use engine::stop::FinishReason;

use crate::error::ServeError;
use crate::mailbox;

/// Identifies a request for its whole life, across preemptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// A tokenized generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// Token counts of a finished request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub prompt_tokens: usize,
    pub completion_tokens: usize,
    /// Prompt tokens restored from a snapshot instead of computed.
    pub cached_tokens: usize,
    /// Times the request was preempted and resumed.
    pub preemptions: u32,
    /// The snapshot keeping its prompt, for a request submitted to keep one
    /// ([`crate::Handles::keep_prefix`]).
    pub kept: Option<cache::SnapshotId>,
}

/// One event on a request's channel.
#[derive(Debug, Clone, PartialEq)]
pub enum Event {
    Token(u32),
    Finished { reason: FinishReason, usage: Usage },
    Failed(ServeError),
    Cancelled,
}

impl Event {
    pub fn is_terminal(&self) -> bool {
        !matches!(self, Event::Token(_))
    }
}

/// What the scheduler sends down a request's channel: the tokens of one step together (one
/// channel operation for a multi-step decode's several), then the terminal event.
#[derive(Debug)]
pub(crate) enum Delivery {
    Token(u32),
    Tokens(Vec<u32>),
    /// Tokens with their log-probabilities (each entry names its token).
    Scored(Vec<TokenLogprobs>),
    /// Log-probabilities of prompt tokens, in order, before the first token
    /// ([`RequestStream::take_prompt_logprobs`]).
    PromptScored(Vec<TokenLogprobs>),
    /// Boxed: a step's deliveries cross to the readers' threads, and the rare end would make
    /// every one of them as large as itself.
    End(Box<Event>),
}

/// What a request's two ends share besides its events: the caller's stop, set when its text
/// reached a stop string and read by the scheduler once the caller's end is closed, to end the
/// request as finished rather than cancelled; and the prompt tokens the scheduler restored
/// instead of computing, which the usage of a request the caller stopped itself reports.
#[derive(Debug, Clone, Default)]
pub(crate) struct RequestLink(Arc<Shared>);

#[derive(Debug, Default)]
struct Shared {
    stopped: AtomicBool,
    cached_tokens: AtomicUsize,
}

impl RequestLink {
    pub fn is_stopped(&self) -> bool {
        self.0.stopped.load(Ordering::Acquire)
    }

    fn stop(&self) {
        self.0.stopped.store(true, Ordering::Release);
    }

    /// Publishes the request's cached prompt tokens (its `usage.cached_tokens`).
    pub fn set_cached_tokens(&self, tokens: usize) {
        self.0.cached_tokens.store(tokens, Ordering::Relaxed);
    }

    fn cached_tokens(&self) -> usize {
        self.0.cached_tokens.load(Ordering::Relaxed)
    }
}

/// Has request streams first read on this thread delivered to through one inbox of the
/// thread's, which the scheduler fills and wakes once a step, instead of each stream's events
/// crossing between threads on their own (see the mailbox module). Call it on each thread that
/// reads many streams, inside its local task set (an actix worker's, as the HTTP server does);
/// a stream first read there must be read there. Does nothing if the thread has one.
pub fn install_stream_inbox() {
    mailbox::install_inbox::<Delivery>();
}

/// The caller's end of a request.
#[derive(Debug)]
pub struct RequestStream {
    pub id: RequestId,
    pub(crate) events: mailbox::Receiver<Delivery>,
    stopped: RequestLink,
    /// Tokens of a batch not yet handed out.
    pending: std::vec::IntoIter<u32>,
    /// The same for a batch that came with log-probabilities.
    pending_scored: std::vec::IntoIter<TokenLogprobs>,
    /// The log-probabilities of the token [`RequestStream::next`] returned last, if asked for.
    scored: Option<TokenLogprobs>,
    /// The prompt's tokens' log-probabilities read so far, when asked for.
    prompt_scores: Vec<TokenLogprobs>,
}

/// A whole request's output: its tokens and how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub end: Event,
}

impl RequestStream {
    pub(crate) fn new(
        id: RequestId,
        events: mailbox::Receiver<Delivery>,
        stopped: RequestLink,
    ) -> Self {
        RequestStream {
            id,
            events,
            stopped,
            pending: Vec::new().into_iter(),
            pending_scored: Vec::new().into_iter(),
            scored: None,
            prompt_scores: Vec::new(),
        }
    }

    /// Ends the request as finished by a stop string (the caller's text reached one): the
    /// scheduler sees the closed stream within one step, releases the pages and counts the
    /// request finished with [`FinishReason::Stop`]. Tokens it generated meanwhile are dropped.
    pub fn stop(self) {
        self.stopped.stop();
    }

    /// Prompt tokens restored from a snapshot or copied instead of computed, as far as the
    /// scheduler has told (0 before the request is admitted): what the `Finished` usage's
    /// `cached_tokens` would say, for a caller that ends the request itself.
    pub fn cached_tokens(&self) -> usize {
        self.stopped.cached_tokens()
    }

    /// The next event, or `None` once the terminal event has been read.
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.next_pending() {
                return Some(event);
            }
            let delivery = self.events.recv().await?;
            if let Some(event) = self.unpack(delivery) {
                return Some(event);
            }
        }
    }

    /// The next event if one is waiting, without waiting for one.
    pub fn try_next(&mut self) -> Option<Event> {
        loop {
            if let Some(event) = self.next_pending() {
                return Some(event);
            }
            let delivery = self.events.try_recv()?;
            if let Some(event) = self.unpack(delivery) {
                return Some(event);
            }
        }
    }

    /// The log-probabilities of the prompt's tokens from its second on, each given the ones
    /// before it (`SamplingParams::prompt_logprobs`), as far as they have arrived: all of them
    /// once the first token or the end has been read.
    pub fn take_prompt_logprobs(&mut self) -> Vec<TokenLogprobs> {
        std::mem::take(&mut self.prompt_scores)
    }

    /// The log-probabilities of the token the last [`RequestStream::next`] returned, when the
    /// request asked for them.
    pub fn logprobs(&self) -> Option<&TokenLogprobs> {
        self.scored.as_ref()
    }

    fn next_pending(&mut self) -> Option<Event> {
        if let Some(token) = self.pending.next() {
            return Some(Event::Token(token));
        }
        let scored = self.pending_scored.next()?;
        let token = scored.token;
        self.scored = Some(scored);
        Some(Event::Token(token))
    }

    /// The delivery's first event; none for prompt scores, which are kept.
    fn unpack(&mut self, delivery: Delivery) -> Option<Event> {
        Some(match delivery {
            Delivery::Token(token) => Event::Token(token),
            Delivery::Tokens(tokens) => {
                self.pending = tokens.into_iter();
                Event::Token(self.pending.next().expect("a batch is never empty"))
            }
            Delivery::Scored(scored) => {
                self.pending_scored = scored.into_iter();
                self.next_pending().expect("a batch is never empty")
            }
            Delivery::PromptScored(scores) => {
                self.prompt_scores.extend(scores);
                return None;
            }
            Delivery::End(event) => *event,
        })
    }

    /// Reads every event up to the terminal one.
    pub async fn collect(mut self) -> Completion {
        let mut tokens = Vec::new();
        while let Some(event) = self.next().await {
            match event {
                Event::Token(token) => tokens.push(token),
                end => return Completion { tokens, end },
            }
        }
        Completion {
            tokens,
            end: Event::Failed(ServeError::ShuttingDown),
        }
    }
}
