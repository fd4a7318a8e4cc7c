#!/usr/bin/env python3
"""The PyTorch FSDP2 side of `cargo bench --bench training` (a): per-rank peak memory of the same
fine-tuning job, on CPU, as PyTorch users run it. Started by `torchrun --nproc-per-node N`:

    torchrun --nproc-per-node 4 torch_fsdp2_memory.py MODEL_DIR DATA SEQ STEPS AC(0|1) STRATEGY

gloo backend; the model built on the meta device, `fully_shard` on every decoder layer and on
the root (STRATEGY FULL_SHARD: reshard_after_forward=True; SHARD_GRAD_OP: False); rank 0 alone
reads the weights and `set_model_state_dict(..., broadcast_from_rank0=True)` streams them;
AdamW; batch 1 per rank; activation checkpointing of each layer when AC=1. Each rank reads its
peak resident set (VmHWM, from /proc, as our ranks do) at the end; rank 0 prints one JSON line
with all of them."""
import json
import os
import sys
import time

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
from torch.distributed.fsdp import fully_shard
from torch.utils.checkpoint import checkpoint
from transformers import AutoConfig, AutoModelForCausalLM


def vmhwm() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


model_dir, data_path = sys.argv[1], sys.argv[2]
seq, steps, ac = int(sys.argv[3]), int(sys.argv[4]), sys.argv[5] == "1"
strategy = sys.argv[6]
torch.set_num_threads(1)
dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()

config = AutoConfig.from_pretrained(model_dir)
with torch.device("meta"):
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
layers = model.model.layers
if ac:
    # Per-layer activation checkpointing, as torchtitan and Accelerate apply it.
    for layer in layers:
        forward = layer.forward
        layer.forward = lambda *a, _f=forward, **k: checkpoint(_f, *a, use_reentrant=False, **k)
reshard = strategy == "FULL_SHARD"
for layer in layers:
    fully_shard(layer, reshard_after_forward=reshard)
fully_shard(model, reshard_after_forward=reshard)
model.to_empty(device="cpu")
full = None
if rank == 0:
    from safetensors.torch import load_file

    full = {}
    for name in sorted(os.listdir(model_dir)):
        if name.endswith(".safetensors"):
            full.update(load_file(os.path.join(model_dir, name)))
set_model_state_dict(model, full or {}, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True))
del full
# Buffers (rotary frequencies) are not in the checkpoint: build them as from_pretrained does.
model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
model.train()

rows = [json.loads(line)["input_ids"][:seq] for line in open(data_path)]
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.0)
times, losses = [], []
for step in range(steps):
    ids = torch.tensor([rows[(step * world + rank) % len(rows)]])
    t = time.perf_counter()
    logits = model(ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    opt.zero_grad()
    loss.backward()
    opt.step()
    times.append(time.perf_counter() - t)
    losses.append(loss.item())
peaks = [None] * world
dist.all_gather_object(peaks, vmhwm())
if rank == 0:
    tps = sorted(world * seq / x for x in times[1:])
    print(json.dumps({"peak_rss_bytes_per_rank": peaks, "tokens_per_s": tps[len(tps) // 2] if tps else None, "losses": losses, "torch": torch.__version__}))
dist.destroy_process_group()
