//! A GPU tensor's values as a kernel argument, for the ops (and the trainer) that launch our
//! CUDA kernels (`kernels::cuda`).

use candle_core::cuda_backend::cudarc::driver::CudaView;
use candle_core::cuda_backend::CudaDType;
use candle_core::{CudaStorage, Layout, Result, Storage};

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

/// A custom op's contiguous input as its values (`layout`'s elements from its start).
pub fn contiguous_values<'a, T: CudaDType>(storage: &'a CudaStorage, layout: &Layout) -> Result<CudaView<'a, T>> {
    match layout.contiguous_offsets() {
        Some((start, end)) => Ok(storage.as_cuda_slice::<T>()?.slice(start..end)),
        None => candle_core::bail!("a GPU kernel's input of shape {:?} is not contiguous", layout.dims()),
    }
}
