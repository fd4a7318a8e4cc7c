#!/usr/bin/env python3
"""Training references for the FSDP engine, computed with PyTorch + transformers on CPU.

    cargo build
    python3 tests/reference/make_training_reference.py [--bin target/debug/fsdp-app]

For the `llama` (untied) and `qwen2` (tied embeddings, qkv bias) fixtures it writes:
  train-data.jsonl                 pre-tokenised rows (some labels -100, some rows short)
  training-<name>.safetensors      gradients of step 1 (before clipping) by parameter name,
                                   and the loss of each of 12 AdamW steps ("losses")
The run matches `fsdp-app finetune --no-shuffle --seq-len 16 --batch-size 4 --max-steps 12
--lr 1e-3 --weight-decay 0.1 --max-grad-norm 1.0 --warmup-steps 2 --lr-scheduler linear`:
global batch 4, loss = summed token cross-entropy / number of target tokens, AdamW with no
decay on 1-D parameters (biases, norm weights), torch's clip_grad_norm_, transformers'
linear schedule with warmup.
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

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
SEQ, BATCH, STEPS = 16, 4, 12
LR, WD, CLIP, WARMUP = 1e-3, 0.1, 1.0, 2


def make_rows():
    rows = []
    for i in range(BATCH * STEPS):
        n = SEQ if i % 3 else SEQ - 5  # every third row is short (padded, labels ignored)
        ids = [(i * 31 + j * 7 + 3) % 384 for j in range(n)]
        labels = list(ids)
        if i % 4 == 1:
            labels[:4] = [-100] * 4  # a masked prompt
        rows.append({"input_ids": ids, "labels": labels})
    return rows


def pad(row, pad_id):
    ids = row["input_ids"][:SEQ] + [pad_id] * (SEQ - len(row["input_ids"]))
    labels = row["labels"][:SEQ] + [-100] * (SEQ - len(row["labels"]))
    return ids, labels


def train(model_dir, rows, micro_batches=1):
    """The 12 AdamW steps of fsdp-app's reference run on the model in `model_dir`: each step's
    rows in `micro_batches` micro-batches, each micro-batch's summed token loss divided by the
    target tokens of the whole step (so accumulation gives the gradients of one batch).
    Returns (losses, step-1 gradients by name, gradient norms before clipping)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    model.train()
    pad_id = model.config.eos_token_id
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=LR, betas=(0.9, 0.999), eps=1e-8)
    sched = get_scheduler("linear", opt, num_warmup_steps=WARMUP, num_training_steps=STEPS)
    losses, grads0, norms = [], {}, []
    per_micro = BATCH // micro_batches
    for step in range(STEPS):
        batch = [pad(r, pad_id) for r in rows[step * BATCH:(step + 1) * BATCH]]
        count = (torch.tensor([b[1] for b in batch])[:, 1:] != -100).sum()
        opt.zero_grad()
        step_loss = 0.0
        for m in range(micro_batches):
            micro = batch[m * per_micro:(m + 1) * per_micro]
            ids = torch.tensor([b[0] for b in micro])
            labels = torch.tensor([b[1] for b in micro])
            logits = model(ids).logits.float()
            shift_logits = logits[:, :-1].reshape(-1, logits.shape[-1])
            shift_labels = labels[:, 1:].reshape(-1)
            loss_sum = torch.nn.functional.cross_entropy(shift_logits, shift_labels, ignore_index=-100, reduction="sum")
            loss = loss_sum / count
            loss.backward()
            step_loss += loss.item()
        if step == 0:
            grads0 = {n: p.grad.detach().clone().contiguous() for n, p in model.named_parameters()}
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        sched.step()
        losses.append(step_loss)
        norms.append(norm.item())
    return losses, grads0, norms


def save(path, losses, grads0, norms, extra=None):
    out = dict(grads0)
    out["losses"] = torch.tensor(losses, dtype=torch.float64)
    out["grad_norms"] = torch.tensor(norms, dtype=torch.float64)
    out.update(extra or {})
    save_file(out, path)


def run(binary, name, rows, work):
    d = os.path.join(work, name)
    subprocess.run([binary, "fixture", "--name", name, "--out", d], check=True)
    losses, grads0, norms = train(d, rows)
    save(os.path.join(HERE, f"training-{name}.safetensors"), losses, grads0, norms)
    print(f"{name}: losses {[round(x, 4) for x in losses]}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "debug", "fsdp-app"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    rows = make_rows()
    with open(os.path.join(HERE, "train-data.jsonl"), "w") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    with tempfile.TemporaryDirectory() as work:
        for name in ["llama", "qwen2"]:
            run(args.bin, name, rows, work)


if __name__ == "__main__":
    main()
