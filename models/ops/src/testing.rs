//! Helpers of the ops' and the models' tests (not used outside tests): random tensors, relative differences, gradients through
//! candle's autograd and central finite differences.

use candle_core::{DType, Device, Result, Tensor, Var};

pub fn rand(shape: &[usize], seed: u64, scale: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let mut r = kernels::rng::SplitMix64(seed);
    Tensor::from_vec((0..n).map(|_| r.next_signed() * scale).collect::<Vec<f32>>(), shape, &Device::Cpu).unwrap()
}

pub fn max_rel(a: &Tensor, b: &Tensor) -> f32 {
    let (a, b) = (a.flatten_all().unwrap().to_vec1::<f32>().unwrap(), b.flatten_all().unwrap().to_vec1::<f32>().unwrap());
    a.iter().zip(&b).map(|(x, y)| (x - y).abs() / y.abs().max(1e-2)).fold(0f32, f32::max)
}

/// Gradients of `sum(f(vars) * probe)` for the fused and the composite form of an op.
pub fn grads(vars: &[Var], probe: &Tensor, f: &dyn Fn(&[Tensor]) -> Result<Tensor>) -> Vec<Tensor> {
    let ts: Vec<Tensor> = vars.iter().map(|v| v.as_tensor().clone()).collect();
    let loss = (f(&ts).unwrap() * probe).unwrap().sum_all().unwrap();
    let g = loss.backward().unwrap();
    vars.iter().map(|v| g.get(v.as_tensor()).unwrap().clone()).collect()
}

/// Central finite differences of `sum(f(x) * probe)` at a few coordinates of input `which`,
/// in f64 through the composite form.
pub fn check_fd(inputs: &[Tensor], which: usize, probe: &Tensor, analytic: &Tensor, f: &dyn Fn(&[Tensor]) -> Result<Tensor>) {
    let base: Vec<Tensor> = inputs.iter().map(|t| t.to_dtype(DType::F64).unwrap()).collect();
    let probe = probe.to_dtype(DType::F64).unwrap();
    let flat = base[which].flatten_all().unwrap().to_vec1::<f64>().unwrap();
    let an = analytic.flatten_all().unwrap().to_vec1::<f32>().unwrap();
    for k in [0, flat.len() / 3, flat.len() - 1] {
        let eval = |delta: f64| {
            let mut v = flat.clone();
            v[k] += delta;
            let mut args = base.clone();
            args[which] = Tensor::from_vec(v, base[which].shape(), &Device::Cpu).unwrap();
            (f(&args).unwrap() * &probe).unwrap().sum_all().unwrap().to_scalar::<f64>().unwrap()
        };
        let h = 1e-5;
        let numeric = (eval(h) - eval(-h)) / (2.0 * h);
        assert!(
            (numeric - an[k] as f64).abs() < 1e-3 * numeric.abs().max(1.0),
            "input {which}[{k}]: numeric {numeric}, analytic {}",
            an[k]
        );
    }
}

/// An f32 CPU tensor of `dims` with values uniform in [-1, 1) from `seed` (kernel tests' inputs).
pub fn random_tensor(dims: &[usize], seed: u64) -> Tensor {
    Tensor::from_vec(kernels::rng::signed_values(dims.iter().product(), seed), dims, &Device::Cpu).unwrap()
}
