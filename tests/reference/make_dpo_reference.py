#!/usr/bin/env python3
"""TRL's tokenisation of preference rows, for `tests/dpo_data.rs` to compare fsdp-app's against.

    cargo build --release
    python3 tests/reference/make_dpo_reference.py [--bin target/release/fsdp-app]

Needs torch, transformers and trl (checked with trl 1.16). Writes, beside this script:
  dpo-rows.jsonl     preference rows in every shape fsdp-app reads: TRL's standard
                     {"prompt", "chosen", "rejected"} (strings), TRL's conversational ones (lists
                     of messages; explicit prompt, and an implicit one shared by chosen and
                     rejected), OpenAI's DPO rows {"input": {"messages"}, "preferred_output",
                     "non_preferred_output"}, and pre-tokenised {"prompt_input_ids",
                     "chosen_input_ids", "rejected_input_ids"}
  dpo-tokens.json    for each row (in order): {"prompt_ids", "chosen_ids", "rejected_ids"} as
                     TRL's DPOTrainer prepares them for the `llama` fixture's tokenizer and chat
                     template (DPOTrainer._prepare_dataset, no max_length)

TRL has no reader for OpenAI's rows: they are given to TRL as the conversational rows they
mean (prompt = input.messages, chosen = preferred_output, rejected = non_preferred_output).
Pre-tokenised rows are TRL's own tokenised columns: their ids are the reference as they are
(eos appended to neither).
"""
import argparse
import json
import os
import subprocess
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))


def rows():
    user = lambda c: {"role": "user", "content": c}
    bot = lambda c: {"role": "assistant", "content": c}
    return [
        {"prompt": "The capital of France is", "chosen": " Paris.", "rejected": " Lyon, I think."},
        # Already ends with the eos token's text: TRL does not add a second one.
        {"prompt": "2 + 2 =", "chosen": " 4<|im_end|>", "rejected": " 5"},
        # A prompt ending inside a word: tokens merge across the boundary.
        {"prompt": "Say hel", "chosen": "lo world", "rejected": "p me"},
        {"prompt": [user("What colour is the sky?")], "chosen": [bot("Blue.")], "rejected": [bot("Green, mostly.")]},
        {
            "prompt": [{"role": "system", "content": "Be brief."}, user("Hi"), bot("Hello."), user("Name a fruit.")],
            "chosen": [bot("Apple.")],
            "rejected": [bot("I would rather not.")],
        },
        # Implicit prompt: the turns chosen and rejected share.
        {"chosen": [user("Count to three."), bot("1 2 3")], "rejected": [user("Count to three."), bot("3 2 1")]},
        {
            "input": {"messages": [user("Write a haiku about rain.")]},
            "preferred_output": [bot("Soft rain on the roof")],
            "non_preferred_output": [bot("No.")],
        },
        {
            "input": {"messages": [{"role": "system", "content": "You answer in French."}, user("Thank you")]},
            "preferred_output": [bot("Merci")],
            "non_preferred_output": [bot("You're welcome")],
        },
        {"prompt_input_ids": [5, 17, 42, 9], "chosen_input_ids": [100, 101, 7], "rejected_input_ids": [200]},
    ]


def as_trl(row):
    """The row in TRL's column names (OpenAI's rows become TRL's conversational ones)."""
    if "input" in row:
        return {"prompt": row["input"]["messages"], "chosen": row["preferred_output"], "rejected": row["non_preferred_output"]}
    return row


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release", "fsdp-app"))
    args = ap.parse_args()
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    with tempfile.TemporaryDirectory() as work:
        model_dir = os.path.join(work, "llama")
        subprocess.run([args.bin, "fixture", "--name", "llama", "--out", model_dir], check=True)
        tok = AutoTokenizer.from_pretrained(model_dir)
        model = AutoModelForCausalLM.from_pretrained(model_dir)
        first = Dataset.from_list([as_trl(rows()[0])])
        config = DPOConfig(output_dir=os.path.join(work, "out"), report_to=[], max_length=None, dataset_num_proc=None,
                           use_cpu=True, bf16=False)
        trainer = DPOTrainer(model=model, args=config, train_dataset=first, processing_class=tok)
        out = []
        for row in rows():
            if "prompt_input_ids" in row:
                out.append({"prompt_ids": row["prompt_input_ids"], "chosen_ids": row["chosen_input_ids"],
                            "rejected_ids": row["rejected_input_ids"]})
                continue
            ds = trainer._prepare_dataset(Dataset.from_list([as_trl(row)]), tok, config, "reference")
            r = ds[0]
            out.append({"prompt_ids": r["prompt_ids"], "chosen_ids": r["chosen_ids"], "rejected_ids": r["rejected_ids"]})
    with open(os.path.join(HERE, "dpo-rows.jsonl"), "w") as f:
        for row in rows():
            f.write(json.dumps(row) + "\n")
    with open(os.path.join(HERE, "dpo-tokens.json"), "w") as f:
        json.dump(out, f, indent=0)
        f.write("\n")
    print(f"wrote {len(out)} rows to dpo-rows.jsonl and dpo-tokens.json")


if __name__ == "__main__":
    main()
