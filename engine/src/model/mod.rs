//! A Hugging Face model folder: configuration, weights, tokenizer and chat template.
//!
//! [`ModelFiles::open`] checks that the folder is usable and reads everything but the weights,
//! which a backend loads from [`Weights`] in its own layout and precision.

pub mod config;
pub mod shard;
pub mod synthetic;
pub mod weights;

use std::path::{Path, PathBuf};

pub use config::{Architecture, ModelConfig, RopeScaling};
pub use shard::Shard;
pub use weights::{BlockType, Weights};

use crate::chat::{ChatTemplate, special_token};
use crate::error::{EngineError, Result};
use crate::tokenizer::Tokenizer;

/// Everything about a model folder except its weights.
pub struct ModelFiles {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub tokenizer: Tokenizer,
    pub chat_template: Option<ChatTemplate>,
    /// Ids that end generation: the config's, the generation config's and the tokenizer's EOS.
    pub eos_token_ids: Vec<u32>,
}

impl ModelFiles {
    pub fn open(dir: &Path) -> Result<Self> {
        if !dir.is_dir() {
            return Err(EngineError::ModelFolder {
                path: dir.to_path_buf(),
                reason: "no such directory".into(),
            });
        }
        let config = ModelConfig::from_dir(dir)?;
        let tokenizer = Tokenizer::from_dir(dir)?;
        if tokenizer.vocab_size() > config.vocab_size {
            return Err(EngineError::ModelFolder {
                path: dir.to_path_buf(),
                reason: format!(
                    "the tokenizer has {} tokens but config.json's vocab_size is {}",
                    tokenizer.vocab_size(),
                    config.vocab_size
                ),
            });
        }
        let chat_template = ChatTemplate::from_dir(dir)?;
        let eos_token_ids = eos_ids(dir, &config, &tokenizer)?;
        Ok(Self {
            dir: dir.to_path_buf(),
            config,
            tokenizer,
            chat_template,
            eos_token_ids,
        })
    }
}

fn eos_ids(dir: &Path, config: &ModelConfig, tokenizer: &Tokenizer) -> Result<Vec<u32>> {
    let mut ids = config.eos_token_ids.clone();
    let generation = read_json(&dir.join("generation_config.json"))?;
    match &generation["eos_token_id"] {
        serde_json::Value::Number(n) => ids.extend(n.as_u64().map(|v| v as u32)),
        serde_json::Value::Array(list) => {
            ids.extend(list.iter().filter_map(|v| v.as_u64()).map(|v| v as u32))
        }
        _ => {}
    }
    let tokenizer_config = read_json(&dir.join("tokenizer_config.json"))?;
    ids.extend(
        special_token(&tokenizer_config, "eos_token").and_then(|t| tokenizer.token_to_id(&t)),
    );
    ids.sort_unstable();
    ids.dedup();
    Ok(ids)
}

/// A JSON file's value, or `Null` if the file does not exist.
fn read_json(path: &Path) -> Result<serde_json::Value> {
    match std::fs::read_to_string(path) {
        Ok(text) => serde_json::from_str(&text).map_err(|source| EngineError::Json {
            path: path.into(),
            source,
        }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(serde_json::Value::Null),
        Err(e) => Err(EngineError::io(path, e)),
    }
}
