#!/usr/bin/env python3
"""Training reference for a model whose config names a pad token that also occurs inside the
training text (as SmolLM2's `<|im_end|>` does), computed with PyTorch + transformers on CPU.

    cargo build
    python3 tests/reference/make_pad_reference.py [--bin target/debug/fsdp-app]

transformers builds the embedding as `nn.Embedding(vocab, hidden, padding_idx=pad_token_id)`, so
the pad token's row receives no gradient from the lookup. This writes
`training-llama-pad.safetensors`: the `llama` fixture with `"pad_token_id": PAD` in config.json,
trained exactly as `make_training_reference.py` trains it (same rows, same settings): the
gradients of step 1 and the losses and gradient norms of 12 AdamW steps.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_training_reference as base  # noqa: E402

# A token of the training text: it occurs in the first micro-batch and in two later ones.
PAD = 10


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(base.ROOT, "target", "debug", "fsdp-app"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rows = [json.loads(line) for line in open(os.path.join(base.HERE, "train-data.jsonl"))]
    assert any(PAD in r["input_ids"] for r in rows[: base.BATCH]), "the pad token must occur in step 1's text"
    with tempfile.TemporaryDirectory() as work:
        d = os.path.join(work, "llama")
        subprocess.run([args.bin, "fixture", "--name", "llama", "--out", d], check=True)
        cfg_path = os.path.join(d, "config.json")
        cfg = json.load(open(cfg_path))
        cfg["pad_token_id"] = PAD
        json.dump(cfg, open(cfg_path, "w"), indent=2)
        losses, grads0, norms = base.train(d, rows)
        assert grads0["model.embed_tokens.weight"][PAD].abs().max() == 0, "transformers' padding_idx"
    base.save(os.path.join(base.HERE, "training-llama-pad.safetensors"), losses, grads0, norms,
              {"pad_token_id": torch.tensor([PAD], dtype=torch.int64)})
    print(f"llama with pad {PAD}: losses {[round(x, 4) for x in losses]}", file=sys.stderr)


if __name__ == "__main__":
    main()
