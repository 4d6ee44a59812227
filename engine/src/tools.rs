//! Tool calls in the model's own syntax: telling the model its tools, reading its calls back,
//! and the grammar that forces a call (`tool_choice` `"required"` or a named function).
//!
//! Three syntaxes, chosen from the chat template ([`ToolFormat::of_template`]):
//! - [`ToolFormat::Hermes`] (Qwen2.5, Hermes, and snapserve's own prompt for templates that know
//!   no tools): `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`, once per call.
//! - [`ToolFormat::Llama3Json`] (Llama 3.1/3.2): the reply is one JSON object
//!   `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`, calls split by `;`.
//! - [`ToolFormat::Mistral`]: `[TOOL_CALLS]` then a JSON list of `{"name", "arguments"}`.
//!
//! Parsing is lenient where models are (whitespace, a missing closing tag at the end of the
//! reply) and strict where a client would be hurt: a call whose JSON does not parse, or that
//! names no function, leaves the reply as plain content.

use serde_json::{Value, json};

use crate::grammar::json_layout;

/// A function the model may call, as the API's `tools` list describes it.
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// JSON schema of its arguments (an empty object schema when not given).
    pub parameters: Value,
}

/// One call the model made.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    pub arguments: Value,
}

/// A reply read for tool calls: the text before them and the calls, in order.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedReply {
    pub content: String,
    pub calls: Vec<ToolCall>,
}

/// The model's tool-call syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    Hermes,
    Llama3Json,
    Mistral,
}

const HERMES_OPEN: &str = "<tool_call>";
const HERMES_CLOSE: &str = "</tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";
const MISTRAL_CALLS: &str = "[TOOL_CALLS]";
/// What separates a call's name from its arguments in Mistral's newer syntax.
const MISTRAL_ARGS: &str = "[ARGS]";

/// Whether a streamed reply has reached a tool call yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallStart {
    /// Text up to this byte offset is content; a call starts there.
    At(usize),
    /// No call started, but text from this offset may be the start of one: hold it back.
    Maybe(usize),
    /// All of the text is content.
    No,
}

impl ToolFormat {
    /// The syntax a chat template uses, if it renders tools at all (`None`: the template knows
    /// no tools; snapserve then describes them in a system message in [`ToolFormat::Hermes`]).
    pub fn of_template(source: &str) -> Option<ToolFormat> {
        if !source.contains("tools") {
            return None;
        }
        if source.contains(MISTRAL_CALLS) {
            Some(ToolFormat::Mistral)
        } else if source.contains(HERMES_OPEN) {
            Some(ToolFormat::Hermes)
        } else if source.contains(PYTHON_TAG) || source.contains("ipython") {
            Some(ToolFormat::Llama3Json)
        } else {
            // A template that takes tools in a syntax we do not know: our own prompt's.
            None
        }
    }

    /// Where a call starts in the reply so far.
    pub fn call_start(self, text: &str) -> CallStart {
        let markers: &[&str] = match self {
            ToolFormat::Hermes => &[HERMES_OPEN],
            ToolFormat::Mistral => &[MISTRAL_CALLS],
            ToolFormat::Llama3Json => {
                let trimmed = text.trim_start();
                let at = text.len() - trimmed.len();
                if trimmed.is_empty() {
                    return CallStart::Maybe(at);
                }
                if trimmed.starts_with('{') || trimmed.starts_with(PYTHON_TAG) {
                    return CallStart::At(at);
                }
                if PYTHON_TAG.starts_with(trimmed) {
                    return CallStart::Maybe(at);
                }
                return CallStart::No;
            }
        };
        let mut maybe = None;
        for marker in markers {
            if let Some(at) = text.find(marker) {
                return CallStart::At(at);
            }
            // The longest tail of the text that begins the marker.
            for (at, _) in text.char_indices().rev().take(marker.len()) {
                if marker.starts_with(&text[at..]) {
                    maybe = Some(maybe.map_or(at, |m: usize| m.min(at)));
                }
            }
        }
        maybe.map_or(CallStart::No, CallStart::Maybe)
    }

    /// Reads the calls in a whole reply; `None` when it makes none (or none that parses).
    pub fn parse(self, text: &str) -> Option<ParsedReply> {
        let CallStart::At(at) = self.call_start(text) else {
            return None;
        };
        let content = text[..at].trim().to_string();
        let rest = &text[at..];
        let calls = match self {
            ToolFormat::Hermes => hermes_calls(rest)?,
            ToolFormat::Mistral => {
                let list = rest[MISTRAL_CALLS.len()..].trim();
                match serde_json::from_str(list) {
                    Ok(Value::Array(items)) => items.iter().map(call_of).collect::<Option<_>>()?,
                    Ok(object) => vec![call_of(&object)?],
                    // Tokenizer v11 and later: `[TOOL_CALLS]name[ARGS]{...}`, once per call.
                    Err(_) => mistral_named_calls(rest)?,
                }
            }
            ToolFormat::Llama3Json => {
                let body = rest.trim_start();
                let body = body.strip_prefix(PYTHON_TAG).unwrap_or(body);
                json_values(body)?
                    .iter()
                    .map(call_of)
                    .collect::<Option<_>>()?
            }
        };
        (!calls.is_empty()).then_some(ParsedReply { content, calls })
    }

    /// The calls as the model would have written them (an assistant's past calls, for a
    /// template that knows no tools).
    pub fn write_calls(self, calls: &[ToolCall]) -> String {
        match self {
            ToolFormat::Hermes => calls
                .iter()
                .map(|c| {
                    let call = json!({"name": c.name, "arguments": c.arguments});
                    format!("{HERMES_OPEN}\n{call}\n{HERMES_CLOSE}")
                })
                .collect::<Vec<_>>()
                .join("\n"),
            ToolFormat::Mistral => {
                let list: Vec<Value> = calls
                    .iter()
                    .map(|c| json!({"name": c.name, "arguments": c.arguments}))
                    .collect();
                format!("{MISTRAL_CALLS}{}", Value::Array(list))
            }
            ToolFormat::Llama3Json => calls
                .iter()
                .map(|c| json!({"name": c.name, "parameters": c.arguments}).to_string())
                .collect::<Vec<_>>()
                .join("; "),
        }
    }

    /// A Lark grammar (llguidance's dialect) for a reply that is exactly one call of one of
    /// `tools` (of `only`, when named) in this syntax. `mistral_calls_token` is the id of
    /// Mistral's `[TOOL_CALLS]` special token.
    pub fn forced_call_grammar(
        self,
        tools: &[Tool],
        only: Option<&str>,
        mistral_calls_token: Option<u32>,
    ) -> Result<String, String> {
        let arguments_key = match self {
            ToolFormat::Llama3Json => "parameters",
            _ => "arguments",
        };
        let choices: Vec<Value> = tools
            .iter()
            .filter(|t| only.is_none_or(|name| t.name == name))
            .map(|t| {
                json!({
                    "type": "object",
                    "properties": {
                        "name": {"const": t.name},
                        arguments_key: t.parameters,
                    },
                    "required": ["name", arguments_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        if choices.is_empty() {
            return Err("no tool to call".into());
        }
        let call = json!({
            "anyOf": choices,
            "x-guidance": json_layout(),
        });
        Ok(match self {
            ToolFormat::Hermes => {
                format!(
                    "start: \"{HERMES_OPEN}\\n\" call \"\\n{HERMES_CLOSE}\"\ncall: %json {call}\n"
                )
            }
            ToolFormat::Llama3Json => format!("start: call\ncall: %json {call}\n"),
            ToolFormat::Mistral => {
                let token = mistral_calls_token
                    .ok_or("the tokenizer has no [TOOL_CALLS] token".to_string())?;
                let list = json!({
                    "type": "array", "items": call, "minItems": 1, "maxItems": 1,
                    "x-guidance": json_layout(),
                });
                format!("start: <[{token}]> calls\ncalls: %json {list}\n")
            }
        })
    }
}

/// The system prompt that tells a model whose template knows no tools what it may call, and
/// how ([`ToolFormat::Hermes`], the syntax Qwen2.5 and Hermes are trained on).
pub fn tools_system_prompt(tools: &[Tool]) -> String {
    let mut prompt = String::from(
        "You may call one or more functions to answer. The functions are listed in \
         <tools></tools> as JSON schemas:\n<tools>\n",
    );
    for tool in tools {
        let mut function = json!({"name": tool.name, "parameters": tool.parameters});
        if let Some(description) = &tool.description {
            function["description"] = json!(description);
        }
        prompt += &json!({"type": "function", "function": function}).to_string();
        prompt.push('\n');
    }
    prompt += "</tools>\nTo call a function, reply with a JSON object holding its name and \
               arguments inside <tool_call></tool_call> tags, one per call:\n<tool_call>\n\
               {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>";
    prompt
}

fn hermes_calls(text: &str) -> Option<Vec<ToolCall>> {
    let mut calls = Vec::new();
    let mut rest = text;
    while let Some(open) = rest.find(HERMES_OPEN) {
        let body = &rest[open + HERMES_OPEN.len()..];
        // A reply cut at the end may lack its closing tag.
        let (inside, after) = match body.find(HERMES_CLOSE) {
            Some(close) => (&body[..close], &body[close + HERMES_CLOSE.len()..]),
            None => (body, ""),
        };
        let value: Value = serde_json::from_str(inside.trim()).ok()?;
        calls.push(call_of(&value)?);
        rest = after;
    }
    Some(calls)
}

/// One or more JSON values separated by `;` or whitespace.
fn json_values(text: &str) -> Option<Vec<Value>> {
    let mut values = Vec::new();
    let mut stream = serde_json::Deserializer::from_str(text).into_iter::<Value>();
    loop {
        match stream.next() {
            None => break,
            Some(Ok(value)) => values.push(value),
            Some(Err(_)) => {
                // Skip a separating `;` and carry on from after it.
                let at = stream.byte_offset();
                let rest = text[at..].trim_start();
                let rest = rest.strip_prefix(';')?;
                let mut more = json_values(rest)?;
                values.append(&mut more);
                break;
            }
        }
    }
    (!values.is_empty()).then_some(values)
}

/// `{"name": ..., "arguments"|"parameters": {...}}`; arguments sent as a JSON string are read.
/// Calls written `[TOOL_CALLS]name[ARGS]{...}`, one after another (Mistral's newer syntax).
fn mistral_named_calls(text: &str) -> Option<Vec<ToolCall>> {
    text.split(MISTRAL_CALLS)
        .map(str::trim)
        .filter(|call| !call.is_empty())
        .map(|call| {
            let (name, arguments) = call.split_once(MISTRAL_ARGS)?;
            let name = name.trim();
            let valid = !name.is_empty()
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            let arguments = serde_json::from_str(arguments.trim()).ok()?;
            valid.then(|| ToolCall {
                name: name.to_string(),
                arguments,
            })
        })
        .collect()
}

fn call_of(value: &Value) -> Option<ToolCall> {
    let name = value.get("name")?.as_str()?.to_string();
    let arguments = value
        .get("arguments")
        .or_else(|| value.get("parameters"))
        .cloned()
        .unwrap_or_else(|| json!({}));
    let arguments = match arguments {
        Value::String(text) => serde_json::from_str(&text).unwrap_or(Value::String(text)),
        other => other,
    };
    Some(ToolCall { name, arguments })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            name: name.into(),
            arguments,
        }
    }

    #[test]
    fn hermes_calls_are_read_with_the_content_before_them() {
        let text = "Let me check.\n<tool_call>\n{\"name\": \"weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"time\", \"arguments\": {}}\n</tool_call>";
        let parsed = ToolFormat::Hermes.parse(text).unwrap();
        assert_eq!(parsed.content, "Let me check.");
        assert_eq!(
            parsed.calls,
            vec![
                call("weather", json!({"city": "Paris"})),
                call("time", json!({}))
            ]
        );
        // Cut before its closing tag, a complete call still counts.
        let cut = "<tool_call>\n{\"name\": \"time\", \"arguments\": {}}";
        assert_eq!(ToolFormat::Hermes.parse(cut).unwrap().calls.len(), 1);
        // Broken JSON or no name: plain content.
        assert!(
            ToolFormat::Hermes
                .parse("<tool_call>{\"name\": </tool_call>")
                .is_none()
        );
        assert!(
            ToolFormat::Hermes
                .parse("<tool_call>{\"x\": 1}</tool_call>")
                .is_none()
        );
        assert!(ToolFormat::Hermes.parse("just text").is_none());
    }

    #[test]
    fn llama3_json_calls_with_and_without_the_python_tag() {
        let text = "{\"name\": \"weather\", \"parameters\": {\"city\": \"Oslo\"}}";
        let parsed = ToolFormat::Llama3Json.parse(text).unwrap();
        assert_eq!(parsed.calls, vec![call("weather", json!({"city": "Oslo"}))]);
        assert_eq!(parsed.content, "");
        let two = "<|python_tag|>{\"name\": \"a\", \"parameters\": {}}; {\"name\": \"b\", \"parameters\": {\"x\": 1}}";
        let parsed = ToolFormat::Llama3Json.parse(two).unwrap();
        assert_eq!(
            parsed.calls,
            vec![call("a", json!({})), call("b", json!({"x": 1}))]
        );
        assert!(
            ToolFormat::Llama3Json
                .parse("The weather is fine.")
                .is_none()
        );
    }

    #[test]
    fn mistral_calls_are_a_list_after_the_marker() {
        let text = "[TOOL_CALLS][{\"name\": \"weather\", \"arguments\": {\"city\": \"Rome\"}}, {\"name\": \"time\", \"arguments\": \"{\\\"tz\\\": \\\"CET\\\"}\"}]";
        let parsed = ToolFormat::Mistral.parse(text).unwrap();
        assert_eq!(
            parsed.calls,
            vec![
                call("weather", json!({"city": "Rome"})),
                call("time", json!({"tz": "CET"}))
            ]
        );
    }

    #[test]
    fn mistral_calls_in_the_newer_name_args_syntax() {
        let text =
            "Let me look.[TOOL_CALLS]weather[ARGS]{\"city\": \"Rome\"}[TOOL_CALLS]time[ARGS]{}";
        let parsed = ToolFormat::Mistral.parse(text).unwrap();
        assert_eq!(parsed.content, "Let me look.");
        assert_eq!(
            parsed.calls,
            vec![
                call("weather", json!({"city": "Rome"})),
                call("time", json!({}))
            ]
        );
        assert!(
            ToolFormat::Mistral
                .parse("[TOOL_CALLS]weather[ARGS]{not json")
                .is_none()
        );
        assert!(
            ToolFormat::Mistral
                .parse("[TOOL_CALLS]bad name[ARGS]{}")
                .is_none()
        );
    }

    #[test]
    fn streaming_holds_back_what_may_begin_a_call() {
        let f = ToolFormat::Hermes;
        assert_eq!(f.call_start("Hello"), CallStart::No);
        assert_eq!(f.call_start("Hello <tool"), CallStart::Maybe(6));
        assert_eq!(f.call_start("Hello <"), CallStart::Maybe(6));
        assert_eq!(f.call_start("Hello <tool_call>{"), CallStart::At(6));
        assert_eq!(f.call_start("a < b"), CallStart::No);
        let l = ToolFormat::Llama3Json;
        assert_eq!(l.call_start("  "), CallStart::Maybe(2));
        assert_eq!(l.call_start(" {\"na"), CallStart::At(1));
        assert_eq!(l.call_start("Sure"), CallStart::No);
    }

    #[test]
    fn formats_are_told_from_their_templates() {
        let qwen = "{% if tools %}<tools>{% for tool in tools %}{{ tool | tojson }}{% endfor %}</tools> <tool_call>{% endif %}";
        assert_eq!(ToolFormat::of_template(qwen), Some(ToolFormat::Hermes));
        let llama = "{% if tools is not none %}<|python_tag|>{{ tools }}{% endif %}ipython";
        assert_eq!(ToolFormat::of_template(llama), Some(ToolFormat::Llama3Json));
        let mistral =
            "{% if tools %}[AVAILABLE_TOOLS]{{ tools }}[/AVAILABLE_TOOLS]{% endif %}[TOOL_CALLS]";
        assert_eq!(ToolFormat::of_template(mistral), Some(ToolFormat::Mistral));
        assert_eq!(ToolFormat::of_template("{{ messages }}"), None);
    }

    #[test]
    fn written_calls_parse_back() {
        let calls = vec![call("a", json!({"x": [1, 2]})), call("b", json!({}))];
        for format in [
            ToolFormat::Hermes,
            ToolFormat::Llama3Json,
            ToolFormat::Mistral,
        ] {
            let text = format.write_calls(&calls);
            assert_eq!(format.parse(&text).unwrap().calls, calls, "{format:?}");
        }
    }
}
