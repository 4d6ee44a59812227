//! Memory-mapped safetensors checkpoints: one `model.safetensors` or shards listed by
//! `model.safetensors.index.json`.
//!
//! Tensors are looked up by their checkpoint name and decoded to f32 on request; errors name
//! the file and the tensor. Nothing is copied until a backend asks for a tensor.

use std::collections::{BTreeSet, HashMap};
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;
use safetensors::SafeTensors;
use serde::Deserialize;

use crate::dtype::DType;
use crate::error::{EngineError, Result};

struct Shard {
    path: PathBuf,
    map: Mmap,
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
        self.shards.push(Shard { path, map });
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

    /// The stored dtype and bytes of `name`, after checking its shape.
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
        let tensors =
            SafeTensors::deserialize(&shard.map).expect("the shard parsed when it was opened");
        let view = tensors
            .tensor(name)
            .expect("the index only lists tensors of this shard");
        if view.shape() != shape {
            return Err(EngineError::Tensor {
                path: shard.path.clone(),
                name: name.into(),
                reason: format!("shape {:?}, expected {:?}", view.shape(), shape),
            });
        }
        let offset = view.data().as_ptr() as usize - shard.map.as_ptr() as usize;
        let bytes = &shard.map[offset..offset + view.data().len()];
        Ok((&shard.path, view.dtype(), bytes))
    }
}
