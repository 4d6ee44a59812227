//! From a request's events to OpenAI's responses: tokens become text once final (never half a
//! UTF-8 character), stop strings cut the text and end the request through the scheduler as
//! `stop` ([`RequestStream::stop`]), and the end carries the finish reason and the token counts,
//! including the prompt tokens restored from a snapshot.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use engine::stop::StopMatcher;
use engine::tokenizer::TextStream;
use futures_util::Stream;
use serde_json::{Value, json};

use super::Model;
use super::error::ApiError;
use crate::error::ServeError;
use crate::metrics;
use crate::request::{Event, RequestStream};

/// Which endpoint's shapes to answer in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// How a response ended.
#[derive(Debug)]
enum End {
    Finished { reason: &'static str, usage: Value },
    Failed(ApiError),
}

/// One read from the request: text that became final, and the end if it came.
struct Piece {
    text: String,
    end: Option<End>,
}

pub struct Output {
    model: Arc<Model>,
    /// Taken at the end; stopped when a stop string ends the text early.
    events: Option<RequestStream>,
    text: TextStream,
    stops: StopMatcher,
    prompt_tokens: usize,
    completion_tokens: usize,
    kind: Kind,
    id: String,
    created: u64,
    submitted: Instant,
    last_token: Option<Instant>,
    /// Text answered before the completion's own (`echo`): the first piece.
    echo: Option<String>,
}

impl Output {
    pub fn new(
        model: Arc<Model>,
        events: RequestStream,
        stops: &[String],
        prompt_tokens: usize,
        kind: Kind,
    ) -> Self {
        let prefix = match kind {
            Kind::Completion => "cmpl",
            Kind::Chat => "chatcmpl",
        };
        Output {
            model,
            id: format!("{prefix}-{:016x}{:08x}", rand::random::<u64>(), events.id.0),
            events: Some(events),
            text: TextStream::new(true),
            stops: StopMatcher::new(stops),
            prompt_tokens,
            completion_tokens: 0,
            kind,
            created: super::unix_now(),
            submitted: Instant::now(),
            last_token: None,
            echo: None,
        }
    }

    /// Answers `echo` (the prompt's text) before the completion, as its first piece.
    pub fn echoing(self, echo: Option<String>) -> Self {
        Output { echo, ..self }
    }

    /// Reads events until some text is final or the request ends.
    async fn next(&mut self) -> Piece {
        if let Some(text) = self.echo.take().filter(|t| !t.is_empty()) {
            return Piece { text, end: None };
        }
        loop {
            let Some(events) = self.events.as_mut() else {
                unreachable!("nothing is read after the end");
            };
            let event = events.next().await;
            match event {
                Some(Event::Token(token)) => {
                    self.completion_tokens += 1;
                    let now = Instant::now();
                    match self.last_token.replace(now) {
                        None => metrics::time_to_first_token((now - self.submitted).as_secs_f64()),
                        Some(last) => metrics::inter_token((now - last).as_secs_f64()),
                    }
                    let text = match self.text.push(&self.model.tokenizer, token) {
                        Ok(text) => text,
                        Err(e) => return self.failed(ServeError::Engine(e.to_string()).into()),
                    };
                    let out = self.stops.push(&text);
                    if out.matched.is_some() {
                        if let Some(events) = self.events.take() {
                            events.stop();
                        }
                        metrics::request_done(self.submitted.elapsed().as_secs_f64(), "stop");
                        let usage = self.usage(self.completion_tokens, None);
                        return Piece {
                            text: out.text,
                            end: Some(End::Finished {
                                reason: "stop",
                                usage,
                            }),
                        };
                    }
                    if !out.text.is_empty() {
                        return Piece {
                            text: out.text,
                            end: None,
                        };
                    }
                }
                Some(Event::Finished { reason, usage }) => {
                    self.events = None;
                    let tail = self.text.finish(&self.model.tokenizer).unwrap_or_default();
                    let out = self.stops.push(&tail);
                    let (text, reason) = match out.matched {
                        Some(_) => (out.text, "stop"),
                        None => (out.text + &self.stops.finish(), reason.as_str()),
                    };
                    metrics::request_done(self.submitted.elapsed().as_secs_f64(), reason);
                    let usage = self.usage(usage.completion_tokens, Some(usage.cached_tokens));
                    return Piece {
                        text,
                        end: Some(End::Finished { reason, usage }),
                    };
                }
                Some(Event::Failed(error)) => return self.failed(error.into()),
                Some(Event::Cancelled) => return self.failed(ServeError::Cancelled.into()),
                // The scheduler went away without a word: it is shutting down.
                None => return self.failed(ServeError::ShuttingDown.into()),
            }
        }
    }

    fn failed(&mut self, error: ApiError) -> Piece {
        self.events = None;
        metrics::request_done(self.submitted.elapsed().as_secs_f64(), "error");
        Piece {
            text: String::new(),
            end: Some(End::Failed(error)),
        }
    }

    fn usage(&self, completion_tokens: usize, cached_tokens: Option<usize>) -> Value {
        let mut usage = json!({
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": self.prompt_tokens + completion_tokens,
        });
        if let Some(cached) = cached_tokens {
            usage["prompt_tokens_details"] = json!({ "cached_tokens": cached });
        }
        usage
    }

    fn envelope(&self, object: &str, choices: Value) -> Value {
        json!({
            "id": self.id,
            "object": object,
            "created": self.created,
            "model": self.model.id,
            "choices": choices,
        })
    }

    /// Reads the request to its end and answers in one body.
    pub async fn whole(mut self) -> Result<Value, ApiError> {
        let mut text = String::new();
        loop {
            let piece = self.next().await;
            text.push_str(&piece.text);
            match piece.end {
                None => {}
                Some(End::Failed(error)) => return Err(error),
                Some(End::Finished { reason, usage }) => {
                    let choice = match self.kind {
                        Kind::Completion => json!({
                            "index": 0, "text": text, "logprobs": null, "finish_reason": reason,
                        }),
                        Kind::Chat => json!({
                            "index": 0,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": null,
                            "finish_reason": reason,
                        }),
                    };
                    let object = match self.kind {
                        Kind::Completion => "text_completion",
                        Kind::Chat => "chat.completion",
                    };
                    let mut body = self.envelope(object, json!([choice]));
                    body["usage"] = usage;
                    return Ok(body);
                }
            }
        }
    }

    /// A chunk of the stream: `text` as the next piece, or the end's `finish_reason`.
    fn chunk(&self, text: Option<&str>, finish_reason: Option<&str>) -> Value {
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": 0,
                "text": text.unwrap_or(""),
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
            Kind::Chat => json!({
                "index": 0,
                "delta": match text {
                    Some(text) => json!({"content": text}),
                    None => json!({}),
                },
                "logprobs": null,
                "finish_reason": finish_reason,
            }),
        };
        self.envelope(self.chunk_object(), json!([choice]))
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    /// The response as server-sent events: a chunk per piece of text, a last chunk with the
    /// finish reason (and one with the usage when asked), then `[DONE]`. A failure after the
    /// stream started is sent as an `error` object before `[DONE]`.
    pub fn into_events(
        self,
        include_usage: bool,
    ) -> impl Stream<Item = Result<Bytes, actix_web::Error>> {
        let opening = (self.kind == Kind::Chat).then(|| {
            let choice = json!([{
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": null,
                "finish_reason": null,
            }]);
            sse(&self.envelope("chat.completion.chunk", choice))
        });
        let state = (self, opening, false);
        futures_util::stream::unfold(state, move |(mut output, opening, done)| async move {
            if let Some(first) = opening {
                return Some((Ok(Bytes::from(first)), (output, None, false)));
            }
            if done {
                return None;
            }
            let piece = output.next().await;
            let mut bytes = String::new();
            if !piece.text.is_empty() {
                bytes += &sse(&output.chunk(Some(&piece.text), None));
            }
            let finished = piece.end.is_some();
            match piece.end {
                None => {}
                Some(End::Finished { reason, usage }) => {
                    bytes += &sse(&output.chunk(None, Some(reason)));
                    if include_usage {
                        let mut chunk = output.envelope(output.chunk_object(), json!([]));
                        chunk["usage"] = usage;
                        bytes += &sse(&chunk);
                    }
                    bytes += "data: [DONE]\n\n";
                }
                Some(End::Failed(error)) => {
                    metrics::error_answered(error.code);
                    bytes += &sse(&error.body());
                    bytes += "data: [DONE]\n\n";
                }
            }
            Some((Ok(Bytes::from(bytes)), (output, None, finished)))
        })
    }
}

fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}
