//! What a caller submits, and the events that come back on the request's own channel.
//!
//! Tokens reach the caller through a channel per request, never one by one through an actor
//! mailbox. Every admitted request ends with exactly one terminal event (`Finished`, `Failed`
//! or `Cancelled`), after which the channel closes. Dropping the [`RequestStream`] cancels the
//! request: the scheduler sees the closed channel and frees its pages within one step.

use engine::sampling::SamplingParams;
use tokio::sync::mpsc;

use crate::error::ServeError;

/// Identifies a request for its whole life, across preemptions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RequestId(pub u64);

/// A tokenized generation request.
#[derive(Debug, Clone, PartialEq)]
pub struct GenerateRequest {
    pub prompt: Vec<u32>,
    pub params: SamplingParams,
}

/// Why a request finished.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token or one of the request's stop token ids.
    Stop,
    /// `max_tokens` generated, or the model's context is full.
    Length,
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

/// The caller's end of a request.
#[derive(Debug)]
pub struct RequestStream {
    pub id: RequestId,
    pub(crate) events: mpsc::UnboundedReceiver<Event>,
}

/// A whole request's output: its tokens and how it ended.
#[derive(Debug, Clone, PartialEq)]
pub struct Completion {
    pub tokens: Vec<u32>,
    pub end: Event,
}

impl RequestStream {
    /// The next event, or `None` once the terminal event has been read.
    pub async fn next(&mut self) -> Option<Event> {
        self.events.recv().await
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
