//! Snapshot buffers of the CUDA backend: device-tier backings are plain device allocations,
//! host-tier ones page-locked host memory mapped into the device's address space.
//!
//! A save gathers pool pages into a backing and a restore scatters them back into any pages, by
//! one kernel launch each, queued on the backend's stream like every step: a later step sees
//! the copy done, and nothing waits for it on the host. A snapshot page has the CPU backend's
//! layout (per layer, K block then V block), so its size is what the store charges
//! (`KvGeometry::page_bytes`). Freeing a backing waits for the work queued before it.

use std::collections::HashMap;
use std::sync::Arc;

use cache::{BackingId, PageCopy, Tier};

use super::device::{DPtr, Device, DeviceBuffer, PinnedBuffer};
use super::kernels::{Kernels, PageCopies};
use super::pool::KvPool;
use crate::error::{EngineError, Result};

enum Memory {
    Device(DeviceBuffer),
    Host(PinnedBuffer),
}

impl Memory {
    fn ptr(&self) -> DPtr<u8> {
        match self {
            Memory::Device(b) => b.ptr(),
            Memory::Host(b) => b.ptr(),
        }
    }

    fn bytes(&self) -> usize {
        match self {
            Memory::Device(b) => b.bytes(),
            Memory::Host(b) => b.bytes(),
        }
    }
}

/// The backings of one backend, and the device list of the copies being made.
pub struct Backings {
    map: HashMap<BackingId, (Tier, Memory)>,
    copy_list: Option<DeviceBuffer>,
    device: Arc<Device>,
}

/// The pool a copy goes to or comes from.
pub struct PoolPages<'a> {
    pub pool: &'a KvPool,
    /// Pages sequences may own (the spare page is not one).
    pub pages: usize,
    /// Bytes of one snapshot page.
    pub page_bytes: usize,
    pub layers: usize,
}

impl Backings {
    pub fn new(device: &Arc<Device>) -> Self {
        Backings {
            map: HashMap::new(),
            copy_list: None,
            device: device.clone(),
        }
    }

    pub fn alloc(&mut self, id: BackingId, tier: Tier, bytes: u64) -> Result<()> {
        if self.map.contains_key(&id) {
            return Err(EngineError::Backing(
                id.to_string(),
                "already allocated".into(),
            ));
        }
        let bytes = usize::try_from(bytes)
            .map_err(|_| EngineError::OutOfMemory(format!("{bytes} bytes")))?;
        let what = format!("snapshot {id}");
        let memory = match tier {
            Tier::Device => Memory::Device(DeviceBuffer::alloc(&self.device, bytes, &what)?),
            Tier::Host => Memory::Host(PinnedBuffer::alloc(&self.device, bytes, &what)?),
        };
        self.map.insert(id, (tier, memory));
        Ok(())
    }

    pub fn free(&mut self, id: BackingId) -> Result<()> {
        let backing = self.map.remove(&id).ok_or_else(|| no_such(id))?;
        self.device.synchronize()?;
        drop(backing);
        Ok(())
    }

    /// Gathers pool pages into the backing (`save`) or scatters the backing into pool pages.
    pub fn copy_pages(
        &mut self,
        kernels: &Kernels,
        pool: &PoolPages,
        id: BackingId,
        copies: &[PageCopy],
        save: bool,
    ) -> Result<()> {
        let (_, memory) = self.map.get(&id).ok_or_else(|| no_such(id))?;
        check_copies(id, memory.bytes(), pool, copies)?;
        if copies.is_empty() {
            return Ok(());
        }
        let snapshot = memory.ptr();
        let list: Vec<u32> = copies
            .iter()
            .flat_map(|c| [c.snapshot_page, c.pool_page.0])
            .collect();
        let list_ptr = self.upload_list(&list)?;
        let args = PageCopies {
            pool: pool.pool.base(),
            snapshot,
            copies: list_ptr,
            count: copies.len(),
            pages_total: pool.pool.pages_total(),
            page_bytes: pool.pool.page_elems() * 2,
            layers: pool.layers,
        };
        kernels.copy_pages(&args, save)
    }

    /// Copies the list of page pairs to the device, growing its buffer when needed.
    fn upload_list(&mut self, list: &[u32]) -> Result<DPtr<u32>> {
        let bytes = list.len() * 4;
        if self.copy_list.as_ref().is_none_or(|b| b.bytes() < bytes) {
            // A queued copy may still read the old list.
            self.device.synchronize()?;
            let grown = bytes.next_power_of_two().max(4096);
            self.copy_list = Some(DeviceBuffer::alloc(&self.device, grown, "page copy lists")?);
        }
        let at = self.copy_list.as_ref().expect("allocated above").ptr();
        self.device.upload(list, at)?;
        Ok(at)
    }

    /// Copies one backing into another of the same size (a demotion) and waits for it.
    pub fn copy_whole(&mut self, from: BackingId, to: BackingId) -> Result<()> {
        let (_, source) = self.map.get(&from).ok_or_else(|| no_such(from))?;
        let (_, target) = self.map.get(&to).ok_or_else(|| no_such(to))?;
        if source.bytes() != target.bytes() {
            return Err(EngineError::Backing(
                to.to_string(),
                format!(
                    "holds {} bytes, the source {}",
                    target.bytes(),
                    source.bytes()
                ),
            ));
        }
        self.device
            .copy_bytes(source.ptr(), target.ptr(), source.bytes())?;
        self.device.synchronize()
    }

    /// The bytes of a backing, once the work queued before has finished.
    pub fn read(&self, id: BackingId) -> Result<Vec<u8>> {
        let (_, memory) = self.map.get(&id).ok_or_else(|| no_such(id))?;
        let mut bytes = vec![0u8; memory.bytes()];
        self.device.download(memory.ptr(), &mut bytes)?;
        Ok(bytes)
    }

    /// Bytes held in `tier`.
    pub fn tier_bytes(&self, tier: Tier) -> u64 {
        self.map
            .values()
            .filter(|(t, _)| *t == tier)
            .map(|(_, m)| m.bytes() as u64)
            .sum()
    }

    pub fn count(&self) -> usize {
        self.map.len()
    }
}

fn no_such(id: BackingId) -> EngineError {
    EngineError::Backing(id.to_string(), "no such buffer".into())
}

/// Checks that every copy names a page sequences may own and a page inside the backing.
fn check_copies(id: BackingId, bytes: usize, pool: &PoolPages, copies: &[PageCopy]) -> Result<()> {
    for copy in copies {
        let end = (copy.snapshot_page as usize + 1) * pool.page_bytes;
        if copy.pool_page.index() >= pool.pages || end > bytes {
            return Err(EngineError::Backing(
                id.to_string(),
                format!("copy {copy:?} is out of range"),
            ));
        }
    }
    Ok(())
}
