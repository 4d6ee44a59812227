//! The CUDA device a backend runs on, and the raw memory everything else is built from.
//!
//! Owns the context (the device's primary context), the one stream all of a backend's work is
//! ordered on, and the launch of a compiled kernel. cudarc's per-buffer event tracking is turned
//! off: a single stream already orders everything, and CUDA graph capture fails with it on.
//! Memory is taken as plain device allocations (`cuMemAlloc`) and page-locked, device-mapped
//! host allocations, never managed memory. [`DPtr`] is a typed device address with no lifetime:
//! a backend owns both its buffers and every launch that reads them, and synchronizes before a
//! buffer is dropped.

use std::ffi::c_void;
use std::marker::PhantomData;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use cudarc::driver::sys::{self, CUdeviceptr, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream, DriverError, result};

use crate::error::{EngineError, Result};

/// The most arguments one kernel takes.
pub(super) const MAX_ARGS: usize = 32;

/// The device and stream of one backend.
pub struct Device {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    pub name: String,
    pub compute_capability: (i32, i32),
    pub multiprocessors: u32,
    /// The most shared memory one block may ask for (opting in past the 48 KB default).
    pub max_block_shared: usize,
    pub total_bytes: u64,
    /// Kernels launched (or captured into a graph) through [`Device::launch`] so far.
    launches: AtomicUsize,
    /// Launches are programmatic dependents of the kernel before them.
    programmatic: AtomicBool,
}

impl Device {
    /// Opens device `ordinal`, or says why there is none: no driver library, no GPU, or one
    /// older than Ampere (bf16 tensor cores are needed).
    pub fn open(ordinal: usize) -> Result<Arc<Device>> {
        check_libraries()?;
        let unavailable = |e: DriverError| EngineError::CudaUnavailable(format!("{e}"));
        let count = CudaContext::device_count().map_err(unavailable)?;
        if ordinal >= count.max(0) as usize {
            return Err(EngineError::CudaUnavailable(format!(
                "device {ordinal} asked for, {count} present"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(unavailable)?;
        // SAFETY: no cudarc slice of this context exists yet; the backend orders its work on
        // one stream itself.
        unsafe { ctx.disable_event_tracking() };
        let compute_capability = ctx.compute_capability()?;
        if compute_capability.0 < 8 {
            return Err(EngineError::CudaUnavailable(format!(
                "{} has compute capability {}.{}; snapserve needs 8.0 or newer (bf16 tensor cores)",
                ctx.name()?,
                compute_capability.0,
                compute_capability.1
            )));
        }
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?
            as u32;
        let max_block_shared = ctx.attribute(
            sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
        )? as usize;
        Ok(Arc::new(Device {
            name: ctx.name()?,
            max_block_shared,
            total_bytes: ctx.total_mem()? as u64,
            stream: ctx.new_stream()?,
            ctx,
            compute_capability,
            multiprocessors,
            launches: AtomicUsize::new(0),
            programmatic: AtomicBool::new(compute_capability.0 >= 9),
        }))
    }

    /// NVRTC's name for the architecture, e.g. `sm_90`.
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }

    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// Makes this device's context current on the calling thread (the backend may move between
    /// threads between calls).
    pub fn bind(&self) -> Result<()> {
        Ok(self.ctx.bind_to_thread()?)
    }

    /// CUDA's ordinal of this device.
    pub fn ordinal(&self) -> usize {
        self.ctx.ordinal()
    }

    /// Lets this context's kernels read and write `peer`'s memory (tensor parallelism's
    /// exchanges). Ranks on one device share its context and need nothing.
    pub fn enable_peer_access(&self, peer: &Device) -> Result<()> {
        if peer.ordinal() == self.ordinal() {
            return Ok(());
        }
        let mut can = 0;
        // SAFETY: both devices are live handles; `can` is written by the call.
        unsafe { sys::cuDeviceCanAccessPeer(&mut can, self.ctx.cu_device(), peer.ctx.cu_device()) }
            .result()?;
        if can == 0 {
            return Err(EngineError::TensorParallel(format!(
                "device {} cannot access device {}'s memory (no NVLink or PCIe peer path), which \
                 the tensor-parallel exchanges need",
                self.ordinal(),
                peer.ordinal()
            )));
        }
        self.bind()?;
        // SAFETY: this context is current; the peer context lives as long as `peer`.
        match unsafe { sys::cuCtxEnablePeerAccess(peer.ctx.cu_ctx(), 0) } {
            sys::CUresult::CUDA_SUCCESS | sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED => {
                Ok(())
            }
            other => Err(other.result().unwrap_err().into()),
        }
    }

    /// Bytes of device memory free right now.
    pub fn free_bytes(&self) -> Result<u64> {
        Ok(self.ctx.mem_get_info()?.0 as u64)
    }

    pub fn synchronize(&self) -> Result<()> {
        Ok(self.stream.synchronize()?)
    }

    /// Waits for queued work, for use in `drop`: a failure there has no caller to go to, so the
    /// context keeps it.
    pub fn wait_idle(&self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        self.ctx.record_err(self.stream.synchronize());
    }

    /// Kernels launched (or captured) through [`Device::launch`] so far; cuBLAS's are not.
    pub fn launches(&self) -> usize {
        self.launches.load(Ordering::Relaxed)
    }

    /// Launches `func` on the stream with `block` threads per block.
    pub fn launch(
        &self,
        func: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        args: &Args,
    ) -> Result<()> {
        self.launch_with_shared(func, grid, block, 0, args)
    }

    /// [`Device::launch`] with `shared_bytes` of dynamic shared memory a block (above 48 KiB
    /// the function must have been allowed them, see [`Device::allow_shared`]).
    pub fn launch_with_shared(
        &self,
        func: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        args: &Args,
    ) -> Result<()> {
        self.launch_clustered(func, grid, block, shared_bytes, 1, args)
    }

    /// Whether the device runs thread block clusters (sm_90 and newer).
    pub fn has_clusters(&self) -> bool {
        self.compute_capability.0 >= 9
    }

    /// [`Device::launch_with_shared`] in clusters of `cluster` blocks along x (1: no cluster;
    /// more needs [`Device::has_clusters`], at most 8, and a grid whose x it divides).
    pub fn launch_clustered(
        &self,
        func: &CudaFunction,
        grid: (u32, u32, u32),
        block: u32,
        shared_bytes: u32,
        cluster: u32,
        args: &Args,
    ) -> Result<()> {
        debug_assert!(cluster == 1 || (self.has_clusters() && grid.0.is_multiple_of(cluster)));
        self.launches.fetch_add(1, Ordering::Relaxed);
        let mut params = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
        for (param, word) in params.iter_mut().zip(&args.words[..args.len]) {
            *param = word as *const u64 as *mut c_void;
        }
        let programmatic = self.programmatic.load(Ordering::Relaxed);
        if !programmatic && cluster == 1 {
            // SAFETY: each kernel's typed wrapper in `kernels` passes the arguments its source
            // declares, in order; every word outlives the call, which copies them.
            unsafe {
                result::launch_kernel(
                    func.cu_function(),
                    grid,
                    (block, 1, 1),
                    shared_bytes,
                    self.stream.cu_stream(),
                    &mut params[..args.len],
                )
            }?;
            return Ok(());
        }
        let attribute = |id| sys::CUlaunchAttribute {
            id,
            pad: [0; 4],
            // SAFETY: an all-zero value is a valid union; the field set is the one `id` names.
            value: unsafe { std::mem::zeroed() },
        };
        // On the stack: a step launches hundreds of kernels.
        let mut attributes = [
            attribute(
                sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            ),
            attribute(sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION),
        ];
        attributes[0].value.programmaticStreamSerializationAllowed = programmatic as i32;
        attributes[1].value.clusterDim.x = cluster;
        attributes[1].value.clusterDim.y = 1;
        attributes[1].value.clusterDim.z = 1;
        // The attributes in use: the programmatic one, the cluster one, or both.
        let used = match (programmatic, cluster > 1) {
            (true, true) => &mut attributes[..],
            (true, false) => &mut attributes[..1],
            (false, _) => &mut attributes[1..],
        };
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared_bytes,
            hStream: self.stream.cu_stream(),
            attrs: used.as_mut_ptr(),
            numAttrs: used.len() as u32,
        };
        // SAFETY: as above; `config` and its attributes outlive the call.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                func.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()?;
        Ok(())
    }

    /// Whether kernels launch as programmatic dependents of the one before (see `pdl_begin` in
    /// `kernels/common.cuh`): on by default where the device has it (sm_90 and newer).
    pub fn set_programmatic_launch(&self, on: bool) {
        let supported = self.compute_capability.0 >= 9;
        self.programmatic.store(on && supported, Ordering::Relaxed);
    }

    /// Lets `func` take up to `bytes` of dynamic shared memory a block, leaving the split of the
    /// unified L1 between cache and shared memory to the driver.
    pub fn allow_dynamic_shared(&self, func: &CudaFunction, bytes: usize) -> Result<()> {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )?;
        Ok(())
    }

    /// Lets `func` take up to `bytes` of dynamic shared memory a block.
    pub fn allow_shared(&self, func: &CudaFunction, bytes: usize) -> Result<()> {
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            bytes as i32,
        )?;
        // As much of the unified L1 as shared memory as the driver allows: the attention
        // kernels' occupancy is their shared memory.
        func.set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
        )?;
        Ok(())
    }

    /// Queues a copy of `src` into device memory at `dst`. Pageable sources are staged by the
    /// driver before this returns; pinned ones must stay untouched until the stream passes it.
    pub fn upload<T: Copy>(&self, src: &[T], dst: DPtr<T>) -> Result<()> {
        // SAFETY: `dst` addresses at least `src.len()` elements (callers size their buffers).
        unsafe { result::memcpy_htod_async(dst.addr, src, self.stream.cu_stream()) }?;
        Ok(())
    }

    /// Copies device memory at `src` into `dst` and waits for it.
    pub fn download<T: Copy>(&self, src: DPtr<T>, dst: &mut [T]) -> Result<()> {
        // SAFETY: `src` addresses at least `dst.len()` elements.
        unsafe { result::memcpy_dtoh_async(dst, src.addr, self.stream.cu_stream()) }?;
        self.synchronize()
    }

    /// Queues a copy of `bytes` bytes between two addresses of the unified address space
    /// (device memory or mapped pinned host memory; the driver infers the direction).
    pub fn copy_bytes(&self, src: DPtr<u8>, dst: DPtr<u8>, bytes: usize) -> Result<()> {
        // SAFETY: both ranges are `bytes` long; the callers check their buffers' sizes.
        unsafe { sys::cuMemcpyAsync(dst.addr, src.addr, bytes, self.stream.cu_stream()) }
            .result()?;
        Ok(())
    }
}

/// Refuses early, with a readable reason, where the CUDA libraries are not installed: cudarc
/// would panic on first use instead.
fn check_libraries() -> Result<()> {
    // SAFETY: each only tries to open a shared library.
    let present = unsafe {
        [
            (
                "the CUDA driver (libcuda)",
                cudarc::driver::sys::is_culib_present(),
            ),
            ("NVRTC (libnvrtc)", cudarc::nvrtc::sys::is_culib_present()),
            (
                "cuBLAS (libcublas)",
                cudarc::cublas::sys::is_culib_present(),
            ),
        ]
    };
    match present.iter().find(|(_, found)| !found) {
        Some((name, _)) => Err(EngineError::CudaUnavailable(format!(
            "{name} was not found on the library path"
        ))),
        None => Ok(()),
    }
}

/// Maps an allocation failure to [`EngineError::OutOfMemory`], naming what was asked for.
fn alloc_error(what: &str, bytes: usize, e: DriverError) -> EngineError {
    if e.0 == sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY {
        EngineError::OutOfMemory(format!("{what} of {bytes} bytes"))
    } else {
        EngineError::Cuda(e)
    }
}

/// A typed device address.
#[derive(Debug)]
pub struct DPtr<T> {
    addr: u64,
    elem: PhantomData<fn() -> T>,
}

impl<T> Clone for DPtr<T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for DPtr<T> {}

impl<T> DPtr<T> {
    /// The null pointer kernels read as "absent".
    pub const NULL: DPtr<T> = DPtr {
        addr: 0,
        elem: PhantomData,
    };

    fn new(addr: u64) -> Self {
        DPtr {
            addr,
            elem: PhantomData,
        }
    }

    /// The address `elems` elements further on.
    pub fn offset(self, elems: usize) -> Self {
        DPtr::new(self.addr + (elems * std::mem::size_of::<T>()) as u64)
    }

    /// A raw address the caller knows to be a device address (mapped host memory).
    pub fn from_addr(addr: CUdeviceptr) -> Self {
        DPtr::new(addr)
    }

    pub fn is_null(self) -> bool {
        self.addr == 0
    }

    /// The address as the driver API takes it.
    pub fn addr(self) -> CUdeviceptr {
        self.addr
    }

    /// The address as a C pointer, for library calls.
    pub fn raw(self) -> *mut c_void {
        self.addr as *mut c_void
    }

    /// The same address seen as elements of another type.
    pub fn cast<U>(self) -> DPtr<U> {
        DPtr::new(self.addr)
    }
}

/// Kernel arguments, each in an 8-byte word. A 4-byte argument sits in the low half of its word,
/// which is where a little-endian machine's pointer to the word finds it.
pub struct Args {
    words: [u64; MAX_ARGS],
    len: usize,
}

impl Args {
    pub fn new() -> Self {
        Args {
            words: [0; MAX_ARGS],
            len: 0,
        }
    }

    fn word(mut self, word: u64) -> Self {
        assert!(
            self.len < MAX_ARGS,
            "a kernel takes at most {MAX_ARGS} arguments"
        );
        self.words[self.len] = word;
        self.len += 1;
        self
    }

    pub fn ptr<T>(self, p: DPtr<T>) -> Self {
        self.word(p.addr)
    }

    pub fn u32(self, v: u32) -> Self {
        self.word(v as u64)
    }

    pub fn u64(self, v: u64) -> Self {
        self.word(v)
    }

    pub fn f32(self, v: f32) -> Self {
        self.word(v.to_bits() as u64)
    }
}

impl Default for Args {
    fn default() -> Self {
        Self::new()
    }
}

/// One plain device allocation, freed on drop.
pub struct DeviceBuffer {
    addr: CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

impl DeviceBuffer {
    /// Allocates `bytes` (at least one) of device memory; `what` names it in errors.
    pub fn alloc(device: &Device, bytes: usize, what: &str) -> Result<Self> {
        device.bind()?;
        // SAFETY: a plain allocation; the memory is uninitialised until written.
        let addr = unsafe { result::malloc_sync(bytes.max(1)) }
            .map_err(|e| alloc_error(what, bytes, e))?;
        Ok(DeviceBuffer {
            addr,
            bytes,
            ctx: device.ctx.clone(),
        })
    }

    pub fn ptr<T>(&self) -> DPtr<T> {
        DPtr::new(self.addr)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by `malloc_sync`, freed once; `cuMemFree` waits for pending work.
        self.ctx.record_err(unsafe { result::free_sync(self.addr) });
    }
}

/// Page-locked host memory mapped into the device's address space: kernels read and write it
/// directly, and copies to and from it run asynchronously.
pub struct PinnedBuffer {
    host: *mut c_void,
    addr: CUdeviceptr,
    bytes: usize,
    ctx: Arc<CudaContext>,
}

// SAFETY: the host pointer is owned by this buffer alone and only handed out as a device
// address; the backend that owns the buffer is used from one thread at a time.
unsafe impl Send for PinnedBuffer {}

impl PinnedBuffer {
    pub fn alloc(device: &Device, bytes: usize, what: &str) -> Result<Self> {
        device.bind()?;
        let flags = sys::CU_MEMHOSTALLOC_DEVICEMAP | sys::CU_MEMHOSTALLOC_PORTABLE;
        // SAFETY: a plain page-locked allocation, freed in `drop`.
        let host = unsafe { result::malloc_host(bytes.max(1), flags) }
            .map_err(|e| alloc_error(what, bytes, e))?;
        let mut addr: CUdeviceptr = 0;
        // SAFETY: `host` was allocated with DEVICEMAP just above.
        let mapped = unsafe { sys::cuMemHostGetDevicePointer_v2(&mut addr, host, 0) }.result();
        if let Err(e) = mapped {
            // SAFETY: allocated above and not handed out.
            unsafe { result::free_host(host) }?;
            return Err(e.into());
        }
        Ok(PinnedBuffer {
            host,
            addr,
            bytes,
            ctx: device.ctx.clone(),
        })
    }

    /// The device address of the buffer.
    pub fn ptr<T>(&self) -> DPtr<T> {
        DPtr::new(self.addr)
    }

    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// The buffer as host words. The caller must have synchronized with any device work on it.
    pub fn as_mut_slice<T: Copy>(&mut self) -> &mut [T] {
        let len = self.bytes / std::mem::size_of::<T>();
        // SAFETY: the allocation is `bytes` long, page-aligned, owned here; device access is
        // excluded by the caller's synchronization and by `&mut self`.
        unsafe { std::slice::from_raw_parts_mut(self.host.cast::<T>(), len) }
    }
}

impl Drop for PinnedBuffer {
    fn drop(&mut self) {
        self.ctx.record_err(self.ctx.bind_to_thread());
        // SAFETY: allocated by `malloc_host`, freed once.
        self.ctx.record_err(unsafe { result::free_host(self.host) });
    }
}
