//! `config.json` of a Hugging Face Llama-family checkpoint, read and validated.
//!
//! Llama 2/3 (incl. `llama3` RoPE scaling), SmolLM2, Mistral (incl. `sliding_window`) and
//! Qwen2/2.5 (q/k/v bias) share one decoder shape; what differs is captured in [`ModelConfig`].
//! Any other architecture is refused by name. Errors name the file and the key.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::error::{EngineError, Result};

/// Architectures snapserve runs, as `config.json` names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Architecture {
    Llama,
    Mistral,
    Qwen2,
}

impl Architecture {
    fn from_name(name: &str) -> Option<Self> {
        match name {
            "LlamaForCausalLM" | "llama" => Some(Self::Llama),
            "MistralForCausalLM" | "mistral" => Some(Self::Mistral),
            "Qwen2ForCausalLM" | "qwen2" => Some(Self::Qwen2),
            _ => None,
        }
    }
}

/// How rotary frequencies are derived from `rope_theta`.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// Llama 3.1's frequency-dependent scaling.
    Llama3 {
        factor: f32,
        low_freq_factor: f32,
        high_freq_factor: f32,
        original_max_position: usize,
    },
}

/// The validated shape and constants of one decoder-only model.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub architecture: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    pub rope_scaling: RopeScaling,
    pub tie_word_embeddings: bool,
    /// Whether q, k and v projections carry a bias (Qwen2).
    pub qkv_bias: bool,
    /// Attention looks back at most this many positions (Mistral v0.1).
    pub sliding_window: Option<usize>,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

/// One or several token ids, as `eos_token_id` may be either.
#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum TokenIds {
    One(u32),
    Many(Vec<u32>),
}

/// `rope_scaling`, or transformers 5's `rope_parameters` (which also carries `rope_theta`).
#[derive(Debug, Deserialize)]
struct RawRope {
    #[serde(alias = "type")]
    rope_type: Option<String>,
    rope_theta: Option<f64>,
    factor: Option<f32>,
    low_freq_factor: Option<f32>,
    high_freq_factor: Option<f32>,
    original_max_position_embeddings: Option<usize>,
}

/// `config.json` as written; unknown keys are ignored since checkpoints carry many.
#[derive(Debug, Deserialize)]
struct RawConfig {
    architectures: Option<Vec<String>>,
    model_type: Option<String>,
    hidden_size: Option<usize>,
    intermediate_size: Option<usize>,
    num_hidden_layers: Option<usize>,
    num_attention_heads: Option<usize>,
    num_key_value_heads: Option<usize>,
    head_dim: Option<usize>,
    vocab_size: Option<usize>,
    max_position_embeddings: Option<usize>,
    rms_norm_eps: Option<f64>,
    rope_theta: Option<f64>,
    rope_scaling: Option<RawRope>,
    rope_parameters: Option<RawRope>,
    tie_word_embeddings: Option<bool>,
    attention_bias: Option<bool>,
    hidden_act: Option<String>,
    sliding_window: Option<usize>,
    use_sliding_window: Option<bool>,
    bos_token_id: Option<u32>,
    eos_token_id: Option<TokenIds>,
}

impl ModelConfig {
    /// Reads `dir/config.json`.
    pub fn from_dir(dir: &Path) -> Result<Self> {
        let path = dir.join("config.json");
        let text = std::fs::read_to_string(&path).map_err(|e| EngineError::io(&path, e))?;
        Self::from_json(&text, &path)
    }

    /// Parses and validates the text of a `config.json`; `path` is only used in errors.
    pub fn from_json(text: &str, path: &Path) -> Result<Self> {
        let raw: RawConfig = serde_json::from_str(text).map_err(|source| EngineError::Json {
            path: path.into(),
            source,
        })?;
        Validator {
            path: path.to_path_buf(),
        }
        .validate(raw)
    }

    /// Query heads per KV head.
    pub fn group_size(&self) -> usize {
        self.num_heads / self.num_kv_heads
    }

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Rotary inverse frequencies, one per pair of head dimensions, as Hugging Face computes them.
    pub fn rope_inv_freq(&self) -> Vec<f32> {
        let dim = self.head_dim as f64;
        let base: Vec<f64> = (0..self.head_dim / 2)
            .map(|i| 1.0 / (self.rope_theta as f64).powf(2.0 * i as f64 / dim))
            .collect();
        match self.rope_scaling {
            RopeScaling::None => base.iter().map(|&f| f as f32).collect(),
            RopeScaling::Linear { factor } => {
                base.iter().map(|&f| (f / factor as f64) as f32).collect()
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position,
            } => {
                let (factor, low, high) = (
                    factor as f64,
                    low_freq_factor as f64,
                    high_freq_factor as f64,
                );
                let old = original_max_position as f64;
                let (low_wavelen, high_wavelen) = (old / low, old / high);
                base.iter()
                    .map(|&f| {
                        let wavelen = 2.0 * std::f64::consts::PI / f;
                        let scaled = if wavelen < high_wavelen {
                            f
                        } else if wavelen > low_wavelen {
                            f / factor
                        } else {
                            let smooth = (old / wavelen - low) / (high - low);
                            (1.0 - smooth) * f / factor + smooth * f
                        };
                        scaled as f32
                    })
                    .collect()
            }
        }
    }
}

struct Validator {
    path: PathBuf,
}

impl Validator {
    fn error(&self, key: &str, reason: impl Into<String>) -> EngineError {
        EngineError::Config {
            path: self.path.clone(),
            key: key.into(),
            reason: reason.into(),
        }
    }

    fn required(&self, value: Option<usize>, key: &str) -> Result<usize> {
        match value {
            Some(0) => Err(self.error(key, "must be positive")),
            Some(v) => Ok(v),
            None => Err(self.error(key, "is missing")),
        }
    }

    fn architecture(&self, raw: &RawConfig) -> Result<Architecture> {
        let name = raw
            .architectures
            .as_ref()
            .and_then(|a| a.first().cloned())
            .or_else(|| raw.model_type.clone())
            .ok_or_else(|| self.error("architectures", "is missing (and so is model_type)"))?;
        Architecture::from_name(&name).ok_or(EngineError::UnsupportedArchitecture {
            path: self.path.clone(),
            name,
        })
    }

    fn validate(&self, raw: RawConfig) -> Result<ModelConfig> {
        let architecture = self.architecture(&raw)?;
        if let Some(act) = raw.hidden_act.as_deref().filter(|&a| a != "silu") {
            return Err(self.error(
                "hidden_act",
                format!("`{act}` is not supported (only silu)"),
            ));
        }
        let hidden_size = self.required(raw.hidden_size, "hidden_size")?;
        let num_heads = self.required(raw.num_attention_heads, "num_attention_heads")?;
        let num_kv_heads = self.required(
            raw.num_key_value_heads.or(Some(num_heads)),
            "num_key_value_heads",
        )?;
        if num_heads % num_kv_heads != 0 {
            return Err(self.error(
                "num_key_value_heads",
                format!("{num_kv_heads} does not divide {num_heads} heads"),
            ));
        }
        let head_dim = match raw.head_dim {
            Some(d) => self.required(Some(d), "head_dim")?,
            None if hidden_size % num_heads == 0 => hidden_size / num_heads,
            None => {
                return Err(self.error(
                    "hidden_size",
                    format!("{hidden_size} is not divisible by {num_heads} heads"),
                ));
            }
        };
        if head_dim % 2 != 0 {
            return Err(self.error(
                "head_dim",
                format!("{head_dim} is odd; rotary embeddings need pairs"),
            ));
        }
        let eos_token_ids = match raw.eos_token_id {
            Some(TokenIds::One(id)) => vec![id],
            Some(TokenIds::Many(ids)) => ids,
            None => Vec::new(),
        };
        let sliding_window = match architecture {
            Architecture::Mistral => raw.sliding_window,
            // Qwen2 slides only on some layers; no released checkpoint turns it on.
            Architecture::Qwen2 if raw.use_sliding_window == Some(true) => {
                return Err(self.error(
                    "use_sliding_window",
                    "Qwen2's per-layer sliding window is not supported",
                ));
            }
            _ => None,
        };
        let rope_theta = raw
            .rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(raw.rope_theta);
        let rope = raw.rope_parameters.or(raw.rope_scaling);
        Ok(ModelConfig {
            architecture,
            hidden_size,
            intermediate_size: self.required(raw.intermediate_size, "intermediate_size")?,
            num_layers: self.required(raw.num_hidden_layers, "num_hidden_layers")?,
            num_heads,
            num_kv_heads,
            head_dim,
            vocab_size: self.required(raw.vocab_size, "vocab_size")?,
            max_position_embeddings: self.required(
                raw.max_position_embeddings.or(Some(4096)),
                "max_position_embeddings",
            )?,
            rms_norm_eps: self.positive_f32(raw.rms_norm_eps.unwrap_or(1e-6), "rms_norm_eps")?,
            rope_theta: self.positive_f32(rope_theta.unwrap_or(10_000.0), "rope_theta")?,
            rope_scaling: self.rope_scaling(rope)?,
            tie_word_embeddings: raw.tie_word_embeddings.unwrap_or(false),
            qkv_bias: architecture == Architecture::Qwen2 || raw.attention_bias == Some(true),
            sliding_window,
            bos_token_id: raw.bos_token_id,
            eos_token_ids,
        })
    }

    fn positive_f32(&self, value: f64, key: &str) -> Result<f32> {
        if value.is_finite() && value > 0.0 {
            Ok(value as f32)
        } else {
            Err(self.error(key, format!("must be a positive number, got {value}")))
        }
    }

    fn rope_scaling(&self, raw: Option<RawRope>) -> Result<RopeScaling> {
        let Some(raw) = raw else {
            return Ok(RopeScaling::None);
        };
        let factor = || {
            raw.factor
                .ok_or_else(|| self.error("rope_scaling.factor", "is missing"))
        };
        match raw.rope_type.as_deref().unwrap_or("default") {
            "default" => Ok(RopeScaling::None),
            "linear" => Ok(RopeScaling::Linear { factor: factor()? }),
            "llama3" => Ok(RopeScaling::Llama3 {
                factor: factor()?,
                low_freq_factor: raw.low_freq_factor.unwrap_or(1.0),
                high_freq_factor: raw.high_freq_factor.unwrap_or(4.0),
                original_max_position: raw.original_max_position_embeddings.unwrap_or(8192),
            }),
            other => Err(self.error(
                "rope_scaling.rope_type",
                format!("`{other}` is not supported (default, linear, llama3)"),
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<ModelConfig> {
        ModelConfig::from_json(text, Path::new("config.json"))
    }

    const SMOLLM2: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":576,"intermediate_size":1536,
        "num_hidden_layers":30,"num_attention_heads":9,"num_key_value_heads":3,"vocab_size":49152,
        "max_position_embeddings":8192,"rms_norm_eps":1e-5,"rope_theta":100000.0,"tie_word_embeddings":true,
        "eos_token_id":2,"bos_token_id":1}"#;

    #[test]
    fn reads_smollm2() {
        let c = parse(SMOLLM2).unwrap();
        assert_eq!(c.architecture, Architecture::Llama);
        assert_eq!((c.head_dim, c.group_size(), c.kv_dim()), (64, 3, 192));
        assert_eq!(c.eos_token_ids, vec![2]);
        assert!(c.tie_word_embeddings && !c.qkv_bias && c.sliding_window.is_none());
        assert_eq!(c.rms_norm_eps, 1e-5);
    }

    #[test]
    fn qwen2_has_bias_and_mistral_a_window() {
        let qwen = SMOLLM2.replace("LlamaForCausalLM", "Qwen2ForCausalLM");
        assert!(parse(&qwen).unwrap().qkv_bias);
        let mistral = SMOLLM2
            .replace("LlamaForCausalLM", "MistralForCausalLM")
            .replace(
                "\"eos_token_id\":2",
                "\"eos_token_id\":[2,3],\"sliding_window\":4096",
            );
        let c = parse(&mistral).unwrap();
        assert_eq!(c.sliding_window, Some(4096));
        assert_eq!(c.eos_token_ids, vec![2, 3]);
    }

    #[test]
    fn reads_transformers5_rope_parameters() {
        let text = SMOLLM2.replace(
            "\"rope_theta\":100000.0",
            r#""rope_parameters":{"rope_type":"linear","factor":2.0,"rope_theta":5000.0}"#,
        );
        let c = parse(&text).unwrap();
        assert_eq!(c.rope_theta, 5000.0);
        assert_eq!(c.rope_scaling, RopeScaling::Linear { factor: 2.0 });
    }

    #[test]
    fn qwen2_per_layer_sliding_window_is_refused() {
        let text = SMOLLM2
            .replace("LlamaForCausalLM", "Qwen2ForCausalLM")
            .replace(
                "\"eos_token_id\":2",
                "\"eos_token_id\":2,\"use_sliding_window\":true,\"sliding_window\":4096",
            );
        let err = parse(&text).unwrap_err();
        assert!(
            err.to_string().contains(
                "`use_sliding_window`: Qwen2's per-layer sliding window is not supported"
            ),
            "{err}"
        );
    }

    #[test]
    fn unsupported_architecture_is_refused_by_name() {
        let err = parse(&SMOLLM2.replace("LlamaForCausalLM", "GPTNeoXForCausalLM")).unwrap_err();
        assert!(
            err.to_string()
                .contains("`GPTNeoXForCausalLM` is not supported"),
            "{err}"
        );
    }

    #[test]
    fn errors_name_the_key() {
        let err = parse(&SMOLLM2.replace("\"num_key_value_heads\":3", "\"num_key_value_heads\":4"))
            .unwrap_err();
        assert!(
            err.to_string()
                .contains("`num_key_value_heads`: 4 does not divide 9 heads"),
            "{err}"
        );
        let err = parse(&SMOLLM2.replace("\"hidden_size\":576,", "")).unwrap_err();
        assert!(
            err.to_string().contains("`hidden_size`: is missing"),
            "{err}"
        );
        let err = parse("{not json").unwrap_err();
        assert!(err.to_string().starts_with("config.json:"), "{err}");
    }

    #[test]
    fn llama3_scaling_keeps_high_frequencies_and_divides_low_ones() {
        let text = SMOLLM2.replace(
            "\"tie_word_embeddings\":true",
            r#""tie_word_embeddings":true,"rope_scaling":{"rope_type":"llama3","factor":8.0,"low_freq_factor":1.0,"high_freq_factor":4.0,"original_max_position_embeddings":8192}"#,
        ).replace("100000.0", "500000.0");
        let c = parse(&text).unwrap();
        let plain = ModelConfig {
            rope_scaling: RopeScaling::None,
            ..c.clone()
        }
        .rope_inv_freq();
        let scaled = c.rope_inv_freq();
        assert_eq!(scaled[0], plain[0]);
        assert_eq!(scaled[31], plain[31] / 8.0);
    }
}
