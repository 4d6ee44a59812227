//! Chat templates: the model's Jinja template rendered with minijinja.
//!
//! The template comes from `chat_template.jinja`, else from `tokenizer_config.json`'s
//! `chat_template` (a string, or a list of named templates of which `default` is used).
//! Python string methods used by common templates (`.strip()`, `.startswith()`) come from
//! minijinja-contrib's pycompat layer; `raise_exception` turns a template's own refusal into an
//! error.

use std::path::Path;

use minijinja::{Environment, ErrorKind, context};
use serde::{Deserialize, Serialize};

use crate::error::{EngineError, Result};

/// One message of a conversation. The tool fields are left out of the template's view when
/// unset, so `message.tool_calls is defined` reads as templates expect.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    /// An assistant's calls, as transformers passes them: `{"type": "function", "function":
    /// {"name", "arguments"}}` with the arguments as an object.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<Vec<serde_json::Value>>,
    /// The call a `tool` message answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

/// A compiled chat template with the special tokens it may refer to.
pub struct ChatTemplate {
    env: Environment<'static>,
    /// The tool-call syntax the template renders, if it renders tools.
    tool_format: Option<crate::tools::ToolFormat>,
    bos_token: String,
    eos_token: String,
}

impl ChatTemplate {
    /// Loads the template of the model folder `dir`, or `None` if it has none.
    pub fn from_dir(dir: &Path) -> Result<Option<Self>> {
        let config = read_tokenizer_config(dir)?;
        let source = match std::fs::read_to_string(dir.join("chat_template.jinja")) {
            Ok(source) => Some(source),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => template_from_config(&config),
            Err(e) => return Err(EngineError::io(dir.join("chat_template.jinja"), e)),
        };
        let token = |key: &str| special_token(&config, key).unwrap_or_default();
        source
            .map(|s| Self::new(&s, token("bos_token"), token("eos_token")))
            .transpose()
    }

    pub fn new(source: &str, bos_token: String, eos_token: String) -> Result<Self> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function(
            "raise_exception",
            |message: String| -> Result<String, minijinja::Error> {
                Err(minijinja::Error::new(ErrorKind::InvalidOperation, message))
            },
        );
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| EngineError::ChatTemplate(describe(&e)))?;
        Ok(Self {
            env,
            tool_format: crate::tools::ToolFormat::of_template(source),
            bos_token,
            eos_token,
        })
    }

    /// Renders `messages`; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, None, add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the `tools` variable set, as transformers sets it: the
    /// API's tool objects (`{"type": "function", "function": {...}}`).
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: Option<&[serde_json::Value]>,
        add_generation_prompt: bool,
    ) -> Result<String> {
        let template = self.env.get_template("chat").expect("added in new");
        let base = context! {
            messages => minijinja::value::Serde(messages),
            add_generation_prompt => add_generation_prompt,
            bos_token => &self.bos_token,
            eos_token => &self.eos_token,
        };
        let ctx = match tools {
            Some(tools) => context! { tools => minijinja::value::Serde(tools), ..base },
            None => base,
        };
        template
            .render(ctx)
            .map_err(|e| EngineError::ChatTemplate(describe(&e)))
    }

    /// The tool-call syntax this template renders tools in; `None` when it renders none (the
    /// server then describes tools in a system message of its own).
    pub fn tool_format(&self) -> Option<crate::tools::ToolFormat> {
        self.tool_format
    }
}

fn describe(e: &minijinja::Error) -> String {
    match e.detail() {
        Some(detail) => format!("{}: {detail}", e.kind()),
        None => e.to_string(),
    }
}

fn read_tokenizer_config(dir: &Path) -> Result<serde_json::Value> {
    let path = dir.join("tokenizer_config.json");
    match std::fs::read_to_string(&path) {
        Ok(text) => {
            serde_json::from_str(&text).map_err(|source| EngineError::Json { path, source })
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(serde_json::Value::Null),
        Err(e) => Err(EngineError::io(path, e)),
    }
}

fn template_from_config(config: &serde_json::Value) -> Option<String> {
    match &config["chat_template"] {
        serde_json::Value::String(s) => Some(s.clone()),
        serde_json::Value::Array(named) => named
            .iter()
            .find(|t| t["name"] == "default")
            .and_then(|t| t["template"].as_str())
            .map(str::to_string),
        _ => None,
    }
}

/// A special token as `tokenizer_config.json` writes it: a string or `{"content": ...}`.
pub(crate) fn special_token(config: &serde_json::Value, key: &str) -> Option<String> {
    let value = &config[key];
    value
        .as_str()
        .or_else(|| value["content"].as_str())
        .map(str::to_string)
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'].strip() + '<|im_end|>\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

    #[test]
    fn renders_chatml_with_generation_prompt() {
        let t = ChatTemplate::new(CHATML, String::new(), String::new()).unwrap();
        let text = t.render(&[ChatMessage::new("user", " hi ")], true).unwrap();
        assert_eq!(
            text,
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn raise_exception_becomes_an_error() {
        let t = ChatTemplate::new(
            "{{ raise_exception('roles must alternate') }}",
            String::new(),
            String::new(),
        )
        .unwrap();
        let err = t.render(&[], false).unwrap_err();
        assert!(err.to_string().contains("roles must alternate"), "{err}");
    }

    #[test]
    fn bad_template_is_an_error() {
        assert!(ChatTemplate::new("{% for %}", String::new(), String::new()).is_err());
    }

    #[test]
    fn tools_and_tool_calls_reach_the_template_as_transformers_passes_them() {
        let source = "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}\
            {% for m in messages %}[{{ m.role }}]{% if m.tool_calls is defined %}{% for c in m.tool_calls %}<tool_call>{{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}{% endif %}{% if m.tool_call_id is defined %}#{{ m.tool_call_id }}{% endif %}{{ m.content }}{% endfor %}";
        let template = ChatTemplate::new(source, String::new(), String::new()).unwrap();
        assert_eq!(
            template.tool_format(),
            Some(crate::tools::ToolFormat::Hermes)
        );
        let mut call = ChatMessage::new("assistant", "");
        call.tool_calls = Some(vec![serde_json::json!({
            "type": "function", "function": {"name": "weather", "arguments": {"city": "Oslo"}}
        })]);
        let mut result = ChatMessage::new("tool", "sunny");
        result.tool_call_id = Some("c1".into());
        let messages = [ChatMessage::new("user", "hi"), call, result];
        let tools = [serde_json::json!({"type": "function", "function": {"name": "weather"}})];
        let text = template
            .render_with_tools(&messages, Some(&tools), false)
            .unwrap();
        assert_eq!(
            text,
            "<tools>weather;</tools>[user]hi[assistant]<tool_call>weather(Oslo)[tool]#c1sunny"
        );
        // Without tools the variable is undefined and plain messages show no tool fields.
        let text = template.render(&messages[..1], false).unwrap();
        assert_eq!(text, "[user]hi");
    }
}
