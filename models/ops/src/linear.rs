//! `y = x Wᵀ` for training on CPU as one candle op with its own backward. Candle's `Linear`
//! builds it from a reshape, a transposed view of W and a matmul, and its backward then
//! accumulates a gradient for each of those nodes (a zero tensor and a sum each, W-sized for
//! the transposed view): here x and W are the only inputs, `dx = gy W` and `dW = gyᵀ x` are one
//! matrix product each over all rows, and a W that trains nothing (a LoRA base) gets no
//! gradient computed at all. Given a sink, dW goes there as its two factors (gy and x,
//! [`LinearGradRows`]) while they are no larger than dW, and the trainer makes it straight
//! into its own gradient buffer.
//!
//! On a GPU the same op runs on cuBLAS through candle's matmul: the forward reads W transposed
//! in place, dW is one product of gyᵀ and x (no zero tensor, no strided sum over the transposed
//! view of W, which candle's `Linear` backward ends in), and with a sink dW goes there whole.

use crate::cpu_f32_values;
use crate::f32_slice;
use crate::weight_grads::{GradRows, WeightGradTarget};
use candle_core::{CpuStorage, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use kernels::matmul::parallel::{input_grad_sum, product, product_add, product_wt};
use std::sync::Arc;

/// `x (.., in) · wᵀ` for `w (out, in)`: (.., out). f32 on the CPU (see [`crate::applies`]).
pub fn linear(x: &Tensor, w: &Tensor) -> Result<Tensor> {
    linear_to(x, w, None)
}

/// [`linear`] whose weight gradient, with `grad_to`, goes to that sink under its name
/// (`crate::weight_grads`) instead of candle's gradient store, which would add it to a
/// weight-sized zero tensor first: a memset and a pass over every weight gradient of a step.
pub fn linear_to(x: &Tensor, w: &Tensor, grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
    let (_, in_dim) = w.dims2()?;
    if x.dim(candle_core::D::Minus1)? != in_dim {
        candle_core::bail!("linear: input {:?} for a weight {:?}", x.dims(), w.dims());
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear { grad_to, heads: None })
}

/// [`linear_to`] whose (.., out) output comes as (.., heads, out / heads), the attention's
/// token-major q, k or v: a reshape after the op would be one more node, a zero tensor and a
/// sum in candle's backward.
pub fn linear_heads_to(x: &Tensor, w: &Tensor, heads: usize, grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
    let (out_dim, in_dim) = w.dims2()?;
    if x.dim(candle_core::D::Minus1)? != in_dim || heads == 0 || out_dim % heads != 0 {
        candle_core::bail!("linear: input {:?} for a weight {:?} in {heads} heads", x.dims(), w.dims());
    }
    x.contiguous()?.apply_op2(&w.contiguous()?, Linear { grad_to, heads: Some(heads) })
}

/// `residual + x · wᵀ` as one op: a transformer block's residual connection after its o_proj
/// and down_proj. The sum taken by a separate op cost candle's backward a zero tensor and a
/// sum for each of its two inputs (`weight_grads` says why); here the residual's gradient is
/// the upstream one itself and the product's is never a tensor. The same values as
/// `(residual + linear_to(x, w, grad_to))`: the product, then the residual added to it. f32 on
/// the CPU, or on a GPU (cuBLAS, then candle's add).
pub fn linear_add_to(x: &Tensor, w: &Tensor, residual: &Tensor, grad_to: Option<WeightGradTarget>) -> Result<Tensor> {
    let (out_dim, in_dim) = w.dims2()?;
    let mut want = x.dims().to_vec();
    if let Some(last) = want.last_mut() {
        *last = out_dim;
    }
    if x.dim(candle_core::D::Minus1)? != in_dim || residual.dims() != want.as_slice() {
        candle_core::bail!("linear_add: input {:?} and residual {:?} for a weight {:?}", x.dims(), residual.dims(), w.dims());
    }
    x.contiguous()?.apply_op3(&w.contiguous()?, &residual.contiguous()?, LinearAdd { grad_to })
}

/// The backward's two products for `gy = ∂L/∂y` of [`linear`]: (`dx = gy W`, `dW = gyᵀ x`), the
/// ops training runs (`cargo bench --bench matmul` times them beside MKL and OpenBLAS).
pub fn linear_grads(x: &Tensor, w: &Tensor, gy: &Tensor) -> Result<(Tensor, Tensor)> {
    let gy = gy.contiguous()?;
    Ok((gy.apply_op2_no_bwd(w, &InputGrad)?, gy.apply_op2_no_bwd(&x.contiguous()?, &WeightGrad)?))
}

struct Linear {
    grad_to: Option<WeightGradTarget>,
    /// Output as (.., heads, out / heads).
    heads: Option<usize>,
}

/// `x · wᵀ` by a backend's own matrix product (cuBLAS on a GPU): x as (rows, in), wᵀ as the
/// (in, out) view of w's storage, which the product reads transposed in place. Both inputs
/// contiguous ([`linear_to`] makes them so).
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
pub(crate) fn backend_product_wt<B: candle_core::backend::BackendStorage>(xs: &B, xl: &Layout, ws: &B, wl: &Layout) -> Result<B> {
    let (out_dim, in_dim) = (wl.dims()[0], wl.dims()[1]);
    let rows = xl.shape().elem_count() / in_dim;
    let x = Layout::contiguous_with_offset((rows, in_dim), xl.start_offset());
    let wt = Layout::new(Shape::from((in_dim, out_dim)), vec![1, in_dim], wl.start_offset());
    xs.matmul(ws, (1, rows, out_dim, in_dim), &x, &wt)
}

impl Linear {
    /// y's shape for an input laid out as `xl`: (.., out), or (.., heads, out / heads).
    fn output_shape(&self, xl: &Layout, out_dim: usize) -> Shape {
        let mut dims = xl.dims().to_vec();
        *dims.last_mut().unwrap() = out_dim;
        if let Some(heads) = self.heads {
            *dims.last_mut().unwrap() = heads;
            dims.push(out_dim / heads);
        }
        Shape::from(dims)
    }
}

impl CustomOp2 for Linear {
    fn name(&self) -> &'static str {
        "fused-linear"
    }

    fn cpu_fwd(&self, xs: &CpuStorage, xl: &Layout, ws: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (x, w) = (f32_slice(xs, xl)?, f32_slice(ws, wl)?);
        let (out_dim, in_dim) = (wl.dims()[0], wl.dims()[1]);
        Ok((CpuStorage::F32(product_wt(x, w, out_dim, in_dim)), self.output_shape(xl, out_dim)))
    }

    /// `x · wᵀ` by cuBLAS ([`backend_product_wt`]).
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        Ok((backend_product_wt(xs, xl, ws, wl)?, self.output_shape(xl, wl.dims()[0])))
    }

    fn bwd(&self, x: &Tensor, w: &Tensor, _y: &Tensor, gy: &Tensor) -> Result<(Option<Tensor>, Option<Tensor>)> {
        linear_backward(x, w, gy, self.grad_to.as_ref())
    }
}

/// (dx, dW) of `y = x wᵀ` for `gy`: dW as [`weight_grad`] makes it.
fn linear_backward(x: &Tensor, w: &Tensor, gy: &Tensor, grad_to: Option<&WeightGradTarget>) -> Result<(Option<Tensor>, Option<Tensor>)> {
    // (.., out) whatever shape y came in (`linear_heads_to`'s (.., heads, head_dim)).
    let mut rows = x.dims().to_vec();
    *rows.last_mut().expect("a linear input has a last dimension") = w.dim(0)?;
    let gy = gy.contiguous()?.reshape(rows)?;
    let dx = match gy.device().is_cpu() {
        true => gy.apply_op2_no_bwd(w, &InputGrad)?,
        false => input_grad_by_matmul(&gy, w, x.dims())?,
    };
    Ok((Some(dx), weight_grad(x, w, gy, grad_to)?))
}

/// `dx = gy w` by candle's matmul (cuBLAS on a GPU), in x's shape `x_dims`.
pub(crate) fn input_grad_by_matmul(gy: &Tensor, w: &Tensor, x_dims: &[usize]) -> Result<Tensor> {
    gy.flatten_to(gy.rank() - 2)?.matmul(w)?.reshape(x_dims)
}

/// `dW = gyᵀ x` as one tensor: our product on the CPU, elsewhere one product of candle's
/// matmul (cuBLAS on a GPU) that reads gyᵀ transposed in place.
fn weight_grad_tensor(x: &Tensor, gy: &Tensor) -> Result<Tensor> {
    match gy.device().is_cpu() {
        true => gy.apply_op2_no_bwd(x, &WeightGrad),
        false => weight_grad_by_matmul(x, gy),
    }
}

/// [`weight_grad_tensor`]'s product off the CPU.
fn weight_grad_by_matmul(x: &Tensor, gy: &Tensor) -> Result<Tensor> {
    gy.flatten_to(gy.rank() - 2)?.t()?.matmul(&x.contiguous()?.flatten_to(x.rank() - 2)?)
}

/// `dW = gyᵀ x` of `y = x wᵀ`, for `gy` (.., out) contiguous: only for a weight that trains,
/// sent to `grad_to` when given (then none for candle's store).
pub(crate) fn weight_grad(x: &Tensor, w: &Tensor, gy: Tensor, grad_to: Option<&WeightGradTarget>) -> Result<Option<Tensor>> {
    match (w.track_op(), grad_to) {
        (false, _) => Ok(None),
        (true, None) => Ok(Some(weight_grad_tensor(x, &gy)?)),
        (true, Some(to)) => {
            let (out_dim, in_dim) = w.dims2()?;
            // The factors while they are no larger than dW itself (as many rows as inputs
            // or fewer): a long sequence's gy would outweigh the gradient it makes. The rows
            // are made by our CPU product; on a GPU dW is one product at once.
            if gy.device().is_cpu() && gy.elem_count() / out_dim <= in_dim {
                to.sink.add_rows(&to.name, Arc::new(LinearGradRows::new(gy, x.clone())?))?;
            } else {
                to.sink.add(&to.name, weight_grad_tensor(x, &gy)?)?;
            }
            Ok(None)
        }
    }
}

/// [`linear_add_to`]'s op: (x, w, residual).
pub(crate) struct LinearAdd {
    pub(crate) grad_to: Option<WeightGradTarget>,
}

impl CustomOp3 for LinearAdd {
    fn name(&self) -> &'static str {
        "fused-linear-add"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        ws: &CpuStorage,
        wl: &Layout,
        rs: &CpuStorage,
        rl: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (CpuStorage::F32(y), shape) = Linear { grad_to: None, heads: None }.cpu_fwd(xs, xl, ws, wl)? else {
            candle_core::bail!("linear_add: the product is not f32")
        };
        let mut y = y;
        // residual + product, as the separate sum computed it.
        kernels::pool::pool_add_into(&mut y, f32_slice(rs, rl)?);
        Ok((CpuStorage::F32(y), shape))
    }

    /// The product by cuBLAS ([`backend_product_wt`]), then residual + product by candle's
    /// add: the forward's work of the two ops it replaces; the backward is where it saves.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        ws: &candle_core::CudaStorage,
        wl: &Layout,
        rs: &candle_core::CudaStorage,
        rl: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::BackendStorage;
        let (product, shape) = Linear { grad_to: None, heads: None }.cuda_fwd(xs, xl, ws, wl)?;
        Ok((rs.binary_impl::<candle_core::op::Add>(&product, rl, &Layout::contiguous(&shape))?, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        _r: &Tensor,
        _y: &Tensor,
        gy: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let (dx, dw) = linear_backward(x, w, gy, self.grad_to.as_ref())?;
        Ok((dx, dw, Some(gy.clone())))
    }
}

/// A linear layer's weight gradient `dW = gyᵀ x` kept as its factors: the trainer makes the
/// rows it wants straight into its own buffer (accumulating), so that no dW tensor is written
/// and then added into that buffer in a second pass (at world 1 the whole gradient goes into
/// the rank's gradient chunk; sharded, each rank's rows into the reduce-scatter buffer).
#[derive(Debug)]
pub(crate) struct LinearGradRows {
    /// (rows, out), contiguous f32 on the CPU.
    gy: Tensor,
    /// (rows, in), contiguous f32 on the CPU.
    x: Tensor,
}

impl LinearGradRows {
    /// The factors of `gyᵀ x`; both must be contiguous f32 CPU tensors with the same rows.
    pub(crate) fn new(gy: Tensor, x: Tensor) -> Result<Self> {
        let rows = |t: &Tensor| t.elem_count() / t.dim(candle_core::D::Minus1).unwrap_or(1).max(1);
        let fits = |t: &Tensor| t.is_contiguous() && t.dtype() == candle_core::DType::F32 && t.device().is_cpu();
        if !fits(&gy) || !fits(&x) || rows(&gy) != rows(&x) {
            candle_core::bail!("linear weight gradient: factors {:?} and {:?} are not contiguous f32 CPU rows alike", gy.dims(), x.dims());
        }
        Ok(Self { gy, x })
    }

    fn out_dim(&self) -> usize {
        *self.gy.dims().last().unwrap_or(&1)
    }

    fn in_dim(&self) -> usize {
        *self.x.dims().last().unwrap_or(&1)
    }
}

impl GradRows for LinearGradRows {
    fn dims(&self) -> (usize, usize) {
        (self.out_dim(), self.in_dim())
    }

    fn add_rows(&self, first: usize, out: &mut [f32]) {
        let (out_dim, in_dim) = (self.out_dim(), self.in_dim());
        let (gs, gl) = self.gy.storage_and_layout();
        let (xs, xl) = self.x.storage_and_layout();
        // `new` checked both: contiguous f32 on the CPU.
        let g = cpu_f32_values(&gs, gl).expect("LinearGradRows::new checked gy");
        let x = cpu_f32_values(&xs, xl).expect("LinearGradRows::new checked x");
        let rows = g.len() / out_dim;
        // out (n, in) += gy[:, first..first + n]ᵀ (n, rows) · x (rows, in).
        product_add(out.len() / in_dim, in_dim, rows, out, (&g[first..], out_dim as isize, 1), (x, 1, in_dim as isize));
    }
}

/// `dx (.., in) = gy (.., out) · w (out, in)`.
struct InputGrad;

impl CustomOp2 for InputGrad {
    fn name(&self) -> &'static str {
        "fused-linear-input-grad"
    }

    fn cpu_fwd(&self, gs: &CpuStorage, gl: &Layout, ws: &CpuStorage, wl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (g, w) = (f32_slice(gs, gl)?, f32_slice(ws, wl)?);
        let (out_dim, in_dim) = (wl.dims()[0], wl.dims()[1]);
        let dx = input_grad_sum(g.len() / out_dim, in_dim, &[(g, w, out_dim)]);
        let mut dims = gl.dims().to_vec();
        *dims.last_mut().unwrap() = in_dim;
        Ok((CpuStorage::F32(dx), Shape::from(dims)))
    }
}

/// `dw (out, in) = gyᵀ (out, rows) · x (rows, in)`, all rows of the batch in one product.
struct WeightGrad;

impl CustomOp2 for WeightGrad {
    fn name(&self) -> &'static str {
        "fused-linear-weight-grad"
    }

    fn cpu_fwd(&self, gs: &CpuStorage, gl: &Layout, xs: &CpuStorage, xl: &Layout) -> Result<(CpuStorage, Shape)> {
        let (g, x) = (f32_slice(gs, gl)?, f32_slice(xs, xl)?);
        let (out_dim, in_dim) = (*gl.dims().last().unwrap(), *xl.dims().last().unwrap());
        let rows = g.len() / out_dim;
        // gyᵀ is (out, rows): element (o, r) at r * out + o.
        let dw = product(out_dim, in_dim, rows, (g, out_dim as isize, 1), (x, 1, in_dim as isize));
        Ok((CpuStorage::F32(dw), Shape::from((out_dim, in_dim))))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::testing::{check_fd, grads, max_rel, rand};
    use candle_core::Var;

    #[test]
    fn linear_matches_candle_and_finite_differences() {
        let (x, w) = (rand(&[2, 7, 24], 31, 1.0), rand(&[40, 24], 32, 0.5));
        let probe = rand(&[2, 7, 40], 33, 1.0);
        let composite = |t: &[Tensor]| candle_nn::Linear::new(t[1].clone(), None).forward_t(&t[0]);
        assert!(max_rel(&linear(&x, &w).unwrap(), &composite(&[x.clone(), w.clone()]).unwrap()) < 1e-5);
        let vars = [Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap()];
        let fused = grads(&vars, &probe, &|t| linear(&t[0], &t[1]));
        let want = grads(&vars, &probe, &composite);
        for (which, (a, b)) in fused.iter().zip(&want).enumerate() {
            assert!(max_rel(a, b) < 1e-4, "input {which}: {}", max_rel(a, b));
            check_fd(&[x.clone(), w.clone()], which, &probe, a, &composite);
        }
        // A frozen weight (not a variable) gets no gradient; the input still does.
        let xv = Var::from_tensor(&x).unwrap();
        let g = (linear(xv.as_tensor(), &w).unwrap() * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(g.get(&w).is_none() && g.get(xv.as_tensor()).is_some());
    }

    /// The residual form is the composite sum's values, bit for bit, and its gradients (the
    /// residual's is the upstream gradient); the heads form is the reshaped product, and its
    /// gradients the plain op's. Through the sink too (`LinearGradRows` of a 4-D gy).
    #[test]
    fn residual_and_heads_forms_match_the_plain_op() {
        let (x, w, r) = (rand(&[2, 7, 24], 41, 1.0), rand(&[40, 24], 42, 0.5), rand(&[2, 7, 40], 43, 1.0));
        let plain = (&r + linear(&x, &w).unwrap()).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        let composite = |t: &[Tensor]| &t[2] + candle_nn::Linear::new(t[1].clone(), None).forward_t(&t[0])?;
        let fused = linear_add_to(&x, &w, &r, None).unwrap().flatten_all().unwrap().to_vec1::<f32>().unwrap();
        assert!(plain.iter().zip(&fused).all(|(a, b)| a.to_bits() == b.to_bits()), "not the composite sum's bits");
        let probe = rand(&[2, 7, 40], 44, 1.0);
        let vars = [Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap(), Var::from_tensor(&r).unwrap()];
        let got = grads(&vars, &probe, &|t| linear_add_to(&t[0], &t[1], &t[2], None));
        let want = grads(&vars, &probe, &composite);
        for (which, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(max_rel(a, b) < 1e-5, "input {which}: {}", max_rel(a, b));
            check_fd(&[x.clone(), w.clone(), r.clone()], which, &probe, a, &composite);
        }
        assert!(linear_add_to(&x, &w, &rand(&[2, 7, 39], 45, 1.0), None).is_err(), "a residual of the wrong shape");

        let heads = linear_heads_to(&x, &w, 4, None).unwrap();
        assert_eq!(heads.dims(), &[2, 7, 4, 10]);
        assert!(max_rel(&heads.reshape((2, 7, 40)).unwrap(), &linear(&x, &w).unwrap()) == 0.0);
        let probe4 = probe.reshape((2, 7, 4, 10)).unwrap();
        let vars = [Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap()];
        let got = grads(&vars, &probe4, &|t| linear_heads_to(&t[0], &t[1], 4, None));
        let want = grads(&vars, &probe, &|t| linear(&t[0], &t[1]));
        for (which, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(max_rel(a, b) == 0.0, "input {which}: {}", max_rel(a, b));
        }
        let sink = crate::weight_grads::WeightGrads::new();
        let to = WeightGradTarget { sink: sink.clone(), name: "w".into() };
        let xv = Var::from_tensor(&x).unwrap();
        let wv = Var::from_tensor(&w).unwrap();
        (linear_heads_to(xv.as_tensor(), wv.as_tensor(), 4, Some(to)).unwrap() * &probe4).unwrap().sum_all().unwrap().backward().unwrap();
        let dw = sink.take("w").expect("the sink got dW").into_tensor(&candle_core::Device::Cpu).unwrap();
        assert!(max_rel(&dw, &want[1]) < 1e-6, "{}", max_rel(&dw, &want[1]));
        assert!(linear_heads_to(&x, &w, 3, None).is_err(), "40 outputs in 3 heads");
    }

    /// With a sink, the weight's gradient goes there, the same values candle's store would have
    /// held, and the store gets none for it (the input's gradient still goes to candle): as its
    /// factors with no more rows than inputs (any range of its rows made on demand), as a
    /// tensor with more.
    #[test]
    fn a_sink_gets_the_weight_gradient_candles_store_would_hold() {
        use crate::weight_grads::WeightGrads;
        for (rows, by_rows) in [(7, true), (30, false)] {
            let (x, w) = (Var::from_tensor(&rand(&[2, rows, 24], 34, 1.0)).unwrap(), Var::from_tensor(&rand(&[40, 24], 35, 0.5)).unwrap());
            let probe = rand(&[2, rows, 40], 36, 1.0);
            let loss = |y: Tensor| (y * &probe).unwrap().sum_all().unwrap();
            let plain = loss(linear(x.as_tensor(), w.as_tensor()).unwrap()).backward().unwrap();
            let sink = WeightGrads::new();
            let to = WeightGradTarget { sink: sink.clone(), name: "proj.weight".into() };
            let store = loss(linear_to(x.as_tensor(), w.as_tensor(), Some(to)).unwrap()).backward().unwrap();
            assert!(store.get(w.as_tensor()).is_none());
            assert_eq!(max_rel(store.get(x.as_tensor()).unwrap(), plain.get(x.as_tensor()).unwrap()), 0.0);
            let grad = sink.take("proj.weight").expect("deposited");
            assert_eq!(grad.as_dense().is_none(), by_rows, "{} rows of 24 inputs", 2 * rows);
            let want = plain.get(w.as_tensor()).unwrap();
            assert_eq!(max_rel(&grad.clone().into_tensor(&candle_core::Device::Cpu).unwrap(), want), 0.0);
            // Rows 10..25 alone, added to ones.
            let mut part = vec![1f32; 15 * 24];
            grad.add_rows(10, &mut part).unwrap();
            let want_part = (want.narrow(0, 10, 15).unwrap() + 1.0).unwrap();
            assert_eq!(max_rel(&Tensor::from_vec(part, (15, 24), &candle_core::Device::Cpu).unwrap(), &want_part), 0.0);
        }
    }

    /// What the GPU path computes, run here through the CPU backend: the forward's product
    /// reading wᵀ in place, dx and dW by candle's matmul, against our CPU op and its gradients.
    #[test]
    fn the_gpu_paths_products_equal_the_cpu_ops() {
        use candle_core::Storage;
        let (x, w) = (rand(&[2, 9, 24], 41, 1.0), rand(&[40, 24], 42, 0.5));
        let (xs, xl) = x.storage_and_layout();
        let (ws, wl) = w.storage_and_layout();
        let (Storage::Cpu(xs), Storage::Cpu(ws)) = (&*xs, &*ws) else { panic!("CPU tensors") };
        let y = backend_product_wt(xs, xl, ws, wl).unwrap();
        let y = Tensor::from_vec(y.as_slice::<f32>().unwrap().to_vec(), (2, 9, 40), &candle_core::Device::Cpu).unwrap();
        assert!(max_rel(&y, &linear(&x, &w).unwrap()) < 1e-6);
        let gy = rand(&[2, 9, 40], 43, 1.0);
        let (dx, dw) = linear_grads(&x, &w, &gy).unwrap();
        assert!(max_rel(&input_grad_by_matmul(&gy, &w, x.dims()).unwrap(), &dx) < 1e-6);
        assert!(max_rel(&weight_grad_by_matmul(&x, &gy).unwrap(), &dw) < 1e-6);
    }

    trait ForwardT {
        fn forward_t(&self, x: &Tensor) -> Result<Tensor>;
    }
    impl ForwardT for candle_nn::Linear {
        fn forward_t(&self, x: &Tensor) -> Result<Tensor> {
            candle_core::Module::forward(self, x)
        }
    }
}
