#!/usr/bin/env python3
"""The PyTorch side of the GPU training benchmark (tests/bench/gpu.rs): the same steps on the
same model directory and data, on one GPU, as PyTorch users run them: FSDP2 `fully_shard` on
every decoder layer and the root, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)
over fp32 parameters (the master copy), activation checkpointing, AdamW, global-norm clipping,
loss normalised by the target tokens. World size 1 (NCCL process group). Prints one JSON line.

usage: torch_gpu_train.py MODEL_DIR DATA.jsonl SEQ STEPS [BATCH]
"""
import json
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import AutoModelForCausalLM

model_dir, data_path, seq, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
batch = int(sys.argv[5]) if len(sys.argv) > 5 else 1
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0"})
torch.cuda.set_device(0)
dist.init_process_group("nccl")

model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").cuda()
model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
model.config.use_cache = False
mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer, mp_policy=mp)
fully_shard(model, mp_policy=mp)
model.train()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0)
rows = [json.loads(l)["input_ids"][:seq] for l in open(data_path)]

times, losses = [], []
for step in range(steps):
    ids = torch.tensor([rows[(step * batch + i) % len(rows)] for i in range(batch)], device="cuda")
    torch.cuda.synchronize()
    t = time.perf_counter()
    logits = model(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - t)
    losses.append(loss.item())
tps = sorted(batch * seq / x for x in times[2:])
print(json.dumps({"tokens_per_s": tps[len(tps) // 2], "losses": losses, "torch": torch.__version__,
                  "transformers": transformers.__version__, "gpu": torch.cuda.get_device_name(0),
                  "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30}))
dist.destroy_process_group()
