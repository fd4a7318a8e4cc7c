#!/usr/bin/env python3
"""Optimizer and accumulation references, computed with PyTorch (+ transformers) on CPU.

    cargo build
    python3 tests/reference/make_optimizer_reference.py [--bin target/debug/fsdp-app]

adamw-steps.safetensors: torch.optim.AdamW (foreach=False: the single-tensor arithmetic, which
fsdp-app's update follows operation by operation) over 6 steps of fixed gradients, for two
settings, with the parameters and both moments after every step:
  case0: lr 1e-3, weight decay 0.1, gradients of size ~1e-6, so that eps (1e-8) is a visible
         part of every denominator (a misplaced eps changes the update by about 1%);
  case1: lr 3e-2, betas (0.8, 0.99), eps 1e-6, no decay, gradients spread over 6 decades, a
         clip coefficient of 0.5 multiplied into the gradients first (torch's clip_grad_norm_
         scales them in place before the step).
Tensors: caseK.param0 (n), caseK.grads (steps, n), caseK.params / exp_avg / exp_avg_sq
(steps, n), caseK.hyper = [lr, beta1, beta2, eps, weight_decay, clip].

training-llama-accum.safetensors: make_training_reference.py's run of the `llama` fixture with
each step's 4 rows as 2 micro-batches of 2 (gradient accumulation): each micro-batch's summed
token loss divided by the target tokens of the whole step (transformers' Trainer normalises by
`num_items_in_batch` the same way), backward per micro-batch, then clipping and one AdamW step.
Holds the 12 losses and gradient norms.
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile

import torch
from safetensors.torch import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_training_reference as base  # noqa: E402

STEPS, N = 6, 257


def adamw_case(lr, betas, eps, wd, clip, grad_scale):
    g = torch.Generator().manual_seed(7)
    p = (torch.rand(N, generator=g, dtype=torch.float32) * 2 - 1)
    grads = (torch.rand(STEPS, N, generator=g, dtype=torch.float32) * 2 - 1) * grad_scale
    param = torch.nn.Parameter(p.clone())
    opt = torch.optim.AdamW([param], lr=lr, betas=betas, eps=eps, weight_decay=wd, foreach=False, fused=False)
    params, ms, vs = [], [], []
    for s in range(STEPS):
        param.grad = grads[s].clone()
        if clip is not None:
            param.grad.mul_(clip)
        opt.step()
        st = opt.state[param]
        params.append(param.detach().clone())
        ms.append(st["exp_avg"].clone())
        vs.append(st["exp_avg_sq"].clone())
    hyper = torch.tensor([lr, betas[0], betas[1], eps, wd, clip if clip is not None else 1.0], dtype=torch.float64)
    return {"param0": p, "grads": grads, "params": torch.stack(params), "exp_avg": torch.stack(ms), "exp_avg_sq": torch.stack(vs), "hyper": hyper}


def adamw_reference():
    spread = torch.logspace(-6, 0, N).reshape(1, N)
    out = {}
    for name, case in [
        ("case0", adamw_case(1e-3, (0.9, 0.999), 1e-8, 0.1, None, 1e-6)),
        ("case1", adamw_case(3e-2, (0.8, 0.99), 1e-6, 0.0, 0.5, spread)),
    ]:
        for k, v in case.items():
            out[f"{name}.{k}"] = v.contiguous()
    save_file(out, os.path.join(base.HERE, "adamw-steps.safetensors"))


def accumulation_reference(binary):
    rows = [json.loads(line) for line in open(os.path.join(base.HERE, "train-data.jsonl"))]
    with tempfile.TemporaryDirectory() as work:
        d = os.path.join(work, "llama")
        subprocess.run([binary, "fixture", "--name", "llama", "--out", d], check=True)
        losses, _, norms = base.train(d, rows, micro_batches=2)
    base.save(os.path.join(base.HERE, "training-llama-accum.safetensors"), losses, {}, norms)
    print(f"accumulated: losses {[round(x, 4) for x in losses]}", file=sys.stderr)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(base.ROOT, "target", "debug", "fsdp-app"))
    args = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    adamw_reference()
    accumulation_reference(args.bin)


if __name__ == "__main__":
    main()
