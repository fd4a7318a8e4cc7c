//! Where tensors live: the `--device` flag (`cpu`, `cuda`, `cuda:N`) and opening it.
//!
//! `cuda` without an ordinal means "this rank's GPU": LOCAL_RANK under a launcher (torchrun's
//! convention, one process per GPU), else GPU 0. A binary built without the `cuda` feature says
//! so and how to get one, instead of candle's generic "not compiled with cuda support".

use anyhow::{bail, Context, Result};
use candle_core::Device;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceSpec {
    #[default]
    Cpu,
    /// A GPU: the given ordinal, or the rank's local GPU when `None`.
    Cuda(Option<usize>),
}

impl std::str::FromStr for DeviceSpec {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        Ok(match s.trim() {
            "cpu" => Self::Cpu,
            "cuda" | "gpu" => Self::Cuda(None),
            other => match other.strip_prefix("cuda:") {
                Some(n) => Self::Cuda(Some(
                    n.parse().with_context(|| format!("--device {other:?}: the GPU ordinal must be a number, e.g. cuda:0"))?,
                )),
                None => bail!("--device {other:?}: use cpu, cuda or cuda:N"),
            },
        })
    }
}

impl std::fmt::Display for DeviceSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Cpu => write!(f, "cpu"),
            Self::Cuda(None) => write!(f, "cuda"),
            Self::Cuda(Some(n)) => write!(f, "cuda:{n}"),
        }
    }
}

impl DeviceSpec {
    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }

    /// The GPU ordinal this process uses (`local_rank` for a bare `cuda`).
    pub fn ordinal(self, local_rank: usize) -> Option<usize> {
        match self {
            Self::Cpu => None,
            Self::Cuda(n) => Some(n.unwrap_or(local_rank)),
        }
    }

    /// Opens the device for the process whose local rank is `local_rank`.
    pub fn open(self, local_rank: usize) -> Result<Device> {
        match self.ordinal(local_rank) {
            None => Ok(Device::Cpu),
            Some(n) => open_cuda(n),
        }
    }
}

#[cfg(feature = "cuda")]
fn open_cuda(ordinal: usize) -> Result<Device> {
    Device::new_cuda(ordinal)
        .with_context(|| format!("--device cuda:{ordinal}: cannot open GPU {ordinal} (is it there, and is the driver loaded?)"))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda(ordinal: usize) -> Result<Device> {
    bail!(
        "--device cuda:{ordinal}: this fsdp-app was built without CUDA; build one with tests/gpu/build-cuda.sh \
         (features cuda,nccl), or use --device cpu"
    )
}

/// A short name of an open device for messages and reports ("cpu", "cuda:0").
pub fn describe(device: &Device) -> String {
    match device.location() {
        candle_core::DeviceLocation::Cpu => "cpu".into(),
        candle_core::DeviceLocation::Cuda { gpu_id } => format!("cuda:{gpu_id}"),
        candle_core::DeviceLocation::Metal { gpu_id } => format!("metal:{gpu_id}"),
    }
}

/// Whether `e` is a GPU running out of memory: the CUDA driver's, cuBLAS's or NCCL's way of
/// saying so, anywhere in the error's chain (candle and cudarc wrap them as text), or a tensor
/// too large for candle's GPU kernels, which a smaller batch fixes the same way.
pub fn is_out_of_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        let text = c.to_string();
        ["CUDA_ERROR_OUT_OF_MEMORY", "out of memory", "CUBLAS_STATUS_ALLOC_FAILED", ops::eager_attention::TOO_LARGE_FOR_GPU_KERNELS]
            .iter()
            .any(|m| text.contains(m))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_and_resolves_the_rank_gpu() {
        assert_eq!("cpu".parse::<DeviceSpec>().unwrap(), DeviceSpec::Cpu);
        assert_eq!("cuda".parse::<DeviceSpec>().unwrap().ordinal(3), Some(3));
        assert_eq!("cuda:1".parse::<DeviceSpec>().unwrap().ordinal(3), Some(1));
        assert_eq!(DeviceSpec::Cpu.ordinal(3), None);
        assert_eq!("cuda:2".parse::<DeviceSpec>().unwrap().to_string(), "cuda:2");
        let e = "cuda:x".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(e.contains("ordinal"), "{e}");
        let e = "tpu".parse::<DeviceSpec>().unwrap_err().to_string();
        assert!(e.contains("--device \"tpu\""), "{e}");
    }

    #[test]
    fn a_tensor_too_large_for_gpu_kernels_counts_as_out_of_memory() {
        // 64 sequences x 8 heads x 4096 x 4096 scores: 2^33 values.
        let e = ops::eager_attention::check_gpu_tensor_len(&[64, 8, 4096, 4096], "attention scores").unwrap_err();
        let e = anyhow::Error::from(e).context("rank 0");
        assert!(is_out_of_memory(&e), "{e:#}");
        assert!(format!("{e:#}").contains("[64, 8, 4096, 4096]") && format!("{e:#}").contains("batch size"), "{e:#}");
        assert!(ops::eager_attention::check_gpu_tensor_len(&[64, 8, 2048, 2048], "attention scores").is_ok());
        assert!(!is_out_of_memory(&anyhow::anyhow!("DriverError(CUDA_ERROR_INVALID_VALUE, \"invalid argument\")")));
    }

    #[cfg(not(feature = "cuda"))]
    #[test]
    fn a_cpu_build_names_the_way_to_a_cuda_one() {
        let e = DeviceSpec::Cuda(None).open(0).unwrap_err().to_string();
        assert!(e.contains("built without CUDA") && e.contains("tests/gpu/build-cuda.sh"), "{e}");
        assert!(DeviceSpec::Cpu.open(0).unwrap().is_cpu());
    }
}
