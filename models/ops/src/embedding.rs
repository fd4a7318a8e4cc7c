//! Token embedding for training on the CPU: rows of the table picked by id, with a backward that
//! builds the table's gradient in one buffer (rows of the upstream gradient added at their ids)
//! and, given a [`WeightGradTarget`], hands it to the trainer instead of candle's gradient store
//! (see `crate::weight_grads`), as rows made on demand: a trainer reducing the gradient a range
//! of rows at a time never holds the (vocab, hidden) buffer. The backward never reads the table
//! itself. On a GPU (f32 or bf16, our kernels on: [`gpu_takes`]) the rows come from candle's
//! `index_select` and the gradient from a kernel of ours that sums each id's rows in token
//! order (candle's `index_select` backward is an `index_add` with a thread per column walking
//! every token, accumulating in the table's dtype). As torch's `nn.Embedding(padding_idx=...)`, which transformers builds with the
//! model's `pad_token_id`, the padding row receives no gradient from the lookup.

use std::sync::Arc;

use candle_core::{CpuStorage, CustomOp2, Layout, Result, Shape, Storage, Tensor};

use crate::f32_slice;
use crate::weight_grads::{GradRows, WeightGradTarget};

/// Whether [`embedding`] runs for the table `w` on a GPU: where `fused_cuda`'s kernels do (f32
/// or bf16, `FSDP_CUDA_KERNELS` not 0). On the CPU it runs in f32.
pub fn gpu_takes(w: &Tensor) -> bool {
    crate::fused_cuda_takes(w)
}

/// `w[ids]`: (ids..., hidden) rows of the (vocab, hidden) table `w` (f32 on the CPU, or where
/// [`gpu_takes`]); `ids` u32. The row `padding_idx` gets no gradient from the lookup.
pub fn embedding(w: &Tensor, ids: &Tensor, padding_idx: Option<u32>, grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
    let hidden = w.dim(1)?;
    let mut shape = ids.dims().to_vec();
    shape.push(hidden);
    let flat = ids.flatten_all()?.contiguous()?;
    let out = w.contiguous()?.apply_op2(&flat, Embed { padding_idx, grad_to })?;
    out.reshape(shape)
}

/// [`embedding`] composed of candle's ops, for every device and dtype: the lookup's rows at
/// `padding_idx` are taken from a detached copy of the output, so no gradient reaches that row.
pub fn embedding_composed(w: &Tensor, ids: &Tensor, padding_idx: Option<u32>) -> Result<Tensor> {
    let hidden = w.dim(1)?;
    let mut shape = ids.dims().to_vec();
    shape.push(hidden);
    let flat = ids.flatten_all()?;
    let out = w.index_select(&flat, 0)?;
    let out = match padding_idx {
        Some(pad) if w.track_op() => {
            let is_pad = flat.to_dtype(candle_core::DType::U32)?.eq(pad)?.unsqueeze(1)?.broadcast_as(out.shape())?;
            is_pad.where_cond(&out.detach(), &out)?
        }
        _ => out,
    };
    out.reshape(shape)
}

struct Embed {
    padding_idx: Option<u32>,
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

    /// On a GPU: the table's rows by candle's `index_select`.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        is: &candle_core::CudaStorage,
        il: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (_, hidden) = wl.shape().dims2()?;
        Ok((ws.index_select(is, wl, il, 0)?, Shape::from((il.shape().elem_count(), hidden))))
    }

    fn bwd(&self, w: &Tensor, ids: &Tensor, _out: &Tensor, grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let (vocab, hidden) = w.dims2()?;
        let mut ids: Vec<u32> = ids.to_dtype(candle_core::DType::U32)?.to_vec1()?;
        if grad.device().is_cuda() {
            return self.gpu_backward(w, &ids, grad);
        }
        let grad = grad.contiguous()?;
        let (gs, gl) = grad.storage_and_layout();
        let Storage::Cpu(gc) = &*gs else { candle_core::bail!("embedding: the backward runs on the CPU") };
        let mut upstream = f32_slice(gc, gl)?.to_vec();
        if let Some(pad) = self.padding_idx {
            // The padding positions' rows leave the gradient (fewer rows to add, too).
            let keep: Vec<usize> = (0..ids.len()).filter(|&r| ids[r] != pad).collect();
            upstream = keep.iter().flat_map(|&r| upstream[r * hidden..(r + 1) * hidden].iter().copied()).collect();
            ids = keep.iter().map(|&r| ids[r]).collect();
        }
        let rows = EmbeddingGradRows { ids, upstream, vocab, hidden };
        match &self.grad_to {
            Some(t) => {
                t.sink.add_rows(&t.name, Arc::new(rows))?;
                Ok((None, None))
            }
            None => {
                let mut dw = vec![0f32; vocab * hidden];
                rows.add_rows(0, &mut dw);
                Ok((Some(Tensor::from_vec(dw, (vocab, hidden), w.device())?), None))
            }
        }
    }
}

impl Embed {
    /// The table's gradient on a GPU (`fused_cuda::embedding_backward`: each id's rows summed in
    /// f32, in token order), in the table's dtype as the other ops' weight gradients are, to the
    /// sink or to candle's store.
    fn gpu_backward(&self, w: &Tensor, ids: &[u32], grad: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        #[cfg(feature = "cuda")]
        {
            let (vocab, runs) = (w.dim(0)?, id_runs(ids, self.padding_idx));
            if ids.iter().any(|&id| id as usize >= vocab) {
                candle_core::bail!("embedding: a token id outside the vocabulary ({vocab})");
            }
            let dw = crate::fused_cuda::embedding_backward(grad, &runs, vocab)?.to_dtype(w.dtype())?;
            match &self.grad_to {
                Some(t) => {
                    t.sink.add(&t.name, dw)?;
                    Ok((None, None))
                }
                None => Ok((Some(dw), None)),
            }
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (w, ids, grad);
            candle_core::bail!("embedding: a GPU gradient in a build without the cuda feature")
        }
    }
}

/// The GPU backward's `runs` (`fused.cu`'s embedding_backward reads them): the tokens in id order (`skip`'s left out), then where each distinct id's
/// run starts (and one past the last), then each run's id; and the number of runs.
pub fn id_runs(ids: &[u32], skip: Option<u32>) -> (Vec<u32>, usize) {
    let mut order: Vec<u32> = (0..ids.len() as u32).filter(|&t| Some(ids[t as usize]) != skip).collect();
    order.sort_by_key(|&t| ids[t as usize]);
    let mut starts = vec![];
    let mut rows = vec![];
    for (j, &t) in order.iter().enumerate() {
        if rows.last() != Some(&ids[t as usize]) {
            starts.push(j as u32);
            rows.push(ids[t as usize]);
        }
    }
    starts.push(order.len() as u32);
    // Positions past `order` are never read: the kernel's `starts` begins at `tokens`.
    order.resize(ids.len(), 0);
    let count = rows.len();
    (order.into_iter().chain(starts).chain(rows).collect(), count)
}

/// The table's gradient: upstream row `r` added at row `ids[r]`.
#[derive(Debug)]
struct EmbeddingGradRows {
    ids: Vec<u32>,
    upstream: Vec<f32>,
    vocab: usize,
    hidden: usize,
}

impl GradRows for EmbeddingGradRows {
    fn dims(&self) -> (usize, usize) {
        (self.vocab, self.hidden)
    }

    fn add_rows(&self, first: usize, out: &mut [f32]) {
        let h = self.hidden;
        let range = first..first + out.len() / h;
        for (r, &id) in self.ids.iter().enumerate() {
            let id = id as usize;
            if range.contains(&id) {
                let at = (id - first) * h;
                for (a, b) in out[at..at + h].iter_mut().zip(&self.upstream[r * h..(r + 1) * h]) {
                    *a += *b;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn runs_of_ids_sorted_stably_without_the_skipped_id() {
        let (runs, count) = super::id_runs(&[5, 2, 5, 0, 2, 7], Some(7));
        assert_eq!(count, 3);
        // order (padded to the 6 tokens), starts (and the end), each run's id.
        assert_eq!(runs, [3, 1, 4, 0, 2, 0, 0, 1, 3, 5, 0, 2, 5]);
        assert_eq!(super::id_runs(&[7, 7], Some(7)), (vec![0, 0, 0], 0), "every token skipped: no runs");
    }

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
        let ours = embedding(w.as_tensor(), &ids, None, None).unwrap();
        let theirs = candle_nn::Embedding::new(w.as_tensor().clone(), 3).forward(&ids).unwrap();
        assert_eq!(ours.to_vec3::<f32>().unwrap(), theirs.to_vec3::<f32>().unwrap());
        let g_ours = (ours * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let g_theirs = (theirs * &up).unwrap().sum_all().unwrap().backward().unwrap();
        let expected = g_theirs.get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        assert_eq!(g_ours.get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap(), expected);
        // Through a sink: candle gets nothing, the sink holds the same gradient.
        let sink = WeightGrads::new();
        let out = embedding(w.as_tensor(), &ids, None, Some(WeightGradTarget { sink: sink.clone(), name: "e".into() })).unwrap();
        let g = (out * &up).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(w.as_tensor()).is_none());
        let from_sink = sink.take("e").unwrap();
        assert!(from_sink.as_dense().is_none(), "the sink gets rows, not a (vocab, hidden) buffer");
        assert_eq!(from_sink.clone().into_tensor(&dev).unwrap().to_vec2::<f32>().unwrap(), expected);
        // Any range of rows on its own: rows 1..3.
        let mut some = vec![0f32; 2 * 3];
        from_sink.add_rows(1, &mut some).unwrap();
        assert_eq!(some, expected[1..3].concat());
        // An id outside the table is an error.
        assert!(embedding(w.as_tensor(), &Tensor::new(&[4u32], &dev).unwrap(), None, None).is_err());
    }

    /// The padding row gets no gradient from the lookup, in the fused and the composed form;
    /// every other row gets what it got without a padding row; the outputs are unchanged.
    #[test]
    fn the_padding_row_gets_no_gradient() {
        let dev = Device::Cpu;
        let w = Var::from_vec((0..12).map(|x| x as f32).collect(), (4, 3), &dev).unwrap();
        let ids = Tensor::new(&[[1u32, 3, 1], [0, 2, 2]], &dev).unwrap();
        let up = Tensor::new(&[[[1f32, 2., 3.], [4., 5., 6.], [7., 8., 9.]], [[1., 1., 1.], [2., 2., 2.], [3., 3., 3.]]], &dev).unwrap();
        let grad =
            |out: Tensor| (out * &up).unwrap().sum_all().unwrap().backward().unwrap().get(w.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
        let plain = grad(embedding(w.as_tensor(), &ids, None, None).unwrap());
        let mut want = plain.clone();
        want[1] = vec![0.0; 3];
        for (what, out) in [
            ("fused", embedding(w.as_tensor(), &ids, Some(1), None).unwrap()),
            ("composed", embedding_composed(w.as_tensor(), &ids, Some(1)).unwrap()),
        ] {
            assert_eq!(
                out.to_vec3::<f32>().unwrap(),
                embedding(w.as_tensor(), &ids, None, None).unwrap().to_vec3::<f32>().unwrap(),
                "{what}"
            );
            assert_eq!(grad(out), want, "{what}");
        }
        assert_ne!(plain[1], vec![0.0; 3], "row 1 is looked up twice: without padding_idx it has a gradient");
    }
}
