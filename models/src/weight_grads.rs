//! Weight gradients an op hands to the trainer directly instead of through candle's gradient
//! store. candle accumulates every gradient as `zeros_like(w) + dw`: for a vocabulary-sized
//! embedding or head that is two more weight-sized buffers at the peak of a training step. An
//! op given a [`WeightGrads`] (through `StageContext`) deposits its weight's gradient here under
//! the parameter's name and returns none to candle; the trainer takes it after the stage's
//! backward. Contributions to one name are summed.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use candle_core::{Result, Tensor};

#[derive(Debug, Clone, Default)]
pub struct WeightGrads(Arc<Mutex<HashMap<String, Tensor>>>);

impl WeightGrads {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `grad` to what `name` holds.
    pub fn add(&self, name: &str, grad: Tensor) -> Result<()> {
        let mut map = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let sum = match map.remove(name) {
            Some(prev) => (prev + grad)?,
            None => grad,
        };
        map.insert(name.to_string(), sum);
        Ok(())
    }

    /// Takes `name`'s gradient out (None when no op deposited one).
    pub fn take(&self, name: &str) -> Option<Tensor> {
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
