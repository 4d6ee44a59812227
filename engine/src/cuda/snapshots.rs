//! Snapshot buffers of the CUDA backend: each tier is an arena of snapshot pages, device memory
//! for the device tier and page-locked host memory mapped into the device's address space for
//! the host tier, allocated once at start-up and carved into pages like the working pool.
//!
//! A backing is a list of arena pages, so allocating and freeing one is bookkeeping: no
//! `cuMemAlloc`, `cuMemHostAlloc` or free on the step path, and nothing that synchronizes the
//! device. (An arena configured empty, as in tests and benchmarks, grows a chunk on demand.)
//! Pinning a host arena of tens of GiB takes seconds, and the driver serializes it with the
//! other threads' calls, so the host arena is reserved as plain memory and pinned a gibibyte at
//! a time on a thread of its own ([`HostArena`]) while the server starts and serves: its pages
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
/// work of one step never holds up other threads' calls for long.
const PIN_STEP_BYTES: usize = 256 << 20;

/// Host memory reserved whole and pinned (page-locked, mapped for the device) a step at a time
/// on a thread of its own, from the start: `pinned()` bytes are usable. With unified addressing
/// a registered range has the same address on the device as on the host, so the arena stays
/// one range a kernel can address from its base.
struct HostArena {
    host: *mut u8,
    layout: std::alloc::Layout,
    pinned: Arc<std::sync::atomic::AtomicUsize>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

// SAFETY: the memory is owned here; the pinning thread only registers ranges of it, and is
// joined before it is unregistered and freed.
unsafe impl Send for HostArena {}

impl HostArena {
    fn new(device: &Arc<Device>, bytes: usize) -> Result<HostArena> {
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
            layout,
            pinned: Arc::new(AtomicUsize::new(0)),
            stop: Arc::new(AtomicBool::new(false)),
            thread: None,
        };
        // The first step now, to learn the device address; the rest beside everything else.
        let first = bytes.min(PIN_STEP_BYTES);
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
                let step = (bytes - done).min(PIN_STEP_BYTES);
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
            at += PIN_STEP_BYTES;
        }
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.host, self.layout) };
    }
}

fn tier_name(tier: Tier) -> &'static str {
    match tier {
        Tier::Device => "device",
        Tier::Host => "host",
    }
}

/// One allocation carved into pages.
struct Chunk {
    memory: Memory,
    /// Pages nobody holds, taken from the end.
    free: Vec<u32>,
}

/// The pages of one tier.
struct Arena {
    tier: Tier,
    page_bytes: usize,
    chunks: Vec<Chunk>,
    /// Sized by configuration: it never grows, and running out is the caller's to handle.
    fixed: bool,
    /// Pages of a host arena still being pinned (its only chunk) already handed to `free`.
    adopted: usize,
}

impl Arena {
    /// An arena of `bytes`: device memory allocated now, or host memory pinned a step at a
    /// time beside everything else.
    fn new(device: &Arc<Device>, tier: Tier, bytes: u64, page_bytes: usize) -> Result<Arena> {
        let mut arena = Arena {
            tier,
            page_bytes,
            chunks: Vec::new(),
            fixed: false,
            adopted: 0,
        };
        let pages = usize::try_from(bytes).unwrap_or(usize::MAX) / page_bytes;
        if pages == 0 {
            return Ok(arena);
        }
        arena.fixed = true;
        match tier {
            Tier::Device => arena.grow(device, pages)?,
            Tier::Host => {
                let memory = Memory::Registered(HostArena::new(device, pages * page_bytes)?);
                arena.chunks.push(Chunk {
                    memory,
                    free: Vec::new(),
                });
                arena.adopt_pinned();
            }
        }
        Ok(arena)
    }

    /// Hands out the pages of a host arena pinned since the last call.
    fn adopt_pinned(&mut self) {
        let Some(Chunk {
            memory: Memory::Registered(host),
            free,
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
        self.chunks.push(Chunk {
            memory,
            free: (0..pages).rev().collect(),
        });
        Ok(())
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
        let taken = free.split_off(free.len() - pages);
        Ok(Some((chunk, taken)))
    }

    fn give(&mut self, chunk: usize, pages: Vec<u32>) {
        self.chunks[chunk].free.extend(pages);
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
    device: Arc<Device>,
}

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
    pub fn new(device: &Arc<Device>, sizes: ArenaSizes, page_bytes: usize) -> Result<Self> {
        device.bind()?;
        let arenas = [
            Arena::new(device, Tier::Device, sizes.device_bytes, page_bytes)?,
            Arena::new(device, Tier::Host, sizes.host_bytes, page_bytes)?,
        ];
        let copy_stream = device.context().new_stream()?;
        let compute_mark = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)?;
        Ok(Backings {
            map: HashMap::new(),
            arenas,
            copy_list: None,
            copy_stream,
            compute_mark,
            copies: Vec::new(),
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
        let list: Vec<u32> = copies
            .iter()
            .flat_map(|c| [backing.pages[c.snapshot_page as usize], c.pool_page.0])
            .collect();
        let list_ptr = self.upload_list(&list)?;
        let args = PageCopies {
            pool: pool.pool.base(),
            snapshot: base,
            copies: list_ptr,
            count: copies.len(),
            pages_total: pool.pool.pages_total(),
            page_bytes: pool.pool.page_elems() * 2,
            layers: pool.layers,
        };
        kernels.copy_pages(&args, save)
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
        for (start, len) in runs {
            let src = from_arena.page_ptr(source.chunk, source.pages[start]);
            let dst = to_arena.page_ptr(target.chunk, target.pages[start]);
            // SAFETY: both ranges lie inside their arenas' chunks (`len` pages from a page
            // held by the backing, contiguous by construction of the run).
            unsafe { sys::cuMemcpyAsync(dst.addr(), src.addr(), len * page_bytes, copy_stream) }
                .result()?;
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
    use super::contiguous_runs;

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
