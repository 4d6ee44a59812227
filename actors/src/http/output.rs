//! From a request's events to OpenAI's responses: tokens become text once final (never half a
//! UTF-8 character), stop strings cut the text and end the request through the scheduler as
//! `stop` ([`RequestStream::stop`]), and the end carries the finish reason and the token counts,
//! including the prompt tokens restored from a snapshot.

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use engine::stop::StopMatcher;
use engine::tokenizer::TextStream;
use futures_util::{Stream, StreamExt};
use serde_json::{Value, json};

use super::Model;
use super::error::ApiError;
use crate::error::ServeError;
use crate::metrics;
use crate::request::{Event, RequestStream};
use engine::sampling::TokenLogprobs;
use engine::tools::{CallStart, ParsedReply, ToolCall};

use super::api::ToolUse;

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

/// One read from the request: text that became final, the log-probabilities of the tokens
/// read for it (when asked for), and the end if it came.
struct Piece {
    text: String,
    logprobs: Vec<TokenLogprobs>,
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
    /// Which of the request's choices (`n` for each prompt) this is.
    index: usize,
    /// Which of the request's prompts it answers (a completion may list several).
    prompt: usize,
    submitted: Instant,
    last_token: Option<Instant>,
    /// Text answered before the completion's own (`echo`): the first piece.
    echo: Option<String>,
    /// The prompt's first token, when the echoed prompt comes with its tokens' logprobs (read
    /// from the stream with the first event, which waits in `peeked`).
    scoring_prompt: Option<u32>,
    peeked: Option<Option<Event>>,
    /// Only the echoed prompt is answered: generated tokens are read and dropped.
    echo_only: bool,
    /// Log-probabilities of tokens read since the last piece, when the request asked for them.
    logprobs: Option<Vec<TokenLogprobs>>,
    /// Characters of text answered so far (`text_offset` of completions' logprobs).
    offset: usize,
    /// Reads tool calls out of the reply, when the request offered tools.
    tools: Option<ToolReader>,
    /// The sum of the log-probabilities of the tokens read, and how many had one (the
    /// ranking of `best_of` candidates).
    score: (f64, usize),
}

/// Splits a streamed reply into content, answered as it comes, and tool calls, held from
/// where one may start until the end, then read whole.
struct ToolReader {
    tools: ToolUse,
    held: String,
    /// A call has started: everything from `held`'s start is the calls' text.
    calling: bool,
}

impl ToolReader {
    /// The part of `text` that is surely content.
    fn push(&mut self, text: &str) -> String {
        self.held.push_str(text);
        if self.calling {
            return String::new();
        }
        let content_end = match self.tools.format.call_start(&self.held) {
            CallStart::At(at) => {
                self.calling = true;
                at
            }
            CallStart::Maybe(at) => at,
            CallStart::No => self.held.len(),
        };
        let rest = self.held.split_off(content_end);
        std::mem::replace(&mut self.held, rest)
    }

    /// The rest of the content, and the calls, at the end of the reply.
    fn finish(&mut self) -> (String, Vec<ToolCall>) {
        let held = std::mem::take(&mut self.held);
        match self
            .calling
            .then(|| read_calls(&self.tools, &held))
            .flatten()
        {
            Some(parsed) => (parsed.content, parsed.calls),
            None => (held, Vec::new()),
        }
    }
}

/// The calls in a whole reply, if it makes any and every one names an offered function; only
/// the first when the request wants no parallel calls.
fn read_calls(tools: &ToolUse, text: &str) -> Option<ParsedReply> {
    let mut parsed = tools
        .format
        .parse(text)
        .filter(|p| p.calls.iter().all(|c| tools.names.contains(&c.name)))?;
    if tools.single {
        parsed.calls.truncate(1);
    }
    Some(parsed)
}

/// OpenAI's `tool_calls` entries, each with a fresh id.
fn calls_json(calls: &[ToolCall]) -> Vec<Value> {
    calls
        .iter()
        .map(|c| {
            json!({
                "id": format!("call_{:016x}", rand::random::<u64>()),
                "type": "function",
                "function": {"name": c.name, "arguments": c.arguments.to_string()},
            })
        })
        .collect()
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
            index: 0,
            prompt: 0,
            submitted: Instant::now(),
            last_token: None,
            echo: None,
            scoring_prompt: None,
            peeked: None,
            echo_only: false,
            logprobs: None,
            offset: 0,
            tools: None,
            score: (0.0, 0),
        }
    }

    /// Reads tool calls out of the reply in `tools`' syntax. Special tokens are then kept in
    /// the text (Mistral's `[TOOL_CALLS]` is one), except the end-of-sequence ones.
    pub fn reading_tools(self, tools: Option<ToolUse>) -> Self {
        match tools {
            None => self,
            Some(tools) => Output {
                text: TextStream::new(false),
                tools: Some(ToolReader {
                    tools,
                    held: String::new(),
                    calling: false,
                }),
                ..self
            },
        }
    }

    /// Reports each token's log-probabilities with its text.
    pub fn with_logprobs(self, wanted: bool) -> Self {
        Output {
            logprobs: wanted.then(Vec::new),
            ..self
        }
    }

    /// Makes this the choice `index` of the response `first` opens (its id and time).
    pub fn choice_of(self, first: &Output, index: usize) -> Self {
        Output {
            id: first.id.clone(),
            created: first.created,
            index,
            ..self
        }
    }

    /// Answers `echo` (the prompt's text) before the completion, as its first piece.
    pub fn echoing(self, echo: Option<String>) -> Self {
        Output { echo, ..self }
    }

    /// Answers the echoed prompt with its tokens' log-probabilities (its first token,
    /// `first`, has none), which the request asked the scheduler for.
    pub fn scoring_prompt(self, first: Option<u32>) -> Self {
        Output {
            scoring_prompt: first,
            ..self
        }
    }

    /// Answers the echoed prompt alone (`max_tokens: 0`), none of the generated tokens.
    pub fn echo_only(self, echo_only: bool) -> Self {
        Output { echo_only, ..self }
    }

    /// Makes this a choice of the request's prompt `prompt` (of a completion's list).
    pub fn for_prompt(self, prompt: usize) -> Self {
        Output { prompt, ..self }
    }

    /// Reads events until some text is final or the request ends.
    async fn next(&mut self) -> Piece {
        if let Some(text) = self.echo.take() {
            if let (Some(first), Some(events)) = (self.scoring_prompt.take(), self.events.as_mut())
            {
                // The prompt's scores arrive before its first token (or its end).
                self.peeked = Some(events.next().await);
                let mut scores = vec![TokenLogprobs {
                    token: first,
                    logprob: f32::NAN,
                    top: Vec::new(),
                }];
                scores.extend(events.take_prompt_logprobs());
                if let Some(list) = &mut self.logprobs {
                    *list = scores;
                }
                return self.piece(text, None);
            }
            if !text.is_empty() {
                return self.piece(text, None);
            }
        }
        loop {
            let Some(events) = self.events.as_mut() else {
                unreachable!("nothing is read after the end");
            };
            let event = match self.peeked.take() {
                Some(event) => event,
                None => events.next().await,
            };
            match event {
                Some(Event::Token(_)) if self.echo_only => {}
                Some(Event::Token(token)) => {
                    self.completion_tokens += 1;
                    if let Some(scored) = events.logprobs() {
                        self.score.0 += f64::from(scored.logprob);
                        self.score.1 += 1;
                    }
                    if let (Some(list), Some(scored)) = (&mut self.logprobs, events.logprobs())
                        && !self.model.eos_token_ids.contains(&token)
                    {
                        list.push(scored.clone());
                    }
                    let now = Instant::now();
                    match self.last_token.replace(now) {
                        None => metrics::time_to_first_token((now - self.submitted).as_secs_f64()),
                        Some(last) => metrics::inter_token((now - last).as_secs_f64()),
                    }
                    if self.tools.is_some() && self.model.eos_token_ids.contains(&token) {
                        continue;
                    }
                    let text = match self.text.push(&self.model.tokenizer, token) {
                        Ok(text) => text,
                        Err(e) => return self.failed(ServeError::Engine(e.to_string()).into()),
                    };
                    let out = self.stops.push(&text);
                    if out.matched.is_some() {
                        let mut cached = None;
                        if let Some(events) = self.events.take() {
                            cached = Some(events.cached_tokens());
                            events.stop();
                        }
                        metrics::request_done(self.submitted.elapsed().as_secs_f64(), "stop");
                        let usage = self.usage(self.completion_tokens, cached);
                        let end = End::Finished {
                            reason: "stop",
                            usage,
                        };
                        return self.piece(out.text, Some(end));
                    }
                    if !out.text.is_empty() {
                        return self.piece(out.text, None);
                    }
                }
                Some(Event::Finished { reason, usage }) => {
                    self.events = None;
                    let tail = self.text.finish(&self.model.tokenizer).unwrap_or_default();
                    let out = self.stops.push(&tail);
                    let (text, reason) = match out.matched {
                        Some(_) => (out.text, "stop"),
                        // Cut at its length, 0: what it generated is not answered.
                        None if self.echo_only => (out.text, "length"),
                        None => (out.text + &self.stops.finish(), reason.as_str()),
                    };
                    metrics::request_done(self.submitted.elapsed().as_secs_f64(), reason);
                    let completion_tokens = if self.echo_only {
                        0
                    } else {
                        usage.completion_tokens
                    };
                    let usage = self.usage(completion_tokens, Some(usage.cached_tokens));
                    return self.piece(text, Some(End::Finished { reason, usage }));
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
        self.piece(String::new(), Some(End::Failed(error)))
    }

    fn piece(&mut self, text: String, end: Option<End>) -> Piece {
        let logprobs = self
            .logprobs
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default();
        Piece {
            text,
            logprobs,
            end,
        }
    }

    /// The `logprobs` of a choice: null when not asked for; else OpenAI's shape for the
    /// endpoint, chat's `content` list or completions' parallel lists.
    fn logprobs_json(&mut self, scored: &[TokenLogprobs]) -> Value {
        if self.logprobs.is_none() {
            return Value::Null;
        }
        let model = &self.model;
        let token = |id: u32| {
            let bytes = model.token_bytes(id);
            (String::from_utf8_lossy(&bytes).into_owned(), bytes)
        };
        match self.kind {
            Kind::Chat => {
                let content: Vec<Value> = scored
                    .iter()
                    .map(|s| {
                        let (text, bytes) = token(s.token);
                        let top: Vec<Value> = s
                            .top
                            .iter()
                            .map(|&(id, logprob)| {
                                let (text, bytes) = token(id);
                                json!({"token": text, "logprob": logprob, "bytes": bytes})
                            })
                            .collect();
                        json!({
                            "token": text, "logprob": s.logprob, "bytes": bytes,
                            "top_logprobs": top,
                        })
                    })
                    .collect();
                json!({"content": content, "refusal": null})
            }
            Kind::Completion => {
                let mut tokens = Vec::new();
                let mut token_logprobs = Vec::new();
                let mut top_logprobs = Vec::new();
                let mut text_offset = Vec::new();
                for s in scored {
                    let (text, _) = token(s.token);
                    text_offset.push(self.offset);
                    self.offset += text.chars().count();
                    tokens.push(text);
                    // An echoed prompt's first token has no log-probability: null, as OpenAI's.
                    if s.logprob.is_nan() {
                        token_logprobs.push(Value::Null);
                        top_logprobs.push(Value::Null);
                        continue;
                    }
                    token_logprobs.push(json!(s.logprob));
                    let top: serde_json::Map<String, Value> = s
                        .top
                        .iter()
                        .map(|&(id, logprob)| (token(id).0, json!(logprob)))
                        .collect();
                    top_logprobs.push(Value::Object(top));
                }
                json!({
                    "tokens": tokens,
                    "token_logprobs": token_logprobs,
                    "top_logprobs": top_logprobs,
                    "text_offset": text_offset,
                })
            }
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

    /// Reads the choice to its end: its `choices` entry, its usage, and its mean token
    /// log-probability (for `best_of`).
    async fn whole_choice(mut self) -> Result<WholeChoice, ApiError> {
        let mut text = String::new();
        let mut scored = Vec::new();
        loop {
            let piece = self.next().await;
            text.push_str(&piece.text);
            scored.extend(piece.logprobs);
            match piece.end {
                None => {}
                Some(End::Failed(error)) => return Err(error),
                Some(End::Finished { reason, usage }) => {
                    let logprobs = self.logprobs_json(&scored);
                    let called = self
                        .tools
                        .as_ref()
                        .and_then(|t| read_calls(&t.tools, &text));
                    let index = self.index;
                    let choice = match (self.kind, called) {
                        (Kind::Completion, _) => json!({
                            "index": index, "text": text, "logprobs": logprobs,
                            "finish_reason": reason,
                        }),
                        (Kind::Chat, None) => json!({
                            "index": index,
                            "message": {"role": "assistant", "content": text},
                            "logprobs": logprobs,
                            "finish_reason": reason,
                        }),
                        (Kind::Chat, Some(parsed)) => json!({
                            "index": index,
                            "message": {
                                "role": "assistant",
                                "content": (!parsed.content.is_empty()).then_some(parsed.content),
                                "tool_calls": calls_json(&parsed.calls),
                            },
                            "logprobs": logprobs,
                            "finish_reason": "tool_calls",
                        }),
                    };
                    let mean = self.score.0 / self.score.1.max(1) as f64;
                    return Ok(WholeChoice {
                        prompt: self.prompt,
                        choice,
                        usage,
                        mean,
                    });
                }
            }
        }
    }

    /// Reads every choice of a request (`outputs`, in order, by prompt) to its end and answers
    /// in one body with `n` for each prompt: all, or, when there are more (`best_of`), the `n`
    /// with the highest log-probability per token, in that order; the choices numbered across
    /// prompts. The usage counts every candidate. The first failure answers the request; the
    /// other choices are then dropped, which cancels them.
    pub async fn whole(outputs: Vec<Output>, n: usize) -> Result<Value, ApiError> {
        let head = outputs.first().expect("a request has a choice");
        let object = match head.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion",
        };
        let mut body = head.envelope(object, Value::Null);
        let read = outputs.into_iter().map(Output::whole_choice);
        let read = futures_util::future::try_join_all(read).await?;
        let usages: Vec<(usize, Value)> =
            read.iter().map(|c| (c.prompt, c.usage.clone())).collect();
        let mut choices = Vec::with_capacity(read.len());
        let mut read = read.into_iter().peekable();
        while let Some(first) = read.next() {
            let prompt = first.prompt;
            let mut group = vec![first];
            while let Some(next) = read.next_if(|c| c.prompt == prompt) {
                group.push(next);
            }
            if group.len() > n {
                // Best first; equal scores keep the candidates' order.
                group.sort_by(|a, b| b.mean.total_cmp(&a.mean));
                group.truncate(n);
            }
            choices.extend(group.into_iter().map(|c| c.choice));
        }
        for (index, choice) in choices.iter_mut().enumerate() {
            choice["index"] = json!(index);
        }
        body["choices"] = Value::Array(choices);
        body["usage"] = merge_usage(&usages);
        Ok(body)
    }

    /// A chunk of the stream: `text` as the next piece with its tokens' `scored`
    /// log-probabilities, or the end's `finish_reason`.
    fn chunk(
        &mut self,
        text: Option<&str>,
        scored: &[TokenLogprobs],
        finish_reason: Option<&str>,
    ) -> Value {
        let logprobs = if text.is_some() {
            self.logprobs_json(scored)
        } else {
            Value::Null
        };
        let choice = match self.kind {
            Kind::Completion => json!({
                "index": self.index,
                "text": text.unwrap_or(""),
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }),
            Kind::Chat => json!({
                "index": self.index,
                "delta": match text {
                    Some(text) => json!({"content": text}),
                    None => json!({}),
                },
                "logprobs": logprobs,
                "finish_reason": finish_reason,
            }),
        };
        self.envelope(self.chunk_object(), json!([choice]))
    }

    /// A chunk carrying one whole tool call, in the delta shape the SDKs assemble.
    fn tool_call_chunk(&self, index: usize, mut call: Value) -> Value {
        call["index"] = json!(index);
        let choice = json!([{
            "index": self.index,
            "delta": {"tool_calls": [call]},
            "logprobs": null,
            "finish_reason": null,
        }]);
        self.envelope(self.chunk_object(), choice)
    }

    fn chunk_object(&self) -> &'static str {
        match self.kind {
            Kind::Completion => "text_completion",
            Kind::Chat => "chat.completion.chunk",
        }
    }

    /// One choice as server-sent event text: a chunk per piece of text, a last chunk with the
    /// finish reason, then how it ended (with its usage), for [`Output::events`] to close.
    fn choice_events(self) -> impl Stream<Item = Streamed> {
        let opening = (self.kind == Kind::Chat).then(|| {
            let choice = json!([{
                "index": self.index,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": null,
                "finish_reason": null,
            }]);
            Streamed::Text(sse(&self.envelope("chat.completion.chunk", choice)))
        });
        let state = (self, opening, None::<Streamed>, false);
        futures_util::stream::unfold(state, move |(mut output, first, last, done)| async move {
            if let Some(item) = first {
                return Some((item, (output, None, last, done)));
            }
            if let Some(item) = last {
                return Some((item, (output, None, None, true)));
            }
            if done {
                return None;
            }
            let piece = output.next().await;
            let mut bytes = String::new();
            let mut text = match &mut output.tools {
                Some(reader) => reader.push(&piece.text),
                None => piece.text,
            };
            let mut calls = Vec::new();
            if piece.end.is_some()
                && let Some(reader) = &mut output.tools
            {
                let (rest, called) = reader.finish();
                text += &rest;
                calls = called;
            }
            if !text.is_empty() || !piece.logprobs.is_empty() {
                bytes += &sse(&output.chunk(Some(&text), &piece.logprobs, None));
            }
            for (index, call) in calls_json(&calls).into_iter().enumerate() {
                bytes += &sse(&output.tool_call_chunk(index, call));
            }
            let end = match piece.end {
                None => None,
                Some(End::Finished { reason, usage }) => {
                    let reason = if calls.is_empty() {
                        reason
                    } else {
                        "tool_calls"
                    };
                    bytes += &sse(&output.chunk(None, &[], Some(reason)));
                    Some(Streamed::Finished(output.prompt, usage))
                }
                Some(End::Failed(error)) => Some(Streamed::Failed(error)),
            };
            Some((Streamed::Text(bytes), (output, None, end, false)))
        })
    }

    /// A request's choices (`outputs`, in order) as one stream of server-sent events: each
    /// choice's chunks as they come, interleaved and told apart by their `index`; once all
    /// have finished, a chunk with the usage when asked, then `[DONE]`. A failure after the
    /// stream started is sent as an `error` object before `[DONE]`, and ends the stream (the
    /// other choices are then dropped, which cancels them).
    pub fn events(
        outputs: Vec<Output>,
        include_usage: bool,
    ) -> impl Stream<Item = Result<Bytes, actix_web::Error>> {
        let head = outputs.first().expect("a request has a choice");
        let closing = head.envelope(head.chunk_object(), json!([]));
        let choices = outputs.len();
        let merged = futures_util::stream::select_all(
            outputs
                .into_iter()
                .map(|output| Box::pin(output.choice_events())),
        );
        let state = (merged, closing, Vec::new(), false);
        futures_util::stream::unfold(state, move |(mut merged, closing, mut usages, done)| {
            async move {
                if done {
                    return None;
                }
                let mut bytes = String::new();
                let mut finished = false;
                // Text comes out as it is read; an end waits for the others.
                while bytes.is_empty() && !finished {
                    match merged.next().await {
                        Some(Streamed::Text(text)) => bytes = text,
                        Some(Streamed::Finished(prompt, usage)) => {
                            usages.push((prompt, usage));
                            if usages.len() == choices {
                                if include_usage {
                                    let mut chunk = closing.clone();
                                    chunk["usage"] = merge_usage(&usages);
                                    bytes += &sse(&chunk);
                                }
                                bytes += "data: [DONE]\n\n";
                                finished = true;
                            }
                        }
                        Some(Streamed::Failed(error)) => {
                            metrics::error_answered(error.code);
                            bytes += &sse(&error.body());
                            bytes += "data: [DONE]\n\n";
                            finished = true;
                        }
                        None => finished = true,
                    }
                }
                Some((Ok(Bytes::from(bytes)), (merged, closing, usages, finished)))
            }
        })
    }
}

/// What a choice's stream carries: event text, then how the choice ended (with its prompt's
/// place in the request and its usage).
enum Streamed {
    Text(String),
    Finished(usize, Value),
    Failed(ApiError),
}

/// A choice read whole ([`Output::whole`]).
struct WholeChoice {
    prompt: usize,
    choice: Value,
    usage: Value,
    /// Its mean token log-probability, which ranks `best_of` candidates.
    mean: f64,
}

/// One usage for a request's choices, each given with its prompt's place in the request: each
/// prompt counted once (its choices computed it once) with the cached tokens of the first of
/// its choices listed, the completions summed.
fn merge_usage(usages: &[(usize, Value)]) -> Value {
    let Some((_, first)) = usages.first() else {
        return Value::Null;
    };
    if usages.len() == 1 {
        return first.clone();
    }
    let mut seen = Vec::new();
    let (mut prompt, mut cached, mut completion) = (0, None::<u64>, 0);
    for (p, usage) in usages {
        completion += usage["completion_tokens"].as_u64().unwrap_or(0);
        if seen.contains(p) {
            continue;
        }
        seen.push(*p);
        prompt += usage["prompt_tokens"].as_u64().unwrap_or(0);
        if let Some(c) = usage["prompt_tokens_details"]["cached_tokens"].as_u64() {
            *cached.get_or_insert(0) += c;
        }
    }
    let mut merged = first.clone();
    merged["prompt_tokens"] = json!(prompt);
    merged["completion_tokens"] = json!(completion);
    merged["total_tokens"] = json!(prompt + completion);
    if let Some(cached) = cached {
        merged["prompt_tokens_details"]["cached_tokens"] = json!(cached);
    }
    merged
}

fn sse(value: &Value) -> String {
    format!("data: {value}\n\n")
}

#[cfg(test)]
mod tests {
    use super::*;
    use engine::tools::ToolFormat;

    #[test]
    fn without_parallel_calls_only_the_first_is_answered() {
        let text = "<tool_call>\n{\"name\": \"a\", \"arguments\": {}}\n</tool_call>\n\
                    <tool_call>\n{\"name\": \"b\", \"arguments\": {}}\n</tool_call>";
        let mut tools = ToolUse {
            format: ToolFormat::Hermes,
            names: vec!["a".into(), "b".into()],
            single: false,
        };
        let names = |tools: &ToolUse| -> Vec<String> {
            read_calls(tools, text)
                .unwrap()
                .calls
                .into_iter()
                .map(|c| c.name)
                .collect()
        };
        assert_eq!(names(&tools), ["a", "b"]);
        tools.single = true;
        assert_eq!(names(&tools), ["a"]);
        tools.names = vec!["a".into()];
        assert!(read_calls(&tools, text).is_none(), "b was never offered");
    }
}
