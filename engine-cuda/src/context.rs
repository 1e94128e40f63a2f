//! The GPU handle: a CUDA context, the one stream every launch goes to, and a cuBLAS handle.
//!
//! cudarc loads libcuda, libnvrtc, libcublas and libcublasLt when first used, and panics (does
//! not return an error) when one is missing, so [`libraries_present`] is checked first.
#![allow(unsafe_code)] // FFI: library probes, event-tracking switch and raw GEMM calls; see each block.

use super::error::CudaError;
use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::{CudaContext, CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::cell::RefCell;
use std::sync::Arc;

/// Names the first CUDA library that cannot be loaded, or `Ok` when all four can.
pub fn libraries_present() -> Result<(), CudaError> {
    // SAFETY: each probe only tries to dlopen the library; it calls nothing in it.
    let probes: [(&'static str, bool); 4] = unsafe {
        [
            ("libcuda (the NVIDIA driver)", cudarc::driver::sys::is_culib_present()),
            ("libnvrtc", cudarc::nvrtc::sys::is_culib_present()),
            ("libcublas", cudarc::cublas::sys::is_culib_present()),
            ("libcublasLt", cudarc::cublaslt::sys::is_culib_present()),
        ]
    };
    match probes.iter().find(|(_, ok)| !ok) {
        Some((name, _)) => Err(CudaError::LibraryMissing(name)),
        None => Ok(()),
    }
}

/// Whether a GPU can be used here: the libraries load and the driver sees a device. GPU
/// tests skip themselves when this is false.
pub fn gpu_available() -> bool {
    libraries_present().is_ok() && CudaContext::device_count().map(|n| n > 0).unwrap_or(false)
}

/// A device, its stream and its cuBLAS handle. Everything runs on the one stream, in order,
/// so no cross-stream synchronisation is needed.
pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: CudaBlas,
    /// `compute_XY` for NVRTC, from the device's compute capability.
    pub arch: String,
    /// Streaming multiprocessors: how many blocks it takes to fill the device (the split
    /// attention kernel sizes its splits from it).
    pub sms: usize,
    /// cuBLAS's workspace, owned here so that eager calls and calls captured into a CUDA
    /// graph use the same memory and so the same algorithms (bit-identical results); without
    /// one cuBLAS would manage its own, which capture does not see.
    _blas_workspace: CudaSlice<u8>,
    /// While a kernel timeline is taken ([`Gpu::start_timeline`]): a timing event recorded
    /// after each launch, with the launch's name. `None` otherwise (and always during graph
    /// capture), so marking costs nothing in serving.
    timeline: RefCell<Option<Vec<(&'static str, CudaEvent)>>>,
}

/// cuBLAS workspace: NVIDIA's recommendation for Hopper.
const BLAS_WORKSPACE_BYTES: usize = 32 << 20;

impl Gpu {
    /// Opens device `ordinal`, failing with a clear error when no driver is present.
    pub fn open(ordinal: usize) -> Result<Gpu, CudaError> {
        libraries_present()?;
        let ctx =
            CudaContext::new(ordinal).map_err(|e| CudaError::call(format!("opening CUDA device {ordinal}"), e))?;
        // SAFETY: called before any allocation or stream exists on this context. Event
        // tracking makes every launch record events, which breaks CUDA-graph capture of
        // cuBLAS (CUBLAS_STATUS_INTERNAL_ERROR); one stream needs no tracking.
        unsafe { ctx.disable_event_tracking() };
        let stream = ctx.new_stream().map_err(|e| CudaError::call("creating a CUDA stream", e))?;
        let blas = CudaBlas::new(stream.clone()).map_err(|e| CudaError::call("creating a cuBLAS handle", e))?;
        let (major, minor) = ctx.compute_capability().map_err(|e| CudaError::call("reading compute capability", e))?;
        let sms = ctx
            .attribute(cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| CudaError::call("reading the multiprocessor count", e))?;
        let workspace = stream
            .alloc_zeros::<u8>(BLAS_WORKSPACE_BYTES)
            .map_err(|e| CudaError::call("allocating the cuBLAS workspace", e))?;
        let ws_ptr = {
            // With event tracking off the guard records nothing.
            let (p, _guard) = workspace.device_ptr(&stream);
            p
        };
        // SAFETY: the workspace is a live allocation of BLAS_WORKSPACE_BYTES that the Gpu
        // keeps for as long as the handle, and every cuBLAS call runs on the one stream, so
        // no two calls use it at once.
        unsafe { blas_sys::cublasSetWorkspace_v2(*blas.handle(), ws_ptr as *mut _, BLAS_WORKSPACE_BYTES) }
            .result()
            .map_err(|e| CudaError::call("setting the cuBLAS workspace", e))?;
        Ok(Gpu {
            ctx,
            stream,
            blas,
            arch: format!("compute_{major}{minor}"),
            sms: usize::try_from(sms).unwrap_or(1).max(1),
            _blas_workspace: workspace,
            timeline: RefCell::new(None),
        })
    }

    /// Device memory in bytes: (free, total).
    pub fn memory(&self) -> Result<(usize, usize), CudaError> {
        self.ctx.mem_get_info().map_err(|e| CudaError::call("reading device memory", e))
    }

    /// `len` zeroed elements of device memory; the error says what the memory was for.
    pub fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
        &self,
        len: usize,
        what: &str,
    ) -> Result<CudaSlice<T>, CudaError> {
        self.stream
            .alloc_zeros::<T>(len.max(1))
            .map_err(|e| CudaError::call(format!("allocating {what} ({} bytes)", len * std::mem::size_of::<T>()), e))
    }

    /// Copies `host` into the front of `dst`.
    pub fn upload<T: cudarc::driver::DeviceRepr>(
        &self,
        host: &[T],
        dst: &mut CudaSlice<T>,
        what: &str,
    ) -> Result<(), CudaError> {
        if host.is_empty() {
            return Ok(());
        }
        let mut view = dst.slice_mut(..host.len());
        self.stream.memcpy_htod(host, &mut view).map_err(|e| CudaError::call(format!("copying {what} to the GPU"), e))
    }

    /// Copies the front `out.len()` elements of `src` to the host (waits for the stream).
    pub fn download<T: cudarc::driver::DeviceRepr>(
        &self,
        src: &CudaSlice<T>,
        out: &mut [T],
        what: &str,
    ) -> Result<(), CudaError> {
        if out.is_empty() {
            return Ok(());
        }
        let view = src.slice(..out.len());
        self.stream.memcpy_dtoh(&view, out).map_err(|e| CudaError::call(format!("copying {what} from the GPU"), e))?;
        self.sync()
    }

    pub fn sync(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(|e| CudaError::call("waiting for the GPU", e))
    }

    /// The raw device address of `s` (plus `offset` elements), for kernel arguments and GEMMs
    /// that address sub-ranges (one layer's weights, one layer's KV cache).
    pub fn ptr<T>(&self, s: &CudaSlice<T>, offset: usize) -> u64 {
        // With event tracking off the returned guard does nothing; the address stays valid
        // for as long as `s` lives, which the callers guarantee by holding it.
        let (p, _guard) = s.device_ptr(&self.stream);
        p + (offset * std::mem::size_of::<T>()) as u64
    }

    /// Starts a kernel timeline: from now on every launch through the model records an event
    /// after it ([`Gpu::mark`]), beginning with one recorded here.
    pub fn start_timeline(&self) -> Result<(), CudaError> {
        *self.timeline.borrow_mut() = Some(Vec::new());
        self.mark("start")
    }

    /// Ends the timeline: the events in launch order, each after the launch it names.
    pub fn take_timeline(&self) -> Vec<(&'static str, CudaEvent)> {
        self.timeline.borrow_mut().take().unwrap_or_default()
    }

    /// Records a timing event named `what` when a timeline is being taken.
    pub fn mark(&self, what: &'static str) -> Result<(), CudaError> {
        let mut timeline = self.timeline.borrow_mut();
        if let Some(events) = timeline.as_mut() {
            let event = self
                .stream
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| CudaError::call("recording a timing event", e))?;
            events.push((what, event));
        }
        Ok(())
    }

    /// Row-major `Y[m, n] = X[m, k] · W[n, k]^T` in bf16 with f32 accumulation (a linear
    /// layer with PyTorch's weight layout). cuBLAS is column-major, where the row-major Y is
    /// Y^T = W · X^T: so W goes first, transposed, with the roles of m and n swapped. `what`
    /// names the product in kernel timelines.
    #[allow(clippy::too_many_arguments)] // A GEMM's shape and operands, and its name.
    pub fn linear(
        &self,
        what: &'static str,
        x: u64,
        w: u64,
        y: u64,
        m: usize,
        n: usize,
        k: usize,
    ) -> Result<(), CudaError> {
        let (alpha, beta) = (1.0f32, 0.0f32);
        let dims = |v: usize| i32::try_from(v).map_err(|_| CudaError::Batch(format!("GEMM dimension {v} exceeds i32")));
        let (mi, ni, ki) = (dims(m)?, dims(n)?, dims(k)?);
        // SAFETY: x, w and y are live device allocations of at least m*k, n*k and m*n bf16
        // elements (the callers size their buffers from the same m, n, k), and the handle is
        // bound to this context's stream.
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha) as *const f32 as *const _,
                w as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ki,
                x as *const _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ki,
                (&beta) as *const f32 as *const _,
                y as *mut _,
                blas_sys::cudaDataType_t::CUDA_R_16BF,
                ni,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| CudaError::call(format!("cuBLAS GEMM {m}x{n}x{k}"), e))?;
        self.mark(what)
    }
}
