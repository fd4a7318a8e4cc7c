//! DPO: preference rows read as TRL reads them, and preference tuning against an independent
//! PyTorch DPO loop.

mod common;

use std::path::Path;

use fsdp_app::tokenize::TextTokenizer;
use fsdp_app::train::data::{Sample, TextTools, IGNORE_INDEX};
use fsdp_app::train::preference::load_preference_dataset;

/// (prompt, completion) of a pair sample: the prompt's positions carry no label.
fn split(s: &Sample) -> (Vec<u32>, Vec<u32>) {
    let prompt = s.labels[..s.len].iter().take_while(|&&l| l == IGNORE_INDEX).count();
    (s.input_ids[..prompt].to_vec(), s.input_ids[prompt..s.len].to_vec())
}

/// Every shape of preference row is tokenised to TRL's ids (tests/reference/make_dpo_reference.py
/// ran TRL 1.16's DPOTrainer on the same rows with the same tokenizer and chat template).
#[test]
fn preference_rows_tokenise_as_trl_does() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let read = |name: &str| std::fs::read(model.join(name)).ok();
    let tokenizer = TextTokenizer::from_bytes(&read("tokenizer.json").unwrap(), read("tokenizer_config.json").as_deref(), None).unwrap();
    let cfg = models::ModelConfig::from_json_str(&std::fs::read_to_string(model.join("config.json")).unwrap()).unwrap();
    let encode = |text: &str, special: bool| tokenizer.encode_with_offsets(text, special);
    let decode = |ids: &[u32]| tokenizer.decode(ids, false);
    let eos = cfg.eos_token_ids.first().copied();
    let tools =
        TextTools { encode: &encode, decode: &decode, template: tokenizer.chat_template.as_ref(), eos_id: eos, pad_id: eos.unwrap() };
    let rows = common::reference_dir().join("dpo-rows.jsonl");
    let data = load_preference_dataset(&rows, &std::fs::read(&rows).unwrap(), 256, false, &tools).unwrap();
    let want = common::reference_json("dpo-tokens.json");
    let want = want.as_array().unwrap();
    assert_eq!(data.samples.len(), 2 * want.len());
    for (i, w) in want.iter().enumerate() {
        let (prompt, chosen) = split(&data.samples[2 * i]);
        let (prompt_r, rejected) = split(&data.samples[2 * i + 1]);
        let line = i + 1;
        assert_eq!(prompt, common::json_ids(&w["prompt_ids"]), "dpo-rows.jsonl:{line}: prompt");
        assert_eq!(prompt_r, prompt, "dpo-rows.jsonl:{line}: the rejected sample's prompt");
        assert_eq!(chosen, common::json_ids(&w["chosen_ids"]), "dpo-rows.jsonl:{line}: chosen");
        assert_eq!(rejected, common::json_ids(&w["rejected_ids"]), "dpo-rows.jsonl:{line}: rejected");
    }
}

/// Bad rows are named by file, line and field.
#[test]
fn bad_preference_rows_name_file_line_and_field() {
    let tmp = tempfile::tempdir().unwrap();
    let model = common::fixture("llama", tmp.path());
    let read = |name: &str| std::fs::read(model.join(name)).ok();
    let tokenizer = TextTokenizer::from_bytes(&read("tokenizer.json").unwrap(), read("tokenizer_config.json").as_deref(), None).unwrap();
    let encode = |text: &str, special: bool| tokenizer.encode_with_offsets(text, special);
    let decode = |ids: &[u32]| tokenizer.decode(ids, false);
    let tools = TextTools { encode: &encode, decode: &decode, template: tokenizer.chat_template.as_ref(), eos_id: Some(2), pad_id: 2 };
    let path = Path::new("pairs.jsonl");
    let body = b"{\"prompt\": \"a\", \"chosen\": \"b\", \"rejected\": \"c\"}\n{\"prompt\": \"a\", \"chosen\": \"b\"}\n";
    let err = format!("{:#}", load_preference_dataset(path, body, 64, false, &tools).unwrap_err());
    assert!(err.contains("pairs.jsonl:2") && err.contains("needs one of"), "{err}");
    let skipped = load_preference_dataset(path, body, 64, true, &tools).unwrap();
    assert_eq!((skipped.rows, skipped.skipped, skipped.samples.len()), (2, 1, 2));
}
