//! The working pool's KV bytes on the device.
//!
//! One allocation holds, for each layer, K and then V, each `[pages_total][page_tokens]
//! [kv_heads][head_dim]` bf16, so a token's slot (`page · page_tokens + offset`) addresses its
//! row in every layer. `pages_total` is the pool's pages plus one spare page that no sequence
//! owns: padding rows of a replayed decode graph write there.

use std::sync::Arc;

use cache::{KvGeometry, PageId};
use half::bf16;

use super::device::{DPtr, Device, DeviceBuffer};
use crate::error::Result;

pub struct KvPool {
    memory: DeviceBuffer,
    geometry: KvGeometry,
    pages: usize,
}

impl KvPool {
    /// Allocates `pages` pages (and the spare) of `geometry`, whose elements must be bf16.
    pub fn new(device: &Arc<Device>, geometry: KvGeometry, pages: usize) -> Result<Self> {
        debug_assert_eq!(geometry.dtype_bytes, 2);
        let bytes = (pages + 1) * geometry.page_bytes();
        Ok(KvPool {
            memory: DeviceBuffer::alloc(device, bytes, "the KV pool")?,
            geometry,
            pages,
        })
    }

    /// The page padding rows write to.
    pub fn spare_page(&self) -> PageId {
        PageId(self.pages as u32)
    }

    /// Pages including the spare.
    pub fn pages_total(&self) -> usize {
        self.pages + 1
    }

    /// Elements of one page of one layer's K (or V).
    pub fn page_elems(&self) -> usize {
        self.geometry.page_tokens * self.geometry.token_elems_per_layer()
    }

    /// Layer `layer`'s K (`value == false`) or V.
    pub fn cache(&self, layer: usize, value: bool) -> DPtr<bf16> {
        let block = 2 * layer + value as usize;
        self.memory
            .ptr::<bf16>()
            .offset(block * self.pages_total() * self.page_elems())
    }

    pub fn base(&self) -> DPtr<u8> {
        self.memory.ptr()
    }

    pub fn bytes(&self) -> u64 {
        self.memory.bytes() as u64
    }
}
