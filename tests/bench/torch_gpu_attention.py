#!/usr/bin/env python3
"""The PyTorch side of the flash-attention kernels' benchmark (tests/bench/gpu_flash.rs): causal
attention forward and backward through `scaled_dot_product_attention` at one shape, bf16, as
transformers' sdpa attention calls it (q, k, v (batch, heads, T, d) views of token-major
projections, is_causal, enable_gqa), once with PyTorch's own choice of kernel and once with each
backend forced. A backend that refuses enable_gqa is given k and v repeated to every query head,
inside the timing (as transformers' repeat_kv would). Median milliseconds of REPS passes after two
warm-up ones. Prints one JSON line.

usage: torch_gpu_attention.py BATCH T HEADS KV_HEADS HEAD_DIM REPS [DEVICE]
(DEVICE cpu checks the script without a GPU; the figures are then not the GPU's.)
"""
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

batch, t, heads, kv_heads, d, reps = (int(a) for a in sys.argv[1:7])
device = sys.argv[7] if len(sys.argv) > 7 else "cuda"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
torch.manual_seed(0)


def projection(h):
    """A (batch, h, T, d) view of a token-major (batch, T, h, d) tensor, as transformers makes."""
    return torch.randn(batch, t, h, d, device=device, dtype=dtype).transpose(1, 2)


q, k, v, dout = projection(heads), projection(kv_heads), projection(kv_heads), projection(heads)


def sync():
    if device == "cuda":
        torch.cuda.synchronize()


def attend(qq, kk, vv, gqa):
    if gqa:
        return F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, enable_gqa=True)
    group = heads // kv_heads
    return F.scaled_dot_product_attention(
        qq, kk.repeat_interleave(group, dim=1), vv.repeat_interleave(group, dim=1), is_causal=True)


def timed(gqa):
    forward, backward = [], []
    for i in range(2 + reps):
        qq, kk, vv = (x.detach().requires_grad_() for x in (q, k, v))
        sync()
        start = time.perf_counter()
        out = attend(qq, kk, vv, gqa)
        sync()
        mid = time.perf_counter()
        out.backward(dout)
        sync()
        end = time.perf_counter()
        if i >= 2:
            forward.append((mid - start) * 1e3)
            backward.append((end - mid) * 1e3)
    return {"forward_ms": statistics.median(forward), "backward_ms": statistics.median(backward)}


rows = [dict(backend="default (enable_gqa)", **timed(True))]
for name, backend in [("flash", SDPBackend.FLASH_ATTENTION), ("cudnn", SDPBackend.CUDNN_ATTENTION),
                      ("efficient", SDPBackend.EFFICIENT_ATTENTION)]:
    row = {"backend": name}
    with sdpa_kernel(backend):
        try:
            row.update(timed(True))
        except RuntimeError:
            try:
                row.update(timed(False), backend=name + " (k, v repeated)")
            except RuntimeError as e:
                row["error"] = str(e).strip().splitlines()[0][:120]
    rows.append(row)
print(json.dumps({"torch": torch.__version__, "rows": rows}))
