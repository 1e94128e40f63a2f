//! Accelerators: memory, bandwidths, peak rates and an assumed price.
//!
//! Rates are NVIDIA's datasheet peaks for the SXM parts, dense (without 2:4 sparsity, which
//! the datasheets' headline numbers include). Link bandwidth is NVLink per GPU per direction
//! (half the datasheet's bidirectional figure), which is what a ring all-reduce is limited by.
//! Prices are assumptions (typical 2025 on-demand rates at GPU clouds, not a quote): change
//! them here or override the computed cost in reports.

use super::error::UnknownName;

const GIB: u64 = 1 << 30;

/// One GPU model.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GpuSpec {
    /// Catalog name, as used in configs.
    pub name: &'static str,
    /// HBM capacity in bytes.
    pub memory_bytes: u64,
    /// Peak HBM bandwidth in bytes/s.
    pub hbm_bytes_per_s: f64,
    /// Dense BF16 tensor-core peak in FLOP/s.
    pub bf16_flops: f64,
    /// Dense FP8 tensor-core peak in FLOP/s; equal to `bf16_flops` on GPUs without FP8 tensor
    /// cores (FP8 weights are then dequantized and multiplied at the BF16 rate).
    pub fp8_flops: f64,
    /// NVLink bandwidth per GPU per direction in bytes/s.
    pub link_bytes_per_s: f64,
    /// Assumed rental price per GPU-hour in USD.
    pub usd_per_hour: f64,
}

static GPUS: [GpuSpec; 5] = [
    // A100 SXM 80GB: nvidia-smi reports 81920 MiB; 2039 GB/s HBM2e; 312 TFLOP/s BF16; no
    // FP8; NVLink 3 600 GB/s bidirectional.
    GpuSpec {
        name: "a100",
        memory_bytes: 80 * GIB,
        hbm_bytes_per_s: 2.039e12,
        bf16_flops: 312e12,
        fp8_flops: 312e12,
        link_bytes_per_s: 300e9,
        usd_per_hour: 1.8,
    },
    // H100 SXM: 80 GiB HBM3, 3.35 TB/s, 989 TFLOP/s BF16, 1979 TFLOP/s FP8, NVLink 4
    // 900 GB/s bidirectional.
    GpuSpec {
        name: "h100",
        memory_bytes: 80 * GIB,
        hbm_bytes_per_s: 3.35e12,
        bf16_flops: 989e12,
        fp8_flops: 1979e12,
        link_bytes_per_s: 450e9,
        usd_per_hour: 2.5,
    },
    // H200 SXM: the H100's compute with 141 GB HBM3e at 4.8 TB/s. The decimal 141e9 is a
    // little under what the driver reports, so capacities err on the small side.
    GpuSpec {
        name: "h200",
        memory_bytes: 141_000_000_000,
        hbm_bytes_per_s: 4.8e12,
        bf16_flops: 989e12,
        fp8_flops: 1979e12,
        link_bytes_per_s: 450e9,
        usd_per_hour: 3.5,
    },
    // B200 (HGX): 180 GB usable HBM3e at 8 TB/s, 2.25 PFLOP/s BF16 and 4.5 PFLOP/s FP8 dense,
    // NVLink 5 1.8 TB/s bidirectional.
    GpuSpec {
        name: "b200",
        memory_bytes: 180_000_000_000,
        hbm_bytes_per_s: 8e12,
        bf16_flops: 2.25e15,
        fp8_flops: 4.5e15,
        link_bytes_per_s: 900e9,
        usd_per_hour: 5.0,
    },
    // Not a GPU: two x86 cores with AVX2 (2 FMA units × 8 f32 lanes × 2 FLOP × 3 GHz per
    // core) and a share of DRAM bandwidth, the machines the vLLM-CPU tests run on. Only a
    // calibration's starting point: `profile-vllm` measures what they do.
    GpuSpec {
        name: "cpu-2core",
        memory_bytes: 24 * GIB,
        hbm_bytes_per_s: 20e9,
        bf16_flops: 192e9,
        fp8_flops: 192e9,
        link_bytes_per_s: 10e9,
        usd_per_hour: 0.1,
    },
];

/// Looks a GPU up by its catalog name.
pub fn gpu_by_name(name: &str) -> Result<&'static GpuSpec, UnknownName> {
    UnknownName::lookup(&GPUS, "gpu", name, |g| g.name)
}

/// Catalog names, in catalog order.
pub fn gpu_names() -> Vec<&'static str> {
    GPUS.iter().map(|g| g.name).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unknown_gpu_name_lists_the_valid_ones() {
        let err = gpu_by_name("tpu-v5").expect_err("not a catalog gpu");
        assert_eq!(err.to_string(), "unknown gpu `tpu-v5` (valid: a100, h100, h200, b200, cpu-2core)");
    }

    #[test]
    fn every_catalog_gpu_is_found_by_its_name() {
        for name in gpu_names() {
            assert_eq!(gpu_by_name(name).map(|g| g.name), Ok(name));
        }
    }
}
