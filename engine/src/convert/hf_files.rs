//! The JSON and template files of the Hugging Face folder: model config, generation config,
//! tokenizer (vocabulary, merges, pre-tokenizer, special tokens) and chat template.

use std::path::Path;

use serde_json::{Map, Value as Json, json};

use super::{LlamaParams, conversion};
use crate::dtype::DType;
use crate::error::{EngineError, Result};
use crate::gguf::{GgufFile, Value};

/// GGUF token types (llama.cpp's `llama_token_type`) that Hugging Face lists as added tokens.
const TOKEN_TYPE_CONTROL: u64 = 3;
const TOKEN_TYPE_USER_DEFINED: u64 = 4;

pub(super) fn write_all(
    gguf: &GgufFile,
    params: &LlamaParams,
    dtype: DType,
    out_dir: &Path,
) -> Result<()> {
    let vocab = Vocab::from_gguf(gguf)?;
    let template = gguf
        .metadata
        .get("tokenizer.chat_template")
        .and_then(Value::as_str);
    write_json(
        &out_dir.join("config.json"),
        &model_config(params, &vocab, dtype),
    )?;
    write_json(
        &out_dir.join("generation_config.json"),
        &generation_config(&vocab),
    )?;
    write_json(
        &out_dir.join("tokenizer.json"),
        &tokenizer_json(gguf, &vocab)?,
    )?;
    write_json(
        &out_dir.join("tokenizer_config.json"),
        &tokenizer_config(params, &vocab, template),
    )?;
    if let Some(template) = template {
        let path = out_dir.join("chat_template.jinja");
        std::fs::write(&path, template).map_err(|e| EngineError::io(path, e))?;
    }
    Ok(())
}

fn write_json(path: &Path, value: &Json) -> Result<()> {
    let mut text =
        serde_json::to_string_pretty(value).expect("serde_json::Value always serializes");
    text.push('\n');
    std::fs::write(path, text).map_err(|e| EngineError::io(path, e))
}

/// The tokenizer's tables as GGUF stores them.
struct Vocab {
    tokens: Vec<String>,
    types: Vec<u64>,
    merges: Vec<String>,
    bos: Option<u64>,
    eos: Option<u64>,
    unk: Option<u64>,
    pad: Option<u64>,
}

impl Vocab {
    fn from_gguf(gguf: &GgufFile) -> Result<Self> {
        let model = gguf.require_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(conversion(
                gguf,
                format!("tokenizer model `{model}` is not supported (only byte-level BPE, `gpt2`)"),
            ));
        }
        let strings = |key: &str| -> Result<Vec<String>> {
            let array = gguf
                .require(key)?
                .as_array()
                .ok_or_else(|| conversion(gguf, format!("`{key}` is not an array")))?;
            array
                .iter()
                .map(|v| {
                    v.as_str()
                        .map(str::to_string)
                        .ok_or_else(|| conversion(gguf, format!("`{key}` holds a non-string")))
                })
                .collect()
        };
        let tokens = strings("tokenizer.ggml.tokens")?;
        let types = match gguf
            .metadata
            .get("tokenizer.ggml.token_type")
            .and_then(Value::as_array)
        {
            Some(types) => types.iter().map(|v| v.as_u64().unwrap_or(1)).collect(),
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(conversion(
                gguf,
                format!("{} token types for {} tokens", types.len(), tokens.len()),
            ));
        }
        let id = |key: &str| {
            gguf.metadata
                .get(key)
                .and_then(Value::as_u64)
                .filter(|&id| (id as usize) < tokens.len())
        };
        Ok(Self {
            merges: strings("tokenizer.ggml.merges")?,
            bos: id("tokenizer.ggml.bos_token_id"),
            eos: id("tokenizer.ggml.eos_token_id"),
            unk: id("tokenizer.ggml.unknown_token_id"),
            pad: id("tokenizer.ggml.padding_token_id"),
            tokens,
            types,
        })
    }

    fn token(&self, id: Option<u64>) -> Json {
        id.map_or(Json::Null, |id| {
            Json::String(self.tokens[id as usize].clone())
        })
    }

    fn added(&self) -> impl Iterator<Item = (usize, &str, bool)> {
        self.tokens
            .iter()
            .zip(&self.types)
            .enumerate()
            .filter_map(|(id, (token, &ty))| match ty {
                TOKEN_TYPE_CONTROL => Some((id, token.as_str(), true)),
                TOKEN_TYPE_USER_DEFINED => Some((id, token.as_str(), false)),
                _ => None,
            })
    }
}

/// Writes an f32 as the shortest decimal that reads back as the same f32 (1e-5, not
/// 9.999999747378752e-6), so that Python's f64 parse rounds to the value GGUF stored.
fn f32_json(value: f32) -> Json {
    let shortest: f64 = value
        .to_string()
        .parse()
        .expect("f32 Display output parses as f64");
    json!(shortest)
}

fn model_config(p: &LlamaParams, vocab: &Vocab, dtype: DType) -> Json {
    json!({
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": p.hidden,
        "intermediate_size": p.ffn,
        "num_hidden_layers": p.layers,
        "num_attention_heads": p.heads,
        "num_key_value_heads": p.kv_heads,
        "head_dim": p.head_dim,
        "max_position_embeddings": p.context,
        "vocab_size": p.vocab,
        "rms_norm_eps": f32_json(p.rms_eps),
        "rope_theta": f32_json(p.rope_theta),
        "rope_scaling": null,
        "hidden_act": "silu",
        "attention_bias": false,
        "attention_dropout": 0.0,
        "mlp_bias": false,
        "tie_word_embeddings": p.tied_embeddings,
        "initializer_range": 0.02,
        "bos_token_id": vocab.bos,
        "eos_token_id": vocab.eos,
        "pad_token_id": vocab.pad,
        "torch_dtype": dtype.torch_name(),
        "use_cache": true,
    })
}

fn generation_config(vocab: &Vocab) -> Json {
    json!({ "bos_token_id": vocab.bos, "eos_token_id": vocab.eos, "pad_token_id": vocab.pad })
}

/// The pre-tokenizer llama.cpp's `tokenizer.ggml.pre` names, in Hugging Face's terms.
fn pre_tokenizer(gguf: &GgufFile) -> Result<Json> {
    let byte_level = json!({ "type": "ByteLevel", "add_prefix_space": false, "trim_offsets": true, "use_regex": true });
    let pre = gguf
        .metadata
        .get("tokenizer.ggml.pre")
        .and_then(Value::as_str)
        .unwrap_or("default");
    match pre {
        "default" | "gpt-2" => Ok(byte_level),
        // SmolLM splits every digit on its own before the GPT-2 byte-level split.
        "smollm" => Ok(json!({
            "type": "Sequence",
            "pretokenizers": [{ "type": "Digits", "individual_digits": true }, byte_level],
        })),
        other => Err(conversion(
            gguf,
            format!("pre-tokenizer `{other}` is not supported (smollm, gpt-2 and default are)"),
        )),
    }
}

/// An added token as `tokenizer_config.json` lists it; `tokenizer.json` adds its `id`.
fn added_token(content: &str, special: bool) -> Json {
    json!({
        "content": content, "single_word": false, "lstrip": false, "rstrip": false,
        "normalized": !special, "special": special,
    })
}

fn added_token_with_id(id: usize, content: &str, special: bool) -> Json {
    let mut token = added_token(content, special);
    token["id"] = json!(id);
    token
}

fn tokenizer_json(gguf: &GgufFile, vocab: &Vocab) -> Result<Json> {
    let ids: Map<String, Json> = vocab
        .tokens
        .iter()
        .enumerate()
        .map(|(id, t)| (t.clone(), json!(id)))
        .collect();
    let merges = vocab
        .merges
        .iter()
        .map(|m| {
            let (a, b) = m
                .split_once(' ')
                .ok_or_else(|| conversion(gguf, format!("merge `{m}` is not a pair")))?;
            Ok(json!([a, b]))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok(json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": vocab.added().map(|(id, t, special)| added_token_with_id(id, t, special)).collect::<Vec<_>>(),
        "normalizer": null,
        "pre_tokenizer": pre_tokenizer(gguf)?,
        "post_processor": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": false, "use_regex": true },
        "decoder": { "type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true },
        "model": {
            "type": "BPE", "dropout": null, "unk_token": null, "continuing_subword_prefix": null,
            "end_of_word_suffix": null, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
            "vocab": ids, "merges": merges,
        },
    }))
}

fn tokenizer_config(p: &LlamaParams, vocab: &Vocab, template: Option<&str>) -> Json {
    let decoder: Map<String, Json> = vocab
        .added()
        .map(|(id, t, special)| (id.to_string(), added_token(t, special)))
        .collect();
    json!({
        "add_bos_token": false,
        "add_eos_token": false,
        "add_prefix_space": false,
        "added_tokens_decoder": decoder,
        "bos_token": vocab.token(vocab.bos),
        "eos_token": vocab.token(vocab.eos),
        "unk_token": vocab.token(vocab.unk),
        "pad_token": vocab.token(vocab.pad),
        "chat_template": template,
        "clean_up_tokenization_spaces": false,
        "model_max_length": p.context,
        "tokenizer_class": "GPT2Tokenizer",
    })
}
