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

/// A source file after `values.cuh` (bf16 as bits, loads, stores, warp sums) and the header
/// named before it if any, each with its own line numbers for NVRTC's messages.
macro_rules! after_values {
    ($file:literal) => {
        concat!(include_str!("values.cuh"), "\n#line 1 \"", $file, "\"\n", include_str!($file))
    };
    ($header:literal, $file:literal) => {
        concat!(
            include_str!("values.cuh"),
            "\n#line 1 \"",
            $header,
            "\"\n",
            include_str!($header),
            "\n#line 1 \"",
            $file,
            "\"\n",
            include_str!($file)
        )
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

/// Flash attention on the tensor cores, forward and backward (`ops::flash_attention_cuda`
/// launches it): `mma` on half precision needs sm_80 or later.
pub static FLASH_ATTENTION: RuntimeSource = RuntimeSource::for_arch(
    "fsdp_app_flash_attention",
    "models/kernels/src/cuda/flash_attention.cu",
    after_values!("flash_tiles.cuh", "flash_attention.cu"),
    true,
    TENSOR_CORE_ARCH,
);

/// Warps in a block of the flash kernels (flash_tiles.cuh's `WARPS`).
pub const FLASH_WARPS: usize = 4;
/// Outer rows (queries, or keys) of a flash block, 16 a warp (flash_tiles.cuh's `ROWS`).
pub const FLASH_ROWS: usize = 16 * FLASH_WARPS;
/// Groups of 16 query rows a warp holds in the flash forward at head dim 64 (flash_attention.cu's
/// `FORWARD_GROUPS_D64`; one at 128): its blocks hold this many times [`FLASH_ROWS`].
pub const FLASH_FORWARD_GROUPS_D64: usize = 2;

/// The oldest GPUs whose tensor cores run `mma.m16n8k16` on bf16 (Ampere); the driver compiles
/// the PTX on for the GPU at hand.
pub const TENSOR_CORE_ARCH: &str = "compute_80";

/// Every source above.
pub static ALL: [&RuntimeSource; 4] = [&ATTENTION_SOFTMAX, &FUSED, &ADAMW, &FLASH_ATTENTION];

/// A `.cu` source of ours, compiled on first use.
pub struct RuntimeSource {
    /// The module name candle loads the PTX under (one per source).
    pub module: &'static str,
    /// The source's path in the repository, for errors.
    path: &'static str,
    source: &'static str,
    /// Whether NVRTC may contract a multiply and an add into one rounding.
    fmad: bool,
    /// The virtual architecture it needs (NVRTC's `--gpu-architecture`), if not NVRTC's default.
    arch: Option<&'static str>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl RuntimeSource {
    pub const fn new(module: &'static str, path: &'static str, source: &'static str, fmad: bool) -> Self {
        Self { module, path, source, fmad, arch: None, ptx: OnceLock::new() }
    }

    /// A source compiled for `arch` (a `compute_XY` NVRTC takes) instead of NVRTC's default.
    pub const fn for_arch(module: &'static str, path: &'static str, source: &'static str, fmad: bool, arch: &'static str) -> Self {
        Self { module, path, source, fmad, arch: Some(arch), ptx: OnceLock::new() }
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

    /// The virtual architecture it is compiled for, if not NVRTC's default.
    pub fn arch(&self) -> Option<&'static str> {
        self.arch
    }

    /// The PTX, compiled once per process.
    #[cfg(feature = "cuda")]
    pub fn ptx(&self) -> Result<&str> {
        self.ptx
            .get_or_init(|| {
                let opts = CompileOptions { fmad: Some(self.fmad), arch: self.arch, ..Default::default() };
                compile_ptx_with_opts(self.source, opts).map(|p| p.to_src()).map_err(|e| format!("{e:?}"))
            })
            .as_deref()
            .map_err(|e| candle_core::Error::Msg(format!("compiling {} with NVRTC: {e}", self.path)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The value of `#define NAME VALUE` in `source`.
    fn defined(source: &str, name: &str) -> Option<usize> {
        source.lines().find_map(|line| {
            let mut words = line.strip_prefix("#define ")?.split_whitespace();
            (words.next()? == name).then(|| words.next()?.parse().ok())?
        })
    }

    /// The launches (ops::flash_attention_cuda) and the KV cache read the flash kernels' geometry
    /// from Rust; the kernels define it in their source: the two must agree, or a grid leaves
    /// rows undone (or a cache block is read at the wrong size) only on a GPU.
    #[test]
    fn the_flash_kernels_define_the_geometry_their_launches_assume() {
        let source = FLASH_ATTENTION.source();
        assert_eq!(defined(source, "WARPS"), Some(FLASH_WARPS));
        assert_eq!(defined(source, "ROWS"), Some(FLASH_ROWS));
        assert_eq!(defined(source, "FORWARD_GROUPS_D64"), Some(FLASH_FORWARD_GROUPS_D64));
        assert_eq!(defined(source, "CACHE_BLOCK"), Some(crate::paged_attention::BLOCK));
        assert_eq!(defined(source, "NO_SUCH_NAME"), None);
    }
}
