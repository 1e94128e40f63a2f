//! The NVRTC-compiled kernels: CUDA C sources embedded in the binary, compiled at start-up for
//! the device's compute capability with the model's head_dim, the KV block size and the
//! query heads per KV head as `#define`s, so the hot loops have constant bounds.
//!
//! | file | kernels |
//! | --- | --- |
//! | `prelude.cu` | bf16 helpers and reductions, prepended to every file |
//! | `norm.cu` | `add_rmsnorm` |
//! | `rope_kv.cu` | `rope_kv_write` |
//! | `attention.cu` | `paged_attention_split` (decode tokens; its last block per token and KV head merges the splits), `prefill_attention_tc` (prompt chunks, tensor cores), `paged_attention` (the simple reference) |
//! | `gemv.cu` | `gemv_*_mN`: the projections of steps of a few tokens, with RMSNorm, the residual add, SiLU-mul, RoPE and the KV write, and the greedy argmax fused in; `argmax_finalize` |
//! | `elementwise.cu` | `embed`, `silu_mul`, `gather_rows`, `argmax_rows`, `widen`, `fill_uniform`, `delay` |
//! | `sample.cu` | `sample_rows`: temperature and top-p sampling |
//! | `kv_copy.cu` | `kv_gather`, `kv_scatter`: a sequence's KV to and from a hand-off buffer |

use super::error::CudaError;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
use cudarc::driver::{CudaContext, CudaFunction};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use std::sync::Arc;

const PRELUDE: &str = include_str!("kernels/prelude.cu");

/// Every kernel source, by file name.
pub const SOURCES: [(&str, &str); 7] = [
    ("norm.cu", include_str!("kernels/norm.cu")),
    ("rope_kv.cu", include_str!("kernels/rope_kv.cu")),
    ("attention.cu", include_str!("kernels/attention.cu")),
    ("elementwise.cu", include_str!("kernels/elementwise.cu")),
    ("sample.cu", include_str!("kernels/sample.cu")),
    ("kv_copy.cu", include_str!("kernels/kv_copy.cu")),
    ("gemv.cu", include_str!("kernels/gemv.cu")),
];

/// What the sources are specialised for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KernelShape {
    pub head_dim: usize,
    pub block_size: usize,
    /// Query heads per KV head (grouped-query attention): the split attention kernel runs
    /// one warp per query head of a group, so at most 32.
    pub group: usize,
}

/// The full text NVRTC compiles for `file`: the shape's defines, the prelude, the file.
pub fn full_source(file_src: &str, shape: KernelShape) -> String {
    format!(
        "#define HEAD_DIM {}\n#define BLOCK_SIZE {}\n#define GROUP {}\n{PRELUDE}\n{file_src}",
        shape.head_dim, shape.block_size, shape.group
    )
}

/// Compiles one source file to PTX for `arch` (`compute_90` on an H200).
pub fn compile(file: &'static str, src: &str, shape: KernelShape, arch: &str) -> Result<Ptx, CudaError> {
    // NVRTC wants the architecture as a &'static str; there are a handful of them, so leaking
    // the string once per distinct value is bounded.
    let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = CompileOptions {
        arch: Some(arch_static),
        // IEEE division and square root: the kernels call __expf and rsqrtf explicitly where
        // speed matters, and everything else should round as the reference does.
        use_fast_math: Some(false),
        options: vec!["--std=c++17".into()],
        name: Some(file.to_string()),
        ..Default::default()
    };
    compile_ptx_with_opts(full_source(src, shape), opts).map_err(|e| CudaError::Compile {
        file,
        arch: arch.to_string(),
        log: format!("{e:?}"),
    })
}

/// The loaded kernels.
pub struct Kernels {
    pub add_rmsnorm: CudaFunction,
    pub rope_kv_write: CudaFunction,
    pub paged_attention: CudaFunction,
    pub paged_attention_split: CudaFunction,
    /// Built for head_dim up to 128 only (see `attention.cu`).
    pub prefill_attention_tc: Option<CudaFunction>,
    pub embed: CudaFunction,
    pub silu_mul: CudaFunction,
    pub gather_rows: CudaFunction,
    pub argmax_rows: CudaFunction,
    pub sample_rows: CudaFunction,
    pub widen: CudaFunction,
    pub fill_uniform: CudaFunction,
    pub kv_gather: CudaFunction,
    pub kv_scatter: CudaFunction,
    /// Spins for a given time: lets the host queue a step's launches ahead of the GPU when
    /// their times are taken one by one (`CudaExecutor::time_decode_launches`).
    pub delay: CudaFunction,
    /// Greedy tokens from the GEMV LM head's argmax keys.
    pub argmax_finalize: CudaFunction,
    /// The fused small-step projections, by row bound (`GEMV_ROW_BOUNDS`).
    pub gemv: Vec<GemvKernels>,
    /// Dynamic shared memory a GEMV block may have (the device's opt-in limit, in bytes).
    pub gemv_smem_limit: usize,
}

/// Row bounds the GEMV kernels are built for (`gemv.cu`, `GEMV_KERNELS`): a step of M rows
/// runs the kernels of the smallest bound ≥ M.
pub const GEMV_ROW_BOUNDS: [usize; 3] = [1, 2, 4];

/// The projections of steps of at most one row bound (`gemv.cu`).
pub struct GemvKernels {
    /// QKV: RMSNorm of the residual stream before, RoPE and the KV write after.
    pub qkv_rope: CudaFunction,
    /// Gate/up: RMSNorm of the residual stream before, SiLU(gate) * up after.
    pub gate_up: CudaFunction,
    /// The product added into the residual stream (output and down projections).
    pub residual: CudaFunction,
    /// LM head: RMSNorm of the sampled rows of the residual stream before, the logits and
    /// their argmax keys after (`argmax_finalize` turns the keys into tokens).
    pub lm_head: CudaFunction,
}

impl Kernels {
    /// Compiles and loads every kernel for this device.
    pub fn load(ctx: &Arc<CudaContext>, arch: &str, shape: KernelShape) -> Result<Kernels, CudaError> {
        let mut modules = Vec::with_capacity(SOURCES.len());
        for (file, src) in SOURCES {
            let ptx = compile(file, src, shape, arch)?;
            let module = ctx.load_module(ptx).map_err(|e| CudaError::call(format!("loading module {file}"), e))?;
            modules.push((file, module));
        }
        let get = |file: &str, name: &str| -> Result<CudaFunction, CudaError> {
            let (_, m) = modules.iter().find(|(f, _)| *f == file).expect("file is in SOURCES");
            m.load_function(name).map_err(|e| CudaError::call(format!("loading kernel {name} from {file}"), e))
        };
        // The GEMV kernels stage their input rows in dynamic shared memory (up to 4 rows of
        // the MLP's width: 112 KiB for Llama 3 8B), over the default 48 KiB: allow up to
        // the device's limit less the kernel's static shared memory (a reduction's 128
        // bytes); the host checks each launch against the smallest such allowance.
        let optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .map_err(|e| CudaError::call("reading the shared memory limit", e))?;
        let mut smem_limit = optin;
        let mut gemv = Vec::new();
        for bound in GEMV_ROW_BOUNDS {
            let mut kernel = |kind: &str| -> Result<CudaFunction, CudaError> {
                let name = format!("gemv_{kind}_m{bound}");
                let f = get("gemv.cu", &name)?;
                let fixed = f
                    .get_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_SHARED_SIZE_BYTES)
                    .map_err(|e| CudaError::call(format!("reading the shared memory of {name}"), e))?;
                let dynamic = optin - fixed;
                f.set_attribute(CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic)
                    .map_err(|e| CudaError::call(format!("raising the shared memory of {name} to {dynamic}"), e))?;
                smem_limit = smem_limit.min(dynamic);
                Ok(f)
            };
            gemv.push(GemvKernels {
                qkv_rope: kernel("qkv_rope")?,
                gate_up: kernel("gate_up")?,
                residual: kernel("residual")?,
                lm_head: kernel("lm_head")?,
            });
        }
        Ok(Kernels {
            add_rmsnorm: get("norm.cu", "add_rmsnorm")?,
            rope_kv_write: get("rope_kv.cu", "rope_kv_write")?,
            paged_attention: get("attention.cu", "paged_attention")?,
            paged_attention_split: get("attention.cu", "paged_attention_split")?,
            prefill_attention_tc: if shape.head_dim <= 128 {
                Some(get("attention.cu", "prefill_attention_tc")?)
            } else {
                None
            },
            embed: get("elementwise.cu", "embed")?,
            silu_mul: get("elementwise.cu", "silu_mul")?,
            gather_rows: get("elementwise.cu", "gather_rows")?,
            argmax_rows: get("elementwise.cu", "argmax_rows")?,
            sample_rows: get("sample.cu", "sample_rows")?,
            widen: get("elementwise.cu", "widen")?,
            fill_uniform: get("elementwise.cu", "fill_uniform")?,
            kv_gather: get("kv_copy.cu", "kv_gather")?,
            kv_scatter: get("kv_copy.cu", "kv_scatter")?,
            delay: get("elementwise.cu", "delay")?,
            argmax_finalize: get("gemv.cu", "argmax_finalize")?,
            gemv,
            gemv_smem_limit: smem_limit as usize,
        })
    }
}
