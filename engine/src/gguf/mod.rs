//! A reader for GGUF files (llama.cpp's model format), version 2 and 3.
//!
//! It maps the file, parses the metadata and the tensor directory, and hands out each tensor's
//! raw bytes; [`dequant`] turns those into f32. It reads only what the converter needs and never
//! writes GGUF. Every malformed or truncated input is an `Err` naming the file and what was being
//! read, never a panic.

pub mod dequant;

use std::collections::BTreeMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use memmap2::Mmap;

use crate::error::{EngineError, Result};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;

/// One metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    String(String),
    Array(Vec<Value>),
}

impl Value {
    /// The value as an unsigned integer, whatever its integer width.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            Value::U8(v) => Some(v.into()),
            Value::U16(v) => Some(v.into()),
            Value::U32(v) => Some(v.into()),
            Value::U64(v) => Some(v),
            Value::I8(v) => u64::try_from(v).ok(),
            Value::I16(v) => u64::try_from(v).ok(),
            Value::I32(v) => u64::try_from(v).ok(),
            Value::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F32(v) => Some(v),
            Value::F64(v) => Some(v as f32),
            _ => None,
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(v) => Some(v),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(v) => Some(v),
            _ => None,
        }
    }
}

/// The storage type of a tensor, by its GGUF code.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TensorType {
    F32,
    F16,
    Q4_0,
    Q4_1,
    Q8_0,
    BF16,
    /// A type this reader does not decode, kept by code so errors can name it.
    Other(u32),
}

impl TensorType {
    fn from_code(code: u32) -> Self {
        match code {
            0 => Self::F32,
            1 => Self::F16,
            2 => Self::Q4_0,
            3 => Self::Q4_1,
            8 => Self::Q8_0,
            30 => Self::BF16,
            other => Self::Other(other),
        }
    }

    /// Elements per block and bytes per block, or `None` for a type we cannot decode.
    pub fn block_layout(self) -> Option<(usize, usize)> {
        match self {
            Self::F32 => Some((1, 4)),
            Self::F16 | Self::BF16 => Some((1, 2)),
            Self::Q4_0 => Some((32, 18)),
            Self::Q4_1 => Some((32, 20)),
            Self::Q8_0 => Some((32, 34)),
            Self::Other(_) => None,
        }
    }
}

/// One entry of the tensor directory.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// Dimensions in GGUF order: the fastest-varying first (the reverse of PyTorch's shape).
    pub dims: Vec<u64>,
    pub ty: TensorType,
    /// Offset of the data from the start of the data section.
    pub offset: u64,
}

impl TensorInfo {
    pub fn elements(&self) -> u64 {
        self.dims.iter().product()
    }

    /// The shape in row-major (PyTorch / safetensors) order.
    pub fn shape(&self) -> Vec<usize> {
        self.dims.iter().rev().map(|&d| d as usize).collect()
    }
}

/// A parsed, memory-mapped GGUF file.
pub struct GgufFile {
    path: PathBuf,
    map: Mmap,
    pub version: u32,
    pub metadata: BTreeMap<String, Value>,
    pub tensors: Vec<TensorInfo>,
    data_start: u64,
}

impl GgufFile {
    pub fn open(path: &Path) -> Result<Self> {
        let file = File::open(path).map_err(|e| EngineError::io(path, e))?;
        // SAFETY: the map is read-only and the file is not modified while snapserve holds it;
        // a file truncated underneath us is the same hazard every mmap-based loader accepts.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| EngineError::io(path, e))?;
        let mut cursor = Cursor {
            bytes: &map,
            pos: 0,
            path,
        };
        let header = cursor.header()?;
        let mut metadata = BTreeMap::new();
        for _ in 0..header.kv_count {
            let key = cursor.string()?;
            let value = cursor.value()?;
            metadata.insert(key, value);
        }
        let tensors = (0..header.tensor_count)
            .map(|_| cursor.tensor_info())
            .collect::<Result<Vec<_>>>()?;
        let alignment = metadata
            .get("general.alignment")
            .and_then(Value::as_u64)
            .unwrap_or(DEFAULT_ALIGNMENT);
        if alignment == 0 {
            return Err(cursor.malformed("general.alignment is 0"));
        }
        let data_start = (cursor.pos as u64).div_ceil(alignment) * alignment;
        let file = Self {
            path: path.to_path_buf(),
            map,
            version: header.version,
            metadata,
            tensors,
            data_start,
        };
        for info in &file.tensors {
            file.tensor_bytes(info)?;
        }
        Ok(file)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A required metadata value, or an error naming the key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.metadata
            .get(key)
            .ok_or_else(|| self.malformed(format!("metadata key `{key}` is missing")))
    }

    pub fn require_u64(&self, key: &str) -> Result<u64> {
        self.require(key)?
            .as_u64()
            .ok_or_else(|| self.malformed(format!("`{key}` is not an integer")))
    }

    pub fn require_f32(&self, key: &str) -> Result<f32> {
        self.require(key)?
            .as_f32()
            .ok_or_else(|| self.malformed(format!("`{key}` is not a float")))
    }

    pub fn require_str(&self, key: &str) -> Result<&str> {
        self.require(key)?
            .as_str()
            .ok_or_else(|| self.malformed(format!("`{key}` is not a string")))
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The raw stored bytes of one tensor.
    pub fn tensor_bytes(&self, info: &TensorInfo) -> Result<&[u8]> {
        let (block_elems, block_bytes) = info.ty.block_layout().ok_or_else(|| {
            self.malformed(format!(
                "tensor `{}` has unsupported type {:?}",
                info.name, info.ty
            ))
        })?;
        let elements = info.elements();
        if !elements.is_multiple_of(block_elems as u64) {
            return Err(self.malformed(format!(
                "tensor `{}` has {elements} elements, not a multiple of its block size {block_elems}",
                info.name
            )));
        }
        let len = elements / block_elems as u64 * block_bytes as u64;
        let start = self.data_start.checked_add(info.offset);
        let end = start.and_then(|s| s.checked_add(len));
        match (start, end) {
            (Some(start), Some(end)) if end <= self.map.len() as u64 => {
                Ok(&self.map[start as usize..end as usize])
            }
            _ => Err(self.malformed(format!(
                "tensor `{}` ({len} bytes at offset {}) runs past the end of the file ({} bytes)",
                info.name,
                info.offset,
                self.map.len()
            ))),
        }
    }

    fn malformed(&self, reason: impl Into<String>) -> EngineError {
        EngineError::MalformedGguf {
            path: self.path.clone(),
            reason: reason.into(),
        }
    }
}

struct Header {
    version: u32,
    tensor_count: u64,
    kv_count: u64,
}

/// A bounds-checked little-endian reader over the mapped bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
    path: &'a Path,
}

/// Upper bound on any element count read from the file, so a corrupt count fails cleanly
/// instead of asking for a huge allocation.
const MAX_COUNT: u64 = 1 << 28;

impl Cursor<'_> {
    fn malformed(&self, reason: impl Into<String>) -> EngineError {
        EngineError::MalformedGguf {
            path: self.path.to_path_buf(),
            reason: reason.into(),
        }
    }

    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.bytes.len());
        let end = end.ok_or_else(|| {
            self.malformed(format!("truncated at byte {} (wanted {n} more)", self.pos))
        })?;
        let out = &self.bytes[self.pos..end];
        self.pos = end;
        Ok(out)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        Ok(self
            .take(N)?
            .try_into()
            .expect("take returned exactly N bytes"))
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn count(&mut self, what: &str) -> Result<u64> {
        let n = self.u64()?;
        if n > MAX_COUNT {
            return Err(self.malformed(format!("{what} count {n} is implausibly large")));
        }
        Ok(n)
    }

    fn header(&mut self) -> Result<Header> {
        if self.take(4)? != MAGIC {
            return Err(self.malformed("not a GGUF file (bad magic)"));
        }
        let version = self.u32()?;
        if !(2..=3).contains(&version) {
            return Err(self.malformed(format!(
                "GGUF version {version} is not supported (2 or 3 are)"
            )));
        }
        Ok(Header {
            version,
            tensor_count: self.count("tensor")?,
            kv_count: self.count("metadata")?,
        })
    }

    fn string(&mut self) -> Result<String> {
        let len = self.count("string length")? as usize;
        let bytes = self.take(len)?;
        String::from_utf8(bytes.to_vec())
            .map_err(|_| self.malformed(format!("string at byte {} is not UTF-8", self.pos)))
    }

    fn value(&mut self) -> Result<Value> {
        let ty = self.u32()?;
        self.value_of(ty)
    }

    fn value_of(&mut self, ty: u32) -> Result<Value> {
        Ok(match ty {
            0 => Value::U8(self.array::<1>()?[0]),
            1 => Value::I8(self.array::<1>()?[0] as i8),
            2 => Value::U16(u16::from_le_bytes(self.array()?)),
            3 => Value::I16(i16::from_le_bytes(self.array()?)),
            4 => Value::U32(self.u32()?),
            5 => Value::I32(i32::from_le_bytes(self.array()?)),
            6 => Value::F32(f32::from_le_bytes(self.array()?)),
            7 => Value::Bool(self.array::<1>()?[0] != 0),
            8 => Value::String(self.string()?),
            9 => {
                let item_ty = self.u32()?;
                let n = self.count("array")?;
                Value::Array(
                    (0..n)
                        .map(|_| self.value_of(item_ty))
                        .collect::<Result<_>>()?,
                )
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(self.malformed(format!("unknown metadata value type {other}"))),
        })
    }

    fn tensor_info(&mut self) -> Result<TensorInfo> {
        let name = self.string()?;
        let n_dims = self.u32()?;
        if n_dims == 0 || n_dims > 4 {
            return Err(self.malformed(format!("tensor `{name}` has {n_dims} dimensions")));
        }
        let dims = (0..n_dims)
            .map(|_| self.u64())
            .collect::<Result<Vec<_>>>()?;
        let ty = TensorType::from_code(self.u32()?);
        let offset = self.u64()?;
        Ok(TensorInfo {
            name,
            dims,
            ty,
            offset,
        })
    }
}
