//! Grammars the output must follow (structured outputs, forced tool calls), through llguidance.
//!
//! [`Grammars`] is built once per model: the bytes of every token (from `tokenizer.json`, by
//! llguidance's own reading of byte-level and byte-fallback vocabularies) in a token trie, and a
//! parser factory over it. [`Grammars::constraint`] compiles one request's [`GrammarSpec`] into
//! a [`TokenConstraint`] its sampler masks the logits with; compiling is where a bad schema or
//! regex is refused, before the request is queued.
//!
//! The mask of the next token is computed by [`TokenConstraint::prepare`], which a GPU backend
//! calls while the device computes the step's logits, so the CPU's work overlaps the GPU's.
//! When the grammar is complete, only the model's end-of-sequence tokens are allowed, so the
//! request ends the way an unconstrained one does.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{Value, json};

use crate::error::{EngineError, Result};
use crate::sampling::{ConstraintSource, TokenConstraint};
use crate::tokenizer::Tokenizer;

/// What one request's output must match.
#[derive(Debug, Clone, PartialEq)]
pub enum GrammarSpec {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against this schema. Not `strict`: keywords the engine does not know are
    /// ignored rather than refused.
    JsonSchema { schema: Value, strict: bool },
    /// Text matching a regular expression (Rust `regex` syntax), whole.
    Regex(String),
    /// A context-free grammar in llguidance's Lark dialect.
    Lark(String),
}

/// The token trie and parser factory of one model's vocabulary.
pub struct Grammars {
    factory: ParserFactory,
    /// The bytes of each token id, special tokens without llguidance's marker byte.
    token_bytes: Vec<Vec<u8>>,
}

impl std::fmt::Debug for Grammars {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammars")
            .field("tokens", &self.token_bytes.len())
            .finish()
    }
}

/// llguidance's view of the tokenizer: the trie for masks, our tokenizer for the text it
/// forces.
struct Env {
    trie: TokTrie,
    tokenizer: tokenizers::Tokenizer,
}

impl TokenizerEnv for Env {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, bytes: &[u8]) -> Vec<TokenId> {
        self.trie.tokenize_with_greedy_fallback(bytes, |text| {
            // An encoding that fails leaves the trie's greedy split, which is still valid.
            self.tokenizer
                .encode_fast(text, false)
                .map(|e| e.get_ids().to_vec())
                .unwrap_or_default()
        })
    }
}

impl Grammars {
    /// The grammars of a model whose rows have `vocab_size` logits and whose generation ends
    /// at `eos_token_ids`.
    pub fn new(tokenizer: &Tokenizer, vocab_size: usize, eos_token_ids: &[u32]) -> Result<Self> {
        let failed = |reason: String| EngineError::Tokenizer {
            path: tokenizer.path().to_path_buf(),
            reason: format!("building the grammar engine's vocabulary: {reason}"),
        };
        let text = std::fs::read_to_string(tokenizer.path())
            .map_err(|e| EngineError::io(tokenizer.path(), e))?;
        let json: Value = serde_json::from_str(&text).map_err(|e| failed(e.to_string()))?;
        let mut words = llguidance::token_bytes_from_tokenizer_json(&json)
            .map_err(|e| failed(e.to_string()))?;
        if words.len() > vocab_size {
            return Err(failed(format!(
                "the tokenizer has {} tokens, the model's rows {vocab_size}",
                words.len()
            )));
        }
        // Ids with a logit but no token (padding of the embedding) are specials never written.
        while words.len() < vocab_size {
            let mut name = format!(".<[{}]>", words.len()).into_bytes();
            name[0] = TokTrie::SPECIAL_TOKEN_MARKER;
            words.push(name);
        }
        let Some(&eos) = eos_token_ids.first() else {
            return Err(failed("the model names no end-of-sequence token".into()));
        };
        let info = TokRxInfo::new(vocab_size as u32, eos);
        let trie = TokTrie::from(&info, &words).with_eos_tokens(eos_token_ids);
        let env: TokEnv = Arc::new(Env {
            trie,
            tokenizer: tokenizer.inner().clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| failed(e.to_string()))?;
        factory.quiet();
        let token_bytes = words
            .into_iter()
            .map(|mut w| {
                if w.first() == Some(&TokTrie::SPECIAL_TOKEN_MARKER) {
                    w.remove(0);
                }
                w
            })
            .collect();
        Ok(Grammars {
            factory,
            token_bytes,
        })
    }

    /// The bytes token `id` stands for (a special token's name), empty past the vocabulary.
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        self.token_bytes.get(id as usize).map_or(&[], Vec::as_slice)
    }

    /// Compiles `spec` for one request; the error says what is wrong with it.
    pub fn constraint(&self, spec: &GrammarSpec) -> std::result::Result<Grammar, String> {
        let grammar = match spec {
            GrammarSpec::JsonObject => {
                TopLevelGrammar::from_json_schema(compact(json!({"type": "object"}), false))
            }
            GrammarSpec::JsonSchema { schema, strict } => {
                if !schema.is_object() && !schema.is_boolean() {
                    return Err("a JSON schema is an object".into());
                }
                TopLevelGrammar::from_json_schema(compact(schema.clone(), !strict))
            }
            GrammarSpec::Regex(regex) => TopLevelGrammar::from_regex(regex),
            GrammarSpec::Lark(lark) => TopLevelGrammar::from_lark(lark.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| e.to_string())?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher_error(&matcher) {
            return Err(e);
        }
        Ok(Grammar {
            matcher,
            mask: None,
            eos: self.factory.tok_env().tok_trie().eos_token_set(),
        })
    }
}

fn matcher_error(matcher: &Matcher) -> Option<String> {
    matcher.is_error().then(|| {
        matcher
            .get_error()
            .unwrap_or_else(|| "the grammar failed".into())
    })
}

/// JSON laid out as `json.dumps` does (`", "` and `": "`, no other whitespace), which keeps a
/// small model from padding its output with blank lines; a schema's own `x-guidance` wins.
fn compact(mut schema: Value, lenient: bool) -> Value {
    if let Value::Object(map) = &mut schema
        && !map.contains_key("x-guidance")
    {
        let mut layout = json_layout();
        layout["lenient"] = json!(lenient);
        map.insert("x-guidance".into(), layout);
    }
    schema
}

/// llguidance's `x-guidance` options for JSON laid out as `json.dumps` does.
pub fn json_layout() -> Value {
    json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "})
}

/// One request's grammar, as its sampler's [`TokenConstraint`].
pub struct Grammar {
    matcher: Matcher,
    /// The allowed set of the next token, once computed.
    mask: Option<SimpleVob>,
    /// The model's end-of-sequence tokens, allowed once the grammar is complete.
    eos: SimpleVob,
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Grammar")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl Grammar {
    /// Whether the output so far is a complete match.
    pub fn is_complete(&mut self) -> bool {
        self.matcher.is_stopped() || self.matcher.is_accepting().unwrap_or(false)
    }

    /// A source from which every sampler starts this grammar afresh.
    pub fn into_source(self) -> ConstraintSource {
        let prototype = std::sync::Mutex::new(self);
        ConstraintSource::new(move || {
            let grammar = prototype.lock().unwrap_or_else(|e| e.into_inner());
            Box::new(Grammar {
                matcher: grammar.matcher.deep_clone(),
                mask: None,
                eos: grammar.eos.clone(),
            })
        })
    }
}

impl TokenConstraint for Grammar {
    fn prepare(&mut self) -> std::result::Result<(), String> {
        if self.mask.is_none() {
            let mask = self
                .matcher
                .compute_mask_or_eos()
                .map_err(|e| e.to_string())?;
            self.mask = Some(mask);
        }
        Ok(())
    }

    fn mask(&mut self, logits: &mut [f32]) -> std::result::Result<(), String> {
        self.prepare()?;
        let mask = self.mask.as_ref().expect("prepared above");
        let words = mask.as_slice();
        for (chunk, &word) in logits.chunks_mut(32).zip(words) {
            if word == u32::MAX {
                continue;
            }
            for (bit, logit) in chunk.iter_mut().enumerate() {
                if word & (1 << bit) == 0 {
                    *logit = f32::NEG_INFINITY;
                }
            }
        }
        // Logits past the mask's words belong to no token it knows.
        let covered = (words.len() * 32).min(logits.len());
        logits[covered..].fill(f32::NEG_INFINITY);
        Ok(())
    }

    fn mask_words(&mut self) -> std::result::Result<Option<&[u32]>, String> {
        self.prepare()?;
        Ok(self.mask.as_ref().map(SimpleVob::as_slice))
    }

    fn has_mask_words(&self) -> bool {
        true
    }

    fn commit(&mut self, token: u32) -> std::result::Result<(), String> {
        self.mask = None;
        // The end-of-sequence token that ends a complete match is not part of it.
        if self.eos.is_allowed(token) && self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| e.to_string())
    }
}
