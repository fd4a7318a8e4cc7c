//! The first half of a Llama MLP for training on CPU, `silu(x W_gateᵀ) ∘ (x W_upᵀ)`, as one candle
//! op. As three ops (two `linear`s, then `swiglu`), candle's backward adds each of gate's and
//! up's gradients to a zero tensor of their (tokens, intermediate) size first (a memset on the
//! calling thread while the pool waits, then a sum), and x's two gradients, one from each
//! product, into a third: here gate and up are never graph nodes (the op keeps them for its
//! backward), and x's gradient is one buffer, the second product added into the first's.
//! The values are those of the three ops: the same products, the same SwiGLU kernel. On a GPU
//! (f32 or bf16, our kernels on: [`gpu_takes`]) the products run on cuBLAS and the SwiGLU on
//! `fused_cuda`'s kernels, the gate and up products kept as GPU tensors for the backward.

use std::sync::Mutex;

use candle_core::{CpuStorage, CustomOp3, Layout, Result, Shape, Tensor};

use crate::fused::{swiglu_grads, swiglu_values};
use crate::linear::{input_grad_by_matmul, weight_grad};
use crate::residual_sublayer::Inside;
use crate::weight_grads::WeightGradTarget;
use crate::{cpu_f32_values, f32_slice};
use kernels::matmul::parallel::{input_grad_sum, product_wt};

/// Whether [`swiglu_linear_to`] runs for x on a GPU: where `fused`'s SwiGLU kernels do (f32 or
/// bf16, `FSDP_CUDA_KERNELS` not 0). On the CPU it runs in f32 ([`crate::applies`]).
pub fn gpu_takes(x: &Tensor) -> bool {
    crate::fused_cuda_takes(x)
}

/// `silu(x · w_gateᵀ) ∘ (x · w_upᵀ)` for x (.., in) and both weights (intermediate, in):
/// (.., intermediate). Each weight's gradient goes to its sink when given (see
/// `linear::linear_to`). f32 on the CPU (see [`crate::applies`]), or where [`gpu_takes`].
pub fn swiglu_linear_to(x: &Tensor, w_gate: &Tensor, w_up: &Tensor, grad_to: [Option<WeightGradTarget>; 2]) -> Result<Tensor> {
    let (inter, in_dim) = w_gate.dims2()?;
    if w_up.dims() != w_gate.dims() || x.dim(candle_core::D::Minus1)? != in_dim {
        candle_core::bail!("gated MLP: input {:?} for a gate weight {:?} and an up weight {:?}", x.dims(), w_gate.dims(), w_up.dims());
    }
    let op = GatedUp { grad_to, saved: Mutex::new(None), inter };
    x.contiguous()?.apply_op3(&w_gate.contiguous()?, &w_up.contiguous()?, op)
}

/// [`swiglu_linear_to`] outside candle's graph, kept for its backward: the inside of an MLP's
/// residual sublayer (`residual_sublayer`). A weight that trains needs a sink.
pub fn swiglu_linear_inside(x: &Tensor, w_gate: &Tensor, w_up: &Tensor, grad_to: [Option<WeightGradTarget>; 2]) -> Result<Inside> {
    let (inter, in_dim) = w_gate.dims2()?;
    if w_up.dims() != w_gate.dims() || x.dim(candle_core::D::Minus1)? != in_dim {
        candle_core::bail!("gated MLP: input {:?} for a gate weight {:?} and an up weight {:?}", x.dims(), w_gate.dims(), w_up.dims());
    }
    if let Some((w, _)) = [w_gate, w_up].into_iter().zip(&grad_to).find(|(w, to)| w.track_op() && to.is_none()) {
        candle_core::bail!("gated MLP: a weight {:?} that trains has no gradient sink", w.dims());
    }
    Inside::of_op3(x, [w_gate, w_up], GatedUp { grad_to, saved: Mutex::new(None), inter })
}

struct GatedUp {
    grad_to: [Option<WeightGradTarget>; 2],
    /// The forward's gate and up products, for the backward (which takes them: one backward
    /// per forward, as training runs it).
    saved: Mutex<Option<Saved>>,
    inter: usize,
}

/// The gate and up products: the CPU's values, or a GPU's tensors.
enum Saved {
    Cpu(Vec<f32>, Vec<f32>),
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    Gpu(Tensor, Tensor),
}

impl GatedUp {
    fn save(&self, saved: Saved) {
        *self.saved.lock().expect("the gated MLP's saved products") = Some(saved);
    }

    /// (.., intermediate) for an input laid out as `xl`.
    fn output_shape(&self, xl: &Layout) -> Shape {
        let mut dims = xl.dims().to_vec();
        *dims.last_mut().expect("checked: x has an `in` dimension") = self.inter;
        Shape::from(dims)
    }
}

impl CustomOp3 for GatedUp {
    fn name(&self) -> &'static str {
        "fused-gated-mlp"
    }

    fn cpu_fwd(
        &self,
        xs: &CpuStorage,
        xl: &Layout,
        gs: &CpuStorage,
        gl: &Layout,
        us: &CpuStorage,
        ul: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        let (x, w_gate, w_up) = (f32_slice(xs, xl)?, f32_slice(gs, gl)?, f32_slice(us, ul)?);
        let in_dim = gl.dims()[1];
        let gate = product_wt(x, w_gate, self.inter, in_dim);
        let up = product_wt(x, w_up, self.inter, in_dim);
        let h = swiglu_values(&gate, &up);
        self.save(Saved::Cpu(gate, up));
        Ok((CpuStorage::F32(h), self.output_shape(xl)))
    }

    /// Both products by cuBLAS (`linear::backend_product_wt`), the SwiGLU by our kernel.
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        xs: &candle_core::CudaStorage,
        xl: &Layout,
        gs: &candle_core::CudaStorage,
        gl: &Layout,
        us: &candle_core::CudaStorage,
        ul: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use crate::linear::backend_product_wt;
        let shape = self.output_shape(xl);
        let (gate, up) = (backend_product_wt(xs, xl, gs, gl)?, backend_product_wt(xs, xl, us, ul)?);
        let layout = Layout::contiguous(&shape);
        let h = crate::fused_cuda::swiglu_forward([(&gate, &layout), (&up, &layout)])?;
        let tensor = |s| Tensor::from_storage(candle_core::Storage::Cuda(s), shape.clone(), candle_core::op::BackpropOp::none(), false);
        self.save(Saved::Gpu(tensor(gate), tensor(up)));
        Ok((h, shape))
    }

    fn bwd(
        &self,
        x: &Tensor,
        w_gate: &Tensor,
        w_up: &Tensor,
        _h: &Tensor,
        gh: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let saved = self.saved.lock().expect("the gated MLP's saved products").take();
        let [to_gate, to_up] = self.grad_to.each_ref().map(Option::as_ref);
        let (gate, up) = match saved {
            Some(Saved::Cpu(gate, up)) => (gate, up),
            Some(Saved::Gpu(gate, up)) => {
                // dx = d_gate · W_gate + d_up · W_up; each weight's gradient one product.
                let (d_gate, d_up) = crate::fused::swiglu_backward(&gate, &up, gh)?;
                drop((gate, up));
                let dx = (input_grad_by_matmul(&d_gate, w_gate, x.dims())? + input_grad_by_matmul(&d_up, w_up, x.dims())?)?;
                let dw_gate = weight_grad(x, w_gate, d_gate, to_gate)?;
                let dw_up = weight_grad(x, w_up, d_up, to_up)?;
                return Ok((Some(dx), dw_gate, dw_up));
            }
            None => candle_core::bail!("gated MLP: a second backward through the same forward"),
        };
        let gh = gh.contiguous()?;
        let ((gs, gl), (wgs, wgl), (wus, wul)) = (gh.storage_and_layout(), w_gate.storage_and_layout(), w_up.storage_and_layout());
        let grads = swiglu_grads(&gate, &up, cpu_f32_values(&gs, gl)?);
        drop((gate, up));
        let (in_dim, inter, n) = (w_gate.dim(1)?, self.inter, gh.elem_count());
        let rows = n / inter;
        // dx = d_gate · W_gate + d_up · W_up, into one buffer.
        let (d_gate, d_up) = grads.split_at(n);
        let terms = [(d_gate, cpu_f32_values(&wgs, wgl)?, inter), (d_up, cpu_f32_values(&wus, wul)?, inter)];
        let dx = input_grad_sum(rows, in_dim, &terms);
        drop(((gs, gl), (wgs, wgl), (wus, wul)));
        let dx = Tensor::from_vec(dx, x.shape(), x.device())?;
        // Each weight's gradient from its half of the buffer (views, no copies).
        let grads = Tensor::from_vec(grads, (2, rows, inter), x.device())?;
        let dw_gate = weight_grad(x, w_gate, grads.get(0)?, to_gate)?;
        let dw_up = weight_grad(x, w_up, grads.get(1)?, to_up)?;
        Ok((Some(dx), dw_gate, dw_up))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fused::rms_norm;
    use crate::linear::{linear, linear_add_to};
    use crate::residual_sublayer::prenorm_residual;
    use crate::testing::{check_fd, grads, max_rel, rand};
    use crate::weight_grads::WeightGrads;
    use candle_core::{Device, Var};

    /// The three ops it replaces: two products, then the SwiGLU.
    fn three_ops(t: &[Tensor]) -> Result<Tensor> {
        crate::fused::swiglu(&linear(&t[0], &t[1])?, &linear(&t[0], &t[2])?)
    }

    /// The same in candle's composite ops, at any dtype (finite differences run in f64).
    fn composite(t: &[Tensor]) -> Result<Tensor> {
        let product = |w: &Tensor| t[0].broadcast_matmul(&w.t()?);
        candle_nn::ops::silu(&product(&t[1])?)? * product(&t[2])?
    }

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    #[test]
    fn matches_the_three_ops_and_finite_differences() {
        let (x, w_gate, w_up) = (rand(&[2, 7, 24], 51, 1.0), rand(&[40, 24], 52, 0.5), rand(&[40, 24], 53, 0.5));
        let inputs = [x.clone(), w_gate.clone(), w_up.clone()];
        let fused = |t: &[Tensor]| swiglu_linear_to(&t[0], &t[1], &t[2], [None, None]);
        assert_eq!(bits(&fused(&inputs).unwrap()), bits(&three_ops(&inputs).unwrap()), "not the three ops' values");
        let probe = rand(&[2, 7, 40], 54, 1.0);
        let vars = inputs.each_ref().map(|t| Var::from_tensor(t).unwrap());
        let got = grads(&vars, &probe, &fused);
        let want = grads(&vars, &probe, &three_ops);
        for (which, (a, w)) in got.iter().zip(&want).enumerate() {
            assert!(max_rel(a, w) < 1e-6, "input {which}: {}", max_rel(a, w));
            check_fd(&inputs, which, &probe, a, &composite);
        }
        let loss = (fused(&vars.each_ref().map(|v| v.as_tensor().clone())).unwrap() * &probe).unwrap().sum_all().unwrap();
        loss.backward().unwrap();
        assert!(loss.backward().is_err(), "the forward's products were taken by the first backward");
        assert!(swiglu_linear_to(&x, &w_gate, &rand(&[41, 24], 55, 0.5), [None, None]).is_err(), "weights of two shapes");
        assert!(swiglu_linear_to(&rand(&[2, 7, 23], 56, 1.0), &w_gate, &w_up, [None, None]).is_err(), "an input of the wrong width");
    }

    /// With sinks, each weight's gradient goes to its own, as the linear layers' do, and
    /// candle's store gets none for them.
    #[test]
    fn the_weight_gradients_go_to_their_sinks() {
        let (x, w_gate, w_up) = (rand(&[2, 7, 24], 61, 1.0), rand(&[40, 24], 62, 0.5), rand(&[40, 24], 63, 0.5));
        let vars = [&x, &w_gate, &w_up].map(|t| Var::from_tensor(t).unwrap());
        let probe = rand(&[2, 7, 40], 64, 1.0);
        let want = grads(&vars, &probe, &three_ops);
        let sink = WeightGrads::new();
        let to = |name: &str| Some(WeightGradTarget { sink: sink.clone(), name: name.into() });
        let h = swiglu_linear_to(vars[0].as_tensor(), vars[1].as_tensor(), vars[2].as_tensor(), [to("gate"), to("up")]).unwrap();
        let store = (h * &probe).unwrap().sum_all().unwrap().backward().unwrap();
        assert!(store.get(vars[1].as_tensor()).is_none() && store.get(vars[2].as_tensor()).is_none());
        assert!(max_rel(store.get(vars[0].as_tensor()).unwrap(), &want[0]) < 1e-6);
        for (name, want) in [("gate", &want[1]), ("up", &want[2])] {
            let got = sink.take(name).expect("deposited").into_tensor(&Device::Cpu).unwrap();
            assert!(max_rel(&got, want) < 1e-6, "{name}: {}", max_rel(&got, want));
        }
    }

    /// The MLP half of a block as one op against the three ops it replaces (norm, gated MLP,
    /// down product with the residual) under candle's backward: the output's bits, x's and the
    /// norm weight's gradients in candle's store, each projection's in its sink, all the same
    /// bits; and the backward runs once.
    #[test]
    fn its_residual_sublayer_matches_the_composed_ops() {
        let (b, t, hidden, inter) = (2, 9, 24, 40);
        let x = Var::from_tensor(&rand(&[b, t, hidden], 91, 1.0)).unwrap();
        let norm = Var::from_tensor(&(rand(&[hidden], 92, 0.2) + 1.0).unwrap()).unwrap();
        let ws = [rand(&[inter, hidden], 93, 0.4), rand(&[inter, hidden], 94, 0.4), rand(&[hidden, inter], 95, 0.4)];
        let ws = ws.map(|w| Var::from_tensor(&w).unwrap());
        let probe = rand(&[b, t, hidden], 96, 1.0);
        let names = ["gate", "up", "down"];
        let run = |sublayer: bool| {
            let sink = WeightGrads::new();
            let to = |i: usize| Some(WeightGradTarget { sink: sink.clone(), name: names[i].into() });
            let (gate, up, down) = (ws[0].as_tensor(), ws[1].as_tensor(), ws[2].as_tensor());
            let y = match sublayer {
                true => {
                    let inside = |n: &Tensor| swiglu_linear_inside(n, gate, up, [to(0), to(1)]);
                    prenorm_residual(x.as_tensor(), norm.as_tensor(), 1e-5, inside, (down.clone(), to(2))).unwrap()
                }
                false => {
                    let n = rms_norm(x.as_tensor(), norm.as_tensor(), 1e-5).unwrap();
                    let h = swiglu_linear_to(&n, gate, up, [to(0), to(1)]).unwrap();
                    linear_add_to(&h, down, x.as_tensor(), to(2)).unwrap()
                }
            };
            let loss = (&y * &probe).unwrap().sum_all().unwrap();
            let store = loss.backward().unwrap();
            if sublayer {
                assert!(loss.backward().is_err(), "the inside was taken by the first backward");
            }
            let sinks = names.map(|n| sink.take(n).expect("deposited").into_tensor(&Device::Cpu).unwrap());
            assert!(ws.iter().all(|w| store.get(w.as_tensor()).is_none()), "a projection's gradient in candle's store");
            (y, store.get(x.as_tensor()).unwrap().clone(), store.get(norm.as_tensor()).unwrap().clone(), sinks)
        };
        let (got, want) = (run(true), run(false));
        assert_eq!(bits(&got.0), bits(&want.0), "not the composed ops' values");
        assert_eq!(bits(&got.1), bits(&want.1), "x's gradient");
        assert_eq!(bits(&got.2), bits(&want.2), "the norm weight's gradient");
        for (name, (g, w)) in names.iter().zip(got.3.iter().zip(&want.3)) {
            assert!(max_rel(g, w) == 0.0, "{name}: {}", max_rel(g, w));
        }
    }

    /// An output weight that trains with no sink would lose its gradient: refused.
    #[test]
    fn a_residual_sublayer_refuses_an_output_weight_without_a_sink() {
        let x = Var::from_tensor(&rand(&[1, 3, 8], 97, 1.0)).unwrap();
        let norm = rand(&[8], 98, 1.0);
        let (gate, up) = (rand(&[12, 8], 99, 0.4), rand(&[12, 8], 100, 0.4));
        let down = Var::from_tensor(&rand(&[8, 12], 101, 0.4)).unwrap();
        let inside = |n: &Tensor| swiglu_linear_inside(n, &gate, &up, [None, None]);
        let e = prenorm_residual(x.as_tensor(), &norm, 1e-5, inside, (down.as_tensor().clone(), None)).unwrap_err();
        assert!(e.to_string().contains("no gradient sink"), "{e}");
    }
}
