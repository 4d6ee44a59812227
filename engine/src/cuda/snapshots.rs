//! Snapshot buffers of the CUDA backend: each tier is an arena of snapshot pages, device memory
//! for the device tier and page-locked host memory mapped into the device's address space for
//! the host tier, allocated once at start-up and carved into pages like the working pool.
//!
//! A backing is a list of arena pages, so allocating and freeing one is bookkeeping: no
//! `cuMemAlloc`, `cuMemHostAlloc` or free on the step path, and nothing that synchronizes the
//! device. (An arena configured empty, as in tests and benchmarks, grows a chunk on demand.)
//! Pinning a host arena of tens of GiB takes seconds, and the driver serializes it with the
//! other threads' calls, so the host arena is reserved as plain memory and pinned a gibibyte at
//! a time on a thread of its own (`HostArena`) while the server starts and serves: its pages
//! become usable as they are pinned, and until there are enough a demotion drops its snapshot
//! as it would with the host tier full.
//!
//! A save gathers pool pages into a backing and a restore scatters them back into any pages, by
//! one kernel launch each, queued on the backend's stream like every step: a later step sees
//! the copy done, and nothing waits for it on the host. A snapshot page has the CPU backend's
//! layout (per layer, K block then V block), so its size is what the store charges
//! (`KvGeometry::page_bytes`).
//!
//! A demotion (device backing to host backing) runs on a stream of its own, after the compute
//! stream's work queued before it (an event orders them), and is reported by
//! [`Backings::finished_copies`] once its end event has fired; the compute stream never waits
//! for it. Pages freed here are reused safely because every reader and writer of a page is
//! ordered: kernels on the compute stream by the stream, a demotion by the event it waits for
//! (everything queued before it) and by its caller, who frees its source only after the copy
//! was reported.

use std::collections::HashMap;
use std::sync::Arc;
use std::thread::JoinHandle;

use cache::{BackingId, PageClone, PageCopy, Tier};
use cudarc::driver::sys::{self, CUevent};
use cudarc::driver::{CudaStream, DriverError, result};

use super::device::{DPtr, Device, DeviceBuffer, PinnedBuffer};
use super::kernels::{Kernels, PageCopies};
use super::pool::KvPool;
use crate::backend::HostRun;
use crate::error::{EngineError, Result};

/// Bytes of a chunk an empty arena grows by.
const GROWTH_BYTES: usize = 64 << 20;

enum Memory {
    Device(DeviceBuffer),
    Host(PinnedBuffer),
    Registered(HostArena),
}

impl Memory {
    fn alloc(device: &Device, tier: Tier, bytes: usize) -> Result<Memory> {
        let what = format!("the {} snapshot arena", tier_name(tier));
        Ok(match tier {
            Tier::Device => Memory::Device(DeviceBuffer::alloc(device, bytes, &what)?),
            Tier::Host => Memory::Host(PinnedBuffer::alloc(device, bytes, &what)?),
            Tier::Disk => return Err(disk_is_not_memory()),
        })
    }

    fn ptr(&self) -> DPtr<u8> {
        match self {
            Memory::Device(b) => b.ptr(),
            Memory::Host(b) => b.ptr(),
            Memory::Registered(a) => a.ptr(),
        }
    }
}

/// Bytes pinned at a time by the thread that pins a host arena: short enough that the driver
/// work of one step never holds up other threads' calls for long. Rounded down to whole
/// snapshot pages: each step is a registration of its own, and a copy may not span two (the
/// driver refuses it as an invalid value), so no page may straddle a step's end.
const PIN_STEP_BYTES: usize = 256 << 20;

/// Host memory reserved whole and pinned (page-locked, mapped for the device) a step at a time
/// on a thread of its own, from the start: `pinned()` bytes are usable. With unified addressing
/// a registered range has the same address on the device as on the host, so the arena stays
/// one range a kernel can address from its base.
struct HostArena {
    host: *mut u8,
    /// Bytes of each registration: whole pages.
    step_bytes: usize,
    layout: std::alloc::Layout,
    pinned: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

// SAFETY: the memory is owned here; the pinning thread only registers ranges of it, and is
// joined before it is unregistered and freed.
unsafe impl Send for HostArena {}

impl HostArena {
    fn new(device: &Arc<Device>, bytes: usize, page_bytes: usize) -> Result<HostArena> {
        let step_bytes = (PIN_STEP_BYTES / page_bytes).max(1) * page_bytes;
        use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
        let oom = || EngineError::OutOfMemory(format!("the host snapshot arena of {bytes} bytes"));
        let layout = std::alloc::Layout::from_size_align(bytes, 2 << 20).map_err(|_| oom())?;
        // SAFETY: a non-zero size; freed in `drop` with the same layout. The pages are not
        // touched until pinned (the allocator maps them lazily).
        let host = unsafe { std::alloc::alloc(layout) };
        if host.is_null() {
            return Err(oom());
        }
        let mut arena = HostArena {
            host,
            step_bytes,
            layout,
            pinned: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
        // The first step now, to learn the device address; the rest beside everything else.
        let first = bytes.min(step_bytes);
        register(host, first).map_err(|e| {
            EngineError::OutOfMemory(format!(
                "pinning host memory for the host snapshot tier (snapshots.host_budget_bytes): {e}"
            ))
        })?;
        let mut mapped: sys::CUdeviceptr = 0;
        // SAFETY: the range was registered with DEVICEMAP just above.
        unsafe { sys::cuMemHostGetDevicePointer_v2(&mut mapped, host.cast(), 0) }.result()?;
        arena.pinned.store(first, Ordering::Release);
        if mapped != host as u64 {
            tracing::warn!(
                "the device maps pinned host memory elsewhere: the host snapshot tier keeps {first} bytes"
            );
            return Ok(arena);
        }
        let (pinned, stop, device) = (arena.pinned.clone(), arena.stop.clone(), device.clone());
        let base = host as usize;
        let pin = move || {
            let started = std::time::Instant::now();
            if let Err(e) = device.bind() {
                tracing::error!("pinning the host snapshot tier: {e}");
                return;
            }
            let mut done = first;
            while done < bytes && !stop.load(Ordering::Acquire) {
                let step = (bytes - done).min(step_bytes);
                if let Err(e) = register((base + done) as *mut u8, step) {
                    tracing::error!("pinning the host snapshot tier stopped at {done} bytes: {e}");
                    return;
                }
                done += step;
                pinned.store(done, Ordering::Release);
            }
            tracing::info!(
                "pinned {:.1} GiB of host memory for the host snapshot tier in {:.1} s",
                done as f64 / (1u64 << 30) as f64,
                started.elapsed().as_secs_f64()
            );
        };
        let thread = std::thread::Builder::new().name("snapserve-pin".into());
        arena.thread = Some(thread.spawn(pin).map_err(|e| {
            EngineError::OutOfMemory(format!("starting the thread that pins host memory: {e}"))
        })?);
        Ok(arena)
    }

    fn ptr(&self) -> DPtr<u8> {
        DPtr::from_addr(self.host as u64)
    }

    /// Bytes pinned so far, from the start.
    fn pinned(&self) -> usize {
        self.pinned.load(std::sync::atomic::Ordering::Acquire)
    }

    fn finished(&self) -> bool {
        self.thread.as_ref().is_none_or(JoinHandle::is_finished)
    }
}

/// Page-locks `bytes` at `host` and maps them for the device. The pages are faulted in first,
/// as transparent huge pages where the kernel has them, by plain writes: that part of pinning
/// needs no driver call, so other threads' CUDA calls do not wait for it.
fn register(host: *mut u8, bytes: usize) -> Result<()> {
    // SAFETY: a range this arena owns; advice only.
    unsafe { libc::madvise(host.cast(), bytes, libc::MADV_HUGEPAGE) };
    for offset in (0..bytes).step_by(4096) {
        // SAFETY: inside the range; nothing else reads it yet.
        unsafe { host.add(offset).write_volatile(0) };
    }
    let flags = sys::CU_MEMHOSTREGISTER_DEVICEMAP | sys::CU_MEMHOSTREGISTER_PORTABLE;
    // SAFETY: a range of memory this arena owns, registered once.
    unsafe { sys::cuMemHostRegister_v2(host.cast(), bytes, flags) }.result()?;
    Ok(())
}

impl Drop for HostArena {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
        let pinned = self.pinned();
        let mut at = 0;
        while at < pinned {
            // SAFETY: each step was registered at this offset; nothing uses it any more (the
            // backend waited for its streams before dropping its backings).
            let _ = unsafe { sys::cuMemHostUnregister(self.host.add(at).cast()) };
            at += self.step_bytes;
        }
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.host, self.layout) };
    }
}

fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host",
        Tier::Disk => "disk",
    }
}

/// One allocation carved into pages.
struct Chunk {
    memory: Memory,
    /// Pages nobody holds, taken from the end.
    free: Vec<u32>,
    /// Device memory: the block sums of every page (`page_blocks` each), written by the saves
    /// and demotions that fill a page and checked by the restores that read it.
    sums: DeviceBuffer,
}

/// The pages of one tier.
struct Arena {
    tier: Tier,
    page_bytes: usize,
    /// Checksummed blocks of one page: each layer's K and V.
    page_blocks: usize,
    chunks: Vec<Chunk>,
    /// Sized by configuration: it never grows, and running out is the caller's to handle.
    fixed: bool,
    /// Pages of a host arena still being pinned (its only chunk) already handed to `free`.
    adopted: usize,
    /// Pages per registration of a pinned host arena (a copy may not span two); `usize::MAX`
    /// for memory allocated whole.
    run_break: usize,
}

impl Arena {
    /// An arena of `bytes`: device memory allocated now, or host memory pinned a step at a
    /// time beside everything else.
    fn new(
        device: &Arc<Device>,
        tier: Tier,
        bytes: u64,
        page_bytes: usize,
        page_blocks: usize,
    ) -> Result<Arena> {
        let mut arena = Arena {
            tier,
            page_bytes,
            page_blocks,
            chunks: Vec::new(),
            fixed: false,
            adopted: 0,
            run_break: usize::MAX,
        };
        let pages = usize::try_from(bytes).unwrap_or(usize::MAX) / page_bytes;
        if pages == 0 {
            return Ok(arena);
        }
        arena.fixed = true;
        match tier {
            Tier::Device => arena.grow(device, pages)?,
            Tier::Host => {
                let host = HostArena::new(device, pages * page_bytes, page_bytes)?;
                arena.run_break = host.step_bytes / page_bytes;
                let memory = Memory::Registered(host);
                let sums = arena.sums_for(device, pages)?;
                arena.chunks.push(Chunk {
                    memory,
                    free: Vec::new(),
                    sums,
                });
                arena.adopt_pinned();
            }
            Tier::Disk => return Err(disk_is_not_memory()),
        }
        Ok(arena)
    }

    /// Hands out the pages of a host arena pinned since the last call.
    fn adopt_pinned(&mut self) {
        let Some(Chunk {
            memory: Memory::Registered(host),
            free,
            ..
        }) = self.chunks.first_mut()
        else {
            return;
        };
        let pinned = host.pinned() / self.page_bytes;
        if pinned > self.adopted {
            free.extend((self.adopted as u32..pinned as u32).rev());
            self.adopted = pinned;
        }
    }

    /// Whether part of the arena is still being pinned.
    fn pinning(&self) -> bool {
        matches!(self.chunks.first(), Some(Chunk { memory: Memory::Registered(host), .. }) if !host.finished())
    }

    fn grow(&mut self, device: &Device, pages: usize) -> Result<()> {
        let pages = u32::try_from(pages)
            .map_err(|_| EngineError::OutOfMemory(format!("{pages} snapshot pages")))?;
        let memory = Memory::alloc(device, self.tier, pages as usize * self.page_bytes)?;
        let sums = self.sums_for(device, pages as usize)?;
        self.chunks.push(Chunk {
            memory,
            free: (0..pages).rev().collect(),
            sums,
        });
        Ok(())
    }

    /// The block sums of a chunk of `pages` pages.
    fn sums_for(&self, device: &Device, pages: usize) -> Result<DeviceBuffer> {
        let what = format!("the {} snapshot arena's checksums", tier_name(self.tier));
        DeviceBuffer::alloc(device, (pages * self.page_blocks * 8).max(8), &what)
    }

    /// Where the block sums of page `page` of chunk `chunk` are.
    fn sums_ptr(&self, chunk: usize, page: u32) -> DPtr<u64> {
        self.chunks[chunk]
            .sums
            .ptr::<u64>()
            .offset(page as usize * self.page_blocks)
    }

    /// `pages` pages of one chunk, or `None` when no chunk has that many free.
    fn take(&mut self, device: &Device, pages: usize) -> Result<Option<(usize, Vec<u32>)>> {
        self.adopt_pinned();
        let found = self.chunks.iter().position(|c| c.free.len() >= pages);
        let chunk = match found {
            Some(chunk) => chunk,
            None if self.fixed => return Ok(None),
            None => {
                self.grow(device, pages.max(GROWTH_BYTES / self.page_bytes))?;
                self.chunks.len() - 1
            }
        };
        let free = &mut self.chunks[chunk].free;
        let mut taken = free.split_off(free.len() - pages);
        // The free list hands out its lowest pages last-in first: in ascending order a fresh
        // arena's pages are contiguous, so copies and disk reads move long runs.
        taken.reverse();
        Ok(Some((chunk, taken)))
    }

    fn give(&mut self, chunk: usize, pages: Vec<u32>) {
        // Back in the order `take` reverses.
        self.chunks[chunk].free.extend(pages.into_iter().rev());
    }

    fn free_pages(&self) -> usize {
        self.chunks.iter().map(|c| c.free.len()).sum()
    }

    /// The address of page `page` of chunk `chunk`.
    fn page_ptr(&self, chunk: usize, page: u32) -> DPtr<u8> {
        self.chunks[chunk]
            .memory
            .ptr()
            .offset(page as usize * self.page_bytes)
    }
}

/// One snapshot's pages.
struct Backing {
    tier: Tier,
    chunk: usize,
    pages: Vec<u32>,
}

/// A demotion's copy on the copy stream.
struct Copy {
    from: BackingId,
    to: BackingId,
    done: CUevent,
}

/// The backings of one backend, their arenas, and the copies between them.
pub struct Backings {
    map: HashMap<BackingId, Backing>,
    /// Device tier, host tier.
    arenas: [Arena; 2],
    copy_list: Option<DeviceBuffer>,
    copy_stream: Arc<CudaStream>,
    /// Recorded on the compute stream when a demotion starts; the copy stream waits for it.
    compute_mark: CUevent,
    copies: Vec<Copy>,
    /// One flag per restore queued since the last `restore_verdicts`, set by a restore that
    /// read a block whose sum did not match.
    restore_flags: DeviceBuffer,
    restores: usize,
    device: Arc<Device>,
}

/// Restores one step may queue before their verdicts are collected.
const MAX_RESTORES_PER_STEP: usize = 4096;

// SAFETY: the events are owned here and used from whichever one thread owns the backend.
unsafe impl Send for Backings {}

/// The pool a copy goes to or comes from.
pub struct PoolPages<'a> {
    pub pool: &'a KvPool,
    /// Pages sequences may own (the spare page is not one).
    pub pages: usize,
    /// Bytes of one snapshot page.
    pub page_bytes: usize,
    pub layers: usize,
}

/// How many bytes each arena starts with.
#[derive(Debug, Clone, Copy, Default)]
pub struct ArenaSizes {
    pub device_bytes: u64,
    pub host_bytes: u64,
}

impl Backings {
    pub fn new(
        device: &Arc<Device>,
        sizes: ArenaSizes,
        page_bytes: usize,
        page_blocks: usize,
    ) -> Result<Self> {
        device.bind()?;
        let arenas = [
            Arena::new(
                device,
                Tier::Device,
                sizes.device_bytes,
                page_bytes,
                page_blocks,
            )?,
            Arena::new(
                device,
                Tier::Host,
                sizes.host_bytes,
                page_bytes,
                page_blocks,
            )?,
        ];
        let restore_flags =
            DeviceBuffer::alloc(device, MAX_RESTORES_PER_STEP * 4, "restore verdicts")?;
        let copy_stream = device.context().new_stream()?;
        let compute_mark = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        Ok(Backings {
            map: HashMap::new(),
            arenas,
            copy_list: None,
            copy_stream,
            compute_mark,
            copies: Vec::new(),
            restore_flags,
            restores: 0,
            device: device.clone(),
        })
    }

    /// Waits until every arena's memory is there (the host's may still be being pinned).
    pub fn wait_until_allocated(&mut self) {
        for arena in &mut self.arenas {
            while arena.pinning() {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            arena.adopt_pinned();
        }
    }

    fn arena(&mut self, tier: Tier) -> &mut Arena {
        &mut self.arenas[tier as usize]
    }

    pub fn alloc(&mut self, id: BackingId, tier: Tier, bytes: u64) -> Result<()> {
        if tier == Tier::Disk {
            return Err(disk_is_not_memory());
        }
        if self.map.contains_key(&id) {
            return Err(EngineError::Backing(
                id.to_string(),
                "already allocated".into(),
            ));
        }
        let page_bytes = self.arenas[0].page_bytes as u64;
        let pages = usize::try_from(bytes.div_ceil(page_bytes))
            .map_err(|_| EngineError::OutOfMemory(format!("{bytes} bytes")))?;
        let device = self.device.clone();
        let arena = self.arena(tier);
        let Some((chunk, pages)) = arena.take(&device, pages)? else {
            let pinning = if arena.pinning() {
                " (its memory is still being pinned)"
            } else {
                ""
            };
            return Err(EngineError::OutOfMemory(format!(
                "snapshot {id}: {pages} pages in the {} tier's arena, {} free{pinning}",
                tier_name(tier),
                arena.free_pages()
            )));
        };
        self.map.insert(id, Backing { tier, chunk, pages });
        Ok(())
    }

    /// Returns a backing's pages to its arena. Kernels queued before still read or write them
    /// in stream order; a copy still running on them is waited for first (callers free a
    /// demotion's buffers only once it was reported, so this is a safety net).
    pub fn free(&mut self, id: BackingId) -> Result<()> {
        if !self.map.contains_key(&id) {
            return Err(no_such(id));
        }
        if let Some(at) = self.copies.iter().position(|c| c.from == id || c.to == id) {
            // SAFETY: an event created here and not yet destroyed.
            unsafe { result::event::synchronize(self.copies[at].done) }?;
        }
        let backing = self.map.remove(&id).expect("checked above");
        self.arena(backing.tier).give(backing.chunk, backing.pages);
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
        let backing = self.map.get(&id).ok_or_else(|| no_such(id))?;
        check_copies(id, backing.pages.len(), pool, copies)?;
        if copies.is_empty() {
            return Ok(());
        }
        let arena = &self.arenas[backing.tier as usize];
        let base = arena.page_ptr(backing.chunk, 0);
        let sums = arena.sums_ptr(backing.chunk, 0);
        let list: Vec<u32> = copies
            .iter()
            .flat_map(|c| [backing.pages[c.snapshot_page as usize], c.pool_page.0])
            .collect();
        let bad = if save {
            DPtr::NULL
        } else {
            if self.restores == MAX_RESTORES_PER_STEP {
                return Err(EngineError::InvalidStep(format!(
                    "more than {MAX_RESTORES_PER_STEP} restores before their verdicts were read"
                )));
            }
            let flag = self.restore_flags.ptr::<u32>().offset(self.restores);
            self.device.upload(&[0u32], flag)?;
            flag
        };
        let list_ptr = self.upload_list(&list)?;
        let args = PageCopies {
            pool: pool.pool.base(),
            snapshot: base,
            copies: list_ptr,
            count: copies.len(),
            pages_total: pool.pool.pages_total(),
            page_bytes: pool.pool.page_elems() * 2,
            layers: pool.layers,
            sums,
            bad,
        };
        kernels.copy_pages(&args, save)?;
        if !save {
            self.restores += 1;
        }
        Ok(())
    }

    /// Whether each restore queued since the last call read intact blocks, in order; waits for
    /// them (and everything queued before) to run.
    pub fn restore_verdicts(&mut self) -> Result<Vec<bool>> {
        let count = std::mem::take(&mut self.restores);
        if count == 0 {
            return Ok(Vec::new());
        }
        let mut flags = vec![0u32; count];
        self.device
            .download(self.restore_flags.ptr::<u32>(), &mut flags)?;
        Ok(flags.into_iter().map(|bad| bad == 0).collect())
    }

    /// The block sums of a backing, in snapshot order.
    pub fn sums(&mut self, id: BackingId) -> Result<Vec<u64>> {
        self.device.synchronize()?;
        self.copy_stream.synchronize()?;
        let backing = self.map.get(&id).ok_or_else(|| no_such(id))?;
        let arena = &self.arenas[backing.tier as usize];
        let blocks = arena.page_blocks;
        let chunk_sums = &arena.chunks[backing.chunk].sums;
        let mut all = vec![0u64; chunk_sums.bytes() / 8];
        self.device.download(chunk_sums.ptr::<u64>(), &mut all)?;
        Ok(backing
            .pages
            .iter()
            .flat_map(|&page| all[page as usize * blocks..][..blocks].iter().copied())
            .collect())
    }

    /// Sets the block sums of a backing filled from outside (a file).
    pub fn set_sums(&mut self, id: BackingId, sums: &[u64]) -> Result<()> {
        let backing = self.map.get(&id).ok_or_else(|| no_such(id))?;
        let arena = &self.arenas[backing.tier as usize];
        let blocks = arena.page_blocks;
        if sums.len() != backing.pages.len() * blocks {
            return Err(EngineError::Backing(
                id.to_string(),
                format!(
                    "has {} blocks, {} sums given",
                    backing.pages.len() * blocks,
                    sums.len()
                ),
            ));
        }
        // One upload per run of consecutive pages (a fresh arena's backing is one run): each
        // upload from pageable memory costs the driver a staging round trip.
        let mut start = 0;
        while start < backing.pages.len() {
            let first = backing.pages[start];
            let len = backing.pages[start..]
                .iter()
                .enumerate()
                .take_while(|&(i, &page)| page == first + i as u32)
                .count();
            self.device.upload(
                &sums[start * blocks..(start + len) * blocks],
                arena.sums_ptr(backing.chunk, first),
            )?;
            start += len;
        }
        // The uploads read pageable memory, staged before they return; a sync makes the sums
        // visible to every stream (the copy stream's demotions included).
        self.device.synchronize()
    }

    /// The host memory of a host-tier backing, in snapshot order, adjacent pages merged.
    pub fn host_runs(&mut self, id: BackingId) -> Result<Vec<HostRun>> {
        let backing = self.map.get(&id).ok_or_else(|| no_such(id))?;
        if backing.tier != Tier::Host {
            return Err(EngineError::Backing(
                id.to_string(),
                "is not in host memory".into(),
            ));
        }
        let arena = &self.arenas[Tier::Host as usize];
        let mut runs: Vec<HostRun> = Vec::new();
        for &page in &backing.pages {
            // With unified addressing a mapped host page has the same address on both sides.
            let ptr = arena.page_ptr(backing.chunk, page).addr() as *mut u8;
            match runs.last_mut() {
                Some(run) if run.ptr.wrapping_add(run.len) == ptr => run.len += arena.page_bytes,
                _ => runs.push(HostRun {
                    ptr,
                    len: arena.page_bytes,
                }),
            }
        }
        Ok(runs)
    }

    /// XORs one byte of a backing with `mask` (fault injection), after the work queued before.
    pub fn flip_byte(&mut self, id: BackingId, offset: u64, mask: u8) -> Result<()> {
        self.device.synchronize()?;
        self.copy_stream.synchronize()?;
        let backing = self.map.get(&id).ok_or_else(|| no_such(id))?;
        let arena = &self.arenas[backing.tier as usize];
        let (page, within) = (
            offset / arena.page_bytes as u64,
            (offset % arena.page_bytes as u64) as usize,
        );
        let &arena_page = usize::try_from(page)
            .ok()
            .and_then(|p| backing.pages.get(p))
            .ok_or_else(|| EngineError::Backing(id.to_string(), format!("no byte {offset}")))?;
        let at = arena.page_ptr(backing.chunk, arena_page).offset(within);
        let mut byte = [0u8];
        self.device.download(at, &mut byte)?;
        byte[0] ^= mask;
        self.device.upload(&byte, at)?;
        self.device.synchronize()
    }

    /// Copies pool pages onto other pool pages, every layer's K and V.
    pub fn clone_pages(
        &mut self,
        kernels: &Kernels,
        pool: &PoolPages,
        clones: &[PageClone],
    ) -> Result<()> {
        if let Some(bad) = clones
            .iter()
            .find(|c| c.from.index() >= pool.pages || c.to.index() >= pool.pages || c.from == c.to)
        {
            return Err(EngineError::InvalidStep(format!(
                "page clone {bad:?} is out of range or onto itself ({} pages)",
                pool.pages
            )));
        }
        if clones.is_empty() {
            return Ok(());
        }
        let list: Vec<u32> = clones.iter().flat_map(|c| [c.from.0, c.to.0]).collect();
        let list_ptr = self.upload_list(&list)?;
        let args = PageCopies {
            pool: pool.pool.base(),
            snapshot: pool.pool.base(),
            copies: list_ptr,
            count: clones.len(),
            pages_total: pool.pool.pages_total(),
            page_bytes: pool.pool.page_elems() * 2,
            layers: pool.layers,
            sums: DPtr::NULL,
            bad: DPtr::NULL,
        };
        kernels.clone_pages(&args)
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

    /// Starts copying one backing into another of as many pages (a demotion) on the copy
    /// stream, after everything queued on the compute stream so far. Reported by
    /// [`Backings::finished_copies`].
    pub fn start_copy(&mut self, from: BackingId, to: BackingId) -> Result<()> {
        let source = self.map.get(&from).ok_or_else(|| no_such(from))?;
        let target = self.map.get(&to).ok_or_else(|| no_such(to))?;
        if source.pages.len() != target.pages.len() {
            return Err(EngineError::Backing(
                to.to_string(),
                format!(
                    "holds {} pages, the source {}",
                    target.pages.len(),
                    source.pages.len()
                ),
            ));
        }
        let copy_stream = self.copy_stream.cu_stream();
        // SAFETY: events created here; both streams belong to this backend's context.
        unsafe {
            result::event::record(self.compute_mark, self.device.stream().cu_stream())?;
            result::stream::wait_event(
                copy_stream,
                self.compute_mark,
                sys::CUevent_wait_flags::CU_EVENT_WAIT_DEFAULT,
            )?;
        }
        let page_bytes = self.arenas[0].page_bytes;
        let (from_arena, to_arena) = (
            &self.arenas[source.tier as usize],
            &self.arenas[target.tier as usize],
        );
        let runs = contiguous_runs(&source.pages, &target.pages);
        let breaks = (from_arena.run_break, to_arena.run_break);
        let runs = split_at_registrations(runs, &source.pages, &target.pages, breaks);
        for (start, len) in runs {
            let src = from_arena.page_ptr(source.chunk, source.pages[start]);
            let dst = to_arena.page_ptr(target.chunk, target.pages[start]);
            // SAFETY: both ranges lie inside their arenas' chunks (`len` pages from a page
            // held by the backing, contiguous by construction of the run).
            unsafe { sys::cuMemcpyAsync(dst.addr(), src.addr(), len * page_bytes, copy_stream) }
                .result()
                .map_err(|e| {
                    EngineError::Backing(
                        to.to_string(),
                        format!(
                            "copying {len} pages from {:#x} to {:#x}: {e}",
                            src.addr(),
                            dst.addr()
                        ),
                    )
                })?;
            // The block sums travel with the bytes: the restores from the new tier check them.
            let blocks = from_arena.page_blocks;
            let src = from_arena.sums_ptr(source.chunk, source.pages[start]);
            let dst = to_arena.sums_ptr(target.chunk, target.pages[start]);
            // SAFETY: `len` pages' sums inside both chunks' sum buffers, as above.
            unsafe { sys::cuMemcpyAsync(dst.addr(), src.addr(), len * blocks * 8, copy_stream) }
                .result()
                .map_err(|e| {
                    EngineError::Backing(
                        to.to_string(),
                        format!(
                            "copying {len} pages' sums from {:#x} to {:#x}: {e}",
                            src.addr(),
                            dst.addr()
                        ),
                    )
                })?;
        }
        let done = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        // SAFETY: a fresh event, recorded on this backend's copy stream.
        if let Err(e) = unsafe { result::event::record(done, copy_stream) } {
            // The copies queued may still run: wait for them before the buffers can go.
            let _ = self.copy_stream.synchronize();
            // SAFETY: created above, never recorded.
            let _ = unsafe { result::event::destroy(done) };
            return Err(e.into());
        }
        self.copies.push(Copy { from, to, done });
        Ok(())
    }

    /// The copies that have ended since the last call, by target; with `wait`, every one.
    pub fn finished_copies(&mut self, wait: bool) -> Vec<(BackingId, Result<()>)> {
        let mut ended = Vec::new();
        let mut index = 0;
        while index < self.copies.len() {
            let done = self.copies[index].done;
            // SAFETY: events created here and not yet destroyed.
            let state = unsafe {
                if wait {
                    result::event::synchronize(done)
                } else {
                    result::event::query(done)
                }
            };
            let outcome = match state {
                Err(DriverError(sys::CUresult::CUDA_ERROR_NOT_READY)) => {
                    index += 1;
                    continue;
                }
                Ok(()) => Ok(()),
                Err(e) => Err(EngineError::from(e)),
            };
            let copy = self.copies.swap_remove(index);
            // SAFETY: fired (or failed); destroyed once.
            let _ = unsafe { result::event::destroy(copy.done) };
            ended.push((copy.to, outcome));
        }
        ended
    }

    /// The bytes of a backing, once the work queued before (copies included) has finished.
    pub fn read(&mut self, id: BackingId) -> Result<Vec<u8>> {
        self.copy_stream.synchronize()?;
        self.device.synchronize()?;
        let backing = self.map.get(&id).ok_or_else(|| no_such(id))?;
        let arena = &self.arenas[backing.tier as usize];
        let page_bytes = arena.page_bytes;
        let mut bytes = vec![0u8; backing.pages.len() * page_bytes];
        for (out, &page) in bytes.chunks_mut(page_bytes).zip(&backing.pages) {
            self.device
                .download(arena.page_ptr(backing.chunk, page), out)?;
        }
        Ok(bytes)
    }

    /// Bytes held by backings in `tier`.
    pub fn tier_bytes(&self, tier: Tier) -> u64 {
        let page_bytes = self.arenas[0].page_bytes as u64;
        self.map
            .values()
            .filter(|b| b.tier == tier)
            .map(|b| b.pages.len() as u64 * page_bytes)
            .sum()
    }

    pub fn count(&self) -> usize {
        self.map.len()
    }

    pub fn ids(&self) -> Vec<BackingId> {
        self.map.keys().copied().collect()
    }
}

impl Drop for Backings {
    fn drop(&mut self) {
        // The arenas are freed next: no copy may still run on them.
        let _ = self.device.bind();
        let _ = self.copy_stream.synchronize();
        for copy in self.copies.drain(..) {
            // SAFETY: created here, destroyed once.
            let _ = unsafe { result::event::destroy(copy.done) };
        }
        // SAFETY: created in `new`, destroyed once.
        let _ = unsafe { result::event::destroy(self.compute_mark) };
    }
}

/// Cuts runs where either side crosses into another registration of a pinned host arena
/// (every `breaks` pages from its start): the driver refuses a copy spanning two.
fn split_at_registrations(
    runs: Vec<(usize, usize)>,
    from: &[u32],
    to: &[u32],
    breaks: (usize, usize),
) -> Vec<(usize, usize)> {
    let crosses = |pages: &[u32], every: usize, i: usize| {
        every != usize::MAX && (pages[i] as usize).is_multiple_of(every)
    };
    let mut out = Vec::with_capacity(runs.len());
    for (start, len) in runs {
        let mut at = start;
        for i in start + 1..start + len {
            if crosses(from, breaks.0, i) || crosses(to, breaks.1, i) {
                out.push((at, i - at));
                at = i;
            }
        }
        out.push((at, start + len - at));
    }
    out
}

/// Splits a page-to-page copy into runs contiguous on both sides: (first index, length).
fn contiguous_runs(from: &[u32], to: &[u32]) -> Vec<(usize, usize)> {
    let mut runs: Vec<(usize, usize)> = Vec::new();
    for i in 0..from.len() {
        match runs.last_mut() {
            Some((start, len))
                if from[*start] + *len as u32 == from[i] && to[*start] + *len as u32 == to[i] =>
            {
                *len += 1
            }
            _ => runs.push((i, 1)),
        }
    }
    runs
}

/// The disk tier's files are the engine actor's (`engine::disk`), not the backend's.
fn disk_is_not_memory() -> EngineError {
    EngineError::Backing(
        "the disk tier".into(),
        "holds files, not memory the backend allocates".into(),
    )
}

fn no_such(id: BackingId) -> EngineError {
    EngineError::Backing(id.to_string(), "no such buffer".into())
}

/// Checks that every copy names a page sequences may own and a page of the backing.
fn check_copies(id: BackingId, pages: usize, pool: &PoolPages, copies: &[PageCopy]) -> Result<()> {
    for copy in copies {
        if copy.pool_page.index() >= pool.pages || copy.snapshot_page as usize >= pages {
            return Err(EngineError::Backing(
                id.to_string(),
                format!("copy {copy:?} is out of range"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{contiguous_runs, split_at_registrations};

    #[test]
    fn runs_are_cut_where_a_side_enters_another_registration() {
        let from = [0, 1, 2, 3, 4, 5];
        let to = [6, 7, 8, 9, 10, 11];
        let runs = contiguous_runs(&from, &to);
        assert_eq!(runs, vec![(0, 6)]);
        assert_eq!(
            split_at_registrations(runs.clone(), &from, &to, (usize::MAX, 4)),
            vec![(0, 2), (2, 4)],
            "page 8 starts the target's second registration"
        );
        assert_eq!(
            split_at_registrations(runs.clone(), &from, &to, (3, 4)),
            vec![(0, 2), (2, 1), (3, 3)]
        );
        assert_eq!(
            split_at_registrations(runs, &from, &to, (usize::MAX, usize::MAX)),
            vec![(0, 6)]
        );
    }

    #[test]
    fn copies_run_as_far_as_both_sides_are_contiguous() {
        assert_eq!(contiguous_runs(&[], &[]), vec![]);
        assert_eq!(contiguous_runs(&[4, 5, 6], &[9, 10, 11]), vec![(0, 3)]);
        assert_eq!(
            contiguous_runs(&[4, 5, 6, 2, 3], &[9, 10, 7, 8, 9]),
            vec![(0, 2), (2, 1), (3, 2)]
        );
    }
}
