//! The JSON of the OpenAI API that snapserve accepts, and the checks that turn it into a
//! tokenized request.
//!
//! Unknown fields are ignored, as OpenAI's own clients send fields a server may not know. Known
//! fields snapserve cannot honour (`suffix`, image parts, `echo` with `logprobs` for more than
//! one choice) are refused with a 400 that names them, never silently dropped.
//!
//! Structured outputs (`response_format`, and vLLM's `guided_json`, `guided_regex` and
//! `guided_grammar`) are compiled here, so a schema the grammar engine cannot honour is a 400
//! before the request is queued.

use engine::EngineError;
use engine::chat::ChatMessage;
use engine::grammar::GrammarSpec;
use engine::sampling::{MAX_TOP_LOGPROBS, SamplingParams};
use engine::tools::{Tool, ToolCall, ToolFormat, tools_system_prompt};
use serde::Deserialize;
use serde_json::{Value, json};

use super::Model;
use super::error::ApiError;

/// A prompt as OpenAI allows it: text, token ids, or a list of either (a completion's several
/// prompts, each answered with its own choices).
#[derive(Debug)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
    Texts(Vec<String>),
    TokenLists(Vec<Vec<u32>>),
}

impl Prompt {
    /// The tokens of a request that takes one prompt (`/tokenize`, a prefix to keep): text
    /// encoded as completions encode it, or token ids as given. A list of `what`s is refused.
    pub(super) fn single(&self, model: &Model, what: &str) -> Result<Vec<u32>, ApiError> {
        match self {
            Prompt::Text(text) => encode(model, text),
            Prompt::Tokens(ids) => Ok(ids.clone()),
            Prompt::Texts(_) | Prompt::TokenLists(_) => Err(ApiError::invalid_param(
                "prompt",
                format!("one {what} per request: a string or a list of token ids"),
            )),
        }
    }
}

/// Refuses a token id outside the model's vocabulary, naming `param`.
pub(super) fn check_vocabulary(tokens: &[u32], model: &Model, param: &str) -> Result<(), ApiError> {
    match tokens.iter().find(|&&t| t as usize >= model.vocab_size) {
        Some(&bad) => Err(ApiError::invalid_param(
            param,
            format!(
                "token id {bad} is outside the vocabulary of {}",
                model.vocab_size
            ),
        )),
        None => Ok(()),
    }
}

/// Told apart by the JSON's shape as it is read: a list's first element says which list it is,
/// and the rest are read as that, so a prompt of a whole context of token ids is parsed once,
/// with no copy of it held aside to try each shape in turn (as an untagged enum would).
impl<'de> Deserialize<'de> for Prompt {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(PromptVisitor)
    }
}

const PROMPT_SHAPES: &str =
    "a string, a list of token ids, a list of strings, or a list of lists of token ids";

struct PromptVisitor;

impl<'de> serde::de::Visitor<'de> for PromptVisitor {
    type Value = Prompt;

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        f.write_str(PROMPT_SHAPES)
    }

    fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<Prompt, E> {
        Ok(Prompt::Text(text.to_owned()))
    }

    fn visit_string<E: serde::de::Error>(self, text: String) -> Result<Prompt, E> {
        Ok(Prompt::Text(text))
    }

    fn visit_seq<A: serde::de::SeqAccess<'de>>(self, mut seq: A) -> Result<Prompt, A::Error> {
        match seq.next_element::<PromptItem>()? {
            None => Ok(Prompt::Tokens(Vec::new())),
            Some(PromptItem::Token(first)) => {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0) + 1);
                ids.push(first);
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(Prompt::Tokens(ids))
            }
            Some(PromptItem::Text(first)) => {
                let mut texts = vec![first];
                while let Some(text) = seq.next_element::<String>()? {
                    texts.push(text);
                }
                Ok(Prompt::Texts(texts))
            }
            Some(PromptItem::Tokens(first)) => {
                let mut lists = vec![first];
                while let Some(ids) = seq.next_element::<Vec<u32>>()? {
                    lists.push(ids);
                }
                Ok(Prompt::TokenLists(lists))
            }
        }
    }
}

/// The first element of a list prompt.
enum PromptItem {
    Token(u32),
    Text(String),
    Tokens(Vec<u32>),
}

impl<'de> Deserialize<'de> for PromptItem {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        struct ItemVisitor;
        impl<'de> serde::de::Visitor<'de> for ItemVisitor {
            type Value = PromptItem;

            fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
                f.write_str(PROMPT_SHAPES)
            }

            fn visit_u64<E: serde::de::Error>(self, id: u64) -> Result<PromptItem, E> {
                u32::try_from(id).map(PromptItem::Token).map_err(|_| {
                    E::invalid_value(serde::de::Unexpected::Unsigned(id), &"a token id")
                })
            }

            fn visit_str<E: serde::de::Error>(self, text: &str) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(text.to_owned()))
            }

            fn visit_string<E: serde::de::Error>(self, text: String) -> Result<PromptItem, E> {
                Ok(PromptItem::Text(text))
            }

            fn visit_seq<A: serde::de::SeqAccess<'de>>(
                self,
                mut seq: A,
            ) -> Result<PromptItem, A::Error> {
                let mut ids = Vec::with_capacity(seq.size_hint().unwrap_or(0));
                while let Some(id) = seq.next_element::<u32>()? {
                    ids.push(id);
                }
                Ok(PromptItem::Tokens(ids))
            }
        }
        deserializer.deserialize_any(ItemVisitor)
    }
}

/// `stop`: one string or a list of them.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Stop {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Default, Deserialize)]
pub struct StreamOptions {
    #[serde(default)]
    pub include_usage: bool,
}

/// The sampling fields both endpoints share (OpenAI's, plus vLLM's `top_k`, `min_p`,
/// `repetition_penalty`, `stop_token_ids` and `ignore_eos`).
#[derive(Debug, Default, Deserialize)]
pub struct Sampling {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub stop: Option<Stop>,
    pub stop_token_ids: Option<Vec<u32>>,
    pub ignore_eos: Option<bool>,
    pub n: Option<usize>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Token id (as a string, JSON's object keys) to the bias added to its logit.
    pub logit_bias: Option<std::collections::BTreeMap<String, f32>>,
    pub response_format: Option<ResponseFormat>,
    /// vLLM's extensions: a JSON schema, a regular expression or a Lark grammar.
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_grammar: Option<String>,
}

/// OpenAI's `response_format`.
#[derive(Debug, Deserialize)]
pub struct ResponseFormat {
    #[serde(rename = "type")]
    pub kind: String,
    pub json_schema: Option<JsonSchemaFormat>,
}

#[derive(Debug, Deserialize)]
pub struct JsonSchemaFormat {
    pub schema: Option<Value>,
    pub strict: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct CompletionRequest {
    pub model: Option<String>,
    pub prompt: Prompt,
    pub max_tokens: Option<usize>,
    #[serde(flatten)]
    pub sampling: Sampling,
    /// How many alternatives to report with each token's log-probability (0: none).
    pub logprobs: Option<usize>,
    pub echo: Option<bool>,
    pub best_of: Option<usize>,
    pub suffix: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
pub struct ChatRequest {
    pub model: Option<String>,
    pub messages: Vec<Message>,
    pub max_tokens: Option<usize>,
    pub max_completion_tokens: Option<usize>,
    #[serde(flatten)]
    pub sampling: Sampling,
    pub logprobs: Option<bool>,
    pub top_logprobs: Option<usize>,
    pub tools: Option<Vec<ToolDef>>,
    /// `"none"`, `"auto"`, `"required"` or `{"type": "function", "function": {"name": ...}}`.
    pub tool_choice: Option<Value>,
    /// `false`: at most one call per reply (the first the model makes).
    pub parallel_tool_calls: Option<bool>,
    /// vLLM's: whether the template opens the assistant's turn after the messages (default:
    /// yes, unless the final message is continued).
    pub add_generation_prompt: Option<bool>,
    /// vLLM's: the final message is the assistant's, and the reply continues its text (a reply
    /// prefilled by the caller) instead of opening a turn of its own.
    pub continue_final_message: Option<bool>,
}

/// One entry of `tools`.
#[derive(Debug, Deserialize)]
pub struct ToolDef {
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionDef,
}

#[derive(Debug, Deserialize)]
pub struct FunctionDef {
    pub name: String,
    pub description: Option<String>,
    pub parameters: Option<Value>,
}

#[derive(Debug, Deserialize)]
pub struct Message {
    pub role: String,
    #[serde(default)]
    pub content: Option<Content>,
    /// An assistant's earlier calls.
    pub tool_calls: Option<Vec<MessageToolCall>>,
    /// The call a `tool` message answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

#[derive(Debug, Deserialize)]
pub struct MessageToolCall {
    pub id: Option<String>,
    pub function: CalledFunction,
}

#[derive(Debug, Deserialize)]
pub struct CalledFunction {
    pub name: String,
    /// A JSON string, as OpenAI sends it (an object is taken too).
    pub arguments: Value,
}

/// A message's content: text, or a list of parts of which snapserve reads the text ones.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum Content {
    Text(String),
    Parts(Vec<Part>),
}

#[derive(Debug, Deserialize)]
pub struct Part {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

/// A request ready to submit.
#[derive(Debug)]
pub struct Prepared {
    /// The prompts, each answered with `n` choices: one, or a completion's list.
    pub prompts: Vec<Vec<u32>>,
    pub params: SamplingParams,
    pub stream: bool,
    pub include_usage: bool,
    /// Each prompt's text, answered before its completions (`echo`).
    pub echo: Option<Vec<String>>,
    /// How to read tool calls back out of the reply, when tools may be called.
    pub tools: Option<ToolUse>,
    /// Choices to generate (OpenAI's `n`), sharing the prompt's computation.
    pub n: usize,
    /// Candidates to generate when more than `n` (completions' `best_of`): the `n` with the
    /// highest log-probability per token are answered.
    pub best_of: Option<usize>,
    /// The answer is the echoed prompt alone (a completion's `max_tokens: 0` with `echo`, as
    /// scoring clients send): the one token generated is not answered.
    pub echo_only: bool,
}

/// A chat request's prompt as its template renders it ([`ChatRequest::render`]), with the
/// tools it offers and how it wants them called.
pub struct Rendered {
    pub prompt: Vec<u32>,
    tools: Vec<Tool>,
    choice: Choice,
    format: ToolFormat,
    /// Tools are offered (some are listed and `tool_choice` is not `none`).
    offered: bool,
}

/// The most choices one request may ask for.
pub const MAX_CHOICES: usize = 64;

/// The most prompts one completion request may list (each with its `n` choices, which the
/// queue must also have room for).
pub const MAX_PROMPTS: usize = 1024;

/// Tool calls to read out of a reply: the syntax and the functions that exist.
#[derive(Debug, Clone)]
pub struct ToolUse {
    pub format: ToolFormat,
    pub names: Vec<String>,
    /// At most one call is answered (`parallel_tool_calls: false`).
    pub single: bool,
}

impl Sampling {
    /// How many choices to generate: `n`, from 1 to [`MAX_CHOICES`].
    fn choices(&self) -> Result<usize, ApiError> {
        match self.n.unwrap_or(1) {
            0 => Err(ApiError::invalid_param("n", "n must be at least 1")),
            n if n > MAX_CHOICES => Err(ApiError::invalid_param(
                "n",
                format!("at most {MAX_CHOICES} choices, got {n}"),
            )),
            n => Ok(n),
        }
    }

    /// `logit_bias` by token id, each key a token of the vocabulary.
    fn logit_bias(&self, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
        let Some(map) = &self.logit_bias else {
            return Ok(Vec::new());
        };
        let mut biases = Vec::with_capacity(map.len());
        for (key, &bias) in map {
            let token = key
                .parse::<u32>()
                .ok()
                .filter(|&t| (t as usize) < vocab_size)
                .ok_or_else(|| {
                    ApiError::invalid_param(
                        "logit_bias",
                        format!(
                            "keys must be token ids below the vocabulary size {vocab_size}, got `{key}`"
                        ),
                    )
                })?;
            biases.push((token, bias));
        }
        biases.sort_unstable_by_key(|&(token, _)| token);
        Ok(biases)
    }

    /// The grammar the output must follow, if the request names one (at most one may).
    fn grammar(&self) -> Result<Option<(GrammarSpec, &'static str)>, ApiError> {
        let mut specs = Vec::new();
        if let Some(format) = &self.response_format {
            let param = "response_format";
            match format.kind.as_str() {
                "text" => {}
                "json_object" => specs.push((GrammarSpec::JsonObject, param)),
                "json_schema" => {
                    let Some(schema) = format.json_schema.as_ref().and_then(|j| j.schema.clone())
                    else {
                        return Err(ApiError::invalid_param(
                            "response_format.json_schema.schema",
                            "a `json_schema` response format needs its `json_schema.schema`",
                        ));
                    };
                    let strict = format
                        .json_schema
                        .as_ref()
                        .and_then(|j| j.strict)
                        .unwrap_or(false);
                    specs.push((GrammarSpec::JsonSchema { schema, strict }, param));
                }
                other => {
                    return Err(ApiError::invalid_param(
                        "response_format.type",
                        format!(
                            "`{other}` is not a response format; use text, json_object or json_schema"
                        ),
                    ));
                }
            }
        }
        if let Some(schema) = &self.guided_json {
            let schema = match schema {
                // vLLM also takes the schema as a JSON string.
                Value::String(text) => serde_json::from_str(text).map_err(|e| {
                    ApiError::invalid_param("guided_json", format!("not a JSON schema: {e}"))
                })?,
                schema => schema.clone(),
            };
            let strict = false;
            specs.push((GrammarSpec::JsonSchema { schema, strict }, "guided_json"));
        }
        if let Some(regex) = &self.guided_regex {
            specs.push((GrammarSpec::Regex(regex.clone()), "guided_regex"));
        }
        if let Some(lark) = &self.guided_grammar {
            specs.push((GrammarSpec::Lark(lark.clone()), "guided_grammar"));
        }
        if specs.len() > 1 {
            let names: Vec<&str> = specs.iter().map(|(_, param)| *param).collect();
            return Err(ApiError::invalid_param(
                names[1],
                format!("only one of {} may be given", names.join(", ")),
            ));
        }
        Ok(specs.pop())
    }

    /// Sampling parameters with OpenAI's defaults (temperature 1, top_p 1).
    fn params(&self, max_tokens: usize, logit_bias: Vec<(u32, f32)>) -> SamplingParams {
        let stop = match &self.stop {
            None => Vec::new(),
            Some(Stop::One(s)) => vec![s.clone()],
            Some(Stop::Many(list)) => list.clone(),
        };
        let defaults = SamplingParams::default();
        SamplingParams {
            temperature: self.temperature.unwrap_or(1.0),
            top_p: self.top_p.unwrap_or(1.0),
            top_k: self.top_k.unwrap_or(0),
            min_p: self.min_p.unwrap_or(0.0),
            seed: self.seed,
            presence_penalty: self.presence_penalty.unwrap_or(0.0),
            frequency_penalty: self.frequency_penalty.unwrap_or(0.0),
            repetition_penalty: self
                .repetition_penalty
                .unwrap_or(defaults.repetition_penalty),
            max_tokens,
            stop_token_ids: self.stop_token_ids.clone().unwrap_or_default(),
            stop,
            ignore_eos: self.ignore_eos.unwrap_or(false),
            logit_bias,
            logprobs: None,
            prompt_logprobs: None,
            constraint: None,
        }
    }

    /// Checks the request's sampling fields against its prompts (each must leave room for
    /// `max_tokens`, or one token when it is not given) and builds what to submit. Without
    /// `max_tokens` a choice generates at most `default_max` tokens, fewer where its prompt
    /// leaves less room (the scheduler clips each to its own).
    fn prepare(
        &self,
        model: &Model,
        prompts: Vec<Vec<u32>>,
        max_tokens: Option<usize>,
        default_max: usize,
        logprobs: Option<usize>,
        forced: Option<(GrammarSpec, &'static str)>,
    ) -> Result<Prepared, ApiError> {
        let limit = model.limit.tokens;
        let several = prompts.len() > 1;
        let which = |i: usize| match several {
            true => format!("prompt {i}: "),
            false => String::new(),
        };
        let mut most_room = 0;
        for (i, prompt) in prompts.iter().enumerate() {
            if prompt.len() >= limit {
                return Err(ApiError::invalid_param(
                    "prompt",
                    format!(
                        "{}the prompt has {} tokens; {} holds {}, with room for one generated \
                         token",
                        which(i),
                        prompt.len(),
                        model.limit.holder(),
                        limit - 1
                    ),
                ));
            }
            let room = limit - prompt.len();
            if let Some(asked) = max_tokens.filter(|&asked| asked > room) {
                return Err(ApiError::invalid_param(
                    "max_tokens",
                    format!(
                        "{}the prompt ({} tokens) plus max_tokens ({asked}) exceed {}",
                        which(i),
                        prompt.len(),
                        model.limit.holder()
                    ),
                ));
            }
            most_room = most_room.max(room);
        }
        let max_tokens = max_tokens.unwrap_or(default_max.min(most_room));
        let stream = self.stream.unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::invalid_param(
                "stream_options",
                "stream_options is only allowed when stream is true",
            ));
        }
        let mut params = self.params(max_tokens, self.logit_bias(model.vocab_size)?);
        params.logprobs = logprobs;
        let grammar = match (self.grammar()?, forced) {
            (Some((_, param)), Some(_)) => {
                return Err(ApiError::invalid_param(
                    param,
                    "a response format cannot be combined with a forced tool call",
                ));
            }
            (own, forced) => own.or(forced),
        };
        if let Some((spec, param)) = grammar {
            let grammars = model.grammars.as_ref().map_err(|why| {
                ApiError::invalid_param(
                    param,
                    format!("structured outputs are not available for this model: {why}"),
                )
            })?;
            let grammar = grammars
                .constraint(&spec)
                .map_err(|why| ApiError::invalid_param(param, format!("invalid grammar: {why}")))?;
            params.constraint = Some(grammar.into_source());
        }
        params.validate().map_err(|e| match &e {
            EngineError::InvalidSampling { name, .. } => {
                ApiError::invalid_param(name, e.to_string())
            }
            _ => ApiError::invalid(e.to_string()),
        })?;
        Ok(Prepared {
            prompts,
            params,
            stream,
            include_usage: self
                .stream_options
                .as_ref()
                .is_some_and(|o| o.include_usage),
            echo: None,
            tools: None,
            n: self.choices()?,
            best_of: None,
            echo_only: false,
        })
    }
}

/// Refuses a request for another model than the one served.
pub fn check_model(asked: Option<&str>, model: &Model) -> Result<(), ApiError> {
    match asked {
        Some(name) if name != model.id => Err(ApiError::model_not_found(name, &model.id)),
        _ => Ok(()),
    }
}

impl CompletionRequest {
    pub fn prepare(&self, model: &Model) -> Result<Prepared, ApiError> {
        check_model(self.model.as_deref(), model)?;
        let n = self.sampling.choices()?;
        let refuse = |param: &str, what: &str| {
            Err(ApiError::invalid_param(
                param,
                format!("{what} is not supported"),
            ))
        };
        if let Some(top) = self.logprobs.filter(|&top| top > MAX_TOP_LOGPROBS) {
            return Err(ApiError::invalid_param(
                "logprobs",
                format!("at most {MAX_TOP_LOGPROBS} alternatives, got {top}"),
            ));
        }
        // The prompt's own log-probabilities, as evaluation harnesses score text with.
        let prompt_logprobs = self.logprobs.filter(|_| self.echo == Some(true));
        if prompt_logprobs.is_some() && (n > 1 || self.best_of.is_some_and(|b| b > 1)) {
            return Err(ApiError::invalid_param(
                "echo",
                "echo with logprobs answers one choice a prompt: n and best_of must be 1",
            ));
        }
        let best_of = match self.best_of {
            None => None,
            Some(b) if b < n => {
                return Err(ApiError::invalid_param(
                    "best_of",
                    format!("best_of ({b}) must be at least n ({n})"),
                ));
            }
            Some(b) if b > MAX_CHOICES => {
                return Err(ApiError::invalid_param(
                    "best_of",
                    format!("at most {MAX_CHOICES} candidates, got {b}"),
                ));
            }
            Some(b) if b > n && self.sampling.stream == Some(true) => {
                return Err(ApiError::invalid_param(
                    "best_of",
                    "best_of above n cannot be streamed: the best are known only at the end",
                ));
            }
            Some(b) => (b > n).then_some(b),
        };
        if self.suffix.is_some() {
            return refuse("suffix", "suffix");
        }
        let prompts = match &self.prompt {
            Prompt::Text(text) => vec![encode(model, text)?],
            Prompt::Texts(texts) => texts
                .iter()
                .map(|text| encode(model, text))
                .collect::<Result<_, _>>()?,
            Prompt::Tokens(ids) => vec![ids.clone()],
            Prompt::TokenLists(lists) => lists.clone(),
        };
        if prompts.len() > MAX_PROMPTS {
            return Err(ApiError::invalid_param(
                "prompt",
                format!("at most {MAX_PROMPTS} prompts, got {}", prompts.len()),
            ));
        }
        if let Some(i) = prompts.iter().position(Vec::is_empty) {
            let what = match prompts.len() {
                1 => "the prompt is empty".to_string(),
                _ => format!("prompt {i} is empty"),
            };
            return Err(ApiError::invalid_param("prompt", what));
        }
        let echo = match (self.echo, &self.prompt) {
            (Some(true), Prompt::Text(text)) => Some(vec![text.clone()]),
            (Some(true), Prompt::Texts(texts)) => Some(texts.clone()),
            (Some(true), Prompt::Tokens(_) | Prompt::TokenLists(_)) => Some(
                prompts
                    .iter()
                    .map(|ids| model.tokenizer.decode(ids, false))
                    .collect::<Result<_, _>>()
                    .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))?,
            ),
            _ => None,
        };
        // `max_tokens: 0` with `echo` answers the prompt alone: one token is generated (the
        // prompt's computation ends in a pick) and not answered.
        let echo_only = self.max_tokens == Some(0) && echo.is_some();
        let max_tokens = if echo_only { Some(1) } else { self.max_tokens };
        // OpenAI's default for completions.
        let mut prepared =
            self.sampling
                .prepare(model, prompts, max_tokens, 16, self.logprobs, None)?;
        prepared.params.prompt_logprobs = prompt_logprobs;
        Ok(Prepared {
            echo,
            best_of,
            echo_only,
            ..prepared
        })
    }
}

impl ChatRequest {
    pub fn prepare(&self, model: &Model) -> Result<Prepared, ApiError> {
        check_model(self.model.as_deref(), model)?;
        self.sampling.choices()?;
        let logprobs = match (self.logprobs.unwrap_or(false), self.top_logprobs) {
            (false, Some(_)) => {
                return Err(ApiError::invalid_param(
                    "top_logprobs",
                    "top_logprobs needs logprobs set to true",
                ));
            }
            (true, Some(top)) if top > MAX_TOP_LOGPROBS => {
                return Err(ApiError::invalid_param(
                    "top_logprobs",
                    format!("at most {MAX_TOP_LOGPROBS} alternatives, got {top}"),
                ));
            }
            (true, top) => Some(top.unwrap_or(0)),
            (false, None) => None,
        };
        let Rendered {
            prompt,
            tools,
            choice,
            format,
            offered,
        } = self.render(model)?;
        let forced = match &choice {
            Choice::Required | Choice::Named(_) => {
                let only = match &choice {
                    Choice::Named(name) => Some(name.as_str()),
                    _ => None,
                };
                let mistral = model.tokenizer.token_to_id("[TOOL_CALLS]");
                let lark = format
                    .forced_call_grammar(&tools, only, mistral)
                    .map_err(|e| ApiError::invalid_param("tool_choice", e))?;
                Some((GrammarSpec::Lark(lark), "tool_choice"))
            }
            Choice::None | Choice::Auto => None,
        };
        let max_tokens = self.max_completion_tokens.or(self.max_tokens);
        // Without a limit, a chat reply may use the rest of the context.
        let prepared = self.sampling.prepare(
            model,
            vec![prompt],
            max_tokens,
            model.limit.tokens,
            logprobs,
            forced,
        )?;
        let tools = offered.then(|| ToolUse {
            format,
            names: tools.iter().map(|t| t.name.clone()).collect(),
            single: self.parallel_tool_calls == Some(false),
        });
        Ok(Prepared { tools, ..prepared })
    }

    /// The prompt the chat template renders from the messages (and the tools, when offered),
    /// with the generation prompt, tokenized: what a reply is generated after, and what
    /// `/tokenize` counts.
    pub fn render(&self, model: &Model) -> Result<Rendered, ApiError> {
        let Some(template) = &model.chat_template else {
            return Err(ApiError::invalid(format!(
                "{} has no chat template; use /v1/completions",
                model.id
            )));
        };
        if self.messages.is_empty() {
            return Err(ApiError::invalid_param("messages", "no messages"));
        }
        let continuing = self.continue_final_message.unwrap_or(false);
        let generation_prompt = self.add_generation_prompt.unwrap_or(!continuing);
        if continuing && generation_prompt {
            return Err(ApiError::invalid_param(
                "continue_final_message",
                "continuing the final message cannot open a new turn: leave \
                 add_generation_prompt unset or false",
            ));
        }
        let last = self.messages.len() - 1;
        if continuing && self.messages[last].role != "assistant" {
            return Err(ApiError::invalid_param(
                "continue_final_message",
                format!(
                    "the final message to continue is the assistant's; messages[{last}] is the {}'s",
                    self.messages[last].role
                ),
            ));
        }
        let tools = self.tools()?;
        let choice = self.tool_choice(&tools)?;
        // A template that renders no tools gets them in a system message, in Hermes syntax.
        let format = template.tool_format().unwrap_or(ToolFormat::Hermes);
        let own_prompt = template.tool_format().is_none();
        let mut messages = Vec::with_capacity(self.messages.len() + 1);
        for (i, message) in self.messages.iter().enumerate() {
            messages.push(message_of(i, message, own_prompt.then_some(format))?);
        }
        let offered = !tools.is_empty() && choice != Choice::None;
        let rendered = if offered && own_prompt {
            let prompt = tools_system_prompt(&tools);
            match messages.first_mut() {
                Some(first) if first.role == "system" || first.role == "developer" => {
                    first.content = format!("{}\n\n{prompt}", first.content);
                }
                _ => messages.insert(0, ChatMessage::new("system", &prompt)),
            }
            template.render(&messages, generation_prompt)
        } else if offered {
            let objects: Vec<Value> = self
                .tools
                .iter()
                .flatten()
                .map(|t| {
                    let mut function = json!({"name": t.function.name});
                    if let Some(d) = &t.function.description {
                        function["description"] = json!(d);
                    }
                    function["parameters"] = t
                        .function
                        .parameters
                        .clone()
                        .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
                    json!({"type": "function", "function": function})
                })
                .collect();
            template.render_with_tools(&messages, Some(&objects), generation_prompt)
        } else {
            template.render(&messages, generation_prompt)
        }
        .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
        let rendered = match continuing {
            false => rendered,
            // The final message rendered whole, and what the template closes its turn with cut.
            true => {
                let text = &messages.last().expect("checked above").content;
                let cut = rendered.rfind(text.as_str()).filter(|_| !text.is_empty());
                match cut {
                    Some(at) => rendered[..at + text.len()].to_string(),
                    None => {
                        return Err(ApiError::invalid_param(
                            "continue_final_message",
                            "the final message has no text the chat template renders as it \
                             is, so there is nothing to continue",
                        ));
                    }
                }
            }
        };
        let prompt = model
            .tokenizer
            .encode_rendered(&rendered)
            .map_err(|e| ApiError::invalid_param("messages", e.to_string()))?;
        Ok(Rendered {
            prompt,
            tools,
            choice,
            format,
            offered,
        })
    }

    /// The `tools` list, checked.
    fn tools(&self) -> Result<Vec<Tool>, ApiError> {
        let mut tools = Vec::new();
        for (i, def) in self.tools.iter().flatten().enumerate() {
            if def.kind != "function" {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].type"),
                    format!("`{}` tools are not supported; only `function`", def.kind),
                ));
            }
            let name = &def.function.name;
            let valid = !name.is_empty()
                && name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !valid {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function.name"),
                    format!("`{name}` is not a function name (a-z, A-Z, 0-9, _ and -, at most 64)"),
                ));
            }
            if tools.iter().any(|t: &Tool| &t.name == name) {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function.name"),
                    format!("`{name}` is named twice"),
                ));
            }
            let parameters = def
                .function
                .parameters
                .clone()
                .unwrap_or_else(|| json!({"type": "object", "properties": {}}));
            if !parameters.is_object() {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}].function.parameters"),
                    "parameters are a JSON schema object",
                ));
            }
            tools.push(Tool {
                name: name.clone(),
                description: def.function.description.clone(),
                parameters,
            });
        }
        Ok(tools)
    }

    fn tool_choice(&self, tools: &[Tool]) -> Result<Choice, ApiError> {
        let param = "tool_choice";
        let choice = match &self.tool_choice {
            None | Some(Value::Null) => {
                return Ok(if tools.is_empty() {
                    Choice::None
                } else {
                    Choice::Auto
                });
            }
            Some(Value::String(s)) if s == "none" => return Ok(Choice::None),
            Some(Value::String(s)) if s == "auto" => Choice::Auto,
            Some(Value::String(s)) if s == "required" => Choice::Required,
            Some(Value::Object(o)) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .ok_or_else(|| {
                        ApiError::invalid_param(
                            param,
                            "a named tool choice is {\"type\": \"function\", \"function\": {\"name\": ...}}",
                        )
                    })?;
                if !tools.iter().any(|t| t.name == name) {
                    return Err(ApiError::invalid_param(
                        param,
                        format!("`{name}` is not one of the request's tools"),
                    ));
                }
                Choice::Named(name.to_string())
            }
            Some(other) => {
                return Err(ApiError::invalid_param(
                    param,
                    format!("{other} is not a tool choice; use none, auto, required or a function"),
                ));
            }
        };
        if tools.is_empty() {
            return Err(ApiError::invalid_param(param, "tool_choice needs `tools`"));
        }
        Ok(choice)
    }
}

/// Whether and which tools the model may (or must) call.
#[derive(Debug, Clone, PartialEq)]
enum Choice {
    None,
    Auto,
    Required,
    Named(String),
}

/// A message for the template. `own_syntax` is set when the template knows no tools: an
/// assistant's calls are then written into its content and a tool's result wrapped, as the
/// server's own prompt describes.
pub(super) fn message_of(
    index: usize,
    message: &Message,
    own_syntax: Option<ToolFormat>,
) -> Result<ChatMessage, ApiError> {
    let mut out = ChatMessage::new(&message.role, &text_of(index, message)?);
    let calls = message.tool_calls.as_deref().unwrap_or_default();
    if !calls.is_empty() && message.role != "assistant" {
        return Err(ApiError::invalid_param(
            &format!("messages[{index}].tool_calls"),
            "only assistant messages carry tool calls",
        ));
    }
    let mut parsed = Vec::with_capacity(calls.len());
    for (c, call) in calls.iter().enumerate() {
        let arguments = match &call.function.arguments {
            Value::String(text) => serde_json::from_str(text).map_err(|e| {
                ApiError::invalid_param(
                    &format!("messages[{index}].tool_calls[{c}].function.arguments"),
                    format!("arguments are a JSON object as a string: {e}"),
                )
            })?,
            other => other.clone(),
        };
        parsed.push(ToolCall {
            name: call.function.name.clone(),
            arguments,
        });
    }
    match own_syntax {
        Some(format) => {
            if !parsed.is_empty() {
                let written = format.write_calls(&parsed);
                out.content = if out.content.is_empty() {
                    written
                } else {
                    format!("{}\n{written}", out.content)
                };
            }
            if message.role == "tool" {
                out.content = format!("<tool_response>\n{}\n</tool_response>", out.content);
            }
        }
        None => {
            if !parsed.is_empty() {
                out.tool_calls = Some(
                    calls
                        .iter()
                        .zip(&parsed)
                        .map(|(call, p)| {
                            json!({
                                "id": call.id,
                                "type": "function",
                                "function": {"name": p.name, "arguments": p.arguments},
                            })
                        })
                        .collect(),
                );
            }
            out.tool_call_id = message.tool_call_id.clone();
            out.name = message.name.clone();
        }
    }
    Ok(out)
}

pub(super) fn encode(model: &Model, text: &str) -> Result<Vec<u32>, ApiError> {
    model
        .tokenizer
        .encode_prompt(text)
        .map_err(|e| ApiError::invalid_param("prompt", e.to_string()))
}

/// The roles a message may have (OpenAI's, `developer` being its newer name for `system`).
const ROLES: [&str; 5] = ["system", "developer", "user", "assistant", "tool"];

fn text_of(index: usize, message: &Message) -> Result<String, ApiError> {
    if !ROLES.contains(&message.role.as_str()) {
        return Err(ApiError::invalid_param(
            &format!("messages[{index}].role"),
            format!(
                "`{}` is not a role; a message is one of {}",
                message.role,
                ROLES.join(", ")
            ),
        ));
    }
    match &message.content {
        // Only an assistant's message may come without content (OpenAI: when it called tools).
        None if message.role == "assistant" => Ok(String::new()),
        None => Err(ApiError::invalid_param(
            &format!("messages[{index}].content"),
            format!("a `{}` message needs content", message.role),
        )),
        Some(Content::Text(text)) => Ok(text.clone()),
        Some(Content::Parts(parts)) => {
            let mut text = String::new();
            for (p, part) in parts.iter().enumerate() {
                let param = format!("messages[{index}].content[{p}]");
                match (part.kind.as_str(), &part.text) {
                    ("text", Some(t)) => text.push_str(t),
                    ("text", None) => {
                        return Err(ApiError::invalid_param(
                            &format!("{param}.text"),
                            "a text part needs its `text`",
                        ));
                    }
                    (kind, _) => {
                        return Err(ApiError::invalid_param(
                            &format!("{param}.type"),
                            format!("`{kind}` parts are not supported; only text parts are"),
                        ));
                    }
                }
            }
            Ok(text)
        }
    }
}
