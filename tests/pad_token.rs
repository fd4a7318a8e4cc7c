//! A model whose config names a pad token that also occurs in the training text (SmolLM2's pad is
//! its `<|im_end|>`): transformers builds the embedding with `padding_idx=pad_token_id`, so that
//! row gets no gradient from the lookup. One step's gradients and 12 AdamW steps match PyTorch +
//! transformers on such a model (`tests/reference/make_pad_reference.py`), and differ from the
//! same run without the pad token (so the comparison sees the difference).

mod common;

use std::path::Path;

use common::training::{assert_step_one_gradients_match, max_rel_diff};
use common::*;
use fsdp_app::train::finetune::run_local;

/// The `llama` fixture with `pad_token_id` set in its config.json.
fn fixture_with_pad(root: &Path, pad: u32) -> std::path::PathBuf {
    let dir = fixture("llama", root);
    let path = dir.join("config.json");
    let mut cfg: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    cfg["pad_token_id"] = pad.into();
    std::fs::write(&path, serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    dir
}

#[test]
fn the_pad_tokens_embedding_row_trains_as_in_transformers() {
    let tmp = tempfile::tempdir().unwrap();
    let reference = reference_tensors("training-llama-pad.safetensors");
    let pad = reference["pad_token_id"].to_vec1::<i64>().unwrap()[0] as u32;
    let dir = fixture_with_pad(tmp.path(), pad);
    for ac in [false, true] {
        let grads = assert_step_one_gradients_match(&format!("pad {pad} (ac {ac})"), &dir, ac, &reference);
        let hidden = reference["model.embed_tokens.weight"].dim(1).unwrap();
        let row = &grads["model.embed_tokens.weight"][pad as usize * hidden..(pad as usize + 1) * hidden];
        // The head's gradient is not the lookup's: untied here, so the row is exactly zero.
        assert!(row.iter().all(|x| *x == 0.0), "the pad token's embedding row got a gradient: {:?}", &row[..4]);
    }
    // The same run without the pad token trains that row: its reference is not this one.
    let plain = reference_tensors("training-llama.safetensors");
    let (with_pad, without) = (reference["model.embed_tokens.weight"].clone(), plain["model.embed_tokens.weight"].clone());
    let differ = (with_pad - without).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
    assert!(differ > 1e-6, "the two references agree: the pad token does not occur in step 1's text");
    // 12 AdamW steps on one and two ranks.
    let expected: Vec<f64> = reference["losses"].to_vec1::<f64>().unwrap();
    let expected_norms: Vec<f64> = reference["grad_norms"].to_vec1::<f64>().unwrap();
    for world in [1usize, 2] {
        let mut c = reference_training_config(&dir, &tmp.path().join(format!("out{world}")));
        c.world_size = world;
        c.batch_size = 4 / world;
        let run = run_local(&c).unwrap();
        let d = max_rel_diff(&run.losses, &expected);
        assert!(d < 1e-4, "world {world}: losses differ from PyTorch by {d}\n{:?}\n{expected:?}", run.losses);
        let dn = max_rel_diff(&run.grad_norms, &expected_norms);
        assert!(dn < 1e-4, "world {world}: grad norms differ from PyTorch by {dn}");
    }
}
