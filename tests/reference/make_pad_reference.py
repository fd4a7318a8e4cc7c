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
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, get_scheduler

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
        model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager")
        assert model.model.embed_tokens.padding_idx == PAD
        model.train()
        pad_id = model.config.eos_token_id
        decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
        no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
        opt = torch.optim.AdamW([{"params": decay, "weight_decay": base.WD}, {"params": no_decay, "weight_decay": 0.0}],
                                lr=base.LR, betas=(0.9, 0.999), eps=1e-8)
        sched = get_scheduler("linear", opt, num_warmup_steps=base.WARMUP, num_training_steps=base.STEPS)
        losses, grads0, norms = [], {}, []
        for step in range(base.STEPS):
            batch = [base.pad(r, pad_id) for r in rows[step * base.BATCH:(step + 1) * base.BATCH]]
            ids = torch.tensor([b[0] for b in batch])
            labels = torch.tensor([b[1] for b in batch])
            logits = model(ids).logits.float()
            shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1)
            loss_sum = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
            loss = loss_sum / (shift_labels != -100).sum()
            opt.zero_grad()
            loss.backward()
            if step == 0:
                grads0 = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
                assert grads0["model.embed_tokens.weight"][PAD].abs().max() == 0
            norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), base.CLIP).item())
            opt.step()
            sched.step()
            losses.append(loss.item())
    out = dict(grads0)
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    out["grad_norms"] = torch.tensor(norms, dtype=torch.float64)
    out["pad_token_id"] = torch.tensor([PAD], dtype=torch.int64)
    save_file(out, os.path.join(base.HERE, "training-llama-pad.safetensors"))
    print(f"llama with pad {PAD}: losses {[round(x, 4) for x in losses]}", file=sys.stderr)


if __name__ == "__main__":
    main()
