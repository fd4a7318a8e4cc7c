//! A decoder block's two halves in training, each as one op (`ops::residual_sublayer`): the
//! attention half `x + attention(norm(x))` and the MLP half `h + mlp(norm(h))`, where every part
//! takes the fused training ops the composed forward would take (the CPU's in f32, a GPU's
//! kernels) and every projection's gradient has a sink or trains nothing. Elsewhere (LoRA
//! adapters, biases, q/k norms, packed rows, generation) the block runs its ops one by one.

use candle_core::{Result, Tensor};
use ops::residual_sublayer::{prenorm_residual, Inside};
use ops::self_attention::Projection;

use super::{Attention, AttentionPath, DecoderLayer, Mlp, OpMode, PositionInputs};
use crate::lora::{gated_mlp_takes, linear_op_takes};

/// A sublayer's inside, run on the normed input.
type InsideFn<'a> = Box<dyn FnOnce(&Tensor) -> Result<Inside> + 'a>;

impl DecoderLayer {
    /// The block as its two sublayer ops, where both apply to x; None where they do not.
    pub(super) fn forward_as_sublayers(&self, x: &Tensor, pos: &PositionInputs) -> Result<Option<Tensor>> {
        // x in the graph: the op's backward is what makes every weight's gradient.
        if pos.mode != OpMode::Train || !x.track_op() || !ops::residual_sublayer::enabled() {
            return Ok(None);
        }
        let norms = [&self.input_layernorm, &self.post_attention_layernorm];
        if !norms.iter().all(|norm| ops::fused::rms_norm_applies(x, &norm.weight)) {
            return Ok(None);
        }
        let (Some((attention, o_proj)), Some((mlp, down_proj))) = (self.self_attn.sublayer(x, pos), self.mlp.sublayer(x, pos)) else {
            return Ok(None);
        };
        let [first, second] = norms;
        let h = prenorm_residual(x, &first.weight, first.eps, attention, o_proj)?;
        prenorm_residual(&h, &second.weight, second.eps, mlp, down_proj).map(Some)
    }
}

impl Attention {
    /// The attention half's inside (q/k/v, rotations and attention as one op) and o_proj, where
    /// training takes that one op for x ([`Attention::path`]).
    fn sublayer<'a>(&'a self, x: &Tensor, pos: &'a PositionInputs) -> Option<(InsideFn<'a>, Projection)> {
        let o_proj = self.o_proj.weight_with_sink_where(x, pos.mode, &pos.adapters, linear_op_takes(x))?;
        let heads = (self.num_heads, self.num_kv_heads);
        let rope = (&pos.cos, &pos.sin);
        let scale = self.scale();
        let inside: InsideFn<'a> = match self.path(x, pos, false) {
            AttentionPath::TokenMajor => {
                let projections = self.one_op_projections(x, pos, ops::applies(x))?;
                Box::new(move |n| ops::self_attention::self_attention_inside(n, projections, heads, rope, pos.mask.as_ref(), scale))
            }
            AttentionPath::Flash(visibility) if ops::self_attention_flash::enabled() => {
                let projections = self.one_op_projections(x, pos, true)?;
                Box::new(move |n| ops::self_attention_flash::self_attention_inside(n, projections, heads, rope, visibility, scale))
            }
            _ => return None,
        };
        Some((inside, o_proj))
    }
}

impl Mlp {
    /// The MLP half's inside (the gated MLP's products and SwiGLU as one op) and down_proj.
    fn sublayer<'a>(&'a self, x: &Tensor, pos: &PositionInputs) -> Option<(InsideFn<'a>, Projection)> {
        let (mode, adapters) = (pos.mode, &pos.adapters);
        let ours = gated_mlp_takes(x);
        let (gate, gate_to) = self.gate_proj.weight_with_sink_where(x, mode, adapters, ours)?;
        let (up, up_to) = self.up_proj.weight_with_sink_where(x, mode, adapters, ours)?;
        let down_proj = self.down_proj.weight_with_sink_where(x, mode, adapters, linear_op_takes(x))?;
        if gate.dims() != up.dims() {
            return None;
        }
        Some((Box::new(move |n| ops::gated_mlp::swiglu_linear_inside(n, &gate, &up, [gate_to, up_to])), down_proj))
    }
}

#[cfg(test)]
mod tests {
    use candle_core::{DType, Device, Var};
    use candle_nn::{VarBuilder, VarMap};
    use ops::flash_attention::Visibility;
    use ops::testing::rand;
    use ops::weight_grads::WeightGrads;

    use super::*;
    use crate::config::ModelConfig;
    use crate::layers::Rotary;
    use crate::masks::causal_mask;

    fn bits(t: &Tensor) -> Vec<u32> {
        t.flatten_all().unwrap().to_vec1::<f32>().unwrap().iter().map(|v| v.to_bits()).collect()
    }

    /// A Llama block trained on the CPU as its two sublayer ops gives the bits of its ops one by
    /// one: the output, x's and the norm weights' gradients in candle's store, and each
    /// projection's in its sink.
    #[test]
    fn the_sublayer_ops_give_the_blocks_bits() {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 32, "intermediate_size": 48,
                "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                "vocab_size": 64, "rms_norm_eps": 1e-5, "max_position_embeddings": 64}"#,
        )
        .unwrap();
        let dev = Device::Cpu;
        let varmap = VarMap::new();
        let mut layer = DecoderLayer::new(&cfg, None, VarBuilder::from_varmap(&varmap, DType::F32, &dev).pp("layer")).unwrap();
        let mut vars: Vec<(String, Var)> = varmap.data().lock().unwrap().iter().map(|(n, v)| (n.clone(), v.clone())).collect();
        vars.sort_by(|a, b| a.0.cmp(&b.0));
        for (i, (name, var)) in vars.iter().enumerate() {
            let shift = if name.ends_with("layernorm.weight") { 1.0 } else { 0.0 };
            var.set(&(rand(var.dims(), 10 + i as u64, 0.3) + shift).unwrap()).unwrap();
        }
        let sink = WeightGrads::new();
        layer.send_weight_grads_to(Some(sink.clone()));
        let t = 7;
        let (cos, sin) = Rotary::new(&cfg).tables(0, t, DType::F32, &dev).unwrap();
        let mask = causal_mask(t, 0, None, DType::F32, &dev).unwrap();
        let visibility = Some(Visibility::causal(0, None));
        let pos = PositionInputs { cos, sin, mask, visibility, mode: OpMode::Train, row_seeds: None, adapters: Default::default() };
        let x = Var::from_tensor(&rand(&[2, t, 32], 1, 1.0)).unwrap();
        let probe = rand(&[2, t, 32], 2, 1.0);
        let run = |sublayers: bool| {
            let y = match sublayers {
                true => layer.forward_as_sublayers(x.as_tensor(), &pos).unwrap().expect("the sublayer ops apply"),
                false => layer.forward_op_by_op(x.as_tensor(), &pos, None).unwrap(),
            };
            let store = (&y * &probe).unwrap().sum_all().unwrap().backward().unwrap();
            let mut grads = vec![bits(&y), bits(store.get(x.as_tensor()).unwrap())];
            for (name, var) in &vars {
                let grad = match store.get(var.as_tensor()) {
                    Some(g) => g.clone(),
                    None => sink.take(name).unwrap_or_else(|| panic!("{name}: no gradient")).into_tensor(&dev).unwrap(),
                };
                grads.push(bits(&grad));
            }
            grads
        };
        let (got, want) = (run(true), run(false));
        assert_eq!(vars.len(), 9);
        assert_eq!(got[0], want[0], "the output");
        assert_eq!(got[1], want[1], "x's gradient");
        for ((name, _), (g, w)) in vars.iter().zip(got[2..].iter().zip(&want[2..])) {
            assert_eq!(g, w, "{name}'s gradient");
        }
    }
}
