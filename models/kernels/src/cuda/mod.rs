//! Our CUDA sources and their compilation: each `.cu` here is compiled by NVRTC the first time a
//! process needs it (no CUDA toolkit at build time; the PTX matches the driver's NVRTC), then
//! loaded once per device by candle under its module name (the ops and the trainer launch them).
//! The sources and their compile options are here without the `cuda` feature too: a CPU test
//! (`tests/cuda_sources.rs`) compiles every one of [`ALL`] for the GPUs we run on.

#[cfg(feature = "cuda")]
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
#[cfg(feature = "cuda")]
use candle_core::Result;
use std::sync::OnceLock;

/// A source file after `values.cuh` (bf16 as bits, loads, stores, warp sums), its own line
/// numbers kept for NVRTC's messages.
macro_rules! after_values {
    ($file:literal) => {
        concat!(include_str!("values.cuh"), "\n#line 1 \"", $file, "\"\n", include_str!($file))
    };
}

/// Eager attention's softmax, forward and backward (`ops::attention_softmax_cuda` launches it).
pub static ATTENTION_SOFTMAX: RuntimeSource = RuntimeSource::new(
    "fsdp_app_attention_softmax",
    "models/kernels/src/cuda/attention_softmax.cu",
    after_values!("attention_softmax.cu"),
    true,
);

/// The fused training ops, RMSNorm and SwiGLU, forward and backward (`ops::fused_cuda` launches
/// them). No contracted multiply-adds: the sums keep the CPU loops' roundings.
pub static FUSED: RuntimeSource =
    RuntimeSource::new("fsdp_app_fused", "models/kernels/src/cuda/fused.cu", after_values!("fused.cu"), false);

/// AdamW of a chunk, the host loop's IEEE operations (no contracted multiply-adds), so the GPU
/// and the CPU give the same bits (the trainer's `fsdp::adamw_cuda` launches it).
pub static ADAMW: RuntimeSource = RuntimeSource::new("fsdp_app_adamw", "models/kernels/src/cuda/adamw.cu", include_str!("adamw.cu"), false);

/// Every source above.
pub static ALL: [&RuntimeSource; 3] = [&ATTENTION_SOFTMAX, &FUSED, &ADAMW];

/// A `.cu` source of ours, compiled on first use.
pub struct RuntimeSource {
    /// The module name candle loads the PTX under (one per source).
    pub module: &'static str,
    /// The source's path in the repository, for errors.
    path: &'static str,
    source: &'static str,
    /// Whether NVRTC may contract a multiply and an add into one rounding.
    fmad: bool,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl RuntimeSource {
    pub const fn new(module: &'static str, path: &'static str, source: &'static str, fmad: bool) -> Self {
        Self { module, path, source, fmad, ptx: OnceLock::new() }
    }

    /// The source's path in the repository.
    pub fn path(&self) -> &'static str {
        self.path
    }

    /// The CUDA C++ text.
    pub fn source(&self) -> &'static str {
        self.source
    }

    /// Whether NVRTC may contract a multiply and an add (its `--fmad`).
    pub fn fmad(&self) -> bool {
        self.fmad
    }

    /// The PTX, compiled once per process.
    #[cfg(feature = "cuda")]
    pub fn ptx(&self) -> Result<&str> {
        self.ptx
            .get_or_init(|| {
                let opts = CompileOptions { fmad: Some(self.fmad), ..Default::default() };
                compile_ptx_with_opts(self.source, opts).map(|p| p.to_src()).map_err(|e| format!("{e:?}"))
            })
            .as_deref()
            .map_err(|e| candle_core::Error::Msg(format!("compiling {} with NVRTC: {e}", self.path)))
    }
}
