//! What our GPU kernels share: a CUDA source compiled by NVRTC the first time a process needs
//! it (no CUDA toolkit at build time; the PTX matches the driver's NVRTC), then loaded once per
//! device by candle under its module name; and a GPU tensor's values as a kernel argument.

use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::cuda_backend::cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions};
use candle_core::cuda_backend::CudaDType;
use candle_core::{Result, Storage};
use std::sync::OnceLock;

/// A `.cu` source of ours (`include_str!`), compiled on first use.
pub struct RuntimeSource {
    /// The module name candle loads the PTX under (one per source).
    pub module: &'static str,
    /// The source's path in the repository, for errors.
    path: &'static str,
    source: &'static str,
    /// Whether NVRTC may contract a multiply and an add into one rounding.
    fmad: bool,
    ptx: OnceLock<std::result::Result<String, String>>,
}

impl RuntimeSource {
    pub const fn new(module: &'static str, path: &'static str, source: &'static str, fmad: bool) -> Self {
        Self { module, path, source, fmad, ptx: OnceLock::new() }
    }

    /// The PTX, compiled once per process.
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

/// `len` values (all the rest with `None`) of a GPU tensor's storage from `start`, for a kernel
/// argument; `what` names the tensor in the error when it is not on the GPU.
pub fn values<'a, T: CudaDType>(storage: &'a Storage, start: usize, len: Option<usize>, what: &str) -> Result<CudaView<'a, T>> {
    match storage {
        Storage::Cuda(s) => {
            let all = s.as_cuda_slice::<T>()?;
            Ok(match len {
                Some(n) => all.slice(start..start + n),
                None => all.slice(start..),
            })
        }
        _ => candle_core::bail!("{what} is not on the GPU"),
    }
}
