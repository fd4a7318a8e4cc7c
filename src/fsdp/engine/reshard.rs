//! Resharding without giving up the graph. A stage's autograd graph, kept from its forward until
//! its backward when activation checkpointing is off, points at the gathered parameter tensors.
//! Dropping our own references would free nothing, so FULL_SHARD frees their *bytes* instead:
//! the tensors stay (and the graph with its saved activations), their storage is emptied in
//! place after the unit's forward and refilled in place from a new all-gather just before its
//! backward. This is FSDP2's "resize the storage to zero", done through candle's in-place custom
//! ops, which hand us `&mut CpuStorage`.
//!
//! A freed tensor holds an empty storage of a dtype no kernel computes with (F8E8M0), so reading
//! it is an error (a dtype mismatch, or an unsupported dtype), never stale or foreign values.
//! On a GPU the tensors are dropped instead (see `FsdpEngine::reshard`).

use std::sync::Mutex;

use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, InplaceOp1, Layout, Tensor};

struct Free;

impl InplaceOp1 for Free {
    fn name(&self) -> &'static str {
        "fsdp-free-storage"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, _: &Layout) -> candle_core::Result<()> {
        // F8E8M0: a dtype no operation computes with, so a read errors.
        *storage = CpuStorage::F8E8M0(Vec::new());
        Ok(())
    }
}

/// Moves a full f32 buffer into a freed storage (no copy).
struct Fill(Mutex<Option<Vec<f32>>>);

impl InplaceOp1 for Fill {
    fn name(&self) -> &'static str {
        "fsdp-refill-storage"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        let values = self.0.lock().unwrap().take().expect("a fill is applied once");
        if layout.start_offset() != 0 || !layout.is_contiguous() || layout.shape().elem_count() != values.len() {
            candle_core::bail!("refilling a gathered parameter: {} values for a tensor of shape {:?}", values.len(), layout.shape());
        }
        *storage = CpuStorage::F32(values);
        Ok(())
    }
}

/// Moves an f32 storage's buffer out (no copy), leaving it freed as [`Free`] does.
struct Take(Mutex<Option<Vec<f32>>>);

impl InplaceOp1 for Take {
    fn name(&self) -> &'static str {
        "fsdp-take-storage"
    }
    fn cpu_fwd(&self, storage: &mut CpuStorage, layout: &Layout) -> candle_core::Result<()> {
        if layout.start_offset() != 0 || !layout.is_contiguous() {
            candle_core::bail!("taking back a gathered parameter's buffer from a view of it ({:?})", layout.shape());
        }
        match std::mem::replace(storage, CpuStorage::F8E8M0(Vec::new())) {
            CpuStorage::F32(values) if values.len() == layout.shape().elem_count() => {
                *self.0.lock().unwrap() = Some(values);
                Ok(())
            }
            other => {
                let dtype = other.dtype();
                *storage = other;
                candle_core::bail!("taking back a gathered parameter: a {dtype:?} storage for a tensor of shape {:?}", layout.shape())
            }
        }
    }
}

/// Moves `t`'s values out of its storage (the whole buffer of a tensor made from a vector),
/// leaving `t` and every tensor sharing its storage freed as by [`free`]: how a unit's lent
/// master chunks go back to it (`UnitShards::lend`).
pub(super) fn take(t: &Tensor) -> candle_core::Result<Vec<f32>> {
    let op = Take(Mutex::new(None));
    t.inplace_op1(&op)?;
    Ok(op.0.into_inner().unwrap().expect("the take ran"))
}

/// Frees `t`'s bytes; `t` (and every tensor sharing its storage) stays, unreadable, until
/// [`refill`]. CPU tensors only.
pub(super) fn free(t: &Tensor) -> candle_core::Result<()> {
    t.inplace_op1(&Free)
}

/// Puts `values` (the full parameter, row-major) back into a tensor [`free`] emptied.
pub(super) fn refill(t: &Tensor, values: Vec<f32>) -> candle_core::Result<()> {
    if t.dtype() != DType::F32 {
        candle_core::bail!("refilling a gathered parameter of dtype {:?}: only f32 is resharded in place", t.dtype());
    }
    t.inplace_op1(&Fill(Mutex::new(Some(values))))
}

/// Whether `t`'s bytes were freed by [`free`].
#[cfg(test)]
fn is_freed(t: &Tensor) -> bool {
    let (storage, _) = t.storage_and_layout();
    matches!(&*storage, candle_core::Storage::Cpu(CpuStorage::F8E8M0(v)) if v.is_empty())
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Var};

    #[test]
    fn a_freed_parameter_errors_when_read_and_computes_again_after_refill() {
        let w = Var::from_vec(vec![1f32, 2.0, 3.0, 4.0], (2, 2), &Device::Cpu).unwrap().as_tensor().clone();
        let x = Tensor::new(&[[1f32, 0.0], [0.0, 1.0]], &Device::Cpu).unwrap();
        // The graph keeps `w`, as a stage's graph does between its forward and backward.
        let y = x.matmul(&w).unwrap().sum_all().unwrap();
        free(&w).unwrap();
        assert!(is_freed(&w));
        // Every kind of read fails with an error: matmul (as the linear layers), elementwise,
        // a copy out, the fused kernels' slice access, and the kept graph's backward.
        assert!(x.matmul(&w).is_err());
        assert!((&w + 1.0).is_err());
        assert!(w.to_vec2::<f32>().is_err());
        assert!(w.sqr().is_err());
        assert!(ops::linear::linear(&x, &w).is_err());
        assert!(ops::fused::rms_norm(&x, &w.narrow(0, 0, 1).unwrap().squeeze(0).unwrap(), 1e-5).is_err());
        let view = w.t().unwrap();
        assert!(x.matmul(&view).is_err(), "a view shares the freed storage");
        // Refilled in place: the same tensor, used by the same graph, has its values back.
        refill(&w, vec![1.0, 2.0, 3.0, 4.0]).unwrap();
        assert!(!is_freed(&w));
        assert_eq!(w.to_vec2::<f32>().unwrap(), [[1.0, 2.0], [3.0, 4.0]]);
        let grads = y.backward().unwrap();
        assert_eq!(grads.get(&w).unwrap().to_vec2::<f32>().unwrap(), [[1.0, 1.0], [1.0, 1.0]]);
        // A refill must match the tensor's shape.
        free(&w).unwrap();
        assert!(refill(&w, vec![1.0]).is_err());
    }

    #[test]
    fn a_taken_buffer_comes_back_whole_and_leaves_the_tensor_freed() {
        let w = Var::from_vec(vec![1f32, 2.0, 3.0, 4.0], (2, 2), &Device::Cpu).unwrap().as_tensor().clone();
        let view = w.t().unwrap();
        // A view's layout is not the buffer's: nothing is taken through it.
        assert!(take(&view).is_err());
        assert_eq!(take(&w).unwrap(), [1.0, 2.0, 3.0, 4.0]);
        assert!(is_freed(&w) && w.to_vec2::<f32>().is_err() && view.to_vec2::<f32>().is_err());
        // Freed storage has nothing to take, and keeps being freed.
        assert!(take(&w).is_err());
        assert!(is_freed(&w));
        refill(&w, vec![5.0, 6.0, 7.0, 8.0]).unwrap();
        assert_eq!(view.to_vec2::<f32>().unwrap(), [[5.0, 7.0], [6.0, 8.0]]);
    }
}
