//! Token embedding for training on the CPU: rows of the table picked by id, with a backward that
//! builds the table's gradient in one buffer (rows of the upstream gradient added at their ids)
//! and, given a [`WeightGradTarget`], hands it to the trainer instead of candle's gradient store
//! (see `crate::weight_grads`). The backward never reads the table itself.

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use crate::fused::f32_slice;
use crate::weight_grads::WeightGradTarget;

/// `w[ids]`: (ids..., hidden) rows of the (vocab, hidden) f32 table `w`; `ids` u32.
pub fn embedding(w: &Tensor, ids: &Tensor, grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
    let hidden = w.dim(1)?;
    let mut shape = ids.dims().to_vec();
    shape.push(hidden);
    let flat = ids.flatten_all()?.contiguous()?;
    let out = w.contiguous()?.apply_op2(&flat, Embed { grad_to })?;
    out.reshape(shape)
}

struct Embed {
    grad_to: Option<WeightGradTarget>,
}

fn ids_of(s: &CpuStorage, l: &Layout) -> Result<Vec<usize>> {
    let (a, b) = l.contiguous_offsets().ok_or_else(|| candle_core::Error::Msg("embedding: ids not contiguous".into()))?;
    Ok(match s {
        CpuStorage::U32(v) => v[a..b].iter().map(|&x| x as usize).collect(),
        CpuStorage::I64(v) => v[a..b].iter().map(|&x| x as usize).collect(),
        _ => candle_core::bail!("embedding: ids must be u32 or i64"),
    })
}

impl CustomOp2 for Embed {
    fn name(&self) -> &'static str {
        "embedding"
    }

    fn cpu_fwd(&self, ws: &CpuStorage, wl: &Layout, is: &CpuStorage, il: &Layout) -> Result<(CpuStorage, Shape)> {
        let w = f32_slice(ws, wl)?;
        let (vocab, hidden) = wl.shape().dims2()?;
        let ids = ids_of(is, il)?;
        let mut out = Vec::with_capacity(ids.len() * hidden);
        for &id in &ids {
            if id >= vocab {
                candle_core::bail!("token id {id} is outside the vocabulary ({vocab})");
            }
            out.extend_from_slice(&w[id * hidden..(id + 1) * hidden]);
        }
        Ok((CpuStorage::F32(out), Shape::from((ids.len(), hidden))))
    }

    fn bwd(&self, w: &Tensor, ids: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (vocab, hidden) = w.dims2()?;
        let ids: Vec<u32> = ids.to_dtype(candle_core::DType::U32)?.to_vec1()?;
        let grad = grad.contiguous()?;
        let (gs, gl) = grad.storage_and_layout();
        let Storage::Cpu(gc) = &*gs else { candle_core::bail!("embedding: the backward runs on the CPU") };
        let g = f32_slice(gc, gl)?;
        let mut dw = vec![0f32; vocab * hidden];
        for (r, &id) in ids.iter().enumerate() {
            let id = id as usize;
            for (a, b) in dw[id * hidden..(id + 1) * hidden].iter_mut().zip(&g[r * hidden..(r + 1) * hidden]) {
                *a += *b;
            }
        }
        let dw = Tensor::from_vec(dw, (vocab, hidden), w.device())?;
        match &self.grad_to {
            Some(t) => {
                t.sink.add(&t.name, dw)?;
                Ok((None, None))
            }
            None => Ok((Some(dw), None)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::weight_grads::WeightGrads;
    use candle_core::{Device, Var};
    use candle_nn::Module;

    #[test]
    fn picks_rows_and_its_gradient_matches_index_select_s() {
        let dev = Device::Cpu;
        let w = Var::from_vec((0..12).map(|x| x as f32).collect(), (4, 3), &dev).unwrap();
        let ids = Tensor::new(&[[1u32, 3, 1], [0, 2, 2]], &dev).unwrap();
        let up = Tensor::new(&[[[1f32, 2., 3.], [4., 5., 6.], [7., 8., 9.]], [[1., 1., 1.], [2., 2., 2.], [3., 3., 3.]]], &dev).unwrap();
        let ours = embedding(w.as_tensor(), &ids, None).unwrap();
        let theirs = candle_nn::Embedding::new(w.as_tensor().clone(), 3).forward(&ids).unwrap();
        assert_eq!(ours.to_vec3::<f32>().unwrap(), theirs.to_vec3::<f32>().unwrap());
        let g_ours = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (theirs * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let expected = g_theirs.get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(g_ours.get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap(), expected);
        // Through a sink: candle gets nothing, the sink holds the same gradient.
        let sink = WeightGrads::new();
        let out = embedding(w.as_tensor(), &ids, Some(WeightGradTarget { sink: sink.clone(), name: "e".into() })).unwrap();
        let g = (out * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(w.as_tensor()).is_none());
        assert_eq!(sink.take("e").unwrap().to_vec2::<f32>().unwrap(), expected);
        // An id outside the table is an error.
        assert!(embedding(w.as_tensor(), &Tensor::new(&[4u32], &dev).unwrap(), None).is_err());
    }
}
