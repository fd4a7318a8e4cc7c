#!/usr/bin/env python3
"""The PyTorch side of `cargo bench --bench training`: the same training steps (batch, AdamW,
clipping, loss normalised by target tokens) on the same model directory and data, plain
PyTorch + transformers on CPU with a fixed thread count; prints one JSON line. A last argument
`bf16` runs forward and loss under torch.autocast("cpu", torch.bfloat16): the linear products in
bf16 (oneDNN, on AMX tiles where the CPU has them), weights and optimizer in f32."""
import contextlib
import json
import sys
import time

import torch
import transformers
from transformers import AutoModelForCausalLM

model_dir, data_path, batch, seq, steps, threads = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
bf16 = sys.argv[7:] == ["bf16"]
if sys.argv[7:] not in ([], ["bf16"]):
    sys.exit(f"unknown arguments {sys.argv[7:]}: the only one after THREADS is bf16")
torch.set_num_threads(threads)
# transformers' default attention (sdpa): the peer as users run it.
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
model.train()
rows = [json.loads(l)["input_ids"][:seq] for l in open(data_path)]
decay = [p for p in model.parameters() if p.dim() >= 2]
no_decay = [p for p in model.parameters() if p.dim() < 2]
opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.0}, {"params": no_decay, "weight_decay": 0.0}], lr=1e-4)
times, losses = [], []
for step in range(steps):
    ids = torch.tensor(rows[step * batch:(step + 1) * batch])
    t = time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext():
        logits = model(ids).logits.float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    times.append(time.perf_counter() - t)
    losses.append(loss.item())
tps = sorted(batch * seq / x for x in times[1:])
print(json.dumps({"tokens_per_s": tps[len(tps) // 2], "losses": losses, "torch": torch.__version__,
                  "transformers": transformers.__version__, "threads": torch.get_num_threads(),
                  # ATen's kernel level (ATEN_CPU_CAPABILITY lowers it for the forced-AVX2 rows).
                  "isa": torch.backends.cpu.get_cpu_capability()}))
