//! Memory-mapped safetensors checkpoints: one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`.
//!
//! Tensors are looked up by their checkpoint name and decoded to f32 on request; errors name
//! the file and the tensor. Nothing is copied until a backend asks for a tensor.
//!
//! A folder that `snapserve fetch-model --keep-blocks` wrote may hold matrices in their GGUF's
//! quantized blocks (Q4_1, Q8_0): such a tensor is stored as bytes (`U8`, one row of blocks per
//! matrix row) and named in the file's metadata as `snapserve.blocks.<name>` = `q4_1` |
//! `q8_0`. [`Weights::blocks`] hands them over as they are; [`Weights::load_f32`] decodes them.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::dtype::DType;
use crate::error::{EngineError, Result};
use crate::gguf::{TensorType, dequant};

struct Shard {
    path: PathBuf,
    map: Mmap,
    /// Tensors of this shard stored as quantized blocks, and their type.
    blocks: HashMap<String, BlockType>,
}

/// A quantized block type a checkpoint may store a matrix in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BlockType {
    Q4_1,
    Q8_0,
}

impl BlockType {
    /// The metadata key that names a tensor stored in blocks.
    pub const METADATA_PREFIX: &'static str = "snapserve.blocks.";

    pub fn name(self) -> &'static str {
        match self {
            BlockType::Q4_1 => "q4_1",
            BlockType::Q8_0 => "q8_0",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        match name {
            "q4_1" => Some(BlockType::Q4_1),
            "q8_0" => Some(BlockType::Q8_0),
            _ => None,
        }
    }

    /// Of a GGUF tensor type, if it is one.
    pub fn of_gguf(ty: TensorType) -> Option<Self> {
        match ty {
            TensorType::Q4_1 => Some(BlockType::Q4_1),
            TensorType::Q8_0 => Some(BlockType::Q8_0),
            _ => None,
        }
    }

    pub fn gguf(self) -> TensorType {
        match self {
            BlockType::Q4_1 => TensorType::Q4_1,
            BlockType::Q8_0 => TensorType::Q8_0,
        }
    }

    /// Bytes of one block of 32 weights.
    pub fn block_bytes(self) -> usize {
        match self {
            BlockType::Q4_1 => 20,
            BlockType::Q8_0 => 34,
        }
    }
}

/// The tensors of a checkpoint, across its shards.
pub struct Weights {
    shards: Vec<Shard>,
    /// Tensor name to the index of the shard holding it.
    index: HashMap<String, usize>,
}

#[derive(Deserialize)]
struct ShardIndex {
    weight_map: HashMap<String, String>,
}

impl Weights {
    /// Opens the checkpoint in `dir`: the index if there is one, else `model.safetensors`.
    pub fn open(dir: &Path) -> Result<Self> {
        let index_path = dir.join("model.safetensors.index.json");
        if index_path.exists() {
            return Self::open_sharded(dir, &index_path);
        }
        let single = dir.join("model.safetensors");
        if !single.exists() {
            return Err(EngineError::ModelFolder {
                path: dir.to_path_buf(),
                reason: "neither model.safetensors nor model.safetensors.index.json is present"
                    .into(),
            });
        }
        let mut weights = Self {
            shards: Vec::new(),
            index: HashMap::new(),
        };
        weights.add_shard(single)?;
        Ok(weights)
    }

    fn open_sharded(dir: &Path, index_path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(index_path).map_err(|e| EngineError::io(index_path, e))?;
        let index: ShardIndex =
            serde_json::from_str(&text).map_err(|source| EngineError::Json {
                path: index_path.into(),
                source,
            })?;
        let files: BTreeSet<&String> = index.weight_map.values().collect();
        let mut weights = Self {
            shards: Vec::new(),
            index: HashMap::new(),
        };
        for file in files {
            weights.add_shard(dir.join(file))?;
        }
        for (name, file) in &index.weight_map {
            if !weights.index.contains_key(name) {
                return Err(EngineError::Tensor {
                    path: dir.join(file),
                    name: name.clone(),
                    reason: "listed in model.safetensors.index.json but absent from the shard"
                        .into(),
                });
            }
        }
        Ok(weights)
    }

    fn add_shard(&mut self, path: PathBuf) -> Result<()> {
        let file = File::open(&path).map_err(|e| EngineError::io(&path, e))?;
        // SAFETY: read-only map of a checkpoint that is not modified while it is served.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(&path, e))?;
        let tensors = SafeTensors::deserialize(&map).map_err(|e| EngineError::Tensor {
            path: path.clone(),
            name: "*".into(),
            reason: format!("not a valid safetensors file: {e}"),
        })?;
        let shard = self.shards.len();
        for name in tensors.names() {
            self.index.insert(name.to_string(), shard);
        }
        drop(tensors);
        let blocks = blocks_of(&path, &map)?;
        self.shards.push(Shard { path, map, blocks });
        Ok(())
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.index.keys().map(String::as_str)
    }

    /// The stored shape of `name`, if the checkpoint has it.
    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let shard = &self.shards[*self.index.get(name)?];
        let tensors =
            SafeTensors::deserialize(&shard.map).expect("the shard parsed when it was opened");
        Some(tensors.tensor(name).ok()?.shape().to_vec())
    }

    /// The tensor `name` as f32, checked against `shape`.
    pub fn load_f32(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; shape.iter().product()];
        self.load_f32_into(name, shape, &mut out)?;
        Ok(out)
    }

    /// Decodes the tensor `name`, checked against `shape`, into `out`.
    pub fn load_f32_into(&self, name: &str, shape: &[usize], out: &mut [f32]) -> Result<()> {
        if let Some((ty, bytes)) = self.blocks(name, shape)? {
            assert!(
                dequant::dequantize(ty.gguf(), bytes, out),
                "both block types decode"
            );
            return Ok(());
        }
        let (path, dtype, bytes) = self.raw(name, shape)?;
        debug_assert_eq!(out.len(), shape.iter().product::<usize>());
        let dtype = DType::from_safetensors(dtype).ok_or_else(|| EngineError::Tensor {
            path: path.to_path_buf(),
            name: name.into(),
            reason: format!("dtype {dtype:?} is not supported (f32, f16, bf16 are)"),
        })?;
        dtype.decode_into(bytes, out);
        Ok(())
    }

    /// The block type and bytes of `name` if it is stored in quantized blocks (checked against
    /// the matrix's `shape`, `[rows, cols]`), else `None`.
    pub fn blocks(&self, name: &str, shape: &[usize]) -> Result<Option<(BlockType, &[u8])>> {
        let Some(shard) = self.index.get(name).map(|&i| &self.shards[i]) else {
            return Ok(None);
        };
        let Some(&ty) = shard.blocks.get(name) else {
            return Ok(None);
        };
        let bad = |reason: String| EngineError::Tensor {
            path: shard.path.clone(),
            name: name.into(),
            reason,
        };
        let &[rows, cols] = shape else {
            return Err(bad(format!(
                "stored in {} blocks, which only matrices are",
                ty.name()
            )));
        };
        if cols % 32 != 0 {
            return Err(bad(format!(
                "a row of {cols} is not whole blocks of 32 ({})",
                ty.name()
            )));
        }
        let (_, _, bytes) = stored(shard, name);
        if bytes.len() != rows * cols / 32 * ty.block_bytes() {
            return Err(bad(format!(
                "{} bytes of {} blocks, expected {} for shape {shape:?}",
                bytes.len(),
                ty.name(),
                rows * cols / 32 * ty.block_bytes()
            )));
        }
        Ok(Some((ty, bytes)))
    }

    /// The stored dtype and bytes of `name`, after checking its shape. A tensor stored in
    /// quantized blocks is refused: read it with [`Weights::blocks`] or [`Weights::load_f32`].
    pub fn raw(&self, name: &str, shape: &[usize]) -> Result<(&Path, safetensors::Dtype, &[u8])> {
        let shard = self
            .index
            .get(name)
            .map(|&i| &self.shards[i])
            .ok_or_else(|| EngineError::Tensor {
                path: self
                    .shards
                    .first()
                    .map_or_else(PathBuf::new, |s| s.path.clone()),
                name: name.into(),
                reason: "missing from the checkpoint".into(),
            })?;
        if let Some(ty) = shard.blocks.get(name) {
            return Err(EngineError::Tensor {
                path: shard.path.clone(),
                name: name.into(),
                reason: format!("stored in {} blocks, not as elements", ty.name()),
            });
        }
        let (stored_shape, dtype, bytes) = stored(shard, name);
        if stored_shape != shape {
            return Err(EngineError::Tensor {
                path: shard.path.clone(),
                name: name.into(),
                reason: format!("shape {stored_shape:?}, expected {shape:?}"),
            });
        }
        Ok((&shard.path, dtype, bytes))
    }
}

/// The stored shape, dtype and bytes of `name` in `shard`, unchecked.
fn stored<'a>(shard: &'a Shard, name: &str) -> (Vec<usize>, safetensors::Dtype, &'a [u8]) {
    let tensors =
        SafeTensors::deserialize(&shard.map).expect("the shard parsed when it was opened");
    let view = tensors
        .tensor(name)
        .expect("the index only lists tensors of this shard");
    let offset = view.data().as_ptr() as usize - shard.map.as_ptr() as usize;
    let bytes = &shard.map[offset..offset + view.data().len()];
    (view.shape().to_vec(), view.dtype(), bytes)
}

/// The tensors a shard's metadata names as stored in quantized blocks.
fn blocks_of(path: &Path, map: &[u8]) -> Result<HashMap<String, BlockType>> {
    let (_, metadata) = SafeTensors::read_metadata(map).map_err(|e| EngineError::Tensor {
        path: path.to_path_buf(),
        name: "*".into(),
        reason: format!("not a valid safetensors file: {e}"),
    })?;
    let mut blocks = HashMap::new();
    for (key, value) in metadata.metadata().iter().flatten() {
        let Some(name) = key.strip_prefix(BlockType::METADATA_PREFIX) else {
            continue;
        };
        let ty = BlockType::parse(value).ok_or_else(|| EngineError::Tensor {
            path: path.to_path_buf(),
            name: name.into(),
            reason: format!("unknown block type `{value}` (q4_1 and q8_0 are known)"),
        })?;
        blocks.insert(name.to_string(), ty);
    }
    Ok(blocks)
}
