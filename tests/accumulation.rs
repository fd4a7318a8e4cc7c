//! Gradient accumulation against PyTorch: each step's 4 rows as 2 micro-batches of 2, the loss
//! normalised by the target tokens of the whole step (as transformers' Trainer does with
//! `num_items_in_batch`), gives PyTorch's 12 losses and gradient norms
//! (`tests/reference/make_optimizer_reference.py`), on one rank and on two.

mod common;

use common::training::max_rel_diff;
use common::*;
use fsdp_app::train::finetune::run_local;

#[test]
fn accumulated_micro_batches_train_as_pytorch_does() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixture("llama", tmp.path());
    let reference = reference_tensors("training-llama-accum.safetensors");
    let expected: Vec<f64> = reference["losses"].to_vec1::<f64>().unwrap();
    let expected_norms: Vec<f64> = reference["grad_norms"].to_vec1::<f64>().unwrap();
    for world in [1usize, 2] {
        let mut c = reference_training_config(&model, &tmp.path().join(format!("out{world}")));
        c.world_size = world;
        c.batch_size = 2 / world;
        c.grad_accum = 2;
        let run = run_local(&c).unwrap();
        let d = max_rel_diff(&run.losses, &expected);
        assert!(d < 1e-4, "world {world}: losses differ from PyTorch's accumulated run by {d}\n{:?}\n{expected:?}", run.losses);
        let dn = max_rel_diff(&run.grad_norms, &expected_norms);
        assert!(dn < 1e-4, "world {world}: grad norms differ by {dn}");
    }
}
