//! Weight gradients an op hands to the trainer directly instead of through candle's gradient
//! store. candle accumulates every gradient as `zeros_like(w) + dw`: for a vocabulary-sized
//! embedding or head that is two more weight-sized buffers at the peak of a training step, and
//! for every linear layer a memset and a pass over its gradient (the embedding, the head and
//! `linear::linear_to` send theirs here when training gives them a sink). An
//! op given a [`WeightGrads`] (through `StageContext`) deposits its weight's gradient here under
//! the parameter's name and returns none to candle; the trainer takes it after the stage's
//! backward. Contributions to one name are summed.
//!
//! A gradient can also come as [`GradRows`]: what it takes to make any range of its rows (an
//! embedding's ids and upstream rows; a head's logit gradients and inputs; a linear layer's
//! upstream gradient and input), no larger than the gradient itself. A sharded trainer then
//! makes and reduces it a range of rows at a time, and a full-size copy never exists; one that
//! holds the whole gradient makes it straight into its own buffer.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{Device, Result, Tensor};

/// A (rows, cols) weight gradient made a range of rows at a time.
pub trait GradRows: Send + Sync + std::fmt::Debug {
    /// (rows, cols) of the whole gradient.
    fn dims(&self) -> (usize, usize);
    /// Adds rows `first .. first + out.len() / cols` of the gradient into `out` (row-major).
    fn add_rows(&self, first: usize, out: &mut [f32]);
}

/// One contribution to a weight's gradient.
#[derive(Debug, Clone)]
enum Part {
    Dense(Tensor),
    Rows(Arc<dyn GradRows>),
}

/// A weight's gradient: the sum of its contributions.
#[derive(Debug, Clone)]
pub struct WeightGrad {
    parts: Vec<Part>,
}

impl WeightGrad {
    pub fn dense(t: Tensor) -> Self {
        Self { parts: vec![Part::Dense(t)] }
    }

    pub fn rows(r: Arc<dyn GradRows>) -> Self {
        Self { parts: vec![Part::Rows(r)] }
    }

    /// The gradient as one tensor, when it is one already.
    pub fn as_dense(&self) -> Option<&Tensor> {
        match self.parts.as_slice() {
            [Part::Dense(t)] => Some(t),
            _ => None,
        }
    }

    /// (rows, cols) of a 2-D gradient (a 1-D one is (len, 1)).
    pub fn dims(&self) -> Result<(usize, usize)> {
        match &self.parts[0] {
            Part::Rows(r) => Ok(r.dims()),
            Part::Dense(t) => match t.dims() {
                [n] => Ok((*n, 1)),
                [r, c] => Ok((*r, *c)),
                d => candle_core::bail!("a weight gradient of shape {d:?}"),
            },
        }
    }

    /// Adds rows `first .. first + out.len() / cols` of the gradient into `out`.
    pub fn add_rows(&self, first: usize, out: &mut [f32]) -> Result<()> {
        let (_, cols) = self.dims()?;
        let n = out.len() / cols;
        for part in &self.parts {
            match part {
                Part::Rows(r) => r.add_rows(first, out),
                Part::Dense(t) => {
                    let rows = t.flatten_to(0)?.reshape(((), cols))?.narrow(0, first, n)?.flatten_all()?;
                    for (o, g) in out.iter_mut().zip(rows.to_dtype(candle_core::DType::F32)?.to_vec1::<f32>()?) {
                        *o += g;
                    }
                }
            }
        }
        Ok(())
    }

    /// The whole gradient as one tensor (made on `device` when it comes in rows).
    pub fn into_tensor(self, device: &Device) -> Result<Tensor> {
        if let Some(t) = self.as_dense() {
            return Ok(t.clone());
        }
        let (rows, cols) = self.dims()?;
        let mut all = vec![0f32; rows * cols];
        self.add_rows(0, &mut all)?;
        Tensor::from_vec(all, (rows, cols), device)
    }

    fn add(&mut self, part: Part) -> Result<()> {
        // Two dense contributions become one tensor: no more full-size buffers than needed.
        if let (Part::Dense(new), Some(at)) = (&part, self.parts.iter().position(|p| matches!(p, Part::Dense(_)))) {
            let Part::Dense(old) = &self.parts[at] else { unreachable!() };
            self.parts[at] = Part::Dense((old + new)?);
            return Ok(());
        }
        self.parts.push(part);
        Ok(())
    }
}

#[derive(Debug, Clone, Default)]
pub struct WeightGrads(Arc<Mutex<HashMap<String, WeightGrad>>>);

impl WeightGrads {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a dense `grad` to what `name` holds, detached (as candle's store detaches its
    /// gradients): an op's weight gradient is made from tensors of the forward's graph, and a
    /// trainer that accumulates it over micro-batches would otherwise keep each micro-batch's
    /// whole graph, activations and all, until the optimizer step.
    pub fn add(&self, name: &str, grad: Tensor) -> Result<()> {
        self.add_part(name, Part::Dense(grad.detach()))
    }

    /// Adds a gradient made by rows to what `name` holds.
    pub fn add_rows(&self, name: &str, grad: Arc<dyn GradRows>) -> Result<()> {
        self.add_part(name, Part::Rows(grad))
    }

    fn add_part(&self, name: &str, part: Part) -> Result<()> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        match map.get_mut(name) {
            Some(g) => g.add(part),
            None => {
                map.insert(name.to_string(), WeightGrad { parts: vec![part] });
                Ok(())
            }
        }
    }

    /// Takes `name`'s gradient out (None when no op deposited one).
    pub fn take(&self, name: &str) -> Option<WeightGrad> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).remove(name)
    }

    /// Names holding a gradient.
    pub fn names(&self) -> Vec<String> {
        self.0.lock().unwrap_or_else(|e| e.into_inner()).keys().cloned().collect()
    }
}

/// Where an op sends its weight's gradient: the sink and the parameter's name.
#[derive(Debug, Clone)]
pub struct WeightGradTarget {
    pub sink: WeightGrads,
    pub name: String,
}

#[cfg(test)]
mod tests {
    use candle_core::{Device, Tensor, Var};

    use super::WeightGrads;

    #[test]
    fn a_deposited_gradient_keeps_no_graph() {
        let x = Var::from_tensor(&Tensor::ones((2, 2), candle_core::DType::F32, &Device::Cpu).unwrap()).unwrap();
        let made_from_the_graph = x.as_tensor().matmul(x.as_tensor()).unwrap();
        assert!(made_from_the_graph.track_op());
        let sink = WeightGrads::new();
        sink.add("w", made_from_the_graph.clone()).unwrap();
        sink.add("w", made_from_the_graph).unwrap();
        let grad = sink.take("w").unwrap().into_tensor(&Device::Cpu).unwrap();
        assert!(!grad.track_op(), "the sink's gradient refers to the forward's graph");
        assert_eq!(grad.to_vec2::<f32>().unwrap(), [[4.0, 4.0], [4.0, 4.0]]);
    }
}
