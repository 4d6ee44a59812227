//! The tokenizer (`tokenizer.json`, through the `tokenizers` crate) and incremental decoding.
//!
//! Encoding follows Hugging Face's conventions: a raw prompt is encoded with the tokenizer's
//! own special tokens (a BOS where the post-processor adds one), a rendered chat template
//! without (the template already wrote them). Added tokens written in the text are recognized.

use std::path::{Path, PathBuf};

use crate::error::{EngineError, Result};

/// A loaded tokenizer.
pub struct Tokenizer {
    inner: tokenizers::Tokenizer,
    path: PathBuf,
}

impl Tokenizer {
    /// Loads `dir/tokenizer.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("tokenizer.json");
        if !path.exists() {
            return Err(EngineError::ModelFolder {
                path: dir.to_path_buf(),
                reason: "tokenizer.json is missing".into(),
            });
        }
        let inner =
            tokenizers::Tokenizer::from_file(&path).map_err(|e| EngineError::Tokenizer {
                path: path.clone(),
                reason: e.to_string(),
            })?;
        Ok(Self { inner, path })
    }

    fn error(&self, e: impl ToString) -> EngineError {
        EngineError::Tokenizer {
            path: self.path.clone(),
            reason: e.to_string(),
        }
    }

    /// Encodes a raw prompt, adding the special tokens the tokenizer's post-processor adds.
    pub fn encode_prompt(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(text, true)
    }

    /// Encodes text that already carries its special tokens (a rendered chat template).
    pub fn encode_rendered(&self, text: &str) -> Result<Vec<u32>> {
        self.encode(text, false)
    }

    fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode_fast(text, add_special_tokens)
            .map_err(|e| self.error(e))?;
        Ok(encoding.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String> {
        self.inner
            .decode(ids, skip_special_tokens)
            .map_err(|e| self.error(e))
    }

    /// The number of ids the tokenizer can produce, added tokens included.
    pub fn vocab_size(&self) -> usize {
        self.inner.get_vocab_size(true)
    }

    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The `tokenizer.json` it was loaded from.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The `tokenizers` tokenizer itself, for libraries that take one.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

/// Turns generated ids into text as they arrive, never emitting half of a UTF-8 character.
///
/// Byte-level BPE tokens can split a character; a token's text is only final once decoding a
/// window of recent ids no longer ends in a replacement character. The window restarts at the
/// last emitted boundary, so each step decodes a handful of ids, not the whole output.
#[derive(Debug, Default, Clone)]
pub struct TextStream {
    ids: Vec<u32>,
    prefix: usize,
    read: usize,
    skip_special_tokens: bool,
}

impl TextStream {
    pub fn new(skip_special_tokens: bool) -> Self {
        Self {
            skip_special_tokens,
            ..Self::default()
        }
    }

    /// Adds one id; returns the text that became final (often empty mid-character).
    pub fn push(&mut self, tokenizer: &Tokenizer, id: u32) -> Result<String> {
        self.ids.push(id);
        let before =
            tokenizer.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        if now.len() <= before.len() || now.ends_with('\u{FFFD}') {
            return Ok(String::new());
        }
        let Some(new_text) = now.get(before.len()..).filter(|_| now.starts_with(&before)) else {
            return Ok(String::new());
        };
        let new_text = new_text.to_string();
        self.prefix = self.read;
        self.read = self.ids.len();
        Ok(new_text)
    }

    /// Text still held back at the end of generation (an incomplete character, as U+FFFD).
    pub fn finish(&mut self, tokenizer: &Tokenizer) -> Result<String> {
        let before =
            tokenizer.decode(&self.ids[self.prefix..self.read], self.skip_special_tokens)?;
        let now = tokenizer.decode(&self.ids[self.prefix..], self.skip_special_tokens)?;
        self.prefix = self.ids.len();
        self.read = self.ids.len();
        Ok(now.get(before.len()..).unwrap_or_default().to_string())
    }
}
